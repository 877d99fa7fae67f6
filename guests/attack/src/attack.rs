//! Which attack the StorageClass asks for, parsed from the class parameters.

use crate::wasm_provisioner::provisioner::types::Pair;

/// The class parameter `attack` (absent: behave, provision a normal volume).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attack {
    /// `spin`: an endless loop in wasm code.
    Spin,
    /// `host-loop`: an endless loop of host calls, so most time is spent inside the host.
    HostLoop,
    /// `host-block`: one host call that never returns (a one-hour sleep through WASI).
    HostBlock,
    /// `memory-bomb`: allocate 1 MiB chunks until the allocator gives up.
    MemoryBomb,
    /// `stack-overflow`: unbounded recursion on wasm's own stack.
    StackOverflow,
    /// `shadow-stack-overflow`: unbounded recursion with frames in linear memory (Rust's shadow
    /// stack), which ends in an out-of-bounds access.
    ShadowStackOverflow,
    /// `panic`: a Rust panic.
    Panic,
    /// `unreachable`: the `unreachable` instruction.
    Unreachable,
    /// `log-flood`: hundreds of thousands of `host.log` calls (empty and large), then succeed.
    LogFlood,
    /// `stdout-flood`: 16 MiB to stdout and stderr each (1000 times the default bound), then succeed.
    StdoutFlood,
    /// `host-owned-keys`: set `pv.kubernetes.io/provisioned-by`, `bound-by-controller`, a
    /// `kubernetes.io/` label; ignore the refusals and return the spec anyway.
    HostOwnedKeys,
    /// `huge-capacity`: capacity 2^64-1 bytes, refusal ignored.
    HugeCapacity,
    /// `negative-capacity`: an `i64` of -1 passed as the capacity, refusal ignored.
    NegativeCapacity,
    /// `huge-annotations`: one 10 MB annotation and 64 of 256 KiB, refusals ignored. The 10 MB
    /// value is more than one host call may carry (1 MiB): the call faults before the host
    /// holds any of it.
    HugeAnnotations,
    /// `invalid-labels`: label keys Kubernetes refuses, refusals ignored.
    InvalidLabels,
    /// `slow-sometimes`: odd attempts for a PV busy-wait `slowMs` (default 10 s, past any
    /// sensible deadline), even attempts succeed at once.
    SlowSometimes,
}

const ALL: &[(&str, Attack)] = &[
    ("spin", Attack::Spin),
    ("host-loop", Attack::HostLoop),
    ("host-block", Attack::HostBlock),
    ("memory-bomb", Attack::MemoryBomb),
    ("stack-overflow", Attack::StackOverflow),
    ("shadow-stack-overflow", Attack::ShadowStackOverflow),
    ("panic", Attack::Panic),
    ("unreachable", Attack::Unreachable),
    ("log-flood", Attack::LogFlood),
    ("stdout-flood", Attack::StdoutFlood),
    ("host-owned-keys", Attack::HostOwnedKeys),
    ("huge-capacity", Attack::HugeCapacity),
    ("negative-capacity", Attack::NegativeCapacity),
    ("huge-annotations", Attack::HugeAnnotations),
    ("invalid-labels", Attack::InvalidLabels),
    ("slow-sometimes", Attack::SlowSometimes),
];

/// The parsed class parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plan {
    /// The attack, if any.
    pub attack: Option<Attack>,
    /// `slowMs` for `slow-sometimes`.
    pub slow_ms: u64,
}

impl Plan {
    /// Reads `attack` and `slowMs`; anything else is an error.
    pub fn from_parameters(parameters: &[Pair]) -> Result<Plan, String> {
        let mut plan = Plan {
            attack: None,
            slow_ms: 10_000,
        };
        for Pair { key, value } in parameters {
            match key.as_str() {
                "attack" => {
                    let found = ALL.iter().find(|(name, _)| name == value).ok_or_else(|| {
                        let names: Vec<&str> = ALL.iter().map(|(n, _)| *n).collect();
                        format!(
                            "parameter attack: expected one of {}, got {value:?}",
                            names.join(", ")
                        )
                    })?;
                    plan.attack = Some(found.1);
                }
                "slowMs" => {
                    plan.slow_ms = value
                        .parse()
                        .map_err(|_| format!("parameter slowMs: not a number: {value:?}"))?;
                }
                _ => {
                    return Err(format!(
                        "unknown StorageClass parameter {key:?} (known: attack, slowMs)"
                    ));
                }
            }
        }
        Ok(plan)
    }
}

impl Attack {
    /// The parameter value.
    pub fn name(self) -> &'static str {
        ALL.iter()
            .find(|(_, a)| *a == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> Vec<Pair> {
        pairs
            .iter()
            .map(|(k, v)| Pair {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect()
    }

    #[test]
    fn every_attack_round_trips_through_its_name() {
        for (name, attack) in ALL {
            let plan = Plan::from_parameters(&params(&[("attack", name)])).unwrap();
            assert_eq!(plan.attack, Some(*attack));
            assert_eq!(attack.name(), *name);
        }
    }

    #[test]
    fn no_attack_behaves_and_bad_parameters_are_refused() {
        assert_eq!(Plan::from_parameters(&[]).unwrap().attack, None);
        let err = Plan::from_parameters(&params(&[("attack", "nuke")])).unwrap_err();
        assert!(
            err.contains("got \"nuke\"") && err.contains("spin"),
            "{err}"
        );
        let err = Plan::from_parameters(&params(&[("slowMs", "soon")])).unwrap_err();
        assert!(err.contains("slowMs"), "{err}");
        let err = Plan::from_parameters(&params(&[("color", "red")])).unwrap_err();
        assert!(err.contains("color"), "{err}");
        let plan =
            Plan::from_parameters(&params(&[("attack", "slow-sometimes"), ("slowMs", "50")]))
                .unwrap();
        assert_eq!(plan.slow_ms, 50);
    }
}
