//! A fresh btrfs per test (loop-mounted sparse image made with mkfs.btrfs, btrfs-progs for the
//! tests only), as root: for tests/sizes.rs and the size-enforcing grants of tests/sized.rs.

use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use wasm_provisioner::sizes::{Quotas, SizeBackend};

pub const MIB: u64 = 1 << 20;

/// A fresh btrfs (1 GiB sparse image, quotas off) mounted on a temporary directory; unmounted
/// and its loop device detached on drop, a panicking test included.
pub struct Btrfs {
    dir: tempfile::TempDir,
    /// Where it is mounted.
    pub mnt: PathBuf,
}

/// Runs a command; panics with its output when it fails or cannot be started.
pub fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run {program} ({e}); the sizes tests need btrfs-progs (apt-get install btrfs-progs, as .ci/setup does) and util-linux")
    });
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Btrfs {
    pub fn new() -> Self {
        Self::of(1024 * MIB)
    }

    /// [`Btrfs::new`] on a sparse image of `bytes`.
    pub fn of(bytes: u64) -> Self {
        assert!(
            rustix::process::geteuid().is_root(),
            "tests/sizes.rs needs root: it loop-mounts btrfs images and the btrfs quota ioctls need CAP_SYS_ADMIN (CI runs as root)"
        );
        let filesystems = fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !filesystems.contains("btrfs") {
            // The module may just not be loaded yet; mount loads it.
            let _ = Command::new("modprobe").arg("btrfs").status();
        }
        let dir = tempfile::tempdir().expect("temporary directory");
        let image = dir.path().join("image");
        File::create(&image)
            .and_then(|f| f.set_len(bytes))
            .expect("sparse image file");
        run("mkfs.btrfs", &["-q", path(&image)]);
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).expect("mount point");
        let out = Command::new("mount")
            .args(["-o", "loop", path(&image), path(&mnt)])
            .output()
            .expect("cannot run mount");
        assert!(
            out.status.success(),
            "mounting a btrfs image failed (is btrfs in this kernel, are loop devices available?): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir, mnt }
    }

    /// The top-level directory, opened.
    pub fn root(&self) -> File {
        File::open(&self.mnt).expect("open the mount point")
    }

    /// Enables quotas through the module (as a probe asked to).
    pub fn with_quotas(self) -> Self {
        let probe = SizeBackend::Btrfs
            .check(self.root(), true)
            .expect("quotas enabled");
        assert_eq!(probe.quotas, Quotas::Simple);
        self
    }

    /// Commits the filesystem so qgroup numbers are current.
    pub fn commit(&self) {
        rustix::fs::syncfs(self.root()).expect("syncfs");
    }
}

impl Drop for Btrfs {
    fn drop(&mut self) {
        let mnt = path(&self.mnt);
        let unmounted = Command::new("umount").arg(mnt).status();
        if !unmounted.is_ok_and(|s| s.success()) {
            let _ = Command::new("umount").args(["-l", mnt]).status();
        }
        // mount -o loop sets autoclear; detach anyway if the device is still there.
        let image = self.dir.path().join("image");
        if let Ok(out) = Command::new("losetup").args(["-j", path(&image)]).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some(device) = line.split(':').next() {
                    let _ = Command::new("losetup").args(["-d", device]).status();
                }
            }
        }
    }
}

pub fn path(p: &Path) -> &str {
    p.to_str().expect("UTF-8 temporary path")
}

/// Writes `bytes` (1 MiB chunks, a pattern) to `file`, then fsyncs; the error if any, and how
/// long the file is after.
pub fn write(file: &Path, bytes: u64) -> (Option<std::io::Error>, u64) {
    let mut f = File::create(file).expect("create the file");
    let chunk: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
    let mut error = None;
    for _ in 0..bytes / MIB {
        if let Err(e) = f.write_all(&chunk) {
            error = Some(e);
            break;
        }
    }
    if error.is_none()
        && let Err(e) = f.sync_all()
    {
        error = Some(e);
    }
    let len = f.metadata().expect("metadata").len();
    (error, len)
}

pub fn is_edquot(error: &std::io::Error) -> bool {
    error.raw_os_error() == Some(libc::EDQUOT)
}
