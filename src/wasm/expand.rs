//! Growing a volume (`expansion.expand`, since 0.1.3): the guest's answer checked against the
//! request, then the limit raised by the host where it enforces a size.
//!
//! ```text
//! expand(request) ─▶ storage within the grants? ─▶ guest's `expand` ─▶ answer ≥ request?
//!   ─▶ the PV's path in a grant directory with `sizes`: walked (no link), the volume marked
//!      for this PV, its limit raised to the answer (blocking pool, the call's deadline)
//! ```

use super::bindings::expansion::ExpandRequest;
use super::call::Expand;
use super::errors::CallError;
use super::guest::Guest;
use super::nodepath::{self, OnDisk};
use super::spec::MAX_CAPACITY_BYTES;

/// What [`Guest::expand`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grown {
    /// The capacity the guest says the volume has now (at least the request).
    pub bytes: u64,
    /// Whether the host raised an enforced limit to it (a grant directory with `sizes`).
    pub limit_raised: bool,
}

impl Guest {
    /// Whether the guest exports the `expansion` hook (its classes can grow).
    pub fn expands(&self) -> bool {
        self.expansion.is_some()
    }

    /// Calls `expansion.expand` for a volume whose storage lies within the guest's current
    /// grants; an answer below the request is refused; then the host raises the volume's
    /// enforced limit, if it has one, to the answer. The guest never sets a limit.
    pub async fn expand(&self, request: &ExpandRequest) -> Result<Grown, CallError> {
        if let Some(why) = self.outside_grants(&request.volume) {
            return Err(CallError::Refused {
                guest: self.name().to_owned(),
                message: format!(
                    "growing volume {}: {why}; nothing was grown",
                    request.volume.name
                ),
            });
        }
        let request = request.clone();
        self.dispatch(|guest| async move {
            let Some(indices) = &guest.expansion else {
                return Err(CallError::Refused {
                    guest: guest.name().to_owned(),
                    message: "it exports no `expansion` hook".to_owned(),
                });
            };
            let bytes = guest
                .call(Expand {
                    indices,
                    request: &request,
                })
                .await?
                .map_err(|error| CallError::guest(guest.name(), error))?;
            if bytes < request.requested_bytes || bytes > MAX_CAPACITY_BYTES {
                return Err(CallError::Rejected {
                    guest: guest.name().to_owned(),
                    message: format!(
                        "expand answered {bytes} bytes for {}; a capacity must be at least the {} its claim asks for and at most {MAX_CAPACITY_BYTES}",
                        request.volume.name, request.requested_bytes
                    ),
                });
            }
            let limit_raised = guest.raise_limit(&request, bytes).await?;
            Ok(Grown {
                bytes,
                limit_raised,
            })
        })
        .await
    }

    /// [`nodepath::grow`] through [`Guest::on_disk`] (the blocking pool, the call's deadline).
    async fn raise_limit(&self, request: &ExpandRequest, bytes: u64) -> Result<bool, CallError> {
        let grants = self.grants.clone();
        let (source, pv) = (request.volume.source.clone(), request.volume.name.clone());
        let what = format!("raising the limit of {pv}");
        self.on_disk(what, move || {
            nodepath::grow(&grants, &source, &OnDisk { pv: &pv, bytes })
        })
        .await
    }
}
