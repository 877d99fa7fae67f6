//! A served path cannot change under the kubelet: no nesting, not the prefix itself, and no
//! directory rename that moves a served path or one of its ancestors (docs/threat-model.md).

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_volumes_and_the_prefix_itself_are_refused() {
    let n = NodeAttack::load("");
    let path = |p: &'static str| [("attack", "path"), ("path", p)];
    let outer = n.request("nest-outer", &path("data"));
    let built = n
        .guest
        .provision(&outer)
        .await
        .expect("a first volume at <prefix>/data");
    // The pod of `data` could replace `data/inner` with a link: never served.
    let message = rejected_message(n.provision("nest-inner", &path("data/inner")).await);
    println!("nested below: {message}");
    assert!(message.contains("data"), "{message}");
    // The other way round: a volume over an existing one.
    n.provision("nest-deep", &path("ns/deep/vol"))
        .await
        .expect("a volume two levels down");
    let message = rejected_message(n.provision("nest-over", &path("ns")).await);
    println!("nested above: {message}");
    // The prefix itself would let its pod swap every other volume.
    let message = rejected_message(n.provision("nest-prefix", &path("")).await);
    println!("the prefix: {message}");
    // The same claim asking again gets its own path again.
    n.provision("nest-outer", &path("data"))
        .await
        .expect("a retry of the same volume");
    // Once deleted, its path may be served again, nested or not.
    let request = wasm_provisioner::wasm::bindings::types::DeleteRequest {
        volume: as_volume(&outer, &built),
        storage_class: None,
        config: n.guest.grants().config_json.clone(),
    };
    n.guest.delete(&request).await.expect("deleted");
    n.provision("nest-inner", &path("data/inner"))
        .await
        .expect("no longer nested in a live volume");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renaming_directories_cannot_turn_a_served_path_into_a_link() {
    let n = NodeAttack::load("");
    let served = n.dir().join("ns/pvc-a");
    n.provision("rename-a", &[("attack", "path"), ("path", "ns/pvc-a")])
        .await
        .expect("a two-level served path");
    // A tenant's pod fills its own volume: x/pvc-a -> /etc.
    n.provision("rename-b", &[("attack", "path"), ("path", "pvc-b")])
        .await
        .expect("the tenant's volume");
    std::fs::create_dir(n.dir().join("pvc-b/x")).unwrap();
    std::os::unix::fs::symlink("/etc", n.dir().join("pvc-b/x/pvc-a")).unwrap();
    // Only directories are renamed: `ns` away, then the pod's `x` in its place.
    let message = final_message(
        n.provision(
            "swapper",
            &[("attack", "renames"), ("renames", "ns>ns.away;pvc-b/x>ns")],
        )
        .await,
    );
    println!("directory swap: {message}");
    assert!(
        !is_link(&served),
        "the served path became a link: {message}"
    );
    assert!(served.is_dir(), "the served path stayed where it was");
    assert!(
        !message.contains(": ok"),
        "a rename went through: {message}"
    );
    // Moving the served directory itself, or a directory onto an ancestor, is refused too.
    let message = final_message(
        n.provision(
            "mover",
            &[
                ("attack", "renames"),
                ("renames", "ns/pvc-a>moved;pvc-b/x>fresh;fresh>ns"),
            ],
        )
        .await,
    );
    println!("moves: {message}");
    assert_eq!(
        message.matches(": ok").count(),
        1,
        "only the harmless move went through: {message}"
    );
    assert!(message.contains("rename pvc-b/x fresh: ok"), "{message}");
    assert!(!is_link(&served) && served.is_dir());
}
