//! A memory-limited child cgroup for one test: the shipped deployment's container limit
//! (`deploy/`, 512 MiB) applied to a real provisioner process on this machine.
//!
//! cgroup v2 when the unified hierarchy has the memory controller (`memory.max`, `memory.peak`,
//! `memory.events`), else the v1 memory hierarchy (`memory.limit_in_bytes`,
//! `memory.max_usage_in_bytes`, `memory.oom_control`). The cgroup is created below this
//! process' own cgroup of that hierarchy (so whatever limits this test run stays accountable),
//! and removed on drop, after every process still in it (ours: the one it was made for and its
//! children) is killed by PID.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::node::host::mounts;

/// Which cgroup interface the limit is enforced through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The unified hierarchy.
    V2,
    /// The v1 memory controller.
    V1,
}

/// A child cgroup with a memory limit, removed on drop.
#[derive(Debug)]
pub struct MemoryCgroup {
    path: PathBuf,
    version: CgroupVersion,
}

impl MemoryCgroup {
    /// Creates cgroup `<own cgroup>/wp-<name>-<pid>` with its memory (and, on v1, memory and
    /// swap) limited to `limit_bytes`.
    pub fn create(name: &str, limit_bytes: u64) -> anyhow::Result<MemoryCgroup> {
        let (parent, version) = memory_parent()?;
        let path = parent.join(format!("wp-{name}-{}", std::process::id()));
        std::fs::create_dir(&path)
            .with_context(|| format!("creating cgroup {}", path.display()))?;
        let cgroup = MemoryCgroup { path, version };
        let limit = limit_bytes.to_string();
        match version {
            CgroupVersion::V2 => {
                cgroup.write("memory.max", &limit)?;
                // No swap: what does not fit is reclaimed or OOM-killed, as on a node without
                // swap (the kubelet's default).
                let _ = cgroup.write("memory.swap.max", "0");
            }
            CgroupVersion::V1 => {
                cgroup.write("memory.limit_in_bytes", &limit)?;
                if cgroup.path.join("memory.memsw.limit_in_bytes").exists() {
                    cgroup.write("memory.memsw.limit_in_bytes", &limit)?;
                }
            }
        }
        Ok(cgroup)
    }

    /// Changes the memory limit of the cgroup and what runs in it.
    pub fn set_limit(&self, limit_bytes: u64) -> anyhow::Result<()> {
        let limit = limit_bytes.to_string();
        match self.version {
            CgroupVersion::V2 => self.write("memory.max", &limit),
            CgroupVersion::V1 => {
                // memsw may not go below the memory limit: order the two writes accordingly.
                let memsw = self.path.join("memory.memsw.limit_in_bytes");
                if memsw.exists() && limit_bytes > self.read_u64("memory.limit_in_bytes")? {
                    self.write("memory.memsw.limit_in_bytes", &limit)?;
                    return self.write("memory.limit_in_bytes", &limit);
                }
                self.write("memory.limit_in_bytes", &limit)?;
                if memsw.exists() {
                    self.write("memory.memsw.limit_in_bytes", &limit)?;
                }
                Ok(())
            }
        }
    }

    /// The cgroup's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The interface in use.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// `cmd` run inside this cgroup from its first instruction: a shell writes its own PID into
    /// `cgroup.procs` and execs the program (same PID, so `Process::pid` is the program's).
    pub fn wrap(&self, cmd: &Command) -> Command {
        let mut wrapped = Command::new("sh");
        wrapped
            .arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(self.path.join("cgroup.procs"))
            .arg(cmd.get_program())
            .args(cmd.get_args());
        if let Some(dir) = cmd.get_current_dir() {
            wrapped.current_dir(dir);
        }
        for (key, value) in cmd.get_envs() {
            match value {
                Some(value) => wrapped.env(key, value),
                None => wrapped.env_remove(key),
            };
        }
        wrapped
    }

    /// The PIDs in the cgroup now.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    }

    /// Peak memory charged to the cgroup since it was created (or last reset), bytes: v2
    /// `memory.peak` (Linux 5.19+), v1 `memory.max_usage_in_bytes`. Both count page cache
    /// the cgroup's processes caused, as the container limit does.
    pub fn peak_bytes(&self) -> anyhow::Result<u64> {
        let file = match self.version {
            CgroupVersion::V2 => "memory.peak",
            CgroupVersion::V1 => "memory.max_usage_in_bytes",
        };
        self.read_u64(file)
    }

    /// Memory charged to the cgroup now, bytes.
    pub fn current_bytes(&self) -> anyhow::Result<u64> {
        let file = match self.version {
            CgroupVersion::V2 => "memory.current",
            CgroupVersion::V1 => "memory.usage_in_bytes",
        };
        self.read_u64(file)
    }

    /// Resets the peak to the current usage (v1 always; v2 on kernels where `memory.peak` is
    /// writable, 6.12+). False when the kernel cannot.
    pub fn reset_peak(&self) -> bool {
        let file = match self.version {
            CgroupVersion::V2 => "memory.peak",
            CgroupVersion::V1 => "memory.max_usage_in_bytes",
        };
        self.write(file, "0").is_ok()
    }

    /// Processes the kernel's OOM killer killed in this cgroup: v2 `memory.events` `oom_kill`,
    /// v1 `memory.oom_control` `oom_kill` (4.13+).
    pub fn oom_kills(&self) -> anyhow::Result<u64> {
        let file = match self.version {
            CgroupVersion::V2 => "memory.events",
            CgroupVersion::V1 => "memory.oom_control",
        };
        let text = self.read(file)?;
        text.lines()
            .find_map(|line| line.strip_prefix("oom_kill "))
            .and_then(|count| count.trim().parse().ok())
            .with_context(|| format!("no oom_kill count in {file}: {text}"))
    }

    fn read(&self, file: &str) -> anyhow::Result<String> {
        let path = self.path.join(file);
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    fn read_u64(&self, file: &str) -> anyhow::Result<u64> {
        let text = self.read(file)?;
        text.trim()
            .parse()
            .with_context(|| format!("{file}: not a number: {text:?}"))
    }

    fn write(&self, file: &str, value: &str) -> anyhow::Result<()> {
        let path = self.path.join(file);
        std::fs::write(&path, value)
            .with_context(|| format!("writing {value} to {}", path.display()))
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // A cgroup can only be removed once empty: what is left was started for this test.
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Err(error) = std::fs::remove_dir(&self.path) {
            eprintln!(
                "wp-harness: removing cgroup {}: {error}",
                self.path.display()
            );
        }
    }
}

/// The cgroup of this process that has the memory controller, and its interface.
fn memory_parent() -> anyhow::Result<(PathBuf, CgroupVersion)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let all = mounts();
    // v2: the unified mount, if memory is one of its controllers.
    if let Some((point, _)) = all.iter().find(|(_, fstype)| fstype == "cgroup2")
        && let Some(relative) = own.lines().find_map(|line| line.strip_prefix("0::"))
    {
        let parent = Path::new(point).join(relative.trim_start_matches('/'));
        let controllers =
            std::fs::read_to_string(parent.join("cgroup.controllers")).unwrap_or_default();
        if controllers.split_whitespace().any(|c| c == "memory") {
            // Children get the controller only if the parent hands it down.
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory");
            return Ok((parent, CgroupVersion::V2));
        }
    }
    // v1: the hierarchy the memory controller is mounted on.
    let relative = own
        .lines()
        .find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then(|| path.to_string())
        })
        .context("this process is in no cgroup with the memory controller (v1 or v2)")?;
    let Some((point, _)) = all.iter().find(|(point, fstype)| {
        fstype == "cgroup" && Path::new(point).join("memory.limit_in_bytes").exists()
    }) else {
        bail!("no cgroup v1 memory hierarchy is mounted");
    };
    Ok((
        Path::new(point).join(relative.trim_start_matches('/')),
        CgroupVersion::V1,
    ))
}
