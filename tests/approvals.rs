//! Tool approvals through the `cairn` binary: a call parked for approval survives a SIGKILL
//! of the process that ran it and runs exactly once after it is approved; a denial over the
//! store's socket reaches the model; a deadline denies by itself.

use crate::support::{cairn_command, demo_files};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

/// A script that asks for one shell command (`toolu_sh`), then answers `done`.
fn shell_script(command: &str) -> String {
    json!({"responses": [
        {"parts": [{"type": "tool_use", "id": "toolu_sh", "name": "shell", "input": {"command": command}}],
         "stop_reason": "tool_use"},
        {"parts": [{"type": "text", "text": "done"}]}
    ]})
    .to_string()
}

/// Starts `cairn run` on session `s1` with the shell offered, and waits until it says the
/// call waits for approval. The child's stderr keeps draining on a thread.
fn run_until_parked(data: &Path, script: &Path, workdir: &Path, extra: &[&str]) -> Child {
    let mut child = cairn_command()
        .arg("run")
        .arg("--data")
        .arg(data)
        .arg("--model")
        .arg(format!("scripted:{}", script.display()))
        .arg("--workdir")
        .arg(workdir)
        .args(["--session", "s1", "--shell"])
        .args(extra)
        .arg("record that it ran")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start cairn run");
    let stderr = child.stderr.take().expect("stderr");
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if line.contains("waiting for approval") {
                let _ = sender.send(line);
            }
        }
    });
    let line = receiver
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("cairn run never parked (exit: {:?})", child.try_wait()));
    assert!(line.contains("cairn approve s1 toolu_sh"), "{line}");
    child
}

fn cairn(args: &[&str], data: &Path) -> std::process::Output {
    let output = cairn_command()
        .args(&args[..1])
        .arg("--data")
        .arg(data)
        .args(&args[1..])
        .output()
        .expect("run cairn");
    output
}

fn history(data: &Path) -> Vec<Value> {
    let output = cairn(&["history", "s1", "--json"], data);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

fn count(events: &[Value], kind: &str) -> usize {
    events.iter().filter(|e| e["kind"] == kind).count()
}

#[test]
fn a_parked_call_survives_a_kill_and_runs_once_after_approval() {
    let files = demo_files(&shell_script("echo ran >> side.txt"));
    let data = files.dir.path().join("store");
    let side = files.workdir.join("side.txt");
    let mut child = run_until_parked(&data, &files.script, &files.workdir, &[]);
    // The session's status shows the parked call (through the running process's socket).
    let listed = cairn(&["sessions"], &data);
    let listed = String::from_utf8_lossy(&listed.stdout).to_string();
    assert!(listed.contains("awaiting approval: toolu_sh"), "{listed}");
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    assert!(!side.exists(), "the command ran before it was approved");

    let approved = cairn(&["approve", "s1", "toolu_sh"], &data);
    assert!(
        approved.status.success(),
        "{}",
        String::from_utf8_lossy(&approved.stderr)
    );
    // Decided once: approving again is refused and changes nothing.
    let again = cairn(&["approve", "s1", "toolu_sh"], &data);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("toolu_sh"));

    let resumed = cairn_command()
        .args(["resume", "--data"])
        .arg(&data)
        .arg("--workdir")
        .arg(&files.workdir)
        .output()
        .expect("resume");
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&side).unwrap(),
        "ran\n",
        "the tool ran once"
    );
    let events = history(&data);
    assert_eq!(count(&events, "tool_approval_requested"), 1);
    assert_eq!(count(&events, "tool_call_approved"), 1);
    assert_eq!(count(&events, "tool_call_completed"), 1);
    assert_eq!(count(&events, "turn_completed"), 1);
    assert_eq!(
        events[0]["event"]["session_started"]["tool_policy"],
        json!({"rules": [{"tool": "shell", "decision": "ask"}]})
    );
    let replayed = cairn(&["replay", "s1"], &data);
    assert!(
        replayed.status.success(),
        "{}",
        String::from_utf8_lossy(&replayed.stdout)
    );
}

#[test]
fn a_denial_over_the_socket_reaches_the_model_and_the_run_completes() {
    let files = demo_files(&shell_script("echo ran >> side.txt"));
    let data = files.dir.path().join("store");
    let mut child = run_until_parked(&data, &files.script, &files.workdir, &[]);
    let denied = cairn(
        &["deny", "s1", "toolu_sh", "--reason", "not on this machine"],
        &data,
    );
    assert!(
        denied.status.success(),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );
    let status = child.wait().expect("run ends");
    assert!(status.success(), "{status:?}");
    assert!(!files.workdir.join("side.txt").exists());
    let events = history(&data);
    let denial = events
        .iter()
        .find(|e| e["kind"] == "tool_call_denied")
        .expect("denied");
    assert_eq!(
        denial["event"]["tool_call_denied"]["reason"],
        "not on this machine"
    );
    let transcript = cairn(&["transcript", "s1"], &data);
    let transcript = String::from_utf8_lossy(&transcript.stdout);
    assert!(
        transcript.contains("the tool call was denied: not on this machine"),
        "{transcript}"
    );
}

#[test]
fn an_approval_deadline_denies_by_itself_and_allowed_commands_run_without_asking() {
    let files = demo_files(&shell_script("echo ran >> side.txt"));
    let data = files.dir.path().join("store");
    let mut child = run_until_parked(
        &data,
        &files.script,
        &files.workdir,
        &["--approval-timeout-ms", "300"],
    );
    let status = child.wait().expect("run ends");
    assert!(status.success(), "{status:?}");
    let events = history(&data);
    let denial = events
        .iter()
        .find(|e| e["kind"] == "tool_call_denied")
        .expect("denied");
    assert_eq!(denial["event"]["tool_call_denied"]["by_deadline"], true);
    assert_eq!(count(&events, "tool_call_denied"), 1);
    assert!(!files.workdir.join("side.txt").exists());

    // An allow rule for the command's prefix runs it at once; one for a command with a
    // redirection does not (the deadline guards the test against waiting forever).
    let allowed_script = files.dir.path().join("allowed.json");
    std::fs::write(&allowed_script, shell_script("touch allowed.txt")).unwrap();
    for (session, command) in [("s2", "shell:touch"), ("s3", "shell:echo")] {
        let script = if session == "s2" {
            &allowed_script
        } else {
            &files.script
        };
        let run = cairn_command()
            .arg("run")
            .arg("--data")
            .arg(&data)
            .arg("--model")
            .arg(format!("scripted:{}", script.display()))
            .arg("--workdir")
            .arg(&files.workdir)
            .args(["--session", session, "--shell", "--allow", command])
            .args(["--approval-timeout-ms", "500", "go"])
            .output()
            .expect("run");
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let parked = String::from_utf8_lossy(&run.stderr).contains("waiting for approval");
        assert_eq!(
            parked,
            session == "s3",
            "{session}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    assert!(files.workdir.join("allowed.txt").exists());
    assert!(!files.workdir.join("side.txt").exists());
}
