//! `push`, `pull`, `save` and `load` as the command line runs them: flags into a registry
//! client, the steps in order, and the lines printed for the operator.

use std::fmt::Write as _;

use bytes::Bytes;

use super::archive::{self, ArchiveError};
use super::artifact::{self, MANIFEST_MEDIA_TYPE};
use super::auth::{AuthError, DockerConfig};
use super::digest::Digest;
use super::install::{self, Grant, InstallError};
use super::reference::{Reference, ReferenceError};
use super::registry::{Limits, Registry, RegistryError};
use super::transport::{Transport, TransportError, TransportOptions};
use crate::config::{LoadArgs, PullArgs, PushArgs, RegistryArgs, SaveArgs};

/// Why a registry or air-gap command failed.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Install(#[from] InstallError),
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error("cannot read {path}")]
    ReadModule {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is {size} bytes, over --max-module-mib")]
    ModuleTooLarge { path: std::path::PathBuf, size: u64 },
    #[error("--pull {spec:?}: expected NAME=REFERENCE")]
    PullSpec { spec: String },
    #[error("push needs a tag (REGISTRY/REPOSITORY:TAG), not a digest: {reference}")]
    PushByDigest { reference: String },
    #[error("{reference}: {source}; nothing was written")]
    Signature {
        reference: String,
        #[source]
        source: super::cosign::SignatureError,
    },
}

fn mib(value: u64) -> u64 {
    value.saturating_mul(1024 * 1024)
}

/// A registry client from the shared flags.
pub fn registry(args: &RegistryArgs) -> Result<Registry, OciError> {
    let credentials = match &args.registry_config {
        Some(path) => DockerConfig::load(path)?,
        None => DockerConfig::default(),
    };
    let transport = Transport::new(TransportOptions {
        plain_http: args.plain_http.clone(),
        ca_file: args.ca_file.clone(),
        request_timeout: args.request_timeout,
        ..TransportOptions::default()
    })?;
    let limits = Limits {
        module: mib(args.max_module_mib),
        ..Limits::default()
    };
    Ok(Registry::new(transport, credentials, limits))
}

/// Pushes the component as a wasm artifact; prints the manifest's and the layer's digests.
pub async fn push(args: PushArgs) -> Result<String, OciError> {
    let reference = Reference::parse(&args.reference)?;
    let tag = match (&reference.tag, &reference.digest) {
        (Some(tag), None) => tag.clone(),
        _ => {
            return Err(OciError::PushByDigest {
                reference: args.reference,
            });
        }
    };
    let component = std::fs::read(&args.file).map_err(|source| OciError::ReadModule {
        path: args.file.clone(),
        source,
    })?;
    if component.len() as u64 > mib(args.registry.max_module_mib) {
        return Err(OciError::ModuleTooLarge {
            path: args.file,
            size: component.len() as u64,
        });
    }
    let mut registry = registry(&args.registry)?;
    let created = k8s_openapi::jiff::Timestamp::now().to_string();
    let built = artifact::build(&component, created);
    registry
        .push_blob(&reference, Bytes::from(built.config), &built.config_digest)
        .await?;
    registry
        .push_blob(&reference, Bytes::from(component), &built.layer_digest)
        .await?;
    let digest = registry
        .push_manifest(
            &reference,
            &tag,
            Bytes::from(built.manifest),
            MANIFEST_MEDIA_TYPE,
        )
        .await?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pushed {}/{}:{tag}@{digest}",
        reference.registry, reference.repository
    );
    let _ = writeln!(out, "manifest {digest}");
    let _ = writeln!(out, "layer {}", built.layer_digest);
    let _ = writeln!(out, "sha256 = \"{}\"", built.layer_digest.hex());
    Ok(out)
}

/// What a pull installed.
#[derive(Debug, Clone)]
pub struct Pulled {
    pub manifest: Digest,
    pub module: Digest,
    /// The verified cosign signature, when the grant names a key.
    pub evidence: Option<super::cosign::Evidence>,
}

/// Fetches the module `reference` names: the manifest checked against its digest, the layer's
/// declared size and digest against the cap and the grant's pin before its bytes are fetched,
/// the bytes against both after.
pub async fn fetch_module(
    registry: &mut Registry,
    reference: &Reference,
    grant: Option<&Grant>,
) -> Result<(Pulled, Bytes), OciError> {
    let pulled = registry.manifest(reference).await?;
    let layer = artifact::wasm_layer(&pulled.manifest).map_err(RegistryError::from)?;
    let declared = layer.digest().map_err(RegistryError::from)?;
    if let Some(grant) = grant {
        grant.check(&declared)?;
    }
    // A signed guest's signature is checked before its bytes are fetched, and kept beside it
    // so every load checks it again (offline).
    let evidence = match grant.and_then(|g| g.module.cosign_key.as_deref()) {
        Some(key) => Some(
            super::cosign::fetch(registry, reference, &pulled, &declared, key)
                .await
                .map_err(|source| match source {
                    super::cosign::FetchError::Registry(error) => OciError::Registry(error),
                    super::cosign::FetchError::Signature(source) => OciError::Signature {
                        reference: reference.to_string(),
                        source,
                    },
                })?,
        ),
        None => None,
    };
    let module = registry.blob(reference, layer).await?;
    // The blob was checked against `declared`; the pin is checked on the bytes themselves too.
    let digest = Digest::of(&module);
    if let Some(grant) = grant {
        grant.check(&digest)?;
    }
    let pulled = Pulled {
        manifest: pulled.digest,
        module: digest,
        evidence,
    };
    Ok((pulled, module))
}

/// Pulls the module `reference` names into `dir` as `name` (with `grant`, written too when
/// `install_grant`); nothing is written unless every check passed. A signature's evidence goes
/// in before the module, so a signed guest's module is never there without it.
pub async fn pull_into(
    registry: &mut Registry,
    reference: &Reference,
    dir: &std::path::Path,
    name: &str,
    grant: Option<&Grant>,
    install_grant: bool,
) -> Result<Pulled, OciError> {
    install::check_name(name)?;
    let (pulled, module) = fetch_module(registry, reference, grant).await?;
    // Small blocking writes: a command-line run, or the fetcher's own task.
    if let Some(evidence) = &pulled.evidence {
        let json = serde_json::to_vec(evidence).expect("evidence serializes");
        install::write_atomic(dir, &super::cosign::evidence_file(name), &json)?;
    }
    let grant_bytes = grant.filter(|_| install_grant).map(|g| g.bytes.as_slice());
    install::install(dir, name, &module, grant_bytes)?;
    Ok(pulled)
}

/// `pull`: prints the digests and the `sha256 = "..."` line for the grant's `[module]` table.
pub async fn pull(args: PullArgs) -> Result<String, OciError> {
    let reference = Reference::parse(&args.reference)?;
    install::check_name(&args.name)?;
    let grant = args.grant.as_deref().map(Grant::read).transpose()?;
    let mut registry = registry(&args.registry)?;
    let pulled = pull_into(
        &mut registry,
        &reference,
        &args.plugins,
        &args.name,
        grant.as_ref(),
        true,
    )
    .await?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "installed {} from {}/{}@{}",
        args.plugins.join(format!("{}.wasm", args.name)).display(),
        reference.registry,
        reference.repository,
        pulled.manifest
    );
    if grant.is_some() {
        let _ = writeln!(
            out,
            "installed {}",
            args.plugins.join(format!("{}.toml", args.name)).display()
        );
    }
    let _ = writeln!(out, "sha256 = \"{}\"", pulled.module.hex());
    Ok(out)
}

/// `save`: pulls what --pull names, then packs; one line per plugin saved.
pub async fn save(args: SaveArgs) -> Result<String, OciError> {
    let mut pulled = Vec::new();
    if !args.pulls.is_empty() {
        let mut registry = registry(&args.registry)?;
        for spec in &args.pulls {
            let (name, reference) = spec
                .split_once('=')
                .ok_or_else(|| OciError::PullSpec { spec: spec.clone() })?;
            install::check_name(name)?;
            let reference = Reference::parse(reference)?;
            let grant_path = args.plugins.join(format!("{name}.toml"));
            let grant = if grant_path.exists() {
                Some(Grant::read(&grant_path)?)
            } else {
                None
            };
            let (fetched, module) = fetch_module(&mut registry, &reference, grant.as_ref()).await?;
            let evidence = fetched
                .evidence
                .map(|e| serde_json::to_vec(&e).expect("evidence serializes"));
            pulled.push((name.to_string(), module.to_vec(), evidence));
        }
    }
    let plugins = archive::save(&args.plugins, &args.names, &pulled, &args.out)?;
    let mut out = String::new();
    for plugin in plugins {
        let grant = if plugin.grant {
            " (with its grant)"
        } else {
            ""
        };
        let _ = writeln!(out, "saved {} {}{grant}", plugin.name, plugin.digest);
    }
    let _ = writeln!(out, "wrote {}", args.out.display());
    Ok(out)
}

/// `load`: one line per plugin installed.
pub fn load(args: LoadArgs) -> Result<String, OciError> {
    let plugins = archive::load(&args.file, &args.plugins, mib(args.max_module_mib))?;
    let mut out = String::new();
    for plugin in plugins {
        let grant = if plugin.grant {
            " (with its grant)"
        } else {
            ""
        };
        let _ = writeln!(out, "loaded {} {}{grant}", plugin.name, plugin.digest);
    }
    Ok(out)
}
