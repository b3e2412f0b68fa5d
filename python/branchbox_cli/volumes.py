"""``branchbox volume``: persistent volumes from the shell (create, list, snapshot, fork, sync),
and the ``--volume /path=VOLUME[:ro][:nobranch]`` flag of ``sandbox create`` and ``template build``."""

# No `from __future__ import annotations`: typer evaluates annotations at runtime.
import contextlib
import time
from typing import Iterator, List, Optional

import typer
from rich.table import Table
from rich.text import Text

from branchbox import Volume, VolumeInfo, VolumeMount

from .base import cli_errors, ctx_of, fmt_bytes, fmt_duration, out, print_json

volume_app = typer.Typer(help="Persistent volumes: files that outlive sandboxes.", no_args_is_help=True)

VOLUME_FLAG = "/path=VOLUME[:ro][:nobranch]"


def parse_volume_flags(items: Optional[List[str]]) -> List[VolumeMount]:
    """``["/workspace=ws:ro", ...]`` (``--volume``) -> mounts: ``ro`` mounts read-only,
    ``nobranch`` sets ``branch=False``."""
    mounts: List[VolumeMount] = []
    for item in items or []:
        path, sep, spec = item.partition("=")
        volume, *flags = spec.split(":")
        unknown = [f for f in flags if f not in ("ro", "nobranch")]
        if not sep or not path.startswith("/") or not volume or unknown:
            raise typer.BadParameter("expected %s, got %r" % (VOLUME_FLAG, item), param_hint="--volume")
        mounts.append(VolumeMount(volume=volume, path=path, read_only="ro" in flags, branch="nobranch" not in flags))
    return mounts


def volume_flag(mount: VolumeMount) -> str:
    """A mount as its ``--volume`` flag (the inverse of :func:`parse_volume_flags`)."""
    flags = (":ro" if mount.read_only else "") + ("" if mount.branch else ":nobranch")
    return "%s=%s%s" % (mount.path, mount.volume, flags)


@contextlib.contextmanager
def _volume(ctx: typer.Context, volume: str) -> Iterator[Volume]:
    """The volume ``volume`` (id or name; NotFoundError when unknown), its connection closed after."""
    with Volume.connect(volume, **ctx_of(ctx).sdk()) as vol:
        yield vol


def _print_info(info: VolumeInfo) -> None:
    print_json(info.raw or {"id": info.id})


def _print_volume(vol: Volume, as_json: bool) -> None:
    """A volume just made: its id, or with ``as_json`` the daemon's answer (VolumeInfo JSON)."""
    if as_json:
        print_json(vol._info.raw if vol._info is not None and vol._info.raw else {"id": vol.id})
    else:
        out.print(vol.id)


def _durability(info: VolumeInfo) -> Text:
    if info.durability == "durable":
        return Text("durable" if info.cached else "durable (in the object store only)", style="green")
    return Text("node-local (%s unsynced)" % fmt_bytes(info.backlog_bytes), style="yellow")


@volume_app.command("create")
@cli_errors
def volume_create(
    ctx: typer.Context,
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Name that stands for the id anywhere (unique)."),
    access: str = typer.Option("rwo", "--access", help='"rwo" (one sandbox mounts it at a time), "rox" (read-only mounts) or "rwx" (read-write mounts sharing one copy).'),
    quota_mb: Optional[int] = typer.Option(None, "--quota-mb", min=1, help="Size limit (MiB; default: none)."),
    as_json: bool = typer.Option(False, "--json", help="Print the VolumeInfo JSON."),
) -> None:
    """Create an empty volume and print its id."""
    with Volume.create(name, access, quota_mb, **ctx_of(ctx).sdk()) as vol:
        _print_volume(vol, as_json)


@volume_app.command("ls")
@cli_errors
def volume_ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List volumes."""
    infos = Volume.list(**ctx_of(ctx).sdk())
    if as_json:
        print_json([i.raw for i in infos])
        return
    if not infos:
        out.print("no volumes (create one with `branchbox volume create`)")
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "ACCESS", "SIZE", "QUOTA", "SNAPSHOTS", "MOUNTED IN", "DURABILITY", "AGE"):
        table.add_column(col, no_wrap=True)
    for i in infos:
        table.add_row(
            i.id,
            i.name or "-",
            i.access,
            fmt_bytes(i.size_bytes),
            "-" if i.quota_mb is None else "%d MiB" % i.quota_mb,
            str(i.snapshots),
            ", ".join("%s:%s" % (m.sandbox, m.path) for m in i.mounts) or "-",
            _durability(i),
            fmt_duration(now - i.created_at) if i.created_at else "-",
        )
    out.print(table)


@volume_app.command("info")
@cli_errors
def volume_info(ctx: typer.Context, volume: str = typer.Argument(..., metavar="VOLUME", help="Volume id or name.")) -> None:
    """Print a volume's VolumeInfo JSON."""
    with _volume(ctx, volume) as vol:
        _print_volume(vol, as_json=True)


@volume_app.command("rm")
@cli_errors
def volume_rm(ctx: typer.Context, volume: str = typer.Argument(..., metavar="VOLUME", help="Volume id or name.")) -> None:
    """Delete a volume and its snapshots (refused while a sandbox mounts it)."""
    with _volume(ctx, volume) as vol:
        vol.delete()
    out.print("removed volume %s" % volume)


@volume_app.command("snapshot")
@cli_errors
def volume_snapshot(
    ctx: typer.Context,
    volume: str = typer.Argument(..., metavar="VOLUME", help="Volume id or name."),
    label: Optional[str] = typer.Option(None, "--label", "-l", help="Label shown in `volume snapshots`."),
    as_json: bool = typer.Option(False, "--json", help="Print the VolumeSnapshotInfo JSON."),
) -> None:
    """Snapshot a volume's files and print the snapshot id."""
    with _volume(ctx, volume) as vol:
        snap = vol.snapshot(label)
    if as_json:
        print_json(snap.raw or {"id": snap.id})
    else:
        out.print(snap.id)


@volume_app.command("snapshots")
@cli_errors
def volume_snapshots(
    ctx: typer.Context,
    volume: str = typer.Argument(..., metavar="VOLUME", help="Volume id or name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List a volume's snapshots (STORED: durable once a sync committed it to the object store,
    restorable on any daemon sharing the stores; node-local until then)."""
    with _volume(ctx, volume) as vol:
        snaps = vol.snapshots()
    if as_json:
        print_json([s.raw for s in snaps])
        return
    if not snaps:
        out.print("no snapshots of volume %s" % volume)
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in ("ID", "LABEL", "LAYERS", "STORED", "AGE"):
        table.add_column(col, no_wrap=True)
    for s in snaps:
        stored = "durable" if s.durable else "node-local"
        age = fmt_duration(now - s.created_at) if s.created_at else "-"
        table.add_row(s.id, s.label or "", str(s.layers), stored, age)
    out.print(table)


@volume_app.command("restore")
@cli_errors
def volume_restore(
    ctx: typer.Context,
    volume: str = typer.Argument(..., metavar="VOLUME", help="Volume id or name."),
    snapshot: str = typer.Argument(..., metavar="SNAPSHOT", help="Snapshot id (`volume snapshots`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the VolumeInfo JSON."),
) -> None:
    """Return a volume's files to a snapshot."""
    with _volume(ctx, volume) as vol:
        info = vol.restore(snapshot)
    if as_json:
        _print_info(info)
    else:
        out.print("restored volume %s to %s (%s)" % (volume, snapshot, fmt_bytes(info.size_bytes)))


@volume_app.command("fork")
@cli_errors
def volume_fork(
    ctx: typer.Context,
    volume: str = typer.Argument(..., metavar="VOLUME", help="Volume id or name."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Name of the new volume."),
    snapshot: Optional[str] = typer.Option(None, "--snapshot", "-s", help="Fork this snapshot (default: the files now)."),
    as_json: bool = typer.Option(False, "--json", help="Print the new volume's VolumeInfo JSON."),
) -> None:
    """Make a copy-on-write copy of a volume and print the new volume's id."""
    with _volume(ctx, volume) as vol, vol.fork(name, snapshot) as child:
        _print_volume(child, as_json)


@volume_app.command("sync")
@cli_errors
def volume_sync(
    ctx: typer.Context,
    volume: str = typer.Argument(..., metavar="VOLUME", help="Volume id or name."),
    as_json: bool = typer.Option(False, "--json", help="Print the VolumeInfo JSON."),
) -> None:
    """Make a volume durable: what was written since the last sync goes to the object store."""
    with _volume(ctx, volume) as vol:
        t0 = time.perf_counter()
        info = vol.sync()
        took_ms = (time.perf_counter() - t0) * 1000.0
    if as_json:
        _print_info(info)
        return
    out.print(
        "volume %s %s at version %d (%s), in %.0f ms"
        % (volume, info.durability, info.version, fmt_bytes(info.size_bytes), took_ms)
    )
