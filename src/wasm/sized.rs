//! Volumes in a size-enforcing grant directory (`sizes = "btrfs"`): the host makes each one,
//! limited to its PV's capacity, and destroys it whole.
//!
//! ```text
//! a returned hostPath/local path there, walked on disk (no link in any component), in its parent:
//!   ─ nothing, or an empty directory (the guest's mkdir) ─▶ the directory removed; a volume
//!       `.<pv>.sizing` made by descriptor with the limit, marked with the PV's name, renamed
//!       into place (never over anything)
//!   ─ a volume marked with this PV's name (a retry) ─▶ its limit set again, adopted
//!   ─ anything else (a directory with entries, a volume not marked for this PV) ─▶ refused,
//!       untouched
//! host.copy-tree into such a directory ─▶ the copy is a volume marked `(copy)`: a snapshot of
//!   a source volume (instant, whole) or a new volume the entries are copied into; the PV whose
//!   path it then is adopts it (marks it with its name, sets its limit)
//! host.destroy-volume(path, pv) ─ a volume marked with `pv` or `(copy)` ─▶ destroyed whole (no walk)
//!                               ─ a plain directory, a link, nothing ─▶ false: the guest removes it
//!                               ─ a volume not marked for `pv` ─▶ refused, untouched
//! ```
//!
//! The mark is the extended attribute `trusted.wasm-provisioner.volume` (the PV's name): only
//! a process with `CAP_SYS_ADMIN` can set or read `trusted.*`, so no pod can forge one on a
//! subvolume of its own making, and an operator's subvolume that happens to lie where a volume
//! would go is never adopted and never destroyed. A subvolume is made under a hidden staging
//! name and renamed into place only once limited and marked, so a crash between the steps
//! leaves no unmarked volume at a PV's path: a leftover `.<pv>.sizing` is destroyed by the next
//! attempt for that PV.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, XattrFlags};
use rustix::io::Errno;

use super::grants::{DirGrant, Grants};
use super::guest_path::{self, DIRECTORY, GuestPathError, explain};
use crate::sizes::{SizeBackend, SizeError};

/// The extended attribute that marks a volume the host made, holding its PV's name.
pub const MARK: &str = "trusted.wasm-provisioner.volume";
/// The mark of a volume `copy-tree` made for a clone, not yet any PV's: the first PV whose path
/// it is adopts it (and marks it with its name). No PV name has parentheses.
pub const COPIED: &str = "(copy)";

/// What [`copy_volume`] made.
#[derive(Debug)]
pub enum CopyVolume {
    /// A snapshot of the source volume: the copy is complete.
    Snapshot,
    /// A new, empty volume (the source is a plain directory): the entries go into it.
    Empty(OwnedFd),
}

/// The copy of `source` at `name` in `parent` (in a size-enforcing directory): a snapshot when
/// `source` is a volume (a subvolume) on the same filesystem, else a new empty volume; marked
/// [`COPIED`]. Its limit until a PV adopts it is the source's (or 1 TiB): [`make`] sets the PV's.
pub fn copy_volume(
    backend: SizeBackend,
    source: &OwnedFd,
    parent: &OwnedFd,
    name: &str,
) -> Result<CopyVolume, SizeError> {
    const UNTIL_ADOPTED: u64 = 1 << 40;
    // One filesystem (a snapshot cannot cross one; subvolumes have devices of their own, so
    // the filesystem id tells, not st_dev).
    let fsid = |fd: &OwnedFd| rustix::fs::fstatvfs(fd).map(|s| s.f_fsid).ok();
    let snapshot = backend.is_volume(source)? && fsid(source) == fsid(parent);
    let volume = if snapshot {
        let limit = backend
            .usage(source)
            .ok()
            .and_then(|usage| usage.max_referenced)
            .unwrap_or(UNTIL_ADOPTED);
        backend.snapshot(source, parent, name, limit)?
    } else {
        backend.create(parent, name, UNTIL_ADOPTED)?
    };
    let marked = rustix::fs::fsetxattr(&volume, MARK, COPIED.as_bytes(), XattrFlags::CREATE);
    if let Err(source) = marked {
        drop(volume);
        let _ = backend.destroy(parent, name);
        return Err(SizeError::Os {
            op: "fsetxattr (mark)",
            source,
        });
    }
    Ok(if snapshot {
        CopyVolume::Snapshot
    } else {
        CopyVolume::Empty(volume)
    })
}

/// Why a volume with an enforced size could not be made, or destroyed.
#[derive(Debug, thiserror::Error)]
pub enum SizedError {
    /// The path is taken by a directory holding something.
    #[error("{0} already holds entries; a volume with an enforced size is made new")]
    NotEmpty(String),
    /// A volume (subvolume) is there that the host did not make for this PV.
    #[error(
        "{path} is a subvolume the host did not make for {pv}; it is never adopted or destroyed"
    )]
    NotOurs {
        /// Where.
        path: String,
        /// The PV asked about.
        pv: String,
    },
    /// Something else than a directory is there.
    #[error("{0} is not a directory")]
    NotDirectory(String),
    /// The backend failed.
    #[error("{path}: {source}")]
    Size {
        /// Where.
        path: String,
        /// What failed.
        source: SizeError,
    },
    /// A call failed.
    #[error("{path}: {message}")]
    Os {
        /// Where.
        path: String,
        /// The OS error, explained.
        message: String,
    },
    /// The path a guest named cannot be used.
    #[error(transparent)]
    Path(#[from] GuestPathError),
}

/// The size-enforcing granted directory whose host path holds `path` (the innermost), and its
/// backend; `None` when `path` lies in no such directory.
pub fn sized_dir<'g>(grants: &'g Grants, path: &Path) -> Option<(&'g DirGrant, SizeBackend)> {
    grants
        .dirs
        .iter()
        .filter(|d| path.starts_with(&d.host))
        .max_by_key(|d| d.host.components().count())
        .and_then(|d| d.sizes.map(|backend| (d, backend)))
}

/// The volume `name` in `parent` for PV `pv`: made as the module says, or adopted if this PV's
/// already (a retry). Returns its root directory, not yet limited to the PV's size: the owner
/// and mode go on first, then [`limit`] (a change of a volume's metadata reserves space charged
/// to its qgroup, so a one-byte volume could take neither its mark nor its owner after its
/// limit). `shown` names it in errors.
pub fn make(
    backend: SizeBackend,
    parent: &OwnedFd,
    name: &str,
    pv: &str,
    shown: &str,
) -> Result<OwnedFd, SizedError> {
    let os = |errno: Errno| SizedError::Os {
        path: shown.to_owned(),
        message: explain(errno),
    };
    let size = |source: SizeError| SizedError::Size {
        path: shown.to_owned(),
        source,
    };
    match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Err(Errno::NOENT) => {}
        Err(errno) => return Err(os(errno)),
        Ok(stat) if FileType::from_raw_mode(stat.st_mode) != FileType::Directory => {
            return Err(SizedError::NotDirectory(shown.to_owned()));
        }
        Ok(_) => {
            let dir = rustix::fs::openat(parent, name, DIRECTORY, Mode::empty()).map_err(os)?;
            if backend.is_volume(&dir).map_err(size)? {
                match marked_for(&dir).map_err(os)?.as_deref() {
                    Some(mark) if mark == pv => {}
                    // A clone's copy (`copy-tree`) taken up by the PV it was made for.
                    Some(COPIED) => {
                        rustix::fs::fsetxattr(&dir, MARK, pv.as_bytes(), XattrFlags::REPLACE)
                            .map_err(os)?;
                    }
                    _ => {
                        return Err(SizedError::NotOurs {
                            path: shown.to_owned(),
                            pv: pv.to_owned(),
                        });
                    }
                }
                return Ok(dir);
            }
            if !is_empty(dir).map_err(os)? {
                return Err(SizedError::NotEmpty(shown.to_owned()));
            }
            rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR).map_err(os)?;
        }
    }
    let staging = format!(".{pv}.sizing");
    clear_staging(backend, parent, &staging, pv).map_err(size)?;
    let volume = backend.create(parent, &staging, UNLIMITED).map_err(size)?;
    let placed =
        rustix::fs::fsetxattr(&volume, MARK, pv.as_bytes(), XattrFlags::CREATE).and_then(|()| {
            rustix::fs::renameat_with(parent, &staging, parent, name, RenameFlags::NOREPLACE)
        });
    if let Err(errno) = placed {
        drop(volume);
        let _ = backend.destroy(parent, &staging);
        return Err(os(errno));
    }
    Ok(volume)
}

/// The limit a volume has until [`limit`] gives it its PV's: none to speak of.
const UNLIMITED: u64 = u64::MAX - 1;

/// Limits the volume `volume` (from [`make`]) to its PV's `bytes`, the last step before the PV
/// exists.
pub fn limit(
    backend: SizeBackend,
    volume: &OwnedFd,
    bytes: u64,
    shown: &str,
) -> Result<(), SizedError> {
    backend
        .set_limit(volume, bytes)
        .map_err(|source| SizedError::Size {
            path: shown.to_owned(),
            source,
        })
}

/// Raises the limit of the volume `volume` (at `shown`) to its PV's new capacity `bytes`, when
/// it is a volume the host made for `pv`; a limit already as high stays (a limit is never
/// lowered here: a claim cannot shrink).
pub fn raise(
    backend: SizeBackend,
    volume: &OwnedFd,
    pv: &str,
    bytes: u64,
    shown: &str,
) -> Result<(), SizedError> {
    let size = |source: SizeError| SizedError::Size {
        path: shown.to_owned(),
        source,
    };
    let mark = marked_for(volume).map_err(|errno| SizedError::Os {
        path: shown.to_owned(),
        message: explain(errno),
    })?;
    if !backend.is_volume(volume).map_err(size)? || mark.as_deref() != Some(pv) {
        return Err(SizedError::NotOurs {
            path: shown.to_owned(),
            pv: pv.to_owned(),
        });
    }
    let limit = backend.usage(volume).map_err(size)?.max_referenced;
    if limit.is_some_and(|limit| limit >= bytes) {
        return Ok(());
    }
    backend.set_limit(volume, bytes).map_err(size)
}

/// Destroys a leftover staging volume of this PV (a crash between making and placing it).
fn clear_staging(
    backend: SizeBackend,
    parent: &OwnedFd,
    staging: &str,
    pv: &str,
) -> Result<(), SizeError> {
    let Ok(dir) = rustix::fs::openat(parent, staging, DIRECTORY, Mode::empty()) else {
        return Ok(());
    };
    if backend.is_volume(&dir)? && marked_for(&dir).ok().flatten().as_deref() == Some(pv) {
        drop(dir);
        backend.destroy(parent, staging)?;
    }
    Ok(())
}

/// The PV name a volume is marked with, if any.
fn marked_for(dir: impl AsFd) -> Result<Option<String>, Errno> {
    let mut value = [0u8; 256];
    match rustix::fs::fgetxattr(dir, MARK, &mut value[..]) {
        Ok(length) => Ok(Some(String::from_utf8_lossy(&value[..length]).into_owned())),
        Err(Errno::NODATA) => Ok(None),
        Err(errno) => Err(errno),
    }
}

fn is_empty(dir: OwnedFd) -> Result<bool, Errno> {
    let mut listing = rustix::fs::Dir::new(dir)?;
    while let Some(entry) = listing.read() {
        if !matches!(entry?.file_name().to_bytes(), b"." | b"..") {
            return Ok(false);
        }
    }
    Ok(true)
}

/// `host.destroy-volume`: destroys the volume at `path` (as the guest names it) if the host made
/// it for `pv`, whole, without walking it. `Ok(false)` when there is no volume to destroy
/// there (a plain directory, a link, nothing, or a directory without enforced sizes): the guest
/// removes what is there itself.
pub fn destroy(grants: &Grants, path: &str, pv: &str) -> Result<bool, SizedError> {
    let (parent, name) = guest_path::split(path)?;
    // A parent that cannot be reached (missing, not granted, a link in it) holds no volume of
    // ours: the guest's own removal then looks, and says what it finds (a missing node
    // directory is not taken for gone there).
    let Ok(opened) = guest_path::open_dir(grants, parent, true) else {
        return Ok(false);
    };
    let Some(backend) = opened.grant.sizes else {
        return Ok(false);
    };
    let os = |errno: Errno| SizedError::Os {
        path: path.to_owned(),
        message: explain(errno),
    };
    let dir = match rustix::fs::openat(&opened.dir, name, DIRECTORY, Mode::empty()) {
        Ok(dir) => dir,
        Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => return Ok(false),
        Err(errno) => return Err(os(errno)),
    };
    let size = |source: SizeError| SizedError::Size {
        path: path.to_owned(),
        source,
    };
    if !backend.is_volume(&dir).map_err(size)? {
        return Ok(false);
    }
    let mark = marked_for(&dir).map_err(os)?;
    if mark.as_deref() != Some(pv) && mark.as_deref() != Some(COPIED) {
        return Err(SizedError::NotOurs {
            path: path.to_owned(),
            pv: pv.to_owned(),
        });
    }
    drop(dir);
    backend.destroy(&opened.dir, name).map_err(size)?;
    Ok(true)
}

/// Opens `path`'s parent directory for [`make`] from the `O_PATH` descriptor a walk ended on.
pub fn reopen(o_path: &OwnedFd) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        o_path,
        ".",
        DIRECTORY.difference(OFlags::NOFOLLOW),
        Mode::empty(),
    )
}
