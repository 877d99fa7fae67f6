//! The index of served node paths: every `hostPath`/`local` path a live PV points at, so a
//! served path can never change under the kubelet.
//!
//! ```text
//! PV watch (apply / delete) ──▶ note / forget ─┐
//! provision: returned path ──▶ reserve ────────┤  refused: equal to another PV's path, an
//!                                              │  ancestor or a descendant of one
//! delete call starts ─────────▶ release ───────┤
//! guest rename-at ─▶ real paths of source and destination ─▶ touches? ─▶ refused
//!                 ─▶ else announced as moving until the rename returns ──▶ reserve of a path
//!                    at or below one refused meanwhile (no lock held across the syscall)
//! ```
//!
//! Why: the kubelet follows links in a PV's path, and tenants' pods can plant links anywhere
//! inside their own volume. A served path changes under the kubelet only if one of its
//! components is inside another volume (nesting, or the prefix itself served) or a directory
//! holding a planted link is renamed onto one of its ancestors. The index refuses the first at
//! provision, [`super::sandbox_fs`] the second at `rename-at` (see `docs/threat-model.md`).
//! It is process-wide (every guest, every grant), keyed by the path as the node sees it.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use k8s_openapi::api::core::v1::PersistentVolume;

/// Why a returned path may not be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServedError {
    /// Another live volume's path is this one, above it or below it.
    #[error(
        "{path} {relation} {other_path} of volume {other}; a pod of one could replace a directory of the other with a link the kubelet follows"
    )]
    Nested {
        /// The returned path.
        path: String,
        /// `is the path`, `is inside` or `contains`.
        relation: &'static str,
        /// The other volume.
        other: String,
        /// Its path.
        other_path: String,
    },
    /// A guest is renaming this path or a directory above it right now.
    #[error(
        "{path} is being moved: a rename of {moving} has not returned yet (it may wait on a lock another process holds); try again"
    )]
    Moving {
        /// The returned path.
        path: String,
        /// The source or destination of the rename in progress.
        moving: String,
    },
    /// The path is a granted prefix or granted directory itself (or above one).
    #[error(
        "{path} is the granted directory {granted} or lies above it; a volume must be a directory below it"
    )]
    Granted {
        /// The returned path.
        path: String,
        /// The prefix or directory.
        granted: String,
    },
}

/// Served paths, each with how many volumes are at it (static `local` PVs on different nodes may
/// share one).
#[derive(Debug, Default)]
pub struct ServedPaths {
    inner: Mutex<Index>,
}

/// Every PV with a node path is in here (10,000 static PVs are 10,000 entries), so an entry is
/// one shared path and one name: about 150 bytes, where a set of names per path cost 540.
#[derive(Debug, Default)]
struct Index {
    /// How many volumes are at each path; ordered by component, so a path's descendants follow
    /// it.
    by_path: BTreeMap<Arc<Path>, u32>,
    by_volume: HashMap<Box<str>, Arc<Path>>,
    /// Sources and destinations of renames in progress, each with how many renames name it.
    moving: BTreeMap<PathBuf, u32>,
}

impl Index {
    fn insert(&mut self, volume: &str, path: &Path) {
        if self.by_volume.get(volume).is_some_and(|at| **at == *path) {
            return;
        }
        self.remove(volume);
        let shared = match self.by_path.get_key_value(path) {
            Some((at, _)) => at.clone(),
            None => Arc::from(path),
        };
        *self.by_path.entry(shared.clone()).or_default() += 1;
        self.by_volume.insert(volume.into(), shared);
    }

    fn remove(&mut self, volume: &str) {
        let Some(path) = self.by_volume.remove(volume) else {
            return;
        };
        if let Some(count) = self.by_path.get_mut(&path) {
            *count -= 1;
            if *count == 0 {
                self.by_path.remove(&path);
            }
        }
    }

    /// How many volumes other than `volume` are at `at`.
    fn others_at(&self, volume: &str, at: &Path, count: u32) -> u32 {
        let own = self.by_volume.get(volume).is_some_and(|p| **p == *at);
        count - u32::from(own)
    }

    /// A volume other than `volume` at `at` (the error path only: a scan).
    fn other_name(&self, volume: &str, at: &Path) -> String {
        self.by_volume
            .iter()
            .find(|(name, p)| &***name != volume && ***p == *at)
            .map(|(name, _)| name.to_string())
            .unwrap_or_default()
    }

    /// Another volume at `path`, above it or below it.
    fn conflict(&self, volume: &str, path: &Path) -> Option<ServedError> {
        let nested = |relation, at: &Path| ServedError::Nested {
            path: path.display().to_string(),
            relation,
            other: self.other_name(volume, at),
            other_path: at.display().to_string(),
        };
        let taken = |at: &Path| {
            self.by_path
                .get(at)
                .is_some_and(|count| self.others_at(volume, at, *count) > 0)
        };
        if taken(path) {
            return Some(nested("is the path", path));
        }
        if let Some(above) = path.ancestors().skip(1).find(|above| taken(above)) {
            return Some(nested("is inside", above));
        }
        // Descendants sort right after `path` (paths compare by component).
        self.by_path
            .range::<Path, _>((Bound::Excluded(path), Bound::Unbounded))
            .take_while(|(at, _)| at.starts_with(path))
            .find(|(at, count)| self.others_at(volume, at, **count) > 0)
            .map(|(at, _)| nested("contains", at))
    }

    /// A path being moved that `path` is, or lies below.
    fn moving_over<'p>(&self, path: &'p Path) -> Option<&'p Path> {
        path.ancestors()
            .find(|above| self.moving.contains_key(*above))
    }

    /// A served path that `path` is, or lies above.
    fn touches(&self, path: &Path) -> Option<&Path> {
        self.by_path
            .range::<Path, _>((Bound::Included(path), Bound::Unbounded))
            .next()
            .map(|(at, _)| &**at)
            .filter(|at| at.starts_with(path))
    }
}

/// The process' index (every guest shares it: a volume of one guest nested in another's is the
/// same hole).
pub fn served() -> &'static ServedPaths {
    static SERVED: OnceLock<ServedPaths> = OnceLock::new();
    SERVED.get_or_init(ServedPaths::default)
}

impl ServedPaths {
    fn lock(&self) -> MutexGuard<'_, Index> {
        // A panic while holding it leaves a consistent map (every update is one insert or
        // remove), so a poisoned lock is still good to use.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that `volume` is being served at `path` unless that would nest it with another
    /// live volume, or serve a granted directory (`granted`: the guest's prefixes and
    /// directories) itself. Checked and recorded at once, so two concurrent calls cannot both
    /// pass. The same volume may reserve its own path again (a retried provision).
    pub fn reserve<'g>(
        &self,
        volume: &str,
        path: &Path,
        granted: impl IntoIterator<Item = &'g Path>,
    ) -> Result<(), ServedError> {
        for granted in granted {
            if granted.starts_with(path) {
                return Err(ServedError::Granted {
                    path: path.display().to_string(),
                    granted: granted.display().to_string(),
                });
            }
        }
        let mut index = self.lock();
        if let Some(moving) = index.moving_over(path) {
            return Err(ServedError::Moving {
                path: path.display().to_string(),
                moving: moving.display().to_string(),
            });
        }
        if let Some(conflict) = index.conflict(volume, path) {
            return Err(conflict);
        }
        index.insert(volume, path);
        Ok(())
    }

    /// `volume` is no longer served (its storage is being deleted, or the PV is gone).
    pub fn release(&self, volume: &str) {
        self.lock().remove(volume);
    }

    /// A PV as the watch delivered it: its path is served, or no longer (a PV without a node
    /// path, or one `Released` or `Failed`: no pod mounts it again, its storage goes next).
    pub fn note(&self, pv: &PersistentVolume) {
        let Some(name) = pv.metadata.name.as_deref() else {
            return;
        };
        let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Released" | "Failed")) {
            return self.release(name);
        }
        match node_path(pv) {
            Some(path) => self.lock().insert(name, Path::new(path)),
            None => self.release(name),
        }
    }

    /// The served path `path` is, or lies above, if any: a directory there must not move.
    pub fn touches(&self, path: &Path) -> Option<PathBuf> {
        self.lock().touches(path).map(Path::to_owned)
    }

    /// A rename of `paths` (its source and destination) is about to happen: refused, with the
    /// path and the served path it touches, if either is a served path or lies above one;
    /// otherwise no path at or below either can be reserved until the returned guard is
    /// dropped, right after the rename returned. Checked and announced in one step, so no
    /// volume a rename could move is served in between, and nothing is locked meanwhile.
    pub fn begin_move<'p>(&self, paths: [&'p Path; 2]) -> Result<Move<'_>, (&'p Path, PathBuf)> {
        let mut index = self.lock();
        for path in paths {
            if let Some(served) = index.touches(path) {
                return Err((path, served.to_owned()));
            }
        }
        let paths = paths.map(Path::to_owned);
        for path in &paths {
            *index.moving.entry(path.clone()).or_default() += 1;
        }
        Ok(Move { index: self, paths })
    }

    /// How many paths are served.
    pub fn len(&self) -> usize {
        self.lock().by_path.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A rename in progress, announced to the index until dropped.
#[must_use = "the move ends when this is dropped"]
pub struct Move<'i> {
    index: &'i ServedPaths,
    paths: [PathBuf; 2],
}

impl Drop for Move<'_> {
    fn drop(&mut self) {
        let mut index = self.index.lock();
        for path in &self.paths {
            if let Some(count) = index.moving.get_mut(path) {
                *count -= 1;
                if *count == 0 {
                    index.moving.remove(path);
                }
            }
        }
    }
}

/// The `hostPath` or `local` path of a PV.
pub fn node_path(pv: &PersistentVolume) -> Option<&str> {
    let spec = pv.spec.as_ref()?;
    spec.host_path
        .as_ref()
        .map(|h| h.path.as_str())
        .or_else(|| spec.local.as_ref().map(|l| l.path.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reserve(index: &ServedPaths, volume: &str, path: &str) -> Result<(), ServedError> {
        index.reserve(volume, Path::new(path), [Path::new("/srv/vol")])
    }

    #[test]
    fn nesting_either_way_and_the_prefix_are_refused() {
        let index = ServedPaths::default();
        assert_eq!(reserve(&index, "a", "/srv/vol/a"), Ok(()));
        assert_eq!(reserve(&index, "a", "/srv/vol/a"), Ok(()), "a retry");
        for (path, relation) in [
            ("/srv/vol/a", "is the path"),
            ("/srv/vol/a/x", "is inside"),
            ("/srv/vol/a/x/y", "is inside"),
        ] {
            let err = reserve(&index, "b", path).unwrap_err();
            assert!(
                matches!(&err, ServedError::Nested { relation: r, other, .. } if *r == relation && other == "a"),
                "{path}: {err}"
            );
        }
        assert_eq!(reserve(&index, "deep", "/srv/vol/ns/deep"), Ok(()));
        let err = reserve(&index, "over", "/srv/vol/ns").unwrap_err();
        assert!(
            err.to_string().contains("contains /srv/vol/ns/deep"),
            "{err}"
        );
        for path in ["/srv/vol", "/srv", "/"] {
            assert!(matches!(
                reserve(&index, "p", path),
                Err(ServedError::Granted { .. })
            ));
        }
        // Siblings whose names share a prefix are not nested.
        assert_eq!(reserve(&index, "a2", "/srv/vol/a-x"), Ok(()));
        assert_eq!(reserve(&index, "a3", "/srv/vol/a.b"), Ok(()));
        index.release("a");
        assert_eq!(reserve(&index, "b", "/srv/vol/a/x"), Ok(()));
    }

    #[test]
    fn touches_means_the_path_or_above_it() {
        let index = ServedPaths::default();
        reserve(&index, "a", "/srv/vol/ns/a").unwrap();
        for (path, touches) in [
            ("/srv/vol/ns/a", true),
            ("/srv/vol/ns", true),
            ("/srv/vol", true),
            ("/srv/vol/ns/a/inside", false),
            ("/srv/vol/ns/ab", false),
            ("/srv/vol/n", false),
            ("/srv/vol/other", false),
        ] {
            assert_eq!(index.touches(Path::new(path)).is_some(), touches, "{path}");
        }
    }

    #[test]
    fn a_rename_in_progress_holds_off_paths_at_or_below_it_only_until_it_returns() {
        let index = ServedPaths::default();
        reserve(&index, "a", "/srv/vol/a").unwrap();
        let refused = index
            .begin_move([Path::new("/srv/vol"), Path::new("/srv/other")])
            .err()
            .expect("the grant holds a served path");
        assert_eq!(refused.1, Path::new("/srv/vol/a"));
        let moving = index
            .begin_move([Path::new("/srv/vol/x"), Path::new("/srv/vol/y")])
            .expect("neither holds a served path");
        // The index is not locked meanwhile: other volumes are served.
        assert_eq!(reserve(&index, "b", "/srv/vol/b"), Ok(()));
        for path in ["/srv/vol/x", "/srv/vol/x/v", "/srv/vol/y/v/w"] {
            assert!(
                matches!(reserve(&index, "c", path), Err(ServedError::Moving { .. })),
                "{path}"
            );
        }
        let again = index
            .begin_move([Path::new("/srv/vol/x"), Path::new("/srv/vol/z")])
            .unwrap();
        drop(moving);
        assert!(matches!(
            reserve(&index, "c", "/srv/vol/x/v"),
            Err(ServedError::Moving { .. })
        ));
        assert_eq!(reserve(&index, "c", "/srv/vol/y/v"), Ok(()));
        drop(again);
        assert_eq!(reserve(&index, "d", "/srv/vol/x/v"), Ok(()));
    }

    #[test]
    fn a_volume_moving_its_path_keeps_one_entry() {
        let index = ServedPaths::default();
        reserve(&index, "a", "/srv/vol/a").unwrap();
        reserve(&index, "a", "/srv/vol/b").unwrap();
        assert_eq!(index.len(), 1);
        assert_eq!(reserve(&index, "c", "/srv/vol/a/x"), Ok(()));
    }

    #[test]
    fn volumes_sharing_a_path_are_counted_each() {
        let index = ServedPaths::default();
        // Static `local` PVs of two nodes at one path.
        index.lock().insert("node-1-disk", Path::new("/mnt/disk"));
        index.lock().insert("node-2-disk", Path::new("/mnt/disk"));
        assert_eq!(index.len(), 1);
        let err = index
            .reserve("node-1-disk", Path::new("/mnt/disk"), [Path::new("/mnt")])
            .unwrap_err();
        assert!(err.to_string().contains("node-2-disk"), "{err}");
        index.release("node-2-disk");
        assert_eq!(
            index.reserve("node-1-disk", Path::new("/mnt/disk"), [Path::new("/mnt")]),
            Ok(())
        );
        index.release("node-1-disk");
        assert!(index.is_empty());
        assert_eq!(index.touches(Path::new("/mnt")), None);
    }
}
