//! The compiled-module cache: native code for a component, keyed by the `.wasm`'s SHA-256 and
//! the engine's compatibility fingerprint, kept in an operator-owned directory.
//!
//! Loading native code is running it, so an entry is only ever one we wrote, is checked against
//! the SHA-256 stored in front of it before wasmtime sees it, and anything wrong with it (stale
//! engine, truncated, corrupt, unreadable) is a miss that recompiles, never a failure.

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
}

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
