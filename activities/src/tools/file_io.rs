//! Reading and replacing files for the file tools without being led astray by what the working
//! directory holds: only regular files are read (opening a FIFO to read it would wait for a
//! writer for ever), never more than a limit is held in memory, and a replacement goes through
//! a temporary file that nothing planted beside it can redirect.

use crate::tools::confine::{io_message, Refusal};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::AsyncReadExt;

/// Opens `path` to read it if it is a regular file, and gives its length then. It is opened
/// without blocking (and never as a controlling terminal), so a FIFO is refused instead of
/// waiting for a writer; once the file is known to be regular, the descriptor is made
/// blocking again, as reads of it expect.
pub(crate) async fn open_regular(
    path: &Path,
    requested: &str,
) -> std::result::Result<(tokio::fs::File, u64), Refusal> {
    let file = tokio::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .await
        .map_err(|e| io_message(requested, &e))?;
    let metadata = file
        .metadata()
        .await
        .map_err(|e| io_message(requested, &e))?;
    if metadata.is_dir() {
        return Err(format!("{requested:?} is a directory, not a file"));
    }
    if !metadata.is_file() {
        return Err(format!(
            "{requested:?} is not a regular file (a pipe, socket or device); the file tools \
             work on regular files only"
        ));
    }
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    // SAFETY: fcntl(2) on a descriptor this function owns and keeps open; no memory involved.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(io_message(requested, &std::io::Error::last_os_error()));
    }
    Ok((file, metadata.len()))
}

/// A regular file's content, read only when it is within a limit.
pub(crate) enum Limited {
    /// The whole file.
    Whole(Vec<u8>),
    /// The file holds more than the limit: at least this many bytes.
    TooLarge(u64),
}

/// Reads the regular file at `path` when it holds at most `limit` bytes, without reading
/// more than one byte past the limit (a file that grew since its length was read is caught).
pub(crate) async fn read_limited(
    path: &Path,
    requested: &str,
    limit: u64,
) -> std::result::Result<Limited, Refusal> {
    let (file, length) = open_regular(path, requested).await?;
    if length > limit {
        return Ok(Limited::TooLarge(length));
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| io_message(requested, &e))?;
    if bytes.len() as u64 > limit {
        return Ok(Limited::TooLarge(bytes.len() as u64));
    }
    Ok(Limited::Whole(bytes))
}

/// What a regular file holds, compared with some content, read in pieces so that a file of
/// any size costs no more memory than one piece.
pub(crate) struct Compared {
    /// Whether the file holds exactly the content.
    pub same: bool,
    /// The lowercase hex SHA-256 of the file.
    pub sha256: String,
}

/// Reads the regular file at `path` in pieces, hashing it and comparing it with `content`.
pub(crate) async fn compare_with(
    path: &Path,
    requested: &str,
    content: &[u8],
) -> std::result::Result<Compared, Refusal> {
    let (mut file, _) = open_regular(path, requested).await?;
    let mut hasher = Sha256::new();
    let mut piece = vec![0; 64 * 1024];
    let mut offset = 0usize;
    let mut same = true;
    loop {
        let read = file
            .read(&mut piece)
            .await
            .map_err(|e| io_message(requested, &e))?;
        let Some(bytes) = piece.get(..read).filter(|bytes| !bytes.is_empty()) else {
            break;
        };
        hasher.update(bytes);
        let end = offset.saturating_add(read);
        same = same && content.get(offset..end) == Some(bytes);
        offset = end;
    }
    let sha256 = cairn_ledger::file_versions::digest_hex(&hasher.finalize());
    Ok(Compared {
        same: same && offset == content.len(),
        sha256,
    })
}

/// Replaces `path`'s content with `bytes` atomically: a temporary file beside it, synced, then
/// renamed over it, so a crash leaves the old content or the new, never a torn file. An
/// existing file's permissions are kept.
///
/// The temporary file is created new (`O_EXCL`) under a random name: a file or symlink
/// already at that name is never opened, so nothing planted in the working directory can make
/// the write land outside it. Its permissions are set through the open file (`fchmod`), before
/// any content is written, and it is removed if the write stops before the rename (an error,
/// or the call's future dropped by a timeout).
pub(crate) async fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let permissions = tokio::fs::metadata(path)
        .await
        .ok()
        .map(|m| m.permissions());
    let (mut file, mut temporary) = create_temporary(dir, &name).await?;
    if let Some(permissions) = permissions {
        file.set_permissions(permissions).await?;
    }
    tokio::io::AsyncWriteExt::write_all(&mut file, bytes).await?;
    file.sync_all().await?;
    drop(file);
    tokio::fs::rename(temporary.path(), path).await?;
    temporary.renamed();
    Ok(())
}

/// A temporary file that is removed when dropped, unless it was renamed into place.
struct Temporary(Option<PathBuf>);

impl Temporary {
    fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }

    /// It is the target now: nothing to remove.
    fn renamed(&mut self) {
        self.0 = None;
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Counts the names tried, so that each random name this process draws is new.
static TEMPORARY_NAMES: AtomicU64 = AtomicU64::new(0);

/// Creates a new temporary file in `dir` for replacing `name`, under a random name (std's
/// randomly keyed hasher over a counter: unpredictable, so no one can plant the names ahead).
/// The name keeps at most 100 bytes of `name`, so a long file name still fits.
async fn create_temporary(dir: &Path, name: &str) -> std::io::Result<(tokio::fs::File, Temporary)> {
    let mut cut = name.len().min(100);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let stem = &name[..cut];
    let mut tries = 0;
    loop {
        let random = {
            use std::hash::{BuildHasher, Hasher};
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(TEMPORARY_NAMES.fetch_add(1, Ordering::Relaxed));
            hasher.finish()
        };
        let temporary = dir.join(format!(".{stem}.{random:016x}.cairn-write"));
        match tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary)
            .await
        {
            Ok(file) => return Ok((file, Temporary(Some(temporary)))),
            // Taken (a leftover of a crash, or a clash): draw another name.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 16 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn a_symlink_planted_where_a_temporary_file_would_go_is_never_written_through() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        // The fixed name earlier versions wrote through.
        std::os::unix::fs::symlink(&victim, dir.path().join(".notes.cairn-write")).unwrap();
        let target = dir.path().join("notes");
        std::fs::write(&target, b"old").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_atomically(&target, b"new").await.unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        let written = std::fs::symlink_metadata(&target).unwrap();
        assert!(written.file_type().is_file());
        assert_eq!(written.permissions().mode() & 0o777, 0o640);
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        let victim_mode = std::fs::metadata(&victim).unwrap().permissions().mode();
        assert_eq!(victim_mode & 0o777, 0o600);
        // Nothing is left beside it.
        assert_eq!(names_in(dir.path()), [".notes.cairn-write", "notes"]);
    }

    #[tokio::test]
    async fn a_temporary_file_is_removed_when_the_write_stops_before_its_rename() {
        let dir = tempfile::tempdir().unwrap();
        // The rename fails: the target is a directory that holds something.
        let target = dir.path().join("taken");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), b"x").unwrap();
        assert!(write_atomically(&target, b"new").await.is_err());
        assert_eq!(names_in(dir.path()), ["taken"]);
        // Dropped before the rename (as by a timeout): removed too.
        let (_file, temporary) = create_temporary(dir.path(), "f").await.unwrap();
        assert_eq!(names_in(dir.path()).len(), 2);
        drop(temporary);
        assert_eq!(names_in(dir.path()), ["taken"]);
        // A long name is cut to fit.
        let long = "é".repeat(120);
        let (_file, temporary) = create_temporary(dir.path(), &long).await.unwrap();
        let temporary_name = temporary.path().file_name().unwrap().len();
        assert!(temporary_name < 160, "{temporary_name}");
    }

    #[tokio::test]
    async fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("p");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `name` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let refused = match read_limited(&fifo, "p", 10).await {
            Err(refusal) => refusal,
            Ok(_) => panic!("a FIFO was read"),
        };
        assert!(refused.contains("not a regular file"), "{refused}");
        let refused = compare_with(&fifo, "p", b"").await.err().unwrap();
        assert!(refused.contains("not a regular file"), "{refused}");
    }

    #[tokio::test]
    async fn a_file_past_the_limit_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big");
        // Sparse: 8 GiB long, nothing written.
        std::fs::File::create(&big)
            .unwrap()
            .set_len(8 << 30)
            .unwrap();
        match read_limited(&big, "big", 1024).await {
            Ok(Limited::TooLarge(at_least)) => assert_eq!(at_least, 8 << 30),
            _ => panic!("an 8 GiB file was not refused as too large"),
        }
        std::fs::write(&big, b"0123456789").unwrap();
        match read_limited(&big, "big", 10).await {
            Ok(Limited::Whole(bytes)) => assert_eq!(bytes, b"0123456789"),
            _ => panic!("a file at the limit was not read"),
        }
    }

    #[tokio::test]
    async fn comparing_reads_in_pieces_and_hashes_the_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let content: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        let compared = compare_with(&path, "f", &content).await.unwrap();
        assert!(compared.same);
        assert_eq!(
            compared.sha256,
            cairn_ledger::file_versions::sha256_hex(&content)
        );
        assert!(
            !compare_with(&path, "f", &content[..199_999])
                .await
                .unwrap()
                .same
        );
        let mut longer = content.clone();
        longer.push(0);
        assert!(!compare_with(&path, "f", &longer).await.unwrap().same);
        let mut changed = content.clone();
        changed[150_000] ^= 1;
        assert!(!compare_with(&path, "f", &changed).await.unwrap().same);
    }
}
