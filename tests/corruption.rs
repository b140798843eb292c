//! The corruption matrix: every file of a store with several sessions and a blob, damaged one
//! way at a time (a byte flipped at several offsets, truncated at several lengths, deleted), for
//! every embedded engine. Each case must hold the storage promises: no panic; read-only opens
//! and fsck change no byte; no acknowledged event is lost silently (every session reads whole,
//! or fsck or the open names it); a writable open either refuses and leaves the engine's files
//! as they were, or opens a store that lacks nothing it does not name.

use cairn_runtime::fsck::{fsck, ProblemKind};
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine, LOCK_FILE};
use cairn_runtime::{AppendRequest, Event, EventEnvelope, SessionStatus};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// Sessions and their event counts in the pristine store.
const SESSIONS: [(&str, u64); 4] = [("alpha", 12), ("beta", 12), ("gamma", 12), ("big", 6)];
/// The seq of `big` that carries a large payload (a blob or a large value in the engine).
const BIG_SEQ: u64 = 3;

fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, at: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        let Ok(entries) = fs::read_dir(at) else {
            return;
        };
        for entry in entries {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .expect("prefix")
                    .display()
                    .to_string();
                out.insert(rel, fs::read(&path).expect("read"));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).expect("mkdir");
    for entry in fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), target).expect("copy");
        }
    }
}

async fn write_pristine(dir: &Path, engine: StorageEngine) {
    let opened = embedded::open(dir, OpenMode::Create, Some(engine))
        .await
        .expect("create");
    // Interleaved, one event per append, so sessions share log messages and files.
    for round in 1..=12u64 {
        for (sid, n) in SESSIONS {
            if round > n {
                continue;
            }
            let mut text = format!("{sid}-{round}-");
            if sid == "big" && round == BIG_SEQ {
                text.push_str(&crate::support::incompressible_text(round, 300 * 1024));
            }
            let event = EventEnvelope::new(
                sid,
                round,
                1_000 + round,
                Event::UserMessage {
                    idempotency_key: None,
                    tool_choice: None,
                    turn: 1,
                    text,
                    model: None,
                    media: Vec::new(),
                },
            );
            opened
                .store
                .append(AppendRequest::new(
                    sid,
                    round,
                    vec![event],
                    SessionStatus::Idle,
                    1,
                ))
                .await
                .expect("append");
        }
    }
}

#[derive(Debug, Clone)]
enum Damage {
    Flip(u64),
    Truncate(u64),
    Delete,
}

fn damages(len: u64) -> Vec<Damage> {
    let mut offsets = vec![0, len / 4, len / 2, 3 * len / 4, len.saturating_sub(1)];
    offsets.dedup();
    let mut out: Vec<Damage> = if len == 0 {
        Vec::new()
    } else {
        offsets.into_iter().map(Damage::Flip).collect()
    };
    let mut cuts = vec![0, len / 2, len.saturating_sub(1)];
    cuts.dedup();
    out.extend(cuts.into_iter().filter(|c| *c < len).map(Damage::Truncate));
    out.push(Damage::Delete);
    out
}

fn apply(path: &Path, damage: &Damage) {
    match damage {
        Damage::Flip(at) => {
            let mut bytes = fs::read(path).expect("read");
            bytes[*at as usize] ^= 0x5a;
            fs::write(path, bytes).expect("write");
        }
        Damage::Truncate(len) => {
            let file = fs::OpenOptions::new().write(true).open(path).expect("open");
            file.set_len(*len).expect("truncate");
        }
        Damage::Delete => fs::remove_file(path).expect("delete"),
    }
}

/// What one look at a damaged store found.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Look {
    /// The open failed, with this error.
    refused: Option<String>,
    /// Sessions named by the open or by fsck.
    named: Vec<String>,
    /// Sessions that read whole.
    whole: Vec<String>,
    /// A read-only look changed the store's bytes.
    changed: bool,
}

/// Opens `dir` in `mode` and checks every session: reads it whole or finds it named.
async fn look(dir: &Path, mode: OpenMode) -> Look {
    let opened = match embedded::open(dir, mode, None).await {
        Ok(opened) => opened,
        Err(e) => {
            return Look {
                refused: Some(e.to_string()),
                ..Look::default()
            }
        }
    };
    let mut found = Look::default();
    for loss in &opened.losses {
        found
            .named
            .push(loss.session_id.clone().unwrap_or_else(|| "*".to_owned()));
    }
    match fsck(opened.store.as_ref()).await {
        // The synthetic histories do not fold (no session_started), so only problems of
        // damage count here: replay and status problems are the same before and after.
        Ok(report) => found.named.extend(
            report
                .problems
                .iter()
                .filter(|p| !matches!(p.kind, ProblemKind::Replay | ProblemKind::Status))
                .map(|p| p.session_id.clone()),
        ),
        Err(e) => {
            found.refused = Some(format!("fsck failed: {e}"));
            return found;
        }
    }
    for (sid, n) in SESSIONS {
        if let Ok(events) = opened.store.read_history(sid, 1, None).await {
            let whole = events.len() as u64 == n
                && events
                    .iter()
                    .enumerate()
                    .all(|(i, e)| e.seq == i as u64 + 1);
            if whole {
                found.whole.push(sid.to_owned());
            }
        }
    }
    found
}

/// Every session either reads whole or is named: nothing is lost silently.
fn silent_losses(found: &Look) -> Vec<&'static str> {
    if found.refused.is_some() || found.named.iter().any(|n| n == "*") {
        return Vec::new();
    }
    SESSIONS
        .iter()
        .map(|(sid, _)| *sid)
        .filter(|sid| {
            !found.whole.iter().any(|w| w == sid) && !found.named.iter().any(|n| n == sid)
        })
        .collect()
}

/// The engine's files, without the lock and the files cairn rewrites when a writable open
/// succeeds.
fn engine_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    tree(dir)
        .into_iter()
        .filter(|(name, _)| name != LOCK_FILE)
        .collect()
}

#[derive(Debug, Default)]
struct Tally {
    cases: usize,
    refused: usize,
    named: usize,
    harmless: usize,
    failures: Vec<String>,
}

/// The environment variable naming the store a child looks at.
const CHILD_CASE: &str = "CAIRN_CORRUPTION_CASE";

/// Looks at the damaged store in `dir` in a child process (the test binary running
/// [`one_case_in_a_child`]), so that an engine that aborts the process (an allocation of
/// gigabytes from a damaged length, say) fails the case instead of the whole matrix. Returns the
/// read-only look and the writable look.
fn look_in_child(dir: &Path) -> Result<(Look, Look), String> {
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "corruption::one_case_in_a_child",
            "--exact",
            "--nocapture",
            "--include-ignored",
        ])
        .env(CHILD_CASE, dir)
        .output()
        .map_err(|e| format!("cannot start the child: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let result = stdout
        .lines()
        .chain(stderr.lines())
        .find_map(|l| l.strip_prefix("CASE-RESULT "));
    match result {
        Some(json) if out.status.success() => {
            serde_json::from_str(json).map_err(|e| format!("bad child result {json}: {e}"))
        }
        _ => {
            let last: Vec<&str> = stderr
                .lines()
                .filter(|l| !l.trim().is_empty())
                .filter(|l| !l.starts_with("  ") && !l.contains("backtrace"))
                .collect();
            Err(format!(
                "the child crashed ({}): {}",
                out.status,
                last.iter()
                    .rev()
                    .take(3)
                    .rev()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(" | ")
            ))
        }
    }
}

/// The child's side of [`look_in_child`]: a read-only look, a check that it changed no byte,
/// then a writable look; prints both.
#[test]
#[ignore = "the corruption matrix runs it as a child process, once per damaged store"]
fn one_case_in_a_child() {
    let dir = PathBuf::from(std::env::var_os(CHILD_CASE).expect("run by the corruption matrix"));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let before = tree(&dir);
    let mut read = rt.block_on(look(&dir, OpenMode::ReadOnly));
    if tree(&dir) != before {
        read.refused = None;
        read.named.clear();
        read.whole.clear();
        read.changed = true;
    }
    let write = rt.block_on(look(&dir, OpenMode::Existing));
    println!(
        "CASE-RESULT {}",
        serde_json::to_string(&(read, write)).expect("json")
    );
}

fn run_matrix(engine: StorageEngine) -> Tally {
    let root = tempfile::tempdir().expect("tempdir");
    let pristine = root.path().join("pristine");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(write_pristine(&pristine, engine));
    let files: Vec<(String, u64)> = tree(&pristine)
        .into_iter()
        .map(|(name, bytes)| (name, bytes.len() as u64))
        .collect();
    assert!(
        files.len() >= 4,
        "the store should have several files: {files:?}"
    );
    let mut tally = Tally::default();
    let mut failures = Vec::new();
    for (name, len) in &files {
        for damage in damages(*len) {
            tally.cases += 1;
            let case = format!("{engine}: {name} {damage:?}");
            let dir: PathBuf = root.path().join(format!("case-{}", tally.cases));
            copy_dir(&pristine, &dir);
            apply(&dir.join(name), &damage);
            let before = tree(&dir);

            let (read, write) = match look_in_child(&dir) {
                Ok(looks) => looks,
                Err(what) => {
                    failures.push(format!("{case}: {what}"));
                    continue;
                }
            };
            if read.changed {
                failures.push(format!(
                    "{case}: a read-only open or fsck changed the store"
                ));
            }
            let silent = silent_losses(&read);
            if !silent.is_empty() {
                failures.push(format!(
                    "{case}: sessions {silent:?} lost events silently (read-only): {read:?}"
                ));
            }
            match &write.refused {
                Some(reason) => {
                    tally.refused += 1;
                    if reason.trim().is_empty() {
                        failures.push(format!("{case}: refused without saying why"));
                    }
                    let kept = engine_files(&dir);
                    let was: BTreeMap<String, Vec<u8>> = before
                        .iter()
                        .filter(|(n, _)| *n != LOCK_FILE)
                        .map(|(n, b)| (n.clone(), b.clone()))
                        .collect();
                    // A refused open may only have moved leftovers into set-aside/.
                    let changed: Vec<&String> = was
                        .iter()
                        .filter(|(n, b)| kept.get(*n) != Some(*b))
                        .map(|(n, _)| n)
                        .collect();
                    if !changed.is_empty() {
                        failures.push(format!(
                            "{case}: a refused writable open changed {changed:?}"
                        ));
                    }
                }
                None => {
                    let silent = silent_losses(&write);
                    if !silent.is_empty() {
                        failures.push(format!(
                            "{case}: sessions {silent:?} lost events silently (writable): {write:?}"
                        ));
                    }
                    if write.named.is_empty() && read.named.is_empty() {
                        tally.harmless += 1;
                    } else {
                        tally.named += 1;
                    }
                }
            }
        }
    }
    eprintln!("{engine}: {tally:?}");
    for f in &failures {
        eprintln!("FAILURE {f}");
    }
    tally.failures = failures;
    tally
}

#[test]
fn every_damage_to_every_file_is_contained_named_and_destroys_nothing() {
    for engine in StorageEngine::ALL {
        let tally = run_matrix(engine);
        assert!(
            tally.failures.is_empty(),
            "{engine}: {} of {} cases broke a promise:\n{}",
            tally.failures.len(),
            tally.cases,
            tally.failures.join("\n")
        );
        assert!(tally.cases >= 30, "{engine}: too few cases: {tally:?}");
        assert!(
            tally.refused + tally.named > 0,
            "{engine}: no damage was ever noticed, the matrix tests nothing: {tally:?}"
        );
    }
}
