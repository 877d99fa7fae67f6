//! Size-enforcing grant directories (`sizes = "btrfs"`) with the real hostpath guest loaded
//! in-process: the host makes each volume a subvolume limited to its PV's capacity and destroys
//! it whole. Root and a loop-mounted btrfs, as tests/sizes.rs.

mod common;

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use common::btrfs::{Btrfs, MIB, is_edquot, write};
use common::*;
use wasm_provisioner::sizes::{SizeBackend, btrfs};
use wasm_provisioner::wasm::bindings::expansion::ExpandRequest;
use wasm_provisioner::wasm::bindings::types::{DeleteRequest, Volume};
use wasm_provisioner::wasm::expand::Grown;
use wasm_provisioner::wasm::{Guest, Plugins, WasmEngine, load_dir};

const HOSTPATH: &str = "test.wasm-provisioner.dev/hostpath";

/// The hostpath guest's grant on `storage`, its directory with `sizes = "btrfs"` and `extra`.
fn sized_grant(storage: &Path, extra: &str) -> String {
    let grant = dir_grant(HOSTPATH, storage, "/volumes", "");
    let sized = format!("access = \"read-write\"\nsizes = \"btrfs\"\n{extra}");
    grant.replacen("access = \"read-write\"\n", &sized, 1)
}

fn load(storage: &Path, extra: &str) -> (PluginsDir, Plugins) {
    let plugins = PluginsDir::new();
    plugins.add("hostpath", "hostpath", &sized_grant(storage, extra));
    let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
    (plugins, loaded)
}

fn guest(loaded: &Plugins) -> Arc<Guest> {
    assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
    loaded.for_provisioner(HOSTPATH).unwrap().clone()
}

/// A request for claim `name` asking for `mib` MiB.
fn request_of(
    guest: &Guest,
    name: &str,
    mib: u64,
) -> wasm_provisioner::wasm::bindings::types::ProvisionRequest {
    let mut claim = claim(name);
    claim.requested_bytes = mib * MIB;
    request(claim, class(HOSTPATH, &[]), &guest.grants().config_json)
}

/// The guest's delete of `volume`, as the controller would ask for it.
async fn delete(guest: &Guest, volume: Volume) -> Result<(), wasm_provisioner::wasm::CallError> {
    let request = DeleteRequest {
        volume,
        storage_class: None,
        config: guest.grants().config_json.clone(),
    };
    guest.delete(&request).await
}

fn open(path: &Path) -> File {
    File::open(path).unwrap()
}

#[test]
fn a_directory_that_cannot_enforce_sizes_refuses_its_guest_at_load() {
    let plain = tempfile::tempdir().unwrap();
    let (_plugins, loaded) = load(plain.path(), "");
    let problems = format!("{:?}", loaded.problems);
    assert!(
        problems.contains("cannot hold volumes with enforced sizes")
            && problems.contains("not on btrfs"),
        "{problems}"
    );
    assert!(loaded.for_provisioner(HOSTPATH).is_none());

    let off = Btrfs::new();
    let (_plugins, loaded) = load(&off.mnt, "");
    let problems = format!("{:?}", loaded.problems);
    assert!(problems.contains("quotas are not enabled"), "{problems}");
    let (_plugins, loaded) = load(&off.mnt, "enable-quotas = true\n");
    guest(&loaded);
    assert_eq!(
        btrfs::quotas(off.root()).unwrap(),
        wasm_provisioner::sizes::Quotas::Simple
    );

    let refused = PluginsDir::new();
    refused.add(
        "hostpath",
        "hostpath",
        &sized_grant(plain.path(), "").replace("read-write", "read-only"),
    );
    let loaded = load_dir(&WasmEngine::new().unwrap(), refused.path()).unwrap();
    assert!(
        format!("{:?}", loaded.problems).contains("has `sizes` but is not read-write"),
        "{:?}",
        loaded.problems
    );
}

#[tokio::test]
async fn every_volume_is_a_subvolume_limited_to_its_claim_and_destroyed_whole() {
    let fs = Btrfs::new().with_quotas();
    let (_plugins, loaded) = load(&fs.mnt, "");
    let guest = guest(&loaded);
    let small = request_of(&guest, "small", 64);
    let built = guest.provision(&small).await.expect("provision");
    let dir = fs.mnt.join(&small.pv_name);
    assert!(SizeBackend::Btrfs.is_volume(open(&dir)).unwrap());
    let usage = SizeBackend::Btrfs.usage(open(&dir)).unwrap();
    assert_eq!(usage.max_referenced, Some(64 * MIB));

    // A retry of the same provision adopts the volume it made.
    guest.provision(&small).await.expect("retry");
    assert_eq!(SizeBackend::Btrfs.usage(open(&dir)).unwrap().id, usage.id);

    let other = request_of(&guest, "other", 512);
    let other_built = guest.provision(&other).await.expect("second volume");
    let other_dir = fs.mnt.join(&other.pv_name);

    let (error, written) = write(&dir.join("fill"), 100 * MIB);
    let error = error.expect("a write past the limit fails");
    assert!(is_edquot(&error), "{error}");
    assert!(
        written <= 65 * MIB,
        "wrote {written} bytes into a 64 MiB volume"
    );
    let (error, written) = write(&other_dir.join("data"), 100 * MIB);
    assert!(
        error.is_none() && written == 100 * MIB,
        "{error:?} {written}"
    );

    for i in 0..2_000 {
        std::fs::write(dir.join(format!("f{i}")), "x").unwrap_or(());
    }
    delete(&guest, as_volume(&small, &built))
        .await
        .expect("delete");
    assert!(!dir.exists() && !dir.is_symlink());
    btrfs::wait_dropped(fs.root(), usage.id).expect("dropped");
    assert!(
        !btrfs::qgroup_ids(fs.root()).unwrap().contains(&usage.id),
        "the qgroup 0/{} went with its subvolume",
        usage.id
    );
    let other_volume = as_volume(&other, &other_built);
    delete(&guest, other_volume)
        .await
        .expect("delete the second");
    assert!(!other_dir.exists());
}

#[tokio::test]
async fn a_subvolume_the_host_did_not_make_is_never_adopted_or_destroyed() {
    let fs = Btrfs::new().with_quotas();
    let (_plugins, loaded) = load(&fs.mnt, "");
    let guest = guest(&loaded);
    let req = request_of(&guest, "taken", 64);
    let planted = fs.mnt.join(&req.pv_name);
    // An operator's (or anyone's) empty subvolume where the volume would go.
    drop(
        SizeBackend::Btrfs
            .create(fs.root(), &req.pv_name, 32 * MIB)
            .unwrap(),
    );
    let error = guest.provision(&req).await.unwrap_err().to_string();
    assert!(error.contains("never adopted"), "{error}");
    assert!(SizeBackend::Btrfs.is_volume(open(&planted)).unwrap());
    assert_eq!(
        SizeBackend::Btrfs
            .usage(open(&planted))
            .unwrap()
            .max_referenced,
        Some(32 * MIB),
        "its limit untouched"
    );

    // A delete naming it (a PV that lies about its path) leaves it too.
    let mut other = request_of(&guest, "liar", 64);
    let built = guest.provision(&other).await.expect("a volume of its own");
    other.pv_name = req.pv_name.clone();
    let mut volume = as_volume(&other, &built);
    volume.name = "pvc-uid-liar".into();
    volume.annotations.clear();
    if let wasm_provisioner::wasm::bindings::types::VolumeSource::HostPath(h) = &mut volume.source {
        h.path = planted.display().to_string();
    }
    let error = delete(&guest, volume).await.unwrap_err().to_string();
    assert!(error.contains("never adopted or destroyed"), "{error}");
    assert!(SizeBackend::Btrfs.is_volume(open(&planted)).unwrap());
}

/// A clone in a size-enforcing directory is a snapshot the host makes of the source volume:
/// instant whatever its size, with the clone's own limit, taken up by the clone's PV (marked
/// with its name); a retry finds it, and a delete destroys it.
#[tokio::test]
async fn a_clone_is_a_snapshot_with_a_limit_of_its_own() {
    use wasm_provisioner::wasm::bindings::cloning::CloneSource;
    let fs = Btrfs::new().with_quotas();
    let (_plugins, loaded) = load(&fs.mnt, "");
    let guest = guest(&loaded);
    let source_req = request_of(&guest, "db", 64);
    let source_built = guest.provision(&source_req).await.expect("source");
    let source_dir = fs.mnt.join(&source_req.pv_name);
    let (error, _) = write(&source_dir.join("rows"), 48 * MIB);
    assert!(error.is_none(), "{error:?}");
    std::os::unix::fs::symlink("rows", source_dir.join("latest")).unwrap();
    let source = CloneSource {
        namespace: "ns".into(),
        name: "db".into(),
        uid: "uid-db".into(),
        volume: as_volume(&source_req, &source_built),
    };
    let copy_req = request_of(&guest, "copy", 96);
    let built = guest
        .provision_clone(&copy_req, &source)
        .await
        .expect("clone");
    let copy_dir = fs.mnt.join(&copy_req.pv_name);
    assert!(SizeBackend::Btrfs.is_volume(open(&copy_dir)).unwrap());
    assert_eq!(
        std::fs::read(copy_dir.join("rows")).unwrap(),
        std::fs::read(source_dir.join("rows")).unwrap()
    );
    assert_eq!(
        std::fs::read_link(copy_dir.join("latest")).unwrap(),
        Path::new("rows")
    );
    let usage = SizeBackend::Btrfs.usage(open(&copy_dir)).unwrap();
    assert_eq!(
        usage.max_referenced,
        Some(96 * MIB),
        "the clone's own limit"
    );
    assert_ne!(
        usage.id,
        SizeBackend::Btrfs.usage(open(&source_dir)).unwrap().id
    );
    // The shared 48 MiB stay charged to the source (simple quotas): the clone's own 96 MiB
    // take 90 MiB more, not 100.
    let (error, _) = write(&copy_dir.join("more"), 90 * MIB);
    assert!(error.is_none(), "{error:?}");
    let (error, _) = write(&copy_dir.join("past"), 10 * MIB);
    assert!(error.is_some_and(|e| is_edquot(&e)));
    assert!(
        !fs.mnt
            .join(format!(".{}.cloning", copy_req.pv_name))
            .exists()
    );

    guest
        .provision_clone(&copy_req, &source)
        .await
        .expect("a retry finds the finished clone");
    delete(&guest, as_volume(&copy_req, &built))
        .await
        .expect("delete the clone");
    assert!(!copy_dir.exists());
    assert_eq!(
        std::fs::metadata(source_dir.join("rows")).unwrap().len(),
        48 * MIB
    );
}

/// Hostile sizes: a claim of one byte gets a volume limited to one byte (nothing can be written
/// into it, and it is deleted like any other); a claim larger than the filesystem gets a
/// volume whose limit is its claim (the filesystem's own size then bounds it).
#[tokio::test]
async fn a_claim_of_one_byte_and_one_larger_than_the_filesystem() {
    let fs = Btrfs::new().with_quotas();
    let (_plugins, loaded) = load(&fs.mnt, "");
    let guest = guest(&loaded);
    let mut tiny = request_of(&guest, "tiny", 1);
    tiny.claim.requested_bytes = 1;
    let built = guest.provision(&tiny).await.expect("a one-byte volume");
    let dir = fs.mnt.join(&tiny.pv_name);
    assert_eq!(
        SizeBackend::Btrfs.usage(open(&dir)).unwrap().max_referenced,
        Some(1)
    );
    // Not even a file can be made in it.
    let error = File::create(dir.join("f")).expect_err("a file in a one-byte volume");
    assert!(is_edquot(&error), "{error}");
    delete(&guest, as_volume(&tiny, &built))
        .await
        .expect("delete");
    assert!(!dir.exists());

    let huge = request_of(&guest, "huge", 64 << 20); // 64 TiB on a 1 GiB filesystem
    guest
        .provision(&huge)
        .await
        .expect("a volume larger than the filesystem");
    let dir = fs.mnt.join(&huge.pv_name);
    assert_eq!(
        SizeBackend::Btrfs.usage(open(&dir)).unwrap().max_referenced,
        Some(64 << 40)
    );
}

/// What the controller hands `expand` for `volume` asking for `mib` MiB.
fn expand_request(guest: &Guest, volume: Volume, mib: u64) -> ExpandRequest {
    ExpandRequest {
        volume,
        requested_bytes: mib * MIB,
        storage_class: class(HOSTPATH, &[]),
        config: guest.grants().config_json.clone(),
    }
}

/// A volume grows: the guest's `expand` answers, the host raises the subvolume's limit to the
/// answer, and what did not fit before fits. The host walks the PV's path, never a link a pod
/// left in its place, and never raises a subvolume it did not make for that PV.
#[tokio::test]
async fn a_volume_grows_and_a_link_or_a_foreign_subvolume_in_its_place_is_refused() {
    let fs = Btrfs::new().with_quotas();
    let (_plugins, loaded) = load(&fs.mnt, "");
    let guest = guest(&loaded);
    let small = request_of(&guest, "grows", 32);
    let built = guest.provision(&small).await.expect("provision");
    let dir = fs.mnt.join(&small.pv_name);
    let (error, written) = write(&dir.join("before"), 64 * MIB);
    assert!(error.is_some_and(|e| is_edquot(&e)), "{written}");
    let volume = as_volume(&small, &built);
    let grown = guest
        .expand(&expand_request(&guest, volume.clone(), 128))
        .await
        .expect("expand");
    assert_eq!(
        grown,
        Grown {
            bytes: 128 * MIB,
            limit_raised: true
        }
    );
    let limit = |path: &Path| SizeBackend::Btrfs.usage(open(path)).unwrap().max_referenced;
    assert_eq!(limit(&dir), Some(128 * MIB));
    let (error, written) = write(&dir.join("after"), 64 * MIB);
    assert!(error.is_none() && written == 64 * MIB, "{error:?}");
    // Again (a retry after a crash): the same answer, the limit as it is.
    guest
        .expand(&expand_request(&guest, volume.clone(), 128))
        .await
        .expect("expand again");
    assert_eq!(limit(&dir), Some(128 * MIB));

    // A pod's link where the volume was, to another volume: refused, the other untouched.
    let other = request_of(&guest, "neighbour", 16);
    guest.provision(&other).await.expect("neighbour");
    let neighbour = fs.mnt.join(&other.pv_name);
    std::fs::rename(&dir, fs.mnt.join("moved")).unwrap();
    std::os::unix::fs::symlink(&neighbour, &dir).unwrap();
    let error = guest
        .expand(&expand_request(&guest, volume.clone(), 512))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("link"), "{error}");
    assert_eq!(limit(&neighbour), Some(16 * MIB), "the neighbour's limit");

    // A subvolume the host did not make for this PV at its path: refused, untouched.
    std::fs::remove_file(&dir).unwrap();
    drop(
        SizeBackend::Btrfs
            .create(fs.root(), &small.pv_name, 8 * MIB)
            .unwrap(),
    );
    let error = guest
        .expand(&expand_request(&guest, volume.clone(), 512))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("did not make"), "{error}");
    assert_eq!(limit(&dir), Some(8 * MIB));
}
