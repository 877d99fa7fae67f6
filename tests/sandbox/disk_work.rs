//! Host calls whose cost is the kernel's, not the guest's: truncating or unlinking a file waits
//! for its inode lock and frees its blocks, however little the guest passed. Such a call must
//! end at the deadline like any other.
//!
//! Unsafe here only to hold a lock in the kernel from the test (userfaultfd, an anonymous
//! mapping); the product has none of it.
#![expect(
    unsafe_code,
    reason = "userfaultfd, mmap and raw reads to hold a lock in the kernel from the test"
)]

use super::*;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `_IOWR(0xAA, nr, size)` of `<linux/userfaultfd.h>`.
const fn uffd_ioctl(nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (0xAA << 8) | nr
}
const UFFDIO_API: u64 = uffd_ioctl(0x3F, 24);
const UFFDIO_REGISTER: u64 = uffd_ioctl(0x00, 32);
const UFFDIO_ZEROPAGE: u64 = uffd_ioctl(0x04, 32);
const PAGE: usize = 4096;

/// Holds a file's inode lock from this process for at most `hold`: a write whose source page is
/// missing under userfaultfd faults inside the kernel's write path, with the inode lock taken,
/// and waits there until the page is supplied (kernel-mode faults need root, as the node does).
/// Nothing touches the disk.
struct InodeLock {
    uffd: Arc<OwnedFd>,
    page: usize,
    writer: Option<std::thread::JoinHandle<()>>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    released: Arc<AtomicBool>,
}

fn ioctl(fd: &OwnedFd, request: u64, arg: &mut [u64]) -> std::io::Result<()> {
    // SAFETY: `arg` is the request's struct, as u64 words of its size.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg.as_mut_ptr()) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Supplies the missing page: the blocked write completes and the lock is let go.
fn supply(uffd: &OwnedFd, page: usize) {
    let _ = ioctl(uffd, UFFDIO_ZEROPAGE, &mut [page as u64, PAGE as u64, 0, 0]);
}

impl InodeLock {
    fn take(path: &Path, hold: Duration) -> InodeLock {
        // SAFETY: plain syscalls; the fd is owned from here on.
        let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
        assert!(raw >= 0, "userfaultfd: {}", std::io::Error::last_os_error());
        let uffd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw as i32) });
        ioctl(&uffd, UFFDIO_API, &mut [0xAA, 0, 0]).expect("UFFDIO_API");
        // SAFETY: a fresh anonymous mapping, unmapped in drop.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        let page = page as usize;
        // range, mode MISSING, ioctls (out).
        ioctl(
            &uffd,
            UFFDIO_REGISTER,
            &mut [page as u64, PAGE as u64, 1, 0],
        )
        .expect("UFFDIO_REGISTER");
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        let writer = std::thread::spawn(move || {
            use std::os::unix::fs::FileExt;
            // SAFETY: the mapping outlives this thread (joined before the unmap).
            let source = unsafe { std::slice::from_raw_parts(page as *const u8, PAGE) };
            file.write_at(source, 0).unwrap();
        });
        // The fault's message arrives once the writer waits inside write(2), lock taken.
        let mut message = [0u8; 32];
        // SAFETY: reading into a buffer of the given size.
        let n = unsafe { libc::read(uffd.as_raw_fd(), message.as_mut_ptr().cast(), 32) };
        assert_eq!(n, 32, "no fault: {}", std::io::Error::last_os_error());
        let released = Arc::new(AtomicBool::new(false));
        let watchdog = std::thread::spawn({
            let (uffd, released) = (uffd.clone(), released.clone());
            move || {
                let until = Instant::now() + hold;
                while !released.load(Ordering::Relaxed) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(10));
                }
                supply(&uffd, page);
            }
        });
        InodeLock {
            uffd,
            page,
            writer: Some(writer),
            watchdog: Some(watchdog),
            released,
        }
    }
}

impl Drop for InodeLock {
    fn drop(&mut self) {
        self.released.store(true, Ordering::Relaxed);
        supply(&self.uffd, self.page);
        self.watchdog.take().map(|w| w.join());
        self.writer.take().map(|w| w.join());
        // SAFETY: mapped in `take`; both threads that used it are joined.
        unsafe { libc::munmap(self.page as *mut _, PAGE) };
    }
}

/// Truncating (set-size, open with truncate) and unlinking a file whose inode lock someone
/// else holds end at the 2 s deadline, within its margin, as a deadline fault: they run off
/// the guest's thread even for a local grant. Before, each ran inline and the call lasted as
/// long as the lock was held (here until the 6 s watchdog let it go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_waiting_on_the_kernel_end_at_the_deadline() {
    let _alone = super::CPU_HEAVY.lock().await;
    let n = NodeAttack::load("");
    n.provision("warm", &[]).await.unwrap();
    for op in ["set-size", "open-truncate", "unlink"] {
        let file = n.dir().join(op);
        std::fs::write(&file, b"data").unwrap();
        let lock = InodeLock::take(&file, Duration::from_secs(6));
        let started = Instant::now();
        let outcome = n
            .provision(op, &[("attack", "disk-work"), ("op", op), ("file", op)])
            .await;
        let took = started.elapsed();
        drop(lock);
        println!("{op}: {took:?}: {}", did(&outcome));
        // 2 s deadline; the async timeout adds 500 ms; a second of margin for a loaded machine.
        assert!(
            took < Duration::from_millis(3500),
            "{op}: one call ran {took:?} against a 2 s deadline"
        );
        match &outcome {
            Err(CallError::Fault { kind, .. }) => assert_eq!(*kind, FaultKind::Deadline, "{op}"),
            other => panic!("{op}: expected a deadline fault, got {other:?}"),
        }
    }
}

/// A file of `blocks` 4 KiB blocks written every other block and flushed: each block its own
/// extent, which the kernel takes ~90 us to free here (60,000: ~5 s).
fn fragmented(path: &Path, blocks: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::create(path).unwrap();
    let block = [b'x'; 4096];
    for i in 0..blocks {
        file.write_all_at(&block, i * 8192).unwrap();
    }
    file.sync_all().unwrap();
}

/// The last close of an unlinked file frees its blocks: the guard closes it on the blocking
/// pool, after the call, so the call ends at once (before: 5.0 s, the kernel's time, for
/// 60,000 blocks). Opt-in (`WP_FRAGMENTED_BLOCKS=60000`): freeing that many extents on a disk
/// mounted with online discard slows every write on it for a minute or more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_fragmented_unlinked_file_does_not_hold_the_call() {
    let Some(blocks) = std::env::var("WP_FRAGMENTED_BLOCKS")
        .ok()
        .and_then(|n| n.parse::<u64>().ok())
    else {
        println!("set WP_FRAGMENTED_BLOCKS=60000 to run");
        return;
    };
    let _alone = super::CPU_HEAVY.lock().await;
    let n = NodeAttack::load("");
    let op = "close-unlinked";
    fragmented(&n.dir().join(op), blocks);
    let started = Instant::now();
    let outcome = n
        .provision(op, &[("attack", "disk-work"), ("op", op), ("file", op)])
        .await;
    let took = started.elapsed();
    println!("{op} of {blocks} blocks: {took:?}: {}", did(&outcome));
    assert!(did(&outcome).ends_with(": ok"), "{}", did(&outcome));
    assert!(
        took < Duration::from_secs(2),
        "the call waited {took:?} for the kernel"
    );
}
