//! Overlay mounting (root): merged views, the snapshot pattern (an upper reused as a lower),
//! error reporting, writable layer setup, reflink detection.

mod common;

use bb_layers::{mount_overlay, new_writable, overlay_fd, supports_reflink, unmount, IdMap, LayersError, OverlaySpec};
use common::{require_root, Mounted};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

fn mkfile(p: &Path, data: &str) {
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, data).unwrap();
}

/// lower + fresh upper/work pair under `dir/<name>`, mounted on `dir/<name>/merged`.
fn mount_stack(dir: &Path, name: &str, lower: &[PathBuf]) -> (Mounted, PathBuf) {
    let base = dir.join(name);
    let (upper, work) = new_writable(&base, &IdMap::default()).unwrap();
    let merged = base.join("merged");
    fs::create_dir_all(&merged).unwrap();
    let t = Instant::now();
    mount_overlay(&OverlaySpec { lower, upper: &upper, work: &work }, &merged).unwrap();
    eprintln!("mount_overlay({} lowers) took {:?}", lower.len(), t.elapsed());
    (Mounted(merged), upper)
}

#[test]
fn merged_view_and_unmount() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let (l1, l2) = (d.path().join("l1"), d.path().join("l2"));
    mkfile(&l1.join("a"), "a1");
    mkfile(&l1.join("b"), "b1");
    mkfile(&l2.join("b"), "b2");
    let (m, upper) = mount_stack(d.path(), "s", &[l2.clone(), l1.clone()]);
    assert_eq!(fs::read_to_string(m.0.join("a")).unwrap(), "a1");
    assert_eq!(fs::read_to_string(m.0.join("b")).unwrap(), "b2", "first lower is the top-most");
    fs::write(m.0.join("c"), "new").unwrap();
    assert_eq!(fs::read_to_string(upper.join("c")).unwrap(), "new");
    let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mi.lines().find(|l| l.contains(m.0.to_str().unwrap())).expect("mounted");
    // mountinfo lists non-default options only (index/metacopy/xino off are the defaults here).
    for opt in ["redirect_dir=on", "nodev", "lowerdir+="] {
        assert!(line.contains(opt), "{opt} missing in {line}");
    }
    for opt in ["metacopy=on", "index=on", "xino=on", "xino=auto"] {
        assert!(!line.contains(opt), "{opt} in {line}");
    }
    unmount(&m.0).unwrap();
    assert!(!m.0.join("a").exists());
    unmount(&m.0).unwrap(); // not mounted any more: still Ok
    unmount(&d.path().join("does-not-exist")).unwrap();
}

/// The super options (the field after the filesystem type and source) of the mountinfo line
/// whose mount point is `target`.
fn super_options(target: &Path) -> String {
    let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mi
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(target.to_str().unwrap()))
        .unwrap_or_else(|| panic!("{} is not in mountinfo", target.display()));
    let (_, after) = line.split_once(" - ").unwrap();
    after.splitn(3, ' ').nth(2).unwrap().to_string()
}

/// A sandbox reads its root's options in /proc/self/mountinfo: they must not name the host's
/// state dir. Laid out like a real state dir, mounted with overlay_fd as the daemon does.
#[test]
fn overlay_options_show_no_host_path() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state-dir-7f3a");
    let layers: Vec<PathBuf> =
        ["sha256:aa", "local:bb", "sl-cc"].iter().map(|n| state.join("layers").join(n)).collect();
    for (i, l) in layers.iter().enumerate() {
        mkfile(&l.join(format!("f{i}")), &format!("layer {i}"));
    }
    let (upper, work) = new_writable(&state.join("sandboxes/sb1"), &IdMap::default()).unwrap();
    let spec = OverlaySpec { lower: &layers, upper: &upper, work: &work };
    let mnt = overlay_fd(&spec, &state.join("sandboxes/sb1/rootfs")).unwrap();
    let target = d.path().join("attached");
    fs::create_dir(&target).unwrap();
    bb_sys::mount_api::move_mount_to(std::os::fd::AsFd::as_fd(&mnt), &target).unwrap();
    let m = Mounted(target.clone());
    let opts = super_options(&target);

    // The mount is the stack it was asked for ...
    for i in 0..layers.len() {
        assert_eq!(fs::read_to_string(m.0.join(format!("f{i}"))).unwrap(), format!("layer {i}"));
    }
    fs::write(m.0.join("new"), "n").unwrap();
    assert_eq!(fs::read_to_string(upper.join("new")).unwrap(), "n");
    // ... and its options say nothing of where its dirs live.
    for leak in [d.path().to_str().unwrap(), "state-dir-7f3a", "layers", "sandboxes", "sha256", "sb1"] {
        assert!(!opts.contains(leak), "{leak:?} in {opts}");
    }
    let named: Vec<&str> = opts
        .split(',')
        .filter(|o| o.starts_with("lowerdir") || o.starts_with("upperdir=") || o.starts_with("workdir="))
        .collect();
    assert_eq!(named.len(), layers.len() + 2, "{opts}");
    for o in &named {
        assert!(o.ends_with("=."), "{o} in {opts}");
    }
    assert!(opts.contains("redirect_dir=on"), "{opts}");
    drop(m);
    drop(mnt);
}

/// The snapshot pattern: freeze a sandbox's upper and stack it as a lower of a new overlay. A
/// directory renamed in the first overlay (redirect_dir=on, so the rename is a redirect, not a
/// copy) must read correctly through the second and third.
#[test]
fn upper_reused_as_lower_keeps_renames_deletes_and_edits() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let l1 = d.path().join("l1");
    mkfile(&l1.join("d/x"), "x");
    mkfile(&l1.join("d/sub/y"), "y");
    mkfile(&l1.join("keep"), "keep");
    mkfile(&l1.join("del"), "del");
    mkfile(&l1.join("edit"), "old");
    mkfile(&l1.join("tree/t1"), "t1");

    let (m1, u1) = mount_stack(d.path(), "s1", std::slice::from_ref(&l1));
    fs::rename(m1.0.join("d"), m1.0.join("e")).expect("rename of a merged dir (needs redirect_dir=on)");
    fs::remove_file(m1.0.join("del")).unwrap();
    fs::write(m1.0.join("edit"), "new").unwrap();
    fs::remove_dir_all(m1.0.join("tree")).unwrap();
    fs::create_dir(m1.0.join("tree")).unwrap(); // re-created: opaque
    mkfile(&m1.0.join("tree/t2"), "t2");
    unmount(&m1.0).unwrap();
    // The rename really was recorded as a redirect, not as a copy of the directory.
    assert!(xattr::get(u1.join("e"), "trusted.overlay.redirect").unwrap().is_some());
    assert!(!u1.join("e/x").exists(), "e/x must come from l1 via the redirect");

    let (m2, u2) = mount_stack(d.path(), "s2", &[u1.clone(), l1.clone()]);
    let r = &m2.0;
    assert_eq!(fs::read_to_string(r.join("e/x")).unwrap(), "x");
    assert_eq!(fs::read_to_string(r.join("e/sub/y")).unwrap(), "y");
    assert!(!r.join("d").exists());
    assert!(!r.join("del").exists());
    assert_eq!(fs::read_to_string(r.join("edit")).unwrap(), "new");
    assert_eq!(fs::read_to_string(r.join("keep")).unwrap(), "keep");
    let mut t: Vec<_> = fs::read_dir(r.join("tree")).unwrap().map(|e| e.unwrap().file_name()).collect();
    t.sort();
    assert_eq!(t, vec!["t2"]);
    // Rename the redirected dir again, and move a file out of it.
    fs::rename(r.join("e"), r.join("f")).unwrap();
    fs::rename(r.join("f/x"), r.join("x-moved")).unwrap();
    unmount(r).unwrap();

    let (m3, _u3) = mount_stack(d.path(), "s3", &[u2, u1, l1]);
    let r = &m3.0;
    assert!(!r.join("e").exists() && !r.join("d").exists());
    assert_eq!(fs::read_to_string(r.join("f/sub/y")).unwrap(), "y");
    assert!(!r.join("f/x").exists());
    assert_eq!(fs::read_to_string(r.join("x-moved")).unwrap(), "x");
    assert_eq!(fs::read_to_string(r.join("edit")).unwrap(), "new");
}

#[test]
fn mount_errors_name_the_step() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let (upper, work) = new_writable(&d.path().join("w"), &IdMap::default()).unwrap();
    let target = d.path().join("merged");
    fs::create_dir(&target).unwrap();
    let missing = [d.path().join("no-such-layer")];
    match mount_overlay(&OverlaySpec { lower: &missing, upper: &upper, work: &work }, &target) {
        Err(e @ LayersError::Mount { step: "fsconfig(lowerdir+)", .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("no-such-layer"), "{msg}");
        }
        other => panic!("expected a lowerdir+ failure, got {other:?}"),
    }
    let lower = [d.path().join("l")];
    fs::create_dir(&lower[0]).unwrap();
    match mount_overlay(&OverlaySpec { lower: &lower, upper: &upper, work: &work }, &d.path().join("no-target")) {
        Err(LayersError::Mount { step: "move_mount", .. }) => {}
        other => panic!("expected a move_mount failure, got {other:?}"),
    }
    match mount_overlay(&OverlaySpec { lower: &[], upper: &upper, work: &work }, &target) {
        Err(LayersError::Mount { .. }) => {}
        other => panic!("expected an error for no lowers, got {other:?}"),
    }
}

#[test]
fn new_writable_owns_upper_and_refuses_reuse() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let idmap = IdMap { host_base: 3_000_000, size: 65_536 };
    let (upper, work) = new_writable(&d.path().join("sb/rw"), &idmap).unwrap();
    let m = fs::metadata(&upper).unwrap();
    assert_eq!((m.uid(), m.gid(), m.permissions().mode() & 0o7777), (3_000_000, 3_000_000, 0o755));
    assert!(work.is_dir());
    // Empty: may be called again.
    new_writable(&d.path().join("sb/rw"), &idmap).unwrap();
    fs::write(upper.join("f"), "x").unwrap();
    assert!(matches!(new_writable(&d.path().join("sb/rw"), &idmap), Err(LayersError::NotEmpty { .. })));
}

#[test]
fn reflink_detection_matches_filesystem() {
    let d = tempfile::tempdir().unwrap();
    let st = nix::sys::statfs::statfs(d.path()).unwrap();
    let t = st.filesystem_type();
    let expected = if t == nix::sys::statfs::BTRFS_SUPER_MAGIC {
        Some(true)
    } else if t == nix::sys::statfs::EXT4_SUPER_MAGIC || t == nix::sys::statfs::TMPFS_MAGIC {
        Some(false)
    } else {
        None // xfs: depends on mkfs options
    };
    let got = supports_reflink(d.path());
    if let Some(e) = expected {
        assert_eq!(got, e, "filesystem type {t:?}");
    }
    let shm = Path::new("/dev/shm");
    if nix::sys::statfs::statfs(shm).is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC) {
        assert!(!supports_reflink(shm), "tmpfs cannot reflink");
    }
}
