//! Directory chores inside the guest's granted directories, with errors that name the path:
//! create, check, remove (any depth, any number of entries, never leaving the volume whatever
//! its pod does meanwhile), and rename to a free name (archiving).
//!
//! Deleting a volume says "already gone" only after looking where its PV says the storage is:
//! [`present`], [`remove_in`] and [`remove`] look for it from a root that must be there (the
//! directory volumes lie in). A root that does not exist or lies in no granted directory (the
//! grant's directory moved, its `[[dirs]]` entry dropped, a mount missing) is an error: the
//! storage may well be there, where the guest cannot see it.

use std::fs;
use std::io::ErrorKind;

#[cfg(not(target_os = "wasi"))]
mod copy;
#[cfg(not(target_os = "wasi"))]
mod native;
mod walk;
#[cfg(all(test, unix))]
mod walk_tests;
#[cfg(target_os = "wasi")]
mod wasi;

use crate::Host;
use crate::types::{ProvisionError, final_error};

/// What a copy made ([`copy_tree`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Copied {
    /// Directories, files and links made (inside WebAssembly, the target directory too).
    pub entries: u64,
    /// Bytes of file contents copied.
    pub bytes: u64,
    /// Of the entries, links (made with the same text; their targets never read).
    pub links: u64,
    /// FIFOs, sockets and devices left out.
    pub skipped: u64,
    /// Entries whose granted owner the filesystem would not let the host give (an NFS export
    /// that squashes root): they belong to the host's user.
    pub owners_not_kept: u64,
    /// The copy is a snapshot the host made of the source volume (a size-enforcing grant
    /// directory): instant and whole, the counts above not counted.
    pub snapshot: bool,
}

impl Copied {
    /// Logs a finished clone as `message` with the fields `about` it (the PV, its source) and
    /// the counts: at info, or at warn when owners could not be kept (the clone's pods may not
    /// be able to write what they own in the source).
    pub fn log(&self, host: &dyn Host, message: &str, about: &[(&str, &str)]) {
        let counts = [
            ("entries", self.entries),
            ("bytes", self.bytes),
            ("links", self.links),
            ("skipped", self.skipped),
            ("owners-not-kept", self.owners_not_kept),
            ("snapshot", u64::from(self.snapshot)),
        ]
        .map(|(key, value)| (key, value.to_string()));
        let mut fields = about.to_vec();
        fields.extend(counts.iter().map(|(key, value)| (*key, value.as_str())));
        if self.owners_not_kept > 0 {
            let message =
                format!("{message}; the filesystem would not let the host keep some owners");
            host.warn(&message, &fields);
        } else {
            host.info(message, &fields);
        }
    }
}

/// `mkdir -p`.
pub fn create(path: &str) -> Result<(), ProvisionError> {
    fs::create_dir_all(path)
        .map_err(|error| final_error(format!("creating directory {path}: {error}")))
}

/// `mkdir -p` for a new volume: an existing directory is taken only when it is empty (a retry
/// of this very provision, before any pod could write). One that holds anything may be another
/// claim's data (two claims whose paths collide): never adopted.
pub fn create_empty(path: &str) -> Result<(), ProvisionError> {
    create(path)?;
    let mut entries =
        fs::read_dir(path).map_err(|error| final_error(format!("listing {path}: {error}")))?;
    if entries.next().is_some() {
        return Err(final_error(format!(
            "directory {path} already exists and is not empty; it may hold another claim's data, so it is not adopted"
        )));
    }
    Ok(())
}

/// Whether `path` exists (a symlink counts, and is not followed). A path in no granted
/// directory does not exist for this: to decide that a volume's storage is gone, use
/// [`present`].
pub fn exists(path: &str) -> Result<bool, ProvisionError> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(error) if error.kind() == ErrorKind::NotFound => Ok(false),
        Err(error) => Err(final_error(format!("inspecting {path}: {error}"))),
    }
}

/// Whether the storage at `path` is there, looked for from `root`, the directory the guest
/// keeps volumes in (its granted directory, or a node's directory below it): false only when
/// `root` is there and `path` is not (a directory between them missing too). A `root` that is
/// not there, or lies in no granted directory, is an error, never "gone".
pub fn present(root: &str, path: &str) -> Result<bool, ProvisionError> {
    walk::present(&tree(), root, path).map_err(looking)
}

/// `rm -r` of `path`, looked for from `root` as [`present`] does; false when there was
/// nothing to remove (`root` there, `path` not), an error when `root` is not there. See
/// [`remove`] for how it removes.
pub fn remove_in(root: &str, path: &str) -> Result<bool, ProvisionError> {
    walk::remove(&tree(), root, path).map_err(removing)
}

#[cfg(target_os = "wasi")]
fn tree() -> wasi::Wasi {
    wasi::Wasi
}

#[cfg(not(target_os = "wasi"))]
fn tree() -> native::Native {
    native::Native
}

fn looking(failed: walk::Failed) -> ProvisionError {
    final_error(format!("looking for {}: {}", failed.at, failed.failure))
}

fn removing(failed: walk::Failed) -> ProvisionError {
    final_error(format!("removing {}: {}", failed.at, failed.failure))
}

/// [`remove_in`] for volume `pv`'s directory: where the host made it with an enforced size
/// (a grant directory with `sizes`), the host destroys it whole, without a walk, whatever a pod
/// put in it (`host.destroy-volume`); anywhere else, or natively, [`remove_in`] removes it.
/// False when there was nothing to remove.
pub fn remove_volume(root: &str, path: &str, pv: &str) -> Result<bool, ProvisionError> {
    #[cfg(target_os = "wasi")]
    {
        use crate::bindings::wasm_provisioner::provisioner::host::destroy_volume;
        if destroy_volume(path, pv).map_err(final_error)? {
            return Ok(true);
        }
    }
    #[cfg(not(target_os = "wasi"))]
    let _ = pv;
    remove_in(root, path)
}

/// `rm -r`; returns false when there was nothing to remove. The directory holding `path` must
/// be there: if it is not, that is an error, not "gone" ([`remove_in`] looks from a root
/// further up instead).
///
/// A tenant's pod decides what is in a volume, and may still be running while it is deleted
/// (a force-deleted pod on a partitioned node, another pod of a ReadWriteMany claim). So this
/// walks by descriptor ([`walk`]): each directory is opened relative to the one above it by
/// its one name, never through a link, and each entry is unlinked relative to its directory,
/// so a directory swapped for a link to another volume after it was listed fails to open and
/// the link itself is removed. At most 16 directories and one listing are open at once
/// (within the call's descriptor cap); a directory deeper than that, or whose path below the
/// volume passes 2,048 bytes, is renamed to `.deleting-N` right in the volume and emptied from
/// there, so the work grows with the number of entries whatever their depth. Nothing is kept
/// in memory but those 16 names.
pub fn remove(path: &str) -> Result<bool, ProvisionError> {
    let parent = parent_of(path)
        .ok_or_else(|| final_error(format!("removing {path}: not an absolute path")))?;
    remove_in(parent, path)
}

/// The directory holding `path` (`/` for `/x`); `None` for a path without a `/`.
pub fn parent_of(path: &str) -> Option<&str> {
    match path.trim_end_matches('/').rsplit_once('/')? {
        ("", _) => Some("/"),
        (parent, _) => Some(parent),
    }
}

/// Copies the directory `from` into a new directory `to` (`to`'s parent must exist, `to` must
/// not), for a clone. Inside WebAssembly the host copies (`host.copy-tree`): by descriptor
/// beneath the granted directories, never following a link (a link in any component of either
/// path is refused); links as links (their targets never read), modes (no setuid bit; setgid
/// only on directories), owners the grant's `[volumes] uids`/`gids` allow (any other fails the
/// copy, naming the entry); FIFOs, sockets and devices left out, counted. Gives up at
/// `deadline` (or the call's own), or when the tree nests deeper than the call's
/// `limits.descriptors` allow (two per level), with a final error naming what happened; the
/// partial copy is the caller's to remove ([`clone_into`] does). Natively (unit tests) a
/// stand-in copies the same entries, keeping neither modes nor owners.
pub fn copy_tree(
    from: &str,
    to: &str,
    deadline: std::time::Instant,
) -> Result<Copied, ProvisionError> {
    #[cfg(target_os = "wasi")]
    {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let within_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
        crate::bindings::wasm_provisioner::provisioner::host::copy_tree(from, to, within_ms)
            .map(|done| Copied {
                entries: done.entries,
                bytes: done.bytes,
                links: done.links,
                skipped: done.skipped,
                owners_not_kept: done.owners_not_kept,
                snapshot: done.snapshot,
            })
            .map_err(final_error)
    }
    #[cfg(not(target_os = "wasi"))]
    copy_natively(from, to, deadline)
}

#[cfg(not(target_os = "wasi"))]
fn copy_natively(
    from: &str,
    to: &str,
    deadline: std::time::Instant,
) -> Result<Copied, ProvisionError> {
    use walk::Tree;
    let tree = tree();
    let (parent, name) = split_parent(to)?;
    let opening = |what: &str, failure: walk::Failure| {
        final_error(format!("copying {from} to {to}: opening {what}: {failure}"))
    };
    let source = tree.open_root(from).map_err(|f| opening(from, f))?;
    let parent = tree.open_root(parent).map_err(|f| opening(parent, f))?;
    copy::CopyTree::create_dir(&tree, &parent, name).map_err(|f| opening(to, f))?;
    let target = tree.open_dir(&parent, name).map_err(|f| opening(to, f))?;
    copy::copy(&tree, source, target, deadline).map_err(|failed| {
        final_error(match failed {
            copy::CopyFailed::OutOfTime(done) => format!(
                "copying {from} to {to}: out of time after {} entries and {} bytes",
                done.entries, done.bytes
            ),
            copy::CopyFailed::TooDeep(at) => format!(
                "copying {from} to {to}: {at} is more than {} directories deep",
                copy::MAX_DEPTH
            ),
            copy::CopyFailed::At(at, failure) => {
                format!("copying {from} to {to}: at {at}: {failure}")
            }
        })
    })
}

/// Where a clone, volume `pv` whose directory is `target`, is copied before it is renamed into
/// place: a hidden sibling named after the PV, `.<pv>.cloning`. No claim's directory is called
/// that (claim, namespace and PV names cannot start with a dot, nor can a pattern's values but
/// an annotation's), so clearing a leftover never takes another claim's volume.
pub fn clone_staging(target: &str, pv: &str) -> String {
    let path = target.trim_end_matches('/');
    let parent = path.rsplit_once('/').map_or("", |(parent, _)| parent);
    format!("{parent}/.{pv}.cloning")
}

/// Copies the directory `from` into the new volume directory `target` of volume `pv` through
/// its staging directory ([`clone_staging`]): a leftover of an attempt cut short is cleared,
/// the copy is made there with [`copy_tree`] until `deadline`, removed again if it fails, and
/// renamed into place when complete. So `target` exists only as a finished copy, and a copy cut
/// short (the call ended) leaves only the staging directory, for the next attempt or the
/// volume's delete to remove.
pub fn clone_into(
    from: &str,
    target: &str,
    pv: &str,
    deadline: std::time::Instant,
) -> Result<Copied, ProvisionError> {
    let staging = clone_staging(target, pv);
    let parent = parent_of(&staging).unwrap_or("/");
    create(parent)?;
    // The staging directory may be a volume the host made (a size-enforcing directory).
    remove_volume(parent, &staging, pv)?;
    let copied = match copy_tree(from, &staging, deadline) {
        Ok(copied) => copied,
        Err(error) => {
            remove_volume(parent, &staging, pv)?;
            return Err(error);
        }
    };
    fs::rename(&staging, target)
        .map_err(|error| final_error(format!("renaming {staging} to {target}: {error}")))?;
    Ok(copied)
}

#[cfg(not(target_os = "wasi"))]
fn split_parent(path: &str) -> Result<(&str, &str), ProvisionError> {
    match path.trim_end_matches('/').rsplit_once('/') {
        Some(("", name)) if !name.is_empty() => Ok(("/", name)),
        Some((parent, name)) if !name.is_empty() => Ok((parent, name)),
        _ => Err(final_error(format!(
            "{path} is not an absolute path below a directory"
        ))),
    }
}

/// Renames `from` to `{root}/{base}`, or `{base}-1`, `{base}-2`, ... if taken; returns the name.
pub fn rename_to_free_name(from: &str, root: &str, base: &str) -> Result<String, ProvisionError> {
    let path_of = |name: &str| crate::join(root, name);
    let name = free_name(base, |name| fs::symlink_metadata(path_of(name)).is_ok());
    let to = path_of(&name);
    fs::rename(from, &to)
        .map_err(|error| final_error(format!("renaming {from} to {to}: {error}")))?;
    Ok(name)
}

/// `base`, or the first of `base-1`, `base-2`, ... that `taken` says is free.
pub fn free_name(base: &str, taken: impl Fn(&str) -> bool) -> String {
    if !taken(base) {
        return base.to_owned();
    }
    (1u64..)
        .map(|suffix| format!("{base}-{suffix}"))
        .find(|candidate| !taken(candidate))
        .expect("some numeric suffix is free")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_logged_with_its_counts_and_at_warn_when_owners_were_not_kept() {
        let host = crate::testing::FakeHost::new();
        let copied = Copied {
            entries: 3,
            links: 1,
            ..Copied::default()
        };
        copied.log(&host, "cloned", &[("pv", "pvc-1")]);
        let lost = Copied {
            owners_not_kept: 2,
            ..copied.clone()
        };
        lost.log(&host, "cloned", &[("pv", "pvc-2")]);
        assert_eq!(
            host.logs(),
            [
                "LogLevel::Info cloned pv=pvc-1 entries=3 bytes=0 links=1 skipped=0 owners-not-kept=0 snapshot=0",
                "LogLevel::Warn cloned; the filesystem would not let the host keep some owners pv=pvc-2 entries=3 bytes=0 links=1 skipped=0 owners-not-kept=2 snapshot=0",
            ]
        );
    }

    #[test]
    fn clone_staging_is_a_hidden_sibling_named_after_the_pv() {
        assert_eq!(
            clone_staging("/nodes/n1/opt/lp/ns/data", "pvc-1"),
            "/nodes/n1/opt/lp/ns/.pvc-1.cloning"
        );
        assert_eq!(
            clone_staging("/nodes/n1/x/", "pvc-1"),
            "/nodes/n1/.pvc-1.cloning"
        );
        assert_eq!(
            clone_staging("/export/team-a/db", "pvc-2"),
            "/export/team-a/.pvc-2.cloning"
        );
    }

    /// A copy takes files, directories and links (as links, relative or absolute, never their
    /// targets), leaves FIFOs out, and stops at its deadline.
    #[cfg(unix)]
    #[test]
    fn a_tree_is_copied_by_descriptor_with_links_as_links() {
        use std::os::unix::fs::symlink;
        let base = std::env::temp_dir().join(format!("sdk-copy-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let (from, to) = (base.join("from"), base.join("to"));
        fs::create_dir_all(from.join("a/b")).unwrap();
        fs::write(from.join("top"), b"top").unwrap();
        fs::write(from.join("a/b/deep"), vec![7u8; 200_000]).unwrap();
        fs::write(base.join("secret"), b"outside").unwrap();
        symlink("../secret", from.join("a/up")).unwrap();
        symlink("/etc", from.join("etc")).unwrap();
        let fifo = std::process::Command::new("mkfifo")
            .arg(from.join("fifo"))
            .status()
            .unwrap();
        assert!(fifo.success());
        let later = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
        let copied = copy_tree(&path(&from), &path(&to), later).unwrap();
        assert_eq!(fs::read(to.join("top")).unwrap(), b"top");
        assert_eq!(fs::read(to.join("a/b/deep")).unwrap().len(), 200_000);
        assert_eq!(
            fs::read_link(to.join("a/up")).unwrap(),
            std::path::Path::new("../secret")
        );
        assert_eq!(
            fs::read_link(to.join("etc")).unwrap(),
            std::path::Path::new("/etc")
        );
        assert!(!to.join("fifo").exists());
        assert_eq!(copied.skipped, 1);
        assert_eq!(copied.links, 2);
        assert_eq!(copied.bytes, 200_003);
        assert_eq!(copied.entries, 6, "{copied:?}");

        let error = copy_tree(
            &path(&from),
            &path(&base.join("late")),
            std::time::Instant::now(),
        )
        .unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("out of time")),
            "{error:?}"
        );
        let error = copy_tree(&path(&from), &path(&to), later).unwrap_err();
        assert!(
            matches!(&error, ProvisionError::Final(m) if m.contains("opening")),
            "an existing target is never copied into: {error:?}"
        );
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn chores_on_a_real_directory() {
        let root = std::env::temp_dir().join(format!("sdk-dirs-{}", std::process::id()));
        let root = root.to_str().unwrap().to_owned();
        let a = format!("{root}/x/a");
        create(&a).unwrap();
        assert!(exists(&a).unwrap());
        create(&format!("{root}/archived-a")).unwrap();
        assert_eq!(
            rename_to_free_name(&a, &root, "archived-a").unwrap(),
            "archived-a-1"
        );
        assert!(!exists(&a).unwrap());
        assert!(remove(&format!("{root}/archived-a-1")).unwrap());
        assert!(
            !remove(&format!("{root}/archived-a-1")).unwrap(),
            "already gone"
        );
        remove(&root).unwrap();
    }

    #[test]
    fn removes_deep_trees_and_many_entries_and_never_follows_links() {
        let root = std::env::temp_dir().join(format!("sdk-rm-{}", std::process::id()));
        let root = root.to_str().unwrap().to_owned();
        let mut deep = format!("{root}/v");
        for i in 0..100 {
            deep = format!("{deep}/d{i}");
        }
        create(&deep).unwrap();
        for i in 0..3000 {
            fs::write(format!("{root}/v/f{i}"), b"x").unwrap();
        }
        let outside = format!("{root}-outside");
        create(&outside).unwrap();
        fs::write(format!("{outside}/keep"), b"x").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&outside, format!("{root}/v/d0/link")).unwrap();
        assert!(remove(&format!("{root}/v")).unwrap());
        assert!(!exists(&format!("{root}/v")).unwrap());
        assert!(
            exists(&format!("{outside}/keep")).unwrap(),
            "the link was not followed"
        );
        remove(&root).unwrap();
        remove(&outside).unwrap();
    }

    #[test]
    fn removes_trees_deeper_than_path_max() {
        let root = std::env::temp_dir().join(format!("sdk-path-max-{}", std::process::id()));
        let root = root.to_str().unwrap().to_owned();
        let (chain, up) = (format!("{root}/chain"), format!("{root}/up"));
        create(&chain).unwrap();
        fs::write(format!("{chain}/bottom"), b"x").unwrap();
        // Grown from the top, since no path this long can be created in one go.
        let long = "d".repeat(200);
        for level in 0..40 {
            create(&up).unwrap();
            fs::rename(&chain, format!("{up}/{long}")).unwrap();
            fs::write(format!("{up}/file-{level}"), b"x").unwrap();
            fs::rename(&up, &chain).unwrap();
        }
        assert!(remove(&chain).unwrap());
        assert!(!exists(&chain).unwrap());
        remove(&root).unwrap();
    }

    /// A pod still running swaps a directory of the volume and a link to the volume beside it
    /// (`RENAME_EXCHANGE`) in a loop while the volume is deleted: the neighbour keeps every
    /// file. The path-walking delete this replaced lost some of them in most rounds.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_pod_swapping_in_a_link_never_leads_the_delete_out() {
        use rustix::fs::{Mode, OFlags, RenameFlags};
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let root = std::env::temp_dir().join(format!("sdk-race-{}", std::process::id()));
        let neighbour = root.join("neighbour");
        create(neighbour.to_str().unwrap()).unwrap();
        for i in 0..500 {
            fs::write(neighbour.join(format!("f{i}")), b"x").unwrap();
        }
        for round in 0..20 {
            let volume = root.join(format!("v{round}"));
            create(volume.join("d/sub").to_str().unwrap()).unwrap();
            for i in 0..100 {
                fs::write(volume.join(format!("d/f{i}")), b"x").unwrap();
                fs::write(volume.join(format!("d/sub/f{i}")), b"x").unwrap();
            }
            std::os::unix::fs::symlink("../neighbour", volume.join("l")).unwrap();
            let dir = rustix::fs::open(&volume, OFlags::DIRECTORY, Mode::empty()).unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let pod = std::thread::spawn({
                let stop = stop.clone();
                move || {
                    // Puts back what the delete removed, a bounded number of times.
                    let mut relinks = 200;
                    while !stop.load(Ordering::Relaxed) {
                        if rustix::fs::renameat_with(&dir, "d", &dir, "l", RenameFlags::EXCHANGE)
                            .is_err()
                        {
                            if relinks == 0 {
                                break;
                            }
                            relinks -= 1;
                            let _ = rustix::fs::symlinkat("../neighbour", &dir, "l");
                            let _ = rustix::fs::mkdirat(&dir, "d", Mode::from_raw_mode(0o755));
                        }
                    }
                }
            });
            // As the controller does, a delete that failed is tried again.
            let outcomes: Vec<_> = (0..5)
                .map_while(|_| {
                    exists(volume.to_str().unwrap())
                        .unwrap()
                        .then(|| remove(volume.to_str().unwrap()))
                })
                .collect();
            stop.store(true, Ordering::Relaxed);
            pod.join().unwrap();
            assert_eq!(
                fs::read_dir(&neighbour).unwrap().count(),
                500,
                "round {round}: the neighbour lost files ({outcomes:?})"
            );
            assert!(
                !exists(volume.to_str().unwrap()).unwrap(),
                "round {round}: {outcomes:?}"
            );
        }
        remove(root.to_str().unwrap()).unwrap();
    }

    #[test]
    fn a_new_volume_never_adopts_a_directory_with_data() {
        let root = std::env::temp_dir().join(format!("sdk-adopt-{}", std::process::id()));
        let root = root.to_str().unwrap().to_owned();
        create_empty(&format!("{root}/a")).unwrap();
        create_empty(&format!("{root}/a")).expect("a retry finds it empty");
        fs::write(format!("{root}/a/data"), b"x").unwrap();
        let error = create_empty(&format!("{root}/a")).unwrap_err();
        assert!(format!("{error:?}").contains("not adopted"), "{error:?}");
        remove(&root).unwrap();
    }

    #[test]
    fn free_names_count_up() {
        assert_eq!(free_name("a", |_| false), "a");
        assert_eq!(free_name("a", |n| ["a", "a-1"].contains(&n)), "a-2");
    }
}
