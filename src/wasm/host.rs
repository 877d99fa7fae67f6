//! Per-call host state and the host functions guests import (`host`, `volume-builder`).
//!
//! One `GuestState` lives in one `Store` for one call; nothing here outlives the call.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use wasmtime::component::{Resource, ResourceTable};
use wasmtime::{ResourceLimiter, Result as WasmResult};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::types::{
    AccessMode, CsiSource, HostPathType, LogLevel, NodeSelectorTerm, Pair, ReclaimPolicy,
    SpecError, VolumeMode,
};
use super::bindings::{VolumeSpecBuilder, host, types, volume_builder};
use super::copy;
use super::fs_view::{FsWork, SandboxFsView};
use super::grants::Grants;
use super::handles::{FsGuard, Lingering, TABLE_ENTRIES_PER_CALL};
use super::output::printable;
use super::ownership::Ownership;
use super::sized;

/// What each `host.log` message costs on top of its text, so a flood of empty messages runs out
/// of budget too (one line of output is never free).
pub const LOG_MESSAGE_OVERHEAD: usize = 64;
/// Volume-spec resources one call may create (each is host memory the guest does not pay for).
pub const SPECS_PER_CALL: usize = 16;

/// Bytes one table element is counted as against the call's memory budget (a function
/// reference is a pointer on the host).
pub const TABLE_ELEMENT_BYTES: usize = 8;

/// Caps the memory of one store (from the guest's grants): the *sum* of all its linear
/// memories and tables at `memory-mib`, each table at `table-elements`, the number of memories
/// at `memories` and of instances and tables at `instances`. Remembers which cap was hit so a
/// failed call is reported as a limit, not a generic trap.
#[derive(Debug)]
pub struct CallLimiter {
    memory_bytes: usize,
    table_elements: usize,
    instances: usize,
    memories: usize,
    /// Bytes of linear memory and tables granted so far in this store.
    reserved: usize,
    /// Set when the guest tried to grow memory past its cap.
    pub memory_hit: bool,
    /// Set when the guest tried to grow a table past its cap.
    pub table_hit: bool,
}

impl CallLimiter {
    /// A limiter with the caps of `grants`.
    pub fn new(grants: &Grants) -> Self {
        CallLimiter {
            memory_bytes: grants.memory_bytes,
            table_elements: grants.table_elements,
            instances: grants.instances,
            memories: grants.memories,
            reserved: 0,
            memory_hit: false,
            table_hit: false,
        }
    }

    /// Bytes of memories and tables this store holds (as far as the limiter has seen).
    pub fn reserved_bytes(&self) -> usize {
        self.reserved
    }

    /// Moves one memory or table from `current` to `desired` bytes if the sum stays in budget.
    fn reserve(&mut self, current: usize, desired: usize) -> bool {
        let total = self
            .reserved
            .saturating_sub(current)
            .saturating_add(desired);
        if total > self.memory_bytes {
            return false;
        }
        self.reserved = total;
        true
    }
}

impl ResourceLimiter for CallLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> WasmResult<bool> {
        if !self.reserve(current, desired) {
            self.memory_hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> WasmResult<bool> {
        let bytes = |elements: usize| elements.saturating_mul(TABLE_ELEMENT_BYTES);
        if desired > self.table_elements {
            self.table_hit = true;
            return Ok(false);
        }
        if !self.reserve(bytes(current), bytes(desired)) {
            self.memory_hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        self.instances
    }

    fn tables(&self) -> usize {
        self.instances
    }

    fn memories(&self) -> usize {
        // A composed component may carry several memories; they share one budget, and their
        // number is capped at what guests need (a wasip2 guest has one, an adapted wasip1 two).
        self.memories
    }
}

/// Everything a store holds for one call into one guest.
pub struct GuestState {
    guest: Arc<str>,
    grants: Arc<Grants>,
    wasi: WasiCtx,
    table: ResourceTable,
    /// Memory and table caps for this call.
    pub limiter: CallLimiter,
    /// The filesystem guard: descriptors held, calls refused.
    pub fs_guard: FsGuard,
    log_bytes_left: usize,
    /// Log messages dropped because the per-call budget ran out.
    pub logs_dropped: u64,
    specs_created: usize,
}

impl GuestState {
    /// State for one call of `guest` under `grants`, with a prepared WASI context;
    /// `lingering` is what the guest's ended calls left running, charged to this one too, and
    /// `work` where its filesystem work runs.
    pub fn new(
        guest: Arc<str>,
        grants: Arc<Grants>,
        wasi: WasiCtx,
        lingering: Arc<Lingering>,
        work: FsWork,
    ) -> Self {
        let limiter = CallLimiter::new(&grants);
        let mut fs_guard = FsGuard::new(grants.descriptors, lingering);
        fs_guard.work = work;
        let log_bytes_left = grants.log_bytes;
        let mut table = ResourceTable::new();
        table.set_max_capacity(TABLE_ENTRIES_PER_CALL);
        GuestState {
            guest,
            grants,
            wasi,
            table,
            limiter,
            fs_guard,
            log_bytes_left,
            logs_dropped: 0,
            specs_created: 0,
        }
    }

    /// Takes a finished volume spec out of the resource table.
    pub fn take_spec(
        &mut self,
        spec: Resource<VolumeSpecBuilder>,
    ) -> WasmResult<VolumeSpecBuilder> {
        Ok(self.table.delete(spec)?)
    }

    /// The guest's `wasi:filesystem/types`, through the guard ([`super::sandbox_fs`]).
    pub fn sandbox_fs(&mut self) -> SandboxFsView<'_> {
        let inner = wasmtime_wasi::filesystem::WasiFilesystemCtxView {
            ctx: self.wasi.filesystem(),
            table: &mut self.table,
        };
        SandboxFsView::new(inner, &mut self.fs_guard)
    }

    /// The grants this call runs under.
    pub fn grants(&self) -> &Grants {
        &self.grants
    }

    fn spec(&mut self, spec: &Resource<VolumeSpecBuilder>) -> WasmResult<&mut VolumeSpecBuilder> {
        Ok(self.table.get_mut(spec)?)
    }

    /// Applies one checked setter; a refusal is also noted on the spec, so a guest that ignores
    /// it cannot get the rest of the volume through.
    fn set(
        &mut self,
        spec: &Resource<VolumeSpecBuilder>,
        f: impl FnOnce(&mut VolumeSpecBuilder, &Grants) -> Result<(), SpecError>,
    ) -> SpecResult {
        self.with_spec(spec, |b, g| {
            let result = f(b, g);
            if let Err(error) = &result {
                b.note_refusal(error);
            }
            result
        })
    }

    /// Applies one setter to a spec, with the grants at hand.
    fn with_spec<R>(
        &mut self,
        spec: &Resource<VolumeSpecBuilder>,
        f: impl FnOnce(&mut VolumeSpecBuilder, &Grants) -> R,
    ) -> WasmResult<R> {
        let grants = self.grants.clone();
        let builder = self.spec(spec)?;
        Ok(f(builder, &grants))
    }
}

impl WasiView for GuestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for GuestState {}

impl host::Host for GuestState {
    fn log(&mut self, level: LogLevel, message: String, fields: Vec<Pair>) -> WasmResult<()> {
        let size = LOG_MESSAGE_OVERHEAD
            + message.len()
            + fields
                .iter()
                .map(|p| p.key.len() + p.value.len())
                .sum::<usize>();
        if size > self.log_bytes_left {
            self.logs_dropped += 1;
            if self.logs_dropped == 1 {
                tracing::warn!(guest = %self.guest, budget = self.grants.log_bytes, "guest log budget per call exhausted; dropping further messages");
            }
            return Ok(());
        }
        self.log_bytes_left -= size;
        // Guest text never starts a log line of its own (docs/threat-model.md).
        let fields = fields
            .iter()
            .map(|p| format!("{}={}", printable(&p.key), printable(&p.value)))
            .collect::<Vec<_>>()
            .join(" ");
        let message = printable(&message);
        let guest = &*self.guest;
        match level {
            LogLevel::Trace => tracing::trace!(target: "guest", guest, fields, "{message}"),
            LogLevel::Debug => tracing::debug!(target: "guest", guest, fields, "{message}"),
            LogLevel::Info => tracing::info!(target: "guest", guest, fields, "{message}"),
            LogLevel::Warn => tracing::warn!(target: "guest", guest, fields, "{message}"),
            LogLevel::Error => tracing::error!(target: "guest", guest, fields, "{message}"),
        }
        Ok(())
    }

    fn config(&mut self) -> WasmResult<String> {
        Ok(self.grants.config_json.clone())
    }

    async fn copy_tree(
        &mut self,
        source: String,
        target: String,
        within_ms: u64,
    ) -> WasmResult<Result<host::Copied, String>> {
        let resolved = match copy::resolve(&self.grants, &source, &target) {
            Ok(resolved) => resolved,
            Err(error) => return Ok(Err(error.to_string())),
        };
        let within = std::time::Duration::from_millis(within_ms).min(self.grants.call_timeout);
        let deadline = std::time::Instant::now() + within;
        let owners = copy::Owners::of(&self.grants);
        // The copy counts its descriptors itself, against what the call's cap leaves.
        let copied = self
            .on_pool("copy-tree", move |held, max_held| {
                copy::copy(resolved, owners, deadline, held, max_held)
            })
            .await?;
        Ok(copied
            .map(Into::into)
            .map_err(|error| format!("copying {source} to {target}: {error}")))
    }

    async fn destroy_volume(
        &mut self,
        path: String,
        pv: String,
    ) -> WasmResult<Result<bool, String>> {
        let grants = self.grants.clone();
        self.on_pool("destroy-volume", move |held, _| {
            // The granted directory, the parent and the volume, open at once at most.
            held.store(3, Ordering::Relaxed);
            sized::destroy(&grants, &path, &pv)
                .map_err(|error| format!("destroying the volume at {path}: {error}"))
        })
        .await
    }
}

impl GuestState {
    /// Runs `work` on the blocking pool as an operation of this call: it gets the counter of
    /// the descriptors it holds (charged like the guest's own, and to its next calls if it
    /// outlives this one) and how many it may hold at once.
    async fn on_pool<R: Send + 'static>(
        &mut self,
        what: &str,
        work: impl FnOnce(Arc<AtomicUsize>, usize) -> R + Send + 'static,
    ) -> WasmResult<R> {
        let (held, max_held) = self.fs_guard.begin_operation()?;
        tokio::task::spawn_blocking(move || work(held, max_held))
            .await
            .map_err(|error| wasmtime::Error::msg(format!("{what}: {error}")))
    }
}

impl From<copy::Copied> for host::Copied {
    fn from(done: copy::Copied) -> host::Copied {
        host::Copied {
            entries: done.entries,
            bytes: done.bytes,
            links: done.links,
            skipped: done.skipped,
            owners_not_kept: done.owners_not_kept,
            snapshot: done.snapshot,
        }
    }
}

impl volume_builder::Host for GuestState {}

type Spec = Resource<VolumeSpecBuilder>;
type SpecResult = WasmResult<Result<(), SpecError>>;

impl volume_builder::HostVolumeSpec for GuestState {
    fn new(&mut self) -> WasmResult<Spec> {
        self.specs_created += 1;
        if self.specs_created > SPECS_PER_CALL {
            wasmtime::bail!("guest created more than {SPECS_PER_CALL} volume specs in one call");
        }
        Ok(self.table.push(VolumeSpecBuilder::default())?)
    }

    fn capacity(&mut self, spec: Spec, bytes: u64) -> SpecResult {
        self.set(&spec, |b, _| b.capacity(bytes))
    }

    fn access_modes(&mut self, spec: Spec, modes: Vec<AccessMode>) -> SpecResult {
        self.set(&spec, |b, _| b.access_modes(modes))
    }

    fn volume_mode(&mut self, spec: Spec, mode: VolumeMode) -> WasmResult<()> {
        self.with_spec(&spec, |b, _| b.volume_mode(mode))
    }

    fn reclaim_policy(&mut self, spec: Spec, policy: ReclaimPolicy) -> WasmResult<()> {
        self.with_spec(&spec, |b, _| b.reclaim_policy(policy))
    }

    fn mount_options(&mut self, spec: Spec, options: Vec<String>) -> SpecResult {
        self.set(&spec, |b, _| b.mount_options(options))
    }

    fn node_affinity(&mut self, spec: Spec, terms: Vec<NodeSelectorTerm>) -> SpecResult {
        self.set(&spec, |b, _| b.node_affinity(terms))
    }

    fn label(&mut self, spec: Spec, key: String, value: String) -> SpecResult {
        self.set(&spec, |b, _| b.label(key, value))
    }

    fn annotation(&mut self, spec: Spec, key: String, value: String) -> SpecResult {
        self.set(&spec, |b, _| b.annotation(key, value))
    }

    fn host_path(&mut self, spec: Spec, path: String, kind: HostPathType) -> SpecResult {
        self.set(&spec, |b, g| b.host_path(g, path, kind))
    }

    fn local(&mut self, spec: Spec, path: String, fs_type: Option<String>) -> SpecResult {
        self.set(&spec, |b, g| b.local(g, path, fs_type))
    }

    fn nfs(&mut self, spec: Spec, server: String, path: String, read_only: bool) -> SpecResult {
        self.set(&spec, |b, g| b.nfs(g, server, path, read_only))
    }

    fn csi(
        &mut self,
        spec: Spec,
        driver: String,
        volume_handle: String,
        fs_type: Option<String>,
        read_only: bool,
        attributes: Vec<Pair>,
    ) -> SpecResult {
        let source = CsiSource {
            driver,
            volume_handle,
            fs_type,
            read_only,
            attributes,
        };
        self.set(&spec, |b, g| b.csi(g, source))
    }

    fn ownership(
        &mut self,
        spec: Spec,
        uid: Option<u32>,
        gid: Option<u32>,
        mode: Option<u32>,
    ) -> SpecResult {
        let asked = Ownership { uid, gid, mode };
        self.set(&spec, |b, g| b.ownership(g, asked))
    }

    fn drop(&mut self, spec: Spec) -> WasmResult<()> {
        self.table.delete(spec)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wasm::bindings::volume_builder::HostVolumeSpec;
    use std::path::Path;

    fn state() -> GuestState {
        let grants = Grants::parse(
            "provisioner = \"x/y\"\n[volumes]\nkinds = [\"host-path\"]\npath-prefixes = [\"/srv\"]\n[config]\nk = \"v\"",
            Path::new("/"),
        )
        .unwrap();
        GuestState::new(
            "t".into(),
            Arc::new(grants),
            WasiCtx::builder().build(),
            Default::default(),
            FsWork::Pool,
        )
    }

    #[test]
    fn builder_functions_check_grants_when_called() {
        let mut s = state();
        let spec = HostVolumeSpec::new(&mut s).unwrap();
        let r = s
            .host_path(
                Resource::new_borrow(spec.rep()),
                "/etc".into(),
                HostPathType::Unset,
            )
            .unwrap();
        assert!(matches!(r, Err(SpecError::NotGranted(_))));
        let r = s
            .host_path(
                Resource::new_borrow(spec.rep()),
                "/srv/a".into(),
                HostPathType::Unset,
            )
            .unwrap();
        assert!(r.is_ok());
        // The guest went on after the refusal: the host rejects the spec as a whole.
        let err = s.take_spec(spec).unwrap().finish(s.grants()).unwrap_err();
        assert!(matches!(err, SpecError::Invalid(m) if m.contains("refused")));
        let spec = HostVolumeSpec::new(&mut s).unwrap();
        let r = s
            .host_path(
                Resource::new_borrow(spec.rep()),
                "/srv/a".into(),
                HostPathType::Unset,
            )
            .unwrap();
        assert!(r.is_ok());
        let built = s.take_spec(spec).unwrap().finish(s.grants()).unwrap();
        assert!(built.capacity.is_none());
    }

    #[test]
    fn spec_count_per_call_is_bounded() {
        let mut s = state();
        for _ in 0..SPECS_PER_CALL {
            HostVolumeSpec::new(&mut s).unwrap();
        }
        assert!(HostVolumeSpec::new(&mut s).is_err());
    }

    #[test]
    fn config_and_log_budget() {
        let mut s = state();
        assert_eq!(host::Host::config(&mut s).unwrap(), r#"{"k":"v"}"#);
        let big = "x".repeat(s.grants.log_bytes / 2);
        host::Host::log(&mut s, LogLevel::Info, big.clone(), vec![]).unwrap();
        host::Host::log(&mut s, LogLevel::Info, big, vec![]).unwrap();
        assert_eq!(s.logs_dropped, 1);
        // Empty messages are not free: a flood of them runs out of budget as well.
        let mut s = state();
        for _ in 0..100_000 {
            host::Host::log(&mut s, LogLevel::Info, String::new(), vec![]).unwrap();
        }
        let kept = s.grants.log_bytes / LOG_MESSAGE_OVERHEAD;
        assert_eq!(s.logs_dropped, 100_000 - kept as u64);
    }

    #[test]
    fn memory_and_table_caps_come_from_the_grants_and_are_recorded() {
        let s = state();
        let mut l = CallLimiter::new(&s.grants);
        let cap = s.grants.memory_bytes;
        assert!(l.memory_growing(0, cap / 2, None).unwrap());
        assert!(!l.memory_hit);
        assert!(!l.memory_growing(cap / 2, cap + 1, None).unwrap());
        assert!(l.memory_hit);
        let elements = s.grants.table_elements;
        let mut l = CallLimiter::new(&s.grants);
        assert!(l.table_growing(0, elements, None).unwrap());
        assert!(!l.table_growing(0, elements + 1, None).unwrap());
        assert!(l.table_hit);
        assert_eq!(l.instances(), s.grants.instances);
        assert_eq!(l.memories(), s.grants.memories);
    }

    #[test]
    fn all_memories_and_tables_of_a_call_share_one_budget() {
        let s = state();
        let cap = s.grants.memory_bytes;
        let mut l = CallLimiter::new(&s.grants);
        // Two memories of half the cap each fit; a third byte anywhere does not.
        assert!(l.memory_growing(0, cap / 2, None).unwrap());
        assert!(l.memory_growing(0, cap / 2, None).unwrap());
        assert!(!l.memory_growing(0, 65536, None).unwrap());
        assert!(l.memory_hit);
        assert!(!l.table_growing(0, 1, None).unwrap());
        assert_eq!(l.reserved_bytes(), cap);
        // Growing one memory counts only the difference.
        let mut l = CallLimiter::new(&s.grants);
        assert!(l.memory_growing(0, 65536, None).unwrap());
        assert!(l.memory_growing(65536, cap, None).unwrap());
        assert_eq!(l.reserved_bytes(), cap);
    }
}
