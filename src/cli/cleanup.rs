//! What `cairn chaos` leaves behind: its temporary data directory is removed after a run whose
//! checks passed (unless `--keep`), and kept, said with its path, otherwise.

use super::out::outln;
use anyhow::Context;
use std::path::Path;

/// Removes `data` when `remove`, else says where it is.
pub fn chaos_data(data: &Path, remove: bool) -> anyhow::Result<()> {
    if remove {
        std::fs::remove_dir_all(data)
            .with_context(|| format!("cannot remove the chaos data {}", data.display()))?;
        outln!(
            "removed the chaos data {} (--keep keeps it)",
            data.display()
        )?;
    } else {
        outln!("the chaos data is kept in {}", data.display())?;
    }
    Ok(())
}
