//! The same checks against SQLite and a real PostgreSQL (started here on 127.0.0.1 with
//! scripts/pg-test-server.sh; `scripts/install-postgres.sh` installs it). Without PostgreSQL that
//! case is skipped, unless `MUST_WORK=1` (CI): then it fails.

use bb_meta::{Meta, MetaError, MetaUrl, Record};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const MINUTE: Duration = Duration::from_secs(60);

/// A PostgreSQL serving a temporary directory on 127.0.0.1; stopped on drop.
struct Postgres {
    dir: tempfile::TempDir,
    port: u16,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg-test-server.sh")
}

impl Postgres {
    fn start() -> Option<Postgres> {
        let installed = std::fs::read_dir("/usr/lib/postgresql")
            .is_ok_and(|mut d| d.any(|v| v.is_ok_and(|v| v.path().join("bin/initdb").exists())));
        if !installed {
            assert!(
                std::env::var("MUST_WORK").map_or(true, |v| v != "1"),
                "PostgreSQL is missing: run scripts/install-postgres.sh"
            );
            eprintln!("skipping the PostgreSQL case: it is not installed (scripts/install-postgres.sh installs it)");
            return None;
        }
        // A port the kernel just gave out and took back.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let pg = Postgres { dir: tempfile::tempdir().unwrap(), port };
        pg.up();
        Some(pg)
    }

    fn up(&self) {
        let out = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(self.dir.path())
            .arg(self.port.to_string())
            .output()
            .unwrap();
        assert!(out.status.success(), "pg-test-server.sh start: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), self.url_text());
    }

    fn down(&self) {
        let _ = Command::new("bash").arg(script()).arg("stop").arg(self.dir.path()).status();
    }

    fn url_text(&self) -> String {
        format!("postgres://bbtest:bbtest@127.0.0.1:{}/bbtest", self.port)
    }

    fn url(&self) -> MetaUrl {
        self.url_text().parse().unwrap()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.down();
    }
}

fn record(id: &str, kind: &str, at: f64, body: &str) -> Record {
    Record { id: id.into(), kind: kind.into(), node: "node-1".into(), created_at: at, body: body.into() }
}

fn exercise(url: &MetaUrl) {
    let m = Meta::open(url).unwrap();
    // Records: idempotent, conflicting, listed oldest first.
    m.put_record(&record("snap-2", "snapshot", 20.5, r#"{"layers":["b"]}"#)).unwrap();
    m.put_record(&record("snap-1", "snapshot", 10.25, r#"{"layers":["a"]}"#)).unwrap();
    m.put_record(&record("sb-1", "paused", 15.0, "{}")).unwrap();
    m.put_record(&record("snap-2", "snapshot", 20.5, r#"{"layers":["b"]}"#)).unwrap();
    let e = m.put_record(&record("snap-2", "snapshot", 20.5, r#"{"layers":["c"]}"#)).unwrap_err();
    assert!(matches!(e, MetaError::Conflict { .. }) && e.to_string().contains("snap-2"), "{e}");
    assert_eq!(m.get_record("snap-1").unwrap(), Some(record("snap-1", "snapshot", 10.25, r#"{"layers":["a"]}"#)));
    assert_eq!(m.get_record("nope").unwrap(), None);
    let ids = |kind| m.list_records(kind).unwrap().into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(ids(None), ["snap-1", "sb-1", "snap-2"]);
    assert_eq!(ids(Some("snapshot")), ["snap-1", "snap-2"]);
    assert!(m.delete_record("sb-1").unwrap());
    assert!(!m.delete_record("sb-1").unwrap());

    // Objects: set once; prefixes are literal and case-sensitive.
    for (name, value) in [("layer/a", "ta"), ("layer/b", "tb"), ("Layer/c", "tc"), ("layer_d", "td"), ("layer%e", "te")]
    {
        m.put_object(name, value).unwrap();
    }
    m.put_object("layer/a", "ta").unwrap();
    assert!(matches!(m.put_object("layer/a", "tz"), Err(MetaError::Conflict { .. })));
    assert_eq!(m.get_object("layer/b").unwrap().as_deref(), Some("tb"));
    assert_eq!(m.get_object("layer/z").unwrap(), None);
    let listed = m.list_objects("layer/").unwrap();
    assert_eq!(listed, [("layer/a".into(), "ta".into()), ("layer/b".into(), "tb".into())]);
    assert_eq!(m.list_objects("").unwrap().len(), 5);
    let names: Vec<String> =
        (0..12000).map(|i| format!("layer/{i}")).chain(["layer/a".into(), "Layer/c".into()]).collect();
    let got = m.get_objects(&names).unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got["Layer/c"], "tc");
    assert!(m.get_objects(&[]).unwrap().is_empty());
    assert!(m.delete_object("layer/a").unwrap());
    assert!(!m.delete_object("layer/a").unwrap());

    // Heads: compare-and-swap.
    assert_eq!(m.head("main").unwrap(), None);
    assert_eq!(m.cas_head("main", None, "v1").unwrap().version, 1);
    match m.cas_head("main", None, "again") {
        Err(MetaError::HeadMoved { expected: None, found: Some(1), .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(m.cas_head("main", Some(1), "v2").unwrap().version, 2);
    let e = m.cas_head("main", Some(1), "stale").unwrap_err();
    assert!(matches!(e, MetaError::HeadMoved { found: Some(2), .. }), "{e}");
    assert!(e.to_string().contains("main") && e.to_string().contains("version 2"), "{e}");
    assert!(matches!(m.cas_head("other", Some(3), "x"), Err(MetaError::HeadMoved { found: None, .. })));
    let h = m.head("main").unwrap().unwrap();
    assert_eq!((h.version, h.value.as_str()), (2, "v2"));
    m.cas_head("volume/a", None, "va").unwrap();
    m.cas_head("Volume/b", None, "vb").unwrap();
    let listed: Vec<(String, i64)> =
        m.list_heads("volume/").unwrap().into_iter().map(|h| (h.name, h.version)).collect();
    assert_eq!(listed, vec![("volume/a".to_string(), 1)], "prefix match is exact and case-sensitive");
    m.delete_head("volume/a", 1).unwrap();
    m.delete_head("Volume/b", 1).unwrap();
    assert!(matches!(m.delete_head("main", 1), Err(MetaError::HeadMoved { found: Some(2), .. })));
    m.delete_head("main", 2).unwrap();
    assert_eq!(m.head("main").unwrap(), None);

    // Two daemons racing on one head: exactly one wins each round.
    let other = Arc::new(Meta::open(url).unwrap());
    let m = Arc::new(m);
    let rounds = 25;
    // `attempt(round)` is the head and expected version both try in that round.
    let race = |attempt: fn(i64) -> (String, Option<i64>)| {
        let barrier = Arc::new(Barrier::new(2));
        let threads: Vec<_> = [m.clone(), other.clone()]
            .into_iter()
            .enumerate()
            .map(|(who, meta)| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    (0..rounds)
                        .map(|round| {
                            let (name, expected) = attempt(round);
                            barrier.wait();
                            match meta.cas_head(&name, expected, &format!("by {who}")) {
                                Ok(_) => true,
                                Err(MetaError::HeadMoved { .. }) => false,
                                Err(e) => panic!("{e}"),
                            }
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let wins: Vec<Vec<bool>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for (round, (a, b)) in wins[0].iter().zip(&wins[1]).enumerate() {
            assert!(a != b, "round {round}: both or neither won");
        }
    };
    race(|round| (format!("created-{round}"), None));
    m.cas_head("raced", None, "start").unwrap();
    race(|round| ("raced".into(), Some(round + 1)));
    assert_eq!(m.head("raced").unwrap().unwrap().version, rounds + 1);

    // Leases: one holder; another takes over only after expiry.
    assert!(m.acquire_lease("vol-1", "node-a", Duration::from_millis(300)).unwrap());
    assert!(m.acquire_lease("vol-1", "node-a", Duration::from_millis(300)).unwrap());
    assert!(!other.acquire_lease("vol-1", "node-b", MINUTE).unwrap());
    let (holder, left) = other.lease_holder("vol-1").unwrap().unwrap();
    assert!(holder == "node-a" && left > 0.0 && left <= 0.3, "{holder} {left}");
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(m.lease_holder("vol-1").unwrap(), None);
    assert!(other.acquire_lease("vol-1", "node-b", MINUTE).unwrap());
    assert!(!m.acquire_lease("vol-1", "node-a", MINUTE).unwrap());
    m.release_lease("vol-1", "node-a").unwrap(); // not its lease: nothing happens
    assert_eq!(m.lease_holder("vol-1").unwrap().unwrap().0, "node-b");
    other.release_lease("vol-1", "node-b").unwrap();
    assert!(m.acquire_lease("vol-1", "node-a", MINUTE).unwrap());

    // The store lock: pushes exclude GC and the other way round, across daemons.
    assert!(m.begin_push("push-1", MINUTE).unwrap());
    assert!(other.begin_push("push-2", MINUTE).unwrap());
    assert!(!other.begin_gc("gc-b", MINUTE).unwrap());
    m.end_push("push-1").unwrap();
    assert!(!other.begin_gc("gc-b", MINUTE).unwrap());
    other.end_push("push-2").unwrap();
    assert!(other.begin_gc("gc-b", MINUTE).unwrap());
    assert!(other.begin_gc("gc-b", MINUTE).unwrap(), "renewal");
    assert!(!m.begin_gc("gc-a", MINUTE).unwrap());
    assert!(!m.begin_push("push-1", MINUTE).unwrap());
    m.end_gc("gc-a").unwrap(); // not its GC: nothing happens
    assert!(!m.begin_push("push-1", MINUTE).unwrap());
    other.end_gc("gc-b").unwrap();
    // Expired intents and GCs do not hold the store.
    assert!(m.begin_push("push-1", Duration::from_millis(300)).unwrap());
    assert!(!other.begin_gc("gc-b", MINUTE).unwrap());
    std::thread::sleep(Duration::from_millis(400));
    assert!(other.begin_gc("gc-b", Duration::from_millis(300)).unwrap());
    assert!(!m.begin_push("push-1", MINUTE).unwrap());
    std::thread::sleep(Duration::from_millis(400));
    assert!(m.begin_push("push-1", MINUTE).unwrap());
    m.end_push("push-1").unwrap();
    // Under contention: never a GC and a push inside at once.
    let (pushing, collecting) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (mut pushes, mut gcs) = (0, 0);
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let meta = if i % 2 == 0 { m.clone() } else { other.clone() };
            let (pushing, collecting) = (pushing.clone(), collecting.clone());
            std::thread::spawn(move || {
                let mut entered = 0;
                for _ in 0..30 {
                    let me = format!("t{i}");
                    let (mine, theirs) = if i == 0 { (&collecting, &pushing) } else { (&pushing, &collecting) };
                    let got = if i == 0 { meta.begin_gc(&me, MINUTE) } else { meta.begin_push(&me, MINUTE) }.unwrap();
                    if got {
                        entered += 1;
                        mine.fetch_add(1, Ordering::SeqCst);
                        assert_eq!(theirs.load(Ordering::SeqCst), 0, "a GC and a push at once");
                        std::thread::sleep(Duration::from_millis(2));
                        mine.fetch_sub(1, Ordering::SeqCst);
                        if i == 0 { meta.end_gc(&me) } else { meta.end_push(&me) }.unwrap();
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                entered
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        let entered = t.join().unwrap();
        if i == 0 {
            gcs += entered
        } else {
            pushes += entered
        }
    }
    assert!(pushes > 0, "no push got in");
    eprintln!("{gcs} GCs and {pushes} pushes under contention");

    // Reopening migrates nothing and keeps everything.
    drop((m, other));
    let m = Meta::open(url).unwrap();
    assert_eq!(m.list_records(None).unwrap().len(), 2);
    assert_eq!(m.head("raced").unwrap().unwrap().version, rounds + 1);
}

#[test]
fn sqlite() {
    let d = tempfile::tempdir().unwrap();
    let url: MetaUrl = format!("sqlite://{}", d.path().join("meta.db").display()).parse().unwrap();
    exercise(&url);
}

#[test]
fn postgres() {
    let Some(pg) = Postgres::start() else { return };
    let url = pg.url();
    // Several daemons opening a fresh database at once: migrations run once, nobody fails.
    let opens: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || Meta::open(&url).map(drop))
        })
        .collect();
    for t in opens {
        t.join().unwrap().unwrap();
    }
    exercise(&url);

    let m = Meta::open(&url).unwrap();
    assert_eq!(m.url(), format!("postgres://bbtest:***@127.0.0.1:{}/bbtest", pg.port));
    // The server goes away: a clear error, no panic; it comes back: the next call reconnects.
    pg.down();
    let t = Instant::now();
    let e = m.head("raced").unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(matches!(e, MetaError::Unreachable { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&m.url()) && msg.contains("unreachable") && !msg.contains(":bbtest@"), "{msg}");
    assert!(m.put_object("x", "y").is_err());
    pg.up();
    assert_eq!(m.head("raced").unwrap().unwrap().version, 26);
    m.put_object("x", "y").unwrap();
    // Wrong credentials: the server's answer, not "unreachable".
    let wrong: MetaUrl = format!("postgres://bbtest:wrong@127.0.0.1:{}/bbtest", pg.port).parse().unwrap();
    let e = Meta::open(&wrong).err().unwrap();
    assert!(matches!(e, MetaError::Postgres { .. }) && e.to_string().contains("password"), "{e}");
}

#[test]
fn an_unreachable_postgres() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url: MetaUrl = format!("postgres://bbtest:secret@127.0.0.1:{port}/bbtest").parse().unwrap();
    let t = Instant::now();
    let e = Meta::open(&url).err().expect("nothing listens there");
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    assert!(matches!(e, MetaError::Unreachable { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("metadata store postgres://bbtest:***@127.0.0.1:{port}/bbtest is unreachable: ")),
        "{msg}"
    );
    assert!(msg.contains("refused") && msg.contains("retry once it is back") && !msg.contains("secret"), "{msg}");
}
