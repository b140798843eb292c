//! The store's local socket: a process that holds a store open for writing serves the `/v1`
//! API on `DIR/cairn.sock`, so another `cairn` command that finds the store locked acts
//! through it instead of failing (`cairn sessions` while `cairn run` runs, `cairn cancel` of a
//! running turn).

use cairn_runtime::store::embedded::SOCKET_FILE;
use cairn_runtime::Engine;
use cairn_server::ServerConfig;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long closing waits for requests in flight (a long poll, a stream) before cutting them.
const CLOSE_GRACE: Duration = Duration::from_millis(500);

/// The API served on a store's socket; closed (and its file removed) by [`StoreSocket::close`].
pub struct StoreSocket {
    path: PathBuf,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl StoreSocket {
    /// Serves `engine`'s API on `dir/cairn.sock`. Only the process holding the store's
    /// exclusive lock calls this, so a socket file already there is a dead process's and is
    /// replaced. The socket is for this user only (mode 0600) and needs no token: the
    /// requests act in the default namespace, like a server without a tokens file.
    pub fn serve(dir: &Path, engine: Engine) -> std::io::Result<StoreSocket> {
        let path = dir.join(SOCKET_FILE);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let router = cairn_server::router(engine, ServerConfig::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "the store socket stopped serving");
            }
        });
        Ok(StoreSocket { path, stop, task })
    }

    /// Stops serving and removes the socket file.
    pub async fn close(self) {
        let _ = self.stop.send(());
        let mut task = self.task;
        if tokio::time::timeout(CLOSE_GRACE, &mut task).await.is_err() {
            task.abort();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}
