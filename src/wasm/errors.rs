//! The host's errors at the wasm boundary: loading a module, and a call that did not give a
//! result (the guest's typed error, a volume the host refused, or a fault of a kind).

use super::bindings::types::ProvisionError;
use super::cache::CacheError;
use super::contract::ContractError;
use super::output::printable;

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
    /// The module's bytes are not the ones its grant file pins.
    #[error("{path}: {source}")]
    Pin {
        /// The module file.
        path: String,
        /// The pinned and the actual digest.
        #[source]
        source: super::pin::PinMismatch,
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
    /// The same bytes were refused before (compile, contract or link); not tried again.
    #[error("{path} was refused before and has not changed since (not compiled again): {message}")]
    RefusedBefore {
        /// The module file.
        path: String,
        /// Why it was refused then.
        message: String,
    },
    /// The guest's calls at its `max-concurrency` would not fit in what the other loaded
    /// guests left of the instance pool ([`super::pool::pool_units`]).
    #[error(
        "guest {guest} needs {needs} units of the instance pool ({calls} calls of {per_call}: limits.max-concurrency x the larger of limits.instances and 16 per memory) but the other guests reserve {reserved} of {total}; lower its max-concurrency or instances"
    )]
    Pool {
        /// The guest's name.
        guest: String,
        /// Units its calls hold at their caps.
        needs: u64,
        /// Its max-concurrency.
        calls: usize,
        /// Units per call.
        per_call: u32,
        /// Units the other loaded guests reserve.
        reserved: u64,
        /// Units in the pool.
        total: u32,
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
    /// The guest tried to hold more descriptors open than its grant allows.
    Descriptors,
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
            FaultKind::Descriptors => "descriptors",
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
    #[error("guest {guest} returned a volume the host refused: {}", printable(.message))]
    Rejected {
        /// The guest's name.
        guest: String,
        /// Why.
        message: String,
    },
    /// The host refused to make the call: what it would act on lies outside the guest's
    /// current grants (a volume to delete whose storage its grant no longer covers).
    #[error("the host refused to call guest {guest}: {}", printable(.message))]
    Refused {
        /// The guest's name.
        guest: String,
        /// Why.
        message: String,
    },
    /// The guest trapped, ran out of time or memory.
    #[error("guest {guest} failed ({}): {}", .kind.as_str(), printable(.message))]
    Fault {
        /// The guest's name.
        guest: String,
        /// What kind of fault.
        kind: FaultKind,
        /// Details, including captured stderr when there is any.
        message: String,
    },
}

impl CallError {
    /// The guest's typed error as it enters the host, its text made [`printable`] once here:
    /// every log line, event and condition built from it later (a transient or reschedule
    /// message goes into an event as it is) is safe to show.
    pub(super) fn guest(guest: &str, error: ProvisionError) -> CallError {
        let escape = |m: String| printable(&m).into_owned();
        let error = match error {
            ProvisionError::Final(m) => ProvisionError::Final(escape(m)),
            ProvisionError::Transient(m) => ProvisionError::Transient(escape(m)),
            ProvisionError::Ignored(m) => ProvisionError::Ignored(escape(m)),
            ProvisionError::Reschedule(m) => ProvisionError::Reschedule(escape(m)),
            ProvisionError::InBackground(m) => ProvisionError::InBackground(escape(m)),
        };
        CallError::Guest {
            guest: guest.to_string(),
            error,
        }
    }
}

pub(super) fn describe_guest_error(error: &ProvisionError) -> String {
    match error {
        ProvisionError::Final(m) => format!("a final error: {}", printable(m)),
        ProvisionError::Transient(m) => format!("a transient error: {}", printable(m)),
        ProvisionError::Ignored(m) => format!("ignored: {}", printable(m)),
        ProvisionError::Reschedule(m) => format!("reschedule: {}", printable(m)),
        ProvisionError::InBackground(m) => format!("in background: {}", printable(m)),
    }
}

/// The metric label of a typed guest error.
pub(super) fn error_label(error: &ProvisionError) -> &'static str {
    match error {
        ProvisionError::Final(_) => "final",
        ProvisionError::Transient(_) => "transient",
        ProvisionError::Ignored(_) => "ignored",
        ProvisionError::Reschedule(_) => "reschedule",
        ProvisionError::InBackground(_) => "in-background",
    }
}
