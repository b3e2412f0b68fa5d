def test_exec_roundtrip(sbx):
    r = sbx.commands.run("echo hi; echo err >&2; exit 4")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 4)
