//! The deployment's keys: one 32-byte secret in a key file (mode 0600), from which the key that
//! names chunks and the key that seals them are derived (BLAKE3 `derive_key`), so neither is
//! ever stored or used for the other's purpose.

use crate::{ChunkId, Result, StoreError};
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
        let secret = bb_sys::secret::load_or_create(path, 32).map_err(|e| StoreError::KeyFile {
            path: path.to_path_buf(),
            why: format!("{e} (every daemon sharing a store needs the deployment's key file)"),
        })?;
        Ok(Keys::from_secret(&secret.try_into().expect("32 bytes")))
    }

    /// A chunk's name: the keyed hash of its plaintext.
    pub fn chunk_id(&self, data: &[u8]) -> ChunkId {
        ChunkId(*blake3::keyed_hash(&self.naming, data).as_bytes())
    }
}
