"""Warm templates against a live daemon: build from a recipe, create(template=) as a live
fork (files and python session state there at once, nested in the template's hidden sandbox,
independent of each other), hidden and undeletable template sandboxes, removal, and errors.
Also ``fork(isolated=True)``.

Every test removes the templates it built, so the suite's final leak check sees no hidden
template sandbox.
"""
import uuid

import pytest

from branchbox import ConflictError, InvalidArgumentError, NotFoundError, Sandbox, Snapshots, Templates
from helpers import URL, api_error, assert_no_host_traces, cgroup_children, expect_output, wait_until

RECIPE_RUN = ["echo hi > /root/recipe", "mkdir -p /srv/app && echo 'x = 1' > /srv/app/conf.py"]
RECIPE_CODE = "import json; big = list(range(200000))"


def tname(prefix="t"):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


class TemplateCtl:
    """The templates API; every template built through it is removed at teardown."""

    def __init__(self):
        self.api = Templates(daemon=URL)
        self.built = set()

    def build(self, name, **kw):
        self.built.add(name)
        return self.api.build(name, **kw)

    def cleanup(self):
        for name in sorted(self.built):
            try:
                self.api.remove(name)
            except NotFoundError:
                pass
        self.api.close()


@pytest.fixture
def templates(daemon):
    ctl = TemplateCtl()
    yield ctl
    ctl.cleanup()


@pytest.fixture
def made(daemon):
    sbxs = []
    yield sbxs
    for s in sbxs:
        try:
            s.kill()
        except Exception:
            pass
        s.close()


def from_template(made, name, **kw):
    kw.setdefault("timeout", 600)
    s = Sandbox.create(template=name, daemon=URL, **kw)
    made.append(s)
    return s


@pytest.fixture
def built(templates):
    """A small template: two recipe commands and a session holding a 200,000-element list."""
    name = tname()
    progress = []
    info = templates.build(name, run=RECIPE_RUN, code=RECIPE_CODE, shells=2, on_progress=progress.append)
    return name, info, progress


def test_build_reports_progress_and_the_template(built, templates):
    name, info, progress = built
    stages = [p.stage for p in progress]
    assert stages[0] == "create" and "code" in stages and "snapshot" in stages, stages
    assert [p.message for p in progress if p.stage == "run"] == RECIPE_RUN, "one progress event per recipe command, naming it"
    assert (info.name, info.image, info.shells, info.alive) == (name, "base", 2, True)
    assert info.snapshot.startswith("sn-") and info.sandbox_id.startswith("sb-") and info.memory_bytes > 0
    assert templates.api.get(name).sandbox_id == info.sandbox_id
    assert name in [t.name for t in templates.api.list()]
    # Its ready shells are prepared in the background.
    wait_until(lambda: templates.api.get(name).ready_shells == 2, timeout=30, what="the template's shells")


def test_sandboxes_from_a_template_share_its_state_and_are_independent(built, made):
    name, info, _ = built
    a = from_template(made, name)
    b = from_template(made, name)
    for s in (a, b):
        si = s.info()
        assert si.nested_in == info.sandbox_id, si
        assert si.image == "base" and si.metadata.get("branchbox.from_template") == name
        assert s.files.read("/root/recipe") == "hi\n"
        expect_output(s.commands.run("cat /srv/app/conf.py"), stdout="x = 1\n")
        ex = s.run_code("len(big), json.dumps([1])")
        assert ex.error is None and ex.result == "(200000, '[1]')", ex
    # Independent of each other: session memory, files, processes, hostnames.
    assert a.run_code("big.append(-1); len(big)").result == "200001"
    assert b.run_code("len(big)").result == "200000"
    a.files.write("/root/only-a", "a")
    assert not b.files.exists("/root/only-a")
    a.commands.run("sleep 3600", background=True)
    assert "sleep" not in b.commands.run("ps -eo args").stdout
    assert a.commands.run("hostname").stdout.strip() == a.id != b.id == b.commands.run("hostname").stdout.strip()
    # A second python session is fresh (only the default one is a copy of the template's).
    sh = a.sessions.create("python")
    ex = sh.run("big")
    assert ex.error is not None and ex.error.name == "NameError"


def test_template_sandboxes_share_the_session_memory_copy_on_write(built, made):
    """A template sandbox's session is a copy-on-write copy: its private memory (host-side
    smaps of its cgroup's processes) is a fraction of a cold sandbox that ran the same code."""
    from branchbox_bench.start import sandbox_memory_mb

    name, _, _ = built
    t = from_template(made, name)
    assert t.run_code("len(big)").result == "200000"
    cold = Sandbox.create(daemon=URL, timeout=600)
    made.append(cold)
    assert cold.run_code(RECIPE_CODE + "\nlen(big)").result == "200000"
    t_private, _ = sandbox_memory_mb(t.id)
    c_private, _ = sandbox_memory_mb(cold.id)
    assert t_private is not None and c_private is not None
    assert t_private < 0.5 * c_private, "template sandbox private %.1f MiB vs cold %.1f MiB" % (t_private, c_private)


def test_create_from_template_applies_request_settings(built, made):
    name, _, _ = built
    s = from_template(made, name, env={"BB_T": "1"}, cwd="/srv/app", memory_mb=256, metadata={"k": "v"}, timeout=120)
    info = s.info()
    assert (info.memory_mb, info.cwd, info.env, info.metadata.get("k")) == (256, "/srv/app", {"BB_T": "1"}, "v")
    expect_output(s.commands.run('pwd; echo "$BB_T"'), stdout="/srv/app\n1\n")
    assert s.run_code("len(big)").result == "200000"
    # The image may be named as long as it is the template's.
    t = from_template(made, name, image="base")
    assert t.info().nested_in == s.info().nested_in


def test_template_sandbox_is_hidden_and_refuses_delete(built, raw, templates, made):
    name, info, _ = built
    s = from_template(made, name)
    listed = {i.id for i in Sandbox.list(daemon=URL)}
    assert info.sandbox_id not in listed and s.id in listed
    err = api_error(raw.delete("/v1/sandboxes/%s" % info.sandbox_id), 409, "conflict")
    assert name in err["message"] and "template rm" in err["message"]
    with pytest.raises(ConflictError):
        Sandbox.connect(info.sandbox_id, daemon=URL).kill()
    # Still usable after the refused delete.
    assert from_template(made, name).run_code("len(big)").result == "200000"


def test_template_rm(templates, made):
    name = tname()
    info = templates.build(name, run=["echo x > /root/x"], code="y = 2", shells=1)
    s = from_template(made, name)
    assert templates.api.remove(name) is True
    with pytest.raises(NotFoundError):
        templates.api.get(name)
    assert name not in [t.name for t in templates.api.list()]
    assert info.snapshot not in [s.id for s in Snapshots(daemon=URL).list()], "the template's snapshot goes with it"
    with pytest.raises(NotFoundError, match=name):
        Sandbox.create(template=name, daemon=URL)
    # A sandbox created from it keeps running (its template's init stays as a husk).
    assert s.run_code("y").result == "2"
    expect_output(s.commands.run("cat /root/x"), stdout="x\n")
    s.kill()
    assert_no_host_traces(info.sandbox_id, timeout=30)


def test_rebuilding_a_template_replaces_it(templates, made):
    name = tname()
    first = templates.build(name, run=["echo one > /root/v"], shells=0)
    second = templates.build(name, run=["echo two > /root/v"], shells=0)
    assert second.sandbox_id != first.sandbox_id and second.snapshot != first.snapshot
    assert [t.sandbox_id for t in templates.api.list() if t.name == name] == [second.sandbox_id]
    assert from_template(made, name).files.read("/root/v") == "two\n"
    snapshots = [s.id for s in Snapshots(daemon=URL).list()]
    assert first.snapshot not in snapshots and second.snapshot in snapshots, "the replaced template's snapshot went"
    assert_no_host_traces(first.sandbox_id, timeout=30)


# ----------------------------------------------------------------------------- errors


def build_events(raw, body):
    r = raw.post("/v1/templates", json=body)
    if r.status_code != 200:
        return r.status_code, r.json()
    import json

    return 200, [json.loads(line) for line in r.text.splitlines() if line.strip()]


@pytest.mark.parametrize("bad", ["a/b", ".hidden", "", "x" * 65, "sp ace"])
def test_bad_template_name_is_refused(templates, raw, bad):
    with pytest.raises(InvalidArgumentError):
        templates.api.build(bad)
    # Refused before the build stream starts: an HTTP error, not 200 and an error event.
    err = api_error(raw.post("/v1/templates", json={"name": bad}), 400, "bad_request")
    assert "template name" in err["message"], err
    assert bad not in [t.name for t in templates.api.list()]


def test_recipe_errors_are_refused_before_anything_starts(templates, raw):
    listed = {i.id for i in Sandbox.list(daemon=URL)}
    name = tname("bad")
    err = api_error(raw.post("/v1/templates", json={"name": name, "image": "no-such-image"}), 404, "not_found")
    assert "no-such-image" in err["message"], err
    with pytest.raises(NotFoundError, match="no-such-image"):
        templates.build(name, image="no-such-image")
    for bad in ({"memory_mb": 1}, {"cpu": 0}, {"pids": 1}, {"shells": 100000}, {"timeout": -1}, {"cwd": "relative"}, {"env": {"A=B": "x"}}):
        api_error(raw.post("/v1/templates", json=dict(bad, name=name)), 400, "bad_request")
    assert {i.id for i in Sandbox.list(daemon=URL)} == listed
    with pytest.raises(NotFoundError):
        templates.api.get(name)


def test_unknown_template_is_404(daemon, raw):
    with pytest.raises(NotFoundError, match="no-such-template"):
        Sandbox.create(template="no-such-template", daemon=URL)
    api_error(raw.post("/v1/sandboxes", json={"template": "no-such-template"}), 404, "not_found")
    api_error(raw.get("/v1/templates/no-such-template"), 404, "not_found")
    api_error(raw.delete("/v1/templates/no-such-template"), 404, "not_found")
    with Templates(daemon=URL) as t, pytest.raises(NotFoundError):
        t.remove("no-such-template")


def test_failing_recipe_command_names_it_and_leaves_nothing(templates, raw):
    baseline = cgroup_children()
    listed = {i.id for i in Sandbox.list(daemon=URL)}
    name = tname("fail")
    cmd = "echo partial-output; exit 3"
    with pytest.raises(InvalidArgumentError) as ei:
        templates.build(name, run=["echo ok", cmd, "echo never"])
    msg = str(ei.value)
    assert cmd in msg and "partial-output" in msg, msg
    assert "exited with status 3" in msg and "Some(" not in msg, msg
    with pytest.raises(NotFoundError):
        templates.api.get(name)
    status, events = build_events(raw, {"name": name, "run": ["false"]})
    assert status == 200 and events[-1]["type"] == "error" and '"false"' in events[-1]["error"]["message"], events
    assert "exited with status 1" in events[-1]["error"]["message"], events
    with pytest.raises(InvalidArgumentError, match="was killed by signal 9"):
        templates.build(name, run=["kill -9 $$"])
    assert [e["message"] for e in events if e.get("stage") == "run"] == ["false"]
    # The build sandbox is gone: nothing listed, no cgroup left.
    assert {i.id for i in Sandbox.list(daemon=URL)} == listed
    wait_until(lambda: cgroup_children() == baseline, timeout=15, what="the failed build's sandbox to go")


def test_failing_recipe_code_is_reported(templates):
    with pytest.raises(InvalidArgumentError, match="ValueError") as ei:
        templates.build(tname("fail"), code="raise ValueError('recipe-code-broke')")
    assert "recipe-code-broke" in str(ei.value)


def test_template_with_another_image_is_400(built, raw, made):
    name, _, _ = built
    with pytest.raises(InvalidArgumentError, match="built on image"):
        Sandbox.create("no-such-image", template=name, daemon=URL)
    err = api_error(raw.post("/v1/sandboxes", json={"template": name, "image": "other"}), 400, "bad_request")
    assert "base" in err["message"]


def test_unknown_recipe_field_is_400(daemon, raw):
    api_error(raw.post("/v1/templates", json={"name": "x", "bogus": 1}), 400)


# ----------------------------------------------------------------------------- fork(isolated=True)


def test_fork_isolated_children_are_independent_with_fresh_sessions(made):
    parent = Sandbox.create(daemon=URL, timeout=600)
    made.append(parent)
    parent.run_code("secret = 41")
    parent.files.write("/root/f", "from parent")
    kids = parent.fork(2, isolated=True)
    made.extend(kids)
    for k in kids:
        info = k.info()
        assert info.nested_in is None, info
        assert k.files.read("/root/f") == "from parent"
        ex = k.run_code("secret")
        assert ex.error is not None and ex.error.name == "NameError", "isolated children start fresh sessions"
    # Neither sees the other's processes, nor the parent's.
    kids[0].commands.run("sleep 3601", background=True)
    assert "3601" not in kids[1].commands.run("ps -eo args").stdout
    assert "3601" not in parent.commands.run("ps -eo args").stdout
    # A killed parent does not take isolated children along.
    parent.kill()
    expect_output(kids[0].commands.run("echo alive"), stdout="alive\n")
