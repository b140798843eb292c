//! Tests of opening embedded stores: leftovers set aside, read-only opens that change nothing,
//! losses named by session and seq, writable opens that put the files back, repair.

use super::*;
use crate::store::conformance::{append_request, incompressible_text, message};
use std::collections::BTreeMap;

/// Every file under `dir` (relative path → bytes), excluding the lock file.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, at: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for entry in fs::read_dir(at).expect("read_dir") {
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

/// Appends one event at a time to each session (each its own log messages) of a new sled
/// store, with a marker `MARK-<session>-<seq>-` in every event, and `big` bytes more in
/// `big_at`'s event ([`marked_text`]).
async fn write_marked(dir: &Path, names: &[&str], events: u64, big_at: Option<(&str, u64, usize)>) {
    write_marked_on(dir, StorageEngine::Sled, names, events, big_at).await
}

async fn write_marked_on(
    dir: &Path,
    engine: StorageEngine,
    names: &[&str],
    events: u64,
    big_at: Option<(&str, u64, usize)>,
) {
    let opened = open(dir, OpenMode::Create, Some(engine))
        .await
        .expect("create");
    for s in names {
        for seq in 1..=events {
            let text = marked_text(s, seq, big_at);
            opened
                .store
                .append(append_request(s, seq, vec![message(s, seq, &text)], 1))
                .await
                .expect("append");
        }
    }
}

/// How many events of `session` read back.
async fn count(opened: &OpenedStore, session: &str) -> usize {
    opened
        .store
        .read_history(session, 1, None)
        .await
        .expect("the session reads")
        .len()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The text of `s`'s event `seq` in [`write_marked`]: its marker, and for `big_at`'s event
/// `len` more letters that compression does not shrink much, so that the record stays large.
fn marked_text(s: &str, seq: u64, big_at: Option<(&str, u64, usize)>) -> String {
    let mut text = format!("MARK-{s}-{seq}-");
    if let Some((bs, bseq, len)) = big_at {
        if (bs, bseq) == (s, seq) {
            text.push_str(&incompressible_text(seq, len));
        }
    }
    text
}

/// The stored record of `s`'s event `seq` in [`write_marked`] (records are compressed, so the
/// marker text is not in the files as it is; the record is, as the codec writes it).
fn marked_record(s: &str, seq: u64, big_at: Option<(&str, u64, usize)>) -> Vec<u8> {
    crate::codec::encode(&message(s, seq, &marked_text(s, seq, big_at))).expect("encode")
}

/// Flips a byte in the middle of the first copy of `record` in the file at `path`.
fn flip(path: &Path, record: &[u8]) {
    let mut bytes = fs::read(path).expect("read");
    let at = find(&bytes, record).expect("the record is in the file");
    bytes[at + record.len() / 2] ^= 0x01;
    fs::write(path, &bytes).expect("write");
}

#[tokio::test]
async fn a_new_store_records_its_engine_and_a_damaged_marker_is_a_clear_error() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("a/b/s");
    write_marked(&dir, &["x"], 2, None).await;
    assert_eq!(
        fs::read_to_string(dir.join(MARKER_FILE)).expect("marker"),
        "cairn-store v1 engine=sled\n"
    );
    assert_eq!(detect(&dir).expect("detect"), Some(StorageEngine::Sled));
    let nothing = root.path().join("empty");
    fs::create_dir(&nothing).expect("mkdir");
    match open(&nothing, OpenMode::ReadOnly, None).await {
        Err(Error::StoreOpen { reason, .. }) => {
            assert!(reason.contains("no store here"), "{reason}")
        }
        other => panic!("expected no store, got {other:?}"),
    }
    assert!(
        fs::read_dir(&nothing).expect("ls").next().is_none(),
        "a read-only open created files"
    );
    fs::write(dir.join(MARKER_FILE), "cairn-store v9 engine=rocks\n").expect("write");
    match open(&dir, OpenMode::Existing, None).await {
        Err(Error::StoreOpen { reason, .. }) => {
            assert!(
                reason.contains("cairn-store") && reason.contains("damaged"),
                "{reason}"
            )
        }
        other => panic!("expected a marker error, got {other:?}"),
    }
}

/// sled 0.34 takes a leftover `snap.*.generating` for its newest snapshot and then cannot open
/// (spacejam/sled#1527): a read-only open reads around it without touching it, a writable open
/// sets it aside, and nothing is lost.
#[tokio::test]
async fn a_leftover_snapshot_is_read_around_then_set_aside_never_deleted() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    write_marked(&dir, &["a", "b"], 5, None).await;
    let leftover = "snap.00000000FFFFFFFF.generating";
    fs::write(dir.join(leftover), [0u8; 100]).expect("write leftover");
    let before = files(&dir);

    let read = open(&dir, OpenMode::ReadOnly, None)
        .await
        .expect("read-only open");
    assert!(
        read.notes.iter().any(|n| n.contains(leftover)),
        "{:?}",
        read.notes
    );
    assert!(read.losses.is_empty(), "{:?}", read.losses);
    assert_eq!(count(&read, "b").await, 5);
    drop(read);
    assert_eq!(files(&dir), before, "a read-only open changed the store");

    let opened = open(&dir, OpenMode::Existing, None)
        .await
        .expect("writable open");
    assert!(opened
        .notes
        .iter()
        .any(|n| n.contains("set aside") && n.contains(leftover)));
    assert_eq!(count(&opened, "a").await, 5);
    drop(opened);
    assert!(!dir.join(leftover).exists());
    let kept: Vec<_> = files(&dir.join(SET_ASIDE_DIR))
        .into_iter()
        .filter(|(name, bytes)| name.ends_with(leftover) && bytes == &[0u8; 100])
        .collect();
    assert_eq!(kept.len(), 1, "the leftover is kept, byte for byte");
}

/// One flipped byte in an old message of sled's log: sled would drop it and everything after
/// it, silently. Read-only: the loss is named by session and seq, the rest stays readable, no
/// byte changes. Writable: refused, files put back. Repair: accepted, old files kept.
#[tokio::test]
async fn a_byte_flip_in_the_log_is_named_contained_and_destroys_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    write_marked(&dir, &["a", "b", "c"], 20, None).await;
    flip(&dir.join("db"), &marked_record("b", 10, None));
    let before = files(&dir);

    let read = open(&dir, OpenMode::ReadOnly, None)
        .await
        .expect("read-only open");
    let lost: Vec<String> = read.losses.iter().map(|l| l.to_string()).collect();
    assert!(
        lost.iter().any(|l| l.starts_with("session \"b\" seq")),
        "{lost:?}"
    );
    assert!(
        lost.iter().all(|l| !l.contains("\"a\"")),
        "a was written before the damage: {lost:?}"
    );
    assert_eq!(count(&read, "a").await, 20);
    drop(read);
    assert_eq!(files(&dir), before, "a read-only open changed the store");

    for _ in 0..2 {
        match open(&dir, OpenMode::Existing, None).await {
            Err(Error::EventsLost { lost, .. }) => {
                assert!(
                    lost.iter().any(|l| l.session_id.as_deref() == Some("b")),
                    "{lost:?}"
                )
            }
            other => panic!("expected EventsLost, got {other:?}"),
        }
        assert_eq!(
            files(&dir),
            before,
            "a refused writable open changed the store"
        );
    }

    let repaired = open(&dir, OpenMode::Repair, None).await.expect("repair");
    assert!(!repaired.losses.is_empty());
    assert!(
        repaired
            .notes
            .iter()
            .any(|n| n.contains("accepted the loss")),
        "{:?}",
        repaired.notes
    );
    drop(repaired);
    let kept = files(&dir.join(SET_ASIDE_DIR));
    let old_db = kept
        .iter()
        .find(|(name, _)| name.ends_with("before-repair/db"))
        .expect("the old db is kept");
    assert_eq!(old_db.1, &before["db"]);
    let again = open(&dir, OpenMode::Existing, None)
        .await
        .expect("opens after repair");
    assert!(again.losses.is_empty());
    assert_eq!(count(&again, "a").await, 20);
}

/// The same for a flipped byte in a blob (a large event sled keeps in its own file).
#[tokio::test]
async fn a_byte_flip_in_a_blob_is_named_and_destroys_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    let big_at = Some(("b", 5, 300 * 1024));
    write_marked(&dir, &["a", "b"], 10, big_at).await;
    let record = marked_record("b", 5, big_at);
    let blob = files(&dir.join("blobs"))
        .into_iter()
        .find(|(_, bytes)| find(bytes, &record).is_some())
        .map(|(name, _)| dir.join("blobs").join(name))
        .expect("the large event is in a blob");
    flip(&blob, &record);
    let before = files(&dir);
    match open(&dir, OpenMode::Existing, None).await {
        Err(Error::EventsLost { lost, .. }) => assert!(!lost.is_empty()),
        other => panic!("expected EventsLost, got {other:?}"),
    }
    assert_eq!(files(&dir), before);
}

/// sled rewrites an empty `conf` silently and calls a damaged one "created with a version
/// earlier than 0.29"; here both are named, and only a repair writes it back.
#[tokio::test]
async fn a_damaged_conf_is_named_and_only_repair_writes_it_back() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    write_marked(&dir, &["a"], 3, None).await;
    let good = fs::read(dir.join("conf")).expect("conf");
    for damaged in [Vec::new(), {
        let mut d = good.clone();
        d[3] ^= 0x20;
        d
    }] {
        fs::write(dir.join("conf"), &damaged).expect("write");
        let before = files(&dir);
        match open(&dir, OpenMode::Existing, None).await {
            Err(Error::StoreOpen { reason, .. }) => {
                assert!(
                    reason.contains("conf") && reason.contains("damaged"),
                    "{reason}"
                )
            }
            other => panic!("expected a conf error, got {other:?}"),
        }
        let read = open(&dir, OpenMode::ReadOnly, None)
            .await
            .expect("read-only");
        assert!(
            read.notes.iter().any(|n| n.contains("conf")),
            "{:?}",
            read.notes
        );
        assert_eq!(count(&read, "a").await, 3);
        drop(read);
        assert_eq!(files(&dir), before);
    }
    let repaired = open(&dir, OpenMode::Repair, None).await.expect("repair");
    assert!(repaired.losses.is_empty());
    drop(repaired);
    assert_eq!(
        fs::read(dir.join("conf")).expect("conf"),
        good,
        "written back exactly"
    );
}

/// An open killed while putting a backup back is finished by the next open.
#[tokio::test]
async fn an_interrupted_restore_is_finished_by_the_next_open() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    write_marked(&dir, &["a"], 4, None).await;
    let good_db = fs::read(dir.join("db")).expect("db");
    backup(&dir, StorageEngine::Sled).expect("backup");
    File::create(dir.join(BACKUP_DIR).join(RESTORING)).expect("marker");
    fs::write(dir.join("db"), b"half-recovered garbage").expect("garble");
    let opened = open(&dir, OpenMode::Existing, None).await.expect("open");
    assert_eq!(count(&opened, "a").await, 4);
    drop(opened);
    assert!(!dir.join(BACKUP_DIR).exists());
    assert!(fs::read(dir.join("db")).expect("db").len() >= good_db.len().min(1));
}

/// A complete backup left by a killed open is the store as it was: read-only opens read it,
/// the next writable open puts it back, whatever the killed open had done to the engine's files.
#[tokio::test]
async fn a_backup_left_by_a_killed_open_is_put_back() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    write_marked(&dir, &["a", "b"], 4, None).await;
    backup(&dir, StorageEngine::Sled).expect("backup");
    // What a recovery that dropped a damaged log would leave.
    fs::write(dir.join("db"), vec![0u8; 4096]).expect("zero db");
    let read = open(&dir, OpenMode::ReadOnly, None)
        .await
        .expect("read-only");
    assert!(
        read.notes.iter().any(|n| n.contains("killed midway")),
        "{:?}",
        read.notes
    );
    assert_eq!(count(&read, "b").await, 4);
    drop(read);
    let opened = open(&dir, OpenMode::Existing, None).await.expect("open");
    assert!(opened.losses.is_empty());
    assert_eq!(count(&opened, "a").await, 4);
}

/// fjall 3.1 does not check its version files against the checksum `current` holds: a damaged
/// one can make it abort on a gigabyte allocation, and a missing `current` makes it start the
/// keyspace empty. Both are named before fjall sees them, and nothing changes.
#[tokio::test]
async fn a_damaged_fjall_version_file_is_named_before_fjall_opens_it() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    write_marked_on(&dir, StorageEngine::Fjall, &["a", "b"], 5, None).await;
    assert_eq!(detect(&dir).expect("detect"), Some(StorageEngine::Fjall));
    let current = dir.join("keyspaces/0/current");
    let bytes = fs::read(&current).expect("current");
    let version = dir.join(format!(
        "keyspaces/0/v{}",
        u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"))
    ));
    let mut damaged = fs::read(&version).expect("version");
    let mid = damaged.len() / 2;
    damaged[mid] ^= 0x40;
    fs::write(&version, &damaged).expect("write");
    let before = files(&dir);
    for mode in [OpenMode::ReadOnly, OpenMode::Existing] {
        match open(&dir, mode, None).await {
            Err(Error::StoreOpen { reason, .. }) => assert!(
                reason.contains("version file") && reason.contains("checksum"),
                "{reason}"
            ),
            other => panic!("expected a version-file error, got {other:?}"),
        }
        assert_eq!(files(&dir), before, "{mode:?} changed the store");
    }
    let mut good = damaged;
    good[mid] ^= 0x40;
    fs::write(&version, &good).expect("restore");
    fs::remove_file(&current).expect("remove current");
    match open(&dir, OpenMode::Existing, None).await {
        Err(Error::StoreOpen { reason, .. }) => assert!(reason.contains("current"), "{reason}"),
        other => panic!("expected a missing-current error, got {other:?}"),
    }
}

/// A byte flipped in fjall's journal: fjall cuts the journal there, silently; the marks name
/// the loss, and the writable open puts the journal back.
#[tokio::test]
async fn a_byte_flip_in_the_fjall_journal_is_named_and_destroys_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    write_marked_on(&dir, StorageEngine::Fjall, &["a", "b", "c"], 20, None).await;
    let journal = names_in(&dir)
        .into_iter()
        .find(|n| n.ends_with(".jnl"))
        .expect("a journal");
    let mut bytes = fs::read(dir.join(&journal)).expect("journal");
    let at = find(&bytes, b"MARK-b-10-").expect("the record is in the journal");
    // Just before the record's value: its length or tag, which fjall takes for a torn tail.
    bytes[at - 3] ^= 0xff;
    fs::write(dir.join(&journal), &bytes).expect("write");
    let before = files(&dir);
    let read = open(&dir, OpenMode::ReadOnly, None).await;
    match &read {
        Ok(read) => {
            let lost: Vec<String> = read.losses.iter().map(|l| l.to_string()).collect();
            assert!(
                lost.iter().any(|l| l.starts_with("session \"b\" seq")),
                "a cut journal must be named: {lost:?}"
            );
        }
        Err(e) => assert!(
            e.to_string().contains("journal") || e.to_string().contains("fjall"),
            "{e}"
        ),
    }
    drop(read);
    assert_eq!(files(&dir), before, "a read-only open changed the store");
    assert!(open(&dir, OpenMode::Existing, None).await.is_err());
    assert_eq!(files(&dir), before, "a refused open changed the store");
}

/// A fjall creation killed before `version` was written leaves an empty 64 MiB journal that
/// fjall refuses to create over: it is set aside, and the store is created.
#[tokio::test]
async fn an_interrupted_fjall_creation_is_set_aside_and_the_store_created() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("s");
    fs::create_dir_all(dir.join("keyspaces")).expect("mkdir");
    let journal = File::create(dir.join("0.jnl")).expect("journal");
    journal.set_len(64 * 1024 * 1024).expect("preallocate");
    drop(journal);
    write_marker(&dir, StorageEngine::Fjall).expect("marker");
    let opened = open(&dir, OpenMode::Existing, None).await.expect("open");
    assert!(
        opened.notes.iter().any(|n| n.contains("set aside 0.jnl")),
        "{:?}",
        opened.notes
    );
    drop(opened);
    let kept = files(&dir.join(SET_ASIDE_DIR));
    assert!(
        kept.keys().any(|n| n.ends_with("0.jnl")),
        "{:?}",
        kept.keys()
    );
}

#[tokio::test]
async fn a_store_is_made_only_in_a_new_or_empty_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let busy = dir.path().join("busy");
    fs::create_dir_all(busy.join("photos")).expect("mkdir");
    fs::write(busy.join("notes.txt"), "mine").expect("write");
    for engine in StorageEngine::ALL {
        let err = open(&busy, OpenMode::Create, Some(engine))
            .await
            .expect_err("a directory of other files is not a store");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("cannot open store at {}: ", busy.display()))
                && text.contains("not empty")
                && text.contains("notes.txt, photos/"),
            "{text}"
        );
        assert_eq!(text.matches("cannot open store").count(), 1, "{text}");
    }
    let left: Vec<String> = names_in(&busy);
    assert_eq!(left, ["notes.txt", "photos"], "nothing was added");

    // An empty directory, and one a creation killed midway left, are fine.
    let empty = dir.path().join("empty");
    fs::create_dir(&empty).expect("mkdir");
    drop(open(&empty, OpenMode::Create, None).await.expect("empty"));
    let cut = dir.path().join("cut");
    fs::create_dir(&cut).expect("mkdir");
    fs::write(cut.join(LOCK_FILE), "").expect("write");
    fs::write(cut.join("0.jnl"), [0u8; 64]).expect("write");
    fs::write(cut.join("lock"), "").expect("write");
    drop(
        open(&cut, OpenMode::Create, Some(StorageEngine::Fjall))
            .await
            .expect("an interrupted creation"),
    );
    // The store itself may hold other files once it exists.
    fs::write(empty.join("README"), "a store").expect("write");
    drop(open(&empty, OpenMode::Create, None).await.expect("a store"));
}

#[test]
fn no_store_here_points_at_a_store_in_its_store_subdirectory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let inner = dir.path().join("store");
    fs::create_dir(&inner).expect("mkdir");
    write_marker(&inner, StorageEngine::Fjall).expect("marker");
    let err = detect(dir.path()).expect("readable");
    assert_eq!(err, None);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let err = rt
        .block_on(open(dir.path(), OpenMode::ReadOnly, None))
        .expect_err("no store");
    assert!(
        err.to_string()
            .contains(&format!("({} is one)", inner.display())),
        "{err}"
    );
}

/// A file of data regions and holes: 64 KiB of data, a hole to 1 MiB, 3 MiB of data (more than
/// the fallback's buffer), and a hole to 8 MiB.
#[cfg(target_os = "linux")]
fn sparse_file(path: &Path) -> Vec<u8> {
    use std::os::unix::fs::FileExt as _;
    let mut want = vec![0u8; 8 << 20];
    for (i, b) in want[..64 << 10].iter_mut().enumerate() {
        *b = (i % 251) as u8 + 1;
    }
    for (i, b) in want[1 << 20..4 << 20].iter_mut().enumerate() {
        *b = (i % 241) as u8 + 1;
    }
    let file = File::create(path).expect("create");
    file.set_len(8 << 20).expect("set_len");
    file.write_all_at(&want[..64 << 10], 0).expect("write");
    file.write_all_at(&want[1 << 20..4 << 20], 1 << 20)
        .expect("write");
    file.sync_all().expect("sync");
    want
}

/// Bytes the filesystem allocated to a file.
#[cfg(target_os = "linux")]
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    fs::metadata(path).expect("metadata").blocks() * 512
}

/// A store's copy (a read-only open's, a writable open's backup) has every byte of the file
/// and leaves its holes as holes, in the kernel's copy and in the fallback through a buffer.
#[cfg(target_os = "linux")]
#[test]
fn a_copied_file_has_its_bytes_and_keeps_its_holes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let from = dir.path().join("journal");
    let want = sparse_file(&from);
    assert!(
        allocated(&from) < 5 << 20,
        "the filesystem here does not keep holes: {} bytes allocated",
        allocated(&from)
    );

    let copied = dir.path().join("copied");
    super::copy_sparse(&from, &copied).expect("copy");
    assert!(
        fs::read(&copied).expect("read") == want,
        "the copy's bytes differ"
    );
    assert!(
        allocated(&copied) < 5 << 20,
        "the copy filled its holes: {} bytes allocated",
        allocated(&copied)
    );

    let buffered = dir.path().join("buffered");
    let (src, dst) = (
        File::open(&from).expect("open"),
        File::create(&buffered).expect("create"),
    );
    dst.set_len(8 << 20).expect("set_len");
    super::copy_region_buffered(&src, &dst, 0, 64 << 10).expect("copy");
    super::copy_region_buffered(&src, &dst, 1 << 20, 4 << 20).expect("copy");
    drop(dst);
    assert!(
        fs::read(&buffered).expect("read") == want,
        "the buffered copy's bytes differ"
    );
    assert!(allocated(&buffered) < 5 << 20);
}
