//! Power cuts: the `LD_PRELOAD` shim of `cairn::powercut` (C, built with `cc`; the test fails
//! if it cannot be built) is checked on a child process writing two files: at the cut, unsynced
//! bytes and names are lost, synced ones are kept.
#![cfg(target_os = "linux")]

use cairn::powercut::{build_shim, Cut, FileFate, NameFate, CUT_EXIT_STATUS};
use std::path::Path;
use std::process::Command;

const SHIM_CHILD_DIR_ENV: &str = "CAIRN_SHIM_CHILD_DIR";

/// Runs [`shim_child`] (this test binary again) under the shim, cutting the power of
/// `dir/target` as `cut` says; returns its exit code and stderr. One process: the shim's undo
/// logs are per process, as a process's view of what it synced is.
fn cut_child(dir: &Path, cut: Cut) -> (Option<i32>, String) {
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
