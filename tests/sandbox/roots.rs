//! Roots are canonical or refused: a relative `dirs.host`, a prefix no read-write directory
//! covers, a prefix over the plugins directory; and node affinity names exactly the selected node.

use super::*;

/// Loads node-attack with `grant` from a plugins directory of its own; the loaded guest or the
/// problems.
fn load_grant(plugins: &PluginsDir, grant: &str) -> Result<Arc<Guest>, String> {
    plugins.add("node-attack", "node_attack", grant);
    let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
    loaded
        .for_provisioner(NODE)
        .cloned()
        .ok_or_else(|| format!("{:?}", loaded.problems))
}

fn grant(host: &str, prefix: &Path, extra_volumes: &str) -> String {
    format!(
        r#"provisioner = "{NODE}"
[[dirs]]
host = "{host}"
guest = "/state"
access = "read-write"
[volumes]
kinds = ["host-path"]
path-prefixes = ["{}"]
{extra_volumes}
[config]
guest-dir = "/state"
node-dir = "{}"
"#,
        prefix.display(),
        prefix.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_granted_directory_keeps_the_on_disk_check() {
    // plugins/ and vol/ side by side; the grant names vol as "../vol".
    let root = tempfile::tempdir().unwrap();
    let root_path = root.path().canonicalize().unwrap();
    let plugins = PluginsDir {
        dir: tempfile::tempdir_in(&root_path).unwrap(),
    };
    let vol = root_path.join("vol");
    std::fs::create_dir(&vol).unwrap();
    let guest = load_grant(&plugins, &grant("../vol", &vol, "")).expect("loads");
    assert_eq!(guest.grants().dirs[0].host, vol, "resolved at load");
    // A link planted where the guest will point: the on-disk check must see it.
    std::os::unix::fs::symlink("/etc", vol.join("pvc-uid-rel")).unwrap();
    let req = request(
        claim("rel"),
        class(NODE, &[("attack", "relative-link")]),
        &guest.grants().config_json,
    );
    let message = rejected_message(guest.provision(&req).await);
    assert!(message.contains("symbolic link"), "{message}");
}

#[test]
fn a_prefix_no_read_write_directory_covers_is_refused_unless_the_grant_says_so() {
    let storage = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let host = storage.path().display().to_string();
    let problems = load_grant(&PluginsDir::new(), &grant(&host, elsewhere.path(), ""))
        .err()
        .expect("refused");
    assert!(problems.contains("on-disk-check = false"), "{problems}");
    load_grant(
        &PluginsDir::new(),
        &grant(&host, elsewhere.path(), "on-disk-check = false"),
    )
    .expect("loads when the grant says so");
    // A prefix through a link is not canonical: the kubelet would follow the link.
    let link = storage.path().join("link");
    std::fs::create_dir(storage.path().join("real")).unwrap();
    std::os::unix::fs::symlink("real", &link).unwrap();
    let problems = load_grant(&PluginsDir::new(), &grant(&host, &link, ""))
        .err()
        .expect("refused");
    assert!(problems.contains("resolves to"), "{problems}");
}

#[test]
fn a_prefix_over_the_plugins_directory_is_refused() {
    let plugins = PluginsDir::new();
    let storage = tempfile::tempdir().unwrap();
    let parent = plugins.path().parent().unwrap().to_owned();
    let problems = load_grant(
        &plugins,
        &grant(
            &storage.path().display().to_string(),
            &parent,
            "on-disk-check = false",
        ),
    )
    .err()
    .expect("refused");
    assert!(problems.contains("overlaps"), "{problems}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_affinity_names_exactly_the_selected_node() {
    let n = NodeAttack::load("");
    let mut req = n.request(
        "wide",
        &[("attack", "other-node"), ("node", "node-a,node-b")],
    );
    req.selected_node = Some("node-a".into());
    let message = rejected_message(n.guest.provision(&req).await);
    assert!(message.contains("selected node"), "{message}");
}
