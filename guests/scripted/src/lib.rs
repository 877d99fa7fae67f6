//! scripted: a test guest whose every outcome is chosen by StorageClass parameters (and the
//! annotations it leaves on PVs), for the controller's end-to-end tests.
//!
//! ```text
//! provision: append calls.log ─▶ count <pv>.attempts ─▶ (success: build spec, create <pv>) ─▶ write <pv>.started ─▶ delayMs / spinForever
//!            ─▶ scripted failure (fail, failTimes) or mkdir <pv> + hostPath <node-dir>/<pv>
//! delete:    append calls.log ─▶ scripted failure (delete-fail annotations) ─▶ deleteDelayMs ─▶ rm -r <pv> (or the byClaim directory)
//! clone:     provision-clone records its source in <pv>.source, waits while clones.hold exists,
//!            then provisions as above
//! expand:    append calls.log ─▶ count <pv>.expand-attempts ─▶ scripted failure (expandFail,
//!            expandFailTimes) or the requested bytes (one less with expandShort)
//! hooks:     should-provision (claim skip annotation), should-delete (PV keep annotation),
//!            supported (capabilities: block and selector), supports-block (always true; the
//!            host asks `supported` instead, this stays for the old contract's sake)
//! ```
//!
//! The parameters are documented on [`script::ProvisionScript`]; everything the guest records
//! lives in the granted directory at `guest-dir`.

mod config;
mod script;

use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::time::Duration;

wit_bindgen::generate!({
    path: "../../wit",
    world: "provisioner-full",
});

use config::ScriptedConfig;
use exports::wasm_provisioner::provisioner::capabilities::{self, CapabilitySet};
use exports::wasm_provisioner::provisioner::cloning::{self, CloneSource};
use exports::wasm_provisioner::provisioner::expansion::{self, ExpandRequest};
use exports::wasm_provisioner::provisioner::{block_support, deletion_guard, lifecycle, qualifier};
use script::ProvisionScript;
use wasm_provisioner::provisioner::host;
use wasm_provisioner::provisioner::types::{
    Claim, DeleteRequest, HostPathType, LogLevel, NodeSelectorOperator, NodeSelectorRequirement,
    NodeSelectorTerm, Pair, ProvisionError, ProvisionRequest, SpecError, StorageClass, Volume,
};
use wasm_provisioner::provisioner::volume_builder::VolumeSpec;

struct Scripted;

impl lifecycle::Guest for Scripted {
    fn provision(request: ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
        provision(&request)
    }

    fn delete(request: DeleteRequest) -> Result<(), ProvisionError> {
        delete(&request)
    }
}

/// A clone is scripted like any provision; the source it was handed is recorded in
/// `<pv>.source` (`namespace/name uid volume-name`) for the test to compare with the cluster,
/// and the call waits while `clones.hold` exists.
impl cloning::Guest for Scripted {
    fn provision_clone(
        request: ProvisionRequest,
        source: CloneSource,
    ) -> Result<VolumeSpec, ProvisionError> {
        let state = StateDir::open(&request.config, &request.pv_name)?;
        state.record_call("provision-clone", &request.pv_name)?;
        state.write(
            &format!("{}.source", request.pv_name),
            &format!(
                "{}/{} {} {}\n",
                source.namespace, source.name, source.uid, source.volume.name
            ),
        )?;
        // While `clones.hold` exists in the state directory, the copy is "running": a test holds
        // it there (within the call deadline) to act on the source meanwhile.
        while fs::metadata(state.config.guest_path("clones.hold")).is_ok() {
            std::thread::sleep(Duration::from_millis(20));
        }
        provision(&request)
    }
}

/// Growth is scripted by the class's `expand*` parameters; every call is recorded.
impl expansion::Guest for Scripted {
    fn expand(request: ExpandRequest) -> Result<u64, ProvisionError> {
        let pv = &request.volume.name;
        let state = StateDir::open(&request.config, pv)?;
        state.record_call("expand", pv)?;
        let script = ProvisionScript::parse(&request.storage_class.parameters)
            .map_err(ProvisionError::Final)?;
        let attempt = state.count_attempt(&format!("{pv}.expand-attempts"))?;
        if let Some(failure) = script.expand_failure(attempt) {
            let message = format!("scripted {failure:?} failure growing {pv}, attempt {attempt}");
            return Err(failure
                .into_error(message)
                .unwrap_or_else(|| panic!("scripted trap growing {pv}")));
        }
        Ok(request.requested_bytes - u64::from(script.expand_short))
    }
}

impl qualifier::Guest for Scripted {
    fn should_provision(claim: Claim, _storage_class: StorageClass) -> bool {
        script::wants_claim(&claim.annotations)
    }
}

impl deletion_guard::Guest for Scripted {
    fn should_delete(volume: Volume) -> bool {
        script::allows_delete(&volume.annotations)
    }
}

impl block_support::Guest for Scripted {
    fn supports_block() -> bool {
        true
    }
}

impl capabilities::Guest for Scripted {
    fn supported() -> CapabilitySet {
        CapabilitySet::BLOCK | CapabilitySet::SELECTOR
    }
}

// Exported only from WebAssembly: the export names (`wasm-provisioner:provisioner/...`) are not
// valid symbol names for a native cdylib, which `cargo test` also links.
#[cfg(target_arch = "wasm32")]
export!(Scripted);

fn provision(request: &ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
    let pv = &request.pv_name;
    let state = StateDir::open(&request.config, pv)?;
    state.record_call("provision", pv)?;
    let script =
        ProvisionScript::parse(&request.storage_class.parameters).map_err(ProvisionError::Final)?;
    let attempt = state.count_attempt(&format!("{pv}.attempts"))?;
    let failure = script.provision_failure(attempt);
    // A successful call creates its storage before `<pv>.started` and the delay, so a test that
    // kills the controller during the delay leaves storage without a PV behind.
    let storage = match script.by_claim {
        true => script::claim_storage_name(&request.claim.namespace, &request.claim.name),
        false => pv.clone(),
    };
    let spec = match (&failure, script.spin_forever) {
        (None, false) => {
            let spec = describe_volume(request, &state.config, &script, &storage)?;
            let guest_path = state.config.guest_path(&storage);
            fs::create_dir_all(&guest_path)
                .map_err(|error| io_failed("creating", &guest_path, error))?;
            Some(spec)
        }
        _ => None,
    };
    state.write(&format!("{pv}.started"), &format!("{attempt}\n"))?;
    if script.delay_ms > 0 {
        std::thread::sleep(Duration::from_millis(script.delay_ms));
    }
    if script.spin_forever {
        spin_forever();
    }
    if let Some(failure) = failure {
        let message = format!("scripted {failure:?} failure provisioning {pv}, attempt {attempt}");
        return Err(failure
            .into_error(message.clone())
            .unwrap_or_else(|| panic!("{message}")));
    }
    let spec = spec.expect("built when no failure is scripted");
    host::log(
        LogLevel::Info,
        "provisioned scripted volume",
        &[pair("pv", pv), pair("attempt", &attempt.to_string())],
    );
    Ok(spec)
}

/// Builds the volume; a refused builder call fails provision unless `ignoreSpecErrors` is set,
/// in which case the spec goes back as it is and the host's final check has to catch it.
fn describe_volume(
    request: &ProvisionRequest,
    config: &ScriptedConfig,
    script: &ProvisionScript,
    storage: &str,
) -> Result<VolumeSpec, ProvisionError> {
    let claim = &request.claim;
    let host_path = script
        .host_path
        .clone()
        .unwrap_or_else(|| config.node_path(storage));
    let spec = VolumeSpec::new();
    let mut refusals = Vec::new();
    let mut note = |outcome: Result<(), SpecError>| {
        if let Err(error) = outcome {
            refusals.push(spec_error_message(error));
        }
    };
    if claim.requested_bytes > 0 {
        note(spec.capacity(claim.requested_bytes));
    }
    if !claim.access_modes.is_empty() {
        note(spec.access_modes(&claim.access_modes));
    }
    note(spec.host_path(&host_path, HostPathType::DirectoryOrCreate));
    if let (true, Some(node)) = (script.pin_to_selected_node, &request.selected_node) {
        note(spec.node_affinity(&[NodeSelectorTerm {
            requirements: vec![NodeSelectorRequirement {
                key: "kubernetes.io/hostname".into(),
                operator: NodeSelectorOperator::In,
                values: vec![node.clone()],
            }],
        }]));
    }
    for (key, value) in script.volume_annotations() {
        note(spec.annotation(key, &value));
    }
    if storage != request.pv_name {
        note(spec.annotation(script::DIR_ANNOTATION, storage));
    }
    if refusals.is_empty() {
        return Ok(spec);
    }
    let refusals = refusals.join("; ");
    if !script.ignore_spec_errors {
        return Err(ProvisionError::Final(refusals));
    }
    host::log(
        LogLevel::Warn,
        "returning a refused volume spec",
        &[pair("refusals", &refusals)],
    );
    Ok(spec)
}

fn delete(request: &DeleteRequest) -> Result<(), ProvisionError> {
    let volume = &request.volume;
    let state = StateDir::open(&request.config, &volume.name)?;
    state.record_call("delete", &volume.name)?;
    if script::delete_is_scripted(&volume.annotations) {
        let attempt = state.count_attempt(&format!("{}.delete-attempts", volume.name))?;
        if let Some(failure) =
            script::delete_failure(&volume.annotations, attempt).map_err(ProvisionError::Final)?
        {
            let message = format!(
                "scripted {failure:?} failure deleting {}, attempt {attempt}",
                volume.name
            );
            return Err(failure
                .into_error(message)
                .expect("delete failures are final or transient"));
        }
    }
    let delay = script::delete_delay_ms(&volume.annotations);
    if delay > 0 {
        std::thread::sleep(Duration::from_millis(delay));
    }
    let storage = script::storage_name(&volume.annotations, &volume.name);
    script::check_file_name(storage).map_err(ProvisionError::Final)?;
    let guest_path = state.config.guest_path(storage);
    match fs::remove_dir_all(&guest_path) {
        Err(error) if error.kind() != ErrorKind::NotFound => {
            return Err(io_failed("removing", &guest_path, error));
        }
        _ => {}
    }
    host::log(
        LogLevel::Info,
        "deleted scripted volume",
        &[pair("pv", &volume.name)],
    );
    Ok(())
}

/// The granted directory, where the guest keeps its call log, attempt counters and volumes.
struct StateDir {
    config: ScriptedConfig,
}

impl StateDir {
    /// Parses the config and checks that `pv` is usable as a file name in the directory.
    fn open(config_json: &str, pv: &str) -> Result<Self, ProvisionError> {
        let config = ScriptedConfig::parse(config_json).map_err(ProvisionError::Final)?;
        script::check_file_name(pv).map_err(ProvisionError::Final)?;
        Ok(Self { config })
    }

    /// Appends `<operation> <pv>` to `calls.log`; when an instance is configured, also
    /// ` <instance> <unix ms>`, so tests can tell which replica called when.
    fn record_call(&self, operation: &str, pv: &str) -> Result<(), ProvisionError> {
        let path = self.config.guest_path("calls.log");
        let line = match &self.config.instance {
            Some(instance) => {
                let millis = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis())
                    .unwrap_or(0);
                format!("{operation} {pv} {instance} {millis}\n")
            }
            None => format!("{operation} {pv}\n"),
        };
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut log| log.write_all(line.as_bytes()))
            .map_err(|error| io_failed("appending to", &path, error))
    }

    /// Reads, increments and writes back the counter in `file`; returns the new value.
    fn count_attempt(&self, file: &str) -> Result<u64, ProvisionError> {
        let path = self.config.guest_path(file);
        let recorded = match fs::read_to_string(&path) {
            Ok(text) => Some(text),
            Err(error) if error.kind() == ErrorKind::NotFound => None,
            Err(error) => return Err(io_failed("reading", &path, error)),
        };
        let attempt = script::next_attempt(recorded.as_deref());
        self.write(file, &format!("{attempt}\n"))?;
        Ok(attempt)
    }

    fn write(&self, file: &str, contents: &str) -> Result<(), ProvisionError> {
        let path = self.config.guest_path(file);
        fs::write(&path, contents).map_err(|error| io_failed("writing", &path, error))
    }
}

/// Never returns: what a runaway guest looks like, for deadline tests.
fn spin_forever() -> ! {
    let mut turns: u64 = 0;
    loop {
        turns = std::hint::black_box(turns.wrapping_add(1));
    }
}

fn io_failed(doing: &str, path: &str, error: std::io::Error) -> ProvisionError {
    ProvisionError::Final(format!("{doing} {path}: {error}"))
}

fn spec_error_message(error: SpecError) -> String {
    match error {
        SpecError::NotGranted(message) => format!("volume spec not granted: {message}"),
        SpecError::Invalid(message) => format!("volume spec invalid: {message}"),
    }
}

fn pair(key: &str, value: &str) -> Pair {
    Pair {
        key: key.to_owned(),
        value: value.to_owned(),
    }
}
