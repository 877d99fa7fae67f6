//! The compiled-module cache: native code for a component, keyed by the `.wasm`'s SHA-256 and
//! the engine's compatibility fingerprint, kept in an operator-owned directory.
//!
//! Loading native code is running it, so an entry is only ever one we wrote, is checked against
//! the SHA-256 stored in front of it before wasmtime sees it, and anything wrong with it (stale
//! engine, truncated, corrupt, unreadable) is a miss that recompiles, never a failure.
//!
//! Modules refused (they did not compile within the child's limits, or do not link) are
//! remembered here too, by SHA-256, in `refused/`: a small record each, at most
//! [`REFUSALS_KEPT`], keyed by the engine's fingerprint, this binary's version and the compile
//! limits, so a restart does not compile them again and an upgrade or other limits do. A record
//! that is unreadable, corrupt or for another key is a miss, never a failure.

use std::hash::Hasher;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Why the cache directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// It cannot be created or resolved.
    #[error("module cache {dir}: {source}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// It is the plugins directory, inside it, or contains it.
    #[error(
        "module cache {cache} overlaps the plugins directory {plugins}; it must be a directory only the provisioner writes"
    )]
    SharedWithPlugins {
        /// The cache directory.
        cache: PathBuf,
        /// The plugins directory.
        plugins: PathBuf,
    },
}

/// Counters of what the cache did.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// Entries found and used.
    pub hits: AtomicU64,
    /// No entry: compiled and stored.
    pub misses: AtomicU64,
    /// An entry existed but was refused (other engine, corrupt, unreadable): recompiled.
    pub stale: AtomicU64,
    /// Entries that could not be written (the module still loads).
    pub write_errors: AtomicU64,
    /// Modules found refused before by a record in `refused/` (not compiled again).
    pub refusal_hits: AtomicU64,
}

/// Refusal records kept at most: the oldest goes when one more is written.
pub const REFUSALS_KEPT: usize = 256;

/// Bytes of a refusal's reason kept in its record (so `refused/` stays under
/// [`REFUSALS_KEPT`] x ~1.2 KiB).
const REFUSAL_REASON_BYTES: usize = 1024;

/// The first line after a refusal record's checksum.
const REFUSAL_HEADER: &str = "wasm-provisioner refusal 1";

/// The on-disk cache.
#[derive(Debug)]
pub struct ModuleCache {
    dir: PathBuf,
    engine_key: String,
    /// What it did so far.
    pub stats: CacheStats,
}

/// Feeds `Hash` output into SHA-256, so the engine fingerprint is stable across processes.
struct ShaHasher(Sha256);

impl Hasher for ShaHasher {
    fn finish(&self) -> u64 {
        let digest = self.0.clone().finalize();
        u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// The engine's compatibility fingerprint: equal fingerprints load each other's artifacts.
pub fn engine_fingerprint(engine: &Engine) -> String {
    let mut hasher = ShaHasher(Sha256::new());
    std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut hasher);
    hex::encode(&hasher.0.finalize()[..12])
}

impl ModuleCache {
    /// Opens (creating it if needed) the cache directory for artifacts of `engine`.
    pub fn open(dir: &Path, engine: &Engine) -> Result<ModuleCache, CacheError> {
        let dir_err = |source| CacheError::Dir {
            dir: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(dir_err)?;
        let dir = dir.canonicalize().map_err(dir_err)?;
        Ok(ModuleCache {
            dir,
            engine_key: engine_fingerprint(engine),
            stats: CacheStats::default(),
        })
    }

    /// The cache directory (resolved).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Refuses a cache that overlaps the plugins directory: whoever may write plugins must not
    /// be able to plant native code.
    pub fn check_separate_from(&self, plugins: &Path) -> Result<(), CacheError> {
        let plugins = plugins
            .canonicalize()
            .unwrap_or_else(|_| plugins.to_owned());
        if self.dir.starts_with(&plugins) || plugins.starts_with(&self.dir) {
            return Err(CacheError::SharedWithPlugins {
                cache: self.dir.clone(),
                plugins,
            });
        }
        Ok(())
    }

    /// Why a module with this SHA-256 was refused by this engine under compile limits `limits`
    /// ([`super::compiler::CompileLimits::key`]), when a sound record says it was.
    pub fn refusal(&self, wasm_sha256: &str, limits: &str) -> Option<String> {
        let (path, key) = self.refusal_entry(wasm_sha256, limits);
        let text = std::fs::read(&path).ok()?;
        let sound = std::str::from_utf8(&text)
            .ok()
            .and_then(|text| text.split_once('\n'))
            .filter(|(digest, body)| hex::encode(Sha256::digest(body.as_bytes())) == *digest)
            .and_then(|(_, body)| body.strip_prefix(REFUSAL_HEADER)?.strip_prefix('\n'))
            .and_then(|body| body.split_once('\n'))
            .filter(|(line, _)| line.strip_prefix("key ") == Some(key.as_str()))
            .map(|(_, reason)| reason.to_string());
        match sound {
            Some(reason) => {
                self.stats.refusal_hits.fetch_add(1, Ordering::Relaxed);
                Some(reason)
            }
            None => {
                tracing::warn!(record = %path.display(), "refusal record unreadable or for another key; the module is compiled again");
                None
            }
        }
    }

    /// Records that a module was refused (temporary file, then rename), forgetting the oldest
    /// records past [`REFUSALS_KEPT`]. A failure is logged, never fatal: the module is then
    /// compiled again at the next start.
    pub fn put_refusal(&self, wasm_sha256: &str, limits: &str, reason: &str) {
        let (path, key) = self.refusal_entry(wasm_sha256, limits);
        let mut end = reason.len().min(REFUSAL_REASON_BYTES);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let body = format!("{REFUSAL_HEADER}\nkey {key}\n{}", &reason[..end]);
        let record = format!("{}\n{body}", hex::encode(Sha256::digest(body.as_bytes())));
        let dir = self.dir.join("refused");
        let result = std::fs::create_dir_all(&dir)
            .and_then(|()| forget_oldest(&dir, REFUSALS_KEPT - 1))
            .and_then(|()| {
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                std::fs::write(&tmp, record)
                    .and_then(|()| std::fs::rename(&tmp, &path))
                    .inspect_err(|_| {
                        let _ = std::fs::remove_file(&tmp);
                    })
            });
        if let Err(error) = result {
            self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(record = %path.display(), %error, "cannot write refusal record");
        }
    }

    /// The record's path and the key written in it: the module, this engine, this binary's
    /// version and the compile limits.
    fn refusal_entry(&self, wasm_sha256: &str, limits: &str) -> (PathBuf, String) {
        let key = format!("{wasm_sha256} {} {limits}", self.engine_key);
        let short = hex::encode(&Sha256::digest(key.as_bytes())[..12]);
        let path = self
            .dir
            .join("refused")
            .join(format!("{wasm_sha256}-{short}.refused"));
        (path, key)
    }

    fn entry(&self, wasm_sha256: &str) -> PathBuf {
        self.dir
            .join(format!("{wasm_sha256}-{}.cwasm", self.engine_key))
    }

    /// The cached component for a `.wasm` with this SHA-256, if a sound entry exists.
    pub fn get(&self, engine: &Engine, wasm_sha256: &str) -> Option<Component> {
        let path = self.entry(wasm_sha256);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            Err(error) => return self.stale(&path, &error.to_string()),
        };
        let Some((digest, artifact)) = bytes.split_at_checked(32) else {
            return self.stale(&path, "truncated");
        };
        if Sha256::digest(artifact).as_slice() != digest {
            return self.stale(&path, "checksum mismatch");
        }
        match deserialize(engine, artifact) {
            Ok(component) => {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                Some(component)
            }
            Err(error) => self.stale(&path, &format!("{error:#}")),
        }
    }

    fn stale(&self, path: &Path, why: &str) -> Option<Component> {
        self.stats.stale.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(entry = %path.display(), why, "module cache entry refused; recompiling");
        None
    }

    /// Stores a freshly compiled component (written to a temporary file, then renamed, so a
    /// reader never sees half an entry). A failure is logged and counted, never fatal.
    pub fn put(&self, wasm_sha256: &str, component: &Component) {
        let path = self.entry(wasm_sha256);
        let result = component
            .serialize()
            .map_err(|e| format!("{e:#}"))
            .and_then(|artifact| {
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                let mut file = std::fs::File::create(&tmp).map_err(|e| e.to_string())?;
                file.write_all(&Sha256::digest(&artifact))
                    .and_then(|()| file.write_all(&artifact))
                    .and_then(|()| file.sync_all())
                    .and_then(|()| std::fs::rename(&tmp, &path))
                    .map_err(|e| {
                        let _ = std::fs::remove_file(&tmp);
                        e.to_string()
                    })
            });
        if let Err(error) = result {
            self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(entry = %path.display(), %error, "cannot write module cache entry");
        }
    }
}

/// Removes the oldest entries of `dir` (by modification time) until at most `keep` are left.
fn forget_oldest(dir: &Path, keep: usize) -> std::io::Result<()> {
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if entries.len() <= keep {
        return Ok(());
    }
    entries.sort();
    for (_, path) in &entries[..entries.len() - keep] {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Turns a cache entry back into a component.
#[expect(
    unsafe_code,
    reason = "Component::deserialize maps the bytes as native code; they are this binary's own \
              compiler output: from an operator-owned directory checked by SHA-256 first, or \
              straight from its own compile-guest child"
)]
pub(super) fn deserialize(engine: &Engine, artifact: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `Component::deserialize` trusts its input to be wasmtime's own output, since
    // it maps it as native code. These bytes are: the cache directory is operator-owned and
    // refused when it overlaps the plugins directory (`check_separate_from`), entries are
    // written only by `put` from a component this process compiled, and the caller checked
    // the SHA-256 stored in front of the artifact, so a truncated or corrupted entry never gets
    // here. Or they come from the pipe of this binary's own `compile-guest` child
    // (`super::compiler`), which compiles exactly as this process would, only under limits
    // (the same trust as compiling here). wasmtime itself refuses artifacts of another version
    // or configuration with an error.
    unsafe { Component::deserialize(engine, artifact) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_fingerprint_is_stable_and_configuration_sensitive() {
        let a = Engine::default();
        let b = Engine::default();
        assert_eq!(engine_fingerprint(&a), engine_fingerprint(&b));
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        let c = Engine::new(&config).unwrap();
        assert_ne!(engine_fingerprint(&a), engine_fingerprint(&c));
    }

    #[test]
    fn refusals_are_kept_by_key_bounded_and_a_bad_record_is_a_miss() {
        let root = tempfile::tempdir().unwrap();
        let engine = Engine::default();
        let cache = ModuleCache::open(root.path(), &engine).unwrap();
        let sha = "ab".repeat(32);
        assert_eq!(cache.refusal(&sha, "limits-a"), None);
        cache.put_refusal(&sha, "limits-a", &"x".repeat(5000));
        let reason = cache.refusal(&sha, "limits-a").expect("recorded");
        assert_eq!(reason.len(), REFUSAL_REASON_BYTES, "the reason is capped");
        // Other limits, or another engine, compile again.
        assert_eq!(cache.refusal(&sha, "limits-b"), None);
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        let other = ModuleCache::open(root.path(), &Engine::new(&config).unwrap()).unwrap();
        assert_eq!(other.refusal(&sha, "limits-a"), None);
        // A corrupt or truncated record is a miss.
        let record = std::fs::read_dir(root.path().join("refused"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let mut bytes = std::fs::read(&record).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&record, &bytes).unwrap();
        assert_eq!(cache.refusal(&sha, "limits-a"), None);
        std::fs::write(&record, b"\xff\xfe").unwrap();
        assert_eq!(cache.refusal(&sha, "limits-a"), None);
        // At most REFUSALS_KEPT records.
        for i in 0..REFUSALS_KEPT + 10 {
            cache.put_refusal(&format!("{i:064}"), "limits-a", "refused");
        }
        let kept = std::fs::read_dir(root.path().join("refused"))
            .unwrap()
            .count();
        assert_eq!(kept, REFUSALS_KEPT);
        assert!(
            cache
                .refusal(&format!("{:064}", REFUSALS_KEPT + 9), "limits-a")
                .is_some()
        );
    }

    #[test]
    fn a_cache_overlapping_the_plugins_directory_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let engine = Engine::default();
        let cache = ModuleCache::open(&root.path().join("plugins/cache"), &engine).unwrap();
        let err = cache
            .check_separate_from(&root.path().join("plugins"))
            .unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
        let cache = ModuleCache::open(root.path(), &engine).unwrap();
        assert!(cache.check_separate_from(&root.path().join("p")).is_err());
        let cache = ModuleCache::open(&root.path().join("cache"), &engine).unwrap();
        std::fs::create_dir(root.path().join("plugins2")).unwrap();
        cache
            .check_separate_from(&root.path().join("plugins2"))
            .unwrap();
    }
}
