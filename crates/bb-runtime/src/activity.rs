//! Operations in flight, so background work can wait for a pause in them.
//!
//! On a small host, work a request leaves behind (a template's registration, a spare copy, a
//! huge-page collapse, a fork-shell refill) competes for the CPUs with the answer on its way to
//! the client and with the sandbox's own next steps. [`Activity`] counts requests in flight and
//! remembers when the last one ended; background work waits for a quiet spell
//! ([`Activity::wait_for_quiet`]) or starts [`BEHIND_ANSWER`] after the request that left it.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long background work a request leaves behind (registering a template with init, a
/// huge-page look at a session, dropping evicted templates) waits before it starts: on a small
/// host it otherwise competes for the CPUs with the answer on its way to the client and
/// with the thawed sandbox.
pub(crate) const BEHIND_ANSWER: Duration = Duration::from_millis(5);

/// Operations in flight, and when the last one ended: background work that can wait waits
/// for a pause in them, so that on a small host it does not take the CPUs from the sandboxes'
/// own work. The runtime's counts the requests that run code in sandboxes (commands,
/// session code, forks: a parent's fork-shell refill waits for them, as a fork's children run
/// their first commands right away); each sandbox's `ops_activity` counts its checkpoints,
/// rollbacks, forks and evaluates (spare template copies wait for them).
#[derive(Default)]
pub struct Activity {
    in_flight: AtomicUsize,
    last_end: Mutex<Option<Instant>>,
}

/// Marks a request in flight until dropped (see [`Activity`]).
pub struct Busy<'a>(&'a Activity);

impl Activity {
    pub(crate) fn busy(&self) -> Busy<'_> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Busy(self)
    }

    /// How long no request has been in flight at `now` (zero while one is; `None`: none ever).
    pub(crate) fn quiet_for(&self, now: Instant) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Some(Duration::ZERO);
        }
        self.last_end.lock().map(|t| now.saturating_duration_since(t))
    }

    /// Wait until nothing was in flight for `quiet`, or for `max` at most.
    pub(crate) async fn wait_for_quiet(&self, quiet: Duration, max: Duration) {
        let t0 = Instant::now();
        loop {
            let now = Instant::now();
            let waited = now.saturating_duration_since(t0);
            let q = self.quiet_for(now).unwrap_or(quiet);
            if q >= quiet || waited >= max {
                return;
            }
            tokio::time::sleep((quiet - q).min(max - waited)).await;
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        // The end is recorded before the count drops: a reader never sees "none in flight"
        // with an older end.
        *self.0.last_end.lock() = Some(Instant::now());
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_is_quiet_only_when_nothing_runs() {
        let a = Activity::default();
        let t0 = Instant::now();
        assert_eq!(a.quiet_for(t0), None, "nothing ever ran");
        let one = a.busy();
        let two = a.busy();
        assert_eq!(a.quiet_for(t0 + Duration::from_secs(1)), Some(Duration::ZERO));
        drop(one);
        assert_eq!(a.quiet_for(Instant::now() + Duration::from_secs(1)), Some(Duration::ZERO), "one still runs");
        drop(two);
        let ended = Instant::now();
        let q = a.quiet_for(ended + Duration::from_millis(50)).unwrap();
        assert!(q >= Duration::from_millis(50) && q < Duration::from_millis(60), "{q:?}");
    }
}
