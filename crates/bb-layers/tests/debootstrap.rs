//! Building the base image with debootstrap (root, network: downloads ~60 MB of .debs).
//! Runs only with BRANCHBOX_TEST_DEBOOTSTRAP=1 (CI sets it); otherwise it returns immediately.

mod common;

use bb_layers::{BaseImageOpts, IdMap, ImageStore, Progress};
use common::require_root;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Instant;

#[test]
fn build_base_image_with_debootstrap() {
    if std::env::var("BRANCHBOX_TEST_DEBOOTSTRAP").as_deref() != Ok("1") {
        eprintln!("skipping: set BRANCHBOX_TEST_DEBOOTSTRAP=1 to run the debootstrap build (needs network)");
        return;
    }
    require_root();
    let d = tempfile::Builder::new().prefix("bb-debootstrap-").tempdir_in("/var/tmp").unwrap();
    let state = d.path().join("state");
    let idmap = IdMap::default();
    let store = ImageStore::open(&state, idmap).unwrap();

    let mut events = Vec::new();
    let t = Instant::now();
    let img = store
        .build_base("base", &BaseImageOpts::default(), &mut |p| {
            if let Progress::Stage { stage, message } = &p {
                if !message.starts_with("Retrieving") && !message.starts_with("Validating") && stage != "extract" {
                    eprintln!("{:>6.1}s [{stage}] {message}", t.elapsed().as_secs_f64());
                }
            }
            events.push(p)
        })
        .unwrap();
    let first = t.elapsed();
    eprintln!("first build: {first:?}, {} bytes", img.size_bytes);

    assert_eq!(img.source, "debootstrap");
    assert_eq!(img.layers.len(), 1);
    assert_eq!(img.cmd, vec!["/bin/bash"]);
    assert_eq!(img.workdir.as_deref(), Some("/root"));
    assert!(img.size_bytes > 100 << 20, "{}", img.size_bytes);
    assert_eq!(store.get("base").unwrap(), img);
    let has_step = |stage: &str| {
        events.iter().any(|e| matches!(e, Progress::Step { stage: s, total, .. } if s == stage && *total > 100))
    };
    assert!(has_step("unpack") && has_step("configure"), "expected counted unpack/configure steps");
    assert!(events
        .iter()
        .any(|e| matches!(e, Progress::Step { stage, done, total } if stage == "configure" && done == total)));

    let root = store.layer_path(&img.layers[0]);
    let lm = |p: &str| fs::symlink_metadata(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let python = lm("usr/bin/python3");
    assert_eq!((python.uid(), python.gid()), (idmap.host_base, idmap.host_base), "python3 owned by the sandbox root");
    // Follow the (relative) symlink inside the layer to the interpreter itself.
    let target = fs::read_link(root.join("usr/bin/python3")).unwrap();
    assert!(target.is_relative(), "{target:?}");
    let interp = fs::metadata(root.join("usr/bin").join(&target)).unwrap();
    assert!(interp.is_file());
    assert_eq!((interp.uid(), interp.permissions().mode() & 0o777), (idmap.host_base, 0o755));
    for (p, mode) in [("", 0o755), ("tmp", 0o1777), ("root", 0o700)] {
        let m = lm(p);
        assert_eq!((m.uid(), m.mode() & 0o7777), (idmap.host_base, mode), "/{p}");
    }
    let su = lm("usr/bin/su");
    assert_eq!((su.uid(), su.mode() & 0o7777), (idmap.host_base, 0o4755), "setuid kept after the shift");
    let shadow = lm("etc/shadow");
    assert!(shadow.gid() > idmap.host_base, "group `shadow` shifted too: {}", shadow.gid());
    assert_eq!(fs::read_to_string(root.join("etc/hostname")).unwrap(), "sandbox\n");
    assert_eq!(fs::read_dir(root.join("dev")).unwrap().count(), 0, "/dev is empty");
    assert!(!fs::read_dir(root.join("var/cache/apt/archives")).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .ends_with(".deb")));
    let cached = fs::read_dir(state.join("cache/debootstrap")).unwrap().count();
    assert!(cached > 50, "debs cached for the next build: {cached}");
    assert!(common::tmp_entries(&state).is_empty());

    // The image runs: mount it and start python3 in a chroot.
    let m = common::mount_image(&store, &img, &d.path().join("sb"));
    let out =
        std::process::Command::new("chroot").arg(&m.0).args(["/usr/bin/python3", "-c", "print(6*7)"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42", "{}", String::from_utf8_lossy(&out.stderr));
    drop(m);

    // Building again replaces the image once complete, reuses the cached debs and removes the
    // old layer.
    let t = Instant::now();
    let mut downloads = 0;
    let img2 = store
        .build_base("base", &BaseImageOpts::default(), &mut |p| {
            if let Progress::Stage { stage, message } = &p {
                if !message.starts_with("Retrieving") && !message.starts_with("Validating") && stage != "extract" {
                    eprintln!("{:>6.1}s [{stage}] {message}", t.elapsed().as_secs_f64());
                }
                downloads += (message.starts_with("Retrieving")
                    && !message.contains("Release")
                    && !message.contains("Packages")) as usize;
            }
        })
        .unwrap();
    eprintln!("rebuild: {:?} ({downloads} packages retrieved)", t.elapsed());
    assert_ne!(img2.layers, img.layers);
    assert!(!Path::new(&store.layer_path(&img.layers[0])).exists(), "old layer removed");
    assert!(store.layer_path(&img2.layers[0]).join("usr/bin/python3").exists());
    assert_eq!(store.list().unwrap().len(), 1);
}
