//! A store on a database server (`cairn server --store postgres://...`, `CAIRN_STORE`,
//! `DATABASE_URL`) and `cairn migrate`, which copies an embedded store into one.

use super::out::{note, showln};
use anyhow::{bail, Context};
use cairn_runtime::store::embedded::{self, OpenMode};
use cairn_runtime::store::Store;
use cairn_runtime::{Clock, SystemClock};
use std::path::Path;
use std::sync::Arc;

/// Where `cairn server` keeps its sessions: a store directory, or a database URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// An embedded store in this directory.
    Dir(std::path::PathBuf),
    /// A database server.
    Url(String),
}

impl StoreLocation {
    /// `--store` (or `CAIRN_STORE`), else `--data`, else `DATABASE_URL`, else the default
    /// data directory. `--store` and `--data` together are a mistake.
    pub fn resolve(
        store: Option<String>,
        data: Option<std::path::PathBuf>,
    ) -> anyhow::Result<StoreLocation> {
        match (store, data) {
            (Some(url), Some(dir)) => bail!(
                "--store {} and --data {} both given: use one (a database, or a store directory)",
                redact(&url),
                dir.display()
            ),
            (Some(url), None) => Ok(StoreLocation::Url(url)),
            (None, Some(dir)) => Ok(StoreLocation::Dir(dir)),
            (None, None) => match std::env::var("DATABASE_URL").ok().filter(|v| !v.is_empty()) {
                Some(url) => Ok(StoreLocation::Url(url)),
                None => Ok(StoreLocation::Dir(super::StoreDir::resolve(None)?.path)),
            },
        }
    }
}

/// The URL without its password, for messages.
#[cfg(feature = "postgres")]
pub fn redact(url: &str) -> String {
    cairn_postgres::redact_url(url)
}

/// Without PostgreSQL support no URL is used, so none is shown.
#[cfg(not(feature = "postgres"))]
pub fn redact(_url: &str) -> String {
    "the database URL".to_owned()
}

/// How a database store uses its connections (`cairn server --store`).
#[derive(clap::Args, Debug, Clone)]
pub struct PoolArgs {
    /// Connections to the database this server opens at most.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub store_connections: u32,
    /// A request that finds every connection taken waits this long for one, then is
    /// answered 503 (retry).
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub store_acquire_ms: u64,
    /// One database statement may run this long (a lock held elsewhere, an overloaded
    /// server), then fails and the request is answered 503.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub store_statement_ms: u64,
}

/// Connects to the database store at `url` (its schema migrated to this build's).
pub async fn connect(url: &str, pool: &PoolArgs) -> anyhow::Result<Arc<dyn Store>> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        bail!(
            "unsupported store URL {}: use postgres://USER@HOST:PORT/DATABASE",
            redact(url)
        );
    }
    connect_postgres(url, pool).await
}

#[cfg(feature = "postgres")]
async fn connect_postgres(url: &str, pool: &PoolArgs) -> anyhow::Result<Arc<dyn Store>> {
    let options = cairn_postgres::PgOptions {
        max_connections: pool.store_connections,
        acquire_timeout: std::time::Duration::from_millis(pool.store_acquire_ms),
        statement_timeout: std::time::Duration::from_millis(pool.store_statement_ms),
        ..cairn_postgres::PgOptions::default()
    };
    let store = cairn_postgres::PgStore::connect(url, options)
        .await
        .with_context(|| format!("cannot use the PostgreSQL store at {}", redact(url)))?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "postgres"))]
async fn connect_postgres(url: &str, _pool: &PoolArgs) -> anyhow::Result<Arc<dyn Store>> {
    bail!(
        "this cairn was built without PostgreSQL support (the `postgres` feature), so it cannot use {}",
        redact(url)
    )
}

/// `cairn migrate --from DIR --to URL`: copies every session of the store in `from` (read
/// through a private copy: the directory is not changed) into the database at `to`, which
/// must hold none of them.
pub async fn migrate(from: &Path, to: &str) -> anyhow::Result<()> {
    let source = embedded::open(from, OpenMode::ReadOnly, None)
        .await
        .with_context(|| format!("cannot read the store at {}", from.display()))?;
    if !source.losses.is_empty() {
        bail!(
            "the store at {} lost acknowledged events ({}); run `cairn fsck` first, nothing was copied",
            from.display(),
            cairn::host::describe_losses(&source.losses)
        );
    }
    let destination = connect(
        to,
        &PoolArgs {
            store_connections: 2,
            store_acquire_ms: 30_000,
            store_statement_ms: 300_000,
        },
    )
    .await?;
    let now = SystemClock.now_ms();
    let report = cairn_runtime::store::copy::copy_sessions(&*source.store, &*destination, now)
        .await
        .with_context(|| format!("copying into {}", redact(to)))?;
    showln!(
        "copied {} session(s), {} event(s), {} queued task(s) and {} deleted session id(s) \
         from {} to {}",
        report.sessions,
        report.events,
        report.tasks,
        report.deleted,
        from.display(),
        redact(to)
    );
    if !report.deleted_left_behind.is_empty() {
        note!(
            "warning: {} deleted session id(s) could not be recorded as deleted there, and may \
             be used again: {}",
            report.deleted_left_behind.len(),
            report.deleted_left_behind.join(", ")
        );
    }
    Ok(())
}
