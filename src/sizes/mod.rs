//! Enforced volume sizes: a volume is a directory the filesystem itself holds to a byte limit.
//!
//! [`SizeBackend`] is the one entry point; its only backend so far is btrfs ([`btrfs`]): a
//! volume is a subvolume and its size the referenced-bytes limit of the subvolume's qgroup.
//! Another backend (ext4 or XFS project quotas) is another variant with the same operations.
//! All of it works on open directory descriptors, with plain ioctls (no `btrfs` command), and
//! needs `CAP_SYS_ADMIN` (the quota ioctls). See docs/sizes.md.
//!
//! A grant directory with `sizes = "btrfs"` is checked here at load; the volumes the host makes
//! in one are in `crate::wasm::sized`.

pub mod btrfs;
mod ioctl;

use std::os::fd::{AsFd, OwnedFd};

/// How a volume's size is enforced on the filesystem a directory is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize)]
#[serde(try_from = "String")]
#[non_exhaustive]
pub enum SizeBackend {
    /// btrfs subvolumes limited by qgroups.
    Btrfs,
}

impl SizeBackend {
    /// The backend's name as configuration spells it (`"btrfs"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Btrfs => "btrfs",
        }
    }

    /// The backend named `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "btrfs" => Some(Self::Btrfs),
            _ => None,
        }
    }

    /// Probes the directory `dir`, enabling quotas first when `enable_quotas` and they are
    /// off. Not this backend's filesystem is an error; the rest is in the [`Probe`], whose
    /// [`Probe::require`] names what is missing.
    pub fn probe(self, dir: impl AsFd, enable_quotas: bool) -> Result<Probe, SizeError> {
        match self {
            Self::Btrfs => btrfs::probe(dir, enable_quotas),
        }
    }

    /// [`Self::probe`], then [`Probe::require`]: `Ok` when volumes can be made in `dir`.
    pub fn check(self, dir: impl AsFd, enable_quotas: bool) -> Result<Probe, SizeError> {
        let probe = self.probe(dir, enable_quotas)?;
        probe.require()?;
        Ok(probe)
    }

    /// Creates the volume `name` (one path component) in `parent`, limited to `bytes`, and
    /// returns its root directory. Nothing is left behind when the limit cannot be set.
    pub fn create(self, parent: impl AsFd, name: &str, bytes: u64) -> Result<OwnedFd, SizeError> {
        match self {
            Self::Btrfs => btrfs::create(parent, name, bytes),
        }
    }

    /// Creates the volume `name` in `parent` as a copy of the volume `source` (its root
    /// directory), limited to `bytes` of its own. Nothing is left behind on failure.
    pub fn snapshot(
        self,
        source: impl AsFd,
        parent: impl AsFd,
        name: &str,
        bytes: u64,
    ) -> Result<OwnedFd, SizeError> {
        match self {
            Self::Btrfs => btrfs::snapshot(source, parent, name, bytes),
        }
    }

    /// Changes the limit of the volume `volume` (its root directory) to `bytes`.
    pub fn set_limit(self, volume: impl AsFd, bytes: u64) -> Result<(), SizeError> {
        match self {
            Self::Btrfs => btrfs::set_limit(volume, bytes),
        }
    }

    /// The usage and limit of the volume `volume`, as of the filesystem's last commit.
    pub fn usage(self, volume: impl AsFd) -> Result<Usage, SizeError> {
        match self {
            Self::Btrfs => btrfs::usage(volume),
        }
    }

    /// Deletes the volume `name` in `parent`, contents and all, with whatever kept its limit.
    /// A directory that is not a volume is refused.
    pub fn destroy(self, parent: impl AsFd, name: &str) -> Result<(), SizeError> {
        match self {
            Self::Btrfs => btrfs::destroy(parent, name),
        }
    }

    /// Whether `dir` is a volume's root directory (for btrfs: a subvolume's) rather than a
    /// plain directory.
    pub fn is_volume(self, dir: impl AsFd) -> Result<bool, SizeError> {
        match self {
            Self::Btrfs => btrfs::is_subvolume(dir),
        }
    }
}

impl TryFrom<String> for SizeBackend {
    type Error = String;

    fn try_from(name: String) -> Result<SizeBackend, String> {
        SizeBackend::from_name(&name)
            .ok_or_else(|| format!("sizes = {name:?}: the only backend is \"btrfs\""))
    }
}

/// Opens the directory `path` for the backend's calls (following links: `path` is the
/// operator's, as a grant's directory is).
pub fn open_dir(path: &std::path::Path) -> Result<OwnedFd, SizeError> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|source| SizeError::Os { op: "open", source })
}

/// The state of quotas on a filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quotas {
    /// Quotas are not enabled: no limit can be set.
    Off,
    /// Simple quotas (Linux 6.7+): each extent is charged to the subvolume that wrote it, and a
    /// subvolume made inside a volume joins the volume's level-1 qgroup, so its writes count
    /// against the volume's limit. What volumes need.
    Simple,
    /// Full quotas: a subvolume a pod makes inside its volume (allowed without privilege) is
    /// charged to no limit, so a pod could write past its size. Refused for volumes.
    Full,
    /// Full quotas marked inconsistent (numbers wrong until a rescan). Refused like `Full`.
    Inconsistent,
}

/// What [`SizeBackend::probe`] found about a directory on the backend's filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Whether quotas are on.
    pub quotas: Quotas,
    /// The filesystem is mounted read-only.
    pub read_only: bool,
    /// This process may create entries in the directory (write and search permission).
    pub writable: bool,
    /// Whether a volume with a limit could be made in the directory and deleted again (tried
    /// only when the rest allows it), or why not.
    pub volumes: Result<(), String>,
}

impl Probe {
    /// `Ok` when volumes with limits can be made in the directory; otherwise the first thing
    /// missing, named.
    pub fn require(&self) -> Result<(), SizeError> {
        match self.quotas {
            Quotas::Off => return Err(SizeError::QuotasOff),
            Quotas::Full | Quotas::Inconsistent => return Err(SizeError::FullQuotas),
            Quotas::Simple => {}
        }
        if self.read_only {
            return Err(SizeError::ReadOnly);
        }
        if !self.writable {
            return Err(SizeError::NotWritable);
        }
        if let Err(why) = &self.volumes {
            return Err(SizeError::CannotMakeVolumes(why.clone()));
        }
        Ok(())
    }
}

/// A volume's usage and limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// The volume's id (for btrfs: the subvolume id, its qgroup `0/<id>`).
    pub id: u64,
    /// Bytes the volume references (what its limit counts), shared or not.
    pub referenced: u64,
    /// Bytes only this volume references.
    pub exclusive: u64,
    /// The limit on referenced bytes, if one is set.
    pub max_referenced: Option<u64>,
}

/// Why enforced sizes cannot be had, or an operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SizeError {
    /// The directory is on another filesystem.
    #[error("not on btrfs (filesystem magic {magic:#x}, btrfs is 0x9123683e)")]
    NotBtrfs {
        /// The filesystem's `f_type`.
        magic: u64,
    },
    /// Quotas are not enabled on the filesystem.
    #[error(
        "btrfs quotas are not enabled on this filesystem (`btrfs quota enable --simple <mount>`, or enable-quotas = true in the grant)"
    )]
    QuotasOff,
    /// Quotas are on in full mode, where a pod can escape its limit.
    #[error(
        "btrfs quotas are on in full mode, where a pod escapes its limit by making a subvolume inside its volume (no privilege needed); switch to simple quotas (`btrfs quota disable <mount>`, then `btrfs quota enable --simple <mount>` with btrfs-progs 6.7+, or let the grant's enable-quotas = true do it on a filesystem with quotas off)"
    )]
    FullQuotas,
    /// The filesystem is mounted read-only.
    #[error("the filesystem is mounted read-only")]
    ReadOnly,
    /// No write and search permission on the directory.
    #[error("no permission to create entries in the directory (write and search needed)")]
    NotWritable,
    /// A probe volume could not be made and deleted in the directory.
    #[error("a volume could not be made and deleted there: {0}")]
    CannotMakeVolumes(String),
    /// The quota ioctls need `CAP_SYS_ADMIN`.
    #[error("the btrfs quota ioctls need CAP_SYS_ADMIN (run as root)")]
    NotPrivileged,
    /// The directory is not a subvolume's root directory.
    #[error("not a btrfs subvolume (a plain directory is not a volume)")]
    NotSubvolume,
    /// The top-level subvolume is the whole filesystem, not a volume.
    #[error("the top-level subvolume (id 5) is the whole filesystem, not a volume")]
    TopLevel,
    /// A volume name that is not one plain path component.
    #[error("invalid volume name {name:?}: {why}")]
    InvalidName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A limit of 0 bytes, or `u64::MAX` (the kernel's "no limit").
    #[error("invalid size limit {0} bytes")]
    InvalidLimit(u64),
    /// The subvolume has no qgroup (quotas were enabled after it was made and no rescan ran).
    #[error("subvolume {id} has no qgroup 0/{id}")]
    NoQgroup {
        /// The subvolume id.
        id: u64,
    },
    /// A new subvolume's limit could not be set; it was removed again (unless `cleanup` says
    /// otherwise).
    #[error(
        "setting the size limit of new subvolume {name:?} failed: {source}{}",
        match cleanup { None => "; the subvolume was removed".to_owned(), Some(e) => format!("; removing it failed too: {e}") }
    )]
    LimitFailed {
        /// The subvolume's name.
        name: String,
        /// Why the limit could not be set.
        source: Box<SizeError>,
        /// Why removing the subvolume failed, if it did.
        cleanup: Option<Box<SizeError>>,
    },
    /// The qgroup of a deleted subvolume could not be removed.
    #[error("the subvolume was deleted but its qgroup 0/{id} could not be removed: {source}")]
    QgroupLeft {
        /// The deleted subvolume's id.
        id: u64,
        /// Why `BTRFS_IOC_QGROUP_CREATE` (remove) failed.
        source: rustix::io::Errno,
    },
    /// A system call or ioctl failed.
    #[error("{op}: {source}")]
    Os {
        /// The call.
        op: &'static str,
        /// Its error.
        source: rustix::io::Errno,
    },
}
