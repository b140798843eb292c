//! Power cuts: an `LD_PRELOAD` shim that makes a child process lose, at a chosen moment, every
//! write the kernel had not made durable, as a power cut would.
//!
//! SIGKILL loses only what is in the process; the kernel's page cache survives it, so a kill
//! cannot tell a store that fsyncs correctly from one that never fsyncs. The shim
//! ([`SHIM_SOURCE`], C, compiled with `cc` by [`build_shim`]) keeps an undo log of every write
//! to the files under one directory since each file's last `fsync`/`fdatasync`, and of every
//! name change (create, rename, unlink, mkdir) since its directory's last fsync. Before the
//! [`Cut::after_ops`]-th operation on the directory it rolls them back and exits with status
//! [`CUT_EXIT_STATUS`] at once, leaving the files as a power cut at that moment could have.
//! `sync_file_range` clears nothing: it neither persists a file's size nor flushes the device's
//! cache. The source's header comment is the reference for what is intercepted and how.
//!
//! Two independent choices per cut model the range of file systems:
//!
//! - [`FileFate`]: every unsynced write is reverted (the state as of each file's last sync), or
//!   a seeded random half of them is (writeback got some pages out; a reverted write that had
//!   extended the file leaves zeros, as ext4 `data=writeback` can).
//! - [`NameFate`]: files and directories created since their directory's last fsync vanish and
//!   renames and unlinks come back, or every name change is kept (a journal committed them).
//!
//! The undo logs live in the process, so a sync by another process is not seen: cut one
//! process that owns the directory (a store's writer does). Only Linux with glibc: the shim
//! intercepts glibc's symbols and uses Linux system calls.

use anyhow::{bail, Context};
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The shim's C source.
pub const SHIM_SOURCE: &str = include_str!("powercut/unsynced.c");
/// The exit status of a process the shim cut.
pub const CUT_EXIT_STATUS: i32 = 86;
/// The start of the line the shim writes to stderr when it cuts.
pub const CUT_LINE_PREFIX: &str = "cairn-powercut: cut before operation ";

/// What happens to the unsynced writes of files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFate {
    /// Every unsynced write is undone: each file is as of its last sync.
    Revert,
    /// A seeded random half of the unsynced writes is undone (appended bytes become zeros).
    Torn,
}

/// What happens to name changes (creations, renames, unlinks) whose directory was not fsynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameFate {
    /// They are undone: new names vanish, renames and unlinks come back.
    Vanish,
    /// They are kept.
    Keep,
}

/// One planned power cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// The cut comes before this (1-based) intercepted operation on the directory: a write,
    /// truncation, sync, `sync_file_range` or name change.
    pub after_ops: u64,
    /// The unsynced file data.
    pub files: FileFate,
    /// The unsynced names.
    pub names: NameFate,
    /// Seeds the choice of writes [`FileFate::Torn`] keeps.
    pub seed: u64,
}

/// A compiled shim and where it works.
#[derive(Debug, Clone)]
pub struct Shim {
    /// The shared library (`LD_PRELOAD`).
    pub library: PathBuf,
    /// Where removed and replaced files are kept (hard links) until their removal is durable,
    /// so that a cut can bring them back. Must be on the target's file system.
    pub stash: PathBuf,
}

/// Compiles the shim into `dir` (created if missing) with `cc -shared -fPIC`. Fails, never
/// skips, when there is no C compiler: a power-cut test that cannot cut must not pass.
pub fn build_shim(dir: &Path) -> anyhow::Result<Shim> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let source = dir.join("unsynced.c");
    let library = dir.join("libcairn_unsynced.so");
    std::fs::write(&source, SHIM_SOURCE)
        .with_context(|| format!("cannot write {}", source.display()))?;
    let output = Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()))
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
        .arg(&library)
        .arg(&source)
        .args(["-ldl", "-lpthread"])
        .output()
        .context("cannot run the C compiler `cc` (set CC) to build the power-cut shim")?;
    if !output.status.success() {
        bail!(
            "the power-cut shim does not compile ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stash = dir.join("stash");
    std::fs::create_dir_all(&stash)
        .with_context(|| format!("cannot create {}", stash.display()))?;
    Ok(Shim { library, stash })
}

impl Shim {
    /// The environment that makes a child cut the power of `target` (an absolute directory,
    /// written without `..` or symlinks, as the child will name it) as `cut` says.
    pub fn env(&self, target: &Path, cut: &Cut) -> Vec<(&'static str, OsString)> {
        vec![
            ("LD_PRELOAD", self.library.clone().into_os_string()),
            ("CAIRN_POWERCUT_DIR", target.as_os_str().to_owned()),
            ("CAIRN_POWERCUT_STASH", self.stash.clone().into_os_string()),
            ("CAIRN_POWERCUT_AFTER", cut.after_ops.to_string().into()),
            (
                "CAIRN_POWERCUT_FILES",
                match cut.files {
                    FileFate::Revert => "revert",
                    FileFate::Torn => "torn",
                }
                .into(),
            ),
            (
                "CAIRN_POWERCUT_NAMES",
                match cut.names {
                    NameFate::Vanish => "vanish",
                    NameFate::Keep => "keep",
                }
                .into(),
            ),
            ("CAIRN_POWERCUT_SEED", cut.seed.to_string().into()),
        ]
    }
}

/// What a cut undid, from the shim's stderr line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutFigures {
    /// The operation the cut came before.
    pub before_op: u64,
    /// Unsynced writes undone.
    pub reverted_writes: u64,
    /// Their bytes.
    pub reverted_bytes: u64,
    /// Unsynced writes kept ([`FileFate::Torn`]).
    pub kept_writes: u64,
    /// Name changes undone ([`NameFate::Vanish`]).
    pub undone_names: u64,
}

impl CutFigures {
    /// Finds the shim's line in a child's stderr.
    pub fn parse(stderr: &str) -> Option<CutFigures> {
        let line = stderr
            .lines()
            .find_map(|l| l.strip_prefix(CUT_LINE_PREFIX))?;
        // "N (op): reverted W unsynced write(s), B byte(s), in F file(s); kept K; undid U name..."
        let numbers: Vec<u64> = line
            .split(|c: char| !c.is_ascii_digit())
            .filter(|w| !w.is_empty())
            .filter_map(|w| w.parse().ok())
            .collect();
        // The op name can hold digits (pwrite64): take the numbers after the parenthesis.
        let after_op = line.split_once(')').map(|(_, rest)| rest)?;
        let rest: Vec<u64> = after_op
            .split(|c: char| !c.is_ascii_digit())
            .filter(|w| !w.is_empty())
            .filter_map(|w| w.parse().ok())
            .collect();
        match (numbers.first(), rest.as_slice()) {
            (Some(&before_op), [writes, bytes, _files, kept, undone, ..]) => Some(CutFigures {
                before_op,
                reverted_writes: *writes,
                reverted_bytes: *bytes,
                kept_writes: *kept,
                undone_names: *undone,
            }),
            _ => None,
        }
    }
}

impl fmt::Display for CutFigures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cut before operation {}: {} unsynced write(s) ({} bytes) undone, {} kept, {} name change(s) undone",
            self.before_op,
            self.reverted_writes,
            self.reverted_bytes,
            self.kept_writes,
            self.undone_names
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cut_line_parses() {
        let stderr = "warn: x\ncairn-powercut: cut before operation 41 (pwrite64): reverted 3 \
                      unsynced write(s), 1207 byte(s), in 2 file(s); kept 1; undid 4 name \
                      change(s); files=torn names=vanish\n";
        assert_eq!(
            CutFigures::parse(stderr),
            Some(CutFigures {
                before_op: 41,
                reverted_writes: 3,
                reverted_bytes: 1207,
                kept_writes: 1,
                undone_names: 4,
            })
        );
        assert_eq!(CutFigures::parse("cairn-powercut: fatal: x"), None);
    }
}
