//! Read-only image layers and the overlay mounts that stack them into sandbox roots.
//!
//! An *image* is an ordered list of read-only *layers* (plain directories under
//! `<state>/layers/<layer_id>/`), shared by every sandbox that uses it. A sandbox root is
//! `overlay(lower = image layers, upper = the sandbox's private writable dir)`, see [`overlay`].
//!
//! * [`ImageStore::build_base`] runs `debootstrap --variant=minbase` (debs cached under
//!   `<state>/cache/debootstrap`) and turns the result into a one-layer image.
//! * [`ImageStore::import`] reads a `docker save` tarball or an OCI image layout (directory or tar,
//!   multi-arch indexes resolved to the host architecture). Layers are keyed by their diff_id
//!   (`sha256:` of the uncompressed tar), unpacked once and shared between images. Tar entries are
//!   written relative to the layer root without ever resolving a symlink (`openat2`
//!   `RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS`); absolute or escaping paths abort the import.
//!   OCI whiteouts become overlay whiteouts (char 0/0) and opaque markers become
//!   `trusted.overlay.opaque=y`; device nodes are skipped.
//! * [`flatten()`] merges the bottom layers of a growing snapshot chain into one equivalent layer
//!   (copy of their read-only merged view; reflinks where the filesystem has them).
//! * Sandboxes run in a user namespace mapping ids `0..size` to `host_base..host_base+size`
//!   ([`IdMap`]), so every file (layer roots included) is stored with `host_base + id` as owner.
//! * Image records live in the `images` table of `<state>/branchbox.db` (SQLite, WAL). Replacing
//!   or removing an image deletes the layers no remaining image references, except those the
//!   optional [`ImageStore::set_layer_in_use_check`] hook reports as in use (collect them later
//!   with [`ImageStore::gc`]).
//!
//! Layer ids are `sha256:<64 hex>` (imported layers: the OCI diff_id) or `local:<32 hex>` (built
//! locally). Everything here needs root (chown to the shifted ids, mknod whiteouts, `trusted.*`
//! xattrs, mounting).

pub mod flatten;
pub mod overlay;

mod base;
mod extract;
mod fsutil;
mod import;
mod store;

pub use flatten::{flatten, flatten_onto, FlattenStats};
pub use overlay::{mount_overlay, new_writable, overlay_fd, supports_reflink, unmount, OverlaySpec};
pub use store::{valid_layer_id, ImageStore};

use bb_sys::SysError;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::PathBuf;

/// The sandbox user namespace mapping: in-sandbox ids `0..size` are host ids
/// `host_base..host_base + size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdMap {
    pub host_base: u32,
    pub size: u32,
}

impl Default for IdMap {
    fn default() -> Self {
        IdMap { host_base: 1_000_000, size: 65_536 }
    }
}

impl IdMap {
    /// Host id for an in-sandbox id, `None` if `id` is outside the mapping.
    pub fn to_host(&self, id: u32) -> Option<u32> {
        if id < self.size {
            self.host_base.checked_add(id)
        } else {
            None
        }
    }
}

/// A stored image. `layers` are layer ids, bottom first (reverse them for overlay's lowerdir
/// order, see [`ImageStore::layer_path`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Image {
    pub name: String,
    /// `sha256:` of the image config (imported) or of a synthesized config (built).
    pub id: String,
    pub layers: Vec<String>,
    /// `KEY=value` strings.
    pub env: Vec<String>,
    pub workdir: Option<String>,
    /// Entrypoint followed by Cmd (imported) or `/bin/bash` (built).
    pub cmd: Vec<String>,
    /// Sum of the layers' regular-file sizes (shared layers counted in every image).
    pub size_bytes: u64,
    /// Unix seconds.
    pub created_at: f64,
    /// `"debootstrap"` or `"oci"`.
    pub source: String,
}

/// Progress of a long operation. `Step` is emitted where a total is known; everything else is a
/// `Stage` with a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    Stage { stage: String, message: String },
    Step { stage: String, done: u64, total: u64 },
}

/// Options for [`ImageStore::build_base`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseImageOpts {
    /// Debian suite, e.g. `bookworm`.
    pub suite: String,
    /// Debian mirror URL; default `$BRANCHBOX_MIRROR` or `http://deb.debian.org/debian`.
    pub mirror: String,
    /// Extra packages (`--include`).
    pub packages: Vec<String>,
}

impl Default for BaseImageOpts {
    fn default() -> Self {
        BaseImageOpts {
            suite: "bookworm".into(),
            mirror: std::env::var("BRANCHBOX_MIRROR")
                .ok()
                .filter(|m| !m.trim().is_empty())
                .unwrap_or_else(|| "http://deb.debian.org/debian".into()),
            packages: [
                "python3",
                "bash",
                "coreutils",
                "git",
                "procps",
                "ca-certificates",
                "curl",
                "sudo",
                "libnss-myhostname",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        }
    }
}

/// Everything that can go wrong in this crate. Messages say what to change.
#[derive(Debug, thiserror::Error)]
pub enum LayersError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("image database {}: {context}: {source}; check that the state directory is writable and the database is not corrupted", .path.display())]
    Db {
        path: PathBuf,
        context: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    #[error("image `{name}` not found; run `branchbox image ls` to see the available images")]
    NotFound { name: String },
    #[error("invalid image name `{name}`: use 1-128 characters from `A-Z a-z 0-9 . _ - : / @ +`, starting with a letter or digit")]
    InvalidName { name: String },
    #[error("invalid {field} `{value}`: {hint}")]
    InvalidOption { field: &'static str, value: String, hint: &'static str },
    #[error("debootstrap not found in PATH, /usr/sbin or /sbin; install it with `apt-get install debootstrap`")]
    DebootstrapMissing,
    #[error("debootstrap {status}; check the suite, mirror and package names and that the mirror is reachable. Last output:\n{output}")]
    DebootstrapFailed { status: String, output: String },
    #[error("{}: {reason}; pass a `docker save` tarball or an OCI image layout (directory or tar), e.g. from `docker save -o image.tar IMAGE` or `skopeo copy docker://IMAGE oci-archive:image.tar`", .path.display())]
    UnsupportedSource { path: PathBuf, reason: String },
    #[error("image {} is malformed: {reason}; re-export the image", .path.display())]
    BadImage { path: PathBuf, reason: String },
    #[error(
        "layer {layer}: entry `{entry}` {reason}; refusing to import this image (the layer is malformed or malicious)"
    )]
    UnsafeEntry { layer: String, entry: String, reason: String },
    #[error("{path}: {what} {id} is outside the sandbox id range 0..{size}; rebuild the image so every file is owned by ids below {size}")]
    IdOutOfRange { path: String, what: &'static str, id: u64, size: u32 },
    #[error("layer {layer}: uncompressed content has digest {actual}, but the image config says {expected}; the image is corrupted, re-export it")]
    DigestMismatch { layer: String, expected: String, actual: String },
    #[error("{} has no linux/{arch} image (available: {available}); export the image for this host, e.g. `docker save --platform linux/{arch}`", .path.display())]
    NoMatchingPlatform { path: PathBuf, arch: String, available: String },
    #[error("layer {layer} of image `{image}` is missing from {}; remove the image (`branchbox image rm {image}`) and import or build it again", .path.display())]
    LayerMissing { image: String, layer: String, path: PathBuf },
    #[error("mounting overlay on {} failed at {step}: {source}{detail}", .target.display())]
    Mount {
        step: &'static str,
        target: PathBuf,
        #[source]
        source: SysError,
        /// Kernel messages from the filesystem context and a hint, prefixed with "; ".
        detail: String,
    },
    #[error("unmounting {} failed: {source}; check for processes still using it (`fuser -vm {}`)", .target.display(), .target.display())]
    Unmount {
        target: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("{} already exists and is not empty; pass a fresh directory for a new writable layer", .path.display())]
    NotEmpty { path: PathBuf },
}

impl LayersError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        LayersError::Io { context: context.into(), source }
    }
}

/// `map_err` helper: `.map_err(io_err(format!("creating {}", p.display())))`.
pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> LayersError {
    let context = context.into();
    move |source| LayersError::Io { context, source }
}

/// Unix time now, in seconds.
pub(crate) fn now_secs() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idmap_to_host() {
        let m = IdMap::default();
        assert_eq!(m.to_host(0), Some(1_000_000));
        assert_eq!(m.to_host(65_535), Some(1_065_535));
        assert_eq!(m.to_host(65_536), None);
        assert_eq!(IdMap { host_base: u32::MAX, size: 10 }.to_host(1), None);
    }

    #[test]
    fn store_is_shareable_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ImageStore>();
        assert_send_sync::<LayersError>();
    }

    #[test]
    fn default_opts() {
        let o = BaseImageOpts::default();
        assert_eq!(o.suite, "bookworm");
        assert!(o.packages.iter().any(|p| p == "python3"));
        assert!(o.mirror.starts_with("http"));
    }

    #[test]
    fn not_found_message_points_to_image_ls() {
        let msg = LayersError::NotFound { name: "foo".into() }.to_string();
        assert!(msg.contains("`foo`") && msg.contains("branchbox image ls"), "{msg}");
    }
}
