"""E2B clients other than the current Python SDK, unchanged, against branchboxd's E2B endpoint:
the JS SDKs (npm `e2b`, `@e2b/code-interpreter`) and an older 2.x Python SDK that calls the routes newer ones replaced
(`POST /sandboxes`, `POST /sandboxes/{id}/connect`). Both are installed by scripts/install-e2b-clients.sh (pinned);
each runs a client script in a subprocess that prints one JSON object, checked here."""
import json
import os
import subprocess
import uuid

import httpx
import pytest

OLD_VENV = os.environ.get("E2B_OLD_VENV", "/opt/branchbox/venv-e2b-old")
JS_DIR = os.environ.get("E2B_JS_DIR", "/opt/branchbox/e2b-js")
HERE = os.path.join(os.path.dirname(__file__), "e2b_clients")


def client_env(daemon, suite):
    url = "http://127.0.0.1:%d" % daemon.e2b_port
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_VOLUME_API_URL=url, E2B_API_KEY=daemon.tcp_token, SUITE=suite)
    return env


def run_client(argv, env, cwd=None):
    p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, "client failed (%d):\nstdout: %s\nstderr: %s" % (p.returncode, p.stdout, p.stderr[-4000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def leftovers(daemon, suite):
    """Sandboxes a client left behind (found by their metadata), killed; their ids."""
    url = "http://127.0.0.1:%d" % daemon.e2b_port
    with httpx.Client(base_url=url, headers={"X-API-KEY": daemon.tcp_token}, timeout=60) as c:
        r = c.get("/v2/sandboxes", params={"metadata": "suite=" + suite})
        r.raise_for_status()
        left = [s["sandboxID"] for s in r.json()]
        for sid in left:
            c.delete("/sandboxes/" + sid)
    return left


def run_js_client(daemon, tmp_path, package, script_name, suite):
    """Run e2b_clients/<script_name> with node against the daemon: its JSON output, and the
    sandboxes it left behind (killed)."""
    if not os.path.isdir(os.path.join(JS_DIR, "node_modules", package)):
        pytest.fail("npm %s is not installed: run scripts/install-e2b-clients.sh (make test does)" % package)
    # ESM resolves packages from the script's directory up: give it the installed node_modules.
    os.symlink(os.path.join(JS_DIR, "node_modules"), tmp_path / "node_modules")
    script = tmp_path / script_name
    script.write_text(open(os.path.join(HERE, script_name)).read())
    try:
        out = run_client(["node", str(script)], client_env(daemon, suite), cwd=tmp_path)
    finally:
        left = leftovers(daemon, suite)
    return out, left


def test_js_sdk(daemon, tmp_path):
    out, left = run_js_client(daemon, tmp_path, "e2b", "client.mjs", "e2bjs-" + uuid.uuid4().hex[:8])
    assert out["run"] == "hello-42\nuser\n"
    assert out["streamed"] == "line-1\nline-2\nline-3\n"
    assert out["exit"] == {"isExitError": True, "code": 7, "stderr": "oops\n"}
    assert out["listed"] is True and out["killedCommand"] is True
    assert out["read"] == "from js" == out["cat"]
    assert out["list"] == ["a.txt"] and out["exists"] == [True, False] and out["afterRemove"] == 0
    assert out["state"] == "running" and out["listedSandbox"] is True
    assert out["killed"] is True and out["runningAfterKill"] is False
    assert out["volumeId"].startswith("vol-")
    assert out["volumeWritten"] == {"type": True, "mode": 0o666, "uid": 9090}  # E2B's defaults
    assert out["volumeRead"] == "vol from js" and out["volumeList"] == ["/d"]
    assert out["volumeExists"] == [True, False] and out["volumeMissing"] is True and out["volumeListed"] is True
    assert out["volumeInSandbox"] == "vol from js" and out["volumeFromSandbox"] == "more\n"
    assert out["volumeAfterRemove"] is False and out["volumeDestroyed"] is True
    assert left == []


def test_js_code_interpreter_sdk(daemon, tmp_path):
    """npm `@e2b/code-interpreter`: runCode (results, errors, streaming, per-run envs), contexts
    (create with cwd, list, restart, remove), bash, and E2B's `Sandbox.fork` whose children
    carry the python context's state. On the base image (the template is not built here)."""
    suite = "e2bjsci-" + uuid.uuid4().hex[:8]
    out, left = run_js_client(daemon, tmp_path, "@e2b/code-interpreter", "code_interpreter.mjs", suite)
    assert out["first"] == {"text": "42", "stdout": ["hi\n"], "count": 1}
    assert out["error"] == {"name": "ZeroDivisionError", "value": "division by zero", "traceback": True}
    assert out["streamed"] == "0\n1\n2\n"
    assert (out["envs"], out["envsAfter"]) == ("'bar'", "'unset'"), "a run's envs hold for that run only"
    assert out["ctxLanguage"] == "python" and out["ctx"] == "(5, '/tmp')" and out["ctxListed"] is True
    assert out["afterRestart"] == "NameError" and out["ctxAfterRemove"] is False
    assert out["bash"] == "42\nroot\n"
    assert out["unknownContext"] == "NotFoundError"
    assert out["forked"] == ["141", "141"] and out["parentAfterForks"] == "41"
    assert out["killed"] is True
    assert left == []


def test_older_python_sdk(daemon):
    py = os.path.join(OLD_VENV, "bin", "python")
    if not os.path.exists(py):
        pytest.fail("the older Python SDK is not installed: run scripts/install-e2b-clients.sh (make test does)")
    suite = "e2bold-" + uuid.uuid4().hex[:8]
    try:
        out = run_client([py, os.path.join(HERE, "old_sdk.py")], client_env(daemon, suite))
    finally:
        left = leftovers(daemon, suite)
    assert out["run"] == "old-42\nuser\n"
    assert out["read"] == "from an older SDK" and out["list"] == ["a.txt"]
    assert out["listed"] is True and out["killed_command"] is True
    assert out["running_while_paused"] is False
    assert out["after_resume"] == "from an older SDK"
    assert out["listed_sandbox"] is True and out["killed"] is True
    assert out["ci"] == {"text": "42", "stdout": ["printed\n"], "error": None}
    assert out["ci_error"] == "ZeroDivisionError"
    assert left == []
