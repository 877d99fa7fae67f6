//! What the node's processes are told: containerd's config, the CNI network, and the flags of the
//! kubelet, kube-scheduler and the second kube-controller-manager. Pure functions of [`Layout`].

use std::path::{Path, PathBuf};

use crate::components::flags;

/// The bridge the pods sit on (created before the kubelet, so its sysctl can be set).
pub(crate) const BRIDGE: &str = "wpnode0";

/// The pods' network on [`BRIDGE`]; the host is its gateway, so probes reach the pods.
pub(crate) const POD_SUBNET: &str = "10.244.77.0/24";

/// The cgroup (in every hierarchy) the kubelet puts pods under.
pub(crate) const CGROUP_ROOT: &str = "wp-harness-node";

/// Image the kubelet and containerd use for pod sandboxes (built by `.ci/images`).
pub(crate) const PAUSE_IMAGE: &str = "docker.io/library/wasm-provisioner-pause:1";

/// Image for the tests' pods (Debian's busybox-static, built by `.ci/images`).
pub const BUSYBOX_IMAGE: &str = "wasm-provisioner-busybox:1";

/// Controllers the node needs beyond the control plane's: tokens for pods' service accounts, the
/// not-ready taint lifted, Deployments and DaemonSets run, finished pods collected.
pub(crate) const NODE_CONTROLLERS: &str =
    "serviceaccount,serviceaccount-token,nodelifecycle,deployment,replicaset,daemonset,podgc,ttl";

/// Where every file of one node run lives.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// Unique per run; processes naming it in their command line are this run's.
    pub run_dir: PathBuf,
}

impl Layout {
    pub fn containerd_dir(&self) -> PathBuf {
        self.run_dir.join("containerd")
    }
    pub fn containerd_socket(&self) -> PathBuf {
        self.containerd_dir().join("containerd.sock")
    }
    pub fn containerd_config(&self) -> PathBuf {
        self.containerd_dir().join("config.toml")
    }
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.run_dir.join("cni/net.d")
    }
    pub fn kubelet_dir(&self) -> PathBuf {
        self.run_dir.join("kubelet")
    }
    /// The node's disk for the provisioner's storage (deploy/'s node directory, moved here).
    pub fn storage_dir(&self) -> PathBuf {
        self.run_dir.join("vols/wasm-hostpath")
    }
    pub fn log(&self, name: &str) -> PathBuf {
        self.run_dir.join(format!("{name}.log"))
    }
}

/// containerd 1.6's config: everything under the run dir, CRI with our pause image, and
/// `restrict_oom_score_adj` (no CAP_SYS_RESOURCE here: runc cannot lower a sandbox's score).
pub(crate) fn containerd_toml(layout: &Layout) -> String {
    let dir = layout.containerd_dir();
    let d = |sub: &str| dir.join(sub).display().to_string();
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{ttrpc}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{runc}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
        root = d("root"),
        state = d("state"),
        socket = layout.containerd_socket().display(),
        ttrpc = d("containerd.sock.ttrpc"),
        opt = d("opt"),
        pause = PAUSE_IMAGE,
        runc = d("runc"),
        cni = layout.cni_conf_dir().display(),
    )
}

/// The pods' network: the bridge plugin on [`BRIDGE`] as gateway, no masquerading (pods need no
/// way out), addresses from host-local with its data in the run dir, and one route besides their
/// subnet: to `service_ip` (the `kubernetes` Service) through the host, where the nat rule sends
/// it to the API server.
pub(crate) fn cni_conflist(layout: &Layout, service_ip: &str) -> String {
    serde_json::json!({
        "cniVersion": "0.4.0",
        "name": "wp-harness-node",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_SUBNET}]],
                "routes": [{"dst": format!("{service_ip}/32")}],
                "dataDir": layout.run_dir.join("cni/ipam").display().to_string(),
            },
        }],
    })
    .to_string()
}

/// The kubelet's flags: own dirs, cgroup root and ports on loopback; node IP `node_ip` (it
/// refuses a loopback one); status every 2 s so Ready comes quickly; no image GC or eviction
/// (the imported images cannot be pulled again).
pub(crate) fn kubelet_args(
    layout: &Layout,
    kubeconfig: &Path,
    node_ip: &str,
    port: u16,
) -> Vec<String> {
    let kubelet = layout.kubelet_dir();
    flags(&[
        ("--kubeconfig", &kubeconfig.display().to_string()),
        ("--root-dir", &kubelet.join("root").display().to_string()),
        ("--cert-dir", &kubelet.join("pki").display().to_string()),
        (
            "--volume-plugin-dir",
            &kubelet.join("volume-plugins").display().to_string(),
        ),
        ("--container-runtime", "remote"),
        (
            "--container-runtime-endpoint",
            &format!("unix://{}", layout.containerd_socket().display()),
        ),
        ("--pod-infra-container-image", PAUSE_IMAGE),
        ("--cgroup-driver", "cgroupfs"),
        ("--cgroup-root", &format!("/{CGROUP_ROOT}")),
        ("--node-ip", node_ip),
        ("--address", "127.0.0.1"),
        ("--port", &port.to_string()),
        ("--read-only-port", "0"),
        ("--healthz-port", "0"),
        ("--anonymous-auth", "true"),
        ("--authorization-mode", "AlwaysAllow"),
        ("--node-status-update-frequency", "2s"),
        ("--fail-swap-on", "false"),
        // No KUBE-* chains and no canary monitor in the host's iptables (nothing here needs them).
        ("--make-iptables-util-chains", "false"),
        ("--image-gc-high-threshold", "100"),
        ("--image-gc-low-threshold", "99"),
        (
            "--eviction-hard",
            "memory.available<1Mi,nodefs.available<1%,imagefs.available<1%",
        ),
        ("--v", "2"),
    ])
}

/// kube-scheduler: no serving, no election.
pub(crate) fn scheduler_args(kubeconfig: &Path) -> Vec<String> {
    flags(&[
        ("--kubeconfig", &kubeconfig.display().to_string()),
        ("--leader-elect", "false"),
        ("--port", "0"),
        ("--secure-port", "0"),
    ])
}

/// The second kube-controller-manager, with [`NODE_CONTROLLERS`]; signs pods' service account
/// tokens with the API server's key, and gives them the API server's CA.
pub(crate) fn controller_manager_args(
    kubeconfig: &Path,
    service_account_key: &Path,
    root_ca: &Path,
) -> Vec<String> {
    flags(&[
        ("--kubeconfig", &kubeconfig.display().to_string()),
        ("--controllers", NODE_CONTROLLERS),
        ("--leader-elect", "false"),
        ("--use-service-account-credentials", "false"),
        (
            "--service-account-private-key-file",
            &service_account_key.display().to_string(),
        ),
        ("--root-ca-file", &root_ca.display().to_string()),
        // Pods of a gone node are reclaimed quickly, and the taint goes as soon as it is Ready.
        ("--node-monitor-period", "1s"),
        ("--port", "0"),
        ("--secure-port", "0"),
    ])
}

/// The nat rule that lets pods reach the API server, which listens on loopback only, through the
/// `kubernetes` Service's address: DNAT from the bridge (needs `route_localnet` on it).
pub(crate) fn api_dnat_rule(service_ip: &str, apiserver_port: u16) -> Vec<String> {
    [
        "PREROUTING",
        "-i",
        BRIDGE,
        "-d",
        &format!("{service_ip}/32"),
        "-p",
        "tcp",
        "--dport",
        "443",
        "-m",
        "comment",
        "--comment",
        "wp-harness-node",
        "-j",
        "DNAT",
        "--to-destination",
        &format!("127.0.0.1:{apiserver_port}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The filter rule that keeps pods' traffic on the node: nothing from the bridge is forwarded to
/// another interface (pods reach each other and the host, which is all the tests need).
pub(crate) fn keep_pods_local_rule() -> Vec<String> {
    [
        "FORWARD",
        "-i",
        BRIDGE,
        "!",
        "-o",
        BRIDGE,
        "-m",
        "comment",
        "--comment",
        "wp-harness-node",
        "-j",
        "DROP",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            run_dir: PathBuf::from("/tmp/wp-node-x"),
        }
    }

    #[test]
    fn containerd_keeps_everything_in_the_run_dir_and_restricts_oom_scores() {
        let toml = containerd_toml(&layout());
        assert!(
            toml.lines()
                .any(|l| l.trim() == "restrict_oom_score_adj = true")
        );
        for line in toml
            .lines()
            .filter(|l| l.contains("= \"/") && !l.contains("bin_dir"))
        {
            assert!(line.contains("/tmp/wp-node-x/"), "{line}");
        }
    }

    #[test]
    fn the_kubelet_listens_on_loopback_only() {
        let args = kubelet_args(&layout(), Path::new("/k"), "192.0.2.2", 4242);
        assert!(args.contains(&"--address=127.0.0.1".to_string()));
        assert!(args.contains(&"--read-only-port=0".to_string()));
        assert!(args.contains(&"--healthz-port=0".to_string()));
        assert!(args.iter().all(|a| !a.contains("0.0.0.0")));
    }
}
