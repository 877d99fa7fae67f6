//! `rename-at` behind the guard ([`super::sandbox_fs`]): no link moved, and no served path or
//! directory above one moved or replaced ([`super::served`]).
//!
//! ```text
//! parents of source and destination ─ openat2 beneath their descriptors (as cap-std resolves)
//!   ─ source a link? ─▶ refused
//!   ─ real paths (/proc/self/fd) ─ source or destination a served path or above one? ─▶ refused
//!     (checked and announced to the index as a move in one step: no path at or below either
//!     can be reserved until the rename returned, and the index is not locked meanwhile)
//!   ─ renameat on the checked parents
//!   ─ destination a link afterwards (a pod swapped the source)? ─▶ removed, refused
//! ```

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags};
use wasmtime_wasi::p2::bindings::filesystem::types::ErrorCode;

/// Why a guarded rename did not happen.
pub enum RenameError {
    /// The OS (or the path) said no.
    Code(ErrorCode),
    /// The guard said no, and why (for the debug log).
    Refused(String),
}

impl From<rustix::io::Errno> for RenameError {
    fn from(errno: rustix::io::Errno) -> Self {
        RenameError::Code(errno_code(errno))
    }
}

fn errno_code(errno: rustix::io::Errno) -> ErrorCode {
    match errno {
        rustix::io::Errno::XDEV => ErrorCode::NotPermitted,
        rustix::io::Errno::NOSYS => ErrorCode::Unsupported,
        errno => std::io::Error::from(errno).into(),
    }
}

/// The directory holding the last component of `path`, opened beneath `dir` as cap-std
/// resolves it (links followed while they stay beneath), and that component.
/// Works on bytes: a name that is not UTF-8 arrives here mapped back from its stand-in
/// ([`super::rawname`]).
fn parent_beneath(dir: &std::fs::File, path: &Path) -> Result<(OwnedFd, OsString), RenameError> {
    use rustix::fs::ResolveFlags;
    let bytes = path.as_os_str().as_bytes();
    let end = bytes.iter().rposition(|&b| b != b'/').map_or(0, |i| i + 1);
    let trimmed = &bytes[..end];
    let (parent, name): (&[u8], &[u8]) = match trimmed.iter().rposition(|&b| b == b'/') {
        Some(0) => (b"/", &trimmed[1..]),
        Some(at) => (&trimmed[..at], &trimmed[at + 1..]),
        None => (b".", trimmed),
    };
    if matches!(name, b"" | b"." | b"..") {
        return Err(RenameError::Code(ErrorCode::Invalid));
    }
    let (parent, name) = (OsStr::from_bytes(parent), OsStr::from_bytes(name));
    let fd = rustix::fs::openat2(
        dir.as_fd(),
        parent,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    )?;
    Ok((fd, name.to_owned()))
}

/// Where an open directory is now, in this process' filesystem.
fn real_path(fd: &OwnedFd) -> Result<std::path::PathBuf, RenameError> {
    use std::os::fd::AsRawFd;
    let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| RenameError::Code(e.into()))?;
    if path.to_string_lossy().ends_with(" (deleted)") {
        return Err(RenameError::Code(ErrorCode::NoEntry));
    }
    Ok(path)
}

fn is_link_at(dir: &OwnedFd, name: &OsStr) -> Result<bool, rustix::io::Errno> {
    let stat = rustix::fs::statat(dir, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)?;
    Ok(FileType::from_raw_mode(stat.st_mode) == FileType::Symlink)
}

/// `rename-at` behind the guard: the source may not be a link, and neither the source nor the
/// destination may be a served path or lie above one ([`super::served`]); the rename is done
/// on the very directories checked. A destination that is a link afterwards (a pod swapped the
/// source in between) is removed and the call refused. The rename can wait on a lock a pod
/// holds for as long as the pod likes, so the served index is not locked across it: the move is
/// announced to it, and volumes at or below either path wait until the rename returned.
pub fn checked_rename(
    old_dir: &std::fs::File,
    old_path: &Path,
    new_dir: &std::fs::File,
    new_path: &Path,
) -> Result<(), RenameError> {
    let (old_parent, old_name) = parent_beneath(old_dir, old_path)?;
    let (new_parent, new_name) = parent_beneath(new_dir, new_path)?;
    if is_link_at(&old_parent, &old_name)? {
        return Err(RenameError::Refused(format!(
            "{} is a symbolic link",
            old_path.display()
        )));
    }
    let source = real_path(&old_parent)?.join(&old_name);
    let destination = real_path(&new_parent)?.join(&new_name);
    let moving = super::served::served()
        .begin_move([source.as_path(), destination.as_path()])
        .map_err(|(path, served)| {
            RenameError::Refused(format!(
                "{} is or holds the served path {}",
                path.display(),
                served.display()
            ))
        })?;
    rustix::fs::renameat(&old_parent, &old_name, &new_parent, &new_name)?;
    drop(moving);
    if is_link_at(&new_parent, &new_name).unwrap_or(false) {
        rustix::fs::unlinkat(&new_parent, &new_name, rustix::fs::AtFlags::empty())?;
        return Err(RenameError::Refused(format!(
            "{} was a symbolic link after the rename",
            new_path.display()
        )));
    }
    Ok(())
}
