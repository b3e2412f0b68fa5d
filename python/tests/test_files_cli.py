"""``branchbox files``: ls, cat, cp (in, out, -r, stdin/stdout), rm, mkdir against the fake daemon."""

from __future__ import annotations

import os
import stat
from typing import Any, Dict, List

import httpx
import pytest
from typer.testing import CliRunner

from conftest import BASE, SID, Chunks, FakeDaemon, invoke, one_red_line

FILES = BASE + "/files"
BLOB = bytes(range(256)) * 16 + b"\x00\xff\xfe not utf-8 \x80"


def entry(path: str, type_: str = "file", size: int = 3, mode: int = 0o644, target: Any = None) -> Dict[str, Any]:
    return {
        "name": path.rstrip("/").rsplit("/", 1)[-1],
        "path": path,
        "type": type_,
        "size": size,
        "mode": mode,
        "mtime": 1732250000.0,
        "symlink_target": target,
    }


def by_path(table: Dict[str, Any], status_missing: int = 404):
    """A responder answering from ``table`` keyed by the request's ``path`` parameter."""

    def respond(request: httpx.Request) -> httpx.Response:
        path = request.url.params["path"]
        if path in table:
            return httpx.Response(200, json=table[path])
        return httpx.Response(status_missing, json={"error": {"code": "not_found", "message": "path %s not found" % path}})

    return respond


def puts(daemon: FakeDaemon) -> List[httpx.Request]:
    return [r for r in daemon.requests if r.method == "PUT" and r.url.path == FILES]


def accept_puts(daemon: FakeDaemon) -> None:
    daemon.on("PUT", FILES, lambda r: httpx.Response(200, json=entry(r.url.params["path"], size=len(r.content))))


# ----------------------------------------------------------------------------- ls, cat


def test_ls_table_and_json(runner: CliRunner, daemon: FakeDaemon) -> None:
    entries = [
        entry("/root/a.txt", size=1234),
        entry("/root/sub", "dir", 4096, 0o755),
        entry("/root/sub/deep.bin", size=7),
        entry("/root/link", "symlink", 8, 0o777, target="/etc/hostname"),
    ]
    daemon.on("GET", FILES + "/list", {"entries": entries})
    r = invoke(runner, "files", "ls", SID, "/root", "--depth", "2", env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stderr
    assert dict(daemon.last.url.params) == {"path": "/root", "depth": "2"}
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    assert rows[0] == ["mode", "size", "modified", "name"]
    assert [(row[0], row[1], row[-1]) for row in rows[1:3]] == [("-rw-r--r--", "1234", "a.txt"), ("drwxr-xr-x", "4096", "sub/")]
    assert rows[3][-1] == "sub/deep.bin"  # deeper entries are shown relative to the listed directory
    assert rows[4][0] == "lrwxrwxrwx" and rows[4][-3:] == ["link", "->", "/etc/hostname"]

    r = invoke(runner, "files", "ls", SID, "--json")
    assert r.exit_code == 0, r.stderr
    assert dict(daemon.last.url.params) == {"path": "/", "depth": "1"}  # defaults
    assert '"path": "/root/sub/deep.bin"' in r.stdout and "/etc/hostname" in r.stdout


def test_cat_is_binary_safe_and_streamed(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", FILES, httpx.Response(200, stream=Chunks([BLOB[:1000], BLOB[1000:3000], BLOB[3000:]])))
    r = invoke(runner, "files", "cat", SID, "/root/blob.bin")
    assert r.exit_code == 0, r.stderr
    assert r.stdout_bytes == BLOB
    assert daemon.last.url.params["path"] == "/root/blob.bin"


def test_cat_errors_are_one_red_line(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", FILES, {"error": {"code": "bad_request", "message": "/root is a directory: give a file path"}}, 400)
    assert one_red_line(invoke(runner, "files", "cat", SID, "/root")) == "error: /root is a directory: give a file path"
    assert "sb-missing" in one_red_line(invoke(runner, "files", "cat", "sb-missing", "/x"))


def test_path_escape_is_one_red_line(runner: CliRunner, daemon: FakeDaemon) -> None:
    escape = {"error": {"code": "path_escape", "message": "path /../etc/passwd climbs above /: paths stay inside the sandbox"}}
    daemon.on("GET", FILES, escape, 400)
    daemon.on("GET", FILES + "/stat", escape, 400)
    assert "climbs above /" in one_red_line(invoke(runner, "files", "cat", SID, "/../etc/passwd"))
    assert "climbs above /" in one_red_line(invoke(runner, "files", "cp", SID + ":/../etc/passwd", "-"))


# ----------------------------------------------------------------------------- cp into a sandbox


def test_cp_upload_streams_the_file_and_keeps_its_mode(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    local = tmp_path / "run.sh"
    local.write_bytes(BLOB)
    local.chmod(0o750)
    daemon.on("GET", FILES + "/stat", by_path({"/root": entry("/root", "dir")}))
    accept_puts(daemon)
    r = invoke(runner, "files", "cp", str(local), SID + ":/root/x.sh")
    assert r.exit_code == 0, r.stderr
    put = puts(daemon)[-1]
    assert dict(put.url.params) == {"path": "/root/x.sh", "mode": "0750"}
    assert put.content == BLOB and put.headers["content-length"] == str(len(BLOB))
    # into an existing directory (or a path ending with /): under the file's own name
    for dst in ("/root", "/new/"):
        r = invoke(runner, "files", "cp", str(local), SID + ":" + dst)
        assert r.exit_code == 0, r.stderr
        assert puts(daemon)[-1].url.params["path"] == dst.rstrip("/") + "/run.sh"


def test_cp_stdin_into_a_sandbox(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("GET", FILES + "/stat", by_path({}))
    accept_puts(daemon)
    r = invoke(runner, "files", "cp", "-", SID + ":/root/in.bin", input=BLOB)
    assert r.exit_code == 0, r.stderr
    put = puts(daemon)[-1]
    assert put.url.params["path"] == "/root/in.bin" and put.content == BLOB and "mode" not in put.url.params


def test_cp_recursive_upload(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    src = tmp_path / "proj"
    (src / "pkg" / "empty").mkdir(parents=True)
    (src / "README").write_text("hi")
    (src / "pkg" / "mod.py").write_bytes(BLOB)
    os.symlink("/etc/passwd", src / "pkg" / "link")
    os.symlink("/etc", src / "dirlink")
    daemon.on("GET", FILES + "/stat", by_path({}))
    daemon.on("POST", FILES + "/mkdir", entry("/d", "dir"))
    accept_puts(daemon)
    r = invoke(runner, "files", "cp", "-r", str(src), SID + ":/work/proj")
    assert r.exit_code == 0, r.stderr
    mkdirs = [daemon.body(q)["path"] for q in daemon.requests if q.url.path == FILES + "/mkdir"]
    assert mkdirs == ["/work/proj", "/work/proj/pkg", "/work/proj/pkg/empty"]
    assert {q.url.params["path"]: q.content for q in puts(daemon)} == {
        "/work/proj/README": b"hi",
        "/work/proj/pkg/mod.py": BLOB,
    }
    skipped = sorted(line for line in r.stderr.splitlines() if line.startswith("skipped "))
    assert len(skipped) == 2 and "dirlink" in skipped[0] and "pkg/link" in skipped[1]


def test_cp_directory_needs_r(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("GET", FILES + "/stat", by_path({"/root/d": entry("/root/d", "dir")}))
    line = one_red_line(invoke(runner, "files", "cp", str(tmp_path), SID + ":/x"))
    assert str(tmp_path) in line and "add -r" in line
    line = one_red_line(invoke(runner, "files", "cp", SID + ":/root/d", str(tmp_path)))
    assert SID + ":/root/d is a directory" in line and "add -r" in line
    assert not puts(daemon)


@pytest.mark.parametrize(
    "args, says",
    [
        (["./a", "./b"], "neither ./a nor ./b is a sandbox path: write one side as SANDBOX:/path"),
        ([SID + ":/a", "sb-other:/b"], "copy out to a local file, then in"),
        (["./a", SID + ":"], "names no path in sandbox %s: write %s:/path/in/the/sandbox" % (SID, SID)),
        (["./no-such-file", SID + ":/a"], "no such local file or directory: ./no-such-file"),
        (["-r", "-", SID + ":/a"], "- (stdin) is one file's content, not a directory: drop -r"),
    ],
)
def test_cp_usage_errors_say_what_to_change(runner: CliRunner, daemon: FakeDaemon, args: List[str], says: str) -> None:
    daemon.on("GET", FILES + "/stat", by_path({}))
    assert says in one_red_line(invoke(runner, "files", "cp", *args))
    assert not puts(daemon)


# ----------------------------------------------------------------------------- cp out of a sandbox


def test_cp_download_streams_and_keeps_the_mode(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("GET", FILES + "/stat", by_path({"/root/blob.bin": entry("/root/blob.bin", size=len(BLOB), mode=0o600)}))
    daemon.on("GET", FILES, httpx.Response(200, stream=Chunks([BLOB[:100], BLOB[100:]])))
    r = invoke(runner, "files", "cp", SID + ":/root/blob.bin", str(tmp_path / "out.bin"))
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "out.bin").read_bytes() == BLOB
    assert stat.S_IMODE((tmp_path / "out.bin").stat().st_mode) == 0o600
    # into an existing local directory, and to stdout
    assert invoke(runner, "files", "cp", SID + ":/root/blob.bin", str(tmp_path)).exit_code == 0
    assert (tmp_path / "blob.bin").read_bytes() == BLOB
    r = invoke(runner, "files", "cp", SID + ":/root/blob.bin", "-")
    assert r.exit_code == 0 and r.stdout_bytes == BLOB
    line = one_red_line(invoke(runner, "files", "cp", SID + ":/root/blob.bin", str(tmp_path / "nope" / "x")))
    assert "local directory %s does not exist: create it first" % (tmp_path / "nope") in line


def _tree_daemon(daemon: FakeDaemon, listing: Dict[str, List[Dict[str, Any]]], contents: Dict[str, bytes]) -> None:
    daemon.on("GET", FILES + "/stat", by_path({"/src": entry("/src", "dir")}))
    daemon.on("GET", FILES + "/list", lambda r: httpx.Response(200, json={"entries": listing[r.url.params["path"]]}))
    daemon.on("GET", FILES, lambda r: httpx.Response(200, content=contents[r.url.params["path"]]))


def test_cp_recursive_download(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    listing = {
        "/src": [entry("/src/a.txt", mode=0o640), entry("/src/sub", "dir"), entry("/src/ln", "symlink", target="/etc")],
        "/src/sub": [entry("/src/sub/b.bin", mode=0o755), entry("/src/sub/empty", "dir")],
        "/src/sub/empty": [],
    }
    _tree_daemon(daemon, listing, {"/src/a.txt": b"a", "/src/sub/b.bin": BLOB})
    r = invoke(runner, "files", "cp", "-r", SID + ":/src", str(tmp_path))  # an existing directory: into it
    assert r.exit_code == 0, r.stderr
    out = tmp_path / "src"
    assert (out / "a.txt").read_bytes() == b"a" and (out / "sub" / "b.bin").read_bytes() == BLOB
    assert stat.S_IMODE((out / "sub" / "b.bin").stat().st_mode) == 0o755
    assert (out / "sub" / "empty").is_dir() and not os.path.lexists(out / "ln")
    assert r.stderr.splitlines() == ["skipped %s:/src/ln: only files and directories are copied (not symlinks or special files)" % SID]


@pytest.mark.parametrize("name", ["..", "../escape", "a/b"])
def test_cp_recursive_download_refuses_names_that_are_not_one_component(
    runner: CliRunner, daemon: FakeDaemon, tmp_path, name: str
) -> None:
    bad = dict(entry("/src/x"), name=name)
    _tree_daemon(daemon, {"/src": [bad]}, {"/src/x": b"x"})
    line = one_red_line(invoke(runner, "files", "cp", "-r", SID + ":/src", str(tmp_path / "dst")))
    assert "which is no file name" in line
    assert os.listdir(tmp_path) == ["dst"] and os.listdir(tmp_path / "dst") == []


# ----------------------------------------------------------------------------- rm, mkdir


def test_rm(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("DELETE", FILES, {"removed": True})
    r = invoke(runner, "files", "rm", SID, "/root/x")
    assert r.exit_code == 0 and r.stdout.strip() == "removed %s:/root/x" % SID
    assert dict(daemon.last.url.params) == {"path": "/root/x", "recursive": "false"}
    assert invoke(runner, "files", "rm", "-r", SID, "/root/d").exit_code == 0
    assert daemon.last.url.params["recursive"] == "true"


def test_rm_errors_say_what_to_change(runner: CliRunner, daemon: FakeDaemon) -> None:
    not_empty = {"error": {"code": "conflict", "message": "remove /root/d: directory not empty (pass recursive=true)"}}
    daemon.on("DELETE", FILES, not_empty, 409)
    assert one_red_line(invoke(runner, "files", "rm", SID, "/root/d")) == (
        "error: %s:/root/d is a directory with contents: add -r to remove it and everything in it" % SID
    )
    daemon.on("DELETE", FILES, {"error": {"code": "not_found", "message": "path /root/nope not found"}}, 404)
    assert one_red_line(invoke(runner, "files", "rm", SID, "/root/nope")) == "error: path /root/nope not found"


def test_mkdir(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", FILES + "/mkdir", entry("/a/b", "dir"))
    r = invoke(runner, "files", "mkdir", SID, "/a/b")
    assert r.exit_code == 0 and r.stdout.strip() == "created %s:/a/b" % SID
    assert daemon.body() == {"path": "/a/b", "parents": False}
    assert invoke(runner, "files", "mkdir", "-p", SID, "/a/b").exit_code == 0
    assert daemon.body() == {"path": "/a/b", "parents": True}
    daemon.on("POST", FILES + "/mkdir", {"error": {"code": "not_found", "message": "path /a not found"}}, 404)
    assert one_red_line(invoke(runner, "files", "mkdir", SID, "/a/b")) == (
        "error: the parent of /a/b does not exist in %s: add -p to create it too" % SID
    )


def test_mkdir_and_cp_as_user(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("POST", FILES + "/mkdir", entry("/home/user/d", "dir"))
    assert invoke(runner, "files", "mkdir", "-p", "--user", "user", SID, "/home/user/d").exit_code == 0
    assert daemon.body() == {"path": "/home/user/d", "parents": True, "user": "user"}

    daemon.on("GET", FILES + "/stat", by_path({"/home/user": entry("/home/user", "dir")}))
    accept_puts(daemon)
    local = tmp_path / "a.txt"
    local.write_bytes(b"abc")
    r = invoke(runner, "files", "cp", "--user", "user", str(local), SID + ":/home/user/a.txt")
    assert r.exit_code == 0, r.stderr
    assert puts(daemon)[-1].url.params["user"] == "user"
    r = invoke(runner, "files", "cp", "-u", "user", "-", SID + ":/home/user/in", input=b"x")
    assert r.exit_code == 0, r.stderr
    assert puts(daemon)[-1].url.params["user"] == "user"

    tree = tmp_path / "proj"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_bytes(b"f")
    n = len(daemon.requests)
    r = invoke(runner, "files", "cp", "-r", "--user", "user", str(tree), SID + ":/home/user/")
    assert r.exit_code == 0, r.stderr
    made = [daemon.body(q) for q in daemon.requests[n:] if q.url.path == FILES + "/mkdir"]
    assert made == [
        {"path": "/home/user/proj", "parents": True, "user": "user"},
        {"path": "/home/user/proj/sub", "parents": True, "user": "user"},
    ]
    assert [dict(p.url.params) for p in puts(daemon)[-1:]] == [
        {"path": "/home/user/proj/sub/f", "mode": "%04o" % (stat.S_IMODE(os.stat(tree / "sub" / "f").st_mode) & 0o777), "user": "user"}
    ]

    r = invoke(runner, "files", "cp", str(local), SID + ":/root/b.txt")
    assert r.exit_code == 0, r.stderr
    assert "user" not in puts(daemon)[-1].url.params
    n = len(daemon.requests)
    assert "--user" in one_red_line(invoke(runner, "files", "cp", "--user", "user", SID + ":/root/b.txt", "-"))
    assert len(daemon.requests) == n
