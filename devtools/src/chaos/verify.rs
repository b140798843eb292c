//! The checks of a chaos run: of the store and the side-effect file after the run, and of a copy
//! of the store after each fault.

use super::child::ledger_fingerprint;
use super::{
    record, session_id, Acks, ChaosConfig, ChaosReport, Explanations, SideEffectRecord,
    StoreEngine, SIDE_EFFECTS_FILE, STORE_DIR,
};
use anyhow::Context;
use cairn_ledger::{validate_transcript, Part, Role};
use cairn_runtime::store::embedded::{self, OpenMode, OpenedStore};
use cairn_runtime::{replay, ErrorClass, Event, SessionState, SessionStatus};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

// ---- Verification ------------------------------------------------------------------------------

/// Opens the store in `dir` through [`embedded`], as a child would: creating it when `create`
/// (nothing acknowledged yet), else requiring it. Blocks on `runtime`.
fn open_store(
    runtime: &tokio::runtime::Runtime,
    engine: StoreEngine,
    dir: &Path,
    create: bool,
) -> anyhow::Result<OpenedStore> {
    let mode = if create {
        OpenMode::Create
    } else {
        OpenMode::Existing
    };
    runtime
        .block_on(embedded::open(dir, mode, Some(engine)))
        .with_context(|| format!("cannot open the {engine} store in {}", dir.display()))
}

/// What verification gathers besides the report's figures.
#[derive(Default)]
pub(super) struct Ledgers {
    /// Every tool_use of every ledger by idempotency key (`SESSION/TOOL_USE_ID`), with the pid
    /// in its one recorded result (the process whose run was recorded).
    pub(super) recorded: BTreeMap<String, Option<u32>>,
}

/// Checks the store and the side-effect file against the acks and the kills; fills in
/// the report's figures and problems. `Err` only when the store cannot be read at all.
pub(super) fn verify(
    config: &ChaosConfig,
    acks: &Acks,
    explanations: &Explanations,
    report: &mut ChaosReport,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a runtime for verification")?;
    let opened = runtime
        .block_on(embedded::open(
            &config.data.join(STORE_DIR),
            OpenMode::ReadOnly,
            Some(config.store),
        ))
        .context("the store does not open after the run")?;
    for loss in &opened.losses {
        report
            .problems
            .push(format!("acknowledged events lost: {loss}"));
    }
    let store = opened.store.clone();
    report.problems.extend(acks.conflicts.iter().cloned());
    report.acked_states = acks.len();
    let mut ledgers = Ledgers::default();
    runtime.block_on(async {
        let listed: BTreeMap<String, SessionStatus> = store
            .list_sessions()
            .await?
            .into_iter()
            .map(|i| (i.session_id, i.status))
            .collect();
        for i in 0..config.sessions {
            let id = session_id(i);
            match listed.get(&id) {
                None => {
                    report.problems.push(format!("{id} does not exist"));
                    continue;
                }
                Some(SessionStatus::Idle) => {}
                Some(other) => report
                    .problems
                    .push(format!("{id} is {}, not idle", other.as_str())),
            }
            let history = store.read_history(&id, 1, None).await?;
            check_session(&id, &history, acks.states.get(&id), report, &mut ledgers);
        }
        if listed.len() != config.sessions {
            report.problems.push(format!(
                "the store lists {} sessions, expected {}",
                listed.len(),
                config.sessions
            ));
        }
        let tasks = store.list_tasks().await?;
        if let Some(task) = tasks.first() {
            report.problems.push(format!(
                "{} task(s) are still queued after every turn completed, e.g. {}",
                tasks.len(),
                task.id
            ));
        }
        anyhow::Ok(())
    })?;
    report.tool_uses = ledgers.recorded.len();
    check_side_effects(
        &config.data.join(SIDE_EFFECTS_FILE),
        &ledgers,
        explanations,
        report,
    )
}

/// One session: status of its turns, replay, ledger validation, acknowledged states, one
/// recorded result per tool_use.
pub(super) fn check_session(
    id: &str,
    history: &[cairn_runtime::EventEnvelope],
    acked: Option<&BTreeMap<u64, u64>>,
    report: &mut ChaosReport,
    ledgers: &mut Ledgers,
) {
    report.events += history.len();
    let problems = &mut report.problems;
    if !check_acked(id, history, acked, problems) {
        return;
    }

    let replayed = match replay(id, history) {
        Ok(r) => r,
        Err(e) => {
            problems.push(format!("{id}: replay fails: {e}"));
            return;
        }
    };
    let transcript = &replayed.state.transcript;
    if let Err(e) = validate_transcript(transcript) {
        problems.push(format!("{id}: the ledger does not validate: {e}"));
    }
    if replayed.state.active.is_some() {
        problems.push(format!("{id}: a turn is still running"));
    }
    let mut completed = 0;
    let mut results: BTreeMap<&str, Vec<&cairn_ledger::ToolResultContent>> = BTreeMap::new();
    for e in history {
        match &e.event {
            Event::TurnCompleted { .. } => completed += 1,
            Event::TurnFailed { turn, reason, .. } => {
                problems.push(format!("{id}: turn {turn} failed: {reason}"))
            }
            Event::ModelCallFailed { failure, .. } | Event::ToolCallFailed { failure, .. } => {
                report.failed_attempts += 1;
                // A kill fails an attempt only as a lapsed lease (a remote worker's, or one
                // held while the server was down): any other failure is not the kills'.
                if failure.class != ErrorClass::Timeout {
                    problems.push(format!(
                        "{id}: seq {} ({}) failed with class {}: {}; only kills, as lapsed \
                         leases, should fail attempts",
                        e.seq,
                        e.event.kind(),
                        failure.class.as_str(),
                        failure.message
                    ));
                }
            }
            Event::ToolCallCompleted {
                tool_use_id,
                content,
                ..
            } => results.entry(tool_use_id).or_default().push(content),
            _ => {}
        }
    }
    report.turns_completed += completed;
    let turns = report.turns_per_session;
    if completed != turns || replayed.state.turns_started as usize != turns {
        problems.push(format!(
            "{id}: {completed} turns completed of {} started, expected {turns}",
            replayed.state.turns_started
        ));
    }
    let mut in_ledger = BTreeSet::new();
    for message in &transcript.messages {
        if message.role != Role::Assistant {
            continue;
        }
        for part in &message.parts {
            if let Part::ToolUse(tool_use) = part {
                in_ledger.insert(tool_use.id.as_str());
            }
        }
    }
    for tool_use_id in &in_ledger {
        let key = format!("{id}/{tool_use_id}");
        let pid = match results.get(tool_use_id).map(Vec::as_slice) {
            Some([content]) => {
                let result = ToolResultJson::parse(content);
                match result {
                    Some(r) if r.key == key => Some(r.pid),
                    _ => {
                        problems.push(format!(
                            "{id}: the result of {tool_use_id} does not carry its key {key}: {}",
                            content.canonical_json()
                        ));
                        None
                    }
                }
            }
            Some(many) => {
                problems.push(format!(
                    "{id}: tool_use {tool_use_id} has {} recorded results",
                    many.len()
                ));
                None
            }
            None => {
                problems.push(format!(
                    "{id}: tool_use {tool_use_id} has no recorded result"
                ));
                None
            }
        };
        ledgers.recorded.insert(key, pid);
    }
    for tool_use_id in results.keys() {
        if !in_ledger.contains(tool_use_id) {
            problems.push(format!(
                "{id}: a result is recorded for {tool_use_id}, which is no tool_use of the ledger"
            ));
        }
    }
}

/// Every acknowledged state of session `id`: its events are in `history` and fold to the
/// acknowledged ledger. Returns false when the history does not fold at all.
fn check_acked(
    id: &str,
    history: &[cairn_runtime::EventEnvelope],
    acked: Option<&BTreeMap<u64, u64>>,
    problems: &mut Vec<String>,
) -> bool {
    let mut state = SessionState::new(id);
    let empty = BTreeMap::new();
    let acked = acked.unwrap_or(&empty);
    for envelope in history {
        if let Err(e) = state.apply(envelope) {
            problems.push(format!("{id}: folding seq {} fails: {e}", envelope.seq));
            return false;
        }
        if let Some(hash) = acked.get(&envelope.seq) {
            let found = ledger_fingerprint(&state.transcript);
            if found != *hash {
                problems.push(format!(
                    "{id}: acknowledged state at seq {} had ledger {hash:016x}, the history \
                     folds to {found:016x} there",
                    envelope.seq
                ));
            }
        }
    }
    if let Some((&seq, _)) = acked.range(history.len() as u64 + 1..).next() {
        problems.push(format!(
            "{id}: acknowledged event seq {seq} is missing; the history ends at seq {}",
            history.len()
        ));
    }
    true
}

/// After a kill or a power cut: a copy of the store as the fault left it must open, hold every
/// state acknowledged so far and check clean with fsck (every history decodes, is complete and
/// replays; the queue matches the sessions). A copy, so that the next child still recovers the
/// store exactly as the fault left it. Problems are prefixed with `fault`; a failed check keeps
/// nothing else: the run stops, leaving the store as the fault left it.
pub(super) fn check_after_fault(
    config: &ChaosConfig,
    acks: &Acks,
    fault: &str,
    report: &mut ChaosReport,
) -> anyhow::Result<()> {
    report.fault_checks += 1;
    let store_dir = config.data.join(STORE_DIR);
    let copy = config.data.join("fault-check");
    if copy.exists() {
        std::fs::remove_dir_all(&copy)
            .with_context(|| format!("cannot remove {}", copy.display()))?;
    }
    if store_dir.exists() {
        copy_tree(&store_dir, &copy)?;
    }
    let mut problems = Vec::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start a runtime for the check")?;
    // Cut before anything was acknowledged, perhaps while the store was being created: the
    // next child creates what is missing, and must be able to.
    let opened = open_store(&runtime, config.store, &copy, acks.len() == 0);
    match opened {
        Err(e) => {
            let diagnosis = diagnose_unopenable(config, &copy, acks);
            problems.push(format!("the store does not open: {e:#}{diagnosis}"));
        }
        Ok(opened) => {
            report.fault_checked_acks += acks.len();
            let store = opened.store.clone();
            runtime.block_on(async {
                for (id, acked) in &acks.states {
                    match store.read_history(id, 1, None).await {
                        Ok(history) => {
                            check_acked(id, &history, Some(acked), &mut problems);
                        }
                        Err(e) => problems.push(format!("{id}: the history does not read: {e}")),
                    }
                }
                match cairn_runtime::fsck::fsck(&*store).await {
                    Ok(fsck) if fsck.is_clean() => {}
                    Ok(fsck) => problems.push(format!("fsck is not clean:\n{fsck}")),
                    Err(e) => problems.push(format!("fsck cannot read the store: {e}")),
                }
            });
        }
    }
    std::fs::remove_dir_all(&copy).ok();
    // The run stops at a failed check, so the store stays exactly as the fault left it.
    let kept_note = format!("{} is left as the fault left it", store_dir.display());
    for p in problems {
        report.problems.push(format!(
            "after {fault} (seed {}): {p}; {kept_note}",
            config.seed
        ));
    }
    Ok(())
}

/// sled's leftover of a snapshot it was writing when the process died.
const SLED_GENERATING_SUFFIX: &str = ".generating";

/// Why a store copy does not open, when a known defect explains it: sled 0.34 takes a
/// `snap.*.generating` file (a snapshot it was writing when the process died, before its
/// rename) for its newest snapshot, finds it incomplete and refuses to open. Retries without
/// those files and says whether the store then opens and holds every acknowledged state.
fn diagnose_unopenable(config: &ChaosConfig, copy: &Path, acks: &Acks) -> String {
    let Ok(entries) = std::fs::read_dir(copy) else {
        return String::new();
    };
    let leftovers: Vec<(String, u64)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let is_leftover = name.starts_with("snap.") && name.ends_with(SLED_GENERATING_SUFFIX);
            is_leftover.then(|| (name, e.metadata().map_or(0, |m| m.len())))
        })
        .collect();
    if leftovers.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = leftovers
        .iter()
        .map(|(name, len)| format!("{name} ({len} bytes)"))
        .collect();
    for (name, _) in &leftovers {
        let _ = std::fs::remove_file(copy.join(name));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let Ok(runtime) = runtime else {
        return String::new();
    };
    let without = match open_store(&runtime, config.store, copy, false) {
        Err(e) => format!("still does not open ({e:#})"),
        Ok(opened) => {
            let store = opened.store.clone();
            let mut missing = Vec::new();
            {
                runtime.block_on(async {
                    for (id, acked) in &acks.states {
                        match store.read_history(id, 1, None).await {
                            Ok(history) => {
                                check_acked(id, &history, Some(acked), &mut missing);
                            }
                            Err(e) => missing.push(format!("{id}: {e}")),
                        }
                    }
                });
            }
            if missing.is_empty() {
                format!("opens and holds all {} acknowledged states", acks.len())
            } else {
                format!("opens but: {}", missing.join("; "))
            }
        }
    };
    format!(
        " [known sled 0.34 defect: the interrupted snapshot {} is read as the newest snapshot; \
         without it the store {without}]",
        shown.join(", ")
    )
}

/// Copies a directory tree (regular files and directories; sled makes no others).
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("cannot create {}", to.display()))?;
    for entry in
        std::fs::read_dir(from).with_context(|| format!("cannot list {}", from.display()))?
    {
        let entry = entry.with_context(|| format!("cannot list {}", from.display()))?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("cannot copy {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// The side-effect tool's result.
#[derive(Deserialize)]
struct ToolResultJson {
    key: String,
    pid: u32,
}

impl ToolResultJson {
    fn parse(content: &cairn_ledger::ToolResultContent) -> Option<Self> {
        match content {
            cairn_ledger::ToolResultContent::Json(json) => serde_json::from_str(json.as_str()).ok(),
            cairn_ledger::ToolResultContent::Text(_)
            | cairn_ledger::ToolResultContent::Blocks(_) => None,
        }
    }
}

/// The side-effect file against the ledgers: every run names a tool_use by its key; every
/// tool_use ran; the recorded result is its last run's; every earlier run was cut short by a
/// kill of the process that made it, or (remote mode) lost its report to a kill of the server
/// between the run and the next run of its key.
pub(super) fn check_side_effects(
    path: &Path,
    ledgers: &Ledgers,
    explanations: &Explanations,
    report: &mut ChaosReport,
) -> anyhow::Result<()> {
    let killed_pids = &explanations.killed_pids;
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let shown = path.display();
    let parsed = record::parse(&bytes);
    for damage in parsed.damage {
        report.problems.push(format!("{shown}: {damage}"));
    }
    // A record torn by a kill: a run that never finished writing it, and whose call therefore
    // ran again. Only a killed process can leave one.
    report.torn_side_effects = parsed.torn.len();
    for torn in &parsed.torn {
        if let Some(pid) = torn.pid.filter(|pid| !killed_pids.contains(pid)) {
            report.problems.push(format!(
                "{shown} offset {}: a torn record by process {pid}, which was not killed",
                torn.offset
            ));
        }
    }
    let mut runs: BTreeMap<String, Vec<SideEffectRecord>> = BTreeMap::new();
    for (n, record) in parsed.records.into_iter().enumerate() {
        report.tool_runs += 1;
        let names_its_call = record
            .key
            .split_once('/')
            .is_some_and(|(_, tool_use_id)| tool_use_id == record.tool_use_id);
        if !names_its_call || !ledgers.recorded.contains_key(&record.key) {
            report.problems.push(format!(
                "{shown} record {}: key {:?} (tool_use {}) names no tool_use of the ledgers",
                n + 1,
                record.key,
                record.tool_use_id
            ));
        }
        runs.entry(record.key.clone()).or_default().push(record);
    }
    for key in ledgers.recorded.keys() {
        if !runs.contains_key(key) {
            report.problems.push(format!(
                "tool_use {key} has a recorded result but never ran"
            ));
        }
    }
    let mut repeats_by_kill: BTreeMap<Kill, usize> = BTreeMap::new();
    for (key, records) in &runs {
        report.max_runs_per_key = report.max_runs_per_key.max(records.len());
        let Some((last, earlier)) = records.split_last() else {
            continue;
        };
        if let Some(Some(recorded_pid)) = ledgers.recorded.get(key) {
            if last.pid != *recorded_pid {
                report.problems.push(format!(
                    "the recorded result of {key} came from process {recorded_pid}, but its last \
                     run was in process {}",
                    last.pid
                ));
            }
        }
        if earlier.is_empty() {
            continue;
        }
        report.repeated_keys += 1;
        report.repeated_tool_runs += earlier.len();
        let pids: BTreeSet<u32> = records.iter().map(|r| r.pid).collect();
        report.same_process_repeats += records.len() - pids.len();
        for (run, next) in earlier.iter().zip(&records[1..]) {
            let kill = if killed_pids.contains(&run.pid) {
                Kill::Process(run.pid)
            } else if let Some(at_ms) = explanations.server_kill_between(run, next) {
                report.server_kill_repeats += 1;
                Kill::Server(at_ms)
            } else {
                report.problems.push(format!(
                    "{key} ran again after a run in process {}, which was not killed{}",
                    run.pid,
                    if explanations.server_kills_ms.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ", and the server was not killed between that run (at {} ms, \
                             lease {} ms) and the next (at {} ms)",
                            run.at_ms, explanations.lease_ms, next.at_ms
                        )
                    }
                ));
                continue;
            };
            *repeats_by_kill.entry(kill).or_default() += 1;
        }
    }
    report.max_repeats_per_kill = repeats_by_kill.values().copied().max().unwrap_or(0);
    Ok(())
}

/// The kill a repeated run is put down to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kill {
    /// Of the process that made the earlier run.
    Process(u32),
    /// Of the server, at this moment (ms since the epoch).
    Server(u64),
}

impl Explanations {
    /// The first server kill that can have lost `run`'s report, if any: one after its lease
    /// was taken (at most a lease before its record) and before `next` ran. A report is lost
    /// only when the server is down until the lease lapses; the lapse is recorded, and only
    /// then is the next attempt scheduled, so that kill comes before `next`.
    fn server_kill_between(&self, run: &SideEffectRecord, next: &SideEffectRecord) -> Option<u64> {
        let leased_after = run.at_ms.saturating_sub(self.lease_ms);
        self.server_kills_ms
            .iter()
            .copied()
            .filter(|k| (leased_after..=next.at_ms).contains(k))
            .min()
    }
}
