//! The wasm engine: one wasmtime `Engine` and `Linker` for all guests, the epoch ticker that
//! drives deadlines, the instance pool ([`super::pool`] sizes and shares it), and compiling and
//! linking a guest once per module.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy};

use super::bindings::{
    ProvisionerFull, block_support, cloning, deletion_guard, expansion, lifecycle, qualifier,
};
use super::cache::ModuleCache;
use super::compiler::{CompileLimits, MAX_MODULE_BYTES, base_config, compile_in_child};
use super::contract::{ContractInfo, Hook};
use super::errors::LoadError;
use super::executor::{ExecutorOptions, GuestExecutor};
use super::grants::Grants;
use super::guest::{Guest, claim_slots};
use super::host::GuestState;
use super::nodefs::{DEFAULT_KUBELET_DIR, NodeFilesystems};
use super::pool::{POOL_CORE_INSTANCES, PoolLedger, pool_units};
use crate::metrics::Metrics;

/// How often the epoch ticks; deadlines are checked against the wall clock on each tick.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Whether instances come from a preallocated pool (fast, bounded) or are allocated per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Pooling {
    /// Use the pool when the machine can reserve its address space, else allocate on demand.
    #[default]
    Auto,
    /// Require the pool; fail to start without it.
    On,
    /// Allocate on demand.
    Off,
}

/// How the engine is built.
#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    /// Instance allocation strategy.
    pub pooling: Pooling,
    /// Directory of the compiled-module cache; none disables it.
    pub module_cache: Option<PathBuf>,
    /// Threads of their own (at a lower priority) for guest code; none runs calls on the
    /// caller's runtime.
    pub executor: Option<ExecutorOptions>,
    /// Compile guests in a child process under these limits ([`super::compiler`]); none
    /// compiles in this process.
    pub compiler: Option<CompileLimits>,
}

/// One engine and linker for all guests, with the epoch ticker that drives deadlines.
#[derive(Clone)]
pub struct WasmEngine {
    engine: Engine,
    linker: Arc<Linker<GuestState>>,
    metrics: Option<Metrics>,
    /// The pool's units when pooling ([`pool_units`]): every call holds its share, so the pool
    /// is never exhausted.
    pool_slots: Option<Arc<Semaphore>>,
    /// What the loaded guests reserve of the pool, when pooling.
    pool_ledger: Arc<PoolLedger>,
    cache: Option<Arc<ModuleCache>>,
    executor: Option<GuestExecutor>,
    compiler: Option<CompileLimits>,
    /// Modules that failed to compile, by SHA-256, with why: not compiled again until they
    /// change (a hot-reload rescan would otherwise compile a refused bomb every time).
    refused: Arc<Mutex<HashMap<String, String>>>,
    /// The node's own filesystems: a read-write grant on one loads with a warning.
    node_filesystems: Arc<NodeFilesystems>,
}

/// The engine's configuration with instances from the pool ([`super::pool`]).
fn pooling_config() -> Config {
    let mut config = base_config();
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(
        super::pool::allocation(),
    ));
    config
}

/// Refused modules remembered at most (a directory full of distinct bad files cannot grow the
/// memo without bound; one is forgotten for each new one, and compiled again if it comes back).
const REFUSED_REMEMBERED: usize = 256;

impl WasmEngine {
    /// Creates the engine with default options (pooling when possible, no module cache).
    pub fn new() -> Result<WasmEngine, LoadError> {
        WasmEngine::with_options(&EngineOptions::default())
    }

    /// Creates the engine, the linker (WASI p2 plus the provisioner host API) and the ticker.
    pub fn with_options(options: &EngineOptions) -> Result<WasmEngine, LoadError> {
        let engine_err = |e: wasmtime::Error| LoadError::Engine(format!("{e:#}"));
        // Creating a pooling engine reserves the pool's address space, so it is its own probe:
        // on machines with a small address space (or a ulimit) it fails and we fall back.
        let (engine, pooled) = match options.pooling {
            Pooling::Off => (Engine::new(&base_config()).map_err(engine_err)?, false),
            Pooling::On => (Engine::new(&pooling_config()).map_err(engine_err)?, true),
            Pooling::Auto => match Engine::new(&pooling_config()) {
                Ok(engine) => (engine, true),
                Err(error) => {
                    tracing::info!(error = %format!("{error:#}"), "pooling allocator unavailable; allocating instances on demand");
                    (Engine::new(&base_config()).map_err(engine_err)?, false)
                }
            },
        };
        let cache = options
            .module_cache
            .as_deref()
            .map(|dir| ModuleCache::open(dir, &engine).map(Arc::new))
            .transpose()?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| LoadError::Engine(e.to_string()))?;
        // The guest's filesystem goes through the guard (links, special files, descriptors).
        super::sandbox_fs::add_to_linker(&mut linker, GuestState::sandbox_fs)
            .map_err(|e| LoadError::Engine(e.to_string()))?;
        ProvisionerFull::add_to_linker::<_, wasmtime::component::HasSelf<_>>(&mut linker, |s| s)
            .map_err(|e| LoadError::Engine(e.to_string()))?;
        let weak = engine.weak();
        std::thread::Builder::new()
            .name("wasm-epoch".into())
            .spawn(move || {
                while let Some(engine) = weak.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    std::thread::sleep(EPOCH_TICK);
                }
            })
            .map_err(|e| LoadError::Engine(e.to_string()))?;
        let executor = options
            .executor
            .map(GuestExecutor::new)
            .transpose()
            .map_err(|e| LoadError::Engine(format!("cannot start the guest threads: {e}")))?;
        Ok(WasmEngine {
            engine,
            linker: Arc::new(linker),
            metrics: None,
            pool_slots: pooled.then(|| Arc::new(Semaphore::new(POOL_CORE_INSTANCES as usize))),
            pool_ledger: Arc::default(),
            cache,
            executor,
            compiler: options.compiler.clone(),
            refused: Arc::default(),
            node_filesystems: Arc::new(NodeFilesystems::probe(Path::new(DEFAULT_KUBELET_DIR))),
        })
    }

    /// Whether instances come from the pooling allocator.
    pub fn pooling(&self) -> bool {
        self.pool_slots.is_some()
    }

    /// The compiled-module cache, when one is configured.
    pub fn module_cache(&self) -> Option<&ModuleCache> {
        self.cache.as_deref()
    }

    /// Guests loaded from now on record their calls in `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> WasmEngine {
        self.metrics = Some(metrics);
        self
    }

    /// Guests loaded from now on are checked against these filesystems of the node (by
    /// default `/`, `/var/lib/kubelet` and the runtimes', as this process sees them).
    pub fn with_node_filesystems(mut self, node: NodeFilesystems) -> WasmEngine {
        self.node_filesystems = Arc::new(node);
        self
    }

    /// The underlying wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Compiles a component file without linking it (for `inspect`).
    pub fn compile(&self, path: &Path) -> Result<(Component, String), LoadError> {
        let bytes = read_module(path)?;
        self.compile_bytes(&path.display().to_string(), &bytes)
    }

    /// Compiles component bytes read from `display`, through the module cache when there is one
    /// (a fresh compile is not stored: [`WasmEngine::load_compiled`] stores what links).
    pub fn compile_bytes(
        &self,
        display: &str,
        bytes: &[u8],
    ) -> Result<(Component, String), LoadError> {
        let (sha256, cached) = self.compiled_before(display, bytes)?;
        match cached {
            Some(component) => Ok((component, sha256)),
            None => Ok((self.compile_now(display, bytes, &sha256)?, sha256)),
        }
    }

    /// What is known of these bytes without compiling them: their SHA-256 and the cached
    /// component when the module cache has one; an error when they are refused without trying
    /// (too large, precompiled, refused before: in this process, or by a record in the module
    /// cache). Cheap: reads at most one cache entry.
    pub fn compiled_before(
        &self,
        display: &str,
        bytes: &[u8],
    ) -> Result<(String, Option<Component>), LoadError> {
        let sha256 = self.admit(display, bytes)?;
        let cached = self.known(display, &sha256)?;
        Ok((sha256, cached))
    }

    /// The SHA-256 of bytes that may be compiled at all; an error for bytes refused on sight
    /// (too large, or a precompiled artifact, which from a plugins directory would be native
    /// code).
    pub fn admit(&self, display: &str, bytes: &[u8]) -> Result<String, LoadError> {
        if bytes.len() > MAX_MODULE_BYTES {
            return Err(LoadError::Compile {
                path: display.to_string(),
                message: format!(
                    "it is {} bytes, more than the {MAX_MODULE_BYTES} a guest may be",
                    bytes.len()
                ),
            });
        }
        if Engine::detect_precompiled(bytes).is_some() {
            return Err(LoadError::Precompiled {
                path: display.to_string(),
            });
        }
        Ok(hex::encode(Sha256::digest(bytes)))
    }

    /// The cached component of the module with SHA-256 `sha256`, if any; an error when it was
    /// refused before (in this process, or by a record in the module cache).
    pub fn known(&self, display: &str, sha256: &str) -> Result<Option<Component>, LoadError> {
        if let Some(message) = self.refused_before(sha256) {
            return Err(LoadError::RefusedBefore {
                path: display.to_string(),
                message,
            });
        }
        Ok(self
            .cache
            .as_ref()
            .and_then(|c| c.get(&self.engine, sha256)))
    }

    /// Compiles `bytes` (SHA-256 `sha256`): in the compiler child when there is one, else here.
    /// A refusal is remembered, and recorded in the module cache when the same bytes under the
    /// same limits would be refused again.
    pub fn compile_now(
        &self,
        display: &str,
        bytes: &[u8],
        sha256: &str,
    ) -> Result<Component, LoadError> {
        let compiled = match &self.compiler {
            None => Component::new(&self.engine, bytes).map_err(|e| (format!("{e:#}"), true)),
            Some(limits) => compile_in_child(limits, bytes)
                .map_err(|e| (e.to_string(), e.is_lasting()))
                .and_then(|artifact| {
                    super::cache::deserialize(&self.engine, &artifact)
                        .map_err(|e| (format!("{e:#}"), false))
                }),
        };
        compiled.map_err(|(message, lasting)| {
            let error = LoadError::Compile {
                path: display.to_string(),
                message,
            };
            self.remember_refused(sha256, &error, lasting);
            error
        })
    }

    /// What refusals depend on besides the bytes and the engine: this binary and the limits.
    fn compile_key(&self) -> String {
        match &self.compiler {
            Some(limits) => limits.key(),
            None => format!("in-process-{}", env!("CARGO_PKG_VERSION")),
        }
    }

    fn refused_before(&self, sha256: &str) -> Option<String> {
        let remembered = {
            let refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
            refused.get(sha256).cloned()
        };
        remembered.or_else(|| {
            let reason = self.cache.as_ref()?.refusal(sha256, &self.compile_key())?;
            self.remember_in_memory(sha256, reason.clone());
            Some(reason)
        })
    }

    /// Remembers a refusal in this process and, when `lasting`, in the module cache.
    fn remember_refused(&self, sha256: &str, why: &LoadError, lasting: bool) {
        let reason: String = why.to_string().chars().take(1024).collect();
        if lasting && let Some(cache) = &self.cache {
            cache.put_refusal(sha256, &self.compile_key(), &reason);
        }
        self.remember_in_memory(sha256, reason);
    }

    fn remember_in_memory(&self, sha256: &str, reason: String) {
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        if refused.len() >= REFUSED_REMEMBERED
            && let Some(oldest) = refused.keys().next().cloned()
        {
            refused.remove(&oldest);
        }
        refused.insert(sha256.to_owned(), reason);
    }

    /// A guest loaded despite `warning` about its grant: logged with its file, counted by
    /// `label` (`wasm_provisioner_plugin_warnings_total`).
    pub fn plugin_warning(&self, name: &str, file: &str, warning: &str, label: &'static str) {
        tracing::warn!(guest = name, file, "{warning}");
        if let Some(metrics) = &self.metrics {
            metrics.plugin_warning(name, label);
        }
    }

    /// Compiles, checks the contract and links a guest, ready to be called.
    pub fn load(&self, name: &str, path: &Path, grants: Grants) -> Result<Guest, LoadError> {
        let bytes = read_module(path)?;
        self.load_bytes(name, &path.display().to_string(), &bytes, grants)
    }

    /// [`WasmEngine::load`] for bytes already read from `display`.
    pub fn load_bytes(
        &self,
        name: &str,
        display: &str,
        bytes: &[u8],
        grants: Grants,
    ) -> Result<Guest, LoadError> {
        let (sha256, cached) = self.compiled_before(display, bytes)?;
        // Before compiling: bytes the operator did not pin cost nothing to refuse.
        check_pin(display, &grants, &sha256)?;
        let fresh = cached.is_none();
        let component = match cached {
            Some(component) => component,
            None => self.compile_now(display, bytes, &sha256)?,
        };
        self.load_compiled(name, display, component, &sha256, fresh, grants)
    }

    /// Checks the contract of a compiled component, links it and reserves its share of the
    /// pool: the guest, ready to be called. A `fresh` compile (not from the module cache) that
    /// links is stored in the cache; one that does not is never stored (its refusal is).
    pub fn load_compiled(
        &self,
        name: &str,
        display: &str,
        component: Component,
        sha256: &str,
        fresh: bool,
        grants: Grants,
    ) -> Result<Guest, LoadError> {
        // Every load ends here, whichever way it compiled. Not remembered as a refusal of the
        // bytes: the pin is the grant's, and a new grant may pin these very bytes.
        check_pin(display, &grants, sha256)?;
        let display = display.to_string();
        // What decides from here on is the bytes alone: a refusal holds until they change.
        let mut guest = self
            .link(name, &display, component, sha256, grants)
            .inspect_err(|error| self.remember_refused(sha256, error, true))?;
        if fresh && let Some(cache) = &self.cache {
            cache.put(sha256, guest.pre.component());
        }
        // The pool depends on the grant and the other guests, not on the bytes: not remembered.
        if self.pool_slots.is_some() {
            let reservation =
                self.pool_ledger
                    .reserve(name, guest.grants.max_concurrency, guest.pool_units)?;
            guest.pool_reservation = Some(Arc::new(reservation));
        }
        // Loud, not refused: the operator may know the disk is sized for it.
        for warning in self.node_filesystems.warnings(&guest.grants) {
            self.plugin_warning(name, &display, &warning, super::nodefs::WARNING_LABEL);
        }
        Ok(guest)
    }

    /// Checks the contract of a compiled guest and links it.
    fn link(
        &self,
        name: &str,
        display: &str,
        component: Component,
        sha256: &str,
        grants: Grants,
    ) -> Result<Guest, LoadError> {
        let display = display.to_string();
        let contract = ContractInfo::of(&self.engine, &component);
        contract.check().map_err(|source| LoadError::Contract {
            path: display.clone(),
            source,
        })?;
        let link_err = |e: wasmtime::Error| LoadError::Link {
            path: display.clone(),
            message: format!("{e:#}"),
        };
        let pre = self.linker.instantiate_pre(&component).map_err(link_err)?;
        let lifecycle = lifecycle::GuestIndices::new(&pre).map_err(link_err)?;
        let qualifier = contract
            .hooks
            .contains(&Hook::Qualifier)
            .then(|| qualifier::GuestIndices::new(&pre))
            .transpose()
            .map_err(link_err)?;
        let deletion_guard = contract
            .hooks
            .contains(&Hook::DeletionGuard)
            .then(|| deletion_guard::GuestIndices::new(&pre))
            .transpose()
            .map_err(link_err)?;
        let block_support = contract
            .hooks
            .contains(&Hook::BlockSupport)
            .then(|| block_support::GuestIndices::new(&pre))
            .transpose()
            .map_err(link_err)?;
        let cloning = contract
            .hooks
            .contains(&Hook::Cloning)
            .then(|| cloning::GuestIndices::new(&pre))
            .transpose()
            .map_err(link_err)?;
        let expansion = contract
            .hooks
            .contains(&Hook::Expansion)
            .then(|| expansion::GuestIndices::new(&pre))
            .transpose()
            .map_err(link_err)?;
        let capabilities = super::capabilities::find_hook(&component, &contract.exports)
            .map_err(|e| link_err(e.into()))?;
        Ok(Guest {
            lingering: Default::default(),
            clock: None,
            name: name.into(),
            pool_slots: self.pool_slots.clone(),
            pool_units: pool_units(grants.instances, grants.memories),
            pool_reservation: None,
            semaphore: Arc::new(Semaphore::new(grants.max_concurrency)),
            claim_semaphore: Arc::new(Semaphore::new(claim_slots(grants.max_concurrency))),
            grants: Arc::new(grants),
            sha256: sha256.into(),
            contract: Arc::new(contract),
            pre,
            lifecycle,
            qualifier,
            deletion_guard,
            block_support,
            cloning,
            expansion,
            capabilities,
            metrics: self.metrics.clone(),
            executor: self.executor.clone(),
        })
    }
}

/// Reads a module, at most [`MAX_MODULE_BYTES`] and one (so a larger one is refused as such).
pub fn read_module(path: &Path) -> Result<Vec<u8>, LoadError> {
    use std::io::Read;
    let read_err = |source| LoadError::Read {
        path: path.display().to_string(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| {
            file.take(MAX_MODULE_BYTES as u64 + 1)
                .read_to_end(&mut bytes)
        })
        .map_err(read_err)?;
    Ok(bytes)
}

/// Refuses a module whose SHA-256 is not the one its grant pins.
pub fn check_pin(display: &str, grants: &Grants, sha256: &str) -> Result<(), LoadError> {
    grants
        .module
        .check(sha256)
        .map_err(|source| LoadError::Pin {
            path: display.to_owned(),
            source,
        })
}
