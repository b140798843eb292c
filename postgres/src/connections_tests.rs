//! Tests of the store's connection pool on a real PostgreSQL (`DATABASE_URL`): a connection
//! goes back without a round trip after a statement that was answered, and with one after a
//! transaction; a broken connection leaves the pool.

// The tests wait in real time for a database's answers and a spawned ping.
#![allow(clippy::disallowed_methods)]

use crate::connections::Connections;
use crate::testing::fresh_database;
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{Connection, Executor, PgConnection, Row};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy in front of the database that counts the `Sync` messages clients send: one
/// ends every statement sqlx runs, and sqlx's ping is a `Sync` alone.
struct SyncCounter {
    port: u16,
    syncs: Arc<AtomicU64>,
}

impl SyncCounter {
    async fn start(server: &PgConnectOptions) -> SyncCounter {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let port = listener.local_addr().expect("its address").port();
        let syncs = Arc::new(AtomicU64::new(0));
        let target = format!("{}:{}", server.get_host(), server.get_port());
        let counted = syncs.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(&target).await.expect("the database");
                tokio::spawn(relay(client, server, counted.clone()));
            }
        });
        SyncCounter { port, syncs }
    }

    fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::SeqCst)
    }
}

/// Relays one connection both ways, counting the client's `Sync` messages: after the startup
/// packet (length-prefixed, no type byte), each message is a type byte and a length.
async fn relay(client: TcpStream, server: TcpStream, syncs: Arc<AtomicU64>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    });
    let mut buffer = Vec::new();
    let mut started = false;
    let mut chunk = [0u8; 8192];
    loop {
        let read = match client_read.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if server_write.write_all(&chunk[..read]).await.is_err() {
            return;
        }
        buffer.extend_from_slice(&chunk[..read]);
        loop {
            let header = if started { 5 } else { 4 };
            if buffer.len() < header {
                break;
            }
            let length_at = header - 4;
            let length = u32::from_be_bytes(
                buffer[length_at..length_at + 4]
                    .try_into()
                    .expect("four bytes"),
            ) as usize;
            let whole = length_at + length;
            if buffer.len() < whole {
                break;
            }
            if started && buffer[0] == b'S' {
                syncs.fetch_add(1, Ordering::SeqCst);
            }
            started = true;
            buffer.drain(..whole);
        }
    }
}

/// Options for `url` without TLS, so that the proxy reads the messages.
fn plain(url: &str) -> PgConnectOptions {
    PgConnectOptions::from_str(url)
        .expect("a PostgreSQL URL")
        .ssl_mode(PgSslMode::Disable)
}

async fn select_one(connections: &Connections) -> i32 {
    let row = connections
        .get()
        .await
        .expect("a connection")
        .fetch_one(sqlx::query("SELECT 1::INT4 AS one"))
        .await
        .expect("SELECT 1");
    row.get("one")
}

#[tokio::test]
async fn a_connection_goes_back_without_a_round_trip() {
    let url = fresh_database().await;
    let counter = SyncCounter::start(&plain(&url)).await;
    let options = plain(&url).host("127.0.0.1").port(counter.port);
    let connections = Connections::new(options, 2, Duration::from_secs(5)).expect("a pool");
    // The first run prepares the statement (its own Sync); the rest run it prepared.
    assert_eq!(select_one(&connections).await, 1);
    let before = counter.syncs();
    for _ in 0..20 {
        assert_eq!(select_one(&connections).await, 1);
    }
    // Let any ping spawned on release reach the proxy.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let syncs = counter.syncs() - before;
    assert_eq!(
        syncs, 20,
        "20 statements, each taken from and given back to the pool, sent {syncs} Sync \
         messages: one each, and none for pings on release"
    );
    connections.close().await;
}

#[tokio::test]
async fn a_transaction_left_open_is_rolled_back_as_its_connection_goes_back() {
    let url = fresh_database().await;
    let mut other = PgConnection::connect(&url).await.expect("a connection");
    other
        .execute("CREATE TABLE locked (id INT PRIMARY KEY); INSERT INTO locked VALUES (1)")
        .await
        .expect("a table");
    let connections = Connections::new(plain(&url), 2, Duration::from_secs(5)).expect("a pool");
    {
        let mut held = connections.get().await.expect("a connection");
        let mut tx = held.raw().begin().await.expect("a transaction");
        sqlx::query("SELECT id FROM locked WHERE id = 1 FOR UPDATE")
            .fetch_one(&mut *tx)
            .await
            .expect("the row locked");
        // Dropped without a commit: sqlx queues the ROLLBACK on the connection.
    }
    // The row is free again without any other use of the pool: the ROLLBACK was sent as the
    // connection went back.
    let mut free = false;
    for _ in 0..100 {
        let locked = sqlx::query("SELECT id FROM locked WHERE id = 1 FOR UPDATE NOWAIT")
            .fetch_optional(&mut other)
            .await;
        if locked.is_ok() {
            free = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        free,
        "the dropped transaction still holds its row lock after 2 s"
    );
    let _ = other.close().await;
    connections.close().await;
}

#[tokio::test]
async fn a_broken_connection_leaves_the_pool() {
    let url = fresh_database().await;
    let connections = Connections::new(plain(&url), 1, Duration::from_secs(5)).expect("a pool");
    let pid: i32 = connections
        .get()
        .await
        .expect("a connection")
        .fetch_one(sqlx::query("SELECT pg_backend_pid() AS pid"))
        .await
        .expect("its backend")
        .get("pid");
    let mut other = PgConnection::connect(&url).await.expect("a connection");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&mut other)
        .await
        .expect("the pooled connection's backend terminated");
    // The pool's one connection is dead, and used within the second that spares it a ping:
    // its next statement fails, and the connection must not be handed out again.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let failed = connections
        .get()
        .await
        .expect("a connection")
        .fetch_one(sqlx::query("SELECT 1::INT4 AS one"))
        .await;
    assert!(
        failed.is_err(),
        "a statement on a terminated backend answered"
    );
    let mut answered = None;
    for _ in 0..20 {
        if let Ok(mut held) = connections.get().await {
            if let Ok(row) = held.fetch_one(sqlx::query("SELECT 1::INT4 AS one")).await {
                answered = Some(row.get::<i32, _>("one"));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        answered,
        Some(1),
        "the pool kept handing out the broken connection"
    );
    let _ = other.close().await;
    connections.close().await;
}
