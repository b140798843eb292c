//! Writes the same workload to a sled and a fjall store and leaves them for measuring: 1,000
//! sessions × 20 events of about 300 bytes by default, each event its own durable append, the
//! sessions appending concurrently.
//!
//! Run: `cargo run --release -p cairn-runtime --example store_footprint -- <dir> [sessions]
//! [events per session]`, then
//! `du -sb <dir>/*` (apparent size) and `du -sk <dir>/*` (allocated blocks: fjall preallocates
//! its active journal to 64 MiB, sparse until written).

use cairn_runtime::store::fjall::FjallStore;
use cairn_runtime::store::sled::SledStore;
use cairn_runtime::{AppendRequest, Event, EventEnvelope, SessionStatus, Store};
use std::path::PathBuf;
use std::sync::Arc;

fn append(session_id: &str, seq: u64) -> AppendRequest {
    let event = EventEnvelope::new(
        session_id,
        seq,
        1_700_000_000_000 + seq,
        Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: 1,
            text: "x".repeat(200),
            model: None,
            media: Vec::new(),
        },
    );
    AppendRequest::new(
        session_id,
        seq,
        vec![event],
        SessionStatus::Running,
        1_700_000_000_000 + seq,
    )
}

async fn fill(store: Arc<dyn Store>, sessions: usize, events: u64) {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..sessions {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            let s = format!("session-{i:04}");
            for seq in 1..=events {
                store.append(append(&s, seq)).await.expect("append");
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("session task");
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let usage = "usage: store_footprint <dir> [sessions] [events per session]";
    let mut args = std::env::args().skip(1);
    let root: PathBuf = args.next().expect(usage).into();
    let sessions: usize = args.next().map_or(1_000, |n| n.parse().expect(usage));
    let events: u64 = args.next().map_or(20, |n| n.parse().expect(usage));
    let sled: Arc<dyn Store> = Arc::new(SledStore::open(root.join("sled")).expect("sled"));
    fill(sled, sessions, events).await;
    let fjall: Arc<dyn Store> = Arc::new(FjallStore::open(root.join("fjall")).expect("fjall"));
    fill(fjall, sessions, events).await;
    println!(
        "wrote {sessions} sessions × {events} events to each store under {}",
        root.display()
    );
}
