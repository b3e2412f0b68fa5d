//! Filesystem helpers shared by the base-image builder and the importer: private work dirs under
//! `<state>/tmp`, tree removal that never descends into mounts, ownership shifting, sizes.

use crate::{io_err, IdMap, LayersError};
use nix::fcntl::{Flock, FlockArg};
use nix::sys::stat::{fchmodat, FchmodatFlags, Mode};
use nix::unistd::{fchownat, Gid, Uid};
use std::collections::HashSet;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// `n` random bytes as lowercase hex.
pub(crate) fn random_hex(n: usize) -> Result<String, LayersError> {
    let mut buf = vec![0u8; n];
    File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).map_err(io_err("reading /dev/urandom"))?;
    Ok(hex::encode(buf))
}

/// A private scratch directory `<state>/tmp/<prefix>-<random>/`, holding an exclusive flock on its
/// `.lock` file while alive so that stale-dir cleanup in another process leaves it alone. Removed
/// (with everything in it, after detaching any mounts below it) on drop.
pub(crate) struct WorkDir {
    pub path: PathBuf,
    _lock: Flock<File>,
}

impl WorkDir {
    pub fn new(tmp_root: &Path, prefix: &str) -> Result<WorkDir, LayersError> {
        let path = tmp_root.join(format!("{prefix}-{}", random_hex(8)?));
        fs::create_dir(&path).map_err(io_err(format!("creating work dir {}", path.display())))?;
        let lock_path = path.join(".lock");
        let file = File::create(&lock_path).map_err(io_err(format!("creating {}", lock_path.display())))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| LayersError::io(format!("locking {}", lock_path.display()), e.into()))?;
        Ok(WorkDir { path, _lock: lock })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove work dir");
        }
    }
}

/// Remove entries of `tmp_root` left behind by a crashed process: work dirs whose `.lock` nobody
/// holds, and `trash-*` dirs.
pub(crate) fn clean_stale_tmp(tmp_root: &Path) {
    let Ok(rd) = fs::read_dir(tmp_root) else { return };
    for ent in rd.flatten() {
        let path = ent.path();
        let name = ent.file_name().to_string_lossy().into_owned();
        // A work dir is briefly unlocked between its creation and its owner taking the lock.
        let age = ent.metadata().ok().and_then(|m| m.modified().ok()).and_then(|t| t.elapsed().ok());
        let young = match age {
            Some(age) => age < std::time::Duration::from_secs(60),
            None => true,
        };
        let stale = if name.starts_with("trash-") {
            true
        } else if young {
            false
        } else {
            match File::open(path.join(".lock")) {
                // Held lock: in use. Acquired: stale (the lock is released when `f` drops, after
                // removal has started; a new WorkDir never reuses a name).
                Ok(f) => Flock::lock(f, FlockArg::LockExclusiveNonblock).is_ok(),
                Err(_) => true,
            }
        };
        if stale {
            if let Err(e) = remove_tree(&path) {
                tracing::warn!(path = %path.display(), error = %e, "could not remove stale tmp entry");
            }
        }
    }
}

/// Decode the octal escapes (`\040`) the kernel uses in /proc/self/mountinfo.
pub(crate) fn unescape_mountinfo(s: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Mount points at or below `root` in this mount namespace, deepest first.
pub(crate) fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .filter(|p| p.starts_with(root))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    v
}

/// Detach every mount at or below `root` (debootstrap mounts /proc, /sys and, when it thinks it
/// runs in a container, bind-mounts host device nodes into its target; deleting through such a
/// bind mount would delete host files).
pub(crate) fn unmount_under(root: &Path) -> Result<(), LayersError> {
    for m in mounts_under(root) {
        match nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(LayersError::Unmount { target: m, source: e }),
        }
    }
    Ok(())
}

/// Remove a directory tree (or file) without following symlinks and without ever deleting through
/// a mount point below it. Missing paths are fine.
pub(crate) fn remove_tree(path: &Path) -> Result<(), LayersError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(LayersError::io(format!("inspecting {}", path.display()), e)),
    };
    if !meta.is_dir() {
        return fs::remove_file(path).map_err(io_err(format!("removing {}", path.display())));
    }
    unmount_under(path)?;
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LayersError::io(format!("removing {}", path.display()), e)),
    }
}

/// Sum of regular-file sizes below `root` (hard links counted once, symlinks not followed).
pub(crate) fn tree_size(root: &Path) -> u64 {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    for ent in walkdir::WalkDir::new(root).follow_links(false).same_file_system(true).into_iter().flatten() {
        if !ent.file_type().is_file() {
            continue;
        }
        if let Ok(m) = ent.metadata() {
            if m.nlink() > 1 && !seen.insert((m.dev(), m.ino())) {
                continue;
            }
            total += m.len();
        }
    }
    total
}

/// Translate a `security.capability` value into one that is valid on the host for a file inside a
/// sandbox: v1/v2 values (namespace-independent) are kept, v3 values are turned into v2 when their
/// root id is 0 (the image's root) and dropped otherwise. `None` = do not set the xattr.
pub(crate) fn caps_for_host(v: &[u8]) -> Option<Vec<u8>> {
    if v.len() < 4 {
        return None;
    }
    let magic = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    match (magic & 0xFF00_0000, v.len()) {
        (0x0100_0000, 12) | (0x0200_0000, 20) => Some(v.to_vec()),
        (0x0300_0000, 24) => {
            let rootid = u32::from_le_bytes([v[20], v[21], v[22], v[23]]);
            if rootid != 0 {
                return None;
            }
            let magic2 = (magic & 0x00FF_FFFF) | 0x0200_0000;
            let mut out = v[..20].to_vec();
            out[..4].copy_from_slice(&magic2.to_le_bytes());
            Some(out)
        }
        _ => None,
    }
}

const CAPS_XATTR: &str = "security.capability";

/// Shift the ownership of every entry below (and including) `root` from in-image ids to host ids
/// (`host_base + id`), keeping setuid/setgid bits and file capabilities (both are cleared by the
/// kernel on chown, so they are restored afterwards). Never follows symlinks or crosses mounts.
/// Returns the tree's size (regular files, hard links once).
pub(crate) fn shift_tree(root: &Path, idmap: &IdMap) -> Result<u64, LayersError> {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    for ent in walkdir::WalkDir::new(root).follow_links(false).same_file_system(true) {
        let ent = ent.map_err(|e| {
            let ctx = format!("walking {}", root.display());
            LayersError::io(ctx, e.into())
        })?;
        let path = ent.path();
        let meta = fs::symlink_metadata(path).map_err(io_err(format!("inspecting {}", path.display())))?;
        if !meta.is_dir() && meta.nlink() > 1 && !seen.insert((meta.dev(), meta.ino())) {
            continue; // another name of an inode already shifted
        }
        if meta.is_file() {
            total += meta.len();
        }
        let display = || path.strip_prefix(root).unwrap_or(path).display().to_string();
        let uid = idmap.to_host(meta.uid()).ok_or_else(|| LayersError::IdOutOfRange {
            path: format!("/{}", display()),
            what: "uid",
            id: meta.uid() as u64,
            size: idmap.size,
        })?;
        let gid = idmap.to_host(meta.gid()).ok_or_else(|| LayersError::IdOutOfRange {
            path: format!("/{}", display()),
            what: "gid",
            id: meta.gid() as u64,
            size: idmap.size,
        })?;
        let caps = if meta.is_file() { xattr::get(path, CAPS_XATTR).ok().flatten() } else { None };
        fchownat(
            None,
            path,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| LayersError::io(format!("chown {}", path.display()), e.into()))?;
        if !meta.file_type().is_symlink() {
            let mode = Mode::from_bits_truncate(meta.mode() & 0o7777);
            fchmodat(None, path, mode, FchmodatFlags::FollowSymlink)
                .map_err(|e| LayersError::io(format!("chmod {}", path.display()), e.into()))?;
        }
        if let Some(c) = caps.as_deref().and_then(caps_for_host) {
            xattr::set(path, CAPS_XATTR, &c)
                .map_err(io_err(format!("restoring file capabilities of {}", path.display())))?;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape_mountinfo(r"/a\040b\134c"), PathBuf::from("/a b\\c"));
        assert_eq!(unescape_mountinfo("/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape_mountinfo(r"/trail\04"), PathBuf::from(r"/trail\04"));
    }

    #[test]
    fn caps_translation() {
        let mut v2 = vec![0u8; 20];
        v2[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
        v2[4] = 0x20; // CAP_NET_RAW bit 13 in permitted
        assert_eq!(caps_for_host(&v2), Some(v2.clone()));
        let mut v3 = v2.clone();
        v3[..4].copy_from_slice(&0x0300_0001u32.to_le_bytes());
        v3.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(caps_for_host(&v3), Some(v2.clone()), "v3 with rootid 0 becomes v2");
        let mut v3_other = v3.clone();
        v3_other[20..].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(caps_for_host(&v3_other), None);
        assert_eq!(caps_for_host(&[1, 2]), None);
        assert_eq!(caps_for_host(&v2[..19]), None);
    }

    #[test]
    fn random_hex_is_random() {
        let a = random_hex(16).unwrap();
        assert_eq!(a.len(), 32);
        assert_ne!(a, random_hex(16).unwrap());
    }
}
