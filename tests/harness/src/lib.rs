//! A real, local Kubernetes control plane for end-to-end tests and the demo.
//!
//! ```text
//!  ControlPlane::start()
//!    ├─ etcd                      127.0.0.1:<free>, data dir on tmpfs when available
//!    ├─ kube-apiserver            https://127.0.0.1:<free>, token auth, RBAC
//!    ├─ kube-controller-manager   PV binder, PV/PVC protection, namespace, GC
//!    └─ apply deploy/rbac.yaml    (as admin)  ──▶  provisioner identity has exactly that RBAC
//!
//!  run dir (temp): tokens.csv, *.kubeconfig, sa.key, certs/, etcd.log, kube-apiserver.log, ...
//! ```
//!
//! Every process gets fresh loopback ports and is stopped by PID when the [`ControlPlane`] is
//! stopped or dropped. Set `WP_KUBECONFIG` to attach to an existing cluster instead, and
//! `WP_KEEP_RUN_DIR=1` to keep the run dir of a failed run for inspection.

mod apply;
mod binaries;
mod budget;
mod cgroup;
mod cluster;
mod components;
mod control_plane;
mod demo_support;
mod identity;
mod kustomize;
mod latency;
mod node;
mod ports;
mod process;
mod wait;

pub use apply::{RBAC_YAML, apply_yaml, create_or_merge_yaml};
pub use binaries::{BIN_DIR_ENV, Binaries, default_bin_dir};
pub use budget::budget_floor;
pub use cgroup::{CgroupVersion, MemoryCgroup};
pub use cluster::{
    NodeCluster, SHIPPED_NODE_DIR, build_images, pinned_to, render_with_node_dir, with_sizes,
};
pub use control_plane::{
    ATTACH_KUBECONFIG_ENV, ControlPlane, KEEP_RUN_DIR_ENV, RESTRICTED_IDENTITIES,
};
pub use demo_support::{demo_inputs, repo_root, step};
pub use kustomize::render_kustomization;
pub use latency::{Distant, LatencyProxy};
pub use node::{BUSYBOX_IMAGE, HostSnapshot, IMAGE_TARBALLS, Node, NodeTimings, processes_of_pod};
pub use process::Process;
pub use wait::wait_for;
