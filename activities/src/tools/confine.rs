//! Confinement of the file tools to a working directory: a path is resolved against it,
//! canonicalized, and refused when it escapes (by `..`, an absolute path or a symlink). Shared
//! by `read_file`, `list_dir`, `write_file` and `edit_file`, so they all draw the same line.

use crate::error::{Error, Result};
use cairn_ledger::file_versions::FileVersion;
use std::io::ErrorKind as IoKind;
use std::path::{Component, Path, PathBuf};

/// Why a path cannot be used, as the model should read it.
pub(crate) type Refusal = String;

/// The working directory a file tool is confined to.
#[derive(Debug, Clone)]
pub(crate) struct WorkDir {
    dir: PathBuf,
    /// The tool's name and what it does to files ("reads", "writes"), for the refusals.
    tool: &'static str,
    verb: &'static str,
}

/// A path checked to lie inside the working directory, not necessarily existing yet.
pub(crate) struct Inside {
    /// The path, `..` and `.` removed, under the canonical working directory.
    pub lexical: PathBuf,
    /// The canonical working directory.
    pub root: PathBuf,
}

impl WorkDir {
    pub(crate) fn new(dir: PathBuf, tool: &'static str, verb: &'static str) -> Self {
        WorkDir { dir, tool, verb }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// This confinement in the session's own working directory when it recorded one (it may
    /// differ from the directory of the process that hosts the tool: a turn resumed from
    /// elsewhere), else in the tool's own.
    pub(crate) fn for_session(&self, context: &crate::context::ActivityContext) -> WorkDir {
        match context.working_dir() {
            Some(dir) => WorkDir {
                dir: dir.to_path_buf(),
                ..self.clone()
            },
            None => self.clone(),
        }
    }

    fn escapes(&self, requested: &str) -> Refusal {
        format!(
            "{requested:?} escapes the working directory; {} only {} files inside it",
            self.tool, self.verb
        )
    }

    /// Checks `requested` lexically: inside the working directory, before touching the
    /// filesystem (so paths outside never reveal whether they exist). The working directory
    /// as given counts too: an absolute path the model built from it need not be canonical.
    pub(crate) async fn lexical(
        &self,
        requested: &str,
    ) -> Result<std::result::Result<Inside, Refusal>> {
        let root = tokio::fs::canonicalize(&self.dir)
            .await
            .map_err(|source| Error::Io {
                path: self.dir.display().to_string(),
                source,
            })?;
        if requested.is_empty() {
            return Ok(Err("the path is empty".to_owned()));
        }
        let lexical = normalize(&root.join(requested));
        if lexical.starts_with(&root) {
            return Ok(Ok(Inside { lexical, root }));
        }
        let given_root = std::path::absolute(&self.dir)
            .map(|given| normalize(&given))
            .unwrap_or_else(|_| root.clone());
        let lexical_alt = normalize(&given_root.join(requested));
        match lexical_alt.strip_prefix(&given_root) {
            // Re-rooted on the canonical directory, so later checks compare like with like.
            Ok(rest) => Ok(Ok(Inside {
                lexical: root.join(rest),
                root,
            })),
            Err(_) => Ok(Err(self.escapes(requested))),
        }
    }

    /// Resolves `requested` to the canonical path of an existing entry inside the working
    /// directory, or says why not.
    pub(crate) async fn existing(
        &self,
        requested: &str,
    ) -> Result<std::result::Result<PathBuf, Refusal>> {
        let inside = match self.lexical(requested).await? {
            Ok(inside) => inside,
            Err(refusal) => return Ok(Err(refusal)),
        };
        // Symlinks are only visible after canonicalizing; this check is the one that decides.
        match tokio::fs::canonicalize(&inside.lexical).await {
            Ok(resolved) if resolved.starts_with(&inside.root) => Ok(Ok(resolved)),
            Ok(_) => Ok(Err(self.escapes(requested))),
            Err(e) => Ok(Err(io_message(requested, &e))),
        }
    }

    /// Resolves `requested` for writing: the canonical path of the file when it exists, or,
    /// when it does not, the path under its nearest existing ancestor, which must itself lie
    /// inside (so a symlinked directory cannot lead out). Returns the path and whether the
    /// file exists.
    pub(crate) async fn for_write(
        &self,
        requested: &str,
    ) -> Result<std::result::Result<(PathBuf, bool), Refusal>> {
        let inside = match self.lexical(requested).await? {
            Ok(inside) => inside,
            Err(refusal) => return Ok(Err(refusal)),
        };
        if inside.lexical == inside.root {
            return Ok(Err(format!(
                "{requested:?} is the working directory, not a file"
            )));
        }
        match tokio::fs::symlink_metadata(&inside.lexical).await {
            Ok(_) => {
                return match tokio::fs::canonicalize(&inside.lexical).await {
                    Ok(resolved) if resolved.starts_with(&inside.root) => Ok(Ok((resolved, true))),
                    Ok(_) => Ok(Err(self.escapes(requested))),
                    // A dangling symlink: where it points is not known to be inside.
                    Err(_) => Ok(Err(self.escapes(requested))),
                };
            }
            Err(e) if e.kind() == IoKind::NotFound => {}
            Err(e) => return Ok(Err(io_message(requested, &e))),
        }
        let mut ancestor = inside.lexical.parent();
        while let Some(dir) = ancestor {
            match tokio::fs::canonicalize(dir).await {
                Ok(resolved) if resolved.starts_with(&inside.root) => {
                    let rest = inside
                        .lexical
                        .strip_prefix(dir)
                        .unwrap_or(inside.lexical.as_path());
                    return Ok(Ok((resolved.join(rest), false)));
                }
                Ok(_) => return Ok(Err(self.escapes(requested))),
                Err(e) if e.kind() == IoKind::NotFound => ancestor = dir.parent(),
                Err(e) => return Ok(Err(io_message(requested, &e))),
            }
        }
        Ok(Err(self.escapes(requested)))
    }

    /// The version the session last saw of the file at `target` (a canonical path): the latest
    /// recorded version whose path resolves to it.
    pub(crate) async fn last_seen<'v>(
        &self,
        versions: &'v [FileVersion],
        target: &Path,
    ) -> Result<Option<&'v FileVersion>> {
        for version in versions.iter().rev() {
            if let Ok(resolved) = self.existing(&version.path).await? {
                if resolved == target {
                    return Ok(Some(version));
                }
            }
        }
        Ok(None)
    }
}

/// Removes `.` and resolves `..` without touching the filesystem.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// A filesystem failure as the model should read it.
pub(crate) fn io_message(requested: &str, error: &std::io::Error) -> Refusal {
    match error.kind() {
        IoKind::NotFound => format!("no such file: {requested:?}"),
        IoKind::PermissionDenied => format!("permission denied: {requested:?}"),
        _ => format!("cannot access {requested:?}: {error}"),
    }
}

/// Whether the file at `target`, whose content now hashes to `current_sha256`, is as the
/// session last saw it (read, written or edited, per `versions`); the refusal says what to do
/// when it is not.
pub(crate) async fn check_unchanged_since_seen(
    working_dir: &WorkDir,
    versions: &[FileVersion],
    target: &Path,
    requested: &str,
    current_sha256: &str,
) -> Result<std::result::Result<(), Refusal>> {
    let Some(seen) = working_dir.last_seen(versions, target).await? else {
        return Ok(Err(format!(
            "{requested:?} has not been read in this session; read it with read_file first, \
             so that changes made since are not overwritten"
        )));
    };
    if seen.sha256 == current_sha256 {
        Ok(Ok(()))
    } else {
        Ok(Err(format!(
            "{requested:?} changed since this session last read or wrote it; read it again \
             before changing it"
        )))
    }
}
