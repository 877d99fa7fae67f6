//! The running host's own pulls: a grant file whose `[module]` names a `source` gets its module
//! fetched into the plugins directory whenever the module is missing or not the one the grant
//! vouches for, the way `pull` does it (digest and size checked, signature checked when the
//! grant names a key, evidence first, every file written by temp file and rename).
//!
//! A registry that is down costs retries with backoff per guest, never the guests that serve:
//! the module in the directory stays until a whole, checked one replaces it, and the plugins
//! watcher loads the new one when it lands.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Reference;
use super::commands::{OciError, pull_into};
use super::digest::Digest;
use super::install::Grant;
use super::registry::Registry;

/// First retry after a failed fetch; doubled per failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(5);
/// The longest wait between attempts for one guest.
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// The largest grant file read by the fetcher (the loader refuses larger ones anyway).
const MAX_GRANT_BYTES: u64 = 1024 * 1024;

/// A guest whose grant names a source.
#[derive(Debug)]
struct Wanted {
    name: String,
    reference: Reference,
    grant: Grant,
}

/// Why a guest's module is fetched now, or `None` when the one in place is what the grant asks.
pub fn fetch_reason(
    dir: &Path,
    name: &str,
    reference: &Reference,
    grant: &Grant,
) -> Option<String> {
    let module = dir.join(format!("{name}.wasm"));
    let Ok(bytes) = std::fs::read(&module) else {
        return Some(format!("{} is missing", module.display()));
    };
    let digest = Digest::of(&bytes);
    if let Some(pin) = &grant.pin
        && *pin != digest
    {
        return Some(format!(
            "{} is {digest}, the grant pins {pin}",
            module.display()
        ));
    }
    // Evidence that does not verify for the file in place is refetched, not only missing one:
    // the loader refuses that module, and a fetch heals it.
    if let Some(key) = &grant.module.cosign_key
        && let Err(why) = super::cosign::verify_beside(dir, name, key, digest.hex())
    {
        return Some(format!("{}: {why}", module.display()));
    }
    // Unpinned: the module is the one last fetched from this very reference, or is fetched.
    let marker = std::fs::read_to_string(dir.join(source_marker(name))).ok();
    if grant.pin.is_none() && marker.as_deref().map(str::trim) != Some(&reference.to_string()) {
        return Some(format!("the grant's source is now {reference}"));
    }
    None
}

fn backoff_key(wanted: &Wanted) -> String {
    format!("{} {}", wanted.name, wanted.reference)
}

/// The hidden file that records which reference `NAME.wasm` was fetched from.
fn source_marker(name: &str) -> String {
    format!(".{name}.source")
}

/// Fetches for the grants of one plugins directory.
pub struct Fetcher {
    dir: PathBuf,
    registry: Registry,
    /// Per guest and source: when it may be tried again, and the wait after its next failure
    /// (a grant that names another source starts afresh).
    backoff: BTreeMap<String, (Instant, Duration)>,
}

/// What one pass did for one guest.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Fetched and installed, because of the reason given.
    Fetched { name: String, because: String },
    /// Failed; tried again after the backoff.
    Failed { name: String, error: String },
}

impl Fetcher {
    /// A fetcher for `dir` using `registry` (and its size caps).
    pub fn new(dir: PathBuf, registry: Registry) -> Fetcher {
        Fetcher {
            dir,
            registry,
            backoff: BTreeMap::new(),
        }
    }

    /// Every grant naming a source; grants the fetcher cannot read are the loader's to report.
    fn wanted(&self) -> Vec<Wanted> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut wanted = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .filter(|n| !n.starts_with('.'))
                .and_then(|n| n.strip_suffix(".toml"))
            else {
                continue;
            };
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            if meta.len() > MAX_GRANT_BYTES {
                continue;
            }
            let Ok(grant) = Grant::read(&path) else {
                continue;
            };
            let Some(source) = grant.module.source.clone() else {
                continue;
            };
            match Reference::parse(&source) {
                Ok(reference) => wanted.push(Wanted {
                    name: name.to_string(),
                    reference,
                    grant,
                }),
                Err(error) => {
                    tracing::warn!(grant = %path.display(), %error, "module.source is not a registry reference; nothing is fetched for it")
                }
            }
        }
        wanted.sort_by(|a, b| a.name.cmp(&b.name));
        wanted
    }

    /// One pass: every guest whose module is missing or not what its grant asks, and whose
    /// backoff has passed, is fetched.
    pub async fn pass(&mut self) -> Vec<Outcome> {
        let mut outcomes = Vec::new();
        let now = Instant::now();
        let wanted = self.wanted();
        let keys: Vec<String> = wanted.iter().map(backoff_key).collect();
        self.backoff.retain(|key, _| keys.contains(key));
        for wanted in wanted {
            let key = backoff_key(&wanted);
            let Some(because) =
                fetch_reason(&self.dir, &wanted.name, &wanted.reference, &wanted.grant)
            else {
                self.backoff.remove(&key);
                continue;
            };
            if let Some((after, _)) = self.backoff.get(&key)
                && now < *after
            {
                continue;
            }
            match self.fetch(&wanted).await {
                Ok(()) => {
                    self.backoff.remove(&key);
                    tracing::info!(guest = %wanted.name, source = %wanted.reference, %because, "module fetched from its source");
                    outcomes.push(Outcome::Fetched {
                        name: wanted.name,
                        because,
                    });
                }
                Err(error) => {
                    let wait = self
                        .backoff
                        .get(&key)
                        .map_or(FIRST_BACKOFF, |(_, wait)| *wait);
                    self.backoff
                        .insert(key, (Instant::now() + wait, (wait * 2).min(MAX_BACKOFF)));
                    let error = format!("{error:#}");
                    tracing::warn!(guest = %wanted.name, source = %wanted.reference, %because, retry_in = ?wait, "cannot fetch the module from its source; what serves now serves on: {error}");
                    outcomes.push(Outcome::Failed {
                        name: wanted.name,
                        error,
                    });
                }
            }
        }
        outcomes
    }

    async fn fetch(&mut self, wanted: &Wanted) -> Result<(), OciError> {
        pull_into(
            &mut self.registry,
            &wanted.reference,
            &self.dir,
            &wanted.name,
            Some(&wanted.grant),
            // The grant is the operator's file in place: never rewritten by a fetch.
            false,
        )
        .await?;
        super::install::write_atomic(
            &self.dir,
            &source_marker(&wanted.name),
            wanted.reference.to_string().as_bytes(),
        )?;
        Ok(())
    }

    /// Runs passes forever, `every` apart (a failed guest waits for its own backoff).
    pub async fn run(mut self, every: Duration) {
        loop {
            self.pass().await;
            tokio::time::sleep(every).await;
        }
    }
}
