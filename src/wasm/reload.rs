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
//!
//! With [`Loader::compiling_in_background`] (as `run` loads), a scan never compiles: a module
//! neither in the module cache nor refused before goes to the [`CompileQueue`], the scan serves
//! every guest that is ready, and the compile's end brings the next scan, which loads it. A
//! module still compiling keeps the version it replaces serving; a new one's provisioner name
//! is unavailable meanwhile (its claims wait).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::compile_queue::{CompileQueue, Compiled};
use super::engine::WasmEngine;
use super::grants::Grants;
use super::guest::Guest;
use super::pin::OnMismatch;
use super::plugins::{PluginDirError, PluginProblem, Plugins};

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
    /// Kept only to delete, and why: its file stopped matching the grant's pin and the grant
    /// says `on-mismatch = "delete-with-last-good"`.
    deletes_only: Option<String>,
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
    /// Compiles modules off the scan, when loading in the background.
    queue: Option<CompileQueue>,
    /// Modules compiling after the last scan (file → provisioner), and their count as last
    /// reported.
    compiling: BTreeMap<String, String>,
    last_compiling: usize,
}

/// What one `NAME.wasm` came to in a scan.
enum Loaded {
    /// The module and its grant file are unchanged since the last scan.
    Unchanged,
    /// Loaded now.
    New(Entry),
    /// Waiting for its compile in the background.
    Compiling { provisioner: String, sha256: String },
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
            queue: None,
            compiling: BTreeMap::new(),
            last_compiling: 0,
        }
    }

    /// Scans never compile from now on: modules to compile go to a [`CompileQueue`] (one at a
    /// time, smallest first) and load at the scan after their compile ends ([`watch`] scans
    /// as soon as one does). Each guest serves as soon as its own module is ready.
    pub fn compiling_in_background(mut self) -> std::io::Result<Loader> {
        self.queue = Some(CompileQueue::start(self.engine.clone())?);
        Ok(self)
    }

    /// Modules waiting for their compile or compiling (0 without background compiles).
    pub fn compiling(&self) -> usize {
        self.queue.as_ref().map_or(0, CompileQueue::pending)
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
        let mut compiling = BTreeMap::new();
        let mut compiling_shas = HashSet::new();
        for wasm in &listing.wasm_files {
            let name = wasm
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("guest")
                .to_string();
            let previous = self.entries.remove(&name);
            match self.load_one(&name, wasm, previous.as_ref()) {
                Ok(Loaded::New(entry)) => {
                    kept.insert(name, entry);
                }
                Ok(Loaded::Unchanged) => {
                    let mut entry = previous.expect("unchanged means it existed");
                    // The file holds again the bytes this entry was loaded from, under the same
                    // grant: a guest kept only to delete serves again.
                    if entry.deletes_only.take().is_some() {
                        tracing::info!(guest = %name, sha256 = %entry.wasm_sha256, "plugin serves again: its module matches its grant");
                    }
                    kept.insert(name, entry);
                }
                // The version serving (if any) serves on until the new one is compiled.
                Ok(Loaded::Compiling {
                    provisioner,
                    sha256,
                }) => {
                    compiling.insert(wasm.display().to_string(), provisioner);
                    compiling_shas.insert(sha256);
                    if let Some(previous) = previous {
                        kept.insert(name, previous);
                    }
                }
                Err(Refusal {
                    problem,
                    previous: then,
                }) => {
                    problems.push(problem);
                    match (previous, then) {
                        (Some(previous), Previous::Keep) => {
                            kept.insert(name, previous);
                        }
                        (Some(previous), Previous::DeletesOnly(why)) => {
                            if previous.deletes_only.is_none() {
                                self.unload(&name, &previous, &why);
                            }
                            kept.insert(
                                name,
                                Entry {
                                    deletes_only: Some(why),
                                    ..previous
                                },
                            );
                        }
                        (Some(previous), Previous::Unload(why)) => {
                            self.unload(&name, &previous, why)
                        }
                        (None, _) => {}
                    }
                }
            }
        }
        for (name, entry) in std::mem::take(&mut self.entries) {
            self.unload(&name, &entry, "its module file is gone");
        }
        self.entries = kept;
        if let Some(queue) = &self.queue {
            queue.retain(&compiling_shas);
        }
        self.compiling = compiling;
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

    /// Loads `NAME.wasm` with its grant file.
    fn load_one(
        &self,
        name: &str,
        wasm: &Path,
        previous: Option<&Entry>,
    ) -> Result<Loaded, Refusal> {
        let grant_path = wasm.with_extension("toml");
        let refuse = |file: &Path, reason: String, keep_previous: bool| Refusal {
            problem: PluginProblem {
                file: file.to_owned(),
                reason,
            },
            previous: if keep_previous {
                Previous::Keep
            } else {
                Previous::Unload("its grant file is gone")
            },
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
            return Ok(Loaded::Unchanged);
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
        let display = wasm.display().to_string();
        if let Err(mismatch) = super::engine::check_pin(&display, &grants, &wasm_sha256) {
            PluginStats::bump(&self.stats.rejections);
            return Err(module_refusal(
                wasm,
                mismatch.to_string(),
                &grants,
                previous,
            ));
        }
        if let Some(key) = &grants.module.cosign_key
            && let Err(why) = crate::oci::cosign::verify_beside(&self.dir, name, key, &wasm_sha256)
        {
            PluginStats::bump(&self.stats.rejections);
            let reason = format!("{display}: {why}; refused");
            return Err(module_refusal(wasm, reason, &grants, previous));
        }
        let loaded = match &self.queue {
            None => self.engine.load_bytes(name, &display, &bytes, grants),
            Some(queue) => {
                let sha256 = self
                    .engine
                    .admit(&display, &bytes)
                    .map_err(|e| rejected(wasm, e.to_string()))?;
                // A compile that ended since the last scan is reported as itself: the engine
                // already remembers a refusal, and "refused before" would hide why (killed,
                // out of time, invalid) the first time anyone hears of it.
                let cached = match queue.take(&sha256) {
                    Some(Ok(component)) => Some((component, true)),
                    Some(Err(error)) => return Err(rejected(wasm, error.to_string())),
                    None => self
                        .engine
                        .known(&display, &sha256)
                        .map_err(|e| rejected(wasm, e.to_string()))?
                        .map(|component| (component, false)),
                };
                let (component, fresh) = match cached {
                    Some(cached) => cached,
                    None => match queue.get(&display, &bytes, &sha256) {
                        Compiled::Ready(component) => (component, true),
                        Compiled::Refused(error) => return Err(rejected(wasm, error.to_string())),
                        Compiled::Pending { queued_now } => {
                            if queued_now {
                                tracing::info!(
                                    guest = name,
                                    provisioner = %grants.provisioner,
                                    sha256 = %sha256,
                                    bytes = bytes.len(),
                                    compiling = queue.pending(),
                                    "plugin compiling in the background; the guests that are ready serve meanwhile"
                                );
                            }
                            return Ok(Loaded::Compiling {
                                provisioner: grants.provisioner.clone(),
                                sha256,
                            });
                        }
                    },
                };
                self.engine
                    .load_compiled(name, &display, component, &sha256, fresh, grants)
            }
        };
        let guest = loaded.map_err(|e| rejected(wasm, e.to_string()))?;
        for warning in super::needs::warnings(&bytes, guest.grants()) {
            self.engine
                .plugin_warning(name, &display, &warning, super::needs::WARNING_LABEL);
        }
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
            "{what}"
        );
        Ok(Loaded::New(Entry {
            wasm_sha256,
            grant_sha256,
            guest: Arc::new(guest),
            deletes_only: None,
        }))
    }

    /// Builds the served set: one guest per provisioner name. When two guests claim one name,
    /// the one already serving it keeps it; otherwise neither serves it.
    fn assemble(&mut self, mut problems: Vec<PluginProblem>) -> Plugins {
        let mut by_provisioner: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        let mut deleting = BTreeMap::new();
        let mut deleting_why = BTreeMap::new();
        for (name, entry) in &self.entries {
            if let Some(why) = &entry.deletes_only {
                let provisioner = entry.guest.grants().provisioner.clone();
                deleting.insert(provisioner.clone(), entry.guest.clone());
                deleting_why.insert(provisioner, format!("guest {name}: {why}"));
                continue;
            }
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
        // A guest that only deletes serves no claims; its name says why.
        deleting.retain(|p, _| !served.contains_key(p));
        for (provisioner, why) in deleting_why {
            if deleting.contains_key(&provisioner) {
                self.unavailable.insert(provisioner, why);
            }
        }
        self.served = served;
        // A new guest's name is unavailable while its module compiles: its claims wait.
        let mut unavailable = self.unavailable.clone();
        for (file, provisioner) in &self.compiling {
            if !self.served.contains_key(provisioner) {
                unavailable
                    .entry(provisioner.clone())
                    .or_insert_with(|| format!("its module {file} is still being compiled"));
            }
        }
        Plugins::new(guests, problems, unavailable)
            .with_compiling(self.compiling.len())
            .with_deleting(deleting)
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
        let changed = current != self.served_ptrs
            || problems_changed
            || plugins.compiling() != self.last_compiling;
        self.served_ptrs = current;
        self.last_compiling = plugins.compiling();
        changed
    }
}

/// Loads every guest in `dir` once. Compiles, so call it off the async hot path.
pub fn load_dir(engine: &WasmEngine, dir: &Path) -> Result<Plugins, PluginDirError> {
    let mut loader = Loader::new(engine.clone(), dir.to_owned());
    Ok(loader.scan()?.plugins)
}

/// A file that was not (re)loaded, and whether an older version keeps serving.
struct Refusal {
    problem: PluginProblem,
    previous: Previous,
}

/// What becomes of the version that served before a refusal.
enum Previous {
    /// It serves on (the new files are broken; the old ones were fine).
    Keep,
    /// It stops serving, for this reason.
    Unload(&'static str),
    /// It only deletes from now on, for this reason.
    DeletesOnly(String),
}

/// The refusal of a module whose bytes are not the ones its grant vouches for (pin or
/// signature). The guest that served before stops serving claims; it deletes on only when the
/// grant says so and its own bytes are the pinned ones (a grant that pins new bytes has not
/// vouched for the old).
fn module_refusal(
    wasm: &Path,
    mismatch: String,
    grants: &Grants,
    previous: Option<&Entry>,
) -> Refusal {
    let last_good = previous.filter(|p| {
        grants.module.on_mismatch == OnMismatch::DeleteWithLastGood
            && grants.module.check(&p.wasm_sha256).is_ok()
    });
    let (then, consequence) = match (previous, last_good) {
        (_, Some(good)) => {
            let why = format!(
                "its module is no longer one its grant vouches for (pin, signature); the last good module (sha256 {}) only deletes (on-mismatch = \"delete-with-last-good\")",
                good.wasm_sha256
            );
            (
                Previous::DeletesOnly(why),
                "; new claims wait, released volumes are deleted by the last good module",
            )
        }
        (Some(_), None) => (
            Previous::Unload("its module is no longer one its grant vouches for (pin, signature)"),
            "; the guest stops serving: its claims and released volumes wait for a module that matches",
        ),
        (None, None) => (Previous::Unload("refused"), ""),
    };
    Refusal {
        problem: PluginProblem {
            file: wasm.to_owned(),
            reason: format!("{mismatch}{consequence}"),
        },
        previous: then,
    }
}

/// Why the watcher thread woke.
enum Wake {
    /// A file event in the directory (debounced).
    Changed,
    /// A background compile ended (scanned at once).
    Compiled,
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
    let (tx, rx) = std::sync::mpsc::channel::<Wake>();
    let events = tx.clone();
    if let Some(queue) = &loader.queue {
        // A compile's end is acted on at once (no debounce: nothing is being written).
        let compiled = tx.clone();
        queue.on_done(move || {
            let _ = compiled.send(Wake::Compiled);
        });
    }
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event
            && !matches!(event.kind, notify::EventKind::Access(_))
        {
            let _ = events.send(Wake::Changed);
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
            let mut compiled = false;
            while !stopped.load(Ordering::Relaxed) {
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(Wake::Changed) => {
                        let now = Instant::now();
                        pending = Some((pending.map_or(now, |(first, _)| first), now));
                        continue;
                    }
                    Ok(Wake::Compiled) => compiled = true,
                    Err(_) => {}
                }
                // Quiet for `debounce`, or busy for ten times that: a directory that never settles
                // is still scanned.
                let due = match pending {
                    Some((first, last)) => {
                        last.elapsed() >= options.debounce
                            || first.elapsed() >= options.debounce * 10
                    }
                    None => compiled || last_scan.elapsed() >= options.rescan,
                };
                if !due {
                    continue;
                }
                pending = None;
                compiled = false;
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
