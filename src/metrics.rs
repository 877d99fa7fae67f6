//! Prometheus metrics in one registry: the Go library's series, work queues, leadership, guests.
//!
//! The provision/delete series keep the exact names and labels of
//! `sig-storage-lib-external-provisioner` (`controller/metrics/metrics.go`), so dashboards built
//! for it keep working. The work-queue and leader series follow `k8s.io/component-base`'s names.
//! A [`Metrics`] handle is cheap to clone and is passed down (controller context, wasm engine);
//! nothing here is global, so tests can read a private registry.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Go's `prometheus.DefBuckets`, which the library's duration histograms use.
const GO_DEFAULT_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Guest calls range from sub-millisecond hooks to the 30 s default deadline.
const GUEST_CALL_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0,
];

/// `class`, `source`: the library's provision labels (`source` = `spec.dataSource.kind`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    class: String,
    source: String,
}

/// `class`: the library's delete label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VolumeLabels {
    class: String,
}

/// `name`: which work queue (`claims` or `volumes`), as in component-base.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    name: String,
}

impl QueueLabels {
    fn of(queue: Queue) -> QueueLabels {
        QueueLabels {
            name: queue.as_str().into(),
        }
    }
}

/// `controller`, `kind`: why a reconcile failed (the error's `label()`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    controller: String,
    kind: String,
}

/// `guest`, `operation`, `outcome` of one guest call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    guest: String,
    operation: String,
    outcome: String,
}

/// `guest`, `operation` for call durations.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallDurationLabels {
    guest: String,
    operation: String,
}

/// `guest`, `kind` of a fault.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    guest: String,
    kind: String,
}

/// `event`: load, reload, rejection or unload of a plugin.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginEventLabels {
    event: &'static str,
}

/// `guest`, `warning` of a guest loaded despite a warning about its grant.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginWarningLabels {
    guest: String,
    warning: &'static str,
}

/// `name`: the lease (component-base's label).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaderLabels {
    name: String,
}

fn go_histogram() -> Histogram {
    Histogram::new(GO_DEFAULT_BUCKETS)
}

fn guest_histogram() -> Histogram {
    Histogram::new(GUEST_CALL_BUCKETS)
}

/// Which work queue a series is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queue {
    /// The provision path, keyed by claim.
    Claims,
    /// The delete path, keyed by PV name.
    Volumes,
}

impl Queue {
    fn as_str(self) -> &'static str {
        match self {
            Queue::Claims => "claims",
            Queue::Volumes => "volumes",
        }
    }
}

struct Inner {
    registry: Registry,
    provision_total: Family<ClaimLabels, Counter>,
    provision_failed_total: Family<ClaimLabels, Counter>,
    provision_duration: Family<ClaimLabels, Histogram, fn() -> Histogram>,
    delete_total: Family<VolumeLabels, Counter>,
    delete_failed_total: Family<VolumeLabels, Counter>,
    delete_duration: Family<VolumeLabels, Histogram, fn() -> Histogram>,
    reconcile_errors: Family<ErrorLabels, Counter>,
    queue_depth: Family<QueueLabels, Gauge>,
    queue_adds: Family<QueueLabels, Counter>,
    queue_retries: Family<QueueLabels, Counter>,
    queue_work_duration: Family<QueueLabels, Histogram, fn() -> Histogram>,
    in_flight: Family<QueueLabels, Gauge>,
    leader: Family<LeaderLabels, Gauge>,
    guests_loaded: Gauge,
    guests_compiling: Gauge,
    guest_calls: Family<CallLabels, Counter>,
    guest_call_duration: Family<CallDurationLabels, Histogram, fn() -> Histogram>,
    guest_faults: Family<FaultLabels, Counter>,
    /// Keys with a retry scheduled, per queue: the part of the queue we can observe.
    waiting: Mutex<[HashSet<String>; 2]>,
    plugin_events: Family<PluginEventLabels, Counter>,
    plugin_counts_seen: Mutex<[u64; 4]>,
    plugin_warnings: Family<PluginWarningLabels, Counter>,
    ready: AtomicBool,
}

/// The metrics handle: clone it freely; all clones share one registry.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A fresh registry with every series registered.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let provision_total = Family::<ClaimLabels, Counter>::default();
        let provision_failed_total = Family::<ClaimLabels, Counter>::default();
        let provision_duration =
            Family::<ClaimLabels, Histogram, fn() -> Histogram>::new_with_constructor(go_histogram);
        let delete_total = Family::<VolumeLabels, Counter>::default();
        let delete_failed_total = Family::<VolumeLabels, Counter>::default();
        let delete_duration =
            Family::<VolumeLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                go_histogram,
            );
        {
            // The Go library's subsystem is `controller`.
            let lib = registry.sub_registry_with_prefix("controller");
            lib.register(
                "persistentvolumeclaim_provision",
                "Total number of persistent volumes provisioned successfully.",
                provision_total.clone(),
            );
            lib.register(
                "persistentvolumeclaim_provision_failed",
                "Total number of persistent volume provision failed attempts.",
                provision_failed_total.clone(),
            );
            lib.register(
                "persistentvolumeclaim_provision_duration_seconds",
                "Latency in seconds to provision persistent volumes. Failed provisioning attempts are ignored.",
                provision_duration.clone(),
            );
            lib.register(
                "persistentvolume_delete",
                "Total number of persistent volumes deleted successfully.",
                delete_total.clone(),
            );
            lib.register(
                "persistentvolume_delete_failed",
                "Total number of persistent volume delete failed attempts.",
                delete_failed_total.clone(),
            );
            lib.register(
                "persistentvolume_delete_duration_seconds",
                "Latency in seconds to delete persistent volumes. Failed deletion attempts are ignored.",
                delete_duration.clone(),
            );
        }
        let queue_depth = Family::<QueueLabels, Gauge>::default();
        let queue_adds = Family::<QueueLabels, Counter>::default();
        let queue_retries = Family::<QueueLabels, Counter>::default();
        let queue_work_duration =
            Family::<QueueLabels, Histogram, fn() -> Histogram>::new_with_constructor(go_histogram);
        {
            let queue = registry.sub_registry_with_prefix("workqueue");
            queue.register(
                "depth",
                "Objects waiting for a scheduled retry or parked for a turn (kube-runtime does not expose its queue).",
                queue_depth.clone(),
            );
            queue.register(
                "adds",
                "Reconciles started (watch events, resyncs and retries).",
                queue_adds.clone(),
            );
            queue.register(
                "retries",
                "Retries scheduled after a failed reconcile.",
                queue_retries.clone(),
            );
            queue.register(
                "work_duration_seconds",
                "How long one reconcile takes.",
                queue_work_duration.clone(),
            );
        }
        let leader = Family::<LeaderLabels, Gauge>::default();
        registry.register(
            "leader_election_master_status",
            "1 while this replica holds the lease, 0 otherwise.",
            leader.clone(),
        );
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let in_flight = Family::<QueueLabels, Gauge>::default();
        let guests_loaded = Gauge::default();
        let guests_compiling = Gauge::default();
        let guest_calls = Family::<CallLabels, Counter>::default();
        let guest_call_duration =
            Family::<CallDurationLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                guest_histogram,
            );
        let guest_faults = Family::<FaultLabels, Counter>::default();
        let plugin_events = Family::<PluginEventLabels, Counter>::default();
        let plugin_warnings = Family::<PluginWarningLabels, Counter>::default();
        {
            let own = registry.sub_registry_with_prefix("wasm_provisioner");
            own.register(
                "reconcile_errors",
                "Failed reconciles by controller and error kind (the kind in the log line).",
                reconcile_errors.clone(),
            );
            own.register(
                "reconciles_in_flight",
                "Reconciles running now.",
                in_flight.clone(),
            );
            own.register(
                "guests_loaded",
                "Guests loaded from the plugins directory.",
                guests_loaded.clone(),
            );
            own.register(
                "guests_compiling",
                "Modules of the plugins directory waiting for their compile in the background (neither served nor refused yet).",
                guests_compiling.clone(),
            );
            own.register(
                "guest_calls",
                "Calls into guests by operation and outcome (ok, a typed error, or a fault kind).",
                guest_calls.clone(),
            );
            own.register(
                "guest_call_duration_seconds",
                "Wall-clock time of guest calls, waiting for a concurrency slot excluded.",
                guest_call_duration.clone(),
            );
            own.register(
                "plugin_events",
                "Plugins directory changes: guests loaded, reloaded (new version), rejected, unloaded.",
                plugin_events.clone(),
            );
            own.register(
                "plugin_warnings",
                "Guests loaded despite a warning about their grant, by guest and warning (node-filesystem: a read-write directory on the filesystem of /, the kubelet or the container runtime).",
                plugin_warnings.clone(),
            );
            own.register(
                "guest_faults",
                "Guest calls that trapped, ran out of time or memory, by fault kind.",
                guest_faults.clone(),
            );
        }
        Metrics {
            inner: Arc::new(Inner {
                registry,
                provision_total,
                provision_failed_total,
                provision_duration,
                delete_total,
                delete_failed_total,
                delete_duration,
                reconcile_errors,
                queue_depth,
                queue_adds,
                queue_retries,
                queue_work_duration,
                in_flight,
                leader,
                guests_loaded,
                guests_compiling,
                guest_calls,
                guest_call_duration,
                guest_faults,
                waiting: Mutex::new([HashSet::new(), HashSet::new()]),
                plugin_events,
                plugin_counts_seen: Mutex::new([0; 4]),
                plugin_warnings,
                ready: AtomicBool::new(false),
            }),
        }
    }

    /// The exposition text (OpenMetrics text format).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.inner.registry);
        text
    }

    /// A claim was provisioned: the PV exists.
    pub fn provision_succeeded(&self, class: &str, source: &str, took: Duration) {
        let labels = ClaimLabels {
            class: class.into(),
            source: source.into(),
        };
        self.inner.provision_total.get_or_create(&labels).inc();
        self.inner
            .provision_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// A provision attempt failed with an error of kind `kind`.
    pub fn provision_failed(&self, class: &str, source: &str, kind: &str) {
        let labels = ClaimLabels {
            class: class.into(),
            source: source.into(),
        };
        self.inner
            .provision_failed_total
            .get_or_create(&labels)
            .inc();
        self.reconcile_error(Queue::Claims, kind);
    }

    /// A volume's storage and PV were deleted.
    pub fn delete_succeeded(&self, class: &str, took: Duration) {
        let labels = VolumeLabels {
            class: class.into(),
        };
        self.inner.delete_total.get_or_create(&labels).inc();
        self.inner
            .delete_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// A delete attempt failed with an error of kind `kind`.
    pub fn delete_failed(&self, class: &str, kind: &str) {
        let labels = VolumeLabels {
            class: class.into(),
        };
        self.inner.delete_failed_total.get_or_create(&labels).inc();
        self.reconcile_error(Queue::Volumes, kind);
    }

    fn reconcile_error(&self, queue: Queue, kind: &str) {
        self.inner
            .reconcile_errors
            .get_or_create(&ErrorLabels {
                controller: queue.as_str().into(),
                kind: kind.into(),
            })
            .inc();
    }

    /// A reconcile of `key` starts; the returned guard records its duration when dropped.
    pub fn reconcile_started(&self, queue: Queue, key: &str) -> ReconcileGuard {
        let labels = QueueLabels::of(queue);
        self.inner.queue_adds.get_or_create(&labels).inc();
        self.inner.in_flight.get_or_create(&labels).inc();
        let mut waiting = self.inner.waiting.lock().expect("metrics lock");
        if waiting[queue as usize].remove(key) {
            self.inner.queue_depth.get_or_create(&labels).dec();
        }
        ReconcileGuard {
            metrics: self.clone(),
            labels,
            started: std::time::Instant::now(),
        }
    }

    /// A retry of `key` was scheduled after a failure.
    pub fn retry_scheduled(&self, queue: Queue, key: &str) {
        let labels = QueueLabels::of(queue);
        self.inner.queue_retries.get_or_create(&labels).inc();
        self.parked(queue, key);
    }

    /// `key` waits in a queue of ours (parked for a turn, or for a retry): counted in
    /// the depth until its next reconcile starts.
    pub fn parked(&self, queue: Queue, key: &str) {
        let mut waiting = self.inner.waiting.lock().expect("metrics lock");
        if waiting[queue as usize].insert(key.to_string()) {
            self.inner
                .queue_depth
                .get_or_create(&QueueLabels::of(queue))
                .inc();
        }
    }

    /// Drops waiting keys (a retry, or parked) of objects that no longer exist: their next
    /// reconcile never comes.
    pub fn retain_waiting(&self, queue: Queue, alive: impl Fn(&str) -> bool) {
        let labels = QueueLabels::of(queue);
        let mut waiting = self.inner.waiting.lock().expect("metrics lock");
        let before = waiting[queue as usize].len();
        waiting[queue as usize].retain(|key| alive(key));
        let gone = before - waiting[queue as usize].len();
        if gone > 0 {
            self.inner
                .queue_depth
                .get_or_create(&labels)
                .dec_by(i64::try_from(gone).unwrap_or(i64::MAX));
        }
    }

    /// Keys waiting in `queue`: a retry scheduled, or parked for a turn (`workqueue_depth`).
    pub fn waiting(&self, queue: Queue) -> usize {
        self.inner.waiting.lock().expect("metrics lock")[queue as usize].len()
    }

    /// Retries scheduled in `queue` so far (`workqueue_retries_total`).
    pub fn retries(&self, queue: Queue) -> u64 {
        let labels = QueueLabels::of(queue);
        self.inner.queue_retries.get_or_create(&labels).get()
    }

    /// Whether this replica leads (`lease` = the lease name). For the leader-election module.
    pub fn leader(&self, lease: &str, leading: bool) {
        self.inner
            .leader
            .get_or_create(&LeaderLabels { name: lease.into() })
            .set(i64::from(leading));
    }

    /// The plugins loader's running totals (loads, reloads, rejections, unloads); counters
    /// advance by what changed since the last call.
    pub fn plugin_counts(&self, totals: [u64; 4]) {
        let mut seen = self
            .inner
            .plugin_counts_seen
            .lock()
            .expect("plugin counts lock");
        for (i, event) in ["load", "reload", "rejection", "unload"]
            .into_iter()
            .enumerate()
        {
            let delta = totals[i].saturating_sub(seen[i]);
            if delta > 0 {
                self.inner
                    .plugin_events
                    .get_or_create(&PluginEventLabels { event })
                    .inc_by(delta);
            }
            seen[i] = seen[i].max(totals[i]);
        }
    }

    /// A guest was loaded (or reloaded) despite `warning` about its grant.
    pub fn plugin_warning(&self, guest: &str, warning: &'static str) {
        self.inner
            .plugin_warnings
            .get_or_create(&PluginWarningLabels {
                guest: guest.to_string(),
                warning,
            })
            .inc();
    }

    /// How many guests serve now (set on load and reload).
    pub fn guests_loaded(&self, count: usize) {
        self.inner
            .guests_loaded
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// How many modules wait for their compile (set on load and reload).
    pub fn guests_compiling(&self, count: usize) {
        self.inner
            .guests_compiling
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// One guest call finished. `outcome` is `ok`, a typed error or a fault kind; `fault` is
    /// set when the call trapped.
    pub fn guest_call(
        &self,
        guest: &str,
        operation: &str,
        outcome: &str,
        fault: bool,
        took: Duration,
    ) {
        self.inner
            .guest_calls
            .get_or_create(&CallLabels {
                guest: guest.into(),
                operation: operation.into(),
                outcome: outcome.into(),
            })
            .inc();
        self.inner
            .guest_call_duration
            .get_or_create(&CallDurationLabels {
                guest: guest.into(),
                operation: operation.into(),
            })
            .observe(took.as_secs_f64());
        if fault {
            self.inner
                .guest_faults
                .get_or_create(&FaultLabels {
                    guest: guest.into(),
                    kind: outcome.into(),
                })
                .inc();
        }
    }

    /// Marks the process ready (caches synced, guests loaded) or not.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::SeqCst);
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
    }
}

/// Records a reconcile's duration and in-flight count when it ends (also on cancellation).
pub struct ReconcileGuard {
    metrics: Metrics,
    labels: QueueLabels,
    started: std::time::Instant,
}

impl ReconcileGuard {
    /// Time since the reconcile started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for ReconcileGuard {
    fn drop(&mut self) {
        let inner = &self.metrics.inner;
        inner.in_flight.get_or_create(&self.labels).dec();
        inner
            .queue_work_duration
            .get_or_create(&self.labels)
            .observe(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(prefix))
    }

    #[test]
    fn library_series_keep_their_go_names_and_labels() {
        let m = Metrics::new();
        m.provision_succeeded("fast", "", Duration::from_millis(30));
        m.provision_failed("fast", "PersistentVolumeClaim", "final");
        m.delete_succeeded("fast", Duration::from_millis(20));
        m.delete_failed("slow", "api");
        let text = m.encode();
        assert_eq!(
            line(&text, "controller_persistentvolumeclaim_provision_total{"),
            Some(r#"controller_persistentvolumeclaim_provision_total{class="fast",source=""} 1"#)
        );
        assert!(text.contains(r#"controller_persistentvolumeclaim_provision_failed_total{class="fast",source="PersistentVolumeClaim"} 1"#), "{text}");
        assert!(text.contains(r#"controller_persistentvolumeclaim_provision_duration_seconds_bucket{le="0.05",class="fast",source=""} 1"#), "{text}");
        assert!(text.contains(r#"controller_persistentvolume_delete_total{class="fast"} 1"#));
        assert!(
            text.contains(r#"controller_persistentvolume_delete_failed_total{class="slow"} 1"#)
        );
        assert!(text.contains(
            r#"controller_persistentvolume_delete_duration_seconds_count{class="fast"} 1"#
        ));
        assert!(text.contains(
            r#"wasm_provisioner_reconcile_errors_total{controller="claims",kind="final"} 1"#
        ));
        assert!(text.contains(
            r#"wasm_provisioner_reconcile_errors_total{controller="volumes",kind="api"} 1"#
        ));
    }

    #[test]
    fn depth_counts_each_waiting_key_once_until_it_runs() {
        let m = Metrics::new();
        m.retry_scheduled(Queue::Claims, "a");
        m.retry_scheduled(Queue::Claims, "a");
        m.retry_scheduled(Queue::Claims, "b");
        assert!(m.encode().contains(r#"workqueue_depth{name="claims"} 2"#));
        assert!(
            m.encode()
                .contains(r#"workqueue_retries_total{name="claims"} 3"#)
        );
        {
            let _guard = m.reconcile_started(Queue::Claims, "a");
            let text = m.encode();
            assert!(
                text.contains(r#"workqueue_depth{name="claims"} 1"#),
                "{text}"
            );
            assert!(text.contains(r#"wasm_provisioner_reconciles_in_flight{name="claims"} 1"#));
        }
        let text = m.encode();
        assert!(text.contains(r#"wasm_provisioner_reconciles_in_flight{name="claims"} 0"#));
        assert!(text.contains(r#"workqueue_adds_total{name="claims"} 1"#));
        assert!(text.contains(r#"workqueue_work_duration_seconds_count{name="claims"} 1"#));
    }

    #[test]
    fn guest_calls_faults_leader_and_readiness() {
        let m = Metrics::new();
        m.guest_call(
            "hostpath",
            "provision",
            "ok",
            false,
            Duration::from_millis(2),
        );
        m.guest_call(
            "hostpath",
            "provision",
            "deadline",
            true,
            Duration::from_secs(1),
        );
        m.leader("wasm-provisioner", true);
        m.guests_loaded(2);
        let text = m.encode();
        assert!(text.contains(r#"wasm_provisioner_guest_calls_total{guest="hostpath",operation="provision",outcome="ok"} 1"#));
        assert!(text.contains(
            r#"wasm_provisioner_guest_faults_total{guest="hostpath",kind="deadline"} 1"#
        ));
        assert!(text.contains(r#"wasm_provisioner_guest_call_duration_seconds_count{guest="hostpath",operation="provision"} 2"#));
        assert!(text.contains(r#"leader_election_master_status{name="wasm-provisioner"} 1"#));
        assert!(text.contains("wasm_provisioner_guests_loaded 2"));
        assert!(!m.is_ready());
        m.set_ready(true);
        assert!(m.is_ready());
    }
}
