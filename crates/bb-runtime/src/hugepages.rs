//! Huge pages for session memory, at low priority in the background.
//!
//! Forking a process copies one page-table entry per 4 KiB page; backed by 2 MiB transparent
//! huge pages, the same memory costs one entry per 2 MiB. So:
//! * a template forked into many children ([`COLLAPSE_MIN_FORK`]) is collapsed once
//!   ([`Runtime::collapse_template`]);
//! * a live session with much of its heap in small pages ([`SESSION_COLLAPSE_MIN`]) is
//!   collapsed after a checkpoint, 2 MiB at a time while it is idle
//!   ([`Runtime::maybe_collapse_session`]). A session that splits its huge pages back at once
//!   (it rewrites its heap between checkpoints) is collapsed less and less often ([`SessionThp`]).
//!
//! The cost is a copy of the collapsed memory (no longer shared with the process it was forked
//! from) and CPU; BENCHMARKS.md has the measured gains.

use crate::sandbox::procs::ns_pid;
use crate::sandbox::Sandbox;
use crate::session::Session;
use crate::Runtime;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// Children of one fork from which its templates are collapsed into huge pages afterwards.
pub const COLLAPSE_MIN_FORK: usize = 8;

/// Anonymous memory in 4 KiB pages from which a live session is collapsed into huge pages.
pub const SESSION_COLLAPSE_MIN: u64 = 16 << 20;

/// Session processes remembered by [`Runtime::maybe_collapse_session`] before the dead are
/// forgotten.
const SESSION_THP_KEEP: usize = 256;

/// A collapse that lasted this long before the session split it back was worth it.
const SESSION_THP_WORTH: std::time::Duration = std::time::Duration::from_secs(30);

/// What [`Runtime::maybe_collapse_session`] remembers of a live session process. A session that
/// rewrites its whole heap between checkpoints (e.g. walks every object: reference counts are
/// writes) splits every huge page back at once: collapsing it again each time costs CPU and
/// saves nothing, so each quick split doubles the checkpoints it waits (up to 15).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SessionThp {
    host: i32,
    /// Bytes still in small pages after the last collapse, and when it ended.
    last: Option<(u64, Instant)>,
    /// Collapses split back soon after, in a row.
    strikes: u32,
    /// Checkpoints to let pass before the next try.
    skip: u32,
    busy: bool,
}

impl SessionThp {
    fn new(host: i32) -> SessionThp {
        SessionThp { host, last: None, strikes: 0, skip: 0, busy: false }
    }

    /// At a checkpoint, with `small` bytes of the session in small pages: collapse now?
    fn due(&mut self, small: u64, now: Instant) -> bool {
        if self.busy {
            return false;
        }
        match self.last {
            None if small < SESSION_COLLAPSE_MIN => return false,
            None => {}
            Some((left, _)) if small < 2 * left + SESSION_COLLAPSE_MIN => return false,
            Some((_, at)) => {
                if now.saturating_duration_since(at) >= SESSION_THP_WORTH {
                    self.strikes = 0;
                    self.skip = 0;
                } else if self.skip > 0 {
                    self.skip -= 1;
                    return false;
                } else {
                    self.strikes = (self.strikes + 1).min(4);
                    self.skip = (1 << self.strikes) - 1;
                }
            }
        }
        self.busy = true;
        true
    }

    fn done(&mut self, left: u64, now: Instant) {
        self.busy = false;
        self.last = Some((left, now));
    }
}

/// Collapse the private anonymous memory of `host_pid` into transparent huge pages, in aligned
/// 2 MiB chunks at low priority. `gate` runs before each chunk and returns a guard held over
/// it, or `None` to stop. Returns the bytes collapsed.
pub(crate) fn collapse_memory<G>(host_pid: i32, gate: impl FnMut() -> Option<G>) -> std::result::Result<usize, String> {
    let _nice = bb_sys::process::niced_thread(15);
    collapse_chunks(host_pid, gate)
}

pub(crate) fn collapse_chunks<G>(
    host_pid: i32,
    mut gate: impl FnMut() -> Option<G>,
) -> std::result::Result<usize, String> {
    const HUGE: u64 = 2 << 20;
    let regions = bb_sys::process::anon_rw_regions(host_pid, HUGE).map_err(|e| e.to_string())?;
    let pidfd = bb_sys::process::pidfd_open(host_pid).map_err(|e| e.to_string())?;
    let mut done = 0usize;
    for (start, len) in regions {
        let mut a = start.next_multiple_of(HUGE);
        while a + HUGE <= start + len {
            let Some(guard) = gate() else { return Ok(done) };
            // Each chunk is retried a few times: EAGAIN is transient (a page briefly held, e.g.
            // by a fork copying this memory map), and one failing chunk (no huge page free)
            // must not stop the others.
            for attempt in 0..4 {
                match bb_sys::process::process_madvise(&pidfd, &[(a, HUGE)], bb_sys::process::MADV_COLLAPSE) {
                    Ok(n) => {
                        done += n;
                        break;
                    }
                    Err(e) if e.errno() == libc::EAGAIN && attempt < 3 => {
                        std::thread::sleep(std::time::Duration::from_millis(5))
                    }
                    Err(e) if e.errno() == libc::ESRCH => return Ok(done),
                    Err(_) => break,
                }
            }
            drop(guard);
            a += HUGE;
        }
    }
    Ok(done)
}

/// What the huge-page work remembers: templates collapsed (or being collapsed), and live
/// session processes looked at.
#[derive(Default)]
pub struct HugePages {
    pub(crate) templates: Mutex<HashSet<String>>,
    pub(crate) sessions: Mutex<HashMap<String, SessionThp>>,
}

impl HugePages {
    /// A template left the pool: a new one with its key (never reused) starts afresh.
    pub(crate) fn forget_template(&self, key: &str) {
        self.templates.lock().remove(key);
    }
}

impl Runtime {
    /// Back a template's heap with transparent huge pages, once, in the background (at low
    /// priority): forking it then copies a few hundred page-table entries instead of one per
    /// 4 KiB page. It costs a copy of its memory (the template no longer shares those pages with
    /// the live session) and CPU, so only templates forked into many children get it.
    pub(crate) fn collapse_template(&self, key: &str, host_pid: i32) {
        if !self.hugepages.templates.lock().insert(key.to_string()) {
            return;
        }
        let _ = std::thread::Builder::new().name("bb-thp".into()).spawn(move || {
            let t0 = Instant::now();
            match collapse_memory(host_pid, || Some(())) {
                Ok(bytes) => tracing::debug!(pid = host_pid, mib = bytes >> 20, took = ?t0.elapsed(), "template collapsed into huge pages"),
                Err(e) => tracing::debug!(pid = host_pid, "template not collapsed: {e}"),
            }
        });
    }

    /// After a checkpoint: back a live session's heap with huge pages when much of it is in
    /// 4 KiB pages (at least [`SESSION_COLLAPSE_MIN`]), in the background at low priority and
    /// only while the session is idle (2 MiB at a time under its operation lock, so neither
    /// its code nor a checkpoint waits more than one chunk). Every later checkpoint fork of it
    /// copies page-middle entries instead of page tables, and its templates and their live-fork
    /// copies share those huge pages. Writes
    /// after a fork split huge pages back into small ones in the writer only; a session
    /// collapsed once is collapsed again when its small pages grew to twice what was left and
    /// [`SESSION_COLLAPSE_MIN`] more.
    pub(crate) fn maybe_collapse_session(self: &Arc<Self>, sb: &Arc<Sandbox>, s: &Arc<Session>) {
        let (rt, sb, s) = (self.clone(), sb.clone(), s.clone());
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(crate::activity::BEHIND_ANSWER);
            // Even the look (every process's status, the session's page map) stays behind the
            // requests.
            let _nice = bb_sys::process::niced_thread(15);
            let key = format!("session:{}:{}:{}", sb.id, s.id, s.pid);
            let Some(host) = sb.cgroup.pids().ok().and_then(|p| p.into_iter().find(|h| ns_pid(*h) == Some(s.pid)))
            else {
                return;
            };
            let Some(small) = bb_sys::process::small_anon_bytes(host) else { return };
            {
                let mut all = rt.hugepages.sessions.lock();
                if all.len() >= SESSION_THP_KEEP {
                    all.retain(|_, st| std::path::Path::new(&format!("/proc/{}", st.host)).exists());
                }
                if !all.entry(key.clone()).or_insert_with(|| SessionThp::new(host)).due(small, Instant::now()) {
                    return;
                }
            }
            let t0 = Instant::now();
            let deadline = t0 + std::time::Duration::from_secs(60);
            let res = collapse_memory(host, || loop {
                if !s.is_alive() || Instant::now() > deadline {
                    return None;
                }
                match s.op_lock.try_lock() {
                    Ok(g) => return Some(g),
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            });
            let left = bb_sys::process::small_anon_bytes(host).unwrap_or(small);
            if let Some(st) = rt.hugepages.sessions.lock().get_mut(&key) {
                st.done(left, Instant::now());
            }
            match res {
                Ok(bytes) => {
                    tracing::debug!(sandbox = %sb.id, session = %s.id, mib = bytes >> 20, small_mib_left = left >> 20, took = ?t0.elapsed(), "session collapsed into huge pages")
                }
                Err(e) => tracing::debug!(sandbox = %sb.id, session = %s.id, "session not collapsed: {e}"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_that_split_their_huge_pages_at_once_are_collapsed_less_often() {
        let mib = |n: u64| n << 20;
        let t0 = Instant::now();
        let mut st = SessionThp::new(1);
        assert!(!st.due(mib(8), t0), "too little in small pages");
        assert!(st.due(mib(60), t0));
        assert!(!st.due(mib(60), t0), "in progress");
        st.done(mib(4), t0);
        // Split back at the next checkpoint, every time: collapsed at checkpoints 1, 3, 7, 15.
        let mut collapsed = Vec::new();
        for i in 1..=20 {
            let now = t0 + std::time::Duration::from_millis(100 * i);
            if st.due(mib(60), now) {
                collapsed.push(i);
                st.done(mib(4), now);
            }
        }
        assert_eq!(collapsed, [1, 3, 7, 15]);
        // A collapse that held for a while was worth it: tried again at once, strikes forgotten.
        let later = t0 + SESSION_THP_WORTH + std::time::Duration::from_secs(5);
        assert!(st.due(mib(60), later));
        st.done(mib(4), later);
        assert_eq!((st.strikes, st.skip), (0, 0));
        assert!(!st.due(mib(20), later), "not grown enough since");
    }
}
