//! The storage protocol: what a guest is asked, in which order, to build a claim's storage and
//! to delete a volume's, and what each answer means; with the durable record of what may need
//! deleting ([`intent`]), each path's entries in it ([`claim_entry`], [`volume_entry`]) and what
//! becomes of an entry nobody is working on ([`recovery`]). One error type, [`StorageError`],
//! says why a step did not complete; the log keeps its own ([`intent::IntentError`]) inside it.
//!
//! The claim and volume paths, recovery and the offline commands all call guests through here,
//! so the sequence (capabilities, request, qualifier, provision; guard, delete) is written once.
//! Gating a call (this replica's lease) is the caller's: each step is one future to wrap. Which
//! claims and volumes are queued is each path's word, passed in: nothing here imports them.
//!
//! Nothing here ever asks a guest what it built in order to delete it: a delete is always of a
//! volume a guest call returned, or of a PV the cluster holds.

pub mod claim_entry;
pub mod intent;
pub mod recovery;
pub mod volume_entry;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;

use super::convert::{self, ConvertError, PvIdentity};
use super::decide;
use super::gate::GateError;
use crate::wasm::bindings::cloning::CloneSource;
use crate::wasm::bindings::types::{ProvisionError, ProvisionRequest};
use crate::wasm::capabilities::Capability;
use crate::wasm::{CallError, Guest};

/// Why a step of the protocol did not complete.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The claim or volume cannot be expressed in the contract.
    #[error(transparent)]
    Convert(#[from] ConvertError),
    /// The guest failed, refused, or was refused by the host.
    #[error(transparent)]
    Guest(#[from] CallError),
    /// An API request failed (recovery's live checks).
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// This replica may not write now.
    #[error(transparent)]
    Gate(#[from] GateError),
    /// An entry's new state could not be recorded.
    #[error(transparent)]
    Intent(#[from] intent::IntentError),
}

impl StorageError {
    /// The guest's message when it asks to be asked again later (transient, or still working in
    /// the background): not a failure of the storage.
    pub fn retry_later(&self) -> Option<&str> {
        match self {
            StorageError::Guest(CallError::Guest {
                error: ProvisionError::Transient(m) | ProvisionError::InBackground(m),
                ..
            }) => Some(m),
            _ => None,
        }
    }
}

/// Entries recorded ahead per intent write at most, for claims and for volumes each.
const AHEAD: usize = 64;

/// What a guest says before it is asked to build a claim's storage.
#[derive(Debug)]
pub enum Qualified {
    /// Ask it to build this.
    Ready(Box<ProvisionRequest>),
    /// The claim needs something the guest does not declare (a block volume, a selector).
    Unsupported(Capability),
    /// The guest's qualifier hook declines the claim.
    Declined,
}

/// What a guest is handed to build a claim's storage.
pub fn provision_request(
    pvc: &PersistentVolumeClaim,
    class: &StorageClass,
    guest: &Guest,
    pv_name: &str,
) -> Result<ProvisionRequest, ConvertError> {
    Ok(ProvisionRequest {
        pv_name: pv_name.to_string(),
        claim: convert::claim(pvc)?,
        storage_class: convert::storage_class(class),
        selected_node: decide::selected_node(pvc).map(str::to_string),
        config: guest.grants().config_json.clone(),
    })
}

/// The steps before building: the guest's capabilities (when the claim needs any: a block
/// volume, a selector), the request, the guest's qualifier.
pub async fn qualify(
    guest: &Guest,
    pvc: &PersistentVolumeClaim,
    class: &StorageClass,
    pv_name: &str,
) -> Result<Qualified, StorageError> {
    let needs = decide::claim_needs(pvc);
    if !needs.is_empty()
        && let Some(missing) = needs.first_missing(guest.capabilities().await?)
    {
        return Ok(Qualified::Unsupported(missing));
    }
    let request = provision_request(pvc, class, guest, pv_name)?;
    if !guest
        .should_provision(&request.claim, &request.storage_class)
        .await?
    {
        return Ok(Qualified::Declined);
    }
    Ok(Qualified::Ready(Box::new(request)))
}

/// Builds the storage (a copy of `source`'s, for a clone) and returns the PV that describes it
/// (not yet created).
pub async fn build(
    guest: &Guest,
    request: &ProvisionRequest,
    source: Option<&CloneSource>,
    identity: &PvIdentity<'_>,
) -> Result<PersistentVolume, CallError> {
    let built = match source {
        Some(source) => guest.provision_clone(request, source).await?,
        None => guest.provision(request).await?,
    };
    Ok(convert::persistent_volume(identity, &built))
}

/// The guest's deletion guard on a volume: `false` keeps its storage.
pub async fn guard(guest: &Guest, pv: &PersistentVolume) -> Result<bool, StorageError> {
    let volume = convert::volume(pv)?;
    Ok(guest.should_delete(&volume).await?)
}

/// How a storage delete ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deleted {
    /// The guest deleted it.
    Gone,
    /// The guest says it holds none of it (it ignored the volume), with its reason.
    NotHeld(String),
}

/// Deletes the storage `pv` describes: a PV the cluster held, or one a guest call returned.
pub async fn delete(
    guest: &Guest,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
) -> Result<Deleted, StorageError> {
    let request = convert::delete_request(pv, class, guest.grants().config_json.clone())?;
    match guest.delete(&request).await {
        Ok(()) => Ok(Deleted::Gone),
        Err(CallError::Guest {
            error: ProvisionError::Ignored(reason),
            ..
        }) => Ok(Deleted::NotHeld(reason)),
        Err(error) => Err(error.into()),
    }
}
