//! What a guest's calls make the host keep: open files and directories, their streams,
//! listings, and filesystem operations still running, counted per call and, for operations and
//! calls blocked in the kernel past their call's end, per guest.
//!
//! ```text
//! open-at, read-directory, get-directories, *-via-stream
//!   ─ handles of this call + operations its guest's ended calls left running ≥ cap? ─▶ trap
//!   ─ a stream, and live streams at their cap? ─▶ trap                 (fault `descriptors`)
//! call ends ─▶ what is still referenced (an operation blocked in the kernel) ─▶ [`Lingering`]
//! caller gives up on a call blocked in the kernel ─▶ [`Lingering`]: one operation, one slot
//! next call of the guest ─ lingering at the cap, or every slot stuck? ─▶ refused before it starts
//! ```
//!
//! Why: every open file, directory and listing is one `Arc` that whatever uses it clones, the
//! guest's descriptor, each stream of it and each operation in flight alike. Counting those
//! references counts what the process holds for the guest: descriptors, stream buffers (up to
//! 64 KiB each) and threads. A pod can hold an inode lock for as
//! long as it likes, and an operation waiting on it outlives the call that started it (the
//! call ends at its deadline, the thread does not): those are charged to the guest until they
//! end, so one guest can never take the threads, instances or descriptors of the others.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::dirstream::DirStream;
use super::fs_view::FsWork;

/// Streams one call may hold at once: each can keep a 64 KiB buffer and one blocking-pool
/// thread (a read or write started in the background), which the handle count alone would let
/// grow to `limits.descriptors` of them.
pub const STREAMS_PER_CALL: usize = 8;

/// Entries one call's resource table may hold (descriptors, streams, pollables, listings,
/// errors, volume specs: anything a host function hands the guest). Each is a few hundred bytes
/// of host memory at most; the ones that keep more are capped on their own as well.
pub const TABLE_ENTRIES_PER_CALL: usize = 1024;

/// Something of the call's that keeps host resources: a file or directory `open-at` created,
/// a listing, or a preopened directory. Alive while anything references it.
#[derive(Debug)]
pub(super) enum Held {
    /// The guard keeps a reference of its own, so that it, not the guest's drop, closes the
    /// file last: on the blocking pool ([`close_on_pool`]), since the last close of an unlinked
    /// file frees its blocks.
    File(Arc<std::fs::File>),
    Dir(Weak<std::fs::File>),
    Listing(Weak<Mutex<DirStream>>),
    /// A granted directory: one reference is the call's WASI context's own while the call runs.
    Preopen(Weak<std::fs::File>),
    /// A host function's work on the blocking pool (`copy-tree`): the descriptors it holds
    /// right now, which it counts itself, for as long as it runs.
    Operation(Weak<AtomicUsize>),
}

impl Held {
    /// References to it other than the guard's and the WASI context's: the guest's handles
    /// (descriptors, streams, listings) and operations running on it.
    fn handles(&self, context_alive: bool) -> usize {
        match self {
            Held::File(file) => Arc::strong_count(file) - 1,
            Held::Dir(dir) => dir.strong_count(),
            Held::Listing(listing) => listing.strong_count(),
            Held::Preopen(dir) => dir
                .strong_count()
                .saturating_sub(usize::from(context_alive)),
            Held::Operation(held) => held
                .upgrade()
                .map_or(0, |count| count.load(Ordering::Relaxed)),
        }
    }

    /// Whether nothing of it is left to count: an operation only once it has ended (it may
    /// hold no descriptor for a moment between two).
    fn finished(&self, context_alive: bool) -> bool {
        match self {
            Held::Operation(held) => held.strong_count() == 0,
            _ => self.handles(context_alive) == 0,
        }
    }

    /// Whether a preopen is tracked already (they are shared by every `get-directories`).
    fn is_preopen(&self, dir: &Arc<std::fs::File>) -> bool {
        matches!(self, Held::Preopen(held) if std::ptr::eq(held.as_ptr(), Arc::as_ptr(dir)))
    }
}

/// Closes the files nobody holds any more on the blocking pool (or here, outside a runtime).
fn close_on_pool(released: Vec<Held>) {
    if !released.iter().any(|held| matches!(held, Held::File(_))) {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(move || drop(released))),
        Err(_) => drop(released),
    }
}

/// Filesystem operations a guest's ended calls left running (blocked in the kernel), shared by
/// all its calls; and the calls whose caller gave up on them at their deadline while their
/// thread was blocked in the kernel, which keep their slot until the kernel lets them go.
#[derive(Debug, Default)]
pub struct Lingering {
    held: Mutex<Vec<Held>>,
    stuck_calls: AtomicUsize,
    /// Told whenever a call gets stuck or a stuck call ends.
    stuck_changed: tokio::sync::Notify,
}

impl Lingering {
    /// Operations still running; forgets (and closes) what nothing references any more.
    pub fn count(&self) -> usize {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        close_on_pool(held.extract_if(.., |h| h.finished(false)).collect());
        held.iter().map(|h| h.handles(false)).sum()
    }

    fn keep(&self, mut left: Vec<Held>) {
        if left.is_empty() {
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.append(&mut left);
    }

    /// Calls given up on whose threads are still blocked in the kernel.
    pub fn stuck_calls(&self) -> usize {
        self.stuck_calls.load(Ordering::Acquire)
    }

    /// A call was given up on while its thread runs on: the thread is charged as one
    /// operation for as long as `running` lives (its thread holds it), and counted as stuck
    /// until [`Lingering::call_ended`].
    pub(super) fn call_stuck(&self, running: &Arc<AtomicUsize>) {
        self.keep(vec![Held::Operation(Arc::downgrade(running))]);
        self.stuck_calls.fetch_add(1, Ordering::AcqRel);
        self.stuck_changed.notify_waiters();
    }

    /// A call given up on ended after all.
    pub(super) fn call_ended(&self) {
        self.stuck_calls.fetch_sub(1, Ordering::AcqRel);
        self.stuck_changed.notify_waiters();
    }

    /// Resolves at the next change of [`Lingering::stuck_calls`] after it was made.
    pub(super) fn stuck_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.stuck_changed.notified()
    }
}

/// What hit a cap; the trap that ends the call, reported as the fault kind `descriptors`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleCapHit {
    /// Descriptors, streams, listings and operations in flight.
    #[error(
        "the guest tried to hold more than {max} open descriptors in one call (limits.descriptors; its streams, listings and filesystem operations still running count, {lingering} of them left by earlier calls)"
    )]
    Handles {
        /// The cap (`limits.descriptors`).
        max: usize,
        /// Of those, operations the guest's ended calls left blocked.
        lingering: usize,
    },
    /// Live streams.
    #[error("the guest tried to hold more than {0} streams in one call")]
    Streams(usize),
}

/// Per-call state of the filesystem guard: what the guest holds and its caps on it.
#[derive(Debug)]
pub struct FsGuard {
    max_descriptors: usize,
    /// What the guest opened; dead entries are pruned when something new is admitted.
    held: Vec<Held>,
    /// The resource handles of the streams it made (checked against the table when counted).
    streams: Vec<u32>,
    lingering: Arc<Lingering>,
    /// Where the call's filesystem work runs.
    pub work: FsWork,
    /// Set when the guest tried to hold more than a cap allows.
    pub descriptors_hit: bool,
    /// Filesystem calls refused by the guard (links, special files), for the debug log.
    pub refused: u32,
}

impl FsGuard {
    /// A guard that lets one call hold at most `max_descriptors` handles, charging what the
    /// guest's earlier calls left running (`lingering`) as well.
    pub fn new(max_descriptors: usize, lingering: Arc<Lingering>) -> FsGuard {
        FsGuard {
            max_descriptors,
            held: Vec::new(),
            streams: Vec::new(),
            lingering,
            work: FsWork::Pool,
            descriptors_hit: false,
            refused: 0,
        }
    }

    /// Host handles the guest's call holds right now: files and directories it opened
    /// (directly or through a stream), listings, preopened directories it asked for, and
    /// operations running on any of them.
    pub fn open_descriptors(&self) -> usize {
        self.held.iter().map(|h| h.handles(true)).sum()
    }

    /// Room for one more handle, or the trap that ends the call.
    pub(super) fn admit(&mut self) -> Result<(), HandleCapHit> {
        close_on_pool(self.held.extract_if(.., |h| h.finished(true)).collect());
        let lingering = self.lingering.count();
        if self.open_descriptors() + lingering >= self.max_descriptors {
            self.descriptors_hit = true;
            return Err(HandleCapHit::Handles {
                max: self.max_descriptors,
                lingering,
            });
        }
        Ok(())
    }

    /// Room for one more stream (`live` says which of the ones made are still in the table),
    /// and one more handle.
    pub(super) fn admit_stream(&mut self, live: impl Fn(u32) -> bool) -> Result<(), HandleCapHit> {
        self.streams.retain(|rep| live(*rep));
        if self.streams.len() >= STREAMS_PER_CALL {
            self.descriptors_hit = true;
            return Err(HandleCapHit::Streams(STREAMS_PER_CALL));
        }
        self.admit()
    }

    /// Room for a host function's work on the blocking pool that opens descriptors of its own:
    /// the counter it keeps them in (charged to this call, and to the guest's next calls if it
    /// outlives this one) and how many it may hold at once (what the cap leaves), or the trap
    /// that ends the call when not even one is left.
    pub(super) fn begin_operation(&mut self) -> Result<(Arc<AtomicUsize>, usize), HandleCapHit> {
        self.admit()?;
        let left = self.max_descriptors - self.open_descriptors() - self.lingering.count();
        let count = Arc::new(AtomicUsize::new(0));
        self.held.push(Held::Operation(Arc::downgrade(&count)));
        Ok((count, left))
    }

    /// A stream was made.
    pub(super) fn stream_made(&mut self, rep: u32) {
        if !self.streams.contains(&rep) {
            self.streams.push(rep);
        }
    }

    pub(super) fn hold(&mut self, held: Held) {
        self.held.push(held);
    }

    /// A preopened directory handed to the guest (once per directory, however often asked).
    pub(super) fn hold_preopen(&mut self, dir: &Arc<std::fs::File>) {
        if !self.held.iter().any(|h| h.is_preopen(dir)) {
            self.held.push(Held::Preopen(Arc::downgrade(dir)));
        }
    }

    /// The cap on them.
    pub fn max_descriptors(&self) -> usize {
        self.max_descriptors
    }
}

impl Drop for FsGuard {
    fn drop(&mut self) {
        // The store's WASI context and table went first (they are declared before the guard):
        // what is still referenced now is an operation running on the blocking pool.
        let (left, done) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| !h.finished(false));
        close_on_pool(done);
        self.lingering.keep(left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Arc<std::fs::File> {
        Arc::new(std::fs::File::open("/").unwrap())
    }

    #[test]
    fn every_reference_counts_and_what_outlives_the_call_is_charged_to_the_next() {
        let lingering = Arc::new(Lingering::default());
        let mut guard = FsGuard::new(4, lingering.clone());
        let (a, b) = (file(), file());
        guard.hold(Held::File(a.clone()));
        guard.hold(Held::Dir(Arc::downgrade(&b)));
        // The guest's descriptor of `a` (the clone above), a stream of it, and `b`.
        let stream = a.clone();
        assert_eq!(guard.open_descriptors(), 3);
        guard.admit().unwrap();
        let in_flight = b.clone();
        assert_eq!(
            guard.admit(),
            Err(HandleCapHit::Handles {
                max: 4,
                lingering: 0
            })
        );
        assert!(guard.descriptors_hit);
        drop((a, b, stream));
        // The call ends with one operation on `b` still running.
        drop(guard);
        assert_eq!(lingering.count(), 1);
        let mut next = FsGuard::new(2, lingering.clone());
        let descriptor = file();
        next.hold(Held::File(descriptor.clone()));
        assert_eq!(
            next.admit(),
            Err(HandleCapHit::Handles {
                max: 2,
                lingering: 1
            })
        );
        drop(in_flight);
        assert_eq!(lingering.count(), 0);
        next.admit().unwrap();
        drop(descriptor);
    }

    #[test]
    fn streams_have_a_cap_of_their_own_and_dropped_ones_free_their_place() {
        let mut guard = FsGuard::new(64, Arc::default());
        for rep in 0..STREAMS_PER_CALL as u32 {
            guard.admit_stream(|_| true).unwrap();
            guard.stream_made(rep);
        }
        assert_eq!(
            guard.admit_stream(|_| true),
            Err(HandleCapHit::Streams(STREAMS_PER_CALL))
        );
        guard.admit_stream(|rep| rep != 3).unwrap();
    }

    #[test]
    fn a_preopen_is_tracked_once_and_the_context_reference_is_not_the_guests() {
        let mut guard = FsGuard::new(64, Arc::default());
        let context = file();
        let handed_out = context.clone();
        guard.hold_preopen(&context);
        guard.hold_preopen(&handed_out);
        assert_eq!(guard.open_descriptors(), 1);
    }

    #[test]
    fn an_operation_counts_what_it_holds_until_it_ends_even_past_its_call() {
        let lingering = Arc::new(Lingering::default());
        let mut guard = FsGuard::new(10, lingering.clone());
        let descriptor = file();
        guard.hold(Held::File(descriptor.clone()));
        let (count, left) = guard.begin_operation().unwrap();
        assert_eq!(left, 9, "what the cap leaves the operation");
        count.store(4, Ordering::Relaxed);
        assert_eq!(guard.open_descriptors(), 5);
        // Between two descriptors it holds none, and is still tracked.
        count.store(0, Ordering::Relaxed);
        guard.admit().unwrap();
        count.store(9, Ordering::Relaxed);
        assert!(guard.admit().is_err());
        drop(descriptor);
        // The call ends while the operation runs: the next call of the guest is charged.
        drop(guard);
        count.store(0, Ordering::Relaxed);
        assert_eq!(lingering.count(), 0);
        count.store(3, Ordering::Relaxed);
        assert_eq!(lingering.count(), 3);
        let mut next = FsGuard::new(3, lingering.clone());
        assert!(next.admit().is_err());
        drop(count);
        next.admit().unwrap();
        assert_eq!(lingering.count(), 0);
    }
}
