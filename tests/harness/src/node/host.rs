//! The host state a node changes, recorded as it is changed and put back in reverse order: on
//! stop, on drop (a failed test), and at the next start if a run died before it could.
//!
//! Every change is appended to a journal file next to the machine-wide lock before it is made, so
//! a run killed with SIGKILL leaves a journal the next node start replays first.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// The machine-wide lock and journal: kubelet v1.20 puts its device-plugin socket under the fixed
/// `/var/lib/kubelet/device-plugins`, so two nodes on one machine would collide; node starts
/// serialize on this lock instead.
const STATE_DIR: &str = "/run/wp-harness-node";

/// Sysctls the kubelet (and the CNI bridge plugin, with `isGateway`) set on the host.
pub(crate) const SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
];

/// Host paths that kubelet v1.20 and containerd 1.6 use whatever their flags say.
pub(crate) const FIXED_PATHS: &[&str] = &[
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/kubelet",
    "/run/containerd",
    "/run/netns",
    // libcni's cache (containerd's CRI does not move it).
    "/var/lib/cni",
];

/// One change, and how to undo it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) enum Undo {
    /// Write the saved value back to `/proc/sys/<key>`.
    Sysctl { key: String, value: String },
    /// A directory that did not exist: remove it (after unmounting what lies under it).
    RemoveDir { path: PathBuf },
    /// A directory that existed: remove only the entries that were not there before.
    RemoveNewEntries { path: PathBuf, before: Vec<String> },
    /// A cgroup created in every hierarchy: remove it and every child, deepest first.
    Cgroup { name: String },
    /// A network link (the bridge).
    Link { name: String },
    /// The pods' veth links that are not in `before` (a pod's netns can outlive a killed run for
    /// a while, and its veth with it).
    NewVeths { before: Vec<String> },
    /// An iptables rule in table `table`, as its `-A` arguments.
    Iptables { table: String, rule: Vec<String> },
    /// Processes whose command line names this directory (the containerd shims, which leave
    /// containerd's process tree), and every mount under it.
    RunDir { path: PathBuf },
}

/// The journal of changes of one node, undone in reverse order by [`HostJournal::restore`].
pub(crate) struct HostJournal {
    _lock: File,
    path: PathBuf,
    undo: Vec<Undo>,
}

impl HostJournal {
    /// Takes the machine-wide lock (waiting for another node to stop), replays a journal a dead
    /// run left behind, and starts an empty one.
    pub(crate) fn open() -> anyhow::Result<HostJournal> {
        std::fs::create_dir_all(STATE_DIR).with_context(|| format!("creating {STATE_DIR}"))?;
        let lock_path = Path::new(STATE_DIR).join("lock");
        let lock =
            File::create(&lock_path).with_context(|| format!("opening {}", lock_path.display()))?;
        lock.lock()
            .with_context(|| format!("locking {}", lock_path.display()))?;
        let path = Path::new(STATE_DIR).join("journal.json");
        let mut journal = HostJournal {
            _lock: lock,
            path,
            undo: Vec::new(),
        };
        if let Ok(text) = std::fs::read_to_string(&journal.path) {
            let stale: Vec<Undo> = text
                .lines()
                .filter_map(|line| serde_json::from_str(line).ok())
                .collect();
            eprintln!(
                "wp-harness: undoing {} host changes a node run left behind",
                stale.len()
            );
            journal.undo = stale;
            journal.restore();
        }
        std::fs::write(&journal.path, "").context("starting the host journal")?;
        Ok(journal)
    }

    /// Records `undo` before the change it undoes is made.
    pub(crate) fn record(&mut self, undo: Undo) -> anyhow::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .context("opening the host journal")?;
        writeln!(file, "{}", serde_json::to_string(&undo)?).context("writing the host journal")?;
        self.undo.push(undo);
        Ok(())
    }

    /// Saves a sysctl's value (once) so restore writes it back.
    pub(crate) fn save_sysctl(&mut self, key: &str) -> anyhow::Result<()> {
        let value = read_sysctl(key)?;
        self.record(Undo::Sysctl {
            key: key.to_string(),
            value,
        })
    }

    /// Makes sure `path` exists and records how to take back what is added in it.
    pub(crate) fn claim_dir(&mut self, path: &Path) -> anyhow::Result<()> {
        if path.is_dir() {
            let before = entries(path);
            self.record(Undo::RemoveNewEntries {
                path: path.to_owned(),
                before,
            })
        } else {
            self.record(Undo::RemoveDir {
                path: path.to_owned(),
            })?;
            std::fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))
        }
    }

    /// Undoes every change in reverse order; keeps going past failures (each is printed), then
    /// empties the journal.
    pub(crate) fn restore(&mut self) {
        while let Some(undo) = self.undo.pop() {
            if let Err(error) = undo_one(&undo) {
                eprintln!("wp-harness: undoing {undo:?}: {error:#}");
            }
        }
        let _ = std::fs::write(&self.path, "");
    }
}

impl Drop for HostJournal {
    fn drop(&mut self) {
        self.restore();
        let _ = std::fs::remove_file(&self.path);
    }
}

fn undo_one(undo: &Undo) -> anyhow::Result<()> {
    match undo {
        Undo::Sysctl { key, value } => write_sysctl(key, value),
        Undo::RemoveDir { path } => {
            unmount_under(path);
            match std::fs::remove_dir_all(path) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    Err(error).with_context(|| format!("removing {}", path.display()))
                }
                _ => Ok(()),
            }
        }
        Undo::RemoveNewEntries { path, before } => {
            for entry in entries(path) {
                if !before.contains(&entry) {
                    let entry = path.join(entry);
                    unmount_under(&entry);
                    let removed = if entry.is_dir() && !entry.is_symlink() {
                        std::fs::remove_dir_all(&entry)
                    } else {
                        std::fs::remove_file(&entry)
                    };
                    removed.with_context(|| format!("removing {}", entry.display()))?;
                }
            }
            Ok(())
        }
        Undo::Cgroup { name } => {
            for hierarchy in cgroup_hierarchies() {
                remove_cgroup_tree(&hierarchy.join(name))?;
            }
            Ok(())
        }
        Undo::NewVeths { before } => {
            for link in entries(Path::new("/sys/class/net")) {
                if link.starts_with("veth") && !before.contains(&link) {
                    run("ip", &["link", "delete", &link])?;
                }
            }
            Ok(())
        }
        Undo::Link { name } => {
            if Path::new("/sys/class/net").join(name).exists() {
                run("ip", &["link", "delete", name])?;
            }
            Ok(())
        }
        Undo::Iptables { table, rule } => {
            let mut check = vec!["-t", table.as_str(), "-C"];
            check.extend(rule.iter().map(String::as_str));
            if run("iptables", &check).is_ok() {
                let mut delete = vec!["-t", table.as_str(), "-D"];
                delete.extend(rule.iter().map(String::as_str));
                run("iptables", &delete)?;
            }
            Ok(())
        }
        Undo::RunDir { path } => {
            kill_processes_naming(path);
            unmount_under(path);
            Ok(())
        }
    }
}

/// Names in a directory (empty if it is missing), sorted.
pub(crate) fn entries(path: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

pub(crate) fn read_sysctl(key: &str) -> anyhow::Result<String> {
    let path = Path::new("/proc/sys").join(key);
    Ok(std::fs::read_to_string(&path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_string())
}

pub(crate) fn write_sysctl(key: &str, value: &str) -> anyhow::Result<()> {
    let path = Path::new("/proc/sys").join(key);
    std::fs::write(&path, value).with_context(|| format!("writing {value} to {}", path.display()))
}

/// The mount points of the cgroup v1 hierarchies and the v2 one, e.g. `/sys/fs/cgroup/memory`.
pub(crate) fn cgroup_hierarchies() -> Vec<PathBuf> {
    mounts()
        .into_iter()
        .filter(|(_, fstype)| fstype == "cgroup" || fstype == "cgroup2")
        .map(|(point, _)| PathBuf::from(point))
        .collect()
}

/// `(mount point, filesystem type)` of every mount this process sees.
pub(crate) fn mounts() -> Vec<(String, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let point = fields.get(4)?;
            let separator = fields.iter().position(|field| *field == "-")?;
            let fstype = fields.get(separator + 1)?;
            Some((unescape_mount(point), fstype.to_string()))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount(point: &str) -> String {
    point
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Unmounts every mount at or below `path`, deepest first (lazily if busy).
pub(crate) fn unmount_under(path: &Path) {
    let mut points: Vec<String> = mounts()
        .into_iter()
        .map(|(point, _)| point)
        .filter(|point| Path::new(point).starts_with(path))
        .collect();
    points.sort_by_key(|point| std::cmp::Reverse(point.len()));
    for point in points {
        if run("umount", &[&point]).is_err() {
            let _ = run("umount", &["-l", &point]);
        }
    }
}

/// SIGKILLs every process whose command line contains `path` (a directory unique to one node run:
/// the containerd shims it started, which daemonize out of our process tree).
pub(crate) fn kill_processes_naming(path: &Path) {
    let needle = path.to_string_lossy().into_owned();
    for pid in processes_naming(&needle) {
        let _ = run("kill", &["-KILL", &pid.to_string()]);
    }
}

/// PIDs of the processes whose command line contains `needle`.
pub(crate) fn processes_naming(needle: &str) -> Vec<u32> {
    processes_where("cmdline", |text| {
        String::from_utf8_lossy(text).contains(needle)
    })
}

/// PIDs of the processes (not this one) whose `/proc/<pid>/<file>` satisfies `matches`.
pub(crate) fn processes_where(file: &str, matches: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    let own = std::process::id();
    let Ok(proc_entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    proc_entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != own)
        .filter(|pid| std::fs::read(format!("/proc/{pid}/{file}")).is_ok_and(|text| matches(&text)))
        .collect()
}

fn remove_cgroup_tree(path: &Path) -> anyhow::Result<()> {
    if !path.is_dir() {
        return Ok(());
    }
    // Containers whose shim was killed with a dead run are still in here: they are this run's.
    for pid in std::fs::read_to_string(path.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
    {
        let _ = run("kill", &["-KILL", pid.trim()]);
    }
    for entry in std::fs::read_dir(path)?.filter_map(Result::ok) {
        if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            remove_cgroup_tree(&entry.path())?;
        }
    }
    // A cgroup can only go once its processes are gone; they are being killed, so retry a bit.
    for _ in 0..50 {
        match std::fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
    std::fs::remove_dir(path).with_context(|| format!("removing cgroup {}", path.display()))
}

/// Runs a host tool, failing with its stderr if it fails.
pub(crate) fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} (is it installed? bash .ci/setup)"))?;
    if !output.status.success() {
        bail!(
            "{program} {} failed with {}: {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undo_entries_round_trip_through_the_journal_format() {
        let undo = Undo::RemoveNewEntries {
            path: PathBuf::from("/var/log/pods"),
            before: vec!["a".into(), "b c".into()],
        };
        let line = serde_json::to_string(&undo).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<Undo>(&line).unwrap(), undo);
    }

    #[test]
    fn removes_only_new_entries_of_a_directory_that_existed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("old"), "").unwrap();
        let undo = Undo::RemoveNewEntries {
            path: dir.path().to_owned(),
            before: entries(dir.path()),
        };
        std::fs::create_dir_all(dir.path().join("new/deep")).unwrap();
        std::fs::write(dir.path().join("new-file"), "").unwrap();
        undo_one(&undo).unwrap();
        assert_eq!(entries(dir.path()), ["old"]);
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mount("/a\\040b"), "/a b");
    }
}
