"""Warm pool and templates in the SDK (sync and async), against httpx.MockTransport:
request shapes, parsing, client-side validation and error mapping."""

from __future__ import annotations

import inspect

import httpx
import pytest

import branchbox
from branchbox import (
    AsyncPool,
    AsyncSandbox,
    AsyncTemplates,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    Pool,
    PoolImageStats,
    PoolStats,
    Sandbox,
    SandboxError,
    TemplateInfo,
    TemplateProgress,
    Templates,
    VolumeInfo,
    VolumeMount,
)
from branchbox import _core, sandbox_async, sandbox_sync
from conftest import BASE, SANDBOX, SID, FakeDaemon, ndjson
from test_volumes_sdk import FORKED, VID, VID2, mount

POOL = {
    "images": {"base": {"min": 2, "max": 4, "ready": 1, "wired": 1}, "py": {"min": 0, "max": 0, "ready": 0}},
    "hits": 5,
    "misses": 2,
    "recycled": 3,
    "created": 7,
    "failures": 1,
    "last_error": "image \"gone\" not found",
    "refill_ms_p50": 12.5,
    "refill_ms_p99": 30.0,
    "cgroup_placement": "migrate",
    "cgroup_placement_ms_p50": 6.5,
}
TEMPLATE = {
    "name": "py",
    "image": "base",
    "snapshot": "sn-0123456789ab",
    "sandbox_id": "sb-aaaaaaaaaaaa",
    "created_at": 1732250000.0,
    "shells": 4,
    "ready_shells": 3,
    "alive": True,
    "memory_bytes": 18874368,
}
BUILD_EVENTS = [
    {"type": "progress", "stage": "create", "message": "starting a sandbox of image base", "done": 1, "total": 4},
    {"type": "progress", "stage": "run", "message": "echo hi > /root/recipe", "done": 2, "total": 4},
    {"type": "progress", "stage": "code", "message": "running the session code", "done": 3, "total": 4},
    {"type": "progress", "stage": "snapshot", "message": "checkpointing the live session", "done": 4, "total": 4},
    {"type": "progress", "stage": "shells", "message": "preparing 4 sandboxes to hand out", "done": None, "total": None},
    {"type": "done", "template": TEMPLATE},
]
# A template holding two volumes: a branching workspace (forked into each sandbox) and a
# read-only shared one.
TEMPLATE_VOLUMES = dict(
    TEMPLATE,
    volumes=[mount(VID, "/workspace"), mount(VID2, "/data", read_only=True, branch=False)],
)
NOT_FOUND = {"error": {"code": "not_found", "message": "template \"nope\" not found: list templates with `branchbox template ls`"}}


def _stream(*events, split=0) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/x-ndjson"}, stream=ndjson(*events, split=split))


# ----------------------------------------------------------------------------- models


def test_pool_stats_model() -> None:
    s = PoolStats.from_dict(POOL)
    assert s.images["base"] == PoolImageStats(min=2, max=4, ready=1, wired=1)
    assert s.images["py"].wired == 0, "a daemon that does not say has none wired"
    assert isinstance(s.images["py"], PoolImageStats)
    assert (s.hits, s.misses, s.recycled, s.created, s.failures) == (5, 2, 3, 7, 1)
    assert s.last_error.startswith("image") and s.cgroup_placement == "migrate"
    assert (s.refill_ms_p50, s.refill_ms_p99, s.cgroup_placement_ms_p50) == (12.5, 30.0, 6.5)
    assert s.ready("base") == 1 and s.ready("nope") == 0
    assert s.raw == POOL
    empty = PoolStats.from_dict({"images": {}, "hits": 0, "misses": 0, "recycled": 0, "created": 0, "failures": 0})
    assert empty.images == {} and empty.last_error is None and empty.cgroup_placement is None
    assert PoolStats.from_dict(None).images == {}


def test_template_models() -> None:
    t = TemplateInfo.from_dict(TEMPLATE)
    assert (t.name, t.image, t.snapshot, t.sandbox_id) == ("py", "base", "sn-0123456789ab", "sb-aaaaaaaaaaaa")
    assert (t.shells, t.ready_shells, t.alive, t.memory_bytes) == (4, 3, True, 18874368)
    p = TemplateProgress.from_dict(BUILD_EVENTS[1])
    assert (p.stage, p.message, p.done, p.total) == ("run", "echo hi > /root/recipe", 2, 4)
    assert isinstance(p, branchbox.ImageProgress)  # the CLI's progress views accept both
    assert t.volumes == []


def test_template_info_has_its_volumes() -> None:
    t = TemplateInfo.from_dict(TEMPLATE_VOLUMES)
    assert t.volumes == [
        VolumeMount(volume=VID, path="/workspace"),
        VolumeMount(volume=VID2, path="/data", read_only=True, branch=False),
    ]
    assert all(isinstance(m, VolumeMount) for m in t.volumes)
    assert t.volumes[0].raw == TEMPLATE_VOLUMES["volumes"][0] and t.raw == TEMPLATE_VOLUMES
    # Older daemons send no "volumes"; null is tolerated too.
    assert TemplateInfo.from_dict(TEMPLATE).volumes == []
    assert TemplateInfo.from_dict(dict(TEMPLATE, volumes=None)).volumes == []
    assert TemplateInfo.from_dict(None).volumes == []


# ----------------------------------------------------------------------------- create(template=), fork(isolated=)


def test_create_from_template(fake: FakeDaemon) -> None:
    s = Sandbox.create(template="py", transport=fake.transport())
    assert fake.body() == {"template": "py", "timeout": 300}, "no image or network: the template's are used"
    assert s.id == SID
    Sandbox.create(template=TemplateInfo.from_dict(TEMPLATE), memory_mb=256, transport=fake.transport())
    assert fake.body() == {"template": "py", "memory_mb": 256, "timeout": 300}
    Sandbox.create("base", template="py", transport=fake.transport())
    assert fake.body()["image"] == "base" and fake.body()["template"] == "py"
    Sandbox.create(transport=fake.transport())
    assert fake.body() == {"image": "base", "timeout": 300, "network": "none"}, "default image unchanged"


def test_create_from_template_errors(fake: FakeDaemon) -> None:
    for bad in ("", "  ", 3):
        with pytest.raises(InvalidArgumentError):
            Sandbox.create(template=bad, transport=fake.transport())
    n = len(fake.requests)
    fake.on("POST", "/v1/sandboxes", NOT_FOUND, 404)
    with pytest.raises(NotFoundError, match="template ls"):
        Sandbox.create(template="nope", transport=fake.transport())
    fake.on("POST", "/v1/sandboxes", {"error": {"code": "bad_request", "message": "built on image base, not x"}}, 400)
    with pytest.raises(InvalidArgumentError, match="built on image"):
        Sandbox.create("x", template="py", transport=fake.transport())
    assert len(fake.requests) == n + 2, "bad arguments are refused before any request"


def test_delete_template_sandbox_is_conflict(fake: FakeDaemon) -> None:
    fake.on("DELETE", BASE, {"error": {"code": "conflict", "message": "holds template \"py\""}}, 409)
    s = Sandbox.create(transport=fake.transport())
    with pytest.raises(ConflictError, match="holds template"):
        s.kill()


FORK = {"snapshot": "sn-1", "sandboxes": [dict(SANDBOX, id="sb-child0000001")], "sessions_restarted": True, "took_ms": 3.0}


def test_fork_isolated(fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/fork", FORK, 201)
    s = Sandbox.create(transport=fake.transport())
    kids = s.fork(2, isolated=True)
    assert fake.body() == {"count": 2, "isolated": True}
    assert [k.id for k in kids] == ["sb-child0000001"]
    s.fork()
    assert fake.body() == {"count": 1}, "isolated is only sent when set"
    s.fork(1, snapshot="sn-1", timeout=5, isolated=False)
    assert fake.body() == {"count": 1, "snapshot": "sn-1", "timeout": 5}
    with pytest.raises(InvalidArgumentError):
        s.fork(1, isolated="yes")  # type: ignore[arg-type]


def test_fork_replay_inflight(fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/fork", dict(FORK, inflight_handed=2), 201)
    s = Sandbox.create(transport=fake.transport())
    kids, result = s.fork_info(2, replay_inflight=True)
    assert fake.body() == {"count": 2, "replay_inflight": True}
    assert [k.id for k in kids] == ["sb-child0000001"] and result.inflight_handed == 2
    s.fork(3, isolated=True, replay_inflight=True)
    assert fake.body() == {"count": 3, "isolated": True, "replay_inflight": True}
    s.fork(1, replay_inflight=False)
    assert fake.body() == {"count": 1}, "replay_inflight is only sent when set"
    sent = len(fake.requests)
    with pytest.raises(InvalidArgumentError, match="replay_inflight must be True or False"):
        s.fork(1, replay_inflight=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="leave snapshot out"):
        s.fork(1, snapshot="sn-1", replay_inflight=True)
    assert len(fake.requests) == sent, "rejected before anything is sent"


def test_nested_in_is_parsed(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/sandboxes", dict(SANDBOX, nested_in="sb-aaaaaaaaaaaa"), 201)
    s = Sandbox.create(template="py", transport=fake.transport())
    assert s._info.nested_in == "sb-aaaaaaaaaaaa"


# ----------------------------------------------------------------------------- pool


def test_pool(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/pool", POOL)
    fake.on("PUT", "/v1/pool/[^/]+", POOL)
    with Pool(transport=fake.transport()) as pool:
        assert pool.stats().hits == 5
        assert (fake.last.method, fake.last.url.path) == ("GET", "/v1/pool")
        s = pool.set("base", 2, 4)
        assert (fake.last.method, fake.last.url.path, fake.body()) == ("PUT", "/v1/pool/base", {"min": 2, "max": 4})
        assert isinstance(s, PoolStats) and s.images["base"].max == 4
        pool.set("py-numpy", 3)
        assert fake.body() == {"min": 3}, "max left to the daemon (= min)"
        pool.drain("my image")
        assert fake.last.url.raw_path == b"/v1/pool/my%20image" and fake.body() == {"min": 0, "max": 0}


def test_pool_validation_and_errors(fake: FakeDaemon) -> None:
    fake.on("PUT", "/v1/pool/nope", {"error": {"code": "not_found", "message": "image \"nope\" not found"}}, 404)
    with Pool(transport=fake.transport()) as pool:
        for args in (("base", -1), ("base", 1.5), ("base", True), ("base", 3, 2), ("", 1), ("base", 1, -1)):
            with pytest.raises(InvalidArgumentError):
                pool.set(*args)
        assert fake.requests == []
        with pytest.raises(NotFoundError, match="nope"):
            pool.set("nope", 1)


def test_pool_module_functions(daemon: FakeDaemon) -> None:
    fake = daemon
    fake.on("GET", "/v1/pool", POOL)
    fake.on("PUT", "/v1/pool/base", POOL)
    assert branchbox.pool.stats().recycled == 3
    branchbox.pool.set("base", 1, 2)
    assert fake.body() == {"min": 1, "max": 2}
    branchbox.pool.drain("base")
    assert fake.body() == {"min": 0, "max": 0}
    assert branchbox.pool.__all__ == ["stats", "set", "drain"]


# ----------------------------------------------------------------------------- templates


def test_template_build(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/templates", _stream(*BUILD_EVENTS, split=7))
    progress = []
    with Templates(transport=fake.transport()) as templates:
        info = templates.build(
            "py",
            image="py-numpy",
            run=["echo hi > /root/recipe", "pip --version"],
            code="import numpy",
            env={"A": 1},
            cwd="/work",
            cpu=2.0,
            memory_mb=1024,
            pids=128,
            metadata={"team": "x"},
            timeout=120,
            shells=2,
            on_progress=progress.append,
        )
    assert fake.body() == {
        "name": "py",
        "image": "py-numpy",
        "run": ["echo hi > /root/recipe", "pip --version"],
        "code": "import numpy",
        "env": {"A": "1"},
        "cwd": "/work",
        "cpu": 2.0,
        "memory_mb": 1024,
        "pids": 128,
        "metadata": {"team": "x"},
        "timeout": 120,
        "shells": 2,
    }
    assert fake.last.headers["accept"] == "application/x-ndjson"
    assert info == TemplateInfo.from_dict(TEMPLATE)
    assert [(p.stage, p.done, p.total) for p in progress] == [
        ("create", 1, 4), ("run", 2, 4), ("code", 3, 4), ("snapshot", 4, 4), ("shells", None, None)
    ]
    assert all(isinstance(p, TemplateProgress) for p in progress)


def test_template_build_minimal_body_and_run_string(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/templates", _stream(BUILD_EVENTS[-1]))
    with Templates(transport=fake.transport()) as templates:
        templates.build("t")
        assert fake.body() == {"name": "t"}
        templates.build("t", run="make")
        assert fake.body() == {"name": "t", "run": ["make"]}


def test_template_recipe_volumes() -> None:
    assert "volumes" not in _core.template_recipe("t")
    assert _core.template_recipe("t", volumes={})["volumes"] == [], "an empty mapping is sent as given"
    recipe = _core.template_recipe(
        "t", run="git clone repo /workspace", volumes={"/workspace": "ws", "/data": VolumeInfo.from_dict(FORKED)}
    )
    assert recipe["volumes"] == [mount("ws", "/workspace"), mount(VID2, "/data")]
    recipe = _core.template_recipe("t", volumes=[VolumeMount("ws", "/w", read_only=True, branch=False)])
    assert recipe["volumes"] == [mount("ws", "/w", True, False)]


def test_template_build_with_volumes(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/templates", _stream(*BUILD_EVENTS[:-1], {"type": "done", "template": TEMPLATE_VOLUMES}))
    with Templates(transport=fake.transport()) as templates:
        info = templates.build(
            "py",
            run=["git clone https://example.com/repo /workspace"],
            volumes={"/workspace": "ws", "/data": VolumeMount(volume=VID2, read_only=True, branch=False)},
        )
        assert fake.body() == {
            "name": "py",
            "run": ["git clone https://example.com/repo /workspace"],
            "volumes": [mount("ws", "/workspace"), mount(VID2, "/data", read_only=True, branch=False)],
        }
        assert info.volumes == [
            VolumeMount(volume=VID, path="/workspace"),
            VolumeMount(volume=VID2, path="/data", read_only=True, branch=False),
        ], "the done event's TemplateInfo names the volumes the template holds"
        templates.build("py", volumes=[{"volume": VID, "path": "/workspace"}])
        assert fake.body() == {"name": "py", "volumes": [mount(VID, "/workspace")]}
        n = len(fake.requests)
        for bad in ({"workspace": "ws"}, [VolumeMount("a", "/w"), VolumeMount("b", "/w")], "/w=ws"):
            with pytest.raises(InvalidArgumentError):
                templates.build("py", volumes=bad)
        assert len(fake.requests) == n, "bad volumes send nothing"


def test_template_build_read_timeout_covers_a_step() -> None:
    assert _core.build_template({"name": "t"}).op_timeout >= _core.TEMPLATE_STEP_TIMEOUT
    assert _core.build_template({"name": "t", "timeout": 3600}).op_timeout >= 3600
    assert _core.build_template({"name": "t", "timeout": 3600}).http_timeout(120).read >= 3600


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": ""},
        {"name": 3},
        {"name": "t", "run": [""]},
        {"name": "t", "run": ["ok", 3]},
        {"name": "t", "run": 5},
        {"name": "t", "code": b"import os"},
        {"name": "t", "shells": -1},
        {"name": "t", "timeout": 0},
    ],
)
def test_template_build_validation(fake: FakeDaemon, kwargs) -> None:
    with Templates(transport=fake.transport()) as templates:
        name = kwargs.pop("name")
        with pytest.raises(InvalidArgumentError):
            templates.build(name, **kwargs)
    assert fake.requests == []


def test_template_build_errors(fake: FakeDaemon) -> None:
    failing = [
        BUILD_EVENTS[0],
        BUILD_EVENTS[1],
        {"type": "error", "error": {"code": "bad_request", "message": "recipe command \"false\" failed (exit 1)"}},
    ]
    fake.on("POST", "/v1/templates", _stream(*failing))
    seen = []
    with Templates(transport=fake.transport()) as templates:
        with pytest.raises(InvalidArgumentError, match="recipe command \"false\" failed") as ei:
            templates.build("t", run=["false"], on_progress=seen.append)
        assert ei.value.code == "bad_request"
        assert [p.stage for p in seen] == ["create", "run"], "progress before the error is delivered"
        fake.on("POST", "/v1/templates", _stream(*BUILD_EVENTS[:2]))
        with pytest.raises(SandboxError, match="without a done event"):
            templates.build("t")
        fake.on("POST", "/v1/templates", {"error": {"code": "bad_request", "message": "unknown field"}}, 400)
        with pytest.raises(InvalidArgumentError, match="unknown field"):
            templates.build("t")


def test_template_list_get_remove(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/templates", {"templates": [TEMPLATE]})
    fake.on("GET", "/v1/templates/py", TEMPLATE)
    fake.on("DELETE", "/v1/templates/py", {"removed": True})
    fake.on("GET", "/v1/templates/nope", NOT_FOUND, 404)
    fake.on("DELETE", "/v1/templates/nope", NOT_FOUND, 404)
    with Templates(transport=fake.transport()) as templates:
        assert templates.list() == [TemplateInfo.from_dict(TEMPLATE)]
        info = templates.get("py")
        assert info.sandbox_id == "sb-aaaaaaaaaaaa"
        assert templates.get(info).name == "py"
        assert templates.remove(info) is True
        assert (fake.last.method, fake.last.url.path) == ("DELETE", "/v1/templates/py")
        with pytest.raises(NotFoundError, match="template ls"):
            templates.get("nope")
        with pytest.raises(NotFoundError):
            templates.remove("nope")
        with pytest.raises(InvalidArgumentError):
            templates.get("")


def test_templates_module_functions(daemon: FakeDaemon) -> None:
    fake = daemon
    fake.on("GET", "/v1/templates", {"templates": [TEMPLATE]})
    fake.on("GET", "/v1/templates/py", TEMPLATE)
    fake.on("DELETE", "/v1/templates/py", {"removed": True})
    fake.on("POST", "/v1/templates", _stream(*BUILD_EVENTS))
    assert [t.name for t in branchbox.templates.list()] == ["py"]
    assert branchbox.templates.get("py").shells == 4
    assert branchbox.templates.build("py", run=["true"], code="x = 1").name == "py"
    assert fake.body() == {"name": "py", "run": ["true"], "code": "x = 1"}
    branchbox.templates.build("py", volumes={"/workspace": "ws"})
    assert fake.body() == {"name": "py", "volumes": [mount("ws", "/workspace")]}
    assert branchbox.templates.remove("py") is True
    assert branchbox.templates.__all__ == ["list", "get", "build", "remove"]


# ----------------------------------------------------------------------------- async mirror


async def test_async_create_from_template_and_fork(fake: FakeDaemon) -> None:
    fake.on("POST", BASE + "/fork", FORK, 201)
    s = await AsyncSandbox.create(template="py", transport=fake.transport())
    assert fake.body() == {"template": "py", "timeout": 300}
    kids = await s.fork(3, isolated=True)
    assert fake.body() == {"count": 3, "isolated": True} and kids[0].id == "sb-child0000001"
    kids, result = await s.fork_info(2, replay_inflight=True)
    assert fake.body() == {"count": 2, "replay_inflight": True} and result.inflight_handed == 0
    with pytest.raises(InvalidArgumentError, match="leave snapshot out"):
        await s.fork(1, snapshot="sn-1", replay_inflight=True)
    fake.on("POST", "/v1/sandboxes", NOT_FOUND, 404)
    with pytest.raises(NotFoundError):
        await AsyncSandbox.create(template="nope", transport=fake.transport())
    await s.close()


async def test_async_pool(fake: FakeDaemon) -> None:
    fake.on("GET", "/v1/pool", POOL)
    fake.on("PUT", "/v1/pool/base", POOL)
    async with AsyncPool(transport=fake.transport()) as pool:
        assert (await pool.stats()).images["base"].ready == 1
        await pool.set("base", 2, 4)
        assert fake.body() == {"min": 2, "max": 4}
        await pool.drain("base")
        assert fake.body() == {"min": 0, "max": 0}
        with pytest.raises(InvalidArgumentError):
            await pool.set("base", 5, 1)


async def test_async_templates(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/templates", _stream(*BUILD_EVENTS, split=5))
    fake.on("GET", "/v1/templates", {"templates": [TEMPLATE]})
    fake.on("GET", "/v1/templates/py", TEMPLATE)
    fake.on("DELETE", "/v1/templates/py", {"removed": True})
    seen = []

    async def on_progress(p):
        seen.append(p.stage)

    async with AsyncTemplates(transport=fake.transport()) as templates:
        info = await templates.build("py", run=["echo hi"], code="import json", shells=1, on_progress=on_progress)
        assert info.name == "py" and fake.body() == {"name": "py", "run": ["echo hi"], "code": "import json", "shells": 1}
        assert seen == ["create", "run", "code", "snapshot", "shells"]
        await templates.build("py", on_progress=seen.append)  # plain callbacks work too
        await templates.build("py", volumes={"/workspace": VolumeMount(volume="ws", read_only=True)})
        assert fake.body() == {"name": "py", "volumes": [mount("ws", "/workspace", read_only=True)]}
        fake.on("GET", "/v1/templates/py", TEMPLATE_VOLUMES)
        assert (await templates.get("py")).volumes[0] == VolumeMount(volume=VID, path="/workspace")
        fake.on("GET", "/v1/templates/py", TEMPLATE)
        assert [t.name for t in await templates.list()] == ["py"]
        assert (await templates.get("py")).alive is True
        assert await templates.remove("py") is True
        fake.on("POST", "/v1/templates", _stream({"type": "error", "error": {"code": "bad_request", "message": "template name \"a/b\" is invalid"}}))
        with pytest.raises(InvalidArgumentError, match="invalid"):
            await templates.build("a/b")


@pytest.mark.parametrize(
    "sync_cls, async_cls",
    [(Templates, AsyncTemplates), (Pool, AsyncPool)],
    ids=["Templates", "Pool"],
)
def test_sync_async_surfaces_match(sync_cls, async_cls) -> None:
    def public(cls):
        return {n: getattr(cls, n) for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)) and n != "close"}

    s, a = public(sync_cls), public(async_cls)
    assert set(s) == set(a)
    for name in s:
        assert list(inspect.signature(s[name]).parameters) == list(inspect.signature(a[name]).parameters), name
        assert inspect.iscoroutinefunction(a[name]), name


def test_template_build_signatures_take_volumes() -> None:
    for fn in (Templates.build, AsyncTemplates.build, branchbox.templates.build):
        param = inspect.signature(fn).parameters["volumes"]
        assert param.default is None and param.kind is inspect.Parameter.KEYWORD_ONLY, fn
    # The module function takes every keyword of Templates.build.
    sync = set(inspect.signature(Templates.build).parameters) - {"self"}
    assert sync <= set(inspect.signature(branchbox.templates.build).parameters)


def test_create_and_fork_signatures_mirror() -> None:
    for name in ("create", "fork"):
        s = inspect.signature(getattr(Sandbox, name)).parameters
        a = inspect.signature(getattr(AsyncSandbox, name)).parameters
        assert list(s) == list(a), name
    assert "template" in inspect.signature(Sandbox.create).parameters
    assert inspect.signature(Sandbox.fork).parameters["isolated"].default is False
    for name in ("fork", "fork_info"):
        assert list(inspect.signature(getattr(Sandbox, name)).parameters)[-2:] == ["replay_inflight", "processes"], name
        assert inspect.signature(getattr(AsyncSandbox, name)).parameters["processes"].default is None, name
        assert inspect.signature(getattr(Sandbox, name)).parameters["replay_inflight"].default is False, name
        assert inspect.signature(getattr(AsyncSandbox, name)).parameters["replay_inflight"].default is False, name
    assert sandbox_sync.__all__[-3:] == ["Templates", "Pool", "health"]
    assert sandbox_async.__all__[-3:] == ["AsyncTemplates", "AsyncPool", "health"]
