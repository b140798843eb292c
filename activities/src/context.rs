//! The activity context: what a running attempt can ask of its runtime — heartbeats (with
//! progress details the next attempt receives), cancellation, which attempt it is, the
//! working directory its session recorded, and for tools that change files, what the session
//! last saw of each file.

use cairn_ledger::file_versions::FileVersion;
use cairn_ledger::{JsonText, Usage};
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

type HeartbeatFn = dyn Fn(Option<JsonText>) + Send + Sync;

/// Handed to every activity attempt; cheap to clone.
#[derive(Clone)]
pub struct ActivityContext {
    inner: Arc<Inner>,
    /// The session's own working directory, when it recorded one; tools prefer it to theirs.
    working_dir: Option<Arc<Path>>,
    file_versions: Arc<[FileVersion]>,
}

struct Inner {
    attempt: u32,
    previous_details: Option<JsonText>,
    cancel: CancellationToken,
    heartbeat: Box<HeartbeatFn>,
    usage: Mutex<Option<Usage>>,
}

impl ActivityContext {
    /// A context for `attempt`, with the details the previous attempt last heartbeated, a
    /// cancellation token, and where heartbeats go.
    pub fn new(
        attempt: u32,
        previous_details: Option<JsonText>,
        cancel: CancellationToken,
        heartbeat: impl Fn(Option<JsonText>) + Send + Sync + 'static,
    ) -> Self {
        ActivityContext {
            inner: Arc::new(Inner {
                attempt,
                previous_details,
                cancel,
                heartbeat: Box::new(heartbeat),
                usage: Mutex::new(None),
            }),
            working_dir: None,
            file_versions: Arc::new([]),
        }
    }

    /// This context for a session that recorded `working_dir`: tools that work in a directory
    /// (`read_file`, `shell`) work there instead of in their own.
    pub fn with_working_dir(mut self, working_dir: Option<&Path>) -> Self {
        self.working_dir = working_dir.map(Arc::from);
        self
    }

    /// The session's working directory, when it recorded one (see
    /// [`ActivityContext::with_working_dir`]).
    pub fn working_dir(&self) -> Option<&Path> {
        self.working_dir.as_deref()
    }

    /// The same context, with what the session last saw of each file (derived from its
    /// recorded history by the engine; see [`cairn_ledger::file_versions`]).
    pub fn with_file_versions(mut self, versions: Vec<FileVersion>) -> Self {
        self.file_versions = versions.into();
        self
    }

    /// What the session last saw of each file, the latest last; empty for tools that do not
    /// change files.
    pub fn file_versions(&self) -> &[FileVersion] {
        &self.file_versions
    }

    /// A context that is never cancelled and drops heartbeats (tests, one-off calls).
    pub fn detached() -> Self {
        Self::new(1, None, CancellationToken::new(), |_| {})
    }

    /// The attempt number, from 1.
    pub fn attempt(&self) -> u32 {
        self.inner.attempt
    }

    /// Progress details the previous attempt heartbeated last, to resume from.
    pub fn previous_heartbeat_details(&self) -> Option<&JsonText> {
        self.inner.previous_details.as_ref()
    }

    /// Reports liveness (and optionally progress). Long activities must call this more often
    /// than their heartbeat timeout, or the attempt is failed as timed out.
    pub fn heartbeat(&self, details: Option<JsonText>) {
        (self.inner.heartbeat)(details);
    }

    /// Records the usage a model call has consumed so far (cumulative), so that an attempt that
    /// fails mid-stream still has its usage recorded.
    pub fn report_usage(&self, usage: Usage) {
        *self.inner.usage.lock().unwrap_or_else(|p| p.into_inner()) = Some(usage);
    }

    /// The last usage reported by [`ActivityContext::report_usage`].
    pub fn reported_usage(&self) -> Option<Usage> {
        *self.inner.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether cancellation was requested.
    pub fn is_cancelled(&self) -> bool {
        self.inner.cancel.is_cancelled()
    }

    /// Completes when cancellation is requested; select on it to stop cooperatively.
    pub async fn cancelled(&self) {
        self.inner.cancel.cancelled().await;
    }
}

impl std::fmt::Debug for ActivityContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivityContext")
            .field("attempt", &self.inner.attempt)
            .field("previous_details", &self.inner.previous_details)
            .field("cancelled", &self.inner.cancel.is_cancelled())
            .field("working_dir", &self.working_dir)
            .finish()
    }
}
