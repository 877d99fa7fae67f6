//! Which escape the StorageClass asks for, and the verdict over the filesystem probes.

use crate::wasm_provisioner::provisioner::types::Pair;

/// PV annotation listing what escaped, set only when something did.
pub const ESCAPED_ANNOTATION: &str = "escape.wasm-provisioner.dev/escaped";

/// The class parameter `attempt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// `host-path-outside`: a `hostPath` of `/etc`, outside every granted prefix.
    HostPathOutside,
    /// `source-not-granted`: an NFS source, a kind the grant does not list.
    SourceNotGranted,
    /// `dotdot`: write through `<guest-dir>/..` and to an absolute path outside the preopen.
    DotDot,
    /// `symlink`: plant symlinks to `/` and `..` in the granted directory and write through them.
    Symlink,
}

impl Attempt {
    /// The attempt named by the class parameters.
    pub fn from_parameters(parameters: &[Pair]) -> Result<Self, String> {
        let mut attempt = None;
        for Pair { key, value } in parameters {
            if key != "attempt" {
                return Err(format!(
                    "unknown StorageClass parameter {key:?} (known: attempt)"
                ));
            }
            attempt = Some(match value.as_str() {
                "host-path-outside" => Self::HostPathOutside,
                "source-not-granted" => Self::SourceNotGranted,
                "dotdot" => Self::DotDot,
                "symlink" => Self::Symlink,
                _ => {
                    return Err(format!(
                        "parameter attempt: expected one of host-path-outside, source-not-granted, dotdot, \
                         symlink, got {value:?}"
                    ));
                }
            });
        }
        attempt.ok_or_else(|| "parameter attempt is required".to_owned())
    }

    /// The parameter value, as recorded in [`ESCAPED_ANNOTATION`].
    pub fn name(self) -> &'static str {
        match self {
            Self::HostPathOutside => "host-path-outside",
            Self::SourceNotGranted => "source-not-granted",
            Self::DotDot => "dotdot",
            Self::Symlink => "symlink",
        }
    }
}

/// One thing the guest tried in the filesystem.
#[derive(Debug)]
pub struct Probe {
    /// What was tried, e.g. `write /volumes/../escaped.txt`.
    pub action: String,
    /// Whether succeeding means the guest got out (a write), rather than only setting up.
    pub escapes_on_success: bool,
    /// What happened.
    pub outcome: Result<(), String>,
}

/// How a filesystem attempt ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every escaping action failed; the details list all probes.
    Contained(String),
    /// These escaping actions succeeded.
    Escaped(Vec<String>),
}

/// Judges the probes: escaped when any escaping action succeeded.
pub fn judge(probes: &[Probe]) -> Verdict {
    let escaped: Vec<String> = probes
        .iter()
        .filter(|probe| probe.escapes_on_success && probe.outcome.is_ok())
        .map(|probe| probe.action.clone())
        .collect();
    if !escaped.is_empty() {
        return Verdict::Escaped(escaped);
    }
    let details = probes
        .iter()
        .map(|probe| match &probe.outcome {
            Ok(()) => format!("{}: ok", probe.action),
            Err(error) => format!("{}: {error}", probe.action),
        })
        .collect::<Vec<_>>()
        .join("; ");
    Verdict::Contained(details)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(value: &str) -> Result<Attempt, String> {
        Attempt::from_parameters(&[Pair {
            key: "attempt".to_owned(),
            value: value.to_owned(),
        }])
    }

    fn probe(action: &str, escapes_on_success: bool, outcome: Result<(), &str>) -> Probe {
        Probe {
            action: action.to_owned(),
            escapes_on_success,
            outcome: outcome.map_err(str::to_owned),
        }
    }

    #[test]
    fn every_attempt_round_trips_through_its_name() {
        for known in [
            Attempt::HostPathOutside,
            Attempt::SourceNotGranted,
            Attempt::DotDot,
            Attempt::Symlink,
        ] {
            assert_eq!(attempt(known.name()), Ok(known));
        }
        assert!(attempt("tunnel").unwrap_err().contains("got \"tunnel\""));
        assert_eq!(
            Attempt::from_parameters(&[]).unwrap_err(),
            "parameter attempt is required"
        );
    }

    #[test]
    fn contained_when_every_write_failed_even_if_setup_succeeded() {
        let verdict = judge(&[
            probe("symlink link -> /", false, Ok(())),
            probe("write /v/link/x", true, Err("Operation not permitted")),
        ]);
        assert_eq!(
            verdict,
            Verdict::Contained(
                "symlink link -> /: ok; write /v/link/x: Operation not permitted".to_owned()
            )
        );
    }

    #[test]
    fn escaped_lists_the_writes_that_succeeded() {
        let verdict = judge(&[
            probe("write /v/../escaped.txt", true, Ok(())),
            probe("write /escaped-abs.txt", true, Err("not found")),
        ]);
        assert_eq!(
            verdict,
            Verdict::Escaped(vec!["write /v/../escaped.txt".to_owned()])
        );
    }
}
