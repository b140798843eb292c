//! `cairn completions SHELL`: the shell completion script of the whole command line, made by
//! `clap_complete` from the same definition the parser uses.

use super::out::out;
use clap::CommandFactory;
use std::process::ExitCode;

/// Prints `shell`'s completion script for `C` on stdout.
pub fn print<C: CommandFactory>(shell: clap_complete::Shell) -> anyhow::Result<ExitCode> {
    let mut command = C::command();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut command, "cairn", &mut script);
    out!("{}", String::from_utf8_lossy(&script))?;
    Ok(ExitCode::SUCCESS)
}
