"""The `branchbox` CLI against the live test daemon: create, exec (exit code and output), ls, info,
run-code, kill, image ls, bench, files."""
import hashlib
import json
import os
import shutil
import subprocess

from conftest import URL

EXE = shutil.which("branchbox") or "/opt/branchbox/venv/bin/branchbox"
ENV = dict(os.environ, BRANCHBOX_URL=URL, COLUMNS="200")


def cli(*args, check=True, timeout=120, text=True, input=None):
    r = subprocess.run([EXE, *args], capture_output=True, text=text, input=input, timeout=timeout, env=ENV)
    if check:
        assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r


def one_error_line(r) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_sandbox_lifecycle_through_the_cli(daemon):
    sid = cli("sandbox", "create", "--memory-mb", "256", "--timeout", "120", "--env", "GREETING=hej").stdout.strip()
    assert sid.startswith("sb-"), sid
    try:
        r = cli("sandbox", "exec", sid, "--", "sh", "-c", 'echo "$GREETING"; echo oops >&2; exit 7', check=False)
        assert r.returncode == 7 and "hej" in r.stdout and "oops" in r.stderr, (r.returncode, r.stdout, r.stderr)
        assert sid in cli("sandbox", "ls").stdout
        info = json.loads(cli("sandbox", "info", sid).stdout)
        assert info["id"] == sid and info["memory_mb"] == 256 and info["env"] == {"GREETING": "hej"}
        assert "42" in cli("sandbox", "run-code", sid, "6 * 7").stdout
    finally:
        cli("sandbox", "kill", sid)
    assert sid not in cli("sandbox", "ls").stdout
    r = cli("sandbox", "info", sid, check=False)
    assert r.returncode != 0 and sid in (r.stdout + r.stderr) and "Traceback" not in r.stderr


def test_image_ls_and_bench_api(daemon):
    images = json.loads(cli("image", "ls", "--json").stdout)
    assert any(i["name"] == "base" and i["layers"] for i in images)
    out = cli("bench", "api", "--json", "--n", "3", timeout=300).stdout.strip().splitlines()
    result = json.loads(out[-1])
    for key in ("create_ms_p50", "create_ms_p99", "exec_true_ms_p50", "exec_true_ms_p99", "run_code_ms_p50",
                "files_write_4k_ms_p50", "host_spawn_true_ms_p50", "exec_vs_host_ratio"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result)
    assert abs(result["exec_vs_host_ratio"] - result["exec_true_ms_p50"] / result["host_spawn_true_ms_p50"]) < 0.01


def test_files_round_trip_through_the_cli(sbx, tmp_path):
    blob = os.urandom(3 * 1024 * 1024 + 17)  # binary, bigger than 1 MiB
    (tmp_path / "blob.bin").write_bytes(blob)
    cli("files", "cp", str(tmp_path / "blob.bin"), sbx.id + ":/root/in/blob.bin")
    r = sbx.commands.run("sha256sum /root/in/blob.bin")
    assert r.stdout.split()[0] == hashlib.sha256(blob).hexdigest()

    assert cli("files", "cat", sbx.id, "/root/in/blob.bin", text=False).stdout == blob
    cli("files", "cp", sbx.id + ":/root/in/blob.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == blob
    cli("files", "cp", "-", sbx.id + ":/root/in/piped.bin", text=False, input=blob[:4096])
    assert cli("files", "cp", sbx.id + ":/root/in/piped.bin", "-", text=False).stdout == blob[:4096]

    entries = json.loads(cli("files", "ls", sbx.id, "/root/in", "--json").stdout)
    assert {e["name"]: e["size"] for e in entries} == {"blob.bin": len(blob), "piped.bin": 4096}
    listing = cli("files", "ls", sbx.id, "/root").stdout
    assert "in/" in listing.split()

    cli("files", "mkdir", "-p", sbx.id, "/root/in/sub/deeper")
    assert "add -r" in one_error_line(cli("files", "rm", sbx.id, "/root/in", check=False))
    cli("files", "rm", sbx.id, "/root/in/blob.bin")
    assert [e["name"] for e in json.loads(cli("files", "ls", sbx.id, "/root/in", "--json").stdout)] == ["piped.bin", "sub"]
    cli("files", "rm", "-r", sbx.id, "/root/in")
    assert "not found" in one_error_line(cli("files", "cat", sbx.id, "/root/in/piped.bin", check=False))


def test_files_recursive_copy_through_the_cli(sbx, tmp_path):
    src = tmp_path / "proj"
    (src / "pkg" / "empty").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("print('hi')\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    os.symlink("/etc/passwd", src / "pkg" / "link")
    r = cli("files", "cp", "-r", str(src), sbx.id + ":/work/proj")
    assert "skipped" in r.stderr and "pkg/link" in r.stderr
    assert sbx.commands.run("/work/proj/run.sh").stdout == "ran\n"  # the mode came along
    assert sbx.commands.run("test -d /work/proj/pkg/empty && test ! -e /work/proj/pkg/link").exit_code == 0
    cli("files", "cp", "-r", sbx.id + ":/work/proj", str(tmp_path / "back"))
    assert (tmp_path / "back" / "pkg" / "mod.py").read_text() == "print('hi')\n"
    assert os.access(tmp_path / "back" / "run.sh", os.X_OK) and (tmp_path / "back" / "pkg" / "empty").is_dir()


def test_files_path_escapes_are_refused(sbx, tmp_path):
    for args in (
        ("files", "cat", sbx.id, "/../../etc/hostname"),
        ("files", "cp", sbx.id + ":/../../etc/hostname", str(tmp_path / "stolen")),
        ("files", "cp", "-", sbx.id + ":/../../tmp/bb-cli-escape"),
        ("files", "ls", sbx.id, "/.."),
    ):
        line = one_error_line(cli(*args, check=False, input=""))
        assert "climbs above the sandbox root" in line, line
    assert not os.path.exists(tmp_path / "stolen") and not os.path.exists("/tmp/bb-cli-escape")


def _peak_rss_kib(*args, input_path=None) -> int:
    """Run the CLI in a python that reports its own peak RSS (KiB) on its last stderr line."""
    code = (
        "import resource, runpy, sys\n"
        "sys.argv = ['branchbox'] + sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_module('branchbox_cli', run_name='__main__')\n"
        "finally:\n"
        "    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    )
    python = os.path.join(os.path.dirname(os.path.realpath(EXE)), "python")
    with open(input_path or os.devnull, "rb") as stdin:
        r = subprocess.run([python, "-c", code, *args], stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr
    return int(r.stderr.strip().splitlines()[-1])


def test_files_cp_streams_instead_of_holding_the_file(sbx, tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(64):
            f.write(os.urandom(1 << 20))
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1024)
    base = _peak_rss_kib("files", "cp", str(small), sbx.id + ":/root/small.bin")
    grew = {
        "upload": _peak_rss_kib("files", "cp", str(big), sbx.id + ":/root/big.bin") - base,
        "stdin": _peak_rss_kib("files", "cp", "-", sbx.id + ":/root/big2.bin", input_path=str(big)) - base,
        "download": _peak_rss_kib("files", "cp", sbx.id + ":/root/big.bin", str(tmp_path / "back.bin")) - base,
        "cat": _peak_rss_kib("files", "cat", sbx.id, "/root/big2.bin") - base,
    }
    assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()
    # 64 MiB held in memory would show as 64 MiB more; streaming stays within a few chunks.
    assert all(kib < 16 * 1024 for kib in grew.values()), grew
