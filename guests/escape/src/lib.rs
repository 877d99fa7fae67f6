//! escape: an adversarial test guest that tries to leave its sandbox the way the class
//! parameter `attempt` says, and reports whether it got out.
//!
//! ```text
//! host-path-outside, source-not-granted: builder call ─▶ refused? final "refused: <why>"
//!                                                       accepted? the spec, annotated escaped
//! dotdot, symlink: filesystem probes ─▶ all escaping writes failed? final "contained: <details>"
//!                                       any succeeded? hostPath <node-dir>/<pv>, annotated escaped
//! ```
//!
//! A test asserts containment by expecting the `final` errors, never the annotation.

mod attempt;
mod config;

use std::fs;

wit_bindgen::generate!({
    path: "../../wit",
    world: "provisioner",
});

use attempt::{Attempt, ESCAPED_ANNOTATION, Probe, Verdict};
use config::EscapeConfig;
use exports::wasm_provisioner::provisioner::lifecycle::Guest;
use wasm_provisioner::provisioner::host;
use wasm_provisioner::provisioner::types::{
    DeleteRequest, HostPathType, LogLevel, Pair, ProvisionError, ProvisionRequest, SpecError,
};
use wasm_provisioner::provisioner::volume_builder::VolumeSpec;

struct Escape;

impl Guest for Escape {
    fn provision(request: ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
        let config = EscapeConfig::parse(&request.config).map_err(ProvisionError::Final)?;
        let attempt = Attempt::from_parameters(&request.storage_class.parameters)
            .map_err(ProvisionError::Final)?;
        host::log(
            LogLevel::Info,
            "attempting an escape",
            &[pair("attempt", attempt.name())],
        );
        match attempt {
            Attempt::HostPathOutside => try_builder(attempt, |spec| {
                spec.host_path("/etc", HostPathType::DirectoryOrCreate)
            }),
            Attempt::SourceNotGranted => {
                try_builder(attempt, |spec| spec.nfs("evil.example", "/x", false))
            }
            Attempt::DotDot => settle(
                attempt::judge(&dotdot_probes(&config)),
                &config,
                &request.pv_name,
            ),
            Attempt::Symlink => settle(
                attempt::judge(&symlink_probes(&config)),
                &config,
                &request.pv_name,
            ),
        }
    }

    fn delete(_request: DeleteRequest) -> Result<(), ProvisionError> {
        Ok(())
    }
}

// Exported only from WebAssembly: the export names (`wasm-provisioner:provisioner/...`) are not
// valid symbol names for a native cdylib, which `cargo test` also links.
#[cfg(target_arch = "wasm32")]
export!(Escape);

/// Makes one builder call that the grants should refuse.
fn try_builder(
    attempt: Attempt,
    call: impl FnOnce(&VolumeSpec) -> Result<(), SpecError>,
) -> Result<VolumeSpec, ProvisionError> {
    let spec = VolumeSpec::new();
    match call(&spec) {
        Err(SpecError::NotGranted(message) | SpecError::Invalid(message)) => {
            Err(ProvisionError::Final(format!("refused: {message}")))
        }
        Ok(()) => {
            // Not refused: hand the spec back so the host's check of the finished spec is tested too.
            let _ = spec.annotation(ESCAPED_ANNOTATION, attempt.name());
            Ok(spec)
        }
    }
}

/// Turns a filesystem verdict into the provision result.
fn settle(
    verdict: Verdict,
    config: &EscapeConfig,
    pv_name: &str,
) -> Result<VolumeSpec, ProvisionError> {
    let escaped = match verdict {
        Verdict::Contained(details) => {
            return Err(ProvisionError::Final(format!("contained: {details}")));
        }
        Verdict::Escaped(actions) => actions.join(", "),
    };
    host::log(
        LogLevel::Warn,
        "escaped the sandbox",
        &[pair("escaped", &escaped)],
    );
    let spec = VolumeSpec::new();
    let described = spec
        .host_path(&config.node_path(pv_name), HostPathType::DirectoryOrCreate)
        .and_then(|()| spec.annotation(ESCAPED_ANNOTATION, &escaped));
    match described {
        Ok(()) => Ok(spec),
        Err(SpecError::NotGranted(message) | SpecError::Invalid(message)) => {
            Err(ProvisionError::Final(format!(
                "escaped ({escaped}), but the spec was refused: {message}"
            )))
        }
    }
}

fn dotdot_probes(config: &EscapeConfig) -> Vec<Probe> {
    [
        config.guest_path("../escaped.txt"),
        "/escaped-abs.txt".to_owned(),
    ]
    .into_iter()
    .map(|path| write_probe(&path))
    .collect()
}

fn symlink_probes(config: &EscapeConfig) -> Vec<Probe> {
    let mut probes = Vec::new();
    for (link_name, target) in [("link", "/"), ("link-up", "..")] {
        let link = config.guest_path(link_name);
        // A link left by an earlier call would make creating it fail; start afresh.
        let _ = fs::remove_file(&link);
        probes.push(Probe {
            action: format!("symlink {link} -> {target}"),
            escapes_on_success: false,
            outcome: symlink(target, &config.guest_dir, link_name),
        });
        probes.push(write_probe(&format!("{link}/escaped-via-link.txt")));
    }
    probes
}

fn write_probe(path: &str) -> Probe {
    Probe {
        action: format!("write {path}"),
        escapes_on_success: true,
        outcome: fs::write(path, "escaped\n").map_err(|error| error.to_string()),
    }
}

/// Creates the symlink `<dir>/<name>` -> `target`. Through the preopened directory's WASI
/// descriptor, because `std::os::wasi::fs::symlink_path` is unstable on wasm32-wasip2.
#[cfg(target_os = "wasi")]
fn symlink(target: &str, dir: &str, name: &str) -> Result<(), String> {
    let (directory, _) = wasip2::filesystem::preopens::get_directories()
        .into_iter()
        .find(|(_, preopened)| preopened.trim_end_matches('/') == dir.trim_end_matches('/'))
        .ok_or_else(|| format!("{dir} is not a preopened directory"))?;
    directory
        .symlink_at(target, name)
        .map_err(|code| code.to_string())
}

/// Native builds only run the unit tests, which never plant links.
#[cfg(not(target_os = "wasi"))]
fn symlink(_target: &str, _dir: &str, _name: &str) -> Result<(), String> {
    Err("symlinks are only attempted inside WebAssembly".to_owned())
}

fn pair(key: &str, value: &str) -> Pair {
    Pair {
        key: key.to_owned(),
        value: value.to_owned(),
    }
}
