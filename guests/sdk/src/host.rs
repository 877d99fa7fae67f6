//! [`Host`]: what a guest may ask of the provisioner while it works (log, check a spec).
//!
//! Guest code takes `&dyn Host`, so the same code runs against the real host inside
//! WebAssembly ([`WasmHost`]) and against [`crate::testing::FakeHost`] in native unit tests.

use crate::spec::VolumeSpec;
use crate::types::{LogLevel, SpecError};

/// The provisioner, as a guest sees it.
pub trait Host {
    /// Logs a message with fields, attributed to the guest in the provisioner's logs.
    fn log(&self, level: LogLevel, message: &str, fields: &[(&str, &str)]);

    /// Checks `spec` against the operator's grants now, with the checks the host applies when
    /// the spec is returned. Call it before creating storage so a refused spec leaves nothing.
    fn check(&self, spec: &VolumeSpec) -> Result<(), SpecError>;

    /// The path the guest's own filesystem calls reach the granted directory `guest` by (a
    /// directory it declared with `needs!`): `guest` itself inside WebAssembly, where the host
    /// preopens the directory at that path; in native unit tests, where
    /// [`FakeHost::dir`](crate::testing::FakeHost::dir) put it.
    fn dir(&self, guest: &str) -> String {
        guest.to_owned()
    }

    /// Logs at info level.
    fn info(&self, message: &str, fields: &[(&str, &str)]) {
        self.log(LogLevel::Info, message, fields);
    }

    /// Logs at warn level.
    fn warn(&self, message: &str, fields: &[(&str, &str)]) {
        self.log(LogLevel::Warn, message, fields);
    }
}

/// The real host, through the contract's imports. Only exists inside WebAssembly.
#[cfg(target_arch = "wasm32")]
pub struct WasmHost;

#[cfg(target_arch = "wasm32")]
impl Host for WasmHost {
    fn log(&self, level: LogLevel, message: &str, fields: &[(&str, &str)]) {
        let fields: Vec<_> = fields
            .iter()
            .map(|(key, value)| crate::types::pair(key, value))
            .collect();
        crate::bindings::wasm_provisioner::provisioner::host::log(level, message, &fields);
    }

    fn check(&self, spec: &VolumeSpec) -> Result<(), SpecError> {
        // The built resource is dropped: the host forgets it, the real one is built on return.
        spec.build().map(drop)
    }
}
