"""The `branchbox` CLI against the live test daemon: create, exec (exit code and output), ls, info,
run-code, kill, image ls, bench."""
import json
import os
import shutil
import subprocess

from conftest import URL


def cli(*args, check=True, timeout=120):
    exe = shutil.which("branchbox") or "/opt/branchbox/venv/bin/branchbox"
    env = dict(os.environ, BRANCHBOX_URL=URL, COLUMNS="200")
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r


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
