"""``branchbox files``: a sandbox's files from the shell, so no one has to write Python for one.

``SANDBOX:/path`` names a path in a sandbox (``cp``); ``-`` is stdin or stdout. Contents
go through the SDK's streamed reads and writes, so a large file never sits in memory.
``cp -r`` copies directories (walk + mkdir); symlinks and special files are skipped with a
warning each, in both directions: the files API makes no symlinks, and a symlink a
sandbox made must never steer a write on the host.
"""

# No `from __future__ import annotations`: typer evaluates annotations at runtime.
import contextlib
import os
import posixpath
import re
import stat
import sys
import time
from typing import Iterator, List, Optional, Tuple, Type

import typer
from rich.table import Table
from rich.text import Text

from branchbox import ConflictError, EntryInfo, NotFoundError, Sandbox

from .base import cli_errors, connected, err, fail, out, print_json

files_app = typer.Typer(
    help="Read and write a sandbox's files (SANDBOX:/path names a path in a sandbox, - is stdin/stdout).",
    no_args_is_help=True,
)

# SANDBOX:PATH. A local path holding a colon is written ./a:b (or absolute).
_REMOTE = re.compile(r"^(?P<sandbox>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<path>.*)$")
_TYPE_BITS = {"dir": stat.S_IFDIR, "file": stat.S_IFREG, "symlink": stat.S_IFLNK}
_SIGPIPE_EXIT = 128 + 13


def parse_remote(arg: str) -> Optional[Tuple[str, str]]:
    """``(sandbox, path)`` for ``SANDBOX:/path``; None for a local path (or ``-``)."""
    if arg == "-" or arg.startswith(("/", "./", "../")):
        return None
    m = _REMOTE.match(arg)
    if m is None:
        return None
    if not m.group("path"):
        raise fail("%s names no path in sandbox %s: write %s:/path/in/the/sandbox" % (arg, m.group("sandbox"), m.group("sandbox")))
    return m.group("sandbox"), m.group("path")


def _mode_string(e: EntryInfo) -> str:
    return stat.filemode(_TYPE_BITS.get(e.type, 0) | (e.mode & 0o7777))


def _shown_name(e: EntryInfo, listed: str) -> str:
    rel = posixpath.relpath(e.path, listed) if e.path else e.name
    name = e.name if rel.startswith("..") else rel
    if e.is_dir:
        return name + "/"
    if e.type == "symlink" and e.symlink_target is not None:
        return "%s -> %s" % (name, e.symlink_target)
    return name


@files_app.command("ls")
@cli_errors
def files_ls(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="SANDBOX"),
    path: str = typer.Argument("/", metavar="[PATH]", help="Directory in the sandbox (default /)."),
    depth: int = typer.Option(1, "--depth", min=1, help="Levels to list (1: the directory's own entries)."),
    as_json: bool = typer.Option(False, "--json", help="Print the entries as JSON."),
) -> None:
    """List a directory in a sandbox: mode, size in bytes, modification time, name."""
    with connected(ctx, sandbox_id) as sbx:
        entries = sbx.files.list(path, depth)
    if as_json:
        print_json([e.raw for e in entries])
        return
    listed = posixpath.normpath(posixpath.join("/", path))
    table = Table(box=None, header_style="bold")
    for col in ("mode", "size", "modified", "name"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for e in entries:
        mtime = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.mtime)) if e.mtime is not None else "-"
        table.add_row(_mode_string(e), str(e.size), mtime, Text(_shown_name(e, listed)))
    out.print(table)


def _to_stdout(sbx: Sandbox, path: str) -> None:
    """Stream a sandbox file to stdout as bytes."""
    stdout = sys.stdout.buffer
    try:
        with sbx.files.read(path, format="stream") as stream:
            for chunk in stream:
                stdout.write(chunk)
        stdout.flush()
    except BrokenPipeError:  # `| head`: the reader is gone, as for cat
        _silence_stdout()
        raise typer.Exit(_SIGPIPE_EXIT) from None


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush does not complain."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


@files_app.command("cat")
@cli_errors
def files_cat(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="SANDBOX"),
    path: str = typer.Argument(..., metavar="PATH", help="File in the sandbox."),
) -> None:
    """Write a sandbox file's bytes to stdout (binary-safe)."""
    with connected(ctx, sandbox_id) as sbx:
        _to_stdout(sbx, path)


@files_app.command("cp")
@cli_errors
def files_cp(
    ctx: typer.Context,
    src: str = typer.Argument(..., metavar="SRC", help="Local path, - (stdin) or SANDBOX:/path."),
    dst: str = typer.Argument(..., metavar="DST", help="Local path, - (stdout) or SANDBOX:/path."),
    recursive: bool = typer.Option(
        False, "-r", "--recursive", help="Copy a directory and its contents (symlinks and special files are skipped)."
    ),
    user: Optional[str] = typer.Option(
        None, "--user", "-u", help="Copying in: the files and directories made belong to this sandbox user (default root)."
    ),
) -> None:
    """Copy a file into a sandbox or out of it: exactly one of SRC and DST is SANDBOX:/path.

    A DST that is an existing directory (or ends with /) receives SRC under its own name.
    """
    into, out_of = parse_remote(dst), parse_remote(src)
    if into is not None and out_of is not None:
        raise fail("both %s and %s are sandbox paths: copy out to a local file, then in" % (src, dst))
    if into is None and out_of is None:
        raise fail("neither %s nor %s is a sandbox path: write one side as SANDBOX:/path" % (src, dst))
    if into is None and user is not None:
        raise fail("--user sets who owns files copied into a sandbox: drop it when copying out")
    if into is not None:
        with connected(ctx, into[0]) as sbx:
            _upload(sbx, src, into[1], recursive, user)
    else:
        assert out_of is not None
        with connected(ctx, out_of[0]) as sbx:
            _download(sbx, out_of[1], dst, recursive)


def _remote_dir(sbx: Sandbox, path: str) -> bool:
    try:
        return sbx.files.stat(path).is_dir
    except NotFoundError:
        return False


def _upload(sbx: Sandbox, src: str, dst: str, recursive: bool, user: Optional[str] = None) -> None:
    where = "%s:%s" % (sbx.id, dst)
    if src == "-":
        if recursive:
            raise fail("- (stdin) is one file's content, not a directory: drop -r")
        if dst.endswith("/") or _remote_dir(sbx, dst):
            raise fail("%s is a directory: name the file stdin goes to, e.g. %s" % (where, posixpath.join(where, "stdin")))
        sbx.files.write(dst, sys.stdin.buffer, user=user)
        return
    try:
        st = os.stat(src)
    except FileNotFoundError:
        raise fail("no such local file or directory: %s" % src) from None
    into_dir = dst.endswith("/") or _remote_dir(sbx, dst)
    target = posixpath.join(dst, os.path.basename(os.path.normpath(src))) if into_dir else dst
    if stat.S_ISDIR(st.st_mode):
        if not recursive:
            raise fail("%s is a directory: add -r to copy it with its contents" % src)
        _report_skipped(_upload_tree(sbx, src, target, user))
    elif stat.S_ISREG(st.st_mode):
        sbx.files.upload(src, target, mode=stat.S_IMODE(st.st_mode) & 0o777, user=user)
    else:
        raise fail("%s is not a regular file or a directory: only those can be copied" % src)


def _upload_tree(sbx: Sandbox, root: str, target: str, user: Optional[str] = None) -> List[str]:
    """Copy the local directory ``root`` to ``target`` in the sandbox (what it makes owned by
    ``user``); returns what was skipped."""
    skipped: List[str] = []
    sbx.files.make_dir(target, parents=True, user=user)

    def raise_error(e: OSError) -> None:
        raise e

    for dirpath, dirnames, filenames in os.walk(root, onerror=raise_error):
        rel = os.path.relpath(dirpath, root)
        rdir = target if rel == "." else posixpath.join(target, *rel.split(os.sep))
        for name in sorted(dirnames):
            local = os.path.join(dirpath, name)
            if os.path.islink(local):  # os.walk does not descend into it either
                skipped.append(local)
            else:
                sbx.files.make_dir(posixpath.join(rdir, name), parents=True, user=user)
        for name in sorted(filenames):
            local = os.path.join(dirpath, name)
            st = os.lstat(local)
            if stat.S_ISREG(st.st_mode):
                sbx.files.upload(local, posixpath.join(rdir, name), mode=stat.S_IMODE(st.st_mode) & 0o777, user=user)
            else:
                skipped.append(local)
    return skipped


def _download(sbx: Sandbox, src: str, dst: str, recursive: bool) -> None:
    where = "%s:%s" % (sbx.id, src)
    info = sbx.files.stat(src)
    if info.is_dir:
        if not recursive:
            raise fail("%s is a directory: add -r to copy it with its contents" % where)
        if dst == "-":
            raise fail("%s is a directory: give a local directory, not - (stdout)" % where)
    elif info.type not in ("file", "symlink"):  # a symlink is read through, inside the sandbox
        raise fail("%s is not a regular file or a directory: only those can be copied" % where)
    if dst == "-":
        _to_stdout(sbx, src)
        return
    name = posixpath.basename(posixpath.normpath(posixpath.join("/", src))) or sbx.id
    target = os.path.join(dst, name) if os.path.isdir(dst) else dst
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        raise fail("local directory %s does not exist: create it first" % parent)
    if info.is_dir:
        _report_skipped(_download_tree(sbx, src, target))
        return
    sbx.files.download(src, target)
    if info.is_file:
        os.chmod(target, info.mode & 0o777)


def _download_tree(sbx: Sandbox, root: str, target: str) -> List[str]:
    """Copy the sandbox directory ``root`` to the local ``target``, one listing per directory;
    returns what was skipped. Local paths are built from entry names only (never from a
    symlink's target), and a name that is not one path component is refused."""
    skipped: List[str] = []
    os.makedirs(target, exist_ok=True)
    todo = [(root, target)]
    while todo:
        rdir, ldir = todo.pop()
        for e in sbx.files.list(rdir, 1):
            if e.name in ("", ".", "..") or "/" in e.name or "\0" in e.name:
                raise fail("%s:%s holds an entry named %r, which is no file name: nothing more copied" % (sbx.id, rdir, e.name))
            rpath, lpath = posixpath.join(rdir, e.name), os.path.join(ldir, e.name)
            if e.is_dir:
                os.makedirs(lpath, exist_ok=True)
                todo.append((rpath, lpath))
            elif e.is_file:
                sbx.files.download(rpath, lpath)
                os.chmod(lpath, e.mode & 0o777)
            else:
                skipped.append("%s:%s" % (sbx.id, rpath))
    return skipped


def _report_skipped(skipped: List[str]) -> None:
    for path in skipped:
        err.print(Text("skipped %s: only files and directories are copied (not symlinks or special files)" % path, style="yellow"))


@contextlib.contextmanager
def _flag_hint(error: Type[Exception], flag_given: bool, hint: str) -> Iterator[None]:
    """Without the flag, the daemon's ``error`` means the flag is what is missing: say so."""
    try:
        yield
    except error:
        if flag_given:
            raise
        raise fail(hint) from None


@files_app.command("rm")
@cli_errors
def files_rm(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="SANDBOX"),
    path: str = typer.Argument(..., metavar="PATH", help="File or directory in the sandbox."),
    recursive: bool = typer.Option(False, "-r", "--recursive", help="Remove a directory and everything in it."),
) -> None:
    """Remove a file (or, with -r, a directory and its contents) from a sandbox."""
    hint = "%s:%s is a directory with contents: add -r to remove it and everything in it" % (sandbox_id, path)
    with connected(ctx, sandbox_id) as sbx, _flag_hint(ConflictError, recursive, hint):
        sbx.files.remove(path, recursive)
    out.print("removed %s:%s" % (sandbox_id, path))


@files_app.command("mkdir")
@cli_errors
def files_mkdir(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="SANDBOX"),
    path: str = typer.Argument(..., metavar="PATH", help="Directory to create in the sandbox."),
    parents: bool = typer.Option(False, "-p", "--parents", help="Create missing parents too; no error if it exists."),
    user: Optional[str] = typer.Option(
        None, "--user", "-u", help="The directories made belong to this sandbox user (default root)."
    ),
) -> None:
    """Create a directory in a sandbox."""
    hint = "the parent of %s does not exist in %s: add -p to create it too" % (path, sandbox_id)
    with connected(ctx, sandbox_id) as sbx, _flag_hint(NotFoundError, parents, hint):
        sbx.files.make_dir(path, parents, user=user)
    out.print("created %s:%s" % (sandbox_id, path))
