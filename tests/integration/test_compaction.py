"""Compaction of deep snapshot chains (raw HTTP): the daemon merges the oldest snapshot layers of
a chain deeper than --max-chain (MAX_CHAIN, small in this suite) into one layer in the background.
Every snapshot keeps exactly its files and sessions; the merged layer holds only what the
snapshots changed, not the image; live sandboxes go on with the shorter chain.
"""
import hashlib
import os

from helpers import MAX_CHAIN, STATE, ckpt, py, rollback, sh, wait_until

# Files under /work, an edited image file, a deleted one and a renamed image directory: what a
# snapshot holds, as one digest.
STATE_CMD = (
    "cd / && { find work usr/share/doc/bash* etc/issue etc/motd -exec stat -c '%n %F %a %s' {} + 2>&1 | sort;"
    " find work -type f | sort | xargs -r cat; cat etc/issue; } | sha256sum"
)


def edit(raw, sid, i, marker):
    """Step i of a tree search's edits: a new file, deletes, an image file edited, renames."""
    cmd = "mkdir -p /work/d && echo step-%d > /work/f%d && echo %d >> /work/d/log" % (i, i, i)
    if i == 0:
        cmd += " && : > /work/%s && rm /etc/motd" % marker
    if i % 3 == 2:
        cmd += " && rm /work/f%d" % (i - 1)
    if i % 5 == 4:
        cmd += " && mv /work/d /work/d%d && mkdir /work/d" % i
    if i == 6:
        cmd += " && mv /usr/share/doc/bash /usr/share/doc/bash-moved"
    if i % 4 == 1:
        cmd += " && echo edit-%d >> /etc/issue" % i
    sh(raw, sid, cmd)
    py(raw, sid, "v = %d" % i)


def our_layers(marker):
    """Layer dirs of this test's sandbox: those holding its marker file."""
    root = os.path.join(STATE, "snaplayers")
    return [os.path.join(root, n) for n in os.listdir(root) if os.path.lexists(os.path.join(root, n, "work", marker))]


def test_deep_chains_are_compacted_and_every_snapshot_keeps_its_files_and_sessions(sbx, raw):
    sid = sbx.sandbox_id
    marker = "marker-" + hashlib.sha256(sid.encode()).hexdigest()[:12]
    steps = 4 * MAX_CHAIN + 3
    snaps = []
    for i in range(steps):
        edit(raw, sid, i, marker)
        s = ckpt(raw, sid)
        snaps.append((s["id"], sh(raw, sid, STATE_CMD), i))
    deepest = max(s["depth"] for s in raw.get("/v1/sandboxes/%s/snapshots" % sid).json()["snapshots"])

    # The live chain stays short: once compaction caught up, a checkpoint is at most
    # MAX_CHAIN + 1 deep (the merged layer, the kept ones, the new one).
    wait_until(lambda: ckpt(raw, sid)["depth"] <= MAX_CHAIN + 1, timeout=60, interval=0.3,
               what="a checkpoint on a compacted chain")

    # Merged layers exist (they hold the files of many steps) and hold no image file.
    layers = our_layers(marker)
    merged = [l for l in layers if len([n for n in os.listdir(os.path.join(l, "work")) if n.startswith("f")]) >= 5]
    assert merged, "no layer holds the files of many steps: nothing was compacted (deepest snapshot: %d)" % deepest
    for l in merged:
        assert not os.path.exists(os.path.join(l, "usr", "bin")), "%s copied the image" % l
        # The deleted image file is a whiteout, the renamed image dir is whole.
        st = os.lstat(os.path.join(l, "etc", "motd"))
        assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0, "etc/motd is not a whiteout in %s" % l
        assert os.path.isdir(os.path.join(l, "usr", "share", "doc", "bash-moved"))

    # Every snapshot still holds exactly its files, and its session (newest first: their
    # templates are the least likely to have been evicted).
    for sid_snap, digest, i in reversed(snaps):
        r = rollback(raw, sid, sid_snap)
        assert sh(raw, sid, STATE_CMD) == digest, "snapshot of step %d changed" % i
        if not r.get("sessions_restarted"):
            assert py(raw, sid, "v").get("result") == str(i)

    # A fork of an old snapshot and of a new one: the same files, and they go on on their own.
    for sid_snap, digest, i in (snaps[1], snaps[-2]):
        r = raw.post("/v1/sandboxes/%s/fork" % sid, json={"snapshot": sid_snap})
        assert r.status_code == 201, r.text
        child = r.json()["sandboxes"][0]["id"]
        try:
            assert sh(raw, child, STATE_CMD) == digest
            for j in range(MAX_CHAIN + 2):
                sh(raw, child, "echo child-%d > /work/c%d" % (j, j))
                ckpt(raw, child)
            assert sh(raw, child, "cat /work/c0 /work/c%d" % (MAX_CHAIN + 1)) == "child-0\nchild-%d\n" % (MAX_CHAIN + 1)
        finally:
            raw.delete("/v1/sandboxes/%s" % child)
