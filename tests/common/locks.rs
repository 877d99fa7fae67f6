//! Another process holding an inode lock the way a pod's stuck write or listing does
//! (`tests/fixtures/hold_lock.c`: a system call that faults on a userfaultfd page while the
//! kernel holds the lock), for as long as the test says.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;

/// tests/fixtures/hold_lock.c, built once per test binary.
fn hold_lock_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hold_lock");
        let source = super::repo().join("tests/fixtures/hold_lock.c");
        let status = Command::new("cc")
            .args(["-O1", "-pthread", "-o"])
            .arg(&out)
            .arg(&source)
            .status()
            .expect("cc (gcc) builds the lock holder");
        assert!(status.success(), "building {}", source.display());
        out
    })
}

/// The lock of a file (`file`: a write holds it) or a directory (`dir`: a listing holds it
/// shared and a mkdir queued behind it makes readers wait too), held until released or
/// dropped.
pub struct HeldLock {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl HeldLock {
    /// Holds it; returns once the kernel does.
    pub fn hold(mode: &str, path: &Path) -> HeldLock {
        let mut child = Command::new(hold_lock_binary())
            .arg(mode)
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "held", "the lock holder is in the kernel");
        HeldLock { child, stdin }
    }

    /// Lets the stuck system call go on; waits for the holder to end.
    pub fn release(mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.flush();
        }
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the lock holder ended cleanly");
    }
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        // A test that failed: end the holder by its PID (a fatal signal ends its fault too).
        if self.stdin.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
