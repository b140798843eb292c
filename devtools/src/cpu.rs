//! The CPU time processes have used, read from `/proc/<pid>/stat`: what `cairn bench` divides
//! by the turns of a row, so that a row says what a turn costs in CPU as well as in time.

use anyhow::Context;

/// Clock ticks per second of the times in `/proc/<pid>/stat` (Linux's `USER_HZ`, 100 whatever
/// the kernel's own tick rate).
const USER_HZ: f64 = 100.0;

/// The user and system CPU seconds process `pid` has used so far, all its threads together
/// (Linux only; to 10 ms).
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {path} (the bench's CPU figures need Linux)"))?;
    stat_cpu_seconds(&stat).with_context(|| format!("no utime and stime fields in {path}"))
}

/// The CPU seconds processes `pids` have used so far, together.
pub fn total_cpu_seconds(pids: &[u32]) -> anyhow::Result<f64> {
    pids.iter().map(|&pid| cpu_seconds(pid)).sum()
}

/// utime + stime of a `/proc/<pid>/stat` text, in seconds.
pub fn stat_cpu_seconds(stat: &str) -> Option<f64> {
    // Field 2, the command, is in parentheses and may hold spaces and parentheses itself:
    // the fields are counted after its last `)`, from field 3 (the state).
    let after_command = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_command.split_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stat_line_gives_user_plus_system_seconds() {
        // A command name with a space and a parenthesis; utime 250 and stime 50 ticks.
        let stat = "4242 (cairn (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 5 0 \
                    123 456789 1000 18446744073709551615";
        assert_eq!(stat_cpu_seconds(stat), Some(3.0));
        assert_eq!(stat_cpu_seconds("4242 (cairn) S 1 2"), None);
        assert_eq!(stat_cpu_seconds("no parenthesis"), None);
    }

    #[test]
    fn this_process_has_used_some_cpu_and_more_after_work() {
        let pid = std::process::id();
        let before = cpu_seconds(pid).unwrap();
        // Spin until the kernel counts a tick more (10 ms of CPU), bounded.
        let mut after = before;
        let mut n = 0u64;
        for _ in 0..10_000 {
            for _ in 0..1_000_000 {
                n = std::hint::black_box(n.wrapping_add(1));
            }
            after = total_cpu_seconds(&[pid]).unwrap();
            if after > before {
                break;
            }
        }
        assert!(after > before, "{before} s, then {after} s after spinning");
        assert!(cpu_seconds(u32::MAX).is_err());
    }
}
