//! The wasm engine and loaded guests: compile once, a fresh bounded instance per call.
//!
//! Each call gets its own `Store` with the guest's grants (preopens only, no network, no
//! environment), a memory cap, an epoch deadline measured against the wall clock, and an async
//! timeout around the whole call so time spent in host functions counts too. A trap is a
//! [`CallError::Fault`], distinct from the typed errors the guest returns on purpose.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use wasmtime::component::{Component, InstancePre, Linker};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap,
    UpdateDeadline,
};
use wasmtime_wasi::{FsPerms, WasiCtx};

use super::bindings::types::{
    Claim, DeleteRequest, ProvisionError, ProvisionRequest, StorageClass, Volume,
};
use super::bindings::{ProvisionerFull, block_support, deletion_guard, lifecycle, qualifier};
use super::cache::{CacheError, ModuleCache};
use super::contract::{ContractError, ContractInfo, Hook};
use super::executor::{ExecutorOptions, GuestExecutor};
use super::grants::{DirAccess, Grants};
use super::host::GuestState;
use super::output::BoundedOutput;
use super::spec::BuiltVolume;
use crate::metrics::Metrics;

/// How often the epoch ticks; deadlines are checked against the wall clock on each tick.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Concurrent instances the pooling allocator is sized for (all guests together); calls beyond
/// it wait for a slot rather than fail to instantiate.
pub const POOL_INSTANCES: u32 = 128;
/// Extra time the async timeout allows over the epoch deadline before dropping the call.
const ASYNC_TIMEOUT_MARGIN: Duration = Duration::from_millis(500);

/// Why a module could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The module file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A precompiled artifact was offered; loading one would run unverified native code.
    #[error("{path} is a precompiled wasmtime artifact; only .wasm components are accepted")]
    Precompiled {
        /// The module file.
        path: String,
    },
    /// Not a valid component, or compilation failed.
    #[error("{path} does not compile as a WebAssembly component: {message}")]
    Compile {
        /// The module file.
        path: String,
        /// wasmtime's message.
        message: String,
    },
    /// The component does not implement a contract version this host serves.
    #[error("{path}: {source}")]
    Contract {
        /// The module file.
        path: String,
        /// What is wrong with its contract.
        #[source]
        source: ContractError,
    },
    /// Imports this host does not provide (for example networking).
    #[error("{path} cannot be linked: {message}")]
    Link {
        /// The module file.
        path: String,
        /// wasmtime's message.
        message: String,
    },
    /// The engine could not be created.
    #[error("cannot create the wasm engine: {0}")]
    Engine(String),
    /// The module cache directory cannot be used.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// A fault: the guest did not return normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The call ran past its deadline.
    Deadline,
    /// The guest tried to grow memory past its cap.
    Memory,
    /// The guest panicked.
    Panic,
    /// The guest overflowed its stack.
    StackOverflow,
    /// Any other trap (`unreachable`, bad memory access, ...).
    Trap,
    /// The host refused something the guest did (too many specs, bad resource handle, ...).
    Host,
}

impl FaultKind {
    /// Short name used in events, logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Deadline => "deadline",
            FaultKind::Memory => "memory",
            FaultKind::Panic => "panic",
            FaultKind::StackOverflow => "stack-overflow",
            FaultKind::Trap => "trap",
            FaultKind::Host => "host",
        }
    }
}

/// Why a call into a guest did not produce a result.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The guest returned one of the contract's typed errors.
    #[error("guest {guest} returned {}", describe_guest_error(.error))]
    Guest {
        /// The guest's name.
        guest: String,
        /// The typed error.
        error: ProvisionError,
    },
    /// The guest returned a volume that breaks its grants or Kubernetes' rules.
    #[error("guest {guest} returned a volume the host refused: {message}")]
    Rejected {
        /// The guest's name.
        guest: String,
        /// Why.
        message: String,
    },
    /// The guest trapped, ran out of time or memory.
    #[error("guest {guest} failed ({}): {message}", .kind.as_str())]
    Fault {
        /// The guest's name.
        guest: String,
        /// What kind of fault.
        kind: FaultKind,
        /// Details, including captured stderr when there is any.
        message: String,
    },
}

fn describe_guest_error(error: &ProvisionError) -> String {
    match error {
        ProvisionError::Final(m) => format!("a final error: {m}"),
        ProvisionError::Transient(m) => format!("a transient error: {m}"),
        ProvisionError::Ignored(m) => format!("ignored: {m}"),
        ProvisionError::Reschedule(m) => format!("reschedule: {m}"),
        ProvisionError::InBackground(m) => format!("in background: {m}"),
    }
}

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
}

/// One engine and linker for all guests, with the epoch ticker that drives deadlines.
#[derive(Clone)]
pub struct WasmEngine {
    engine: Engine,
    linker: Arc<Linker<GuestState>>,
    metrics: Option<Metrics>,
    /// Instance slots when pooling: every call holds one, so the pool is never exhausted.
    pool_slots: Option<Arc<Semaphore>>,
    cache: Option<Arc<ModuleCache>>,
    executor: Option<GuestExecutor>,
}

fn base_config() -> Config {
    let mut config = Config::new();
    config.epoch_interruption(true);
    config.wasm_component_model(true);
    // Guests recursing without bound hit this, not the host's stack.
    config.max_wasm_stack(1 << 20);
    config
}

/// The pool: memories up to the largest grant (4 GiB; each guest's own cap is enforced by its
/// limiter), room for [`POOL_INSTANCES`] component instances, pages returned to the OS on reuse.
fn pooling_config() -> Config {
    let mut pool = PoolingAllocationConfig::new();
    pool.total_component_instances(POOL_INSTANCES)
        .total_core_instances(POOL_INSTANCES * 8)
        .total_memories(POOL_INSTANCES * 2)
        .total_tables(POOL_INSTANCES * 8)
        .total_stacks(POOL_INSTANCES)
        .max_memory_size(4 << 30)
        .table_elements(super::grants::DEFAULT_TABLE_ELEMENTS)
        .linear_memory_keep_resident(0)
        .table_keep_resident(0);
    let mut config = base_config();
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    config
}

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
            pool_slots: pooled.then(|| Arc::new(Semaphore::new(POOL_INSTANCES as usize))),
            cache,
            executor,
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

    /// The underlying wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Compiles a component file without linking it (for `inspect`).
    pub fn compile(&self, path: &Path) -> Result<(Component, String), LoadError> {
        let bytes = read_module(path)?;
        self.compile_bytes(&path.display().to_string(), &bytes)
    }

    /// Compiles component bytes read from `display`, through the module cache when there is one.
    /// Precompiled artifacts are refused: from a plugins directory they would be native code.
    pub fn compile_bytes(
        &self,
        display: &str,
        bytes: &[u8],
    ) -> Result<(Component, String), LoadError> {
        if Engine::detect_precompiled(bytes).is_some() {
            return Err(LoadError::Precompiled {
                path: display.to_string(),
            });
        }
        let sha256 = hex::encode(Sha256::digest(bytes));
        if let Some(component) = self
            .cache
            .as_ref()
            .and_then(|c| c.get(&self.engine, &sha256))
        {
            return Ok((component, sha256));
        }
        let component = Component::new(&self.engine, bytes).map_err(|e| LoadError::Compile {
            path: display.to_string(),
            message: format!("{e:#}"),
        })?;
        if let Some(cache) = &self.cache {
            cache.put(&sha256, &component);
        }
        Ok((component, sha256))
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
        let display = display.to_string();
        let (component, sha256) = self.compile_bytes(&display, bytes)?;
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
        Ok(Guest {
            name: name.into(),
            pool_slots: self.pool_slots.clone(),
            semaphore: Arc::new(Semaphore::new(grants.max_concurrency)),
            grants: Arc::new(grants),
            sha256: sha256.into(),
            contract: Arc::new(contract),
            pre,
            lifecycle,
            qualifier,
            deletion_guard,
            block_support,
            metrics: self.metrics.clone(),
            executor: self.executor.clone(),
        })
    }
}

fn read_module(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// A compiled, linked guest with its grants. Cheap to clone; every call is independent.
#[derive(Clone)]
pub struct Guest {
    name: Arc<str>,
    grants: Arc<Grants>,
    sha256: Arc<str>,
    contract: Arc<ContractInfo>,
    semaphore: Arc<Semaphore>,
    pool_slots: Option<Arc<Semaphore>>,
    pre: InstancePre<GuestState>,
    lifecycle: lifecycle::GuestIndices,
    qualifier: Option<qualifier::GuestIndices>,
    deletion_guard: Option<deletion_guard::GuestIndices>,
    block_support: Option<block_support::GuestIndices>,
    metrics: Option<Metrics>,
    executor: Option<GuestExecutor>,
}

/// Captured guest output of one call.
struct Output {
    stdout: BoundedOutput,
    stderr: BoundedOutput,
}

impl Guest {
    /// The guest's name (its file stem).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its grants.
    pub fn grants(&self) -> &Grants {
        &self.grants
    }

    /// The SHA-256 of its `.wasm`.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// What it implements.
    pub fn contract(&self) -> &ContractInfo {
        &self.contract
    }

    /// Whether every concurrency slot is taken: a caller that should not wait in line (a
    /// reconcile worker shared with other guests) can come back later instead.
    pub fn at_capacity(&self) -> bool {
        self.semaphore.available_permits() == 0
    }

    fn new_store(&self, deadline: Instant) -> Result<(Store<GuestState>, Output), CallError> {
        let stdout = BoundedOutput::new(self.grants.output_bytes);
        let stderr = BoundedOutput::new(self.grants.output_bytes);
        let mut wasi = WasiCtx::builder();
        wasi.stdout(stdout.clone()).stderr(stderr.clone());
        for dir in &self.grants.dirs {
            let perms = match dir.access {
                DirAccess::ReadOnly => FsPerms::ReadOnly,
                DirAccess::ReadWrite => FsPerms::ReadWrite,
            };
            wasi.preopened_dir(&dir.host, &dir.guest, perms)
                .map_err(|e| {
                    self.fault(
                        FaultKind::Host,
                        format!("cannot open granted directory {}: {e}", dir.host.display()),
                    )
                })?;
        }
        let state = GuestState::new(self.name.clone(), self.grants.clone(), wasi.build());
        let mut store = Store::new(self.pre.engine(), state);
        store.limiter(|s| &mut s.limiter);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            // Compare with the wall clock rather than counting ticks, so a burst of late
            // ticks on a loaded machine cannot end a call early.
            if Instant::now() >= deadline {
                Ok(UpdateDeadline::Interrupt)
            } else {
                Ok(UpdateDeadline::Yield(1))
            }
        });
        Ok((store, Output { stdout, stderr }))
    }

    fn fault(&self, kind: FaultKind, message: String) -> CallError {
        CallError::Fault {
            guest: self.name.to_string(),
            kind,
            message,
        }
    }

    /// Waits for a concurrency slot and prepares a fresh store under the guest's limits.
    async fn begin(&self) -> Result<CallScope<'_>, CallError> {
        let permit = self
            .semaphore
            .acquire()
            .await
            .expect("guest semaphore is never closed");
        let pool_slot = match &self.pool_slots {
            Some(slots) => Some(
                slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("pool semaphore is never closed"),
            ),
            None => None,
        };
        let timeout = self.grants.call_timeout;
        let (store, output) = self.new_store(Instant::now() + timeout)?;
        Ok(CallScope {
            guest: self,
            started: Instant::now(),
            _permit: permit,
            _pool_slot: pool_slot,
            store,
            output,
            timeout,
        })
    }

    fn classify(
        &self,
        operation: &str,
        error: wasmtime::Error,
        store: &Store<GuestState>,
        output: &Output,
        timeout: Duration,
    ) -> CallError {
        let stderr = output.stderr.contents().text;
        let trap = error.downcast_ref::<Trap>().copied();
        let limiter = &store.data().limiter;
        let kind = if trap == Some(Trap::Interrupt) {
            FaultKind::Deadline
        } else if limiter.memory_hit || limiter.table_hit {
            FaultKind::Memory
        } else if stderr.contains("panicked at") {
            FaultKind::Panic
        } else if trap == Some(Trap::StackOverflow) {
            FaultKind::StackOverflow
        } else if trap.is_some() {
            FaultKind::Trap
        } else {
            FaultKind::Host
        };
        let mut message = match kind {
            FaultKind::Deadline => format!("{operation} exceeded its deadline of {timeout:?}"),
            FaultKind::Memory if limiter.table_hit && !limiter.memory_hit => format!(
                "{operation} exceeded its table cap of {} elements",
                self.grants.table_elements
            ),
            FaultKind::Memory => format!(
                "{operation} exceeded its memory cap of {} MiB",
                self.grants.memory_bytes / (1024 * 1024)
            ),
            // The trap (or the host's refusal) says what happened; the wasm backtrace is for
            // the debug log, not for a Kubernetes event.
            _ => {
                tracing::debug!(guest = %self.name, operation, error = %format!("{error:?}"), "guest fault");
                match trap {
                    Some(trap) => format!("{operation}: {trap}"),
                    None => format!("{operation}: {}", error.root_cause()),
                }
            }
        };
        let stderr = stderr.trim();
        if !stderr.is_empty() {
            let tail: String = stderr
                .chars()
                .rev()
                .take(1024)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            message.push_str(&format!("; stderr: {tail}"));
        }
        self.fault(kind, message)
    }

    fn log_output(&self, operation: &str, output: &Output, store: &Store<GuestState>) {
        for (stream, pipe) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
            let contents = pipe.contents();
            for line in contents.text.lines().take(200) {
                tracing::info!(target: "guest", guest = %self.name, operation, stream, "{line}");
            }
            if contents.dropped > 0 {
                tracing::warn!(guest = %self.name, operation, stream, dropped_bytes = contents.dropped, kept_bytes = self.grants.output_bytes, "guest output over its bound; the middle was dropped");
            }
        }
        let dropped = store.data().logs_dropped;
        if dropped > 0 {
            tracing::warn!(guest = %self.name, operation, dropped_messages = dropped, budget_bytes = self.grants.log_bytes, "guest log messages over the per-call budget were dropped");
        }
    }

    /// [`Guest::provision`] on the current runtime.
    async fn provision_here(&self, request: &ProvisionRequest) -> Result<BuiltVolume, CallError> {
        let mut scope = self.begin().await?;
        let store = &mut scope.store;
        let outcome = tokio::time::timeout(scope.timeout + ASYNC_TIMEOUT_MARGIN, async {
            let instance = self.pre.instantiate_async(&mut *store).await?;
            let exports = self.lifecycle.load(&mut *store, &instance)?;
            match exports.call_provision(&mut *store, request).await? {
                Ok(spec) => Ok(Ok(store.data_mut().take_spec(spec)?)),
                Err(e) => Ok(Err(e)),
            }
        })
        .await;
        let result = scope.finish("provision", outcome)?;
        let spec = result.map_err(|error| CallError::Guest {
            guest: self.name.to_string(),
            error,
        })?;
        spec.finish(&self.grants).map_err(|e| CallError::Rejected {
            guest: self.name.to_string(),
            message: super::describe_spec_error(&e),
        })
    }

    /// [`Guest::delete`] on the current runtime.
    async fn delete_here(&self, request: &DeleteRequest) -> Result<(), CallError> {
        let mut scope = self.begin().await?;
        let store = &mut scope.store;
        let outcome = tokio::time::timeout(scope.timeout + ASYNC_TIMEOUT_MARGIN, async {
            let instance = self.pre.instantiate_async(&mut *store).await?;
            let exports = self.lifecycle.load(&mut *store, &instance)?;
            exports.call_delete(&mut *store, request).await
        })
        .await;
        let result = scope.finish("delete", outcome)?;
        result.map_err(|error| CallError::Guest {
            guest: self.name.to_string(),
            error,
        })
    }

    /// [`Guest::should_provision`] on the current runtime.
    async fn should_provision_here(
        &self,
        claim: &Claim,
        class: &StorageClass,
    ) -> Result<bool, CallError> {
        let Some(indices) = &self.qualifier else {
            return Ok(true);
        };
        let mut scope = self.begin().await?;
        let store = &mut scope.store;
        let outcome = tokio::time::timeout(scope.timeout + ASYNC_TIMEOUT_MARGIN, async {
            let instance = self.pre.instantiate_async(&mut *store).await?;
            let exports = indices.load(&mut *store, &instance)?;
            exports
                .call_should_provision(&mut *store, claim, class)
                .await
        })
        .await;
        scope.finish("should-provision", outcome)
    }

    /// [`Guest::should_delete`] on the current runtime.
    async fn should_delete_here(&self, volume: &Volume) -> Result<bool, CallError> {
        let Some(indices) = &self.deletion_guard else {
            return Ok(true);
        };
        let mut scope = self.begin().await?;
        let store = &mut scope.store;
        let outcome = tokio::time::timeout(scope.timeout + ASYNC_TIMEOUT_MARGIN, async {
            let instance = self.pre.instantiate_async(&mut *store).await?;
            let exports = indices.load(&mut *store, &instance)?;
            exports.call_should_delete(&mut *store, volume).await
        })
        .await;
        scope.finish("should-delete", outcome)
    }

    /// [`Guest::supports_block`] on the current runtime.
    async fn supports_block_here(&self) -> Result<bool, CallError> {
        let Some(indices) = &self.block_support else {
            return Ok(false);
        };
        let mut scope = self.begin().await?;
        let store = &mut scope.store;
        let outcome = tokio::time::timeout(scope.timeout + ASYNC_TIMEOUT_MARGIN, async {
            let instance = self.pre.instantiate_async(&mut *store).await?;
            let exports = indices.load(&mut *store, &instance)?;
            exports.call_supports_block(&mut *store).await
        })
        .await;
        scope.finish("supports-block", outcome)
    }
}

impl Guest {
    /// Calls `provision` and validates the returned spec against the grants.
    pub async fn provision(&self, request: &ProvisionRequest) -> Result<BuiltVolume, CallError> {
        let request = request.clone();
        self.dispatch(|guest| async move { guest.provision_here(&request).await })
            .await
    }

    /// Calls `delete`.
    pub async fn delete(&self, request: &DeleteRequest) -> Result<(), CallError> {
        let request = request.clone();
        self.dispatch(|guest| async move { guest.delete_here(&request).await })
            .await
    }

    /// The `qualifier` hook; `true` when the guest does not implement it.
    pub async fn should_provision(
        &self,
        claim: &Claim,
        class: &StorageClass,
    ) -> Result<bool, CallError> {
        let (claim, class) = (claim.clone(), class.clone());
        self.dispatch(|guest| async move { guest.should_provision_here(&claim, &class).await })
            .await
    }

    /// The `deletion-guard` hook; `true` when the guest does not implement it.
    pub async fn should_delete(&self, volume: &Volume) -> Result<bool, CallError> {
        let volume = volume.clone();
        self.dispatch(|guest| async move { guest.should_delete_here(&volume).await })
            .await
    }

    /// The `block-support` hook; `false` when the guest does not implement it.
    pub async fn supports_block(&self) -> Result<bool, CallError> {
        self.dispatch(|guest| async move { guest.supports_block_here().await })
            .await
    }

    /// Runs a call on the guest executor when there is one, else right here.
    async fn dispatch<R, F>(&self, call: impl FnOnce(Guest) -> F) -> Result<R, CallError>
    where
        F: std::future::Future<Output = Result<R, CallError>> + Send + 'static,
        R: Send + 'static,
    {
        let Some(executor) = &self.executor else {
            return call(self.clone()).await;
        };
        match executor.run(call(self.clone())).await {
            Ok(result) => result,
            Err(error) => Err(self.fault(
                FaultKind::Host,
                format!("the call ended without a result: {error}"),
            )),
        }
    }
}

/// One call in progress: the concurrency slot, the fresh store and its captured output.
struct CallScope<'g> {
    guest: &'g Guest,
    started: Instant,
    _permit: tokio::sync::SemaphorePermit<'g>,
    _pool_slot: Option<OwnedSemaphorePermit>,
    store: Store<GuestState>,
    output: Output,
    timeout: Duration,
}

impl CallScope<'_> {
    /// Logs the guest's output, turns the outcome into a result (classifying faults) and
    /// records the call in the guest metrics: the one place every guest call passes.
    fn finish<R: CallOutcome>(
        self,
        operation: &'static str,
        outcome: Result<wasmtime::Result<R>, tokio::time::error::Elapsed>,
    ) -> Result<R, CallError> {
        let guest = self.guest;
        guest.log_output(operation, &self.output, &self.store);
        let result = self.classify_outcome(operation, outcome);
        if let Some(metrics) = &guest.metrics {
            let (label, fault) = match &result {
                Ok(value) => (value.label(), false),
                Err(CallError::Fault { kind, .. }) => (kind.as_str(), true),
                Err(CallError::Rejected { .. }) => ("rejected", false),
                Err(CallError::Guest { error, .. }) => (error_label(error), false),
            };
            metrics.guest_call(
                guest.name(),
                operation,
                label,
                fault,
                self.started.elapsed(),
            );
        }
        result
    }

    fn classify_outcome<R>(
        &self,
        operation: &'static str,
        outcome: Result<wasmtime::Result<R>, tokio::time::error::Elapsed>,
    ) -> Result<R, CallError> {
        let guest = self.guest;
        match outcome {
            Err(_) => Err(guest.fault(
                FaultKind::Deadline,
                format!(
                    "{operation} did not finish within {:?} (blocked in a host call)",
                    self.timeout
                ),
            )),
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => {
                Err(guest.classify(operation, error, &self.store, &self.output, self.timeout))
            }
        }
    }
}

/// What a returned value says about the call, for the `outcome` metric label.
trait CallOutcome {
    fn label(&self) -> &'static str;
}

impl CallOutcome for bool {
    fn label(&self) -> &'static str {
        "ok"
    }
}

impl CallOutcome for () {
    fn label(&self) -> &'static str {
        "ok"
    }
}

impl<T> CallOutcome for Result<T, ProvisionError> {
    fn label(&self) -> &'static str {
        match self {
            Ok(_) => "ok",
            Err(error) => error_label(error),
        }
    }
}

/// The metric label of a typed guest error.
fn error_label(error: &ProvisionError) -> &'static str {
    match error {
        ProvisionError::Final(_) => "final",
        ProvisionError::Transient(_) => "transient",
        ProvisionError::Ignored(_) => "ignored",
        ProvisionError::Reschedule(_) => "reschedule",
        ProvisionError::InBackground(_) => "in-background",
    }
}

/// The hooks a guest implements, for display.
pub fn hook_names(hooks: &BTreeSet<Hook>) -> Vec<&'static str> {
    hooks.iter().map(|h| h.as_str()).collect()
}
