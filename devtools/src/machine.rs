//! The machine a benchmark runs on, as one line that `cairn bench` prints above its figures:
//! the facts that moved them between machines of the same size (docs/benchmarks.md), read from
//! Linux's `/proc` and `/sys` at the time of the run.
//!
//! The same workload's figures differ by more than a fifth between 2-vCPU machines whose CPUs,
//! disks and kernels differ, and by as much on one machine when a kernel setting changes: with a
//! KVM guest's idle driver `haltpoll` polling before it halts, one session's turn took 0.69–0.71
//! ms, and 0.85–0.88 ms without (the ninth machine's type, 2026-12-06). So the line names the
//! CPU, the kernel, the file system the stores are made on (its mount options, its device's I/O
//! scheduler) and the CPU idle driver, with the guest's halt polling when the driver is
//! `haltpoll`. A fact that cannot be read (another OS, a file missing or unreadable) is left
//! out; the line never fails a run.

use std::fmt;
use std::path::{Path, PathBuf};

/// What the line says of a machine; each `None` could not be read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Machine {
    /// Logical CPUs this process may use.
    pub cpus: Option<usize>,
    /// The CPU, from `/proc/cpuinfo`.
    pub cpu: Option<Cpu>,
    /// The kernel's release (`/proc/sys/kernel/osrelease`).
    pub kernel: Option<String>,
    /// The directory the stores are made in, symbolic links resolved.
    pub store_dir: PathBuf,
    /// The file system holding `store_dir`, from `/proc/mounts`.
    pub mount: Option<Mount>,
    /// The I/O scheduler of the file system's block device.
    pub scheduler: Option<String>,
    /// The CPU idle driver (`/sys/devices/system/cpu/cpuidle/current_driver`).
    pub idle_driver: Option<String>,
    /// How long an idle vCPU polls before it halts, when the idle driver is `haltpoll`
    /// (`/sys/module/haltpoll/parameters/guest_halt_poll_ns`).
    pub guest_halt_poll_ns: Option<u64>,
}

/// A CPU as `/proc/cpuinfo` describes its first processor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cpu {
    /// `model name`.
    pub model_name: Option<String>,
    /// `cpu family` and `model` (x86).
    pub family_model: Option<(u32, u32)>,
    /// Whether the CPU flags say it runs under a hypervisor.
    pub virtual_machine: bool,
}

/// A mounted file system, as a line of `/proc/mounts` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The device (`/dev/vda`), or the source of a virtual file system (`tmpfs`).
    pub device: String,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Its type (`ext4`).
    pub fs_type: String,
    /// Its mount options, as listed.
    pub options: String,
}

impl Machine {
    /// The machine, for stores made where the benchmark harnesses make theirs: new temporary
    /// directories (`tempfile`), in the system's temporary directory (`TMPDIR`).
    pub fn of_bench_stores() -> Machine {
        Machine::probe(&std::env::temp_dir())
    }

    /// Reads what this machine's `/proc` and `/sys` say, for stores made in `store_dir`.
    pub fn probe(store_dir: &Path) -> Machine {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let store_dir = store_dir
            .canonicalize()
            .unwrap_or_else(|_| store_dir.to_path_buf());
        let mount = read("/proc/mounts").and_then(|mounts| mount_of(&mounts, &store_dir));
        let scheduler = mount
            .as_ref()
            .and_then(|mount| block_device_name(&mount.device))
            .and_then(scheduler_of_device);
        let idle_driver = read("/sys/devices/system/cpu/cpuidle/current_driver")
            .map(|driver| driver.trim().to_owned())
            .filter(|driver| !driver.is_empty());
        let guest_halt_poll_ns = match idle_driver.as_deref() {
            Some("haltpoll") => read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
                .and_then(|ns| ns.trim().parse().ok()),
            _ => None,
        };
        Machine {
            cpus: std::thread::available_parallelism().ok().map(usize::from),
            cpu: read("/proc/cpuinfo").map(|cpuinfo| parse_cpuinfo(&cpuinfo)),
            kernel: read("/proc/sys/kernel/osrelease")
                .map(|release| release.trim().to_owned())
                .filter(|release| !release.is_empty()),
            store_dir,
            mount,
            scheduler,
            idle_driver,
            guest_halt_poll_ns,
        }
    }
}

impl fmt::Display for Machine {
    /// `machine: 2 CPUs (Intel(R) Xeon(R) Processor, family 6, model 167, a virtual machine),
    /// Linux 6.18.44; stores in /tmp: ext4 (rw,relatime) on /dev/vda, I/O scheduler
    /// mq-deadline; CPU idle driver haltpoll, guest halt polling off (guest_halt_poll_ns 0)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("machine: ")?;
        match self.cpus {
            Some(1) => f.write_str("1 CPU")?,
            Some(cpus) => write!(f, "{cpus} CPUs")?,
            None => f.write_str("CPUs unknown")?,
        }
        if let Some(cpu) = &self.cpu {
            let mut about: Vec<String> = Vec::new();
            if let Some(name) = &cpu.model_name {
                about.push(name.clone());
            }
            if let Some((family, model)) = cpu.family_model {
                about.push(format!("family {family}, model {model}"));
            }
            if cpu.virtual_machine {
                about.push("a virtual machine".to_owned());
            }
            if !about.is_empty() {
                write!(f, " ({})", about.join(", "))?;
            }
        }
        if let Some(kernel) = &self.kernel {
            write!(f, ", Linux {kernel}")?;
        }
        write!(f, "; stores in {}", self.store_dir.display())?;
        match &self.mount {
            Some(mount) => {
                write!(
                    f,
                    ": {} ({}) on {}",
                    mount.fs_type, mount.options, mount.device
                )?;
                if let Some(scheduler) = &self.scheduler {
                    write!(f, ", I/O scheduler {scheduler}")?;
                }
            }
            None => f.write_str(": file system unknown")?,
        }
        if let Some(driver) = &self.idle_driver {
            write!(f, "; CPU idle driver {driver}")?;
            match self.guest_halt_poll_ns {
                Some(0) => f.write_str(", guest halt polling off (guest_halt_poll_ns 0)")?,
                // Whole microseconds as such; anything finer (under 1 µs, or not a whole
                // number of them) in nanoseconds, so that polling on never reads as 0 µs.
                Some(ns) if ns % 1_000 == 0 => write!(
                    f,
                    ", guest halt polling up to {} µs (guest_halt_poll_ns {ns})",
                    ns / 1_000
                )?,
                Some(ns) => write!(
                    f,
                    ", guest halt polling up to {ns} ns (guest_halt_poll_ns {ns})"
                )?,
                None => {}
            }
        }
        Ok(())
    }
}

/// The CPU of `/proc/cpuinfo`'s first processor (the fields of the others repeat it on the
/// machines measured).
pub fn parse_cpuinfo(cpuinfo: &str) -> Cpu {
    let first = cpuinfo.split("\n\n").next().unwrap_or_default();
    let field = |name: &str| {
        first.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_owned())
        })
    };
    let number = |name: &str| field(name).and_then(|value| value.parse::<u32>().ok());
    Cpu {
        model_name: field("model name").filter(|name| !name.is_empty()),
        family_model: number("cpu family").zip(number("model")),
        virtual_machine: field("flags")
            .is_some_and(|flags| flags.split_whitespace().any(|flag| flag == "hypervisor")),
    }
}

/// The file system holding `path` (absolute, symbolic links resolved): the `/proc/mounts`
/// line whose mount point is the longest whole-component prefix of it, the last such line
/// when one place was mounted over.
pub fn mount_of(mounts: &str, path: &Path) -> Option<Mount> {
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let device = unescape_mount_field(fields.next()?);
            let mount_point = PathBuf::from(unescape_mount_field(fields.next()?));
            let fs_type = fields.next()?.to_owned();
            let options = fields.next()?.to_owned();
            path.starts_with(&mount_point).then_some(Mount {
                device,
                mount_point,
                fs_type,
                options,
            })
        })
        .fold(None, |best: Option<Mount>, mount| match best {
            Some(best)
                if best.mount_point.components().count()
                    > mount.mount_point.components().count() =>
            {
                Some(best)
            }
            _ => Some(mount),
        })
}

/// A `/proc/mounts` field with the kernel's octal escapes (`\040` for a space, `\011`, `\012`,
/// `\134`) turned back into their characters; an escape that is not three octal digits is kept
/// as it is.
fn unescape_mount_field(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = bytes
            .get(i + 1..i + 4)
            .filter(|_| bytes[i] == b'\\')
            .filter(|digits| digits.iter().all(|digit| (b'0'..=b'7').contains(digit)))
            .and_then(|digits| std::str::from_utf8(digits).ok())
            .and_then(|digits| u8::from_str_radix(digits, 8).ok());
        match escape {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The kernel's name of the block device a mount's device path names (`/dev/vda1` → `vda1`);
/// `None` for a source that is not under `/dev/` (`tmpfs`, `overlay`).
fn block_device_name(device: &str) -> Option<String> {
    let name = device.strip_prefix("/dev/")?;
    let resolved = Path::new(device).canonicalize().ok().and_then(|path| {
        path.file_name()
            .map(|name| name.to_string_lossy().into_owned())
    });
    Some(resolved.unwrap_or_else(|| name.to_owned()))
}

/// The I/O scheduler of block device `name`: its own queue's, or, for a partition, its disk's.
fn scheduler_of_device(name: String) -> Option<String> {
    let device = Path::new("/sys/class/block").join(name);
    let own = device.join("queue/scheduler");
    let disk = device
        .canonicalize()
        .ok()
        .and_then(|path| path.parent().map(|disk| disk.join("queue/scheduler")));
    [Some(own), disk]
        .into_iter()
        .flatten()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .and_then(|schedulers| active_scheduler(&schedulers))
}

/// The active entry of a `queue/scheduler` file (`none [mq-deadline] kyber` → `mq-deadline`);
/// a device without a choice lists only `none`.
pub fn active_scheduler(schedulers: &str) -> Option<String> {
    let schedulers = schedulers.trim();
    match schedulers.split_once('[') {
        Some((_, rest)) => rest.split_once(']').map(|(active, _)| active.to_owned()),
        None => {
            (!schedulers.is_empty() && !schedulers.contains(' ')).then(|| schedulers.to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPUINFO: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu vme hypervisor lahf_lm\n\nprocessor\t: 1\nmodel name\t: Another\n";

    #[test]
    fn the_first_processor_names_the_cpu() {
        let cpu = parse_cpuinfo(CPUINFO);
        assert_eq!(
            cpu.model_name.as_deref(),
            Some("Intel(R) Xeon(R) Processor")
        );
        assert_eq!(cpu.family_model, Some((6, 167)));
        assert!(cpu.virtual_machine);
        // An ARM machine's cpuinfo has neither a model name nor a family.
        let arm = parse_cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n");
        assert_eq!(arm, Cpu::default());
        assert_eq!(parse_cpuinfo(""), Cpu::default());
    }

    const MOUNTS: &str = "/dev/vda / ext4 rw,relatime,discard 0 0\n\
        proc /proc proc rw,nosuid 0 0\n\
        tmpfs /tmp tmpfs rw,nosuid 0 0\n\
        /dev/vdb1 /tmp/my\\040disks xfs rw,noatime 0 0\n\
        tmpfs /tmp tmpfs rw,size=1g 0 0\n\
        garbage\n";

    #[test]
    fn a_path_is_on_the_longest_mount_point_before_it() {
        let on = |path: &str| mount_of(MOUNTS, Path::new(path)).map(|m| m.mount_point);
        assert_eq!(on("/work/store"), Some(PathBuf::from("/")));
        // The later of two mounts on one place is the one seen.
        let tmp = mount_of(MOUNTS, Path::new("/tmp/bench")).expect("a mount");
        assert_eq!(tmp.fs_type, "tmpfs");
        assert_eq!(tmp.options, "rw,size=1g");
        // An escaped space in a mount point, and whole components only.
        let disks = mount_of(MOUNTS, Path::new("/tmp/my disks/a")).expect("a mount");
        assert_eq!(
            (disks.device.as_str(), disks.fs_type.as_str()),
            ("/dev/vdb1", "xfs")
        );
        assert_eq!(on("/tmp/my disksX"), Some(PathBuf::from("/tmp")));
        assert_eq!(on("/procfs"), Some(PathBuf::from("/")));
        assert_eq!(mount_of("", Path::new("/tmp")), None);
        assert_eq!(mount_of("garbage\n\n", Path::new("/")), None);
    }

    #[test]
    fn escapes_in_mount_fields_are_undone_and_broken_ones_kept() {
        assert_eq!(unescape_mount_field("a\\040b\\011c"), "a b\tc");
        assert_eq!(unescape_mount_field("back\\134slash"), "back\\slash");
        assert_eq!(unescape_mount_field("trailing\\04"), "trailing\\04");
        assert_eq!(unescape_mount_field("not\\08x"), "not\\08x");
        assert_eq!(unescape_mount_field("sign\\+12"), "sign\\+12");
    }

    #[test]
    fn the_bracketed_scheduler_is_the_active_one() {
        assert_eq!(
            active_scheduler("none [mq-deadline] kyber\n").as_deref(),
            Some("mq-deadline")
        );
        assert_eq!(
            active_scheduler("[none] mq-deadline").as_deref(),
            Some("none")
        );
        assert_eq!(active_scheduler("none\n").as_deref(), Some("none"));
        assert_eq!(active_scheduler(""), None);
        assert_eq!(active_scheduler("[unclosed"), None);
    }

    #[test]
    fn the_line_names_what_was_read_and_leaves_out_the_rest() {
        let machine = Machine {
            cpus: Some(2),
            cpu: Some(parse_cpuinfo(CPUINFO)),
            kernel: Some("6.18.44".to_owned()),
            store_dir: PathBuf::from("/tmp"),
            mount: mount_of(MOUNTS, Path::new("/work")),
            scheduler: Some("mq-deadline".to_owned()),
            idle_driver: Some("haltpoll".to_owned()),
            guest_halt_poll_ns: Some(0),
        };
        assert_eq!(
            machine.to_string(),
            "machine: 2 CPUs (Intel(R) Xeon(R) Processor, family 6, model 167, a virtual \
             machine), Linux 6.18.44; stores in /tmp: ext4 (rw,relatime,discard) on /dev/vda, \
             I/O scheduler mq-deadline; CPU idle driver haltpoll, guest halt polling off \
             (guest_halt_poll_ns 0)"
        );
        let polling = Machine {
            guest_halt_poll_ns: Some(200_000),
            ..machine.clone()
        };
        assert!(polling
            .to_string()
            .ends_with("guest halt polling up to 200 µs (guest_halt_poll_ns 200000)"));
        let brief = Machine {
            guest_halt_poll_ns: Some(500),
            ..machine.clone()
        };
        assert!(brief
            .to_string()
            .ends_with("guest halt polling up to 500 ns (guest_halt_poll_ns 500)"));
        let unknown = Machine {
            store_dir: PathBuf::from("/data"),
            ..Machine::default()
        };
        assert_eq!(
            unknown.to_string(),
            "machine: CPUs unknown; stores in /data: file system unknown"
        );
    }

    #[test]
    fn this_machine_is_probed_without_failing() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let machine = Machine::probe(dir.path());
        let line = machine.to_string();
        assert!(line.starts_with("machine: "), "{line}");
        assert!(machine.cpus.is_some_and(|cpus| cpus >= 1), "{line}");
        #[cfg(target_os = "linux")]
        {
            // Linux always has /proc/mounts, and the temporary directory is on one of them.
            let mount = machine.mount.as_ref().expect("a mount");
            assert!(machine.store_dir.starts_with(&mount.mount_point), "{line}");
            assert!(machine.kernel.is_some(), "{line}");
        }
    }
}
