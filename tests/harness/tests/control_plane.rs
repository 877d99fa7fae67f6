//! The harness starts a working control plane: the PV binder of kube-controller-manager runs, and
//! the provisioner identity has exactly the RBAC of `deploy/rbac.yaml`; the API server and
//! kube-controller-manager stop and start again.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Namespace, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec, Secret,
    VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use wp_harness::{ControlPlane, wait_for};

const TEST_PROVISIONER: &str = "example.com/test";
const PROVISIONER_ANNOTATION: &str = "volume.beta.kubernetes.io/storage-provisioner";

#[tokio::test]
async fn control_plane_binds_claims_to_external_provisioners_and_enforces_rbac() {
    let control_plane = ControlPlane::start().await.expect("control plane starts");
    let admin = control_plane.admin_client().await.unwrap();

    let namespace = Namespace {
        metadata: named("harness-test"),
        ..Default::default()
    };
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();

    Api::<StorageClass>::all(admin.clone())
        .create(&PostParams::default(), &external_class("test-class"))
        .await
        .unwrap();

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), "harness-test");
    claims
        .create(&PostParams::default(), &claim_of("claim", "test-class"))
        .await
        .unwrap();

    // Only kube-controller-manager's PV binder sets this annotation: it proves the binder runs.
    let provisioner = wait_for(
        "the PV binder to annotate the claim",
        Duration::from_secs(60),
        || async { Ok(provisioner_of(&claims.get("claim").await?)) },
    )
    .await
    .unwrap();
    assert_eq!(provisioner, TEST_PROVISIONER);

    if control_plane.is_attached() {
        eprintln!(
            "attached to an existing cluster: the provisioner identity is admin, RBAC is not proven"
        );
        return;
    }
    let provisioner = ControlPlane::client_for(control_plane.provisioner_kubeconfig())
        .await
        .unwrap();
    Api::<PersistentVolume>::all(provisioner.clone())
        .list(&ListParams::default())
        .await
        .expect("deploy/rbac.yaml lets the provisioner list PersistentVolumes");
    let secrets_error = Api::<Secret>::all(provisioner)
        .list(&ListParams::default())
        .await
        .expect_err("deploy/rbac.yaml must not grant secrets");
    assert!(
        is_forbidden(&secrets_error),
        "expected 403 Forbidden, got {secrets_error:?}"
    );

    let restricted = ControlPlane::client_for(control_plane.restricted_kubeconfig(1))
        .await
        .unwrap();
    let volumes_error = Api::<PersistentVolume>::all(restricted)
        .list(&ListParams::default())
        .await
        .expect_err("restricted identities start with no permissions");
    assert!(
        is_forbidden(&volumes_error),
        "expected 403 Forbidden, got {volumes_error:?}"
    );
    assert_eq!(
        control_plane.restricted_user(1),
        "system:serviceaccount:wasm-provisioner:restricted-1"
    );
}

#[tokio::test]
async fn apiserver_restarts_on_the_same_port_with_its_data() {
    let control_plane = ControlPlane::start().await.expect("control plane starts");
    if control_plane.is_attached() {
        eprintln!("attached to an existing cluster: cannot stop its API server");
        return;
    }
    let namespaces = Api::<Namespace>::all(control_plane.admin_client().await.unwrap());
    namespaces
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: named("survives"),
                ..Default::default()
            },
        )
        .await
        .unwrap();

    control_plane.stop_apiserver().await.unwrap();
    namespaces
        .get("survives")
        .await
        .expect_err("the API server is down");

    control_plane.start_apiserver().await.unwrap();
    // The same client (same URL, same token) works again, and etcd kept the data.
    namespaces
        .get("survives")
        .await
        .expect("namespace still there after the restart");
}

#[tokio::test]
async fn controller_manager_stops_and_starts_again_with_its_pv_binder() {
    let control_plane = ControlPlane::start().await.expect("control plane starts");
    if control_plane.is_attached() {
        eprintln!("attached to an existing cluster: cannot stop its kube-controller-manager");
        return;
    }
    let admin = control_plane.admin_client().await.unwrap();
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: named("kcm-restart"),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    Api::<StorageClass>::all(admin.clone())
        .create(&PostParams::default(), &external_class("kcm-restart-class"))
        .await
        .unwrap();

    control_plane.stop_controller_manager().await.unwrap();
    let pids = control_plane.component_pids().await;
    assert!(
        pids.iter()
            .all(|(name, _)| *name != "kube-controller-manager"),
        "a stopped kube-controller-manager has no PID: {pids:?}"
    );
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin, "kcm-restart");
    claims
        .create(
            &PostParams::default(),
            &claim_of("claim", "kcm-restart-class"),
        )
        .await
        .unwrap();
    // The running binder marks such a claim within a second or two; nobody does while it is down.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let unmarked = claims.get("claim").await.unwrap();
    assert_eq!(
        provisioner_of(&unmarked),
        None,
        "nobody marks claims while kube-controller-manager is stopped"
    );

    control_plane.start_controller_manager().await.unwrap();
    let provisioner = wait_for(
        "the restarted PV binder to annotate the claim",
        Duration::from_secs(60),
        || async { Ok(provisioner_of(&claims.get("claim").await?)) },
    )
    .await
    .unwrap();
    assert_eq!(provisioner, TEST_PROVISIONER);
    let pids = control_plane.component_pids().await;
    assert!(
        pids.iter()
            .any(|(name, _)| *name == "kube-controller-manager"),
        "{pids:?}"
    );
    let run_dir = control_plane.run_dir();
    for log in [
        "kube-controller-manager.log",
        "kube-controller-manager-2.log",
    ] {
        let text = std::fs::read_to_string(run_dir.join(log)).unwrap_or_default();
        assert!(
            text.contains("persistentvolume-binder"),
            "{log} is kept and tells of its PV binder"
        );
    }
}

/// A StorageClass of [`TEST_PROVISIONER`], which nothing serves: only the PV binder touches its
/// claims.
fn external_class(name: &str) -> StorageClass {
    StorageClass {
        metadata: named(name),
        provisioner: TEST_PROVISIONER.into(),
        volume_binding_mode: Some("Immediate".into()),
        ..Default::default()
    }
}

/// A 1Gi ReadWriteOnce claim of `class`.
fn claim_of(name: &str, class: &str) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: named(name),
        spec: Some(PersistentVolumeClaimSpec {
            storage_class_name: Some(class.into()),
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".into(), Quantity("1Gi".into()))])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The provisioner the PV binder marked the claim for, if it did.
fn provisioner_of(claim: &PersistentVolumeClaim) -> Option<String> {
    claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(PROVISIONER_ANNOTATION).cloned())
}

fn named(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        ..Default::default()
    }
}

fn is_forbidden(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 403)
}
