//! Owner, group and mode a class asks for (issue 34): applied by the host to the volume's
//! directory within the grant's `uids`/`gids`; anything else is a `ProvisioningFailed` event
//! with no PV and no directory.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::*;

/// The hostpath guest, its grant allowing uids 1000-1999 and gid 1000.
fn granted_world() -> World {
    World::with_grant("hostpath", "/volumes", settings(), "", |grant| {
        grant.replace(
            "[volumes]\n",
            "[volumes]\nuids = [\"1000-1999\"]\ngids = [\"1000\"]\n",
        )
    })
}

#[tokio::test]
async fn a_class_owner_within_the_grant_is_applied_before_the_pv_exists() {
    let mut world = granted_world();
    world.class(
        "fast",
        json!({"uid": "1000", "gid": "1000", "mode": "0700"}),
        json!({}),
    );
    let pvc = world.claim(claim_of("mine", "fast", P));
    world.provision(&pvc).await.expect("provisioned");
    assert!(world.api.get(&pv_path("pvc-u-mine")).is_some(), "the PV");
    let meta = std::fs::metadata(world.storage.path().join("pvc-u-mine")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (1000, 1000));
    assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
}

#[tokio::test]
async fn an_owner_outside_the_grant_is_a_failed_provision_with_no_pv_and_no_directory() {
    let mut world = granted_world();
    world.class("root", json!({"uid": "0"}), json!({}));
    world.class("far", json!({"uid": "2000"}), json!({}));
    for (name, class) in [("as-root", "root"), ("far-away", "far")] {
        let pvc = world.claim(claim_of(name, class, P));
        let _ = world.provision(&pvc).await;
        assert!(
            world.api.get(&pv_path(&format!("pvc-u-{name}"))).is_none(),
            "no PV for {name}"
        );
    }
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let notes = world.api.event_notes();
    for refused in ["uid 0 is not granted", "uid 2000 is not granted"] {
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("ProvisioningFailed:") && n.contains(refused)),
            "{refused}: {notes:#?}"
        );
    }
    assert_eq!(
        std::fs::read_dir(world.storage.path()).unwrap().count(),
        0,
        "the guest checked the owner with the host before creating anything"
    );
}
