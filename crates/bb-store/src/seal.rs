//! Sealed objects: `MAGIC || nonce (24 bytes) || XChaCha20-Poly1305(zstd(plaintext))`, with the
//! object's name as associated data, so an object copied under another name fails too.

use crate::Keys;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::XChaCha20Poly1305;

/// Format tag of a sealed object.
pub const MAGIC: &[u8; 4] = b"BBS1";
const NONCE: usize = 24;
/// zstd level: fast (the store is often faster than a stronger level would be).
const LEVEL: i32 = 3;

/// Seal `plain` as the object named `name`.
pub fn seal(keys: &Keys, name: &str, plain: &[u8]) -> Vec<u8> {
    let packed = zstd::bulk::compress(plain, LEVEL).expect("zstd compresses any input in memory");
    let cipher = XChaCha20Poly1305::new((&keys.sealing).into());
    let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
    let body = cipher
        .encrypt(&nonce, Payload { msg: &packed, aad: name.as_bytes() })
        .expect("XChaCha20-Poly1305 encrypts any length we write");
    let mut out = Vec::with_capacity(MAGIC.len() + NONCE + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&body);
    out
}

/// The plaintext of `sealed`, the object named `name`, at most `max` bytes; None when it does
/// not authenticate (changed, truncated, another name's or another key's) or is not ours.
pub fn open(keys: &Keys, name: &str, sealed: &[u8], max: usize) -> Option<Vec<u8>> {
    let rest = sealed.strip_prefix(MAGIC)?;
    if rest.len() < NONCE {
        return None;
    }
    let (nonce, body) = rest.split_at(NONCE);
    let cipher = XChaCha20Poly1305::new((&keys.sealing).into());
    let packed = cipher.decrypt(nonce.into(), Payload { msg: body, aad: name.as_bytes() }).ok()?;
    zstd::bulk::decompress(&packed, max).ok()
}
