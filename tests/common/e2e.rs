//! The end-to-end fixture every `tests/e2e*.rs` builds its worlds on: one test's namespace and
//! provisioner name on the shared control plane, StorageClasses and claims that read like the spec
//! (`fx.class("fast").reclaim("Retain").create()`, `fx.claim("data").class(&fast).create()`), the
//! waits every test needs, and the provisioner processes, whose logs every failed wait quotes.
//!
//! A suite's own `World` holds a [`Fixture`] in `fx` and dereferences to it
//! ([`fixture_world!`](crate::fixture_world)), adding only what is its own (storage directories,
//! replicas, nodes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{
    ConfigMap, Event, Namespace, PersistentVolume, PersistentVolumeClaim,
};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use wp_harness::{ControlPlane, Process, wait_for};

/// `impl Deref<Target = Fixture>` for a suite's world that keeps its fixture in field `fx`.
#[macro_export]
macro_rules! fixture_world {
    ($world:ty) => {
        impl std::ops::Deref for $world {
            type Target = $crate::common::e2e::Fixture;

            fn deref(&self) -> &Self::Target {
                &self.fx
            }
        }
    };
}

/// How long a test waits for one thing to happen (a claim bound, a PV gone, an event).
pub const WAIT: Duration = Duration::from_secs(60);

/// The scheduler's annotation naming the node a WaitForFirstConsumer claim goes to.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";

/// How many lines of each provisioner log a failed wait quotes.
const LOG_TAIL: usize = 80;

/// One test's namespace, provisioner name and processes on the suite's control plane.
pub struct Fixture {
    pub cp: Arc<ControlPlane>,
    pub admin: Client,
    /// The test's short name, unique in its suite.
    pub name: String,
    /// `<suite>-<name>`: the namespace, and the prefix of every cluster-scoped name.
    pub ns: String,
    /// `<suite>.wasm-provisioner.dev/<name>`: the provisioner name the test's classes use.
    pub provisioner: String,
    /// Every process started through [`Fixture::spawn`]: (label, log file).
    logs: Mutex<Vec<(String, PathBuf)>>,
}

impl Fixture {
    /// Creates namespace `<suite>-<name>`.
    pub async fn new(cp: Arc<ControlPlane>, suite: &str, name: &str) -> anyhow::Result<Fixture> {
        let admin = cp.admin_client().await?;
        let ns = format!("{suite}-{name}");
        Api::<Namespace>::all(admin.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
            )
            .await
            .with_context(|| format!("create namespace {ns}"))?;
        Ok(Fixture {
            cp,
            admin,
            name: name.into(),
            provisioner: format!("{suite}.wasm-provisioner.dev/{name}"),
            ns,
            logs: Mutex::new(Vec::new()),
        })
    }

    pub fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.admin.clone(), &self.ns)
    }

    pub fn pvs(&self) -> Api<PersistentVolume> {
        Api::all(self.admin.clone())
    }

    /// A StorageClass `<ns>-<suffix>` for this test's provisioner: `Delete`, `Immediate`.
    pub fn class(&self, suffix: &str) -> ClassBuilder {
        let mut class = ClassBuilder::new(&format!("{}-{suffix}", self.ns), &self.provisioner);
        class.admin = Some(self.admin.clone());
        class
    }

    /// A claim in this test's namespace: 1Gi, ReadWriteOnce, filesystem.
    pub fn claim(&self, name: &str) -> ClaimBuilder {
        let mut claim = ClaimBuilder::new(name);
        claim.claims = Some(self.claims());
        claim
    }

    /// `wasm-provisioner run --plugins DIR --kubeconfig FILE` with fast retries and debug logs;
    /// callers add their flags, then [`Fixture::spawn`] it.
    pub fn provisioner_command(&self, plugins: &Path, kubeconfig: &Path) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"));
        cmd.args(["run", "--plugins"])
            .arg(plugins)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--retry-interval-start", "300ms"])
            .args(["--retry-interval-max", "2s"])
            .env("RUST_LOG", "info,wasm_provisioner=debug");
        cmd
    }

    /// Starts `cmd` with its log in the run dir as `<ns>-<label>-<n>.log`; failed waits quote it.
    pub fn spawn(&self, label: &str, cmd: Command) -> anyhow::Result<Process> {
        let mut logs = self.logs.lock().expect("logs");
        let path = self
            .cp
            .run_dir()
            .join(format!("{}-{label}-{}.log", self.ns, logs.len()));
        let process = Process::spawn(cmd, path.clone())?;
        logs.push((label.into(), path));
        Ok(process)
    }

    /// The last lines of every process this test started, for failure messages.
    pub fn logs(&self) -> String {
        self.logs
            .lock()
            .expect("logs")
            .iter()
            .map(|(label, path)| {
                let log = std::fs::read_to_string(path).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(LOG_TAIL)..].join("\n");
                format!("--- {label} ({}) ---\n{tail}", path.display())
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The intent logs of this test's provisioner, started as the suites start it (leases in
    /// namespace `wasm-provisioner`, named after the test's namespace).
    pub async fn intent_logs(&self) -> anyhow::Result<Vec<ConfigMap>> {
        let logs: Api<ConfigMap> = Api::namespaced(self.admin.clone(), "wasm-provisioner");
        let selector = format!("wasm-provisioner.dev/intents={}", self.ns);
        Ok(logs
            .list(&ListParams::default().labels(&selector))
            .await?
            .items)
    }

    /// Polls `check` until it yields, quoting the provisioner logs if it never does.
    pub async fn wait<T, F, Fut>(&self, what: &str, check: F) -> anyhow::Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = anyhow::Result<Option<T>>>,
    {
        wait_for(what, WAIT, check)
            .await
            .with_context(|| self.logs())
    }

    /// How many claims of this test's namespace are Bound.
    pub async fn bound_count(&self) -> anyhow::Result<usize> {
        Ok(self
            .claims()
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .count())
    }

    /// Waits until the claim is Bound and returns its PV.
    pub async fn wait_bound(&self, claim: &str) -> anyhow::Result<PersistentVolume> {
        let claims = self.claims();
        let volume = self
            .wait(&format!("claim {claim} Bound"), || async {
                let c = claims.get(claim).await?;
                let bound = c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
                Ok(bound.then(|| c.spec.and_then(|s| s.volume_name)).flatten())
            })
            .await?;
        Ok(self.pvs().get(&volume).await?)
    }

    pub async fn wait_pv(&self, pv: &str) -> anyhow::Result<PersistentVolume> {
        let pvs = self.pvs();
        self.wait(&format!("PV {pv}"), || async { Ok(pvs.get_opt(pv).await?) })
            .await
    }

    pub async fn wait_pv_phase(&self, pv: &str, phase: &str) -> anyhow::Result<()> {
        let pvs = self.pvs();
        self.wait(&format!("PV {pv} {phase}"), || async {
            let p = pvs.get(pv).await?;
            Ok((p.status.and_then(|s| s.phase).as_deref() == Some(phase)).then_some(()))
        })
        .await
    }

    pub async fn wait_pv_gone(&self, pv: &str) -> anyhow::Result<()> {
        let pvs = self.pvs();
        self.wait(&format!("PV {pv} deleted"), || async {
            Ok(pvs.get_opt(pv).await?.is_none().then_some(()))
        })
        .await
    }

    pub async fn wait_claim_gone(&self, claim: &str) -> anyhow::Result<()> {
        let claims = self.claims();
        self.wait(&format!("claim {claim} deleted"), || async {
            Ok(claims.get_opt(claim).await?.is_none().then_some(()))
        })
        .await
    }

    /// Waits until `path` exists (a guest's marker file, say).
    pub async fn wait_file(&self, what: &str, path: &Path) -> anyhow::Result<()> {
        self.wait(what, || async { Ok(path.exists().then_some(())) })
            .await
    }

    /// Polls a condition on this machine (a directory, a log line) until it holds. Storage is
    /// deleted just after its PV in intent-log mode, so "PV gone" is no proof of it.
    pub async fn wait_until(
        &self,
        what: &str,
        mut holds: impl FnMut() -> bool,
    ) -> anyhow::Result<()> {
        self.wait(what, || {
            let held = holds();
            async move { Ok(held.then_some(())) }
        })
        .await
    }

    /// Asks claim `claim` for `size` (a growth), as its user would.
    pub async fn resize(&self, claim: &str, size: &str) -> anyhow::Result<()> {
        let patch = json!({"spec": {"resources": {"requests": {"storage": size}}}});
        self.claims()
            .patch(claim, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("resize claim {claim} to {size}"))?;
        Ok(())
    }

    /// Waits until claim `claim`'s `status.capacity.storage` is `size`; returns the claim.
    pub async fn wait_capacity(
        &self,
        claim: &str,
        size: &str,
    ) -> anyhow::Result<PersistentVolumeClaim> {
        let claims = self.claims();
        self.wait(&format!("claim {claim} with capacity {size}"), || async {
            let c = claims.get(claim).await?;
            let capacity = c
                .status
                .as_ref()
                .and_then(|s| s.capacity.as_ref())
                .and_then(|c| c.get("storage"))
                .map(|q| q.0.clone());
            Ok((capacity.as_deref() == Some(size)).then_some(c))
        })
        .await
    }

    /// (reason, message) of every event about the object with this UID.
    pub async fn events(&self, uid: &str) -> anyhow::Result<Vec<(String, String)>> {
        let events: Api<Event> = Api::all(self.admin.clone());
        let list = events
            .list(&ListParams::default().fields(&format!("involvedObject.uid={uid}")))
            .await?;
        Ok(list
            .items
            .into_iter()
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
            .collect())
    }

    /// The reasons of every event about the object with this UID.
    pub async fn reasons(&self, uid: &str) -> anyhow::Result<Vec<String>> {
        Ok(self
            .events(uid)
            .await?
            .into_iter()
            .map(|(r, _)| r)
            .collect())
    }

    /// Waits for an event about the object with this UID with `reason` and a message containing
    /// every one of `contains`; returns the message.
    pub async fn wait_event(
        &self,
        uid: &str,
        reason: &str,
        contains: &[&str],
    ) -> anyhow::Result<String> {
        self.wait(&format!("event {reason} with {contains:?}"), || async {
            Ok(self.events(uid).await?.into_iter().find_map(|(r, m)| {
                (r == reason && contains.iter().all(|c| m.contains(c))).then_some(m)
            }))
        })
        .await
    }
}

/// A StorageClass: created on the control plane ([`Fixture::class`]) or built as an object
/// ([`ClassBuilder::new`], [`ClassBuilder::build`]) for the fake-API tests.
pub struct ClassBuilder {
    admin: Option<Client>,
    name: String,
    uid: Option<String>,
    provisioner: String,
    parameters: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    reclaim: String,
    binding: String,
    mount_options: Vec<String>,
    allow_expansion: Option<bool>,
}

impl ClassBuilder {
    /// Class `name` of `provisioner`: `Delete`, `Immediate`, no parameters.
    pub fn new(name: &str, provisioner: &str) -> ClassBuilder {
        ClassBuilder {
            admin: None,
            name: name.into(),
            uid: None,
            provisioner: provisioner.into(),
            parameters: BTreeMap::new(),
            annotations: BTreeMap::new(),
            reclaim: "Delete".into(),
            binding: "Immediate".into(),
            mount_options: Vec::new(),
            allow_expansion: None,
        }
    }

    /// `metadata.uid`, as the API server would set it (for objects that never reach one).
    pub fn uid(mut self, uid: &str) -> Self {
        self.uid = Some(uid.into());
        self
    }

    pub fn param(mut self, key: &str, value: &str) -> Self {
        self.parameters.insert(key.into(), value.into());
        self
    }

    pub fn params(self, params: &[(&str, &str)]) -> Self {
        params.iter().fold(self, |class, (k, v)| class.param(k, v))
    }

    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    pub fn reclaim(mut self, policy: &str) -> Self {
        self.reclaim = policy.into();
        self
    }

    /// `volumeBindingMode: WaitForFirstConsumer`.
    pub fn wait_for_first_consumer(self) -> Self {
        self.binding("WaitForFirstConsumer")
    }

    pub fn binding(mut self, mode: &str) -> Self {
        self.binding = mode.into();
        self
    }

    pub fn mount_options(mut self, options: &[&str]) -> Self {
        self.mount_options = options.iter().map(|o| o.to_string()).collect();
        self
    }

    /// `allowVolumeExpansion: true`.
    pub fn allow_expansion(mut self) -> Self {
        self.allow_expansion = Some(true);
        self
    }

    /// Serves another provisioner name than the test's own.
    pub fn provisioner(mut self, provisioner: &str) -> Self {
        self.provisioner = provisioner.into();
        self
    }

    /// The class as an object.
    pub fn build(&self) -> StorageClass {
        serde_json::from_value(json!({
            "metadata": {"name": self.name, "uid": self.uid, "annotations": self.annotations},
            "provisioner": self.provisioner,
            "parameters": self.parameters,
            "reclaimPolicy": self.reclaim,
            "volumeBindingMode": self.binding,
            "mountOptions": self.mount_options,
            "allowVolumeExpansion": self.allow_expansion,
        }))
        .expect("a StorageClass")
    }

    /// Creates the class and returns its name.
    pub async fn create(self) -> anyhow::Result<String> {
        let class = self.build();
        let admin = self
            .admin
            .context("a class built without a fixture is not created")?;
        Api::<StorageClass>::all(admin)
            .create(&PostParams::default(), &class)
            .await
            .with_context(|| format!("create StorageClass {}", self.name))?;
        Ok(self.name)
    }
}

/// A claim: created on the control plane ([`Fixture::claim`]) or built as an object
/// ([`ClaimBuilder::new`], [`ClaimBuilder::build`]) for the fake-API tests.
pub struct ClaimBuilder {
    claims: Option<Api<PersistentVolumeClaim>>,
    name: String,
    namespace: Option<String>,
    uid: Option<String>,
    class: Option<String>,
    size: String,
    block: bool,
    selector: Option<serde_json::Value>,
    data_source: Option<serde_json::Value>,
    annotations: BTreeMap<String, String>,
}

impl ClaimBuilder {
    /// Claim `name`: 1Gi, ReadWriteOnce, filesystem, no class.
    pub fn new(name: &str) -> ClaimBuilder {
        ClaimBuilder {
            claims: None,
            name: name.into(),
            namespace: None,
            uid: None,
            class: None,
            size: "1Gi".into(),
            block: false,
            selector: None,
            data_source: None,
            annotations: BTreeMap::new(),
        }
    }

    /// `metadata.namespace` and `metadata.uid`, as the API server would set them (for objects
    /// that never reach one).
    pub fn stored_as(mut self, namespace: &str, uid: &str) -> Self {
        self.namespace = Some(namespace.into());
        self.uid = Some(uid.into());
        self
    }

    pub fn class(mut self, class: &str) -> Self {
        self.class = Some(class.into());
        self
    }

    pub fn size(mut self, size: &str) -> Self {
        self.size = size.into();
        self
    }

    /// `spec.selector` matching `key=value`.
    pub fn selector(mut self, key: &str, value: &str) -> Self {
        self.selector = Some(json!({"matchLabels": {key: value}}));
        self
    }

    /// `spec.dataSource`: `kind` `name` of API group `group` ("" for the core group).
    pub fn data_source(mut self, group: &str, kind: &str, name: &str) -> Self {
        let group = (!group.is_empty()).then_some(group);
        self.data_source = Some(json!({"apiGroup": group, "kind": kind, "name": name}));
        self
    }

    /// `volumeMode: Block`.
    pub fn block(mut self) -> Self {
        self.block = true;
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    /// The scheduler's pick, as `volume.kubernetes.io/selected-node` (when `node` is some).
    pub fn selected_node(self, node: Option<&str>) -> Self {
        match node {
            Some(node) => self.annotation(SELECTED_NODE, node),
            None => self,
        }
    }

    /// The claim as an object.
    pub fn build(&self) -> PersistentVolumeClaim {
        let mode = if self.block { "Block" } else { "Filesystem" };
        serde_json::from_value(json!({
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid,
                         "annotations": self.annotations},
            "spec": {
                "storageClassName": self.class,
                "volumeMode": mode,
                "selector": self.selector,
                "dataSource": self.data_source,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": self.size}},
            }
        }))
        .expect("a claim")
    }

    pub async fn create(self) -> anyhow::Result<PersistentVolumeClaim> {
        let claim = self.build();
        let claims = self
            .claims
            .context("a claim built without a fixture is not created")?;
        claims
            .create(&PostParams::default(), &claim)
            .await
            .with_context(|| format!("create claim {}", self.name))
    }
}

/// A static PV as an admin writes one: 1Gi of `class`, ReadWriteOnce, a hostPath under
/// `storage` that nothing mounts, Retain, no provisioner's annotation; pre-bound by name to
/// `claim` (namespace, name) when some, with no UID, as a user pre-binds one.
pub fn static_pv(
    name: &str,
    class: &str,
    storage: &Path,
    claim: Option<(&str, &str)>,
) -> PersistentVolume {
    let claim_ref = claim.map(|(namespace, name)| json!({"namespace": namespace, "name": name}));
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "storageClassName": class,
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "volumeMode": "Filesystem",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": storage.join(name).display().to_string()},
            "claimRef": claim_ref,
        }
    }))
    .expect("a PersistentVolume")
}

/// The claim's UID.
pub fn uid(claim: &PersistentVolumeClaim) -> String {
    claim.metadata.uid.clone().unwrap_or_default()
}

/// The PV the controller names after a claim: `pvc-<uid>`.
pub fn pv_name(claim: &PersistentVolumeClaim) -> String {
    format!("pvc-{}", uid(claim))
}

/// The PV's required node affinity as (key, values) pairs.
pub fn affinity(pv: &PersistentVolume) -> Vec<(String, Vec<String>)> {
    pv.spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .map(|r| {
            r.node_selector_terms
                .iter()
                .flat_map(|t| t.match_expressions.iter().flatten())
                .map(|e| (e.key.clone(), e.values.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

/// A loopback address free a moment ago (for a provisioner's `--metrics-address`).
pub fn free_port() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr")
}

/// A plain HTTP/1.1 GET; returns (status, body).
pub async fn http_get(address: std::net::SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await?;
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no HTTP status")?;
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}
