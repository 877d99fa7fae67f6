//! The offline commands as a user runs them: the real binary on real guests and YAML files.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;

const HOSTPATH: &str = "test.wasm-provisioner.dev/hostpath";

fn wasm_provisioner(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args(args)
        .output()
        .expect("run wasm-provisioner")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn inspect_reports_contract_and_hooks() {
    let out = wasm_provisioner(&["inspect", guest_wasm("hostpath").to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("contract:  wasm-provisioner:provisioner@0.1.3"),
        "{stdout}"
    );
    assert!(stdout.contains("hooks:     cloning"), "{stdout}");
    assert!(stdout.contains("runnable:  yes"), "{stdout}");

    let out = wasm_provisioner(&["inspect", guest_wasm("scripted").to_str().unwrap()]);
    assert!(text(&out.stdout).contains("qualifier, deletion-guard, block-support"));
}

/// The pin `inspect` prints is grant syntax: pasted into a grant file, that module loads and
/// another one does not.
#[test]
fn the_pin_inspect_prints_loads_its_module_and_refuses_another() {
    let out = wasm_provisioner(&["inspect", guest_wasm("hostpath").to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let pin = &stdout[stdout.find("[module]\n").expect("pin lines")..];
    let storage = tempfile::tempdir().unwrap();
    let grant = format!(
        "{}\n{pin}",
        dir_grant(HOSTPATH, storage.path(), "/volumes", "")
    );
    let files = tempfile::tempdir().unwrap();
    let class = write(
        files.path(),
        "sc.yaml",
        &format!(
            "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: hostpath\nprovisioner: {HOSTPATH}\n"
        ),
    );
    let claim = write(
        files.path(),
        "pvc.yaml",
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: data\n  namespace: demo\n  uid: 77\nspec:\n  storageClassName: hostpath\n  resources:\n    requests:\n      storage: 1Gi\n",
    );
    for (crate_name, loads) in [("hostpath", true), ("scripted", false)] {
        let plugins = PluginsDir::new();
        plugins.add("pinned", crate_name, &grant);
        let out = wasm_provisioner(&[
            "provision",
            "--plugins",
            plugins.path().to_str().unwrap(),
            "--class",
            &class,
            "--claim",
            &claim,
        ]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(
            out.status.success(),
            loads,
            "{crate_name}: {stdout}{stderr}"
        );
        if !loads {
            assert!(stderr.contains("its grant file pins"), "{stderr}");
        }
    }
}

#[test]
fn inspect_rejects_other_contract_versions_and_garbage() {
    let out = wasm_provisioner(&["inspect", guest_wasm("contract_v2").to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("runnable:  no") && stderr.contains("@0.2.0"),
        "{stderr}"
    );

    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("x.wasm");
    std::fs::write(&garbage, b"not wasm at all").unwrap();
    let out = wasm_provisioner(&["inspect", garbage.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("does not compile"),
        "{}",
        text(&out.stderr)
    );
}

/// Runs `wasm-provisioner ARGS` with `env` and samples its own peak resident memory (`VmHWM` of
/// its /proc entry, every 5 ms until it exits): the process alone, never its children (wait4's
/// `ru_maxrss` would fold in a reaped compile child's). Output and peak MiB.
fn run_sampling_peak(args: &[&str], env: &[(&str, &str)]) -> (Output, u64) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run wasm-provisioner");
    let status = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0;
    while child.try_wait().expect("wait").is_none() {
        let kib = std::fs::read_to_string(&status)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0);
        peak_kib = peak_kib.max(kib);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    (child.wait_with_output().expect("output"), peak_kib / 1024)
}

/// `inspect` is what an operator runs on a module before trusting it: it compiles in the same
/// child, under the same limits, as `run` (here the limits of a 512 MiB pod, from the flags'
/// environment variables), so a compile bomb costs the child, not the operator's process.
#[test]
fn inspect_compiles_in_the_child_under_the_run_limits() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"not wasm at all").unwrap();
    let bomb = dir.path().join("bomb.wasm");
    std::fs::write(&bomb, compile_bomb(2, 2_000, 100_000)).unwrap();
    let limits = [
        ("WP_COMPILE_MEMORY_MIB", "384"),
        ("WP_COMPILE_CPU_SECONDS", "2"),
    ];
    let (_, base) = run_sampling_peak(&["inspect", garbage.to_str().unwrap()], &limits);
    let started = std::time::Instant::now();
    let (out, peak) = run_sampling_peak(&["inspect", bomb.to_str().unwrap()], &limits);
    let took = started.elapsed();
    let stderr = text(&out.stderr);
    println!(
        "inspect of a {} KiB compile bomb: {took:?}, the inspect process' peak {peak} MiB (without compiling: {base} MiB); {}",
        std::fs::metadata(&bomb).unwrap().len() / 1024,
        stderr.trim()
    );
    assert!(!out.status.success(), "the bomb is not runnable");
    assert!(
        stderr.contains("compiler process"),
        "refused by the compile child: {stderr}"
    );
    assert!(
        peak <= base + 32,
        "the inspect process grew from {base} to {peak} MiB"
    );
}

fn write(dir: &Path, name: &str, body: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path.display().to_string()
}

#[test]
fn provision_prints_the_pv_and_delete_removes_the_directory() {
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "hostpath",
        "hostpath",
        &dir_grant(HOSTPATH, storage.path(), "/volumes", ""),
    );
    let files = tempfile::tempdir().unwrap();
    let class = write(
        files.path(),
        "sc.yaml",
        &format!(
            "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: hostpath\nprovisioner: {HOSTPATH}\nreclaimPolicy: Delete\nmountOptions: [noatime]\n"
        ),
    );
    let claim = write(
        files.path(),
        "pvc.yaml",
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: data\n  namespace: demo\n  uid: 1234\nspec:\n  storageClassName: hostpath\n  accessModes: [ReadWriteOnce]\n  resources:\n    requests:\n      storage: 2Gi\n",
    );
    let plugins_dir = plugins.path().to_str().unwrap();
    let out = wasm_provisioner(&[
        "provision",
        "--plugins",
        plugins_dir,
        "--class",
        &class,
        "--claim",
        &claim,
        "--node",
        "node-1",
    ]);
    let pv = text(&out.stdout);
    assert!(out.status.success(), "{pv}{}", text(&out.stderr));
    let dir = storage.path().join("pvc-1234");
    assert!(dir.is_dir(), "the directory exists");
    for want in [
        "kind: PersistentVolume",
        "name: pvc-1234",
        &format!("pv.kubernetes.io/provisioned-by: {HOSTPATH}"),
        "storageClassName: hostpath",
        "storage: 2Gi",
        "persistentVolumeReclaimPolicy: Delete",
        "- noatime",
        "type: DirectoryOrCreate",
        &format!("path: {}", dir.display()),
        "- node-1",
        "uid: '1234'",
    ] {
        assert!(pv.contains(want), "missing {want:?} in:\n{pv}");
    }

    let volume = write(files.path(), "pv.yaml", &pv);
    let out = wasm_provisioner(&["delete", "--plugins", plugins_dir, "--volume", &volume]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!dir.exists(), "delete removed the directory");
}

#[test]
fn provision_reports_guest_errors_and_unserved_classes() {
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "hostpath",
        "hostpath",
        &dir_grant(HOSTPATH, storage.path(), "/volumes", ""),
    );
    let files = tempfile::tempdir().unwrap();
    let claim = write(
        files.path(),
        "pvc.yaml",
        "metadata:\n  name: c\nspec:\n  resources:\n    requests:\n      storage: 1Gi\n",
    );
    let bad = write(
        files.path(),
        "bad.yaml",
        &format!(
            "metadata:\n  name: bad\nprovisioner: {HOSTPATH}\nparameters:\n  archiveOnDelete: maybe\n"
        ),
    );
    let plugins_dir = plugins.path().to_str().unwrap();
    let out = wasm_provisioner(&[
        "provision",
        "--plugins",
        plugins_dir,
        "--class",
        &bad,
        "--claim",
        &claim,
    ]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("final error") && stderr.contains("archiveOnDelete"),
        "{stderr}"
    );

    let other = write(
        files.path(),
        "other.yaml",
        "metadata:\n  name: other\nprovisioner: example.com/none\n",
    );
    let out = wasm_provisioner(&[
        "provision",
        "--plugins",
        plugins_dir,
        "--class",
        &other,
        "--claim",
        &claim,
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains(&format!("served: {HOSTPATH}")),
        "{}",
        text(&out.stderr)
    );
}

/// `run` refuses a value out of its range at start, before it loads a guest or reaches a cluster,
/// naming the flag and the range (they were once raised to 1 without a word).
#[test]
fn run_refuses_out_of_range_values_at_start() {
    for flag in ["--worker-threads", "--create-pv-retry-count"] {
        let out = wasm_provisioner(&["run", "--plugins", "/nonexistent", flag, "0"]);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{flag}: {stderr}");
        assert!(
            stderr.contains(&format!("error: {flag} must be at least 1 (1..=")),
            "{flag}: {stderr}"
        );
    }
}

/// `test` replays recorded claims: a matching file passes, a file whose expectation is not what
/// the guest returns fails with the difference and a non-zero exit, and `--record` rewrites the
/// expectations so that the file passes again.
#[test]
fn test_replays_fixtures_and_record_rewrites_them() {
    let files = tempfile::tempdir().unwrap();
    let grant = write(
        files.path(),
        "hostpath.toml",
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("guests/hostpath/hostpath.toml"),
        )
        .unwrap(),
    );
    let fixture = |path: &str| {
        format!(
            "cases:\n\
             - name: default\n  claim: {{name: data, uid: \"11\", storage: 2Gi}}\n  pv-name: pvc-11\n  node: node-1\n\
             \x20 expect:\n    volume: {{hostPath: {{path: {path}}}, capacity: {{storage: 2Gi}}}}\n\
             - name: refused\n  class: {{parameters: {{pathPattern: \"../up\"}}}}\n  claim: {{name: d2, uid: \"22\", storage: 1Gi}}\n\
             \x20 expect:\n    error: pathPattern\n"
        )
    };
    let module = guest_wasm("hostpath");
    let module = module.to_str().unwrap();
    let run = |file: &str, record: bool| {
        let mut args = vec!["test", module, "--grant", &grant, file];
        if record {
            args.push("--record");
        }
        wasm_provisioner(&args)
    };
    let good = write(
        files.path(),
        "good.yaml",
        &fixture("/var/lib/wasm-provisioner/hostpath/pvc-11"),
    );
    let out = run(&good, false);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("2 passed, 0 failed"), "{stdout}");

    let stale = write(files.path(), "stale.yaml", &fixture("/elsewhere/pvc-11"));
    let out = run(&stale, false);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("FAILED   default: spec.hostPath.path differs")
            && stderr.contains("1 passed, 1 failed"),
        "{stderr}"
    );
    let out = run(&stale, true);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let recorded = std::fs::read_to_string(&stale).unwrap();
    assert!(
        recorded.contains("path: /var/lib/wasm-provisioner/hostpath/pvc-11"),
        "{recorded}"
    );
    assert!(run(&stale, false).status.success(), "recorded: passes");
}

/// Every sample guest declares its needs; `scaffold grant` turns them into a grant file that
/// loads unchanged, with nothing the module needs missing (no load warning about it).
#[test]
fn scaffold_grant_writes_a_grant_each_sample_loads_with() {
    let samples = [
        ("hostpath", "/volumes"),
        ("local_path", "/nodes"),
        ("nfs_subdir", "/export"),
        ("scripted", "/state"),
    ];
    for (crate_name, guest_dir) in samples {
        let host = tempfile::tempdir().unwrap();
        let module = guest_wasm(crate_name);
        let out = wasm_provisioner(&[
            "scaffold",
            "grant",
            module.to_str().unwrap(),
            "--host-dir",
            &format!("{guest_dir}={}", host.path().display()),
        ]);
        let grant = text(&out.stdout);
        assert!(out.status.success(), "{crate_name}: {}", text(&out.stderr));
        let plugins = PluginsDir::new();
        plugins.add(crate_name, crate_name, &grant);
        let direct = wasm_provisioner::wasm::load_dir(
            &wasm_provisioner::wasm::WasmEngine::new().unwrap(),
            plugins.path(),
        )
        .unwrap();
        assert_eq!(
            direct.len(),
            1,
            "{crate_name}: {:?}\n{grant}",
            direct.problems
        );
        let needs = wasm_provisioner::wasm::needs::read(&std::fs::read(&module).unwrap())
            .unwrap()
            .expect("a sample declares its needs");
        let (_, guest) = direct.iter().next().unwrap();
        assert_eq!(
            wasm_provisioner::wasm::needs::missing(&needs, guest.grants()),
            Vec::<String>::new(),
            "{crate_name}\n{grant}"
        );
    }
}

/// The fixture files the samples ship pass against the samples as built, under their shipped
/// grant files.
#[test]
fn the_samples_pass_their_shipped_fixtures() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (dir, crate_name) in [
        ("hostpath", "hostpath"),
        ("local-path", "local_path"),
        ("nfs-subdir", "nfs_subdir"),
    ] {
        let folder = repo.join("guests").join(dir);
        let fixtures = folder.join("fixtures.yaml");
        let grant = folder.join(format!("{dir}.toml"));
        let out = wasm_provisioner(&[
            "test",
            guest_wasm(crate_name).to_str().unwrap(),
            "--grant",
            grant.to_str().unwrap(),
            fixtures.to_str().unwrap(),
        ]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{dir}: {stdout}{}", text(&out.stderr));
        assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
        let cases = std::fs::read_to_string(&fixtures)
            .unwrap()
            .matches("- name:")
            .count();
        assert!(cases >= 5, "{dir}: {cases} cases");
        assert!(
            stdout.contains(&format!("{cases} passed")),
            "{dir}: {stdout}"
        );
    }
}
