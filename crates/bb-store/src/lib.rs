//! branchbox's object store (../shared/STORAGE.md): what a daemon keeps beyond its own disk.
//!
//! **Backends** ([`StoreUrl`]): a local directory (the default, no set-up) or any S3-compatible
//! bucket, both through Apache Arrow's `object_store` (retries with backoff, conditional puts).
//!
//! **Chunks**: file contents are cut at content-defined boundaries (FastCDC, 256 KiB .. 1 MiB ..
//! 4 MiB), so an insertion moves no boundary but its own and equal content is stored once. A
//! chunk is named by a *keyed* BLAKE3 hash of its plaintext (the key is the deployment's: names
//! reveal nothing to whoever reads the bucket), compressed (zstd) and sealed with
//! XChaCha20-Poly1305 under its own object name as associated data ([`seal`]): a changed,
//! truncated, swapped or foreign object fails authentication and is an error naming it, never
//! data. After opening, the plaintext's keyed hash must be the chunk's name again.
//!
//! **Packs** ([`Packer`]): chunks smaller than [`MIN_CHUNK`] (small files, file tails) are not
//! objects of their own but sealed one after the other into pack objects of a few MiB, with a
//! sealed index object beside each; a reference to such a chunk says where it is, and reading
//! it is one range read. 10,000 small files are a handful of PUTs.
//!
//! Objects are never overwritten (`PutMode::Create`): a chunk already there is skipped, which is
//! also how a second daemon pushing the same content costs nothing. A pack's index is written
//! after the pack, so no index names a pack that is not all there.
//!
//! **Trees** ([`tree`]): a directory (an overlayfs layer, a CRIU image directory) is stored as
//! its files' chunks plus a manifest (one entry per path: type, mode, owner, mtime, xattrs,
//! symlink target, hard link, chunk list), itself stored as chunks; [`TreeRef`] names it by a
//! keyed hash of its content, so pushing an unchanged tree twice writes nothing.

mod keys;
mod pack;
pub mod seal;
pub mod tree;
mod url;

pub use keys::Keys;
pub use pack::{PackId, Packer};
pub use tree::{TreeRef, TreeStats};
pub use url::StoreUrl;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use thiserror::Error;

/// Smallest, average and largest chunk (bytes) by default ([`ChunkSizes::DEFAULT`]): a file
/// smaller than `MIN_CHUNK` is one chunk. Chunks under `MIN_CHUNK` go into packs; no chunk is
/// ever larger than `MAX_CHUNK`.
pub const MIN_CHUNK: u32 = 256 << 10;
pub const AVG_CHUNK: u32 = 1 << 20;
pub const MAX_CHUNK: u32 = 4 << 20;

/// Where FastCDC may cut a file (bytes): never before `min`, about every `avg`, at `max` at the
/// latest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSizes {
    pub min: u32,
    pub avg: u32,
    pub max: u32,
}

impl ChunkSizes {
    /// For most files: 256 KiB .. 1 MiB .. 4 MiB.
    pub const DEFAULT: ChunkSizes = ChunkSizes { min: MIN_CHUNK, avg: AVG_CHUNK, max: MAX_CHUNK };
    /// For CRIU page files (`pages-*.img`): 16 KiB .. 64 KiB .. 256 KiB. Two dumps of one process
    /// differ in scattered pages; with 1 MiB chunks every changed page re-uploads ~1-3 MiB around
    /// it, with these ~100 KiB. The chunks are under [`MIN_CHUNK`], so they are packed: a 1 GiB
    /// image is ~64 pack objects, not 16,000.
    pub const PAGES: ChunkSizes = ChunkSizes { min: 16 << 10, avg: 64 << 10, max: 256 << 10 };

    /// The sizes for a file named `name`.
    pub fn for_file(name: &std::ffi::OsStr) -> ChunkSizes {
        use std::os::unix::ffi::OsStrExt;
        let n = name.as_bytes();
        if n.starts_with(b"pages-") && n.ends_with(b".img") {
            ChunkSizes::PAGES
        } else {
            ChunkSizes::DEFAULT
        }
    }

    /// Within FastCDC's bounds and at most [`MAX_CHUNK`].
    fn valid(&self) -> bool {
        use fastcdc::v2020 as f;
        let (min, avg, max) = (self.min as usize, self.avg as usize, self.max as usize);
        (f::MINIMUM_MIN..=f::MINIMUM_MAX).contains(&min)
            && (f::AVERAGE_MIN..=f::AVERAGE_MAX).contains(&avg)
            && (f::MAXIMUM_MIN..=(MAX_CHUNK as usize).min(f::MAXIMUM_MAX)).contains(&max)
            && min <= avg
            && avg <= max
    }
}
/// Uploads or downloads of one call in flight at once (default).
pub const DEFAULT_CONCURRENCY: usize = 8;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("object store URL {url:?}: {why}")]
    BadUrl { url: String, why: String },
    #[error("object store {store}: {source}")]
    Backend {
        store: String,
        #[source]
        source: object_store::Error,
    },
    #[error("object {key} in {store} failed authentication: it was changed, truncated or written with another key, and is not used")]
    Tampered { store: String, key: String },
    #[error("object {key} is missing from {store}")]
    Missing { store: String, key: String },
    #[error("store key file {path}: {why}")]
    KeyFile { path: PathBuf, why: String },
    #[error("tree {tree}: {why}")]
    BadTree { tree: String, why: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
        let what = what.into();
        move |source| StoreError::Io { what, source }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A chunk's name: the keyed BLAKE3 hash of its plaintext. Serialized as hex in human-readable
/// formats (JSON), as 32 bytes in binary ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl serde::Serialize for ChunkId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        ids::serialize(&self.0, s)
    }
}

impl<'de> serde::Deserialize<'de> for ChunkId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        ids::deserialize(d).map(ChunkId)
    }
}

/// Fixed-size ids: hex strings where a format is read by people, bytes elsewhere.
pub(crate) mod ids {
    use serde::de::{Error, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &[u8], s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&hex::encode(id))
        } else {
            s.serialize_bytes(id)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>, const N: usize>(d: D) -> Result<[u8; N], D::Error> {
        struct Id<const N: usize>;
        impl<const N: usize> Visitor<'_> for Id<N> {
            type Value = [u8; N];
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "{N} bytes or {} hex digits", 2 * N)
            }
            fn visit_str<E: Error>(self, v: &str) -> Result<[u8; N], E> {
                let mut out = [0u8; N];
                hex::decode_to_slice(v, &mut out)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Str(v), &self))?;
                Ok(out)
            }
            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<[u8; N], E> {
                v.try_into().map_err(|_| E::invalid_length(v.len(), &self))
            }
        }
        if d.is_human_readable() {
            d.deserialize_str(Id::<N>)
        } else {
            d.deserialize_bytes(Id::<N>)
        }
    }
}

impl std::fmt::Display for ChunkId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl ChunkId {
    /// Where the chunk lives in the store.
    pub fn key(&self) -> String {
        let h = self.to_string();
        format!("chunks/{}/{h}", &h[..2])
    }
}

/// A chunk of a file: its name, plaintext length and where it is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ChunkRef {
    pub id: ChunkId,
    pub len: u32,
    pub at: Location,
}

/// Where a chunk's sealed bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Location {
    /// Its own object ([`ChunkId::key`]).
    Own,
    /// `sealed_len` bytes at `offset` of a pack.
    Pack { pack: PackId, offset: u64, sealed_len: u32 },
}

/// What a store did since it was opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Objects written, and their bytes (sealed).
    pub puts: u64,
    pub put_bytes: u64,
    /// Chunks not written because the store had them.
    pub skipped: u64,
    /// Objects read, and their bytes (sealed).
    pub gets: u64,
    pub get_bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    puts: AtomicU64,
    put_bytes: AtomicU64,
    skipped: AtomicU64,
    gets: AtomicU64,
    get_bytes: AtomicU64,
}

/// An object store with the deployment's keys.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    /// The store's URL without credentials, for messages.
    name: String,
    keys: Keys,
    concurrency: usize,
    pack_bytes: usize,
    counters: Arc<Counters>,
    /// Chunks known to be in packs (written here or read from pack indexes).
    packed: Arc<parking_lot::Mutex<std::collections::HashMap<ChunkId, ChunkRef>>>,
}

impl Store {
    /// Open the store at `url` (a local directory is made if missing) with `keys`; S3
    /// credentials from the environment.
    pub fn open(url: &StoreUrl, keys: Keys) -> Result<Store> {
        Store::open_with(url, keys, None)
    }

    /// [`Store::open`] with these S3 credentials (access key id, secret) instead of the
    /// environment's.
    pub fn open_with(url: &StoreUrl, keys: Keys, credentials: Option<(&str, &str)>) -> Result<Store> {
        Ok(Store {
            inner: url.build(credentials)?,
            name: url.to_string(),
            keys,
            concurrency: DEFAULT_CONCURRENCY,
            pack_bytes: pack::DEFAULT_PACK_BYTES,
            counters: Arc::default(),
            packed: Arc::default(),
        })
    }

    /// The same store writing packs of about `n` bytes.
    pub fn with_pack_bytes(self, n: usize) -> Store {
        Store { pack_bytes: n.max(1), ..self }
    }

    /// The same store with `n` (>= 1) transfers of one call in flight at once.
    pub fn with_concurrency(self, n: usize) -> Store {
        Store { concurrency: n.max(1), ..self }
    }

    /// Forget which packs hold which chunks (learnt from this store's pushes and loaded
    /// indexes): after a collection on any daemon, a pack it remembers may be gone, and a push
    /// must not name a chunk in it.
    pub fn forget_packed(&self) {
        self.packed.lock().clear();
    }

    pub fn stats(&self) -> StoreStats {
        let c = &self.counters;
        StoreStats {
            puts: c.puts.load(Ordering::Relaxed),
            put_bytes: c.put_bytes.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            gets: c.gets.load(Ordering::Relaxed),
            get_bytes: c.get_bytes.load(Ordering::Relaxed),
        }
    }

    fn backend(&self, source: object_store::Error) -> StoreError {
        StoreError::Backend { store: self.name.clone(), source }
    }

    /// Store `data` as a chunk object of its own (unless the store has it). Returns its
    /// reference.
    pub async fn put_chunk(&self, data: &[u8]) -> Result<ChunkRef> {
        let id = self.keys.chunk_id(data);
        let key = id.key();
        let path = ObjectPath::from(key.as_str());
        let chunk = ChunkRef { id, len: data.len() as u32, at: Location::Own };
        match self.inner.head(&path).await {
            Ok(_) => {
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(chunk);
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(self.backend(e)),
        }
        let sealed = seal::seal(&self.keys, &key, data);
        let n = sealed.len() as u64;
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        match self.inner.put_opts(&path, PutPayload::from(sealed), opts).await {
            Ok(_) => {
                self.counters.puts.fetch_add(1, Ordering::Relaxed);
                self.counters.put_bytes.fetch_add(n, Ordering::Relaxed);
            }
            // Written meanwhile by someone else: the same content under the same name.
            Err(object_store::Error::AlreadyExists { .. }) => {
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return Err(self.backend(e)),
        }
        Ok(chunk)
    }

    /// Read chunk `chunk` back (a range of its pack if packed): authenticated, and its
    /// plaintext checked against its name.
    pub async fn get_chunk(&self, chunk: &ChunkRef) -> Result<Vec<u8>> {
        let key = chunk.id.key();
        let (object, range) = match chunk.at {
            Location::Own => (key.clone(), None),
            Location::Pack { pack, offset, sealed_len } => (pack.key(), Some(offset..offset + sealed_len as u64)),
        };
        let path = ObjectPath::from(object.as_str());
        let got = match range {
            None => match self.inner.get(&path).await {
                Ok(r) => r.bytes().await,
                Err(e) => Err(e),
            },
            Some(r) => self.inner.get_range(&path, r).await,
        };
        let sealed = match got {
            Ok(b) => b,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(StoreError::Missing { store: self.name.clone(), key: object });
            }
            // A range past the end: the pack was cut short.
            Err(e) if chunk.at != Location::Own && e.to_string().to_lowercase().contains("range") => {
                return Err(StoreError::Tampered { store: self.name.clone(), key: object });
            }
            Err(e) => return Err(self.backend(e)),
        };
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        self.counters.get_bytes.fetch_add(sealed.len() as u64, Ordering::Relaxed);
        self.open_chunk(chunk, &sealed)
    }

    /// Read `end - start` bytes at `start` of pack `pack` (several chunks at once; see
    /// [`Store::open_chunk`]). A pack cut short is `Tampered`.
    pub async fn get_pack_range(&self, pack: PackId, start: u64, end: u64) -> Result<bytes::Bytes> {
        let object = pack.key();
        let got = self.inner.get_range(&ObjectPath::from(object.as_str()), start..end).await;
        let bytes = match got {
            Ok(b) if b.len() as u64 == end - start => b,
            Ok(_) => return Err(StoreError::Tampered { store: self.name.clone(), key: object }),
            Err(object_store::Error::NotFound { .. }) => {
                return Err(StoreError::Missing { store: self.name.clone(), key: object })
            }
            Err(e) if e.to_string().to_lowercase().contains("range") => {
                return Err(StoreError::Tampered { store: self.name.clone(), key: object })
            }
            Err(e) => return Err(self.backend(e)),
        };
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        self.counters.get_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// The plaintext of `chunk` from its sealed bytes: authenticated, and checked against its
    /// name and length.
    pub fn open_chunk(&self, chunk: &ChunkRef, sealed: &[u8]) -> Result<Vec<u8>> {
        let key = chunk.id.key();
        let tampered = || StoreError::Tampered {
            store: self.name.clone(),
            key: match chunk.at {
                Location::Own => key.clone(),
                Location::Pack { pack, .. } => format!("{} (chunk {})", pack.key(), chunk.id),
            },
        };
        let data = seal::open(&self.keys, &key, sealed, MAX_CHUNK as usize).ok_or_else(tampered)?;
        if data.len() != chunk.len as usize || self.keys.chunk_id(&data) != chunk.id {
            return Err(tampered());
        }
        Ok(data)
    }

    /// Store the file at `path` as content-defined chunks (those the store has are skipped;
    /// those under [`MIN_CHUNK`] go to `packer`, whose [`Packer::finish`] must succeed before
    /// the references are used). Returns its chunks in order.
    pub async fn put_file(&self, path: &Path, packer: &Packer) -> Result<Vec<ChunkRef>> {
        self.put_file_with(path, packer, ChunkSizes::DEFAULT).await
    }

    /// [`Store::put_file`] cutting at `sizes` (e.g. [`ChunkSizes::for_file`]).
    pub async fn put_file_with(&self, path: &Path, packer: &Packer, sizes: ChunkSizes) -> Result<Vec<ChunkRef>> {
        let file = std::fs::File::open(path).map_err(StoreError::io(format!("open {}", path.display())))?;
        self.put_open_file(file, path.display().to_string(), packer, sizes).await
    }

    /// [`Store::put_file_with`] for an open file (`name` for messages).
    pub(crate) async fn put_open_file(
        &self,
        file: std::fs::File,
        name: String,
        packer: &Packer,
        sizes: ChunkSizes,
    ) -> Result<Vec<ChunkRef>> {
        if !sizes.valid() {
            return Err(StoreError::Io {
                what: format!("chunking {name}"),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("chunk sizes {sizes:?}")),
            });
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>>>(self.concurrency);
        // Reading and cutting are blocking work; uploads overlap them.
        let reader = tokio::task::spawn_blocking(move || {
            let cuts = fastcdc::v2020::StreamCDC::new(
                std::io::BufReader::new(file),
                sizes.min as usize,
                sizes.avg as usize,
                sizes.max as usize,
            );
            for cut in cuts {
                let item = cut.map(|c| c.data).map_err(|e| StoreError::Io {
                    what: format!("read {name}"),
                    source: std::io::Error::other(e.to_string()),
                });
                let stop = item.is_err();
                if tx.blocking_send(item).is_err() || stop {
                    return;
                }
            }
        });
        let chunks: Vec<ChunkRef> = tokio_stream(rx)
            .map(|item| async move {
                let data = item?;
                if data.len() < MIN_CHUNK as usize {
                    packer.add(&data).await
                } else {
                    self.put_chunk(&data).await
                }
            })
            .buffered(self.concurrency)
            .try_collect()
            .await?;
        let _ = reader.await;
        Ok(chunks)
    }

    /// Write the file made of `chunks` to `out` (replaced; written beside it, then renamed).
    pub async fn get_file(&self, chunks: &[ChunkRef], out: &Path) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        let tmp = out.with_file_name(format!(
            ".{}.part",
            out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
        ));
        let mut f = tokio::fs::File::create(&tmp).await.map_err(StoreError::io(format!("create {}", tmp.display())))?;
        let mut parts = futures::stream::iter(chunks.iter().copied())
            .map(|c| async move { self.get_chunk(&c).await })
            .buffered(self.concurrency);
        let written: Result<()> = async {
            while let Some(part) = parts.next().await {
                f.write_all(&part?).await.map_err(StoreError::io(format!("write {}", tmp.display())))?;
            }
            f.sync_all().await.map_err(StoreError::io(format!("sync {}", tmp.display())))
        }
        .await;
        if let Err(e) = written {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e);
        }
        tokio::fs::rename(&tmp, out).await.map_err(StoreError::io(format!("rename to {}", out.display())))
    }
}

/// The receiver as a stream.
fn tokio_stream<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &Path, secret: u8) -> Store {
        Store::open(&StoreUrl::Local(dir.join("store")), Keys::from_secret(&[secret; 32])).unwrap()
    }

    /// Deterministic bytes that do not compress away (xorshift).
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

    fn objects(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut todo = vec![dir.join("store")];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.file_type().unwrap().is_dir() {
                    todo.push(e.path());
                } else {
                    out.push(e.path());
                }
            }
        }
        out.sort();
        out
    }

    #[tokio::test]
    async fn a_file_round_trips_and_an_edited_copy_uploads_only_what_changed() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 1);
        let a = d.path().join("a");
        let data = noise(9 << 20, 7);
        std::fs::write(&a, &data).unwrap();
        let p = s.packer();
        let chunks = s.put_file(&a, &p).await.unwrap();
        p.finish().await.unwrap();
        assert!(chunks.len() >= 3, "{} chunks", chunks.len());
        assert!(chunks.iter().all(|c| c.len <= MAX_CHUNK));
        assert_eq!(chunks.iter().map(|c| c.len as usize).sum::<usize>(), data.len());
        let first = s.stats();
        // Every chunk an object of its own, but the tail's pack and its index.
        let own = chunks.iter().filter(|c| c.at == Location::Own).count() as u64;
        assert_eq!(first.puts, own + if own < chunks.len() as u64 { 2 } else { 0 });
        // The same file again: nothing written.
        assert_eq!(s.put_file(&a, &p).await.unwrap(), chunks);
        p.finish().await.unwrap();
        assert_eq!(s.stats().puts, first.puts);
        // 100 bytes inserted in the middle: content-defined cuts move only around them.
        let mut edited = data.clone();
        edited.splice(4 << 20..4 << 20, noise(100, 9));
        let b = d.path().join("b");
        std::fs::write(&b, &edited).unwrap();
        let chunks_b = s.put_file(&b, &p).await.unwrap();
        p.finish().await.unwrap();
        let new = s.stats().puts - first.puts;
        assert!(new <= 4, "{new} objects written for a 100-byte insertion");
        let out = d.path().join("out");
        s.get_file(&chunks_b, &out).await.unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), edited);
        // Small and empty files.
        std::fs::write(&a, b"tiny").unwrap();
        let tiny = s.put_file(&a, &p).await.unwrap();
        p.finish().await.unwrap();
        assert_eq!(tiny.len(), 1);
        s.get_file(&tiny, &out).await.unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"tiny");
        std::fs::write(&a, b"").unwrap();
        assert!(s.put_file(&a, &p).await.unwrap().is_empty());
        s.get_file(&[], &out).await.unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"");
    }

    #[tokio::test]
    async fn names_and_contents_reveal_nothing_without_the_key() {
        let d = tempfile::tempdir().unwrap();
        let text = b"the same secret text, stored by two deployments".repeat(100);
        let c1 = store(d.path(), 1).put_chunk(&text).await.unwrap();
        let c2 = store(d.path(), 2).put_chunk(&text).await.unwrap();
        assert_ne!(c1.id, c2.id, "another key names the same content differently");
        assert_ne!(c1.id.0, *blake3::hash(&text).as_bytes(), "the name is not the plain hash");
        for f in objects(d.path()) {
            let raw = std::fs::read(&f).unwrap();
            assert!(!raw.windows(15).any(|w| w == b"the same secret"), "{} holds plaintext", f.display());
        }
        // Another deployment's key cannot read it.
        let e = store(d.path(), 2).get_chunk(&c1).await.unwrap_err().to_string();
        assert!(e.contains("failed authentication") && e.contains(&c1.id.to_string()), "{e}");
    }

    #[tokio::test]
    async fn a_changed_truncated_swapped_or_missing_object_is_an_error_naming_it() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 1);
        let c1 = s.put_chunk(&noise(5000, 1)).await.unwrap();
        let c2 = s.put_chunk(&noise(6000, 2)).await.unwrap();
        let p1 = d.path().join("store").join(c1.id.key());
        let p2 = d.path().join("store").join(c2.id.key());
        let good = std::fs::read(&p1).unwrap();
        let check = |e: StoreError, c: &ChunkRef, what: &str| {
            let e = e.to_string();
            assert!(e.contains(&c.id.key()) && e.contains(what), "{e}");
        };
        let mut bad = good.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 1;
        std::fs::write(&p1, &bad).unwrap();
        check(s.get_chunk(&c1).await.unwrap_err(), &c1, "failed authentication");
        std::fs::write(&p1, &good[..good.len() - 10]).unwrap();
        check(s.get_chunk(&c1).await.unwrap_err(), &c1, "failed authentication");
        std::fs::write(&p1, &good[..3]).unwrap();
        check(s.get_chunk(&c1).await.unwrap_err(), &c1, "failed authentication");
        std::fs::copy(&p2, &p1).unwrap();
        check(s.get_chunk(&c1).await.unwrap_err(), &c1, "failed authentication");
        std::fs::write(&p1, &good).unwrap();
        assert_eq!(s.get_chunk(&c1).await.unwrap(), noise(5000, 1));
        // A reference whose length lies is refused too.
        let liar = ChunkRef { len: c1.len + 1, ..c1 };
        check(s.get_chunk(&liar).await.unwrap_err(), &liar, "failed authentication");
        std::fs::remove_file(&p2).unwrap();
        check(s.get_chunk(&c2).await.unwrap_err(), &c2, "missing");
        // A file made of it: not written at all, no partial file left.
        let out = d.path().join("out");
        assert!(s.get_file(&[c1, c2], &out).await.is_err());
        assert!(!out.exists() && !d.path().join(".out.part").exists());
    }

    #[tokio::test]
    async fn small_files_go_into_a_few_packs_read_back_by_range_and_known_to_another_daemon() {
        let d = tempfile::tempdir().unwrap();
        // Packs of ~1 MiB: 1000 files of 4 KiB are 4 packs, each with its index.
        let s = store(d.path(), 1).with_pack_bytes(1 << 20);
        let files: Vec<Vec<u8>> = (0..1000).map(|i| noise(4096, i + 1)).collect();
        let p = s.packer();
        let mut refs = Vec::new();
        for f in &files {
            refs.push(p.add(f).await.unwrap());
        }
        assert_eq!(p.add(&files[3]).await.unwrap(), refs[3], "the same content is packed once");
        p.finish().await.unwrap();
        let written = s.stats().puts;
        assert!((6..=10).contains(&written), "{written} objects for 1000 small files");
        for (f, r) in files.iter().zip(&refs).step_by(97) {
            assert!(matches!(r.at, Location::Pack { .. }));
            assert_eq!(&s.get_chunk(r).await.unwrap(), f);
        }
        // Another daemon (same store, same keys) learns the packs and writes nothing again.
        let other = store(d.path(), 1);
        assert_eq!(other.load_pack_indexes().await.unwrap(), 1000);
        let p2 = other.packer();
        for (f, r) in files.iter().zip(&refs) {
            assert_eq!(&p2.add(f).await.unwrap(), r);
        }
        p2.finish().await.unwrap();
        assert_eq!(other.stats().puts, 0);
        // A pack above the multipart threshold is uploaded in parts and reads the same.
        let big = store(d.path(), 1).with_pack_bytes(3 * pack::MULTIPART_PART);
        let pb = big.packer();
        let mut last = None;
        for i in 0..((2 * pack::MULTIPART_PART) / 200_000 + 2) {
            last = Some((pb.add(&noise(200_000, 10_000 + i as u64)).await.unwrap(), i));
        }
        pb.finish().await.unwrap();
        let (r, i) = last.unwrap();
        assert_eq!(big.get_chunk(&r).await.unwrap(), noise(200_000, 10_000 + i as u64));
        // A damaged pack fails the chunks in it, naming the pack; a cut-short one too.
        let Location::Pack { pack, offset, .. } = refs[0].at else { unreachable!() };
        let path = d.path().join("store").join(pack.key());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[offset as usize + 40] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = s.get_chunk(&refs[0]).await.unwrap_err().to_string();
        assert!(e.contains(&pack.key()) && e.contains("failed authentication"), "{e}");
        std::fs::write(&path, &bytes[..100]).unwrap();
        let e = s.get_chunk(&refs[1]).await.unwrap_err().to_string();
        assert!(e.contains(&pack.key()), "{e}");
    }

    #[test]
    fn the_key_file_is_made_private_once_and_refused_when_readable_or_wrong() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("store.key");
        let k1 = Keys::load_or_create(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        let k2 = Keys::load_or_create(&p).unwrap();
        assert_eq!(k1.chunk_id(b"x"), k2.chunk_id(b"x"), "the same file gives the same keys");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(Keys::load_or_create(&p).unwrap_err().to_string().contains("chmod 600"));
        std::fs::write(&p, b"short").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Keys::load_or_create(&p).unwrap_err().to_string().contains("5 bytes, not 32"));
    }

    #[test]
    fn store_urls_are_parsed_and_shown_without_secrets() {
        assert_eq!("/var/x".parse::<StoreUrl>().unwrap(), StoreUrl::Local("/var/x".into()));
        assert_eq!("file:///var/x".parse::<StoreUrl>().unwrap(), StoreUrl::Local("/var/x".into()));
        let s3: StoreUrl = "s3://bkt/a/b/?endpoint=http://127.0.0.1:9000&region=eu-1".parse().unwrap();
        assert_eq!(
            s3,
            StoreUrl::S3 {
                bucket: "bkt".into(),
                prefix: "a/b".into(),
                endpoint: Some("http://127.0.0.1:9000".into()),
                region: "eu-1".into()
            }
        );
        assert_eq!(s3.to_string(), "s3://bkt/a/b at http://127.0.0.1:9000");
        for bad in ["file://relative", "s3://", "s3://b?secret=x", "gs://b", "relative/dir"] {
            assert!(bad.parse::<StoreUrl>().is_err(), "{bad}");
        }
    }
}
