//! Offline commands for guest authors and operators: `inspect`, `provision`, `delete`.
//!
//! They run guests exactly as the controller does (same grants, limits and validation) on YAML
//! files, without a cluster; and compile them as it does, in the compiler child under the same
//! limits (`inspect` is what an operator runs on a module not trusted yet).

use std::path::Path;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;

use crate::controller::convert::PvIdentity;
use crate::controller::data_source::{self, DataSource};
use crate::controller::decide;
use crate::controller::storage::{self, Deleted, Qualified};
use crate::wasm::compiler::CompileLimits;
use crate::wasm::contract::ContractInfo;
use crate::wasm::contract::hook_names;
use crate::wasm::{EngineOptions, Grants, Plugins, WasmEngine, load_dir};

/// The engine of the offline commands: `run`'s, compiling in the child under `compiler`.
fn engine(compiler: Option<CompileLimits>) -> anyhow::Result<WasmEngine> {
    Ok(WasmEngine::with_options(&EngineOptions {
        compiler,
        ..EngineOptions::default()
    })?)
}

/// What the module at `file` declares it needs, for `inspect`.
fn describe_needs(file: &Path) -> anyhow::Result<String> {
    use crate::wasm::needs;
    let bytes = crate::wasm::engine::read_module(file)?;
    let declared = match needs::read(&bytes) {
        Ok(Some(declared)) => declared,
        Ok(None) => return Ok("needs:     none declared\n".into()),
        Err(error) => return Ok(format!("needs:     unreadable: {error}\n")),
    };
    let mut out = String::from(
        "needs:     (declared by the module; `scaffold grant` writes a grant from it)\n",
    );
    if let Some(provisioner) = &declared.provisioner {
        out.push_str(&format!("  provisioner  {provisioner}\n"));
    }
    for dir in &declared.dirs {
        let why = dir
            .why
            .as_deref()
            .map(|w| format!(": {w}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  dir          {} ({}){why}\n",
            dir.guest,
            needs::access_name(dir.access)
        ));
    }
    let kinds: Vec<&str> = declared.kinds.iter().map(|k| k.as_str()).collect();
    out.push_str(&format!("  kinds        {}\n", kinds.join(", ")));
    for key in &declared.config {
        let mut notes = Vec::new();
        if key.required {
            notes.push("required".to_string());
        }
        if let Some(example) = &key.example {
            notes.push(format!("example {example:?}"));
        }
        if let Some(why) = &key.why {
            notes.push(why.clone());
        }
        out.push_str(&format!(
            "  config       {} ({})\n",
            key.key,
            notes.join("; ")
        ));
    }
    out.push_str(&format!(
        "  owners       {}\n",
        if declared.owners { "yes" } else { "no" }
    ));
    if let Some(limits) = &declared.limits {
        let show = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "  limits       memory-mib {}, call-timeout-ms {}\n",
            show(limits.memory_mib),
            show(limits.call_timeout_ms)
        ));
    }
    Ok(out)
}

/// `inspect FILE`: prints what the guest implements; fails when this host cannot run it.
/// Compiles once, in the child under `compiler`.
pub fn inspect(file: &Path, compiler: Option<CompileLimits>) -> anyhow::Result<String> {
    let engine = engine(compiler)?;
    let (component, sha256) = engine.compile(file)?;
    let info = ContractInfo::of(engine.engine(), &component);
    let mut out = String::new();
    out.push_str(&format!(
        "file:      {}\nsha256:    {sha256}\n",
        file.display()
    ));
    out.push_str(&format!(
        "contract:  {}\n",
        info.version
            .as_deref()
            .map(|v| format!("{}@{v}", crate::wasm::bindings::PACKAGE))
            .unwrap_or_else(|| "none (no lifecycle export)".into())
    ));
    let hooks = hook_names(&info.hooks);
    out.push_str(&format!(
        "hooks:     {}\n",
        if hooks.is_empty() {
            "none (defaults: provision every claim, delete every released volume, no block)"
                .to_string()
        } else {
            hooks.join(", ")
        }
    ));
    out.push_str("imports:\n");
    for import in &info.imports {
        out.push_str(&format!("  {import}\n"));
    }
    out.push_str(&format!(
        "host serves: {}@{} (compatible: 0.1.x)\n",
        crate::wasm::bindings::PACKAGE,
        crate::wasm::bindings::PACKAGE_VERSION
    ));
    out.push_str(&describe_needs(file)?);
    let grants = Grants::parse("provisioner = \"inspect\"", Path::new("."))?;
    let display = file.display().to_string();
    match engine.load_compiled("inspect", &display, component, &sha256, true, grants) {
        Ok(_) => {
            out.push_str("runnable:  yes\n");
            out.push_str("pin (add to its grant file to load exactly these bytes):\n");
            out.push_str(&crate::wasm::pin::pin_lines(&sha256));
            Ok(out)
        }
        Err(error) => {
            out.push_str(&format!("runnable:  no: {error}\n"));
            bail!("{out}")
        }
    }
}

fn read_yaml<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    serde_yaml::from_str(&text)
        .with_context(|| format!("{} is not a valid {what} manifest", path.display()))
}

pub(crate) fn load_plugins(dir: &Path, compiler: Option<CompileLimits>) -> anyhow::Result<Plugins> {
    let engine = engine(compiler)?;
    let plugins = load_dir(&engine, dir)?;
    for problem in &plugins.problems {
        eprintln!("skipped {problem}");
    }
    Ok(plugins)
}

fn served_names(plugins: &Plugins) -> String {
    let names: Vec<&str> = plugins.iter().map(|(n, _)| n.as_str()).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// `provision`: runs the guest serving the class and returns the PV YAML the controller would create.
pub async fn provision(
    plugins_dir: &Path,
    class_path: &Path,
    claim_path: &Path,
    node: Option<&str>,
    compiler: Option<CompileLimits>,
) -> anyhow::Result<String> {
    let class: StorageClass = read_yaml(class_path, "StorageClass")?;
    let claim: PersistentVolumeClaim = read_yaml(claim_path, "PersistentVolumeClaim")?;
    let plugins = load_plugins(plugins_dir, compiler)?;
    let pv = provision_pv(&plugins, &class, claim, node).await?;
    let mut yaml = String::from("apiVersion: v1\nkind: PersistentVolume\n");
    yaml.push_str(&serde_yaml::to_string(&pv)?);
    Ok(yaml)
}

/// The PV the controller would create for `claim` of `class` with `plugins`, the claim
/// completed as the cluster would have it (uid, namespace, the provisioner and node annotations).
pub async fn provision_pv(
    plugins: &Plugins,
    class: &StorageClass,
    mut claim: PersistentVolumeClaim,
    node: Option<&str>,
) -> anyhow::Result<PersistentVolume> {
    if claim.metadata.uid.is_none() {
        claim.metadata.uid = Some(random_uid());
    }
    if claim.metadata.namespace.is_none() {
        claim.metadata.namespace = Some("default".into());
    }
    let annotations = claim
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    annotations
        .entry(decide::ANN_STORAGE_PROVISIONER.to_string())
        .or_insert_with(|| class.provisioner.clone());
    if let Some(node) = node {
        annotations.insert(decide::ANN_SELECTED_NODE.to_string(), node.to_string());
    }
    let guest = plugins
        .for_provisioner(&class.provisioner)
        .with_context(|| {
            format!(
                "no loaded guest serves provisioner {:?} (served: {})",
                class.provisioner,
                served_names(plugins)
            )
        })?;
    let class_name = class.metadata.name.clone().unwrap_or_default();
    let pv_name = decide::pv_name(&claim).expect("uid set above");
    let request = match storage::qualify(guest, &claim, class, &pv_name).await? {
        Qualified::Ready(request) => request,
        Qualified::Unsupported(missing) => {
            bail!("{}", missing.refusal(&class.provisioner, guest.name()))
        }
        Qualified::Declined => bail!(
            "guest {} declined the claim (its qualifier hook returned false)",
            guest.name()
        ),
    };
    let identity = PvIdentity {
        name: &pv_name,
        claim: &claim,
        class,
        class_name: &class_name,
        held: false,
    };
    if let DataSource::Claim { name, .. } = data_source::of(&claim) {
        bail!(
            "the claim clones claim {name:?}: a copy needs its source read and held in the live cluster, which this command does not reach"
        );
    }
    Ok(storage::build(guest, &request, None, &identity).await?)
}

/// `delete`: runs the guest that provisioned the PV on it.
pub async fn delete(
    plugins_dir: &Path,
    volume_path: &Path,
    class_path: Option<&Path>,
    compiler: Option<CompileLimits>,
) -> anyhow::Result<String> {
    let pv: PersistentVolume = read_yaml(volume_path, "PersistentVolume")?;
    let class: Option<StorageClass> = class_path
        .map(|p| read_yaml(p, "StorageClass"))
        .transpose()?;
    let provisioner = decide::claim_provisioner_of_volume(&pv)
        .with_context(|| {
            format!(
                "the volume has no {} annotation",
                decide::ANN_PROVISIONED_BY
            )
        })?
        .to_string();
    let plugins = load_plugins(plugins_dir, compiler)?;
    let guest = plugins.for_provisioner(&provisioner).with_context(|| {
        format!(
            "no loaded guest serves provisioner {provisioner:?} (served: {})",
            served_names(&plugins)
        )
    })?;
    if !storage::guard(guest, &pv).await? {
        bail!(
            "guest {} keeps the volume (its deletion-guard hook returned false)",
            guest.name()
        );
    }
    if let Deleted::NotHeld(reason) = storage::delete(guest, &pv, class.as_ref()).await? {
        return Ok(format!(
            "guest {} holds no storage of {}: {reason}\n",
            guest.name(),
            pv.metadata.name.unwrap_or_default()
        ));
    }
    Ok(format!(
        "deleted storage of {} with guest {}\n",
        pv.metadata.name.unwrap_or_default(),
        guest.name()
    ))
}

fn random_uid() -> String {
    let bytes: [u8; 16] = rand::random();
    let hex = hex::encode(bytes);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}
