//! The script a StorageClass (and the annotations it leaves on PVs) plays: which call fails
//! how, how long provision takes, and what the returned volume says.

use crate::wasm_provisioner::provisioner::types::{Pair, ProvisionError};

/// Claim annotation: `"true"` makes `should-provision` answer false.
pub const SKIP_ANNOTATION: &str = "scripted.wasm-provisioner.dev/skip";
/// PV annotation set on every volume provisioned.
pub const CREATED_ANNOTATION: &str = "scripted.wasm-provisioner.dev/created";
/// PV annotation (from `keep`): `"true"` makes `should-delete` answer false.
pub const KEEP_ANNOTATION: &str = "scripted.wasm-provisioner.dev/keep";
/// PV annotation (from `deleteFail`): how `delete` fails, `final` or `transient`.
pub const DELETE_FAIL_ANNOTATION: &str = "scripted.wasm-provisioner.dev/delete-fail";
/// PV annotation (from `deleteFailTimes`): how many deletes fail before one succeeds.
pub const DELETE_FAIL_TIMES_ANNOTATION: &str = "scripted.wasm-provisioner.dev/delete-fail-times";
/// PV annotation (from `deleteDelayMs`): how long delete sleeps before it removes the storage.
pub const DELETE_DELAY_ANNOTATION: &str = "scripted.wasm-provisioner.dev/delete-delay-ms";
/// PV annotation (from `byClaim`): the storage directory's name, when not the PV's.
pub const DIR_ANNOTATION: &str = "scripted.wasm-provisioner.dev/dir";

const KNOWN_PARAMETERS: &[&str] = &[
    "fail",
    "failTimes",
    "delayMs",
    "spinForever",
    "hostPath",
    "deleteFail",
    "deleteFailTimes",
    "deleteDelayMs",
    "byClaim",
    "keep",
    "pinToSelectedNode",
    "ignoreSpecErrors",
    "expandFail",
    "expandFailTimes",
    "expandShort",
];

/// How a scripted call fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// `provision-error::final`.
    Final,
    /// `provision-error::transient`.
    Transient,
    /// `provision-error::reschedule`.
    Reschedule,
    /// `provision-error::in-background`.
    InBackground,
    /// `provision-error::ignored`.
    Ignored,
    /// A panic, which the host sees as a trap.
    Trap,
}

impl Failure {
    fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "final" => Self::Final,
            "transient" => Self::Transient,
            "reschedule" => Self::Reschedule,
            "in-background" => Self::InBackground,
            "ignored" => Self::Ignored,
            "trap" => Self::Trap,
            _ => return None,
        })
    }

    /// The WIT error for this failure; `None` for [`Failure::Trap`], which the caller must panic for.
    pub fn into_error(self, message: String) -> Option<ProvisionError> {
        Some(match self {
            Self::Final => ProvisionError::Final(message),
            Self::Transient => ProvisionError::Transient(message),
            Self::Reschedule => ProvisionError::Reschedule(message),
            Self::InBackground => ProvisionError::InBackground(message),
            Self::Ignored => ProvisionError::Ignored(message),
            Self::Trap => return None,
        })
    }
}

/// The parsed StorageClass parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProvisionScript {
    /// `fail`: how provision fails.
    pub fail: Option<Failure>,
    /// `failTimes`: how many provision attempts fail before one succeeds (all when unset).
    pub fail_times: Option<u64>,
    /// `delayMs`: how long provision sleeps after writing `<pv>.started`.
    pub delay_ms: u64,
    /// `spinForever: "true"`: provision never returns (a busy loop).
    pub spin_forever: bool,
    /// `hostPath`: the path put into the volume instead of `<node-dir>/<pv>`.
    pub host_path: Option<String>,
    /// `deleteFail`: how `delete` will fail (`final` or `transient`), recorded on the PV.
    pub delete_fail: Option<Failure>,
    /// `deleteFailTimes`: how many deletes fail before one succeeds (all when unset), recorded on the PV.
    pub delete_fail_times: Option<u64>,
    /// `keep: "true"`: `should-delete` will answer false, recorded on the PV.
    pub keep: bool,
    /// `deleteDelayMs`: how long `delete` sleeps before removing the storage, recorded on the PV.
    pub delete_delay_ms: u64,
    /// `byClaim: "true"`: the storage is named after the claim (`claim-<namespace>-<name>`), as
    /// name-based patterns do, instead of after the PV; the name is recorded on the PV.
    pub by_claim: bool,
    /// `ignoreSpecErrors: "true"`: return the spec even when a builder call was refused, so the
    /// host's check of the finished spec is exercised too.
    pub ignore_spec_errors: bool,
    /// `pinToSelectedNode: "true"`: pin the volume to the selected node (`kubernetes.io/hostname`),
    /// as node-local guests do; for the node-deployment tests.
    pub pin_to_selected_node: bool,
    /// `expandFail`: how `expand` fails.
    pub expand_fail: Option<Failure>,
    /// `expandFailTimes`: how many `expand` attempts fail before one succeeds (all when unset).
    pub expand_fail_times: Option<u64>,
    /// `expandShort: "true"`: `expand` answers one byte less than the request (which the host
    /// must refuse).
    pub expand_short: bool,
}

impl ProvisionScript {
    /// Parses the class parameters; unknown ones are an error, so that a test's typo shows.
    pub fn parse(parameters: &[Pair]) -> Result<Self, String> {
        let mut script = Self::default();
        for Pair { key, value } in parameters {
            let invalid =
                |expected: &str| format!("parameter {key}: expected {expected}, got {value:?}");
            match key.as_str() {
                "fail" => {
                    script.fail = Some(Failure::parse(value).ok_or_else(|| {
                        invalid("one of final, transient, reschedule, in-background, ignored, trap")
                    })?)
                }
                "failTimes" => {
                    script.fail_times = Some(value.parse().map_err(|_| invalid("a count"))?)
                }
                "delayMs" => {
                    script.delay_ms = value.parse().map_err(|_| invalid("milliseconds"))?
                }
                "spinForever" => {
                    script.spin_forever = parse_bool(value).ok_or_else(|| invalid("a boolean"))?
                }
                "hostPath" => script.host_path = Some(value.clone()),
                "deleteFail" => {
                    script.delete_fail = Some(
                        parse_delete_failure(value).ok_or_else(|| invalid("final or transient"))?,
                    )
                }
                "deleteFailTimes" => {
                    script.delete_fail_times = Some(value.parse().map_err(|_| invalid("a count"))?);
                }
                "keep" => script.keep = parse_bool(value).ok_or_else(|| invalid("a boolean"))?,
                "deleteDelayMs" => {
                    script.delete_delay_ms = value.parse().map_err(|_| invalid("milliseconds"))?
                }
                "byClaim" => {
                    script.by_claim = parse_bool(value).ok_or_else(|| invalid("a boolean"))?
                }
                "pinToSelectedNode" => {
                    script.pin_to_selected_node =
                        parse_bool(value).ok_or_else(|| invalid("a boolean"))?;
                }
                "expandFail" => {
                    script.expand_fail = Some(Failure::parse(value).ok_or_else(|| {
                        invalid("one of final, transient, in-background, ignored, trap")
                    })?)
                }
                "expandFailTimes" => {
                    script.expand_fail_times = Some(value.parse().map_err(|_| invalid("a count"))?)
                }
                "expandShort" => {
                    script.expand_short = parse_bool(value).ok_or_else(|| invalid("a boolean"))?
                }
                "ignoreSpecErrors" => {
                    script.ignore_spec_errors =
                        parse_bool(value).ok_or_else(|| invalid("a boolean"))?;
                }
                _ => {
                    return Err(format!(
                        "unknown StorageClass parameter {key:?} (known: {})",
                        KNOWN_PARAMETERS.join(", ")
                    ));
                }
            }
        }
        Ok(script)
    }

    /// How provision attempt number `attempt` (1-based, per PV) fails, if it does.
    pub fn provision_failure(&self, attempt: u64) -> Option<Failure> {
        failure_for_attempt(self.fail, self.fail_times, attempt)
    }

    /// How expand attempt number `attempt` (1-based, per PV) fails, if it does.
    pub fn expand_failure(&self, attempt: u64) -> Option<Failure> {
        failure_for_attempt(self.expand_fail, self.expand_fail_times, attempt)
    }

    /// The annotations provision records on the PV for `delete` and `should-delete` to read.
    pub fn volume_annotations(&self) -> Vec<(&'static str, String)> {
        let mut annotations = vec![(CREATED_ANNOTATION, "true".to_owned())];
        if let Some(failure) = self.delete_fail {
            let name = if failure == Failure::Transient {
                "transient"
            } else {
                "final"
            };
            annotations.push((DELETE_FAIL_ANNOTATION, name.to_owned()));
        }
        if let Some(times) = self.delete_fail_times {
            annotations.push((DELETE_FAIL_TIMES_ANNOTATION, times.to_string()));
        }
        if self.keep {
            annotations.push((KEEP_ANNOTATION, "true".to_owned()));
        }
        if self.delete_delay_ms > 0 {
            annotations.push((DELETE_DELAY_ANNOTATION, self.delete_delay_ms.to_string()));
        }
        annotations
    }
}

/// How delete attempt number `attempt` (1-based, per PV) fails, from the PV's annotations.
pub fn delete_failure(annotations: &[Pair], attempt: u64) -> Result<Option<Failure>, String> {
    let Some(fail) = annotation(annotations, DELETE_FAIL_ANNOTATION) else {
        return Ok(None);
    };
    let failure = parse_delete_failure(fail).ok_or_else(|| {
        format!("annotation {DELETE_FAIL_ANNOTATION}: expected final or transient, got {fail:?}")
    })?;
    let times = annotation(annotations, DELETE_FAIL_TIMES_ANNOTATION)
        .map(|times| {
            times.parse::<u64>().map_err(|_| {
                format!(
                    "annotation {DELETE_FAIL_TIMES_ANNOTATION}: expected a count, got {times:?}"
                )
            })
        })
        .transpose()?;
    Ok(failure_for_attempt(Some(failure), times, attempt))
}

/// How long delete sleeps first, from the PV's annotations (0 when unset or unreadable).
pub fn delete_delay_ms(annotations: &[Pair]) -> u64 {
    annotation(annotations, DELETE_DELAY_ANNOTATION)
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(0)
}

/// The storage directory's name: the one recorded on the PV (`byClaim`), else the PV's.
pub fn storage_name<'a>(annotations: &'a [Pair], pv: &'a str) -> &'a str {
    annotation(annotations, DIR_ANNOTATION).unwrap_or(pv)
}

/// The storage directory of a claim under `byClaim`: one flat name from namespace and name.
pub fn claim_storage_name(namespace: &str, name: &str) -> String {
    format!("claim-{namespace}-{name}")
}

/// Whether a delete call for this PV has any scripted failure, so it needs an attempt count.
pub fn delete_is_scripted(annotations: &[Pair]) -> bool {
    annotation(annotations, DELETE_FAIL_ANNOTATION).is_some()
}

/// `should-provision`: false for claims annotated `skip: "true"`.
pub fn wants_claim(claim_annotations: &[Pair]) -> bool {
    annotation(claim_annotations, SKIP_ANNOTATION) != Some("true")
}

/// `should-delete`: false for volumes annotated `keep: "true"`.
pub fn allows_delete(volume_annotations: &[Pair]) -> bool {
    annotation(volume_annotations, KEEP_ANNOTATION) != Some("true")
}

/// The attempt number after the one recorded in an attempts file (missing or unreadable: none).
pub fn next_attempt(recorded: Option<&str>) -> u64 {
    recorded
        .and_then(|text| text.trim().parse::<u64>().ok())
        .unwrap_or(0)
        + 1
}

/// Checks that a PV name can be used as a file name directly in the granted directory.
pub fn check_file_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(format!(
            "volume name {name:?} cannot be used as a file name"
        ));
    }
    Ok(())
}

fn failure_for_attempt(
    fail: Option<Failure>,
    fail_times: Option<u64>,
    attempt: u64,
) -> Option<Failure> {
    fail.filter(|_| fail_times.is_none_or(|times| attempt <= times))
}

fn parse_delete_failure(value: &str) -> Option<Failure> {
    match value {
        "final" => Some(Failure::Final),
        "transient" => Some(Failure::Transient),
        _ => None,
    }
}

fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

fn annotation<'a>(annotations: &'a [Pair], key: &str) -> Option<&'a str> {
    annotations
        .iter()
        .find(|pair| pair.key == key)
        .map(|pair| pair.value.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(entries: &[(&str, &str)]) -> Vec<Pair> {
        entries
            .iter()
            .map(|(key, value)| Pair {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect()
    }

    fn script(entries: &[(&str, &str)]) -> Result<ProvisionScript, String> {
        ProvisionScript::parse(&pairs(entries))
    }

    #[test]
    fn no_parameters_means_plain_success() {
        let script = script(&[]).unwrap();
        assert_eq!(script, ProvisionScript::default());
        assert_eq!(script.provision_failure(1), None);
        assert_eq!(
            script.volume_annotations(),
            vec![(CREATED_ANNOTATION, "true".to_owned())]
        );
    }

    #[test]
    fn every_failure_kind_parses() {
        for (value, failure) in [
            ("final", Failure::Final),
            ("transient", Failure::Transient),
            ("reschedule", Failure::Reschedule),
            ("in-background", Failure::InBackground),
            ("ignored", Failure::Ignored),
            ("trap", Failure::Trap),
        ] {
            assert_eq!(script(&[("fail", value)]).unwrap().fail, Some(failure));
        }
        assert!(
            script(&[("fail", "sometimes")])
                .unwrap_err()
                .contains("parameter fail")
        );
        assert!(Failure::Trap.into_error("x".to_owned()).is_none());
        assert!(matches!(
            Failure::Reschedule.into_error("x".to_owned()),
            Some(ProvisionError::Reschedule(message)) if message == "x"
        ));
    }

    #[test]
    fn fail_times_bounds_the_failing_attempts() {
        let always = script(&[("fail", "transient")]).unwrap();
        assert_eq!(always.provision_failure(1000), Some(Failure::Transient));
        let twice = script(&[("fail", "transient"), ("failTimes", "2")]).unwrap();
        assert_eq!(twice.provision_failure(1), Some(Failure::Transient));
        assert_eq!(twice.provision_failure(2), Some(Failure::Transient));
        assert_eq!(twice.provision_failure(3), None);
        assert_eq!(
            script(&[("failTimes", "2")]).unwrap().provision_failure(1),
            None
        );
    }

    #[test]
    fn bad_values_and_unknown_parameters_are_refused() {
        assert!(
            script(&[("delayMs", "soon")])
                .unwrap_err()
                .contains("parameter delayMs")
        );
        assert!(
            script(&[("spinForever", "yes")])
                .unwrap_err()
                .contains("expected a boolean")
        );
        assert!(
            script(&[("deleteFail", "trap")])
                .unwrap_err()
                .contains("final or transient")
        );
        assert!(
            script(&[("failTime", "1")])
                .unwrap_err()
                .contains("unknown StorageClass parameter \"failTime\"")
        );
    }

    #[test]
    fn delete_behaviour_travels_in_annotations() {
        let script = script(&[
            ("deleteFail", "transient"),
            ("deleteFailTimes", "1"),
            ("keep", "true"),
        ])
        .unwrap();
        let annotations: Vec<Pair> = script
            .volume_annotations()
            .into_iter()
            .map(|(key, value)| Pair {
                key: key.to_owned(),
                value,
            })
            .collect();
        assert!(delete_is_scripted(&annotations));
        assert_eq!(
            delete_failure(&annotations, 1),
            Ok(Some(Failure::Transient))
        );
        assert_eq!(delete_failure(&annotations, 2), Ok(None));
        assert!(!allows_delete(&annotations));
        assert_eq!(delete_failure(&pairs(&[]), 1), Ok(None));
        assert!(allows_delete(&pairs(&[])));
        assert!(delete_failure(&pairs(&[(DELETE_FAIL_ANNOTATION, "maybe")]), 1).is_err());
    }

    #[test]
    fn skip_annotation_declines_the_claim() {
        assert!(!wants_claim(&pairs(&[(SKIP_ANNOTATION, "true")])));
        assert!(wants_claim(&pairs(&[(SKIP_ANNOTATION, "false")])));
        assert!(wants_claim(&pairs(&[])));
    }

    #[test]
    fn attempts_count_up_from_the_recorded_number() {
        assert_eq!(next_attempt(None), 1);
        assert_eq!(next_attempt(Some("3\n")), 4);
        assert_eq!(next_attempt(Some("garbage")), 1);
    }

    #[test]
    fn file_names_must_be_single_components() {
        assert!(check_file_name("pvc-1").is_ok());
        for name in ["", ".", "..", "a/b", "../x"] {
            assert!(check_file_name(name).is_err(), "{name}");
        }
    }
}
