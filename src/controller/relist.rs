//! Watches that list again when the API server cannot resume them from their resourceVersion.
//!
//! ```text
//! kube-runtime watcher ──▶ event ─────────────────────────────────────────────▶ caller
//!                     └──▶ error: resourceVersion gone (410) or too large (504) ─▶ log, drop
//!                          the watcher, start a fresh one (a LIST, then a watch from its RV)
//! ```
//!
//! kube-runtime 5.0 lists again on a 410 `Gone` that arrives inside a watch stream, but on the
//! API server's "Too large resource version" (504, reason `Timeout`, cause
//! `ResourceVersionTooLarge`: the requested version is ahead of etcd's, which is what every
//! watch sees after etcd is restored from a backup) it watches again from the same version,
//! forever; a 410 answering the watch request itself is retried the same way. That is what
//! kube-controller-manager 1.20 does too, and why new claims waited for a restart. client-go's
//! reflector relists on both since 1.21; so do these watches.

use std::fmt::Debug;

use futures::{Stream, StreamExt, stream::BoxStream};
use kube::Api;
use kube::core::Status;
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;

/// Why a watch cannot go on from its resourceVersion, if that is what `error` says.
pub fn cannot_resume(error: &watcher::Error) -> Option<&'static str> {
    let status: &Status = match error {
        watcher::Error::WatchError(status) => status,
        watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status,
        _ => return None,
    };
    if status.code == 410 || status.reason == "Expired" || status.reason == "Gone" {
        return Some("gone, compacted");
    }
    let too_large_cause = status.details.as_ref().is_some_and(|details| {
        details
            .causes
            .iter()
            .any(|cause| cause.reason == "ResourceVersionTooLarge")
    });
    let too_large_message = status.message.contains("Too large resource version");
    (too_large_cause || (status.code == 504 && too_large_message))
        .then_some("too large, etcd restored from a backup?")
}

/// [`kube::runtime::watcher`], listing again when the server cannot resume the watch (see the
/// module). The error is still yielded, after a warning, so the caller's backoff spaces the lists.
pub fn watcher<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static
where
    K: kube::Resource + Clone + Debug + DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).into_owned();
    let fresh = {
        let (api, config) = (api.clone(), config.clone());
        move || -> BoxStream<'static, Result<Event<K>, watcher::Error>> {
            kube::runtime::watcher(api.clone(), config.clone()).boxed()
        }
    };
    let first = fresh();
    futures::stream::unfold((first, fresh), move |(mut inner, fresh)| {
        let kind = kind.clone();
        async move {
            let item = inner.next().await?;
            if let Err(error) = &item
                && let Some(why) = cannot_resume(error)
            {
                tracing::warn!(
                    %kind, %error, why,
                    "the API server cannot resume the watch from its resourceVersion ({why}); \
                     listing {kind} again"
                );
                inner = fresh();
            }
            Some((item, (inner, fresh)))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::response::{StatusCause, StatusDetails};

    fn status(code: u16, reason: &str, message: &str, cause: Option<&str>) -> Status {
        Status {
            code,
            reason: reason.into(),
            message: message.into(),
            details: cause.map(|c| StatusDetails {
                causes: vec![StatusCause {
                    reason: c.into(),
                    message: "Too large resource version".into(),
                    field: String::new(),
                }],
                name: String::new(),
                group: String::new(),
                kind: String::new(),
                uid: String::new(),
                retry_after_seconds: 1,
            }),
            ..Status::failure("", "")
        }
    }

    #[test]
    fn gone_and_too_large_are_told_apart_from_other_errors() {
        let too_large = status(
            504,
            "Timeout",
            "Too large resource version: 200, current: 100",
            Some("ResourceVersionTooLarge"),
        );
        let gone = status(410, "Expired", "too old resource version: 1 (5)", None);
        let timeout = status(504, "Timeout", "request timed out", None);
        let forbidden = status(403, "Forbidden", "no", None);
        let cases = [
            (
                watcher::Error::WatchError(too_large.clone().boxed()),
                Some("too large, etcd restored from a backup?"),
            ),
            (
                watcher::Error::WatchStartFailed(kube::Error::Api(too_large.boxed())),
                Some("too large, etcd restored from a backup?"),
            ),
            (
                watcher::Error::WatchError(gone.clone().boxed()),
                Some("gone, compacted"),
            ),
            (
                watcher::Error::WatchStartFailed(kube::Error::Api(gone.boxed())),
                Some("gone, compacted"),
            ),
            (watcher::Error::WatchError(timeout.boxed()), None),
            (
                watcher::Error::WatchStartFailed(kube::Error::Api(forbidden.boxed())),
                None,
            ),
            (watcher::Error::NoResourceVersion, None),
        ];
        for (error, expected) in cases {
            assert_eq!(cannot_resume(&error), expected, "{error}");
        }
    }
}
