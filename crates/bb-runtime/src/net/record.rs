//! Recorded answers of the proxy, for deterministic replays (sandboxes created with
//! `proxy_record`).
//!
//! The requests a sandbox sends through the proxy in the clear (plain HTTP, and HTTPS the
//! proxy opens itself for a host with credentials) and their answers form a tree: each node is
//! an answered request, its children the requests answered after it. Each recording sandbox
//! stands on a node (its *cursor*); a checkpoint marks the cursor under the snapshot's id, and
//! a rollback to the snapshot, a fork child of it or a sandbox created from it stands on that
//! mark again. A request that matches a child of the cursor (same method, host, port, path,
//! query and body) is answered from the record, and the cursor moves there; another goes
//! upstream and its answer becomes a new child. So a branch that repeats what an earlier branch
//! did from the same snapshot gets the same answers, and one that does something else gets
//! fresh ones, recorded in turn. Concurrent requests are matched in the order they were
//! answered.
//!
//! The records live in the daemon's memory, at most [`MAX_BYTES`] of answers in all (beyond
//! it nothing more is recorded, said once in the log); a daemon restart forgets them (a
//! rollback then stands on a fresh node: nothing is replayed).

use bytes::Bytes;
use hyper::{HeaderMap, StatusCode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Most bytes of answers kept over all sandboxes.
pub const MAX_BYTES: usize = 256 << 20;
/// Largest answer body recorded (a larger one is passed on, not recorded).
pub const MAX_ANSWER: usize = 32 << 20;
/// Largest request body of a recording sandbox (it is read whole to match it).
pub const MAX_REQUEST: usize = 16 << 20;

/// Refuses recording without the proxy.
pub fn check(record: bool, proxy_port: Option<u16>) -> Result<(), crate::error::RuntimeError> {
    if record && proxy_port.is_none() {
        return Err(crate::error::RuntimeError::BadRequest(
            "proxy_record records the proxy's answers: create the sandbox with proxy=True too".into(),
        ));
    }
    Ok(())
}

/// What identifies a request: a hash of its method, host, port, path and query, and body.
pub type Key = [u8; 32];

/// The key of a request.
pub fn key(method: &str, host: &str, port: u16, path: &str, body: &[u8]) -> Key {
    let mut h = hasher(method, host, port, path);
    h.update(body);
    *h.finalize().as_bytes()
}

/// A request's key as its body comes: [`key`] is this hasher fed the body, then finalized.
pub fn hasher(method: &str, host: &str, port: u16, path: &str) -> blake3::Hasher {
    let mut h = blake3::Hasher::new();
    for part in [method.as_bytes(), host.as_bytes(), &port.to_be_bytes(), path.as_bytes()] {
        h.update(&(part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h
}

/// A recorded answer.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

#[derive(Default)]
struct Node {
    next: HashMap<Key, usize>,
}

#[derive(Default)]
struct Records {
    /// Node `i`'s answer is `answers[i]` (none for a root).
    nodes: Vec<Node>,
    answers: Vec<Option<Arc<Answer>>>,
    /// Each recording sandbox's cursor.
    at: HashMap<String, usize>,
    /// The cursor a snapshot was taken at.
    marks: HashMap<String, usize>,
    bytes: usize,
    full: bool,
}

impl Records {
    fn node(&mut self, answer: Option<Arc<Answer>>) -> usize {
        self.nodes.push(Node::default());
        self.answers.push(answer);
        self.nodes.len() - 1
    }
}

/// The proxy's records, by sandbox and snapshot.
#[derive(Default)]
pub struct Recorder(Mutex<Records>);

impl Recorder {
    /// Sandbox `id` records from now on, standing on snapshot `from`'s mark (none, or a snapshot
    /// taken before the records began: a fresh node).
    pub fn start(&self, id: &str, from: Option<&str>) {
        let mut r = self.0.lock();
        let node = match from.and_then(|s| r.marks.get(s).copied()) {
            Some(n) => n,
            None => r.node(None),
        };
        r.at.insert(id.to_string(), node);
    }

    /// Sandbox `id` (if it records) was checkpointed as `snapshot`.
    pub fn mark(&self, id: &str, snapshot: &str) {
        let mut r = self.0.lock();
        if let Some(&n) = r.at.get(id) {
            r.marks.insert(snapshot.to_string(), n);
        }
    }

    /// Sandbox `id` (if it records) was rolled back to `snapshot`.
    pub fn rewind(&self, id: &str, snapshot: &str) {
        let mut r = self.0.lock();
        if !r.at.contains_key(id) {
            return;
        }
        let node = match r.marks.get(snapshot).copied() {
            Some(n) => n,
            None => r.node(None),
        };
        r.at.insert(id.to_string(), node);
    }

    /// Sandbox `id` is gone.
    pub fn forget(&self, id: &str) {
        self.0.lock().at.remove(id);
    }

    pub fn records(&self, id: &str) -> bool {
        self.0.lock().at.contains_key(id)
    }

    /// The recorded answer to request `key` after sandbox `id`'s cursor, if any (the cursor
    /// moves to it).
    pub fn replay(&self, id: &str, key: &Key) -> Option<Arc<Answer>> {
        let mut r = self.0.lock();
        let at = *r.at.get(id)?;
        let next = *r.nodes[at].next.get(key)?;
        r.at.insert(id.to_string(), next);
        r.answers[next].clone()
    }

    /// Record `answer` to request `key` after sandbox `id`'s cursor (which moves to it).
    pub fn record(&self, id: &str, key: Key, answer: Arc<Answer>) {
        let mut r = self.0.lock();
        let Some(&at) = r.at.get(id) else { return };
        if let Some(&next) = r.nodes[at].next.get(&key) {
            // Recorded meanwhile by another branch standing on the same node.
            r.at.insert(id.to_string(), next);
            return;
        }
        let size = answer.body.len() + answer.headers.iter().map(|(k, v)| k.as_str().len() + v.len()).sum::<usize>();
        if r.bytes + size > MAX_BYTES {
            if !r.full {
                r.full = true;
                tracing::warn!(sandbox = %id, "proxy: {} MiB of answers recorded, the most kept: no more are recorded", MAX_BYTES >> 20);
            }
            return;
        }
        r.bytes += size;
        let next = r.node(Some(answer));
        r.nodes[at].next.insert(key, next);
        r.at.insert(id.to_string(), next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(body: &str) -> Arc<Answer> {
        Arc::new(Answer { status: StatusCode::OK, headers: HeaderMap::new(), body: Bytes::from(body.to_string()) })
    }

    fn body(a: Option<Arc<Answer>>) -> Option<String> {
        a.map(|a| String::from_utf8(a.body.to_vec()).unwrap())
    }

    #[test]
    fn a_branch_from_a_snapshot_replays_what_was_answered_after_it() {
        let rec = Recorder::default();
        let (a, b) = (key("GET", "h", 80, "/a", b""), key("GET", "h", 80, "/b", b""));
        assert!(!rec.records("s1"));
        assert!(rec.replay("s1", &a).is_none(), "not recording");
        rec.start("s1", None);
        rec.mark("s1", "snap0");
        assert!(rec.replay("s1", &a).is_none(), "nothing recorded yet");
        rec.record("s1", a, answer("a1"));
        rec.mark("s1", "snap1");
        rec.record("s1", b, answer("b1"));
        // Rollback to snap0: the same requests in the same order get the same answers.
        rec.rewind("s1", "snap0");
        assert_eq!(body(rec.replay("s1", &a)).as_deref(), Some("a1"));
        assert_eq!(body(rec.replay("s1", &b)).as_deref(), Some("b1"));
        // Past the record: upstream again.
        assert!(rec.replay("s1", &a).is_none());
        // Another order diverges: b first is not what was answered after snap0.
        rec.rewind("s1", "snap0");
        assert!(rec.replay("s1", &b).is_none());
        rec.record("s1", b, answer("b2"));
        // A fork child of snap1 stands where the checkpoint was taken.
        rec.start("child", Some("snap1"));
        assert_eq!(body(rec.replay("child", &b)).as_deref(), Some("b1"));
        // Both branches from snap0 are kept.
        rec.rewind("s1", "snap0");
        assert_eq!(body(rec.replay("s1", &b)).as_deref(), Some("b2"));
        // A snapshot the records do not know (before a restart): a fresh node.
        rec.rewind("s1", "unknown");
        assert!(rec.replay("s1", &a).is_none());
        rec.forget("s1");
        assert!(!rec.records("s1"));
    }

    #[test]
    fn keys_tell_requests_apart_by_every_part() {
        let k = key("GET", "h", 80, "/p?q=1", b"");
        assert_eq!(k, key("GET", "h", 80, "/p?q=1", b""));
        for other in [
            key("POST", "h", 80, "/p?q=1", b""),
            key("GET", "h2", 80, "/p?q=1", b""),
            key("GET", "h", 81, "/p?q=1", b""),
            key("GET", "h", 80, "/p?q=2", b""),
            key("GET", "h", 80, "/p?q=1", b"x"),
            key("GET", "h", 80, "/p", b"?q=1"),
        ] {
            assert_ne!(k, other);
        }
    }
}
