//! Kubernetes events with the Go library's reasons, published on claims and volumes.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};

/// Normal: provisioning started.
pub const PROVISIONING: &str = "Provisioning";
/// Normal: the PV was created.
pub const PROVISIONING_SUCCEEDED: &str = "ProvisioningSucceeded";
/// Warning: a provision attempt failed.
pub const PROVISIONING_FAILED: &str = "ProvisioningFailed";
/// Warning: the asset of a PV that could not be saved could not be deleted either.
pub const PROVISIONING_CLEANUP_FAILED: &str = "ProvisioningCleanupFailed";
/// Warning: deleting a volume's storage failed.
pub const VOLUME_FAILED_DELETE: &str = "VolumeFailedDelete";
/// Normal: a volume's storage was deleted.
pub const VOLUME_DELETED: &str = "VolumeDeleted";
/// Warning: the failure threshold was reached; no more attempts until the spec changes.
pub const GIVEN_UP: &str = "ProvisioningGivenUp";
/// Warning: the volume's deletion was given up.
pub const DELETE_GIVEN_UP: &str = "DeletionGivenUp";
/// Warning: the claim's guest is not loaded now (unloaded or refused on reload); it waits.
pub const WAITING_FOR_GUEST: &str = "WaitingForGuest";
/// Normal: the claim was deleted while provisioning and its storage was cleaned up.
pub const PROVISIONING_ABANDONED: &str = "ProvisioningAbandoned";

/// Publishes an event; a failure to publish is logged, never fatal.
pub async fn publish(
    recorder: &Recorder,
    reference: &ObjectReference,
    warning: bool,
    reason: &str,
    action: &str,
    note: String,
) {
    let event = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_string(),
        note: Some(truncate(note, 1024)),
        action: action.to_string(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, reference).await {
        tracing::warn!(%error, reason, "could not publish event");
    }
}

/// Cuts `s` to at most `max` bytes (the API server counts bytes), ellipsis included.
fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max - '…'.len_utf8();
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_to_the_byte_limit_with_the_ellipsis_inside_it() {
        let cut = truncate("é".repeat(700), 1024);
        assert!(cut.len() <= 1024 && cut.ends_with('…'), "{}", cut.len());
        assert_eq!(truncate("short".into(), 1024), "short");
    }
}
