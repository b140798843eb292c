//! Small file-system and error helpers the embedded stores share: fsyncing directories,
//! creating or finding a store directory, `StoreOpen` errors, and the text of a caught panic.
//!
//! The error texts are the stores' own: each helper reports exactly what the code it replaced
//! in [`sled`](super::sled), [`fjall`](super::fjall) and [`marks`](super::marks) reported.

use crate::error::{Error, Result};
use std::fs::{self, File};
use std::path::Path;

/// fsyncs a directory, making the names in it durable.
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        // Directories cannot be opened for syncing here; NTFS journals the names itself.
        let _ = dir;
        Ok(())
    }
}

/// [`sync_dir`], failing with a sentence that names the directory.
pub(super) fn sync_dir_described(dir: &Path) -> std::result::Result<(), String> {
    sync_dir(dir).map_err(|e| format!("fsync of directory {} failed: {e}", dir.display()))
}

/// A `StoreOpen` error for the store in `dir`.
pub(super) fn open_error(dir: &Path, reason: String) -> Error {
    Error::StoreOpen {
        path: dir.display().to_string(),
        reason,
    }
}

/// Creates `dir` and any missing parents, then fsyncs the parent of each directory it created
/// (deepest first), so their names are durable before a store is opened in it.
pub(super) fn create_store_dir(dir: &Path) -> Result<()> {
    let created: Vec<&Path> = dir
        .ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
        .collect();
    fs::create_dir_all(dir).map_err(|e| open_error(dir, format!("cannot create it: {e}")))?;
    // Make the names of the directories just created durable, deepest first.
    for new_dir in created {
        if let Some(parent) = new_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir_described(parent).map_err(|e| open_error(dir, e))?;
        }
    }
    Ok(())
}

/// Fails with `StoreOpen` ("no store here") unless `dir` is an existing directory.
pub(super) fn check_store_dir(dir: &Path) -> Result<()> {
    let meta = fs::metadata(dir).map_err(|e| open_error(dir, format!("no store here: {e}")))?;
    if !meta.is_dir() {
        return Err(open_error(dir, "no store here: not a directory".to_owned()));
    }
    Ok(())
}

/// The message of a caught panic, when it has one.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_owned()
    }
}
