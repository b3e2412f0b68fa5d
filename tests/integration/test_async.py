"""The main surface through AsyncSandbox, and many sandboxes driven concurrently with asyncio."""
import asyncio
import hashlib
import os
import uuid

import pytest

from branchbox import AsyncCommandHandle, AsyncSandbox, NotFoundError
from helpers import URL, assert_no_host_traces, expect_output

N_CONCURRENT = 8


@pytest.fixture
async def async_sandboxes(daemon):
    """Factory ``await make(n, **kw)``; every sandbox made is killed at teardown."""
    made = []

    async def make(n=1, **kw):
        kw.setdefault("timeout", 600)
        boxes = await asyncio.gather(*(AsyncSandbox.create(daemon=URL, **kw) for _ in range(n)))
        made.extend(boxes)
        return boxes

    yield make
    await asyncio.gather(*(b.kill() for b in made), return_exceptions=True)
    await asyncio.gather(*(b.close() for b in made), return_exceptions=True)


async def test_async_main_surface(async_sandboxes, tmp_path):
    """create/info/list, commands (fg, bg, stream), run_code, sessions, files, kill -> 404."""
    t = uuid.uuid4().hex[:8]
    (sbx,) = await async_sandboxes(1, env={"BB_ASYNC": "yes"}, cwd="/tmp", metadata={"async": t})
    info = await sbx.info()
    assert (info.state, info.env, info.cwd, info.metadata) == ("running", {"BB_ASYNC": "yes"}, "/tmp", {"async": t})
    assert [i.id for i in await AsyncSandbox.list(daemon=URL, metadata={"async": t})] == [sbx.id]

    fg = await sbx.commands.run('pwd; echo "$BB_ASYNC"; echo err >&2; exit 4')

    chunks = []

    async def on_out(data):  # coroutine callbacks are awaited
        chunks.append(data)

    streamed = await sbx.commands.run(["python3", "-c", "for i in range(50): print(i, flush=True)"], on_stdout=on_out)
    assert streamed.exit_code == 0 and "".join(chunks) == streamed.stdout

    h = await sbx.commands.run("echo bg; exit 3", background=True)
    assert isinstance(h, AsyncCommandHandle)
    r = await h.wait(timeout=30)
    assert (r.stdout, r.exit_code) == ("bg\n", 3)
    long = await sbx.commands.run("sleep 4281", background=True)
    assert {p.pid: p.running for p in await sbx.commands.list()}[long.pid] is True
    assert await long.kill() is True
    assert (await long.wait(timeout=30)).signal == 9

    assert (await sbx.run_code("z = 6")).error is None
    assert (await sbx.run_code("z * 7")).text == "42"
    sh = await sbx.sessions.create("shell")
    await sh.run("cd /etc; export K=v")
    assert (await sh.run('pwd; echo "$K"')).stdout == "/etc\nv\n"
    assert sh.id in {s.id for s in await sbx.sessions.list()}
    assert await sh.kill() is True

    data = os.urandom(1 << 20)
    e = await sbx.files.write("/root/a/blob.bin", data)
    assert (e.type, e.size) == ("file", len(data))
    assert await sbx.files.read("/root/a/blob.bin", format="bytes") == data
    await sbx.files.write("/root/a/t.txt", "héllo")
    assert await sbx.files.read("/root/a/t.txt") == "héllo"
    assert {x.name for x in await sbx.files.list("/root/a")} == {"blob.bin", "t.txt"}
    dst = tmp_path / "dl.bin"
    await sbx.files.download("/root/a/blob.bin", dst)
    assert dst.read_bytes() == data
    ex = await sbx.run_code("import hashlib\nhashlib.sha256(open('/root/a/blob.bin','rb').read()).hexdigest()")
    assert ex.result == repr(hashlib.sha256(data).hexdigest())
    assert await sbx.files.exists("/root/a/t.txt") and not await sbx.files.exists("/root/a/none")

    assert await sbx.kill() is True
    with pytest.raises(NotFoundError) as ei:
        await sbx.info()
    assert sbx.id in str(ei.value)
    assert await sbx.kill() is False
    assert_no_host_traces(sbx.id)
    expect_output(fg, stdout="/tmp\nyes\n", stderr="err\n", exit_code=4)
    expect_output(streamed, stdout="".join("%d\n" % i for i in range(50)))


async def test_concurrent_sandboxes_stay_isolated(async_sandboxes):
    """8 sandboxes created and driven at once: every answer comes from its own sandbox."""
    boxes = await async_sandboxes(N_CONCURRENT)
    assert len({b.id for b in boxes}) == N_CONCURRENT
    tokens = [uuid.uuid4().hex for _ in boxes]

    # Each sandbox gets its own file, concurrently...
    await asyncio.gather(*(b.files.write("/root/token", tok) for b, tok in zip(boxes, tokens)))
    # ...then commands, code and file reads all run concurrently across the sandboxes.
    cmds = asyncio.gather(*(b.commands.run('test "$(cat /root/token)" = %s && test "$HOSTNAME" = %s' % (tok, b.id))
                            for b, tok in zip(boxes, tokens)))
    codes = asyncio.gather(*(b.run_code("import socket\n(socket.gethostname(), open('/root/token').read())")
                             for b in boxes))
    reads = asyncio.gather(*(b.files.read("/root/token") for b in boxes))
    outs = asyncio.gather(*(b.commands.run("cat /root/token; echo; hostname") for b in boxes))
    cmd_results, code_results, read_results, out_results = await asyncio.gather(cmds, codes, reads, outs)

    for b, tok, r, ex, content, out in zip(boxes, tokens, cmd_results, code_results, read_results, out_results):
        assert r.exit_code == 0, "sandbox %s saw another sandbox's token or hostname: %r" % (b.id, r)
        assert ex.result == repr((b.id, tok)), (b.id, ex)
        assert content == tok
        assert out.exit_code == 0
        assert out.stdout == "%s\n%s\n" % (tok, b.id), "sandbox %s returned %r" % (b.id, out.stdout)


async def test_concurrent_commands_return_complete_output(async_sandboxes):
    """8 sandboxes each running commands concurrently get their complete, own output back."""
    boxes = await async_sandboxes(N_CONCURRENT)
    bad = []
    rounds = 0
    while rounds < 10 and not bad:  # stops at the first round with a wrong answer
        results = await asyncio.gather(*(b.commands.run("echo %s-%d" % (b.id, rounds)) for b in boxes))
        for b, r in zip(boxes, results):
            if (r.exit_code, r.stdout) != (0, "%s-%d\n" % (b.id, rounds)):
                bad.append((b.id, r))
        rounds += 1
    assert not bad, "round %d: %d of %d concurrent commands returned wrong output, e.g. %r" % (
        rounds, len(bad), N_CONCURRENT, bad[:3])
