//! Test support (feature `testing`): a fresh, empty database per test on the PostgreSQL server
//! that `DATABASE_URL` names (`scripts/postgres start` prints one for a throwaway server).

use crate::url::redact;
use sqlx::{Connection, Executor, PgConnection};
use std::sync::atomic::{AtomicU64, Ordering};

static DATABASES: AtomicU64 = AtomicU64::new(0);

/// Dead queue rows a store handle leaves before it vacuums the queue (`upkeep`).
pub const QUEUE_VACUUM_AFTER: u64 = crate::upkeep::VACUUM_AFTER;

/// The server to create test databases on: `DATABASE_URL`. Panics when it is not set, since a
/// test that cannot reach PostgreSQL must fail, not skip.
pub fn server_url() -> String {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "set DATABASE_URL or run scripts/test, which starts a throwaway PostgreSQL \
             (`eval \"$(scripts/postgres start)\"` starts one by hand)"
        ),
    }
}

/// Creates a uniquely named, empty database on the server of `DATABASE_URL` and returns its
/// URL. Panics when `DATABASE_URL` is unset or the database cannot be created. The databases
/// are left behind: a throwaway server goes with them.
#[allow(clippy::disallowed_methods)] // a unique name, not a time anything depends on
pub async fn fresh_database() -> String {
    let server = server_url();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    let name = format!(
        "cairn_test_{}_{}_{nanos}",
        std::process::id(),
        DATABASES.fetch_add(1, Ordering::Relaxed)
    );
    let mut conn = PgConnection::connect(&server)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to DATABASE_URL {}: {e}", redact(&server)));
    conn.execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .unwrap_or_else(|e| panic!("cannot create database {name} on {}: {e}", redact(&server)));
    let _ = conn.close().await;
    crate::url::with_database(&server, &name)
}

#[cfg(test)]
mod tests {
    use crate::url::with_database;

    #[test]
    fn database_is_replaced() {
        let cases = [
            (
                "postgres://postgres@127.0.0.1:5432/postgres",
                "postgres://postgres@127.0.0.1:5432/t",
            ),
            ("postgres://u:p/w@h:1", "postgres://u:p/w@h:1/t"),
            (
                "postgres://h/db?sslmode=disable",
                "postgres://h/t?sslmode=disable",
            ),
            ("postgresql://h", "postgresql://h/t"),
        ];
        for (url, want) in cases {
            assert_eq!(with_database(url, "t"), want, "{url}");
        }
    }
}
