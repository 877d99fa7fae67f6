//! `.ci/images` builds what the Dockerfile describes: the images it writes for the node tests hold
//! exactly the files the Dockerfile's `runtime` and `guests` stages copy (plus the stand-ins for
//! their base images: the libraries the binary loads, busybox), with the same user, entrypoint,
//! command and port, tagged as `deploy/` names them. No node, no docker needed.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::repo;

/// What one Dockerfile stage says about its image.
#[derive(Debug, Default)]
struct Stage {
    /// Absolute paths in the image that its `COPY --from=build` lines create.
    copied: BTreeSet<String>,
    /// `(source in the build stage, destination)` of each copied file.
    sources: Vec<(String, String)>,
    user: Option<String>,
    entrypoint: Option<serde_json::Value>,
    cmd: Option<serde_json::Value>,
    exposed: Option<String>,
}

/// Reads a stage (`FROM ... AS <name>`) of the Dockerfile.
fn dockerfile_stage(name: &str) -> Stage {
    let text = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    let mut stage = Stage::default();
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (keyword, rest) = line.split_once(' ').unwrap_or((line, ""));
        if keyword == "FROM" {
            inside = rest
                .split_whitespace()
                .last()
                .is_some_and(|stage_name| stage_name.eq_ignore_ascii_case(name));
            continue;
        }
        if !inside {
            continue;
        }
        match keyword {
            "COPY" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                assert_eq!(words[0], "--from=build", "{line}");
                let dest = words[words.len() - 1];
                for source in &words[1..words.len() - 1] {
                    let target = if dest.ends_with('/') {
                        format!(
                            "{dest}{}",
                            Path::new(source).file_name().unwrap().to_string_lossy()
                        )
                    } else {
                        dest.to_string()
                    };
                    stage.copied.insert(target.clone());
                    stage.sources.push((source.to_string(), target));
                }
            }
            "USER" => stage.user = Some(rest.to_string()),
            "ENTRYPOINT" => stage.entrypoint = Some(serde_json::from_str(rest).unwrap()),
            "CMD" => stage.cmd = Some(serde_json::from_str(rest).unwrap()),
            "EXPOSE" => stage.exposed = Some(format!("{rest}/tcp")),
            _ => {}
        }
    }
    assert!(
        !stage.copied.is_empty(),
        "Dockerfile stage {name} copies nothing"
    );
    stage
}

/// One image tarball: its tag, image config and the entries of its layer (`path`, type char).
struct Image {
    tag: String,
    config: serde_json::Value,
    entries: Vec<(String, char)>,
}

fn read_image(tarball: &Path, scratch: &Path) -> Image {
    let dir = scratch.join(tarball.file_stem().unwrap());
    std::fs::create_dir_all(&dir).unwrap();
    run(Command::new("tar")
        .arg("-xf")
        .arg(tarball)
        .arg("-C")
        .arg(&dir));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let manifest = &manifest[0];
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join(manifest["Config"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    let layers = manifest["Layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "{}: one layer", tarball.display());
    let listing = run(Command::new("tar")
        .arg("-tvf")
        .arg(dir.join(layers[0].as_str().unwrap())));
    let entries = listing
        .lines()
        .map(|line| {
            let kind = line.chars().next().unwrap();
            let path = line.split_whitespace().nth(5).unwrap();
            (path.trim_start_matches('.').to_string(), kind)
        })
        .filter(|(path, _)| !path.is_empty() && path != "/")
        .collect();
    Image {
        tag: manifest["RepoTags"][0].as_str().unwrap().to_string(),
        config: config["config"].clone(),
        entries,
    }
}

fn run(command: &mut Command) -> String {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Regular files and links of an image that are not directories.
fn files(image: &Image) -> BTreeSet<String> {
    image
        .entries
        .iter()
        .filter(|(_, kind)| *kind != 'd')
        .map(|(path, _)| path.trim_end_matches('/').to_string())
        .collect()
}

/// The tags `deploy/kustomization.yaml` gives the two images (`name:newTag`).
fn deployed_tags() -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo().join("deploy/kustomization.yaml")).unwrap();
    let k: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    k["images"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|image| {
            format!(
                "{}:{}",
                image["name"].as_str().unwrap(),
                image["newTag"].as_str().unwrap()
            )
        })
        .collect()
}

#[test]
fn the_images_script_builds_what_the_dockerfile_describes() {
    let runtime = dockerfile_stage("runtime");
    let guests = dockerfile_stage("guests");
    // Stand-ins for the build stage's outputs: the provisioner this test run built, and a guest
    // file named as the Dockerfile names it (the list of files is what is compared).
    let scratch = tempfile::tempdir().unwrap();
    let guests_dir = scratch.path().join("guests");
    std::fs::create_dir_all(&guests_dir).unwrap();
    for (source, _) in &guests.sources {
        let name = Path::new(source).file_name().unwrap();
        std::fs::write(guests_dir.join(name), b"\0asm").unwrap();
    }
    let out = scratch.path().join("images");
    let printed = run(Command::new("bash")
        .arg(repo().join(".ci/images"))
        .arg(&out)
        .env("WP_PROVISIONER_BIN", env!("CARGO_BIN_EXE_wasm-provisioner"))
        .env("WP_GUESTS_DIR", &guests_dir));
    assert_eq!(
        PathBuf::from(printed.lines().last().unwrap()),
        out,
        "prints the output directory last"
    );

    let provisioner = read_image(&out.join("wasm-provisioner.tar"), scratch.path());
    let guest_image = read_image(&out.join("wasm-provisioner-guests.tar"), scratch.path());
    assert_eq!(
        BTreeSet::from([provisioner.tag.clone(), guest_image.tag.clone()]),
        deployed_tags(),
        "the images carry the tags deploy/ runs"
    );
    for (image, stage, base_is) in [
        (
            &provisioner,
            &runtime,
            &(|path: &str| {
                // distroless/cc's stand-in: shared libraries the binary loads, nothing else.
                (path.starts_with("/lib/")
                    || path.starts_with("/lib64/")
                    || path.starts_with("/usr/lib/"))
                    && path.contains(".so")
            }) as &dyn Fn(&str) -> bool,
        ),
        (
            &guest_image,
            &guests,
            &(|path: &str| path.starts_with("/bin/")) as &dyn Fn(&str) -> bool,
        ),
    ] {
        let files = files(image);
        let added: BTreeSet<String> = files.iter().filter(|f| !base_is(f)).cloned().collect();
        assert_eq!(
            added, stage.copied,
            "{}: files beyond the base image",
            image.tag
        );
        assert_eq!(
            image.config["User"].as_str(),
            stage.user.as_deref(),
            "{}: user",
            image.tag
        );
        assert_eq!(
            image.config.get("Entrypoint"),
            stage.entrypoint.as_ref(),
            "{}",
            image.tag
        );
        assert_eq!(image.config.get("Cmd"), stage.cmd.as_ref(), "{}", image.tag);
        if let Some(port) = &stage.exposed {
            assert!(
                image.config["ExposedPorts"].get(port).is_some(),
                "{}: exposes {port}",
                image.tag
            );
        }
    }
    // The provisioner image can start: every library the binary loads is in it.
    assert!(
        files(&provisioner)
            .iter()
            .any(|f| f.ends_with("/libc.so.6")),
        "{:?}",
        files(&provisioner)
    );
    // The guests image has the shell and tools deploy/'s init containers run.
    let guest_files = files(&guest_image);
    for tool in ["/bin/sh", "/bin/cp", "/bin/chown"] {
        assert!(guest_files.contains(tool), "guests image lacks {tool}");
    }
    // The images only the node tests use.
    let pause = read_image(&out.join("pause.tar"), scratch.path());
    assert_eq!(files(&pause), BTreeSet::from(["/pause".to_string()]));
    let busybox = read_image(&out.join("busybox.tar"), scratch.path());
    assert!(files(&busybox).contains("/bin/sh"));
}
