//! Developer tool: starts a local control plane, prints how to reach it, and waits for Ctrl-C.
//!
//! `cargo run -p wp-harness --bin control-plane`, then in another shell
//! `export KUBECONFIG=<printed admin kubeconfig>` and use kubectl as usual.

use wp_harness::{ControlPlane, RESTRICTED_IDENTITIES};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    eprintln!("starting etcd, kube-apiserver and kube-controller-manager...");
    let mut control_plane = ControlPlane::start().await?;
    println!("{}", control_plane.admin_kubeconfig().display());
    eprintln!(
        "api server:              {}",
        control_plane.apiserver_url()?
    );
    eprintln!(
        "admin kubeconfig:        {}",
        control_plane.admin_kubeconfig().display()
    );
    eprintln!(
        "provisioner kubeconfig:  {}  ({})",
        control_plane.provisioner_kubeconfig().display(),
        control_plane.provisioner_user()
    );
    for n in 1..=RESTRICTED_IDENTITIES {
        eprintln!(
            "restricted-{n} kubeconfig: {}  ({})",
            control_plane.restricted_kubeconfig(n).display(),
            control_plane.restricted_user(n)
        );
    }
    eprintln!(
        "logs:                    {}",
        control_plane.run_dir().display()
    );
    eprintln!(
        "\nexport KUBECONFIG={}\n\nCtrl-C stops it.",
        control_plane.admin_kubeconfig().display()
    );
    tokio::signal::ctrl_c().await?;
    eprintln!("stopping...");
    control_plane.stop();
    Ok(())
}
