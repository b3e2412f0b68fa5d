//! A seam for signalling processes, so logic that decides whom to kill can be unit-tested
//! without root or real processes.
//!
//! Code that kills takes a `&dyn Signaller` (or a generic `S: Signaller`); the daemon passes
//! [`Host`], which is [`crate::process::kill`] / [`crate::process::kill_group`]. Tests pass a
//! `RecordingSignaller` (feature `fake`, or this crate's own tests): it records every call
//! and answers `ESRCH` for the pids it was told are gone, like the kernel for a process that
//! has exited. Both refuse the same arguments (`EINVAL` for a pid <= 0 or a group <= 1), so a
//! test also catches a kill that would have broadcast.

use crate::SysResult;

/// Sends signals to processes by pid.
pub trait Signaller: Send + Sync {
    /// `kill(pid, sig)` of one process (`sig` 0: existence check); see [`crate::process::kill`].
    fn kill(&self, pid: i32, sig: i32) -> SysResult<()>;
    /// `kill(-pgid, sig)`; see [`crate::process::kill_group`].
    fn kill_group(&self, pgid: i32, sig: i32) -> SysResult<()>;
}

/// The real thing: signals go to the kernel.
#[derive(Debug, Clone, Copy, Default)]
pub struct Host;

impl Signaller for Host {
    fn kill(&self, pid: i32, sig: i32) -> SysResult<()> {
        crate::process::kill(pid, sig)
    }

    fn kill_group(&self, pgid: i32, sig: i32) -> SysResult<()> {
        crate::process::kill_group(pgid, sig)
    }
}

/// Whom a recorded signal was sent to.
#[cfg(any(test, feature = "fake"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Pid(i32),
    Group(i32),
}

/// One call seen by a [`RecordingSignaller`].
#[cfg(any(test, feature = "fake"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    pub target: Target,
    pub sig: i32,
}

/// A test double: records calls instead of signalling. Pids marked [`gone`](Self::gone) answer
/// `ESRCH` (for [`Signaller::kill`] and, as group ids, for [`Signaller::kill_group`]); calls
/// that fail are recorded too, in order.
#[cfg(any(test, feature = "fake"))]
#[derive(Debug, Default)]
pub struct RecordingSignaller {
    state: std::sync::Mutex<Recorded>,
}

#[cfg(any(test, feature = "fake"))]
#[derive(Debug, Default)]
struct Recorded {
    sent: Vec<Sent>,
    gone: std::collections::HashSet<i32>,
}

#[cfg(any(test, feature = "fake"))]
impl RecordingSignaller {
    pub fn new() -> Self {
        Self::default()
    }

    /// From now on `pid` (and group `pid`) answers `ESRCH`.
    pub fn gone(&self, pid: i32) -> &Self {
        self.lock().gone.insert(pid);
        self
    }

    /// Every call so far, oldest first.
    pub fn sent(&self) -> Vec<Sent> {
        self.lock().sent.clone()
    }

    /// Every call so far, oldest first, forgetting them.
    pub fn take(&self) -> Vec<Sent> {
        std::mem::take(&mut self.lock().sent)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Recorded> {
        // A test that panicked while holding the lock has failed already; its record is still
        // worth reading.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record(&self, target: Target, sig: i32, call: &'static str, valid: bool) -> SysResult<()> {
        let mut st = self.lock();
        st.sent.push(Sent { target, sig });
        let id = match target {
            Target::Pid(p) | Target::Group(p) => p,
        };
        let errno = if !valid {
            libc::EINVAL
        } else if st.gone.contains(&id) {
            libc::ESRCH
        } else {
            return Ok(());
        };
        Err(crate::SysError { call, source: std::io::Error::from_raw_os_error(errno) })
    }
}

#[cfg(any(test, feature = "fake"))]
impl Signaller for RecordingSignaller {
    fn kill(&self, pid: i32, sig: i32) -> SysResult<()> {
        self.record(Target::Pid(pid), sig, "kill", pid > 0)
    }

    fn kill_group(&self, pgid: i32, sig: i32) -> SysResult<()> {
        self.record(Target::Group(pgid), sig, "kill(-pgid)", pgid > 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a caller under test might do: SIGKILL each pid, counting the ones still there.
    fn kill_all(s: &dyn Signaller, pids: &[i32]) -> usize {
        pids.iter().filter(|&&p| s.kill(p, libc::SIGKILL).is_ok()).count()
    }

    #[test]
    fn recording_signaller_records_and_answers_esrch_for_gone_pids() {
        let s = RecordingSignaller::new();
        s.gone(20).gone(30);
        assert_eq!(kill_all(&s, &[10, 20, 30, 40]), 2);
        assert_eq!(s.kill(20, 0).unwrap_err().errno(), libc::ESRCH);
        assert_eq!(s.kill_group(30, libc::SIGTERM).unwrap_err().errno(), libc::ESRCH);
        s.kill_group(10, libc::SIGTERM).unwrap();
        let sent = s.take();
        assert_eq!(sent.len(), 7);
        assert_eq!(sent[0], Sent { target: Target::Pid(10), sig: libc::SIGKILL });
        assert_eq!(sent[6], Sent { target: Target::Group(10), sig: libc::SIGTERM });
        assert!(s.sent().is_empty());
    }

    #[test]
    fn both_refuse_broadcasts_alike() {
        let fake = RecordingSignaller::new();
        for s in [&Host as &dyn Signaller, &fake] {
            assert_eq!(s.kill(0, 0).unwrap_err().errno(), libc::EINVAL);
            assert_eq!(s.kill(-1, 0).unwrap_err().errno(), libc::EINVAL);
            assert_eq!(s.kill_group(1, 0).unwrap_err().errno(), libc::EINVAL);
            assert_eq!(s.kill_group(0, 0).unwrap_err().errno(), libc::EINVAL);
        }
    }

    #[test]
    fn host_signals_a_real_process() {
        let mut child = std::process::Command::new("/bin/sleep").arg("60").spawn().unwrap();
        let pid = child.id() as i32;
        Host.kill(pid, 0).unwrap();
        Host.kill(pid, libc::SIGKILL).unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert_eq!(Host.kill(pid, 0).unwrap_err().errno(), libc::ESRCH);
    }
}
