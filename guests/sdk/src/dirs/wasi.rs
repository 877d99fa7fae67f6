//! The walk's calls inside WebAssembly: `wasi:filesystem/types` directly, each relative to a
//! descriptor, since std opens by path (and the host resolves a path through the links a pod
//! planted, as long as they stay in the granted directory).

use wasip2::filesystem::preopens::get_directories;
use wasip2::filesystem::types::{
    Descriptor, DescriptorFlags, DescriptorType, DirectoryEntryStream, ErrorCode, OpenFlags,
    PathFlags,
};

use super::walk::{Failure, Kind, Tree};

/// The guest's preopened directories.
pub struct Wasi;

fn failure(code: ErrorCode) -> Failure {
    match code {
        ErrorCode::NoEntry => Failure::NoEntry,
        ErrorCode::NotDirectory | ErrorCode::Loop => Failure::NotDirectory,
        ErrorCode::IsDirectory => Failure::IsDirectory,
        ErrorCode::NotEmpty | ErrorCode::Exist => Failure::NotEmpty,
        ErrorCode::NotPermitted | ErrorCode::Access => Failure::Refused(code.to_string()),
        code => Failure::Other(code.to_string()),
    }
}

/// A listing, one entry per host call.
pub struct Listing(DirectoryEntryStream);

impl Iterator for Listing {
    type Item = Result<(String, Kind), Failure>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.0.read_directory_entry() {
            Ok(None) => None,
            Ok(Some(entry)) if matches!(entry.name.as_str(), "." | "..") => self.next(),
            Ok(Some(entry)) => {
                let kind = match entry.type_ {
                    DescriptorType::Directory => Kind::Directory,
                    DescriptorType::Unknown => Kind::Unknown,
                    _ => Kind::NotDirectory,
                };
                Some(Ok((entry.name, kind)))
            }
            Err(code) => Some(Err(failure(code))),
        }
    }
}

impl Tree for Wasi {
    type Dir = Descriptor;
    type Listing = Listing;

    fn open_root(&self, root: &str) -> Result<Descriptor, Failure> {
        let invalid = |why: &str| Failure::Other(format!("{root} {why}"));
        let above = root.trim_end_matches('/');
        if !root.starts_with('/') {
            return Err(invalid("is not an absolute path"));
        }
        // The preopen holding it that is deepest, and the components below it.
        let below = |preopen: &str| {
            let preopen = preopen.trim_end_matches('/');
            let rest = above.strip_prefix(preopen)?;
            (rest.is_empty() || rest.starts_with('/')).then_some(rest)
        };
        let (mut dir, rest) = get_directories()
            .into_iter()
            .filter_map(|(dir, preopen)| {
                let rest = below(&preopen)?;
                Some((preopen.len(), dir, rest.to_owned()))
            })
            .max_by_key(|(depth, _, _)| *depth)
            .map(|(_, dir, rest)| (dir, rest))
            .ok_or_else(|| invalid("is not inside a granted directory"))?;
        for component in rest.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if component == ".." {
                return Err(invalid("has a .. component"));
            }
            dir = self.open_dir(&dir, component)?;
        }
        Ok(dir)
    }

    fn exists(&self, dir: &Descriptor, name: &str) -> Result<bool, Failure> {
        match dir.stat_at(PathFlags::empty(), name) {
            Ok(_) => Ok(true),
            Err(ErrorCode::NoEntry) => Ok(false),
            Err(code) => Err(failure(code)),
        }
    }

    fn open_dir(&self, dir: &Descriptor, name: &str) -> Result<Descriptor, Failure> {
        // No SYMLINK_FOLLOW: the host opens with O_NOFOLLOW, and a link fails.
        dir.open_at(
            PathFlags::empty(),
            name,
            OpenFlags::DIRECTORY,
            DescriptorFlags::READ,
        )
        .map_err(failure)
    }

    fn list(&self, dir: &Descriptor) -> Result<Listing, Failure> {
        dir.read_directory().map(Listing).map_err(failure)
    }

    fn unlink(&self, dir: &Descriptor, name: &str) -> Result<(), Failure> {
        dir.unlink_file_at(name).map_err(failure)
    }

    fn remove_dir(&self, dir: &Descriptor, name: &str) -> Result<(), Failure> {
        dir.remove_directory_at(name).map_err(failure)
    }

    fn rename(
        &self,
        from: &Descriptor,
        name: &str,
        to: &Descriptor,
        to_name: &str,
    ) -> Result<(), Failure> {
        from.rename_at(name, to, to_name).map_err(failure)
    }
}

impl super::copy::CopyTree for Wasi {
    fn kind(&self, dir: &Descriptor, name: &str) -> Result<super::copy::EntryKind, Failure> {
        use super::copy::EntryKind;
        let stat = dir.stat_at(PathFlags::empty(), name).map_err(failure)?;
        Ok(match stat.type_ {
            DescriptorType::Directory => EntryKind::Directory,
            DescriptorType::RegularFile => EntryKind::File,
            DescriptorType::SymbolicLink => EntryKind::Link,
            _ => EntryKind::Other,
        })
    }

    fn create_dir(&self, dir: &Descriptor, name: &str) -> Result<(), Failure> {
        dir.create_directory_at(name).map_err(failure)
    }

    fn copy_file(
        &self,
        from: &Descriptor,
        to: &Descriptor,
        name: &str,
        in_time: &dyn Fn() -> bool,
    ) -> Result<u64, Failure> {
        // No SYMLINK_FOLLOW: a link swapped in since the entry was looked at fails to open.
        let source = from
            .open_at(
                PathFlags::empty(),
                name,
                OpenFlags::empty(),
                DescriptorFlags::READ,
            )
            .map_err(failure)?;
        let target = to
            .open_at(
                PathFlags::empty(),
                name,
                OpenFlags::CREATE | OpenFlags::EXCLUSIVE,
                DescriptorFlags::WRITE,
            )
            .map_err(failure)?;
        let mut offset = 0u64;
        loop {
            if !in_time() {
                return Err(Failure::Other("out of time".into()));
            }
            let (chunk, end) = source.read(64 << 10, offset).map_err(failure)?;
            let mut written = 0usize;
            while written < chunk.len() {
                let n = target
                    .write(&chunk[written..], offset + written as u64)
                    .map_err(failure)?;
                written += n as usize;
            }
            offset += chunk.len() as u64;
            if end || chunk.is_empty() {
                return Ok(offset);
            }
        }
    }

    fn read_link(&self, dir: &Descriptor, name: &str) -> Result<String, Failure> {
        dir.readlink_at(name).map_err(failure)
    }

    fn symlink(&self, dir: &Descriptor, name: &str, target: &str) -> Result<(), Failure> {
        dir.symlink_at(target, name).map_err(failure)
    }
}
