//! Live plugins: scan the plugins directory incrementally and watch it for changes.
//!
//! ```text
//! notify event ─▶ debounce (quiet for `debounce`) ─┐
//! every `rescan` (safety net) ─────────────────────┴▶ Loader::scan ─▶ changed? ─▶ on_change(Arc<Plugins>)
//! ```
//!
//! A scan reuses every guest whose `.wasm` and grant file are byte-for-byte unchanged, loads new
//! pairs, and swaps a changed guest only once the new version compiled, linked and validated; a
//! broken new version leaves the old one serving and is reported. A removed guest is unloaded and
//! its provisioner is remembered as unavailable, so its claims wait instead of failing. Calls in
//! flight hold their own `Arc<Guest>` and finish on the version they started with. Kubernetes
//! ConfigMap/Secret volumes swap a `..data` symlink; that is an event in the directory too, and
//! files are compared by content, never by timestamp.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::grants::Grants;
use super::plugins::{PluginDirError, PluginProblem, Plugins};
use super::runtime::{Guest, WasmEngine};

/// What happened to plugins since the process started (the lead wires these to `/metrics`).
#[derive(Debug, Default)]
pub struct PluginStats {
    loads: AtomicU64,
    reloads: AtomicU64,
    rejections: AtomicU64,
    unloads: AtomicU64,
    scans: AtomicU64,
}

/// A snapshot of [`PluginStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PluginCounts {
    /// Guests loaded that were not loaded before.
    pub loads: u64,
    /// Guests replaced by a new version.
    pub reloads: u64,
    /// Module or grant files refused (a new guest, or a new version of a serving one).
    pub rejections: u64,
    /// Guests removed.
    pub unloads: u64,
    /// Directory scans.
    pub scans: u64,
}

impl PluginStats {
    /// The counts so far.
    pub fn counts(&self) -> PluginCounts {
        PluginCounts {
            loads: self.loads.load(Ordering::Relaxed),
            reloads: self.reloads.load(Ordering::Relaxed),
            rejections: self.rejections.load(Ordering::Relaxed),
            unloads: self.unloads.load(Ordering::Relaxed),
            scans: self.scans.load(Ordering::Relaxed),
        }
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A loaded guest and the content it was loaded from.
struct Entry {
    wasm_sha256: String,
    grant_sha256: String,
    guest: Arc<Guest>,
}

/// Loads the plugins directory, remembering what it loaded so the next scan only does the work
/// that changed files need.
pub struct Loader {
    engine: WasmEngine,
    dir: PathBuf,
    entries: BTreeMap<String, Entry>,
    /// Provisioner name → guest name, as of the last scan.
    served: BTreeMap<String, String>,
    unavailable: BTreeMap<String, String>,
    last_problems: Vec<PluginProblem>,
    /// (provisioner, guest identity) served after the last scan, to tell whether a scan changed anything.
    served_ptrs: BTreeSet<(String, usize)>,
    stats: Arc<PluginStats>,
}

/// The result of one scan.
pub struct Scan {
    /// The guests to serve now.
    pub plugins: Plugins,
    /// Whether anything differs from the previous scan (served guests or problems).
    pub changed: bool,
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl Loader {
    /// A loader for `dir` that has loaded nothing yet.
    pub fn new(engine: WasmEngine, dir: PathBuf) -> Loader {
        Loader {
            engine,
            dir,
            entries: BTreeMap::new(),
            served: BTreeMap::new(),
            unavailable: BTreeMap::new(),
            last_problems: Vec::new(),
            served_ptrs: BTreeSet::new(),
            stats: Arc::default(),
        }
    }

    /// The counters, shared.
    pub fn stats(&self) -> Arc<PluginStats> {
        self.stats.clone()
    }

    /// The directory it loads.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Scans the directory once. Compiles, so call it off the async hot path.
    pub fn scan(&mut self) -> Result<Scan, PluginDirError> {
        PluginStats::bump(&self.stats.scans);
        let listing = super::plugins::list_dir(&self.dir)?;
        let mut problems = listing.problems;
        let mut kept: BTreeMap<String, Entry> = BTreeMap::new();
        for wasm in &listing.wasm_files {
            let name = wasm
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("guest")
                .to_string();
            let previous = self.entries.remove(&name);
            match self.load_one(&name, wasm, previous.as_ref()) {
                Ok(Some(entry)) => {
                    kept.insert(name, entry);
                }
                Ok(None) => {
                    kept.insert(name, previous.expect("unchanged means it existed"));
                }
                Err(problem) => {
                    let keep = problem.keep_previous;
                    problems.push(problem.problem);
                    match previous {
                        Some(previous) if keep => {
                            kept.insert(name, previous);
                        }
                        Some(previous) => self.unload(&name, &previous, "its grant file is gone"),
                        None => {}
                    }
                }
            }
        }
        for (name, entry) in std::mem::take(&mut self.entries) {
            self.unload(&name, &entry, "its module file is gone");
        }
        self.entries = kept;
        let plugins = self.assemble(problems);
        let changed = self.note_changes(&plugins);
        Ok(Scan { plugins, changed })
    }

    fn unload(&self, name: &str, entry: &Entry, why: &str) {
        PluginStats::bump(&self.stats.unloads);
        tracing::warn!(
            guest = name,
            provisioner = %entry.guest.grants().provisioner,
            sha256 = entry.guest.sha256(),
            "plugin unloaded: {why}; its claims wait until it returns"
        );
    }

    /// Loads `NAME.wasm` with its grant file: `Ok(None)` when both are unchanged.
    fn load_one(
        &self,
        name: &str,
        wasm: &Path,
        previous: Option<&Entry>,
    ) -> Result<Option<Entry>, Refusal> {
        let grant_path = wasm.with_extension("toml");
        let refuse = |file: &Path, reason: String, keep_previous: bool| Refusal {
            problem: PluginProblem {
                file: file.to_owned(),
                reason,
            },
            keep_previous,
        };
        let grant_text = match std::fs::read(&grant_path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                // Taking the grant away revokes it: the guest is unloaded, not kept.
                return Err(refuse(
                    wasm,
                    format!(
                        "no grant file {}; a guest without grants is not loaded",
                        grant_path.display()
                    ),
                    false,
                ));
            }
            Err(error) => {
                return Err(refuse(&grant_path, format!("cannot read: {error}"), true));
            }
        };
        let bytes = super::engine::read_module(wasm)
            .map_err(|error| refuse(wasm, error.to_string(), true))?;
        let (wasm_sha256, grant_sha256) = (sha256(&bytes), sha256(&grant_text));
        if let Some(previous) = previous
            && previous.wasm_sha256 == wasm_sha256
            && previous.grant_sha256 == grant_sha256
        {
            return Ok(None);
        }
        let keeping = |reason: String| match previous {
            Some(p) => format!(
                "{reason}; still serving the previous version (sha256 {})",
                p.wasm_sha256
            ),
            None => reason,
        };
        let rejected = |file: &Path, reason: String| {
            PluginStats::bump(&self.stats.rejections);
            refuse(file, keeping(reason), true)
        };
        let grant_text = String::from_utf8(grant_text)
            .map_err(|_| rejected(&grant_path, "grant file is not UTF-8".into()))?;
        let mut grants = Grants::from_text(&grant_path, &grant_text)
            .map_err(|e| rejected(&grant_path, e.to_string()))?;
        let mut protected = vec![self.dir.as_path()];
        protected.extend(self.engine.module_cache().map(|c| c.dir()));
        let notes = grants.resolve(&protected).map_err(|reason| {
            rejected(
                &grant_path,
                format!("grant file {}: {reason}", grant_path.display()),
            )
        })?;
        for note in notes {
            tracing::warn!(guest = name, grant = %grant_path.display(), "{note}");
        }
        let guest = self
            .engine
            .load_bytes(name, &wasm.display().to_string(), &bytes, grants)
            .map_err(|e| rejected(wasm, e.to_string()))?;
        let what = if previous.is_some() {
            PluginStats::bump(&self.stats.reloads);
            "plugin reloaded"
        } else {
            PluginStats::bump(&self.stats.loads);
            "plugin loaded"
        };
        tracing::info!(
            guest = name,
            provisioner = %guest.grants().provisioner,
            sha256 = %wasm_sha256,
            previous = previous.map(|p| p.wasm_sha256.as_str()).unwrap_or("-"),
            filesystem = if guest.filesystem_inline() { "inline (local grants)" } else { "blocking pool" },
            "{what}"
        );
        Ok(Some(Entry {
            wasm_sha256,
            grant_sha256,
            guest: Arc::new(guest),
        }))
    }

    /// Builds the served set: one guest per provisioner name. When two guests claim one name,
    /// the one already serving it keeps it; otherwise neither serves it.
    fn assemble(&mut self, mut problems: Vec<PluginProblem>) -> Plugins {
        let mut by_provisioner: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (name, entry) in &self.entries {
            by_provisioner
                .entry(entry.guest.grants().provisioner.clone())
                .or_default()
                .push(name);
        }
        let mut guests = BTreeMap::new();
        let mut served = BTreeMap::new();
        for (provisioner, names) in by_provisioner {
            let incumbent = self.served.get(&provisioner).map(String::as_str);
            let winner = match names.as_slice() {
                [only] => Some(*only),
                _ => names.iter().copied().find(|n| Some(*n) == incumbent),
            };
            let files: Vec<String> = names
                .iter()
                .map(|n| self.dir.join(format!("{n}.wasm")).display().to_string())
                .collect();
            for name in &names {
                if Some(*name) == winner {
                    continue;
                }
                let reason = match winner {
                    Some(w) => format!(
                        "provisioner {provisioner:?} is already served by {w}.wasm; claimed by more than one guest ({})",
                        files.join(", ")
                    ),
                    None => format!(
                        "provisioner {provisioner:?} is claimed by more than one guest ({}); none of them serves it",
                        files.join(", ")
                    ),
                };
                problems.push(PluginProblem {
                    file: self.dir.join(format!("{name}.wasm")),
                    reason,
                });
            }
            if let Some(winner) = winner {
                guests.insert(provisioner.clone(), self.entries[winner].guest.clone());
                served.insert(provisioner, winner.to_string());
            }
        }
        for (provisioner, name) in &self.served {
            if !served.contains_key(provisioner) {
                self.unavailable.insert(
                    provisioner.clone(),
                    format!("guest {name} that served it was unloaded or refused"),
                );
            }
        }
        self.unavailable.retain(|p, _| !served.contains_key(p));
        self.served = served;
        Plugins::new(guests, problems, self.unavailable.clone())
    }

    fn note_changes(&mut self, plugins: &Plugins) -> bool {
        let problems_changed = plugins.problems != self.last_problems;
        if problems_changed {
            for problem in &plugins.problems {
                if !self.last_problems.contains(problem) {
                    tracing::error!(file = %problem.file.display(), "plugin not loaded: {}", problem.reason);
                }
            }
        }
        self.last_problems = plugins.problems.clone();
        let current: BTreeSet<(String, usize)> = plugins
            .iter()
            .map(|(p, g)| (p.clone(), Arc::as_ptr(g) as usize))
            .collect();
        let changed = current != self.served_ptrs || problems_changed;
        self.served_ptrs = current;
        changed
    }
}

/// A file that was not (re)loaded, and whether an older version keeps serving.
struct Refusal {
    problem: PluginProblem,
    keep_previous: bool,
}

/// How the watcher behaves.
#[derive(Debug, Clone, Copy)]
pub struct WatchOptions {
    /// Full rescan this often even without events (the safety net for missed events).
    pub rescan: Duration,
    /// A change is acted on once the directory was quiet this long (partial writes settle).
    pub debounce: Duration,
}

/// The running watcher; dropping it stops watching.
pub struct PluginWatcher {
    stop: Arc<AtomicBool>,
    _watcher: Option<notify::RecommendedWatcher>,
}

impl Drop for PluginWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Watches the loader's directory on a thread of its own (scans compile) and hands every
/// changed set of plugins to `on_change`. Without file events (the watch could not be set up)
/// the periodic rescan still works.
pub fn watch(
    mut loader: Loader,
    options: WatchOptions,
    mut on_change: impl FnMut(Arc<Plugins>) + Send + 'static,
) -> std::io::Result<PluginWatcher> {
    use notify::Watcher as _;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let events = tx.clone();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event
            && !matches!(event.kind, notify::EventKind::Access(_))
        {
            let _ = events.send(());
        }
    })
    .and_then(|mut w| {
        w.watch(loader.dir(), notify::RecursiveMode::NonRecursive)
            .map(|()| w)
    });
    let watcher = match watcher {
        Ok(w) => Some(w),
        Err(error) => {
            tracing::warn!(%error, dir = %loader.dir().display(), rescan = ?options.rescan, "cannot watch the plugins directory; relying on the periodic rescan");
            None
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::Builder::new()
        .name("plugins-watch".into())
        .spawn(move || {
            let _keep_channel_open = tx;
            let mut last_scan = Instant::now();
            // (first, last) event since the last scan.
            let mut pending: Option<(Instant, Instant)> = None;
            while !stopped.load(Ordering::Relaxed) {
                if rx.recv_timeout(Duration::from_millis(50)).is_ok() {
                    let now = Instant::now();
                    pending = Some((pending.map_or(now, |(first, _)| first), now));
                    continue;
                }
                // Quiet for `debounce`, or busy for ten times that: a directory that never settles
                // is still scanned.
                let due = match pending {
                    Some((first, last)) => {
                        last.elapsed() >= options.debounce
                            || first.elapsed() >= options.debounce * 10
                    }
                    None => last_scan.elapsed() >= options.rescan,
                };
                if !due {
                    continue;
                }
                pending = None;
                last_scan = Instant::now();
                match loader.scan() {
                    Ok(scan) if scan.changed => {
                        tracing::info!(
                            guests = scan.plugins.len(),
                            problems = scan.plugins.problems.len(),
                            "plugins changed"
                        );
                        on_change(Arc::new(scan.plugins));
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::error!(%error, "plugins rescan failed; keeping the current guests")
                    }
                }
            }
        })?;
    Ok(PluginWatcher {
        stop,
        _watcher: watcher,
    })
}
