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
