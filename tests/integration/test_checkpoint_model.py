"""Model-based property test of checkpoint / rollback / fork (raw HTTP, like test_checkpoint.py).

A seeded random walk builds a tree of snapshots: checkpoints, rollbacks (to snapshots of the same
sandbox or of other sandboxes of the same image) and forks, interleaved with random file operations
under /work (create, overwrite, append, truncate, delete, rename of files and of directories with
contents, chmod, symlinks, hard links, mkdir/rmdir, replacing a name by another type) and random
changes to session state (variables of the default python session; exported and plain variables of
a shell session). Every operation is applied both to the sandbox and to an in-memory model; after
every rollback and fork (and after some checkpoints) the sandbox's file tree digest and every
session variable must equal the model's.

Hard links follow overlayfs (index=off), not POSIX: a checkpoint, a rollback and a fork freeze every
inode into a read-only lower layer, and the first change through one name of a frozen inode copies
that name up to a new inode (content and metadata copied, then the change applied) while its other
names keep the old inode. The model tracks which inodes are frozen (``Model.frozen``) and detaches
a name on every operation that copies it up (``Model.copy_up``): open for writing (shell ``>``,
``>>``; ``truncate``), chmod, rename of the file (``mv``, the file API's rename) and link(2) with
it as the source (the new name joins the copied-up inode). Unlink does not copy up; renaming a
directory does not copy up what it contains (redirect_dir=on); names linked since the last
freeze are in the writable layer and behave like POSIX.

Session expectations: a session comes back with its state after a rollback when its snapshot's
template is alive and was forked in the sandbox being rolled back; otherwise (template evicted or
killed with its sandbox, snapshot of another sandbox, fork children) it restarts fresh, and the
model's variables of that session are reset.

Replay: BRANCHBOX_MODEL_SEED=<seed> (printed on failure; the walk is deterministic given the seed);
BRANCHBOX_MODEL_TREE_OPS sets how many checkpoints + rollbacks + forks to make (default 200);
BRANCHBOX_MODEL_SKIP=kind,... leaves operation kinds out to narrow a failure down (file ops by name:
hardlink, rename, ...; file API ops as api_write, ...; ckpt_after_rollback: no checkpoint taken
right after a rollback). The trace of the last run is written to /tmp/branchbox-model-<seed>.log.
The reduced cases at the end of this file are what the walk found, in a few operations each.
"""
import ast
import base64
import copy
import hashlib
import json
import os
import posixpath
import random
import shlex
import time

import pytest

from helpers import ckpt, rollback

DEFAULT_SEED = 20241122
TREE_OPS = int(os.environ.get("BRANCHBOX_MODEL_TREE_OPS", "200"))
# Op kinds to leave out (comma separated), to narrow a failure down: e.g. "hardlink".
SKIP_OPS = {s for s in os.environ.get("BRANCHBOX_MODEL_SKIP", "").split(",") if s}
MAX_LIVE = 4  # live sandboxes at most (forks beyond it kill a random other one)
MAX_DEPTH = 4  # directory depth new entries are created at (renames may go a little deeper)
MAX_ENTRIES = 70  # beyond it deletes are favoured
ROOT = "/work"
# Names are drawn from a small pool so that names collide across types and operations.
NAMES = ["a", "b", "c", "d", "e", "sub", "x y", "\u00fc-\u00df", ".hidden", "n" * 40, "f.txt", "it's"]
FILE_MODES = [0o644, 0o600, 0o755, 0o700, 0o444, 0o400, 0o640, 0o000, 0o666, 0o777]
DIR_MODES = [0o755, 0o700, 0o750, 0o777, 0o1777, 0o711, 0o555, 0o500]

# Run in the sandbox: {path relative to ROOT ("." for ROOT): entry}; regular files name their
# hard-link group by its smallest path (None when the inode has one name under ROOT).
DIGEST = r"""
import hashlib, json, os, stat, sys
root = sys.argv[1]
out, inodes = {}, {}
def visit(rel):
    p = os.path.join(root, rel) if rel else root
    st = os.lstat(p)
    key = rel or "."
    m = st.st_mode
    if stat.S_ISLNK(m):
        out[key] = ["l", os.readlink(p)]
    elif stat.S_ISDIR(m):
        out[key] = ["d", stat.S_IMODE(m), st.st_uid, st.st_gid]
        for n in sorted(os.listdir(p)):
            visit(rel + "/" + n if rel else n)
    elif stat.S_ISREG(m):
        with open(p, "rb") as f:
            h = hashlib.sha256(f.read()).hexdigest()
        out[key] = ["f", stat.S_IMODE(m), st.st_uid, st.st_gid, st.st_size, h, None]
        inodes.setdefault((st.st_dev, st.st_ino), []).append(key)
    else:
        out[key] = ["other", m]
visit("")
for names in inodes.values():
    if len(names) > 1:
        for n in names:
            out[n][6] = min(names)
json.dump(out, sys.stdout)
"""

PY_VARS = "{k: globals()[k] for k in sorted(globals()) if k.startswith('v_')}"
SHELL_VARS = "env | grep -E '^(BBV_|bbs_)' | LC_ALL=C sort; echo @@vars@@; for n in ${!bbs_@}; do printf '%s=%s\\n' \"$n\" \"${!n}\"; done"


# ----------------------------------------------------------------------------- model


class Model:
    """What one sandbox should hold: the tree under ROOT and its session state."""

    def __init__(self):
        # path relative to ROOT ("" is ROOT) -> ("d", mode) | ("l", target) | ("f", inode)
        self.tree = {"": ("d", 0o755)}
        self.inodes = {}  # inode -> [content bytes, mode]
        self.next_ino = 1
        # Inodes in a read-only lower layer (frozen by the last checkpoint / rollback / fork):
        # copying up one of their names gives that name a new inode (overlayfs, index=off).
        self.frozen = set()
        self.py = {}  # variables of the default python session
        self.shell = None  # {"sid": session id, "env": {exported}, "vars": {plain}} or None

    def digest(self):
        names = {}
        for p, e in self.tree.items():
            if e[0] == "f":
                names.setdefault(e[1], []).append(p)
        out = {}
        for p, e in self.tree.items():
            key = p or "."
            if e[0] == "d":
                out[key] = ["d", e[1], 0, 0]
            elif e[0] == "l":
                out[key] = ["l", e[1]]
            else:
                data, mode = self.inodes[e[1]]
                group = names[e[1]]
                out[key] = ["f", mode, 0, 0, len(data), hashlib.sha256(data).hexdigest(), min(group) if len(group) > 1 else None]
        return out

    def freeze(self):
        """A checkpoint, rollback or fork: every inode is now in a read-only lower layer."""
        self.frozen = {e[1] for e in self.tree.values() if e[0] == "f"}

    def copy_up(self, p):
        """The regular file ``p`` is about to be changed through its name (opened for writing,
        truncated, chmod'ed, renamed, or the source of link(2)): overlayfs copies it up to the
        writable layer first. A frozen inode with other names loses ``p``, which gets a new inode
        with the same content and mode; the other names keep the old one. Returns p's inode."""
        ino = self.tree[p][1]
        if ino not in self.frozen:
            return ino  # already in the writable layer: POSIX semantics
        if sum(1 for e in self.tree.values() if e == ("f", ino)) == 1:
            self.frozen.discard(ino)  # copied up; nothing else shows the difference
            return ino
        new = self.next_ino
        self.next_ino += 1
        data, mode = self.inodes[ino]
        self.inodes[new] = [data, mode]
        self.tree[p] = ("f", new)
        return new

    def reset_sessions(self):
        """Sessions started fresh: same sessions, no state."""
        self.py = {}
        if self.shell is not None:
            self.shell = {"sid": self.shell["sid"], "env": {}, "vars": {}}


def join(parent, name):
    return parent + "/" + name if parent else name


def depth(p):
    return p.count("/") + 1 if p else 0


def q(p):
    return shlex.quote(p)


class Mutator:
    """Random operations: each updates the model and returns the shell line doing the same."""

    def __init__(self, rng, m):
        self.rng = rng
        self.m = m
        self.splits = 0  # names detached from a frozen hard-linked inode by a copy-up

    def copy_up(self, p):
        before = self.m.tree[p]
        ino = self.m.copy_up(p)
        self.splits += self.m.tree[p] != before
        return ino

    # -- helpers
    def entries(self):
        return sorted(p for p in self.m.tree if p)

    def of_type(self, t, include_root=False):
        return sorted(p for p, e in self.m.tree.items() if e[0] == t and (p or include_root))

    def subtree(self, p):
        return [x for x in self.m.tree if x == p or x.startswith(p + "/")]

    def new_path(self, max_depth=MAX_DEPTH):
        dirs = [d for d in self.of_type("d", include_root=True) if depth(d) < max_depth]
        for _ in range(20):
            p = join(self.rng.choice(dirs), self.rng.choice(NAMES))
            if p not in self.m.tree:
                return p
        return None

    def content(self):
        r = self.rng.random()
        n = self.rng.randint(0, 64) if r < 0.5 else self.rng.randint(65, 4096) if r < 0.92 else self.rng.randint(4097, 40000)
        k = self.rng.random()
        if k < 0.5:
            return self.rng.randbytes(n)
        if k < 0.8:
            return bytes(self.rng.choice(b"abcxyz \n") for _ in range(n))
        pat = self.rng.randbytes(self.rng.randint(1, 8))
        return (pat * (n // len(pat) + 1))[:n]

    @staticmethod
    def write_sh(data, redir, p):
        if not data:
            return ": %s %s" % (redir, q(p))
        return "printf %%s %s | base64 -d %s %s" % (base64.b64encode(data).decode(), redir, q(p))

    def new_file(self, p, data):
        ino = self.m.next_ino
        self.m.next_ino += 1
        self.m.inodes[ino] = [data, 0o644]
        self.m.tree[p] = ("f", ino)

    def link_target(self, parent):
        r = self.rng.random()
        entries = self.entries()
        if entries and r < 0.6:
            return posixpath.relpath(self.rng.choice(entries), parent or ".")
        if r < 0.8:
            return "missing/" + self.rng.choice(NAMES)
        if r < 0.9:
            return "../" * self.rng.randint(1, 3) + self.rng.choice(NAMES)
        return "/etc/" + self.rng.choice(["hostname", "passwd", "nope"])

    def remove(self, p):
        for x in self.subtree(p):
            del self.m.tree[x]

    # -- operations: (shell, description) or None when not applicable now
    def op_create(self):
        p = self.new_path()
        if p is None:
            return None
        data = self.content()
        self.new_file(p, data)
        return self.write_sh(data, ">", p), "create %r (%d bytes)" % (p, len(data))

    def op_overwrite(self):
        files = self.of_type("f")
        if not files:
            return None
        p = self.rng.choice(files)
        data = self.content()
        self.m.inodes[self.copy_up(p)][0] = data  # open(O_WRONLY|O_CREAT|O_TRUNC)
        return self.write_sh(data, ">", p), "overwrite %r (%d bytes)" % (p, len(data))

    def op_append(self):
        files = self.of_type("f")
        if not files:
            return None
        p = self.rng.choice(files)
        data = self.content()
        ino = self.m.inodes[self.copy_up(p)]  # open(O_WRONLY|O_CREAT|O_APPEND), even for no data
        ino[0] = ino[0] + data
        return self.write_sh(data, ">>", p), "append %r (%d bytes)" % (p, len(data))

    def op_truncate(self):
        files = self.of_type("f")
        if not files:
            return None
        p = self.rng.choice(files)
        ino = self.m.inodes[self.copy_up(p)]  # truncate(1) opens O_WRONLY|O_CREAT, then ftruncate
        old = len(ino[0])
        r = self.rng.random()
        n = 0 if r < 0.3 else self.rng.randint(0, old) if r < 0.7 else old + self.rng.randint(1, 5000)
        ino[0] = ino[0][:n] + b"\0" * (n - old if n > old else 0)
        return "truncate -s %d -- %s" % (n, q(p)), "truncate %r %d -> %d" % (p, old, n)

    def op_delete(self):
        entries = self.entries()
        if not entries:
            return None
        p = self.rng.choice(entries)
        kind = self.m.tree[p][0]
        n = len(self.subtree(p))
        self.remove(p)
        return "rm -rf -- %s" % q(p), "delete %s %r (%d entries)" % (kind, p, n)

    def pick_rename(self, mv=False):
        """(src, dst) for a rename(2) that succeeds, or None; dst may exist (and is replaced).
        With ``mv``, no symlink replaces or is replaced (mv refuses some as "the same file")."""
        entries = self.entries()
        if not entries:
            return None
        dirs = self.of_type("d")
        src = self.rng.choice(dirs) if dirs and self.rng.random() < 0.5 else self.rng.choice(entries)
        se = self.m.tree[src]
        is_dir = se[0] == "d"
        height = max(depth(x) for x in self.subtree(src)) - depth(src)
        targets = self.of_type("d", include_root=True)
        for _ in range(20):
            parent = self.rng.choice(targets)
            if is_dir and (parent == src or parent.startswith(src + "/")):
                continue
            dst = join(parent, self.rng.choice(NAMES))
            if dst == src or depth(dst) + height > MAX_DEPTH + 2:
                continue
            de = self.m.tree.get(dst)
            if de is not None:
                if is_dir and (de[0] != "d" or len(self.subtree(dst)) > 1):
                    continue  # a directory replaces only an empty directory
                if not is_dir and de[0] == "d":
                    continue
                if de == se:
                    continue  # two names of one inode: POSIX rename(2) does nothing, mv refuses
                if mv and "l" in (de[0], se[0]):
                    continue
            return src, dst
        return None

    def apply_rename(self, src, dst):
        kind = self.m.tree[src][0]
        if kind == "f":
            self.copy_up(src)  # a renamed file is copied up (a directory is not, nor its contents)
        replaced = dst in self.m.tree
        if replaced:
            del self.m.tree[dst]
        for x in sorted(self.subtree(src)):
            self.m.tree[dst + x[len(src):]] = self.m.tree.pop(x)
        return "rename %s %r -> %r%s" % (kind, src, dst, " (replacing)" if replaced else "")

    def op_rename(self):
        got = self.pick_rename(mv=True)
        if got is None:
            return None
        src, dst = got
        return "mv -f -T -- %s %s" % (q(src), q(dst)), self.apply_rename(src, dst)

    def op_chmod(self):
        cands = self.of_type("f") + self.of_type("d", include_root=True)
        p = self.rng.choice(sorted(cands))
        e = self.m.tree[p]
        if e[0] == "f":
            mode = self.rng.choice(FILE_MODES)
            self.m.inodes[self.copy_up(p)][1] = mode  # chmod(1) calls fchmodat even for the same mode
        else:
            mode = self.rng.choice(DIR_MODES)
            self.m.tree[p] = ("d", mode)
        return "chmod %04o -- %s" % (mode, q(p or ".")), "chmod %r %04o" % (p, mode)

    def op_symlink(self):
        p = self.new_path()
        if p is None:
            return None
        target = self.link_target(posixpath.dirname(p))
        self.m.tree[p] = ("l", target)
        return "ln -s -- %s %s" % (q(target), q(p)), "symlink %r -> %r" % (p, target)

    def op_hardlink(self):
        files = self.of_type("f")
        if not files:
            return None
        src = self.rng.choice(files)
        dst = self.new_path()
        if dst is None:
            return None
        self.copy_up(src)  # link(2) copies the source up first: dst joins the copied-up inode
        self.m.tree[dst] = self.m.tree[src]
        return "ln -- %s %s" % (q(src), q(dst)), "hardlink %r -> %r" % (dst, src)

    def op_mkdir(self):
        p = self.new_path()
        if p is None:
            return None
        self.m.tree[p] = ("d", 0o755)
        return "mkdir -- %s" % q(p), "mkdir %r" % p

    def op_rmdir(self):
        empty = [d for d in self.of_type("d") if len(self.subtree(d)) == 1]
        if not empty:
            return None
        p = self.rng.choice(empty)
        del self.m.tree[p]
        return "rmdir -- %s" % q(p), "rmdir %r" % p

    def op_retype(self):
        """Delete a name and create it again as another type (file -> dir, dir -> file, ...)."""
        entries = self.entries()
        if not entries:
            return None
        p = self.rng.choice(entries)
        old = self.m.tree[p][0]
        new = self.rng.choice([t for t in "fdl" if t != old])
        self.remove(p)
        if new == "d":
            self.m.tree[p] = ("d", 0o755)
            make = "mkdir -- %s" % q(p)
        elif new == "f":
            data = self.content()
            self.new_file(p, data)
            make = self.write_sh(data, ">", p)
        else:
            target = self.link_target(posixpath.dirname(p))
            self.m.tree[p] = ("l", target)
            make = "ln -s -- %s %s" % (q(target), q(p))
        return "rm -rf -- %s && %s" % (q(p), make), "retype %r %s -> %s" % (p, old, new)

    # -- the same through the daemon's file API (host-side view of the sandbox's root):
    #    ({"method", "url", "params", "json", "content"}, description)
    def api_write(self):
        """PUT: a new inode renamed over the name (hard links of the old one keep it); the mode
        is the given one, else the replaced regular file's, else 0644; parents are created."""
        r = self.rng.random()
        files, links = self.of_type("f"), self.of_type("l")
        if files and r < 0.5:
            p = self.rng.choice(files)
        elif links and r < 0.6:
            p = self.rng.choice(links)
        else:
            p = self.new_path()
            if p is None:
                return None
            if self.rng.random() < 0.3:
                self.m.tree[p] = ("d", 0o755)  # created as a parent
                p = join(p, self.rng.choice(NAMES))
        old = self.m.tree.get(p)
        mode = self.rng.choice(FILE_MODES) if self.rng.random() < 0.3 else None
        keep = self.m.inodes[old[1]][1] if old is not None and old[0] == "f" else 0o644
        data = self.content()
        self.new_file(p, data)
        self.m.inodes[self.m.tree[p][1]][1] = keep if mode is None else mode
        params = {"path": ROOT + "/" + p}
        if mode is not None:
            params["mode"] = "%04o" % mode
        return {"method": "PUT", "url": "files", "params": params, "content": data}, "api write %r (%d bytes, mode %s)" % (
            p, len(data), "kept" if mode is None else "%04o" % mode)

    def api_mkdir(self):
        p = self.new_path()
        if p is None:
            return None
        self.m.tree[p] = ("d", 0o755)
        if self.rng.random() < 0.3:
            p = join(p, self.rng.choice(NAMES))
            self.m.tree[p] = ("d", 0o755)
        return {"method": "POST", "url": "files/mkdir", "json": {"path": ROOT + "/" + p, "parents": True}}, "api mkdir -p %r" % p

    def api_rename(self):
        got = self.pick_rename()
        if got is None:
            return None
        src, dst = got
        body = {"from": ROOT + "/" + src, "to": ROOT + "/" + dst}
        return {"method": "POST", "url": "files/rename", "json": body}, "api " + self.apply_rename(src, dst)

    def api_remove(self):
        entries = self.entries()
        if not entries:
            return None
        p = self.rng.choice(entries)
        kind = self.m.tree[p][0]
        self.remove(p)
        params = {"path": ROOT + "/" + p, "recursive": "true" if kind == "d" else "false"}
        return {"method": "DELETE", "url": "files", "params": params}, "api remove %s %r" % (kind, p)

    WEIGHTS = {
        "create": 14, "overwrite": 8, "append": 6, "truncate": 6, "delete": 6, "rename": 10,
        "chmod": 6, "symlink": 5, "hardlink": 6, "mkdir": 8, "rmdir": 2, "retype": 5,
    }

    API_WEIGHTS = {"write": 10, "mkdir": 3, "rename": 5, "remove": 3}

    def random_ops(self, n, api=False):
        """``n`` random shell lines (or file API requests with ``api``) and their descriptions."""
        lines, descs = [], []
        prefix = "api_" if api else "op_"
        table = self.API_WEIGHTS if api else self.WEIGHTS
        weights = {k: w for k, w in table.items() if prefix + k not in SKIP_OPS and k not in SKIP_OPS}
        if len(self.m.tree) > MAX_ENTRIES:
            big = "remove" if api else "delete"
            weights = dict(weights, **{big: weights.get(big, 0) + 30})
        kinds = sorted(weights)
        while len(lines) < n:
            kind = self.rng.choices(kinds, [weights[k] for k in kinds])[0]
            got = getattr(self, prefix + kind)()
            if got is not None:
                lines.append(got[0])
                descs.append(got[1])
        return lines, descs


def rand_value(rng, depth=0):
    r = rng.random()
    if r < 0.25:
        return rng.choice([0, 1, -7, 2**64 + rng.randint(0, 99), rng.randint(-10**6, 10**6)])
    if r < 0.45:
        return "".join(rng.choice("abc XYZ'\"\\\n\u00e9\u4e2d") for _ in range(rng.randint(0, 12)))
    if r < 0.55:
        return rng.choice([None, True, False, 0.5, rng.random()])
    if r < 0.6:
        return rng.randbytes(rng.randint(0, 6))
    if depth >= 2:
        return rng.randint(0, 9)
    if r < 0.8:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.9:
        return tuple(rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    return {"k%d" % i: rand_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def py_changes(rng, vars_):
    """Python statements changing v_* variables (applied to ``vars_`` too)."""
    stmts = []
    for _ in range(rng.randint(1, 4)):
        name = "v_%d" % rng.randrange(8)
        r = rng.random()
        cur = vars_.get(name)
        if cur is not None and r < 0.2:
            stmts.append("del %s" % name)
            del vars_[name]
        elif isinstance(cur, list) and r < 0.5:
            v = rand_value(rng, 1)
            stmts.append("%s.append(%r)" % (name, v))
            cur.append(v)
        elif type(cur) is int and r < 0.6:
            k = rng.randint(-5, 5)
            stmts.append("%s += %d" % (name, k))
            vars_[name] = cur + k
        else:
            v = rand_value(rng)
            stmts.append("%s = %r" % (name, v))
            vars_[name] = copy.deepcopy(v)
    return "\n".join(stmts)


def shell_changes(rng, sh):
    """Shell lines exporting / setting / unsetting variables (applied to ``sh`` too)."""
    lines = []
    for _ in range(rng.randint(1, 3)):
        exported = rng.random() < 0.5
        name = ("BBV_%d" if exported else "bbs_%d") % rng.randrange(5)
        store = sh["env"] if exported else sh["vars"]
        if name in store and rng.random() < 0.3:
            lines.append("unset %s" % name)
            del store[name]
        else:
            value = "".join(rng.choice("ab Z09_.:=+-'\"$\\*\u00e9") for _ in range(rng.randint(0, 10)))
            lines.append("%s%s=%s" % ("export " if exported else "", name, shlex.quote(value)))
            store[name] = value
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the walk


class Failure(AssertionError):
    pass


class Walk:
    def __init__(self, raw, seed):
        self.raw = raw
        self.seed = seed
        self.rng = random.Random(seed)
        self.live = {}  # sandbox id -> Model, in creation order (ids are random: never sort them)
        self.created = []  # every sandbox id made (for clean-up)
        self.nodes = []  # {"snap", "sandbox", "model"}
        self.snaps = []  # every snapshot id made (for clean-up)
        # snapshot -> sandbox its session templates were forked in: the sandbox checkpointed, or
        # for a lightweight snapshot (nothing changed since the last checkpoint or rollback) the
        # one of the snapshot it shares.
        self.tpl_owner = {}
        self.trace = []
        self.step = 0
        self.counts = {"checkpoint": 0, "rollback": 0, "fork": 0, "mutate": 0, "verify": 0, "delete_snapshot": 0, "kill": 0,
                       "sessions_restored": 0, "sessions_fresh": 0, "lightweight": 0, "max_depth": 0, "fork_now": 0,
                       "link_splits": 0}

    # -- plumbing
    def log(self, msg):
        self.trace.append("[%d] %s" % (self.step, msg))

    def fail(self, msg):
        raise Failure(msg)

    def call(self, method, path, body=None, status=(200,), params=None, content=None):
        r = self.raw.request(method, path, json=body, params=params, content=content)
        if r.status_code not in status:
            self.fail("%s %s -> HTTP %d: %s" % (method, path, r.status_code, r.text[:1000]))
        return r.json() if r.content else None

    def run(self, sid, args, stdin=None):
        body = {"args": args, "timeout": 120}
        if stdin is not None:
            body["stdin"] = stdin
        return self.call("POST", "/v1/sandboxes/%s/commands" % sid, body)

    def code(self, sid, src):
        res = self.call("POST", "/v1/sandboxes/%s/code" % sid, {"code": src, "timeout": 60})
        if res.get("error") is not None or res.get("timed_out"):
            self.fail("python session in %s failed on %r: %r" % (sid, src, res))
        return res

    def shell_run(self, sid, ssid, src):
        res = self.call("POST", "/v1/sandboxes/%s/sessions/%s/run" % (sid, ssid), {"code": src, "timeout": 60})
        if res.get("timed_out"):
            self.fail("shell session %s in %s timed out on %r" % (ssid, sid, src))
        return res

    # -- verification
    def verify(self, sid, what):
        m = self.live[sid]
        self.counts["verify"] += 1
        res = self.run(sid, ["python3", "-c", DIGEST, ROOT])
        if res["exit_code"] != 0:
            self.fail("%s: digest failed in %s: %r" % (what, sid, res))
        got, want = json.loads(res["stdout"]), m.digest()
        if got != want:
            lines = []
            for p in sorted(set(got) | set(want)):
                if got.get(p) != want.get(p):
                    lines.append("  %r: sandbox %s | model %s" % (p, got.get(p), want.get(p)))
            self.fail("%s: files of %s differ from the model (%d paths):\n%s" % (what, sid, len(lines), "\n".join(lines)))
        self.verify_file_api(sid, m, what)
        res = self.code(sid, PY_VARS)
        got = ast.literal_eval(res["result"])
        if got != m.py:
            self.fail("%s: python variables of %s are %r, model %r" % (what, sid, got, m.py))
        sessions = self.call("GET", "/v1/sandboxes/%s/sessions" % sid)["sessions"]
        shells = sorted(s["id"] for s in sessions if s["kind"] == "shell")
        want_shells = [m.shell["sid"]] if m.shell else []
        if shells != want_shells:
            self.fail("%s: shell sessions of %s are %r, model %r" % (what, sid, shells, want_shells))
        if m.shell:
            out = self.shell_run(sid, m.shell["sid"], SHELL_VARS)["stdout"]
            lines = out.splitlines()  # values have no newline and no "@"
            sep = lines.index("@@vars@@")
            env = dict(line.split("=", 1) for line in lines[:sep])
            vars_ = dict(line.split("=", 1) for line in lines[sep + 1:])
            if (env, vars_) != (m.shell["env"], m.shell["vars"]):
                self.fail("%s: shell variables of %s are env=%r vars=%r, model env=%r vars=%r"
                          % (what, sid, env, vars_, m.shell["env"], m.shell["vars"]))

    def verify_file_api(self, sid, m, what):
        """The daemon's host-side view (file API) shows the same tree as the sandbox's processes."""
        entries = self.call("GET", "/v1/sandboxes/%s/files/list" % sid, params={"path": ROOT, "depth": 32})["entries"]
        got = {}
        for e in entries:
            rel = e["path"][len(ROOT) + 1:]
            if e["type"] == "symlink":
                got[rel] = ("l", e["symlink_target"])
            elif e["type"] == "dir":
                got[rel] = ("d", e["mode"])
            elif e["type"] == "file":
                got[rel] = ("f", e["mode"], e["size"])
            else:
                got[rel] = (e["type"],)
        want = {}
        for p, e in m.tree.items():
            if p:
                want[p] = ("f", m.inodes[e[1]][1], len(m.inodes[e[1]][0])) if e[0] == "f" else e
        if got != want:
            lines = ["  %r: file API %s | model %s" % (p, got.get(p), want.get(p))
                     for p in sorted(set(got) | set(want)) if got.get(p) != want.get(p)]
            self.fail("%s: file API listing of %s differs from the model:\n%s" % (what, sid, "\n".join(lines)))
        files = sorted(p for p, e in m.tree.items() if e[0] == "f")
        for p in self.rng.sample(files, min(2, len(files))):
            r = self.raw.get("/v1/sandboxes/%s/files" % sid, params={"path": ROOT + "/" + p})
            if r.status_code != 200 or r.content != m.inodes[m.tree[p][1]][0]:
                self.fail("%s: file API read of %r in %s: HTTP %d, %d bytes, model %d bytes"
                          % (what, p, sid, r.status_code, len(r.content), len(m.inodes[m.tree[p][1]][0])))

    # -- steps
    def pick_live(self):
        return self.rng.choice(list(self.live))

    def pick_node(self, prefer_sandbox=None):
        """A random node, biased to recent ones and (if given) to one sandbox's."""
        nodes = self.nodes
        if prefer_sandbox and self.rng.random() < 0.5:
            # Snapshots taken in it or whose session templates live in it (those restore sessions).
            own = [n for n in nodes if prefer_sandbox in (n["sandbox"], self.tpl_owner.get(n["snap"]))]
            nodes = own or nodes
        if self.rng.random() < 0.6:
            nodes = nodes[-8:]
        return self.rng.choice(nodes)

    def create(self):
        info = self.call("POST", "/v1/sandboxes", {"image": "base", "timeout": 1800, "memory_mb": 1024}, status=(201,))
        sid = info["id"]
        self.created.append(sid)
        res = self.run(sid, ["/bin/sh", "-c", "mkdir -p %s && chmod 0755 %s" % (ROOT, ROOT)])
        assert res["exit_code"] == 0, res
        self.live[sid] = Model()
        self.log("create %s" % sid)
        return sid

    def mutate(self):
        sid = self.pick_live()
        m = self.live[sid]
        self.counts["mutate"] += 1
        mut = Mutator(self.rng, m)
        if self.rng.random() < 0.25:
            reqs, descs = mut.random_ops(self.rng.randint(1, 4), api=True)
            self.log("mutate %s: %s" % (sid, "; ".join(descs)))
            for req, desc in zip(reqs, descs):
                url = "/v1/sandboxes/%s/%s" % (sid, req["url"])
                r = self.raw.request(req["method"], url, params=req.get("params"), json=req.get("json"), content=req.get("content"))
                if r.status_code not in (200, 201):
                    self.fail("%s in %s: HTTP %d: %s" % (desc, sid, r.status_code, r.text[:500]))
        else:
            lines, descs = mut.random_ops(self.rng.randint(1, 6))
            self.log("mutate %s: %s" % (sid, "; ".join(descs)))
            script = "set -e\numask 022\ncd %s\n%s\n" % (ROOT, "\n".join(lines))
            res = self.run(sid, ["/bin/sh", "-s"], stdin=script)
            if res["exit_code"] != 0 or res["stderr"]:
                self.fail("mutation script failed in %s: exit %r, stderr %r\nops: %s"
                          % (sid, res["exit_code"], res["stderr"], "; ".join(descs)))
        self.counts["link_splits"] += mut.splits
        r = self.rng.random()
        if r < 0.4:
            src = py_changes(self.rng, m.py)
            self.log("python %s: %s" % (sid, src.replace("\n", "; ")))
            self.code(sid, src)
        elif r < 0.6 and m.shell:
            src = shell_changes(self.rng, m.shell)
            self.log("shell %s: %s" % (sid, src.replace("\n", "; ")))
            res = self.shell_run(sid, m.shell["sid"], src)
            if res.get("exit_code") != 0:
                self.fail("shell run failed: %r" % res)
        elif r < 0.66 and not m.shell:
            info = self.call("POST", "/v1/sandboxes/%s/sessions" % sid, {"kind": "shell"}, status=(201,))
            m.shell = {"sid": info["id"], "env": {}, "vars": {}}
            self.log("shell session %s in %s" % (info["id"], sid))
        elif r < 0.68 and m.shell:
            self.call("DELETE", "/v1/sandboxes/%s/sessions/%s" % (sid, m.shell["sid"]))
            self.log("kill shell session %s in %s" % (m.shell["sid"], sid))
            m.shell = None

    def checkpoint(self, sid=None):
        sid = sid or self.pick_live()
        snap = self.call("POST", "/v1/sandboxes/%s/checkpoint" % sid, {}, status=(201,))
        self.counts["checkpoint"] += 1
        self.add_node(snap, sid)
        self.counts["max_depth"] = max(self.counts["max_depth"], snap["depth"])
        self.log("checkpoint %s -> %s%s (depth %d)" % (sid, snap["id"], " lightweight" if snap["lightweight"] else "", snap["depth"]))
        if self.rng.random() < 0.3:
            self.verify(sid, "live state after checkpoint %s" % snap["id"])

    def add_node(self, snap, sid):
        """Record a snapshot just taken of ``sid`` (``snap``: its SnapshotInfo)."""
        self.snaps.append(snap["id"])
        self.live[sid].freeze()  # the writable layer became the snapshot's top lower layer
        node = {"snap": snap["id"], "sandbox": sid, "model": copy.deepcopy(self.live[sid])}
        self.nodes.append(node)
        self.tpl_owner[snap["id"]] = self.tpl_owner.get(snap["parent"]) if snap["lightweight"] else sid
        self.counts["lightweight"] += bool(snap["lightweight"])
        return node

    def expected_sessions(self, node, sid):
        """Sessions of ``node``'s snapshot rolled back into ``sid``: a session comes back with its
        state when its template is alive and lives in ``sid``; otherwise it starts fresh."""
        info = self.call("GET", "/v1/snapshots/%s" % node["snap"])
        restored = {s["id"]: s["template"] and self.tpl_owner.get(node["snap"]) == sid for s in info["sessions"]}
        m = node["model"]
        if m.shell and m.shell["sid"] not in restored:
            self.fail("snapshot %s lacks the shell session %s: %r" % (node["snap"], m.shell["sid"], info["sessions"]))
        default = [s["id"] for s in info["sessions"] if s["default"]]
        if m.py and not default:
            self.fail("snapshot %s has python variables in the model but no default session: %r" % (node["snap"], info["sessions"]))
        return restored, default

    def rollback(self):
        sid = self.pick_live()
        node = self.pick_node(prefer_sandbox=sid)
        restored, default = self.expected_sessions(node, sid)
        res = self.call("POST", "/v1/sandboxes/%s/rollback" % sid, {"snapshot": node["snap"]})
        self.counts["rollback"] += 1
        m = copy.deepcopy(node["model"])
        m.freeze()  # a fresh writable layer over the snapshot's layers
        if not all(restored[d] for d in default):
            m.py = {}
        if m.shell and not restored[m.shell["sid"]]:
            m.shell = {"sid": m.shell["sid"], "env": {}, "vars": {}}
        n_fresh = sum(1 for v in restored.values() if not v)
        self.counts["sessions_restored"] += len(restored) - n_fresh
        self.counts["sessions_fresh"] += n_fresh
        self.live[sid] = m
        self.log("rollback %s to %s (taken in %s, templates of %s; sessions %r; restarted %r)"
                 % (sid, node["snap"], node["sandbox"], self.tpl_owner.get(node["snap"]), restored, res["sessions_restarted"]))
        if res["sessions_restarted"] != (n_fresh > 0):
            self.fail("rollback of %s to %s: sessions_restarted=%r, expected %r (sessions %r)"
                      % (sid, node["snap"], res["sessions_restarted"], n_fresh > 0, restored))
        if "ckpt_after_rollback" not in SKIP_OPS and self.rng.random() < 0.3:
            # Checkpoint the untouched rolled-back state (verifying first would run session code):
            # this snapshot shares the one rolled back to.
            self.checkpoint(sid)
        self.verify(sid, "after rollback of %s to %s" % (sid, node["snap"]))

    def kill(self, sid):
        self.call("DELETE", "/v1/sandboxes/%s" % sid)
        del self.live[sid]
        self.counts["kill"] += 1
        self.log("kill %s" % sid)

    def fork(self):
        count = 2 if self.rng.random() < 0.2 else 1
        if self.rng.random() < 0.25:
            # Fork the current state: the fork takes a checkpoint first.
            src, node = self.pick_live(), None
        else:
            node = self.pick_node()
            src = node["sandbox"] if node["sandbox"] in self.live else self.pick_live()
        while len(self.live) + count > MAX_LIVE:
            self.kill(self.rng.choice([s for s in self.live if s != src]))
        body = {"count": count, "timeout": 1800}
        if node is not None:
            body["snapshot"] = node["snap"]
        res = self.call("POST", "/v1/sandboxes/%s/fork" % src, body, status=(201,))
        self.counts["fork"] += 1
        kids = [c["id"] for c in res["sandboxes"]]
        self.created.extend(kids)
        if node is None:
            self.counts["fork_now"] += 1
            node = self.add_node(self.call("GET", "/v1/snapshots/%s" % res["snapshot"]), src)
        elif res["snapshot"] != node["snap"]:
            self.fail("fork of %s answered snapshot %s" % (node["snap"], res["snapshot"]))
        self.log("fork %s from %s (taken in %s) -> %s (sessions_restarted %r)"
                 % (src, node["snap"], node["sandbox"], kids, res["sessions_restarted"]))
        if len(kids) != count:
            self.fail("fork made %d sandboxes, asked %d" % (len(kids), count))
        for k in kids:
            m = copy.deepcopy(node["model"])
            m.freeze()  # a fresh writable layer over the snapshot's layers
            if res["sessions_restarted"]:
                m.reset_sessions()
            self.live[k] = m
            self.verify(k, "fork child %s of %s" % (k, node["snap"]))

    def delete_snapshot(self):
        node = self.rng.choice(self.nodes[:-1])
        self.call("DELETE", "/v1/snapshots/%s" % node["snap"], status=(200, 204))
        self.nodes.remove(node)
        self.counts["delete_snapshot"] += 1
        self.log("delete snapshot %s" % node["snap"])

    def tree_ops(self):
        return self.counts["checkpoint"] + self.counts["rollback"] + self.counts["fork"]

    def walk(self, target):
        self.create()
        self.mutate()
        self.checkpoint()
        steps = ["mutate", "checkpoint", "rollback", "fork", "delete_snapshot"]
        weights = [45, 25, 18, 9, 3]
        while self.tree_ops() < target:
            self.step += 1
            kind = self.rng.choices(steps, weights)[0]
            if kind == "delete_snapshot" and len(self.nodes) < 10:
                kind = "mutate"
            getattr(self, kind)()
        for sid in list(self.live):
            self.verify(sid, "final state of %s" % sid)

    def cleanup(self):
        for sid in self.created:
            try:
                self.raw.delete("/v1/sandboxes/%s" % sid)
            except Exception:
                pass
        for snap in self.snaps:
            try:
                self.raw.delete("/v1/snapshots/%s" % snap)
            except Exception:
                pass


def test_random_snapshot_tree_matches_model(raw):
    seed = int(os.environ.get("BRANCHBOX_MODEL_SEED", DEFAULT_SEED))
    w = Walk(raw, seed)
    t0 = time.monotonic()
    trace_file = "/tmp/branchbox-model-%d.log" % seed
    try:
        w.walk(TREE_OPS)
    except Exception as e:
        tail = "\n".join(w.trace[-40:])
        raise AssertionError(
            "model test failed (replay with BRANCHBOX_MODEL_SEED=%d%s) at step %d: %s\n"
            "last operations (full trace in %s):\n%s" % (seed, ", BRANCHBOX_MODEL_SKIP=" + ",".join(sorted(SKIP_OPS)) if SKIP_OPS else "",
                                                         w.step, e, trace_file, tail)
        ) from e
    finally:
        with open(trace_file, "w") as f:
            f.write("\n".join(w.trace) + "\n")
        w.cleanup()
    print("seed %d: %d steps, %r, %.1fs" % (seed, w.step, w.counts, time.monotonic() - t0))
    assert w.tree_ops() >= TREE_OPS


# ----------------------------------------------------------------------------- reduced cases
# Minimal reproductions of what the random walk found (raw HTTP, few operations).


def _sh(raw, sid, cmd):
    r = raw.post("/v1/sandboxes/%s/commands" % sid, json={"cmd": cmd, "timeout": 30})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.json()
    return r.json()["stdout"]


def _py(raw, sid, code):
    r = raw.post("/v1/sandboxes/%s/code" % sid, json={"code": code})
    assert r.status_code == 200, r.text
    assert r.json().get("error") is None, r.json()
    return r.json().get("result")


def test_hard_links_across_a_checkpoint_follow_overlayfs(sbx, raw):
    """The walk's first find, which is the kernel's semantics, not a bug: after a checkpoint a
    hard-link pair is in a read-only lower layer, and overlayfs (index=off, like Docker's overlay2)
    copies up only the name changed through (write, append, truncate, chmod, rename, link source);
    the other names keep the old inode. Names linked since the last checkpoint behave like POSIX."""
    sid = sbx.sandbox_id
    _sh(raw, sid, "mkdir /work && cd /work && echo one > a && ln a b && echo m > c && ln c d && echo e > e && ln e f"
                  " && ln e f2 && echo g > g && ln g h && echo i > i && ln i j && echo k > k && ln k l")
    snap = ckpt(raw, sid)["id"]
    try:
        same = "cd /work && set -- %s && for p in %s; do [ $1 -ef $p ] && printf 1 || printf 0; shift; done; echo"
        # A copy-up of one name detaches it; the other name keeps the old inode, content and mode.
        _sh(raw, sid, "cd /work && echo two >> a && chmod 600 c && truncate -s 0 g && mv i i2 && ln k k2")
        assert _sh(raw, sid, "cd /work && cat a b; stat -c %a c d; wc -c < g; wc -c < h; cat i2 j") == (
            "one\ntwo\none\n600\n644\n0\n2\ni\ni\n")
        assert _sh(raw, sid, same % ("b d h j l k2", "a c g i2 k k")) == "000001\n"
        # Reading and unlinking a name copy nothing up: e and f stay one inode.
        _sh(raw, sid, "cd /work && cat e f >/dev/null && rm f2")
        assert _sh(raw, sid, same % ("e", "f")) == "1\n"
        # Links made since the checkpoint (k and k2 after the copy-up, the new pair m, n) are in
        # the writable layer: POSIX.
        _sh(raw, sid, "cd /work && echo more >> k2 && echo m > m && ln m n && chmod 700 n")
        assert _sh(raw, sid, "cd /work && cat k l; stat -c %a m") == "k\nmore\nk\n700\n"
        # The next checkpoint freezes them in turn.
        snap2 = ckpt(raw, sid)["id"]
        try:
            _sh(raw, sid, "cd /work && echo x >> m")
            assert _sh(raw, sid, "cd /work && cat m n; [ m -ef n ] || echo split") == "m\nx\nm\nsplit\n"
        finally:
            raw.delete("/v1/snapshots/%s" % snap2)
    finally:
        raw.delete("/v1/snapshots/%s" % snap)


def test_lightweight_snapshot_after_foreign_rollback_keeps_fresh_sessions(make_sandbox, raw):
    """A rollback whose sessions restarted fresh leaves the sandbox dirty: the next checkpoint is
    a full one with the fresh sessions, not a lightweight copy of the rolled-back-to snapshot
    (whose templates hold the old state)."""
    a = make_sandbox().sandbox_id
    b = make_sandbox().sandbox_id
    _py(raw, a, "x = 1")
    x = ckpt(raw, a)["id"]
    snaps = [x]
    try:
        rollback(raw, b, x)  # x's templates live in a: b's session starts fresh (sessions_restarted)
        y = ckpt(raw, b)
        assert not y["lightweight"], "b's sessions are not x's: y must have its own templates"
        snaps.append(y["id"])
        rollback(raw, a, y["id"])
        # b's session had no `x` when y was taken.
        assert _py(raw, a, "'x' in globals()") == "False"
    finally:
        for s in snaps:
            raw.delete("/v1/snapshots/%s" % s)
