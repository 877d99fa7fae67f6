//! End to end on a real node: kubelet + kube-scheduler + containerd beside the control plane
//! (wp_harness::Node), the provisioner running as the pods `deploy/` and `deploy/node/` describe,
//! from the images `.ci/images` builds, and pods that mount and write what the guests provision.
//!
//! One node for every case, run in order (each needs the state the one before left):
//! deploy/ as shipped, a hostile pod, volumes owned by a non-root pod's user (hostpath and
//! local-path), a clone, leader failover with real pods, deploy/node/, and last the host check:
//! the node stopped and a second one started and stopped leave the host as it was.
//! Needs root (the node changes host state, and puts it back); `bash .ci/test` runs it.

mod common;

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use libtest_mimic::{Arguments, Failed, Trial};
use wp_harness::{
    ControlPlane, HostSnapshot, Node, NodeCluster, build_images, pinned_to, processes_of_pod,
};

use common::repo;

/// A tenant's user and group, within deploy/'s grant (`uids`/`gids` 1000-59999).
const TENANT_UID: i64 = 1000;

/// The cases, in the order they run.
const CASES: &[&str] = &[
    "deploy_runs_as_shipped_and_a_pod_writes_into_its_claim",
    "a_hostile_pod_exposes_nothing_and_its_volume_is_deleted_cleanly",
    "a_non_root_pod_writes_into_the_volume_its_class_gives_it",
    "a_pod_reads_in_a_clone_what_another_pod_wrote_into_its_source",
    "a_link_a_pod_planted_where_a_later_volume_goes_changes_no_owner",
    "a_non_root_pod_writes_into_a_local_path_volume_its_class_gives_it",
    "leader_failover_with_real_pods",
    "node_daemonset_provisions_for_the_pod_the_scheduler_placed",
    "a_pod_cannot_write_past_its_claims_size_on_btrfs",
    "two_node_runs_one_after_the_other_leave_nothing_behind",
];

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let selected: Vec<&str> = CASES
        .iter()
        .copied()
        .filter(|name| args.filter.as_deref().is_none_or(|f| name.contains(f)))
        .collect();
    if args.list || selected.is_empty() {
        let trials = CASES
            .iter()
            .map(|name| Trial::test(*name, || Ok(())))
            .collect();
        return libtest_mimic::run(&args, trials).exit_code();
    }
    // Every case runs here, in order, on one node; libtest-mimic then reports their outcomes.
    let outcomes = run_cases(&selected);
    let trials = CASES
        .iter()
        .map(|name| {
            let outcome = outcomes
                .iter()
                .find(|(case, _)| case == name)
                .map(|(_, outcome)| outcome.clone());
            Trial::test(*name, move || match outcome {
                Some(Ok(())) | None => Ok(()),
                Some(Err(error)) => Err(Failed::from(error)),
            })
            .with_ignored_flag(!selected.contains(name))
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

fn run_cases(selected: &[&str]) -> Vec<(&'static str, Result<(), String>)> {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let fail_all = |error: anyhow::Error| -> Vec<(&'static str, Result<(), String>)> {
        let message = format!("{error:#}");
        CASES
            .iter()
            .map(|case| (*case, Err(message.clone())))
            .collect()
    };
    let before = match HostSnapshot::take() {
        Ok(snapshot) => snapshot,
        Err(error) => return fail_all(error),
    };
    let images = match images() {
        Ok(images) => images,
        Err(error) => return fail_all(error),
    };
    let world = runtime.block_on(async {
        let started = Instant::now();
        let cp = ControlPlane::start().await?;
        let node = Node::start(&cp, images.path()).await?;
        let t = node.timings();
        println!(
            "node up in {:.1} s (containerd {:.1} s, images {:.1} s, kubelet to Ready {:.1} s); with the control plane {:.1} s",
            t.total.as_secs_f64(),
            t.containerd.as_secs_f64(),
            t.images.as_secs_f64(),
            t.kubelet_to_ready.as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        NodeCluster::new(cp, node).await
    });
    let mut world = match world {
        Ok(world) => world,
        Err(error) => return fail_all(error.context("starting the control plane and the node")),
    };
    let mut outcomes = Vec::new();
    for case in CASES {
        if !selected.contains(case) {
            continue;
        }
        let result = runtime.block_on(async {
            let run = async {
                match *case {
                    "deploy_runs_as_shipped_and_a_pod_writes_into_its_claim" => {
                        deploy_as_shipped(&mut world).await
                    }
                    "a_hostile_pod_exposes_nothing_and_its_volume_is_deleted_cleanly" => {
                        hostile_pod(&mut world).await
                    }
                    "a_non_root_pod_writes_into_the_volume_its_class_gives_it" => {
                        owned_volume(&mut world).await
                    }
                    "a_pod_reads_in_a_clone_what_another_pod_wrote_into_its_source" => {
                        cloned_volume(&mut world).await
                    }
                    "a_link_a_pod_planted_where_a_later_volume_goes_changes_no_owner" => {
                        planted_link_before_reprovision(&mut world).await
                    }
                    "a_non_root_pod_writes_into_a_local_path_volume_its_class_gives_it" => {
                        owned_local_path(&mut world).await
                    }
                    "leader_failover_with_real_pods" => leader_failover(&mut world).await,
                    "node_daemonset_provisions_for_the_pod_the_scheduler_placed" => {
                        node_daemonset(&mut world).await
                    }
                    "a_pod_cannot_write_past_its_claims_size_on_btrfs" => {
                        enforced_sizes(&mut world).await
                    }
                    "two_node_runs_one_after_the_other_leave_nothing_behind" => {
                        nothing_left_behind(&mut world, &before, images.path()).await
                    }
                    other => anyhow::bail!("unknown case {other}"),
                }
            };
            tokio::time::timeout(Duration::from_secs(300), run)
                .await
                .map_err(|_| anyhow::anyhow!("timed out after 300 s"))?
        });
        let result = match result {
            Ok(()) => Ok(()),
            Err(error) => {
                world.cp.mark_failed();
                let state = runtime.block_on(world.describe());
                Err(format!("{error:#}\n{state}"))
            }
        };
        outcomes.push((*case, result));
    }
    runtime.block_on(world.stop());
    outcomes
}

/// The images, built by `.ci/images` from this build's provisioner and the release guests.
fn images() -> anyhow::Result<tempfile::TempDir> {
    common::guest_wasm("hostpath");
    build_images(&repo(), Path::new(env!("CARGO_BIN_EXE_wasm-provisioner")))
}

/// (a) `kubectl apply -k deploy/` (with the overlay): both replicas Ready, one leader; the example
/// claim Bound; a busybox pod writes into it and the file is where the PV says on the node;
/// deleting pod and claim removes PV and storage.
async fn deploy_as_shipped(world: &mut NodeCluster) -> anyhow::Result<()> {
    let started = Instant::now();
    world.apply_kustomization(&repo().join("deploy")).await?;
    world.wait_deployment_ready("wasm-provisioner", 2).await?;
    println!(
        "deploy/ applied to 2/2 replicas Ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let leader = world.leader().await?;
    let pods = world.provisioner_pods().await?;
    ensure!(
        pods.contains(&leader),
        "the lease holder {leader} is not one of the replicas {pods:?}"
    );
    println!("leader: {leader} (replicas {pods:?})");

    let claim_yaml = std::fs::read_to_string(repo().join("deploy/examples/claim.yaml"))?;
    let started = Instant::now();
    world.apply_yaml(&claim_yaml).await?;
    let pv = world.wait_bound("default", "data").await?;
    println!(
        "deploy/examples/claim.yaml Bound in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let path = world.host_path_of(&pv)?;
    let started = Instant::now();
    world
        .run_pod(
            "writer",
            "data",
            "echo written-by-a-pod > /data/proof && cat /data/proof",
        )
        .await?;
    println!(
        "busybox pod writing into the claim: applied to Succeeded in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let on_node = std::fs::read_to_string(path.join("proof"))
        .with_context(|| format!("reading the pod's file on the node at {}", path.display()))?;
    ensure!(on_node == "written-by-a-pod\n", "the node has {on_node:?}");
    ensure!(
        world.pod_output("default", "writer")? == "written-by-a-pod",
        "the pod's output"
    );
    world.delete_pod("default", "writer").await?;
    world
        .delete_claim_and_wait_storage("default", "data", &pv)
        .await?;
    world.assert_no_forbidden()
}

/// (c) A pod plants a symlink to the node's /etc, a FIFO and a 100-level tree in its volume; the
/// next claims of the same guest are served; a second pod sees only its own volume's data; the
/// planted volume is deleted cleanly and /etc is untouched.
async fn hostile_pod(world: &mut NodeCluster) -> anyhow::Result<()> {
    world.create_claim("default", "planted", "hostpath").await?;
    let planted = world.wait_bound("default", "planted").await?;
    let planted_path = world.host_path_of(&planted)?;
    // As root: the provisioner deletes what a root pod planted (DAC_OVERRIDE, deploy/).
    world
        .run_pod(
            "planter",
            "planted",
            "ln -s /etc /data/etc-link && mkfifo /data/fifo && d=/data/deep && \
             for i in $(seq 100); do d=$d/d; done && mkdir -p $d && echo planted > $d/leaf && \
             chmod 000 /data/deep && ls /data",
        )
        .await?;
    ensure!(
        planted_path.join("etc-link").is_symlink() && planted_path.join("fifo").exists(),
        "the pod planted what it should have in {}",
        planted_path.display()
    );
    for name in ["after-1", "after-2"] {
        world.create_claim("default", name, "hostpath").await?;
    }
    let after = world.wait_bound("default", "after-1").await?;
    let after_2 = world.wait_bound("default", "after-2").await?;
    world
        .run_pod(
            "reader",
            "after-1",
            "echo own > /data/own && find /data | sort",
        )
        .await?;
    let seen = world.pod_output("default", "reader")?;
    ensure!(
        seen == "/data\n/data/own",
        "the second pod sees more than its own data: {seen:?}"
    );
    let after_path = world.host_path_of(&after)?;
    ensure!(
        std::fs::canonicalize(&after_path)?
            .starts_with(std::fs::canonicalize(world.storage_dir())?),
        "{} resolves outside the granted directory",
        after_path.display()
    );
    world.delete_pod("default", "planter").await?;
    world.delete_pod("default", "reader").await?;
    world
        .delete_claim_and_wait_storage("default", "planted", &planted)
        .await?;
    ensure!(
        Path::new("/etc/hostname").exists() && Path::new("/etc/passwd").exists(),
        "the node's /etc lost files"
    );
    world
        .delete_claim_and_wait_storage("default", "after-1", &after)
        .await?;
    world
        .delete_claim_and_wait_storage("default", "after-2", &after_2)
        .await?;
    world.assert_no_forbidden()
}

/// (c2) A class asks for uid and gid 1000 and mode 0700: a pod running as 1000 (no fsGroup)
/// writes into its volume, a pod of another user cannot; a class asking for uid 0 gets a
/// ProvisioningFailed event and no PV; the owned volume (1000's 0700 tree) is deleted cleanly.
async fn owned_volume(world: &mut NodeCluster) -> anyhow::Result<()> {
    world
        .apply_yaml(
            r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: { name: hostpath-owned }
provisioner: wasm-provisioner.dev/hostpath
reclaimPolicy: Delete
parameters: { uid: "1000", gid: "1000", mode: "0700" }
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: { name: hostpath-as-root }
provisioner: wasm-provisioner.dev/hostpath
reclaimPolicy: Delete
parameters: { uid: "0" }
"#,
        )
        .await?;
    world
        .create_claim("default", "owned", "hostpath-owned")
        .await?;
    let owned = world.wait_bound("default", "owned").await?;
    let path = world.host_path_of(&owned)?;
    owned_by_the_tenant(&path)?;
    world
        .run_pod_as(
            "tenant",
            "owned",
            "echo mine > /data/f && mkdir /data/sub && echo deep > /data/sub/g && chmod 700 /data/sub && cat /data/f",
            TENANT_UID,
        )
        .await?;
    ensure!(world.pod_output("default", "tenant")? == "mine");
    let stranger = world
        .run_pod_as("stranger", "owned", "echo x > /data/intruder", 2000)
        .await;
    ensure!(
        stranger.is_err() && !path.join("intruder").exists(),
        "a pod of user 2000 wrote into 1000's 0700 volume: {stranger:?}"
    );
    println!(
        "owned volume: uid 1000 wrote, uid 2000 refused: {}",
        stranger.err().map(|e| format!("{e:#}")).unwrap_or_default()
    );

    world
        .create_claim("default", "as-root", "hostpath-as-root")
        .await?;
    let failed = world
        .wait_event("default", "as-root", "ProvisioningFailed")
        .await?;
    ensure!(failed.contains("uid 0 is not granted"), "{failed}");
    ensure!(
        world.volume_name("default", "as-root").await?.is_none(),
        "a PV for a class asking for root"
    );

    world.delete_pod("default", "tenant").await?;
    world.delete_pod("default", "stranger").await?;
    world
        .delete_claim_and_wait_storage("default", "owned", &owned)
        .await?;
    world.delete_claim("default", "as-root").await?;
    world.assert_no_forbidden()
}

/// (c3) A pod running as 1000 writes into a claim of a class that gives it the volume (uid 1000,
/// mode 0700): a 0600 file in a 0700 directory and a link to it. A second claim clones it; a pod
/// running as 1000 reads the file through the link in the clone and writes beside it (the copy
/// kept the link, the modes and the owner); both claims go with their storage.
async fn cloned_volume(world: &mut NodeCluster) -> anyhow::Result<()> {
    world
        .apply_yaml(
            r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: { name: hostpath-clones }
provisioner: wasm-provisioner.dev/hostpath
reclaimPolicy: Delete
parameters: { uid: "1000", gid: "1000", mode: "0700" }
"#,
        )
        .await?;
    world
        .create_claim("default", "original", "hostpath-clones")
        .await?;
    let original = world.wait_bound("default", "original").await?;
    world
        .run_pod_as(
            "clone-author",
            "original",
            "mkdir /data/letters && echo dear-clone > /data/letters/one && \
             chmod 600 /data/letters/one && chmod 700 /data/letters && ln -s letters/one /data/latest",
            TENANT_UID,
        )
        .await?;
    world
        .create_claim_from("default", "copy", "hostpath-clones", Some("original"))
        .await?;
    let copy = world.wait_bound("default", "copy").await?;
    world
        .run_pod_as(
            "clone-reader",
            "copy",
            "cat /data/latest && echo reply > /data/letters/two && \
             stat -c '%a %u:%g' /data/letters /data/letters/one && readlink /data/latest",
            TENANT_UID,
        )
        .await?;
    let read = world.pod_output("default", "clone-reader")?;
    ensure!(
        read == "dear-clone\n700 1000:1000\n600 1000:1000\nletters/one",
        "the clone's pod saw {read:?}"
    );
    owned_by_the_tenant(&world.host_path_of(&copy)?)?;
    println!(
        "clone {} of {}: a pod of uid 1000 read through the copied link and wrote beside it",
        copy.metadata.name.as_deref().unwrap_or_default(),
        original.metadata.name.as_deref().unwrap_or_default()
    );
    world.delete_pod("default", "clone-author").await?;
    world.delete_pod("default", "clone-reader").await?;
    world
        .delete_claim_and_wait_storage("default", "copy", &copy)
        .await?;
    world
        .delete_claim_and_wait_storage("default", "original", &original)
        .await?;
    world.assert_no_forbidden()
}

/// (c3b) A root pod plants links where later volumes will go, inside its own retained volume:
/// `victim` to the node's `/etc`, `sneak` to a neighbour's volume. Claims of a class whose
/// volumes lie there (`pathPattern` below the planter's, uid 1000, mode 0777) get
/// ProvisioningFailed and no PV, and neither `/etc` nor the neighbour's volume changes owner or
/// mode: the host never follows a pod's link to chown.
async fn planted_link_before_reprovision(world: &mut NodeCluster) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    world
        .apply_yaml(
            r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: { name: hostpath-kept }
provisioner: wasm-provisioner.dev/hostpath
reclaimPolicy: Retain
parameters: { pathPattern: "${pvc.namespace}/${pvc.name}", uid: "1000", gid: "1000", mode: "0700" }
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: { name: hostpath-below }
provisioner: wasm-provisioner.dev/hostpath
reclaimPolicy: Delete
parameters: { pathPattern: "${pvc.namespace}/nest/${pvc.name}", uid: "1000", gid: "1000", mode: "0777" }
"#,
        )
        .await?;
    for claim in ["nest", "neighbour"] {
        world
            .create_claim("default", claim, "hostpath-kept")
            .await?;
    }
    let nest = world.wait_bound("default", "nest").await?;
    let neighbour = world.wait_bound("default", "neighbour").await?;
    let neighbour_path = world.host_path_of(&neighbour)?;
    world
        .run_pod(
            "link-planter",
            "nest",
            "ln -s /etc /data/victim && ln -s ../neighbour /data/sneak && ls -l /data",
        )
        .await?;
    world.delete_pod("default", "link-planter").await?;
    let nest_path = world.delete_retained("default", "nest", &nest).await?;
    ensure!(
        nest_path.join("victim").is_symlink() && nest_path.join("sneak").is_symlink(),
        "the pod's links are in its retained volume {}",
        nest_path.display()
    );
    let owner_and_mode = |path: &Path| -> anyhow::Result<(u32, u32, u32)> {
        let meta = std::fs::metadata(path)?;
        Ok((meta.uid(), meta.gid(), meta.mode() & 0o7777))
    };
    let etc_before = owner_and_mode(Path::new("/etc"))?;
    let neighbour_before = owner_and_mode(&neighbour_path)?;
    ensure!(
        neighbour_before == (1000, 1000, 0o700),
        "{neighbour_before:?}"
    );

    for claim in ["victim", "sneak"] {
        world
            .create_claim("default", claim, "hostpath-below")
            .await?;
        let failed = world
            .wait_event("default", claim, "ProvisioningFailed")
            .await?;
        println!("planted link {claim}: {failed}");
        ensure!(
            world.volume_name("default", claim).await?.is_none(),
            "a PV for {claim}, a path through a pod's link"
        );
    }
    ensure!(
        owner_and_mode(Path::new("/etc"))? == etc_before,
        "the node's /etc changed owner or mode"
    );
    ensure!(
        owner_and_mode(&neighbour_path)? == neighbour_before,
        "the neighbour's volume changed owner or mode"
    );
    for claim in ["victim", "sneak"] {
        world.delete_claim("default", claim).await?;
    }
    let neighbour_path = world
        .delete_retained("default", "neighbour", &neighbour)
        .await?;
    // What Retain kept is the operator's to remove; the test is the operator here.
    std::fs::remove_dir_all(&nest_path)?;
    std::fs::remove_dir_all(&neighbour_path)?;
    world.assert_no_forbidden()
}

/// (c4) local-path, run as one instance with the node's directory mounted at its own path (so
/// the host walks and owns it on disk): a class with `userPattern`/`groupPattern` 1000 and
/// `permPattern` 0700 gives a WaitForFirstConsumer volume to a pod running as 1000, which writes.
async fn owned_local_path(world: &mut NodeCluster) -> anyhow::Result<()> {
    let node = world.node_name().to_owned();
    let dir = world.storage_dir().with_file_name("local-path");
    std::fs::create_dir_all(&dir)?;
    let dir = dir.display().to_string();
    let grant = format!(
        r#"provisioner = "wasm-provisioner.dev/local-path"
[[dirs]]
host = "{dir}"
guest = "/nodes/{node}{dir}"
access = "read-write"
[volumes]
kinds = ["host-path"]
path-prefixes = ["{dir}"]
uids = ["1000-59999"]
gids = ["1000-59999"]
[config]
nodes-dir = "/nodes"
node-path-map = [{{ node = "{node}", paths = ["{dir}"] }}]
"#
    );
    let grant = grant.replace('\n', "\n    ");
    world
        .apply_yaml(&format!(
            r#"apiVersion: v1
kind: ConfigMap
metadata: {{ name: local-path-grants, namespace: wasm-provisioner }}
data:
  local-path.toml: |
    {grant}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{ name: local-path, namespace: wasm-provisioner }}
spec:
  replicas: 1
  selector: {{ matchLabels: {{ app.kubernetes.io/name: local-path }} }}
  template:
    metadata: {{ labels: {{ app.kubernetes.io/name: local-path }} }}
    spec:
      serviceAccountName: wasm-provisioner
      securityContext: {{ runAsNonRoot: true, runAsUser: 65532, runAsGroup: 65532, fsGroup: 65532 }}
      initContainers:
        - name: plugins
          image: wasm-provisioner-guests:0.1.0
          command: ["sh", "-c", "cp /guests/samples/local_path.wasm /plugins/local-path.wasm && cp /grants/*.toml /plugins/"]
          volumeMounts:
            - {{ name: plugins, mountPath: /plugins }}
            - {{ name: grants, mountPath: /grants, readOnly: true }}
      containers:
        - name: provisioner
          image: wasm-provisioner:0.1.0
          args: ["run", "--plugins=/plugins", "--leader-election=false", "--log-format=json"]
          env:
            - {{ name: POD_NAME, valueFrom: {{ fieldRef: {{ fieldPath: metadata.name }} }} }}
            - {{ name: POD_NAMESPACE, valueFrom: {{ fieldRef: {{ fieldPath: metadata.namespace }} }} }}
          securityContext:
            runAsUser: 0
            runAsNonRoot: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {{ drop: ["ALL"], add: ["CHOWN", "FOWNER", "DAC_OVERRIDE"] }}
          volumeMounts:
            - {{ name: plugins, mountPath: /plugins, readOnly: true }}
            - {{ name: node-dir, mountPath: "{dir}" }}
      volumes:
        - {{ name: plugins, emptyDir: {{}} }}
        - {{ name: grants, configMap: {{ name: local-path-grants }} }}
        - {{ name: node-dir, hostPath: {{ path: "{dir}", type: Directory }} }}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{ name: local-path-owned }}
provisioner: wasm-provisioner.dev/local-path
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
parameters: {{ userPattern: "1000", groupPattern: "1000", permPattern: "0700" }}
"#
        ))
        .await?;
    world.wait_deployment_ready("local-path", 1).await?;
    world
        .create_claim("default", "local-owned", "local-path-owned")
        .await?;
    // WaitForFirstConsumer: the pod's scheduling picks the node, then the volume is made.
    let written = world.run_pod_as(
        "local-tenant",
        "local-owned",
        "echo mine > /data/f && cat /data/f",
        TENANT_UID,
    );
    written.await?;
    ensure!(world.pod_output("default", "local-tenant")? == "mine");
    let pv = world.wait_bound("default", "local-owned").await?;
    let path = pv
        .spec
        .as_ref()
        .and_then(|s| s.host_path.as_ref())
        .map(|h| std::path::PathBuf::from(&h.path))
        .context("a hostPath local-path volume")?;
    owned_by_the_tenant(&path)?;
    println!(
        "local-path volume {} owned by 1000, written by a pod running as 1000",
        path.display()
    );
    world.delete_pod("default", "local-tenant").await?;
    world.delete_claim("default", "local-owned").await?;
    let pvs = pv.metadata.name.clone().unwrap_or_default();
    let gone = path.clone();
    wp_harness::wait_for(
        &format!("PV {pvs} and {} gone", gone.display()),
        Duration::from_secs(120),
        || {
            let gone = !gone.exists();
            async move { Ok(gone.then_some(())) }
        },
    )
    .await?;
    world.remove_deployment("local-path").await?;
    world.assert_no_forbidden()
}

/// (f2) Enforced sizes on the real node: deploy/node/ with the lines it marks `with sizes`
/// (the grant's `sizes = "btrfs"` and `enable-quotas`, the container's SYS_ADMIN), its node
/// directory a btrfs the test makes on a loop file (quotas off: the grant turns simple ones
/// on). A pod writing 100 MiB into a 64 Mi claim gets "Disk quota exceeded" having written at
/// most 65 MiB; a pod of a second claim on the same filesystem writes its 32 MiB; deleting the
/// claims removes their subvolumes and qgroups.
async fn enforced_sizes(world: &mut NodeCluster) -> anyhow::Result<()> {
    use std::os::fd::AsFd as _;
    use wasm_provisioner::sizes::{SizeBackend, btrfs};
    let fs = common::btrfs::Btrfs::new();
    world
        .apply_kustomization_at(
            &repo().join("deploy/node"),
            &fs.mnt,
            &wp_harness::with_sizes,
        )
        .await?;
    world.wait_daemonset_ready("wasm-provisioner-node").await?;
    for claim in ["sized", "sized-b"] {
        world
            .create_claim_of("default", claim, "hostpath-local", None, "64Mi")
            .await?;
    }
    world
        .run_pod(
            "filler",
            "sized",
            "dd if=/dev/zero of=/data/big bs=1M count=100 conv=fsync 2>&1 | grep -i quota; \
             stat -c %s /data/big",
        )
        .await?;
    let said = world.pod_output("default", "filler")?;
    let written: u64 = said
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("the filler printed {said:?}"))?;
    ensure!(
        said.to_lowercase().contains("quota exceeded") && written <= 65 << 20,
        "a pod wrote {written} bytes into a 64 Mi claim: {said:?}"
    );
    world
        .run_pod(
            "neighbour",
            "sized-b",
            "dd if=/dev/zero of=/data/f bs=1M count=32 conv=fsync 2>/dev/null; stat -c %s /data/f",
        )
        .await?;
    ensure!(
        world.pod_output("default", "neighbour")? == (32u64 << 20).to_string(),
        "the second claim on the filesystem was affected"
    );
    // Growth: 96 MiB do not fit in a 64 Mi claim; grown to 128 Mi, they do.
    world
        .create_claim_of("default", "grows", "hostpath-local", None, "64Mi")
        .await?;
    world
        .run_pod(
            "before",
            "grows",
            "dd if=/dev/zero of=/data/f bs=1M count=96 conv=fsync 2>&1 | grep -i quota; \
             stat -c %s /data/f; rm -f /data/f; sync",
        )
        .await?;
    let before = world.pod_output("default", "before")?;
    ensure!(
        before.to_lowercase().contains("quota exceeded"),
        "96 MiB fit in a 64 Mi claim: {before:?}"
    );
    world.delete_pod("default", "before").await?;
    let asked = Instant::now();
    world.resize_claim("default", "grows", "128Mi").await?;
    world
        .wait_claim_capacity("default", "grows", "128Mi")
        .await?;
    let grew_in = asked.elapsed();
    world
        .run_pod(
            "after",
            "grows",
            "dd if=/dev/zero of=/data/f bs=1M count=96 conv=fsync 2>&1 | grep -i quota; \
             stat -c %s /data/f",
        )
        .await?;
    let after = world.pod_output("default", "after")?;
    ensure!(
        after == (96u64 << 20).to_string(),
        "96 MiB into the claim grown to 128 Mi: {after:?}"
    );
    println!(
        "enforced sizes: a 64 Mi claim grown to 128 Mi in {grew_in:?} (request to status.capacity); 96 MiB then fit"
    );
    world.delete_pod("default", "after").await?;
    let mut volumes = Vec::new();
    for (claim, mib) in [("sized", 64u64), ("sized-b", 64), ("grows", 128)] {
        let pv = world.wait_bound("default", claim).await?;
        let path = std::path::PathBuf::from(
            pv.spec
                .as_ref()
                .and_then(|s| s.host_path.as_ref())
                .map(|h| h.path.clone())
                .context("a hostPath PV")?,
        );
        ensure!(
            path.starts_with(&fs.mnt),
            "{} is not on the btrfs",
            path.display()
        );
        let usage = SizeBackend::Btrfs.usage(std::fs::File::open(&path)?)?;
        ensure!(
            usage.max_referenced == Some(mib << 20),
            "{}: {usage:?}",
            path.display()
        );
        volumes.push((claim, pv, path, usage.id));
    }
    println!(
        "enforced sizes: a pod stopped at {:.1} MiB in a 64 Mi claim ({}); its neighbour wrote 32 MiB",
        written as f64 / f64::from(1 << 20),
        said.lines().next().unwrap_or_default().trim()
    );
    world.delete_pod("default", "filler").await?;
    world.delete_pod("default", "neighbour").await?;
    for (claim, pv, path, _) in &volumes {
        world
            .delete_claim_and_wait_gone("default", claim, pv, path)
            .await?;
    }
    for (_, _, _, id) in &volumes {
        btrfs::wait_dropped(fs.root().as_fd(), *id)?;
    }
    let left = btrfs::qgroup_ids(fs.root().as_fd())?;
    for (_, _, _, id) in &volumes {
        ensure!(
            !left.contains(id) && !left.contains(&btrfs::volume_qgroup(*id)),
            "qgroups of subvolume {id} left: {left:?}"
        );
    }
    world.assert_no_forbidden()?;
    world.remove_daemonset("wasm-provisioner-node").await
}

/// Fails unless the volume directory at `path` is the tenant's (uid and gid 1000) with mode 0700.
fn owned_by_the_tenant(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(path)?;
    let mode = meta.permissions().mode() & 0o7777;
    ensure!(
        (meta.uid(), meta.gid(), mode) == (1000, 1000, 0o700),
        "{} is {}:{} {mode:o}",
        path.display(),
        meta.uid(),
        meta.gid(),
    );
    Ok(())
}

/// (d) The leader pod is deleted (grace 0, as a crashed node would lose it); a claim made right
/// after gets its PV from the standby within the lease duration plus a margin.
async fn leader_failover(world: &mut NodeCluster) -> anyhow::Result<()> {
    /// deploy/ runs the default --leader-election-lease-duration.
    const LEASE_DURATION: Duration = Duration::from_secs(15);
    const MARGIN: Duration = Duration::from_secs(30);
    world.wait_deployment_ready("wasm-provisioner", 2).await?;
    world.assert_no_forbidden()?;
    let leader = world.leader().await?;
    let leader_processes = processes_of_pod(&leader);
    ensure!(
        !leader_processes.is_empty(),
        "no process of the leader pod {leader} found"
    );
    let deleted = Instant::now();
    world.delete_pod("wasm-provisioner", &leader).await?;
    // The object goes at once; the kubelet stops the container a moment later. Until then the
    // old leader would still serve the claim, which would time nothing.
    wp_harness::wait_for(
        "the old leader's process to exit",
        LEASE_DURATION + MARGIN,
        || {
            let gone = leader_processes
                .iter()
                .all(|pid| !Path::new(&format!("/proc/{pid}")).exists());
            async move { Ok(gone.then_some(())) }
        },
    )
    .await?;
    let exited = deleted.elapsed();
    let killed = Instant::now();
    world
        .create_claim("default", "after-failover", "hostpath")
        .await?;
    let pv = world
        .wait_bound_within("default", "after-failover", LEASE_DURATION + MARGIN)
        .await?;
    let took = killed.elapsed();
    let new_leader = world.leader().await?;
    println!(
        "leader failover: leader pod {leader} deleted (grace 0), its process gone {:.1} s later; a claim made then Bound in {:.1} s (lease duration {} s); new leader {new_leader}",
        exited.as_secs_f64(),
        took.as_secs_f64(),
        LEASE_DURATION.as_secs()
    );
    ensure!(new_leader != leader, "the lease is still {leader}'s");
    world
        .delete_claim_and_wait_storage("default", "after-failover", &pv)
        .await?;
    world.assert_no_forbidden()
}

/// (b) deploy/ removed, deploy/node/ applied: the DaemonSet runs on the node; a
/// WaitForFirstConsumer claim with a pod: the scheduler selects the node, its instance
/// provisions, the pod runs and writes.
async fn node_daemonset(world: &mut NodeCluster) -> anyhow::Result<()> {
    world.remove_deployment("wasm-provisioner").await?;
    let started = Instant::now();
    world
        .apply_kustomization(&repo().join("deploy/node"))
        .await?;
    world.wait_daemonset_ready("wasm-provisioner-node").await?;
    println!(
        "deploy/node/ DaemonSet rolled out in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    world
        .create_claim("default", "local", "hostpath-local")
        .await?;
    let started = Instant::now();
    world
        .run_pod(
            "local-writer",
            "local",
            "echo node-local > /data/proof && cat /data/proof",
        )
        .await?;
    println!(
        "WaitForFirstConsumer claim + pod: created to Succeeded in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let pv = world.wait_bound("default", "local").await?;
    let selected = world.selected_node("default", "local").await?;
    ensure!(
        selected.as_deref() == Some(world.node_name()),
        "the scheduler selected {selected:?}, not {}",
        world.node_name()
    );
    ensure!(
        pinned_to(&pv) == vec![world.node_name().to_string()],
        "the PV is not pinned to the node: {:?}",
        pinned_to(&pv)
    );
    let path = world.host_path_of(&pv)?;
    ensure!(std::fs::read_to_string(path.join("proof"))? == "node-local\n");
    world.delete_pod("default", "local-writer").await?;
    world
        .delete_claim_and_wait_storage("default", "local", &pv)
        .await?;
    world.assert_no_forbidden()?;
    // Its hostPath is this node's run dir: a DaemonSet left for the next node would recreate it.
    world.remove_daemonset("wasm-provisioner-node").await
}

/// The node stops and leaves the host as it was before it started; a second node on the same
/// machine starts, gets Ready and stops, and leaves nothing either.
async fn nothing_left_behind(
    world: &mut NodeCluster,
    before: &HostSnapshot,
    images: &Path,
) -> anyhow::Result<()> {
    world.stop_node().await?;
    let after_first = HostSnapshot::take()?;
    ensure!(
        before.diff(&after_first).is_empty(),
        "the first node left: {:#?}",
        before.diff(&after_first)
    );
    let started = Instant::now();
    let mut second = Node::start(&world.cp, images).await?;
    println!("second node up in {:.1} s", started.elapsed().as_secs_f64());
    second.stop().await?;
    drop(second);
    let after_second = HostSnapshot::take()?;
    ensure!(
        before.diff(&after_second).is_empty(),
        "the second node left: {:#?}",
        before.diff(&after_second)
    );
    Ok(())
}
