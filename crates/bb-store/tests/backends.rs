//! The same checks against a local directory and a real S3 server (MinIO on 127.0.0.1, started
//! here; `make deps` installs it with scripts/install-minio.sh). Without MinIO the S3 case is
//! skipped, unless `MUST_WORK=1` (CI): then it fails.

use bb_store::{Keys, Location, Store, StoreError, StoreUrl};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MINIO: &str = "/usr/local/lib/branchbox/minio";
const USER: &str = "bbtest";
const SECRET: &str = "bbtest-secret-key";

fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A MinIO serving a temporary directory on 127.0.0.1, with bucket `bbtest`; killed on drop.
struct Minio {
    child: Child,
    port: u16,
    _data: tempfile::TempDir,
}

impl Drop for Minio {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Minio {
    fn start() -> Option<Minio> {
        if !Path::new(MINIO).exists() {
            assert!(
                std::env::var("MUST_WORK").map_or(true, |v| v != "1"),
                "{MINIO} is missing: run scripts/install-minio.sh"
            );
            eprintln!("skipping the S3 case: {MINIO} is missing (scripts/install-minio.sh installs it)");
            return None;
        }
        let data = tempfile::tempdir().unwrap();
        // A port the kernel just gave out and took back.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let console =
            format!("127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
        let child = Command::new(MINIO)
            .args(["server", "--quiet", "--address", &addr, "--console-address", &console])
            .arg(data.path())
            .env("MINIO_ROOT_USER", USER)
            .env("MINIO_ROOT_PASSWORD", SECRET)
            .env("MINIO_BROWSER", "off")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let m = Minio { child, port, _data: data };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !m.curl(&["-f", &format!("http://{addr}/minio/health/live")]) {
            assert!(Instant::now() < deadline, "MinIO did not start on {addr}");
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(m.curl(&[
            "-f",
            "-X",
            "PUT",
            "--aws-sigv4",
            "aws:amz:us-east-1:s3",
            "--user",
            &format!("{USER}:{SECRET}"),
            &format!("http://{addr}/bbtest")
        ]));
        Some(m)
    }

    fn curl(&self, args: &[&str]) -> bool {
        Command::new("curl")
            .arg("-s")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    fn url(&self) -> StoreUrl {
        self.url_at("deploy-1")
    }

    fn url_at(&self, prefix: &str) -> StoreUrl {
        format!("s3://bbtest/{prefix}?endpoint=http://127.0.0.1:{}", self.port).parse().unwrap()
    }
}

/// Overwrite the object at `key` of the store (as someone with the bucket's credentials).
async fn raw_put(url: &StoreUrl, key: &str, bytes: Vec<u8>) {
    let inner: Box<dyn object_store::ObjectStore> = match url {
        StoreUrl::Local(dir) => Box::new(object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap()),
        StoreUrl::S3 { endpoint, prefix, .. } => Box::new(object_store::prefix::PrefixStore::new(
            object_store::aws::AmazonS3Builder::new()
                .with_bucket_name("bbtest")
                .with_region("us-east-1")
                .with_endpoint(endpoint.clone().unwrap())
                .with_allow_http(true)
                .with_access_key_id(USER)
                .with_secret_access_key(SECRET)
                .build()
                .unwrap(),
            prefix.as_str(),
        )),
    };
    inner.put(&ObjectPath::from(key), PutPayload::from(bytes)).await.unwrap();
}

async fn exercise(url: StoreUrl, work: &Path) {
    let keys = Keys::from_secret(&[7; 32]);
    let open = || Store::open_with(&url, keys.clone(), Some((USER, SECRET))).unwrap().with_pack_bytes(1 << 20);
    let s = open();
    // A large file (own chunks) and 300 small ones (packs).
    let big = work.join("big");
    std::fs::write(&big, noise(6 << 20, 1)).unwrap();
    let p = s.packer();
    let big_chunks = s.put_file(&big, &p).await.unwrap();
    let mut small = Vec::new();
    for i in 0..300u64 {
        let f = work.join(format!("small-{i}"));
        std::fs::write(&f, noise(3000 + i as usize, 100 + i)).unwrap();
        small.push((f.clone(), s.put_file(&f, &p).await.unwrap()));
    }
    p.finish().await.unwrap();
    let written = s.stats().puts;
    assert!(written < 20, "{written} objects for one 6 MiB file and 300 small ones");
    let out: PathBuf = work.join("out");
    s.get_file(&big_chunks, &out).await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&big).unwrap());
    for (f, chunks) in small.iter().step_by(37) {
        s.get_file(chunks, &out).await.unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(f).unwrap());
    }
    // A second daemon sharing the store writes nothing for the same content.
    let other = open();
    other.load_pack_indexes().await.unwrap();
    let p2 = other.packer();
    assert_eq!(other.put_file(&big, &p2).await.unwrap(), big_chunks);
    for (f, chunks) in &small {
        assert_eq!(&other.put_file(f, &p2).await.unwrap(), chunks);
    }
    p2.finish().await.unwrap();
    assert_eq!(other.stats().puts, 0);
    // Someone with the bucket's credentials changes an object: an error naming it.
    let victim = big_chunks[1];
    assert_eq!(victim.at, Location::Own);
    raw_put(&url, &victim.id.key(), b"BBS1 not what was written".to_vec()).await;
    match s.get_chunk(&victim).await {
        Err(StoreError::Tampered { key, .. }) => assert_eq!(key, victim.id.key()),
        other => panic!("a changed object was read: {other:?}"),
    }
    assert!(s.get_file(&big_chunks, &out).await.is_err());
}

#[tokio::test]
async fn a_local_directory() {
    let d = tempfile::tempdir().unwrap();
    let work = d.path().join("work");
    std::fs::create_dir(&work).unwrap();
    exercise(StoreUrl::Local(d.path().join("store")), &work).await;
    trees(StoreUrl::Local(d.path().join("trees")), &work).await;
}

#[tokio::test]
async fn an_s3_server() {
    let Some(minio) = Minio::start() else { return };
    let d = tempfile::tempdir().unwrap();
    exercise(minio.url(), d.path()).await;
    let work = d.path().join("trees");
    std::fs::create_dir(&work).unwrap();
    trees(minio.url_at("trees"), &work).await;
    // Unreachable: a clear error naming the store, after the retries.
    let gone = minio.url();
    drop(minio);
    let s = Store::open_with(&gone, Keys::from_secret(&[7; 32]), Some((USER, SECRET))).unwrap();
    let e = tokio::time::timeout(Duration::from_secs(120), s.put_chunk(b"x")).await.expect("retries end").unwrap_err();
    assert!(e.to_string().contains("s3://bbtest/deploy-1"), "{e}");
}

// ---- trees ----

fn set_mtime(p: &Path, sec: i64, nsec: i64) {
    let t = rustix::fs::Timespec { tv_sec: sec, tv_nsec: nsec as _ };
    let times = rustix::fs::Timestamps { last_access: t, last_modification: t };
    rustix::fs::utimensat(rustix::fs::CWD, p, &times, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).unwrap();
}

/// An overlayfs-layer-like tree: files (empty, small, multi-chunk), nested dirs, symlinks, a hard
/// link, a whiteout, opaque dirs, xattrs, a fifo, a socket (not stored), odd modes and owners.
fn layer_tree(root: &Path) {
    use std::os::unix::fs::{lchown, PermissionsExt};
    let mode = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    std::fs::create_dir_all(root.join("dir/sub")).unwrap();
    std::fs::create_dir(root.join("opq")).unwrap();
    std::fs::create_dir(root.join("uopq")).unwrap();
    std::fs::write(root.join("empty"), b"").unwrap();
    std::fs::write(root.join("small"), b"hello tree").unwrap();
    std::fs::write(root.join("big"), noise(9 << 20, 11)).unwrap();
    std::fs::write(root.join("dir/sub/deep"), noise(300_000, 12)).unwrap();
    std::fs::write(root.join("opq/inside"), b"only this").unwrap();
    std::fs::write(root.join("suid"), b"#!/bin/true\n").unwrap();
    std::fs::hard_link(root.join("small"), root.join("dir/hard")).unwrap();
    std::os::unix::fs::symlink("small", root.join("link")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("dir/abs")).unwrap();
    std::os::unix::fs::symlink("../..", root.join("dir/sub/up")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("gone"),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::empty(),
        0,
    )
    .unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_bits_truncate(0o640),
        0,
    )
    .unwrap();
    let _sock = std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
    xattr::set(root.join("opq"), "trusted.overlay.opaque", b"y").unwrap();
    xattr::set(root.join("uopq"), "user.overlay.opaque", b"y").unwrap();
    xattr::set(root.join("small"), "user.note", b"hi").unwrap();
    xattr::set(root.join("link"), "trusted.bb.on-a-symlink", b"1").unwrap();
    xattr::set(root.join("gone"), "trusted.bb.on-a-whiteout", b"2").unwrap();
    lchown(root.join("small"), Some(1000), Some(1001)).unwrap();
    lchown(root.join("dir/abs"), Some(1002), Some(1003)).unwrap();
    lchown(root.join("dir"), Some(5), Some(6)).unwrap();
    lchown(root.join("suid"), Some(7), Some(7)).unwrap();
    mode(&root.join("small"), 0o640);
    mode(&root.join("suid"), 0o4755);
    mode(&root.join("dir"), 0o750);
    mode(&root.join("opq"), 0o700);
    for (i, p) in ["small", "big", "empty", "suid", "link", "dir/abs", "gone", "fifo", "dir/sub/deep", "dir/sub/up"]
        .iter()
        .enumerate()
    {
        set_mtime(&root.join(p), 1_600_000_000 + i as i64, 1000 * i as i64);
    }
    for p in ["dir/sub", "dir", "opq", "uopq", ""] {
        set_mtime(&root.join(p), 1_500_000_000, 123);
    }
}

/// Everything about every path below `root` that a tree keeps (not atimes), sockets left out.
fn describe(root: &Path) -> std::collections::BTreeMap<String, String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut all = Vec::new();
    let mut todo = vec![String::new()];
    while let Some(rel) = todo.pop() {
        let p = root.join(&rel);
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                let name = e.unwrap().file_name().into_string().unwrap();
                todo.push(if rel.is_empty() { name } else { format!("{rel}/{name}") });
            }
        }
        all.push((rel, m));
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let mut first_name = std::collections::HashMap::new();
    let mut out = std::collections::BTreeMap::new();
    for (rel, m) in all {
        let ft = m.file_type();
        if ft.is_socket() {
            continue;
        }
        let p = root.join(&rel);
        let what = if ft.is_file() {
            format!("file {}", blake3::hash(&std::fs::read(&p).unwrap()).to_hex())
        } else if ft.is_symlink() {
            format!("symlink {}", std::fs::read_link(&p).unwrap().display())
        } else if ft.is_char_device() {
            format!("chardev {}", m.rdev())
        } else if ft.is_fifo() {
            "fifo".into()
        } else {
            "dir".into()
        };
        let mut xattrs: Vec<_> = xattr::list(&p)
            .unwrap()
            .map(|k| (k.to_string_lossy().into_owned(), xattr::get(&p, &k).unwrap().unwrap()))
            .collect();
        xattrs.sort();
        let link = if !m.is_dir() && m.nlink() > 1 {
            first_name.entry(m.ino()).or_insert_with(|| rel.clone()).clone()
        } else {
            String::new()
        };
        let mtime = (m.mtime(), m.mtime_nsec());
        let line = format!(
            "{what} mode={:o} owner={}:{} mtime={mtime:?} nlink={} link-group={link} xattrs={xattrs:?}",
            m.mode(),
            m.uid(),
            m.gid(),
            m.nlink(),
        );
        out.insert(rel, line);
    }
    out
}

fn fresh(work: &Path, name: &str) -> PathBuf {
    let p = work.join(name);
    std::fs::create_dir(&p).unwrap();
    p
}

async fn trees(url: StoreUrl, work: &Path) {
    let keys = Keys::from_secret(&[9; 32]);
    let open = || Store::open_with(&url, keys.clone(), Some((USER, SECRET))).unwrap();
    let s = open();

    // A layer round-trips: every type, mode, owner, mtime, xattr and link.
    let src = fresh(work, "layer");
    layer_tree(&src);
    let t = s.put_tree(&src).await.unwrap();
    assert_eq!((t.files, t.bytes), (6, 10 + (9 << 20) + 300_000 + 9 + 12));
    let out = fresh(work, "layer-out");
    let got = s.get_tree(&t, &out).await.unwrap();
    assert_eq!((got.files, got.bytes), (t.files, t.bytes));
    let (a, b) = (describe(&src), describe(&out));
    assert_eq!(a.len(), 17, "{a:#?}");
    assert_eq!(a, b);
    assert!(b["gone"].starts_with("chardev 0 mode=20000"), "{}", b["gone"]);
    assert!(b["opq"].contains("trusted.overlay.opaque"));
    assert!(b["suid"].contains("mode=104755 owner=7:7"), "{}", b["suid"]);
    // Not into a directory that is not empty, nor one that is not there.
    assert!(s.get_tree(&t, &out).await.is_err());
    assert!(s.get_tree(&t, &work.join("nowhere")).await.is_err());

    // The same tree again: the same ref, nothing written. Another daemon gets the same id, and
    // after learning the packs writes nothing either.
    let before = s.stats();
    assert_eq!(s.put_tree(&src).await.unwrap(), t);
    assert_eq!(s.stats().puts, before.puts);
    assert_eq!(open().put_tree(&src).await.unwrap().id, t.id, "the id does not depend on where chunks are");
    let other = open();
    other.load_pack_indexes().await.unwrap();
    // (The daemon before it wrote its own packs of the same chunks: either may be referenced.)
    assert_eq!(other.put_tree(&src).await.unwrap().id, t.id);
    assert_eq!(other.stats().puts, 0);

    // A CRIU image: a 32 MiB page file, then the same process with 1 MiB of memory changed.
    let img = fresh(work, "img-1");
    let mut pages = noise(32 << 20, 21);
    std::fs::write(img.join("pages-1.img"), &pages).unwrap();
    std::fs::write(img.join("core-1.img"), noise(5000, 22)).unwrap();
    let s = open(); // fresh counters
    let i1 = s.put_tree(&img).await.unwrap();
    let first = s.stats();
    assert!(first.puts <= 12, "{} objects for a 32 MiB image of small chunks", first.puts);
    pages[15 << 20..16 << 20].copy_from_slice(&noise(1 << 20, 23));
    let img2 = fresh(work, "img-2");
    std::fs::write(img2.join("pages-1.img"), &pages).unwrap();
    std::fs::copy(img.join("core-1.img"), img2.join("core-1.img")).unwrap();
    s.put_tree(&img2).await.unwrap();
    let uploaded = s.stats().put_bytes - first.put_bytes;
    eprintln!("{url}: 32 MiB image: {} objects; 1 MiB changed: {uploaded} bytes uploaded", first.puts);
    assert!(uploaded < 5 << 19, "{uploaded} bytes uploaded for 1 MiB of changed memory");
    // Another daemon that learnt the packs dedups against them the same way.
    std::fs::write(img2.join("pages-1.img"), &pages[..31 << 20]).unwrap();
    let other = open();
    other.load_pack_indexes().await.unwrap();
    let i3 = other.put_tree(&img2).await.unwrap();
    assert!(other.stats().put_bytes < 1 << 20, "{} bytes for a cut-short image", other.stats().put_bytes);
    let out = fresh(work, "img-3-out");
    other.get_tree(&i3, &out).await.unwrap();
    assert_eq!(describe(&out), describe(&img2));

    // GC: keep the layer, delete everything else; the layer still restores, the images do not.
    let keep = s.tree_objects(&t).await.unwrap();
    let listed = s.list_objects().await.unwrap();
    let now = std::time::SystemTime::now();
    for (key, modified, size) in &listed {
        assert!(*size > 0, "{key}");
        let age = now.duration_since(*modified).unwrap_or_default();
        assert!(age < Duration::from_secs(3600), "{key} modified {age:?} ago");
    }
    let all: std::collections::BTreeSet<String> = listed.into_iter().map(|(k, ..)| k).collect();
    assert!(keep.is_subset(&all), "{:?}", keep.difference(&all).collect::<Vec<_>>());
    assert!(keep.iter().any(|k| k.ends_with(".idx")) && keep.iter().any(|k| k.starts_with("chunks/")));
    let doomed: Vec<String> = all.difference(&keep).cloned().collect();
    assert!(!doomed.is_empty());
    assert_eq!(s.delete_objects(&doomed).await.unwrap(), doomed.len() as u64);
    let left: std::collections::BTreeSet<String> =
        s.list_objects().await.unwrap().into_iter().map(|(k, ..)| k).collect();
    assert_eq!(left, keep);
    s.delete_objects(&doomed).await.unwrap(); // already gone: fine
    let out = fresh(work, "layer-after-gc");
    s.get_tree(&t, &out).await.unwrap();
    assert_eq!(describe(&out), describe(&src));
    assert!(s.get_tree(&i1, &fresh(work, "img-1-gone")).await.is_err());
    // The store forgot the deleted packs: pushing the image again writes it all again.
    let i1_again = s.put_tree(&img).await.unwrap();
    assert_eq!(i1_again.id, i1.id);
    let out = fresh(work, "img-1-again");
    s.get_tree(&i1_again, &out).await.unwrap();
    assert_eq!(describe(&out), describe(&img));

    // A changed manifest chunk: an error naming its object, nothing read from it.
    let victim = t.chunks[0];
    let object = match victim.at {
        Location::Own => victim.id.key(),
        Location::Pack { pack, .. } => pack.key(),
    };
    raw_put(&url, &object, b"BBS1 not what was written".to_vec()).await;
    match open().get_tree(&t, &fresh(work, "tampered")).await {
        Err(StoreError::Tampered { key, .. }) => assert!(key.starts_with(&object), "{key} names {object}"),
        other => panic!("a changed manifest was read: {other:?}"),
    }
    assert!(matches!(open().tree_objects(&t).await, Err(StoreError::Tampered { .. })));
}
