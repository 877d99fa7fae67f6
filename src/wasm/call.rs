//! One guest call apart from the guest making it: each export, called the one way; the fresh
//! `Store` under the guest's limits; and what the outcome says (the fault classified, the
//! output logged, the metric label). The loaded guest drives these for every call.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use wasmtime::component::{Instance, ResourceTableError};
use wasmtime::{Engine, Store, Trap, UpdateDeadline};
use wasmtime_wasi::{FsPerms, WasiCtx};

use super::bindings::cloning::CloneSource;
use super::bindings::types::{
    Claim, DeleteRequest, ProvisionError, ProvisionRequest, StorageClass, Volume,
};
use super::bindings::{
    VolumeSpecBuilder, block_support, cloning, deletion_guard, expansion, lifecycle, qualifier,
};
use super::capabilities::Capabilities;
use super::errors::{CallError, FaultKind, error_label};
use super::executor::FIRST_SLICE;
use super::fs_view::FsWork;
use super::grants::{DirAccess, Grants};
use super::handles::{HandleCapHit, Lingering, TABLE_ENTRIES_PER_CALL};
use super::host::GuestState;
use super::output::BoundedOutput;

/// What one host call may carry from the guest into the host (wasmtime's hostcall fuel).
pub const HOSTCALL_BYTES: usize = 1 << 20;

/// Largest `wasi:random` answer the host allocates for one call (wasmtime-wasi's default is
/// 64 MiB; a guest seeds its hash maps with a few bytes).
const RANDOM_BYTES: u64 = 64 << 10;

/// Extra time the async timeout allows over the epoch deadline before dropping the call.
pub(super) const ASYNC_TIMEOUT_MARGIN: Duration = Duration::from_millis(500);

/// Captured guest output of one call.
pub(super) struct Output {
    stdout: BoundedOutput,
    stderr: BoundedOutput,
}

/// One guest export, called the one way every export is called (the guest's `call`).
pub(super) trait Export: Send {
    /// What the export returns when the guest did not fault.
    type Output: CallOutcome + Send;
    /// The operation's name in logs, events and metrics.
    const OPERATION: &'static str;
    /// Calls the export on a fresh instance.
    fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> impl Future<Output = wasmtime::Result<Self::Output>> + Send;
}

pub(super) struct Provision<'r> {
    pub(super) indices: &'r lifecycle::GuestIndices,
    pub(super) request: &'r ProvisionRequest,
}
pub(super) struct ProvisionClone<'r> {
    pub(super) indices: &'r cloning::GuestIndices,
    pub(super) request: &'r ProvisionRequest,
    pub(super) source: &'r CloneSource,
}
pub(super) struct Expand<'r> {
    pub(super) indices: &'r expansion::GuestIndices,
    pub(super) request: &'r expansion::ExpandRequest,
}
pub(super) struct Delete<'r> {
    pub(super) indices: &'r lifecycle::GuestIndices,
    pub(super) request: &'r DeleteRequest,
}
pub(super) struct ShouldProvision<'r> {
    pub(super) indices: &'r qualifier::GuestIndices,
    pub(super) claim: &'r Claim,
    pub(super) class: &'r StorageClass,
}
pub(super) struct ShouldDelete<'r> {
    pub(super) indices: &'r deletion_guard::GuestIndices,
    pub(super) volume: &'r Volume,
}
pub(super) struct SupportsBlock<'r>(pub(super) &'r block_support::GuestIndices);
pub(super) struct Supported<'r>(pub(super) &'r wasmtime::component::ComponentExportIndex);

/// A provision answer with the returned spec taken out of the call's resource table.
fn spec_taken(
    store: &mut Store<GuestState>,
    answer: Result<wasmtime::component::Resource<VolumeSpecBuilder>, ProvisionError>,
) -> wasmtime::Result<Result<VolumeSpecBuilder, ProvisionError>> {
    match answer {
        Ok(spec) => Ok(Ok(store.data_mut().take_spec(spec)?)),
        Err(e) => Ok(Err(e)),
    }
}

impl Export for Provision<'_> {
    type Output = Result<VolumeSpecBuilder, ProvisionError>;
    const OPERATION: &'static str = "provision";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self::Output> {
        let exports = self.indices.load(&mut *store, instance)?;
        let answer = exports.call_provision(&mut *store, self.request).await?;
        spec_taken(store, answer)
    }
}

impl Export for ProvisionClone<'_> {
    type Output = Result<VolumeSpecBuilder, ProvisionError>;
    const OPERATION: &'static str = "provision-clone";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self::Output> {
        let exports = self.indices.load(&mut *store, instance)?;
        let answer = exports
            .call_provision_clone(&mut *store, self.request, self.source)
            .await?;
        spec_taken(store, answer)
    }
}

impl Export for Expand<'_> {
    type Output = Result<u64, ProvisionError>;
    const OPERATION: &'static str = "expand";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self::Output> {
        let exports = self.indices.load(&mut *store, instance)?;
        exports.call_expand(&mut *store, self.request).await
    }
}

impl Export for Delete<'_> {
    type Output = Result<(), ProvisionError>;
    const OPERATION: &'static str = "delete";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self::Output> {
        let exports = self.indices.load(&mut *store, instance)?;
        exports.call_delete(&mut *store, self.request).await
    }
}

impl Export for ShouldProvision<'_> {
    type Output = bool;
    const OPERATION: &'static str = "should-provision";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<bool> {
        let exports = self.indices.load(&mut *store, instance)?;
        exports
            .call_should_provision(&mut *store, self.claim, self.class)
            .await
    }
}

impl Export for ShouldDelete<'_> {
    type Output = bool;
    const OPERATION: &'static str = "should-delete";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<bool> {
        let exports = self.indices.load(&mut *store, instance)?;
        exports.call_should_delete(&mut *store, self.volume).await
    }
}

impl Export for SupportsBlock<'_> {
    type Output = bool;
    const OPERATION: &'static str = "supports-block";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<bool> {
        let exports = self.0.load(&mut *store, instance)?;
        exports.call_supports_block(&mut *store).await
    }
}

impl Export for Supported<'_> {
    type Output = Capabilities;
    const OPERATION: &'static str = "supported";
    async fn invoke(
        self,
        store: &mut Store<GuestState>,
        instance: &Instance,
    ) -> wasmtime::Result<Capabilities> {
        use wasmtime::component::Val;
        let func = instance
            .get_func(&mut *store, self.0)
            .ok_or_else(|| wasmtime::format_err!("capabilities.supported is not exported"))?;
        let mut results = [Val::Bool(false)];
        func.call_async(&mut *store, &[], &mut results).await?;
        match &results[0] {
            Val::Flags(names) => Ok(Capabilities::from_flags(names.iter().map(String::as_str))),
            other => Err(wasmtime::format_err!(
                "capabilities.supported returned {other:?}, not flags"
            )),
        }
    }
}

/// What one call needs of the guest making it: its name (in every message), its grants (the
/// store's limits) and the count of its lingering filesystem operations.
pub(super) struct CallSite<'g> {
    pub(super) name: &'g Arc<str>,
    pub(super) grants: &'g Arc<Grants>,
    pub(super) lingering: &'g Arc<Lingering>,
}

impl CallSite<'_> {
    /// A fresh store for one call: the granted directories preopened, output captured and
    /// bounded, the limiter, the hostcall fuel and the epoch deadline at `deadline`; its
    /// filesystem work runs where `work` says, and `long` is set once the call has run past
    /// its first slice ([`super::executor::FIRST_SLICE`]).
    pub(super) fn new_store(
        &self,
        engine: &Engine,
        deadline: Instant,
        work: FsWork,
        long: Option<Arc<AtomicBool>>,
    ) -> Result<(Store<GuestState>, Output), CallError> {
        let stdout = BoundedOutput::new(self.grants.output_bytes);
        let stderr = BoundedOutput::new(self.grants.output_bytes);
        let mut wasi = WasiCtx::builder();
        // wasmtime-wasi's own filesystem calls (on the preopens, and on what `open-at` opens)
        // run where the guard's do ([`super::sandbox_fs`]); set before the preopens, which
        // take it when they are opened.
        wasi.stdout(stdout.clone())
            .stderr(stderr.clone())
            .max_random_size(RANDOM_BYTES)
            .allow_blocking_current_thread(work.inline());
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
        let state = GuestState::new(
            self.name.clone(),
            self.grants.clone(),
            wasi.build(),
            self.lingering.clone(),
            work,
        );
        let mut store = Store::new(engine, state);
        store.limiter(|s| &mut s.limiter);
        // What one host call may carry from the guest (strings, lists): a host copy per call in
        // flight, so it is capped far below a guest's memory (the largest legitimate value, an
        // annotation or a log line, is a few hundred KiB; streams pass at most 64 KiB a call).
        store.set_hostcall_fuel(self.grants.memory_bytes.min(HOSTCALL_BYTES));
        store.set_epoch_deadline(1);
        let started = Instant::now();
        store.epoch_deadline_callback(move |_| {
            let now = Instant::now();
            if let Some(long) = &long
                && now.duration_since(started) >= FIRST_SLICE
            {
                // The yield below is where the executor moves it to the nicer threads.
                long.store(true, Ordering::Release);
            }
            // Compare with the wall clock rather than counting ticks, so a burst of late
            // ticks on a loaded machine cannot end a call early.
            if now >= deadline {
                Ok(UpdateDeadline::Interrupt)
            } else {
                Ok(UpdateDeadline::Yield(1))
            }
        });
        Ok((store, Output { stdout, stderr }))
    }

    /// The fault an error of the call is: what hit (deadline, memory, descriptors, panic,
    /// trap) and a message with the tail of the guest's stderr.
    pub(super) fn classify(
        &self,
        operation: &str,
        error: wasmtime::Error,
        store: &Store<GuestState>,
        output: &Output,
        timeout: Duration,
    ) -> CallError {
        let stderr = output.stderr.contents().text;
        let trap = error.downcast_ref::<Trap>().copied();
        let state = store.data();
        let limiter = &state.limiter;
        let kind = if trap == Some(Trap::Interrupt) {
            FaultKind::Deadline
        } else if limiter.memory_hit || limiter.table_hit {
            FaultKind::Memory
        } else if state.fs_guard.descriptors_hit
            || error.downcast_ref::<HandleCapHit>().is_some()
            || matches!(
                error.downcast_ref::<ResourceTableError>(),
                Some(ResourceTableError::Full)
            )
        {
            FaultKind::Descriptors
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
                "{operation} exceeded its memory cap of {} MiB (all memories and tables together)",
                self.grants.memory_bytes / (1024 * 1024)
            ),
            FaultKind::Descriptors => match error.downcast_ref::<HandleCapHit>() {
                Some(hit) => format!("{operation}: {hit}"),
                None if error.downcast_ref::<ResourceTableError>().is_some() => format!(
                    "{operation} tried to hold more than {TABLE_ENTRIES_PER_CALL} host resources (streams, pollables, descriptors, ...) at once"
                ),
                None => format!(
                    "{operation} tried to hold more than {} open descriptors (limits.descriptors)",
                    state.fs_guard.max_descriptors()
                ),
            },
            // The trap (or the host's refusal) says what happened; the wasm backtrace is for
            // the debug log, not for a Kubernetes event.
            _ => {
                tracing::debug!(guest = %self.name, operation, error = %super::output::printable(&format!("{error:?}")), "guest fault");
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

    /// Logs the guest's captured output and what its limits dropped or refused.
    pub(super) fn log_output(&self, operation: &str, output: &Output, store: &Store<GuestState>) {
        for (stream, pipe) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
            let contents = pipe.contents();
            for line in contents.text.lines().take(200) {
                let line = super::output::printable(line);
                tracing::info!(target: "guest", guest = %self.name, operation, stream, "{line}");
            }
            if contents.dropped > 0 {
                tracing::warn!(guest = %self.name, operation, stream, dropped_bytes = contents.dropped, kept_bytes = self.grants.output_bytes, "guest output over its bound; the middle was dropped");
            }
        }
        let state = store.data();
        if state.logs_dropped > 0 {
            tracing::warn!(guest = %self.name, operation, dropped_messages = state.logs_dropped, budget_bytes = self.grants.log_bytes, "guest log messages over the per-call budget were dropped");
        }
        if state.fs_guard.refused > 0 {
            tracing::warn!(guest = %self.name, operation, refused = state.fs_guard.refused, "filesystem calls refused by the sandbox (symlinks, links or renames of links, FIFOs, sockets, devices)");
        }
    }

    /// A fault of this guest's call.
    pub(super) fn fault(&self, kind: FaultKind, message: String) -> CallError {
        CallError::Fault {
            guest: self.name.to_string(),
            kind,
            message,
        }
    }
}

/// What a returned value says about the call, for the `outcome` metric label.
pub(super) trait CallOutcome {
    fn label(&self) -> &'static str;
}

impl CallOutcome for bool {
    fn label(&self) -> &'static str {
        "ok"
    }
}

impl CallOutcome for Capabilities {
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
