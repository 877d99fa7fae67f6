//! The btrfs backend: a volume is a subvolume, its size the referenced-bytes limit of its level-0 qgroup (`0/<subvolume id>`).
//!
//! Everything goes through descriptors: the directory a volume lives in (`parent`) and the
//! volume's own root directory. Names are single path components, looked up by the kernel in
//! `parent` only. The quota ioctls (`QGROUP_LIMIT`, `QGROUP_CREATE`, `TREE_SEARCH`,
//! `QUOTA_CTL`) need `CAP_SYS_ADMIN`, so the backend runs as root; `SNAP_DESTROY` then deletes a
//! non-empty subvolume without the `user_subvol_rm_allowed` mount option.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{Access, AtFlags, Mode, OFlags};
use rustix::io::Errno;

use super::ioctl;
use super::{Probe, Quotas, SizeError, Usage};

/// `BTRFS_SUPER_MAGIC`, the `f_type` of `fstatfs` on btrfs.
pub const SUPER_MAGIC: u64 = 0x9123_683e;
pub use super::ioctl::FIRST_FREE_OBJECTID;
/// `BTRFS_FS_TREE_OBJECTID`: the top-level subvolume, never a volume.
const FS_TREE_OBJECTID: u64 = 5;
/// `BTRFS_QUOTA_TREE_OBJECTID`.
const QUOTA_TREE_OBJECTID: u64 = 8;
/// `BTRFS_QGROUP_STATUS_KEY`: the one item (0, 240, 0) saying whether quotas are on.
const QGROUP_STATUS_KEY: u32 = 240;
/// `BTRFS_QGROUP_INFO_KEY`: one item (0, 242, qgroupid) per qgroup, its usage.
const QGROUP_INFO_KEY: u32 = 242;
/// `BTRFS_QGROUP_LIMIT_KEY`: one item (0, 244, qgroupid) per qgroup, its limits.
const QGROUP_LIMIT_KEY: u32 = 244;
/// `BTRFS_QGROUP_STATUS_FLAG_ON`.
const STATUS_FLAG_ON: u64 = 1 << 0;
/// `BTRFS_QGROUP_STATUS_FLAG_INCONSISTENT`: the numbers are wrong until a rescan.
const STATUS_FLAG_INCONSISTENT: u64 = 1 << 2;
/// `BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE`: simple quotas.
const STATUS_FLAG_SIMPLE_MODE: u64 = 1 << 3;
/// A referenced-bytes limit of all ones: no limit (what `btrfs qgroup limit none` sets).
const NO_LIMIT: u64 = u64::MAX;
/// `BTRFS_QGROUP_LEVEL_SHIFT`: a qgroup id is `level << 48 | id`; level 0 ids are subvolume ids.
const QGROUP_LEVEL_SHIFT: u32 = 48;

/// An ioctl's (or system call's) failure, named.
fn os(op: &'static str) -> impl FnOnce(Errno) -> SizeError {
    move |source| SizeError::Os { op, source }
}

/// Refuses a directory that is not on btrfs.
fn require_btrfs(fd: BorrowedFd<'_>) -> Result<(), SizeError> {
    let magic = filesystem_magic(fd)?;
    if magic == SUPER_MAGIC {
        Ok(())
    } else {
        Err(SizeError::NotBtrfs { magic })
    }
}

/// The `f_type` of the filesystem `fd` is on.
fn filesystem_magic(fd: BorrowedFd<'_>) -> Result<u64, SizeError> {
    let st = rustix::fs::fstatfs(fd).map_err(os("fstatfs"))?;
    // A magic number in a word that is signed on some targets: its low 32 bits are what count.
    Ok(st.f_type as u64 & 0xffff_ffff)
}

/// Reads the quota status item; `Off` when the quota tree does not exist.
pub fn quotas(dir: impl AsFd) -> Result<Quotas, SizeError> {
    let dir = dir.as_fd();
    require_btrfs(dir)?;
    match ioctl::tree_search(dir, QUOTA_TREE_OBJECTID, 0, QGROUP_STATUS_KEY, 0..=0) {
        Err(Errno::NOENT) => Ok(Quotas::Off),
        Err(Errno::PERM) => Err(SizeError::NotPrivileged),
        Err(source) => Err(SizeError::Os {
            op: "BTRFS_IOC_TREE_SEARCH (quota status)",
            source,
        }),
        Ok(items) => {
            // struct btrfs_qgroup_status_item { version, generation, flags, rescan } (__le64).
            let flags = items.first().and_then(|item| le64(&item.data, 2));
            Ok(match flags {
                Some(flags) if flags & STATUS_FLAG_ON == 0 => Quotas::Off,
                Some(flags) if flags & STATUS_FLAG_SIMPLE_MODE != 0 => Quotas::Simple,
                Some(flags) if flags & STATUS_FLAG_INCONSISTENT != 0 => Quotas::Inconsistent,
                Some(_) => Quotas::Full,
                None => Quotas::Off,
            })
        }
    }
}

/// The `index`th little-endian `u64` of an item.
fn le64(data: &[u8], index: usize) -> Option<u64> {
    let bytes = data.get(index * 8..index * 8 + 8)?;
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// Probes `dir`: btrfs or not, quota state (enabling quotas first when `enable_quotas`), and
/// whether subvolumes can be created in it. Errors: [`SizeError::NotBtrfs`],
/// [`SizeError::NotPrivileged`], or a failed ioctl; a missing quota or access is reported in
/// the [`Probe`] (see [`Probe::require`]).
pub fn probe(dir: impl AsFd, enable_quotas: bool) -> Result<Probe, SizeError> {
    let dir = dir.as_fd();
    require_btrfs(dir)?;
    let read_only = rustix::fs::fstatvfs(dir)
        .map_err(os("fstatvfs"))?
        .f_flag
        .contains(rustix::fs::StatVfsMountFlags::RDONLY);
    let mut state = quotas(dir)?;
    // Read-only, enabling would fail with EROFS; the probe reports both instead.
    if state == Quotas::Off && enable_quotas && !read_only {
        enable(dir)?;
        state = quotas(dir)?;
    }
    let writable = rustix::fs::accessat(
        dir,
        ".",
        Access::WRITE_OK | Access::EXEC_OK,
        AtFlags::EACCESS,
    )
    .is_ok();
    // A volume is made and deleted again, as every volume will be: what permissions and quotas
    // say is not all the kernel checks (an LSM, a mount that refuses subvolumes).
    let volumes = if state == Quotas::Simple && writable && !read_only {
        let name = format!(".wasm-provisioner-probe-{}", std::process::id());
        create(dir, &name, 1 << 20)
            .and_then(|volume| {
                drop(volume);
                destroy(dir, &name)
            })
            .map_err(|error| error.to_string())
    } else {
        Err("not tried (quotas, access or a read-only mount first)".to_owned())
    };
    Ok(Probe {
        quotas: state,
        read_only,
        writable,
        volumes,
    })
}

/// `BTRFS_IOC_QUOTA_CTL` with `BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA`: simple quotas (Linux
/// 6.7+; `EINVAL` from an older kernel). Simple quotas need no rescan: data written before they
/// were on is charged to no qgroup, and volumes are made after.
pub fn enable(dir: impl AsFd) -> Result<(), SizeError> {
    let dir = dir.as_fd();
    require_btrfs(dir)?;
    match ioctl::quota_ctl(dir, ioctl::QUOTA_CTL_ENABLE_SIMPLE) {
        Err(Errno::PERM) => Err(SizeError::NotPrivileged),
        other => other.map_err(os("BTRFS_IOC_QUOTA_CTL (enable simple quotas, Linux 6.7+)")),
    }
}

/// `BTRFS_IOC_QUOTA_CTL` with `BTRFS_QUOTA_CTL_ENABLE` (full quotas), then waits for the rescan
/// the kernel starts. Volumes refuse full quotas ([`Quotas::Full`]); this is for tests that
/// show why.
pub fn enable_full(dir: impl AsFd) -> Result<(), SizeError> {
    let dir = dir.as_fd();
    require_btrfs(dir)?;
    match ioctl::quota_ctl(dir, ioctl::QUOTA_CTL_ENABLE) {
        Err(Errno::PERM) => return Err(SizeError::NotPrivileged),
        other => other.map_err(os("BTRFS_IOC_QUOTA_CTL (enable)"))?,
    }
    ioctl::quota_rescan_wait(dir).map_err(os("BTRFS_IOC_QUOTA_RESCAN_WAIT"))
}

/// The level-1 qgroup `1/<id>` of the volume whose subvolume is `id`: it holds the volume's
/// limit, and every subvolume made inside the volume joins it (simple quotas), so what they
/// hold counts against that limit too.
pub fn volume_qgroup(id: u64) -> u64 {
    (1 << QGROUP_LEVEL_SHIFT) | id
}

/// Whether `dir` is the root directory of a btrfs subvolume (inode 256 on btrfs); `false` on
/// any other filesystem.
pub fn is_subvolume(dir: impl AsFd) -> Result<bool, SizeError> {
    let dir = dir.as_fd();
    if filesystem_magic(dir)? != SUPER_MAGIC {
        return Ok(false);
    }
    let st = rustix::fs::fstat(dir).map_err(os("fstat"))?;
    Ok(
        st.st_ino == FIRST_FREE_OBJECTID
            && rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir(),
    )
}

/// The id of the subvolume whose root directory `volume` is; refuses anything else,
/// including the top-level subvolume (id 5), which is the whole filesystem.
pub fn subvolume_id(volume: impl AsFd) -> Result<u64, SizeError> {
    let volume = volume.as_fd();
    require_btrfs(volume)?;
    if !is_subvolume(volume)? {
        return Err(SizeError::NotSubvolume);
    }
    let id = ioctl::subvolume_id_of(volume).map_err(os("BTRFS_IOC_INO_LOOKUP"))?;
    if id == FS_TREE_OBJECTID {
        return Err(SizeError::TopLevel);
    }
    Ok(id)
}

/// Checks a volume name: one path component the kernel will take.
fn check_name(name: &str) -> Result<&[u8], SizeError> {
    let invalid = |why: &'static str| SizeError::InvalidName {
        name: name.to_owned(),
        why,
    };
    if name.is_empty() || name == "." || name == ".." {
        return Err(invalid("empty, `.` or `..`"));
    }
    if name.contains('/') || name.contains('\0') {
        return Err(invalid("contains `/` or NUL"));
    }
    if name.len() > 255 {
        return Err(invalid("longer than 255 bytes"));
    }
    Ok(name.as_bytes())
}

/// Checks a limit: at least one byte, and not the kernel's "no limit" value.
fn check_limit(bytes: u64) -> Result<u64, SizeError> {
    if bytes == 0 || bytes == u64::MAX {
        return Err(SizeError::InvalidLimit(bytes));
    }
    Ok(bytes)
}

/// Opens `name` in `parent` as a directory, not following a symlink.
fn open_child(parent: BorrowedFd<'_>, name: &str) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Sets the limit of the volume whose subvolume `volume` is (its root directory) to `bytes`
/// referenced bytes: `BTRFS_IOC_QGROUP_LIMIT` on its level-1 qgroup ([`volume_qgroup`]),
/// spelled out after checking `volume` is a subvolume root (0 would make the kernel take "the
/// subvolume of the fd", which for a plain directory is its enclosing one). Quotas off is
/// `ENOTCONN`.
pub fn set_limit(volume: impl AsFd, bytes: u64) -> Result<(), SizeError> {
    let volume = volume.as_fd();
    let bytes = check_limit(bytes)?;
    let id = subvolume_id(volume)?;
    match ioctl::qgroup_limit_rfer(volume, volume_qgroup(id), bytes) {
        Err(Errno::NOTCONN) => Err(SizeError::QuotasOff),
        Err(Errno::PERM) => Err(SizeError::NotPrivileged),
        Err(Errno::NOENT) => Err(SizeError::NoQgroup { id }),
        other => other.map_err(os("BTRFS_IOC_QGROUP_LIMIT")),
    }
}

/// Reads the volume's level-1 qgroup: the bytes it and every subvolume made inside it hold
/// (as of the last transaction commit: `syncfs` first for fresh numbers) and its limit.
pub fn usage(volume: impl AsFd) -> Result<Usage, SizeError> {
    let volume = volume.as_fd();
    let id = subvolume_id(volume)?;
    let usage = qgroup(volume, volume_qgroup(id))?.ok_or(SizeError::NoQgroup { id })?;
    Ok(Usage { id, ..usage })
}

/// The qgroup `qgroupid`, or `None` when it does not exist.
fn qgroup(fd: BorrowedFd<'_>, qgroupid: u64) -> Result<Option<Usage>, SizeError> {
    let search =
        |kind| match ioctl::tree_search(fd, QUOTA_TREE_OBJECTID, 0, kind, qgroupid..=qgroupid) {
            Err(Errno::NOENT) => Err(SizeError::QuotasOff),
            Err(Errno::PERM) => Err(SizeError::NotPrivileged),
            other => other.map_err(os("BTRFS_IOC_TREE_SEARCH (qgroup)")),
        };
    // struct btrfs_qgroup_info_item { generation, rfer, rfer_cmpr, excl, excl_cmpr } (__le64).
    let Some(info) = search(QGROUP_INFO_KEY)?.into_iter().next() else {
        return Ok(None);
    };
    // struct btrfs_qgroup_limit_item { flags, max_rfer, max_excl, rsv_rfer, rsv_excl }.
    let limit = search(QGROUP_LIMIT_KEY)?.into_iter().next();
    let max_referenced = limit.and_then(|item| {
        let flags = le64(&item.data, 0)?;
        (flags & ioctl::QGROUP_LIMIT_MAX_RFER != 0)
            .then(|| le64(&item.data, 1))
            .flatten()
    });
    let short = || SizeError::Os {
        op: "BTRFS_IOC_TREE_SEARCH (qgroup info item)",
        source: Errno::IO,
    };
    Ok(Some(Usage {
        id: qgroupid & ((1 << QGROUP_LEVEL_SHIFT) - 1),
        referenced: le64(&info.data, 1).ok_or_else(short)?,
        exclusive: le64(&info.data, 3).ok_or_else(short)?,
        max_referenced,
    }))
}

/// The ids of every qgroup on the filesystem of `fd`, of any level (`level << 48 | id`; level
/// 0 ids are subvolume ids), for tests and audits: a destroyed volume's must not be among them.
pub fn qgroup_ids(fd: impl AsFd) -> Result<Vec<u64>, SizeError> {
    let fd = fd.as_fd();
    require_btrfs(fd)?;
    match ioctl::tree_search(fd, QUOTA_TREE_OBJECTID, 0, QGROUP_INFO_KEY, 0..=u64::MAX) {
        Ok(items) => Ok(items.into_iter().map(|item| item.offset).collect()),
        Err(Errno::NOENT) => Err(SizeError::QuotasOff),
        Err(Errno::PERM) => Err(SizeError::NotPrivileged),
        Err(source) => Err(SizeError::Os {
            op: "BTRFS_IOC_TREE_SEARCH (qgroups)",
            source,
        }),
    }
}

/// The subvolumes made inside subvolume `id` (at any depth), each after those inside it.
pub fn nested_subvolumes(fd: impl AsFd, id: u64) -> Result<Vec<u64>, SizeError> {
    let fd = fd.as_fd();
    let mut found = Vec::new();
    // Depth-first, children pushed before their parent is: deepest first when reversed.
    let mut parents = vec![id];
    while let Some(parent) = parents.pop() {
        let children = match ioctl::tree_search(
            fd,
            ioctl::ROOT_TREE_OBJECTID,
            parent,
            ioctl::ROOT_REF_KEY,
            0..=u64::MAX,
        ) {
            Ok(items) => items,
            Err(Errno::PERM) => return Err(SizeError::NotPrivileged),
            Err(source) => {
                return Err(SizeError::Os {
                    op: "BTRFS_IOC_TREE_SEARCH (subvolume references)",
                    source,
                });
            }
        };
        for child in children {
            found.push(child.offset);
            parents.push(child.offset);
        }
    }
    found.reverse();
    Ok(found)
}

/// Creates the subvolume `name` in `parent` limited to `bytes` referenced bytes, and returns
/// its root directory. A subvolume whose limit could not be set is deleted again before the
/// error is returned ([`SizeError::LimitFailed`]).
pub fn create(parent: impl AsFd, name: &str, bytes: u64) -> Result<OwnedFd, SizeError> {
    let parent = parent.as_fd();
    let raw = check_name(name)?;
    let bytes = check_limit(bytes)?;
    require_btrfs(parent)?;
    ioctl::subvol_create(parent, raw).map_err(os("BTRFS_IOC_SUBVOL_CREATE"))?;
    limit_new(parent, name, bytes)
}

/// Makes the subvolume `name` in `parent` a writable snapshot of the subvolume `source`,
/// limited to `bytes` referenced bytes of its own (the source's limit is not carried over;
/// the snapshot references the source's data, so `bytes` must cover what it holds). Cleaned
/// up like [`create`] when the limit cannot be set.
pub fn snapshot(
    source: impl AsFd,
    parent: impl AsFd,
    name: &str,
    bytes: u64,
) -> Result<OwnedFd, SizeError> {
    let (source, parent) = (source.as_fd(), parent.as_fd());
    let raw = check_name(name)?;
    let bytes = check_limit(bytes)?;
    require_btrfs(parent)?;
    subvolume_id(source)?;
    ioctl::snap_create(parent, source, raw).map_err(os("BTRFS_IOC_SNAP_CREATE_V2"))?;
    limit_new(parent, name, bytes)
}

/// Opens the just-made subvolume `name`, gives it its level-1 qgroup with the limit
/// ([`volume_qgroup`]); deletes both again on any failure.
fn limit_new(parent: BorrowedFd<'_>, name: &str, bytes: u64) -> Result<OwnedFd, SizeError> {
    let mut group = None;
    let limited = open_child(parent, name)
        .map_err(os("openat (new subvolume)"))
        .and_then(|volume| {
            let id = subvolume_id(&volume)?;
            match ioctl::qgroup_create(parent, volume_qgroup(id)) {
                Err(Errno::NOTCONN) => return Err(SizeError::QuotasOff),
                other => other.map_err(os("BTRFS_IOC_QGROUP_CREATE"))?,
            }
            group = Some(volume_qgroup(id));
            ioctl::qgroup_assign(parent, id, volume_qgroup(id), true)
                .map_err(os("BTRFS_IOC_QGROUP_ASSIGN"))?;
            set_limit(&volume, bytes).map(|()| volume)
        });
    match limited {
        Ok(volume) => Ok(volume),
        Err(error) => {
            let mut cleanup = ioctl::snap_destroy(parent, name.as_bytes())
                .err()
                .map(|source| SizeError::Os {
                    op: "BTRFS_IOC_SNAP_DESTROY (cleanup)",
                    source,
                });
            if let Some(group) = group
                && cleanup.is_none()
            {
                cleanup = remove_group(parent, group).err();
            }
            Err(SizeError::LimitFailed {
                name: name.to_owned(),
                source: Box::new(error),
                cleanup: cleanup.map(Box::new),
            })
        }
    }
}

/// Removes a volume's level-1 qgroup (its members went with their subvolumes); one already
/// gone is fine.
fn remove_group(fd: BorrowedFd<'_>, group: u64) -> Result<(), SizeError> {
    match ioctl::qgroup_remove(fd, group) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(source) => Err(SizeError::QgroupLeft {
            id: group & ((1 << QGROUP_LEVEL_SHIFT) - 1),
            source,
        }),
    }
}

/// Deletes the subvolume `name` in `parent`, contents and all, with the subvolumes made inside
/// it (a pod may have made some; the kernel refuses to delete a subvolume that holds another),
/// deepest first and by id (`BTRFS_IOC_SNAP_DESTROY_V2`, no path a pod could have changed),
/// and their qgroups and the volume's level-1 qgroup. Refuses a plain directory
/// ([`SizeError::NotSubvolume`]).
///
/// With quotas on, the volume's level-1 qgroup is removed at once and the deletion committed
/// (`BTRFS_IOC_SYNC`, which also wakes the cleaner thread); each subvolume's `0/<id>` goes when
/// the cleaner has dropped it: kernels since 2024 (6.18 here) remove the qgroup of a dropped
/// subvolume themselves, and a level-0 qgroup cannot be removed while its subvolume still
/// exists (`EBUSY`). [`wait_dropped`] waits for that and removes one the kernel left.
pub fn destroy(parent: impl AsFd, name: &str) -> Result<(), SizeError> {
    let parent = parent.as_fd();
    let raw = check_name(name)?;
    require_btrfs(parent)?;
    let id = {
        let volume = open_child(parent, name).map_err(os("openat (subvolume)"))?;
        subvolume_id(&volume)?
    };
    let nested = nested_subvolumes(parent, id)?;
    let quotas_on = quotas(parent)? != Quotas::Off;
    if quotas_on {
        // Deleting a subvolume reserves metadata charged to its qgroups: a volume its pod
        // filled to the limit could not be deleted (EDQUOT) with the limit in place.
        match ioctl::qgroup_limit_rfer(parent, volume_qgroup(id), NO_LIMIT) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(source) => {
                return Err(SizeError::Os {
                    op: "BTRFS_IOC_QGROUP_LIMIT (lifting the limit before deleting)",
                    source,
                });
            }
        }
    }
    for inner in &nested {
        match ioctl::snap_destroy_by_id(parent, *inner) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(source) => {
                return Err(SizeError::Os {
                    op: "BTRFS_IOC_SNAP_DESTROY_V2 (a subvolume inside the volume)",
                    source,
                });
            }
        }
    }
    ioctl::snap_destroy(parent, raw).map_err(os("BTRFS_IOC_SNAP_DESTROY"))?;
    if quotas_on {
        // The volume's level-1 qgroup goes now, its members taken out of it first; each
        // subvolume's own 0/<id> goes with the subvolume once the cleaner has dropped it (the
        // kernel removes it then). Not waited for here: the cleaner polls once a second, which
        // made every delete take a second or more ([`wait_dropped`] waits, for tests).
        for member in nested.iter().chain([&id]) {
            match ioctl::qgroup_assign(parent, *member, volume_qgroup(id), false) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(source) => {
                    return Err(SizeError::Os {
                        op: "BTRFS_IOC_QGROUP_ASSIGN (removing a member)",
                        source,
                    });
                }
            }
        }
        remove_group(parent, volume_qgroup(id))?;
        // Commits the deletion and wakes the cleaner, so the drop starts now rather than at
        // the next periodic commit.
        ioctl::sync(parent).map_err(os("BTRFS_IOC_SYNC"))?;
    }
    Ok(())
}

/// Waits until the deleted subvolume `id` is dropped, then makes sure its qgroup `0/<id>` is
/// gone (removing it if the kernel did not).
pub fn wait_dropped(fd: impl AsFd, id: u64) -> Result<(), SizeError> {
    let fd = fd.as_fd();
    // The deletion's transaction must commit before the cleaner sees the dead root, and the
    // cleaner be woken: BTRFS_IOC_SYNC does both.
    ioctl::sync(fd).map_err(os("BTRFS_IOC_SYNC"))?;
    match ioctl::subvol_sync_wait(fd, id) {
        // ENOENT: dropped (6.18 answers ENOENT after a wait, not 0, and so does a subvolume
        // already gone on the first look); ENOTTY: a kernel that predates the ioctl (the removal below then
        // says EBUSY if the subvolume is still there).
        Ok(()) | Err(Errno::NOENT | Errno::NOTTY) => {}
        Err(source) => {
            return Err(SizeError::Os {
                op: "BTRFS_IOC_SUBVOL_SYNC_WAIT",
                source,
            });
        }
    }
    // The kernel's own removal runs in the cleaner right after the drop; commit so its result
    // (and the final accounting) is in place before looking.
    rustix::fs::syncfs(fd).map_err(os("syncfs"))?;
    if qgroup(fd, id)?.is_none() {
        return Ok(());
    }
    match ioctl::qgroup_remove(fd, id) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(source) => Err(SizeError::QgroupLeft { id, source }),
    }
}
