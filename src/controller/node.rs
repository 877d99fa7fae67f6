//! Node-local deployment (`--node-deployment`): one instance per node, each serving only the
//! claims and volumes of its own node, for guests that keep storage on a node's disk.
//!
//! The decisions ("is this claim for my node?", "which node is this PV pinned to?", "has that
//! node been gone long enough?") are pure functions with table tests; [`NodeState`] is the small
//! amount of memory the claim and volume reconciles share (node cache, when a node was first seen
//! missing, when to compete for an immediate-binding claim).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::Store;

use super::decide;
use super::gate::Mode;

/// The node label hostPath/local volumes are usually pinned with.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// The node field a `matchFields` term can pin with.
pub const NAME_FIELD: &str = "metadata.name";
/// StorageClass annotation: `"false"` keeps node instances from picking a node for the class's
/// immediate-binding claims (they are then left to a central deployment).
pub const ANN_NODE_IMMEDIATE: &str = "wasm-provisioner.dev/node-immediate-binding";

/// The `--node-deployment*` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSettings {
    /// This instance's node (`--node-name`, `NODE_NAME`).
    pub name: String,
    /// Shortest wait before competing for an immediate-binding claim.
    pub base_delay: Duration,
    /// Longest such wait.
    pub max_delay: Duration,
    /// Whether node instances pick nodes for immediate-binding claims at all.
    pub immediate_binding: bool,
    /// How long a PV's node must be missing before the PV is deleted without cleanup.
    pub gone_grace: Duration,
}

/// The leader-election mode node mode runs with: one whole-controller leader would leave every
/// other node unserved, so `leader` becomes off; per-claim leases still guard two instances on
/// one node (a rolling update with surge).
pub fn election_mode(requested: Mode, node_mode: bool) -> Mode {
    match (requested, node_mode) {
        (Mode::Leader, true) => Mode::Off,
        (mode, _) => mode,
    }
}

/// Who should provision a claim in node mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOwner {
    /// Its selected node is this node.
    Mine,
    /// Its selected node is another node.
    OtherNode,
    /// No node selected (immediate binding): compete to pick this node.
    Compete,
    /// No node selected and the class (or `--node-deployment-immediate-binding=false`) opts out.
    OptedOut,
}

/// Whether the class lets node instances pick a node for its immediate-binding claims.
pub fn class_allows_immediate(class: &StorageClass) -> bool {
    class
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANN_NODE_IMMEDIATE))
        .is_none_or(|v| v.trim() != "false")
}

/// Is this claim for my node? Only asked for claims [`decide::should_provision`] accepted, so a
/// claim without a selected node has an immediate-binding class.
pub fn claim_owner(
    pvc: &PersistentVolumeClaim,
    class: &StorageClass,
    me: &str,
    immediate_binding: bool,
) -> ClaimOwner {
    match decide::selected_node(pvc) {
        Some(node) if node == me => ClaimOwner::Mine,
        Some(_) => ClaimOwner::OtherNode,
        None if immediate_binding && class_allows_immediate(class) => ClaimOwner::Compete,
        None => ClaimOwner::OptedOut,
    }
}

/// Whether this node finishes a deleted claim that still carries our finalizer. In node mode the
/// finalizer is only ever added by the claim's selected node (immediate claims get one picked
/// first), so that node alone may have storage for it.
pub fn cleans_up_deleted_claim(pvc: &PersistentVolumeClaim, me: &str) -> bool {
    decide::selected_node(pvc) == Some(me)
}

/// How a PV names the one node it lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin<'a> {
    /// `matchFields: metadata.name In [name]`.
    Name(&'a str),
    /// `matchExpressions: kubernetes.io/hostname In [value]`.
    Hostname(&'a str),
}

/// The one node a PV's required node affinity pins it to: every term must name exactly one node,
/// the same one, by name or hostname label. Anything broader (zones, several nodes, no affinity)
/// is not node-local storage, and no node instance owns it.
pub fn pinned_node(pv: &PersistentVolume) -> Option<Pin<'_>> {
    let terms = &pv
        .spec
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required
        .as_ref()?
        .node_selector_terms;
    let mut pin = None;
    for term in terms {
        let by_field = term.match_fields.iter().flatten().find_map(|r| {
            (r.key == NAME_FIELD && r.operator == "In")
                .then(|| single(&r.values))
                .flatten()
                .map(Pin::Name)
        });
        let by_label = term.match_expressions.iter().flatten().find_map(|r| {
            (r.key == HOSTNAME_LABEL && r.operator == "In")
                .then(|| single(&r.values))
                .flatten()
                .map(Pin::Hostname)
        });
        let this = by_field.or(by_label)?;
        match pin {
            None => pin = Some(this),
            Some(earlier) if same_node(earlier, this) => {}
            Some(_) => return None,
        }
    }
    pin
}

fn single(values: &Option<Vec<String>>) -> Option<&str> {
    match values.as_deref() {
        Some([one]) if !one.is_empty() => Some(one.as_str()),
        _ => None,
    }
}

fn same_node(a: Pin<'_>, b: Pin<'_>) -> bool {
    let value = |p: Pin<'_>| match p {
        Pin::Name(v) | Pin::Hostname(v) => v.to_string(),
    };
    value(a) == value(b)
}

/// Whether a node (its name and `kubernetes.io/hostname` label) is the one a pin names. A node
/// without the label is matched by name, as the kubelet defaults the label to the node name.
pub fn pin_matches(pin: Pin<'_>, name: &str, hostname: Option<&str>) -> bool {
    match pin {
        Pin::Name(v) => v == name,
        Pin::Hostname(v) => hostname.unwrap_or(name) == v,
    }
}

/// Who should delete a PV in node mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeOwner {
    /// Pinned to this node.
    Mine,
    /// Pinned to another node that exists.
    OtherNode,
    /// Not pinned to one node: not node-local storage.
    NotPinned,
    /// Pinned to a node that does not exist (any instance may delete the PV, without cleanup).
    NodeGone(String),
}

/// Whose PV is this? `me` is my node's name and hostname label; `exists` says whether any node
/// in the cache matches a pin.
pub fn volume_owner(
    pv: &PersistentVolume,
    me: (&str, Option<&str>),
    exists: impl Fn(Pin<'_>) -> bool,
) -> VolumeOwner {
    let Some(pin) = pinned_node(pv) else {
        return VolumeOwner::NotPinned;
    };
    if pin_matches(pin, me.0, me.1) {
        VolumeOwner::Mine
    } else if exists(pin) {
        VolumeOwner::OtherNode
    } else {
        let (Pin::Name(node) | Pin::Hostname(node)) = pin;
        VolumeOwner::NodeGone(node.to_string())
    }
}

/// How much longer to wait before a node missing since `since` counts as gone (None: it does).
pub fn gone_wait(since: Instant, now: Instant, grace: Duration) -> Option<Duration> {
    let missing = now.saturating_duration_since(since);
    (missing < grace).then(|| grace - missing)
}

/// The randomised wait before competing for an immediate-binding claim: `unit` (in [0, 1)) picks
/// a point between `base` and `max`, so instances rarely try at the same moment.
pub fn compete_delay(base: Duration, max: Duration, unit: f64) -> Duration {
    let spread = max.saturating_sub(base);
    base + spread.mul_f64(unit.clamp(0.0, 1.0))
}

/// What the node-mode reconciles share.
pub struct NodeState {
    /// The settings.
    pub settings: NodeSettings,
    /// Node metadata cache (name and labels are all node mode reads).
    pub nodes: Store<PartialObjectMeta<Node>>,
    /// Node names (or hostname values) first seen missing, and when.
    missing_since: Mutex<HashMap<String, Instant>>,
    /// Claim UIDs this instance will compete for, and from when.
    compete_at: Mutex<HashMap<String, Instant>>,
}

impl NodeState {
    /// State over a node cache.
    pub fn new(settings: NodeSettings, nodes: Store<PartialObjectMeta<Node>>) -> NodeState {
        NodeState {
            settings,
            nodes,
            missing_since: Mutex::new(HashMap::new()),
            compete_at: Mutex::new(HashMap::new()),
        }
    }

    /// My node's `kubernetes.io/hostname` label, from the cache.
    fn my_hostname(&self) -> Option<String> {
        self.nodes
            .state()
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(&self.settings.name))
            .and_then(|n| n.metadata.labels.as_ref()?.get(HOSTNAME_LABEL).cloned())
    }

    /// Whether a node matching `pin` is in the cache.
    pub fn exists(&self, pin: Pin<'_>) -> bool {
        self.nodes.state().iter().any(|n| {
            let name = n.metadata.name.as_deref().unwrap_or_default();
            let hostname = n
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(HOSTNAME_LABEL))
                .map(String::as_str);
            pin_matches(pin, name, hostname)
        })
    }

    /// [`claim_owner`] with this instance's settings.
    pub fn claim_owner(&self, pvc: &PersistentVolumeClaim, class: &StorageClass) -> ClaimOwner {
        claim_owner(
            pvc,
            class,
            &self.settings.name,
            self.settings.immediate_binding,
        )
    }

    /// [`volume_owner`] against the node cache; forgets missing marks of nodes that came back.
    pub fn volume_owner(&self, pv: &PersistentVolume) -> VolumeOwner {
        let hostname = self.my_hostname();
        let owner = volume_owner(pv, (&self.settings.name, hostname.as_deref()), |pin| {
            self.exists(pin)
        });
        if let (VolumeOwner::OtherNode | VolumeOwner::Mine, Some(pin)) = (&owner, pinned_node(pv)) {
            let (Pin::Name(node) | Pin::Hostname(node)) = pin;
            self.missing_since.lock().expect("lock").remove(node);
        }
        owner
    }

    /// How much longer before `node` counts as gone; the first call marks it missing from now.
    pub fn gone_wait(&self, node: &str) -> Option<Duration> {
        let now = Instant::now();
        let since = *self
            .missing_since
            .lock()
            .expect("lock")
            .entry(node.to_string())
            .or_insert(now);
        gone_wait(since, now, self.settings.gone_grace)
    }

    /// Forgets that `node` was missing (it exists after all).
    pub fn node_seen(&self, node: &str) {
        self.missing_since.lock().expect("lock").remove(node);
    }

    /// How much longer to wait before competing for claim `uid`; the first call draws the delay.
    pub fn compete_wait(&self, uid: &str) -> Option<Duration> {
        let now = Instant::now();
        let mut at = self.compete_at.lock().expect("lock");
        // Claims bound or deleted elsewhere leave entries behind: drop the long-expired ones.
        let keep = self.settings.max_delay * 10 + Duration::from_secs(60);
        at.retain(|_, t| now.saturating_duration_since(*t) < keep);
        let when = *at.entry(uid.to_string()).or_insert_with(|| {
            now + compete_delay(
                self.settings.base_delay,
                self.settings.max_delay,
                rand::random::<f64>(),
            )
        });
        let wait = when.saturating_duration_since(now);
        (!wait.is_zero()).then_some(wait)
    }

    /// Forgets a claim's competition (it has a node now).
    pub fn compete_done(&self, uid: &str) {
        self.compete_at.lock().expect("lock").remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(selected: Option<&str>) -> PersistentVolumeClaim {
        let mut anns = serde_json::Map::new();
        if let Some(node) = selected {
            anns.insert(decide::ANN_SELECTED_NODE.into(), json!(node));
        }
        serde_json::from_value(json!({"metadata": {"name": "c", "annotations": anns}})).unwrap()
    }

    fn class(opt: Option<&str>) -> StorageClass {
        let mut anns = serde_json::Map::new();
        if let Some(v) = opt {
            anns.insert(ANN_NODE_IMMEDIATE.into(), json!(v));
        }
        serde_json::from_value(
            json!({"metadata": {"name": "sc", "annotations": anns}, "provisioner": "p"}),
        )
        .unwrap()
    }

    #[test]
    fn claim_owner_table() {
        use ClaimOwner::*;
        let cases = [
            (Some("n1"), None, true, Mine),
            (Some("n2"), None, true, OtherNode),
            (Some("n2"), Some("false"), true, OtherNode),
            (None, None, true, Compete),
            (None, Some("true"), true, Compete),
            (None, Some("false"), true, OptedOut),
            (None, Some(" false "), true, OptedOut),
            (None, None, false, OptedOut),
            (Some("n1"), None, false, Mine),
        ];
        for (selected, opt, immediate, want) in cases {
            assert_eq!(
                claim_owner(&claim(selected), &class(opt), "n1", immediate),
                want,
                "selected {selected:?}, class opt-out {opt:?}, immediate {immediate}"
            );
        }
    }

    #[test]
    fn only_the_selected_node_finishes_a_deleted_claim() {
        assert!(cleans_up_deleted_claim(&claim(Some("n1")), "n1"));
        assert!(!cleans_up_deleted_claim(&claim(Some("n2")), "n1"));
        assert!(!cleans_up_deleted_claim(&claim(None), "n1"));
    }

    fn pv(affinity: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": "pv"},
            "spec": {"nodeAffinity": {"required": {"nodeSelectorTerms": affinity}}}
        }))
        .unwrap()
    }

    fn host_in(values: &[&str]) -> serde_json::Value {
        json!({"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": values}]})
    }

    #[test]
    fn pinned_node_table() {
        let name_field =
            json!({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]});
        let zone = json!({"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z"]}]});
        let not_in = json!({"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "NotIn", "values": ["n1"]}]});
        let cases = [
            (json!([host_in(&["n1"])]), Some(Pin::Hostname("n1"))),
            (json!([name_field.clone()]), Some(Pin::Name("n1"))),
            (
                json!([host_in(&["n1"]), name_field]),
                Some(Pin::Hostname("n1")),
            ),
            (
                json!([host_in(&["n1"]), host_in(&["n1"])]),
                Some(Pin::Hostname("n1")),
            ),
            (json!([host_in(&["n1"]), host_in(&["n2"])]), None),
            (json!([host_in(&["n1", "n2"])]), None),
            (json!([host_in(&[""])]), None),
            (json!([host_in(&["n1"]), zone.clone()]), None),
            (json!([zone]), None),
            (json!([not_in]), None),
            (json!([]), None),
        ];
        for (terms, want) in cases {
            assert_eq!(pinned_node(&pv(terms.clone())), want, "{terms}");
        }
        let no_affinity: PersistentVolume =
            serde_json::from_value(json!({"metadata": {"name": "pv"}, "spec": {}})).unwrap();
        assert_eq!(pinned_node(&no_affinity), None);
    }

    #[test]
    fn volume_owner_table() {
        let on = |node: &str| pv(json!([host_in(&[node])]));
        let nodes = ["n1", "n2"];
        let exists = |pin: Pin<'_>| nodes.iter().any(|n| pin_matches(pin, n, None));
        assert_eq!(
            volume_owner(&on("n1"), ("n1", None), exists),
            VolumeOwner::Mine
        );
        assert_eq!(
            volume_owner(&on("n2"), ("n1", None), exists),
            VolumeOwner::OtherNode
        );
        assert_eq!(
            volume_owner(&on("n3"), ("n1", None), exists),
            VolumeOwner::NodeGone("n3".into())
        );
        // Hostname label differing from the node name (some clouds): the label is what counts.
        assert_eq!(
            volume_owner(&on("ip-10-0-0-1"), ("n1", Some("ip-10-0-0-1")), exists),
            VolumeOwner::Mine
        );
        assert_eq!(
            volume_owner(&pv(json!([])), ("n1", None), exists),
            VolumeOwner::NotPinned
        );
    }

    #[test]
    fn gone_wait_counts_down_to_none() {
        let grace = Duration::from_secs(300);
        let since = Instant::now();
        assert_eq!(gone_wait(since, since, grace), Some(grace));
        assert_eq!(
            gone_wait(since, since + Duration::from_secs(100), grace),
            Some(Duration::from_secs(200))
        );
        assert_eq!(gone_wait(since, since + grace, grace), None);
        assert_eq!(gone_wait(since, since + grace * 2, grace), None);
        // A clock reading before `since` (never with Instant, but harmless) waits the full grace.
        assert_eq!(gone_wait(since + grace, since, grace), Some(grace));
    }

    #[test]
    fn compete_delay_spans_base_to_max() {
        let (base, max) = (Duration::from_secs(20), Duration::from_secs(60));
        assert_eq!(compete_delay(base, max, 0.0), base);
        assert_eq!(compete_delay(base, max, 0.5), Duration::from_secs(40));
        assert_eq!(compete_delay(base, max, 1.0), max);
        assert_eq!(compete_delay(base, max, 7.0), max);
        // max below base: the base alone.
        assert_eq!(compete_delay(max, base, 0.5), max);
    }

    #[test]
    fn node_mode_turns_the_whole_controller_leader_off_only() {
        assert_eq!(election_mode(Mode::Leader, true), Mode::Off);
        assert_eq!(election_mode(Mode::PerClaim, true), Mode::PerClaim);
        assert_eq!(election_mode(Mode::Off, true), Mode::Off);
        assert_eq!(election_mode(Mode::Leader, false), Mode::Leader);
    }

    #[test]
    fn class_opt_out_is_only_false() {
        assert!(class_allows_immediate(&class(None)));
        assert!(class_allows_immediate(&class(Some("yes"))));
        assert!(!class_allows_immediate(&class(Some("false"))));
    }
}
