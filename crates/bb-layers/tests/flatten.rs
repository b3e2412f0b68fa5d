//! Flattening a layer chain (root): the merged view of the flattened layer equals the chain's, also
//! under a further layer with its own whiteouts, opaque dirs and redirects; metadata, xattrs and
//! hard links survive; errors; reflinks on XFS (loop device).

mod common;

use bb_layers::{
    flatten, flatten_onto, mount_overlay, new_writable, supports_reflink, FlattenStats, IdMap, LayersError, OverlaySpec,
};
use common::{require_root, Mounted};
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const BASE: u32 = 1_000_000;

// ---------------------------------------------------------------------------------------------
// Building layers by hand

fn chown(p: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).unwrap();
}

fn chmod(p: &Path, mode: u32) {
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

fn mkdirs(p: &Path) {
    fs::create_dir_all(p).unwrap();
}

fn file(p: &Path, data: &[u8]) {
    mkdirs(p.parent().unwrap());
    fs::write(p, data).unwrap();
    chown(p, BASE, BASE);
}

fn dir(p: &Path) {
    mkdirs(p);
    chown(p, BASE, BASE);
}

fn mknod(p: &Path, kind: libc::mode_t, mode: u32, dev: libc::dev_t) {
    mkdirs(p.parent().unwrap());
    nix::sys::stat::mknod(
        p,
        nix::sys::stat::SFlag::from_bits_truncate(kind),
        nix::sys::stat::Mode::from_bits_truncate(mode),
        dev,
    )
    .unwrap();
    chown(p, BASE, BASE);
    chmod(p, mode); // past the umask
}

fn whiteout(p: &Path) {
    mknod(p, libc::S_IFCHR, 0o000, 0);
}

fn opaque(p: &Path) {
    xattr::set(p, "trusted.overlay.opaque", b"y").unwrap();
}

fn redirect(p: &Path, to: &str) {
    xattr::set(p, "trusted.overlay.redirect", to.as_bytes()).unwrap();
}

fn set_times(p: &Path, atime: (i64, i64), mtime: (i64, i64)) {
    use nix::sys::stat::{utimensat, UtimensatFlags};
    use nix::sys::time::TimeSpec;
    utimensat(
        None,
        p,
        &TimeSpec::new(atime.0, atime.1),
        &TimeSpec::new(mtime.0, mtime.1),
        UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
}

/// `security.capability` v2 with cap_net_raw permitted+effective.
fn caps_v2() -> Vec<u8> {
    let mut v = vec![0u8; 20];
    v[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
    v[4] = 0x20; // bit 13
    v
}

/// Give every entry below `root` a distinct, fixed atime/mtime with nanoseconds (dirs last).
fn stamp_times(root: &Path, seed: i64) {
    let mut entries: Vec<PathBuf> =
        walkdir::WalkDir::new(root).contents_first(true).into_iter().map(|e| e.unwrap().path().to_path_buf()).collect();
    // contents_first already orders children before their dirs.
    for (i, p) in entries.drain(..).enumerate() {
        let i = i as i64;
        set_times(
            &p,
            (1_600_000_000 + seed * 1000 + i, 111_111_111 + i),
            (1_500_000_000 + seed * 1000 + i, 123_456_789 + i),
        );
    }
}

/// The chain below the top layer, bottom first: l1, l2, l3. Plus `t`, a layer to stack on top.
struct Chain {
    l1: PathBuf,
    l2: PathBuf,
    l3: PathBuf,
    t: PathBuf,
}

impl Chain {
    /// The flattened part, TOP-most first.
    fn lower(&self) -> Vec<PathBuf> {
        vec![self.l3.clone(), self.l2.clone(), self.l1.clone()]
    }
}

fn build_chain(d: &Path) -> Chain {
    let l1 = d.join("layers/l1");
    let l2 = d.join("layers/l2");
    let l3 = d.join("layers/l3");
    let t = d.join("layers/t");
    for l in [&l1, &l2, &l3, &t] {
        dir(l);
        chmod(l, 0o755);
    }

    // ---- L1: a small base image
    file(&l1.join("etc/passwd"), b"root:x:0:0:root:/root:/bin/bash\n");
    xattr::set(l1.join("etc/passwd"), "user.x", b"l1").unwrap();
    xattr::set(l1.join("etc"), "user.dir", b"etc-l1").unwrap();
    file(&l1.join("etc/hidden"), b"whited out by l2");
    file(&l1.join("etc/shadow"), b"root:*:19000::::::\n");
    chown(&l1.join("etc/shadow"), BASE, BASE + 42);
    chmod(&l1.join("etc/shadow"), 0o640);
    file(&l1.join("bin/su"), b"#!setuid");
    chmod(&l1.join("bin/su"), 0o4755);
    file(&l1.join("bin/wall"), b"#!setgid");
    chown(&l1.join("bin/wall"), BASE, BASE + 5);
    chmod(&l1.join("bin/wall"), 0o2755);
    file(&l1.join("bin/ping"), b"\x7fELF ping");
    chmod(&l1.join("bin/ping"), 0o755);
    xattr::set(l1.join("bin/ping"), "security.capability", &caps_v2()).unwrap();
    dir(&l1.join("tmp"));
    chmod(&l1.join("tmp"), 0o1777);
    let big: Vec<u8> = (0..(1u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    file(&l1.join("data/big"), &big);
    file(&l1.join("data/empty"), b"");
    file(&l1.join("hl/a"), b"hard-linked three times");
    fs::hard_link(l1.join("hl/a"), l1.join("hl/b")).unwrap();
    dir(&l1.join("other"));
    fs::hard_link(l1.join("hl/a"), l1.join("other/c")).unwrap();
    file(&l1.join("opq/old1"), b"hidden by opaque");
    file(&l1.join("opq/old2"), b"hidden by opaque");
    file(&l1.join("olddir/x"), b"x from l1");
    file(&l1.join("olddir/sub/y"), b"y from l1");
    file(&l1.join("a/deep/f1"), b"f1");
    file(&l1.join("a/deep/g/f2"), b"f2");
    file(&l1.join("a/stay"), b"stay");
    file(&l1.join("dir2file/inner"), b"inner");
    file(&l1.join("file2dir"), b"was a file");
    symlink("etc/passwd", l1.join("rel-link")).unwrap();
    symlink("/etc/passwd", l1.join("abs-link")).unwrap();
    symlink("nowhere/at/all", l1.join("dangling")).unwrap();
    for p in ["rel-link", "abs-link", "dangling"] {
        chown(&l1.join(p), BASE, BASE);
    }
    xattr::set(l1.join("abs-link"), "trusted.bb-test", b"on a symlink").unwrap();
    mknod(&l1.join("run/fifo"), libc::S_IFIFO, 0o620, 0);
    chown(&l1.join("run/fifo"), BASE + 7, BASE + 8);
    mknod(&l1.join("dev/null"), libc::S_IFCHR, 0o666, libc::makedev(1, 3));
    mknod(&l1.join("dev/loopx"), libc::S_IFBLK, 0o660, libc::makedev(7, 200));
    file(&l1.join("home/u/odd"), b"odd owner");
    chown(&l1.join("home/u/odd"), BASE + 1234, BASE + 5678);
    chmod(&l1.join("home/u/odd"), 0o600);
    chown(&l1.join("home/u"), BASE + 1234, BASE + 1234);
    chmod(&l1.join("home/u"), 0o700);
    {
        // A socket: not copied (skipped_sockets).
        let _l = std::os::unix::net::UnixListener::bind(l1.join("run/sock")).unwrap();
    }
    stamp_times(&l1, 1);

    // ---- L2: a snapshot on top of L1
    file(&l2.join("etc/passwd"), b"root:x:0:0:root:/root:/bin/bash\nu:x:1000:1000::/home/u:/bin/sh\n");
    xattr::set(l2.join("etc/passwd"), "user.x", b"l2").unwrap();
    whiteout(&l2.join("etc/hidden"));
    dir(&l2.join("opq"));
    opaque(&l2.join("opq"));
    file(&l2.join("opq/new"), b"new in opaque dir");
    // `mv olddir newdir` (same parent: relative redirect + whiteout of the old name).
    dir(&l2.join("newdir"));
    redirect(&l2.join("newdir"), "olddir");
    file(&l2.join("newdir/added"), b"added after the rename");
    whiteout(&l2.join("olddir"));
    // `mv a/deep b/moved` (other parent: absolute redirect).
    dir(&l2.join("b/moved"));
    redirect(&l2.join("b/moved"), "/a/deep");
    dir(&l2.join("a"));
    whiteout(&l2.join("a/deep"));
    file(&l2.join("dir2file"), b"now a file");
    dir(&l2.join("file2dir"));
    file(&l2.join("file2dir/inside"), b"inside");
    file(&l2.join("l2hl/x"), b"l2 hard link");
    fs::hard_link(l2.join("l2hl/x"), l2.join("l2hl/y")).unwrap();
    // A name with spaces, a newline and colons.
    file(&l2.join("we ird\nna:me"), b"odd name");
    stamp_times(&l2, 2);

    // ---- L3: the newest snapshot of the chain
    whiteout(&l3.join("hl/b")); // one name of the hard-link group disappears
    dir(&l3.join("newdir2"));
    redirect(&l3.join("newdir2"), "newdir"); // a redirect to a redirected dir
    file(&l3.join("newdir2/l3file"), b"l3");
    whiteout(&l3.join("newdir"));
    file(&l3.join("bin/su"), b"#!setuid v2"); // replaced, keeps setuid
    chmod(&l3.join("bin/su"), 0o4750);
    dir(&l3.join("empty-odd"));
    chown(&l3.join("empty-odd"), BASE + 99, BASE + 98);
    chmod(&l3.join("empty-odd"), 0o711);
    dir(&l3.join("data"));
    xattr::set(l3.join("data"), "user.note", b"merged dir xattr from l3").unwrap();
    // A whiteout in a directory no lower layer has (listed by overlay's readdir, not visible).
    file(&l3.join("pure/keep"), b"keep");
    whiteout(&l3.join("pure/wo"));
    // Root attributes come from the top layer.
    chown(&l3, BASE + 1, BASE + 2);
    chmod(&l3, 0o751);
    xattr::set(&l3, "user.root", b"l3 root").unwrap();
    stamp_times(&l3, 3);

    // ---- T: a layer stacked above the chain later, with its own markers.
    whiteout(&t.join("etc/shadow"));
    dir(&t.join("tmp"));
    chmod(&t.join("tmp"), 0o1777);
    opaque(&t.join("tmp"));
    file(&t.join("tmp/fresh"), b"fresh");
    // `mv b/moved c/again` (absolute) and `mv newdir2 renamed` (relative), as overlay records them.
    dir(&t.join("c/again"));
    redirect(&t.join("c/again"), "/b/moved");
    dir(&t.join("b"));
    whiteout(&t.join("b/moved"));
    dir(&t.join("renamed"));
    redirect(&t.join("renamed"), "newdir2");
    whiteout(&t.join("newdir2"));
    file(&t.join("a/new"), b"new in a");
    file(&t.join("other/c"), b"copied up, no longer linked");
    stamp_times(&t, 4);

    Chain { l1, l2, l3, t }
}

// ---------------------------------------------------------------------------------------------
// Comparing merged views

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
    atime: (i64, i64),
    mtime: (i64, i64),
    size: u64,
    rdev: u64,
    link: Option<PathBuf>,
    content: Option<Vec<u8>>,
    xattrs: BTreeMap<OsString, Vec<u8>>,
    /// First path (in sorted order) of this inode's hard-link group, for non-dirs with > 1 name.
    link_group: Option<PathBuf>,
}

fn kind_name(ft: &fs::FileType) -> &'static str {
    if ft.is_dir() {
        "dir"
    } else if ft.is_file() {
        "file"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_fifo() {
        "fifo"
    } else if ft.is_char_device() {
        "chr"
    } else if ft.is_block_device() {
        "blk"
    } else if ft.is_socket() {
        "sock"
    } else {
        "?"
    }
}

/// Every entry below `root` (the root itself as ""), metadata first, contents in a second pass so
/// that reading cannot disturb any atime recorded.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    let mut inodes: HashMap<(u64, u64), Vec<PathBuf>> = HashMap::new();
    for e in walkdir::WalkDir::new(root).sort_by_file_name() {
        let e = e.unwrap();
        let rel = e.path().strip_prefix(root).unwrap().to_path_buf();
        let m = match fs::symlink_metadata(e.path()) {
            Ok(m) => m,
            // Overlay lists whiteouts in a directory only one layer has, but they cannot be looked up.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
            Err(err) => panic!("{}: {err}", e.path().display()),
        };
        let ft = m.file_type();
        let mut xattrs = BTreeMap::new();
        for n in xattr::list(e.path()).unwrap() {
            if let Some(v) = xattr::get(e.path(), &n).unwrap() {
                xattrs.insert(n, v);
            }
        }
        if !ft.is_dir() {
            inodes.entry((m.dev(), m.ino())).or_default().push(rel.clone());
        }
        out.insert(
            rel,
            Entry {
                kind: kind_name(&ft),
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
                // Listing a directory (walkdir does before yielding it) updates its atime.
                atime: if ft.is_dir() { (0, 0) } else { (m.atime(), m.atime_nsec()) },
                mtime: (m.mtime(), m.mtime_nsec()),
                size: if ft.is_dir() { 0 } else { m.len() },
                rdev: m.rdev(),
                link: ft.is_symlink().then(|| fs::read_link(e.path()).unwrap()),
                content: None,
                xattrs,
                link_group: None,
            },
        );
    }
    for names in inodes.values() {
        if names.len() > 1 {
            let first = names.iter().min().unwrap().clone();
            for n in names {
                out.get_mut(n).unwrap().link_group = Some(first.clone());
            }
        }
    }
    for (rel, e) in out.iter_mut() {
        if e.kind == "file" {
            e.content = Some(fs::read(root.join(rel)).unwrap());
        }
    }
    out
}

fn assert_same_tree(what: &str, a: &BTreeMap<PathBuf, Entry>, b: &BTreeMap<PathBuf, Entry>) {
    let mut problems = Vec::new();
    for (p, ea) in a {
        match b.get(p) {
            None => problems.push(format!("/{}: missing in the second view", p.display())),
            Some(eb) if ea != eb => problems.push(format!("/{}:\n  {ea:?}\n  {eb:?}", p.display())),
            _ => {}
        }
    }
    for p in b.keys() {
        if !a.contains_key(p) {
            problems.push(format!("/{}: only in the second view", p.display()));
        }
    }
    assert!(problems.is_empty(), "{what}: views differ:\n{}", problems.join("\n"));
}

/// The root of a layer stack shows the top layer's root: the flattened layer's root must match.
fn assert_same_root(top: &Path, flat: &Path) {
    let a = snapshot_root(top);
    let b = snapshot_root(flat);
    assert_eq!(a, b, "root of {} vs {}", top.display(), flat.display());
}

/// mode, uid, gid, mtime, xattrs.
type RootAttrs = (u32, u32, u32, (i64, i64), BTreeMap<OsString, Vec<u8>>);

fn snapshot_root(p: &Path) -> RootAttrs {
    let m = fs::symlink_metadata(p).unwrap();
    let x = xattr::list(p)
        .unwrap()
        .filter(|n| !n.as_bytes().starts_with(b"trusted.overlay."))
        .map(|n| {
            let v = xattr::get(p, &n).unwrap().unwrap();
            (n, v)
        })
        .collect();
    (m.mode(), m.uid(), m.gid(), (m.mtime(), m.mtime_nsec()), x)
}

fn without_sockets(mut m: BTreeMap<PathBuf, Entry>) -> BTreeMap<PathBuf, Entry> {
    m.retain(|_, e| e.kind != "sock");
    m
}

/// `overlay(lower)` with a fresh empty upper under `dir/<name>`; snapshot of the merged view
/// without its root (whose attributes are the upper dir's; see [`assert_same_root`]).
fn merged_snapshot(dir: &Path, name: &str, lower: &[PathBuf]) -> BTreeMap<PathBuf, Entry> {
    let base = dir.join(name);
    let (upper, work) = new_writable(&base, &IdMap::default()).unwrap();
    let merged = base.join("merged");
    fs::create_dir_all(&merged).unwrap();
    mount_overlay(&OverlaySpec { lower, upper: &upper, work: &work }, &merged).unwrap();
    let m = Mounted(merged);
    let mut snap = snapshot(&m.0);
    drop(m);
    snap.remove(Path::new(""));
    assert!(fs::read_dir(&upper).unwrap().next().is_none(), "reading the view must not copy anything up");
    snap
}

fn raw_tree_has_no_overlay_markers(root: &Path) {
    for e in walkdir::WalkDir::new(root) {
        let e = e.unwrap();
        let m = fs::symlink_metadata(e.path()).unwrap();
        assert!(
            !(m.file_type().is_char_device() && m.rdev() == 0),
            "whiteout left in the flattened layer: {}",
            e.path().display()
        );
        for n in xattr::list(e.path()).unwrap() {
            assert!(!n.as_bytes().starts_with(b"trusted.overlay."), "{} has {n:?}", e.path().display());
        }
    }
}

fn mountinfo_mentions(p: &Path) -> bool {
    fs::read_to_string("/proc/self/mountinfo").unwrap().contains(p.to_str().unwrap())
}

// ---------------------------------------------------------------------------------------------

#[test]
fn flattened_layer_shows_the_same_tree() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let c = build_chain(d.path());
    let dest = d.path().join("layers/flat");
    // Views of the original chain before flattening (flatten must not change the layers).
    let before = merged_snapshot(d.path(), "orig", &c.lower());

    // Directory atimes, checked with lstat only (any listing would change them).
    let atime = |p: &Path| {
        let m = fs::symlink_metadata(p).unwrap();
        (m.atime(), m.atime_nsec())
    };
    let dir_atimes = [
        (c.l3.clone(), PathBuf::new()),
        (c.l1.join("home/u"), PathBuf::from("home/u")),
        (c.l2.join("opq"), PathBuf::from("opq")),
    ]
    .map(|(src, rel)| (atime(&src), rel));

    let t = Instant::now();
    let stats = flatten(&c.lower(), &dest).unwrap();
    eprintln!("flatten: {stats:?} (wall {:?})", t.elapsed());
    for (a, rel) in &dir_atimes {
        assert_eq!(atime(&dest.join(rel)), *a, "atime of dir /{}", rel.display());
    }

    // (a) overlay(layers) == overlay([dest]).
    let flat = merged_snapshot(d.path(), "flat", std::slice::from_ref(&dest));
    let after = merged_snapshot(d.path(), "orig-again", &c.lower());
    assert_same_tree("chain before vs after flatten (layers untouched)", &before, &after);
    assert_same_tree("overlay(l3,l2,l1) vs overlay(flat)", &without_sockets(before.clone()), &flat);
    // And the raw layer itself is a plain tree with the same content.
    let mut raw = snapshot(&dest);
    raw.remove(Path::new(""));
    assert_same_tree("overlay(flat) vs flat dir", &flat, &raw);
    assert_same_root(&c.l3, &dest);
    assert!(!flat.contains_key(Path::new("pure/wo")));
    assert!(flat.contains_key(Path::new("pure/keep")));
    raw_tree_has_no_overlay_markers(&dest);

    // Spot checks, so that a bug in both the overlay and the comparison cannot hide.
    let e = |p: &str| flat.get(Path::new(p)).unwrap_or_else(|| panic!("{p} missing")).clone();
    assert!(!flat.contains_key(Path::new("etc/hidden")));
    assert!(!flat.contains_key(Path::new("olddir")) && !flat.contains_key(Path::new("newdir")));
    assert_eq!(e("newdir2/x").content.unwrap(), b"x from l1");
    assert_eq!(e("newdir2/sub/y").content.unwrap(), b"y from l1");
    assert_eq!(e("newdir2/added").content.unwrap(), b"added after the rename");
    assert_eq!(e("b/moved/g/f2").content.unwrap(), b"f2");
    assert!(!flat.contains_key(Path::new("a/deep")));
    assert_eq!(
        flat.keys().filter(|p| p.starts_with("opq") && p.as_os_str() != "opq").collect::<Vec<_>>(),
        vec![Path::new("opq/new")]
    );
    assert_eq!(e("etc/passwd").xattrs.get(&OsString::from("user.x")).unwrap(), b"l2");
    assert_eq!(e("bin/su").mode, 0o4750);
    assert_eq!(e("bin/wall").mode, 0o2755);
    assert_eq!(e("tmp").mode, 0o1777);
    assert_eq!(e("bin/ping").xattrs.get(&OsString::from("security.capability")).unwrap(), &caps_v2());
    assert_eq!(e("abs-link").xattrs.get(&OsString::from("trusted.bb-test")).unwrap(), b"on a symlink");
    assert_eq!(e("abs-link").link.unwrap(), PathBuf::from("/etc/passwd"));
    assert_eq!((e("home/u/odd").uid, e("home/u/odd").gid), (BASE + 1234, BASE + 5678));
    assert_eq!((e("run/fifo").kind, e("run/fifo").mode), ("fifo", 0o620));
    assert_eq!(e("dev/null").rdev, libc::makedev(1, 3));
    assert_eq!(e("dev/loopx").kind, "blk");
    assert_eq!(e("hl/a").link_group, Some(PathBuf::from("hl/a")));
    assert_eq!(e("other/c").link_group, Some(PathBuf::from("hl/a")));
    assert_eq!(e("l2hl/y").link_group, Some(PathBuf::from("l2hl/x")));
    assert_eq!(e("data").xattrs.get(&OsString::from("user.note")).unwrap(), b"merged dir xattr from l3");
    assert_eq!(e("data").mtime.1 % 1000, before[Path::new("data")].mtime.1 % 1000);
    assert!(e("empty-odd").mtime.1 != 0, "nanoseconds kept");
    let raw = fs::symlink_metadata(dest.join("hl/a")).unwrap();
    assert_eq!(raw.nlink(), 2, "hl/a + other/c (hl/b was whited out)");

    // Stats.
    let files = flat.values().filter(|e| e.kind != "dir").count() as u64;
    let dirs = 1 + flat.values().filter(|e| e.kind == "dir").count() as u64; // + the root
    assert_eq!((stats.files, stats.dirs), (files, dirs), "{stats:?}");
    assert_eq!(stats.hardlinks, 2, "other/c and l2hl/y");
    assert_eq!(stats.skipped_sockets, 1);
    let data_bytes: u64 = flat
        .iter()
        .filter(|(p, e)| e.kind == "file" && e.link_group.iter().all(|g| g == *p))
        .map(|(_, e)| e.size)
        .sum();
    assert_eq!(stats.bytes, data_bytes);
    let reflink = supports_reflink(d.path());
    assert_eq!(stats.reflinked, reflink, "{stats:?}");
    if !reflink {
        assert_eq!(stats.reflinked_files, 0);
        assert!(stats.copied_files > 0);
    }

    // No temp dir next to dest, no mount left behind.
    let leftovers: Vec<_> = fs::read_dir(d.path().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("flatten"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(!fs::read_to_string("/proc/self/mountinfo").unwrap().contains("flatten"));
}

#[test]
fn layers_above_read_the_same_over_the_flattened_layer() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let c = build_chain(d.path());
    let dest = d.path().join("layers/flat");
    flatten(&c.lower(), &dest).unwrap();

    let mut full = vec![c.t.clone()];
    full.extend(c.lower());
    let orig = without_sockets(merged_snapshot(d.path(), "orig", &full));
    let flat = merged_snapshot(d.path(), "flat", &[c.t.clone(), dest.clone()]);
    assert_same_tree("overlay(t,l3,l2,l1) vs overlay(t,flat)", &orig, &flat);

    // T's markers took effect.
    assert!(!flat.contains_key(Path::new("etc/shadow")));
    assert!(flat.contains_key(Path::new("etc/passwd")));
    let tmp: Vec<_> = flat.keys().filter(|p| p.starts_with("tmp")).collect();
    assert_eq!(tmp, vec![Path::new("tmp"), Path::new("tmp/fresh")]);
    assert_eq!(flat[Path::new("c/again/f1")].content.as_deref(), Some(&b"f1"[..]));
    assert_eq!(flat[Path::new("c/again/g/f2")].content.as_deref(), Some(&b"f2"[..]));
    assert!(!flat.contains_key(Path::new("b/moved")));
    assert_eq!(flat[Path::new("renamed/x")].content.as_deref(), Some(&b"x from l1"[..]));
    assert_eq!(flat[Path::new("renamed/l3file")].content.as_deref(), Some(&b"l3"[..]));
    assert!(!flat.contains_key(Path::new("newdir2")));
    assert_eq!(flat[Path::new("a/stay")].content.as_deref(), Some(&b"stay"[..]));
    assert_eq!(flat[Path::new("other/c")].link_group, None);
    assert_eq!(flat[Path::new("hl/a")].link_group, None, "hl/b whited out, other/c copied up");

    // And a sandbox keeps working on top: a writable upper above [t, flat] edits through.
    let base = d.path().join("rw");
    let (upper, work) = new_writable(&base, &IdMap::default()).unwrap();
    let merged = base.join("merged");
    fs::create_dir_all(&merged).unwrap();
    mount_overlay(&OverlaySpec { lower: &[c.t.clone(), dest.clone()], upper: &upper, work: &work }, &merged).unwrap();
    let m = Mounted(merged);
    fs::rename(m.0.join("renamed"), m.0.join("renamed-again")).unwrap();
    assert_eq!(fs::read_to_string(m.0.join("renamed-again/sub/y")).unwrap(), "y from l1");
    fs::write(m.0.join("etc/passwd"), "edited").unwrap();
    assert_eq!(fs::read_to_string(dest.join("etc/passwd")).unwrap().lines().count(), 2);
}

#[test]
fn flatten_of_one_layer_and_of_a_flattened_layer() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let c = build_chain(d.path());
    // Two steps (l2+l1, then l3 + that) give the same result as one.
    let f21 = d.path().join("layers/f21");
    flatten(&[c.l2.clone(), c.l1.clone()], &f21).unwrap();
    let f321 = d.path().join("layers/f321");
    flatten(&[c.l3.clone(), f21.clone()], &f321).unwrap();
    let one_step = d.path().join("layers/one-step");
    flatten(&c.lower(), &one_step).unwrap();
    assert_same_tree("two-step vs one-step flatten", &snapshot(&one_step), &snapshot(&f321));
    assert_same_root(&c.l3, &one_step);
    // One layer: a plain copy of its merged view (markers resolved against nothing).
    let single = d.path().join("layers/single");
    let stats = flatten(std::slice::from_ref(&c.l1), &single).unwrap();
    assert_eq!(stats.skipped_sockets, 1);
    let orig = without_sockets(merged_snapshot(d.path(), "l1", std::slice::from_ref(&c.l1)));
    let mut raw = snapshot(&single);
    raw.remove(Path::new(""));
    assert_same_tree("overlay(l1) vs l1 flattened", &orig, &raw);
    assert_same_root(&c.l1, &single);
    // L3 alone: its whiteouts and redirects resolve against nothing; none is left in the result.
    let single3 = d.path().join("layers/single3");
    flatten(std::slice::from_ref(&c.l3), &single3).unwrap();
    raw_tree_has_no_overlay_markers(&single3);
    let mut raw = snapshot(&single3);
    raw.remove(Path::new(""));
    assert_same_tree(
        "overlay(l3) vs l3 flattened",
        &merged_snapshot(d.path(), "l3", std::slice::from_ref(&c.l3)),
        &raw,
    );
}

fn is_whiteout(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == 0)
}

fn is_opaque(p: &Path) -> bool {
    xattr::get(p, "trusted.overlay.opaque").unwrap().as_deref() == Some(&b"y"[..])
}

#[test]
fn flatten_onto_a_base_writes_only_what_the_layers_change() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let c = build_chain(d.path());
    let base = std::slice::from_ref(&c.l1);
    let orig = merged_snapshot(d.path(), "orig", &c.lower());
    let dest = d.path().join("layers/compact");
    let stats = flatten_onto(&[c.l3.clone(), c.l2.clone()], base, &dest).unwrap();
    eprintln!("flatten_onto: {stats:?}");

    // overlay(l3, l2, l1) == overlay(compact, l1), sockets of the base included.
    let comp = merged_snapshot(d.path(), "compact", &[dest.clone(), c.l1.clone()]);
    assert_same_tree("overlay(l3,l2,l1) vs overlay(compact,l1)", &orig, &comp);
    assert_same_root(&c.l3, &dest);
    // A layer stacked above reads the same (its whiteouts, opaque dirs, redirects).
    let mut full = vec![c.t.clone()];
    full.extend(c.lower());
    assert_same_tree(
        "overlay(t,l3,l2,l1) vs overlay(t,compact,l1)",
        &merged_snapshot(d.path(), "orig-t", &full),
        &merged_snapshot(d.path(), "compact-t", &[c.t.clone(), dest.clone(), c.l1.clone()]),
    );

    // Only the changes are in the layer: nothing the base shows unchanged was copied.
    for p in [
        "data/big",
        "data/empty",
        "bin/ping",
        "bin/wall",
        "etc/shadow",
        "hl/a",
        "other",
        "home",
        "dev",
        "run",
        "a/stay",
        "tmp",
    ] {
        assert!(fs::symlink_metadata(dest.join(p)).is_err(), "/{p} was copied from the base");
    }
    assert!(stats.bytes < 4096, "{} bytes of file data written", stats.bytes);
    assert!(stats.from_base >= 10, "{stats:?}");
    assert_eq!(fs::read(dest.join("bin/su")).unwrap(), b"#!setuid v2");
    assert_eq!(fs::read_to_string(dest.join("etc/passwd")).unwrap().lines().count(), 2);
    // Base names the view does not show are whited out; dirs that must hide the base are opaque.
    for p in ["etc/hidden", "olddir", "a/deep", "hl/b"] {
        assert!(is_whiteout(&dest.join(p)), "/{p} should be a whiteout");
    }
    assert_eq!(stats.whiteouts, 4, "{stats:?}");
    assert!(is_opaque(&dest.join("opq")), "opaque in l2");
    assert!(is_opaque(&dest.join("file2dir")), "a dir over a base file");
    assert!(!is_opaque(&dest.join("etc")) && !is_opaque(&dest.join("data")) && !is_opaque(&dest.join("a")));
    // Renamed dirs are written whole (no redirect left), their base content copied.
    assert_eq!(fs::read(dest.join("newdir2/sub/y")).unwrap(), b"y from l1");
    assert_eq!(fs::read(dest.join("b/moved/g/f2")).unwrap(), b"f2");
    assert!(xattr::get(dest.join("newdir2"), "trusted.overlay.redirect").unwrap().is_none());

    // Compacting a compacted layer again (the next compaction of a chain) gives the same view.
    let c2 = d.path().join("layers/c2");
    flatten_onto(std::slice::from_ref(&c.l2), base, &c2).unwrap();
    let c32 = d.path().join("layers/c32");
    flatten_onto(&[c.l3.clone(), c2.clone()], base, &c32).unwrap();
    assert_same_tree(
        "overlay(l3,l2,l1) vs overlay(flatten_onto(l3, flatten_onto(l2)), l1)",
        &orig,
        &merged_snapshot(d.path(), "c32", &[c32.clone(), c.l1.clone()]),
    );

    // A sandbox goes on above [compact, l1]: renames, edits and deletes work through.
    let rw = d.path().join("rw");
    let (upper, work) = new_writable(&rw, &IdMap::default()).unwrap();
    let merged = rw.join("merged");
    fs::create_dir_all(&merged).unwrap();
    mount_overlay(&OverlaySpec { lower: &[dest.clone(), c.l1.clone()], upper: &upper, work: &work }, &merged).unwrap();
    let m = Mounted(merged);
    fs::rename(m.0.join("newdir2"), m.0.join("again")).unwrap();
    assert_eq!(fs::read_to_string(m.0.join("again/sub/y")).unwrap(), "y from l1");
    fs::remove_file(m.0.join("a/stay")).unwrap();
    assert!(!m.0.join("a/stay").exists() && !m.0.join("a/deep").exists());
    fs::write(m.0.join("data/big"), "small now").unwrap();
    assert_eq!(fs::read(c.l1.join("data/big")).unwrap().len(), 1 << 20, "the base is untouched");
}

#[test]
fn flatten_refuses_bad_destinations_and_cleans_up() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let l = d.path().join("layers/l");
    file(&l.join("f"), b"f");
    let layers = [l.clone()];

    let nonempty = d.path().join("layers/nonempty");
    file(&nonempty.join("x"), b"x");
    let err = flatten(&layers, &nonempty).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, LayersError::InvalidOption { .. }) && msg.contains("not empty") && msg.contains("nonempty"),
        "{msg}"
    );
    assert_eq!(fs::read(nonempty.join("x")).unwrap(), b"x", "left alone");

    let a_file = d.path().join("layers/a-file");
    fs::write(&a_file, "x").unwrap();
    let msg = flatten(&layers, &a_file).unwrap_err().to_string();
    assert!(msg.contains("not a directory"), "{msg}");

    let inside = l.join("sub-dest");
    let msg = flatten(&layers, &inside).unwrap_err().to_string();
    assert!(msg.contains("inside one of the layers"), "{msg}");
    assert!(!inside.exists());

    let msg = flatten(&[], &d.path().join("layers/none")).unwrap_err().to_string();
    assert!(msg.contains("at least one layer"), "{msg}");

    // A missing layer fails at mount time; nothing is left behind.
    let dest = d.path().join("layers/out");
    match flatten(&[l.clone(), d.path().join("layers/missing")], &dest) {
        Err(LayersError::Io { .. }) | Err(LayersError::Mount { .. }) => {}
        other => panic!("expected an error, got {other:?}"),
    }
    assert!(!dest.exists());
    let names: Vec<_> = fs::read_dir(d.path().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains("flatten")), "{names:?}");
    assert!(!mountinfo_mentions(d.path()));

    // An existing empty dir is fine (replaced by the new layer).
    let empty = d.path().join("layers/empty");
    fs::create_dir(&empty).unwrap();
    flatten(&layers, &empty).unwrap();
    assert_eq!(fs::read(empty.join("f")).unwrap(), b"f");
}

// ---------------------------------------------------------------------------------------------
// Reflinks on XFS

fn must_work() -> bool {
    std::env::var("MUST_WORK").is_ok_and(|v| v == "1")
}

fn find_tool(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"].iter().map(|d| Path::new(d).join(name)).find(|p| p.exists())
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!("{cmd:?}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// An XFS filesystem with reflink=1 on a loop device, mounted on a temp dir. Unmounted and
/// detached on drop (also when the test fails).
struct LoopXfs {
    mnt: PathBuf,
    dev: Option<String>,
    mounted: bool,
    _dir: tempfile::TempDir,
}

impl LoopXfs {
    fn new(size_mb: u64) -> Result<LoopXfs, String> {
        let mkfs = find_tool("mkfs.xfs").ok_or("mkfs.xfs not found (apt-get install xfsprogs)")?;
        let losetup = find_tool("losetup").ok_or("losetup not found")?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let img = dir.path().join("xfs.img");
        let f = fs::File::create(&img).map_err(|e| e.to_string())?;
        f.set_len(size_mb << 20).map_err(|e| e.to_string())?;
        drop(f);
        run(Command::new(&mkfs).args(["-q", "-m", "reflink=1", "-f"]).arg(&img))?;
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).map_err(|e| e.to_string())?;
        let mut me = LoopXfs { mnt, dev: None, mounted: false, _dir: dir };
        let dev = run(Command::new(&losetup).args(["--find", "--show"]).arg(&img))?;
        me.dev = Some(dev.clone());
        nix::mount::mount(Some(Path::new(&dev)), &me.mnt, Some("xfs"), nix::mount::MsFlags::empty(), None::<&str>)
            .map_err(|e| format!("mount {dev} (xfs): {e}"))?;
        me.mounted = true;
        Ok(me)
    }
}

impl Drop for LoopXfs {
    fn drop(&mut self) {
        if self.mounted {
            let _ = bb_layers::unmount(&self.mnt);
            // Wait for the lazy unmount to let go of the device before detaching it.
            let _ = nix::mount::umount2(&self.mnt, nix::mount::MntFlags::empty());
        }
        if let (Some(dev), Some(losetup)) = (&self.dev, find_tool("losetup")) {
            for _ in 0..50 {
                if run(Command::new(&losetup).arg("-d").arg(dev)).is_ok() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// Count of `shared` extents `filefrag -v` reports, if filefrag exists.
fn shared_extents(p: &Path) -> Option<usize> {
    let ff = find_tool("filefrag")?;
    let out = run(Command::new(ff).arg("-v").arg(p)).ok()?;
    Some(out.lines().filter(|l| l.contains("shared")).count())
}

#[test]
fn flatten_reflinks_on_xfs() {
    require_root();
    let xfs = match LoopXfs::new(512) {
        Ok(x) => x,
        Err(e) if !must_work() => {
            eprintln!("skipping flatten_reflinks_on_xfs: {e} (set MUST_WORK=1 to make this a failure)");
            return;
        }
        Err(e) => panic!("MUST_WORK=1 but no XFS loop filesystem: {e}"),
    };
    assert!(supports_reflink(&xfs.mnt), "mkfs.xfs -m reflink=1 must give reflinks");
    let c = build_chain(&xfs.mnt);
    // Some bigger data, so that copy vs clone shows in the timing.
    let chunk: Vec<u8> = (0..(8u32 << 20)).map(|i| (i.wrapping_mul(40_503) >> 7) as u8).collect();
    for i in 0..8 {
        file(&c.l1.join(format!("blobs/b{i}")), &chunk);
    }
    let dest = xfs.mnt.join("layers/flat");
    let t = Instant::now();
    let stats: FlattenStats = flatten(&c.lower(), &dest).unwrap();
    eprintln!("flatten on xfs: {stats:?} (wall {:?})", t.elapsed());
    assert!(stats.reflinked, "{stats:?}");
    assert_eq!(stats.copied_files, 0, "{stats:?}");
    assert!(stats.bytes >= 64 << 20);

    let orig = without_sockets(merged_snapshot(&xfs.mnt, "orig", &c.lower()));
    let flat = merged_snapshot(&xfs.mnt, "flat", std::slice::from_ref(&dest));
    assert_same_tree("xfs: overlay(l3,l2,l1) vs overlay(flat)", &orig, &flat);
    if let Some(n) = shared_extents(&dest.join("blobs/b0")) {
        assert!(n > 0, "blobs/b0 should share its extents with l1/blobs/b0");
    }
    drop(xfs);
}

// ---------------------------------------------------------------------------------------------
// Timing on a real tree (manual):
//   BRANCHBOX_FLATTEN_BENCH_SRC=<rootfs dir> cargo test --release -p bb-layers --test flatten \
//     -- --ignored --nocapture flatten_benchmark

/// Snapshot layer made the way a sandbox makes one: a real overlay over `lower`, edited through
/// the merged view, then unmounted; returns the frozen upper.
fn snapshot_layer(dir: &Path, name: &str, lower: &[PathBuf], edit: impl FnOnce(&Path)) -> PathBuf {
    let base = dir.join(name);
    let (upper, work) = new_writable(&base, &IdMap::default()).unwrap();
    let merged = base.join("merged");
    fs::create_dir_all(&merged).unwrap();
    mount_overlay(&OverlaySpec { lower, upper: &upper, work: &work }, &merged).unwrap();
    let m = Mounted(merged);
    edit(&m.0);
    drop(m);
    upper
}

fn files_below(root: &Path, limit: usize) -> Vec<PathBuf> {
    walkdir::WalkDir::new(root)
        .sort_by_file_name()
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().is_file())
        .map(|e| e.path().to_path_buf())
        .take(limit)
        .collect()
}

fn bench_on(label: &str, root: &Path, src: &Path) {
    let layers = root.join("layers");
    fs::create_dir_all(&layers).unwrap();
    let base = layers.join("base");
    let t = Instant::now();
    run(Command::new("cp").arg("-a").arg("--reflink=auto").arg(src).arg(&base)).unwrap();
    eprintln!("[{label}] cp -a of the base: {:?}", t.elapsed());
    let l2 = snapshot_layer(&layers, "s2", std::slice::from_ref(&base), |m| {
        // Edits, deletes (whiteouts), a big directory rename (redirect), new files.
        for (i, f) in files_below(&m.join("etc"), 200).iter().enumerate() {
            if i % 2 == 0 {
                let mut data = fs::read(f).unwrap();
                data.extend_from_slice(b"\n# edited\n");
                fs::write(f, data).unwrap();
            } else {
                fs::remove_file(f).unwrap();
            }
        }
        if m.join("usr/share/doc").is_dir() {
            fs::rename(m.join("usr/share/doc"), m.join("usr/share/doc-renamed")).unwrap();
        }
        fs::create_dir_all(m.join("root/work")).unwrap();
        for i in 0..100 {
            fs::write(m.join(format!("root/work/f{i}")), vec![i as u8; 100_000]).unwrap();
        }
    });
    let l3 = snapshot_layer(&layers, "s3", &[l2.clone(), base.clone()], |m| {
        if m.join("usr/share/doc-renamed").is_dir() {
            fs::rename(m.join("usr/share/doc-renamed"), m.join("opt-doc")).unwrap();
        }
        for f in files_below(&m.join("usr/lib"), 300).iter().step_by(3) {
            fs::remove_file(f).unwrap();
        }
        fs::remove_dir_all(m.join("root/work")).unwrap();
        fs::create_dir_all(m.join("root/work")).unwrap();
        fs::write(m.join("root/work/again"), "opaque now").unwrap();
    });
    let chain = vec![l3, l2, base];
    let dest = layers.join("flat");
    let stats = flatten(&chain, &dest).unwrap();
    let mb = stats.bytes as f64 / (1 << 20) as f64;
    eprintln!(
        "[{label}] flatten of 3 layers: {:?} for {} files, {} dirs, {mb:.1} MiB ({:.0} MiB/s); reflinked={} ({} cloned, {} copied)",
        stats.duration,
        stats.files,
        stats.dirs,
        mb / stats.duration.as_secs_f64(),
        stats.reflinked,
        stats.reflinked_files,
        stats.copied_files
    );
    let t = Instant::now();
    let orig = without_sockets(merged_snapshot(root, "v-orig", &chain));
    let flat = merged_snapshot(root, "v-flat", std::slice::from_ref(&dest));
    assert_same_tree(label, &orig, &flat);
    eprintln!("[{label}] views compared ({} entries) in {:?}", flat.len(), t.elapsed());
}

#[test]
#[ignore = "manual timing; needs BRANCHBOX_FLATTEN_BENCH_SRC"]
fn flatten_benchmark() {
    require_root();
    let Ok(src) = std::env::var("BRANCHBOX_FLATTEN_BENCH_SRC") else {
        eprintln!("set BRANCHBOX_FLATTEN_BENCH_SRC to a root filesystem tree (e.g. a debootstrap layer)");
        return;
    };
    let src = PathBuf::from(src);
    let d = tempfile::Builder::new().prefix("bb-flatten-bench-").tempdir_in("/var/tmp").unwrap();
    bench_on("ext4", d.path(), &src);
    match LoopXfs::new(2048) {
        Ok(x) => bench_on("xfs reflink=1", &x.mnt, &src),
        Err(e) => eprintln!("no XFS run: {e}"),
    }
}
