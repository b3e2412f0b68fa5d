//! The two databases behind one small transaction interface: SQL is written once with `$1`
//! placeholders, types both accept (TEXT, BIGINT, DOUBLE PRECISION) and `ON CONFLICT`; the few
//! differences (the clock, row locks, the migration lock) are methods of [`Tx`].

use crate::{MetaError, MetaUrl, Result};
use postgres::types::{ToSql, Type};
use std::error::Error as _;
use std::time::Duration;

/// A value in or out of a statement.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Val {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
}

impl Val {
    pub(crate) fn text(s: &str) -> Val {
        Val::Text(s.to_owned())
    }

    pub(crate) fn int(&self) -> Option<i64> {
        match self {
            Val::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub(crate) fn real(&self) -> Option<f64> {
        match self {
            Val::Real(r) => Some(*r),
            Val::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub(crate) fn as_text(&self) -> Option<&str> {
        match self {
            Val::Text(s) => Some(s),
            _ => None,
        }
    }
}

/// One open transaction.
pub(crate) trait Tx {
    /// Rows changed.
    fn exec(&mut self, sql: &str, params: &[Val]) -> Result<u64>;
    fn query(&mut self, sql: &str, params: &[Val]) -> Result<Vec<Vec<Val>>>;
    /// Several statements, no parameters.
    fn batch(&mut self, sql: &str) -> Result<()>;
    /// The database's clock, seconds since the Unix epoch, as an SQL expression.
    fn now(&self) -> &'static str;
    /// Appended to a SELECT to lock its rows until the end of the transaction.
    fn for_update(&self) -> &'static str;
    /// Makes concurrent migrations of one database wait for each other.
    fn migration_lock(&mut self) -> Result<()>;
}

pub(crate) enum Backend {
    Sqlite(rusqlite::Connection),
    Postgres { config: Box<postgres::Config>, client: Option<Box<postgres::Client>> },
}

impl Drop for Backend {
    fn drop(&mut self) {
        // A postgres::Client drives its connection on a runtime of its own, which must not be
        // dropped (it blocks) on a thread of an async runtime, as the daemon's shutdown does: it
        // goes on a thread of its own.
        if let Backend::Postgres { client, .. } = self {
            if let Some(c) = client.take() {
                let closing = std::thread::Builder::new().name("bb-meta-close".into()).spawn(move || drop(c));
                let _ = closing.map(|t| t.join());
            }
        }
    }
}

impl Backend {
    pub(crate) fn open(url: &MetaUrl) -> Result<Backend> {
        match url {
            MetaUrl::Sqlite(path) => {
                let c = rusqlite::Connection::open(path)?;
                c.busy_timeout(Duration::from_secs(5))?;
                c.pragma_update(None, "journal_mode", "WAL")?;
                Ok(Backend::Sqlite(c))
            }
            MetaUrl::Postgres(s) => {
                let mut config: postgres::Config =
                    s.parse().map_err(|e| MetaError::BadUrl { url: url.to_string(), why: describe(&e) })?;
                // Ours first: an `options` in the URL overrides it.
                let options = format!("-c statement_timeout=30000 {}", config.get_options().unwrap_or(""));
                config
                    .connect_timeout(Duration::from_secs(5))
                    .tcp_user_timeout(Duration::from_secs(30))
                    .keepalives_idle(Duration::from_secs(30))
                    .options(options.trim_end());
                if config.get_application_name().is_none() {
                    config.application_name("branchbox");
                }
                let client = Some(Box::new(connect(&config, &url.to_string())?));
                Ok(Backend::Postgres { config: Box::new(config), client })
            }
        }
    }

    /// Runs `f` in one transaction and commits it. A PostgreSQL connection found broken when the
    /// transaction begins (nothing sent yet) is reopened once; one that breaks later is dropped
    /// and the call fails (the next call reconnects), since the commit may or may not have landed.
    pub(crate) fn run<T>(&mut self, url: &str, write: bool, f: &mut dyn FnMut(&mut dyn Tx) -> Result<T>) -> Result<T> {
        match self {
            Backend::Sqlite(c) => {
                use rusqlite::TransactionBehavior::{Deferred, Immediate};
                let mut tx = c.transaction_with_behavior(if write { Immediate } else { Deferred })?;
                let out = f(&mut tx)?;
                tx.commit()?;
                Ok(out)
            }
            Backend::Postgres { config, client } => {
                for retry in [true, false] {
                    let c = match client {
                        Some(c) if !c.is_closed() => c,
                        _ => client.insert(Box::new(connect(config, url)?)),
                    };
                    let began = match c.build_transaction().read_only(!write).start() {
                        Ok(tx) => {
                            let mut tx = PgTx { tx, url };
                            Ok(f(&mut tx).and_then(|out| {
                                tx.tx.commit().map_err(|e| pg_error(url, e))?;
                                Ok(out)
                            }))
                        }
                        Err(e) => Err(pg_error(url, e)),
                    };
                    let out = match began {
                        Ok(out) => out,
                        Err(MetaError::Unreachable { .. }) if retry => {
                            tracing::info!(url, "metadata store connection broken; reconnecting");
                            *client = None;
                            continue;
                        }
                        Err(e) => Err(e),
                    };
                    if let Err(MetaError::Unreachable { .. }) = out {
                        *client = None;
                    }
                    return out;
                }
                unreachable!("the second attempt returns")
            }
        }
    }
}

fn connect(config: &postgres::Config, url: &str) -> Result<postgres::Client> {
    config.connect(postgres::NoTls).map_err(|e| pg_error(url, e))
}

/// A connection-level failure (the server is gone, restarting or refusing) is `Unreachable`;
/// anything the server answered (a constraint, a syntax error, a timeout it enforced) is not.
fn pg_error(url: &str, e: postgres::Error) -> MetaError {
    let code = e.code().map(|c| c.code());
    let broken = e.is_closed()
        || e.source().is_some_and(|s| s.is::<std::io::Error>())
        || code.is_some_and(|c| c.starts_with("08") || c.starts_with("57P"))
        || (code.is_none() && e.to_string().starts_with("timeout"));
    if broken {
        MetaError::Unreachable { url: url.to_owned(), why: describe(&e) }
    } else {
        MetaError::Postgres { url: url.to_owned(), source: e }
    }
}

/// An error and its causes, "outer: inner: innermost" (postgres::Error shows only the outer).
pub(crate) fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

impl Tx for rusqlite::Transaction<'_> {
    fn exec(&mut self, sql: &str, params: &[Val]) -> Result<u64> {
        Ok(self.execute(&sqlite_sql(sql), rusqlite::params_from_iter(params.iter().map(sqlite_val)))? as u64)
    }

    fn query(&mut self, sql: &str, params: &[Val]) -> Result<Vec<Vec<Val>>> {
        let mut stmt = self.prepare(&sqlite_sql(sql))?;
        let n = stmt.column_count();
        let rows = stmt.query_map(rusqlite::params_from_iter(params.iter().map(sqlite_val)), |row| {
            (0..n)
                .map(|i| {
                    use rusqlite::types::ValueRef;
                    Ok(match row.get_ref(i)? {
                        ValueRef::Null => Val::Null,
                        ValueRef::Integer(v) => Val::Int(v),
                        ValueRef::Real(v) => Val::Real(v),
                        ValueRef::Text(t) | ValueRef::Blob(t) => Val::Text(String::from_utf8_lossy(t).into_owned()),
                    })
                })
                .collect()
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn batch(&mut self, sql: &str) -> Result<()> {
        Ok(self.execute_batch(sql)?)
    }

    fn now(&self) -> &'static str {
        "unixepoch('subsec')"
    }

    fn for_update(&self) -> &'static str {
        "" // BEGIN IMMEDIATE already holds the database's write lock.
    }

    fn migration_lock(&mut self) -> Result<()> {
        Ok(()) // Likewise.
    }
}

/// `$1` -> `?1`: SQLite reads `$1` as a name, numbered by first appearance, not by its digits.
fn sqlite_sql(sql: &str) -> String {
    sql.replace('$', "?")
}

fn sqlite_val(v: &Val) -> rusqlite::types::Value {
    use rusqlite::types::Value;
    match v {
        Val::Null => Value::Null,
        Val::Int(i) => Value::Integer(*i),
        Val::Real(r) => Value::Real(*r),
        Val::Text(s) => Value::Text(s.clone()),
    }
}

struct PgTx<'a, 'u> {
    tx: postgres::Transaction<'a>,
    url: &'u str,
}

impl PgTx<'_, '_> {
    fn params(params: &[Val]) -> Vec<&(dyn ToSql + Sync)> {
        const NULL: Option<String> = None;
        params
            .iter()
            .map(|v| -> &(dyn ToSql + Sync) {
                match v {
                    Val::Null => &NULL,
                    Val::Int(i) => i,
                    Val::Real(r) => r,
                    Val::Text(s) => s,
                }
            })
            .collect()
    }

    fn row(&self, row: &postgres::Row) -> Result<Vec<Val>> {
        let get = |i: usize, t: &Type| -> Result<Val, postgres::Error> {
            Ok(match *t {
                Type::INT8 => row.try_get::<_, Option<i64>>(i)?.map_or(Val::Null, Val::Int),
                Type::INT4 => row.try_get::<_, Option<i32>>(i)?.map_or(Val::Null, |v| Val::Int(v.into())),
                Type::FLOAT8 => row.try_get::<_, Option<f64>>(i)?.map_or(Val::Null, Val::Real),
                _ => row.try_get::<_, Option<String>>(i)?.map_or(Val::Null, Val::Text),
            })
        };
        row.columns().iter().enumerate().map(|(i, c)| get(i, c.type_()).map_err(|e| pg_error(self.url, e))).collect()
    }
}

impl Tx for PgTx<'_, '_> {
    fn exec(&mut self, sql: &str, params: &[Val]) -> Result<u64> {
        self.tx.execute(sql, &Self::params(params)).map_err(|e| pg_error(self.url, e))
    }

    fn query(&mut self, sql: &str, params: &[Val]) -> Result<Vec<Vec<Val>>> {
        let rows = self.tx.query(sql, &Self::params(params)).map_err(|e| pg_error(self.url, e))?;
        rows.iter().map(|r| self.row(r)).collect()
    }

    fn batch(&mut self, sql: &str) -> Result<()> {
        self.tx.batch_execute(sql).map_err(|e| pg_error(self.url, e))
    }

    fn now(&self) -> &'static str {
        "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
    }

    fn for_update(&self) -> &'static str {
        " FOR UPDATE"
    }

    fn migration_lock(&mut self) -> Result<()> {
        // An arbitrary key of this crate ("bbmeta" in ASCII), held until commit or rollback.
        self.batch("SELECT pg_advisory_xact_lock(108732437460321)")
    }
}
