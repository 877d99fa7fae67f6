//! `cp -r` by descriptor outside WebAssembly (unit tests of the SDK and of guests): every call
//! names one entry of a directory held open, a link is copied as a link (its target never
//! read), and the copy stops at a time budget. Inside WebAssembly the host copies
//! (`host.copy-tree`, which keeps modes and granted owners too); this stand-in keeps neither.
//!
//! ```text
//! source dir, new dir ─▶ list source (all names, then the listing is closed)
//!   each entry, as it is now (never followed): directory ─▶ mkdir + descend
//!                                              file      ─▶ open (no link followed) ─▶ 64 KiB chunks
//!                                              link      ─▶ readlink ─▶ symlink (or skipped, counted)
//!                                              other     ─▶ skipped, counted (FIFOs, sockets, devices)
//! ```
//!
//! A pod writing into the source meanwhile gets a copy of some moment of each file; an entry
//! swapped for a link between the listing and the open is refused by the open, never followed,
//! so nothing outside the source volume is read.

use std::time::Instant;

use super::Copied;
use super::walk::{Failure, Kind, Tree};

/// Directories deep the copy goes; two descriptors are open per level.
pub const MAX_DEPTH: usize = 24;

/// What an entry is, looked at without following a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Directory,
    File,
    Link,
    /// A FIFO, socket or device: not copied.
    Other,
}

/// The calls a copy makes beyond the walk's.
pub trait CopyTree: Tree {
    /// What entry `name` of `dir` is now (a link is a link).
    fn kind(&self, dir: &Self::Dir, name: &str) -> Result<EntryKind, Failure>;
    /// Creates directory `name` in `dir`; an existing one is `NotEmpty`.
    fn create_dir(&self, dir: &Self::Dir, name: &str) -> Result<(), Failure>;
    /// Copies regular file `name` of `from` to a new file `name` of `to`, refusing a link;
    /// `in_time` is asked between chunks. Returns the bytes copied.
    fn copy_file(
        &self,
        from: &Self::Dir,
        to: &Self::Dir,
        name: &str,
        in_time: &dyn Fn() -> bool,
    ) -> Result<u64, Failure>;
    /// The target of link `name` of `dir`, as text.
    fn read_link(&self, dir: &Self::Dir, name: &str) -> Result<String, Failure>;
    /// Creates link `name` in `dir` pointing at `target`.
    fn symlink(&self, dir: &Self::Dir, name: &str, target: &str) -> Result<(), Failure>;
}

/// Why a copy stopped.
#[derive(Debug)]
pub enum CopyFailed {
    /// The budget ran out.
    OutOfTime(Copied),
    /// Deeper than [`MAX_DEPTH`], at this path below the source.
    TooDeep(String),
    /// A call failed, at this path below the source.
    At(String, Failure),
}

struct Level<D> {
    from: D,
    to: D,
    entries: Vec<(String, Kind)>,
    next: usize,
    path: String,
}

/// Copies everything in `from` into `to` (an empty directory), until `deadline`.
pub fn copy<T: CopyTree>(
    tree: &T,
    from: T::Dir,
    to: T::Dir,
    deadline: Instant,
) -> Result<Copied, CopyFailed> {
    let in_time = || Instant::now() < deadline;
    let mut copied = Copied::default();
    let list = |dir: &T::Dir, path: &str| -> Result<Vec<(String, Kind)>, CopyFailed> {
        let at = |failure| CopyFailed::At(path.to_owned(), failure);
        tree.list(dir)
            .map_err(at)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|failure| CopyFailed::At(path.to_owned(), failure))
    };
    let entries = list(&from, "")?;
    let mut stack = vec![Level {
        from,
        to,
        entries,
        next: 0,
        path: String::new(),
    }];
    while let Some(level) = stack.last_mut() {
        if !in_time() {
            return Err(CopyFailed::OutOfTime(copied));
        }
        let Some((name, _)) = level.entries.get(level.next).cloned() else {
            stack.pop();
            continue;
        };
        level.next += 1;
        let path = if level.path.is_empty() {
            name.clone()
        } else {
            format!("{}/{name}", level.path)
        };
        let at = |failure| CopyFailed::At(path.clone(), failure);
        let kind = match tree.kind(&level.from, &name) {
            Ok(kind) => kind,
            // Gone since the listing: a pod removed it; the copy is of a later moment.
            Err(Failure::NoEntry) => continue,
            Err(failure) => return Err(at(failure)),
        };
        match kind {
            EntryKind::Directory => {
                if stack.len() >= MAX_DEPTH {
                    return Err(CopyFailed::TooDeep(path));
                }
                let level = stack.last().expect("a level");
                tree.create_dir(&level.to, &name).map_err(at)?;
                let to = tree.open_dir(&level.to, &name).map_err(at)?;
                let from = match tree.open_dir(&level.from, &name) {
                    Ok(from) => from,
                    // Swapped for a link or a file since: not followed, left out.
                    Err(Failure::NoEntry | Failure::NotDirectory) => continue,
                    Err(failure) => return Err(at(failure)),
                };
                let entries = list(&from, &path)?;
                copied.entries += 1;
                stack.push(Level {
                    from,
                    to,
                    entries,
                    next: 0,
                    path,
                });
            }
            EntryKind::File => {
                match tree.copy_file(&level.from, &level.to, &name, &in_time) {
                    Ok(bytes) => {
                        copied.entries += 1;
                        copied.bytes += bytes;
                    }
                    // Gone, or swapped for a link (refused, not followed) since it was looked at.
                    Err(Failure::NoEntry | Failure::NotDirectory) => {}
                    Err(failure) if !in_time() => {
                        let _ = failure;
                        return Err(CopyFailed::OutOfTime(copied));
                    }
                    Err(failure) => return Err(at(failure)),
                }
            }
            EntryKind::Link => {
                let target = match tree.read_link(&level.from, &name) {
                    Ok(target) => target,
                    Err(Failure::NoEntry) => continue,
                    Err(failure) => return Err(at(failure)),
                };
                tree.symlink(&level.to, &name, &target).map_err(at)?;
                copied.entries += 1;
                copied.links += 1;
            }
            EntryKind::Other => copied.skipped += 1,
        }
    }
    Ok(copied)
}
