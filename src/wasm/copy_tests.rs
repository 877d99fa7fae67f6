//! The host's `copy-tree` called directly, on real directories.

use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use super::*;

/// A grant with `rw` read-write at `/rw` and `ro` read-only at `/ro`, ids 1000-1999.
fn grants(rw: &Path, ro: &Path) -> Grants {
    let text = format!(
        "provisioner = \"x/y\"\n[[dirs]]\nhost = {:?}\nguest = \"/rw\"\naccess = \"read-write\"\n\
         [[dirs]]\nhost = {:?}\nguest = \"/ro\"\naccess = \"read-only\"\n\
         [volumes]\nkinds = [\"host-path\"]\npath-prefixes = [\"/srv\"]\nuids = [\"1000-1999\"]\ngids = [\"1000-1999\"]\n",
        rw.display().to_string(),
        ro.display().to_string()
    );
    Grants::parse(&text, Path::new("/")).unwrap()
}

struct Dirs {
    rw: tempfile::TempDir,
    ro: tempfile::TempDir,
    grants: Grants,
}

fn dirs() -> Dirs {
    let (rw, ro) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let grants = grants(rw.path(), ro.path());
    Dirs { rw, ro, grants }
}

fn run(d: &Dirs, source: &str, target: &str, max_held: usize) -> Result<Copied, CopyError> {
    let held = Arc::new(AtomicUsize::new(0));
    let resolved = resolve(&d.grants, source, target)?;
    let later = Instant::now() + Duration::from_secs(30);
    let result = copy(
        resolved,
        Owners::of(&d.grants),
        later,
        held.clone(),
        max_held,
    );
    assert_eq!(held.load(Ordering::Relaxed), 0, "every descriptor closed");
    result
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777
}

#[test]
fn files_directories_links_and_modes_are_copied_and_links_never_followed() {
    let d = dirs();
    let src = d.rw.path().join("src");
    std::fs::create_dir_all(src.join("sub/deeper")).unwrap();
    std::fs::write(src.join("data"), b"hello").unwrap();
    std::fs::write(src.join("sub/deeper/big"), vec![7u8; 3 << 20]).unwrap();
    std::fs::write(src.join("setuid"), b"#!/bin/sh").unwrap();
    symlink("/etc", src.join("etc")).unwrap();
    symlink("../data", src.join("sub/relative")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        src.join("fifo"),
        FileType::Fifo,
        Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    std::fs::set_permissions(src.join("data"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::set_permissions(src.join("setuid"), std::fs::Permissions::from_mode(0o6755)).unwrap();
    std::fs::set_permissions(src.join("sub"), std::fs::Permissions::from_mode(0o2750)).unwrap();
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o701)).unwrap();
    // A directory nobody may write: its contents are copied all the same.
    std::fs::set_permissions(
        src.join("sub/deeper"),
        std::fs::Permissions::from_mode(0o555),
    )
    .unwrap();

    let copied = run(&d, "/rw/src", "/rw/copy", 64).unwrap();

    let dst = d.rw.path().join("copy");
    assert_eq!(std::fs::read(dst.join("data")).unwrap(), b"hello");
    assert_eq!(
        std::fs::read(dst.join("sub/deeper/big")).unwrap().len(),
        3 << 20
    );
    assert_eq!(
        std::fs::read_link(dst.join("etc")).unwrap(),
        Path::new("/etc")
    );
    assert_eq!(
        std::fs::read_link(dst.join("sub/relative")).unwrap(),
        Path::new("../data")
    );
    assert!(!dst.join("fifo").exists());
    assert_eq!(mode(&dst), 0o701);
    assert_eq!(mode(&dst.join("data")), 0o640);
    assert_eq!(mode(&dst.join("sub")), 0o2750, "setgid kept on a directory");
    assert_eq!(mode(&dst.join("sub/deeper")), 0o555);
    assert_eq!(
        mode(&dst.join("setuid")),
        0o755,
        "no setuid or setgid on a file"
    );
    assert_eq!(
        copied,
        Copied {
            // copy, data, sub, deeper, big, setuid, etc, relative
            entries: 8,
            bytes: 5 + (3 << 20) + 9,
            links: 2,
            skipped: 1,
            owners_not_kept: 0,
            snapshot: false,
        }
    );
    std::fs::set_permissions(
        src.join("sub/deeper"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::set_permissions(
        dst.join("sub/deeper"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
}

#[test]
fn paths_are_checked_against_the_grant_and_never_through_a_link() {
    let d = dirs();
    std::fs::create_dir_all(d.rw.path().join("src/inner")).unwrap();
    std::fs::create_dir_all(d.ro.path().join("vol")).unwrap();
    symlink(d.rw.path().join("src"), d.rw.path().join("link")).unwrap();
    symlink("/tmp", d.rw.path().join("elsewhere")).unwrap();
    let refused = |source: &str, target: &str| run(&d, source, target, 64).unwrap_err();

    for (source, target, expected) in [
        ("/rw/link", "/rw/a", "symbolic link"),
        ("/rw/link/inner", "/rw/a", "symbolic link"),
        ("/rw/src", "/rw/elsewhere/a", "symbolic link"),
        ("/rw/src", "/rw/src", "File exists"),
        ("/rw/missing", "/rw/a", "No such file"),
        (
            "/etc",
            "/rw/a",
            "/etc lies in no directory granted to this guest",
        ),
        ("/rw/src", "/ro/a", "granted read-write"),
        ("/rw/src/../../etc", "/rw/a", "without `..`"),
        ("/rw/src", "/rw/..", "without `..`"),
        ("rw/src", "/rw/a", "absolute"),
    ] {
        let error = refused(source, target).to_string();
        assert!(error.contains(expected), "{source} -> {target}: {error}");
    }
    assert!(!d.rw.path().join("a").exists(), "nothing made by a refusal");
    // A read-only grant may be copied from.
    run(&d, "/ro/vol", "/rw/from-ro", 64).unwrap();
    assert!(d.rw.path().join("from-ro").is_dir());
}

#[test]
fn a_target_inside_its_source_is_not_copied_into_itself() {
    let d = dirs();
    std::fs::create_dir_all(d.rw.path().join("src/a/b")).unwrap();
    std::fs::write(d.rw.path().join("src/a/b/f"), b"x").unwrap();
    let copied = run(&d, "/rw/src", "/rw/src/a/copy", 64).unwrap();
    assert_eq!(copied.entries, 4, "copy, a, b, f: {copied:?}");
    let dst = d.rw.path().join("src/a/copy");
    assert_eq!(std::fs::read(dst.join("a/b/f")).unwrap(), b"x");
    assert!(!dst.join("a/copy").exists());
}

#[test]
fn the_deadline_and_the_descriptor_budget_end_a_copy() {
    let d = dirs();
    let mut deep = d.rw.path().join("src");
    for level in 0..10 {
        deep = deep.join(format!("l{level}"));
    }
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join("f"), b"x").unwrap();

    // Ten levels need 22 descriptors (source and copy at each, and the file's two).
    let error = run(&d, "/rw/src", "/rw/shallow", 12).unwrap_err();
    assert!(
        matches!(&error, CopyError::TooDeep { levels: 6, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("limits.descriptors"), "{error}");
    run(&d, "/rw/src", "/rw/enough", 24).unwrap();

    let held = Arc::new(AtomicUsize::new(0));
    let resolved = resolve(&d.grants, "/rw/src", "/rw/late").unwrap();
    let error = copy(
        resolved,
        Owners::of(&d.grants),
        Instant::now(),
        held.clone(),
        64,
    );
    assert!(matches!(error, Err(CopyError::OutOfTime(_))), "{error:?}");
    assert_eq!(held.load(Ordering::Relaxed), 0);
}

#[test]
fn owners_are_kept_when_they_are_the_hosts_or_granted() {
    let d = dirs();
    let owners = Owners::of(&d.grants);
    let stat_of = |uid, gid| {
        let mut stat = rustix::fs::stat("/").unwrap();
        stat.st_uid = uid;
        stat.st_gid = gid;
        stat
    };
    let (own_uid, own_gid) = (owners.own_uid, owners.own_gid);
    assert_eq!(
        owners.for_entry(&stat_of(own_uid, own_gid), "x"),
        Ok((None, None))
    );
    assert_eq!(
        owners.for_entry(&stat_of(1000, 1999), "x"),
        Ok((Some(1000), Some(1999)))
    );
    let error = owners
        .for_entry(&stat_of(999, own_gid), "/v/pgdata")
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "/v/pgdata is owned by uid 999, which the grant's [volumes] uids do not include (widen them to clone it)"
    );
    assert!(matches!(
        owners.for_entry(&stat_of(own_uid, 2000), "x"),
        Err(CopyError::OwnerNotGranted {
            kind: "gid",
            id: 2000,
            ..
        })
    ));
}

#[test]
fn granted_owners_are_given_to_the_copy() {
    let d = dirs();
    std::fs::create_dir_all(d.rw.path().join("src/db")).unwrap();
    std::fs::write(d.rw.path().join("src/db/table"), b"rows").unwrap();
    let chown = |path: &Path, id: u32| std::os::unix::fs::chown(path, Some(id), Some(id));
    if chown(&d.rw.path().join("src/db"), 1500).is_err() {
        // Giving an owner takes CAP_CHOWN, which .ci/test has (it runs as root).
        assert!(!rustix::process::geteuid().is_root());
        return;
    }
    chown(&d.rw.path().join("src/db/table"), 1501).unwrap();
    symlink("table", d.rw.path().join("src/db/current")).unwrap();
    std::os::unix::fs::lchown(d.rw.path().join("src/db/current"), Some(1502), Some(1502)).unwrap();
    run(&d, "/rw/src", "/rw/copy", 64).unwrap();
    let meta = |p: &str| std::fs::symlink_metadata(d.rw.path().join(p)).unwrap();
    assert_eq!((meta("copy/db").uid(), meta("copy/db").gid()), (1500, 1500));
    assert_eq!(meta("copy/db/table").uid(), 1501);
    assert_eq!(meta("copy/db/current").uid(), 1502);

    chown(&d.rw.path().join("src/db/table"), 999).unwrap();
    let error = run(&d, "/rw/src", "/rw/copy2", 64).unwrap_err().to_string();
    assert!(
        error.contains("/rw/src/db/table is owned by uid 999"),
        "{error}"
    );
}
