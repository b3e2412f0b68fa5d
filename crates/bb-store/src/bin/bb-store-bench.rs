//! `branchbox-store-bench`: the store's push and pull throughput against a plain multipart
//! upload and a plain download of the same bytes, by the same client (`object_store`), to the
//! same server, in one process (`branchbox bench store` runs it against a MinIO of its own).
//!
//! ```text
//! branchbox-store-bench --url s3://bucket/prefix?endpoint=http://127.0.0.1:9000 [--dir DIR | --mb 64]
//!                       [--rounds 3] [--concurrency 8] [--work /var/tmp]
//! ```
//!
//! S3 credentials come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`).
//! Without `--dir`, `--mb` MiB of incompressible files are made in a temporary directory (nine
//! tenths in four large files, the rest in files of 16..128 KiB). Each round, alternating which
//! goes first: `put_tree` into a fresh prefix (a new store handle with a new key: nothing
//! dedups) against a raw upload of every file into another fresh prefix (`put_multipart` in
//! 8 MiB parts, or one PUT below that; as many files and parts in flight as `put_tree` has), then
//! `get_tree` into an empty directory against raw ranged GETs of the raw objects written to
//! files. Prints one JSON line: medians of MB/s (10^6 bytes of file content per second) and
//! the ratios store / raw.

use bb_store::{Keys, Store, StoreUrl, DEFAULT_CONCURRENCY};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const PART: usize = 8 << 20;

type Error = Box<dyn std::error::Error + Send + Sync>;

struct Args {
    url: StoreUrl,
    dir: Option<PathBuf>,
    mb: u64,
    rounds: usize,
    concurrency: usize,
    work: PathBuf,
}

fn parse_args() -> Result<Args, Error> {
    let mut a = Args {
        url: StoreUrl::Local(PathBuf::new()),
        dir: None,
        mb: 64,
        rounds: 3,
        concurrency: DEFAULT_CONCURRENCY,
        work: std::env::temp_dir(),
    };
    let mut url = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => url = Some(value()?.parse::<StoreUrl>()?),
            "--dir" => a.dir = Some(value()?.into()),
            "--mb" => a.mb = value()?.parse()?,
            "--rounds" => a.rounds = value()?.parse()?,
            "--concurrency" => a.concurrency = value()?.parse()?,
            "--work" => a.work = value()?.into(),
            "-h" | "--help" => {
                println!("usage: branchbox-store-bench --url URL [--dir DIR | --mb N] [--rounds N] [--concurrency N] [--work DIR]");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {flag:?} (--help)").into()),
        }
    }
    a.url = url.ok_or("--url is required")?;
    if a.rounds == 0 || a.concurrency == 0 || (a.dir.is_none() && a.mb == 0) {
        return Err("--rounds, --concurrency and --mb must be at least 1".into());
    }
    Ok(a)
}

/// `url` with `sub` appended to its prefix.
fn under(url: &StoreUrl, sub: &str) -> StoreUrl {
    match url {
        StoreUrl::Local(d) => StoreUrl::Local(d.join(sub)),
        StoreUrl::S3 { bucket, prefix, endpoint, region } => StoreUrl::S3 {
            bucket: bucket.clone(),
            prefix: if prefix.is_empty() { sub.to_string() } else { format!("{prefix}/{sub}") },
            endpoint: endpoint.clone(),
            region: region.clone(),
        },
    }
}

/// The plain client for `url`: what the store builds, without the store.
fn raw_client(url: &StoreUrl) -> Result<Arc<dyn ObjectStore>, Error> {
    Ok(match url {
        StoreUrl::Local(d) => {
            std::fs::create_dir_all(d)?;
            Arc::new(object_store::local::LocalFileSystem::new_with_prefix(d)?)
        }
        StoreUrl::S3 { bucket, prefix, endpoint, region } => {
            let mut b = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket).with_region(region);
            if let Some(e) = endpoint {
                b = b.with_endpoint(e).with_allow_http(e.starts_with("http://"));
            }
            Arc::new(object_store::prefix::PrefixStore::new(b.build()?, prefix.as_str()))
        }
    })
}

/// Incompressible bytes from the OS.
fn random(n: usize) -> Vec<u8> {
    use chacha20poly1305::aead::rand_core::RngCore;
    let mut v = vec![0u8; n];
    chacha20poly1305::aead::OsRng.fill_bytes(&mut v);
    v
}

/// `mb` MiB in `dir`: four large files (9/10) and small ones of 16..128 KiB.
fn make_files(dir: &Path, mb: u64) -> Result<(), Error> {
    let total = (mb << 20) as usize;
    let big = total * 9 / 10 / 4;
    for i in 0..4 {
        std::fs::write(dir.join(format!("big-{i}.bin")), random(big))?;
    }
    std::fs::create_dir_all(dir.join("small"))?;
    let (mut left, mut i) = (total - 4 * big, 0usize);
    while left > 0 {
        let n = left.min((16 << 10) + (i * 37_813) % (112 << 10));
        std::fs::write(dir.join(format!("small/f-{i:05}.bin")), random(n))?;
        left -= n;
        i += 1;
    }
    Ok(())
}

/// Regular files under `dir`: path relative to it, size.
fn files(dir: &Path) -> Result<Vec<(String, u64)>, Error> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() {
                let rel = e.path().strip_prefix(dir)?.to_string_lossy().into_owned();
                out.push((rel, e.metadata()?.len()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Upload every file of `dir` as an object of its own: `concurrency` files at once, each with
/// up to `concurrency` parts in flight.
async fn raw_put(
    c: &Arc<dyn ObjectStore>,
    dir: &Path,
    list: &[(String, u64)],
    concurrency: usize,
) -> Result<(), Error> {
    futures::stream::iter(list)
        .map(|(rel, size)| async move {
            let data = bytes::Bytes::from(tokio::fs::read(dir.join(rel)).await?);
            let path = ObjectPath::from(rel.as_str());
            if (*size as usize) < PART {
                c.put(&path, PutPayload::from(data)).await?;
                return Ok::<_, Error>(());
            }
            let mut w = WriteMultipart::new_with_chunk_size(c.put_multipart(&path).await?, PART);
            for at in (0..data.len()).step_by(PART) {
                w.wait_for_capacity(concurrency).await?;
                w.put(data.slice(at..(at + PART).min(data.len())));
            }
            w.finish().await?;
            Ok(())
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await
}

/// Download every raw object into `dest` (same relative paths): `concurrency` ranged GETs of
/// up to 8 MiB in flight, each written at its offset.
async fn raw_get(
    c: &Arc<dyn ObjectStore>,
    dest: &Path,
    list: &[(String, u64)],
    concurrency: usize,
) -> Result<(), Error> {
    let mut jobs = Vec::new();
    for (rel, size) in list {
        let out = dest.join(rel);
        std::fs::create_dir_all(out.parent().unwrap_or(dest))?;
        let f = Arc::new(std::fs::File::create(&out)?);
        for at in (0..*size).step_by(PART) {
            jobs.push((rel.clone(), f.clone(), at..(at + PART as u64).min(*size)));
        }
    }
    futures::stream::iter(jobs)
        .map(|(rel, f, range)| async move {
            let at = range.start;
            let data = c.get_range(&ObjectPath::from(rel.as_str()), range).await?;
            tokio::task::spawn_blocking(move || f.write_all_at(&data, at)).await??;
            Ok::<_, Error>(())
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn json_list(xs: &[f64]) -> String {
    format!("[{}]", xs.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(", "))
}

async fn run(a: Args, work: &Path) -> Result<String, Error> {
    let src = match &a.dir {
        Some(d) => d.clone(),
        None => {
            let d = work.join("src");
            std::fs::create_dir_all(&d)?;
            make_files(&d, a.mb)?;
            d
        }
    };
    let list = files(&src)?;
    let bytes: u64 = list.iter().map(|(_, n)| n).sum();
    let mb_s = |secs: f64| bytes as f64 / 1e6 / secs;
    let run_id = hex::encode(random(6));
    let (mut push, mut put, mut pull, mut get, mut sealed) = (vec![], vec![], vec![], vec![], 0u64);
    for round in 0..a.rounds {
        let tree_url = under(&a.url, &format!("bench-{run_id}/{round}/tree"));
        let raw = raw_client(&under(&a.url, &format!("bench-{run_id}/{round}/raw")))?;
        let store = Store::open(&tree_url, Keys::from_secret(&random(32).try_into().expect("32 bytes")))?
            .with_concurrency(a.concurrency);
        let (tree_dest, raw_dest) = (work.join(format!("tree-{round}")), work.join(format!("raw-{round}")));
        std::fs::create_dir_all(&tree_dest)?;
        std::fs::create_dir_all(&raw_dest)?;
        let mut tree = None;
        for store_first in [round % 2 == 0, round % 2 == 1] {
            let t = Instant::now();
            if store_first {
                tree = Some(store.put_tree(&src).await?);
                push.push(mb_s(t.elapsed().as_secs_f64()));
            } else {
                raw_put(&raw, &src, &list, a.concurrency).await?;
                put.push(mb_s(t.elapsed().as_secs_f64()));
            }
        }
        let tree = tree.expect("pushed");
        sealed = store.stats().put_bytes;
        for store_first in [round % 2 == 0, round % 2 == 1] {
            let t = Instant::now();
            if store_first {
                store.get_tree(&tree, &tree_dest).await?;
                pull.push(mb_s(t.elapsed().as_secs_f64()));
            } else {
                raw_get(&raw, &raw_dest, &list, a.concurrency).await?;
                get.push(mb_s(t.elapsed().as_secs_f64()));
            }
        }
        std::fs::remove_dir_all(&tree_dest)?;
        std::fs::remove_dir_all(&raw_dest)?;
    }
    let (push_m, put_m, pull_m, get_m) = (median(&push), median(&put), median(&pull), median(&get));
    Ok(format!(
        "{{\"bytes\": {bytes}, \"files\": {}, \"rounds\": {}, \"concurrency\": {}, \"uploaded_bytes\": {sealed}, \
         \"push_mb_s\": {push_m:.1}, \"raw_put_mb_s\": {put_m:.1}, \"pull_mb_s\": {pull_m:.1}, \"raw_get_mb_s\": {get_m:.1}, \
         \"push_vs_raw_ratio\": {:.3}, \"pull_vs_raw_ratio\": {:.3}, \"push_mb_s_samples\": {}, \"raw_put_mb_s_samples\": {}, \
         \"pull_mb_s_samples\": {}, \"raw_get_mb_s_samples\": {}}}",
        list.len(),
        a.rounds,
        a.concurrency,
        push_m / put_m,
        pull_m / get_m,
        json_list(&push),
        json_list(&put),
        json_list(&pull),
        json_list(&get),
    ))
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("branchbox-store-bench: {e}");
            std::process::exit(2);
        }
    };
    let work = a.work.join(format!("branchbox-store-bench-{}", std::process::id()));
    let result = std::fs::create_dir_all(&work)
        .map_err(Error::from)
        .and_then(|()| tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(a, &work)));
    let _ = std::fs::remove_dir_all(&work);
    match result {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("branchbox-store-bench: {e}");
            std::process::exit(1);
        }
    }
}
