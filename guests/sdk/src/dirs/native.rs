//! The walk's calls natively (unit tests of the SDK and of guests): `openat`, `unlinkat` and
//! `renameat` relative to descriptors, the same calls the host makes for a guest. Only the
//! root a volume is looked for from is opened by path (following links: natively nothing is
//! sandboxed).

use std::os::fd::OwnedFd;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::walk::{Failure, Kind, Tree};

/// This process' filesystem.
pub struct Native;

fn failure(errno: Errno) -> Failure {
    match errno {
        Errno::NOENT => Failure::NoEntry,
        Errno::NOTDIR | Errno::LOOP => Failure::NotDirectory,
        Errno::ISDIR => Failure::IsDirectory,
        Errno::NOTEMPTY | Errno::EXIST => Failure::NotEmpty,
        Errno::PERM | Errno::ACCESS => Failure::Refused(std::io::Error::from(errno).to_string()),
        errno => Failure::Other(std::io::Error::from(errno).to_string()),
    }
}

const DIRECTORY: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// A listing, read in small batches.
pub struct Listing(rustix::fs::Dir);

impl Iterator for Listing {
    type Item = Result<(String, Kind), Failure>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let entry = match self.0.read()? {
                Ok(entry) => entry,
                Err(errno) => return Some(Err(failure(errno))),
            };
            let name = entry.file_name().to_bytes();
            if matches!(name, b"." | b"..") {
                continue;
            }
            let Ok(name) = std::str::from_utf8(name) else {
                return Some(Err(Failure::Other(format!(
                    "{} is not UTF-8",
                    String::from_utf8_lossy(name)
                ))));
            };
            let kind = match entry.file_type() {
                FileType::Directory => Kind::Directory,
                FileType::Unknown => Kind::Unknown,
                _ => Kind::NotDirectory,
            };
            return Some(Ok((name.to_owned(), kind)));
        }
    }
}

impl Tree for Native {
    type Dir = OwnedFd;
    type Listing = Listing;

    fn open_root(&self, root: &str) -> Result<OwnedFd, Failure> {
        let root = if root.is_empty() { "/" } else { root };
        rustix::fs::open(root, DIRECTORY.difference(OFlags::NOFOLLOW), Mode::empty())
            .map_err(failure)
    }

    fn exists(&self, dir: &OwnedFd, name: &str) -> Result<bool, Failure> {
        match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(_) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(errno) => Err(failure(errno)),
        }
    }

    fn open_dir(&self, dir: &OwnedFd, name: &str) -> Result<OwnedFd, Failure> {
        rustix::fs::openat(dir, name, DIRECTORY, Mode::empty()).map_err(failure)
    }

    fn list(&self, dir: &OwnedFd) -> Result<Listing, Failure> {
        rustix::fs::Dir::read_from(dir)
            .map(Listing)
            .map_err(failure)
    }

    fn unlink(&self, dir: &OwnedFd, name: &str) -> Result<(), Failure> {
        rustix::fs::unlinkat(dir, name, AtFlags::empty()).map_err(failure)
    }

    fn remove_dir(&self, dir: &OwnedFd, name: &str) -> Result<(), Failure> {
        rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(failure)
    }

    fn rename(
        &self,
        from: &OwnedFd,
        name: &str,
        to: &OwnedFd,
        to_name: &str,
    ) -> Result<(), Failure> {
        rustix::fs::renameat(from, name, to, to_name).map_err(failure)
    }
}
