//! The built-in tools: a calculator, a file reader confined to a working directory, and a
//! shell that runs commands there.

mod calculator;
mod read_file;
mod shell;

pub use calculator::Calculator;
pub use read_file::ReadFile;
pub use shell::Shell;
