//! The users the local API server knows: a static token file and one kubeconfig per user.

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// Namespace of the provisioner's service account (and of the spare restricted identities).
pub(crate) const PROVISIONER_NAMESPACE: &str = "wasm-provisioner";

/// A user authenticated by bearer token through `--token-auth-file`.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    /// Short label, used for the kubeconfig's file name.
    pub label: String,
    pub user: String,
    pub groups: Vec<String>,
    pub token: String,
}

impl Identity {
    /// A cluster administrator: `system:masters` bypasses RBAC.
    pub fn admin() -> anyhow::Result<Identity> {
        Ok(Identity {
            label: "admin".into(),
            user: "admin".into(),
            groups: vec!["system:masters".into()],
            token: random_token()?,
        })
    }

    /// The username and groups a real service account token would authenticate as, so RBAC
    /// bindings to `kind: ServiceAccount` subjects apply to it.
    pub fn service_account(namespace: &str, name: &str) -> anyhow::Result<Identity> {
        Ok(Identity {
            label: name.into(),
            user: service_account_user(namespace, name),
            groups: vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ],
            token: random_token()?,
        })
    }

    /// Writes a kubeconfig for this user against `server` (TLS not verified: the API server's
    /// certificate is self-signed per run) to `dir/<label>.kubeconfig`.
    pub fn write_kubeconfig(&self, dir: &Path, server: &str) -> anyhow::Result<PathBuf> {
        let path = dir.join(format!("{}.kubeconfig", self.label));
        let kubeconfig = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{
                "name": "wp-harness",
                "cluster": { "server": server, "insecure-skip-tls-verify": true },
            }],
            "users": [{ "name": self.user, "user": { "token": self.token } }],
            "contexts": [{
                "name": "wp-harness",
                "context": { "cluster": "wp-harness", "user": self.user },
            }],
            "current-context": "wp-harness",
        });
        let yaml = serde_yaml::to_string(&kubeconfig).context("serialising kubeconfig")?;
        std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

/// `system:serviceaccount:<namespace>:<name>`, the username of a service account.
pub(crate) fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// The `--token-auth-file` CSV: `token,user,uid,"group1,group2"` per line.
pub(crate) fn token_auth_csv(identities: &[&Identity]) -> String {
    let mut csv = String::new();
    for identity in identities {
        // Tokens are hex and usernames never contain commas or quotes, so no escaping is needed.
        let _ = writeln!(
            csv,
            "{},{},{},\"{}\"",
            identity.token,
            identity.user,
            identity.user,
            identity.groups.join(",")
        );
    }
    csv
}

/// 32 hex characters from the OS's random source.
fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut urandom| urandom.read_exact(&mut bytes))
        .context("reading /dev/urandom for an API token")?;
    Ok(bytes.iter().map(|byte| format!("{byte:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_account_identity_has_the_groups_a_real_token_gets() {
        let identity = Identity::service_account("wasm-provisioner", "wasm-provisioner").unwrap();
        assert_eq!(
            identity.user,
            "system:serviceaccount:wasm-provisioner:wasm-provisioner"
        );
        assert_eq!(
            identity.groups,
            [
                "system:serviceaccounts",
                "system:serviceaccounts:wasm-provisioner",
                "system:authenticated"
            ]
        );
        let csv = token_auth_csv(&[&identity]);
        assert!(csv.ends_with(",\"system:serviceaccounts,system:serviceaccounts:wasm-provisioner,system:authenticated\"\n"), "{csv}");
    }

    #[test]
    fn kubeconfig_is_readable_by_kube() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identity::service_account("ns", "sa").unwrap();
        let path = identity
            .write_kubeconfig(dir.path(), "https://127.0.0.1:6443")
            .unwrap();
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
        assert_eq!(kubeconfig.auth_infos[0].name, "system:serviceaccount:ns:sa");
        assert_eq!(
            kubeconfig.clusters[0]
                .cluster
                .as_ref()
                .unwrap()
                .insecure_skip_tls_verify,
            Some(true)
        );
    }
}
