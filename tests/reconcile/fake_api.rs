//! A fake API server behind a real `kube::Client`: an in-memory object map answering the GET,
//! POST, PATCH and DELETE requests the reconciles make, and a log of every request for asserts.
//! Collections are listed whole; a watch stays open and silent (tests apply changes to the caches
//! themselves). Only the semantics the controller relies on: NotFound, AlreadyExists, UID and resourceVersion
//! preconditions on delete, resourceVersion preconditions on merge patches, finalizer and
//! annotation patches.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use kube::Client;
use serde_json::{Value, json};

/// One request as the fake saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub body: Value,
}

#[derive(Default)]
struct State {
    objects: BTreeMap<String, Value>,
    requests: Vec<Seen>,
    version: u64,
    /// Requests answered 503 (an API-server outage): method, path prefix, how many more.
    outage: Option<(Method, String, usize)>,
}

/// The fake server; clone it freely (shared state).
#[derive(Clone, Default)]
pub struct FakeApi(Arc<Mutex<State>>);

impl FakeApi {
    /// A client whose every request this fake answers.
    pub fn client(&self) -> Client {
        let api = self.clone();
        let service = tower::service_fn(move |request: Request<kube::client::Body>| {
            let api = api.clone();
            async move {
                let (parts, body) = request.into_parts();
                if parts.uri.query().is_some_and(|q| q.contains("watch=true")) {
                    // A watch: nothing ever changes behind the reconciles' backs; it stays open.
                    api.0.lock().unwrap().requests.push(Seen {
                        method: parts.method.clone(),
                        path: format!("{}?watch", parts.uri.path()),
                        body: Value::Null,
                    });
                    return std::future::pending().await;
                }
                let bytes = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let content_type = parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                let (status, reply) =
                    api.answer(&parts.method, parts.uri.path(), &content_type, &bytes);
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(status)
                        .header(http::header::CONTENT_TYPE, "application/json")
                        .body(Full::new(Bytes::from(reply.to_string())))
                        .expect("response"),
                )
            }
        });
        Client::new(service, "default")
    }

    /// Stores an object at its path (as if created by someone else).
    pub fn put(&self, path: &str, object: Value) {
        let mut state = self.0.lock().unwrap();
        state.version += 1;
        let mut object = object;
        object["metadata"]["resourceVersion"] = json!(state.version.to_string());
        state.objects.insert(path.to_string(), object);
    }

    /// The object at `path`, if any.
    pub fn get(&self, path: &str) -> Option<Value> {
        self.0.lock().unwrap().objects.get(path).cloned()
    }

    /// The next `times` requests of `method` under `prefix` are answered 503 Service Unavailable.
    pub fn outage(&self, method: Method, prefix: &str, times: usize) {
        self.0.lock().unwrap().outage = Some((method, prefix.to_string(), times));
    }

    /// Removes an object (as if deleted by someone else).
    pub fn remove(&self, path: &str) {
        self.0.lock().unwrap().objects.remove(path);
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Seen> {
        self.0.lock().unwrap().requests.clone()
    }

    /// Requests other than events (the writes the reconcile itself made, and its reads).
    pub fn calls(&self) -> Vec<String> {
        self.requests()
            .into_iter()
            .filter(|r| !r.path.contains("/events"))
            .map(|r| format!("{} {}", r.method, r.path))
            .collect()
    }

    /// Stored objects whose path starts with `prefix`.
    pub fn objects_under(&self, prefix: &str) -> Vec<Value> {
        let state = self.0.lock().unwrap();
        state
            .objects
            .iter()
            .filter(|(path, _)| path.starts_with(prefix))
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// `reason: note` of the events written so far.
    pub fn event_notes(&self) -> Vec<String> {
        let state = self.0.lock().unwrap();
        state
            .objects
            .iter()
            .filter(|(path, _)| path.contains("/events/"))
            .map(|(_, e)| {
                let note = e["note"].as_str().or(e["message"].as_str());
                format!(
                    "{}: {}",
                    e["reason"].as_str().unwrap_or_default(),
                    note.unwrap_or_default()
                )
            })
            .collect()
    }

    /// Reasons of the events written so far.
    pub fn event_reasons(&self) -> Vec<String> {
        let state = self.0.lock().unwrap();
        state
            .objects
            .iter()
            .filter(|(path, _)| path.contains("/events/"))
            .map(|(_, e)| e["reason"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    fn answer(
        &self,
        method: &Method,
        path: &str,
        content_type: &str,
        body: &[u8],
    ) -> (StatusCode, Value) {
        let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let mut state = self.0.lock().unwrap();
        state.requests.push(Seen {
            method: method.clone(),
            path: path.to_string(),
            body: body.clone(),
        });
        if let Some((failing, prefix, left)) = &mut state.outage
            && failing == method
            && path.starts_with(prefix.as_str())
            && *left > 0
        {
            *left -= 1;
            let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "ServiceUnavailable", "code": 503,
                                "message": "the server is currently unable to handle the request"});
            return (StatusCode::SERVICE_UNAVAILABLE, status);
        }
        match *method {
            Method::GET => match state.objects.get(path) {
                Some(object) => (StatusCode::OK, object.clone()),
                // A collection: its direct children (label selectors are not applied).
                None if path.trim_start_matches("/api/v1/").split('/').count() % 2 == 1 => {
                    let prefix = format!("{path}/");
                    let items: Vec<Value> = state
                        .objects
                        .iter()
                        .filter(|(p, _)| p.starts_with(&prefix) && !p[prefix.len()..].contains('/'))
                        .map(|(_, o)| o.clone())
                        .collect();
                    (
                        StatusCode::OK,
                        json!({"apiVersion": "v1", "kind": "List",
                               "metadata": {"resourceVersion": state.version.to_string()},
                               "items": items}),
                    )
                }
                None => not_found(path),
            },
            Method::POST => {
                let name = body["metadata"]["name"].as_str().unwrap_or_default();
                let key = format!("{path}/{name}");
                if state.objects.contains_key(&key) {
                    return status(StatusCode::CONFLICT, "AlreadyExists", &key);
                }
                state.version += 1;
                let mut object = body.clone();
                object["metadata"]["resourceVersion"] = json!(state.version.to_string());
                object["metadata"]["uid"] = json!(format!("uid-{name}"));
                state.objects.insert(key, object.clone());
                (StatusCode::CREATED, object)
            }
            Method::PATCH => {
                let version = state.version + 1;
                // The status subresource: only `status` of the object changes.
                let (path, subresource) = match path.strip_suffix("/status") {
                    Some(object) => (object, true),
                    None => (path, false),
                };
                let Some(object) = state.objects.get_mut(path) else {
                    return not_found(path);
                };
                let wanted = &body["metadata"]["resourceVersion"];
                let wanted_uid = &body["metadata"]["uid"];
                if (!wanted.is_null() && *wanted != object["metadata"]["resourceVersion"])
                    || (!wanted_uid.is_null() && *wanted_uid != object["metadata"]["uid"])
                {
                    return status(StatusCode::CONFLICT, "Conflict", path);
                }
                if subresource {
                    merge(&mut object["status"], &body["status"]);
                } else {
                    apply_patch(object, &body, content_type.contains("strategic"));
                }
                object["metadata"]["resourceVersion"] = json!(version.to_string());
                let object = object.clone();
                state.version = version;
                // An object marked deleted goes once its last finalizer does, as on a real server.
                if !object["metadata"]["deletionTimestamp"].is_null() && !holds_finalizers(&object)
                {
                    state.objects.remove(path);
                }
                (StatusCode::OK, object)
            }
            Method::PUT => {
                let version = state.version + 1;
                let Some(object) = state.objects.get_mut(path) else {
                    return not_found(path);
                };
                let wanted = &body["metadata"]["resourceVersion"];
                if !wanted.is_null() && *wanted != object["metadata"]["resourceVersion"] {
                    return status(StatusCode::CONFLICT, "Conflict", path);
                }
                let uid = object["metadata"]["uid"].clone();
                *object = body.clone();
                object["metadata"]["uid"] = uid;
                object["metadata"]["resourceVersion"] = json!(version.to_string());
                let object = object.clone();
                state.version = version;
                (StatusCode::OK, object)
            }
            Method::DELETE => {
                let Some(object) = state.objects.get(path) else {
                    return not_found(path);
                };
                let uid = &body["preconditions"]["uid"];
                let version = &body["preconditions"]["resourceVersion"];
                if (!uid.is_null() && *uid != object["metadata"]["uid"])
                    || (!version.is_null() && *version != object["metadata"]["resourceVersion"])
                {
                    return status(StatusCode::CONFLICT, "Conflict", path);
                }
                if holds_finalizers(object) {
                    // Held by finalizers: marked deleted (once), removed when the last goes.
                    let version = state.version + 1;
                    let object = state.objects.get_mut(path).expect("present");
                    if object["metadata"]["deletionTimestamp"].is_null() {
                        object["metadata"]["deletionTimestamp"] = json!("2026-12-05T00:00:00Z");
                        object["metadata"]["resourceVersion"] = json!(version.to_string());
                        state.version = version;
                    }
                    let object = state.objects[path].clone();
                    return (StatusCode::OK, object);
                }
                let object = state.objects.remove(path).expect("present");
                (StatusCode::OK, object)
            }
            _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", path),
        }
    }
}

fn holds_finalizers(object: &Value) -> bool {
    object["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| !f.is_empty())
}

/// Applies the patch shapes the controller sends: finalizer adds/removes (strategic merge) or a
/// replaced list (merge), and annotations set or removed (null).
fn apply_patch(object: &mut Value, patch: &Value, strategic: bool) {
    // Outside metadata, a JSON merge patch (events' counts).
    for (key, value) in patch.as_object().into_iter().flatten() {
        if key != "metadata" {
            merge(&mut object[key], value);
        }
    }
    let meta = &patch["metadata"];
    let finalizers = object["metadata"]["finalizers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut finalizers: Vec<Value> = finalizers;
    if let Some(add) = meta["finalizers"].as_array() {
        if strategic {
            for f in add {
                if !finalizers.contains(f) {
                    finalizers.push(f.clone());
                }
            }
        } else {
            finalizers = add.clone();
        }
    }
    if let Some(remove) = meta["$deleteFromPrimitiveList/finalizers"].as_array() {
        finalizers.retain(|f| !remove.contains(f));
    }
    object["metadata"]["finalizers"] = Value::Array(finalizers);
    if let Some(annotations) = meta["annotations"].as_object() {
        if !object["metadata"]["annotations"].is_object() {
            object["metadata"]["annotations"] = json!({});
        }
        for (key, value) in annotations {
            let target = object["metadata"]["annotations"]
                .as_object_mut()
                .expect("object");
            if value.is_null() {
                target.remove(key);
            } else {
                target.insert(key.clone(), value.clone());
            }
        }
    }
}

/// RFC 7386: objects merge key by key, null removes, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let object = target.as_object_mut().expect("object");
    for (key, value) in fields {
        if value.is_null() {
            object.remove(key);
        } else {
            merge(object.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

fn not_found(path: &str) -> (StatusCode, Value) {
    status(StatusCode::NOT_FOUND, "NotFound", path)
}

fn status(code: StatusCode, reason: &str, path: &str) -> (StatusCode, Value) {
    (
        code,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{reason}: {path}"), "reason": reason, "code": code.as_u16(),
        }),
    )
}
