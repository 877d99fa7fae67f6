//! What the claim path hands a guest (its request) and how it warns on a claim.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Resource;

use super::ClaimError;
use crate::controller::convert;
use crate::controller::decide;
use crate::controller::handle::Handle;
use crate::wasm::Guest;
use crate::wasm::bindings::types::ProvisionRequest;

/// The guest's request for a claim.
pub(crate) fn provision_request(
    pvc: &PersistentVolumeClaim,
    class: &StorageClass,
    guest: &Guest,
    pv_name: &str,
) -> Result<ProvisionRequest, ClaimError> {
    Ok(ProvisionRequest {
        pv_name: pv_name.to_string(),
        claim: convert::claim(pvc)?,
        storage_class: convert::storage_class(class),
        selected_node: decide::selected_node(pvc).map(str::to_string),
        config: guest.grants().config_json.clone(),
    })
}

/// A warning event on a claim.
pub(crate) fn warn_claim(
    handle: &Handle<'_>,
    pvc: &PersistentVolumeClaim,
    reason: &str,
    note: String,
) {
    handle.event(&pvc.object_ref(&()), true, reason, "Provision", note);
}
