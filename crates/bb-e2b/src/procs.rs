//! The processes the envd endpoint started: each is attached to the daemon (its stdin held, its
//! output read) for as long as it runs, whoever is listening. Streams (`Start`, `Connect`)
//! subscribe to its output; one that goes away leaves the process running, as envd does.

use bb_runtime::sandbox::exec::{Attached, AttachedProcess, Pty, Stdin};
use bytes::Bytes;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// What a stream of a process is sent.
#[derive(Debug, Clone)]
pub enum Ev {
    Stdout(Bytes),
    Stderr(Bytes),
    /// What the process's terminal shows (a process started on one).
    Pty(Bytes),
    /// Exit code, or the signal that killed it.
    End {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The sandbox went away under it (killed, or its init died): streams break.
    Lost,
}

impl Ev {
    fn is_last(&self) -> bool {
        matches!(self, Ev::End { .. } | Ev::Lost)
    }
}

/// Output chunks a slow stream may lag behind before the process waits for it.
const STREAM_BACKLOG: usize = 1024;

#[derive(Default)]
struct Subscribers {
    list: Vec<mpsc::Sender<Ev>>,
    last: Option<Ev>,
}

pub struct Proc {
    pub pid: u32,
    /// The `ProcessConfig` it was started with (as `List` answers it).
    pub config: Value,
    pub tag: Option<String>,
    pub stdin: Option<Stdin>,
    /// Its terminal, when started on one.
    pub pty: Option<Pty>,
    subs: Mutex<Subscribers>,
}

impl Proc {
    /// A stream of what the process does from now on (its end at once, if it has ended).
    pub fn subscribe(&self) -> mpsc::Receiver<Ev> {
        let (tx, rx) = mpsc::channel(STREAM_BACKLOG);
        let mut subs = self.subs.lock().expect("subscribers lock");
        match &subs.last {
            Some(last) => {
                let _ = tx.try_send(last.clone());
            }
            None => subs.list.push(tx),
        }
        rx
    }

    async fn publish(&self, ev: Ev) {
        let list = {
            let mut subs = self.subs.lock().expect("subscribers lock");
            subs.list.retain(|s| !s.is_closed());
            if ev.is_last() {
                subs.last = Some(ev.clone());
                std::mem::take(&mut subs.list)
            } else {
                subs.list.clone()
            }
        };
        for s in list {
            let _ = s.send(ev.clone()).await;
        }
    }
}

/// What the runtime keeps with a process it started for us (a checkpoint keeps it with the
/// process): its `ProcessConfig` and tag, for [`Procs::adopt_restored`].
pub fn note(config: &Value, tag: Option<&str>) -> Value {
    serde_json::json!({"config": config, "tag": tag})
}

/// Processes by sandbox and pid.
#[derive(Default)]
pub struct Procs {
    all: Mutex<HashMap<(String, u32), Arc<Proc>>>,
}

impl Procs {
    /// Track a process just started; its output is published until it ends, then it is
    /// forgotten. The returned stream is subscribed before any output is read.
    pub fn adopt(
        self: &Arc<Self>,
        sandbox: &str,
        config: Value,
        tag: Option<String>,
        attached: AttachedProcess,
    ) -> (Arc<Proc>, mpsc::Receiver<Ev>) {
        let AttachedProcess { pid, stdin, pty, mut events } = attached;
        let pid = pid as u32;
        let proc = Arc::new(Proc { pid, config, tag, stdin, pty, subs: Mutex::new(Subscribers::default()) });
        let first = proc.subscribe();
        let key = (sandbox.to_string(), pid);
        self.all.lock().expect("procs lock").insert(key.clone(), proc.clone());
        let (me, p) = (self.clone(), proc.clone());
        tokio::spawn(async move {
            let mut end = Ev::Lost;
            while let Some(a) = events.recv().await {
                match a {
                    Attached::Stdout(b) => p.publish(Ev::Stdout(b)).await,
                    Attached::Stderr(b) => p.publish(Ev::Stderr(b)).await,
                    Attached::Pty(b) => p.publish(Ev::Pty(b)).await,
                    Attached::Exit(st) => end = Ev::End { code: st.code, signal: st.signal },
                }
            }
            {
                // A rollback may have restored another process under its pid already.
                let mut all = me.all.lock().expect("procs lock");
                if all.get(&key).is_some_and(|q| Arc::ptr_eq(q, &p)) {
                    all.remove(&key);
                }
            }
            p.publish(end).await;
        });
        (proc, first)
    }

    /// Track a process a restore brought back into `sandbox` (a rollback, a fork child, a
    /// sandbox made from a snapshot): listed and reachable as the one it was copied from, with
    /// the config and tag of its `note` ([`note`]). Nobody listens yet: its output is dropped
    /// until a stream connects, as for one whose stream went away.
    pub fn adopt_restored(self: &Arc<Self>, sandbox: &str, note: Value, attached: AttachedProcess) {
        let config = note.get("config").cloned().unwrap_or(Value::Null);
        let tag = note.get("tag").and_then(Value::as_str).map(str::to_string);
        drop(self.adopt(sandbox, config, tag, attached));
    }

    pub fn get(&self, sandbox: &str, pid: u32) -> Option<Arc<Proc>> {
        self.all.lock().expect("procs lock").get(&(sandbox.to_string(), pid)).cloned()
    }

    pub fn by_tag(&self, sandbox: &str, tag: &str) -> Option<Arc<Proc>> {
        let all = self.all.lock().expect("procs lock");
        all.iter().find(|((s, _), p)| s == sandbox && p.tag.as_deref() == Some(tag)).map(|(_, p)| p.clone())
    }

    /// The running processes of a sandbox, by pid.
    pub fn of(&self, sandbox: &str) -> Vec<Arc<Proc>> {
        let all = self.all.lock().expect("procs lock");
        let mut v: Vec<Arc<Proc>> = all.iter().filter(|((s, _), _)| s == sandbox).map(|(_, p)| p.clone()).collect();
        v.sort_by_key(|p| p.pid);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn streams_get_output_then_the_end_and_late_ones_the_end_only() {
        let procs = Arc::new(Procs::default());
        let (tx, events) = mpsc::channel(8);
        let attached = AttachedProcess { pid: 7, stdin: None, pty: None, events };
        let (proc, mut first) = procs.adopt("sb-1", Value::Null, Some("t".into()), attached);
        assert!(procs.get("sb-1", 7).is_some() && procs.by_tag("sb-1", "t").is_some());
        assert!(procs.get("sb-2", 7).is_none());
        tx.send(Attached::Stdout(Bytes::from_static(b"hi"))).await.unwrap();
        assert!(matches!(first.recv().await, Some(Ev::Stdout(b)) if &b[..] == b"hi"));
        let mut second = proc.subscribe();
        tx.send(Attached::Stderr(Bytes::from_static(b"err"))).await.unwrap();
        tx.send(Attached::Exit(bb_runtime::sandbox::exec::ExitStatus { code: Some(3), signal: None })).await.unwrap();
        drop(tx);
        for rx in [&mut first, &mut second] {
            assert!(matches!(rx.recv().await, Some(Ev::Stderr(_))));
            assert!(matches!(rx.recv().await, Some(Ev::End { code: Some(3), signal: None })));
            assert!(rx.recv().await.is_none());
        }
        assert!(procs.get("sb-1", 7).is_none(), "an ended process is forgotten");
        let mut late = proc.subscribe();
        assert!(matches!(late.recv().await, Some(Ev::End { code: Some(3), .. })));
    }

    #[tokio::test]
    async fn a_restored_process_under_the_pid_of_one_that_ended_stays_listed() {
        let procs = Arc::new(Procs::default());
        let (old_tx, events) = mpsc::channel(8);
        let (_, mut old_stream) =
            procs.adopt("sb-1", Value::Null, None, AttachedProcess { pid: 5, stdin: None, pty: None, events });
        // A rollback restores the process (its note: config and tag) before the old one's end is read.
        let (new_tx, events) = mpsc::channel(8);
        let config = serde_json::json!({"cmd": "cat"});
        let attached = AttachedProcess { pid: 5, stdin: None, pty: None, events };
        procs.adopt_restored("sb-1", note(&config, Some("t")), attached);
        let restored = procs.get("sb-1", 5).expect("restored");
        assert_eq!((&restored.config, restored.tag.as_deref()), (&config, Some("t")));
        old_tx
            .send(Attached::Exit(bb_runtime::sandbox::exec::ExitStatus { code: None, signal: Some(9) }))
            .await
            .unwrap();
        drop(old_tx);
        assert!(matches!(old_stream.recv().await, Some(Ev::End { signal: Some(9), .. })));
        assert!(procs.get("sb-1", 5).is_some_and(|p| Arc::ptr_eq(&p, &restored)), "the old one's end forgets only it");
        // Nobody listens to the restored one: its output is read and dropped (4x the channel's
        // room goes through), and a stream that connects later gets what comes next.
        let sent = async {
            for _ in 0..32 {
                new_tx.send(Attached::Stdout(Bytes::from_static(b"x"))).await.unwrap();
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), sent).await.expect("output is read");
        let mut late = restored.subscribe();
        new_tx.send(Attached::Stdout(Bytes::from_static(b"late"))).await.unwrap();
        loop {
            match late.recv().await {
                Some(Ev::Stdout(b)) if &b[..] == b"late" => break,
                Some(Ev::Stdout(b)) if &b[..] == b"x" => {} // read before the stream, published after it
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_sandbox_that_goes_away_breaks_the_streams() {
        let procs = Arc::new(Procs::default());
        let (tx, events) = mpsc::channel(8);
        let attached = AttachedProcess { pid: 9, stdin: None, pty: None, events };
        let (_proc, mut first) = procs.adopt("sb-1", Value::Null, None, attached);
        drop(tx);
        assert!(matches!(first.recv().await, Some(Ev::Lost)));
    }
}
