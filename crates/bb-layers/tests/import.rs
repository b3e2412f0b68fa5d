//! Importing synthetic docker-save and OCI images (root): stored layers, merged overlay view,
//! sharing, removal, rejection of unsafe layers.

mod common;

use bb_layers::{IdMap, ImageStore, LayersError, Progress};
use common::*;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Three layers exercising whiteouts, an opaque dir, ownership, setuid, links and a device node.
fn three_layers() -> Vec<Vec<u8>> {
    let l1 = LayerTar::new()
        .dir("etc/")
        .file("etc/passwd", "root:x:0:0::/root:/bin/sh\n")
        .file("etc/keep", "will be deleted")
        .dir("opq/")
        .file("opq/a", "a")
        .file("opq/b", "b")
        .dir("gone/")
        .file("gone/f", "f")
        .dir("home/")
        .entry("home/user/", tar::EntryType::Directory, 0o700, 1000, b"", None)
        .file_owned("home/user/notes", "n", 0o600, 1000)
        .file_owned("bin/su", "suid", 0o4755, 0)
        .hardlink("bin/su2", "bin/su")
        .symlink("bin/sh", "/bin/busybox")
        .chardev("dev/null")
        .build();
    let l2 = LayerTar::new()
        .whiteout("etc", "keep")
        .file("etc/new", "new")
        .opaque("opq")
        .file("opq/c", "c")
        .whiteout("", "gone")
        .build();
    let l3 = LayerTar::new().file("etc/passwd", "root:x:0:0::/root:/bin/bash\n").file("top", "3").build();
    vec![l1, l2, l3]
}

fn open_store(state: &Path) -> ImageStore {
    ImageStore::open(state, IdMap::default()).unwrap()
}

fn check_merged_view(root: &Path) {
    assert_eq!(fs::read_to_string(root.join("etc/passwd")).unwrap(), "root:x:0:0::/root:/bin/bash\n", "top layer wins");
    assert!(!root.join("etc/keep").exists(), "whiteout hides the lower file");
    assert_eq!(fs::read_to_string(root.join("etc/new")).unwrap(), "new");
    let mut opq: Vec<String> =
        fs::read_dir(root.join("opq")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    opq.sort();
    assert_eq!(opq, vec!["c"], "opaque dir hides the lower contents");
    assert!(!root.join("gone").exists(), "whiteout hides the lower dir");
    assert_eq!(fs::read_to_string(root.join("top")).unwrap(), "3");
    let su = fs::metadata(root.join("bin/su")).unwrap();
    assert_eq!(su.permissions().mode() & 0o7777, 0o4755);
    assert_eq!(su.uid(), 1_000_000);
    assert_eq!(fs::metadata(root.join("home/user/notes")).unwrap().uid(), 1_001_000);
    assert_eq!(fs::read_link(root.join("bin/sh")).unwrap(), Path::new("/bin/busybox"));
    assert!(!root.join("dev/null").exists(), "device nodes are not imported");
    let mut top: Vec<String> =
        fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    top.sort();
    assert!(top.iter().all(|n| !n.starts_with(".wh.")), "{top:?}");
}

#[test]
fn docker_save_import_stores_shifted_layers_and_mounts() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let store = open_store(&state);
    let img = TestImage::new(three_layers());
    let tarball = d.path().join("image.tar");
    write_docker_save(&tarball, &img, &[Comp::None, Comp::Gzip, Comp::None]);

    let mut events = Vec::new();
    let t = Instant::now();
    let got = store.import("test", &tarball, &mut |p| events.push(p)).unwrap();
    eprintln!("docker-save import: {:?}", t.elapsed());
    assert_eq!(got.layers, img.diff_ids(), "layers are keyed by diff_id, bottom first");
    assert_eq!(got.id, img.id());
    assert_eq!(got.env, img.env);
    assert_eq!(got.cmd, vec!["/bin/sh", "-c", "echo hi"], "entrypoint + cmd");
    assert_eq!(got.workdir.as_deref(), Some("/work"));
    assert_eq!(got.source, "oci");
    assert!(got.size_bytes > 0);
    assert_eq!(store.get("test").unwrap(), got);
    assert!(events.contains(&Progress::Step { stage: "extract".into(), done: 3, total: 3 }), "{events:?}");
    assert!(tmp_entries(&state).is_empty(), "work dirs cleaned: {:?}", tmp_entries(&state));

    // On disk: ownership shifted (layer roots included), whiteouts, opaque xattr.
    let l1 = store.layer_path(&got.layers[0]);
    let l2 = store.layer_path(&got.layers[1]);
    for l in &got.layers {
        let m = fs::metadata(store.layer_path(l)).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1_000_000, 1_000_000, 0o755), "layer root {l}");
    }
    assert_eq!(fs::metadata(l1.join("etc/passwd")).unwrap().uid(), 1_000_000);
    assert_eq!(fs::metadata(l1.join("home/user")).unwrap().uid(), 1_001_000);
    assert_eq!(fs::metadata(l1.join("bin/su")).unwrap().ino(), fs::metadata(l1.join("bin/su2")).unwrap().ino());
    let wh = fs::symlink_metadata(l2.join("etc/keep")).unwrap();
    assert_eq!((wh.mode() & libc::S_IFMT, wh.rdev(), wh.uid()), (libc::S_IFCHR, 0, 1_000_000));
    assert_eq!(xattr::get(l2.join("opq"), "trusted.overlay.opaque").unwrap(), Some(b"y".to_vec()));

    let m = common::mount_image(&store, &got, d.path());
    check_merged_view(&m.0);
}

#[test]
fn oci_layout_dir_and_archive_share_layers() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let store = open_store(&state);
    let img = TestImage::new(three_layers());
    let layout = d.path().join("layout");
    write_oci_layout(&layout, &img, &[Comp::Gzip, Comp::Zstd, Comp::None], true);

    let t = Instant::now();
    let a = store.import("from-dir", &layout, &mut |_| {}).unwrap();
    eprintln!("OCI layout import: {:?}", t.elapsed());
    assert_eq!(a.layers, img.diff_ids());
    assert_eq!(a.id, img.id());
    assert_eq!(a.cmd, vec!["/bin/sh", "-c", "echo hi"]);

    // Same image as an OCI archive (tar of the layout), gzip-compressed as a whole.
    let archive = d.path().join("layout.tar");
    tar_dir(&layout, &archive);
    let gz = d.path().join("layout.tar.gz");
    fs::write(&gz, compress(&fs::read(&archive).unwrap(), Comp::Gzip)).unwrap();
    let mut shared = 0;
    let b = store
        .import("from-archive", &gz, &mut |p| {
            if let Progress::Stage { message, .. } = &p {
                shared += message.contains("already stored") as usize;
            }
        })
        .unwrap();
    assert_eq!(b.layers, a.layers);
    assert_eq!(shared, 3, "every layer reused, none unpacked again");
    assert_eq!(stored_layers(&state).len(), 3, "each layer stored once");
    assert!(tmp_entries(&state).is_empty(), "{:?}", tmp_entries(&state));
    let mut names: Vec<String> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    names.sort();
    assert_eq!(names, vec!["from-archive", "from-dir"]);

    let m = common::mount_image(&store, &b, d.path());
    check_merged_view(&m.0);
}

#[test]
fn shared_layers_are_stored_once_and_removed_when_unreferenced() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let mut store = open_store(&state);
    let base = LayerTar::new().file("etc/os-release", "ID=test\n").build();
    let a_top = LayerTar::new().file("a", "a").build();
    let b_top = LayerTar::new().file("b", "b").build();
    let img_a = TestImage::new(vec![base.clone(), a_top]);
    let img_b = TestImage::new(vec![base.clone(), b_top]);
    let (ta, tb) = (d.path().join("a.tar"), d.path().join("b.tar"));
    write_docker_save(&ta, &img_a, &[]);
    write_oci_layout(&d.path().join("b"), &img_b, &[Comp::Zstd, Comp::Gzip], false);
    tar_dir(&d.path().join("b"), &tb);

    let a = store.import("a", &ta, &mut |_| {}).unwrap();
    let b = store.import("b", &tb, &mut |_| {}).unwrap();
    assert_eq!(a.layers[0], b.layers[0]);
    assert_eq!(stored_layers(&state).len(), 3);

    store.remove("a").unwrap();
    assert!(matches!(store.get("a"), Err(LayersError::NotFound { .. })));
    let left = stored_layers(&state);
    assert_eq!(left.len(), 2, "a's own layer removed, the shared one kept: {left:?}");
    assert!(store.layer_path(&b.layers[0]).is_dir() && store.layer_path(&b.layers[1]).is_dir());
    assert!(!store.layer_path(&a.layers[1]).exists());

    // Re-importing `b` under the same name with a different top layer replaces it and drops the
    // old top layer; the shared base stays.
    let b2_img = TestImage::new(vec![base, LayerTar::new().file("b", "b2").build()]);
    let tb2 = d.path().join("b2.tar");
    write_docker_save(&tb2, &b2_img, &[Comp::Gzip, Comp::Gzip]);
    let b2 = store.import("b", &tb2, &mut |_| {}).unwrap();
    assert_eq!(store.list().unwrap().len(), 1);
    assert!(!store.layer_path(&b.layers[1]).exists(), "replaced image's unique layer removed");
    assert!(store.layer_path(&b2.layers[0]).is_dir() && store.layer_path(&b2.layers[1]).is_dir());

    // A layer still mounted by a sandbox survives removal until gc finds it unused.
    let busy = Arc::new(AtomicBool::new(true));
    let flag = busy.clone();
    let watched = b2.layers[1].clone();
    store.set_layer_in_use_check(move |id| id == watched && flag.load(Ordering::SeqCst));
    store.remove("b").unwrap();
    assert_eq!(stored_layers(&state), vec![b2.layers[1].clone()]);
    assert!(store.gc().unwrap().is_empty());
    busy.store(false, Ordering::SeqCst);
    assert_eq!(store.gc().unwrap(), vec![b2.layers[1].clone()]);
    assert!(stored_layers(&state).is_empty());
    assert!(store.list().unwrap().is_empty());
    // Removed layers were moved to tmp/trash-* and are deleted by a background thread.
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while !tmp_entries(&state).is_empty() && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(tmp_entries(&state).is_empty(), "{:?}", tmp_entries(&state));
}

#[test]
fn unsafe_layers_are_rejected_and_leave_nothing_behind() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let store = open_store(&state);
    // Escape targets are a decoy dir and a file name that does not exist in /etc, so a regression
    // fails the test without damaging the host.
    let decoy = d.path().join("decoy");
    fs::create_dir(&decoy).unwrap();
    fs::write(decoy.join("passwd"), "decoy").unwrap();
    let dp = decoy.to_str().unwrap();
    let marker = format!("bb-import-escape-{}", std::process::id());
    let good = LayerTar::new().file("ok", "ok").build();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("dotdot", LayerTar::new().file("x", "x").file(&format!("../../{marker}"), "evil").build()),
        ("absolute", LayerTar::new().file(&format!("/tmp/{marker}"), "evil").build()),
        ("symlink", LayerTar::new().symlink("a", dp).file("a/passwd", "evil").build()),
        ("symlink-etc", LayerTar::new().symlink("a", "/etc").file(&format!("a/{marker}"), "evil").build()),
        ("hardlink", LayerTar::new().symlink("a", dp).hardlink("h", "a/passwd").build()),
    ];
    for (what, bad) in cases {
        // The good layer comes first, so a partial import would have stored it.
        let img = TestImage::new(vec![good.clone(), bad]);
        let p = d.path().join(format!("{what}.tar"));
        write_docker_save(&p, &img, &[]);
        match store.import(what, &p, &mut |_| {}) {
            Err(e @ LayersError::UnsafeEntry { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("refusing to import"), "{msg}");
            }
            other => panic!("{what}: expected UnsafeEntry, got {other:?}"),
        }
        assert!(matches!(store.get(what), Err(LayersError::NotFound { .. })));
        assert!(stored_layers(&state).is_empty(), "{what}: layers left: {:?}", stored_layers(&state));
        assert!(tmp_entries(&state).is_empty(), "{what}: tmp left: {:?}", tmp_entries(&state));
    }
    let leaked = Path::new("/etc").join(&marker);
    if leaked.exists() {
        let _ = fs::remove_file(&leaked);
        panic!("wrote through a symlink into /etc");
    }
    assert_eq!(fs::read_to_string(decoy.join("passwd")).unwrap(), "decoy");
    assert_eq!(fs::read_dir(&decoy).unwrap().count(), 1);
    assert!(!Path::new("/tmp").join(&marker).exists());
    assert!(!d.path().join(&marker).exists() && !state.join(&marker).exists());
}

#[test]
fn corrupt_and_unsupported_sources_are_reported() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let store = open_store(&state);

    // diff_id that does not match the layer content.
    let mut img = TestImage::new(vec![LayerTar::new().file("f", "1").build()]);
    let real = img.layers[0].clone();
    img.layers[0] = LayerTar::new().file("f", "2").build();
    let diff_ids = vec![format!("sha256:{}", sha256_hex(&real))];
    let layout = d.path().join("bad-digest");
    write_oci_layout(&layout, &img, &[Comp::Gzip], false);
    // Rewrite the config so it claims the other layer's diff_id (and re-point the manifest).
    rewrite_diff_ids(&layout, &diff_ids);
    assert!(matches!(store.import("x", &layout, &mut |_| {}), Err(LayersError::DigestMismatch { .. })));
    assert!(stored_layers(&state).is_empty() && tmp_entries(&state).is_empty());

    let junk = d.path().join("junk.bin");
    fs::write(&junk, b"definitely not an image").unwrap();
    let e = store.import("x", &junk, &mut |_| {}).unwrap_err();
    assert!(matches!(e, LayersError::UnsupportedSource { .. }), "{e:?}");
    assert!(e.to_string().contains("docker save"), "{e}");
    let e = store.import("x", &d.path().join("missing.tar"), &mut |_| {}).unwrap_err();
    assert!(matches!(e, LayersError::UnsupportedSource { .. }), "{e:?}");
    assert!(matches!(store.import("bad name", &junk, &mut |_| {}), Err(LayersError::InvalidName { .. })));

    // Out-of-range owner: tells the user to rebuild with ids below 65536.
    let img = TestImage::new(vec![LayerTar::new().file_owned("f", "x", 0o644, 100_000).build()]);
    let p = d.path().join("uid.tar");
    write_docker_save(&p, &img, &[]);
    let e = store.import("x", &p, &mut |_| {}).unwrap_err();
    assert!(matches!(e, LayersError::IdOutOfRange { id: 100_000, .. }), "{e:?}");
    assert!(stored_layers(&state).is_empty() && tmp_entries(&state).is_empty());
}

/// Point the layout's config at `diff_ids` (rewriting config, manifest and index digests).
fn rewrite_diff_ids(layout: &Path, diff_ids: &[String]) {
    let index: serde_json::Value = serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let blob = |d: &str| layout.join("blobs/sha256").join(d.trim_start_matches("sha256:"));
    let mdigest = index["manifests"][0]["digest"].as_str().unwrap().to_string();
    let mut manifest: serde_json::Value = serde_json::from_slice(&fs::read(blob(&mdigest)).unwrap()).unwrap();
    let cdigest = manifest["config"]["digest"].as_str().unwrap().to_string();
    let mut config: serde_json::Value = serde_json::from_slice(&fs::read(blob(&cdigest)).unwrap()).unwrap();
    config["rootfs"]["diff_ids"] = serde_json::json!(diff_ids);
    let cbytes = serde_json::to_vec(&config).unwrap();
    let cd = format!("sha256:{}", sha256_hex(&cbytes));
    fs::write(blob(&cd), &cbytes).unwrap();
    manifest["config"]["digest"] = cd.into();
    let mbytes = serde_json::to_vec(&manifest).unwrap();
    let md = format!("sha256:{}", sha256_hex(&mbytes));
    fs::write(blob(&md), &mbytes).unwrap();
    let mut index = index;
    index["manifests"][0]["digest"] = md.into();
    fs::write(layout.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

#[test]
fn multi_arch_index_without_host_platform_is_rejected() {
    require_root();
    let d = tempfile::tempdir().unwrap();
    let store = open_store(&d.path().join("state"));
    let layout = d.path().join("l");
    write_oci_layout(&layout, &TestImage::new(vec![LayerTar::new().file("f", "1").build()]), &[], true);
    // Rename the host platform in the nested index to something else.
    for e in fs::read_dir(layout.join("blobs/sha256")).unwrap() {
        let p = e.unwrap().path();
        let s = fs::read_to_string(&p).unwrap_or_default();
        if s.contains("\"manifests\"") {
            let s2 = s.replace(&format!("\"architecture\":\"{}\"", host_arch()), "\"architecture\":\"s390x\"");
            fs::write(&p, &s2).unwrap();
            let nd = format!("sha256:{}", sha256_hex(s2.as_bytes()));
            fs::rename(&p, p.with_file_name(&nd[7..])).unwrap();
            let idx = fs::read_to_string(layout.join("index.json")).unwrap();
            let old = format!("sha256:{}", p.file_name().unwrap().to_str().unwrap());
            fs::write(layout.join("index.json"), idx.replace(&old, &nd)).unwrap();
        }
    }
    let e = store.import("x", &layout, &mut |_| {}).unwrap_err();
    match &e {
        LayersError::NoMatchingPlatform { available, .. } => assert!(available.contains("linux/s390x"), "{available}"),
        other => panic!("expected NoMatchingPlatform, got {other:?}"),
    }
}
