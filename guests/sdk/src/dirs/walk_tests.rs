//! Tests of the walk ([`super::walk`]) against this process's filesystem ([`super::native`]):
//! kept apart so that the walk itself does not depend on the native calls.

use super::walk::*;
use crate::dirs::native::{self, Native};
use std::cell::Cell;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::rc::Rc;

/// Something the walk holds open (a directory or a listing), counted while it lives.
struct Held<T> {
    inner: T,
    open: Rc<Cell<usize>>,
    calls: Rc<Cell<usize>>,
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        self.open.set(self.open.get() - 1);
    }
}

impl<T: Iterator> Iterator for Held<T> {
    type Item = T::Item;
    fn next(&mut self) -> Option<T::Item> {
        self.calls.set(self.calls.get() + 1);
        self.inner.next()
    }
}

/// What a pod does right before the walk opens a directory (its parent, the name).
type BeforeOpen = Box<dyn Fn(&OwnedFd, &str)>;

/// The native calls, counting every call and the most held open at once; `before_open`
/// runs before each `open_dir` (a pod acting between a listing and the open).
#[derive(Default)]
struct Counting {
    open: Rc<Cell<usize>>,
    most: Cell<usize>,
    calls: Rc<Cell<usize>>,
    before_open: Option<BeforeOpen>,
}

impl Counting {
    fn hold<T>(&self, inner: T) -> Held<T> {
        self.open.set(self.open.get() + 1);
        self.most.set(self.most.get().max(self.open.get()));
        Held {
            inner,
            open: self.open.clone(),
            calls: self.calls.clone(),
        }
    }

    fn call(&self) {
        self.calls.set(self.calls.get() + 1);
    }
}

impl Tree for Counting {
    type Dir = Held<OwnedFd>;
    type Listing = Held<native::Listing>;

    fn open_root(&self, root: &str) -> Result<Self::Dir, Failure> {
        Native.open_root(root).map(|d| self.hold(d))
    }
    fn exists(&self, dir: &Self::Dir, name: &str) -> Result<bool, Failure> {
        self.call();
        Native.exists(&dir.inner, name)
    }
    fn open_dir(&self, dir: &Self::Dir, name: &str) -> Result<Self::Dir, Failure> {
        self.call();
        if let Some(before) = &self.before_open {
            before(&dir.inner, name);
        }
        Native.open_dir(&dir.inner, name).map(|d| self.hold(d))
    }
    fn list(&self, dir: &Self::Dir) -> Result<Self::Listing, Failure> {
        self.call();
        Native.list(&dir.inner).map(|l| self.hold(l))
    }
    fn unlink(&self, dir: &Self::Dir, name: &str) -> Result<(), Failure> {
        self.call();
        Native.unlink(&dir.inner, name)
    }
    fn remove_dir(&self, dir: &Self::Dir, name: &str) -> Result<(), Failure> {
        self.call();
        Native.remove_dir(&dir.inner, name)
    }
    fn rename(
        &self,
        from: &Self::Dir,
        name: &str,
        to: &Self::Dir,
        to_name: &str,
    ) -> Result<(), Failure> {
        self.call();
        Native.rename(&from.inner, name, &to.inner, to_name)
    }
}

fn open(path: &Path) -> OwnedFd {
    Native.open_root(&path.display().to_string()).unwrap()
}

/// `remove` of `path`, looked for from its parent.
fn remove(tree: &Counting, path: &str) -> Result<bool, Failed> {
    let (root, _) = path.rsplit_once('/').unwrap();
    super::walk::remove(tree, root, path)
}

/// `depth` nested directories `a` below `top`, each made relative to the one above.
fn chain(top: &Path, depth: usize) {
    let mut at = open(top);
    for _ in 0..depth {
        rustix::fs::mkdirat(&at, "a", rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
        at = Native.open_dir(&at, "a").unwrap();
    }
}

fn scratch(what: &str) -> std::path::PathBuf {
    let root = std::env::temp_dir().join(format!("sdk-walk-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    root
}

#[test]
fn a_chain_far_deeper_than_the_stack_costs_what_it_holds() {
    let root = scratch("chain");
    let volume = root.join("v");
    std::fs::create_dir(&volume).unwrap();
    let depth = 10_000;
    chain(&volume, depth);
    let tree = Counting::default();
    assert!(remove(&tree, volume.to_str().unwrap()).is_ok_and(|removed| removed));
    assert!(!volume.exists());
    let calls = tree.calls.get();
    println!(
        "{depth} nested directories: {calls} calls, at most {} open",
        tree.most.get()
    );
    // Each directory: opened, listed (twice: before and after its child), its entry read,
    // removed; and one in DEEPEST moved up. Starting over from the top would be ~depth^2/2.
    assert!(calls < 7 * depth, "{calls} calls for {depth} directories");
    // The stack, a listing, the child being opened and the volume's parent.
    assert!(tree.most.get() <= DEEPEST + 3, "{} open", tree.most.get());
    assert_eq!(tree.open.get(), 0, "everything closed");
    std::fs::remove_dir(&root).unwrap();
}

#[test]
fn a_directory_swapped_for_a_link_after_the_listing_is_unlinked_not_followed() {
    let root = scratch("swap");
    let (volume, neighbour) = (root.join("v"), root.join("neighbour"));
    std::fs::create_dir_all(volume.join("d/sub")).unwrap();
    std::fs::create_dir_all(neighbour.join("sub")).unwrap();
    for i in 0..10 {
        std::fs::write(volume.join(format!("d/sub/{i}")), b"x").unwrap();
        std::fs::write(neighbour.join(format!("sub/{i}")), b"x").unwrap();
        std::fs::write(neighbour.join(format!("{i}")), b"x").unwrap();
    }
    std::os::unix::fs::symlink("../neighbour", volume.join("l")).unwrap();
    // The pod: the first time the walk opens `d`, which it listed as a directory, `d` has
    // just been moved aside and replaced by a link to the neighbour.
    let swapped = Rc::new(Cell::new(false));
    let tree = Counting {
        before_open: Some(Box::new({
            let swapped = swapped.clone();
            move |dir, name| {
                if name == "d" && !swapped.replace(true) {
                    rustix::fs::renameat(dir, "d", dir, "was-d").unwrap();
                    rustix::fs::symlinkat("../neighbour", dir, "d").unwrap();
                }
            }
        })),
        ..Counting::default()
    };
    assert!(remove(&tree, volume.to_str().unwrap()).unwrap());
    assert!(swapped.get(), "the pod swapped");
    assert!(!volume.exists());
    assert_eq!(
        std::fs::read_dir(neighbour.join("sub")).unwrap().count()
            + std::fs::read_dir(&neighbour).unwrap().count(),
        21,
        "the neighbour keeps every file"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn names_taken_in_the_volume_are_skipped_when_moving_up() {
    let root = scratch("taken");
    let volume = root.join("v");
    std::fs::create_dir_all(volume.join(".deleting-1/kept-until-its-turn")).unwrap();
    std::fs::write(volume.join(".deleting-0"), b"a file").unwrap();
    std::os::unix::fs::symlink("/", volume.join(".deleting-2")).unwrap();
    chain(&volume, 3 * DEEPEST);
    let tree = Counting::default();
    assert!(remove(&tree, volume.to_str().unwrap()).unwrap());
    assert!(!volume.exists());
    std::fs::remove_dir(&root).unwrap();
}

#[test]
fn nothing_there_is_not_an_error() {
    let root = scratch("gone");
    let tree = Counting::default();
    let path = root.join("never");
    assert!(!remove(&tree, path.to_str().unwrap()).unwrap());
    // Below the root, a missing directory on the way is gone too (a pruned parent).
    let (root_text, below) = (root.to_str().unwrap(), path.join("below"));
    assert!(!super::walk::remove(&tree, root_text, below.to_str().unwrap()).unwrap());
    assert!(!present(&tree, root_text, below.to_str().unwrap()).unwrap());
    std::fs::remove_dir(&root).unwrap();
}

/// Issue 32: a root that is not there (its grant's directory moved away, a mount missing)
/// is an error, never "already gone": before, `remove` answered false (gone) for a path
/// whose parent did not exist.
#[test]
fn a_missing_root_is_an_error_not_gone() {
    let root = scratch("missing-root");
    let tree = Counting::default();
    let moved = root.join("moved-away");
    let path = moved.join("pvc-1");
    let (moved, path) = (moved.to_str().unwrap(), path.to_str().unwrap());
    for error in [
        remove(&tree, path).unwrap_err(),
        super::walk::remove(&tree, moved, path).unwrap_err(),
        present(&tree, moved, path).unwrap_err(),
    ] {
        assert_eq!(error.at, moved);
        assert!(
            error.failure.to_string().contains("not taken for gone"),
            "{error:?}"
        );
    }
    for (root, path) in [
        (moved, "/elsewhere/pvc-1"),
        (moved, moved),
        (moved, &format!("{moved}/a/../b")),
    ] {
        assert!(super::walk::remove(&tree, root, path).is_err(), "{path}");
    }
    std::fs::remove_dir(&root).unwrap();
}
