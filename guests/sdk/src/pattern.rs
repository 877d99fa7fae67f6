//! Path patterns (`${pvc.namespace}/${pvc.name}`): a volume's directory from the claim, and the
//! check that a directory stays inside the granted one.
//!
//! Variables: `${pv.name}`, `${pvc.namespace}`, `${pvc.name}`, `${pvc.labels.KEY}`,
//! `${pvc.annotations.KEY}`. Every expansion must be a directory no other claim can get, and
//! no tenant may write a path of its own choosing through an annotation, so these are errors
//! naming the pattern:
//! - a missing label or annotation (substituting "" would merge claims' directories);
//! - a value with a `/` in it;
//! - unless the pattern holds `${pv.name}` (unique per claim): two adjacent variables
//!   (`${a}${b}`), or a value holding the first character of the text after its variable
//!   (`team-a` in `${pvc.namespace}-${pvc.name}`, where `team-a/x` and `team/a-x` would both be
//!   `team-a-x`). The expansion then reads back into one set of values.
//!
//! Variables separated by `/` (`${pvc.namespace}/${pvc.name}`) therefore always work.

use crate::types::{Pair, ProvisionRequest};

/// What a `pathPattern` can refer to.
pub struct PatternValues<'a> {
    /// `${pv.name}`.
    pub pv_name: &'a str,
    /// `${pvc.namespace}`.
    pub claim_namespace: &'a str,
    /// `${pvc.name}`.
    pub claim_name: &'a str,
    /// `${pvc.labels.KEY}`.
    pub claim_labels: &'a [Pair],
    /// `${pvc.annotations.KEY}`.
    pub claim_annotations: &'a [Pair],
}

impl<'a> PatternValues<'a> {
    /// The values a provision request offers.
    pub fn of(request: &'a ProvisionRequest) -> Self {
        Self {
            pv_name: &request.pv_name,
            claim_namespace: &request.claim.namespace,
            claim_name: &request.claim.name,
            claim_labels: &request.claim.labels,
            claim_annotations: &request.claim.annotations,
        }
    }

    fn lookup(&self, variable: &str) -> Result<&'a str, String> {
        if let Some(key) = variable.strip_prefix("pvc.labels.") {
            return value_of(self.claim_labels, key)
                .ok_or_else(|| format!("the claim has no label {key:?}"));
        }
        if let Some(key) = variable.strip_prefix("pvc.annotations.") {
            return value_of(self.claim_annotations, key)
                .ok_or_else(|| format!("the claim has no annotation {key:?}"));
        }
        match variable {
            "pv.name" => Ok(self.pv_name),
            "pvc.namespace" => Ok(self.claim_namespace),
            "pvc.name" => Ok(self.claim_name),
            _ => Err(format!(
                "unknown variable \"${{{variable}}}\" (known: ${{pvc.namespace}}, ${{pvc.name}}, ${{pv.name}}, \
                 ${{pvc.labels.KEY}}, ${{pvc.annotations.KEY}})"
            )),
        }
    }
}

use crate::types::lookup as value_of;

/// Expands `pattern` and checks that the result is a safe relative directory.
/// Errors name the pattern, for the `ProvisioningFailed` event.
pub fn expand(pattern: &str, values: &PatternValues) -> Result<String, PatternError> {
    expand_text(pattern, values).map_err(PatternError)
}

/// A pattern that does not expand to a safe directory; the message names the pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternError(pub String);

impl std::fmt::Display for PatternError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PatternError {}

impl From<PatternError> for crate::types::ProvisionError {
    fn from(error: PatternError) -> Self {
        crate::types::final_error(error)
    }
}

/// Substitutes the variables of `pattern`, refusing the same values as [`expand`], without
/// checking the result: for guests that allow `..` on purpose and confine the path themselves.
/// Prefer [`expand`].
pub fn substitute(pattern: &str, values: &PatternValues) -> Result<String, PatternError> {
    substitute_text(pattern, values).map_err(PatternError)
}

fn expand_text(pattern: &str, values: &PatternValues) -> Result<String, String> {
    let expanded = substitute_text(pattern, values)?;
    check_relative_dir(&expanded).map_err(|why| {
        format!("parameter pathPattern {pattern:?} expands to {expanded:?}, which {why}")
    })?;
    Ok(expanded)
}

/// A pattern split at its variables: literal text, or the name inside `${...}`.
enum Piece<'p> {
    Text(&'p str),
    Variable(&'p str),
}

fn pieces(pattern: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut rest = pattern;
    while let Some(start) = rest.find("${") {
        if start > 0 {
            pieces.push(Piece::Text(&rest[..start]));
        }
        let after_open = &rest[start + 2..];
        let end = after_open
            .find('}')
            .ok_or_else(|| format!("parameter pathPattern {pattern:?}: unclosed \"${{\""))?;
        pieces.push(Piece::Variable(&after_open[..end]));
        rest = &after_open[end + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

const SEPARATE: &str = "separate variables with `/`, as in `${pvc.namespace}/${pvc.name}`";

fn substitute_text(pattern: &str, values: &PatternValues) -> Result<String, String> {
    let pieces = pieces(pattern)?;
    // The PV name is unique per claim, so an expansion holding it cannot be another claim's.
    let unique = pieces
        .iter()
        .any(|piece| matches!(piece, Piece::Variable("pv.name")));
    let mut expanded = String::new();
    for (index, piece) in pieces.iter().enumerate() {
        let variable = match piece {
            Piece::Text(text) => {
                expanded.push_str(text);
                continue;
            }
            Piece::Variable(variable) => variable,
        };
        // Without a value ever holding the character that follows its variable, the expansion
        // reads back into one set of values: no two claims share a directory.
        let separator = match pieces.get(index + 1) {
            _ if unique => None,
            Some(Piece::Variable(next)) => {
                return Err(format!(
                    "parameter pathPattern {pattern:?}: ${{{variable}}} and ${{{next}}} are adjacent, \
                     so two claims could get the same directory; {SEPARATE}"
                ));
            }
            Some(Piece::Text(text)) => text.chars().next(),
            None => None,
        };
        let value = values
            .lookup(variable)
            .map_err(|why| format!("parameter pathPattern {pattern:?}: {why}"))?;
        if value.contains('/') {
            return Err(format!(
                "parameter pathPattern {pattern:?}: the value {value:?} of ${{{variable}}} contains `/`; values may not choose directories"
            ));
        }
        if let Some(separator) = separator.filter(|&c| value.contains(c)) {
            return Err(format!(
                "parameter pathPattern {pattern:?}: the value {value:?} of ${{{variable}}} contains {separator:?}, \
                 which follows it in the pattern, so another claim could get the same directory; {SEPARATE}"
            ));
        }
        expanded.push_str(value);
    }
    Ok(expanded)
}

/// Checks that `dir` is a relative path of plain components (no `..`, `.`, empty or absolute
/// parts), so that joining it to the granted directory stays inside it.
/// The error completes a sentence such as "`dir` ...".
pub fn check_relative_dir(dir: &str) -> Result<(), String> {
    if dir.is_empty() {
        return Err("is empty".to_owned());
    }
    if dir.starts_with('/') {
        return Err("is absolute".to_owned());
    }
    if dir.contains('\0') {
        return Err("contains a NUL character".to_owned());
    }
    for component in dir.split('/') {
        match component {
            "" => return Err("has an empty path component".to_owned()),
            "." | ".." => return Err(format!("has a {component:?} path component")),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(key: &str, value: &str) -> Pair {
        Pair {
            key: key.to_owned(),
            value: value.to_owned(),
        }
    }

    fn expand_for_claim(pattern: &str) -> Result<String, String> {
        let labels = [pair("app.kubernetes.io/name", "db"), pair("tier", "")];
        let annotations = [
            pair("example.com/dir", "../../etc"),
            pair("example.com/sub", "a/b"),
        ];
        let values = PatternValues {
            pv_name: "pvc-1234",
            claim_namespace: "team-a",
            claim_name: "data",
            claim_labels: &labels,
            claim_annotations: &annotations,
        };
        expand(pattern, &values).map_err(|error| error.to_string())
    }

    #[test]
    fn expands_every_variable() {
        assert_eq!(
            expand_for_claim("${pvc.namespace}/${pvc.name}").unwrap(),
            "team-a/data"
        );
        assert_eq!(expand_for_claim("${pv.name}").unwrap(), "pvc-1234");
        assert_eq!(
            expand_for_claim("x-${pvc.labels.app.kubernetes.io/name}-y").unwrap(),
            "x-db-y"
        );
        let error = expand_for_claim("${pvc.annotations.example.com/sub}/${pv.name}").unwrap_err();
        assert!(error.contains("contains `/`"), "{error}");
        assert_eq!(expand_for_claim("static/dir").unwrap(), "static/dir");
    }

    #[test]
    fn unknown_variables_missing_keys_and_unclosed_braces_are_errors() {
        let error = expand_for_claim("${pvc.uid}").unwrap_err();
        assert!(error.contains("unknown variable \"${pvc.uid}\""), "{error}");
        let error = expand_for_claim("${pvc.labels.nope}").unwrap_err();
        assert!(error.contains("no label \"nope\""), "{error}");
        let error = expand_for_claim("${pvc.annotations.nope}").unwrap_err();
        assert!(error.contains("no annotation \"nope\""), "{error}");
        let error = expand_for_claim("${pvc.name").unwrap_err();
        assert!(error.contains("unclosed"), "{error}");
    }

    #[test]
    fn escaping_results_are_refused_and_name_the_pattern() {
        let error = expand_for_claim("${pvc.annotations.example.com/dir}").unwrap_err();
        assert!(
            error.starts_with("parameter pathPattern \"${pvc.annotations.example.com/dir}\""),
            "{error}"
        );
        assert!(error.contains("contains `/`"), "{error}");
        assert!(
            expand_for_claim("/abs/${pv.name}")
                .unwrap_err()
                .contains("is absolute")
        );
        assert!(
            expand_for_claim("a/${pvc.labels.tier}/${pv.name}")
                .unwrap_err()
                .contains("empty path component")
        );
        assert!(
            expand_for_claim("${pvc.labels.tier}")
                .unwrap_err()
                .contains("is empty")
        );
        assert!(
            expand_for_claim("a//b")
                .unwrap_err()
                .contains("empty path component")
        );
        assert!(expand_for_claim("a/./b").unwrap_err().contains("\".\""));
        assert!(
            expand_for_claim("a/")
                .unwrap_err()
                .contains("empty path component")
        );
    }

    /// `pattern` for claim `namespace/name` with volume `pvc-1` and fixed labels and annotations.
    fn expand_as(pattern: &str, namespace: &str, name: &str) -> Result<String, String> {
        let labels = [pair("app", "web-1"), pair("tier", "db")];
        let annotations = [pair("example.com/owner", "a-b_c.d")];
        let values = PatternValues {
            pv_name: "pvc-1",
            claim_namespace: namespace,
            claim_name: name,
            claim_labels: &labels,
            claim_annotations: &annotations,
        };
        expand(pattern, &values).map_err(|error| error.to_string())
    }

    /// Pattern, namespace, name, and the directory or what the error says.
    type Case<'a> = (&'a str, &'a str, &'a str, Result<&'a str, &'a [&'a str]>);

    #[test]
    fn expansions_never_collide_across_claims() {
        let ns_dash_name = "${pvc.namespace}-${pvc.name}";
        let ns_slash_name = "${pvc.namespace}/${pvc.name}";
        let ns_under_name = "${pvc.namespace}_${pvc.name}";
        let table: &[Case<'_>] = &[
            (ns_dash_name, "team", "a-x", Ok("team-a-x")),
            (
                ns_dash_name,
                "team-a",
                "x",
                Err(&[
                    ns_dash_name,
                    "${pvc.namespace}",
                    "\"team-a\"",
                    "'-'",
                    ns_slash_name,
                ]),
            ),
            (ns_slash_name, "team-a", "x", Ok("team-a/x")),
            (ns_slash_name, "team", "a-x", Ok("team/a-x")),
            (ns_under_name, "team-a", "x", Ok("team-a_x")),
            (ns_under_name, "team", "a-x", Ok("team_a-x")),
            (
                "${pvc.namespace}${pvc.name}",
                "team",
                "ax",
                Err(&["${pvc.namespace}${pvc.name}", "adjacent", ns_slash_name]),
            ),
            (
                "${pvc.namespace}-${pvc.name}-${pv.name}",
                "team-a",
                "x",
                Ok("team-a-x-pvc-1"),
            ),
            (
                "${pv.name}${pvc.namespace}-${pvc.name}",
                "team-a",
                "x",
                Ok("pvc-1team-a-x"),
            ),
            ("vol-${pvc.namespace}", "team-a", "x", Ok("vol-team-a")),
            ("${pvc.name}-${pvc.labels.app}", "team", "x", Ok("x-web-1")),
            (
                "${pvc.labels.app}-${pvc.name}",
                "team",
                "x",
                Err(&["${pvc.labels.app}", "\"web-1\"", "'-'"]),
            ),
            ("${pvc.labels.tier}-${pvc.name}", "team", "x", Ok("db-x")),
            (
                "${pvc.annotations.example.com/owner}_${pvc.name}",
                "team",
                "x",
                Err(&["${pvc.annotations.example.com/owner}", "\"a-b_c.d\"", "'_'"]),
            ),
            (
                "${pvc.annotations.example.com/owner}.d/${pvc.name}",
                "team",
                "x",
                Err(&["'.'"]),
            ),
            (
                "${pvc.annotations.example.com/owner}/${pvc.name}",
                "team",
                "x",
                Ok("a-b_c.d/x"),
            ),
        ];
        for (pattern, namespace, name, expected) in table {
            let got = expand_as(pattern, namespace, name);
            match (expected, &got) {
                (Ok(dir), Ok(got)) => assert_eq!(got, dir, "{pattern} for {namespace}/{name}"),
                (Err(fragments), Err(error)) => {
                    for fragment in *fragments {
                        assert!(
                            error.contains(fragment),
                            "{fragment:?} missing from {error}"
                        );
                    }
                }
                _ => panic!("{pattern} for {namespace}/{name}: expected {expected:?}, got {got:?}"),
            }
        }
        let values = PatternValues {
            pv_name: "pvc-1",
            claim_namespace: "team-a",
            claim_name: "x",
            claim_labels: &[],
            claim_annotations: &[],
        };
        let error = substitute(ns_dash_name, &values).unwrap_err().to_string();
        assert!(error.contains("'-'"), "substitute refuses it too: {error}");
    }

    #[test]
    fn plain_relative_dirs_pass() {
        assert_eq!(check_relative_dir("pvc-1"), Ok(()));
        assert_eq!(check_relative_dir("ns/name/..x"), Ok(()));
        assert!(check_relative_dir("..").is_err());
        assert!(check_relative_dir("a/../b").is_err());
    }
}
