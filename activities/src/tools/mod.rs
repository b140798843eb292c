//! The built-in tools: a calculator and a file reader confined to a working directory.

mod calculator;
mod read_file;

pub use calculator::Calculator;
pub use read_file::ReadFile;
