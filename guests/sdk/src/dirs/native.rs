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

impl super::copy::CopyTree for Native {
    fn kind(&self, dir: &OwnedFd, name: &str) -> Result<super::copy::EntryKind, Failure> {
        use super::copy::EntryKind;
        let stat = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(failure)?;
        Ok(match FileType::from_raw_mode(stat.st_mode) {
            FileType::Directory => EntryKind::Directory,
            FileType::RegularFile => EntryKind::File,
            FileType::Symlink => EntryKind::Link,
            _ => EntryKind::Other,
        })
    }

    fn create_dir(&self, dir: &OwnedFd, name: &str) -> Result<(), Failure> {
        rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o777)).map_err(failure)
    }

    fn copy_file(
        &self,
        from: &OwnedFd,
        to: &OwnedFd,
        name: &str,
        in_time: &dyn Fn() -> bool,
    ) -> Result<u64, Failure> {
        let source = rustix::fs::openat(
            from,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(failure)?;
        let target = rustix::fs::openat(
            to,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o666),
        )
        .map_err(failure)?;
        let mut buffer = vec![0u8; 64 << 10];
        let mut copied = 0u64;
        loop {
            if !in_time() {
                return Err(Failure::Other("out of time".into()));
            }
            let read = rustix::io::read(&source, &mut buffer).map_err(failure)?;
            if read == 0 {
                return Ok(copied);
            }
            let mut written = 0;
            while written < read {
                written += rustix::io::write(&target, &buffer[written..read]).map_err(failure)?;
            }
            copied += read as u64;
        }
    }

    fn read_link(&self, dir: &OwnedFd, name: &str) -> Result<String, Failure> {
        let target = rustix::fs::readlinkat(dir, name, Vec::new()).map_err(failure)?;
        target
            .into_string()
            .map_err(|_| Failure::Other(format!("the target of link {name} is not UTF-8")))
    }

    fn symlink(&self, dir: &OwnedFd, name: &str, target: &str) -> Result<(), Failure> {
        rustix::fs::symlinkat(target, dir, name).map_err(failure)
    }
}
