//! Every series the metrics handle records into: names, help texts, labels and buckets, which
//! dashboards built for the Go library and component-base read; registered once in one registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::Queue;

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
pub(super) struct ClaimLabels {
    pub(super) class: String,
    pub(super) source: String,
}

/// `class`: the library's delete label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct VolumeLabels {
    pub(super) class: String,
}

/// `name`: which work queue (`claims` or `volumes`), as in component-base.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct QueueLabels {
    pub(super) name: String,
}

impl QueueLabels {
    pub(super) fn of(queue: Queue) -> QueueLabels {
        QueueLabels {
            name: queue.as_str().into(),
        }
    }
}

/// `controller`, `kind`: why a reconcile failed (the error's `label()`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ErrorLabels {
    pub(super) controller: String,
    pub(super) kind: String,
}

/// `guest`, `operation`, `outcome` of one guest call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct CallLabels {
    pub(super) guest: String,
    pub(super) operation: String,
    pub(super) outcome: String,
}

/// `guest`, `operation` for call durations.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct CallDurationLabels {
    pub(super) guest: String,
    pub(super) operation: String,
}

/// `guest`, `kind` of a fault.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct FaultLabels {
    pub(super) guest: String,
    pub(super) kind: String,
}

/// `event`: load, reload, rejection or unload of a plugin.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PluginEventLabels {
    pub(super) event: &'static str,
}

/// `guest`, `warning` of a guest loaded despite a warning about its grant.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PluginWarningLabels {
    pub(super) guest: String,
    pub(super) warning: &'static str,
}

/// `name`: the lease (component-base's label).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct LeaderLabels {
    pub(super) name: String,
}

fn go_histogram() -> Histogram {
    Histogram::new(GO_DEFAULT_BUCKETS)
}

fn guest_histogram() -> Histogram {
    Histogram::new(GUEST_CALL_BUCKETS)
}

/// Every series in one registry, as dashboards read them.
pub(super) struct Series {
    pub(super) registry: Registry,
    pub(super) provision_total: Family<ClaimLabels, Counter>,
    pub(super) provision_failed_total: Family<ClaimLabels, Counter>,
    pub(super) provision_duration: Family<ClaimLabels, Histogram, fn() -> Histogram>,
    pub(super) delete_total: Family<VolumeLabels, Counter>,
    pub(super) delete_failed_total: Family<VolumeLabels, Counter>,
    pub(super) delete_duration: Family<VolumeLabels, Histogram, fn() -> Histogram>,
    pub(super) expand_total: Family<VolumeLabels, Counter>,
    pub(super) expand_failed_total: Family<VolumeLabels, Counter>,
    pub(super) reconcile_errors: Family<ErrorLabels, Counter>,
    pub(super) queue_depth: Family<QueueLabels, Gauge>,
    pub(super) queue_adds: Family<QueueLabels, Counter>,
    pub(super) queue_retries: Family<QueueLabels, Counter>,
    pub(super) queue_work_duration: Family<QueueLabels, Histogram, fn() -> Histogram>,
    pub(super) in_flight: Family<QueueLabels, Gauge>,
    pub(super) leader: Family<LeaderLabels, Gauge>,
    pub(super) guests_loaded: Gauge,
    pub(super) guests_compiling: Gauge,
    pub(super) guest_calls: Family<CallLabels, Counter>,
    pub(super) guest_call_duration: Family<CallDurationLabels, Histogram, fn() -> Histogram>,
    pub(super) guest_faults: Family<FaultLabels, Counter>,
    pub(super) plugin_events: Family<PluginEventLabels, Counter>,
    pub(super) plugin_warnings: Family<PluginWarningLabels, Counter>,
}

impl Series {
    /// A fresh registry with every series registered.
    pub(super) fn register() -> Series {
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
        let expand_total = Family::<VolumeLabels, Counter>::default();
        let expand_failed_total = Family::<VolumeLabels, Counter>::default();
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
            // Not the Go library's (it cannot expand): the same shape for claims that grew.
            lib.register(
                "persistentvolumeclaim_expand",
                "Total number of claims whose volumes were grown successfully.",
                expand_total.clone(),
            );
            lib.register(
                "persistentvolumeclaim_expand_failed",
                "Total number of failed attempts to grow a claim's volume.",
                expand_failed_total.clone(),
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
                "Guests loaded despite a warning about their grant, by guest and warning (node-filesystem: a read-write directory on the filesystem of /, the kubelet or the container runtime; needs: the grant lacks something the module declares every claim needs).",
                plugin_warnings.clone(),
            );
            own.register(
                "guest_faults",
                "Guest calls that trapped, ran out of time or memory, by fault kind.",
                guest_faults.clone(),
            );
        }
        Series {
            registry,
            provision_total,
            provision_failed_total,
            provision_duration,
            delete_total,
            delete_failed_total,
            delete_duration,
            expand_total,
            expand_failed_total,
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
            plugin_events,
            plugin_warnings,
        }
    }
}
