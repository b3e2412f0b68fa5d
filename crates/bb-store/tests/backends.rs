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
        format!("s3://bbtest/deploy-1?endpoint=http://127.0.0.1:{}", self.port).parse().unwrap()
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
}

#[tokio::test]
async fn an_s3_server() {
    let Some(minio) = Minio::start() else { return };
    let d = tempfile::tempdir().unwrap();
    exercise(minio.url(), d.path()).await;
    // Unreachable: a clear error naming the store, after the retries.
    let gone = minio.url();
    drop(minio);
    let s = Store::open_with(&gone, Keys::from_secret(&[7; 32]), Some((USER, SECRET))).unwrap();
    let e = tokio::time::timeout(Duration::from_secs(120), s.put_chunk(b"x")).await.expect("retries end").unwrap_err();
    assert!(e.to_string().contains("s3://bbtest/deploy-1"), "{e}");
}
