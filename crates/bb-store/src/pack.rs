//! Packs: small chunks sealed one after the other into one object, and a sealed index beside it.
//!
//! A pack is `packs/<id[..2]>/<id>` (the id is random: the pack is named before it is full);
//! its index `packs/<id[..2]>/<id>.idx` holds one [`INDEX_ENTRY`]-byte entry per chunk: chunk
//! id, offset, sealed length, plaintext length. Each chunk in a pack is sealed under its own
//! chunk key ([`crate::ChunkId::key`]) as if it were an object of its own, so a chunk read from
//! the wrong place fails authentication, and a repack may move it without re-sealing.

use crate::{seal, ChunkId, ChunkRef, Location, Result, Store, StoreError};
use chacha20poly1305::aead::rand_core::RngCore;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Size a pack is written at (bytes, sealed).
pub const DEFAULT_PACK_BYTES: usize = 16 << 20;
/// Larger objects are uploaded in parts of this size (S3 multipart).
pub const MULTIPART_PART: usize = 8 << 20;
/// Bytes of one index entry.
pub const INDEX_ENTRY: usize = 32 + 8 + 4 + 4;

/// A pack's name (hex in human-readable formats, 16 bytes in binary ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackId(pub [u8; 16]);

impl serde::Serialize for PackId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        crate::ids::serialize(&self.0, s)
    }
}

impl<'de> serde::Deserialize<'de> for PackId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        crate::ids::deserialize(d).map(PackId)
    }
}

impl std::fmt::Display for PackId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl PackId {
    fn new() -> PackId {
        let mut id = [0u8; 16];
        chacha20poly1305::aead::OsRng.fill_bytes(&mut id);
        PackId(id)
    }

    pub fn key(&self) -> String {
        let h = self.to_string();
        format!("packs/{}/{h}", &h[..2])
    }

    /// Its index object's key.
    pub fn index_key(&self) -> String {
        format!("{}.idx", self.key())
    }
}

#[derive(Debug)]
struct Open {
    pack: PackId,
    bytes: Vec<u8>,
    chunks: Vec<ChunkRef>,
    /// Chunks of this packer not yet in a written pack (the same one added twice is packed once).
    pending: HashMap<ChunkId, ChunkRef>,
}

impl Open {
    fn new() -> Open {
        Open { pack: PackId::new(), bytes: Vec::new(), chunks: Vec::new(), pending: HashMap::new() }
    }
}

/// Writes small chunks of one push into packs. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct Packer {
    store: Store,
    open: Arc<tokio::sync::Mutex<Open>>,
}

impl Store {
    /// A packer writing into this store.
    pub fn packer(&self) -> Packer {
        Packer { store: self.clone(), open: Arc::new(tokio::sync::Mutex::new(Open::new())) }
    }

    /// Learn every pack index in the store (another daemon's packs), so their chunks are not
    /// written again. Returns how many chunks they hold.
    pub async fn load_pack_indexes(&self) -> Result<usize> {
        use futures::TryStreamExt;
        let metas: Vec<_> =
            self.inner.list(Some(&ObjectPath::from("packs"))).try_collect().await.map_err(|e| self.backend(e))?;
        let mut n = 0;
        for m in metas.iter().filter(|m| m.location.as_ref().ends_with(".idx")) {
            let key = m.location.to_string();
            let hex = key.rsplit('/').next().and_then(|f| f.strip_suffix(".idx")).unwrap_or_default();
            let mut id = [0u8; 16];
            if hex::decode_to_slice(hex, &mut id).is_err() {
                continue; // not ours
            }
            let pack = PackId(id);
            let sealed = self
                .inner
                .get(&m.location)
                .await
                .map_err(|e| self.backend(e))?
                .bytes()
                .await
                .map_err(|e| self.backend(e))?;
            let tampered = || StoreError::Tampered { store: self.name.clone(), key: key.clone() };
            let plain = seal::open(&self.keys, &key, &sealed, 64 << 20).ok_or_else(tampered)?;
            if plain.len() % INDEX_ENTRY != 0 {
                return Err(tampered());
            }
            let mut packed = self.packed.lock();
            for e in plain.chunks_exact(INDEX_ENTRY) {
                let chunk = decode_entry(pack, e);
                packed.insert(chunk.id, chunk);
                n += 1;
            }
        }
        Ok(n)
    }
}

fn encode_entry(c: &ChunkRef, out: &mut Vec<u8>) {
    let Location::Pack { offset, sealed_len, .. } = c.at else { unreachable!("only packed chunks are indexed") };
    out.extend_from_slice(&c.id.0);
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&sealed_len.to_le_bytes());
    out.extend_from_slice(&c.len.to_le_bytes());
}

fn decode_entry(pack: PackId, e: &[u8]) -> ChunkRef {
    let u32_at = |i: usize| u32::from_le_bytes(e[i..i + 4].try_into().expect("4 bytes"));
    ChunkRef {
        id: ChunkId(e[..32].try_into().expect("32 bytes")),
        len: u32_at(44),
        at: Location::Pack {
            pack,
            offset: u64::from_le_bytes(e[32..40].try_into().expect("8 bytes")),
            sealed_len: u32_at(40),
        },
    }
}

impl Packer {
    /// Add a chunk; returns where it will be (or already is). Valid once [`Packer::finish`]
    /// returned Ok.
    pub async fn add(&self, data: &[u8]) -> Result<ChunkRef> {
        let id = self.store.keys.chunk_id(data);
        if let Some(known) = self.store.packed.lock().get(&id) {
            self.store.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(*known);
        }
        let mut open = self.open.lock().await;
        if let Some(known) = open.pending.get(&id) {
            return Ok(*known);
        }
        let sealed = seal::seal(&self.store.keys, &id.key(), data);
        let chunk = ChunkRef {
            id,
            len: data.len() as u32,
            at: Location::Pack { pack: open.pack, offset: open.bytes.len() as u64, sealed_len: sealed.len() as u32 },
        };
        open.bytes.extend_from_slice(&sealed);
        open.chunks.push(chunk);
        open.pending.insert(id, chunk);
        if open.bytes.len() >= self.store.pack_bytes {
            let full = std::mem::replace(&mut *open, Open::new());
            self.write(full).await?;
        }
        Ok(chunk)
    }

    /// Write what is left. Every reference [`Packer::add`] returned is readable after it.
    pub async fn finish(&self) -> Result<()> {
        let mut open = self.open.lock().await;
        if open.chunks.is_empty() {
            return Ok(());
        }
        let last = std::mem::replace(&mut *open, Open::new());
        self.write(last).await
    }

    async fn write(&self, open: Open) -> Result<()> {
        let s = &self.store;
        let key = open.pack.key();
        let path = ObjectPath::from(key.as_str());
        let n = open.bytes.len() as u64;
        if open.bytes.len() > MULTIPART_PART {
            let upload = s.inner.put_multipart(&path).await.map_err(|e| s.backend(e))?;
            let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, MULTIPART_PART);
            w.put(bytes::Bytes::from(open.bytes));
            w.finish().await.map_err(|e| s.backend(e))?;
        } else {
            let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
            s.inner.put_opts(&path, PutPayload::from(open.bytes), opts).await.map_err(|e| s.backend(e))?;
        }
        let mut index = Vec::with_capacity(open.chunks.len() * INDEX_ENTRY);
        for c in &open.chunks {
            encode_entry(c, &mut index);
        }
        let index_key = open.pack.index_key();
        let sealed = seal::seal(&s.keys, &index_key, &index);
        let m = sealed.len() as u64;
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        s.inner
            .put_opts(&ObjectPath::from(index_key.as_str()), PutPayload::from(sealed), opts)
            .await
            .map_err(|e| s.backend(e))?;
        s.counters.puts.fetch_add(2, Ordering::Relaxed);
        s.counters.put_bytes.fetch_add(n + m, Ordering::Relaxed);
        let mut packed = s.packed.lock();
        for c in open.chunks {
            packed.insert(c.id, c);
        }
        Ok(())
    }
}
