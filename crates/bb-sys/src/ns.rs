//! Namespace and mount-tree syscalls used to swap a running sandbox's root filesystem from the
//! host: `setns`, `unshare`, `open_tree`, `move_mount` between arbitrary fds/paths, `pivot_root`,
//! `umount2`, `fchdir`; and sockets made in a sandbox's network namespace.

use crate::{check, SysResult};
use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

/// `open_tree` flags.
pub const OPEN_TREE_CLONE: u32 = 1;
pub const OPEN_TREE_CLOEXEC: u32 = libc::O_CLOEXEC as u32;
/// `move_mount` flags.
pub const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x0000_0004;
/// `move_mount` flag: the target is the `to_dirfd` itself (empty path).
pub const MOVE_MOUNT_T_EMPTY_PATH: u32 = 0x0000_0040;

fn cpath(call: &'static str, p: &Path) -> SysResult<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes()).map_err(|_| crate::SysError {
        call,
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains a NUL byte"),
    })
}

/// `setns(fd, nstype)` for the calling thread.
pub fn setns(fd: BorrowedFd<'_>, nstype: libc::c_int) -> SysResult<()> {
    // SAFETY: plain integer arguments; fd is borrowed for the call.
    let ret = unsafe { libc::setns(fd.as_raw_fd(), nstype) };
    check("setns", ret as libc::c_long).map(drop)
}

/// `unshare(flags)` for the calling thread (e.g. `CLONE_FS` before `setns(CLONE_NEWNS)` in a
/// multi-threaded process).
pub fn unshare(flags: libc::c_int) -> SysResult<()> {
    // SAFETY: plain integer argument.
    let ret = unsafe { libc::unshare(flags) };
    check("unshare", ret as libc::c_long).map(drop)
}

/// `open_tree(dirfd, path, flags)`. With `path` empty, `AT_EMPTY_PATH` is added so `dirfd`
/// itself (e.g. a detached mount from `fsmount`) is the source.
pub fn open_tree(dirfd: BorrowedFd<'_>, path: &Path, flags: u32) -> SysResult<OwnedFd> {
    let c = cpath("open_tree", path)?;
    let flags = if path.as_os_str().is_empty() { flags | libc::AT_EMPTY_PATH as u32 } else { flags };
    // SAFETY: c is a valid NUL-terminated string outliving the call; dirfd is borrowed.
    let ret = unsafe { libc::syscall(libc::SYS_open_tree, dirfd.as_raw_fd(), c.as_ptr(), flags) };
    let fd = check("open_tree", ret)?;
    // SAFETY: open_tree returned a fresh fd that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `move_mount(from_dirfd, from_path, to_dirfd, to_path, flags)`. `None` dirfds mean `AT_FDCWD`.
pub fn move_mount(
    from_dirfd: Option<BorrowedFd<'_>>,
    from_path: &Path,
    to_dirfd: Option<BorrowedFd<'_>>,
    to_path: &Path,
    flags: u32,
) -> SysResult<()> {
    let from = cpath("move_mount", from_path)?;
    let to = cpath("move_mount", to_path)?;
    let fd = |d: Option<BorrowedFd<'_>>| d.map(|d| d.as_raw_fd()).unwrap_or(libc::AT_FDCWD);
    // SAFETY: both strings are valid NUL-terminated strings outliving the call; fds are borrowed.
    let ret =
        unsafe { libc::syscall(libc::SYS_move_mount, fd(from_dirfd), from.as_ptr(), fd(to_dirfd), to.as_ptr(), flags) };
    check("move_mount", ret).map(drop)
}

/// `fchdir(fd)`.
pub fn fchdir(fd: BorrowedFd<'_>) -> SysResult<()> {
    // SAFETY: plain integer argument.
    let ret = unsafe { libc::fchdir(fd.as_raw_fd()) };
    check("fchdir", ret as libc::c_long).map(drop)
}

/// `pivot_root(".", ".")` then `umount2(".", MNT_DETACH)`: the mount at the cwd becomes the root of
/// the caller's mount namespace, and every process whose root (or cwd) was the old root now has
/// the new one; the old root is detached (it lives on while something still references it).
pub fn pivot_root_to_cwd() -> SysResult<()> {
    crate::process::pivot_root_here()
}

/// `umount2(path, flags)`.
pub fn umount2(path: &Path, flags: libc::c_int) -> SysResult<()> {
    let c = cpath("umount2", path)?;
    // SAFETY: valid NUL-terminated path.
    let ret = unsafe { libc::umount2(c.as_ptr(), flags) };
    check("umount2", ret as libc::c_long).map(drop)
}

/// A new TCP/IPv4 socket (non-blocking, close-on-exec) in network namespace `netns` (e.g.
/// `/proc/<pid>/ns/net`); see [`socket_in`].
pub fn tcp_socket_in(netns: &Path) -> SysResult<OwnedFd> {
    socket_in(netns, libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0)
}

/// A new close-on-exec rtnetlink socket (blocking) in network namespace `netns`, to change its
/// links, addresses and routes; see [`socket_in`].
pub fn rtnetlink_socket_in(netns: &Path) -> SysResult<OwnedFd> {
    socket_in(netns, libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE)
}

/// `socket(domain, ty, protocol)` in network namespace `netns`. A thread of its own enters the
/// namespace, makes the socket and ends: a socket stays in the namespace it was made in, and
/// the caller's threads never change namespace.
pub fn socket_in(netns: &Path, domain: libc::c_int, ty: libc::c_int, protocol: libc::c_int) -> SysResult<OwnedFd> {
    let ns = std::fs::File::open(netns).map_err(|source| crate::SysError { call: "open netns", source })?;
    std::thread::scope(|s| {
        s.spawn(|| {
            use std::os::fd::AsFd;
            setns(ns.as_fd(), libc::CLONE_NEWNET)?;
            // SAFETY: plain integer arguments.
            let fd = unsafe { libc::socket(domain, ty, protocol) };
            let fd = check("socket", fd as libc::c_long)?;
            // SAFETY: socket returned a fresh fd that we own.
            Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
        })
        .join()
        .unwrap_or_else(|_| {
            Err(crate::SysError { call: "socket", source: std::io::Error::other("the namespace thread panicked") })
        })
    })
}
