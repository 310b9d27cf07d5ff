//! Two devices on one machine: the laptop side (router, prefill node) pinned to one CPU
//! core, the phone side (decode node and the ggml RPC server it starts) pinned to another
//! and slowed to a fraction of it with the kernel's CPU bandwidth control - cgroup v1's
//! `cpu.cfs_quota_us` / `cpu.cfs_period_us`, or cgroup v2's `cpu.max`.
//!
//! Where a core each or the throttle cannot be had (fewer than two CPUs allowed, no
//! writable cpu controller: not root, a container without it), [`Devices::new`] says why
//! and nothing runs: a run on shared cores would measure something else.
//!
//! What it is not: a throttled x86 core keeps the laptop's caches and memory bandwidth (a
//! phone's are smaller), and nothing emulates heat (a warm phone runs 13-44% slower than a
//! cool one). The period is short ([`PERIOD_US`]) so that a throttled decode step is delayed
//! by at most a few milliseconds at a time rather than stalled for half of a 100 ms period.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// `--phone-speed`, on every subcommand that starts a stack.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DeviceArgs {
    /// Emulate the two devices: the laptop side (router, prefill node) on one CPU core, the
    /// phone side (decode node) on another at this fraction of it (0 < F <= 1), each engine
    /// with one thread. Needs two CPUs and root (cgroup CPU bandwidth control); refused,
    /// with the reason, where either is missing. Default: no emulation (shared cores).
    #[arg(long)]
    pub phone_speed: Option<f64>,
}

/// The bandwidth-control period: 10 ms (the kernel's default is 100 ms).
pub const PERIOD_US: u64 = 10_000;

/// The two devices' CPUs and the phone's throttle; the throttle's cgroup is removed on drop
/// (after the processes in it have gone: drop this after them).
#[derive(Debug)]
pub struct Devices {
    pub laptop_cpu: usize,
    pub phone_cpu: usize,
    /// The fraction of its core the phone side gets (0 < F <= 1).
    pub phone_speed: f64,
    /// The phone side's cgroup: its directory, and the file a process writes its pid to.
    group: PathBuf,
    procs: PathBuf,
    /// More phones on the same core, each in a group of its own ([`Devices::add_phone`]):
    /// speed, directory, procs file.
    more: Vec<(f64, PathBuf, PathBuf)>,
}

/// The CPUs this process may run on (`Cpus_allowed_list` of /proc/self/status: "0-3,6").
pub fn allowed_cpus() -> anyhow::Result<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .context("no Cpus_allowed_list in /proc/self/status")?;
    parse_cpu_list(list.trim())
}

fn parse_cpu_list(list: &str) -> anyhow::Result<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>()?..=b.parse::<usize>()?),
            None => cpus.push(part.parse()?),
        }
    }
    Ok(cpus)
}

impl Devices {
    /// Picks the last two allowed CPUs (laptop, phone) and makes the phone's throttle:
    /// under `cgroup_root` (`/sys/fs/cgroup` on a real system), a group of its own with
    /// `phone_speed` of one core. An error says why it cannot.
    pub fn new(phone_speed: f64, cgroup_root: &Path) -> anyhow::Result<Devices> {
        anyhow::ensure!(
            phone_speed > 0.0 && phone_speed <= 1.0,
            "--phone-speed must be above 0 and at most 1 (a fraction of one core), not {phone_speed}"
        );
        let cpus = allowed_cpus()?;
        let [.., laptop_cpu, phone_cpu] = cpus[..] else {
            anyhow::bail!(
                "device emulation needs two CPUs, one per device; this process may use {cpus:?}"
            );
        };
        anyhow::ensure!(
            which("taskset"),
            "device emulation pins with `taskset` (util-linux), which is not on PATH"
        );
        let name = format!("edgesplit-phone-{}", std::process::id());
        let quota = ((phone_speed * PERIOD_US as f64).round() as u64).max(1_000);
        let v1 = cgroup_root.join("cpu");
        let (group, procs) = if v1.join("cpu.cfs_quota_us").is_file() {
            sweep(&v1);
            let group = v1.join(&name);
            make_group(&group)?;
            write(&group.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
            write(&group.join("cpu.cfs_quota_us"), &quota.to_string())?;
            let procs = group.join("cgroup.procs");
            (group, procs)
        } else if std::fs::read_to_string(cgroup_root.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"))
        {
            // cgroup v2: the root may hand the cpu controller to its children.
            write(&cgroup_root.join("cgroup.subtree_control"), "+cpu")?;
            sweep(cgroup_root);
            let group = cgroup_root.join(&name);
            make_group(&group)?;
            write(&group.join("cpu.max"), &format!("{quota} {PERIOD_US}"))?;
            let procs = group.join("cgroup.procs");
            (group, procs)
        } else {
            anyhow::bail!(
                "device emulation throttles the phone with the cgroup cpu controller, and {} \
                 has none (cgroup v1 {}/cpu.cfs_quota_us, or v2 \"cpu\" in cgroup.controllers)",
                cgroup_root.display(),
                v1.display()
            );
        };
        Ok(Devices {
            laptop_cpu,
            phone_cpu,
            phone_speed,
            group,
            procs,
            more: Vec::new(),
        })
    }

    /// Another phone on the phone's core at `speed` of it, in a cgroup of its own beside the
    /// first's (the speeds of all phones should add up to at most 1: they share the core);
    /// its number for [`Devices::phone_n`] (the first phone is 0).
    ///
    /// # Errors
    /// A speed out of range, or the group not made.
    pub fn add_phone(&mut self, speed: f64) -> anyhow::Result<usize> {
        anyhow::ensure!(
            speed > 0.0 && speed <= 1.0,
            "a phone speed must be above 0 and at most 1, not {speed}"
        );
        let n = self.more.len() + 1;
        let parent = self.group.parent().context("the phone group's parent")?;
        let name = self.group.file_name().context("the phone group's name")?;
        let group = parent.join(format!("{}-{n}", name.to_string_lossy()));
        make_group(&group)?;
        let quota = ((speed * PERIOD_US as f64).round() as u64).max(1_000);
        if self.group.join("cpu.cfs_quota_us").is_file() {
            write(&group.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
            write(&group.join("cpu.cfs_quota_us"), &quota.to_string())?;
        } else {
            write(&group.join("cpu.max"), &format!("{quota} {PERIOD_US}"))?;
        }
        let procs = group.join("cgroup.procs");
        self.more.push((speed, group, procs));
        Ok(n)
    }

    /// `program` run as phone `n` (0: the first, [`Devices::phone`]; else one
    /// [`Devices::add_phone`] made).
    #[must_use]
    pub fn phone_n(&self, n: usize, program: &[PathBuf]) -> Vec<PathBuf> {
        let procs = match n {
            0 => &self.procs,
            n => &self.more[n - 1].2,
        };
        let mut p: Vec<PathBuf> = vec![
            "sh".into(),
            "-c".into(),
            r#"procs=$0; cpu=$1; shift; echo $$ > "$procs" && exec taskset -c "$cpu" "$@""#.into(),
            procs.clone(),
            self.phone_cpu.to_string().into(),
        ];
        p.extend_from_slice(program);
        p
    }

    /// `program` (a binary and its leading arguments) run on the laptop's core.
    #[must_use]
    pub fn laptop(&self, program: &[PathBuf]) -> Vec<PathBuf> {
        let mut p = vec![
            "taskset".into(),
            "-c".into(),
            self.laptop_cpu.to_string().into(),
        ];
        p.extend_from_slice(program);
        p
    }

    /// `program` run on the phone's core, in its throttled group: a shell joins the group
    /// and then becomes the program (`exec`), so everything it runs is throttled from its
    /// first instruction, and so is every process it starts.
    #[must_use]
    pub fn phone(&self, program: &[PathBuf]) -> Vec<PathBuf> {
        self.phone_n(0, program)
    }

    /// Changes the phone's share of its core to `speed` (0 < speed <= 1) at once, for the
    /// processes already in its group: a phone that throttles, or recovers.
    ///
    /// # Errors
    /// A speed out of range, or the cgroup file not written.
    pub fn set_speed(&self, speed: f64) -> anyhow::Result<()> {
        anyhow::ensure!(
            speed > 0.0 && speed <= 1.0,
            "a phone speed must be above 0 and at most 1, not {speed}"
        );
        let quota = ((speed * PERIOD_US as f64).round() as u64).max(1_000);
        let v1 = self.group.join("cpu.cfs_quota_us");
        if v1.is_file() {
            write(&v1, &quota.to_string())
        } else {
            write(&self.group.join("cpu.max"), &format!("{quota} {PERIOD_US}"))
        }
    }

    /// Whether a process is still in a phone's group.
    #[must_use]
    pub fn busy(&self) -> bool {
        std::iter::once(&self.procs)
            .chain(self.more.iter().map(|m| &m.2))
            .any(|procs| std::fs::read_to_string(procs).is_ok_and(|p| !p.trim().is_empty()))
    }

    /// A line for logs and reports.
    #[must_use]
    pub fn describe(&self) -> String {
        let mut s = format!(
            "laptop on CPU {}, phone on CPU {} at {} of it ({} / {PERIOD_US} us)",
            self.laptop_cpu,
            self.phone_cpu,
            self.phone_speed,
            (self.phone_speed * PERIOD_US as f64).round()
        );
        for (i, (speed, _, _)) in self.more.iter().enumerate() {
            s.push_str(&format!(
                ", phone {} on the same CPU at {speed} of it",
                i + 2
            ));
        }
        s
    }
}

impl Drop for Devices {
    fn drop(&mut self) {
        // Empty once its processes have exited; a group still in use stays (and says so).
        for group in self
            .more
            .iter()
            .map(|m| &m.1)
            .chain(std::iter::once(&self.group))
        {
            if let Err(e) = std::fs::remove_dir(group) {
                eprintln!("could not remove {}: {e}", group.display());
            }
        }
    }
}

/// Removes the phone groups of benches that are gone (killed before their `Drop`): a group
/// is named after its bench's pid, and is removed once no process of that pid runs (the
/// kernel refuses to remove a group that still holds a process; said, and left).
fn sweep(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("edgesplit-phone-"))
            .and_then(|p| p.split('-').next()?.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        match std::fs::remove_dir(e.path()) {
            Ok(()) => eprintln!(
                "removed {}, left by a bench that was killed",
                e.path().display()
            ),
            Err(err) => eprintln!("could not remove {}: {err}", e.path().display()),
        }
    }
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(program).is_file()))
}

fn make_group(group: &Path) -> anyhow::Result<()> {
    std::fs::create_dir(group).with_context(|| {
        format!(
            "device emulation could not make the cgroup {} (it needs root)",
            group.display()
        )
    })
}

fn write(path: &Path, value: &str) -> anyhow::Result<()> {
    std::fs::write(path, value).with_context(|| format!("writing {value:?} to {}", path.display()))
}

/// CPU time (user + system) a process and its finished threads used so far, in ms
/// (`/proc/PID/stat`, clock ticks of 10 ms on Linux).
#[must_use]
pub fn process_cpu_ms(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (in parentheses, which may hold spaces): state is field 3,
    // utime field 14, stime field 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) * 1000.0 / CLOCK_TICKS_PER_S)
}

/// `sysconf(_SC_CLK_TCK)`: 100 on every Linux architecture we build for.
const CLOCK_TICKS_PER_S: f64 = 100.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-1").unwrap(), vec![0, 1]);
        assert_eq!(parse_cpu_list("0-2,5,7-8").unwrap(), vec![0, 1, 2, 5, 7, 8]);
        assert_eq!(parse_cpu_list("3").unwrap(), vec![3]);
        assert!(parse_cpu_list("a-b").is_err());
    }

    #[test]
    fn a_speed_out_of_range_is_refused_first() {
        for f in [0.0, -0.5, 1.5, f64::NAN] {
            let e = Devices::new(f, Path::new("/nonexistent")).unwrap_err();
            assert!(e.to_string().contains("--phone-speed"), "{f}: {e}");
        }
    }

    #[test]
    fn without_a_cpu_controller_it_says_why() {
        let root = std::env::temp_dir().join(format!("edgesplit-nocg-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let e = Devices::new(0.5, &root).unwrap_err().to_string();
        // On a machine with one CPU it stops earlier, at the CPU count: also a reason.
        assert!(
            e.contains("cgroup cpu controller") || e.contains("two CPUs"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A fake cgroup v1 tree: the group is made with the period and quota, and removed on
    /// drop.
    #[test]
    fn a_v1_group_is_made_and_removed() {
        if allowed_cpus().unwrap().len() < 2 {
            // Not skipped silently: the refusal is the behaviour to check here.
            let e = Devices::new(0.5, Path::new("/nonexistent")).unwrap_err();
            assert!(e.to_string().contains("two CPUs"), "{e}");
            return;
        }
        let root = std::env::temp_dir().join(format!("edgesplit-cg1-{}", std::process::id()));
        std::fs::create_dir_all(root.join("cpu")).unwrap();
        std::fs::write(root.join("cpu/cpu.cfs_quota_us"), "-1").unwrap();
        let d = Devices::new(0.25, &root).unwrap();
        let g = root.join(format!("cpu/edgesplit-phone-{}", std::process::id()));
        let read = |f: &str| std::fs::read_to_string(g.join(f)).unwrap();
        assert_eq!(read("cpu.cfs_period_us"), "10000");
        assert_eq!(read("cpu.cfs_quota_us"), "2500");
        assert_ne!(d.laptop_cpu, d.phone_cpu);
        let phone = d.phone(&[PathBuf::from("prog"), PathBuf::from("--x")]);
        assert_eq!(phone[0], PathBuf::from("sh"));
        assert_eq!(phone[3], g.join("cgroup.procs"));
        assert_eq!(phone[5..], [PathBuf::from("prog"), PathBuf::from("--x")]);
        // A fake group is a plain folder holding the files written: empty them so that
        // the drop's rmdir (which a real cgroup allows) succeeds.
        for f in ["cpu.cfs_period_us", "cpu.cfs_quota_us"] {
            std::fs::remove_file(g.join(f)).unwrap();
        }
        drop(d);
        assert!(!g.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A fake cgroup v2 tree: the root hands the cpu controller down, the group gets
    /// `cpu.max` as "quota period"; a group a killed bench left (its pid gone) is removed
    /// first, a live bench's kept.
    #[test]
    fn a_v2_group_is_made_and_a_killed_benchs_group_removed() {
        if allowed_cpus().unwrap().len() < 2 {
            let e = Devices::new(0.5, Path::new("/nonexistent")).unwrap_err();
            assert!(e.to_string().contains("two CPUs"), "{e}");
            return;
        }
        let root = std::env::temp_dir().join(format!("edgesplit-cg2-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("cgroup.controllers"), "cpuset cpu io memory pids").unwrap();
        // pid_max is at most 2^22 on Linux: this pid runs nowhere.
        let stale = root.join("edgesplit-phone-4294967295");
        let live = root.join("edgesplit-phone-1");
        std::fs::create_dir(&stale).unwrap();
        std::fs::create_dir(&live).unwrap();
        let d = Devices::new(0.5, &root).unwrap();
        assert!(!stale.exists() && live.exists());
        assert_eq!(
            std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap(),
            "+cpu"
        );
        let g = root.join(format!("edgesplit-phone-{}", std::process::id()));
        assert_eq!(
            std::fs::read_to_string(g.join("cpu.max")).unwrap(),
            "5000 10000"
        );
        assert_eq!(d.phone(&[PathBuf::from("prog")])[3], g.join("cgroup.procs"));
        std::fs::remove_file(g.join("cpu.max")).unwrap();
        drop(d);
        assert!(!g.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn this_process_has_a_cpu_time() {
        let ms = process_cpu_ms(std::process::id()).unwrap();
        assert!(ms >= 0.0);
        assert_eq!(process_cpu_ms(u32::MAX), None);
    }
}
