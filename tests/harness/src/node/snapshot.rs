//! What a node run can leave on the host, taken as a snapshot to compare before and after, and
//! the processes of a pod found by their environment.

use std::path::Path;

use super::{config, host};

/// PIDs of the processes on this machine whose environment has `POD_NAME=<pod>` (deploy/ sets
/// it in the provisioner's container): to tell when a deleted pod's process is really gone.
pub fn processes_of_pod(pod: &str) -> Vec<u32> {
    let needle = format!("POD_NAME={pod}");
    host::processes_where("environ", |environ| {
        environ
            .split(|byte| *byte == 0)
            .any(|variable| variable == needle.as_bytes())
    })
}

/// What a node run may leave on the host, to compare before and after: sysctls, links, nat rules,
/// the node's cgroups, mounts and processes of node runs, and the fixed host paths' entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSnapshot {
    lines: Vec<String>,
}

impl HostSnapshot {
    pub fn take() -> anyhow::Result<HostSnapshot> {
        let mut lines = Vec::new();
        for key in host::SYSCTLS {
            lines.push(format!("sysctl {key}={}", host::read_sysctl(key)?));
        }
        for link in host::entries(Path::new("/sys/class/net")) {
            lines.push(format!("link {link}"));
        }
        for program in ["iptables", "ip6tables"] {
            for table in ["nat", "filter", "mangle"] {
                // ip6tables may be unusable on a host without IPv6: then there is nothing to compare.
                for rule in host::run(program, &["-t", table, "-S"])
                    .unwrap_or_default()
                    .lines()
                {
                    lines.push(format!("{program} {table} {rule}"));
                }
            }
        }
        for hierarchy in host::cgroup_hierarchies() {
            let cgroup = hierarchy.join(config::CGROUP_ROOT);
            if cgroup.exists() {
                lines.push(format!("cgroup {}", cgroup.display()));
            }
        }
        for (point, _) in host::mounts() {
            if point.starts_with("/tmp/wp-node-")
                || host::FIXED_PATHS
                    .iter()
                    .any(|path| Path::new(&point).starts_with(path))
            {
                lines.push(format!("mount {point}"));
            }
        }
        for path in host::FIXED_PATHS {
            if Path::new(path).exists() {
                lines.push(format!("path {path} {:?}", host::entries(Path::new(path))));
            }
        }
        for pid in host::processes_naming("/tmp/wp-node-") {
            lines.push(format!("process {pid}"));
        }
        for dir in host::entries(Path::new("/tmp")) {
            if dir.starts_with("wp-node-") {
                lines.push(format!("run dir /tmp/{dir}"));
            }
        }
        Ok(HostSnapshot { lines })
    }

    /// Lines in `self` or `other` only, marked `-` and `+`.
    pub fn diff(&self, other: &HostSnapshot) -> Vec<String> {
        let mut diff: Vec<String> = self
            .lines
            .iter()
            .filter(|line| !other.lines.contains(line))
            .map(|line| format!("- {line}"))
            .collect();
        diff.extend(
            other
                .lines
                .iter()
                .filter(|line| !self.lines.contains(line))
                .map(|line| format!("+ {line}")),
        );
        diff
    }
}
