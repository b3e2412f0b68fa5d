//! The metadata store several branchbox daemons share (../shared/STORAGE.md, "Metadata store"):
//!
//! * **records**: pushed snapshots and paused sandboxes, an opaque JSON body per id;
//! * **objects**: named references to immutable things (`layer/<id>` -> its tree ref), set once;
//! * **heads**: name -> value with a version, changed only by compare-and-swap on that version;
//! * **leases**: one holder per name until it expires, then anyone may take it over;
//! * **the store lock**: object-store garbage collection excludes pushes (many pushes, or one GC).
//!
//! SQLite (a file, WAL) by default; PostgreSQL when the URL says so, so that daemons on several
//! nodes agree. Every write is one transaction, so nothing is half-recorded when a connection
//! drops, and times (lease expiry) come from the database, so the daemons' clocks do not matter.
//! A write that returned `Ok` is durable in the database.
//!
//! The API is synchronous: call it from plain threads or `tokio::task::spawn_blocking`, never from
//! async code (the PostgreSQL client runs its own small runtime and would panic there).
//! [`Meta`] holds one connection behind a mutex; a broken PostgreSQL connection is reopened once
//! before a call fails with [`MetaError::Unreachable`], and again on the next call.

mod backend;

use backend::{Backend, Tx, Val};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum MetaError {
    #[error("metadata store URL {url:?}: {why}")]
    BadUrl { url: String, why: String },
    #[error("metadata store {url} is unreachable: {why}; local work goes on, retry once it is back")]
    Unreachable { url: String, why: String },
    #[error("{what}")]
    Conflict { what: String },
    #[error("head {name} moved: expected {}, found {}", version(.expected), version(.found))]
    HeadMoved { name: String, expected: Option<i64>, found: Option<i64> },
    #[error("metadata store {url}: schema migration {version}: {why}")]
    Migration { url: String, version: i64, why: String },
    #[error("metadata store (SQLite): {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("metadata store {url}: {}", backend::describe(.source))]
    Postgres { url: String, source: postgres::Error },
    #[error("metadata store {url} returned {what}")]
    Unexpected { url: String, what: String },
}

fn version(v: &Option<i64>) -> String {
    v.map_or_else(|| "no head".to_owned(), |v| format!("version {v}"))
}

pub type Result<T, E = MetaError> = std::result::Result<T, E>;

/// Where the metadata lives: `sqlite:///abs/path`, `sqlite:relative`, a bare path, or
/// `postgres://user:password@host:port/db` (also `postgresql://`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaUrl {
    Sqlite(PathBuf),
    Postgres(String),
}

impl FromStr for MetaUrl {
    type Err = MetaError;

    fn from_str(s: &str) -> Result<MetaUrl> {
        let bad = |why: &str| {
            MetaError::BadUrl {
            url: MetaUrl::Postgres(s.to_owned()).to_string(),
            why: format!("{why}; accepted: postgres://user:password@host:port/db, postgresql://..., sqlite:///absolute/path, sqlite:relative/path or a bare file path"),
        }
        };
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            let config = postgres::Config::from_str(s).map_err(|e| bad(&backend::describe(&e)))?;
            if config.get_hosts().is_empty() {
                return Err(bad("no host"));
            }
            return Ok(MetaUrl::Postgres(s.to_owned()));
        }
        let path = match s.strip_prefix("sqlite:") {
            Some(rest) if rest.starts_with("//") => match rest.strip_prefix("//") {
                Some(p) if p.starts_with('/') => p,
                _ => return Err(bad("sqlite:// must be followed by an absolute path")),
            },
            Some(rest) => rest,
            // A scheme we do not know ("mysql://", "redis:x") rather than a path.
            None if s.split('/').next().is_some_and(|first| first.contains(':')) => return Err(bad("unknown scheme")),
            None => s,
        };
        if path.is_empty() {
            return Err(bad("no path"));
        }
        Ok(MetaUrl::Sqlite(PathBuf::from(path)))
    }
}

/// The URL with any password replaced by `***`.
impl fmt::Display for MetaUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaUrl::Sqlite(p) if p.is_absolute() => write!(f, "sqlite://{}", p.display()),
            MetaUrl::Sqlite(p) => write!(f, "sqlite:{}", p.display()),
            MetaUrl::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("{user_info}@{host}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|kv| if kv.starts_with("password=") { "password=***".to_owned() } else { kv.to_owned() })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

/// A pushed snapshot or a paused sandbox; `body` is JSON the daemon wrote, opaque here.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub id: String,
    pub kind: String,
    pub node: String,
    /// Seconds since the Unix epoch.
    pub created_at: f64,
    pub body: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub name: String,
    pub version: i64,
    pub value: String,
}

/// The schema, one migration per step; never edit a released one, add the next.
const MIGRATIONS: &[&str] = &["
CREATE TABLE records (id TEXT PRIMARY KEY, kind TEXT NOT NULL, node TEXT NOT NULL,
                      created_at DOUBLE PRECISION NOT NULL, body TEXT NOT NULL);
CREATE INDEX records_by_kind ON records (kind, created_at);
CREATE TABLE objects (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE heads (name TEXT PRIMARY KEY, version BIGINT NOT NULL, value TEXT NOT NULL);
CREATE TABLE leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires DOUBLE PRECISION NOT NULL);
CREATE TABLE store_lock (id BIGINT PRIMARY KEY, gc_holder TEXT, gc_expires DOUBLE PRECISION);
INSERT INTO store_lock (id) VALUES (1);
CREATE TABLE push_intents (holder TEXT PRIMARY KEY, expires DOUBLE PRECISION NOT NULL);
"];

/// Names within one `get_objects` statement (far below both databases' parameter limits).
const IN_CHUNK: usize = 5000;

/// The metadata store: one connection, shared by threads.
pub struct Meta {
    url: MetaUrl,
    backend: Mutex<Backend>,
}

impl Meta {
    /// Connects (PostgreSQL: 5 s connect timeout, 30 s statement timeout; SQLite: WAL, 5 s busy
    /// timeout, the file created if missing) and brings the schema up to date.
    pub fn open(url: &MetaUrl) -> Result<Meta> {
        let meta = Meta { url: url.clone(), backend: Mutex::new(Backend::open(url)?) };
        meta.migrate()?;
        Ok(meta)
    }

    /// The URL, password redacted.
    pub fn url(&self) -> String {
        self.url.to_string()
    }

    /// Runs `f` in one write transaction (SQLite: `BEGIN IMMEDIATE`, so writers queue up front
    /// rather than fail halfway).
    fn tx<T>(&self, mut f: impl FnMut(&mut dyn Tx) -> Result<T>) -> Result<T> {
        self.backend.lock().run(&self.url(), true, &mut f)
    }

    /// Runs `f` in one read-only transaction (SQLite: deferred, never waits for writers in WAL).
    fn read<T>(&self, mut f: impl FnMut(&mut dyn Tx) -> Result<T>) -> Result<T> {
        self.backend.lock().run(&self.url(), false, &mut f)
    }

    fn migrate(&self) -> Result<()> {
        let url = self.url();
        self.tx(|tx| {
            tx.migration_lock()?;
            tx.batch("CREATE TABLE IF NOT EXISTS bb_meta_schema (version BIGINT NOT NULL)")?;
            let rows = tx.query("SELECT max(version) FROM bb_meta_schema", &[])?;
            let at = rows.first().and_then(|r| r[0].int()).unwrap_or(0);
            let known = MIGRATIONS.len() as i64;
            if at > known {
                return Err(MetaError::Migration {
                    url: url.clone(),
                    version: at,
                    why: format!("the database is at schema version {at}, newer than this branchbox knows ({known}): upgrade branchbox"),
                });
            }
            for (version, sql) in (1..).zip(MIGRATIONS).skip(at as usize) {
                let fail = |e: MetaError| MetaError::Migration { url: url.clone(), version, why: e.to_string() };
                tx.batch(sql).map_err(fail)?;
                tx.exec("INSERT INTO bb_meta_schema (version) VALUES ($1)", &[Val::Int(version)]).map_err(fail)?;
                tracing::info!(url = %url, version, "metadata schema migrated");
            }
            Ok(())
        })
    }

    fn unexpected(&self, what: impl Into<String>) -> MetaError {
        MetaError::Unexpected { url: self.url(), what: what.into() }
    }

    // --- records ---

    /// Records `r`; the same record again is a no-op, another body under its id is a `Conflict`.
    pub fn put_record(&self, r: &Record) -> Result<()> {
        self.tx(|tx| {
            let params =
                [Val::text(&r.id), Val::text(&r.kind), Val::text(&r.node), Val::Real(r.created_at), Val::text(&r.body)];
            let sql = "INSERT INTO records (id, kind, node, created_at, body) VALUES ($1, $2, $3, $4, $5)
                       ON CONFLICT (id) DO NOTHING";
            if tx.exec(sql, &params)? == 1 {
                return Ok(());
            }
            let rows = tx.query("SELECT body FROM records WHERE id = $1", &[Val::text(&r.id)])?;
            match rows.first().map(|row| row[0].as_text()) {
                Some(Some(body)) if body == r.body => Ok(()),
                Some(_) => Err(MetaError::Conflict { what: format!("record {} exists with another body", r.id) }),
                None => Err(self.unexpected(format!("no record {} after a conflicting insert", r.id))),
            }
        })
    }

    pub fn get_record(&self, id: &str) -> Result<Option<Record>> {
        let rows = self.read(|tx| {
            tx.query("SELECT id, kind, node, created_at, body FROM records WHERE id = $1", &[Val::text(id)])
        })?;
        rows.into_iter().next().map(|row| self.record(row)).transpose()
    }

    /// All records, or those of one kind, oldest first.
    pub fn list_records(&self, kind: Option<&str>) -> Result<Vec<Record>> {
        let rows = self.read(|tx| match kind {
            Some(kind) => tx.query(
                "SELECT id, kind, node, created_at, body FROM records WHERE kind = $1 ORDER BY created_at, id",
                &[Val::text(kind)],
            ),
            None => tx.query("SELECT id, kind, node, created_at, body FROM records ORDER BY created_at, id", &[]),
        })?;
        rows.into_iter().map(|row| self.record(row)).collect()
    }

    fn record(&self, row: Vec<Val>) -> Result<Record> {
        match <[Val; 5]>::try_from(row) {
            Ok([Val::Text(id), Val::Text(kind), Val::Text(node), at, Val::Text(body)]) => {
                let created_at = at.real().ok_or_else(|| self.unexpected(format!("record {id}: created_at {at:?}")))?;
                Ok(Record { id, kind, node, created_at, body })
            }
            other => Err(self.unexpected(format!("a malformed record row {other:?}"))),
        }
    }

    /// True if it was there.
    pub fn delete_record(&self, id: &str) -> Result<bool> {
        self.tx(|tx| Ok(tx.exec("DELETE FROM records WHERE id = $1", &[Val::text(id)])? > 0))
    }

    // --- objects ---

    /// Names an immutable object: the same value again is a no-op, another value a `Conflict`.
    pub fn put_object(&self, name: &str, value: &str) -> Result<()> {
        self.tx(|tx| {
            let sql = "INSERT INTO objects (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING";
            if tx.exec(sql, &[Val::text(name), Val::text(value)])? == 1 {
                return Ok(());
            }
            let rows = tx.query("SELECT value FROM objects WHERE name = $1", &[Val::text(name)])?;
            match rows.first().map(|row| row[0].as_text()) {
                Some(Some(v)) if v == value => Ok(()),
                Some(_) => Err(MetaError::Conflict { what: format!("object {name} is already set to another value") }),
                None => Err(self.unexpected(format!("no object {name} after a conflicting insert"))),
            }
        })
    }

    pub fn get_object(&self, name: &str) -> Result<Option<String>> {
        Ok(self.get_objects(&[name.to_owned()])?.remove(name))
    }

    /// The values of those of `names` that exist, in one query.
    pub fn get_objects(&self, names: &[String]) -> Result<HashMap<String, String>> {
        if names.is_empty() {
            return Ok(HashMap::new());
        }
        let rows = self.read(|tx| {
            let mut rows = Vec::new();
            for chunk in names.chunks(IN_CHUNK) {
                let marks: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
                let sql = format!("SELECT name, value FROM objects WHERE name IN ({})", marks.join(", "));
                let params: Vec<Val> = chunk.iter().map(|n| Val::text(n)).collect();
                rows.extend(tx.query(&sql, &params)?);
            }
            Ok(rows)
        })?;
        rows.into_iter().map(|row| self.pair(row)).collect()
    }

    /// (name, value) of every object whose name starts with `prefix`, by name.
    pub fn list_objects(&self, prefix: &str) -> Result<Vec<(String, String)>> {
        let rows = self.read(|tx| {
            // Not LIKE (case-insensitive in SQLite, wildcards) nor a range (collation-dependent).
            let sql = "SELECT name, value FROM objects
                       WHERE substr(name, 1, length(CAST($1 AS TEXT))) = CAST($1 AS TEXT)";
            tx.query(sql, &[Val::text(prefix)])
        })?;
        let mut out = rows.into_iter().map(|row| self.pair(row)).collect::<Result<Vec<_>>>()?;
        out.sort();
        Ok(out)
    }

    fn pair(&self, row: Vec<Val>) -> Result<(String, String)> {
        match <[Val; 2]>::try_from(row) {
            Ok([Val::Text(a), Val::Text(b)]) => Ok((a, b)),
            other => Err(self.unexpected(format!("a malformed row {other:?}"))),
        }
    }

    /// True if it was there.
    pub fn delete_object(&self, name: &str) -> Result<bool> {
        self.tx(|tx| Ok(tx.exec("DELETE FROM objects WHERE name = $1", &[Val::text(name)])? > 0))
    }

    // --- heads ---

    pub fn head(&self, name: &str) -> Result<Option<Head>> {
        let rows = self.read(|tx| tx.query("SELECT version, value FROM heads WHERE name = $1", &[Val::text(name)]))?;
        let Some(row) = rows.into_iter().next() else { return Ok(None) };
        match <[Val; 2]>::try_from(row) {
            Ok([Val::Int(version), Val::Text(value)]) => Ok(Some(Head { name: name.to_owned(), version, value })),
            other => Err(self.unexpected(format!("a malformed head row {other:?}"))),
        }
    }

    /// Every head whose name starts with `prefix`, by name.
    pub fn list_heads(&self, prefix: &str) -> Result<Vec<Head>> {
        let rows = self.read(|tx| {
            let sql = "SELECT name, version, value FROM heads
                       WHERE substr(name, 1, length(CAST($1 AS TEXT))) = CAST($1 AS TEXT)";
            tx.query(sql, &[Val::text(prefix)])
        })?;
        let mut out = rows
            .into_iter()
            .map(|row| match <[Val; 3]>::try_from(row) {
                Ok([Val::Text(name), Val::Int(version), Val::Text(value)]) => Ok(Head { name, version, value }),
                other => Err(self.unexpected(format!("a malformed head row {other:?}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Sets head `name` to `value` if it is at version `expected` (`None`: if it does not exist,
    /// creating version 1); the new head has the next version. Otherwise `HeadMoved`.
    pub fn cas_head(&self, name: &str, expected: Option<i64>, value: &str) -> Result<Head> {
        self.tx(|tx| {
            let changed = match expected {
                None => tx.exec(
                    "INSERT INTO heads (name, version, value) VALUES ($1, 1, $2) ON CONFLICT (name) DO NOTHING",
                    &[Val::text(name), Val::text(value)],
                )?,
                Some(v) => tx.exec(
                    "UPDATE heads SET version = version + 1, value = $3 WHERE name = $1 AND version = $2",
                    &[Val::text(name), Val::Int(v), Val::text(value)],
                )?,
            };
            if changed == 1 {
                let version = expected.map_or(1, |v| v + 1);
                return Ok(Head { name: name.to_owned(), version, value: value.to_owned() });
            }
            Err(MetaError::HeadMoved { name: name.to_owned(), expected, found: head_version(tx, name)? })
        })
    }

    /// Deletes head `name` if it is at version `expected`; otherwise `HeadMoved`.
    pub fn delete_head(&self, name: &str, expected: i64) -> Result<()> {
        self.tx(|tx| {
            if tx.exec("DELETE FROM heads WHERE name = $1 AND version = $2", &[Val::text(name), Val::Int(expected)])?
                == 1
            {
                return Ok(());
            }
            Err(MetaError::HeadMoved {
                name: name.to_owned(),
                expected: Some(expected),
                found: head_version(tx, name)?,
            })
        })
    }

    // --- leases ---

    /// Takes or renews lease `name` for `ttl`: true if `holder` now holds it (it was free, expired
    /// or already `holder`'s), false if someone else holds it unexpired.
    pub fn acquire_lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool> {
        self.tx(|tx| {
            let now = tx.now();
            let sql = format!(
                "INSERT INTO leases (name, holder, expires) VALUES ($1, $2, {now} + $3)
                 ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires = excluded.expires
                 WHERE leases.holder = excluded.holder OR leases.expires <= {now}"
            );
            Ok(tx.exec(&sql, &[Val::text(name), Val::text(holder), Val::Real(ttl.as_secs_f64())])? == 1)
        })
    }

    /// Gives up lease `name` if `holder` holds it.
    pub fn release_lease(&self, name: &str, holder: &str) -> Result<()> {
        self.tx(|tx| {
            tx.exec("DELETE FROM leases WHERE name = $1 AND holder = $2", &[Val::text(name), Val::text(holder)])
        })
        .map(drop)
    }

    /// Who holds lease `name` unexpired, and for how many more seconds.
    pub fn lease_holder(&self, name: &str) -> Result<Option<(String, f64)>> {
        let rows = self.read(|tx| {
            let now = tx.now();
            let sql = format!("SELECT holder, expires - {now} FROM leases WHERE name = $1 AND expires > {now}");
            tx.query(&sql, &[Val::text(name)])
        })?;
        let Some(row) = rows.into_iter().next() else { return Ok(None) };
        match <[Val; 2]>::try_from(row) {
            Ok([Val::Text(holder), Val::Real(left)]) => Ok(Some((holder, left))),
            other => Err(self.unexpected(format!("a malformed lease row {other:?}"))),
        }
    }

    // --- the store lock ---

    /// Records (or renews) `holder`'s intent to push for `ttl`; false if a live GC holds the store.
    pub fn begin_push(&self, holder: &str, ttl: Duration) -> Result<bool> {
        self.tx(|tx| {
            if live_gc(tx)?.is_some() {
                return Ok(false);
            }
            let now = tx.now();
            tx.exec(&format!("DELETE FROM push_intents WHERE expires <= {now}"), &[])?;
            let sql = format!(
                "INSERT INTO push_intents (holder, expires) VALUES ($1, {now} + $2)
                 ON CONFLICT (holder) DO UPDATE SET expires = excluded.expires"
            );
            tx.exec(&sql, &[Val::text(holder), Val::Real(ttl.as_secs_f64())])?;
            Ok(true)
        })
    }

    pub fn end_push(&self, holder: &str) -> Result<()> {
        self.tx(|tx| tx.exec("DELETE FROM push_intents WHERE holder = $1", &[Val::text(holder)])).map(drop)
    }

    /// End every push intent and collection held by a holder named `prefix...`: a daemon that
    /// restarted after a crash lets go of what its previous run held, instead of blocking
    /// collection until it expires.
    pub fn release_holders(&self, prefix: &str) -> Result<()> {
        self.tx(|tx| {
            let p = Val::text(prefix);
            let starts = "substr({col}, 1, length(CAST($1 AS TEXT))) = CAST($1 AS TEXT)";
            tx.exec(
                &format!("DELETE FROM push_intents WHERE {}", starts.replace("{col}", "holder")),
                std::slice::from_ref(&p),
            )?;
            tx.exec(
                &format!(
                    "UPDATE store_lock SET gc_holder = NULL, gc_expires = NULL WHERE {}",
                    starts.replace("{col}", "gc_holder")
                ),
                &[p],
            )?;
            Ok(())
        })
    }

    /// Takes (or renews) the store for garbage collection for `ttl`; false while a live push
    /// intent or another holder's live GC exists. Expired ones are removed.
    pub fn begin_gc(&self, holder: &str, ttl: Duration) -> Result<bool> {
        self.tx(|tx| {
            if live_gc(tx)?.is_some_and(|h| h != holder) {
                return Ok(false);
            }
            let now = tx.now();
            tx.exec(&format!("DELETE FROM push_intents WHERE expires <= {now}"), &[])?;
            if !tx.query("SELECT holder FROM push_intents", &[])?.is_empty() {
                return Ok(false);
            }
            let sql = format!("UPDATE store_lock SET gc_holder = $1, gc_expires = {now} + $2 WHERE id = 1");
            tx.exec(&sql, &[Val::text(holder), Val::Real(ttl.as_secs_f64())])?;
            Ok(true)
        })
    }

    pub fn end_gc(&self, holder: &str) -> Result<()> {
        self.tx(|tx| {
            tx.exec(
                "UPDATE store_lock SET gc_holder = NULL, gc_expires = NULL WHERE id = 1 AND gc_holder = $1",
                &[Val::text(holder)],
            )
        })
        .map(drop)
    }
}

fn head_version(tx: &mut dyn Tx, name: &str) -> Result<Option<i64>> {
    let rows = tx.query("SELECT version FROM heads WHERE name = $1", &[Val::text(name)])?;
    Ok(rows.first().and_then(|row| row[0].int()))
}

/// Locks the store-lock row for the rest of the transaction and returns the live GC holder.
fn live_gc(tx: &mut dyn Tx) -> Result<Option<String>> {
    let sql = format!("SELECT gc_holder, gc_expires - {} FROM store_lock WHERE id = 1{}", tx.now(), tx.for_update());
    let rows = tx.query(&sql, &[])?;
    Ok(match rows.into_iter().next().and_then(|row| <[Val; 2]>::try_from(row).ok()) {
        Some([Val::Text(holder), left]) if left.real().is_some_and(|l| l > 0.0) => Some(holder),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        let p = |s: &str| s.parse::<MetaUrl>();
        assert_eq!(p("sqlite:///var/lib/bb/meta.db").unwrap(), MetaUrl::Sqlite("/var/lib/bb/meta.db".into()));
        assert_eq!(p("sqlite:meta.db").unwrap(), MetaUrl::Sqlite("meta.db".into()));
        assert_eq!(p("/var/lib/bb/meta.db").unwrap(), MetaUrl::Sqlite("/var/lib/bb/meta.db".into()));
        assert_eq!(p("./meta.db").unwrap(), MetaUrl::Sqlite("./meta.db".into()));
        assert_eq!(p("meta.db").unwrap(), MetaUrl::Sqlite("meta.db".into()));
        let pg = "postgres://u:secret@db.example:5433/bb";
        assert_eq!(p(pg).unwrap(), MetaUrl::Postgres(pg.into()));
        assert!(matches!(p("postgresql://u@localhost/bb").unwrap(), MetaUrl::Postgres(_)));
        for bad in ["", "mysql://x/y", "redis:foo", "sqlite://relative", "sqlite:", "postgres://u:secret@h:notaport/x"]
        {
            let e = p(bad).unwrap_err();
            assert!(matches!(e, MetaError::BadUrl { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("sqlite:///absolute/path"), "{e}");
            assert!(!e.to_string().contains("secret"), "{e}");
        }
    }

    #[test]
    fn urls_redact_passwords() {
        let show = |s: &str| s.parse::<MetaUrl>().unwrap().to_string();
        assert_eq!(show("postgres://user:pw@host/db"), "postgres://user:***@host/db");
        assert_eq!(
            show("postgresql://user:p%40w@host:5432/db?sslmode=disable"),
            "postgresql://user:***@host:5432/db?sslmode=disable"
        );
        assert_eq!(
            show("postgres://user@host/db?password=pw&connect_timeout=3"),
            "postgres://user@host/db?password=***&connect_timeout=3"
        );
        assert_eq!(show("postgres://host/db"), "postgres://host/db");
        assert_eq!(show("sqlite:///a/b.db"), "sqlite:///a/b.db");
        assert_eq!(show("b.db"), "sqlite:b.db");
    }

    #[test]
    fn meta_is_shareable() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Meta>();
    }

    #[test]
    fn the_api_on_sqlite() {
        let d = tempfile::tempdir().unwrap();
        let url = MetaUrl::Sqlite(d.path().join("meta.db"));
        let m = Meta::open(&url).unwrap();
        assert_eq!(m.url(), format!("sqlite://{}", d.path().join("meta.db").display()));
        let r = |id: &str, kind: &str, at: f64, body: &str| Record {
            id: id.into(),
            kind: kind.into(),
            node: "n1".into(),
            created_at: at,
            body: body.into(),
        };
        m.put_record(&r("b", "snapshot", 2.0, "{}")).unwrap();
        m.put_record(&r("a", "paused", 1.0, "{\"x\":1}")).unwrap();
        m.put_record(&r("b", "snapshot", 2.0, "{}")).unwrap();
        assert!(matches!(m.put_record(&r("b", "snapshot", 2.0, "{\"y\":1}")), Err(MetaError::Conflict { .. })));
        assert_eq!(m.get_record("a").unwrap().unwrap(), r("a", "paused", 1.0, "{\"x\":1}"));
        assert_eq!(m.get_record("zz").unwrap(), None);
        let ids = |rs: Vec<Record>| rs.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(m.list_records(None).unwrap()), ["a", "b"]);
        assert_eq!(ids(m.list_records(Some("snapshot")).unwrap()), ["b"]);
        assert!(m.delete_record("a").unwrap());
        assert!(!m.delete_record("a").unwrap());

        m.put_object("layer/1", "t1").unwrap();
        m.put_object("layer/1", "t1").unwrap();
        m.put_object("Layer/2", "t2").unwrap();
        m.put_object("layer%3", "t3").unwrap();
        assert!(matches!(m.put_object("layer/1", "other"), Err(MetaError::Conflict { .. })));
        assert_eq!(m.get_object("layer/1").unwrap().as_deref(), Some("t1"));
        assert_eq!(m.list_objects("layer/").unwrap(), [("layer/1".to_owned(), "t1".to_owned())]);
        assert_eq!(m.list_objects("").unwrap().len(), 3);
        let got = m.get_objects(&["layer/1".into(), "Layer/2".into(), "nope".into()]).unwrap();
        assert_eq!(got.len(), 2);
        assert!(m.delete_object("layer/1").unwrap());
        assert_eq!(m.get_object("layer/1").unwrap(), None);

        let h = m.cas_head("main", None, "v1").unwrap();
        assert_eq!(h.version, 1);
        let e = m.cas_head("main", None, "x").unwrap_err();
        assert!(matches!(e, MetaError::HeadMoved { expected: None, found: Some(1), .. }), "{e}");
        assert_eq!(m.cas_head("main", Some(1), "v2").unwrap().version, 2);
        assert!(matches!(m.cas_head("main", Some(1), "x"), Err(MetaError::HeadMoved { found: Some(2), .. })));
        assert_eq!(m.head("main").unwrap().unwrap().value, "v2");
        assert!(m.delete_head("main", 1).is_err());
        m.delete_head("main", 2).unwrap();
        assert_eq!(m.head("main").unwrap(), None);

        assert!(m.acquire_lease("vol", "a", Duration::from_secs(60)).unwrap());
        assert!(!m.acquire_lease("vol", "b", Duration::from_secs(60)).unwrap());
        let (holder, left) = m.lease_holder("vol").unwrap().unwrap();
        assert_eq!(holder, "a");
        assert!(left > 50.0 && left <= 60.0, "{left}");
        m.release_lease("vol", "b").unwrap();
        assert!(m.lease_holder("vol").unwrap().is_some());
        m.release_lease("vol", "a").unwrap();
        assert!(m.acquire_lease("vol", "b", Duration::from_secs(60)).unwrap());

        assert!(m.begin_push("p1", Duration::from_secs(60)).unwrap());
        assert!(!m.begin_gc("gc", Duration::from_secs(60)).unwrap());
        m.end_push("p1").unwrap();
        assert!(m.begin_gc("gc", Duration::from_secs(60)).unwrap());
        assert!(!m.begin_push("p1", Duration::from_secs(60)).unwrap());
        assert!(!m.begin_gc("gc2", Duration::from_secs(60)).unwrap());
        m.end_gc("gc").unwrap();
        assert!(m.begin_push("p1", Duration::from_secs(60)).unwrap());
        // A restarted daemon lets go of its own holds (named by its prefix), not another's.
        assert!(m.begin_push("node-a@1:x", Duration::from_secs(60)).unwrap());
        m.end_push("p1").unwrap();
        m.release_holders("node-b@1:").unwrap();
        assert!(!m.begin_gc("node-b@1:gc", Duration::from_secs(60)).unwrap());
        m.release_holders("node-a@1:").unwrap();
        assert!(m.begin_gc("node-a@1:gc", Duration::from_secs(60)).unwrap());
        m.release_holders("node-a@1:").unwrap();
        assert!(m.begin_gc("node-b@1:gc", Duration::from_secs(60)).unwrap());
        m.end_gc("node-b@1:gc").unwrap();
        drop(m);
        // Reopening runs no migration again.
        let m = Meta::open(&url).unwrap();
        assert_eq!(m.list_records(None).unwrap().len(), 1);
    }
}
