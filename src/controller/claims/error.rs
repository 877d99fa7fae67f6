//! Why a claim reconcile did not finish, and how each reason counts toward giving up.

use crate::controller::bookkeeping::Failure;
use crate::controller::convert::ConvertError;
use crate::controller::gate::GateError;
use crate::controller::storage::StorageError;
use crate::controller::storage::intent::IntentError;
use crate::wasm::CallError;

/// Why a claim reconcile did not finish.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The claim's class is not in the cache (yet).
    #[error("storageclass.storage.k8s.io {0:?} not found")]
    ClassNotFound(String),
    /// The claim a clone copies cannot be copied (missing, unbound, elsewhere, another class
    /// or provisioner, being deleted).
    #[error("{0}")]
    Source(String),
    /// The guest failed for good (final error, fault or a refused volume).
    #[error(transparent)]
    Guest(CallError),
    /// The guest asked to be retried.
    #[error("{0}")]
    Transient(String),
    /// The guest is still working in the background.
    #[error("provisioning in background: {0}")]
    InBackground(String),
    /// The PV could not be created; its storage was deleted again.
    #[error("creating PV {pv}: {source}")]
    CreatePv {
        /// The PV name.
        pv: String,
        /// The last API error.
        #[source]
        source: kube::Error,
    },
    /// The PV could not be created and its storage could not be deleted either.
    #[error("cleaning up storage of PV {pv} failed: {source}")]
    Cleanup {
        /// The PV name.
        pv: String,
        /// Why the delete failed.
        #[source]
        source: StorageError,
    },
    /// The claim cannot be expressed in the contract.
    #[error("the claim cannot be provisioned as written: {0}")]
    Convert(#[from] ConvertError),
    /// An API request failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The whole operation ran past `--provision-timeout`.
    #[error("provisioning did not finish within {0:?}")]
    Timeout(std::time::Duration),
    /// The claim has no UID (never from a real API server).
    #[error("claim has no uid")]
    NoUid,
    /// This replica may not write now (not the leader, or another replica holds the claim).
    #[error(transparent)]
    Gate(#[from] GateError),
    /// The intent could not be recorded, so the guest was not called.
    #[error(transparent)]
    Intent(#[from] IntentError),
}

impl From<StorageError> for ClaimError {
    fn from(error: StorageError) -> Self {
        match error {
            StorageError::Convert(error) => ClaimError::Convert(error),
            StorageError::Guest(error) => ClaimError::Guest(error),
            StorageError::Kube(error) => ClaimError::Kube(error),
            StorageError::Gate(error) => ClaimError::Gate(error),
            StorageError::Intent(error) => ClaimError::Intent(error),
        }
    }
}

impl Failure for ClaimError {
    fn gate_refusal(&self) -> Option<&GateError> {
        match self {
            ClaimError::Gate(gate) => Some(gate),
            _ => None,
        }
    }

    fn counts(&self) -> bool {
        !matches!(
            self,
            ClaimError::Transient(_) | ClaimError::InBackground(_) | ClaimError::Gate(_)
        )
    }

    fn label(&self) -> &'static str {
        match self {
            ClaimError::ClassNotFound(_) => "class-not-found",
            ClaimError::Source(_) => "clone-source",
            ClaimError::Guest(CallError::Fault { kind, .. }) => kind.as_str(),
            ClaimError::Guest(CallError::Rejected { .. } | CallError::Refused { .. }) => "rejected",
            ClaimError::Guest(CallError::Guest { .. }) => "final",
            ClaimError::Transient(_) => "transient",
            ClaimError::InBackground(_) => "in-background",
            ClaimError::CreatePv { .. } => "create-pv",
            ClaimError::Cleanup { .. } => "cleanup",
            ClaimError::Convert(_) => "invalid-claim",
            ClaimError::Kube(_) => "api",
            ClaimError::Timeout(_) => "timeout",
            ClaimError::NoUid => "invalid-claim",
            ClaimError::Gate(_) => "not-leader",
            ClaimError::Intent(_) => "intent",
        }
    }

    fn timed_out(after: std::time::Duration) -> Self {
        ClaimError::Timeout(after)
    }
}
