//! Paths a guest names to a host function (`copy-tree`, `destroy-volume`): the granted
//! directory that holds one, and the directory opened beneath it with no link in any component.
//!
//! A guest sees its granted directories at their `guest` paths; a host function that works on
//! one of its paths maps it to the innermost granted directory whose guest path holds it, opens
//! that directory by its host path (the operator's, as its preopen is opened) and everything
//! below with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`: a link anywhere below the
//! granted directory, a pod's or the guest's, is refused, never followed.

use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::grants::{DirAccess, DirGrant, Grants};

/// Why a path a guest named cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuestPathError {
    /// Not absolute, with `..`, or without a name at its end.
    #[error("{0}: not an absolute path without `..`, with a name at its end")]
    BadPath(String),
    /// No granted directory (of the access needed) holds the path.
    #[error("{path} lies in no directory granted{access} to this guest")]
    NotGranted {
        /// The path, as the guest gave it.
        path: String,
        /// ` read-write` when writing, empty when reading.
        access: &'static str,
    },
    /// Opening it failed: a link in a component, a missing directory.
    #[error("{path}: {message}")]
    Open {
        /// The path, as the guest gave it.
        path: String,
        /// The OS error, explained.
        message: String,
    },
}

impl GuestPathError {
    /// The same error about `path` (the entry a parent was opened for) where it named the
    /// parent as not granted.
    pub fn naming(self, path: &str) -> GuestPathError {
        match self {
            GuestPathError::NotGranted { access, .. } => GuestPathError::NotGranted {
                path: path.to_owned(),
                access,
            },
            other => other,
        }
    }
}

/// A directory a guest named, opened, and the grant it lies in.
#[derive(Debug)]
pub struct OpenedDir<'g> {
    /// The granted directory holding it.
    pub grant: &'g DirGrant,
    /// The directory (`O_RDONLY | O_DIRECTORY`).
    pub dir: OwnedFd,
}

/// `path`'s parent and last component (which is neither `.` nor `..`).
pub fn split(path: &str) -> Result<(&str, &str), GuestPathError> {
    let bad = || GuestPathError::BadPath(path.to_owned());
    let trimmed = path.trim_end_matches('/');
    let (parent, name) = trimmed.rsplit_once('/').ok_or_else(bad)?;
    if matches!(name, "" | "." | "..") {
        return Err(bad());
    }
    Ok((if parent.is_empty() { "/" } else { parent }, name))
}

/// The granted directory (read-write ones only when `writable`) whose guest path holds
/// `path`, the innermost, and the rest of `path` below it.
fn granted<'g>(grants: &'g Grants, path: &str, writable: bool) -> Option<(&'g DirGrant, PathBuf)> {
    grants
        .dirs
        .iter()
        .filter(|d| !writable || d.access == DirAccess::ReadWrite)
        .filter_map(|d| {
            let rest = Path::new(path).strip_prefix(&d.guest).ok()?;
            Some((d, rest.to_path_buf()))
        })
        .max_by_key(|(d, _)| Path::new(&d.guest).components().count())
}

/// Opens the directory `path` (as the guest names it) beneath its granted directory.
pub fn open_dir<'g>(
    grants: &'g Grants,
    path: &str,
    writable: bool,
) -> Result<OpenedDir<'g>, GuestPathError> {
    let plain = Path::new(path).is_absolute()
        && Path::new(path)
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !plain {
        return Err(GuestPathError::BadPath(path.to_owned()));
    }
    let Some((grant, rest)) = granted(grants, path, writable) else {
        return Err(GuestPathError::NotGranted {
            path: path.to_owned(),
            access: if writable { " read-write" } else { "" },
        });
    };
    let failed = |errno: Errno| GuestPathError::Open {
        path: path.to_owned(),
        message: explain(errno),
    };
    let root = rustix::fs::open(
        &grant.host,
        DIRECTORY.difference(OFlags::NOFOLLOW),
        Mode::empty(),
    )
    .map_err(failed)?;
    let rest = if rest.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rest.as_path()
    };
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let dir =
        rustix::fs::openat2(&root, rest, DIRECTORY, Mode::empty(), resolve).map_err(failed)?;
    Ok(OpenedDir { grant, dir })
}

/// Opening a directory: read-only, never through a link, never blocking on a FIFO.
pub const DIRECTORY: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::NONBLOCK)
    .union(OFlags::CLOEXEC);

/// An OS error as a guest should read it: the ones a link causes say so.
pub fn explain(errno: Errno) -> String {
    match errno {
        Errno::LOOP | Errno::XDEV => "a component is a symbolic link (never followed)".to_owned(),
        // O_DIRECTORY|O_NOFOLLOW on a link says "not a directory".
        Errno::NOTDIR => "not a directory, or a symbolic link (never followed)".to_owned(),
        errno => std::io::Error::from(errno).to_string(),
    }
}
