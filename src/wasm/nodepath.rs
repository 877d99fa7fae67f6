//! The on-disk check of a returned `hostPath`/`local` path: beneath its granted directory,
//! with no symlink in any component.
//!
//! The text checks in [`super::spec`] only see the string. The kubelet follows links, so a
//! guest (or a tenant's pod writing into a volume inside the guest's preopen) that leaves a
//! link at `<prefix>/pvc-x` or at any component between the prefix and it would hand the pod
//! whatever the link points at. Each component is opened with `O_PATH | O_NOFOLLOW` relative to
//! the one before (never by its full path), so nothing can be swapped between two steps.

use std::os::fd::OwnedFd;
use std::path::{Component, Path};

use rustix::fs::{FileType, Mode, OFlags};

use super::bindings::types::{HostPathSource, LocalSource, VolumeSource};
use super::grants::Grants;

/// Why a returned path was refused on disk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodePathError {
    /// A component of the path is a symbolic link.
    #[error("{path}: component {component:?} is a symbolic link; the kubelet would follow it")]
    Symlink {
        /// The returned path.
        path: String,
        /// The path up to and including the link.
        component: String,
    },
    /// A component below the granted directory is neither a directory nor, for the last one,
    /// a regular file.
    #[error("{path}: component {component:?} is not a directory or a regular file")]
    NotDirectory {
        /// The returned path.
        path: String,
        /// The offending component.
        component: String,
    },
    /// The path could not be inspected.
    #[error("{path}: cannot inspect {component:?}: {message}")]
    Io {
        /// The returned path.
        path: String,
        /// Where it failed.
        component: String,
        /// The OS error.
        message: String,
    },
}

/// The directory in the controller's filesystem under which a node path can be checked: a
/// granted directory whose host path is a prefix of it (the node and the controller see that
/// directory at the same path, as `deploy/` mounts it); the outermost one, so every component
/// the guest could have written is walked. `None` when the path is not visible here.
pub fn checkable_root<'g>(grants: &'g Grants, path: &Path) -> Option<&'g Path> {
    grants
        .dirs
        .iter()
        .map(|d| d.host.as_path())
        .filter(|host| path.starts_with(host))
        .min_by_key(|host| host.components().count())
}

/// The node path of a `hostPath` or `local` source.
pub fn node_path(source: &VolumeSource) -> Option<&str> {
    match source {
        VolumeSource::HostPath(HostPathSource { path, .. })
        | VolumeSource::Local(LocalSource { path, .. }) => Some(path),
        VolumeSource::Nfs(_) | VolumeSource::Csi(_) => None,
    }
}

/// Checks the source of a built volume on disk when its path is visible to the controller.
pub fn check_source(grants: &Grants, source: &VolumeSource) -> Result<(), NodePathError> {
    let Some(path) = node_path(source).map(Path::new) else {
        return Ok(());
    };
    match checkable_root(grants, path) {
        Some(root) => check_beneath(root, path),
        None => Ok(()),
    }
}

/// Checks that `path` lies beneath `root` with no symlink in any component below `root`.
/// `root` itself is the operator's and trusted. Components that do not exist yet are fine (the
/// kubelet creates them under what was checked); the deepest existing one must be clean.
pub fn check_beneath(root: &Path, path: &Path) -> Result<(), NodePathError> {
    let shown = path.display().to_string();
    let io = |component: &Path, e: rustix::io::Errno| NodePathError::Io {
        path: shown.clone(),
        component: component.display().to_string(),
        message: std::io::Error::from(e).to_string(),
    };
    let rest = path.strip_prefix(root).map_err(|_| NodePathError::Io {
        path: shown.clone(),
        component: root.display().to_string(),
        message: "not beneath the granted directory".into(),
    })?;
    let mut current: OwnedFd = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(root, e))?;
    let mut walked = root.to_path_buf();
    let parts: Vec<_> = rest.components().collect();
    for (i, part) in parts.iter().enumerate() {
        let Component::Normal(name) = part else {
            return Err(NodePathError::Io {
                path: shown,
                component: walked.display().to_string(),
                message: "path is not normalised".into(),
            });
        };
        walked.push(name);
        let next = match rustix::fs::openat(
            &current,
            *name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            // Not there yet: the kubelet (or the guest later) creates it below what was checked.
            Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(io(&walked, e)),
        };
        let stat = rustix::fs::fstat(&next).map_err(|e| io(&walked, e))?;
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Symlink => {
                return Err(NodePathError::Symlink {
                    path: shown,
                    component: walked.display().to_string(),
                });
            }
            FileType::Directory => current = next,
            FileType::RegularFile if i + 1 == parts.len() => return Ok(()),
            _ => {
                return Err(NodePathError::NotDirectory {
                    path: shown,
                    component: walked.display().to_string(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn clean_paths_pass_and_missing_tails_are_fine() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("ns/pvc-1")).unwrap();
        std::fs::write(root.path().join("ns/file"), b"x").unwrap();
        let r = root.path();
        assert_eq!(check_beneath(r, &r.join("ns/pvc-1")), Ok(()));
        assert_eq!(check_beneath(r, &r.join("ns/file")), Ok(()));
        assert_eq!(check_beneath(r, &r.join("ns/new/deeper")), Ok(()));
        assert_eq!(check_beneath(r, r), Ok(()));
    }

    #[test]
    fn a_link_anywhere_below_the_root_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("real/pvc-2")).unwrap();
        symlink("../../../../etc", r.join("pvc-1")).unwrap();
        symlink("real", r.join("mid")).unwrap();
        symlink("/nonexistent", r.join("dangling")).unwrap();
        for (path, component) in [
            ("pvc-1", "pvc-1"),
            ("mid/pvc-2", "mid"),
            ("dangling", "dangling"),
            ("dangling/below", "dangling"),
        ] {
            let err = check_beneath(r, &r.join(path)).unwrap_err();
            assert_eq!(
                err,
                NodePathError::Symlink {
                    path: r.join(path).display().to_string(),
                    component: r.join(component).display().to_string(),
                },
                "{path}"
            );
        }
        std::fs::write(r.join("file"), b"x").unwrap();
        assert!(matches!(
            check_beneath(r, &r.join("file/below")),
            Err(NodePathError::NotDirectory { .. })
        ));
    }

    #[test]
    fn only_paths_under_a_granted_directory_are_checkable() {
        let grants = Grants::parse(
            "provisioner = \"x/y\"\n[[dirs]]\nhost = \"/srv/a\"\nguest = \"/a\"\naccess = \"read-write\"\n[[dirs]]\nhost = \"/srv/a/b\"\nguest = \"/b\"\naccess = \"read-only\"",
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(
            checkable_root(&grants, Path::new("/srv/a/b/c")),
            Some(Path::new("/srv/a"))
        );
        assert_eq!(
            checkable_root(&grants, Path::new("/srv/a/x")),
            Some(Path::new("/srv/a"))
        );
        assert_eq!(checkable_root(&grants, Path::new("/srv/ab")), None);
    }
}
