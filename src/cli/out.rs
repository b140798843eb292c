//! What commands print. Standard output may be a pipe whose reader went away (`cairn history |
//! head`): Rust ignores SIGPIPE, so the write fails with `BrokenPipe` and `println!` would
//! panic. Here a command's data ends quietly instead: [`line`] and [`text`] give
//! [`StdoutClosed`], on which `main` exits 0 without a word. A turn is not stopped by it: `run`,
//! `resume` and `demo` print their answers with [`show_line`], which drops what cannot be written,
//! and the turn goes on to its outcome and exit status. Messages go to standard error through
//! [`note_line`], which ignores a closed stderr.
//!
//! The binary's code prints only through these (`clippy::print_stdout` and
//! `clippy::print_stderr` are denied in `main.rs`).

use std::fmt;
use std::io::{self, Write};

/// Standard output's reader went away; `main` ends the process quietly (exit 0) on it.
#[derive(Debug)]
pub struct StdoutClosed;

impl fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Whether `error` is, or was caused by, standard output being closed.
pub fn is_stdout_closed(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| cause.is::<StdoutClosed>())
}

/// Writes `args` on standard output: a closed pipe is [`StdoutClosed`], another failure (a
/// full disk) an error naming standard output.
pub fn text(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("cannot write to standard output")),
    }
}

/// Writes `args` and a newline on standard output; see [`text`].
pub fn line(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    text(format_args!("{args}\n"))
}

/// Writes `args` and a newline on standard output as far as it can: output of a running turn,
/// which must not stop the turn.
pub fn show_line(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{args}").and_then(|()| out.flush());
}

/// Writes `args` and a newline on standard error, ignoring a closed one.
pub fn note_line(args: fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr().lock(), "{args}");
}

/// `println!` for a command's data: `outln!(...)?` (see [`line`]).
macro_rules! outln {
    () => {
        $crate::cli::out::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::cli::out::line(format_args!($($arg)*))
    };
}

/// `print!` for a command's data: `out!(...)?` (see [`text`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::out::text(format_args!($($arg)*))
    };
}

/// `println!` for what a running turn prints: never fails (see [`show_line`]).
macro_rules! showln {
    () => {
        $crate::cli::out::show_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::cli::out::show_line(format_args!($($arg)*))
    };
}

/// `eprintln!` that survives a closed standard error (see [`note_line`]).
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::cli::out::note_line(format_args!($($arg)*))
    };
}

pub(crate) use {note, out, outln, showln};
