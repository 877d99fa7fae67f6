//! `host.copy-tree`: the host copies a directory a guest names into a new directory (a clone's
//! data), by descriptor, keeping links as links, modes, and the owners the grant allows.
//!
//! ```text
//! source (any granted dir), target (new, in a read-write one): openat2 beneath the grant,
//!   no link in any component ─▶ target created, its (dev, ino) never copied into itself
//! each entry of a directory held open, as it is now (never followed):
//!   directory ─▶ mkdir 0700 ─▶ descend ─▶ owner, mode        (two descriptors per level)
//!   file      ─▶ open O_NOFOLLOW|O_NONBLOCK, still a file? ─▶ new file (O_EXCL) ─▶ data
//!                (copy_file_range: reflinks where the filesystem can) ─▶ owner, mode
//!   link      ─▶ readlink ─▶ symlink with the same text ─▶ owner  (its target never read)
//!   FIFO, socket, device ─▶ left out, counted
//! ```
//!
//! Why in the host: WASI has no chmod, chown or stat of modes and owners, and the sandbox
//! refuses every `symlink-at` (a guest must never turn a path into a link); so a copy a guest
//! makes itself loses the links, modes and owners a clone's user relies on (a database refuses
//! a data directory it does not own). The host does it without widening what a guest can do:
//! only directories the grant gives it, links made only inside the new directory, owners only
//! from the grant's `[volumes] uids`/`gids` (or the host's own), setuid and setgid bits never
//! set on a copied file (a guest could otherwise plant a setuid binary of its choosing in a
//! volume of another namespace). Bounded like any other host function: by the call's deadline
//! (checked between entries and between 16 MiB chunks), by the call's descriptor cap (the copy
//! counts what it holds, [`super::handles`]), and without keeping any listing in memory.

use std::ffi::CStr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use rustix::fs::{AtFlags, Dir, FileType, Gid, Mode, OFlags, Stat, Uid};
use rustix::io::Errno;

use super::grants::Grants;
use super::guest_path::{self, DIRECTORY, GuestPathError, explain};
use super::ownership::IdRange;
use super::sized;
use crate::sizes::SizeBackend;

/// Bytes one `copy_file_range` (or read and write) moves before the deadline is looked at again.
const CHUNK: usize = 16 << 20;
/// Directories deep a copy goes at most, whatever the descriptor cap allows.
pub const MAX_DEPTH: usize = 256;

/// What a copy did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Copied {
    /// Directories, files and links made.
    pub entries: u64,
    /// Bytes of file contents copied.
    pub bytes: u64,
    /// Of the entries, links (recreated with the same text).
    pub links: u64,
    /// FIFOs, sockets and devices left out.
    pub skipped: u64,
    /// Entries whose granted owner the filesystem would not let the host give (an NFS export
    /// that squashes root, a host without `CAP_CHOWN`): they belong to the host's user.
    pub owners_not_kept: u64,
    /// The copy is a snapshot of the source volume the host made (a size-enforcing directory):
    /// instant and whole, the counts above not counted.
    pub snapshot: bool,
}

/// Why a copy was refused or stopped; the partial copy is the guest's to remove.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// A path the guest named cannot be used (not granted, a link in it, missing).
    #[error(transparent)]
    Path(#[from] GuestPathError),
    /// Making the target failed (it exists, or a link took its place).
    #[error("{path}: {message}")]
    Open {
        /// The path, as the guest gave it.
        path: String,
        /// The OS error.
        message: String,
    },
    /// The deadline passed.
    #[error("out of time after {} entries and {} bytes", .0.entries, .0.bytes)]
    OutOfTime(Copied),
    /// The tree nests deeper than the descriptors the call has left allow.
    #[error(
        "{at}: nests deeper than {levels} directories, as many as limits.descriptors leaves this call (two per level)"
    )]
    TooDeep {
        /// Where, below the source.
        at: String,
        /// Levels the copy could go.
        levels: usize,
    },
    /// An entry is owned by an id the grant does not let this guest hand out.
    #[error(
        "{at} is owned by {kind} {id}, which the grant's [volumes] {kind}s do not include (widen them to clone it)"
    )]
    OwnerNotGranted {
        /// Where, below the source.
        at: String,
        /// `uid` or `gid`.
        kind: &'static str,
        /// The id.
        id: u32,
    },
    /// A call failed.
    #[error("{at}: {message}")]
    At {
        /// Where, below the source.
        at: String,
        /// The OS error.
        message: String,
    },
}

/// The ids a copy may give its entries: the grant's ranges and the host's own.
#[derive(Debug, Clone)]
pub struct Owners {
    uids: Vec<IdRange>,
    gids: Vec<IdRange>,
    own_uid: u32,
    own_gid: u32,
}

impl Owners {
    /// The ids `grants` allow, with this process' own.
    pub fn of(grants: &Grants) -> Owners {
        Owners {
            uids: grants.volumes.uids.clone(),
            gids: grants.volumes.gids.clone(),
            own_uid: rustix::process::geteuid().as_raw(),
            own_gid: rustix::process::getegid().as_raw(),
        }
    }

    /// What to give an entry whose source has `stat`'s ids: `None` for an id that is the
    /// host's own (nothing to change).
    fn for_entry(&self, stat: &Stat, at: &str) -> Result<(Option<u32>, Option<u32>), CopyError> {
        let pick = |id: u32, own: u32, ranges: &[IdRange], kind| {
            if id == own {
                Ok(None)
            } else if ranges.iter().any(|r| r.contains(id)) {
                Ok(Some(id))
            } else {
                Err(CopyError::OwnerNotGranted {
                    at: at.to_owned(),
                    kind,
                    id,
                })
            }
        };
        Ok((
            pick(stat.st_uid, self.own_uid, &self.uids, "uid")?,
            pick(stat.st_gid, self.own_gid, &self.gids, "gid")?,
        ))
    }
}

/// The source and the target's parent, opened; what [`copy`] works from.
#[derive(Debug)]
pub struct Resolved {
    source: OwnedFd,
    target_parent: OwnedFd,
    /// How the target's granted directory enforces sizes, if it does.
    target_sizes: Option<SizeBackend>,
    target_name: String,
    source_path: String,
    target_path: String,
}

/// Opens `source` (in any granted directory) and `target`'s parent (in a read-write one) as
/// the guest names them, each beneath its granted directory with no link in any component.
pub fn resolve(grants: &Grants, source: &str, target: &str) -> Result<Resolved, CopyError> {
    let (target_parent, target_name) = guest_path::split(target)?;
    let opened_source = guest_path::open_dir(grants, source, false)?.dir;
    let opened_parent =
        guest_path::open_dir(grants, target_parent, true).map_err(|error| error.naming(target))?;
    let target_sizes = opened_parent.grant.sizes;
    let opened_parent = opened_parent.dir;
    Ok(Resolved {
        source: opened_source,
        target_parent: opened_parent,
        target_sizes,
        target_name: target_name.to_owned(),
        source_path: source.to_owned(),
        target_path: target.to_owned(),
    })
}

/// One descriptor the copy holds, counted until dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A descriptor and its slot.
struct Held<T> {
    inner: T,
    slot: Slot,
}

/// One copy under way.
struct Copy {
    deadline: Instant,
    owners: Owners,
    /// Descriptors held now (also read by the call's guard) and the most the copy may hold.
    held: Arc<AtomicUsize>,
    max_held: usize,
    /// The target directory, never copied into itself.
    target: (u64, u64),
    done: Copied,
    /// For filesystems `copy_file_range` cannot serve (allocated on first use).
    buffer: Vec<u8>,
}

/// Copies what `resolved` names: the source's entries into a new directory at the target,
/// then the source's owner (where granted) and mode onto it. `held` counts the descriptors
/// the copy holds, never more than `max_held`.
pub fn copy(
    resolved: Resolved,
    owners: Owners,
    deadline: Instant,
    held: Arc<AtomicUsize>,
    max_held: usize,
) -> Result<Copied, CopyError> {
    let Resolved {
        source,
        target_parent,
        target_sizes,
        target_name,
        source_path,
        target_path,
    } = resolved;
    let made = |errno: Errno| CopyError::Open {
        path: target_path.clone(),
        message: explain(errno),
    };
    let target = match target_sizes {
        // Where sizes are enforced, the host made volume is the copy itself: a snapshot of a
        // source volume (instant, whole), or a new one the entries are copied into.
        Some(backend) => {
            match sized::copy_volume(backend, &source, &target_parent, &target_name).map_err(
                |error| CopyError::Open {
                    path: target_path.clone(),
                    message: error.to_string(),
                },
            )? {
                sized::CopyVolume::Snapshot => {
                    return Ok(Copied {
                        entries: 1,
                        snapshot: true,
                        ..Copied::default()
                    });
                }
                sized::CopyVolume::Empty(volume) => volume,
            }
        }
        None => {
            rustix::fs::mkdirat(
                &target_parent,
                target_name.as_str(),
                Mode::from_raw_mode(0o700),
            )
            .map_err(made)?;
            rustix::fs::openat(
                &target_parent,
                target_name.as_str(),
                DIRECTORY,
                Mode::empty(),
            )
            .map_err(made)?
        }
    };
    drop(target_parent);
    let stat = rustix::fs::fstat(&target).map_err(made)?;
    let mut copy = Copy {
        deadline,
        owners,
        held,
        max_held,
        target: (stat.st_dev, stat.st_ino),
        done: Copied::default(),
        buffer: Vec::new(),
    };
    let source = copy.counted(source);
    let target = copy.counted(target);
    copy.directory(source, &target, &mut source_path.clone(), 1)?;
    copy.done.entries += 1;
    Ok(copy.done)
}

impl Copy {
    fn counted<T>(&self, inner: T) -> Held<T> {
        self.held.fetch_add(1, Ordering::Relaxed);
        Held {
            inner,
            slot: Slot(Arc::clone(&self.held)),
        }
    }

    /// Opens with `open` if the copy may hold one more descriptor.
    fn open(
        &self,
        at: &str,
        levels: usize,
        open: impl FnOnce() -> rustix::io::Result<OwnedFd>,
    ) -> Result<Option<Held<OwnedFd>>, CopyError> {
        if self.held.load(Ordering::Relaxed) >= self.max_held {
            return Err(CopyError::TooDeep {
                at: at.to_owned(),
                levels,
            });
        }
        match open() {
            Ok(fd) => Ok(Some(self.counted(fd))),
            // Removed by a pod since it was listed: there is nothing to copy.
            Err(Errno::NOENT) => Ok(None),
            Err(errno) => Err(failed(at, errno)),
        }
    }

    fn in_time(&self) -> Result<(), CopyError> {
        if Instant::now() >= self.deadline {
            return Err(CopyError::OutOfTime(self.done));
        }
        Ok(())
    }

    /// Copies the entries of `source` into `target`, then gives `target` the source's owner
    /// and mode. `at` is the source's path (for errors), `depth` its level.
    fn directory(
        &mut self,
        source: Held<OwnedFd>,
        target: &Held<OwnedFd>,
        at: &mut String,
        depth: usize,
    ) -> Result<(), CopyError> {
        let stat = rustix::fs::fstat(&source.inner).map_err(|e| failed(at, e))?;
        // The listing owns the descriptor now; it stays counted through `slot`.
        let Held { inner, slot } = source;
        let mut listing = Dir::new(inner).map_err(|e| failed(at, e))?;
        let levels = (self.max_held / 2).min(MAX_DEPTH);
        while let Some(entry) = listing.read() {
            let entry = entry.map_err(|e| failed(at, e))?;
            let name = entry.file_name();
            if matches!(name.to_bytes(), b"." | b"..") {
                continue;
            }
            self.in_time()?;
            let dir = listing.fd().map_err(|e| failed(at, e))?;
            let length = at.len();
            at.push('/');
            at.push_str(&String::from_utf8_lossy(name.to_bytes()));
            self.entry(dir, name, target, at, depth, levels)?;
            at.truncate(length);
        }
        drop(listing);
        drop(slot);
        self.attributes(&target.inner, &stat, true, at)
    }

    fn entry(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &CStr,
        target: &Held<OwnedFd>,
        at: &mut String,
        depth: usize,
        levels: usize,
    ) -> Result<(), CopyError> {
        let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => return Ok(()),
            Err(errno) => return Err(failed(at, errno)),
        };
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Directory => {
                if (stat.st_dev, stat.st_ino) == self.target {
                    return Ok(());
                }
                if depth >= MAX_DEPTH {
                    return Err(CopyError::TooDeep {
                        at: at.clone(),
                        levels,
                    });
                }
                let Some(source) = self.open(at, levels, || {
                    rustix::fs::openat(dir, name, DIRECTORY, Mode::empty())
                })?
                else {
                    return Ok(());
                };
                rustix::fs::mkdirat(&target.inner, name, Mode::from_raw_mode(0o700))
                    .map_err(|e| failed(at, e))?;
                let Some(made) = self.open(at, levels, || {
                    rustix::fs::openat(&target.inner, name, DIRECTORY, Mode::empty())
                })?
                else {
                    return Err(failed(at, Errno::NOENT));
                };
                self.directory(source, &made, at, depth + 1)?;
                self.done.entries += 1;
            }
            FileType::RegularFile => {
                let reading = OFlags::RDONLY
                    | OFlags::NOFOLLOW
                    | OFlags::NONBLOCK
                    | OFlags::NOCTTY
                    | OFlags::CLOEXEC;
                let Some(source) = self.open(at, levels, || {
                    rustix::fs::openat(dir, name, reading, Mode::empty())
                })?
                else {
                    return Ok(());
                };
                // What was opened, not what was listed: a pod may have swapped in a FIFO.
                let stat = rustix::fs::fstat(&source.inner).map_err(|e| failed(at, e))?;
                if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
                    self.done.skipped += 1;
                    return Ok(());
                }
                let writing = OFlags::WRONLY
                    | OFlags::CREATE
                    | OFlags::EXCL
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC;
                let Some(made) = self.open(at, levels, || {
                    rustix::fs::openat(&target.inner, name, writing, Mode::from_raw_mode(0o600))
                })?
                else {
                    return Err(failed(at, Errno::NOENT));
                };
                self.data(&source.inner, &made.inner, at)?;
                self.attributes(&made.inner, &stat, false, at)?;
                self.done.entries += 1;
            }
            FileType::Symlink => {
                let text = match rustix::fs::readlinkat(dir, name, Vec::new()) {
                    Ok(text) => text,
                    Err(Errno::NOENT) => return Ok(()),
                    Err(errno) => return Err(failed(at, errno)),
                };
                rustix::fs::symlinkat(text.as_c_str(), &target.inner, name)
                    .map_err(|e| failed(at, e))?;
                let (uid, gid) = self.owners.for_entry(&stat, at)?;
                if uid.is_some() || gid.is_some() {
                    let changed = rustix::fs::chownat(
                        &target.inner,
                        name,
                        uid.map(Uid::from_raw),
                        gid.map(Gid::from_raw),
                        AtFlags::SYMLINK_NOFOLLOW,
                    );
                    self.owner_result(changed, at)?;
                }
                self.done.entries += 1;
                self.done.links += 1;
            }
            _ => self.done.skipped += 1,
        }
        Ok(())
    }

    /// The contents of `from` into `to`, in chunks, looking at the deadline between them.
    fn data(&mut self, from: &OwnedFd, to: &OwnedFd, at: &str) -> Result<(), CopyError> {
        let mut by_range = true;
        loop {
            self.in_time()?;
            let moved = if by_range {
                match rustix::fs::copy_file_range(from, None, to, None, CHUNK) {
                    Ok(moved) => moved,
                    Err(Errno::XDEV | Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) => {
                        by_range = false;
                        continue;
                    }
                    Err(errno) => return Err(failed(at, errno)),
                }
            } else {
                self.buffer.resize(CHUNK.min(1 << 20), 0);
                let read =
                    rustix::io::read(from, &mut self.buffer[..]).map_err(|e| failed(at, e))?;
                let mut written = 0;
                while written < read {
                    written += rustix::io::write(to, &self.buffer[written..read])
                        .map_err(|e| failed(at, e))?;
                }
                read
            };
            if moved == 0 {
                return Ok(());
            }
            self.done.bytes += moved as u64;
        }
    }

    /// The source's owner (where granted) and mode onto a made file or directory: owner first,
    /// since a change of owner clears setuid bits. Setuid never, setgid only on directories.
    fn attributes(
        &mut self,
        made: &OwnedFd,
        source: &Stat,
        directory: bool,
        at: &str,
    ) -> Result<(), CopyError> {
        let (uid, gid) = self.owners.for_entry(source, at)?;
        if uid.is_some() || gid.is_some() {
            let changed = rustix::fs::fchown(made, uid.map(Uid::from_raw), gid.map(Gid::from_raw));
            self.owner_result(changed, at)?;
        }
        let kept = if directory { 0o3777 } else { 0o1777 };
        rustix::fs::fchmod(made, Mode::from_raw_mode(source.st_mode & kept))
            .map_err(|e| failed(at, e))
    }

    fn owner_result(&mut self, changed: rustix::io::Result<()>, at: &str) -> Result<(), CopyError> {
        match changed {
            Ok(()) => Ok(()),
            Err(Errno::PERM) => {
                self.done.owners_not_kept += 1;
                Ok(())
            }
            Err(errno) => Err(failed(at, errno)),
        }
    }
}

fn failed(at: &str, errno: Errno) -> CopyError {
    CopyError::At {
        at: at.to_owned(),
        message: explain(errno),
    }
}

#[cfg(test)]
#[path = "copy_tests.rs"]
mod tests;
