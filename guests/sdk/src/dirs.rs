//! Directory chores inside the guest's granted directories, with errors that name the path:
//! create, check, remove (already gone is fine; any depth, any number of entries), and rename to
//! a free name (archiving).

use std::fs;
use std::io::ErrorKind;

use crate::types::{ProvisionError, final_error};

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

/// Whether `path` exists (a symlink counts, and is not followed).
pub fn exists(path: &str) -> Result<bool, ProvisionError> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(error) if error.kind() == ErrorKind::NotFound => Ok(false),
        Err(error) => Err(final_error(format!("inspecting {path}: {error}"))),
    }
}

/// Paths longer than this are not walked: the directory is moved up under the root first.
/// Well below PATH_MAX (4096), leaving room for where the host keeps the granted directory.
const LONGEST_WALKED_PATH: usize = 2048;

/// `rm -r`; returns false when there was nothing to remove.
///
/// A tenant's pod decides what is in a volume: a tree deeper than the call's descriptor cap or
/// than PATH_MAX, or more entries than the guest's memory holds. So this never holds more than
/// one open directory (it walks down by path, removing files as it lists, and starts over from
/// the top each time a directory is emptied and removed), never keeps a listing in memory, and
/// renames a directory whose path grows past `LONGEST_WALKED_PATH` to a short name right
/// under `path` (`.deleting`, numbered if taken) before going on from the top. A link is
/// removed, never followed.
pub fn remove(path: &str) -> Result<bool, ProvisionError> {
    let fail = |at: &str, error: std::io::Error| final_error(format!("removing {at}: {error}"));
    match fs::symlink_metadata(path) {
        Err(error) if error.kind() == ErrorKind::NotFound => return Ok(false),
        Err(error) => return Err(fail(path, error)),
        Ok(meta) if !meta.is_dir() => {
            fs::remove_file(path).map_err(|e| fail(path, e))?;
            return Ok(true);
        }
        Ok(_) => {}
    }
    'walk: loop {
        let mut at = path.to_owned();
        // Down to a directory with no subdirectory left, emptying each on the way.
        loop {
            let mut below = None;
            for entry in fs::read_dir(&at).map_err(|e| fail(&at, e))? {
                let entry = entry.map_err(|e| fail(&at, e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let child = crate::join(&at, &name);
                if entry.file_type().map_err(|e| fail(&child, e))?.is_dir() {
                    below = Some(child);
                    break;
                }
                match fs::remove_file(&child) {
                    Err(error) if error.kind() != ErrorKind::NotFound => {
                        return Err(fail(&child, error));
                    }
                    _ => {}
                }
            }
            match below {
                // Moving it up shortens the paths below it; one right under `path` cannot be.
                Some(child) if child.len() > LONGEST_WALKED_PATH && at != path => {
                    rename_to_free_name(&child, path, ".deleting")?;
                    continue 'walk;
                }
                Some(child) => at = child,
                None => break,
            }
        }
        match fs::remove_dir(&at) {
            // Entries a listing skipped while it was being emptied: list it again.
            Err(error) if error.kind() == ErrorKind::DirectoryNotEmpty => continue,
            Err(error) if error.kind() != ErrorKind::NotFound => return Err(fail(&at, error)),
            _ => {}
        }
        if at == path {
            return Ok(true);
        }
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
