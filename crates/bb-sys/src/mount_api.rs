//! New mount API (fsopen/fsconfig/fsmount/move_mount), `openat2` and `FICLONE`.
//!
//! Thin, safe wrappers: each function is one syscall, takes borrowed fds and Rust strings/paths,
//! and returns a [`SysError`] naming the call on failure. Constants are spelled out here (from
//! `linux/mount.h` and `linux/openat2.h`) so callers do not depend on which ones a libc release
//! happens to export.
//!
//! When an `fsconfig` call fails, the kernel usually queues a human-readable reason on the
//! filesystem context fd; [`fs_context_messages`] drains it so callers can put it into their error.

use crate::{check, SysError, SysResult};
use std::ffi::{CString, OsStr};
use std::os::fd::AsFd;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `fsopen` flag: the returned context fd is close-on-exec.
pub const FSOPEN_CLOEXEC: u32 = 0x0000_0001;
/// `fsmount` flag: the returned mount fd is close-on-exec.
pub const FSMOUNT_CLOEXEC: u32 = 0x0000_0001;

/// `fsmount` attribute flags (`MOUNT_ATTR_*`).
pub const MOUNT_ATTR_RDONLY: u32 = 0x0000_0001;
pub const MOUNT_ATTR_NOSUID: u32 = 0x0000_0002;
pub const MOUNT_ATTR_NODEV: u32 = 0x0000_0004;
pub const MOUNT_ATTR_NOEXEC: u32 = 0x0000_0008;
pub const MOUNT_ATTR_NOATIME: u32 = 0x0000_0010;
pub const MOUNT_ATTR_NODIRATIME: u32 = 0x0000_0080;
pub const MOUNT_ATTR_NOSYMFOLLOW: u32 = 0x0020_0000;

/// `fsconfig` commands (`enum fsconfig_command`).
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_SET_FD: libc::c_uint = 5;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;

/// `move_mount` flag: the source is the fd itself (empty path).
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x0000_0004;

/// `openat2` resolve flags (`RESOLVE_*`, linux/openat2.h).
pub const RESOLVE_NO_XDEV: u64 = 0x01;
pub const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
pub const RESOLVE_NO_SYMLINKS: u64 = 0x04;
pub const RESOLVE_BENEATH: u64 = 0x08;
pub const RESOLVE_IN_ROOT: u64 = 0x10;
pub const RESOLVE_CACHED: u64 = 0x20;

/// `struct open_how` (linux/openat2.h, version 0: 24 bytes).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

fn cstring(call: &'static str, s: &OsStr) -> SysResult<CString> {
    CString::new(s.as_bytes()).map_err(|_| SysError {
        call,
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "argument contains a NUL byte"),
    })
}

/// Turn a new-fd return value into an `OwnedFd`.
fn owned_fd(call: &'static str, ret: libc::c_long) -> SysResult<OwnedFd> {
    let fd = check(call, ret)?;
    // SAFETY: the syscall succeeded and returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `fsopen(fstype, flags)`: create a filesystem context, e.g. `fsopen("overlay", FSOPEN_CLOEXEC)`.
pub fn fsopen(fstype: &str, flags: u32) -> SysResult<OwnedFd> {
    let fstype = cstring("fsopen", OsStr::new(fstype))?;
    // SAFETY: fstype is a valid NUL-terminated string that outlives the call.
    let ret = unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), flags as libc::c_uint) };
    owned_fd("fsopen", ret)
}

/// `fsconfig(fd, FSCONFIG_SET_STRING, key, value, 0)`.
pub fn fsconfig_set_string(fd: BorrowedFd<'_>, key: &str, value: impl AsRef<OsStr>) -> SysResult<()> {
    let key = cstring("fsconfig", OsStr::new(key))?;
    let value = cstring("fsconfig", value.as_ref())?;
    // SAFETY: key and value are valid NUL-terminated strings that outlive the call; fd is borrowed
    // for the duration of the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fd.as_raw_fd(),
            FSCONFIG_SET_STRING,
            key.as_ptr(),
            value.as_ptr(),
            0 as libc::c_int,
        )
    };
    check("fsconfig(FSCONFIG_SET_STRING)", ret).map(drop)
}

/// `fsconfig(fd, FSCONFIG_SET_FLAG, key, NULL, 0)`.
pub fn fsconfig_set_flag(fd: BorrowedFd<'_>, key: &str) -> SysResult<()> {
    let key = cstring("fsconfig", OsStr::new(key))?;
    // SAFETY: key is a valid NUL-terminated string that outlives the call; value must be NULL for
    // FSCONFIG_SET_FLAG.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fd.as_raw_fd(),
            FSCONFIG_SET_FLAG,
            key.as_ptr(),
            std::ptr::null::<libc::c_char>(),
            0 as libc::c_int,
        )
    };
    check("fsconfig(FSCONFIG_SET_FLAG)", ret).map(drop)
}

/// `fsconfig(fd, FSCONFIG_SET_FD, key, NULL, value)`.
pub fn fsconfig_set_fd(fd: BorrowedFd<'_>, key: &str, value: BorrowedFd<'_>) -> SysResult<()> {
    let key = cstring("fsconfig", OsStr::new(key))?;
    // SAFETY: key is a valid NUL-terminated string that outlives the call; value must be NULL for
    // FSCONFIG_SET_FD; both fds are borrowed for the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fd.as_raw_fd(),
            FSCONFIG_SET_FD,
            key.as_ptr(),
            std::ptr::null::<libc::c_char>(),
            value.as_raw_fd(),
        )
    };
    check("fsconfig(FSCONFIG_SET_FD)", ret).map(drop)
}

/// A detached procfs mount (`nosuid,nodev,noexec`) showing pid namespace `pidns` (an fd of
/// `/proc/<pid>/ns/pid`), via procfs's `pidns=` option (Linux 6.15). The caller needs
/// CAP_SYS_ADMIN over that namespace, which must descend from its own. Mounting a procfs is
/// only allowed where an unmasked one is already visible to the caller, so a process can make
/// one for a sandbox nested below it whose own mount namespace would be refused.
pub fn procfs_for_pidns(pidns: BorrowedFd<'_>) -> SysResult<OwnedFd> {
    let fs = fsopen("proc", FSOPEN_CLOEXEC)?;
    fsconfig_set_fd(fs.as_fd(), "pidns", pidns)?;
    fsconfig_create(fs.as_fd())?;
    fsmount(fs.as_fd(), FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
}

/// `fsconfig(fd, FSCONFIG_CMD_CREATE, NULL, NULL, 0)`: create the superblock.
pub fn fsconfig_create(fd: BorrowedFd<'_>) -> SysResult<()> {
    // SAFETY: FSCONFIG_CMD_CREATE takes no pointers (both NULL); fd is borrowed for the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fd.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0 as libc::c_int,
        )
    };
    check("fsconfig(FSCONFIG_CMD_CREATE)", ret).map(drop)
}

/// Drain the messages the kernel queued on a filesystem context fd (lines like
/// `e overlay: failed to resolve 'x': -2`). Returns them without the trailing newline; never fails
/// (an fd without messages, or a read error, yields what was collected so far).
pub fn fs_context_messages(fd: BorrowedFd<'_>) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    // The kernel keeps at most 8 messages per context.
    for _ in 0..16 {
        // SAFETY: buf is a valid writable buffer of buf.len() bytes; fd is borrowed for the call.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        let msg = String::from_utf8_lossy(&buf[..n as usize]);
        out.push(msg.trim_end().to_string());
    }
    out
}

/// `fsmount(fd, flags, attr_flags)`: turn a created context into a detached mount.
pub fn fsmount(fd: BorrowedFd<'_>, flags: u32, attr_flags: u32) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments; fd is borrowed for the call.
    let ret =
        unsafe { libc::syscall(libc::SYS_fsmount, fd.as_raw_fd(), flags as libc::c_uint, attr_flags as libc::c_uint) };
    owned_fd("fsmount", ret)
}

/// `struct mount_attr` (linux/mount.h, version 0: 32 bytes).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `mount_setattr(fd, "", AT_EMPTY_PATH, {attr_set})`: set `MOUNT_ATTR_*` flags on the mount
/// `fd` refers to (a detached one from `open_tree(OPEN_TREE_CLONE)` included), that mount only.
pub fn mount_setattr(fd: BorrowedFd<'_>, attr_set: u32) -> SysResult<()> {
    let attr = MountAttr { attr_set: attr_set as u64, attr_clr: 0, propagation: 0, userns_fd: 0 };
    let empty = c"";
    // SAFETY: `empty` and `attr` outlive the call and the size passed is `attr`'s; fd is borrowed.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check("mount_setattr", ret).map(drop)
}

/// `move_mount(fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH)`: attach a detached mount (from
/// [`fsmount`] or `open_tree`) at `target` (relative paths are relative to the cwd).
pub fn move_mount_to(fd: BorrowedFd<'_>, target: &Path) -> SysResult<()> {
    let empty = c"";
    let target = cstring("move_mount", target.as_os_str())?;
    // SAFETY: both strings are valid NUL-terminated strings that outlive the call; fd is borrowed.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            fd.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    check("move_mount", ret).map(drop)
}

/// `openat2(dirfd, path, {flags, mode, resolve})`.
///
/// `flags` are `O_*` flags (`O_CLOEXEC` is always added), `mode` is only used with `O_CREAT` /
/// `O_TMPFILE` and must be 0 otherwise, `resolve` is a combination of the `RESOLVE_*` constants.
/// Typical uses: `RESOLVE_IN_ROOT` to treat `dirfd` as `/` (absolute symlinks and `..` stay inside),
/// `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` to refuse anything that leaves `dirfd` or crosses a symlink.
pub fn openat2(
    dirfd: BorrowedFd<'_>,
    path: impl AsRef<Path>,
    flags: i32,
    mode: u32,
    resolve: u64,
) -> SysResult<OwnedFd> {
    let path = cstring("openat2", path.as_ref().as_os_str())?;
    let how = OpenHow { flags: (flags | libc::O_CLOEXEC) as u32 as u64, mode: mode as u64, resolve };
    // SAFETY: path is a valid NUL-terminated string and `how` a properly initialised open_how whose
    // size we pass; both outlive the call. dirfd is borrowed for the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dirfd.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    owned_fd("openat2", ret)
}

/// `ioctl(dest, FICLONE, src)`: make `dest` share `src`'s extents (reflink copy). Fails with
/// `EOPNOTSUPP`/`EINVAL`/`EXDEV` where the filesystem (or the pair) cannot reflink.
pub fn ficlone(dest: BorrowedFd<'_>, src: BorrowedFd<'_>) -> SysResult<()> {
    // SAFETY: FICLONE takes the source fd as its integer argument; both fds are borrowed for the call.
    let ret = unsafe { libc::ioctl(dest.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) };
    check("ioctl(FICLONE)", ret as libc::c_long).map(drop)
}

/// `FS_TOPDIR_FL` (linux/fs.h): directories made under one are spread over the filesystem's
/// block groups like top-level directories (ext2/3/4's Orlov allocator), instead of packed into
/// the group of their parent.
const FS_TOPDIR_FL: libc::c_long = 0x0002_0000;

/// Mark directory `dir` as a top of a hierarchy (`chattr +T`). Returns whether the filesystem
/// took the flag: only the ext family has it (`ENOTTY`/`EOPNOTSUPP` elsewhere, `Ok(false)`).
pub fn set_topdir(dir: BorrowedFd<'_>) -> SysResult<bool> {
    let mut flags: libc::c_long = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one long through the pointer, which outlives the call.
    let ret = unsafe { libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags as *mut libc::c_long) };
    if let Err(e) = check("ioctl(FS_IOC_GETFLAGS)", ret as libc::c_long) {
        return match e.errno() {
            libc::ENOTTY | libc::EOPNOTSUPP | libc::EINVAL => Ok(false),
            _ => Err(e),
        };
    }
    if flags & FS_TOPDIR_FL != 0 {
        return Ok(true);
    }
    flags |= FS_TOPDIR_FL;
    // SAFETY: FS_IOC_SETFLAGS reads one long through the pointer, which outlives the call.
    let ret = unsafe { libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags as *const libc::c_long) };
    match check("ioctl(FS_IOC_SETFLAGS)", ret as libc::c_long) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.errno(), libc::ENOTTY | libc::EOPNOTSUPP | libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn open_how_is_version_0_size() {
        assert_eq!(std::mem::size_of::<OpenHow>(), 24);
    }

    #[test]
    fn topdir_flag_is_set_where_the_filesystem_has_it() {
        let dir = std::env::temp_dir().join(format!("bb-sys-topdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let f = std::fs::File::open(&dir).unwrap();
        let took = set_topdir(f.as_fd()).unwrap();
        let mut flags: libc::c_long = 0;
        // SAFETY: FS_IOC_GETFLAGS writes one long through the pointer.
        let ret = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags as *mut libc::c_long) };
        if took {
            assert_eq!(ret, 0);
            assert_ne!(flags & FS_TOPDIR_FL, 0, "flag reported set but not read back");
            assert!(set_topdir(f.as_fd()).unwrap(), "idempotent");
        } else {
            // Not the ext family: no flags at all, or none of this one.
            assert!(ret != 0 || flags & FS_TOPDIR_FL == 0);
        }
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn openat2_refuses_escape_and_symlinks() {
        let dir = std::env::temp_dir().join(format!("bb-sys-openat2-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/f"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc", dir.join("link")).unwrap();
        let root = std::fs::File::open(&dir).unwrap();
        let fd = root.as_fd();

        openat2(fd, "sub/f", libc::O_RDONLY, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS).unwrap();
        let e = openat2(fd, "../x", libc::O_RDONLY, 0, RESOLVE_BENEATH).unwrap_err();
        assert_eq!(e.errno(), libc::EXDEV, "{e}");
        let e = openat2(fd, "link/passwd", libc::O_RDONLY, 0, RESOLVE_NO_SYMLINKS).unwrap_err();
        assert_eq!(e.errno(), libc::ELOOP, "{e}");
        // IN_ROOT: the absolute symlink resolves inside dir, where etc/passwd does not exist.
        let e = openat2(fd, "link/passwd", libc::O_RDONLY, 0, RESOLVE_IN_ROOT).unwrap_err();
        assert_eq!(e.errno(), libc::ENOENT, "{e}");
        assert_eq!(e.call, "openat2");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The whole new-mount-API chain: a read-only tmpfs via fsopen/fsconfig/fsmount/move_mount.
    #[test]
    fn mount_readonly_tmpfs() {
        assert!(is_root(), "this test mounts a tmpfs; run it as root");
        let dir = std::env::temp_dir().join(format!("bb-sys-mount-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fs = fsopen("tmpfs", FSOPEN_CLOEXEC).unwrap();
        fsconfig_set_string(fs.as_fd(), "size", "1m").unwrap();
        fsconfig_set_flag(fs.as_fd(), "ro").unwrap();
        let e = fsconfig_set_string(fs.as_fd(), "no-such-option", "1").unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(fs_context_messages(fs.as_fd()).iter().any(|m| m.contains("no-such-option")));
        fsconfig_create(fs.as_fd()).unwrap();
        let mnt = fsmount(fs.as_fd(), FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC).unwrap();
        move_mount_to(mnt.as_fd(), &dir).unwrap();
        let err = std::fs::write(dir.join("f"), b"x").unwrap_err();
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS));
        let line = info.lines().find(|l| l.contains(dir.to_str().unwrap())).expect("mounted");
        assert!(line.contains("tmpfs") && line.contains("nodev") && line.contains("noexec"), "{line}");
    }

    fn is_root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    #[test]
    fn fsopen_unknown_fs_names_call() {
        let e = fsopen("no-such-filesystem-type", FSOPEN_CLOEXEC).unwrap_err();
        assert_eq!(e.call, "fsopen");
        // ENODEV for an unknown type; EPERM when not privileged.
        assert!(matches!(e.errno(), libc::ENODEV | libc::EPERM), "{e}");
    }
}
