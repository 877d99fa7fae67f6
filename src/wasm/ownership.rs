//! Owner, group and mode of a volume's directory: what a guest may ask for (checked against the
//! grant's id ranges) and how the host applies it (to the directory it checked, by descriptor).
//!
//! WASI has no chown or chmod, so a guest cannot make a volume writable by a non-root pod
//! itself; the host does it for the directory the returned `hostPath`/`local` path names. The
//! directory is reached as [`super::nodepath`] walks it (each component opened with
//! `O_NOFOLLOW` relative to the one before), and the change is made through that descriptor:
//! a pod that swaps its volume directory, or any component above it, for a symlink makes the
//! walk fail; it never redirects the change.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd};

use rustix::fs::{AtFlags, FileType, Gid, Uid};
use serde::Deserialize;

/// What a guest asked for one volume's directory; `None` parts stay as they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ownership {
    /// Owner uid.
    pub uid: Option<u32>,
    /// Group gid.
    pub gid: Option<u32>,
    /// Permission bits (at most `0o7777`).
    pub mode: Option<u32>,
}

impl Ownership {
    /// Whether nothing is asked.
    pub fn is_empty(&self) -> bool {
        self.uid.is_none() && self.gid.is_none() && self.mode.is_none()
    }
}

impl fmt::Display for Ownership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(uid) = self.uid {
            parts.push(format!("uid {uid}"));
        }
        if let Some(gid) = self.gid {
            parts.push(format!("gid {gid}"));
        }
        if let Some(mode) = self.mode {
            parts.push(format!("mode {mode:04o}"));
        }
        f.write_str(&parts.join(", "))
    }
}

/// One inclusive range of ids a grant lets a guest hand out: `"1000-1999"` or `"1000"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct IdRange {
    /// First id.
    pub first: u32,
    /// Last id (inclusive).
    pub last: u32,
}

impl TryFrom<String> for IdRange {
    type Error = String;

    fn try_from(text: String) -> Result<IdRange, String> {
        // 4294967295 is -1, "leave unchanged" to chown: never an id to hand out.
        let number = |s: &str| {
            s.trim()
                .parse::<u32>()
                .ok()
                .filter(|id| *id != u32::MAX)
                .ok_or_else(|| {
                    format!("id range {text:?}: {s:?} is not a number from 0 to 4294967294")
                })
        };
        let (first, last) = match text.split_once('-') {
            Some((first, last)) => (number(first)?, number(last)?),
            None => {
                let id = number(&text)?;
                (id, id)
            }
        };
        if first > last {
            return Err(format!("id range {text:?}: {first} is above {last}"));
        }
        Ok(IdRange { first, last })
    }
}

impl IdRange {
    /// Whether `id` lies in the range.
    pub fn contains(&self, id: u32) -> bool {
        (self.first..=self.last).contains(&id)
    }
}

/// Why an ownership request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OwnershipError {
    /// The mode has bits beyond `0o7777`.
    #[error("mode {0:o} has bits beyond 0o7777")]
    Mode(u32),
    /// The uid lies in no granted range.
    #[error("uid {id} is not granted (the grant's [volumes] uids: {granted})")]
    Uid {
        /// The uid asked for.
        id: u32,
        /// The granted ranges, as the grant file spells them.
        granted: String,
    },
    /// The gid lies in no granted range.
    #[error("gid {id} is not granted (the grant's [volumes] gids: {granted})")]
    Gid {
        /// The gid asked for.
        id: u32,
        /// The granted ranges, as the grant file spells them.
        granted: String,
    },
}

fn spelled(ranges: &[IdRange]) -> String {
    if ranges.is_empty() {
        return "none".to_owned();
    }
    let each = ranges.iter().map(|r| {
        if r.first == r.last {
            format!("\"{}\"", r.first)
        } else {
            format!("\"{}-{}\"", r.first, r.last)
        }
    });
    format!("[{}]", each.collect::<Vec<_>>().join(", "))
}

/// Checks `asked` against the granted uid and gid ranges (none by default: no id may be
/// handed out) and the mode's bits. Any mode is allowed: it gives nothing the process did not
/// already own.
pub fn check(asked: &Ownership, uids: &[IdRange], gids: &[IdRange]) -> Result<(), OwnershipError> {
    if let Some(mode) = asked.mode
        && mode & !0o7777 != 0
    {
        return Err(OwnershipError::Mode(mode));
    }
    if let Some(id) = asked.uid
        && !uids.iter().any(|r| r.contains(id))
    {
        return Err(OwnershipError::Uid {
            id,
            granted: spelled(uids),
        });
    }
    if let Some(id) = asked.gid
        && !gids.iter().any(|r| r.contains(id))
    {
        return Err(OwnershipError::Gid {
            id,
            granted: spelled(gids),
        });
    }
    Ok(())
}

/// Applies `asked` to the directory `dir` refers to (an `O_PATH` descriptor from the walk that
/// checked it). The mode first, while this process may still own the directory, then the owner.
pub fn apply(dir: impl AsFd, asked: &Ownership) -> std::io::Result<()> {
    let stat = rustix::fs::fstat(&dir)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
        return Err(std::io::Error::other("it is not a directory"));
    }
    if let Some(mode) = asked.mode {
        // fchmod needs a descriptor opened for I/O, which a pod's `chmod 000` could deny us;
        // the /proc magic link names the very inode the O_PATH descriptor holds (no lookup by
        // name, no link of the pod's followed).
        let link = format!("/proc/self/fd/{}", dir.as_fd().as_raw_fd());
        rustix::fs::chmod(link.as_str(), rustix::fs::Mode::from_raw_mode(mode))?;
    }
    if asked.uid.is_some() || asked.gid.is_some() {
        rustix::fs::chownat(
            &dir,
            "",
            asked.uid.map(Uid::from_raw),
            asked.gid.map(Gid::from_raw),
            AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(texts: &[&str]) -> Vec<IdRange> {
        texts
            .iter()
            .map(|t| IdRange::try_from((*t).to_owned()).unwrap())
            .collect()
    }

    #[test]
    fn ids_are_granted_by_range_and_none_by_default() {
        let uids = ranges(&["1000-1999", "3000"]);
        let asked = |uid, gid| Ownership {
            uid,
            gid,
            mode: None,
        };
        assert!(check(&asked(Some(1000), None), &uids, &[]).is_ok());
        assert!(check(&asked(Some(1999), None), &uids, &[]).is_ok());
        assert!(check(&asked(Some(3000), None), &uids, &[]).is_ok());
        for refused in [0, 999, 2000, 2999, 3001, u32::MAX] {
            let error = check(&asked(Some(refused), None), &uids, &[]).unwrap_err();
            assert!(
                error
                    .to_string()
                    .contains(&format!("uid {refused} is not granted"))
                    && error.to_string().contains(r#"["1000-1999", "3000"]"#),
                "{error}"
            );
        }
        let error = check(&asked(None, Some(1000)), &uids, &[]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "gid 1000 is not granted (the grant's [volumes] gids: none)"
        );
        assert!(check(&Ownership::default(), &[], &[]).is_ok());
    }

    #[test]
    fn modes_beyond_the_permission_bits_are_refused() {
        let mode = |mode| Ownership {
            mode: Some(mode),
            ..Ownership::default()
        };
        assert!(check(&mode(0o7777), &[], &[]).is_ok());
        assert!(check(&mode(0o700), &[], &[]).is_ok());
        assert_eq!(
            check(&mode(0o10777), &[], &[]),
            Err(OwnershipError::Mode(0o10777))
        );
    }

    #[test]
    fn range_syntax_is_checked() {
        assert_eq!(
            ranges(&["7", " 1 - 2 "]),
            vec![IdRange { first: 7, last: 7 }, IdRange { first: 1, last: 2 }]
        );
        for bad in ["", "a", "5-1", "-1", "1-", "4294967295", "4294967296"] {
            assert!(IdRange::try_from(bad.to_owned()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn applied_through_the_descriptor_to_directories_only() {
        let dir = tempfile::tempdir().unwrap();
        let volume = dir.path().join("v");
        std::fs::create_dir(&volume).unwrap();
        let open = |path: &std::path::Path| {
            rustix::fs::open(
                path,
                rustix::fs::OFlags::PATH | rustix::fs::OFlags::NOFOLLOW,
                rustix::fs::Mode::empty(),
            )
            .unwrap()
        };
        let asked = Ownership {
            uid: Some(rustix::process::getuid().as_raw()),
            gid: Some(rustix::process::getgid().as_raw()),
            mode: Some(0o2750),
        };
        apply(open(&volume), &asked).unwrap();
        let stat = rustix::fs::stat(&volume).unwrap();
        assert_eq!(stat.st_mode & 0o7777, 0o2750);
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(apply(open(&file), &asked).is_err());
    }
}
