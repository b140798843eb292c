//! Running a future and doing something the first time it has to wait: how a worker slot
//! tells an activity that answered at once from one that is still going.

use std::future::Future;

/// Runs `work` to its output, calling `on_wait` once, the first time `work` is not ready
/// when polled (before it is polled again); never, when it is ready at its first poll.
pub(crate) async fn on_first_wait<T>(work: impl Future<Output = T>, on_wait: impl FnOnce()) -> T {
    let mut work = std::pin::pin!(work);
    let mut on_wait = Some(on_wait);
    std::future::poll_fn(|cx| {
        let polled = work.as_mut().poll(cx);
        if polled.is_pending() {
            if let Some(on_wait) = on_wait.take() {
                on_wait();
            }
        }
        polled
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::on_first_wait;
    use std::cell::Cell;

    #[tokio::test]
    async fn a_future_ready_at_once_never_calls_it() {
        let calls = Cell::new(0);
        let out = on_first_wait(async { 7 }, || calls.set(calls.get() + 1)).await;
        assert_eq!((out, calls.get()), (7, 0));
    }

    #[tokio::test]
    async fn a_future_that_waits_calls_it_once_before_its_output() {
        let calls = Cell::new(0);
        let out = on_first_wait(
            async {
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
                calls.get()
            },
            || calls.set(calls.get() + 1),
        )
        .await;
        // The future read the count after its first wait: the call came before that.
        assert_eq!((out, calls.get()), (1, 1));
    }
}
