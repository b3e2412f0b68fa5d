def test_exec_roundtrip(sbx):
    r = sbx.commands.run("echo hi; echo err >&2; exit 4")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 4)


def test_base_image_loads_c_utf8_from_a_locale_archive(sbx):
    """C.UTF-8 (the sandboxes' LANG) is in glibc's locale archive, and bash and python map it
    from there rather than opening a dozen files in every exec."""
    script = (
        "echo $LANG; localedef --list-archive; grep -q locale-archive /proc/$$/maps && echo bash-mapped; "
        "python3 -c \"import locale; print(locale.setlocale(locale.LC_ALL, '')); "
        "print(any('locale-archive' in line for line in open('/proc/self/maps')))\""
    )
    r = sbx.commands.run(["/bin/bash", "-c", script])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["C.UTF-8", "C.utf8", "bash-mapped", "C.UTF-8", "True"], r.stdout
