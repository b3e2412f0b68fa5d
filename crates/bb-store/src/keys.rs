//! The deployment's keys: one 32-byte secret in a key file (mode 0600), from which the key that
//! names chunks and the key that seals them are derived (BLAKE3 `derive_key`), so neither is
//! ever stored or used for the other's purpose.

use crate::{ChunkId, Result, StoreError};
use chacha20poly1305::aead::rand_core::RngCore;
use std::path::Path;

const NAMING_CONTEXT: &str = "branchbox 2026-11 chunk names";
const SEALING_CONTEXT: &str = "branchbox 2026-11 object sealing";

#[derive(Clone)]
pub struct Keys {
    naming: [u8; 32],
    pub(crate) sealing: [u8; 32],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

impl Keys {
    /// Keys derived from `secret`.
    pub fn from_secret(secret: &[u8; 32]) -> Keys {
        Keys {
            naming: blake3::derive_key(NAMING_CONTEXT, secret),
            sealing: blake3::derive_key(SEALING_CONTEXT, secret),
        }
    }

    /// The keys in the key file at `path`; a missing file is made with a new random secret
    /// (mode 0600). Every daemon sharing a store must be given the same file.
    pub fn load_or_create(path: &Path) -> Result<Keys> {
        use std::io::Write;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let err = |why: String| StoreError::KeyFile { path: path.to_path_buf(), why };
        match std::fs::read(path) {
            Ok(bytes) => {
                let secret: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
                    err(format!("holds {} bytes, not 32: restore the deployment's key file", bytes.len()))
                })?;
                let mode = std::fs::metadata(path).map_err(|e| err(e.to_string()))?.permissions().mode();
                if mode & 0o077 != 0 {
                    return Err(err(format!("mode {:o} lets others read it: chmod 600 it", mode & 0o777)));
                }
                Ok(Keys::from_secret(&secret))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut secret = [0u8; 32];
                chacha20poly1305::aead::OsRng.fill_bytes(&mut secret);
                let tmp = path.with_extension("tmp");
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&tmp)
                    .map_err(|e| err(e.to_string()))?;
                f.write_all(&secret).and_then(|_| f.sync_all()).map_err(|e| err(e.to_string()))?;
                // Two daemons starting at once: the first file made wins, both use it.
                match std::fs::hard_link(&tmp, path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(err(e.to_string())),
                }
                let _ = std::fs::remove_file(&tmp);
                Keys::load_or_create(path)
            }
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// A chunk's name: the keyed hash of its plaintext.
    pub fn chunk_id(&self, data: &[u8]) -> ChunkId {
        ChunkId(*blake3::keyed_hash(&self.naming, data).as_bytes())
    }
}
