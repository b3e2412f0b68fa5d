//! Where volumes keep their layers on the node: an encrypted filesystem of the daemon's own.
//!
//! A volume's writable layer is what a sandbox's fsync lands in (the volume's write-ahead
//! state) and its frozen or pulled layers are the node's cache of the object store: none of it
//! is kept in clear. The daemon makes an ext4 filesystem in a sparse image
//! (`<state>/volume-fs.img`), mounts it on a loop device at `<state>/volume-fs` and encrypts
//! `<state>/volume-fs/v` with fscrypt (v2 policy: AES-256-XTS contents, AES-256-CTS names) under
//! a master key only the daemon reads (`<state>/volume.key`, or `--volume-key-file`). The
//! sandboxes use the overlay instances the daemon mounts on it and never see the key. Volume
//! layers have ids `sl-v<hex>` and live in `<state>/volume-fs/v/layers`; their overlay work dirs
//! in `.../v/work/<volume>/<n>` (an overlay's work dir shares its upper's filesystem and policy).
//!
//! With `--volume-encryption off` the same paths are plain directories of the state dir's
//! filesystem.

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Result, Runtime};

/// Id prefix of volume layers (`sl-v<hex>`: a snapshot layer's ids are `sl-<hex>`, never `v`).
pub const LAYER_PREFIX: &str = "sl-v";

#[derive(Debug, thiserror::Error)]
pub enum VolumeFsError {
    #[error("cannot set up the volumes' encrypted filesystem ({what}): {problem}; start branchboxd with --volume-encryption off where loop devices, ext4 or fscrypt are unavailable")]
    Setup { what: &'static str, problem: String },
    #[error("the volumes' filesystem {dir} was encrypted with another key than {key}: restore that key file (or move the state dir's volume-fs.img away to start over without the volumes)")]
    WrongKey { dir: PathBuf, key: PathBuf },
    #[error("{dir} holds volume layers written with --volume-encryption off: start branchboxd with --volume-encryption off to use them")]
    WasPlain { dir: PathBuf },
}

/// The mount point of the volumes' filesystem.
pub fn mount_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("volume-fs")
}

fn image(state_dir: &Path) -> PathBuf {
    state_dir.join("volume-fs.img")
}

/// The encrypted directory everything of the volumes goes under.
fn top(state_dir: &Path) -> PathBuf {
    mount_dir(state_dir).join("v")
}

/// Directory of volume layers.
pub fn layers_dir(state_dir: &Path) -> PathBuf {
    top(state_dir).join("layers")
}

/// Where layers being pulled or deleted go first (the same filesystem as the layers).
pub fn tmp_dir(state_dir: &Path) -> PathBuf {
    top(state_dir).join("tmp")
}

/// The lower layer of a volume that has no frozen layer yet.
pub fn empty_dir(state_dir: &Path) -> PathBuf {
    top(state_dir).join("empty")
}

/// Overlay work dirs of volume `id`.
pub fn work_dir(state_dir: &Path, id: &str) -> PathBuf {
    top(state_dir).join("work").join(id)
}

fn run(what: &'static str, cmd: &mut Command) -> std::result::Result<(), VolumeFsError> {
    let out = cmd.output().map_err(setup_err(what))?;
    if !out.status.success() {
        let problem = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(VolumeFsError::Setup { what, problem: format!("{} ({})", problem, out.status) });
    }
    Ok(())
}

fn setup_err<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> VolumeFsError {
    move |e| VolumeFsError::Setup { what, problem: e.to_string() }
}

/// Make (first time), mount (after a reboot) and unlock the volumes' filesystem; idempotent.
/// Returns whether it is encrypted.
pub(crate) fn ensure(cfg: &crate::RuntimeConfig) -> std::result::Result<bool, VolumeFsError> {
    let state = &cfg.state_dir;
    let dir = mount_dir(state);
    std::fs::create_dir_all(&dir).map_err(setup_err("create its mount point"))?;
    if !cfg.volume_encryption {
        make_dirs(state)?;
        return Ok(false);
    }
    if !super::is_mountpoint(&dir) {
        let img = image(state);
        if !img.exists() {
            if top(state).exists() {
                return Err(VolumeFsError::WasPlain { dir: top(state) });
            }
            let tmp = state.join("volume-fs.img.new");
            let _ = std::fs::remove_file(&tmp);
            let f = std::fs::File::create(&tmp).map_err(setup_err("create its image"))?;
            f.set_len(cfg.volume_fs_bytes).map_err(setup_err("size its image"))?;
            drop(f);
            // Sparse and lazily initialised: the image takes the space its files take (`discard`
            // gives freed blocks back).
            run(
                "mkfs.ext4",
                Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-O", "encrypt", "-m", "0", "-L", "bb-volumes"])
                    .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
                    .arg(&tmp),
            )?;
            std::fs::rename(&tmp, &img).map_err(setup_err("name its image"))?;
        }
        run(
            "mount",
            Command::new("mount")
                .args(["-t", "ext4", "-o", "loop,discard,noinit_itable,nosuid,nodev"])
                .arg(&img)
                .arg(&dir),
        )?;
    }
    let key = bb_sys::secret::load_or_create(&cfg.volume_key(), bb_sys::fscrypt::KEY_LEN)
        .map_err(setup_err("load its key"))?;
    let key: [u8; bb_sys::fscrypt::KEY_LEN] = key[..].try_into().expect("key length");
    let mnt = std::fs::File::open(&dir).map_err(setup_err("open its mount point"))?;
    let ident = bb_sys::fscrypt::add_key(mnt.as_fd(), &key).map_err(setup_err("add its key"))?;
    let top = top(state);
    match std::fs::create_dir(&top) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(setup_err("create its encrypted dir")(e)),
    }
    let t = std::fs::File::open(&top).map_err(setup_err("open its encrypted dir"))?;
    match bb_sys::fscrypt::set_policy(t.as_fd(), ident) {
        Ok(()) => {}
        Err(e) if e.errno() == libc::EEXIST => return Err(VolumeFsError::WrongKey { dir: top, key: cfg.volume_key() }),
        Err(e) => return Err(setup_err("encrypt its dir")(e)),
    }
    make_dirs(state)?;
    Ok(true)
}

fn make_dirs(state: &Path) -> std::result::Result<(), VolumeFsError> {
    for d in [layers_dir(state), tmp_dir(state), top(state).join("work"), empty_dir(state)] {
        std::fs::create_dir_all(&d).map_err(setup_err("create its dirs"))?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).map_err(setup_err("chmod its dirs"))?;
    }
    Ok(())
}

impl Runtime {
    /// The volumes' filesystem, ready (made and mounted on first use). Blocking.
    pub(crate) fn volume_fs_ready(&self) -> Result<()> {
        let mut ready = self.volumes.fs_ready.lock();
        if ready.is_none() {
            *ready = Some(ensure(&self.cfg)?);
        }
        Ok(())
    }

    /// [`Self::volume_fs_ready`] off the async threads (making it takes a mkfs and a mount).
    pub(crate) async fn volume_fs_ready_async(self: &std::sync::Arc<Self>) -> Result<()> {
        if self.volume_fs_encrypted().is_some() {
            return Ok(());
        }
        let rt = self.clone();
        tokio::task::spawn_blocking(move || rt.volume_fs_ready()).await.map_err(crate::RuntimeError::Worker)?
    }

    /// Whether the volumes' layers are encrypted on this node (`None`: not set up yet).
    pub(crate) fn volume_fs_encrypted(&self) -> Option<bool> {
        *self.volumes.fs_ready.lock()
    }

    /// At start: mount the volumes' filesystem again if this node has one (after a reboot).
    pub(crate) fn recover_volume_fs(&self) -> Result<()> {
        let state = &self.cfg.state_dir;
        if image(state).exists() || top(state).exists() {
            self.volume_fs_ready()?;
            // Pulls and removals a crash cut short.
            for e in std::fs::read_dir(tmp_dir(state)).into_iter().flat_map(|rd| rd.flatten()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(())
    }
}
