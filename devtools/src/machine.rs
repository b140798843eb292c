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
//!
//! It also names the disk's hardware queues and the CPUs their completion interrupts go to:
//! on two machine types with one queue whose interrupt went to one vCPU, an fdatasync issued
//! from the other vCPU took 1.4–1.5 times as long (the ninth's 188–199 µs against 132–134, the
//! tenth's 175–204 µs against 122–143), and where the threads run is the kernel's choice.

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
    /// How many hardware queues the disk has (`/sys/block/<disk>/mq/`).
    pub hardware_queues: Option<usize>,
    /// The disk's completion interrupts (from `/proc/interrupts`) and the CPUs each goes to.
    pub disk_interrupts: Vec<Interrupt>,
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

/// An interrupt of the stores' disk: what `/proc/interrupts` names it, and the CPUs it is
/// delivered to (`/proc/irq/<n>/effective_affinity_list`, else `smp_affinity_list`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interrupt {
    /// Its name (`virtio1-req.0`, `nvme0q1`).
    pub name: String,
    /// The CPUs, as the kernel lists them (`1`, `0-3`).
    pub cpus: String,
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
        let disk = mount
            .as_ref()
            .and_then(|mount| block_device_name(&mount.device))
            .and_then(|name| disk_of(&name));
        let scheduler = disk.as_deref().and_then(scheduler_of_disk);
        let hardware_queues = disk.as_deref().and_then(hardware_queues_of_disk);
        let disk_interrupts = disk
            .as_deref()
            .and_then(interrupt_prefix_of_disk)
            .zip(read("/proc/interrupts"))
            .map(|(device, interrupts)| {
                interrupts_of_device(&interrupts, &device)
                    .into_iter()
                    .filter_map(|(irq, name)| {
                        let cpus = ["effective_affinity_list", "smp_affinity_list"]
                            .into_iter()
                            .find_map(|file| read(&format!("/proc/irq/{irq}/{file}")))
                            .map(|cpus| cpus.trim().to_owned())
                            .filter(|cpus| !cpus.is_empty())?;
                        Some(Interrupt { name, cpus })
                    })
                    .collect()
            })
            .unwrap_or_default();
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
            hardware_queues,
            disk_interrupts,
            idle_driver,
            guest_halt_poll_ns,
        }
    }
}

impl fmt::Display for Machine {
    /// `machine: 2 CPUs (Intel(R) Xeon(R) Processor, family 6, model 167, a virtual machine),
    /// Linux 6.18.44; stores in /tmp: ext4 (rw,relatime) on /dev/vda, I/O scheduler
    /// mq-deadline, 1 hardware queue, its completion interrupt virtio1-req.0 on CPU 1; CPU idle
    /// driver haltpoll, guest halt polling off (guest_halt_poll_ns 0)`
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
                match self.hardware_queues {
                    Some(1) => f.write_str(", 1 hardware queue")?,
                    Some(queues) => write!(f, ", {queues} hardware queues")?,
                    None => {}
                }
                write_interrupts(f, &self.disk_interrupts)?;
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

/// `, its completion interrupt virtio1-req.0 on CPU 1`, each one named while there are a few;
/// nothing when none was read.
fn write_interrupts(f: &mut fmt::Formatter<'_>, interrupts: &[Interrupt]) -> fmt::Result {
    let on = |interrupt: &Interrupt| {
        let plural = interrupt.cpus.contains([',', '-']);
        format!(
            "{} on CPU{} {}",
            interrupt.name,
            if plural { "s" } else { "" },
            interrupt.cpus
        )
    };
    match interrupts {
        [] => Ok(()),
        [one] => write!(f, ", its completion interrupt {}", on(one)),
        few if few.len() <= 4 => write!(
            f,
            ", completion interrupts {}",
            few.iter().map(on).collect::<Vec<_>>().join(", ")
        ),
        many => write!(f, ", {} completion interrupts", many.len()),
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

/// The disk block device `name` is or is a partition of, as its `/sys` directory.
fn disk_of(name: &str) -> Option<PathBuf> {
    let device = Path::new("/sys/class/block")
        .join(name)
        .canonicalize()
        .ok()?;
    if device.join("partition").exists() {
        device.parent().map(Path::to_path_buf)
    } else {
        Some(device)
    }
}

/// The I/O scheduler of the disk at `disk` (its `/sys` directory).
fn scheduler_of_disk(disk: &Path) -> Option<String> {
    std::fs::read_to_string(disk.join("queue/scheduler"))
        .ok()
        .and_then(|schedulers| active_scheduler(&schedulers))
}

/// How many hardware queues the disk at `disk` has: the entries of its `mq` directory.
fn hardware_queues_of_disk(disk: &Path) -> Option<usize> {
    let queues = std::fs::read_dir(disk.join("mq")).ok()?.count();
    (queues > 0).then_some(queues)
}

/// The name its driver gives the disk's interrupts in `/proc/interrupts`: the name of the
/// device the disk is on (`virtio1`, whose interrupts are `virtio1-req.0`; `nvme0`).
fn interrupt_prefix_of_disk(disk: &Path) -> Option<String> {
    let device = disk.join("device").canonicalize().ok()?;
    Some(device.file_name()?.to_string_lossy().into_owned())
}

/// The interrupts `/proc/interrupts` lists for `device` (its driver's name for it, `virtio1`),
/// as numbers and names: those named `<device>-…` or `<device>q<n>`, but for a virtio
/// device's configuration changes (`…-config`) and an NVMe controller's admin queue (`…q0`),
/// which carry no completions of reads and writes.
pub fn interrupts_of_device(interrupts: &str, device: &str) -> Vec<(u32, String)> {
    interrupts
        .lines()
        .filter_map(|line| {
            let (number, rest) = line.trim_start().split_once(':')?;
            let number = number.parse::<u32>().ok()?;
            let name = rest.split_whitespace().last()?;
            let queue = name
                .strip_prefix(device)
                .filter(|queue| match queue.strip_prefix('q') {
                    Some(index) => {
                        !index.is_empty()
                            && index.bytes().all(|b| b.is_ascii_digit())
                            && index != "0"
                    }
                    None => queue.starts_with('-') && !queue.ends_with("-config"),
                });
            queue.map(|_| (number, name.to_owned()))
        })
        .collect()
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
            hardware_queues: Some(1),
            disk_interrupts: vec![interrupt("virtio1-req.0", "1")],
            idle_driver: Some("haltpoll".to_owned()),
            guest_halt_poll_ns: Some(0),
        };
        assert_eq!(
            machine.to_string(),
            "machine: 2 CPUs (Intel(R) Xeon(R) Processor, family 6, model 167, a virtual \
             machine), Linux 6.18.44; stores in /tmp: ext4 (rw,relatime,discard) on /dev/vda, \
             I/O scheduler mq-deadline, 1 hardware queue, its completion interrupt \
             virtio1-req.0 on CPU 1; CPU idle driver haltpoll, guest halt polling off \
             (guest_halt_poll_ns 0)"
        );
        let queues = Machine {
            hardware_queues: Some(2),
            disk_interrupts: vec![interrupt("nvme0q1", "0"), interrupt("nvme0q2", "1-3")],
            idle_driver: None,
            ..machine.clone()
        };
        assert!(
            queues.to_string().ends_with(
                "I/O scheduler mq-deadline, 2 hardware queues, completion interrupts nvme0q1 \
                 on CPU 0, nvme0q2 on CPUs 1-3"
            ),
            "{queues}"
        );
        let many = Machine {
            hardware_queues: Some(8),
            disk_interrupts: (1..=8)
                .map(|q| interrupt(&format!("nvme0q{q}"), "0,4"))
                .collect(),
            idle_driver: None,
            ..machine.clone()
        };
        assert!(
            many.to_string()
                .ends_with("8 hardware queues, 8 completion interrupts"),
            "{many}"
        );
        let unread = Machine {
            hardware_queues: None,
            disk_interrupts: Vec::new(),
            idle_driver: None,
            ..machine.clone()
        };
        assert!(
            unread.to_string().ends_with("I/O scheduler mq-deadline"),
            "{unread}"
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

    fn interrupt(name: &str, cpus: &str) -> Interrupt {
        Interrupt {
            name: name.to_owned(),
            cpus: cpus.to_owned(),
        }
    }

    /// A Firecracker guest's (the tenth machine's type), with an NVMe controller added.
    const INTERRUPTS: &str = "           CPU0       CPU1       \n \
         24:          1          0  IO-APIC   5-edge      ACPI:Ged\n \
         35:          0          1 PCI-MSIX-0000:00:02.0   0-edge      virtio1-config\n \
         36:          0      56072 PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0\n \
         37:          0          0 PCI-MSIX-0000:00:03.0   0-edge      virtio10-req.0\n \
         38:          0       1639 PCI-MSIX-0000:00:03.0   1-edge      virtio2-input.0\n \
         50:         10          0 PCI-MSIX-0000:00:06.0   0-edge      nvme0q0\n \
         51:        900          0 PCI-MSIX-0000:00:06.0   1-edge      nvme0q1\n \
         52:          0        800 PCI-MSIX-0000:00:06.0   2-edge      nvme0q2\n \
        NMI:          0          0   Non-maskable interrupts\n \
        LOC:      17394      18739   Local timer interrupts\n \
        broken line\n";

    #[test]
    fn a_disks_interrupts_are_its_queues_and_not_its_configuration() {
        assert_eq!(
            interrupts_of_device(INTERRUPTS, "virtio1"),
            vec![(36, "virtio1-req.0".to_owned())]
        );
        assert_eq!(
            interrupts_of_device(INTERRUPTS, "nvme0"),
            vec![(51, "nvme0q1".to_owned()), (52, "nvme0q2".to_owned())]
        );
        assert_eq!(
            interrupts_of_device(INTERRUPTS, "virtio10"),
            vec![(37, "virtio10-req.0".to_owned())]
        );
        assert!(interrupts_of_device(INTERRUPTS, "sda").is_empty());
        assert!(interrupts_of_device("", "virtio1").is_empty());
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
