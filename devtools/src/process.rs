//! Child `cairn` processes for benchmarks and tests: started, waited for until they say they
//! are ready on stdout, and SIGKILLed when dropped.

use anyhow::{bail, Context};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A child process, killed (SIGKILL) and reaped when dropped.
pub struct Process {
    /// The child.
    pub child: Child,
}

impl Process {
    /// SIGKILLs it now and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `exe args` and waits for a stdout line starting with `ready`; returns the process
/// and the rest of that line. Its stdout is read on to the end so it never blocks on a full
/// pipe; its stderr goes to `stderr`.
pub fn start_and_wait(
    exe: &Path,
    args: &[String],
    ready: &str,
    stderr: Stdio,
) -> anyhow::Result<(Process, String)> {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("starting {} {}", exe.display(), args.join(" ")))?;
    let stdout = child.stdout.take().context("the child's stdout")?;
    let process = Process { child };
    let mut lines = BufReader::new(stdout).lines();
    loop {
        let line = match lines.next() {
            Some(line) => line.context("reading the child's stdout")?,
            None => bail!(
                "{} {} exited before saying {ready:?}",
                exe.display(),
                args.join(" ")
            ),
        };
        if let Some(rest) = line.strip_prefix(ready) {
            std::thread::spawn(move || for _ in lines.by_ref() {});
            return Ok((process, rest.trim().to_owned()));
        }
    }
}
