//! The built-in tools: a calculator, file tools confined to a working directory (read, list,
//! write, edit), and a shell that runs commands there.

mod calculator;
pub(crate) mod confine;
mod edit_file;
mod file_io;
mod list_dir;
mod read_file;
mod shell;
mod write_file;

pub use calculator::Calculator;
pub use edit_file::EditFile;
pub use list_dir::ListDir;
pub use read_file::ReadFile;
pub use shell::Shell;
pub use write_file::WriteFile;
