//! Compiling in the background: modules that are neither in the module cache nor refused
//! before are compiled here, one at a time and smallest first, on a thread of its own, while the
//! plugins loader serves every guest whose module is ready.
//!
//! ```text
//! Loader::scan ─ cached / refused before? ─▶ served / reported now
//!              ─ else ─▶ queue (smallest first) ─▶ one compile child at a time ─▶ done
//!                                                      └─ on_done() ─▶ the watcher scans again
//! ```
//!
//! Why: the first scan compiled every module in turn before any guest served, so two modules
//! that compile for half a minute each (and are then refused) held every good guest's first
//! volume back by a minute, at every start. One child at a time bounds what untrusted compiles
//! take of the container (one CPU at `SCHED_BATCH`, nice 10, one child's address space: two at once could
//! together reach the memory limit, and the kernel would then kill the other module's child);
//! smallest first lets a guest of a few hundred KiB go ahead of a large module queued beside it.
//! What it does not do: stop a compile that has started. A module queued while a larger one
//! compiles waits for it, at most the child's limits (60 CPU seconds, 120 s by default).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};

use wasmtime::component::Component;

use super::engine::WasmEngine;
use super::errors::LoadError;

/// Called on the compiler thread each time a compile ends.
type OnDone = Arc<dyn Fn() + Send + Sync>;

/// What the queue knows of one module.
pub enum Compiled {
    /// Compiled since it was queued: the component, from this process' compile.
    Ready(Component),
    /// Refused by its compile (reported once; the engine remembers it as refused before).
    Refused(LoadError),
    /// Queued or compiling; `queued_now` when this call queued it.
    Pending {
        /// Whether this call put it in the queue.
        queued_now: bool,
    },
}

/// A module waiting for the compiler thread.
struct Job {
    display: String,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct State {
    /// By (size, SHA-256): the smallest first.
    queued: BTreeMap<(usize, String), Job>,
    /// The SHA-256 of the module compiling now.
    running: Option<String>,
    /// Compiles ended and not yet taken, by SHA-256.
    done: HashMap<String, Result<Component, LoadError>>,
    on_done: Option<OnDone>,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The queue and its compiler thread; dropping it stops the thread after the compile running
/// now (if any).
pub struct CompileQueue {
    shared: Arc<Shared>,
}

impl CompileQueue {
    /// Starts the compiler thread, compiling with `engine` ([`WasmEngine::compile_now`]: in its
    /// compiler child when it has one).
    pub fn start(engine: WasmEngine) -> std::io::Result<CompileQueue> {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            work: Condvar::new(),
        });
        let worker = shared.clone();
        std::thread::Builder::new()
            .name("plugins-compile".into())
            .spawn(move || compile_loop(&worker, &engine))?;
        Ok(CompileQueue { shared })
    }

    /// Calls `on_done` (on the compiler thread) whenever a compile ends, and once now if some
    /// ended before it was set.
    pub fn on_done(&self, on_done: impl Fn() + Send + Sync + 'static) {
        let on_done: OnDone = Arc::new(on_done);
        let ended = {
            let mut state = self.shared.lock();
            state.on_done = Some(on_done.clone());
            !state.done.is_empty()
        };
        if ended {
            on_done();
        }
    }

    /// The outcome of a compile of the module with SHA-256 `sha256` that ended and was not
    /// taken yet (taken now: the caller keeps it).
    pub fn take(&self, sha256: &str) -> Option<Result<Component, LoadError>> {
        self.shared.lock().done.remove(sha256)
    }

    /// The module with SHA-256 `sha256`: its compile's outcome (taken: the caller keeps it), or
    /// pending (queued now if it was not).
    pub fn get(&self, display: &str, bytes: &[u8], sha256: &str) -> Compiled {
        let mut state = self.shared.lock();
        if let Some(outcome) = state.done.remove(sha256) {
            return match outcome {
                Ok(component) => Compiled::Ready(component),
                Err(error) => Compiled::Refused(error),
            };
        }
        let key = (bytes.len(), sha256.to_string());
        if state.running.as_deref() == Some(sha256) || state.queued.contains_key(&key) {
            return Compiled::Pending { queued_now: false };
        }
        state.queued.insert(
            key,
            Job {
                display: display.to_string(),
                bytes: bytes.to_vec(),
            },
        );
        self.shared.work.notify_one();
        Compiled::Pending { queued_now: true }
    }

    /// Forgets queued modules and unclaimed outcomes whose SHA-256 is not in `wanted` (their
    /// file changed or went away before they were compiled or loaded).
    pub fn retain(&self, wanted: &HashSet<String>) {
        let mut state = self.shared.lock();
        state.queued.retain(|(_, sha), _| wanted.contains(sha));
        state.done.retain(|sha, _| wanted.contains(sha));
    }

    /// Modules queued or compiling.
    pub fn pending(&self) -> usize {
        let state = self.shared.lock();
        state.queued.len() + usize::from(state.running.is_some())
    }
}

impl Drop for CompileQueue {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
    }
}

fn compile_loop(shared: &Shared, engine: &WasmEngine) {
    loop {
        let ((_, sha256), job) = {
            let mut state = shared.lock();
            loop {
                if state.stop {
                    return;
                }
                if let Some(next) = state.queued.pop_first() {
                    state.running = Some(next.0.1.clone());
                    break next;
                }
                state = shared.work.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        };
        let outcome = engine.compile_now(&job.display, &job.bytes, &sha256);
        drop(job);
        let on_done = {
            let mut state = shared.lock();
            state.running = None;
            state.done.insert(sha256, outcome);
            state.on_done.clone()
        };
        if let Some(on_done) = on_done {
            on_done();
        }
    }
}
