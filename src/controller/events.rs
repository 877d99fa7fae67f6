//! Kubernetes events with the Go library's reasons, published on claims and volumes.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use super::ratelimit::RateLimiter;

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
/// Normal: node mode picked this instance's node for an immediate-binding claim.
pub const NODE_SELECTED: &str = "NodeSelected";
/// Warning: a Released PV's node no longer exists; the PV was deleted without cleaning up.
pub const DELETED_NODE_GONE: &str = "VolumeDeletedNodeGone";
/// Normal, on the Lease: a replica became leader or stopped leading (client-go's reason).
pub const LEADER_ELECTION: &str = "LeaderElection";

/// Publishes core/v1 Events, as client-go's recorder does. kube-runtime's recorder writes
/// events.k8s.io/v1 Events into `default` for cluster-scoped objects, which API servers before
/// 1.22 reject for PVs ("involvedObject.namespace does not match event.namespace").
///
/// Events are written in the background with their own request budget (as client-go's event
/// broadcaster does), so reporting never slows provisioning down or eats its API budget.
///
/// Like client-go's correlator, an event that repeats (same object, type, reason and message
/// within [`SERIES_WINDOW`]) is not written again: the first one's `count` is patched instead.
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    component: String,
    instance: Option<String>,
    budget: Arc<RateLimiter>,
    series: Arc<Mutex<HashMap<SeriesKey, Series>>>,
}

/// How long a repeated event is folded into the first one.
const SERIES_WINDOW: Duration = Duration::from_secs(10 * 60);

/// Object UID, type, reason, message.
type SeriesKey = (String, String, String, String);

#[derive(Clone)]
struct Series {
    namespace: String,
    name: String,
    count: i32,
    first_seen: std::time::Instant,
}

/// Event writes per second, and burst, independent of `--kube-api-qps`.
const EVENT_QPS: f64 = 10.0;
const EVENT_BURST: u32 = 50;

impl Recorder {
    /// A recorder reporting as `component` (and `instance`, the replica).
    pub fn new(client: Client, component: String, instance: Option<String>) -> Recorder {
        Recorder {
            client,
            component,
            instance,
            budget: Arc::new(RateLimiter::new(EVENT_QPS, EVENT_BURST)),
            series: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// Publishes an event unless the write gate is closed; a failure to publish is logged, never fatal.
pub async fn publish(
    recorder: &Recorder,
    reference: &ObjectReference,
    warning: bool,
    reason: &str,
    action: &str,
    note: String,
) {
    publish_inner(recorder, reference, warning, reason, action, note, false).await;
}

/// [`publish`], returning only once the event is written: for events sent right before the
/// process exits (a replica releasing its lease on SIGTERM), which a background write would lose.
pub async fn publish_and_wait(
    recorder: &Recorder,
    reference: &ObjectReference,
    warning: bool,
    reason: &str,
    action: &str,
    note: String,
) {
    publish_inner(recorder, reference, warning, reason, action, note, true).await;
}

async fn publish_inner(
    recorder: &Recorder,
    reference: &ObjectReference,
    warning: bool,
    reason: &str,
    action: &str,
    note: String,
    wait: bool,
) {
    if !super::gate::may_write_now() {
        tracing::debug!(reason, "not publishing: this replica may not write now");
        return;
    }
    let now = Time(Timestamp::now());
    let namespace = reference
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let object = reference.name.clone().unwrap_or_default();
    let stamp = now.0.as_nanosecond();
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{object}.{stamp:x}")),
            namespace: Some(namespace.clone()),
            ..Default::default()
        },
        involved_object: reference.clone(),
        reason: Some(reason.to_string()),
        message: Some(truncate(note, 1024)),
        type_: Some(if warning { "Warning" } else { "Normal" }.to_string()),
        action: Some(action.to_string()),
        count: Some(1),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        source: Some(EventSource {
            component: Some(recorder.component.clone()),
            host: recorder.instance.clone(),
        }),
        reporting_component: Some(recorder.component.clone()),
        reporting_instance: recorder.instance.clone(),
        ..Default::default()
    };
    let key: SeriesKey = (
        reference.uid.clone().unwrap_or_default(),
        event.type_.clone().unwrap_or_default(),
        reason.to_string(),
        event.message.clone().unwrap_or_default(),
    );
    let repeat = {
        let mut series = recorder.series.lock().expect("event series lock");
        series.retain(|_, s| s.first_seen.elapsed() < SERIES_WINDOW);
        match series.get_mut(&key) {
            Some(s) => {
                s.count += 1;
                Some(s.clone())
            }
            None => {
                series.insert(
                    key,
                    Series {
                        namespace: namespace.clone(),
                        name: event.metadata.name.clone().unwrap_or_default(),
                        count: 1,
                        first_seen: std::time::Instant::now(),
                    },
                );
                None
            }
        }
    };
    let budget = recorder.budget.clone();
    let client = recorder.client.clone();
    let reason = reason.to_string();
    let write = tokio::spawn(async move {
        budget.acquire().await;
        let result = match repeat {
            None => Api::<Event>::namespaced(client, &namespace)
                .create(&PostParams::default(), &event)
                .await
                .map(|_| ()),
            Some(series) => {
                let patch = json!({ "count": series.count, "lastTimestamp": event.last_timestamp });
                Api::<Event>::namespaced(client, &series.namespace)
                    .patch(&series.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ())
            }
        };
        if let Err(error) = result {
            tracing::warn!(%error, reason, "could not publish event");
        }
    });
    if wait {
        let _ = write.await;
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
