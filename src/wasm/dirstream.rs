//! Directory listings streamed from the kernel, one entry per guest call.
//!
//! wasmtime-wasi's `read-directory` reads and stats the *whole* directory in one host call, and
//! keeps the list in host memory the guest's cap does not see: a directory of 10^6 entries
//! costs hundreds of MiB and seconds past any deadline. Here `read-directory` only opens the
//! directory again (one descriptor, counted against the call's cap by [`super::sandbox_fs`]),
//! and each `read-directory-entry` reads the next entry from a small `getdents64` buffer: the
//! host keeps a few KiB per listing, and no call does more than one buffer's work.
//!
//! The resource the guest holds is this type, pushed into the call's table under the handle
//! type of wasmtime-wasi's own listing; only [`super::sandbox_fs`] (which wraps every function
//! of `wasi:filesystem/types`) ever looks it up.

use std::sync::{Arc, Mutex};

use rustix::fs::{AtFlags, FileType};
use wasmtime_wasi::p2::bindings::filesystem::types::{DescriptorType, DirectoryEntry, ErrorCode};

/// One open listing.
pub struct DirStream {
    dir: rustix::fs::Dir,
}

/// What the call's table holds for a listing: shared so a blocking-pool thread can read it.
pub type SharedDirStream = Arc<Mutex<DirStream>>;

fn code(errno: rustix::io::Errno) -> ErrorCode {
    std::io::Error::from(errno).into()
}

impl DirStream {
    /// Opens a listing of `dir` (a new descriptor on the same directory, read from its start).
    pub fn open(dir: &std::fs::File) -> Result<DirStream, ErrorCode> {
        let dir = rustix::fs::Dir::read_from(dir).map_err(code)?;
        Ok(DirStream { dir })
    }

    /// The next entry, without `.` and `..`; `None` at the end.
    pub fn next_entry(&mut self) -> Result<Option<DirectoryEntry>, ErrorCode> {
        loop {
            let entry = match self.dir.read() {
                None => return Ok(None),
                Some(entry) => entry.map_err(code)?,
            };
            let name = entry.file_name();
            if matches!(name.to_bytes(), b"." | b"..") {
                continue;
            }
            let file_type = match entry.file_type() {
                // Some filesystems do not say in the listing: ask, without following links.
                FileType::Unknown => {
                    let fd = self.dir.fd().map_err(code)?;
                    match rustix::fs::statat(fd, name, AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(stat) => FileType::from_raw_mode(stat.st_mode),
                        // Gone since it was listed: skip it, as a later listing would.
                        Err(rustix::io::Errno::NOENT) => continue,
                        Err(errno) => return Err(code(errno)),
                    }
                }
                known => known,
            };
            // A name that is not UTF-8 (a pod can make one) gets a stand-in the calls that
            // remove it map back ([`super::rawname`]), rather than failing the listing.
            let name = super::rawname::stand_in(name.to_bytes());
            return Ok(Some(DirectoryEntry {
                type_: descriptor_type(file_type),
                name,
            }));
        }
    }
}

fn descriptor_type(file_type: FileType) -> DescriptorType {
    match file_type {
        FileType::RegularFile => DescriptorType::RegularFile,
        FileType::Directory => DescriptorType::Directory,
        FileType::Symlink => DescriptorType::SymbolicLink,
        FileType::Fifo => DescriptorType::Fifo,
        FileType::Socket => DescriptorType::Socket,
        FileType::CharacterDevice => DescriptorType::CharacterDevice,
        FileType::BlockDevice => DescriptorType::BlockDevice,
        FileType::Unknown => DescriptorType::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_every_entry_once_with_its_type() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("d")).unwrap();
        std::fs::write(root.path().join("f"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc", root.path().join("l")).unwrap();
        for i in 0..2000 {
            std::fs::write(root.path().join(format!("n{i}")), b"").unwrap();
        }
        let dir = std::fs::File::open(root.path()).unwrap();
        let mut stream = DirStream::open(&dir).unwrap();
        let mut seen = std::collections::BTreeMap::new();
        while let Some(entry) = stream.next_entry().unwrap() {
            assert!(seen.insert(entry.name, entry.type_).is_none());
        }
        assert_eq!(seen.len(), 2003);
        assert_eq!(seen["d"], DescriptorType::Directory);
        assert_eq!(seen["f"], DescriptorType::RegularFile);
        assert_eq!(seen["l"], DescriptorType::SymbolicLink);
        assert!(stream.next_entry().unwrap().is_none(), "stays at the end");
    }

    /// Issue 31: a name that is not UTF-8 failed the listing (`illegal-byte-sequence`), so no
    /// guest could empty the directory; it is listed as a stand-in naming it.
    #[test]
    fn a_name_that_is_not_utf8_is_listed_as_its_stand_in() {
        use std::os::unix::ffi::OsStrExt;
        let root = tempfile::tempdir().unwrap();
        let raw = std::ffi::OsStr::from_bytes(b"bad-\xff-\xfe");
        std::fs::write(root.path().join(raw), b"x").unwrap();
        std::fs::write(root.path().join("good"), b"x").unwrap();
        let dir = std::fs::File::open(root.path()).unwrap();
        let mut stream = DirStream::open(&dir).unwrap();
        let mut names = Vec::new();
        while let Some(entry) = stream.next_entry().unwrap() {
            names.push(entry.name);
        }
        names.sort();
        assert_eq!(names, ["\0bad-\\xff-\\xfe", "good"]);
        let back = super::super::rawname::host_path(&names[0]).unwrap();
        assert_eq!(back.as_os_str().as_bytes(), raw.as_bytes());
    }
}
