//! Power cuts and kills during startup: no fault, at any moment, may leave a store cairn cannot
//! open or lose an acknowledged event.
//!
//! - The shim itself (`cairn_devtools::powercut`, C, built with `cc`; the test fails if it cannot be
//!   built) is checked on a child process writing two files: unsynced bytes and names are lost
//!   at the cut, synced ones are kept.
//! - `power_cuts_lose_no_acknowledged_event`: the chaos child (`cairn_devtools::chaos`) runs under the
//!   shim, which cuts the power of the store directory at a seeded operation, dropping every
//!   write and name change not yet fsynced (all of them, or a random half; new names vanish or
//!   stay). After each cut a copy of the store must open, hold every state the children
//!   acknowledged (on stdout, to this process, which survives the cut: the acknowledgement is
//!   outside the cut's reach, as a client on another machine would be), and fsck clean.
//! - `kills_while_opening_lose_nothing`: children are SIGKILLed 0–100 ms after they start, while
//!   sled opens and recovers the store and the engine resumes, with the same check after each.
//!
//! - `a_store_opens_after_a_kill_while_sled_wrote_its_snapshot`: the defect these found (sled
//!   0.34 refuses to open a store holding an interrupted `snap.*.generating`), reproduced
//!   deterministically: cairn's store opening sets the leftover aside and says so.
//!
//! Seeds are printed; rerun with `CAIRN_POWERCUT_TEST_SEED=<seed>` (the kill moments and cut
//! points are seeded; which operations a child has made by then depends on timing);
//! `CAIRN_POWERCUT_CUTS` and `CAIRN_STARTUP_KILLS` change the counts (30 and 50). `cairn chaos
//! --power-cuts N --startup-kills N` runs the same outside the test suite. A failed run keeps
//! its data directory and prints where.
#![cfg(target_os = "linux")]

use cairn_devtools::chaos::{run_chaos, ChaosConfig, ChaosReport};
use cairn_devtools::powercut::{build_shim, Cut, FileFate, NameFate, CUT_EXIT_STATUS};
use cairn_runtime::store::embedded::StorageEngine;
use std::path::Path;
use std::process::Command;

const SEED_ENV: &str = "CAIRN_POWERCUT_TEST_SEED";
const CUTS_ENV: &str = "CAIRN_POWERCUT_CUTS";
const STARTUP_KILLS_ENV: &str = "CAIRN_STARTUP_KILLS";

fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

const SHIM_CHILD_DIR_ENV: &str = "CAIRN_SHIM_CHILD_DIR";
/// Set (to `durable` or `lost`) to make [`shim_child`] run [`rmdir_child`] instead.
const SHIM_CHILD_RMDIR_ENV: &str = "CAIRN_SHIM_CHILD_RMDIR";
/// Set (to `synced` or `unsynced`) to make [`shim_child`] run [`copy_child`] instead.
const SHIM_CHILD_COPY_ENV: &str = "CAIRN_SHIM_CHILD_COPY";

/// A synced file `s` ("SOURCE") is copied into a new, empty file `c`, whose name and size are
/// synced, with `copy_file_range` (as a store copies its files); with `synced`, `c` is then
/// fsynced. The last operation writes `z`, where the tests cut.
fn copy_child(target: &Path, synced: bool) {
    use std::os::fd::AsRawFd;
    let sync = |p: &Path| std::fs::File::open(p).unwrap().sync_all().unwrap();
    std::fs::write(target.join("s"), b"SOURCE").unwrap();
    sync(&target.join("s"));
    let c = std::fs::File::create(target.join("c")).unwrap();
    c.sync_all().unwrap();
    sync(target);
    let s = std::fs::File::open(target.join("s")).unwrap();
    let (mut off_in, mut off_out) = (0i64, 0i64);
    // SAFETY: both descriptors belong to live Files; the offsets are locals.
    let copied = unsafe {
        libc::copy_file_range(
            s.as_raw_fd(),
            &mut off_in,
            c.as_raw_fd(),
            &mut off_out,
            6,
            0,
        )
    };
    assert_eq!(copied, 6, "{}", std::io::Error::last_os_error());
    if synced {
        c.sync_all().unwrap();
    }
    std::fs::write(target.join("z"), b"last").unwrap();
}

/// The result of `run` at the highest cut point that still cuts the child (`run` answers
/// whether it cut, and what the test reads afterwards), found by bisection between 1 and 256.
fn at_last_cut<T>(run: impl Fn(u64) -> (bool, T)) -> T {
    let (mut cuts, mut runs_through) = (1u64, 256u64);
    assert!(
        run(cuts).0 && !run(runs_through).0,
        "the cut points bracket the child"
    );
    while runs_through - cuts > 1 {
        let mid = (cuts + runs_through) / 2;
        if run(mid).0 {
            cuts = mid;
        } else {
            runs_through = mid;
        }
    }
    run(cuts).1
}

/// Runs [`shim_child`] with `env` under the shim, cutting before operation `after_ops` (every
/// unsynced write reverted, unsynced names vanishing); returns whether it cut, its stderr and
/// the directory (the child's files are under `target/`).
fn cut_at(after_ops: u64, env: &[(&str, &str)]) -> (bool, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cut = Cut {
        after_ops,
        files: FileFate::Revert,
        names: NameFate::Vanish,
        seed: 1,
    };
    let (code, stderr) = cut_child_with(dir.path(), cut, env);
    assert!(code == Some(CUT_EXIT_STATUS) || code == Some(0), "{stderr}");
    (code == Some(CUT_EXIT_STATUS), stderr, dir)
}

/// Runs [`copy_child`] under the shim, cutting before its last operation ([`at_last_cut`]);
/// returns what `c` holds then, and the child's stderr.
fn copy_cut(synced: bool) -> (Option<String>, String) {
    let fate = if synced { "synced" } else { "unsynced" };
    at_last_cut(|after_ops| {
        let (cut, stderr, dir) = cut_at(after_ops, &[(SHIM_CHILD_COPY_ENV, fate)]);
        let c = std::fs::read_to_string(dir.path().join("target/c")).ok();
        (cut, (c, stderr))
    })
}

/// Bytes `copy_file_range` wrote are unsynced writes like any other: lost at a cut unless the
/// file was fsynced since (a store's backup and read-only copies are made with it).
#[test]
fn the_shim_loses_what_a_copy_wrote_unless_it_was_synced() {
    let (c, stderr) = copy_cut(false);
    assert_eq!(c.as_deref(), Some(""), "{stderr}");
    assert!(
        stderr.contains("reverted 1 unsynced write(s), 6 byte(s)"),
        "{stderr}"
    );
    let (c, stderr) = copy_cut(true);
    assert_eq!(c.as_deref(), Some("SOURCE"), "{stderr}");
}

/// A directory holding a synced file `x` ("OLD") is emptied and removed. With `durable`, the
/// removal is fsynced and a new `d` with a synced `x` ("NEW") takes its place (spacer
/// directories first, so the new `d` rarely gets the old inode number back); without, nothing
/// is synced after the removal. The last operation writes `z`, where the tests cut.
fn rmdir_child(target: &Path, durable: bool) {
    use std::io::Write;
    let sync = |p: &Path| std::fs::File::open(p).unwrap().sync_all().unwrap();
    let d = target.join("d");
    std::fs::create_dir(&d).unwrap();
    sync(target);
    let mut x = std::fs::File::create(d.join("x")).unwrap();
    x.write_all(b"OLD").unwrap();
    x.sync_all().unwrap();
    sync(&d);
    std::fs::remove_file(d.join("x")).unwrap();
    std::fs::remove_dir(&d).unwrap();
    if durable {
        sync(target);
        for i in 0..8 {
            std::fs::create_dir(target.join(format!("spacer-{i}"))).unwrap();
        }
        std::fs::create_dir(&d).unwrap();
        sync(target);
        let mut x = std::fs::File::create(d.join("x")).unwrap();
        x.write_all(b"NEW").unwrap();
        x.sync_all().unwrap();
        sync(&d);
    }
    std::fs::write(target.join("z"), b"last").unwrap();
}

/// Runs [`rmdir_child`] under the shim, cutting before its last operation ([`at_last_cut`]);
/// returns what `d/x` holds then.
fn rmdir_cut(durable: bool) -> Option<String> {
    let fate = if durable { "durable" } else { "lost" };
    at_last_cut(|after_ops| {
        let (cut, _, dir) = cut_at(after_ops, &[(SHIM_CHILD_RMDIR_ENV, fate)]);
        (
            cut,
            std::fs::read_to_string(dir.path().join("target/d/x")).ok(),
        )
    })
}

/// A removed directory's pending name changes go with its removal: a durable rmdir makes them
/// durable (a cut must not bring back the old file over a new, synced one: this is what made a
/// fjall store look as if its meta keyspace had lost its versions), and a lost rmdir brings the
/// directory and its file back.
#[test]
fn the_shim_models_a_removed_directory() {
    assert_eq!(rmdir_cut(true).as_deref(), Some("NEW"));
    assert_eq!(rmdir_cut(false).as_deref(), Some("OLD"));
}

/// Runs [`shim_child`] (this test binary again) under the shim, cutting the power of
/// `dir/target` as `cut` says; returns its exit code and stderr. One process: the shim's undo
/// logs are per process, as a process's view of what it synced is.
fn cut_child(dir: &Path, cut: Cut) -> (Option<i32>, String) {
    cut_child_with(dir, cut, &[])
}

/// [`cut_child`] with more environment for the child (e.g. [`SHIM_CHILD_RMDIR_ENV`]).
fn cut_child_with(dir: &Path, cut: Cut, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let shim = build_shim(&dir.join("shim")).expect("the power-cut shim must build (needs cc)");
    let output = Command::new(std::env::current_exe().expect("current_exe"))
        .args([
            "--exact",
            "powercut::shim_child",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SHIM_CHILD_DIR_ENV, dir)
        .envs(env.iter().copied())
        .envs(shim.env(&dir.join("target"), &cut))
        .output()
        .expect("the shim child");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The writer the shim is tested on. Its operations on `target/` (syncing `dir` itself is
/// outside, so not counted, but makes the name `target` durable): 1 mkdir target, 2 create f,
/// 3 write "one", 4 fsync f, 5 fsync target, 6 write "two" (f opened to append, without
/// O_CREAT: not an operation), 7 create g, 8 write "new".
#[test]
#[ignore = "run by the_shim_loses_exactly_what_was_not_synced in a child process"]
fn shim_child() {
    use std::io::Write;
    let Some(dir) = std::env::var_os(SHIM_CHILD_DIR_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let target = dir.join("target");
    std::fs::create_dir(&target).unwrap();
    std::fs::File::open(dir).unwrap().sync_all().unwrap();
    if let Some(durable) = std::env::var_os(SHIM_CHILD_RMDIR_ENV) {
        rmdir_child(&target, durable == "durable");
        return;
    }
    if let Some(synced) = std::env::var_os(SHIM_CHILD_COPY_ENV) {
        copy_child(&target, synced == "synced");
        return;
    }
    let mut f = std::fs::File::create(target.join("f")).unwrap();
    f.write_all(b"one").unwrap();
    f.sync_all().unwrap();
    std::fs::File::open(&target).unwrap().sync_all().unwrap();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(target.join("f"))
        .unwrap();
    f.write_all(b"two").unwrap();
    std::fs::File::create(target.join("g"))
        .unwrap()
        .write_all(b"new")
        .unwrap();
}

#[test]
fn the_shim_loses_exactly_what_was_not_synced() {
    let read = |dir: &Path, name: &str| std::fs::read_to_string(dir.join("target").join(name)).ok();
    let cut = |after_ops, files, names| Cut {
        after_ops,
        files,
        names,
        seed: 1,
    };

    // Never cut: everything is there.
    let dir = tempfile::tempdir().unwrap();
    let (code, stderr) = cut_child(dir.path(), cut(0, FileFate::Revert, NameFate::Vanish));
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(read(dir.path(), "f").as_deref(), Some("onetwo"));
    assert_eq!(read(dir.path(), "g").as_deref(), Some("new"));

    // Cut before the last write: "two" and g's contents are lost, g's name too (its directory
    // was not synced since it was created) or not.
    for (names, g) in [(NameFate::Vanish, None), (NameFate::Keep, Some(""))] {
        let dir = tempfile::tempdir().unwrap();
        let (code, stderr) = cut_child(dir.path(), cut(8, FileFate::Revert, names));
        assert_eq!(code, Some(CUT_EXIT_STATUS), "{stderr}");
        assert!(
            stderr.contains(
                "cut before operation 8 (write): reverted 1 unsynced write(s), 3 byte(s)"
            ),
            "{stderr}"
        );
        assert_eq!(read(dir.path(), "f").as_deref(), Some("one"), "{names:?}");
        assert_eq!(read(dir.path(), "g").as_deref(), g, "{names:?}");
    }

    // Cut before the file's fsync: its bytes are lost; before the directory's, its name too
    // (but not the directory, whose name was synced).
    let dir = tempfile::tempdir().unwrap();
    let (code, stderr) = cut_child(dir.path(), cut(4, FileFate::Revert, NameFate::Keep));
    assert_eq!(code, Some(CUT_EXIT_STATUS), "{stderr}");
    assert_eq!(read(dir.path(), "f").as_deref(), Some(""));
    let dir = tempfile::tempdir().unwrap();
    let (code, stderr) = cut_child(dir.path(), cut(5, FileFate::Revert, NameFate::Vanish));
    assert_eq!(code, Some(CUT_EXIT_STATUS), "{stderr}");
    assert_eq!(read(dir.path(), "f"), None, "{stderr}");
    assert!(dir.path().join("target").is_dir(), "{stderr}");
}

fn run(
    name: &str,
    config: ChaosConfig,
    root: tempfile::TempDir,
    check: impl Fn(&ChaosReport) -> Result<(), String>,
) {
    let seed = config.seed;
    let checked = run_chaos(&config, Path::new(env!("CARGO_BIN_EXE_cairn")))
        .map_err(|e| format!("{e:#}"))
        .and_then(|report| {
            eprintln!("{report}");
            if report.passed() {
                check(&report)
            } else {
                Err(format!("verification failed:\n{report}"))
            }
        });
    if let Err(what) = checked {
        let kept = root.keep();
        panic!(
            "{name}, seed {seed} (data kept in {}): {what}",
            kept.display()
        );
    }
}

#[test]
fn power_cuts_lose_no_acknowledged_event() {
    power_cuts(StorageEngine::Sled);
}

/// This test once failed on fjall (every session lost after a cut, loudly): the cause was this
/// shim, not fjall. It passed rmdir through, so the unlinks inside a removed directory stayed
/// keyed to the dead directory and were replayed at a cut into the new one, bringing back an
/// old, fully replaced `keyspaces/0/current`. `the_shim_models_a_removed_directory` pins it.
#[test]
fn power_cuts_lose_no_acknowledged_event_on_fjall() {
    power_cuts(StorageEngine::Fjall);
}

fn power_cuts(engine: StorageEngine) {
    let seed = env_number(SEED_ENV).unwrap_or_else(rand::random::<u64>);
    // fjall preallocates 64 MiB journals, and the shim saves what every write replaces, so a
    // fjall child under the shim starts about ten times slower: fewer cuts keep CI short.
    let default_cuts = match engine {
        StorageEngine::Sled => 30,
        StorageEngine::Fjall => 8,
    };
    let cuts = env_number(CUTS_ENV).unwrap_or(default_cuts);
    eprintln!("power cuts on {engine}: seed {seed} (rerun with {SEED_ENV}={seed})");
    let root = tempfile::Builder::new()
        .prefix("cairn-powercut-test-")
        .tempdir()
        .expect("tempdir");
    let config = ChaosConfig {
        sessions: 8,
        turns_per_session: 20,
        kills: 0,
        power_cuts: cuts,
        check_each_fault: true,
        store: engine,
        ..ChaosConfig::new(root.path().join("data"), seed)
    };
    run("power cuts", config, root, |report| {
        if report.power_cuts != cuts || report.fault_checks != cuts {
            return Err(format!(
                "{} cuts and {} checks, expected {cuts}",
                report.power_cuts, report.fault_checks
            ));
        }
        // The cuts must have had something to lose, and the children something to promise.
        if report.cut_reverted_writes == 0 || report.fault_checked_acks == 0 {
            return Err(format!("the cuts lost no write or nothing was acknowledged: the test tested nothing\n{report}"));
        }
        Ok(())
    });
}

#[test]
fn kills_while_opening_lose_nothing() {
    kills_while_opening(StorageEngine::Sled);
}

#[test]
fn kills_while_opening_lose_nothing_on_fjall() {
    kills_while_opening(StorageEngine::Fjall);
}

fn kills_while_opening(engine: StorageEngine) {
    let seed = env_number(SEED_ENV).unwrap_or_else(rand::random::<u64>);
    let kills = env_number(STARTUP_KILLS_ENV).unwrap_or(50);
    eprintln!("startup kills on {engine}: seed {seed} (rerun with {SEED_ENV}={seed})");
    let root = tempfile::Builder::new()
        .prefix("cairn-startup-kill-test-")
        .tempdir()
        .expect("tempdir");
    let config = ChaosConfig {
        sessions: 8,
        turns_per_session: 20,
        // A few ordinary kills first: the store has histories, interrupted turns and leases
        // for the startups to recover and resume.
        kills: 3,
        kill_after_ms: (300, 500),
        startup_kills: kills,
        // A debug build (sled optimized) on the 2-core machine is ready about 35 ms after the
        // start (store opened, recovered and resumed); the window stays inside that mostly.
        startup_kill_ms: (0, 45),
        check_each_fault: true,
        store: engine,
        ..ChaosConfig::new(root.path().join("data"), seed)
    };
    run("startup kills", config, root, |report| {
        if report.startup_kills != kills {
            return Err(format!(
                "{} startup kills, expected {kills}",
                report.startup_kills
            ));
        }
        if report.fault_checked_acks == 0 {
            return Err(format!(
                "nothing was acknowledged: the test tested nothing\n{report}"
            ));
        }
        // The kills must land in the start, not after it: most before the store is open or
        // resume is done.
        if report.startup_kills_before_ready * 2 < kills {
            return Err(format!(
                "most startup kills came after the child was ready\n{report}"
            ));
        }
        Ok(())
    });
}

/// The defect the cuts and kills found, on its own: sled 0.34 takes a `snap.*.generating` file
/// (the snapshot it writes while opening, synced and renamed only when complete) for its newest
/// snapshot. A process that dies between creating it and renaming it (a kill or a power cut
/// that keeps the name) leaves it incomplete, and the store no longer opens ("Read corrupted
/// data"), though without the file it opens with every event.
#[test]
fn a_store_opens_after_a_kill_while_sled_wrote_its_snapshot() {
    use cairn_runtime::store::embedded::{self, OpenMode};
    use cairn_runtime::store::sled::SledStore;
    use cairn_runtime::{AppendRequest, Event, EventEnvelope, SessionStatus, Store};
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let event = EventEnvelope::new(
        "s",
        1,
        0,
        Event::UserMessage {
            idempotency_key: None,
            tool_choice: None,
            turn: 1,
            text: "acknowledged".to_owned(),
            model: None,
            media: Vec::new(),
        },
    );
    {
        let store = SledStore::open(dir.path()).unwrap();
        runtime
            .block_on(store.append(AppendRequest::new(
                "s",
                1,
                vec![event.clone()],
                SessionStatus::Idle,
                0,
            )))
            .unwrap();
    }
    // Reopening writes a snapshot (snap.<lsn>): the interrupted one is a prefix of the next.
    drop(SledStore::open_existing(dir.path()).unwrap());
    let snapshot = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("snap.")
        })
        .expect("sled wrote a snapshot");
    let bytes = std::fs::read(&snapshot).unwrap();
    std::fs::write(
        dir.path().join("snap.7FFFFFFFFFFFFFFF.generating"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();

    // sled alone refuses (the upstream defect), which is why cairn opens through `embedded`.
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir.path()).unwrap().flatten() {
        if entry.path().is_file() {
            std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
        }
    }
    std::fs::create_dir(copy.path().join("blobs")).unwrap();
    assert!(
        SledStore::open_existing(copy.path()).is_err(),
        "sled 0.34 is expected to refuse this store on its own"
    );

    let opened = runtime
        .block_on(embedded::open(dir.path(), OpenMode::Existing, None))
        .expect("the store must open after a kill while sled wrote a snapshot");
    assert!(
        opened
            .notes
            .iter()
            .any(|n| n.contains("set aside snap.7FFFFFFFFFFFFFFF.generating")),
        "{:?}",
        opened.notes
    );
    let history = runtime
        .block_on(opened.store.read_history("s", 1, None))
        .unwrap();
    assert_eq!(history, [event]);
}
