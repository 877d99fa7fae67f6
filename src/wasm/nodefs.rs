//! Grants on the node's own filesystems: a read-write grant directory on the filesystem that holds
//! `/`, the kubelet's directory or the container runtime's lets a guest, and the pods writing
//! into its volumes, fill the disk the node itself needs (docs/threat-model.md, "Disk"). Such a
//! guest still loads, with a warning in the log and a metric (`plugin_warnings`).
//!
//! ```text
//! probe (once, at the edge): st_dev of /, --kubelet-dir, /var/lib/{containerd,docker,containers},
//!                            and the files the kubelet and the runtime mount into a container
//! load:  st_dev of each read-write dirs[].host ─▶ shared_with ─▶ warning naming what it shares
//! ```

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::grants::{DirAccess, Grants};

/// The kubelet's directory when `--kubelet-dir` does not say otherwise.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet";

/// Where the container runtimes keep images, container layers and logs.
const RUNTIME_DIRS: &[&str] = &[
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/containers",
];

/// Files the kubelet and the runtime mount into every container, from their own directories:
/// in a container (where `/` is the container's own overlay and the node's directories are not
/// mounted) they tell which device those directories are on. Used only when each is a mount
/// point here, so a plain host's `/etc/resolv.conf` (often a link into `/run`) says nothing.
const MOUNTED_INTO_CONTAINERS: &[(&str, &str)] = &[
    ("/etc/hosts", "the kubelet's directory"),
    ("/dev/termination-log", "the kubelet's directory"),
    ("/etc/hostname", "the container runtime's directory"),
    ("/etc/resolv.conf", "the container runtime's directory"),
];

/// The metric label of the warning.
pub const WARNING_LABEL: &str = "node-filesystem";

/// A filesystem the node needs: what it is, the path it was seen through, its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFilesystem {
    /// What the node keeps there ("/", "the kubelet's directory /var/lib/kubelet", ...).
    pub what: String,
    /// `st_dev` of the path.
    pub dev: u64,
}

/// The node's filesystems as this process sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFilesystems {
    filesystems: Vec<NodeFilesystem>,
}

impl NodeFilesystems {
    /// These filesystems (for tests and for callers that probed themselves).
    pub fn of(filesystems: Vec<NodeFilesystem>) -> NodeFilesystems {
        NodeFilesystems { filesystems }
    }

    /// Stats `/`, `kubelet_dir`, the runtimes' directories that exist and, in a container, the
    /// files the kubelet and the runtime mount into it. Paths that do not exist are left out.
    pub fn probe(kubelet_dir: &Path) -> NodeFilesystems {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mount_points: Vec<PathBuf> = mountinfo
            .lines()
            .filter_map(super::localfs::mount_of)
            .map(|(point, _)| point)
            .collect();
        let mut seen = vec![
            ("/".to_string(), PathBuf::from("/")),
            (
                format!("the kubelet's directory {}", kubelet_dir.display()),
                kubelet_dir.to_owned(),
            ),
        ];
        seen.extend(RUNTIME_DIRS.iter().map(|dir| {
            (
                format!("the container runtime's directory {dir}"),
                PathBuf::from(dir),
            )
        }));
        seen.extend(
            MOUNTED_INTO_CONTAINERS
                .iter()
                .filter(|(file, _)| mount_points.iter().any(|p| p == Path::new(file)))
                .map(|(file, what)| (format!("{what} (seen through {file})"), file.into())),
        );
        let filesystems = seen
            .into_iter()
            .filter_map(|(what, path)| {
                let dev = std::fs::metadata(&path).ok()?.dev();
                Some(NodeFilesystem { what, dev })
            })
            .collect();
        NodeFilesystems { filesystems }
    }

    /// One warning per read-write grant directory on one of these filesystems (a directory that
    /// cannot be read is left to the load that resolves it).
    pub fn warnings(&self, grants: &Grants) -> Vec<String> {
        grants
            .dirs
            .iter()
            .filter_map(|dir| {
                let dev = std::fs::metadata(&dir.host).ok()?.dev();
                warning(&dir.host, dir.access, dev, &self.filesystems)
            })
            .collect()
    }
}

/// The node's filesystems a grant directory of `access` on device `dev` shares: none for a
/// read-only one (it cannot fill anything).
pub fn shared_with(access: DirAccess, dev: u64, node: &[NodeFilesystem]) -> Vec<&NodeFilesystem> {
    match access {
        DirAccess::ReadOnly => Vec::new(),
        DirAccess::ReadWrite => node.iter().filter(|fs| fs.dev == dev).collect(),
    }
}

/// The warning for grant directory `host`, if it shares a filesystem with the node.
pub fn warning(
    host: &Path,
    access: DirAccess,
    dev: u64,
    node: &[NodeFilesystem],
) -> Option<String> {
    let shared = shared_with(access, dev, node);
    if shared.is_empty() {
        return None;
    }
    let what: Vec<&str> = shared.iter().map(|fs| fs.what.as_str()).collect();
    Some(format!(
        "dirs: {} (read-write) is on the filesystem of {} (device {}:{}): this guest and the pods \
         of its volumes can fill the disk the node runs on, and the kubelet then evicts pods \
         (docs/threat-model.md, \"Disk\"); give the guest a filesystem of its own (a disk, \
         partition, LVM volume or loop-mounted image) mounted at its directory",
        host.display(),
        what.join(" and "),
        rustix::fs::major(dev),
        rustix::fs::minor(dev),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fs(what: &str, dev: u64) -> NodeFilesystem {
        NodeFilesystem {
            what: what.into(),
            dev,
        }
    }

    #[test]
    fn only_read_write_grants_on_a_node_filesystem_are_warned_about() {
        let root = rustix::fs::makedev(254, 0);
        let var = rustix::fs::makedev(254, 1);
        let own = rustix::fs::makedev(8, 16);
        let node = [
            fs("/", root),
            fs("the kubelet's directory /var/lib/kubelet", var),
            fs("the container runtime's directory /var/lib/containerd", var),
        ];
        let whats = |access, dev| -> Vec<String> {
            shared_with(access, dev, &node)
                .into_iter()
                .map(|fs| fs.what.clone())
                .collect()
        };
        use DirAccess::{ReadOnly, ReadWrite};
        for (access, dev, expected) in [
            (ReadWrite, root, vec!["/"]),
            (
                ReadWrite,
                var,
                vec![
                    "the kubelet's directory /var/lib/kubelet",
                    "the container runtime's directory /var/lib/containerd",
                ],
            ),
            (ReadWrite, own, vec![]),
            (ReadOnly, root, vec![]),
            (ReadOnly, var, vec![]),
        ] {
            assert_eq!(whats(access, dev), expected, "{access:?} on {dev:#x}");
        }
        let text = warning(Path::new("/srv/guest"), ReadWrite, var, &node).unwrap();
        assert!(
            text.starts_with(
                "dirs: /srv/guest (read-write) is on the filesystem of the kubelet's directory /var/lib/kubelet and the container runtime's directory /var/lib/containerd (device 254:1)"
            ),
            "{text}"
        );
        assert!(text.contains("docs/threat-model.md, \"Disk\""), "{text}");
        assert_eq!(
            warning(Path::new("/srv/guest"), ReadWrite, own, &node),
            None
        );
        assert_eq!(
            warning(Path::new("/srv/guest"), ReadOnly, root, &node),
            None
        );
        assert!(NodeFilesystems::default().filesystems.is_empty());
    }

    #[test]
    fn the_probe_sees_the_root_filesystem() {
        let probed = NodeFilesystems::probe(Path::new("/nonexistent/kubelet"));
        let root = std::fs::metadata("/").unwrap().dev();
        assert!(
            probed
                .filesystems
                .iter()
                .any(|fs| fs.what == "/" && fs.dev == root),
            "{probed:?}"
        );
        assert!(
            !probed
                .filesystems
                .iter()
                .any(|fs| fs.what.contains("/nonexistent")),
            "a missing directory is left out: {probed:?}"
        );
    }
}
