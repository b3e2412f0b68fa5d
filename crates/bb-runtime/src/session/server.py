"""branchbox in-sandbox session server (stdlib only, Python 3.9+).

The daemon runs this file inside a sandbox as::

    python3 -I -S -c "<source of this file>" python|shell|javascript|typescript

with fd 3 a connected AF_UNIX SOCK_STREAM socket (the *channel*).  Nothing from the
``branchbox`` package is imported: this file must stay self-contained.

Wire protocol: one UTF-8 JSON object per line in each direction, one response per
request, in order.  A request's ``"id"`` (any JSON value) is echoed in its response.

    {"op":"ping"}              -> {"ok":true,"pid":N}
    {"op":"run","code":"..."}  -> python: {"stdout":s,"stderr":s,"result":s|null,
                                           "error":null|{"name","value","traceback"}}
                                  shell:  {"stdout":s,"stderr":s,"exit_code":n}
                                  javascript: as python (result: util.inspect of the
                                  last expression's value, a promise awaited)
                                  typescript: as javascript, each run's code compiled
                                  first (types stripped, imports made `var`s: see
                                  _NODE_RUNNER)
                                  (+ "stdout_truncated"/"stderr_truncated": true when a
                                  stream exceeded 16 MiB or 24 MiB once JSON-escaped;
                                  exit_code is 128+N for signal N)
    {"op":"fork"} sent with exactly one fd (SCM_RIGHTS, same sendmsg)
                               -> old channel (parent): {"ok":true,"child":PID}
                                  new channel (child):  {"ok":true,"pid":PID}
    {"op":"fork","role":"template"} + one fd  (checkpoint)
                               -> old channel (parent, stays the live session):
                                      {"ok":true,"child":PID}
                                  new channel (child, the snapshot's template):
                                      {"ok":true,"pid":PID,"role":"template"}
    {"op":"fork","role":"restore"} + one fd   (rollback / fork from a template)
                               -> old channel (parent, stays a template):
                                      {"ok":true,"child":PID}
                                  new channel (child, a new live session):
                                      {"ok":true,"pid":PID,"role":"restore"}
                                  the child's next non-fork answer carries "reopened":N
    {"op":"rechannel"}         -> {"ok":true,"peer_fd":N}, then the channel is one end of a
                                  socket pair made here whose other end is fd N of this
                                  process (before a process dump: see op_rechannel); fd N is
                                  closed at the next request
    bad JSON / not an object / unknown op / missing field / unknown fork role
                               -> {"error":{"name":"ProtocolError","value":"..."}}
    internal failure (e.g. memfd_create denied)
                               -> {"error":{"name":...,"value":...,"traceback":...}}

EOF on the channel exits 0.  fds received with any other op are closed (with a rejected
fork too).

Checkpoint and rollback.  A *template* is a frozen copy of a session: it idles in
recvmsg() on its own channel and the daemon forks it with role "restore" only (it
would serve ping/run like any session, but code run in it changes what later restores
get).

* role "template", parent: before forking it records its cwd and every open fd except
  0-3 (and the new channel) that is a regular file of the root filesystem or of a volume
  (same st_dev as "/" or as an overlay mount, path not deleted): path, open flags (/proc/self/fdinfo), offset,
  close-on-exec.  It answers right after the fork: the daemon may swap the root
  filesystem before the child ran at all.  The parent's cwd, then a directory of the old
  mount, is re-resolved by path - chdir() to the recorded cwd, "/" if that fails -
  before the next request that is not a fork.  (The shell kind also passes its own cwd
  string to every bash it starts.)
* role "template" or "restore": the child gets a process group of its own, set by the
  parent before it answers and by the child (killing the live session's process group,
  or the template's, never kills a copy, even one that has not run yet).
* role "template", child: keeps that record, prctl(PR_SET_DUMPABLE, 0) so sandbox code
  without CAP_SYS_PTRACE cannot read or alter its memory, then answers.  A template
  forked with role "template" gives a copy of itself (same record).
* role "restore", child: prctl(PR_SET_DUMPABLE, 1), and answers at once (the
  daemon may swap the root filesystem before or after that).  Before its next request it does the
  rest: chdir() to the recorded cwd by path ("/" if that fails); every recorded fd is
  reopened by path with its flags
  (minus O_CREAT/O_TRUNC/O_EXCL/O_NOCTTY), seeked to its offset and dup2()ed over its
  old number with its close-on-exec flag, so the new session uses the files of the
  current root filesystem.  "reopened" (in that next answer) counts them; an fd whose
  path no longer opens
  (or is no longer a regular file) keeps the old open file.  fds that shared one open
  file (dup) get one open file each.  The template itself is unchanged and can be
  forked again.  On a session that is not a template, "restore" is a plain fork in a
  process group of its own ("reopened":0).

SIGINT (python kind): a KeyboardInterrupt in the user's code, as in an interactive
python, whatever disposition the server inherited.  One that arrives after the request
was read but before the code starts, or after the code ended but before the answer is
written, is that run's error {"name":"KeyboardInterrupt","value":"","traceback":...}
(result null; the output so far is kept).  One that arrives while the server idles
between requests is dropped.  The shell kind's server ignores SIGINT: it reaches a
command through the session's process group.

The javascript and typescript kinds run code in a node process they start (see
JavaScriptKernel): its pipes are the only fds beyond 0-3 open between requests, closed in
every fork child, which starts its own node and makes the original's global scope again in it
from what node listed before the fork.

Process model: single-threaded, fd 0 is /dev/null, only fds 0-3 are open between
requests (memfds live for one run), and the server idles in recvmsg() - a quiescent
point where it can fork.  A parent that forked reaps its fork children from a SIGCHLD
handler that waits for those pids only.  Output is captured at the fd level into memfds;
nothing is written to the sandbox filesystem.  The python kind re-enables site-packages
(``-S`` skipped them) and puts ``''`` and ``$PYTHONPATH`` on ``sys.path`` like an
interactive interpreter.
"""

import array
import ast
import base64
import builtins
import gc
import fcntl
import io
import json
import linecache
import os
import re
import signal
import socket
import stat
import sys
import time
import traceback
import types

CHANNEL_FD = 3
MAX_OUTPUT = 16 * 1024 * 1024  # bytes read back per stream and run
MAX_ENCODED = 24 * 1024 * 1024  # bytes of JSON per stream in a response line
MAX_RESULT = 4 * 1024 * 1024  # bytes of JSON for a result repr / an error text
MAX_FDS = 16  # ancillary fds accepted per recvmsg
_RECV_SIZE = 256 * 1024
_MFD_CLOEXEC = getattr(os, "MFD_CLOEXEC", 1)
# Thread-pool sizes of OpenBLAS, OpenMP, MKL, BLIS, Accelerate and numexpr (python sessions).
_THREAD_POOL_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


# --------------------------------------------------------------------------- channel


class Channel(object):
    """Newline-delimited JSON over a stream socket, collecting SCM_RIGHTS fds."""

    def __init__(self, fd):
        self.sock = socket.socket(fileno=fd)
        self.buf = bytearray()
        self.scanned = 0
        self.fds = []

    def read_request(self):
        """Return (line bytes, fds received with it) or (None, []) at EOF."""
        while True:
            i = self.buf.find(b"\n", self.scanned)
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 1]
                self.scanned = 0
                fds, self.fds = self.fds, []
                return line, fds
            self.scanned = len(self.buf)
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(
                    _RECV_SIZE,
                    socket.CMSG_SPACE(MAX_FDS * 4),
                    getattr(socket, "MSG_CMSG_CLOEXEC", 0),
                )
            except KeyboardInterrupt:  # only from a SIGINT handler user code installed
                continue
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    arr = array.array("i")
                    arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
                    self.fds.extend(arr)
            if not data:
                return None, []
            self.buf += data

    @staticmethod
    def encode(obj):
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8", "replace") + b"\n"

    def write(self, data):
        self.sock.sendall(data)

    def close(self):
        self.sock.close()


# --------------------------------------------------------------------------- helpers


def _protocol_error(message):
    return {"error": {"name": "ProtocolError", "value": message}}


def _close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _memfd(name):
    return os.memfd_create(name, _MFD_CLOEXEC)


def _output_memfds(fds):
    """A run's stdout and stderr memfds (the daemon finds them by name), appended to ``fds``."""
    for name in ("bb-stdout", "bb-stderr"):
        fds.append(_memfd(name))
    return fds[-2], fds[-1]


def _read_memfd(fd, limit=MAX_OUTPUT):
    """Read a memfd from its start; returns (text, truncated)."""
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    total = 0
    while total < limit:
        chunk = os.read(fd, min(1 << 20, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    truncated = total >= limit and bool(os.read(fd, 1))
    return b"".join(chunks).decode("utf-8", "replace"), truncated


def _fit(text, truncated, limit=None):
    """Keep a string's JSON encoding under ``limit`` bytes (the daemon bounds lines)."""
    limit = limit or MAX_ENCODED
    if len(text) * 6 <= limit:  # no character encodes to more than 6 bytes
        return text, truncated
    size = len(json.dumps(text, ensure_ascii=False).encode("utf-8"))
    while size > limit:
        text = text[: int(len(text) * limit / size * 0.95)]
        size = len(json.dumps(text, ensure_ascii=False).encode("utf-8"))
        truncated = True
    return text, truncated


def _capture_result(out_fd, err_fd):
    stdout, out_trunc = _fit(*_read_memfd(out_fd))
    stderr, err_trunc = _fit(*_read_memfd(err_fd))
    res = {"stdout": stdout, "stderr": stderr}
    if out_trunc:
        res["stdout_truncated"] = True
    if err_trunc:
        res["stderr_truncated"] = True
    return res


def _ensure_std_fds():
    """fd 0 is /dev/null (user code must never block on stdin); 1 and 2 must exist."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(null, fd)
    if null > 2:
        os.close(null)


# --------------------------------------------------------------------------- interrupts


class Interrupts(object):
    """The server's SIGINT handler: a KeyboardInterrupt only where the user's code runs.

    Python runs a signal handler between two bytecodes of whatever the main thread
    executes, so the default handler raises KeyboardInterrupt at any point of the server
    too: after the user's code returned (the answer then lost its output, fds 1 and 2
    could stay redirected), while it answers or idles (the exception ended the server).
    Here the handler raises only while ``user`` is set *and* the interrupted frame is not
    one of this file's: ``user`` is set and cleared by the server's own frames, and a
    signal handled there is only counted, so the flag's two stores need no protection.
    A counted SIGINT becomes the run's error before the answer is written
    (:meth:`Server.serve`).  The handler writes ``received`` and the server only
    ``seen``, so no count is lost whichever bytecode the handler runs after.

    A handler the user's code installs replaces this one for the rest of the session,
    as in plain python.
    """

    def __init__(self):
        self.user = False  # the python kind's user code may be running
        self.received = 0  # SIGINTs counted by the handler
        self.seen = 0  # ... of which the server has accounted for
        self.own = globals()  # this file's frames
        # Installed whatever the inherited disposition: a daemon started in the background
        # of a non-interactive shell would hand SIG_IGN down to every session.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, _signum, frame):
        if self.user and frame is not None and frame.f_globals is not self.own:
            raise KeyboardInterrupt
        self.received += 1

    def take(self):
        """True once for any SIGINT counted since the last take() or forget()."""
        received = self.received
        if received == self.seen:
            return False
        self.seen = received
        return True

    def forget(self):
        """Drop what came while the server idled (called once a request was read)."""
        self.seen = self.received


# --------------------------------------------------------------------------- python kind


class PythonKernel(object):
    """Runs code in one persistent ``__main__`` namespace."""

    def __init__(self, interrupts):
        self.interrupts = interrupts
        self._setup_paths()
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        # The server's own functions keep their globals; user code gets a clean __main__
        # (pickle and multiprocessing resolve user classes through sys.modules).
        sys.modules["__main__"] = main
        self.globals = main.__dict__
        self.counter = 0
        sys.argv = [""]
        # Rich outputs of the current run: display() calls, open matplotlib figures, then the
        # last expression's representations (answered as "displays").
        self.displays = []
        self.main_bundle = None
        main.__dict__["display"] = self.display
        # matplotlib draws off-screen (figures are returned as PNG).
        os.environ.setdefault("MPLBACKEND", "Agg")
        # Numeric libraries start their thread pools when loaded; a session is copied by a raw
        # clone (see _fork_beside), which copies the calling thread only and runs no
        # pthread_atfork handler, so a copy of a session that had loaded numpy would wait
        # forever on workers it does not have. One thread each unless the user says otherwise.
        for name in _THREAD_POOL_ENV:
            os.environ.setdefault(name, "1")

    def display(self, *objs):
        """Show objects as rich outputs of the current run (IPython's display())."""
        for obj in objs:
            self.displays.append(_bundle(obj, _fit(_clean(repr(obj)), False, MAX_RESULT)[0]))

    def _collect_figures(self):
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        try:
            nums = plt.get_fignums()
        except Exception:
            return
        for n in nums:
            try:
                fig = plt.figure(n)
                buf = io.BytesIO()
                fig.savefig(buf, format="png", bbox_inches="tight")
                png = base64.b64encode(buf.getvalue()).decode("ascii")
                shown = {"text": _clean(repr(fig)), "png": png}
                chart = _figure_chart(fig)  # after savefig: tick labels are drawn
                if chart is not None:
                    shown["chart"] = chart
                self.displays.append(shown)
            except Exception:
                pass
        try:
            plt.close("all")
        except Exception:
            pass

    @staticmethod
    def _setup_paths():
        # -S skips site: restore site-packages so installed libraries import; -I drops
        # the cwd and PYTHONPATH: give user code what an interactive python would see.
        # (Harmless when the server is started without -I/-S.)
        if sys.flags.no_site:
            try:
                import site

                site.main()
            except Exception:
                pass
        extra = [""]
        pp = os.environ.get("PYTHONPATH")
        if pp:
            extra.extend(p for p in pp.split(os.pathsep) if p)
        sys.path[:0] = [p for p in extra if p not in sys.path]

    def run(self, code, env=None):
        """Run ``code``; ``env`` is set in ``os.environ`` for this run only."""
        saved = {k: os.environ.get(k) for k in env or ()}
        os.environ.update(env or {})
        try:
            return self._run(code)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _run(self, code):
        self.counter += 1
        filename = "<cell-%d>" % self.counter
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        out_fd = _memfd("bb-stdout")
        err_fd = _memfd("bb-stderr")
        try:
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except Exception:
                    pass
            saved_out = os.dup(1)
            saved_err = os.dup(2)
            old_stdout, old_stderr = sys.stdout, sys.stderr
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            new_stdout = _text_stream(1)
            new_stderr = _text_stream(2)
            sys.stdout, sys.stderr = new_stdout, new_stderr
            try:
                self.displays = []
                self.main_bundle = None
                result, error = self._execute(code, filename)
                self._collect_figures()
            finally:
                for f in (sys.stdout, sys.stderr, new_stdout, new_stderr):
                    try:
                        f.flush()
                    except Exception:
                        pass
                _flush_c_stdio()
                sys.stdout, sys.stderr = old_stdout, old_stderr
                os.dup2(saved_out, 1)
                os.dup2(saved_err, 2)
                os.close(saved_out)
                os.close(saved_err)
            res = _capture_result(out_fd, err_fd)
        finally:
            os.close(out_fd)
            os.close(err_fd)
        res["result"] = result
        res["error"] = error
        res["execution_count"] = self.counter
        displays, self.displays = self.displays, []
        if self.main_bundle is not None:
            displays.append(self.main_bundle)
            self.main_bundle = None
        if displays:
            res["displays"] = _fit_displays(displays)
        return res

    def _execute(self, code, filename):
        """Returns (repr of the last expression or None, error dict or None)."""
        g = self.globals
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
            body = compile(tree, filename, "exec", flags=flags, dont_inherit=True)
            expr = None
            if last is not None:
                expr = compile(last, filename, "eval", flags=flags, dont_inherit=True)
        except BaseException as exc:  # SyntaxError, ValueError (null bytes), ...
            return None, _format_error(exc, only=True)
        interrupts = self.interrupts
        try:
            interrupts.user = True
            if interrupts.take():  # came after the request was read: the code does not start
                raise KeyboardInterrupt
            if _is_coroutine_code(body) or (expr is not None and _is_coroutine_code(expr)):
                value = _run_async(body, expr, g)
            else:
                exec(body, g)
                value = eval(expr, g) if expr is not None else None
            text = None
            if value is not None:
                g["_"] = value
                text = _fit(_clean(repr(value)), False, MAX_RESULT)[0]
                # Its text is the answer's "result": the bundle only carries what more it has.
                rich = _bundle(value, None)
                if rich:
                    self.main_bundle = dict(rich, is_main_result=True)
            interrupts.user = False
        except BaseException as exc:  # SystemExit / KeyboardInterrupt must not kill us
            interrupts.user = False
            return None, _format_error(exc)
        return text, None


_MIME = (
    ("html", "_repr_html_"),
    ("markdown", "_repr_markdown_"),
    ("svg", "_repr_svg_"),
    ("png", "_repr_png_"),
    ("jpeg", "_repr_jpeg_"),
    ("pdf", "_repr_pdf_"),
    ("latex", "_repr_latex_"),
    ("json", "_repr_json_"),
    ("javascript", "_repr_javascript_"),
)
MAX_DISPLAYS = 16 * 1024 * 1024  # bytes of rich outputs per run (beyond: text only)


def _bundle(value, text):
    """The representations of a value, as IPython's display formatter gathers them (with
    ``text`` when given)."""
    out = {} if text is None else {"text": text}
    if isinstance(value, type):  # a class: its _repr_*_ are unbound functions
        return out
    for key, name in _MIME:
        try:
            f = getattr(value, name, None)
            if not callable(f):
                continue
            r = f()
        except Exception:
            continue
        if isinstance(r, tuple) and r:
            r = r[0]
        if isinstance(r, bytes):
            r = base64.b64encode(r).decode("ascii")
        if key == "json":
            if isinstance(r, (dict, list)):
                out[key] = r
        elif isinstance(r, str):
            out[key] = _clean(r)
    return out


# ----------------------------------------------------------------------------- charts


def _figure_chart(fig):
    """The data of a matplotlib figure as E2B's code interpreter gives it (a result's ``chart``,
    read by ``e2b_code_interpreter.charts``): a line, scatter, bar, pie or box-and-whisker chart
    per axes, a ``superchart`` of them for a figure of several axes; None when no axes is one of
    those."""
    try:
        axes = [ax for ax in fig.get_axes() if ax.get_visible()]
        charts = [c for c in (_axes_chart(ax) for ax in axes) if c is not None]
    except Exception:
        return None
    if not charts:
        return None
    if len(axes) == 1:
        return charts[0]
    title = getattr(fig, "_suptitle", None)
    return {"type": "superchart", "title": title.get_text() if title is not None else "", "elements": charts}


def _num(v):
    """A JSON-safe value of a plotted coordinate: str as is, numbers as float (None if not finite)."""
    if isinstance(v, str):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if f == f and f not in (float("inf"), float("-inf")) else None


def _label(artist):
    label = artist.get_label()
    return "" if not isinstance(label, str) or label.startswith("_") else label


def _tick_names(ax, horizontal):
    """{position: text} of the ticks along an axes' category axis: x for vertical bars and
    boxes, y for horizontal ones (positions rounded, as the patches' centres are looked up)."""
    names = {}
    for t in ax.get_yticklabels() if horizontal else ax.get_xticklabels():
        x, y = t.get_position()
        names[round(float(y if horizontal else x), 6)] = t.get_text()
    return names


def _box_and_whiskers(ax):
    """The boxes of an axes drawn by ``boxplot`` (with its default fliers), or None. It draws
    seven lines per box: the box (a closed outline of five points), two whiskers (from the
    quartiles out to the extremes), two caps, the median (as wide as the box) and the
    outliers (markers only); told apart by their shapes, not their order."""
    lines = ax.get_lines()
    if not lines or len(lines) % 7:
        return None
    names = None
    out = []
    for i in range(0, len(lines), 7):
        group = [[list(map(float, v)) for v in ln.get_data()] for ln in lines[i:i + 7]]
        markers = [ln.get_linestyle() in ("None", "none", " ", "") for ln in lines[i:i + 7]]
        boxes = [g for g in group if len(g[0]) == 5 and (g[0][0], g[1][0]) == (g[0][-1], g[1][-1])]
        fliers = [g for g, m in zip(group, markers) if m]
        segments = [g for g, m in zip(group, markers) if not m and len(g[0]) == 2]
        if len(boxes) != 1 or len(fliers) != 1 or len(segments) != 5:
            return None
        (bx, by), (fx, fy) = boxes[0], fliers[0]
        vertical = sum(1 for x, _ in segments if x[0] == x[1]) == 2  # the whiskers (a cap is across)
        pos, val = (0, 1) if vertical else (1, 0)
        whiskers = [g for g in segments if g[pos][0] == g[pos][1]]
        across = [g for g in segments if not any(g is w for w in whiskers)]  # caps and median
        if len(whiskers) != 2 or len(across) != 3:
            return None
        median = max(across, key=lambda g: abs(g[pos][1] - g[pos][0]))
        ends = [v for g in whiskers for v in g[val]]
        spread = by if vertical else bx
        if names is None:
            names = _tick_names(ax, horizontal=not vertical)
        centre = (min(boxes[0][pos]) + max(boxes[0][pos])) / 2.0
        out.append({
            "label": names.get(round(centre, 6)) or str(_num(centre)),
            "min": _num(min(ends)),
            "first_quartile": _num(min(spread)),
            "median": _num(median[val][0]),
            "third_quartile": _num(max(spread)),
            "max": _num(max(ends)),
            "outliers": [_num(v) for v in (fy if vertical else fx)],
        })
    return out


def _categories(axis):
    """{position: name} of a categorical axis ({} for others): scatter keeps positions only."""
    mapping = getattr(getattr(axis, "units", None), "_mapping", None)
    try:
        return {float(v): str(k) for k, v in mapping.items()} if mapping else {}
    except (AttributeError, TypeError, ValueError):
        return {}


def _scale(axis, scale):
    """E2B's scale type of a matplotlib axis: categorical and date axes are 'linear' to it."""
    if type(getattr(axis, "units", None)).__name__ == "UnitData":
        return "categorical"
    get = getattr(axis, "get_converter", None)
    converter = get() if callable(get) else getattr(axis, "converter", None)
    if converter is not None and "date" in type(converter).__name__.lower():
        return "datetime"
    return scale


def _axes_chart(ax):
    # Loaded with pyplot (the server imports nothing of matplotlib itself).
    PathCollection = sys.modules["matplotlib.collections"].PathCollection
    BarContainer = sys.modules["matplotlib.container"].BarContainer
    Wedge = sys.modules["matplotlib.patches"].Wedge

    title = ax.get_title()
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        return {
            "type": "pie",
            "title": title,
            "elements": [{"label": _label(w), "angle": _num(abs(w.theta2 - w.theta1)), "radius": _num(w.r)} for w in wedges],
        }
    two_d = {
        "title": title,
        "x_label": ax.get_xlabel() or None,
        "y_label": ax.get_ylabel() or None,
        "x_unit": None,
        "y_unit": None,
    }
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        elements = []
        for c in bars:
            horizontal = getattr(c, "orientation", "vertical") == "horizontal"
            names = _tick_names(ax, horizontal)
            for r in c.patches:
                at = r.get_y() + r.get_height() / 2.0 if horizontal else r.get_x() + r.get_width() / 2.0
                name = names.get(round(float(at), 6)) or str(_num(at))
                value = r.get_width() if horizontal else r.get_height()
                elements.append({"label": name, "group": _label(c), "value": _num(value)})
        return dict(two_d, type="bar", elements=elements)
    boxes = _box_and_whiskers(ax)
    if boxes is not None:
        return dict(two_d, type="box_and_whisker", elements=boxes)
    points = dict(
        two_d,
        x_ticks=[_num(t) for t in ax.get_xticks()],
        x_tick_labels=[t.get_text() for t in ax.get_xticklabels()],
        x_scale=_scale(ax.xaxis, ax.get_xscale()),
        y_ticks=[_num(t) for t in ax.get_yticks()],
        y_tick_labels=[t.get_text() for t in ax.get_yticklabels()],
        y_scale=_scale(ax.yaxis, ax.get_yscale()),
    )
    lines = [ln for ln in ax.get_lines() if len(ln.get_xdata(orig=True))]
    if lines:
        elements = [
            {"label": _label(ln), "points": [[_num(x), _num(y)] for x, y in zip(ln.get_xdata(orig=True), ln.get_ydata(orig=True))]}
            for ln in lines
        ]
        return dict(points, type="line", elements=elements)
    dots = [c for c in ax.collections if isinstance(c, PathCollection) and len(c.get_offsets())]
    if dots:
        xs, ys = _categories(ax.xaxis), _categories(ax.yaxis)
        elements = [
            {"label": _label(c), "points": [[xs.get(float(x), _num(x)), ys.get(float(y), _num(y))] for x, y in c.get_offsets()]}
            for c in dots
        ]
        return dict(points, type="scatter", elements=elements)
    return None


def _json_size(value):
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError):
        return 0


def _fit_displays(displays):
    """Keep rich outputs under MAX_DISPLAYS bytes: past it, only their text."""
    total = 0
    kept = []
    for d in displays:
        size = sum(len(v) if isinstance(v, str) else _json_size(v) for v in d.values())
        if total + size > MAX_DISPLAYS:
            d = {k: v for k, v in d.items() if k in ("text", "is_main_result")}
            size = len(d.get("text", ""))
        total += size
        kept.append(d)
    return kept


def _text_stream(fd):
    return io.open(
        fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
    )


def _flush_c_stdio():
    # Only if user code loaded ctypes can it have written through C stdio buffers.
    if "ctypes" in sys.modules:
        try:
            ctypes = sys.modules["ctypes"]
            ctypes.CDLL(None).fflush(None)
        except Exception:
            pass


def _is_coroutine_code(code_obj):
    return bool(code_obj.co_flags & 0x80)  # CO_COROUTINE (top-level await)


def _run_async(body, expr, g):
    import asyncio

    async def both():
        r = eval(body, g)
        if r is not None and hasattr(r, "__await__"):
            await r
        if expr is None:
            return None
        v = eval(expr, g)
        if _is_coroutine_code(expr):
            v = await v
        return v

    return asyncio.run(both())


def _format_error(exc, only=False):
    """Error dict for the wire; the traceback starts at the first user (cell) frame."""
    tb = None if only else exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
        tb = tb.tb_next
    try:
        if tb is None:
            lines = traceback.format_exception_only(type(exc), exc)
        else:
            lines = traceback.format_exception(type(exc), exc, tb)
        text = "".join(lines)
    except BaseException:
        text = "%s\n" % type(exc).__name__
    try:
        value = str(exc)
    except BaseException:
        value = "<unprintable %s>" % type(exc).__name__
    return {
        "name": type(exc).__name__,
        "value": _fit(_clean(value), False, MAX_RESULT)[0],
        "traceback": _fit(_clean(text), False, MAX_RESULT)[0],
    }


def _clean(text):
    """Replace lone surrogates so the response is valid UTF-8 JSON."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


# --------------------------------------------------------------------------- shell kind

# Variables bash sets itself, readonly ones and dynamic ones: never saved/restored.
_BASH_SKIP = (
    "BASH|BASH[A-Z_]*|COMP_WORDBREAKS|DIRSTACK|EPOCHREALTIME|EPOCHSECONDS|EUID|"
    "FUNCNAME|GROUPS|HISTCMD|HOSTTYPE|LINENO|MACHTYPE|OSTYPE|PIPESTATUS|PPID|PWD|"
    "RANDOM|SECONDS|SHELLOPTS|SHLVL|SRANDOM|UID|_|__bb_*|COPROC|COPROC_PID"
)
_SH_SKIP = frozenset(["PWD", "SHLVL", "_"])
_NAME_PREFIXES = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_"
_MAX_ARG = 100 * 1024  # stay well below MAX_ARG_STRLEN (128 KiB)


def _bash_dump_code(fd, pre=""):
    """Bash code writing 4 NUL-terminated sections (vars, functions, -F, pwd) to fd; ``pre``
    runs first (once)."""
    names = " ".join('"${!%s@}"' % c for c in _NAME_PREFIXES)
    return (
        "{ __bb_st=$?; builtin set +xeuv; } 2>/dev/null; "
        "if [[ -z ${__bb_done+x} ]]; then __bb_done=1; %s"
        "{ for __bb_n in %s; do case $__bb_n in %s) ;; "
        '*) builtin declare -p -- "$__bb_n";; esac; done; '
        'builtin printf "\\0"; builtin declare -f; builtin printf "\\0"; '
        'builtin declare -F; builtin printf "\\0"; builtin pwd; builtin printf "\\0"; '
        "} >&%d 2>/dev/null; fi" % (pre, names, _BASH_SKIP, fd)
    )


def _env_name_ok(name):
    """A shell identifier: ASCII letters, digits and _, not starting with a digit."""
    return (
        name.isascii()
        and name[:1] not in ("",) + tuple("0123456789")
        and all(c == "_" or c.isalnum() for c in name)
    )


def _bash_run_env(env):
    """(lines that save and export each of ``env``, code that puts them back as they were)."""
    before, after = [], []
    for i, (k, v) in enumerate(sorted(env.items())):
        had, old = "__bb_eh%d" % i, "__bb_ev%d" % i
        before.append(
            "if [[ -n ${%s+x} ]]; then %s=1; %s=$%s; else %s=; fi; builtin export %s=%s"
            % (k, had, old, k, had, k, _sh_quote(v))
        )
        after.append('if [[ -n $%s ]]; then %s=$%s; else builtin unset -v %s; fi; ' % (had, k, old, k))
    return before, "".join(after)


def _sh_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"


class ShellKernel(object):
    """Each run is a fresh bash restoring the previous run's variables, functions and cwd.

    Running user code in a child keeps this process single-threaded and forkable.  The
    state travels through memfds: the restore script is read by bash's ``read`` builtin
    from an inherited fd, the new state is dumped by an EXIT trap (and after the last
    line) into another fd.  Without /bin/bash, /bin/sh keeps exported variables and cwd.
    """

    def __init__(self):
        if os.access("/bin/bash", os.X_OK):
            self.shell = "/bin/bash"
        else:
            self.shell = "/bin/sh"
        self.bash = self.shell == "/bin/bash"
        self.cwd = os.getcwd()
        self.env = dict(os.environ)  # sh mode, and bash's environment until a first dump
        self.vars = None  # bash: `declare -p` lines of the last dump
        self.funcs = ""
        self.exported_funcs = []
        import subprocess  # imported now so forked children start warm

        self.subprocess = subprocess

    def run(self, code, env=None):
        """Run ``code``; ``env`` is exported for this run only (what the run leaves in those
        variables is not kept)."""
        env = env or {}
        kept = {k: self.env.get(k) for k in env}
        try:
            return self._run(code, env)
        finally:
            if not self.bash:
                for k, v in kept.items():
                    if v is None:
                        self.env.pop(k, None)
                    else:
                        self.env[k] = v

    def _run(self, code, run_env):
        subprocess = self.subprocess
        code = code.replace("\0", "")
        fds = []
        try:
            out_fd, err_fd = _output_memfds(fds)
            dump_fd = _memfd("bb-state-out")
            fds.append(dump_fd)
            if self.bash:
                argv, env, pass_fds = self._bash_invocation(code, dump_fd, fds, run_env)
            else:
                argv, env, pass_fds = self._sh_invocation(code, dump_fd, fds)
                env = dict(env, **run_env)
            cwd = self.cwd if os.path.isdir(self.cwd) else "/"
            env = dict(env)
            env["PWD"] = cwd
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=err_fd,
                pass_fds=pass_fds,
                cwd=cwd,
                env=env,
                close_fds=True,
            )
            rc = proc.wait()
            exit_code = rc if rc >= 0 else 128 - rc
            self._load_state(dump_fd)
            res = _capture_result(out_fd, err_fd)
        finally:
            _close_fds(fds)
        res["exit_code"] = exit_code
        return res

    # -- bash
    def _bash_invocation(self, code, dump_fd, fds, run_env):
        # Variables of this run only: set after the restore, put back before the dump.
        before, after = _bash_run_env(run_env)
        dump = _bash_dump_code(dump_fd, after)
        parts = []
        if self.vars is not None:
            parts.append(self.vars)
            parts.append(self.funcs)
            parts.extend("builtin declare -fx -- %s" % n for n in self.exported_funcs)
        parts.extend(before)
        parts.append("builtin trap -- %s EXIT" % _sh_quote(dump + "; builtin exit $__bb_st"))
        parts.append("builtin unset -v __bb_r")
        restore = "\n".join(parts) + "\n"
        in_fd = _memfd("bb-state-in")
        fds.append(in_fd)
        read = "IFS= builtin read -r -d '' %s <&%d"
        prefix = read % ("__bb_r", in_fd)
        payload = restore.encode("utf-8", "surrogateescape") + b"\0"
        if len(code.encode("utf-8", "surrogateescape")) > _MAX_ARG:
            # Too big for one argv string: ship it through the memfd too.
            prefix += "; " + read % ("__bb_c", in_fd)
            payload += code.encode("utf-8", "surrogateescape") + b"\0"
            code = 'eval "$__bb_c"'
        _write_all(in_fd, payload)
        os.lseek(in_fd, 0, os.SEEK_SET)
        # The user's first line shares line 1 with the prefix so LINENO/errors match; a
        # dump after the last line covers a user-replaced EXIT trap.
        script = '%s; builtin exec %d<&-; builtin eval "$__bb_r"; %s\n%s; builtin exit $__bb_st\n' % (
            prefix,
            in_fd,
            code,
            dump,
        )
        env = self.env if self.vars is None else {}
        return [self.shell, "-c", script, "bash"], env, (in_fd, dump_fd)

    # -- /bin/sh fallback (degraded: exported variables and cwd only)
    def _sh_invocation(self, code, dump_fd, fds):
        low = _single_digit_fd(dump_fd)  # dash only understands fds 0-9 in redirections
        if low != dump_fd:
            fds.append(low)
        dump = (
            "__bb_st=$?; { export -p; printf '\\000'; pwd; printf '\\000'; } >&%d 2>/dev/null; "
            "exit $__bb_st" % low
        )
        script = "trap %s EXIT; %s\n" % (_sh_quote(dump), code)
        return [self.shell, "-c", script, "sh"], self.env, (low,)

    def _load_state(self, dump_fd):
        os.lseek(dump_fd, 0, os.SEEK_SET)
        chunks = []
        while True:
            chunk = os.read(dump_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        sections = b"".join(chunks).split(b"\0")
        want = 4 if self.bash else 2
        # A run that exec'd another program or was killed dumps nothing: keep old state.
        if len(sections) < want + 1:
            return
        text = [s.decode("utf-8", "surrogateescape") for s in sections[:want]]
        if self.bash:
            self.vars, self.funcs = text[0], text[1]
            self.exported_funcs = [
                line.split()[-1]
                for line in text[2].splitlines()
                if line.startswith("declare -f") and "x" in line.split()[1]
                and not line.split()[-1].startswith("__bb_")
            ]
            cwd = text[3].rstrip("\n")
        else:
            self.env = _parse_export_p(text[0])
            cwd = text[1].rstrip("\n")
        if cwd:
            self.cwd = cwd


def _single_digit_fd(fd):
    """A duplicate of ``fd`` numbered below 10 (``fd`` itself if it already is)."""
    if fd < 10:
        return fd
    for n in range(4, 10):
        try:
            os.fstat(n)
        except OSError:
            os.dup2(fd, n, inheritable=False)
            return n
    raise OSError("no free file descriptor below 10 for /bin/sh")


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _parse_export_p(text):
    import shlex

    env = {}
    try:
        tokens = shlex.split(text, posix=True)
    except ValueError:
        return env
    for tok in tokens:
        if tok == "export" or "=" not in tok:
            continue
        name, value = tok.split("=", 1)
        if name and name not in _SH_SKIP:
            env[name] = value
    return env


# --------------------------------------------------------------------------- templates

_PR_SET_DUMPABLE = 4
_PR_SET_PDEATHSIG = 1
# Flags that only make sense when a file is created: never replayed on a reopen.
_REOPEN_DROP = os.O_CREAT | os.O_TRUNC | os.O_EXCL | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
_O_PATH = getattr(os, "O_PATH", 0)
FORK_ROLES = ("template", "restore")


_PRCTL = []  # [prctl function, c_ulong] once loaded: loading ctypes takes milliseconds


def _load_prctl():
    """Load prctl(2) through ctypes ahead of time (at start), so forks do not pay for it."""
    if not _PRCTL:
        try:
            import ctypes

            _PRCTL.extend([ctypes.CDLL(None, use_errno=True).prctl, ctypes.c_ulong])
        except Exception:
            _PRCTL.extend([None, None])
    return _PRCTL


def _set_dumpable(value):
    """prctl(PR_SET_DUMPABLE, value); best effort (False when it failed)."""
    prctl, ulong = _load_prctl()
    if prctl is None:
        return False
    try:
        zero = ulong(0)
        return prctl(_PR_SET_DUMPABLE, ulong(value), zero, zero, zero) == 0
    except Exception:
        return False


def _setsid():
    try:
        os.setsid()
    except OSError:  # EPERM: already a process group leader
        pass


def _own_group(pid=0):
    """Make ``pid`` (0: this process) the leader of a process group of its own. A fork
    child and its parent both call it (whichever runs first wins): the parent answers the
    daemon right after the fork, and the daemon may then kill the session's process group
    (kill(-pid)) before the child ran at all."""
    try:
        os.setpgid(pid, pid)
    except OSError:  # ESRCH: already gone; EPERM: already moved to another session
        pass


_CLONE_PARENT = 0x00008000
_SIGCHLD = 17
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}


def _fork_beside():
    """fork(), but the child's parent is ours (clone with CLONE_PARENT), with the interpreter's
    fork hooks around it as os.fork() runs them."""
    import ctypes
    import platform

    number = _SYS_CLONE.get(platform.machine())
    if number is None:
        return os.fork()
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held, as in os.fork()
    libc.syscall.restype = ctypes.c_long
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = libc.syscall(ctypes.c_long(number), ctypes.c_ulong(_CLONE_PARENT | _SIGCHLD), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if pid == 0:
        # First thing, before any at-fork hook: a session (and so a process group) of its own
        # (see _wait_own_group). Not the session of the process it was forked from, whose
        # leader may be gone by the time it is dumped (CRIU wants a session's leader).
        libc.setsid()
        api.PyOS_AfterFork_Child()
        return 0
    errno = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(errno, os.strerror(errno))
    return pid


def _wait_own_group(pid, patience=2.0):
    """Wait until process ``pid`` (not our child) is the leader of a process group of its own,
    or is gone (at most ``patience`` seconds)."""
    import time

    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                return
        except OSError:  # gone
            return
        os.sched_yield()


def _fd_flags(fd):
    with io.open("/proc/self/fdinfo/%d" % fd) as f:  # not open(): user code may patch it
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    raise OSError("no flags in fdinfo of fd %d" % fd)


def _overlay_devs():
    """st_dev of every overlay mount this process sees: the root and the volumes, whose
    mounts a checkpoint or rollback replaces (files on them are reopened by path)."""
    devs = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split(" - ", 1)
                if len(fields) == 2 and fields[1].startswith("overlay "):
                    major, minor = fields[0].split()[2].split(":")
                    devs.add(os.makedev(int(major), int(minor)))
    except (OSError, ValueError, IndexError):
        pass
    return devs


def _record_fds(skip):
    """(fd, path, flags, offset|None, cloexec) of every open fd on a regular file of the
    root filesystem or of a volume, except the fds in ``skip``."""
    try:
        devs = _overlay_devs() | {os.stat("/").st_dev}
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    saved = []
    for name in names:
        try:
            fd = int(name)
        except ValueError:
            continue
        if fd in skip:
            continue
        try:  # the fd listdir used is closed by now: fstat fails and it is skipped
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_dev not in devs:
                continue
            path = os.readlink("/proc/self/fd/%d" % fd)
            if not path.startswith("/") or path.endswith(" (deleted)"):
                continue
            flags = _fd_flags(fd)
            cloexec = not os.get_inheritable(fd)
        except (OSError, ValueError):
            continue
        try:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:  # O_PATH fds have no offset
            offset = None
        saved.append((fd, path, flags, offset, cloexec))
    saved.sort()
    return saved


def _reopen_fds(saved):
    """Reopen each recorded fd by path over its old number; returns the fd numbers that were."""
    done = set()
    for fd, path, flags, offset, cloexec in saved:
        want = flags & ~_REOPEN_DROP
        try:
            # O_NONBLOCK: never hang on a fifo that replaced the file; dropped below.
            new = os.open(path, want | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError:
            continue  # gone or not openable any more: keep the old open file
        try:
            if not stat.S_ISREG(os.fstat(new).st_mode):
                continue
            if not (want & os.O_NONBLOCK) and not (want & _O_PATH):
                fcntl.fcntl(new, fcntl.F_SETFL, fcntl.fcntl(new, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            if offset is not None:
                os.lseek(new, offset, os.SEEK_SET)
            os.dup2(new, fd, inheritable=not cloexec)
            done.add(fd)
        except OSError:
            pass
        finally:
            os.close(new)
    return done


def _close_all_but(keep):
    """Close every open fd not in ``keep``; a connected TCP socket (the other sandbox's
    connection) becomes a socket reset by its peer instead, so that its next use fails
    clearly (ECONNRESET) rather than with EBADF or on another object given the same number."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            fd = int(name)
        except ValueError:
            continue
        if fd in keep:
            continue
        if _connected_tcp(fd):
            reset = _reset_socket()
            if reset is not None:
                try:
                    os.dup2(reset.fileno(), fd, inheritable=False)
                    continue
                except OSError:
                    pass
                finally:
                    reset.close()
        try:
            os.close(fd)
        except OSError:
            pass


def _connected_tcp(fd):
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        # Not a socket: the copy is closed here (socket() leaves it open), or the object
        # (a pipe shared with the other sandbox...) would stay open through it.
        os.close(dup)
        return False
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        s.getpeername()
        return True
    except OSError:
        return False
    finally:
        s.close()


def _reset_socket():
    """A TCP socket whose peer reset the connection (over this sandbox's loopback)."""
    import select
    import struct

    lst = cli = srv = None
    try:
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        cli = socket.create_connection(lst.getsockname(), timeout=1)
        srv, _ = lst.accept()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        srv.close()
        srv = None
        select.select([cli], [], [], 1)  # the reset has arrived
        cli.setblocking(True)
        out, cli = cli, None
        return out
    except OSError:
        return None
    finally:
        for s in (lst, cli, srv):
            if s is not None:
                s.close()


def _munmap(addr, length):
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(length))
    except Exception:
        pass


def _after_fork_child():
    """What os.fork() runs in a child (CPython's PyOS_AfterFork_Child: thread and lock state,
    os.register_at_fork hooks such as random's reseed), for a copy the daemon forked from
    outside the interpreter."""
    try:
        import ctypes

        ctypes.pythonapi.PyOS_AfterFork_Child()
    except Exception:
        pass


# --------------------------------------------------------------------------- javascript kind

# The node side of the javascript kind: one persistent global scope (vm.runInThisContext, so
# top-level var/let/const/function declarations of a run stay for the next), requests as JSON
# lines on stdin, one answer line each on the fd named by argv; what the code prints goes to
# node's stdout and stderr (pipes: synchronous writes on Linux), which the server copies into
# the run's memfds as it arrives.  argv ends with the kind and the answer fd.  The typescript
# kind compiles each run with the `typescript` package's transpileModule (loaded at the first
# run, found as `require` finds it, else where Debian's node-typescript or `npm install -g`
# put it): types stripped, no type checking, syntax errors a SyntaxError of the run.  Its
# import declarations become `var`s first (default imports as esModuleInterop has them), so
# imported names stay for later runs as other top-level declarations do (compiled as they
# are, CommonJS would rename them).
_NODE_RUNNER = r"""
'use strict';
// In a function: the runner's own names are not globals a run's declarations would clash with.
(() => {
  const fs = require('fs'), util = require('util'), vm = require('vm'), readline = require('readline'), v8 = require('v8');
  const answerFd = Number(process.argv[process.argv.length - 1]);
  const typescript = process.argv[process.argv.length - 2] === 'typescript';
  // What `require` gave a run, by value: how a copy gets a module again (see carry).
  // (`require` here is globalThis.require, which becomes trackedRequire.)
  const required = new Map(), nodeRequire = require;
  function trackedRequire(spec) {
    const m = nodeRequire(spec);
    if (m !== null && (typeof m === 'object' || typeof m === 'function') && !required.has(m)) {
      required.set(m, /^\.{0,2}\//.test(String(spec)) ? nodeRequire.resolve(spec) : spec);
    }
    return m;
  }
  Object.assign(trackedRequire, nodeRequire);  // resolve, cache, main
  globalThis.require = trackedRequire;
  let ts = null, noTypeScript = false;
  if (typescript) {
    // What compiled imports and exports refer to.
    Object.defineProperty(globalThis, '__bbDefault', {value: (m) => (m && m.__esModule ? m.default : m)});
    globalThis.exports = {};
  }
  // The global scope as node made it: a run's `var` and `function` names are the others, and
  // the built-in modules' globals a run assigned (`-e` makes each, e.g. `util`, a getter;
  // `var util = 1` replaces it with a value; node's other lazy globals replace themselves).
  const baseline = new Set(Object.getOwnPropertyNames(globalThis));
  const moduleGlobals = new Set(nodeRequire('module').builtinModules.filter((n) => {
    const d = Object.getOwnPropertyDescriptor(globalThis, n);
    return d && !('value' in d);
  }));
  function loadTypeScript() {
    const places = ['/usr/share/nodejs/typescript', '/usr/local/lib/node_modules/typescript', '/usr/lib/node_modules/typescript'];
    for (const name of ['typescript'].concat(places)) {
      try { return nodeRequire(name); } catch (e) { if (e.code !== 'MODULE_NOT_FOUND') throw e; }
    }
    const e = new Error("typescript contexts need the 'typescript' package where node finds it: Debian's " +
      "node-typescript (templates/code-interpreter-v1.toml installs it), `npm install -g typescript`, or NODE_PATH");
    e.name = 'KernelError';
    throw e;
  }
  // `code` with each [start, end, text] of `edits` (in source order, not overlapping) replacing
  // that span.
  function edited(code, edits) {
    for (const [start, end, text] of edits.reverse()) code = code.slice(0, start) + text + code.slice(end);
    return code;
  }
  function hoistImports(code) {
    const sf = ts.createSourceFile('cell.ts', code, ts.ScriptTarget.ES2022, true, ts.ScriptKind.TS);
    const edits = [];
    for (const st of sf.statements) {
      if (!ts.isImportDeclaration(st)) continue;
      const from = 'require(' + st.moduleSpecifier.getText(sf) + ')';
      const c = st.importClause, out = [];
      if (!c) out.push(from + ';');
      else if (!c.isTypeOnly) {
        if (c.name) out.push('var ' + c.name.text + ' = __bbDefault(' + from + ');');
        const nb = c.namedBindings;
        if (nb && ts.isNamespaceImport(nb)) out.push('var ' + nb.name.text + ' = ' + from + ';');
        else if (nb) {
          const names = nb.elements.filter((e) => !e.isTypeOnly).map((e) => JSON.stringify((e.propertyName || e.name).text) + ': ' + e.name.text);
          if (names.length) out.push('var {' + names.join(', ') + '} = ' + from + ';');
        }
      }
      edits.push([st.getStart(sf), st.end, out.join(' ')]);
    }
    return edited(code, edits);
  }
  function compile(code, filename) {
    if (!ts) ts = loadTypeScript();
    const out = ts.transpileModule(hoistImports(code), {
      compilerOptions: {target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.CommonJS}, reportDiagnostics: true, fileName: 'cell.ts',
    });
    if (out.diagnostics.length) {
      const d = out.diagnostics[0], where = d.file ? d.file.getLineAndCharacterOfPosition(d.start) : {line: 0, character: 0};
      throw new SyntaxError(ts.flattenDiagnosticMessageText(d.messageText, '\n') + ' (' + filename + ':' + (where.line + 1) + ':' + (where.character + 1) + ')');
    }
    return out.outputText;
  }
  let count = 0, interrupt = null;
  // Idle, a SIGINT (sent to the session's process group) is dropped; while code runs it stops
  // it (breakOnSigint) and while a run awaits a promise it ends the wait.
  process.on('SIGINT', () => { if (interrupt) interrupt(); });
  // A stack without this file's frames (they start where the cell was called from).
  function cellStack(stack) {
    const lines = String(stack).split('\n');
    const cut = lines.findIndex((l) => /^\s+at .*(\[eval\]|node:vm:|sigintHandlersWrap)/.test(l));
    return (cut < 0 ? lines : lines.slice(0, cut)).join('\n');
  }
  function failure(e) {
    if (e instanceof Error || (e && typeof e === 'object' && 'stack' in e)) {
      return {name: String(e.name || 'Error'), value: String(e.message === undefined ? e : e.message), traceback: cellStack(e.stack || e)};
    }
    return {name: 'Error', value: 'Uncaught ' + util.inspect(e), traceback: 'Uncaught ' + util.inspect(e)};
  }
  function interrupted() { const e = new Error('Script execution was interrupted by SIGINT'); e.name = 'Interrupted'; return e; }
  async function settle(value) {
    if (!value || typeof value.then !== 'function') return value;
    return await Promise.race([value, new Promise((_, reject) => { interrupt = () => reject(interrupted()); })]);
  }
  // A run using top-level await is the body of an async function.  With the typescript package
  // at hand (the javascript kind loads it then, if it can), its top-level declarations become
  // assignments, as the node REPL makes them, so they outlive the run like any run's:
  // `const x = await f()` -> `x = await f();`, `function g() {}` -> `g = function g() {};`; and
  // it returns its last statement's value only when that is an expression.  Without the
  // package, the last line is returned when it parses as an expression, declarations stay local.
  function asyncBody(code, filename) {
    if (!ts && !noTypeScript) {
      try { ts = loadTypeScript(); } catch (e) { noTypeScript = true; }  // the plain wrapping below
    }
    if (ts) {
      try { return asyncBodyParsed(code); } catch (e) { /* a typescript whose API differs: below */ }
    }
    return asyncBodyByLines(code, filename);
  }
  function asyncBodyParsed(code) {
    const sf = ts.createSourceFile('cell.js', code, ts.ScriptTarget.ES2022, true, ts.ScriptKind.JS);
    const edits = [], statements = sf.statements, last = statements[statements.length - 1];
    for (const st of statements) {
      let text = null;
      if (ts.isVariableStatement(st)) {
        const isVar = !(st.declarationList.flags & ts.NodeFlags.BlockScoped);
        text = st.declarationList.declarations.map((d) => {
          const name = d.name.getText(sf);
          if (!d.initializer && isVar) {
            // `var x;` keeps the value x has (a redeclaration), else makes it.
            return 'if (!(' + JSON.stringify(name) + ' in globalThis)) globalThis.' + name + ' = undefined;';
          }
          const value = d.initializer ? d.initializer.getText(sf) : 'undefined';
          return ts.isIdentifier(d.name) ? name + ' = ' + value + ';' : '(' + name + ' = ' + value + ');';
        }).join(' ');
      } else if ((ts.isFunctionDeclaration(st) || ts.isClassDeclaration(st)) && st.name) {
        text = st.name.text + ' = ' + st.getText(sf) + ';';
      } else if (st === last && ts.isExpressionStatement(st)) {
        text = 'return (' + st.expression.getText(sf) + '\n);';
      }
      if (text !== null) edits.push([st.getStart(sf), st.end, text]);
    }
    return '(async () => {\n' + edited(code, edits) + '\n})()';
  }
  function asyncBodyByLines(code, filename) {
    const lines = code.replace(/\s+$/, '').split('\n');
    const last = lines.pop().replace(/;\s*$/, '');
    const returning = '(async () => {\n' + lines.join('\n') + '\nreturn (' + last + '\n);\n})()';
    try {
      new vm.Script(returning, {filename});
      return returning;
    } catch (e) {
      return '(async () => {\n' + code + '\n})()';
    }
  }
  // ---- copies.  A copy of the session (fork, checkpoint, rollback) is a copy of the server
  // alone; node's heap is not in it.  Before the copy, `carry` lists the global scope's names
  // (var/function: new properties of globalThis; let/const/class: the inspector's list of
  // the global lexical scope) and how each can be made again: data through v8.serialize (one
  // graph: values shared between names stay shared), functions and classes from their source,
  // modules (and their members) by requiring them again.  The copy's node runs `restore` before
  // its first run.  What cannot be made again is named, with why.
  const CARRY_LIMIT = 16 << 20;
  let inspectorSession = null;
  function lexicalNames() {
    if (!inspectorSession) {
      inspectorSession = new (nodeRequire('inspector').Session)();
      inspectorSession.connect();
    }
    let names = null;
    inspectorSession.post('Runtime.globalLexicalScopeNames', {}, (e, r) => { if (!e && r) names = r.names; });
    if (names === null) throw new Error('the inspector did not list them');
    return names;
  }
  function moduleMember(fn) {
    for (const [m, spec] of required) {
      for (const k of Object.getOwnPropertyNames(m)) {
        const d = Object.getOwnPropertyDescriptor(m, k);
        if (d && d.value === fn) return [spec, k];
      }
    }
    return null;
  }
  // Node's own classes whose instances v8.serialize keeps as they are.
  const CLONED = new Set(['Array', 'Map', 'Set', 'Date', 'RegExp', 'ArrayBuffer', 'SharedArrayBuffer', 'DataView',
    'Boolean', 'Number', 'String', 'BigInt', 'Error', 'EvalError', 'RangeError', 'ReferenceError', 'SyntaxError',
    'TypeError', 'URIError', 'Int8Array', 'Uint8Array', 'Uint8ClampedArray', 'Int16Array', 'Uint16Array', 'Int32Array',
    'Uint32Array', 'Float32Array', 'Float64Array', 'BigInt64Array', 'BigUint64Array', 'Buffer']);
  // The class a value was made by, when the serializer keeps only its own properties ('' when
  // that is one of node's own, e.g. URL: such an instance cannot be made again that way).
  function protoName(value) {
    if (value === null || typeof value !== 'object') return undefined;
    const proto = Object.getPrototypeOf(value);
    if (!proto || proto === Object.prototype || typeof proto.constructor !== 'function') return undefined;
    const name = proto.constructor.name;
    if (!name) return undefined;
    if (baseline.has(name) && globalThis[name] === proto.constructor) return CLONED.has(name) ? undefined : '';
    return name;
  }
  function why(e) { return String(e && e.message !== undefined ? e.message : e).split('\n')[0]; }
  function carry() {
    const entries = [], not = [], values = [], names = [];
    try {
      for (const name of lexicalNames()) names.push([name, true]);
    } catch (e) {
      not.push(['let/const/class names', 'node could not list them: ' + why(e)]);
    }
    for (const name of Object.getOwnPropertyNames(globalThis)) {
      const d = Object.getOwnPropertyDescriptor(globalThis, name);
      if (baseline.has(name) && !(moduleGlobals.has(name) && d && 'value' in d)) continue;
      if (d && 'value' in d) names.push([name, false]);
      else not.push([name, 'a getter or setter of globalThis']);
    }
    for (const [name, lexical] of names) {
      let value, decl = 'var';
      if (lexical) {
        try { value = vm.runInThisContext(name); } catch (e) { not.push([name, 'never initialised']); continue; }
        try { vm.runInThisContext(name + ' = ' + name); decl = 'let'; } catch (e) { decl = 'const'; }
      } else {
        value = globalThis[name];
      }
      const e = {name, decl};
      if ((typeof value === 'object' || typeof value === 'function') && required.has(value)) {
        e.require = required.get(value);
      } else if (typeof value === 'function') {
        const member = moduleMember(value);
        if (member) {
          [e.require, e.prop] = member;
        } else {
          const source = Function.prototype.toString.call(value);
          try {
            if (/\[native code\]\s*\}$/.test(source)) throw new Error('native');
            new vm.Script('(' + source + '\n)');
          } catch (err) {
            not.push([name, 'a function without source to make it again from (native, bound or a method)']);
            continue;
          }
          e.source = source;
        }
      } else {
        const proto = protoName(value);
        if (proto === '') {
          not.push([name, 'cannot be copied: a ' + Object.getPrototypeOf(value).constructor.name + ' (node\'s own object)']);
          continue;
        }
        e.value = values.length;
        values.push(value);
        if (proto) e.proto = proto;
      }
      entries.push(e);
    }
    let data = null;
    try { data = v8.serialize(values); } catch (e) { /* one by one below */ }
    if (data === null || data.length > CARRY_LIMIT) {
      // Without what cannot be serialized, then without the largest values until it fits.
      const sizes = values.map((v) => { try { return v8.serialize(v).length; } catch (e) { return e; } });
      const kept = [], dropped = new Set();
      for (const e of entries) {
        if (!('value' in e)) continue;
        const size = sizes[e.value];
        if (typeof size !== 'number') { not.push([e.name, 'cannot be copied: ' + why(size)]); dropped.add(e); } else kept.push(e);
      }
      kept.sort((a, b) => sizes[b.value] - sizes[a.value]);
      let total = kept.reduce((t, e) => t + sizes[e.value], 0);
      for (const e of kept) {
        if (total <= CARRY_LIMIT) break;
        total -= sizes[e.value];
        not.push([e.name, 'too large to copy (' + (sizes[e.value] / (1 << 20)).toFixed(1) + ' MiB serialized; ' + (CARRY_LIMIT >> 20) + ' MiB in all)']);
        dropped.add(e);
      }
      const left = [], remaining = entries.filter((e) => !dropped.has(e));
      for (const e of remaining) {
        if ('value' in e) { left.push(values[e.value]); e.value = left.length - 1; }
      }
      entries.splice(0, entries.length, ...remaining);
      data = v8.serialize(left);
    }
    return {count, entries, not, data: data.toString('base64')};
  }
  function bind(e, value) {
    if (e.decl === 'var') {
      globalThis[e.name] = value;
      return;
    }
    Object.defineProperty(globalThis, '__bbCarried', {value, configurable: true});
    try {
      vm.runInThisContext(e.decl + ' ' + e.name + ' = __bbCarried;');
    } finally {
      delete globalThis.__bbCarried;
    }
  }
  function restore(c) {
    count = Number(c.count) || 0;
    const values = c.data ? v8.deserialize(Buffer.from(c.data, 'base64')) : [];
    const entries = Array.isArray(c.entries) ? c.entries : [], carried = [], not = (c.not || []).slice();
    const made = (e, f) => {
      try { bind(e, f()); carried.push(e.name); return null; } catch (err) { return err; }
    };
    for (const e of entries.filter((e) => 'require' in e)) {
      const err = made(e, () => { const m = trackedRequire(e.require); return 'prop' in e ? m[e.prop] : m; });
      if (err) not.push([e.name, 'require(' + JSON.stringify(e.require) + ') failed: ' + why(err)]);
    }
    for (const e of entries.filter((e) => 'value' in e)) {
      const err = made(e, () => values[e.value]);
      if (err) not.push([e.name, why(err)]);
    }
    // Sources in rounds: a class may extend one made later in the list.
    let pending = entries.filter((e) => 'source' in e);
    while (pending.length) {
      const next = [], errors = [];
      for (const e of pending) {
        const err = made(e, () => vm.runInThisContext('(' + e.source + '\n)'));
        if (err) { next.push(e); errors.push(err); }
      }
      if (next.length === pending.length) {
        next.forEach((e, i) => not.push([e.name, 'its source did not run again: ' + why(errors[i])]));
        break;
      }
      pending = next;
    }
    for (const e of entries.filter((e) => e.proto)) {
      const value = values[e.value];
      try {
        const C = vm.runInThisContext(e.proto);
        if (typeof C === 'function' && C.prototype && Object.getPrototypeOf(value) === Object.prototype) Object.setPrototypeOf(value, C.prototype);
      } catch (err) {
        not.push([e.name, 'copied as a plain object: its class ' + e.proto + ' is not in the copy']);
      }
    }
    return {carried, not};
  }
  async function handle(req) {
    if (req.op === 'carry' || req.op === 'restore') {
      let answer;
      try {
        answer = req.op === 'carry' ? {carry: carry()} : restore(req.carry || {});
      } catch (e) {
        answer = {error: why(e)};
      }
      answer.seq = req.seq;
      fs.writeSync(answerFd, JSON.stringify(answer) + '\n');
      return;
    }
    const saved = {};
    for (const [k, v] of Object.entries(req.env || {})) { saved[k] = process.env[k]; process.env[k] = v; }
    const filename = '<cell ' + (++count) + '>';
    let result = null, error = null;
    try {
      const code = typescript ? compile(req.code, filename) : req.code;
      let value;
      try {
        value = vm.runInThisContext(code, {filename, breakOnSigint: true});
      } catch (e) {
        // Top-level await: run as the body of an async function (see asyncBody).
        if (!(e instanceof SyntaxError) || !/await/.test(e.message)) throw e;
        value = vm.runInThisContext(asyncBody(code, filename), {filename, breakOnSigint: true});
      }
      value = await settle(value);
      if (value !== undefined) result = typeof value === 'string' ? util.inspect(value) : util.inspect(value, {depth: 4});
    } catch (e) {
      error = failure(e);
    } finally {
      interrupt = null;
      for (const [k, v] of Object.entries(saved)) { if (v === undefined) delete process.env[k]; else process.env[k] = v; }
    }
    fs.writeSync(answerFd, JSON.stringify({result, error, execution_count: count, seq: req.seq}) + '\n');
  }
  let queue = Promise.resolve();
  readline.createInterface({input: process.stdin}).on('line', (line) => {
    queue = queue.then(() => handle(JSON.parse(line)));
  }).on('close', () => process.exit(0));
})();
"""


class _NodeGone(Exception):
    """node exited (or never took the request); the message says what it means for the run."""


_CARRY_TIMEOUT = 5.0  # seconds node may take to list its state before a copy (see carry)
_RESTORE_TIMEOUT = 30.0  # seconds a copy's node may take to make that state again
_CARRY_PREFIX = b'{"carry":'
_SEQ_TAIL = re.compile(rb',"seq":(\d+)\}\s*$')


def _seq_tail(answer):
    """The match of the ``seq`` that ends each of node's answers (searched in the last bytes
    only: a carry answer may be megabytes long)."""
    return _SEQ_TAIL.search(answer, max(0, len(answer) - 40))


class JavaScriptKernel(object):
    """Runs code in one persistent node global scope (``kind`` "typescript": compiled first).

    node runs as a child of this server (same process group: a SIGINT to the session reaches
    it, a kill of the session ends it), started at the first run.  A copy of the session
    (fork, checkpoint template, rollback) is a clone of this process alone: node's heap is not
    in it.  So before a copy node is asked for its global scope as it can be made again (the
    runner's ``carry``: data serialized, functions and classes as source, modules as what was
    required), kept here as the JSON node wrote; the copy starts its own node at its first run
    and has it ``restore`` that.  What could not be carried is said on that run's stderr.
    """

    def __init__(self, kind):
        self.kind = kind
        self.node = None
        for d in (os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin").split(os.pathsep):
            if not d.startswith("/"):
                continue  # as the daemon's check before the session starts: absolute dirs only
            for name in ("node", "nodejs"):
                path = os.path.join(d, name)
                if self.node is None and os.access(path, os.X_OK) and not os.path.isdir(path):
                    self.node = path
        if self.node is None:
            raise SystemExit("%s sessions need node in the image (e.g. apt-get install nodejs)" % kind)
        self.proc = None  # (pid, requests fd, answers fd, stdout fd, stderr fd)
        self.answers = bytearray()  # read from node, not yet taken
        self.seq = 0
        self.copied = False  # a copy of a session whose node had state
        self.carry = None  # that state as node listed it (bytes of JSON), or None
        self.carry_error = None  # why it could not be listed
        import select
        import subprocess  # imported now so forked children start warm

        self.select = select
        self.subprocess = subprocess

    def prepare_copy(self):
        """Before a copy of this process is made: what node holds, as it can be made again.  A
        copy that has not started node yet keeps what it was given."""
        if self.proc is None:
            return
        self.carry = self.carry_error = None
        for fd in self.proc[3:]:
            _drain(fd, None)
        try:
            line = self._ask({"op": "carry"}, None, None, _CARRY_TIMEOUT)
        except _NodeGone:
            self.carry_error = "node had exited"
            return
        except TimeoutError:
            self.carry_error = "node did not list it within %g s (busy?)" % _CARRY_TIMEOUT
            return
        tail = _seq_tail(line)
        if line.startswith(_CARRY_PREFIX) and tail is not None:
            self.carry = bytes(line[len(_CARRY_PREFIX) : tail.start()])
            return
        try:
            self.carry_error = str(json.loads(line.decode("utf-8", "replace")).get("error"))
        except (ValueError, AttributeError):
            self.carry_error = "node answered garbage"

    def copy_made(self):
        """In the original, after the copy: the listed state was the copy's to take."""
        if self.proc is not None:
            self.carry = None

    def forget_node(self):
        """In a fresh copy of this process (right after the fork): node is the original's."""
        if self.proc is not None:
            _close_fds(self.proc[1:])
            self.proc = None
            self.answers = bytearray()
            self.copied = True

    def _start(self):
        fds = []
        try:
            req_r, req_w = os.pipe()
            fds += [req_r, req_w]
            ans_r, ans_w = os.pipe()
            fds += [ans_r, ans_w]
            out_r, out_w = os.pipe()
            fds += [out_r, out_w]
            err_r, err_w = os.pipe()
            fds += [err_r, err_w]
            for fd in (req_w, ans_r, out_r, err_r):
                os.set_inheritable(fd, False)
            proc = self.subprocess.Popen(
                [self.node, "--no-deprecation", "-e", _NODE_RUNNER, self.kind, str(ans_w)],
                stdin=req_r,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(ans_w,),
                close_fds=True,
                preexec_fn=_die_with_parent,
            )
        except BaseException:
            _close_fds(fds)
            raise
        _close_fds([req_r, ans_w, out_w, err_w])
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        self.proc = (proc.pid, req_w, ans_r, out_r, err_r)
        self.answers = bytearray()

    def _stop(self):
        if self.proc is None:
            return
        pid = self.proc[0]
        _close_fds(self.proc[1:])
        self.proc = None
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass

    def _ask(self, request, out_fd, err_fd, timeout=None, raw=None):
        """Send ``request`` (a dict; ``raw``: bytes of JSON members put before its own) to node
        and return node's answer to it (bytes of one JSON line); what node prints meanwhile goes
        to ``out_fd``/``err_fd`` (None: dropped).  Answers carry the request's ``seq``: a late
        answer to an earlier request (one that timed out) is skipped.  Raises _NodeGone (node
        stopped) or TimeoutError (node runs on)."""
        self.seq += 1
        request = dict(request, seq=self.seq)
        line = json.dumps(request).encode()
        if raw is not None:
            line = b"{" + raw + b"," + line[1:]
        pid, req_w, ans_r, out_r, err_r = self.proc
        try:
            _write_all(req_w, line + b"\n")
        except OSError:
            self._stop()
            raise _NodeGone("the javascript kernel (node) had exited: this run started none; run again")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            end = self.answers.find(b"\n")
            while end >= 0:
                answer = bytes(self.answers[:end])
                del self.answers[: end + 1]
                tail = _seq_tail(answer)
                if tail is not None and int(tail.group(1)) == self.seq:
                    return answer
                end = self.answers.find(b"\n")
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = self.select.select([ans_r, out_r, err_r], [], [], wait)[0]
            if not ready and deadline is not None:
                raise TimeoutError()
            if out_r in ready:
                _drain(out_r, out_fd)
            if err_r in ready:
                _drain(err_r, err_fd)
            if ans_r in ready:
                chunk = os.read(ans_r, 1 << 20)
                if not chunk:
                    _drain(out_r, out_fd)
                    _drain(err_r, err_fd)
                    self._stop()
                    raise _NodeGone("the javascript kernel (node) exited during the run; its state is lost")
                self.answers += chunk

    def _restore(self, err_fd):
        """In a copy, node just started: make the original's state again (see prepare_copy) and
        say on ``err_fd`` what could not be."""
        carry, self.carry = self.carry, None
        lost = None
        if carry is None:
            lost = "its state could not be listed (%s)" % (self.carry_error or "unknown")
        else:
            try:
                line = self._ask({"op": "restore"}, None, err_fd, _RESTORE_TIMEOUT, raw=b'"carry":' + carry)
                answer = json.loads(line.decode("utf-8", "replace"))
                if answer.get("error"):
                    lost = "its state could not be made again (%s)" % answer["error"]
                elif answer.get("not"):
                    lost = "not carried: " + "; ".join("%s (%s)" % (n, w) for n, w in answer["not"])
            except TimeoutError:
                self._stop()
                self._start()
                lost = "making its state again took over %g s; it starts afresh" % _RESTORE_TIMEOUT
            except _NodeGone:
                self._start()
                lost = "node exited while making its state again; it starts afresh"
            except (ValueError, AttributeError, TypeError):
                lost = "node answered garbage while making its state again"
        if lost is not None:
            _write_all(err_fd, (_JS_COPIED % (self.kind, lost)).encode())

    def run(self, code, env=None):
        fds = []
        try:
            out_fd, err_fd = _output_memfds(fds)
            answer = self._run(code.replace("\0", ""), env or {}, out_fd, err_fd)
            res = _capture_result(out_fd, err_fd)
        finally:
            _close_fds(fds)
        res.update(answer)
        return res

    def _run(self, code, env, out_fd, err_fd):
        if self.proc is None:
            self._start()
            if self.copied:
                self.copied = False
                self._restore(err_fd)
        for fd in self.proc[3:]:  # what callbacks printed between runs is not this run's
            _drain(fd, None)
        try:
            line = self._ask({"code": code, "env": env}, out_fd, err_fd)
        except _NodeGone as e:
            return _js_failure(str(e))
        _drain(self.proc[3], out_fd)
        _drain(self.proc[4], err_fd)
        try:
            answer = json.loads(line.decode("utf-8", "replace"))
        except ValueError:
            self._stop()
            return _js_failure("the javascript kernel (node) answered garbage; it was restarted")
        out = {"result": answer.get("result"), "error": answer.get("error"), "displays": []}
        if isinstance(answer.get("execution_count"), int):
            out["execution_count"] = answer["execution_count"]
        return out


_JS_COPIED = (
    "[branchbox] this %s context is a copy (fork, checkpoint or rollback) of another, whose "
    "top-level names were made again in it; %s\n"
)


def _js_failure(message):
    return {"result": None, "error": {"name": "KernelError", "value": message, "traceback": message}, "displays": []}


def _drain(fd, into):
    """Read what is in the non-blocking pipe ``fd`` now, into fd ``into`` (None: dropped)."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            return
        if not chunk:
            return
        if into is not None:
            _write_all(into, chunk)


def _die_with_parent():
    """In a child before exec: SIGKILL when this server goes (PR_SET_PDEATHSIG)."""
    prctl, ulong = _load_prctl()
    if prctl is not None:
        zero = ulong(0)
        prctl(_PR_SET_PDEATHSIG, ulong(signal.SIGKILL), zero, zero, zero)


# --------------------------------------------------------------------------- server


class Server(object):
    def __init__(self, kind):
        self.interrupts = Interrupts()
        if kind == "python":
            self.kernel = PythonKernel(self.interrupts)
        elif kind == "shell":
            self.kernel = ShellKernel()
        elif kind in ("javascript", "typescript"):
            self.kernel = JavaScriptKernel(kind)
        else:
            raise SystemExit("usage: session server <python|shell|javascript|typescript>")
        self.kind = kind
        try:
            os.set_inheritable(CHANNEL_FD, False)
        except OSError:
            raise SystemExit("session server: fd %d (the daemon channel) is not open" % CHANNEL_FD)
        self.channel = Channel(CHANNEL_FD)
        self.children = set()
        self.reaping = False
        self.template = False  # a snapshot's frozen template (see the module docstring)
        self.template_pid = None  # the template's own pid (a copy forked from outside differs)
        self.saved_cwd = None  # template: cwd at the checkpoint
        self.saved_fds = []  # template: [(fd, path, flags, offset|None, cloexec)]
        self.rebase_cwd = None  # live session: chdir() here before the next request
        self.pending_restore = None  # restored session: (cwd, fds) to re-resolve before the next request
        self.strict_restore = False  # also close what could not be re-resolved (copy in another sandbox)
        self.pending_rechannel = None  # (fd, peer fd): the channel to switch to after this answer
        self.held_peer = None  # the peer of our channel, held for the daemon across a process dump

    def serve(self):
        while True:
            self._reap()
            line, fds = self.channel.read_request()
            if line is None:
                _close_fds(fds)
                return
            self.interrupts.forget()
            try:
                resp = self.handle(line, fds)
            except KeyboardInterrupt:  # only from a SIGINT handler user code installed
                resp = {"error": {"name": "KeyboardInterrupt", "value": "interrupted"}}
            except Exception as exc:  # a bug here must not take the session down
                resp = {"error": _format_error(exc)}
            data = self.channel.encode(resp)
            # Checked after encoding (megabytes of output take a while): a SIGINT counted up
            # to here came before the answer left, so it is this run's.  One that comes
            # between this check and the write cannot be: the answer is decided; it is
            # dropped at the next request like one that came while idle.
            if _is_python_answer(resp) and resp["error"] is None and self.interrupts.take():
                resp["result"] = None
                resp["error"] = _format_error(KeyboardInterrupt(), only=True)
                data = self.channel.encode(resp)
            try:
                self.channel.write(data)
            except OSError:
                return
            if self.pending_rechannel is not None:
                self._switch_channel(*self.pending_rechannel)

    def op_rechannel(self):
        """Before a process dump: the channel becomes one end of a socket pair made here, the
        other end held in this process (a socket made by the daemon, outside the sandbox, could
        not be dumped).  The answer, on the old channel, names the held end; the daemon takes it
        (pidfd_getfd) after the restore, and it is closed here at the next request."""
        if self.template:
            # A template is non-dumpable (sandbox processes must not read or change it); the
            # dump checks, as the sandbox's owner, that it may read the template's namespaces.
            # Non-dumpable again at the first request after the restore.
            _set_dumpable(1)
        a, b = socket.socketpair()
        fds = (a.detach(), b.detach())
        for fd in fds:
            os.set_inheritable(fd, False)
        self.pending_rechannel = fds
        return {"ok": True, "peer_fd": fds[1]}

    def _switch_channel(self, fd, peer):
        self.pending_rechannel = None
        self.channel.close()
        os.dup2(fd, CHANNEL_FD, inheritable=False)
        os.close(fd)
        self.channel = Channel(CHANNEL_FD)
        self.held_peer = peer

    def handle(self, line, fds):
        if self.held_peer is not None:  # the daemon has its own copy by now
            _close_fds([self.held_peer])
            self.held_peer = None
            if self.template:
                _set_dumpable(0)
        try:
            req = json.loads(line)
        except ValueError as exc:
            _close_fds(fds)
            return _protocol_error("bad JSON: %s" % exc)
        if not isinstance(req, dict):
            _close_fds(fds)
            return _protocol_error("request must be a JSON object")
        op = req.get("op")
        reopened = None
        if op != "restored" and self.template and os.getpid() != self.template_pid:
            # A copy forked from outside that was never finished (the daemon sends "restored"
            # before its first request, but a daemon restarted in between does not know):
            # finish it now, closing what it shared with the template's sandbox.
            self.op_restored([], True)
        if op == "rechannel":
            _close_fds(fds)
            resp = self.op_rechannel()
        elif op == "restored":
            resp = self.op_restored(fds, bool(req.get("strict")), req.get("unmap"))
        elif op == "fork":
            # A copy of a restored session gets the restored files; the fd of this request is
            # not one of the objects a strict restore closes.
            self._finish_restore(keep=fds)
            resp = self.op_fork(fds, req.get("role"))
        else:
            _close_fds(fds)
            reopened = self._finish_restore()
            self._rebase()
            if op == "ping":
                resp = {"ok": True, "pid": os.getpid()}
            elif op == "run":
                code = req.get("code")
                env = req.get("env") or {}
                if not isinstance(code, str):
                    resp = _protocol_error('"run" needs a string "code"')
                elif not isinstance(env, dict) or not all(
                    isinstance(k, str) and _env_name_ok(k) and isinstance(v, str) and "\0" not in v
                    for k, v in env.items()
                ):
                    resp = _protocol_error('"env" must map shell identifiers to strings')
                else:
                    resp = self.kernel.run(code, env)
            else:
                resp = _protocol_error("unknown op %r" % (op,))
        if reopened is not None:
            resp["reopened"] = reopened
        if "id" in req:
            resp["id"] = req["id"]
        return resp

    def op_fork(self, fds, role=None):
        if role is not None and role not in FORK_ROLES:
            _close_fds(fds)
            return _protocol_error('unknown fork role %r (expected "template" or "restore")' % (role,))
        if not fds:
            return _protocol_error('"fork" needs one fd passed with SCM_RIGHTS')
        new_fd = fds[0]
        _close_fds(fds[1:])
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        cwd = record = None
        if role == "template" and not self.template:
            # Recorded before the fork: the daemon swaps the root filesystem as soon as this
            # process answered, maybe before the child ran at all.
            cwd = self.rebase_cwd
            if cwd is None:
                try:
                    cwd = os.getcwd()
                except OSError:
                    cwd = "/"
            record = _record_fds(frozenset((0, 1, 2, CHANNEL_FD, new_fd)))
        prepare = getattr(self.kernel, "prepare_copy", None)
        if prepare is not None:
            prepare()
        # gc.freeze(): a collection would write every tracked object's header and so copy
        # the whole heap page by page in whichever process runs it.
        gc.freeze()
        try:
            # A template or a restored copy is a child of our parent (init), not ours: a
            # session process never has another session process below it, so a template is a
            # tree of its own (a process image of it holds it alone) and init reaps them all.
            pid = _fork_beside() if role is not None else os.fork()
        except OSError as exc:
            os.close(new_fd)
            return {"error": {"name": "OSError", "value": "fork failed: %s" % exc}}
        if pid == 0:
            self.channel.close()
            os.dup2(new_fd, CHANNEL_FD, inheritable=False)
            os.close(new_fd)
            self.channel = Channel(CHANNEL_FD)
            self.children = set()
            forget = getattr(self.kernel, "forget_node", None)
            if forget is not None:
                forget()
            if self.reaping:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self.reaping = False
            if role == "template":
                _own_group()
                return self._become_template(cwd, record)
            if role == "restore":
                _own_group()
                return self._become_restored()
            return {"ok": True, "pid": os.getpid()}
        os.close(new_fd)
        made = getattr(self.kernel, "copy_made", None)
        if made is not None:
            made()
        if role is not None:
            # Not our child: the child moves itself; it must have before the daemon, told the
            # child exists, may kill our process group.
            _wait_own_group(pid)
        if cwd is not None:
            self.rebase_cwd = cwd
        if role is not None:
            return {"ok": True, "child": pid}
        self.children.add(pid)
        if not self.reaping:
            # Reap forked sessions as soon as they die, even while we idle in recvmsg.
            # The handler only waits for our own fork children, never for user processes.
            signal.signal(signal.SIGCHLD, self._on_sigchld)
            self.reaping = True
        return {"ok": True, "child": pid}

    def op_restored(self, fds, strict, unmap=None):
        """This process is a copy of a template that the daemon forked from outside (into
        another sandbox): become a live session in place, like a "restore" fork child.  An fd
        sent along becomes stdout and stderr.  With ``strict``, open objects that could not be
        reopened by path in this root (sockets, pipes, files elsewhere: shared with the
        template's sandbox) are closed before the next request.  ``unmap`` = [address, length]
        of a mapping the daemon used while forking the template, removed here."""
        if not self.template:
            _close_fds(fds)
            return _protocol_error('"restored" is only for a copy of a template')
        if isinstance(unmap, list) and len(unmap) == 2 and all(isinstance(v, int) for v in unmap):
            _munmap(unmap[0], unmap[1])
        _after_fork_child()
        if fds:
            for target in (1, 2):
                os.dup2(fds[0], target, inheritable=True)
            _close_fds(fds)
        try:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            if null != 0:
                os.close(null)
        except OSError:
            pass
        self.children = set()
        if self.reaping:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.reaping = False
        _setsid()  # a session of its own in its new sandbox (its pid namespace's first)
        resp = self._become_restored()
        self.strict_restore = strict
        return resp

    def _become_template(self, cwd, record):
        """Fork child of role "template": freeze as the snapshot's template."""
        if not self.template:  # a template of a template copies its record
            self.saved_cwd = cwd
            self.saved_fds = record or []
            self.template = True
        self.template_pid = os.getpid()
        self.rebase_cwd = None
        _set_dumpable(0)
        return {"ok": True, "pid": os.getpid(), "role": "template"}

    def _become_restored(self):
        """Fork child of role "restore": a new live session from a template.

        Answers at once; the cwd and the files are re-resolved by path before the next
        request (the daemon may swap the root filesystem in between)."""
        if self.template:
            _set_dumpable(1)
            self.pending_restore = (self.saved_cwd, self.saved_fds)
            self.rebase_cwd = None
        self.template = False
        self.saved_cwd = None
        self.saved_fds = []
        return {"ok": True, "pid": os.getpid(), "role": "restore"}

    def _finish_restore(self, keep=()):
        """Deferred part of a restore: chdir to the recorded cwd and reopen the recorded
        files by path, in the current root filesystem. Returns how many were reopened.
        ``keep``: fds received with the request being served (never closed here)."""
        pending, self.pending_restore = self.pending_restore, None
        if pending is None:
            return None
        cwd, fds = pending
        try:
            os.chdir(cwd)
        except (OSError, TypeError):
            try:
                os.chdir("/")
            except OSError:
                pass
        done = _reopen_fds(fds)
        if self.strict_restore:
            self.strict_restore = False
            _close_all_but(done | {0, 1, 2, CHANNEL_FD} | set(keep))
        return len(done)

    def _rebase(self):
        """After a checkpoint, re-resolve the cwd by path in the new root filesystem."""
        cwd, self.rebase_cwd = self.rebase_cwd, None
        if cwd is None:
            return
        try:
            os.chdir(cwd)
        except OSError:
            try:
                os.chdir("/")
            except OSError:
                pass

    def _on_sigchld(self, _signum, _frame):
        self._reap()

    def _reap(self):
        # Forked sessions are our children: collect the dead ones so no zombie lingers.
        for pid in list(self.children):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.children.discard(pid)


def _is_python_answer(resp):
    """An answer to a python kind's "run" (the only one with "result")."""
    return "result" in resp and "error" in resp


def main(argv=None):
    argv = sys.argv if argv is None else argv
    kind = argv[1] if len(argv) > 1 else "python"
    _ensure_std_fds()
    _load_prctl()
    server = Server(kind)
    server.serve()
    # Exit without running interpreter shutdown hooks or waiting on user threads.
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
