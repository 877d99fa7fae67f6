//! After an etcd restore (issue 32): the API server answers a watch from a resourceVersion ahead
//! of etcd's with "Too large resource version" (504, cause `ResourceVersionTooLarge`). A fake
//! server that answers every watch so shows kube-runtime's watcher re-watching from the same
//! version forever, and ours listing again.

use std::convert::Infallible;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use kube::{Api, Client};

use super::*;

const TOO_LARGE: &str = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Too large resource version: 200, current: 100","reason":"Timeout","details":{"causes":[{"reason":"ResourceVersionTooLarge","message":"Too large resource version"}],"retryAfterSeconds":1},"code":504}"#;

/// Lists answer at resourceVersion 100; every watch is refused as too large, inside the stream
/// (`in_stream`, as the watch cache does) or as the answer to the request.
#[derive(Clone, Default)]
struct Restored {
    lists: Arc<AtomicUsize>,
    watches: Arc<Mutex<Vec<String>>>,
}

impl Restored {
    fn client(&self, in_stream: bool) -> Client {
        let this = self.clone();
        let service = tower::service_fn(move |request: Request<kube::client::Body>| {
            let this = this.clone();
            async move {
                let query = request.uri().query().unwrap_or_default().to_string();
                let (code, body) = if query.contains("watch=true") {
                    this.watches.lock().unwrap().push(query);
                    if in_stream {
                        (
                            StatusCode::OK,
                            format!("{{\"type\":\"ERROR\",\"object\":{TOO_LARGE}}}\n"),
                        )
                    } else {
                        (StatusCode::GATEWAY_TIMEOUT, TOO_LARGE.to_string())
                    }
                } else {
                    this.lists.fetch_add(1, Ordering::SeqCst);
                    let list = json!({"kind": "PersistentVolumeClaimList", "apiVersion": "v1",
                        "metadata": {"resourceVersion": "100"}, "items": []});
                    (StatusCode::OK, list.to_string())
                };
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(code)
                        .header(http::header::CONTENT_TYPE, "application/json")
                        .body(Full::new(Bytes::from(body)))
                        .expect("response"),
                )
            }
        });
        Client::new(service, "default")
    }
}

/// Drives `stream` for `items` items (events and errors alike).
async fn drive<S: futures::Stream + Unpin>(mut stream: S, items: usize) {
    for _ in 0..items {
        tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("the watch keeps answering")
            .expect("the watch goes on");
    }
}

#[tokio::test]
async fn kube_runtime_alone_rewatches_a_too_large_version_forever() {
    for in_stream in [true, false] {
        let server = Restored::default();
        let api: Api<PersistentVolumeClaim> = Api::all(server.client(in_stream));
        drive(Box::pin(watcher(api, watcher::Config::default())), 12).await;
        let watches = server.watches.lock().unwrap().clone();
        assert_eq!(
            server.lists.load(Ordering::SeqCst),
            1,
            "in stream: {in_stream}"
        );
        assert!(watches.len() >= 4, "{watches:?}");
        assert!(
            watches.iter().all(|q| q.contains("resourceVersion=100")),
            "{watches:?}"
        );
    }
}

#[tokio::test]
async fn our_watches_list_again_when_the_version_is_too_large() {
    for in_stream in [true, false] {
        let server = Restored::default();
        let api: Api<PersistentVolumeClaim> = Api::all(server.client(in_stream));
        let stream = wasm_provisioner::controller::relist::watcher(api, Default::default());
        drive(Box::pin(stream), 12).await;
        let lists = server.lists.load(Ordering::SeqCst);
        let watches = server.watches.lock().unwrap().len();
        // Each refused watch is followed by a list: Init, InitDone and the error per round.
        assert!(
            lists >= 3,
            "in stream: {in_stream}: {lists} lists, {watches} watches"
        );
        assert!(watches <= lists, "no watch repeated without a list first");
    }
}
