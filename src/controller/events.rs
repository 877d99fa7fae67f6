//! Kubernetes events with the Go library's reasons, published on claims and volumes.

use k8s_openapi::api::core::v1::{Event as CoreEvent, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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
/// Warning: storage an intent-log entry names was kept: something live still names it, or
/// nothing says it is ours to delete.
pub const STORAGE_KEPT: &str = "StorageKept";
/// Warning: the claim's guest is not loaded now (unloaded or refused on reload); it waits.
pub const WAITING_FOR_GUEST: &str = "WaitingForGuest";
/// Normal: the claim was deleted while provisioning and its storage was cleaned up.
pub const PROVISIONING_ABANDONED: &str = "ProvisioningAbandoned";
/// Normal: the claim's data source is an external populator's kind; it is left to it.
pub const LEFT_TO_POPULATOR: &str = "LeftToPopulator";
/// Normal: node mode picked this instance's node for an immediate-binding claim.
pub const NODE_SELECTED: &str = "NodeSelected";
/// Warning: a Released PV's node no longer exists; the PV was deleted without cleaning up.
pub const DELETED_NODE_GONE: &str = "VolumeDeletedNodeGone";
/// Normal: growing a claim's volume started (the CSI external-resizer's reason).
pub const RESIZING: &str = "Resizing";
/// Normal: a claim's volume was grown and its new capacity written (the resizer's reason).
pub const RESIZE_SUCCESSFUL: &str = "VolumeResizeSuccessful";
/// Warning: growing a claim's volume failed, or its class cannot grow (the resizer's reason).
pub const RESIZE_FAILED: &str = "VolumeResizeFailed";
/// Warning: the growth of a claim's volume was given up until the claim changes.
pub const EXPANSION_GIVEN_UP: &str = "ExpansionGivenUp";
/// Normal, on the Lease: a replica became leader or stopped leading (client-go's reason).
pub const LEADER_ELECTION: &str = "LeaderElection";

/// An event's type, as kube-runtime's `EventType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Something went as it should.
    Normal,
    /// Something an operator may need to look at.
    Warning,
}

impl EventType {
    /// The Event's `type` field.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// What the controller was doing when it reported an event: the Event's `action`. Recorders
/// fold repeats with the same reason and action on one object into one series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventAction {
    /// The provision path (claims).
    Provision,
    /// The delete path (volumes) and recovery's storage deletes.
    Delete,
    /// Growing a claim's volume.
    Expand,
    /// This replica took the lease.
    BecameLeader,
    /// This replica let the lease go.
    StoppedLeading,
}

impl EventAction {
    /// The Event's `action` field.
    pub fn as_str(self) -> &'static str {
        match self {
            EventAction::Provision => "Provision",
            EventAction::Delete => "Delete",
            EventAction::Expand => "Expand",
            EventAction::BecameLeader => "BecameLeader",
            EventAction::StoppedLeading => "StoppedLeading",
        }
    }
}

/// One event to publish, in the manner of kube-runtime's `Event`: its type, its reason (one of
/// this module's constants), a note for people and the action it reports on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub type_: EventType,
    /// The PascalCase reason.
    pub reason: &'static str,
    /// The human-readable message.
    pub note: String,
    /// What the controller was doing.
    pub action: EventAction,
}

impl Event {
    /// A `Normal` event.
    pub fn normal(reason: &'static str, action: EventAction, note: String) -> Event {
        Event {
            type_: EventType::Normal,
            reason,
            note,
            action,
        }
    }

    /// A `Warning` event.
    pub fn warning(reason: &'static str, action: EventAction, note: String) -> Event {
        Event {
            type_: EventType::Warning,
            reason,
            note,
            action,
        }
    }
}

/// Publishes core/v1 Events, as client-go's recorder does. kube-runtime's recorder writes
/// events.k8s.io/v1 Events into `default` for cluster-scoped objects, which API servers before
/// 1.22 reject for PVs ("involvedObject.namespace does not match event.namespace").
///
/// Events are written by one background worker with its own request budget (as client-go's event
/// broadcaster does), so reporting never slows provisioning down or eats its API budget. The
/// queue in front of it is bounded ([`QUEUE_CAPACITY`]): a storm of events beyond what the budget
/// can write is dropped and counted, never held in memory or written minutes late.
///
/// Like client-go's correlator, an event that repeats (same object, type, reason and message
/// within [`SERIES_WINDOW`]) is not written again: the first one's `count` is patched instead.
///
/// The recorder does not check the write gate: callers publish through their reconcile's
/// [`super::handle::Handle`], which does.
#[derive(Clone)]
pub struct Recorder {
    component: String,
    instance: Option<String>,
    queue: tokio::sync::mpsc::Sender<Job>,
    state: Arc<QueueState>,
    series: Arc<Mutex<HashMap<SeriesKey, Series>>>,
}

/// How long a repeated event is folded into the first one.
const SERIES_WINDOW: Duration = Duration::from_secs(10 * 60);
/// Series remembered at most (folding is an optimisation; beyond this, events are written whole).
const SERIES_CAPACITY: usize = 4096;
/// Events waiting for the writer at most; more are dropped (and counted).
pub const QUEUE_CAPACITY: usize = 1024;

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

/// One write for the worker, and who waits for it.
struct Job {
    write: Write,
    done: Option<tokio::sync::oneshot::Sender<()>>,
}

/// One event to write. A repeat (`repeat`) patches the first event's count and time instead;
/// when that event is gone (its create dropped from a full queue or failed, or its TTL passed),
/// the repeat is created whole under the series' name, as client-go's recorder does.
struct Write {
    event: Box<CoreEvent>,
    repeat: bool,
}

/// What the queue holds and has dropped, for flushing and for tests.
#[derive(Default)]
struct QueueState {
    pending: AtomicUsize,
    dropped: AtomicU64,
    drained: tokio::sync::Notify,
}

impl Recorder {
    /// A recorder reporting as `component` (and `instance`, the replica); starts its writer on
    /// the current runtime. The writer ends when the last clone of the recorder is dropped.
    pub fn new(client: Client, component: String, instance: Option<String>) -> Recorder {
        let (queue, jobs) = tokio::sync::mpsc::channel(QUEUE_CAPACITY);
        let state = Arc::new(QueueState::default());
        tokio::spawn(write_events(
            client,
            RateLimiter::new(EVENT_QPS, EVENT_BURST),
            jobs,
            state.clone(),
        ));
        Recorder {
            component,
            instance,
            queue,
            state,
            series: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Queues an event; a full queue drops it (counted in [`Recorder::dropped`]).
    pub fn publish(&self, reference: &ObjectReference, event: Event) {
        let write = self.prepare(reference, event);
        self.enqueue(Job { write, done: None });
    }

    /// [`Recorder::publish`], returning only once the event is written: for events sent right
    /// before the process exits (a replica releasing its lease on SIGTERM).
    pub async fn publish_and_wait(&self, reference: &ObjectReference, event: Event) {
        let write = self.prepare(reference, event);
        let (done, written) = tokio::sync::oneshot::channel();
        if self.enqueue(Job {
            write,
            done: Some(done),
        }) {
            let _ = written.await;
        }
    }

    /// Waits until every queued event is written, at most `grace`: on shutdown.
    pub async fn flush(&self, grace: Duration) {
        let drained = async {
            loop {
                let notified = self.state.drained.notified();
                if self.state.pending.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(grace, drained).await.is_err() {
            tracing::warn!(
                pending = self.queued(),
                "events still queued at exit were not written"
            );
        }
    }

    /// Events queued and not yet written.
    pub fn queued(&self) -> usize {
        self.state.pending.load(Ordering::SeqCst)
    }

    /// Events dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.state.dropped.load(Ordering::SeqCst)
    }

    /// Series remembered for folding repeats.
    pub fn series_len(&self) -> usize {
        self.series.lock().expect("event series lock").len()
    }

    fn enqueue(&self, job: Job) -> bool {
        self.state.pending.fetch_add(1, Ordering::SeqCst);
        match self.queue.try_send(job) {
            Ok(()) => true,
            Err(error) => {
                self.state.pending.fetch_sub(1, Ordering::SeqCst);
                let dropped = self.state.dropped.fetch_add(1, Ordering::SeqCst) + 1;
                if dropped.is_power_of_two() {
                    tracing::warn!(dropped, %error, "event queue full: dropping events");
                }
                false
            }
        }
    }

    fn prepare(
        &self,
        reference: &ObjectReference,
        Event {
            type_,
            reason,
            note,
            action,
        }: Event,
    ) -> Write {
        let now = Time(Timestamp::now());
        let namespace = reference
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let object = reference.name.clone().unwrap_or_default();
        let stamp = now.0.as_nanosecond();
        let event = CoreEvent {
            metadata: ObjectMeta {
                name: Some(format!("{object}.{stamp:x}")),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: reference.clone(),
            reason: Some(reason.to_string()),
            message: Some(truncate(note, 1024)),
            type_: Some(type_.as_str().to_string()),
            action: Some(action.as_str().to_string()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            source: Some(EventSource {
                component: Some(self.component.clone()),
                host: self.instance.clone(),
            }),
            reporting_component: Some(self.component.clone()),
            reporting_instance: self.instance.clone(),
            ..Default::default()
        };
        let key: SeriesKey = (
            reference.uid.clone().unwrap_or_default(),
            event.type_.clone().unwrap_or_default(),
            reason.to_string(),
            event.message.clone().unwrap_or_default(),
        );
        let mut series = self.series.lock().expect("event series lock");
        series.retain(|_, s| s.first_seen.elapsed() < SERIES_WINDOW);
        if let Some(s) = series.get_mut(&key) {
            s.count += 1;
            let mut event = event;
            event.metadata.namespace = Some(s.namespace.clone());
            event.metadata.name = Some(s.name.clone());
            event.count = Some(s.count);
            return Write {
                event: Box::new(event),
                repeat: true,
            };
        }
        if series.len() < SERIES_CAPACITY {
            series.insert(
                key,
                Series {
                    namespace: namespace.clone(),
                    name: event.metadata.name.clone().unwrap_or_default(),
                    count: 1,
                    first_seen: std::time::Instant::now(),
                },
            );
        }
        Write {
            event: Box::new(event),
            repeat: false,
        }
    }
}

/// The one writer: takes queued events in order, each within the event budget.
async fn write_events(
    client: Client,
    budget: RateLimiter,
    mut jobs: tokio::sync::mpsc::Receiver<Job>,
    state: Arc<QueueState>,
) {
    while let Some(job) = jobs.recv().await {
        budget.acquire().await;
        let result = write(&client, job.write).await;
        if let Err(error) = result {
            tracing::warn!(%error, "could not publish event");
        }
        if let Some(done) = job.done {
            let _ = done.send(());
        }
        if state.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            state.drained.notify_waiters();
        }
    }
}

/// Creates the event, or for a repeat patches the first one's count and time (creating the
/// repeat whole when the first is gone).
async fn write(client: &Client, Write { event, repeat }: Write) -> kube::Result<()> {
    let namespace = event.metadata.namespace.as_deref().unwrap_or_default();
    let events = Api::<CoreEvent>::namespaced(client.clone(), namespace);
    if repeat {
        let name = event.metadata.name.as_deref().unwrap_or_default();
        let patch = json!({ "count": event.count, "lastTimestamp": event.last_timestamp });
        match events
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Err(kube::Error::Api(status)) if status.is_not_found() => {}
            patched => return patched.map(|_| ()),
        }
    }
    events
        .create(&PostParams::default(), &event)
        .await
        .map(|_| ())
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
