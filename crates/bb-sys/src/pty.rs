//! Pseudo-terminals: a new pair on the calling process's devpts (a sandbox's init opens them on
//! the sandbox's own instance), and window-size changes on a master.

use crate::{SysError, SysResult};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};

fn sys(call: &'static str) -> impl Fn(nix::Error) -> SysError {
    move |e| SysError { call, source: std::io::Error::from_raw_os_error(e as i32) }
}

/// Open a new pseudo-terminal (`/dev/ptmx` as this process resolves it), `rows` x `cols`:
/// (master, slave), both close-on-exec, neither made anyone's controlling terminal.
pub fn open_pty(rows: u16, cols: u16) -> SysResult<(OwnedFd, OwnedFd)> {
    use nix::fcntl::OFlag;
    let master =
        nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC).map_err(sys("posix_openpt"))?;
    nix::pty::grantpt(&master).map_err(sys("grantpt"))?;
    nix::pty::unlockpt(&master).map_err(sys("unlockpt"))?;
    let name = nix::pty::ptsname_r(&master).map_err(sys("ptsname"))?;
    // SAFETY: posix_openpt returned an fd we own; PtyMaster gives it up here.
    let master = unsafe { OwnedFd::from_raw_fd(master.into_raw_fd()) };
    let slave = nix::fcntl::open(
        name.as_str(),
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(sys("open pty slave"))?;
    // SAFETY: open returned a new fd we own.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    set_window_size(master_fd(&master), rows, cols)?;
    Ok((master, slave))
}

fn master_fd(fd: &OwnedFd) -> BorrowedFd<'_> {
    use std::os::fd::AsFd;
    fd.as_fd()
}

/// The index of a pty master's slave (N of `/dev/pts/N`).
pub fn pty_index(master: BorrowedFd<'_>) -> SysResult<u32> {
    let mut n: libc::c_uint = 0;
    // SAFETY: TIOCGPTN writes one unsigned int to the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTN, &mut n) };
    if r < 0 {
        return Err(SysError::last("ioctl(TIOCGPTN)"));
    }
    Ok(n)
}

/// A terminal's window size: (rows, cols).
pub fn window_size(fd: BorrowedFd<'_>) -> SysResult<(u16, u16)> {
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes one winsize to the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
    if r < 0 {
        return Err(SysError::last("ioctl(TIOCGWINSZ)"));
    }
    Ok((ws.ws_row, ws.ws_col))
}

/// Set a terminal's window size (the foreground process group gets SIGWINCH).
pub fn set_window_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> SysResult<()> {
    let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads one winsize from the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if r < 0 {
        return Err(SysError::last("ioctl(TIOCSWINSZ)"));
    }
    Ok(())
}

/// Make the terminal on `fd` the calling process's controlling terminal (it must lead a session
/// without one). Allocation-free: callable in a vforked child.
pub fn set_controlling_terminal(fd: i32) -> SysResult<()> {
    // SAFETY: TIOCSCTTY takes an int argument (0: do not steal it from another session).
    let r = unsafe { libc::ioctl(fd, libc::TIOCSCTTY, 0) };
    if r < 0 {
        return Err(SysError::last("ioctl(TIOCSCTTY)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_pty_carries_bytes_and_its_size() {
        let (master, slave) = open_pty(30, 100).expect("open a pty");
        assert_eq!(window_size(master_fd(&slave)).unwrap(), (30, 100));
        set_window_size(master_fd(&master), 40, 120).unwrap();
        assert_eq!(window_size(master_fd(&slave)).unwrap(), (40, 120));
        assert_eq!(window_size(master_fd(&master)).unwrap(), (40, 120));
        let st = nix::sys::stat::fstat(slave.as_raw_fd()).unwrap();
        assert_eq!(libc::minor(st.st_rdev), pty_index(master_fd(&master)).unwrap());
        nix::unistd::write(&slave, b"hi\n").unwrap();
        let mut buf = [0u8; 16];
        let n = nix::unistd::read(master.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hi\r\n", "the line discipline turns \\n into \\r\\n");
    }
}
