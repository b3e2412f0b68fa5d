//! A run's output while it runs, read from the host.
//!
//! A session server writes a run's stdout and stderr into two memfds it makes for that run
//! (`bb-stdout`, `bb-stderr`; see `server.py`) and answers with their whole content when the run
//! ends. [`OutputTail`] follows those memfds through `/proc/<pid>/fd` meanwhile, so the daemon
//! can pass output on as it is written, with no change to the session protocol and nothing
//! running in the sandbox. Text is cut at UTF-8 character boundaries; what a run writes past
//! [`MAX_TAIL`] per stream only comes with its answer.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// A piece of a run's output, as it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutput {
    Stdout(String),
    Stderr(String),
}

/// Bytes followed per stream and run (the session server keeps as much: `MAX_OUTPUT`).
pub const MAX_TAIL: u64 = 16 * 1024 * 1024;
/// Bytes read per stream and poll.
const READ_CHUNK: usize = 256 * 1024;

/// The memfds of one run of the session server whose host pid is given.
pub struct OutputTail {
    fd_dir: PathBuf,
    streams: [Follow; 2],
}

struct Follow {
    /// What `/proc/<pid>/fd/N` reads for this stream's memfd.
    link: &'static str,
    file: Option<File>,
    offset: u64,
    /// The start of a UTF-8 character whose end was not written yet.
    partial: Vec<u8>,
}

impl Follow {
    fn new(link: &'static str) -> Follow {
        Follow { link, file: None, offset: 0, partial: Vec::new() }
    }
}

impl OutputTail {
    pub fn new(host_pid: i32) -> OutputTail {
        OutputTail {
            fd_dir: PathBuf::from(format!("/proc/{host_pid}/fd")),
            streams: [Follow::new("/memfd:bb-stdout (deleted)"), Follow::new("/memfd:bb-stderr (deleted)")],
        }
    }

    /// What was written since the last call (stdout first). Until the run has made its memfds
    /// (or if the process is gone) there is nothing.
    pub fn poll(&mut self) -> Vec<RunOutput> {
        if self.streams.iter().any(|s| s.file.is_none()) {
            self.find();
        }
        let mut out = Vec::new();
        for (i, s) in self.streams.iter_mut().enumerate() {
            let Some(file) = &s.file else { continue };
            let mut buf = vec![0u8; READ_CHUNK];
            while s.offset < MAX_TAIL {
                let want = READ_CHUNK.min((MAX_TAIL - s.offset) as usize);
                match file.read_at(&mut buf[..want], s.offset) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        s.partial.extend_from_slice(&buf[..n]);
                        s.offset += n as u64;
                    }
                }
            }
            let text = take_text(&mut s.partial);
            if !text.is_empty() {
                out.push(if i == 0 { RunOutput::Stdout(text) } else { RunOutput::Stderr(text) });
            }
        }
        out
    }

    /// Open the run's memfds among the process's fds (by the name the server gave them).
    fn find(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.fd_dir) else { return };
        for e in entries.flatten() {
            let Ok(target) = std::fs::read_link(e.path()) else { continue };
            let Some(s) = self.streams.iter_mut().find(|s| s.file.is_none() && target.as_os_str() == s.link) else {
                continue;
            };
            // Reopened through /proc: a description of our own, read at our own offsets.
            if let Ok(f) = File::open(e.path()) {
                s.file = Some(f);
            }
        }
    }
}

/// The text of `buf` up to its last whole UTF-8 character (invalid bytes become U+FFFD); the
/// start of an unfinished character stays in `buf`.
fn take_text(buf: &mut Vec<u8>) -> String {
    let whole = match std::str::from_utf8(buf) {
        Ok(_) => buf.len(),
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => buf.len() - unfinished_tail(buf),
    };
    let rest = buf.split_off(whole);
    let text = String::from_utf8_lossy(buf).into_owned();
    *buf = rest;
    text
}

/// How many bytes at the end of `buf` start a UTF-8 character that is not finished.
fn unfinished_tail(buf: &[u8]) -> usize {
    for back in 1..=3.min(buf.len()) {
        let b = buf[buf.len() - back];
        if b & 0xC0 != 0x80 {
            // A lead byte: how long its character is.
            let len = match b {
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                0xF0..=0xF7 => 4,
                _ => 1,
            };
            return if len > back { back } else { 0 };
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn text_is_cut_at_character_boundaries() {
        let mut b = "añ".as_bytes().to_vec();
        b.push(0xE2); // the first byte of "€"
        assert_eq!(take_text(&mut b), "añ");
        assert_eq!(b, vec![0xE2]);
        b.extend_from_slice(&[0x82, 0xAC, b'!']);
        assert_eq!(take_text(&mut b), "€!");
        assert!(b.is_empty());
        // An invalid byte does not hold back what follows it; an unfinished end still waits.
        let mut b = vec![b'x', 0xFF, b'y', 0xF0, 0x9F];
        assert_eq!(take_text(&mut b), "x\u{FFFD}y");
        assert_eq!(b, vec![0xF0, 0x9F]);
    }

    fn memfd(name: &str) -> File {
        let fd = nix::sys::memfd::memfd_create(
            &std::ffi::CString::new(name).unwrap(),
            nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .unwrap();
        File::from(fd)
    }

    #[test]
    fn a_runs_memfds_are_followed_through_proc() {
        let mut tail = OutputTail::new(std::process::id() as i32);
        assert_eq!(tail.poll(), vec![], "no run yet");
        let mut out = memfd("bb-stdout");
        let mut err = memfd("bb-stderr");
        out.write_all(b"line 1\n").unwrap();
        assert_eq!(tail.poll(), vec![RunOutput::Stdout("line 1\n".into())]);
        assert_eq!(tail.poll(), vec![]);
        out.write_all("two €".as_bytes()).unwrap();
        err.write_all(b"oops\n").unwrap();
        out.write_all(&[0xE2]).unwrap();
        assert_eq!(tail.poll(), vec![RunOutput::Stdout("two €".into()), RunOutput::Stderr("oops\n".into())]);
        out.write_all(&[0x82, 0xAC]).unwrap();
        assert_eq!(tail.poll(), vec![RunOutput::Stdout("€".into())]);
    }
}
