//! Small helpers for reading and writing cgroupfs control files. Every error names the file.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::{fs_hint, write_hint, IsolationError, Result};

/// Read a whole control file.
pub(crate) fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|source| fs_err("read", path, source))
}

/// Write `value` to an existing control file with a single write(2), as the kernel expects
/// (each write is one command). The file is never created: a missing control file means the
/// controller is not there, and that must be an error, not a stray regular file. (O_TRUNC is what
/// `echo v > file` does too; cgroupfs ignores it, the fake cgroupfs of the unit tests needs it.)
pub(crate) fn write(path: &Path, value: &str) -> Result<()> {
    let file = fs::OpenOptions::new().write(true).truncate(true).open(path);
    let result = file.and_then(|mut f| {
        let n = f.write(value.as_bytes())?;
        if n != value.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, format!("short write: {n} of {} bytes", value.len())));
        }
        Ok(())
    });
    result.map_err(|source| {
        let hint = write_hint(path, &source);
        IsolationError::Write { path: path.to_owned(), value: value.to_owned(), source, hint }
    })
}

/// Read a file holding one unsigned number; "max" (v2) reads as `u64::MAX`.
pub(crate) fn read_u64(path: &Path) -> Result<u64> {
    let text = read(path)?;
    parse_u64(&text).ok_or_else(|| parse_err(path, format!("expected a number, got {text:?}")))
}

pub(crate) fn parse_u64(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return Some(u64::MAX);
    }
    t.parse().ok()
}

/// Value of `key` in a flat keyed file ("key value" per line), e.g. memory.events,
/// memory.oom_control, cgroup.events.
pub(crate) fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        if it.next()? == key {
            parse_u64(it.next()?)
        } else {
            None
        }
    })
}

/// Parse cgroup.procs: one pid per line.
pub(crate) fn parse_pids(path: &Path, text: &str) -> Result<Vec<i32>> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.parse::<i32>().map_err(|_| parse_err(path, format!("bad pid line {l:?}"))))
        .collect()
}

pub(crate) fn fs_err(op: &'static str, path: &Path, source: io::Error) -> IsolationError {
    let hint = fs_hint(&source);
    IsolationError::Fs { op, path: path.to_owned(), source, hint }
}

pub(crate) fn parse_err(path: &Path, detail: String) -> IsolationError {
    IsolationError::Parse { path: PathBuf::from(path), detail }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_numbers() {
        assert_eq!(parse_u64("123\n"), Some(123));
        assert_eq!(parse_u64("max\n"), Some(u64::MAX));
        assert_eq!(parse_u64("-1"), None);
        assert_eq!(parse_u64(""), None);
    }

    #[test]
    fn keyed_files() {
        let oom = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(keyed(oom, "oom_kill"), Some(3));
        assert_eq!(keyed(oom, "oom_kill_disable"), Some(0));
        assert_eq!(keyed(oom, "oom"), None);
        let events = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(keyed(events, "oom_kill"), Some(1));
        assert_eq!(keyed("populated 1\nfrozen 0\n", "frozen"), Some(0));
    }

    #[test]
    fn pids_file() {
        let p = Path::new("/x/cgroup.procs");
        assert_eq!(parse_pids(p, "12\n345\n").unwrap(), vec![12, 345]);
        assert_eq!(parse_pids(p, "").unwrap(), Vec::<i32>::new());
        let err = parse_pids(p, "12\nabc\n").unwrap_err().to_string();
        assert!(err.contains("/x/cgroup.procs") && err.contains("abc"), "{err}");
    }

    #[test]
    fn write_never_creates_and_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("pids.max");
        let err = write(&missing, "10").unwrap_err();
        assert!(!missing.exists(), "write must not create control files");
        let msg = err.to_string();
        assert!(msg.contains("pids.max") && msg.contains("\"10\""), "{msg}");
        assert!(msg.contains("controller"), "ENOENT hint missing: {msg}");

        fs::write(&missing, "max\n").unwrap();
        write(&missing, "10").unwrap();
        assert_eq!(read_u64(&missing).unwrap(), 10);
    }
}
