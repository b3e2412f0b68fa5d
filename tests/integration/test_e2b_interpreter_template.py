"""The `code-interpreter-v1` template (templates/code-interpreter-v1.toml) through the official
`e2b-code-interpreter` SDK: built from the repo's recipe with branchbox's template API, it is
what the SDK's default `Sandbox.create()` gets (the base image before that); matplotlib figures
come back as PNG results with their data as E2B's charts (line, bar, pie, scatter, box and
whisker, superchart); javascript and typescript contexts run on its node; numpy, imported by
the template's warm python session, works in the sandboxes forked from it and in their forks (a
raw-clone copy of a session has no BLAS worker threads: the session keeps numeric thread pools
at one thread).

The template is removed at the end of the module, so the E2B endpoint serves
`code-interpreter-v1` from the base image again for whatever runs next."""
import base64
import struct
import uuid
from pathlib import Path

import pytest

from branchbox import NotFoundError, Sandbox as BBSandbox, Templates
from branchbox_cli.app import load_recipe
from e2b_code_interpreter import Sandbox as CISandbox
from e2b_code_interpreter.charts import (
    BarChart,
    BoxAndWhiskerChart,
    ChartType,
    LineChart,
    PieChart,
    ScaleType,
    ScatterChart,
    SuperChart,
)

from helpers import URL, e2b_sdk_env

TAG = "e2bci-" + uuid.uuid4().hex[:10]
NAME = "code-interpreter-v1"
RECIPE = Path(__file__).resolve().parents[2] / "templates" / "code-interpreter-v1.toml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Large enough that a multi-threaded OpenBLAS would hand it to its worker threads.
MATMUL = "import numpy as np\nint((np.ones((400, 400)) @ np.ones((400, 400)))[0, 0])"


@pytest.fixture(scope="module")
def e2b(daemon):
    """The SDK pointed at the daemon; yields the list of sandboxes made (killed at the end)."""
    with e2b_sdk_env(daemon):
        made = []
        try:
            yield made
        finally:
            for s in made:
                try:
                    s.kill()
                except Exception:
                    pass


@pytest.fixture(scope="module")
def built(e2b):
    """The template, built from the repo's recipe (as its docs say: `branchbox template build
    code-interpreter-v1 -f templates/code-interpreter-v1.toml`), removed at the end."""
    recipe = load_recipe(str(RECIPE))
    with Templates(daemon=URL) as templates:
        try:
            templates.remove(NAME)  # a leftover of an interrupted run
        except NotFoundError:
            pass
        before = CISandbox.create(timeout=120, metadata={"suite": TAG})
        e2b.append(before)
        # Not built yet: the base image, without matplotlib.
        e = before.run_code("import importlib.util\nimportlib.util.find_spec('matplotlib') is None")
        assert e.error is None and e.text == "True", e
        info = templates.build(NAME, **recipe)
        assert info.name == NAME and info.image == "base"
        try:
            yield info
        finally:
            templates.remove(NAME)


def create(e2b, **kw):
    s = CISandbox.create(timeout=300, metadata={"suite": TAG}, **kw)
    e2b.append(s)
    return s


def png_size(data):
    assert data[:8] == PNG_MAGIC, data[:16]
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    return width, height


def test_default_create_is_a_fork_of_the_template_with_numpy_loaded(e2b, built):
    s = create(e2b)
    assert s.get_info().template_id == NAME
    # The default context is the template's session: numpy is there before any import.
    e = s.run_code("import sys\nsorted(m for m in ('numpy', 'matplotlib.pyplot') if m in sys.modules)")
    assert e.error is None and e.text == "['matplotlib.pyplot', 'numpy']", e
    e = s.run_code(MATMUL, timeout=60)
    assert e.error is None and e.text == "400", e
    e = s.run_code("import os\nos.environ['OPENBLAS_NUM_THREADS']")
    assert e.text == "'1'"
    # A sandbox made from it is the recipe's files too, and still E2B's user.
    assert s.commands.run("whoami").stdout == "user\n"
    assert "python3-matplotlib" in s.commands.run("dpkg -l python3-matplotlib").stdout


def test_matplotlib_figures_come_back_as_png_and_chart(e2b, built):
    s = create(e2b)
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(4, 3), dpi=100)\n"
        "ax.plot([1, 2, 3], [1, 4, 9])\n"
        "ax.set_title('squares')\n"
        "plt.show()\n"
    )
    e = s.run_code(code, timeout=60)
    assert e.error is None, e.error
    (fig,) = [r for r in e.results if r.png]
    w, h = png_size(base64.b64decode(fig.png))
    assert 100 < w <= 400 and 100 < h <= 300, (w, h)  # bbox_inches="tight" trims the margins
    # The figure's data, as E2B extracts it.
    chart = fig.chart
    assert isinstance(chart, LineChart) and chart.type == ChartType.LINE and chart.title == "squares", fig.formats()
    assert [el.points for el in chart.elements] == [[(1.0, 1.0), (2.0, 4.0), (3.0, 9.0)]]
    assert "chart" in fig.formats() and chart.x_scale == ScaleType.LINEAR
    # Shown figures are closed: the next run has none left to show.
    assert [r for r in s.run_code("1").results if r.png] == []
    bars = s.run_code(
        "fig, ax = plt.subplots()\nax.bar(['a', 'b'], [3, 5], label='n')\nax.set_ylabel('count')\nplt.show()"
    )
    (fig,) = [r for r in bars.results if r.png]
    assert isinstance(fig.chart, BarChart) and fig.chart.y_label == "count"
    assert [(b.label, b.group, b.value) for b in fig.chart.elements] == [("a", "n", 3.0), ("b", "n", 5.0)]
    two = s.run_code(
        "fig, (a, b) = plt.subplots(1, 2)\na.pie([1, 3], labels=['one', 'three'])\n"
        "b.scatter(['x', 'y'], [1, 2])\nfig.suptitle('both')\nplt.show()"
    )
    (fig,) = [r for r in two.results if r.png]
    assert isinstance(fig.chart, SuperChart) and fig.chart.title == "both"
    pie, dots = fig.chart.elements
    assert isinstance(pie, PieChart) and [(p.label, p.angle) for p in pie.elements] == [("one", 90.0), ("three", 270.0)]
    assert isinstance(dots, ScatterChart) and dots.x_scale == ScaleType.CATEGORICAL
    assert dots.elements[0].points == [("x", 1.0), ("y", 2.0)]
    box = s.run_code("fig, ax = plt.subplots()\nax.boxplot([[1, 2, 3, 4, 10], [2, 3, 4]], labels=['a', 'b'])\nplt.show()")
    (fig,) = [r for r in box.results if r.png]
    assert isinstance(fig.chart, BoxAndWhiskerChart)
    got = [(b.label, b.min, b.first_quartile, b.median, b.third_quartile, b.max, b.outliers) for b in fig.chart.elements]
    assert got == [("a", 1.0, 2.0, 3.0, 4.0, 4.0, [10.0]), ("b", 2.0, 2.5, 3.0, 3.5, 4.0, [])]


def test_forks_of_a_numpy_session_still_compute(e2b, built):
    s = create(e2b)
    e = s.run_code("import numpy as np\na = np.arange(6.0).reshape(2, 3)\nint((a @ a.T).sum())")
    assert e.error is None and e.text == "83", e
    bb = BBSandbox.connect("sb-" + s.sandbox_id[2:], daemon=URL)
    try:
        kids = bb.fork(2)
        try:
            for k in kids:
                r = k.run_code(MATMUL, timeout=60)
                assert r.error is None and r.result == "400", r
                assert k.run_code("a.shape").result == "(2, 3)"
        finally:
            for k in kids:
                k.kill()
                k.close()
    finally:
        bb.close()
    e = s.run_code(MATMUL, timeout=60)
    assert e.error is None and e.text == "400"


def test_javascript_contexts(e2b, built):
    s = create(e2b)
    e = s.run_code("const base = 40; console.log('hi'); base + 2", language="javascript")
    assert e.error is None and e.text == "42" and e.logs.stdout == ["hi\n"], e
    # The default javascript context keeps its scope; "js" names the same language.
    assert s.run_code("base * 2", language="js").text == "80"
    err = s.run_code("null.x", language="javascript").error
    assert err.name == "TypeError" and "reading 'x'" in err.value
    ctx = s.create_code_context(language="javascript")
    assert ctx.language == "javascript"
    assert s.run_code("typeof base", context=ctx).text == "'undefined'"  # a context of its own
    assert s.run_code("let mine = [1, 2]; mine.length", context=ctx).text == "2"
    assert ctx.id in {c.id for c in s.list_code_contexts()}
    e = s.run_code("await new Promise((r) => setTimeout(() => r('later'), 10))", context=ctx)
    assert e.text == "'later'"
    assert s.run_code("class Box { constructor(v) { this.v = v } get() { return this.v } }\nconst box = new Box(mine)", context=ctx).error is None
    # A fork's copy of a javascript context has its global scope (node's heap is not copied:
    # its names are made again, see docs/E2B.md); the parent's contexts keep their state.
    bb = BBSandbox.connect("sb-" + s.sandbox_id[2:], daemon=URL)
    try:
        (kid,) = bb.fork(1)
        try:
            child = CISandbox.connect("sb" + kid.id[3:])
            assert ctx.id in {c.id for c in child.list_code_contexts()}
            r = child.run_code("mine.push(3); [mine.length, box.get() === mine]", context=ctx)
            assert r.text == "[ 3, true ]" and not r.logs.stderr, r.logs.stderr
            assert child.run_code("base", language="javascript").text == "40"
        finally:
            kid.kill()
            kid.close()
    finally:
        bb.close()
    assert s.run_code("mine.length", context=ctx).text == "2"  # the copy's push is its own
    # A rollback brings the scope back as it was at the checkpoint (a copy of its template).
    bb = BBSandbox.connect("sb-" + s.sandbox_id[2:], daemon=URL)
    try:
        snap = bb.checkpoint()
        assert s.run_code("mine.push(9); var later = 1; mine.length", context=ctx).text == "3"
        bb.rollback(snap)
        r = s.run_code("[mine.length, typeof later, box.get() === mine]", context=ctx)
        assert r.text == "[ 2, 'undefined', true ]" and not r.logs.stderr, r
    finally:
        bb.close()
    assert s.run_code("base", language="javascript").text == "40"
    # Restart: the same context, a fresh node; remove: gone.
    s.restart_code_context(ctx)
    assert s.run_code("typeof mine", context=ctx).text == "'undefined'"
    s.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in s.list_code_contexts()}


def test_typescript_contexts(e2b, built):
    """E2B's documented example (`language="ts"`: types, top-level await, ESM-style imports),
    then what a notebook expects: declarations and imports kept for the next run."""
    s = create(e2b)
    e = s.run_code("import path from 'path'\nconst url: string = path.join('a', 'b')\nconst value = await Promise.resolve(42)\nconsole.log(value)\nurl", language="ts")
    assert e.error is None and e.text == "'a/b'" and e.logs.stdout == ["42\n"], e
    assert s.run_code("interface P { n: number }\nconst p: P = { n: value }\npath.basename('/x/y.ts') + p.n", language="typescript").text == "'y.ts42'"
    err = s.run_code("const broken: = 1", language="ts").error
    assert err.name == "SyntaxError" and "Type expected" in err.value, err
    ctx = s.create_code_context(language="typescript")
    assert ctx.language == "typescript" and ctx.id in {c.id for c in s.list_code_contexts()}
    assert s.run_code("typeof value", context=ctx).text == "'undefined'"  # a context of its own
    assert s.run_code("enum E { A = 3 }\nE.A", context=ctx).text == "3"
    # Its copy in a fork has its global scope, as javascript's does.
    bb = BBSandbox.connect("sb-" + s.sandbox_id[2:], daemon=URL)
    try:
        (kid,) = bb.fork(1)
        try:
            r = CISandbox.connect("sb" + kid.id[3:]).run_code("E.A + 1", context=ctx)
            assert r.text == "4" and not r.logs.stderr, r
        finally:
            kid.kill()
            kid.close()
    finally:
        bb.close()
    assert s.run_code("E.A * 2", context=ctx).text == "6"

