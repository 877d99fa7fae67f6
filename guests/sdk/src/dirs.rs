//! Directory chores inside the guest's granted directories, with errors that name the path:
//! create, check, remove (already gone is fine), and rename to a free name (archiving).

use std::fs;
use std::io::ErrorKind;

use crate::types::{ProvisionError, final_error};

/// `mkdir -p`.
pub fn create(path: &str) -> Result<(), ProvisionError> {
    fs::create_dir_all(path)
        .map_err(|error| final_error(format!("creating directory {path}: {error}")))
}

/// Whether `path` exists (a symlink counts, and is not followed).
pub fn exists(path: &str) -> Result<bool, ProvisionError> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(error) if error.kind() == ErrorKind::NotFound => Ok(false),
        Err(error) => Err(final_error(format!("inspecting {path}: {error}"))),
    }
}

/// `rm -r`; returns false when there was nothing to remove. Follows no link (a link is removed,
/// not its target) and holds one directory handle at a time however deep the tree: a pod can fill
/// its volume with a tree deeper than the guest's descriptor limit, and std's `remove_dir_all`
/// keeps a handle open per level.
pub fn remove(path: &str) -> Result<bool, ProvisionError> {
    match remove_tree(path) {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == ErrorKind::NotFound => Ok(false),
        Err(error) => Err(final_error(format!("removing {path}: {error}"))),
    }
}

/// Depth first with a stack of paths: a directory is listed (its handle closed before anything
/// else happens), its files and links removed, its subdirectories stacked; once listing finds it
/// empty it is removed.
fn remove_tree(root: &str) -> std::io::Result<()> {
    if !fs::symlink_metadata(root)?.is_dir() {
        return fs::remove_file(root);
    }
    let mut stack = vec![std::path::PathBuf::from(root)];
    while let Some(dir) = stack.last().cloned() {
        let entries: Vec<fs::DirEntry> = fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
        let mut subdirectories = Vec::new();
        for entry in entries {
            // DirEntry::file_type does not follow links.
            if entry.file_type()?.is_dir() {
                subdirectories.push(entry.path());
            } else {
                fs::remove_file(entry.path())?;
            }
        }
        if subdirectories.is_empty() {
            fs::remove_dir(&dir)?;
            stack.pop();
        } else {
            stack.extend(subdirectories);
        }
    }
    Ok(())
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
    fn free_names_count_up() {
        assert_eq!(free_name("a", |_| false), "a");
        assert_eq!(free_name("a", |n| ["a", "a-1"].contains(&n)), "a-2");
    }
}
