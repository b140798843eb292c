//! Scratch databases for `cairn bench --store`: each measurement gets a new, empty database on
//! the PostgreSQL server the user named, so that no measurement reads another's sessions or
//! queue, and drops it when done.

/// A database created for one measurement. (No `Debug`: its URLs may hold a password.)
pub struct ScratchDatabase {
    /// The URL the user gave, whose server holds the database; connections to create and drop
    /// it go to the database this URL names.
    // Read only by the PostgreSQL code; without it no scratch database is ever made.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    server_url: String,
    /// The database's name (`cairn_bench_...`).
    name: String,
    /// `server_url` naming this database instead.
    url: String,
}

impl ScratchDatabase {
    /// The URL of the scratch database, for `cairn server --store`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::ScratchDatabase;
    use anyhow::Context;
    use cairn_postgres::{redact_url, url_with_database};
    use sqlx::{Connection, Executor, PgConnection};
    use std::sync::atomic::{AtomicU64, Ordering};

    static CREATED: AtomicU64 = AtomicU64::new(0);

    impl ScratchDatabase {
        /// Creates an empty database on the PostgreSQL server of `server_url`.
        pub async fn create(server_url: &str) -> anyhow::Result<ScratchDatabase> {
            // Unique across runs too: a database an interrupted run left behind keeps its name.
            #[allow(clippy::disallowed_methods)] // a name, not a time anything depends on
            let started_s = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_secs());
            let name = format!(
                "cairn_bench_{started_s}_{}_{}",
                std::process::id(),
                CREATED.fetch_add(1, Ordering::Relaxed)
            );
            let mut conn = connect(server_url).await?;
            conn.execute(format!("CREATE DATABASE {name}").as_str())
                .await
                .with_context(|| {
                    format!(
                        "cannot create database {name} on {}",
                        redact_url(server_url)
                    )
                })?;
            let _ = conn.close().await;
            Ok(ScratchDatabase {
                url: url_with_database(server_url, &name),
                server_url: server_url.to_owned(),
                name,
            })
        }

        /// Drops the database. Call it after every process using it has exited: `WITH
        /// (FORCE)` ends sessions still open, and where it is not understood (before
        /// PostgreSQL 13) a plain `DROP` waits a few seconds for them.
        pub async fn drop_database(self) -> anyhow::Result<()> {
            let mut conn = connect(&self.server_url).await?;
            let name = &self.name;
            let forced = conn
                .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                .await;
            if forced.is_err() {
                conn.execute(format!("DROP DATABASE IF EXISTS {name}").as_str())
                    .await
                    .with_context(|| {
                        format!(
                            "cannot drop database {name} on {}",
                            redact_url(&self.server_url)
                        )
                    })?;
            }
            let _ = conn.close().await;
            Ok(())
        }
    }

    async fn connect(url: &str) -> anyhow::Result<PgConnection> {
        PgConnection::connect(url)
            .await
            .with_context(|| format!("cannot connect to {}", redact_url(url)))
    }
}

#[cfg(not(feature = "postgres"))]
impl ScratchDatabase {
    /// Without PostgreSQL support there is no database to create.
    pub async fn create(_server_url: &str) -> anyhow::Result<ScratchDatabase> {
        anyhow::bail!(
            "this cairn was built without PostgreSQL support (the `postgres` feature), so it cannot benchmark a database store"
        )
    }

    /// Nothing was created, so nothing is dropped.
    pub async fn drop_database(self) -> anyhow::Result<()> {
        Ok(())
    }
}
