//! The runtime's store conformance suite on PostgreSQL: every check on a fresh database, then
//! `run_all` with a factory of fresh databases and a reopen that drops the store and connects
//! again.

use crate::support::{connect, fresh_store};
use cairn_postgres::testing::fresh_database;
use cairn_postgres::{PgOptions, PgStore};
use cairn_runtime::store::conformance;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::runtime::Handle;

macro_rules! each_check {
    ($($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let (store, _) = fresh_store().await;
                conformance::$check(&store).await;
            }
        )*
    };
}

each_check!(
    append_read_round_trip,
    conflict_on_wrong_expected_seq,
    batch_with_wrong_seq_is_rejected,
    unknown_and_invalid_sessions,
    list_sessions_ordered_with_status,
    empty_appends,
    large_events_round_trip,
    enqueue_and_lease,
    reenqueue_replaces_task,
    duplicate_ids_in_one_enqueue_keep_the_last,
    complete_with_current_lease,
    complete_with_stale_attempt_writes_nothing,
    complete_after_expiry_is_lost,
    complete_several_tasks_in_one_append,
    cancel_removes_tasks,
    a_task_is_looked_up_by_id,
    extend_lease,
    release_leases_keeps_attempts,
    lease_filters_by_queue_target_session_and_namespace,
    overdue_tasks_are_listed_and_never_leased,
    heartbeat_details_are_kept_until_the_next_lease,
    released_tasks_are_leased_again_and_not_overdue,
    a_fenced_drop_removes_an_unchanged_overdue_task,
    a_fenced_drop_of_a_task_leased_since_is_refused,
    a_fenced_drop_of_a_task_renewed_since_is_refused,
    a_fenced_drop_of_a_task_released_or_gone_since_is_refused,
    far_off_times_are_taken_and_mean_never,
    an_append_expecting_seq_0_is_refused,
    sessions_named_reads_the_records_it_holds,
    deleted_sessions_are_listed_and_recorded,
);

/// Runs `future` to its end from synchronous code inside the test's (multi-threaded) runtime:
/// `run_all` takes synchronous factories, and connecting is async.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::task::block_in_place(|| Handle::current().block_on(future))
}

/// Drops `store` (closing its connections) and connects again to its database, whose URL
/// (with any password) `urls` keeps by the URL the store shows.
fn reopen(store: PgStore, urls: &Mutex<BTreeMap<String, String>>) -> PgStore {
    let url = urls
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .get(store.url())
        .cloned()
        .unwrap_or_else(|| panic!("no database URL recorded for {}", store.url()));
    block_on(async {
        store.close().await;
        drop(store);
        connect(&url, PgOptions::default()).await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_appends() {
    let (store, _) = fresh_store().await;
    conformance::concurrent_appends(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_keeps_everything() {
    let (store, url) = fresh_store().await;
    let urls = Mutex::new(BTreeMap::from([(store.url().to_owned(), url)]));
    conformance::reopen_keeps_everything(store, &mut |store| reopen(store, &urls)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_survives_a_reopen() {
    let (store, url) = fresh_store().await;
    let urls = Mutex::new(BTreeMap::from([(store.url().to_owned(), url)]));
    conformance::a_deletion_survives_a_reopen(store, &mut |store| reopen(store, &urls)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_all() {
    let urls = Mutex::new(BTreeMap::new());
    let fresh = || {
        block_on(async {
            let url = fresh_database().await;
            let store = connect(&url, PgOptions::default()).await;
            urls.lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .insert(store.url().to_owned(), url);
            store
        })
    };
    conformance::run_all(fresh, Some(&mut |store| reopen(store, &urls))).await;
}

/// The concurrency checks with two handles that are two stores on one database, each with
/// its own connection pool and change listener, as two processes would have.
macro_rules! each_concurrency_check {
    ($($check:ident),* $(,)?) => {
        mod two_processes {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $check() {
                    let (a, url) = fresh_store().await;
                    let b = connect(&url, PgOptions::default()).await;
                    conformance::$check(Arc::new(a), Arc::new(b)).await;
                }
            )*
        }
    };
}

each_concurrency_check!(
    concurrent_leases_hand_each_task_once,
    a_lapsed_lease_changes_nothing,
    racing_appends_on_two_handles,
    two_engines_on_one_store,
    a_deletion_is_seen_through_another_handle,
);
