//! `rm -r` by descriptor: every call names one entry of a directory held open, links are never
//! followed, and the work grows with the entries, not with their depth.
//!
//! ```text
//! volume's parent ─ open "name" as a directory (no link followed) ─▶ stack = [volume]
//! loop: list the top ─ each entry: not a directory? unlink it (a link goes, never its target)
//!                    └ first directory: open it (no link followed) ─▶ push it
//!                         (stack full, or its path too long: rename it to .deleting-N in the
//!                          volume instead; the volume's own listing meets it later)
//!       nothing left ─▶ remove it from the directory below it on the stack, pop it; then the
//!                       directory below too, while removing it works (it held only that one)
//! ```
//!
//! A pod still running in the volume cannot lead it out: a directory it swaps for a link
//! between the listing and the open fails to open as a directory and is unlinked (the link),
//! and what is opened stays the same directory whatever is renamed around it, so an unlink
//! always removes an entry of a directory of this volume. What it adds meanwhile is met by a
//! later listing; an emptied directory it refilled is met again by the listing below it.

use std::fmt;

/// Directories held open at once (each costs the call one descriptor, and its listing one
/// more while it is read): 16 + a listing + the child being opened + the volume's parent
/// stay well within the host's default cap of 64.
pub(super) const DEEPEST: usize = 16;

/// Bytes of names below the volume walked before a directory is moved up instead: the host
/// resolves where a renamed directory's parent is from its descriptor, which the kernel only
/// does below PATH_MAX (4096), with room left for where the granted directory lies.
const LONGEST_BELOW: usize = 2048;

/// How often one entry may change between a directory and not (a pod swapping it) before the
/// delete gives up on this attempt.
const FLIPS: usize = 64;

/// How often the volume may be found refilled once emptied before the attempt gives up.
const REFILLS: usize = 64;

/// Why a call failed, as far as the walk cares.
#[derive(Debug)]
pub enum Failure {
    NoEntry,
    /// Not a directory, or a link (which is never followed).
    NotDirectory,
    IsDirectory,
    /// Not empty (`ENOTEMPTY`, or `EEXIST` as some filesystems say it).
    NotEmpty,
    /// The host refused (permission, or a guarded rename).
    Refused(String),
    Other(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NoEntry => f.write_str("no such file or directory"),
            Failure::NotDirectory => f.write_str("not a directory"),
            Failure::IsDirectory => f.write_str("is a directory"),
            Failure::NotEmpty => f.write_str("directory not empty"),
            Failure::Refused(why) | Failure::Other(why) => f.write_str(why),
        }
    }
}

/// What a listing says an entry is (it may have changed since).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Directory,
    NotDirectory,
    Unknown,
}

/// The calls the walk makes. Each names one entry (`name`, never a path) of a directory held
/// open, and none follows a link.
pub trait Tree {
    type Dir;
    type Listing: Iterator<Item = Result<(String, Kind), Failure>>;

    /// The directory `root`, opened (without following links below the granted directory
    /// where the host sandboxes): `NoEntry` when it, or a directory above it, does not exist.
    fn open_root(&self, root: &str) -> Result<Self::Dir, Failure>;
    /// Whether entry `name` of `dir` exists (a link counts, and is not followed).
    fn exists(&self, dir: &Self::Dir, name: &str) -> Result<bool, Failure>;
    /// Entry `name` of `dir`, opened as a directory: a link fails (`NotDirectory`).
    fn open_dir(&self, dir: &Self::Dir, name: &str) -> Result<Self::Dir, Failure>;
    /// The entries of `dir`, streamed, without `.` and `..`.
    fn list(&self, dir: &Self::Dir) -> Result<Self::Listing, Failure>;
    /// Removes entry `name` of `dir`, which is not a directory (a link itself, not its target).
    fn unlink(&self, dir: &Self::Dir, name: &str) -> Result<(), Failure>;
    /// Removes entry `name` of `dir`, an empty directory.
    fn remove_dir(&self, dir: &Self::Dir, name: &str) -> Result<(), Failure>;
    /// Renames entry `name` of `from` to `to_name` in `to`.
    fn rename(
        &self,
        from: &Self::Dir,
        name: &str,
        to: &Self::Dir,
        to_name: &str,
    ) -> Result<(), Failure>;
}

/// A failure and where: the path below the volume (for the message).
#[derive(Debug)]
pub struct Failed {
    pub at: String,
    pub failure: Failure,
}

/// What an entry turned out to be once dealt with.
enum Settled<D> {
    /// A directory, opened.
    Dir(D),
    /// Not a directory: removed.
    Removed,
    /// Gone before anything was done.
    Gone,
}

/// Opens entry `name` of `dir` as a directory, or unlinks it if it is not one; retried while a
/// pod swaps it between the two.
fn settle<T: Tree>(
    tree: &T,
    dir: &T::Dir,
    name: &str,
    kind: Kind,
) -> Result<Settled<T::Dir>, Failure> {
    let mut as_dir = kind != Kind::NotDirectory;
    for _ in 0..FLIPS {
        if as_dir {
            match tree.open_dir(dir, name) {
                Ok(child) => return Ok(Settled::Dir(child)),
                Err(Failure::NoEntry) => return Ok(Settled::Gone),
                Err(Failure::NotDirectory) => as_dir = false,
                Err(failure) => return Err(failure),
            }
        } else {
            match tree.unlink(dir, name) {
                Ok(()) => return Ok(Settled::Removed),
                Err(Failure::NoEntry) => return Ok(Settled::Gone),
                Err(Failure::IsDirectory) => as_dir = true,
                Err(failure) => return Err(failure),
            }
        }
    }
    Err(Failure::Other(format!(
        "it changed between a directory and not {FLIPS} times while being removed"
    )))
}

/// The directory holding `path`, reached from `root` one name at a time, and the name of
/// `path` in it; `None` when a directory between them is missing (the storage is gone: it was
/// looked for where it is). `root` itself must be there: a root that does not exist, or lies
/// in no granted directory, means the guest cannot see where the storage is (a grant moved or
/// dropped, a mount missing), and that is an error, never "gone".
pub fn locate<T: Tree>(
    tree: &T,
    root: &str,
    path: &str,
) -> Result<Option<(T::Dir, String)>, Failed> {
    let at = |failure| Failed {
        at: path.to_owned(),
        failure,
    };
    let root = root.trim_end_matches('/');
    let below = path
        .strip_prefix(root)
        .filter(|rest| rest.starts_with('/'))
        .ok_or_else(|| at(Failure::Other(format!("it is not below {root}"))))?;
    let names: Vec<&str> = below.split('/').filter(|n| !n.is_empty()).collect();
    let Some((name, between)) = names.split_last() else {
        return Err(at(Failure::Other(format!("it is not below {root}"))));
    };
    if names.iter().any(|n| matches!(*n, "." | "..")) {
        return Err(at(Failure::Other("it has a . or .. component".to_owned())));
    }
    let mut dir = tree.open_root(root).map_err(|failure| Failed {
        at: root.to_owned(),
        failure: Failure::Other(format!(
            "the directory this volume's storage lies in cannot be opened ({failure}), so the storage cannot be looked for; not taken for gone (was the grant's directory moved, its [[dirs]] entry dropped, or a mount is missing?)"
        )),
    })?;
    for component in between {
        dir = match tree.open_dir(&dir, component) {
            Ok(next) => next,
            Err(Failure::NoEntry) => return Ok(None),
            Err(failure) => return Err(at(failure)),
        };
    }
    Ok(Some((dir, (*name).to_owned())))
}

/// Whether `path` exists, looked for from `root` ([`locate`]).
pub fn present<T: Tree>(tree: &T, root: &str, path: &str) -> Result<bool, Failed> {
    match locate(tree, root, path)? {
        None => Ok(false),
        Some((dir, name)) => tree.exists(&dir, &name).map_err(|failure| Failed {
            at: path.to_owned(),
            failure,
        }),
    }
}

/// Removes `path` and everything below it, looked for from `root` ([`locate`]); false when
/// there was nothing to remove.
pub fn remove<T: Tree>(tree: &T, root: &str, path: &str) -> Result<bool, Failed> {
    let at = |failure| Failed {
        at: path.to_owned(),
        failure,
    };
    let Some((parent, name)) = locate(tree, root, path)? else {
        return Ok(false);
    };
    let mut refills = 0;
    loop {
        let volume = match settle(tree, &parent, &name, Kind::Unknown).map_err(at)? {
            Settled::Dir(volume) => volume,
            Settled::Removed => return Ok(true),
            Settled::Gone => return Ok(refills > 0),
        };
        Walk {
            tree,
            path,
            stack: vec![(volume, String::new())],
            below: 0,
            spare: 0,
        }
        .empty()?;
        match tree.remove_dir(&parent, &name) {
            Ok(()) | Err(Failure::NoEntry) => return Ok(true),
            // Refilled by a pod since it was emptied: again, a bounded number of times.
            Err(Failure::NotEmpty) if refills < REFILLS => refills += 1,
            Err(failure) => return Err(at(failure)),
        }
    }
}

/// The directories being emptied, the volume's at the bottom, each with its name in the one
/// below it.
struct Walk<'a, T: Tree> {
    tree: &'a T,
    path: &'a str,
    stack: Vec<(T::Dir, String)>,
    /// Bytes of the names on the stack.
    below: usize,
    /// The next `.deleting-N` to try.
    spare: u64,
}

impl<T: Tree> Walk<'_, T> {
    /// Where `name` (in the top directory) is, for a message.
    fn at(&self, name: &str, failure: Failure) -> Failed {
        let mut at = self.path.to_owned();
        for (_, below) in self.stack.iter().skip(1) {
            at = crate::join(&at, below);
        }
        if !name.is_empty() {
            at = crate::join(&at, name);
        }
        Failed { at, failure }
    }

    /// Empties the volume's directory (the bottom of the stack), leaving it in place.
    fn empty(mut self) -> Result<(), Failed> {
        let mut refused = 0;
        loop {
            let (top, _) = self.stack.last().expect("the volume stays at the bottom");
            match self.next_dir(top)? {
                Some((child, name))
                    if self.stack.len() < DEEPEST && self.below + name.len() < LONGEST_BELOW =>
                {
                    self.below += name.len() + 1;
                    self.stack.push((child, name));
                }
                Some((child, name)) => {
                    drop(child);
                    if self.move_up(&name)? {
                        refused = 0;
                    } else {
                        refused += 1;
                        if refused > FLIPS {
                            return Err(self.at(
                                &name,
                                Failure::Other(format!(
                                    "could not move it up to the volume {FLIPS} times in a row"
                                )),
                            ));
                        }
                    }
                }
                None if self.stack.len() == 1 => return Ok(()),
                None => self.remove_emptied()?,
            }
        }
    }

    /// Removes the top directory, listed empty, from the one below it; then each directory
    /// below, while that works: one left with nothing else goes in that one call instead of
    /// another listing (a chain of directories costs an open, a listing and a removal each).
    fn remove_emptied(&mut self) -> Result<(), Failed> {
        let mut listed_empty = true;
        while self.stack.len() > 1 {
            let at = self.stack.len() - 1;
            let (parent, name) = (&self.stack[at - 1].0, &self.stack[at].1);
            match self.tree.remove_dir(parent, name) {
                Ok(()) => {}
                // Not listed yet, and something is left: it is listed next.
                Err(Failure::NotEmpty) if !listed_empty => return Ok(()),
                // Refilled, or swapped for something else, since it was listed empty: the
                // next listing of the directory below meets whatever is there now.
                Err(Failure::NoEntry | Failure::NotEmpty | Failure::NotDirectory) => {
                    self.pop();
                    return Ok(());
                }
                Err(failure) => return Err(self.at("", failure)),
            }
            self.pop();
            listed_empty = false;
        }
        Ok(())
    }

    fn pop(&mut self) {
        let (dir, name) = self.stack.pop().expect("above the volume");
        drop(dir);
        self.below -= name.len() + 1;
    }

    /// Lists `dir`, unlinking every entry that is not a directory, up to the first directory,
    /// which is returned open. The listing is closed before this returns.
    fn next_dir(&self, dir: &T::Dir) -> Result<Option<(T::Dir, String)>, Failed> {
        let listing = self.tree.list(dir).map_err(|f| self.at("", f))?;
        for entry in listing {
            let (name, kind) = entry.map_err(|f| self.at("", f))?;
            match settle(self.tree, dir, &name, kind).map_err(|f| self.at(&name, f))? {
                Settled::Dir(child) => return Ok(Some((child, name))),
                Settled::Removed | Settled::Gone => {}
            }
        }
        Ok(None)
    }

    /// Renames directory `name` of the top directory to a free `.deleting-N` right in the
    /// volume, whose listing meets it later. False when it was not moved because it is no
    /// longer that directory (gone, or swapped for a link: the next listing deals with it).
    fn move_up(&mut self, name: &str) -> Result<bool, Failed> {
        let (top, _) = self.stack.last().expect("the top");
        let (volume, _) = self.stack.first().expect("the volume");
        for _ in 0..FLIPS {
            let to = format!(".deleting-{}", self.spare);
            self.spare += 1;
            match self.tree.rename(top, name, volume, &to) {
                Ok(()) => return Ok(true),
                Err(Failure::NoEntry | Failure::Refused(_)) => return Ok(false),
                // Either the destination is taken (by a pod, or by a directory moved up
                // earlier: try the next number) or the source is no longer a directory.
                Err(Failure::NotEmpty | Failure::IsDirectory | Failure::NotDirectory) => {
                    if self.tree.open_dir(top, name).is_err() {
                        return Ok(false);
                    }
                }
                Err(failure) => return Err(self.at(name, failure)),
            }
        }
        Err(self.at(
            name,
            Failure::Other(format!("no free .deleting-N name in {FLIPS} tries")),
        ))
    }
}
