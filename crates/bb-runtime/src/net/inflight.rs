//! Answers to proxied requests in flight at a fork, handed to its children (fork option
//! `replay_inflight`).
//!
//! The proxy notes each plaintext request it forwards until its answer has all passed (a
//! [`Flight`]: the request's key once its body has all come, see [`super::record::key`], and
//! then its answer, kept as it passes, up to [`MAX_KEPT`]). A fork with `replay_inflight` holds
//! the parent's flights while it takes its checkpoint and hands those still in flight when it
//! began to the snapshot ([`Holding::hand_down`]); each child made from the snapshot takes them
//! on when it is registered ([`InFlight::adopt`]). A child's copy of the parent's connection to
//! the proxy is reset, so a client that retries sends the same request again on a new
//! connection: a child's first request that matches a flight handed to it waits for the
//! parent's answer and gets it, and the upstream answers once for the parent and all its
//! children. If the parent's answer fails or is larger than what is kept, or the parent's
//! request body had not all come at the fork, the child's request goes upstream.

use super::record::{Answer, Key};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tokio::sync::watch;

/// Largest answer kept for fork children (a larger one is passed on, not kept).
pub const MAX_KEPT: usize = 4 << 20;

/// A request in flight: its key and, once it came, its answer.
pub struct Flight {
    key: OnceLock<Key>,
    settled: OnceLock<Instant>,
    /// None while in flight; then the answer, or None if it failed or was not kept.
    answer: watch::Sender<Option<Option<Arc<Answer>>>>,
}

impl Flight {
    fn new(key: Option<Key>) -> Flight {
        let f = Flight { key: OnceLock::new(), settled: OnceLock::new(), answer: watch::channel(None).0 };
        if let Some(k) = key {
            f.keyed(k);
        }
        f
    }

    /// The request's body has all come: this is its key.
    pub fn keyed(&self, key: Key) {
        let _ = self.key.set(key);
    }

    /// The answer came (None: it failed, or was too large to keep). The first word counts.
    fn settle(&self, answer: Option<Arc<Answer>>) {
        let _ = self.settled.set(Instant::now());
        self.answer.send_if_modified(|a| {
            if a.is_some() {
                return false;
            }
            *a = Some(answer);
            true
        });
    }

    /// The answer, once it came (None if it failed or was not kept).
    pub async fn answer(&self) -> Option<Arc<Answer>> {
        let mut rx = self.answer.subscribe();
        let got = rx.wait_for(Option::is_some).await.ok()?.clone();
        got.flatten()
    }

    /// Still in flight at `t`.
    fn flying_at(&self, t: Instant) -> bool {
        self.settled.get().is_none_or(|&s| s >= t)
    }
}

/// The proxy's hold on a flight: settles it as failed if dropped unanswered.
pub struct Flying(Arc<Flight>);

impl Flying {
    pub fn flight(&self) -> &Arc<Flight> {
        &self.0
    }

    /// The answer came (None: it failed, or was too large to keep).
    pub fn settle(self, answer: Option<Arc<Answer>>) {
        self.0.settle(answer);
    }
}

impl Drop for Flying {
    fn drop(&mut self) {
        self.0.settle(None);
    }
}

#[derive(Default)]
struct Books {
    /// Each sandbox's flights (the settled ones dropped as new ones begin, unless held).
    flying: HashMap<String, Vec<Arc<Flight>>>,
    /// Sandboxes being checkpointed for a fork that hands on their flights, since when.
    held: HashMap<String, Instant>,
    /// The flights handed to a fork's snapshot, until its children are made.
    handed: HashMap<String, Vec<Arc<Flight>>>,
    /// What each fork child was handed and has not asked for again yet.
    owed: HashMap<String, Vec<Arc<Flight>>>,
}

impl Books {
    fn prune(&mut self, id: &str) {
        let since = self.held.get(id).copied();
        if let Some(v) = self.flying.get_mut(id) {
            v.retain(|f| f.settled.get().is_none() || since.is_some_and(|t| f.flying_at(t)));
        }
    }
}

/// The proxy's requests in flight, by sandbox, and those handed to fork children.
#[derive(Default)]
pub struct InFlight(Mutex<Books>);

/// A fork's hold on its parent's flights while it checkpoints: the ones in flight from then on
/// are kept until [`Holding::hand_down`] (or the hold drops).
pub struct Holding<'a> {
    books: &'a InFlight,
    parent: String,
    since: Instant,
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        let mut b = self.books.0.lock();
        b.held.remove(&self.parent);
        b.prune(&self.parent);
    }
}

impl<'a> Holding<'a> {
    /// Hand the parent's flights in flight since the hold to `snapshot` (None: the checkpoint
    /// failed), for the children made from it until the returned guard drops.
    pub fn hand_down(self, snapshot: Option<&str>) -> Handed<'a> {
        let mut handed = Handed { books: self.books, snapshot: None, count: 0 };
        if let Some(snapshot) = snapshot {
            let mut b = self.books.0.lock();
            let flights: Vec<_> =
                b.flying.get(&self.parent).into_iter().flatten().filter(|f| f.flying_at(self.since)).cloned().collect();
            handed.count = flights.len();
            b.handed.insert(snapshot.to_string(), flights);
            handed.snapshot = Some(snapshot.to_string());
        }
        handed
    }
}

/// Flights handed to a snapshot: dropped once its children are made (they adopted them).
pub struct Handed<'a> {
    books: &'a InFlight,
    snapshot: Option<String>,
    pub count: usize,
}

impl Drop for Handed<'_> {
    fn drop(&mut self) {
        if let Some(s) = &self.snapshot {
            self.books.0.lock().handed.remove(s);
        }
    }
}

impl InFlight {
    /// Sandbox `id` sends a request (its key if its body has all come).
    pub fn begin(&self, id: &str, key: Option<Key>) -> Flying {
        let f = Arc::new(Flight::new(key));
        let mut b = self.0.lock();
        b.prune(id);
        b.flying.entry(id.to_string()).or_default().push(f.clone());
        Flying(f)
    }

    /// Drop sandbox `id`'s settled flights (unless a fork holds them).
    pub fn prune(&self, id: &str) {
        self.0.lock().prune(id);
    }

    /// Sandbox `parent` is about to be checkpointed for a fork that hands on its flights.
    pub fn hold(&self, parent: &str) -> Holding<'_> {
        let since = Instant::now();
        self.0.lock().held.insert(parent.to_string(), since);
        Holding { books: self, parent: parent.to_string(), since }
    }

    /// Fork child `child` of `snapshot` takes on what was handed to the snapshot, if anything.
    pub fn adopt(&self, child: &str, snapshot: &str) {
        let mut b = self.0.lock();
        if let Some(flights) = b.handed.get(snapshot).filter(|v| !v.is_empty()).cloned() {
            b.owed.insert(child.to_string(), flights);
        }
    }

    /// Sandbox `id` was handed flights it has not asked for again yet.
    pub fn owes(&self, id: &str) -> bool {
        self.0.lock().owed.contains_key(id)
    }

    /// The flight handed to `id` that request `key` asks for again (once).
    pub fn take(&self, id: &str, key: &Key) -> Option<Arc<Flight>> {
        let mut b = self.0.lock();
        let owed = b.owed.get_mut(id)?;
        let i = owed.iter().position(|f| f.key.get() == Some(key))?;
        let f = owed.remove(i);
        if owed.is_empty() {
            b.owed.remove(id);
        }
        Some(f)
    }

    /// Sandbox `id` is gone.
    pub fn forget(&self, id: &str) {
        let mut b = self.0.lock();
        b.flying.remove(id);
        b.held.remove(id);
        b.owed.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use hyper::{HeaderMap, StatusCode};

    fn answer(body: &'static str) -> Option<Arc<Answer>> {
        Some(Arc::new(Answer { status: StatusCode::OK, headers: HeaderMap::new(), body: Bytes::from(body) }))
    }

    fn body(a: Option<Arc<Answer>>) -> Option<String> {
        a.map(|a| String::from_utf8(a.body.to_vec()).unwrap())
    }

    const A: Key = [1; 32];
    const B: Key = [2; 32];

    #[tokio::test]
    async fn children_get_the_answers_in_flight_at_the_fork_once_each() {
        let inf = InFlight::default();
        let done = inf.begin("p", Some(A));
        done.settle(answer("old"));
        let a = inf.begin("p", Some(A));
        let b = inf.begin("p", None);
        let handed = inf.hold("p").hand_down(Some("snap"));
        assert_eq!(handed.count, 2, "the flights still in flight, not the one answered before");
        inf.adopt("c1", "snap");
        inf.adopt("c2", "snap");
        drop(handed);
        inf.adopt("late", "snap");
        assert!(inf.owes("c1") && inf.owes("c2") && !inf.owes("late") && !inf.owes("p"));
        // B's body had not all come: nothing matches it until it has.
        assert!(inf.take("c1", &B).is_none());
        b.flight().keyed(B);
        let (c1a, c2a) = (inf.take("c1", &A).unwrap(), inf.take("c2", &A).unwrap());
        assert!(inf.take("c1", &A).is_none(), "once per child");
        a.settle(answer("a"));
        assert_eq!(body(c1a.answer().await).as_deref(), Some("a"));
        assert_eq!(body(c2a.answer().await).as_deref(), Some("a"));
        // A failed answer (dropped unanswered) sends the child upstream.
        let c1b = inf.take("c1", &B).unwrap();
        assert!(!inf.owes("c1"), "all taken");
        drop(b);
        assert!(c1b.answer().await.is_none());
        inf.forget("c2");
        assert!(!inf.owes("c2"));
    }

    #[tokio::test]
    async fn a_hold_keeps_what_is_answered_during_the_checkpoint() {
        let inf = InFlight::default();
        let a = inf.begin("p", Some(A));
        let hold = inf.hold("p");
        a.settle(answer("a"));
        // Another request meanwhile prunes, but not what the hold keeps.
        let _b = inf.begin("p", Some(B));
        let handed = hold.hand_down(Some("snap"));
        assert_eq!(handed.count, 2);
        inf.adopt("c", "snap");
        assert_eq!(body(inf.take("c", &A).unwrap().answer().await).as_deref(), Some("a"));
        // After the hand-down, settled flights are dropped again.
        assert_eq!(inf.0.lock().flying["p"].len(), 1);
        // A checkpoint that failed hands nothing; a hold dropped (a fork cancelled) ends.
        let none = inf.hold("p").hand_down(None);
        assert_eq!(none.count, 0);
        assert!(inf.0.lock().held.is_empty());
        drop(inf.hold("p"));
        assert!(inf.0.lock().held.is_empty());
    }
}
