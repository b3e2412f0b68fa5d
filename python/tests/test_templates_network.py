"""A template's network: ``Templates.build(network=..., allow=...)`` (sync, async, module
shortcut), ``branchbox template build --network/--allow`` (flags and TOML recipe), and
``Sandbox.create(template=...)`` leaving the network to the template unless one is given."""

from __future__ import annotations

import inspect

import httpx
import pytest
from typer.testing import CliRunner

import branchbox
from branchbox import AsyncSandbox, AsyncTemplates, InvalidArgumentError, Sandbox, Templates, _core
from conftest import FakeDaemon, invoke, ndjson, one_red_line
from test_pool_templates_sdk import BUILD_EVENTS

ENTRIES = ["pypi.org", "*.pythonhosted.org:443"]


def _stream() -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/x-ndjson"}, stream=ndjson(*BUILD_EVENTS))


# ----------------------------------------------------------------------------- SDK: build


def test_recipe_network_fields() -> None:
    assert "network" not in _core.template_recipe("t") and "allow" not in _core.template_recipe("t")
    assert _core.template_recipe("t", network="open") == {"name": "t", "network": "open"}
    assert _core.template_recipe("t", network="allowlist", allow=ENTRIES) == {
        "name": "t", "network": "allowlist", "allow": ENTRIES,
    }
    assert _core.template_recipe("t", allow=tuple(ENTRIES)) == {"name": "t", "allow": ENTRIES}, "allow alone"
    assert _core.template_recipe("t", allow=[]) == {"name": "t", "allow": []}, "an empty list is sent as given"
    assert {"network", "allow"} <= set(_core.RECIPE_KEYS)


def test_build_with_and_without_network(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/templates", _stream())
    with Templates(transport=fake.transport()) as templates:
        templates.build("py", run=["pip install requests"], network="allowlist", allow=ENTRIES)
        assert fake.body() == {
            "name": "py", "run": ["pip install requests"], "network": "allowlist", "allow": ENTRIES,
        }
        templates.build("py", network="open")
        assert fake.body() == {"name": "py", "network": "open"}
        templates.build("py", network="none")
        assert fake.body() == {"name": "py", "network": "none"}, "an explicit none is sent"
        templates.build("py", run="true")
        assert fake.body() == {"name": "py", "run": ["true"]}, "no network: nothing sent (daemon default)"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"network": "wide"},
        {"network": "NONE"},
        {"network": ""},
        {"network": 1},
        {"allow": "pypi.org"},
        {"allow": b"pypi.org"},
        {"allow": {"pypi.org"}},
        {"allow": ["pypi.org", 443]},
        {"network": "allowlist", "allow": "pypi.org"},
    ],
)
def test_build_refuses_bad_network(fake: FakeDaemon, kwargs) -> None:
    with Templates(transport=fake.transport()) as templates:
        with pytest.raises(InvalidArgumentError) as ei:
            templates.build("py", **kwargs)
    assert isinstance(ei.value, ValueError), "the same error as Sandbox.create's"
    assert fake.requests == [], "refused before any request"


async def test_async_build_network(fake: FakeDaemon) -> None:
    fake.on("POST", "/v1/templates", _stream())
    async with AsyncTemplates(transport=fake.transport()) as templates:
        await templates.build("py", network="allowlist", allow=ENTRIES)
        assert fake.body() == {"name": "py", "network": "allowlist", "allow": ENTRIES}
        await templates.build("py")
        assert fake.body() == {"name": "py"}
        n = len(fake.requests)
        with pytest.raises(InvalidArgumentError):
            await templates.build("py", network="bridge")
        with pytest.raises(InvalidArgumentError):
            await templates.build("py", allow="pypi.org")
        assert len(fake.requests) == n


def test_module_build_network(daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/templates", _stream())
    branchbox.templates.build("py", network="open", allow=["10.0.0.0/8:443"])
    assert daemon.body() == {"name": "py", "network": "open", "allow": ["10.0.0.0/8:443"]}


def test_build_signatures() -> None:
    for fn in (Templates.build, AsyncTemplates.build, branchbox.templates.build):
        params = inspect.signature(fn).parameters
        for name in ("network", "allow"):
            assert params[name].default is None and params[name].kind is inspect.Parameter.KEYWORD_ONLY, (fn, name)


# ----------------------------------------------------------------------------- SDK: create(template=)


def test_create_from_template_leaves_network_to_it(fake: FakeDaemon) -> None:
    Sandbox.create(template="py", transport=fake.transport())
    assert fake.body() == {"template": "py", "timeout": 300}, "no network sent: the template's applies"
    Sandbox.create(template="py", allow=["a.test"], transport=fake.transport())
    assert fake.body() == {"template": "py", "timeout": 300, "allow": ["a.test"]}, "entries alone keep its mode"
    Sandbox.create(template="py", network="none", transport=fake.transport())
    assert fake.body() == {"template": "py", "timeout": 300, "network": "none"}, "an explicit none is sent"
    Sandbox.create(template="py", network="open", allow=[], transport=fake.transport())
    assert fake.body() == {"template": "py", "timeout": 300, "network": "open", "allow": []}
    Sandbox.create(transport=fake.transport())
    assert fake.body() == {"image": "base", "timeout": 300, "network": "none"}, "without a template: none"
    n = len(fake.requests)
    with pytest.raises(InvalidArgumentError):
        Sandbox.create(template="py", network="wide", transport=fake.transport())
    assert len(fake.requests) == n


async def test_async_create_from_template_leaves_network_to_it(fake: FakeDaemon) -> None:
    s = await AsyncSandbox.create(template="py", transport=fake.transport())
    assert fake.body() == {"template": "py", "timeout": 300}
    await s.close()


# ----------------------------------------------------------------------------- CLI


def test_cli_build_network_flags(runner: CliRunner, daemon: FakeDaemon) -> None:
    daemon.on("POST", "/v1/templates", _stream())
    r = invoke(
        runner, "template", "build", "py", "--run", "pip install requests",
        "--network", "allowlist", "--allow", ENTRIES[0], "--allow", ENTRIES[1],
    )
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"name": "py", "run": ["pip install requests"], "network": "allowlist", "allow": ENTRIES}
    r = invoke(runner, "template", "build", "py", "--network", "open")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"name": "py", "network": "open"}
    r = invoke(runner, "template", "build", "py")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"name": "py"}, "no flags: nothing sent"


@pytest.mark.parametrize("bad", ["wide", "NONE", ""])
def test_cli_build_bad_network_is_a_usage_error(runner: CliRunner, daemon: FakeDaemon, bad: str) -> None:
    r = invoke(runner, "template", "build", "py", "--network", bad)
    assert r.exit_code == 2 and "--network" in r.output + r.stderr
    assert daemon.requests == []


def test_cli_build_recipe_file_network(runner: CliRunner, daemon: FakeDaemon, tmp_path) -> None:
    daemon.on("POST", "/v1/templates", _stream())
    recipe = tmp_path / "r.toml"
    recipe.write_text('network = "allowlist"\nallow = ["pypi.org"]\n')
    r = invoke(runner, "template", "build", "py", "-f", str(recipe))
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"name": "py", "network": "allowlist", "allow": ["pypi.org"]}
    # Flags replace the file's mode and entries.
    r = invoke(runner, "template", "build", "py", "-f", str(recipe), "--network", "open", "--allow", "a.test")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"name": "py", "network": "open", "allow": ["a.test"]}


@pytest.mark.parametrize(
    "content, needle",
    [
        ("network = 1\n", "network has the wrong type"),
        ('allow = "pypi.org"\n', "allow has the wrong type"),
        ('network = "wide"\n', "network must be"),
        ("allow = [1]\n", "allow entry must be a string"),
    ],
)
def test_cli_build_bad_recipe_network(runner: CliRunner, daemon: FakeDaemon, tmp_path, content: str, needle: str) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(content)
    assert needle in one_red_line(invoke(runner, "template", "build", "py", "-f", str(recipe)))
    assert daemon.requests == []


def test_cli_create_from_template_sends_no_network(runner: CliRunner, daemon: FakeDaemon) -> None:
    r = invoke(runner, "sandbox", "create", "--template", "py")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"template": "py", "timeout": 300.0}
    r = invoke(runner, "sandbox", "create", "--template", "py", "--network", "none")
    assert r.exit_code == 0, r.stderr
    assert daemon.body() == {"template": "py", "timeout": 300.0, "network": "none"}
