//! Enforced sizes (src/sizes/) on a real btrfs: a loop-mounted image per test, made with mkfs.btrfs (btrfs-progs, for the tests only), as root.
//!
//! Nothing here is skipped: without root, loop devices, btrfs or mkfs.btrfs each test fails
//! with what is missing (CI runs as root on a kernel with btrfs).

mod common;

use std::fs::{self, File};
use std::io::Read as _;
use std::path::Path;
use std::process::Command;

use common::btrfs::{Btrfs, MIB, is_edquot, path, run, write};
use wasm_provisioner::sizes::{Quotas, SizeBackend, SizeError, btrfs};

const SIZES: SizeBackend = SizeBackend::Btrfs;

#[test]
fn probe_finds_btrfs_with_quotas_off_then_enables_them() {
    let fs = Btrfs::new();
    let probe = SIZES.probe(fs.root(), false).expect("probe");
    assert_eq!(probe.quotas, Quotas::Off);
    assert!(!probe.read_only && probe.writable, "{probe:?}");
    let error = probe.require().expect_err("quotas are off");
    assert!(matches!(error, SizeError::QuotasOff), "{error:?}");
    assert!(
        error.to_string().contains("quotas are not enabled"),
        "{error}"
    );
    let error = SIZES.check(fs.root(), false).expect_err("quotas still off");
    assert!(matches!(error, SizeError::QuotasOff), "{error:?}");

    let probe = SIZES.probe(fs.root(), true).expect("probe enabling quotas");
    assert_eq!(probe.quotas, Quotas::Simple);
    assert_eq!(probe.volumes, Ok(()), "a probe volume made and deleted");
    probe.require().expect("ready");
    let listed = run("btrfs", &["subvolume", "list", path(&fs.mnt)]);
    assert!(listed.trim().is_empty(), "the probe left {listed}");
    // Enabled once, probing again (asked to enable or not) finds them on.
    assert_eq!(
        SIZES.probe(fs.root(), false).unwrap().quotas,
        Quotas::Simple
    );
    assert_eq!(btrfs::quotas(fs.root()).unwrap(), Quotas::Simple);

    // Read-only: quotas on, but no volume can be made there.
    run("mount", &["-o", "remount,ro", path(&fs.mnt)]);
    let probe = SIZES.probe(fs.root(), true).expect("probe read-only");
    assert!(probe.read_only, "{probe:?}");
    let error = probe.require().expect_err("read-only");
    assert!(matches!(error, SizeError::ReadOnly), "{error:?}");
    assert!(error.to_string().contains("read-only"), "{error}");
}

#[test]
fn other_filesystems_are_refused_by_name() {
    let mut dirs = vec![tempfile::tempdir().expect("temporary directory")];
    if Path::new("/dev/shm").is_dir() {
        dirs.push(tempfile::tempdir_in("/dev/shm").expect("directory in /dev/shm"));
    }
    let mut refused = 0;
    for dir in &dirs {
        let root = File::open(dir.path()).unwrap();
        if rustix::fs::fstatfs(&root).unwrap().f_type as u64 & 0xffff_ffff == btrfs::SUPER_MAGIC {
            continue; // a temporary directory that happens to be on btrfs proves nothing here
        }
        for error in [
            SIZES.probe(&root, true).expect_err("not btrfs"),
            SIZES.create(&root, "vol", 32 * MIB).expect_err("not btrfs"),
        ] {
            assert!(matches!(error, SizeError::NotBtrfs { .. }), "{error:?}");
            assert!(error.to_string().contains("not on btrfs"), "{error}");
        }
        assert!(!SIZES.is_volume(&root).unwrap());
        assert!(!dir.path().join("vol").exists());
        refused += 1;
    }
    assert!(refused > 0, "no directory off btrfs to test with: {dirs:?}");
}

#[test]
fn a_limit_is_enforced_and_can_grow() {
    let fs = Btrfs::new().with_quotas();
    let volume = SIZES.create(fs.root(), "vol", 32 * MIB).expect("create");
    assert!(SIZES.is_volume(&volume).unwrap());
    assert_eq!(SIZES.usage(&volume).unwrap().max_referenced, Some(32 * MIB));

    let file = fs.mnt.join("vol/data");
    let (error, len) = write(&file, 64 * MIB);
    let error = error.expect("writing 64 MiB into 32 MiB must fail");
    assert!(is_edquot(&error), "expected EDQUOT, got {error}");
    assert!(
        (24 * MIB..=32 * MIB).contains(&len),
        "stopped at {len} bytes, not at about 32 MiB"
    );

    SIZES.set_limit(&volume, 96 * MIB).expect("grow");
    fs::remove_file(&file).unwrap();
    fs.commit();
    let (error, len) = write(&file, 64 * MIB);
    assert!(error.is_none(), "64 MiB into 96 MiB failed: {error:?}");
    assert_eq!(len, 64 * MIB);
    fs.commit();
    let usage = SIZES.usage(&volume).unwrap();
    assert_eq!(usage.max_referenced, Some(96 * MIB));
    assert!(
        (64 * MIB..80 * MIB).contains(&usage.referenced),
        "{usage:?}"
    );
}

#[test]
fn a_snapshot_carries_the_data_and_a_limit_of_its_own_for_what_it_writes() {
    let fs = Btrfs::new().with_quotas();
    let source = SIZES.create(fs.root(), "source", 96 * MIB).expect("create");
    let (error, _) = write(&fs.mnt.join("source/data"), 64 * MIB);
    assert!(error.is_none(), "{error:?}");
    fs.commit();

    let copy = SIZES
        .snapshot(&source, fs.root(), "copy", 128 * MIB)
        .expect("snapshot");
    assert!(SIZES.is_volume(&copy).unwrap());
    let (mut a, mut b) = (Vec::new(), Vec::new());
    File::open(fs.mnt.join("source/data"))
        .and_then(|mut f| f.read_to_end(&mut a))
        .unwrap();
    File::open(fs.mnt.join("copy/data"))
        .and_then(|mut f| f.read_to_end(&mut b))
        .unwrap();
    assert_eq!(a.len() as u64, 64 * MIB);
    assert!(a == b, "the snapshot's data differs from its source's");

    let (source_usage, copy_usage) = (SIZES.usage(&source).unwrap(), SIZES.usage(&copy).unwrap());
    assert_ne!(source_usage.id, copy_usage.id);
    assert_eq!(source_usage.max_referenced, Some(96 * MIB));
    assert_eq!(copy_usage.max_referenced, Some(128 * MIB));
    // Simple quotas charge an extent to the subvolume that wrote it, for its whole life: the
    // shared data stays the source's, the copy starts out holding (almost) nothing.
    assert!(copy_usage.referenced < MIB, "{copy_usage:?}");
    assert!(source_usage.referenced >= 64 * MIB, "{source_usage:?}");

    // 64 + 40 MiB: over the source's 96 MiB, within the copy's 128 MiB.
    let (error, _) = write(&fs.mnt.join("copy/more"), 40 * MIB);
    assert!(error.is_none(), "40 MiB more in the copy failed: {error:?}");
    let (error, _) = write(&fs.mnt.join("source/more"), 40 * MIB);
    let error = error.expect("the source keeps its own 96 MiB limit");
    assert!(is_edquot(&error), "expected EDQUOT, got {error}");
}

#[test]
fn destroy_removes_the_subvolume_and_its_qgroup() {
    let fs = Btrfs::new().with_quotas();
    let volume = SIZES.create(fs.root(), "gone", 32 * MIB).expect("create");
    let (error, _) = write(&fs.mnt.join("gone/data"), 8 * MIB);
    assert!(error.is_none(), "{error:?}");
    fs::create_dir_all(fs.mnt.join("gone/a/b")).unwrap();
    let id = SIZES.usage(&volume).unwrap().id;
    drop(volume);
    assert!(btrfs::qgroup_ids(fs.root()).unwrap().contains(&id));

    SIZES.destroy(fs.root(), "gone").expect("destroy");
    let ids = btrfs::qgroup_ids(fs.root()).unwrap();
    assert!(
        !ids.contains(&btrfs::volume_qgroup(id)),
        "the volume's qgroup 1/{id} goes at once: {ids:?}"
    );
    btrfs::wait_dropped(fs.root(), id).expect("dropped");
    assert!(
        !fs.mnt.join("gone").exists(),
        "the subvolume is still there"
    );
    let ids = btrfs::qgroup_ids(fs.root()).unwrap();
    assert!(!ids.contains(&id), "qgroup 0/{id} left behind: {ids:?}");
    assert!(
        !ids.contains(&btrfs::volume_qgroup(id)),
        "qgroup 1/{id} left behind: {ids:?}"
    );
    // And as btrfs-progs sees it.
    let shown = run("btrfs", &["qgroup", "show", "--raw", path(&fs.mnt)]);
    assert!(
        !shown.lines().any(|l| l.starts_with(&format!("0/{id} "))),
        "btrfs qgroup show still lists 0/{id}:\n{shown}"
    );
    assert_eq!(
        btrfs::quotas(fs.root()).unwrap(),
        Quotas::Simple,
        "quotas left inconsistent"
    );

    // Destroying it again is an error, not a silent success.
    assert!(SIZES.destroy(fs.root(), "gone").is_err());
}

#[test]
fn a_failed_limit_leaves_no_subvolume() {
    let fs = Btrfs::new(); // quotas off: the subvolume is made, its limit is refused
    let error = SIZES
        .create(fs.root(), "orphan", 32 * MIB)
        .expect_err("quotas off");
    match &error {
        SizeError::LimitFailed {
            name,
            source,
            cleanup: None,
        } => {
            assert_eq!(name, "orphan");
            assert!(matches!(**source, SizeError::QuotasOff), "{source:?}");
        }
        other => panic!("expected LimitFailed with cleanup done, got {other:?}"),
    }
    assert!(
        error.to_string().contains("the subvolume was removed"),
        "{error}"
    );
    assert!(
        !fs.mnt.join("orphan").exists(),
        "the subvolume was left behind"
    );
    let listed = run("btrfs", &["subvolume", "list", path(&fs.mnt)]);
    assert!(!listed.contains("orphan"), "{listed}");
}

#[test]
fn a_plain_directory_is_not_a_volume() {
    let fs = Btrfs::new().with_quotas();
    fs::create_dir(fs.mnt.join("plain")).unwrap();
    let plain = File::open(fs.mnt.join("plain")).unwrap();
    assert!(!SIZES.is_volume(&plain).unwrap());
    for error in [
        SIZES
            .set_limit(&plain, 32 * MIB)
            .expect_err("plain directory"),
        SIZES.usage(&plain).expect_err("plain directory"),
        SIZES
            .destroy(fs.root(), "plain")
            .expect_err("plain directory"),
        SIZES
            .snapshot(&plain, fs.root(), "copy", 32 * MIB)
            .expect_err("plain directory"),
    ] {
        assert!(matches!(error, SizeError::NotSubvolume), "{error:?}");
    }
    assert!(
        fs.mnt.join("plain").is_dir(),
        "destroy removed a plain directory"
    );
    assert!(!fs.mnt.join("copy").exists());

    let volume = SIZES.create(fs.root(), "vol", 32 * MIB).expect("create");
    assert!(SIZES.is_volume(&volume).unwrap());
    // A directory inside a volume is not one.
    fs::create_dir(fs.mnt.join("vol/inner")).unwrap();
    assert!(
        !SIZES
            .is_volume(File::open(fs.mnt.join("vol/inner")).unwrap())
            .unwrap()
    );
    // The top level is a subvolume, but the whole filesystem: never limited as a volume.
    let error = SIZES.set_limit(fs.root(), 32 * MIB).expect_err("top level");
    assert!(matches!(error, SizeError::TopLevel), "{error:?}");

    for name in ["", ".", "..", "a/b", "../vol"] {
        let error = SIZES.create(fs.root(), name, 32 * MIB).expect_err(name);
        assert!(
            matches!(error, SizeError::InvalidName { .. }),
            "{name:?}: {error:?}"
        );
    }
    let error = SIZES.create(fs.root(), "zero", 0).expect_err("zero bytes");
    assert!(matches!(error, SizeError::InvalidLimit(0)), "{error:?}");
}

#[test]
fn full_mode_quotas_are_refused() {
    let fs = Btrfs::new();
    btrfs::enable_full(fs.root()).expect("full quotas");
    let probe = SIZES.probe(fs.root(), true).expect("probe");
    assert_eq!(probe.quotas, Quotas::Full);
    let error = probe.require().expect_err("full mode");
    assert!(matches!(error, SizeError::FullQuotas), "{error:?}");
    assert!(error.to_string().contains("simple quotas"), "{error}");
}

/// Runs `script` with `sh -c` as uid and gid 1000 with no capabilities (a pod's user).
fn as_tenant(script: &str) -> std::process::Output {
    Command::new("setpriv")
        .args([
            "--reuid=1000",
            "--regid=1000",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "sh",
            "-c",
            script,
        ])
        .output()
        .expect("setpriv (util-linux)")
}

/// What the kernel lets a pod's user do inside its volume: make subvolumes and snapshots (no
/// privilege needed). With simple quotas they join the volume's level-1 qgroup, so a write
/// through them stops at the volume's limit too; destroying the volume takes them along.
#[test]
fn a_tenant_cannot_write_past_its_limit_through_a_subvolume_of_its_own() {
    let fs = Btrfs::new().with_quotas();
    let volume = SIZES.create(fs.root(), "vol", 32 * MIB).expect("create");
    let id = SIZES.usage(&volume).unwrap().id;
    let vol = fs.mnt.join("vol");
    rustix::fs::fchown(
        &volume,
        Some(rustix::fs::Uid::from_raw(1000)),
        Some(rustix::fs::Gid::from_raw(1000)),
    )
    .unwrap();
    fs::set_permissions(&fs.mnt, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let v = path(&vol);
    let made = as_tenant(&format!(
        "btrfs subvolume create {v}/nested && dd if=/dev/zero of={v}/nested/big bs=1M count=100 conv=fsync; \
         rm -f {v}/nested/big; sync; dd if=/dev/zero of={v}/nested/small bs=1M count=8 conv=fsync && \
         btrfs subvolume snapshot {v}/nested {v}/snap && dd if=/dev/zero of={v}/snap/more bs=1M count=100 conv=fsync; \
         ls -l {v} {v}/snap"
    ));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&made.stdout),
        String::from_utf8_lossy(&made.stderr)
    );
    println!("as uid 1000 inside the volume:\n{said}");
    assert!(
        said.contains("Create subvolume"),
        "the kernel let the tenant make a subvolume: {said}"
    );
    assert!(said.contains("Disk quota exceeded"), "{said}");
    let size = |p: &Path| fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    assert!(size(&vol.join("snap/more")) + 8 * MIB <= 33 * MIB, "{said}");
    fs.commit();
    let usage = SIZES.usage(&volume).unwrap();
    assert!(
        usage.referenced <= 33 * MIB,
        "the volume and what the tenant made in it hold {} bytes",
        usage.referenced
    );
    let nested = btrfs::nested_subvolumes(fs.root(), id).unwrap();
    assert_eq!(nested.len(), 2, "{nested:?}");

    // Full to its limit, as the tenant left it: deleting still works.
    drop(volume);
    SIZES
        .destroy(fs.root(), "vol")
        .expect("destroy with what the tenant made inside");
    for dropped in nested.iter().chain([&id]) {
        btrfs::wait_dropped(fs.root(), *dropped).expect("dropped");
    }
    assert!(!vol.exists());
    let ids = btrfs::qgroup_ids(fs.root()).unwrap();
    for gone in nested.iter().chain([&id, &btrfs::volume_qgroup(id)]) {
        assert!(!ids.contains(gone), "qgroup {gone:#x} left: {ids:?}");
    }
}
