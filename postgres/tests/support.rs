//! Helpers of the tests: fresh stores on fresh databases, raw connections, appends.

use cairn_postgres::testing::fresh_database;
use cairn_postgres::{PgOptions, PgStore};
use cairn_runtime::store::conformance::{append_request, message};
use cairn_runtime::store::{NewTask, Store, TaskId, TaskKind};
use sqlx::{Connection, PgConnection};

/// A store on `url`, or a panic naming why.
pub async fn connect(url: &str, options: PgOptions) -> PgStore {
    PgStore::connect(url, options).await.unwrap_or_else(|e| {
        panic!(
            "connecting to {} failed: {e}",
            cairn_postgres::redact_url(url)
        )
    })
}

/// A store on a new, empty database, with that database's URL.
pub async fn fresh_store() -> (PgStore, String) {
    let url = fresh_database().await;
    (connect(&url, PgOptions::default()).await, url)
}

/// A connection of its own to `url`, for what the tests do behind the store's back.
pub async fn raw(url: &str) -> PgConnection {
    PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("a raw connection failed: {e}"))
}

pub fn task_id(session_id: &str, scheduled_seq: u64) -> TaskId {
    TaskId {
        session_id: session_id.to_owned(),
        scheduled_seq,
    }
}

/// Appends `tasks` new tasks (visible at 0) to session `session_id`, with one event.
pub async fn enqueue(store: &dyn Store, session_id: &str, tasks: u64) {
    let mut request = append_request(session_id, 1, vec![message(session_id, 1, "go")], 0);
    request.enqueue = (1..=tasks)
        .map(|seq| NewTask::new(task_id(session_id, seq), TaskKind::Tool, 0))
        .collect();
    if let Err(e) = store.append(request).await {
        panic!("enqueueing {tasks} tasks on {session_id} failed: {e}");
    }
}
