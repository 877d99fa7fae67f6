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
use super::ownership::Ownership;
use super::sized;

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
    /// The owner, group or mode asked for could not be applied.
    #[error("{path}: cannot give it {asked}: {message}")]
    Ownership {
        /// The returned path.
        path: String,
        /// What was asked.
        asked: String,
        /// Why not.
        message: String,
    },
    /// A volume with an enforced size could not be made there.
    #[error("{path}: {message}")]
    Sized {
        /// The returned path.
        path: String,
        /// Why.
        message: String,
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

/// Checks the source of a built volume on disk when its path is visible to the controller, and
/// gives its directory the owner, group and mode the guest asked for, through the descriptor
/// the walk ended on (never by path). Asking for an owner of a path the controller cannot see,
/// or of one that does not exist yet, is refused: the host would have nothing it checked to
/// change.
pub fn check_source(
    grants: &Grants,
    source: &VolumeSource,
    ownership: &Ownership,
    volume: &OnDisk<'_>,
) -> Result<(), NodePathError> {
    let Some(path) = node_path(source).map(Path::new) else {
        return Ok(());
    };
    let refused = |message: &str| NodePathError::Ownership {
        path: path.display().to_string(),
        asked: ownership.to_string(),
        message: message.to_owned(),
    };
    let Some(root) = checkable_root(grants, path) else {
        if ownership.is_empty() {
            return Ok(());
        }
        return Err(refused(
            "the path lies in no granted directory, so this process cannot see it (run one instance per node with the node path mounted at its own path; docs/operating.md)",
        ));
    };
    let end = walk_beneath(root, path)?;
    if let Some((_, backend)) = sized::sized_dir(grants, path) {
        let made = sized_volume(root, path, backend, volume)?;
        super::ownership::apply(&made, ownership).map_err(|e| refused(&e.to_string()))?;
        // The limit last: see sized::make.
        return sized::limit(backend, &made, volume.bytes, &path.display().to_string())
            .map_err(|e| sized_error(path, e.to_string()));
    }
    if ownership.is_empty() {
        return Ok(());
    }
    if path == root {
        return Err(refused(
            "it is the granted directory itself, not a volume in it",
        ));
    }
    let Some(dir) = end else {
        return Err(refused(
            "the directory does not exist; create it before returning the volume",
        ));
    };
    super::ownership::apply(dir, ownership).map_err(|e| refused(&e.to_string()))
}

/// Raises the limit of the volume at `source`'s path to `volume.bytes` when that path lies in a
/// size-enforcing directory ([`sized::raise`]), walked from its granted directory with no link
/// in any component: the path on the PV, never one a pod could have changed under it. `false`
/// when there is no limit to raise (an NFS or CSI source, a directory without `sizes`).
pub fn grow(
    grants: &Grants,
    source: &VolumeSource,
    volume: &OnDisk<'_>,
) -> Result<bool, NodePathError> {
    let Some(path) = node_path(source).map(Path::new) else {
        return Ok(false);
    };
    let (Some((_, backend)), Some(root)) =
        (sized::sized_dir(grants, path), checkable_root(grants, path))
    else {
        return Ok(false);
    };
    let failed = |message: String| sized_error(path, message);
    let end = walk_beneath(root, path)?
        .ok_or_else(|| failed("the volume is not there; nothing to grow".into()))?;
    let dir = sized::reopen(&end).map_err(|e| failed(std::io::Error::from(e).to_string()))?;
    sized::raise(
        backend,
        &dir,
        volume.pv,
        volume.bytes,
        &path.display().to_string(),
    )
    .map_err(|e| failed(e.to_string()))?;
    Ok(true)
}

/// What the host knows of the volume whose path it checks: the PV it is for and its capacity
/// (the limit of a volume with an enforced size).
#[derive(Debug, Clone, Copy)]
pub struct OnDisk<'a> {
    /// The PV's name.
    pub pv: &'a str,
    /// The PV's capacity in bytes.
    pub bytes: u64,
}

/// The volume at `path` in a size-enforcing directory ([`sized::make`]), reached through its
/// parent as walked from `root`.
fn sized_volume(
    root: &Path,
    path: &Path,
    backend: crate::sizes::SizeBackend,
    volume: &OnDisk<'_>,
) -> Result<OwnedFd, NodePathError> {
    let shown = path.display().to_string();
    let failed = |message: String| sized_error(path, message);
    let (Some(parent), Some(name)) = (path.parent().filter(|_| path != root), path.file_name())
    else {
        return Err(failed(
            "it is the granted directory itself, not a volume in it".into(),
        ));
    };
    let name = name
        .to_str()
        .ok_or_else(|| failed("the name is not UTF-8".into()))?;
    let parent = walk_beneath(root, parent)?.ok_or_else(|| {
        failed("its parent directory does not exist; create it before returning the volume".into())
    })?;
    let parent = sized::reopen(&parent).map_err(|e| failed(std::io::Error::from(e).to_string()))?;
    sized::make(backend, &parent, name, volume.pv, &shown).map_err(|e| failed(e.to_string()))
}

fn sized_error(path: &Path, message: String) -> NodePathError {
    NodePathError::Sized {
        path: path.display().to_string(),
        message,
    }
}

/// Checks that `path` lies beneath `root` with no symlink in any component below `root`.
/// `root` itself is the operator's and trusted. Components that do not exist yet are fine (the
/// kubelet creates them under what was checked); the deepest existing one must be clean.
pub fn check_beneath(root: &Path, path: &Path) -> Result<(), NodePathError> {
    walk_beneath(root, path).map(drop)
}

/// [`check_beneath`], answering the `O_PATH` descriptor of `path` itself when all of it exists.
fn walk_beneath(root: &Path, path: &Path) -> Result<Option<OwnedFd>, NodePathError> {
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
            Err(rustix::io::Errno::NOENT) => return Ok(None),
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
            FileType::RegularFile if i + 1 == parts.len() => return Ok(Some(next)),
            _ => {
                return Err(NodePathError::NotDirectory {
                    path: shown,
                    component: walked.display().to_string(),
                });
            }
        }
    }
    Ok(Some(current))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const ON_DISK: OnDisk<'static> = OnDisk {
        pv: "pvc-1",
        bytes: 1 << 30,
    };

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

    fn grants_for(root: &Path) -> Grants {
        let r = root.display();
        Grants::parse(
            &format!(
                "provisioner = \"x/y\"\n[[dirs]]\nhost = \"{r}\"\nguest = \"/v\"\naccess = \"read-write\"\n[volumes]\nkinds = [\"host-path\"]\npath-prefixes = [\"{r}\"]\nuids = [\"0-65534\"]"
            ),
            Path::new("/"),
        )
        .unwrap()
    }

    fn host_path(path: &Path) -> VolumeSource {
        VolumeSource::HostPath(HostPathSource {
            path: path.display().to_string(),
            kind: super::super::bindings::types::HostPathType::DirectoryOrCreate,
        })
    }

    /// The owner a guest asks for lands on the directory the walk checked, and on nothing a
    /// link leads to: a link planted at the volume or above it, after the guest returned, makes
    /// the host refuse and leaves the link's target as it was.
    #[test]
    fn an_owner_goes_to_the_checked_directory_and_never_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let (r, grants) = (root.path(), grants_for(root.path()));
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
        std::fs::set_permissions(outside.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let asked = Ownership {
            mode: Some(0o707),
            ..Ownership::default()
        };
        std::fs::create_dir_all(r.join("ns/pvc-1")).unwrap();
        check_source(&grants, &host_path(&r.join("ns/pvc-1")), &asked, &ON_DISK).unwrap();
        assert_eq!(mode(&r.join("ns/pvc-1")), 0o707);

        symlink(outside.path(), r.join("pvc-2")).unwrap();
        symlink(outside.path(), r.join("mid")).unwrap();
        std::fs::create_dir(outside.path().join("pvc-3")).unwrap();
        let below = mode(&outside.path().join("pvc-3"));
        for planted in ["pvc-2", "mid/pvc-3"] {
            let error =
                check_source(&grants, &host_path(&r.join(planted)), &asked, &ON_DISK).unwrap_err();
            assert!(
                matches!(error, NodePathError::Symlink { .. }),
                "{planted}: {error}"
            );
        }
        assert_eq!(mode(outside.path()), 0o755);
        assert_eq!(mode(&outside.path().join("pvc-3")), below);

        let missing =
            check_source(&grants, &host_path(&r.join("pvc-4")), &asked, &ON_DISK).unwrap_err();
        assert!(missing.to_string().contains("does not exist"), "{missing}");
        let root_itself = check_source(&grants, &host_path(r), &asked, &ON_DISK).unwrap_err();
        assert!(
            root_itself.to_string().contains("granted directory itself"),
            "{root_itself}"
        );
        let unseen = check_source(
            &grants,
            &host_path(Path::new("/elsewhere/pvc-5")),
            &asked,
            &ON_DISK,
        )
        .unwrap_err();
        assert!(unseen.to_string().contains("cannot see it"), "{unseen}");
        std::fs::write(r.join("file"), b"x").unwrap();
        assert!(check_source(&grants, &host_path(&r.join("file")), &asked, &ON_DISK).is_err());
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
