//! The state database (`<state>/branchbox.db`, SQLite): one file, one connection per store.
//!
//! Each mechanism keeps its records in tables of its own through a store type of its own
//! (sandbox records, snapshot records, settings, pool targets, recipes), each on its own
//! connection opened here: WAL without an fsync per commit (a crash loses at most the last
//! transactions, never consistency), and writers wait for each other up to [`BUSY_TIMEOUT`].

use rusqlite::Connection;
use std::path::Path;
use thiserror::Error;

/// How long a statement waits for another connection's write lock.
pub const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum DbError {
    #[error("state database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("state database: unreadable {what} record {id:?}: {source}")]
    Record {
        what: &'static str,
        id: String,
        #[source]
        source: serde_json::Error,
    },
}

pub type DbResult<T> = std::result::Result<T, DbError>;

/// A connection to the state database at `path`, set up as every store expects.
pub fn open(path: &Path) -> DbResult<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    Ok(conn)
}

/// A transaction that takes the write lock at its start (`BEGIN IMMEDIATE`, waiting up to the
/// busy timeout): the database has other connections, and a deferred transaction that reads first
/// fails at once with "database is locked" when one of them wrote since its read began.
pub fn write_tx(conn: &Connection) -> DbResult<rusqlite::Transaction<'_>> {
    Ok(rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Immediate)?)
}

/// JSON text of a record field (our own types: they always serialize).
pub fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("record types serialize")
}
