//! A loaded guest and the one call path every export takes (the call's parts that need no
//! guest, its exports, store and outcome, are in [`super::call`]).
//!
//! ```text
//! provision / delete / should-provision / should-delete / supported (capabilities) / supports-block
//!   ─▶ dispatch: a thread of its own, the caller waiting against the call's clock
//!      ─▶ Guest::call::<Export>
//!        slot (guest, pool; refused when stuck calls hold every slot)
//!        ─▶ fresh Store: grants, limiter, fs guard, fuel, epoch deadline ─▶ clock started
//!        ─▶ timeout( instantiate ─▶ Export::invoke ) ─▶ clock stopped (given up on? a fault)
//!        ─▶ finish: log output, classify, metrics
//! provision only ─▶ the spec against the grants, the selected node, and the path on disk
//! ```
//!
//! Each call gets its own `Store` with the guest's grants (preopens only, no network, no
//! environment), a memory cap, an epoch deadline measured against the wall clock, and an async
//! timeout around the whole call so time spent in host functions counts too; the caller waits
//! against the same deadline, which holds even while a host function is blocked in the kernel
//! ([`super::call_clock`]). A trap is a [`CallError::Fault`], distinct from the typed errors the
//! guest returns on purpose.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::bindings::cloning::CloneSource;
use super::bindings::types::{
    Claim, DeleteRequest, ProvisionError, ProvisionRequest, StorageClass, Volume, VolumeSource,
};
use super::bindings::{
    VolumeSpecBuilder, block_support, cloning, deletion_guard, expansion, lifecycle, qualifier,
};
use super::call::{
    ASYNC_TIMEOUT_MARGIN, CallOutcome, CallSite, Delete, Export, Output, Provision, ProvisionClone,
    ShouldDelete, ShouldProvision, Supported, SupportsBlock,
};
use super::call_clock::{Abandoned, CallClock};
use super::capabilities::{Capabilities, Capability};
use super::contract::ContractInfo;
use super::errors::{CallError, FaultKind, error_label};
use super::executor::GuestExecutor;
use super::fs_view::FsWork;
use super::grants::{DirAccess, Grants};
use super::handles::Lingering;
use super::host::GuestState;
use super::pool::PoolReservation;
use super::spec::BuiltVolume;
use crate::metrics::Metrics;

/// How many calls of a guest with `max_concurrency` slots may be claims' at once: one fewer
/// (at least one), so that a delete always finds a slot.
pub fn claim_slots(max_concurrency: usize) -> usize {
    max_concurrency.saturating_sub(1).max(1)
}

/// A compiled, linked guest with its grants. Cheap to clone; every call is independent.
#[derive(Clone)]
pub struct Guest {
    pub(super) name: Arc<str>,
    pub(super) grants: Arc<Grants>,
    pub(super) sha256: Arc<str>,
    pub(super) contract: Arc<ContractInfo>,
    pub(super) semaphore: Arc<Semaphore>,
    /// Slots a claim's calls may hold: one fewer than `semaphore`'s, so that a delete always
    /// finds one free however many claims are in flight ([`Guest::claim_slot`]).
    pub(super) claim_semaphore: Arc<Semaphore>,
    pub(super) pool_slots: Option<Arc<Semaphore>>,
    /// Units of the pool each call holds ([`super::pool::pool_units`]).
    pub(super) pool_units: u32,
    /// This guest's share of the pool at its `max-concurrency`, held while it is loaded.
    pub(super) pool_reservation: Option<Arc<PoolReservation>>,
    pub(super) pre: InstancePre<GuestState>,
    pub(super) lifecycle: lifecycle::GuestIndices,
    pub(super) qualifier: Option<qualifier::GuestIndices>,
    pub(super) deletion_guard: Option<deletion_guard::GuestIndices>,
    pub(super) block_support: Option<block_support::GuestIndices>,
    pub(super) cloning: Option<cloning::GuestIndices>,
    pub(super) expansion: Option<expansion::GuestIndices>,
    /// `capabilities.supported`, called by name ([`super::capabilities`]).
    pub(super) capabilities: Option<wasmtime::component::ComponentExportIndex>,
    pub(super) metrics: Option<Metrics>,
    pub(super) executor: Option<GuestExecutor>,
    /// Filesystem operations its ended calls left running, and its calls stuck in the kernel
    /// past their deadline ([`super::handles`]).
    pub(super) lingering: Arc<Lingering>,
    /// The clock of the dispatch this clone runs for, on the clone a dispatch hands to the
    /// executor: its caller keeps the deadline ([`super::call_clock`]).
    pub(super) clock: Option<Arc<CallClock>>,
}

impl Guest {
    /// The guest's name (its file stem).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Filesystem operations its ended calls left running (blocked in the kernel).
    pub fn lingering_operations(&self) -> usize {
        self.lingering.count()
    }

    /// The guest's grants.
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

    /// Waits until a claim's calls may run: at most one fewer than `max-concurrency` claims
    /// call the guest at once (its last slot is a delete's), while many more claims may be in
    /// flight, most of their time spent on API round trips, not in the guest.
    pub async fn claim_slot(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.claim_semaphore
            .acquire()
            .await
            .expect("claim semaphore is never closed")
    }

    /// Whether every concurrency slot is taken: a caller that should not wait in line (a
    /// reconcile worker shared with other guests) can come back later instead.
    /// Not when calls stuck in the kernel hold every slot: the caller's call is then refused
    /// at once with the reason, for its claim's events.
    pub fn at_capacity(&self) -> bool {
        self.semaphore.available_permits() == 0
            && self.lingering.stuck_calls() < self.grants.max_concurrency
    }

    /// Calls `provision` and validates the returned volume: against the grants, against the
    /// claim's selected node, and on disk (no symlink in its path), right before the caller
    /// creates the PV.
    pub async fn provision(&self, request: &ProvisionRequest) -> Result<BuiltVolume, CallError> {
        let request = request.clone();
        self.dispatch(|guest| async move {
            let answer = guest
                .call(Provision {
                    indices: &guest.lifecycle,
                    request: &request,
                })
                .await?;
            guest.validated(answer, &request).await
        })
        .await
    }

    /// Calls `cloning.provision-clone` and validates the returned volume as [`Guest::provision`]
    /// does. A guest without the hook is refused (the caller gates on [`Guest::capabilities`]).
    pub async fn provision_clone(
        &self,
        request: &ProvisionRequest,
        source: &CloneSource,
    ) -> Result<BuiltVolume, CallError> {
        let (request, source) = (request.clone(), source.clone());
        self.dispatch(|guest| async move {
            let Some(indices) = &guest.cloning else {
                return Err(CallError::Refused {
                    guest: guest.name.to_string(),
                    message: "it exports no `cloning` hook".to_owned(),
                });
            };
            let answer = guest
                .call(ProvisionClone {
                    indices,
                    request: &request,
                    source: &source,
                })
                .await?;
            guest.validated(answer, &request).await
        })
        .await
    }

    /// Calls `delete`, once the volume's storage is found within the guest's current grants
    /// ([`Guest::check_held`]): a guest cannot see storage outside them, and would answer
    /// "already gone". The volume's path stops being served first: its storage is going (and
    /// the guest may archive it by renaming it).
    pub async fn delete(&self, request: &DeleteRequest) -> Result<(), CallError> {
        self.check_held(&request.volume)?;
        super::served::served().release(&request.volume.name);
        let request = request.clone();
        self.dispatch(|guest| async move {
            guest
                .call(Delete {
                    indices: &guest.lifecycle,
                    request: &request,
                })
                .await?
                .map_err(|error| CallError::guest(&guest.name, error))
        })
        .await
    }

    /// The `qualifier` hook; `true` when the guest does not implement it.
    pub async fn should_provision(
        &self,
        claim: &Claim,
        class: &StorageClass,
    ) -> Result<bool, CallError> {
        if self.qualifier.is_none() {
            return Ok(true);
        }
        let (claim, class) = (claim.clone(), class.clone());
        self.dispatch(|guest| async move {
            let Some(indices) = &guest.qualifier else {
                return Ok(true);
            };
            let export = ShouldProvision {
                indices,
                claim: &claim,
                class: &class,
            };
            guest.call(export).await
        })
        .await
    }

    /// The `deletion-guard` hook; `true` when the guest does not implement it.
    pub async fn should_delete(&self, volume: &Volume) -> Result<bool, CallError> {
        if self.deletion_guard.is_none() {
            return Ok(true);
        }
        let volume = volume.clone();
        self.dispatch(|guest| async move {
            let Some(indices) = &guest.deletion_guard else {
                return Ok(true);
            };
            guest
                .call(ShouldDelete {
                    indices,
                    volume: &volume,
                })
                .await
        })
        .await
    }

    /// The `block-support` hook; `false` when the guest does not implement it.
    pub async fn supports_block(&self) -> Result<bool, CallError> {
        if self.block_support.is_none() {
            return Ok(false);
        }
        self.dispatch(|guest| async move {
            let Some(indices) = &guest.block_support else {
                return Ok(false);
            };
            guest.call(SupportsBlock(indices)).await
        })
        .await
    }

    /// Refuses a delete whose storage lies outside the guest's grants as they are now
    /// ([`Guest::outside_grants`]). A grant whose directory was moved, or whose `[[dirs]]`
    /// entry was dropped, while volumes lay there would otherwise have every delete answer
    /// "already gone" and leave the data behind.
    fn check_held(&self, volume: &Volume) -> Result<(), CallError> {
        let Some(why) = self.outside_grants(volume) else {
            return Ok(());
        };
        Err(CallError::Refused {
            guest: self.name.to_string(),
            message: format!(
                "delete of volume {}: {why}; was the grant's directory moved or its [[dirs]] entry dropped since it was provisioned? Nothing was deleted and the PV is kept: grant the storage again, or remove it by hand and release the PV (wasm-provisioner release-finalizers)",
                volume.name,
            ),
        })
    }

    /// Why `volume`'s storage lies outside the guest's grants as they are now, if it does: the
    /// check a returned volume passes ([`super::spec::check_source`]: the kind, the path
    /// prefix, the NFS server and export, the CSI driver and handle) and, for a node path the
    /// grant has checked on disk, a read-write granted directory holding it.
    pub(super) fn outside_grants(&self, volume: &Volume) -> Option<String> {
        let why = match super::spec::check_source(&self.grants, &volume.source) {
            Err(error) => super::spec::describe_spec_error(&error),
            Ok(()) => match super::nodepath::node_path(&volume.source) {
                Some(path)
                    if self.grants.volumes.on_disk_check != Some(false)
                        && !self.grants.dirs.iter().any(|dir| {
                            dir.access == DirAccess::ReadWrite
                                && Path::new(path).starts_with(&dir.host)
                        }) =>
                {
                    "it lies in no read-write granted directory".to_owned()
                }
                _ => return None,
            },
        };
        Some(format!(
            "its storage, {}, lies outside the guest's current grants ({why})",
            describe_source(&volume.source)
        ))
    }

    /// What the guest serves beyond a plain claim: its `capabilities` hook, else (a guest built
    /// before that hook) `block` when its `block-support` hook says yes, else nothing; and
    /// clones when it exports the `cloning` hook.
    pub async fn capabilities(&self) -> Result<Capabilities, CallError> {
        let declared = if self.capabilities.is_some() {
            self.dispatch(|guest| async move {
                let Some(index) = &guest.capabilities else {
                    return Ok(Capabilities::NONE);
                };
                guest.call(Supported(index)).await
            })
            .await?
        } else {
            let block = self.supports_block().await?;
            Capabilities::NONE.with_if(Capability::Block, block)
        };
        Ok(declared.with_if(Capability::Clone, self.cloning.is_some()))
    }

    /// A provision answer (plain or clone): the guest's refusal, or its spec validated.
    async fn validated(
        &self,
        answer: Result<VolumeSpecBuilder, ProvisionError>,
        request: &ProvisionRequest,
    ) -> Result<BuiltVolume, CallError> {
        let spec = answer.map_err(|error| CallError::guest(&self.name, error))?;
        self.validate(spec, request).await
    }

    /// The checks a returned volume passes before it may become a PV: the grants, the
    /// selected node, no nesting with another live volume (its path is then recorded as
    /// served, [`super::served`]), and the path on disk.
    async fn validate(
        &self,
        spec: VolumeSpecBuilder,
        request: &ProvisionRequest,
    ) -> Result<BuiltVolume, CallError> {
        let (pv_name, selected_node) = (&request.pv_name, request.selected_node.as_deref());
        let rejected = |message: String| CallError::Rejected {
            guest: self.name.to_string(),
            message,
        };
        let built = spec
            .finish(&self.grants)
            .map_err(|e| rejected(super::spec::describe_spec_error(&e)))?;
        super::spec::check_selected_node(&built, selected_node)
            .map_err(|e| rejected(super::spec::describe_spec_error(&e)))?;
        let Some(path) = super::nodepath::node_path(&built.source) else {
            return Ok(built);
        };
        let granted = self
            .grants
            .volumes
            .path_prefixes
            .iter()
            .map(PathBuf::as_path);
        let granted = granted.chain(self.grants.dirs.iter().map(|d| d.host.as_path()));
        super::served::served()
            .reserve(pv_name, Path::new(path), granted)
            .map_err(|e| rejected(e.to_string()))?;
        // On disk, one component at a time, on the blocking pool: a pod can hold a directory
        // of the path locked, so the walk gets the call's deadline too.
        let (grants, source, ownership) =
            (self.grants.clone(), built.source.clone(), built.ownership);
        // A volume with an enforced size is limited to the PV's capacity, the claim's request
        // when the guest set none (the capacity the controller then writes).
        let (pv, bytes) = (
            pv_name.clone(),
            built.capacity.unwrap_or(request.claim.requested_bytes),
        );
        let checked = self
            .on_disk(format!("the check of {path} on disk"), move || {
                let volume = super::nodepath::OnDisk { pv: &pv, bytes };
                super::nodepath::check_source(&grants, &source, &ownership, &volume)
            })
            .await;
        if let Err(error) = checked {
            super::served::served().release(pv_name);
            return Err(error);
        }
        Ok(built)
    }

    /// Runs `work`, a walk of a node path, on the blocking pool within the call's deadline: a
    /// pod can hold a directory of the path locked. Its error (or a walk that did not finish)
    /// refuses what the guest returned; a walk still blocked at the deadline is a fault naming
    /// `what`.
    pub(super) async fn on_disk<T, E>(
        &self,
        what: String,
        work: impl FnOnce() -> Result<T, E> + Send + 'static,
    ) -> Result<T, CallError>
    where
        T: Send + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        let rejected = |message: String| CallError::Rejected {
            guest: self.name.to_string(),
            message,
        };
        let walk = tokio::task::spawn_blocking(work);
        match tokio::time::timeout(self.grants.call_timeout, walk).await {
            Ok(Ok(done)) => done.map_err(|e| rejected(e.to_string())),
            Ok(Err(e)) => Err(rejected(format!("{what} did not finish: {e}"))),
            Err(_) => Err(self.fault(
                FaultKind::Deadline,
                format!(
                    "{what} was blocked for {:?} (a directory of its path locked by another process?)",
                    self.grants.call_timeout
                ),
            )),
        }
    }

    /// The one call path: waits for a slot, runs `export` on a fresh instance within the
    /// deadline, then logs, classifies and counts the outcome.
    pub(super) async fn call<E: Export>(&self, export: E) -> Result<E::Output, CallError> {
        let mut scope = self.begin().await?;
        if let Some(clock) = &self.clock {
            let until = scope.deadline + ASYNC_TIMEOUT_MARGIN;
            clock.start(E::OPERATION, scope.timeout, until);
        }
        let store = &mut scope.store;
        let outcome = tokio::time::timeout(scope.timeout + ASYNC_TIMEOUT_MARGIN, async {
            let instance = self.pre.instantiate_async(&mut *store).await?;
            export.invoke(&mut *store, &instance).await
        })
        .await
        .ok();
        // A call its caller gave up on is over, whatever the guest returned since.
        let abandoned = self.clock.as_ref().and_then(|clock| clock.stop().err());
        scope.finish(E::OPERATION, outcome.filter(|_| abandoned.is_none()))
    }

    /// The guest's part of one call ([`super::call`]).
    fn site(&self) -> CallSite<'_> {
        CallSite {
            name: &self.name,
            grants: &self.grants,
            lingering: &self.lingering,
        }
    }

    fn fault(&self, kind: FaultKind, message: String) -> CallError {
        self.site().fault(kind, message)
    }

    /// Waits for a concurrency slot and prepares a fresh store under the guest's limits.
    async fn begin(&self) -> Result<CallScope<'_>, CallError> {
        let lingering = self.lingering.count();
        if lingering >= self.grants.descriptors {
            return Err(self.fault(
                FaultKind::Descriptors,
                format!(
                    "{lingering} filesystem operations of this guest's earlier calls are still blocked in the kernel (a file or directory locked by another process?); no new call until they end (limits.descriptors is {})",
                    self.grants.descriptors
                ),
            ));
        }
        let permit = self.slot().await?;
        let pool_slot = match &self.pool_slots {
            Some(slots) => Some(
                slots
                    .clone()
                    .acquire_many_owned(self.pool_units)
                    .await
                    .expect("pool semaphore is never closed"),
            ),
            None => None,
        };
        let timeout = self.grants.call_timeout;
        let deadline = Instant::now() + timeout;
        // On a thread of its own, whose caller keeps the deadline, the call's filesystem work
        // runs right there; else each operation goes to the blocking pool, where the call's
        // own timeout can end the wait.
        let (work, long) = match &self.clock {
            Some(clock) => (FsWork::Inline { deadline }, Some(clock.long.clone())),
            None => (FsWork::Pool, None),
        };
        let (store, output) = self
            .site()
            .new_store(self.pre.engine(), deadline, work, long)?;
        Ok(CallScope {
            guest: self,
            started: Instant::now(),
            _permit: permit,
            _pool_slot: pool_slot,
            store,
            output,
            timeout,
            deadline,
        })
    }

    /// Waits for a concurrency slot, unless every slot is held by a call stuck in the kernel
    /// past its deadline (those keep theirs until the kernel lets them go: the instance and
    /// the thread are still in use).
    async fn slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, CallError> {
        loop {
            let changed = self.lingering.stuck_changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let stuck = self.lingering.stuck_calls();
            if stuck >= self.grants.max_concurrency {
                return Err(self.fault(
                    FaultKind::Deadline,
                    format!(
                        "all {stuck} call slots of this guest (limits.max-concurrency) are held by earlier calls still blocked in the kernel past their deadline (a file or directory locked by another process?); no new call until one ends"
                    ),
                ));
            }
            tokio::select! {
                permit = self.semaphore.acquire() => {
                    return Ok(permit.expect("guest semaphore is never closed"));
                }
                () = changed => {}
            }
        }
    }

    /// Runs a call on the guest executor when there is one, else right here. On the executor
    /// the call has a thread of its own and this caller keeps its deadline: a call still
    /// running past it (blocked in the kernel) is given up on and charged to the guest until
    /// its thread ends ([`super::call_clock`]).
    pub(super) async fn dispatch<R, F>(&self, call: impl FnOnce(Guest) -> F) -> Result<R, CallError>
    where
        F: std::future::Future<Output = Result<R, CallError>> + Send + 'static,
        R: Send + 'static,
    {
        let Some(executor) = &self.executor else {
            return call(self.clone()).await;
        };
        let clock = CallClock::new(self.lingering.clone());
        let mut guest = self.clone();
        guest.clock = Some(clock.clone());
        let running = executor.run_sliced(call(guest), clock.long.clone());
        tokio::pin!(running);
        tokio::select! {
            biased;
            joined = &mut running => match joined {
                Ok(result) => result,
                Err(error) => Err(self.fault(
                    FaultKind::Host,
                    format!("the call ended without a result: {error}"),
                )),
            },
            abandoned = clock.overrun(self.grants.call_timeout + ASYNC_TIMEOUT_MARGIN) => {
                Err(self.overran(abandoned))
            }
        }
    }

    /// The fault of a call that did not finish within its deadline.
    fn overran(&self, Abandoned { operation, timeout }: Abandoned) -> CallError {
        self.fault(
            FaultKind::Deadline,
            format!("{operation} did not finish within {timeout:?} (blocked in a host call)"),
        )
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
    /// The store's epoch deadline, `timeout` after it was made.
    deadline: Instant,
}

impl CallScope<'_> {
    /// Logs the guest's output, turns the outcome into a result (classifying faults) and
    /// records the call in the guest metrics: the one place every guest call passes.
    fn finish<R: CallOutcome>(
        self,
        operation: &'static str,
        outcome: Option<wasmtime::Result<R>>,
    ) -> Result<R, CallError> {
        let guest = self.guest;
        guest
            .site()
            .log_output(operation, &self.output, &self.store);
        let result = self.classify_outcome(operation, outcome);
        if let Some(metrics) = &guest.metrics {
            let (label, fault) = match &result {
                Ok(value) => (value.label(), false),
                Err(CallError::Fault { kind, .. }) => (kind.as_str(), true),
                Err(CallError::Rejected { .. }) => ("rejected", false),
                Err(CallError::Refused { .. }) => ("refused", false),
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
        outcome: Option<wasmtime::Result<R>>,
    ) -> Result<R, CallError> {
        let guest = self.guest;
        match outcome {
            None => Err(guest.overran(Abandoned {
                operation,
                timeout: self.timeout,
            })),
            Some(Ok(value)) => Ok(value),
            Some(Err(error)) => Err(guest.site().classify(
                operation,
                error,
                &self.store,
                &self.output,
                self.timeout,
            )),
        }
    }
}

/// Where a volume's storage is, as its PV says, for a message.
fn describe_source(source: &VolumeSource) -> String {
    match source {
        VolumeSource::HostPath(s) => format!("hostPath {}", s.path),
        VolumeSource::Local(s) => format!("local path {}", s.path),
        VolumeSource::Nfs(s) => format!("NFS export {}:{}", s.server, s.path),
        VolumeSource::Csi(s) => format!("CSI volume {} of driver {}", s.volume_handle, s.driver),
    }
}
