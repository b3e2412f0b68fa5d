"""CLI for the warm pool and templates: ``template build|ls|info|rm``, ``pool ls|set|drain``,
``sandbox create --template`` and ``sandbox fork --isolated``, against a fake daemon."""

from __future__ import annotations

import json
import textwrap

import httpx
import pytest
from typer.testing import CliRunner

from conftest import BASE, SANDBOX, FakeDaemon, invoke, ndjson, one_red_line
from test_pool_templates_sdk import BUILD_EVENTS, FORK, NOT_FOUND, POOL, TEMPLATE, TEMPLATE_VOLUMES
from test_volumes_sdk import VID, VID2, mount


def _stream(*events) -> httpx.Response:
    return httpx.Response(200, stream=ndjson(*events))


# ----------------------------------------------------------------------------- template build


def test_template_build_flags(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/templates", _stream(*BUILD_EVENTS))
    r = invoke(
        runner, "template", "build", "py", "--image", "py-numpy", "--run", "echo hi > /root/recipe", "-r", "make",
        "--code", "import numpy", "--shells", "2", "--memory-mb", "1024", "--cpu", "2", "--pids", "64",
        "-e", "A=1", "--cwd", "/work", "-m", "team=x", "--timeout", "90",
    )
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {
        "name": "py", "image": "py-numpy", "run": ["echo hi > /root/recipe", "make"], "code": "import numpy",
        "shells": 2, "memory_mb": 1024, "cpu": 2.0, "pids": 64, "env": {"A": "1"}, "cwd": "/work",
        "metadata": {"team": "x"}, "timeout": 90.0,
    }
    assert r.stdout.strip() == "built template py (image base, snapshot sn-0123456789ab, 4 shells, 18.0 MiB)"
    assert "shells" in r.stderr, "the progress bar goes to stderr"


def test_template_build_with_volumes(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/templates", _stream(*BUILD_EVENTS[:-1], {"type": "done", "template": TEMPLATE_VOLUMES}))
    r = invoke(
        runner, "template", "build", "py", "--run", "git clone https://example.com/repo /workspace",
        "--volume", "/workspace=ws", "-v", "/data=" + VID2 + ":ro:nobranch",
    )
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {
        "name": "py", "run": ["git clone https://example.com/repo /workspace"],
        "volumes": [mount("ws", "/workspace"), mount(VID2, "/data", read_only=True, branch=False)],
    }
    assert r.stdout.strip() == (
        "built template py (image base, snapshot sn-0123456789ab, 4 shells, 18.0 MiB; "
        "volumes /workspace=%s, /data=%s:ro:nobranch)" % (VID, VID2)
    )
    r = invoke(runner, "template", "build", "py", "-v", "/workspace=ws", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == TEMPLATE_VOLUMES


def test_template_build_recipe_file_volumes(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("POST", "/v1/templates", _stream(*BUILD_EVENTS))
    table = tmp_path / "table.toml"
    table.write_text('[volumes]\n"/workspace" = "ws"\n"/data" = "%s"\n' % VID2)
    r = invoke(runner, "template", "build", "py", "-f", str(table))
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"name": "py", "volumes": [mount("ws", "/workspace"), mount(VID2, "/data")]}
    listed = tmp_path / "list.toml"
    listed.write_text(
        '[[volumes]]\nvolume = "ws"\npath = "/workspace"\n'
        '[[volumes]]\nvolume = "%s"\npath = "/data"\nread_only = true\nbranch = false\n' % VID2
    )
    # A --volume replaces the file's mount at its path and adds the others.
    r = invoke(runner, "template", "build", "py", "-f", str(listed), "-v", "/workspace=other:ro", "-v", "/cache=c")
    assert r.exit_code == 0, r.stderr
    assert daemon.body()["volumes"] == [
        mount("other", "/workspace", read_only=True), mount(VID2, "/data", True, False), mount("c", "/cache"),
    ]


def test_template_build_bad_volume_flags(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "template", "build", "py", "--volume", "workspace")
    assert r.exit_code == 2 and "/path=VOLUME" in r.output + r.stderr
    line = one_red_line(invoke(runner, "template", "build", "py", "-v", "/w=a", "-v", "/w=b"))
    assert "more than one volume mounted at /w" in line
    assert daemon.requests == []


def test_template_build_recipe_file_and_overrides(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("POST", "/v1/templates", _stream(*BUILD_EVENTS))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(textwrap.dedent('''
        name = "from-file"
        image = "base"
        run = ["echo one", "echo two"]
        code = """
        import json
        big = list(range(10))
        """
        shells = 3
        memory_mb = 256
        [env]
        A = "file"
        B = "file"
        [metadata]
        k = "v"
    '''))
    r = invoke(runner, "template", "build", "py", "-f", str(recipe))
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {
        "name": "py", "image": "base", "run": ["echo one", "echo two"], "code": "import json\nbig = list(range(10))\n",
        "shells": 3, "memory_mb": 256, "env": {"A": "file", "B": "file"}, "metadata": {"k": "v"},
    }, "NAME on the command line wins over the file's"
    r = invoke(runner, "template", "build", "py", "-f", str(recipe), "--image", "py-numpy", "--run", "only",
               "-e", "B=flag", "-e", "C=flag", "--shells", "0", "--json")
    assert r.exit_code == 0, r.stderr
    body = daemon.body()
    assert body["image"] == "py-numpy" and body["run"] == ["only"] and body["shells"] == 0
    assert body["env"] == {"A": "file", "B": "flag", "C": "flag"}, "env entries merge, the flag wins"
    assert json.loads(r.stdout) == TEMPLATE


def test_template_build_code_file(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("POST", "/v1/templates", _stream(*BUILD_EVENTS))
    code = tmp_path / "setup.py"
    code.write_text("import os\nx = 1\n")
    r = invoke(runner, "template", "build", "py", "--code-file", str(code))
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"name": "py", "code": "import os\nx = 1\n"}
    r = invoke(runner, "template", "build", "py", "--code-file", "-", input="y = 2\n")
    assert r.exit_code == 0 and daemon.body() == {"name": "py", "code": "y = 2\n"}
    n = len(daemon.requests)
    r = invoke(runner, "template", "build", "py", "--code", "x", "--code-file", str(code))
    assert r.exit_code == 2 and "not both" in r.stderr
    line = one_red_line(invoke(runner, "template", "build", "py", "--code-file", str(tmp_path / "missing.py")))
    assert "missing.py" in line
    assert len(daemon.requests) == n


@pytest.mark.parametrize(
    "content, needle",
    [
        ('nmae = "typo"\n', "unknown key nmae"),
        ("run = [\n", "not valid TOML"),
        ("run = 3\n", "run has the wrong type"),
        ('shells = "4"\n', "shells has the wrong type"),
        ("[env]\nA = [1]\n", "env.A must be a string"),
        ('run = ["ok", ""]\n', "non-empty shell command"),
        ('volumes = "/w=ws"\n', "volumes has the wrong type"),
        ('[volumes]\nworkspace = "ws"\n', "absolute"),
        ('[[volumes]]\nvolume = "ws"\n', "keys"),
    ],
)
def test_template_build_bad_recipe(runner: CliRunner, daemon: FakeDaemon, tmp_path, content: str, needle: str) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(content)
    line = one_red_line(invoke(runner, "template", "build", "py", "-f", str(recipe)))
    assert needle in line
    assert daemon.requests == []


def test_template_build_failure_is_one_red_line(runner: CliRunner, daemon: FakeDaemon) -> None:
    events = BUILD_EVENTS[:2] + [
        {"type": "error", "error": {"code": "bad_request", "message": "recipe command \"false\" failed (exit 1); fix the recipe. Last output:\nboom"}}
    ]
    daemon.on("POST", "/v1/templates", _stream(*events))
    r = invoke(runner, "template", "build", "py", "--run", "false")
    assert r.exit_code == 1 and "Traceback" not in r.stderr + r.stdout and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    # The progress bar stays where the build stopped, then one red line says why.
    assert "run: echo hi > /root/recipe" in lines[0]
    assert [x for x in lines if x.startswith("error: ")] == [lines[-1]]
    assert 'recipe command "false" failed' in lines[-1] and "boom" in lines[-1]


# ----------------------------------------------------------------------------- template ls/info/rm


def test_template_ls(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", "/v1/templates", {"templates": [TEMPLATE, dict(TEMPLATE, name="dead", alive=False, ready_shells=0)]})
    r = invoke(runner, "template", "ls")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and "volumes" not in r.stdout, "no volume lines when no template holds volumes"
    assert lines[0].split() == ["NAME", "IMAGE", "SHELLS", "ALIVE", "MEMORY", "AGE", "SNAPSHOT", "SANDBOX"]
    assert lines[1].split()[:5] == ["py", "base", "3/4", "yes", "18.0"]
    assert lines[2].split()[:4] == ["dead", "base", "0/4", "no"]
    r = invoke(runner, "template", "ls", "--json")
    assert json.loads(r.stdout)[0] == TEMPLATE
    daemon.on("GET", "/v1/templates", {"templates": []})
    assert "no templates" in invoke(runner, "template", "ls").stdout


def test_template_ls_shows_volumes(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", "/v1/templates", {"templates": [TEMPLATE_VOLUMES, dict(TEMPLATE, name="bare")]})
    r = invoke(runner, "template", "ls")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "IMAGE", "SHELLS", "ALIVE", "MEMORY", "AGE", "SNAPSHOT", "SANDBOX"]
    assert [x.split()[0] for x in lines[1:3]] == ["py", "bare"]
    # Under the table, one line per template that holds volumes (as --volume flags).
    assert lines[3:] == ["py volumes: /workspace=%s, /data=%s:ro:nobranch" % (VID, VID2)]


def test_template_info_and_rm(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", "/v1/templates/py", TEMPLATE)
    daemon.on("DELETE", "/v1/templates/py", {"removed": True})
    daemon.on("GET", "/v1/templates/nope", NOT_FOUND, 404)
    daemon.on("DELETE", "/v1/templates/nope", NOT_FOUND, 404)
    r = invoke(runner, "template", "info", "py")
    assert r.exit_code == 0 and json.loads(r.stdout) == TEMPLATE
    daemon.on("GET", "/v1/templates/vols", TEMPLATE_VOLUMES)
    r = invoke(runner, "template", "info", "vols")
    assert r.exit_code == 0 and json.loads(r.stdout)["volumes"] == TEMPLATE_VOLUMES["volumes"]
    r = invoke(runner, "template", "rm", "py")
    assert r.exit_code == 0 and r.stdout.strip() == "removed template py"
    assert (daemon.last.method, daemon.last.url.path) == ("DELETE", "/v1/templates/py")
    assert "template ls" in one_red_line(invoke(runner, "template", "info", "nope"))
    assert "not found" in one_red_line(invoke(runner, "template", "rm", "nope"))


# ----------------------------------------------------------------------------- pool


def test_pool_ls(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", "/v1/pool", POOL)
    r = invoke(runner, "pool", "ls")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["IMAGE", "MIN", "MAX", "READY", "WIRED"]
    assert lines[1].split() == ["base", "2", "4", "1", "1"] and lines[2].split() == ["py", "0", "0", "0", "0"]
    assert "hits 5, misses 2, recycled 3, created 7, failures 1" in r.stdout
    assert "refill p50 12.5 ms, p99 30.0 ms; cgroup placement migrate (p50 6.5 ms)" in r.stdout
    assert 'last error: image "gone" not found' in r.stdout
    r = invoke(runner, "pool", "ls", "--json")
    assert json.loads(r.stdout) == POOL
    empty = {"images": {}, "hits": 0, "misses": 0, "recycled": 0, "created": 0, "failures": 0}
    daemon.on("GET", "/v1/pool", empty)
    r = invoke(runner, "pool", "ls")
    assert "no pools" in r.stdout and "last error" not in r.stdout and "placement -" in r.stdout


def test_pool_set_and_drain(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("PUT", "/v1/pool/base", POOL)
    r = invoke(runner, "pool", "set", "base", "--min", "2", "--max", "4")
    assert r.exit_code == 0, r.stderr
    assert (daemon.last.method, daemon.body()) == ("PUT", {"min": 2, "max": 4})
    assert r.stdout.strip() == "pool base: min 2, max 4, ready 1"
    r = invoke(runner, "pool", "set", "base", "--min", "3", "--json")
    assert daemon.body() == {"min": 3} and json.loads(r.stdout) == POOL
    drained = dict(POOL, images={"base": {"min": 0, "max": 0, "ready": 0}})
    daemon.on("PUT", "/v1/pool/base", drained)
    r = invoke(runner, "pool", "drain", "base")
    assert r.exit_code == 0 and daemon.body() == {"min": 0, "max": 0}
    assert r.stdout.strip() == "pool base: drained (ready 0)"
    n = len(daemon.requests)
    r = invoke(runner, "pool", "set", "base", "--min", "3", "--max", "1")
    assert r.exit_code == 2 and "must not exceed" in r.stderr
    assert invoke(runner, "pool", "set", "base").exit_code == 2, "--min is required"
    assert len(daemon.requests) == n
    daemon.on("PUT", "/v1/pool/nope", {"error": {"code": "not_found", "message": "image \"nope\" not found"}}, 404)
    assert "nope" in one_red_line(invoke(runner, "pool", "set", "nope", "--min", "1"))


# ----------------------------------------------------------------------------- sandbox create/fork


def test_sandbox_create_template(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "create", "--template", "py", "--memory-mb", "256")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"template": "py", "memory_mb": 256, "timeout": 300.0}, "the template's network applies"
    invoke(runner, "sandbox", "create")
    assert daemon.body()["image"] == "base" and "template" not in daemon.body()
    daemon.on("POST", "/v1/sandboxes", NOT_FOUND, 404)
    assert "template" in one_red_line(invoke(runner, "sandbox", "create", "-t", "nope"))


def test_sandbox_fork_isolated(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/fork", FORK, 201)
    r = invoke(runner, "sandbox", "fork", SANDBOX["id"], "-n", "2", "--isolated")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"count": 2, "isolated": True}
    assert r.stdout.split() == ["sb-child0000001"]
    invoke(runner, "sandbox", "fork", SANDBOX["id"])
    assert daemon.body() == {"count": 1}


def test_sandbox_fork_replay_inflight(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", BASE + "/fork", dict(FORK, inflight_handed=1), 201)
    r = invoke(runner, "sandbox", "fork", SANDBOX["id"], "-n", "2", "--replay-inflight")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"count": 2, "replay_inflight": True}
    assert r.stdout.split() == ["sb-child0000001"]
    r = invoke(runner, "sandbox", "fork", SANDBOX["id"], "--isolated", "--replay-inflight")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"count": 1, "isolated": True, "replay_inflight": True}
    assert "leave snapshot out" in one_red_line(invoke(runner, "sandbox", "fork", SANDBOX["id"], "-s", "sn-1", "--replay-inflight"))
