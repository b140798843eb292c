//! Opening an embedded store directory safely: which storage engine it uses, one writer at a
//! time, leftovers of a killed process set aside, read-only opens that never change a byte, and
//! writable opens that cannot destroy acknowledged events.
//!
//! # Why this layer exists
//!
//! Embedded engines recover by rewriting their files: sled zeroes its log from the first damaged
//! message on and deletes newer blobs; fjall truncates a damaged journal. Both do it without an
//! error, on every open, read-only or not. And sled 0.34 takes a leftover `snap.<lsn>.generating`
//! file (a kill or power cut while it opened) for its newest snapshot and then refuses to open at
//! all (upstream spacejam/sled#1527). So cairn never lets an engine recover the only copy:
//!
//! * **Read-only opens** ([`OpenMode::ReadOnly`]: `sessions`, `history`, `transcript`, `replay`,
//!   `fsck`, `export`) copy the engine's files into a temporary directory and open the copy. The
//!   store's own files are never opened for writing; what a writable open would do is reported
//!   as notes, and acknowledged events the copy lacks are reported as [`Loss`]es, naming session
//!   and seqs, while the other sessions stay readable.
//! * **Writable opens** first set aside known leftovers (moved to `set-aside/<time>/`, never
//!   deleted), then copy the engine's files to `.cairn-open/`, then let the engine recover. If the
//!   recovered store lacks acknowledged events (per the [`marks`](super::marks)), or the engine
//!   cannot open it, the copy is put back, so the store is byte for byte what it was, and the open
//!   fails naming what was lost. Only [`OpenMode::Repair`] (`fsck --repair`) accepts a loss, and
//!   it keeps the copy of what it changed under `set-aside/`.
//!
//! The copy costs a read and a write of the engine's files per open (for a store of hundreds of
//! megabytes, a fraction of a second; `copy_file_range` reflinks on filesystems that can). It
//! buys the promise that opening never destroys anything.
//!
//! # Files cairn keeps beside the engine's
//!
//! | file            | what                                                              |
//! |-----------------|-------------------------------------------------------------------|
//! | `cairn-store`   | `cairn-store v1 engine=<name>`: the engine, fixed at creation     |
//! | `cairn.lock`    | `flock`ed: exclusive by the one writer, shared by readers         |
//! | `cairn-hwm`     | per-session high-water marks ([`marks`](super::marks))            |
//! | `cairn.sock`    | the API of the process holding the store, for other commands      |
//! | `set-aside/`    | files moved out of the engine's way, kept for inspection          |
//! | `.cairn-open/`  | the engine's files as they were before the open in progress       |
//!
//! A store made before the marker existed (a sled directory with `db` and `conf`) is a sled
//! store; a writable open adds the marker.

use super::fjall::FjallStore;
use super::marks::{sync_dir, Loss, MarkedStore, Marks, MARKS_FILE};
use super::sled::SledStore;
use super::{SessionInfo, Store};
use crate::error::{Error, Result, STORE_IN_USE};
use std::fs::{self, File};
use std::io::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The marker naming a store's engine.
pub const MARKER_FILE: &str = "cairn-store";
/// The lock file.
pub const LOCK_FILE: &str = "cairn.lock";
/// The socket on which the process holding the store serves its API.
pub const SOCKET_FILE: &str = "cairn.sock";
/// Where files moved out of the engine's way are kept.
pub const SET_ASIDE_DIR: &str = "set-aside";
/// The engine's files as they were before the open in progress.
const BACKUP_DIR: &str = ".cairn-open";
/// A backup being made (incomplete until renamed to [`BACKUP_DIR`]).
const BACKUP_TMP_DIR: &str = ".cairn-open.tmp";
/// A backup being deleted: renamed first, so that a kill while deleting never leaves a partial
/// backup under [`BACKUP_DIR`] to be put back.
const BACKUP_OLD_DIR: &str = ".cairn-open.old";
/// Present in [`BACKUP_DIR`] while the backup is being put back.
const RESTORING: &str = "RESTORING";
/// sled's configuration file, as sled 0.34 writes it for cairn's settings (without its CRC).
const SLED_CONF: &[u8] = b"segment_size: 524288\nuse_compression: false\nversion: 0.34\n";

/// The embedded storage engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageEngine {
    /// sled 0.34.
    Sled,
    /// fjall 3.
    Fjall,
}

impl StorageEngine {
    /// Every engine, the default first.
    pub const ALL: [StorageEngine; 2] = [StorageEngine::Fjall, StorageEngine::Sled];

    /// The default for new stores.
    pub const DEFAULT: StorageEngine = StorageEngine::Fjall;

    /// Its name in the marker and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            StorageEngine::Sled => "sled",
            StorageEngine::Fjall => "fjall",
        }
    }

    /// Parses a name.
    pub fn parse(name: &str) -> Option<StorageEngine> {
        StorageEngine::ALL.into_iter().find(|e| e.as_str() == name)
    }

    /// Whether `name` (a file or directory in the store) belongs to the engine: everything but
    /// cairn's own files.
    fn owns(self, name: &str) -> bool {
        ![
            MARKER_FILE,
            LOCK_FILE,
            SOCKET_FILE,
            MARKS_FILE,
            SET_ASIDE_DIR,
            BACKUP_DIR,
            BACKUP_TMP_DIR,
            BACKUP_OLD_DIR,
        ]
        .contains(&name)
            && !name.ends_with(".tmp")
    }

    /// Whether the engine may change the file at `path` in place (so a copy must be a real
    /// copy); files it never changes once written are hard-linked instead, which costs nothing.
    fn changes_in_place(self, path: &Path) -> bool {
        match self {
            // sled rewrites `db` in place and its other files are small.
            StorageEngine::Sled => true,
            // fjall writes a table once and never changes it; everything else it may rewrite
            // (journals are appended to and truncated, and a tree without its `current` file
            // is created anew over its old version files, in place).
            StorageEngine::Fjall => path
                .parent()
                .and_then(Path::file_name)
                .is_none_or(|n| n != "tables"),
        }
    }

    /// Leftovers of an interrupted run that would stop the engine from opening.
    fn leftovers(self, dir: &Path) -> Vec<String> {
        match self {
            StorageEngine::Sled => names_in(dir)
                .into_iter()
                .filter(|n| n.starts_with("snap.") && n.ends_with(".generating"))
                .collect(),
            // A creation killed before fjall wrote `version` leaves an empty journal that fjall
            // then refuses to create again ("File exists").
            StorageEngine::Fjall => match super::fjall::interrupted_creation(dir) {
                Ok(true) => vec!["0.jnl".to_owned()],
                _ => Vec::new(),
            },
        }
    }

    fn open_engine(self, dir: &Path) -> Result<Arc<dyn Store>> {
        let opened = catch_unwind(AssertUnwindSafe(|| match self {
            StorageEngine::Sled => SledStore::open(dir).map(|s| Arc::new(s) as Arc<dyn Store>),
            StorageEngine::Fjall => FjallStore::open(dir).map(|s| Arc::new(s) as Arc<dyn Store>),
        }));
        opened.unwrap_or_else(|_| {
            Err(open_error(
                dir,
                format!("the {} engine panicked while recovering", self.as_str()),
            ))
        })
    }
}

impl std::str::FromStr for StorageEngine {
    type Err = String;

    fn from_str(name: &str) -> std::result::Result<Self, String> {
        StorageEngine::parse(name).ok_or_else(|| {
            let known: Vec<&str> = StorageEngine::ALL.iter().map(|e| e.as_str()).collect();
            format!(
                "unknown storage engine {name:?} (known: {})",
                known.join(", ")
            )
        })
    }
}

impl Default for StorageEngine {
    fn default() -> Self {
        StorageEngine::DEFAULT
    }
}

impl std::fmt::Display for StorageEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How to open a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Open the store, creating it (and its directory) when there is none.
    Create,
    /// Open an existing store for writing.
    Existing,
    /// Open a copy: nothing in the store's directory changes.
    ReadOnly,
    /// Open for writing and accept acknowledged events the engine lost (after copying away
    /// what the open changes); `fsck --repair`.
    Repair,
}

impl OpenMode {
    fn writes(self) -> bool {
        self != OpenMode::ReadOnly
    }
}

/// An opened store, with what the open found and did.
pub struct OpenedStore {
    /// The store (for read-only opens, over a private copy).
    pub store: Arc<dyn Store>,
    /// Its engine.
    pub engine: StorageEngine,
    /// What the open did or, read-only, what a writable open would do; for people.
    pub notes: Vec<String>,
    /// Acknowledged events the store no longer has (read-only and repair opens; a writable
    /// open fails instead).
    pub losses: Vec<Loss>,
    /// The sessions as listed when opening.
    pub sessions: Vec<SessionInfo>,
    /// The lock, held for as long as the store is open.
    _lock: Option<File>,
    /// The copy a read-only open reads; removed when dropped.
    _snapshot: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for OpenedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedStore")
            .field("engine", &self.engine)
            .field("notes", &self.notes)
            .field("losses", &self.losses)
            .finish_non_exhaustive()
    }
}

/// Opens the embedded store in `dir`; see the module docs. `engine` is required to match the
/// store's (a clear error otherwise) and chooses the engine of a new store. A new store is made
/// only in a new or empty directory (or one a creation cut short left): a directory holding
/// other files is refused, naming them.
pub async fn open(
    dir: &Path,
    mode: OpenMode,
    engine: Option<StorageEngine>,
) -> Result<OpenedStore> {
    let found = detect(dir)?;
    let engine = match (found, engine) {
        (Some(found), Some(wanted)) if found != wanted => {
            return Err(open_error(
                dir,
                format!(
                    "this store uses the {found} engine (recorded in {MARKER_FILE}); it cannot be \
                     opened with --engine {wanted}"
                ),
            ))
        }
        (Some(found), _) => found,
        (None, wanted) if mode == OpenMode::Create => {
            refuse_foreign_files(dir)?;
            wanted.unwrap_or(StorageEngine::DEFAULT)
        }
        (None, _) => {
            // The demo and `cairn chaos` of earlier versions made their store in `DIR/store`.
            let inner = dir.join("store");
            let hint = match detect(&inner) {
                Ok(Some(_)) => format!(" ({} is one)", inner.display()),
                _ => String::new(),
            };
            return Err(open_error(
                dir,
                format!("no store here: the directory has no cairn store{hint}"),
            ));
        }
    };
    if mode.writes() {
        open_writable(dir, mode, engine).await
    } else {
        open_read_only(dir, engine).await
    }
}

/// Refuses to make a store in a directory that holds files no store creation leaves (a
/// creation killed midway leaves cairn's files and the engine's first ones, which are fine):
/// a store never mixes with other files, and a mistyped directory is not silently taken.
fn refuse_foreign_files(dir: &Path) -> Result<()> {
    let foreign: Vec<String> = names_in(dir)
        .into_iter()
        .filter(|name| !created_by_a_store(name))
        .map(|name| {
            if dir.join(&name).is_dir() {
                format!("{name}/")
            } else {
                name
            }
        })
        .collect();
    if foreign.is_empty() {
        return Ok(());
    }
    const SHOWN: usize = 5;
    let mut listed = foreign
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if foreign.len() > SHOWN {
        listed.push_str(&format!(" and {} more", foreign.len() - SHOWN));
    }
    Err(open_error(
        dir,
        format!(
            "the directory is not empty and holds no cairn store (it holds {listed}); a new \
             store is made only in a new or empty directory"
        ),
    ))
}

/// Whether `name` may be in a store directory whose creation was cut short: cairn's own files
/// and the first files of fjall (`*.jnl`, `lock`, `version`, `keyspaces`) and sled (`conf`,
/// `db`, `blobs`, `snap.*`).
fn created_by_a_store(name: &str) -> bool {
    let cairn = [
        MARKER_FILE,
        LOCK_FILE,
        SOCKET_FILE,
        MARKS_FILE,
        SET_ASIDE_DIR,
        BACKUP_DIR,
        BACKUP_TMP_DIR,
        BACKUP_OLD_DIR,
    ];
    let engines = ["lock", "version", "keyspaces", "conf", "db", "blobs"];
    cairn.contains(&name)
        || engines.contains(&name)
        || name.ends_with(".tmp")
        || name.ends_with(".jnl")
        || name.starts_with("snap.")
}

/// The engine of the store in `dir`: from its marker, or sled for a store older than the
/// marker; `None` when there is no store.
pub fn detect(dir: &Path) -> Result<Option<StorageEngine>> {
    match fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(open_error(dir, "no store here: not a directory".to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(open_error(dir, format!("cannot read it: {e}"))),
    }
    let marker = dir.join(MARKER_FILE);
    match fs::read(&marker) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let engine = text
                .trim_end()
                .strip_prefix("cairn-store v1 engine=")
                .and_then(StorageEngine::parse);
            match engine {
                Some(engine) => Ok(Some(engine)),
                None => Err(open_error(
                    dir,
                    format!(
                        "{} is damaged or from a newer cairn: {:?} (expected \
                         \"cairn-store v1 engine=<sled|fjall>\"; write that line back to open the store)",
                        marker.display(),
                        text.chars().take(80).collect::<String>()
                    ),
                )),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if dir.join("db").exists() || dir.join("conf").exists() {
                Ok(Some(StorageEngine::Sled))
            } else if dir.join("keyspaces").exists() {
                Ok(Some(StorageEngine::Fjall))
            } else {
                Ok(None)
            }
        }
        Err(e) => Err(open_error(
            dir,
            format!("cannot read {}: {e}", marker.display()),
        )),
    }
}

async fn open_writable(dir: &Path, mode: OpenMode, engine: StorageEngine) -> Result<OpenedStore> {
    let created = create_dirs(dir)?;
    let lock = lock(dir, true)?.expect("a writer always locks");
    let mut notes = Vec::new();
    finish_interrupted_open(dir, engine, &mut notes)?;

    // Leftovers that stop the engine from opening: moved aside, never deleted.
    let leftovers = engine.leftovers(dir);
    let mut set_aside = None;
    if !leftovers.is_empty() {
        let to = set_aside_dir(dir)?;
        for name in &leftovers {
            fs::rename(dir.join(name), to.join(name))
                .map_err(|e| open_error(dir, format!("cannot set aside {name}: {e}")))?;
            notes.push(format!(
                "set aside {name}, left by a process killed while creating or opening the \
                 store, in {}",
                to.display()
            ));
        }
        sync_dir(&to)
            .and_then(|()| sync_dir(dir))
            .map_err(io(dir))?;
        set_aside = Some(to);
    }

    let has_data = dir.join(MARKS_FILE).exists() || dir.join(MARKER_FILE).exists();
    if engine == StorageEngine::Sled {
        if let Some(problem) = sled_conf_problem(dir) {
            if mode == OpenMode::Repair || !has_data {
                // Interrupted creation (nothing acknowledged yet), or a repair: the file's
                // content is fixed for cairn's settings, so it can be written back exactly.
                let to = match &set_aside {
                    Some(to) => to.clone(),
                    None => set_aside_dir(dir)?,
                };
                fs::rename(dir.join("conf"), to.join("conf")).map_err(io(dir))?;
                write_sled_conf(dir).map_err(io(dir))?;
                notes.push(format!(
                    "sled's conf file was damaged ({problem}); set it aside in {} and wrote it \
                     back",
                    to.display()
                ));
            } else {
                return Err(open_error(
                    dir,
                    format!(
                        "sled's conf file is damaged: {problem}; nothing was changed. `cairn \
                         fsck --repair` writes it back (its content is fixed for cairn)"
                    ),
                ));
            }
        }
    }

    if engine == StorageEngine::Fjall {
        if let Some(problem) = fjall_version_problem(dir) {
            return Err(open_error(
                dir,
                format!(
                    "{problem}; nothing was changed. fjall would start that keyspace empty or \
                     abort on it, so cairn does not open the store. {}",
                    affected(
                        &Marks::read(dir).unwrap_or_default(),
                        "Restore the file from a backup"
                    )
                ),
            ));
        }
    }

    backup(dir, engine)?;
    let opened = engine.open_engine(dir);
    let opened = match opened {
        Ok(store) => match store.list_sessions().await {
            Ok(listed) => Ok((store, listed)),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    let marks = Marks::read(dir).map_err(io(dir))?;
    let (store, listed, losses) = match opened {
        Ok((store, listed)) => {
            let losses = marks.losses(&listed);
            (store, listed, losses)
        }
        Err(e) => {
            restore(dir, engine)?;
            return Err(open_error(
                dir,
                format!(
                    "{}; the store's files are as they were. {}",
                    reason_of(&e),
                    affected(&marks, "`cairn fsck` tells what is readable")
                ),
            ));
        }
    };
    if !losses.is_empty() {
        if mode != OpenMode::Repair {
            drop(store);
            restore(dir, engine)?;
            return Err(Error::EventsLost {
                path: dir.display().to_string(),
                lost: losses,
            });
        }
        let to = set_aside_dir(dir)?;
        fs::rename(dir.join(BACKUP_DIR), to.join("before-repair")).map_err(io(dir))?;
        notes.push(format!(
            "accepted the loss of {}; the files as they were are in {}",
            losses
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            to.join("before-repair").display()
        ));
    } else {
        remove_backup(dir)?;
    }

    if !dir.join(MARKER_FILE).exists() {
        write_marker(dir, engine).map_err(io(dir))?;
    }
    for new_dir in created {
        if let Some(parent) = new_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent).map_err(io(dir))?;
        }
    }
    let store: Arc<dyn Store> = Arc::new(MarkedStore::new(store, dir, &listed).map_err(io(dir))?);
    for note in &notes {
        tracing::info!(store = %dir.display(), "{note}");
    }
    Ok(OpenedStore {
        store,
        engine,
        notes,
        losses,
        sessions: listed,
        _lock: Some(lock),
        _snapshot: None,
    })
}

async fn open_read_only(dir: &Path, engine: StorageEngine) -> Result<OpenedStore> {
    let lock = lock(dir, false)?;
    let mut notes = Vec::new();
    let snapshot = tempfile::Builder::new()
        .prefix("cairn-read-")
        .tempdir()
        .map_err(|e| open_error(dir, format!("cannot make a temporary copy: {e}")))?;
    let copy = snapshot.path();
    // After an open that was killed midway, its backup is the store (a writable open puts it
    // back).
    let source = if dir.join(BACKUP_DIR).exists() {
        notes.push(format!(
            "an open was killed midway; reading the files as they were before it, from \
             {BACKUP_DIR}/ (a writable open puts them back)"
        ));
        dir.join(BACKUP_DIR)
    } else {
        dir.to_path_buf()
    };
    for name in names_in(&source) {
        if engine.owns(&name) {
            copy_tree(engine, &source.join(&name), &copy.join(&name)).map_err(io(dir))?;
        }
    }
    for name in engine.leftovers(copy) {
        fs::remove_file(copy.join(&name)).map_err(io(dir))?;
        notes.push(format!(
            "{name} was left by a process killed while creating or opening the store; a \
             writable open sets it aside"
        ));
    }
    if engine == StorageEngine::Sled {
        if let Some(problem) = sled_conf_problem(copy) {
            write_sled_conf(copy).map_err(io(dir))?;
            notes.push(format!(
                "sled's conf file is damaged ({problem}); read with a good one (`cairn fsck \
                 --repair` writes it back)"
            ));
        }
    }
    let marks = Marks::read(dir).map_err(io(dir))?;
    if !marks.skipped_lines.is_empty() {
        notes.push(format!(
            "{MARKS_FILE} has damaged lines {:?}, skipped (the check of those sessions is weaker)",
            marks.skipped_lines
        ));
    }
    if engine == StorageEngine::Fjall {
        if let Some(problem) = fjall_version_problem(copy) {
            return Err(open_error(
                dir,
                format!(
                    "{problem}. fjall would start that keyspace empty or abort on it, so no \
                     session is read. {}",
                    affected(&marks, "Restore the file from a backup")
                ),
            ));
        }
    }
    let store = engine.open_engine(copy).map_err(|e| {
        open_error(
            dir,
            format!(
                "{}. The {engine} engine cannot read its own files, so no session can be read. \
                 {}",
                reason_of(&e),
                affected(
                    &marks,
                    "`cairn fsck --repair` tries a writable recovery after copying the files \
                     away (it puts them back if the engine still fails); otherwise restore the \
                     store from a backup"
                )
            ),
        )
    })?;
    let listed = store.list_sessions().await?;
    let losses = marks.losses(&listed);
    Ok(OpenedStore {
        store,
        engine,
        notes,
        losses,
        sessions: listed,
        _lock: lock,
        _snapshot: Some(snapshot),
    })
}

/// Which sessions the marks say were stored, for an error where the engine cannot tell.
fn affected(marks: &Marks, next: &str) -> String {
    if marks.sessions.is_empty() {
        return format!("Sessions affected: unknown (no marks). {next}.");
    }
    let list: Vec<String> = marks
        .sessions
        .iter()
        .take(20)
        .map(|(s, n)| format!("{s} (seqs 1..={n})"))
        .collect();
    let more = marks.sessions.len().saturating_sub(list.len());
    format!(
        "Sessions affected: {}{}. {next}.",
        list.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    )
}

/// Creates `dir` and missing ancestors; returns the ones created, deepest first.
fn create_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let created: Vec<PathBuf> = dir
        .ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
        .map(Path::to_path_buf)
        .collect();
    fs::create_dir_all(dir).map_err(|e| open_error(dir, format!("cannot create it: {e}")))?;
    Ok(created)
}

/// Takes the store's lock: exclusive for a writer, shared for a reader. A reader of a store
/// that has no lock file yet (made before it existed) takes none rather than create one.
fn lock(dir: &Path, exclusive: bool) -> Result<Option<File>> {
    let path = dir.join(LOCK_FILE);
    let file = if exclusive {
        File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
    } else {
        match File::open(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            other => other,
        }
    }
    .map_err(|e| open_error(dir, format!("cannot open {}: {e}", path.display())))?;
    flock(&file, exclusive).map_err(|e| {
        if e.kind() == std::io::ErrorKind::WouldBlock {
            open_error(
                dir,
                format!(
                    "{STORE_IN_USE} ({})",
                    if exclusive {
                        "another process has it open"
                    } else {
                        "a writer has it open"
                    }
                ),
            )
        } else {
            open_error(dir, format!("cannot lock {}: {e}", path.display()))
        }
    })?;
    Ok(Some(file))
}

#[cfg(unix)]
fn flock(file: &File, exclusive: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    // SAFETY: flock on a descriptor this File owns; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(unix))]
fn flock(_file: &File, _exclusive: bool) -> std::io::Result<()> {
    Ok(())
}

/// Deals with what an open killed midway left: an incomplete backup is dropped (the engine's
/// files were not touched yet); a complete one is put back, since it is the store as it was
/// before that open, and nothing was acknowledged while it existed (an open removes it before
/// it hands out the store). Putting it back is the only safe choice: the killed open may have
/// been about to put it back itself, after its engine dropped acknowledged events.
fn finish_interrupted_open(
    dir: &Path,
    engine: StorageEngine,
    notes: &mut Vec<String>,
) -> Result<()> {
    for leftover in [BACKUP_TMP_DIR, BACKUP_OLD_DIR] {
        let path = dir.join(leftover);
        if path.exists() {
            fs::remove_dir_all(&path).map_err(io(dir))?;
        }
    }
    if dir.join(BACKUP_DIR).exists() {
        restore(dir, engine)?;
        notes.push(format!(
            "an open was killed midway; put back the store's files as they were before it \
             (from {BACKUP_DIR}/)"
        ));
    }
    Ok(())
}

/// Copies the engine's files to [`BACKUP_DIR`] (through [`BACKUP_TMP_DIR`], so that a complete
/// backup is recognisable).
fn backup(dir: &Path, engine: StorageEngine) -> Result<()> {
    let tmp = dir.join(BACKUP_TMP_DIR);
    fs::create_dir(&tmp).map_err(io(dir))?;
    for name in names_in(dir) {
        if engine.owns(&name) {
            copy_tree(engine, &dir.join(&name), &tmp.join(&name)).map_err(io(dir))?;
        }
    }
    // Durable before the rename makes it count: after a power cut, a backup that is put back
    // must be whole.
    sync_tree(&tmp).map_err(io(dir))?;
    fs::rename(&tmp, dir.join(BACKUP_DIR)).map_err(io(dir))?;
    sync_dir(dir).map_err(io(dir))
}

/// Puts the backup back in place of the engine's files, so the store is as it was before the
/// open; durable before it returns. Restartable: a kill midway is finished by the next open.
fn restore(dir: &Path, engine: StorageEngine) -> Result<()> {
    let backup = dir.join(BACKUP_DIR);
    if !backup.join(RESTORING).exists() {
        File::create(backup.join(RESTORING))
            .and_then(|f| f.sync_all())
            .and_then(|()| sync_dir(&backup))
            .map_err(io(dir))?;
    }
    let kept: Vec<String> = names_in(&backup)
        .into_iter()
        .filter(|n| n != RESTORING)
        .collect();
    for name in names_in(dir) {
        if engine.owns(&name) && !kept.contains(&name) {
            remove_tree(&dir.join(&name)).map_err(io(dir))?;
        }
    }
    for name in &kept {
        remove_tree(&dir.join(name)).map_err(io(dir))?;
        copy_tree(engine, &backup.join(name), &dir.join(name)).map_err(io(dir))?;
        sync_tree(&dir.join(name)).map_err(io(dir))?;
    }
    sync_dir(dir).map_err(io(dir))?;
    remove_backup(dir)
}

/// Deletes the backup: renamed out of the way first (one atomic step), then removed.
fn remove_backup(dir: &Path) -> Result<()> {
    let old = dir.join(BACKUP_OLD_DIR);
    fs::rename(dir.join(BACKUP_DIR), &old).map_err(io(dir))?;
    sync_dir(dir).map_err(io(dir))?;
    fs::remove_dir_all(&old).map_err(io(dir))
}

/// A new `set-aside/<time>-<pid>/` directory.
fn set_aside_dir(dir: &Path) -> Result<PathBuf> {
    #[allow(clippy::disallowed_methods)] // names a directory for people; nothing depends on it
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let to = dir
        .join(SET_ASIDE_DIR)
        .join(format!("{now}-{}", std::process::id()));
    fs::create_dir_all(&to).map_err(io(dir))?;
    sync_dir(&dir.join(SET_ASIDE_DIR))
        .and_then(|()| sync_dir(dir))
        .map_err(io(dir))?;
    Ok(to)
}

fn write_marker(dir: &Path, engine: StorageEngine) -> std::io::Result<()> {
    let tmp = dir.join(format!("{MARKER_FILE}.tmp"));
    let mut file = File::create(&tmp)?;
    writeln!(file, "cairn-store v1 engine={}", engine.as_str())?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, dir.join(MARKER_FILE))?;
    sync_dir(dir)
}

/// What is wrong with sled's `conf` file, if anything (sled itself rewrites an empty one
/// silently and reports a damaged one as "created with a sled version earlier than 0.29").
fn sled_conf_problem(dir: &Path) -> Option<String> {
    let bytes = match fs::read(dir.join("conf")) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return dir.join("db").exists().then(|| "it is missing".to_owned())
        }
        Err(e) => return Some(format!("it cannot be read: {e}")),
    };
    if bytes.len() <= 8 {
        return Some(format!("it holds {} bytes", bytes.len()));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(body) != stored {
        return Some("its checksum does not match".to_owned());
    }
    if body != SLED_CONF {
        return Some(format!(
            "it holds settings cairn does not use: {:?}",
            String::from_utf8_lossy(body)
        ));
    }
    None
}

/// What is wrong with a fjall keyspace's version files, if anything. Each keyspace directory
/// has a `current` file naming its version file (`v<id>`) with an xxh3-128 checksum of it,
/// which fjall 3.1 does not check: a damaged version file can make it allocate gigabytes from a
/// damaged count and abort the process, and a missing `current` makes it create the keyspace
/// anew, empty, writing over the old version files.
fn fjall_version_problem(dir: &Path) -> Option<String> {
    let keyspaces = dir.join("keyspaces");
    for name in names_in(&keyspaces) {
        let ks = keyspaces.join(&name);
        let has_versions = names_in(&ks)
            .iter()
            .any(|n| n.starts_with('v') && n[1..].parse::<u64>().is_ok());
        let current = ks.join("current");
        let bytes = match fs::read(&current) {
            Ok(bytes) => bytes,
            Err(_) if !has_versions => continue,
            Err(e) => return Some(format!("fjall's {} cannot be read: {e}", current.display())),
        };
        if bytes.len() != 25 || bytes[24] != 0 {
            return Some(format!(
                "fjall's {} is damaged ({} bytes, expected 25)",
                current.display(),
                bytes.len()
            ));
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[..8]);
        let mut sum = [0u8; 16];
        sum.copy_from_slice(&bytes[8..24]);
        let version = ks.join(format!("v{}", u64::from_le_bytes(id)));
        match fs::read(&version) {
            Ok(data) if xxhash_rust::xxh3::xxh3_128(&data) == u128::from_le_bytes(sum) => {}
            Ok(_) => {
                return Some(format!(
                    "fjall's version file {} is damaged (its checksum does not match)",
                    version.display()
                ))
            }
            Err(e) => {
                return Some(format!(
                    "fjall's version file {} cannot be read: {e}",
                    version.display()
                ))
            }
        }
    }
    None
}

fn write_sled_conf(dir: &Path) -> std::io::Result<()> {
    let mut bytes = SLED_CONF.to_vec();
    bytes.extend_from_slice(&crc32fast::hash(SLED_CONF).to_le_bytes());
    let mut file = File::create(dir.join("conf"))?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    sync_dir(dir)
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Copies a file or directory tree: files the engine changes in place are copied (holes
/// stay holes: fjall preallocates its journals), the others hard-linked.
fn copy_tree(engine: StorageEngine, from: &Path, to: &Path) -> std::io::Result<()> {
    if fs::symlink_metadata(from)?.is_dir() {
        fs::create_dir_all(to)?;
        for entry in fs::read_dir(from)? {
            let entry = entry?;
            copy_tree(engine, &entry.path(), &to.join(entry.file_name()))?;
        }
        Ok(())
    } else if engine.changes_in_place(from) || fs::hard_link(from, to).is_err() {
        copy_sparse(from, to)
    } else {
        Ok(())
    }
}

/// Copies a file's data regions only, leaving its holes as holes.
///
/// Each region is copied by the kernel (`copy_file_range`): no buffer of ours to fill and
/// copy through, and a reflink on a filesystem that can. Reading and writing through a buffer
/// is the fallback where the kernel refuses (another filesystem, an old kernel). A buffer
/// zero-filled per file was most of an open's instructions: a writable open copies every
/// file fjall may change, a dozen small ones at least (callgrind).
#[cfg(target_os = "linux")]
fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let src = File::open(from)?;
    let len = src.metadata()?.len();
    let dst = File::create(to)?;
    dst.set_len(len)?;
    let fd = src.as_raw_fd();
    let mut at: i64 = 0;
    while (at as u64) < len {
        // SAFETY: lseek on a descriptor this File owns; no memory is passed.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            // SEEK_DATA unsupported here: copy everything.
            drop(dst);
            return fs::copy(from, to).map(drop);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { len as i64 } else { hole };
        copy_region(&src, &dst, data as u64, end as u64)?;
        at = end;
    }
    Ok(())
}

/// Copies the bytes `start..end` of `src` to the same offsets of `dst`.
#[cfg(target_os = "linux")]
fn copy_region(src: &File, dst: &File, start: u64, end: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut off_in = start as i64;
    let mut off_out = start as i64;
    while (off_in as u64) < end {
        let want = ((end - off_in as u64) as usize).min(1 << 30);
        // SAFETY: both descriptors are owned by live Files, and the offsets are locals this
        // call updates; no other memory is passed.
        let copied = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        match copied {
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the file shrank while it was copied",
                ))
            }
            n if n > 0 => {}
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue; // a signal; nothing was copied
                }
                return match e.raw_os_error() {
                    Some(
                        libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP | libc::EPERM,
                    ) => copy_region_buffered(src, dst, off_in as u64, end),
                    _ => Err(e),
                };
            }
        }
    }
    Ok(())
}

/// [`copy_region`] through a buffer of ours, where the kernel will not copy.
#[cfg(target_os = "linux")]
fn copy_region_buffered(src: &File, dst: &File, start: u64, end: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let mut buf = vec![0u8; ((end - start) as usize).min(1 << 20)];
    let mut at = start;
    while at < end {
        let n = ((end - at) as usize).min(buf.len());
        src.read_exact_at(&mut buf[..n], at)?;
        dst.write_all_at(&buf[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    fs::copy(from, to).map(drop)
}

fn sync_tree(path: &Path) -> std::io::Result<()> {
    if fs::symlink_metadata(path)?.is_dir() {
        for entry in fs::read_dir(path)? {
            sync_tree(&entry?.path())?;
        }
        sync_dir(path)
    } else {
        File::open(path)?.sync_all()
    }
}

fn remove_tree(path: &Path) -> std::io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Why an open failed, without the "cannot open store at PATH" its message begins with when it
/// is itself an open error (of this store, or of the private copy a read-only open reads), for
/// an error that says it once.
fn reason_of(e: &Error) -> String {
    match e {
        Error::StoreOpen { reason, .. } => reason.clone(),
        e => e.to_string(),
    }
}

fn open_error(dir: &Path, reason: String) -> Error {
    Error::StoreOpen {
        path: dir.display().to_string(),
        reason,
    }
}

fn io(dir: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| open_error(dir, e.to_string())
}

#[cfg(test)]
#[path = "embedded_tests.rs"]
mod tests;
