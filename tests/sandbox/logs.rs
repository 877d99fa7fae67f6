//! Guest text in the host's log: never a line of its own, never reordered, in the text format
//! or JSON.

use super::*;
use tracing_subscriber::layer::SubscriberExt;

/// A writer into a shared buffer, for a fmt layer.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buffer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Runs in a child process of its own: it installs the process' global subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_text_cannot_forge_a_log_line() {
    if !in_child("logs::guest_text_cannot_forge_a_log_line", "WP_LOG_CHILD") {
        return;
    }
    let (text, json) = (Buffer::default(), Buffer::default());
    let subscriber = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer({
                    let text = text.clone();
                    move || text.clone()
                }),
        )
        .with(tracing_subscriber::fmt::layer().json().with_writer({
            let json = json.clone();
            move || json.clone()
        }));
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let n = NodeAttack::load("");
    let outcome = n.provision("forge", &[("attack", "log-forge")]).await;
    let error = outcome.expect_err("a final error");
    // The guest's own text is escaped where it enters the host, so a Kubernetes event or
    // condition built from it later (a transient or reschedule message goes there as it is) is
    // safe too.
    match &error {
        CallError::Guest {
            error: wasm_provisioner::wasm::ProvisionError::Final(message),
            ..
        } => assert!(!message.contains(SPOOFING), "{message:?}"),
        other => panic!("expected the guest's final error, got {other:?}"),
    }
    let event = error.to_string();
    assert!(!event.contains(SPOOFING), "the event text: {event:?}");
    assert!(event.contains("\\u{202e}desrever"), "{event}");
    tracing::warn!(%error, "provision failed");
    let (text, json) = (text.text(), json.text());
    println!("text format:\n{text}\njson format:\n{json}");
    let raw = |s: &str| s.matches(SPOOFING).count();
    println!(
        "raw \\r, ESC, U+2028, U+2029, U+202E: {} in the text format, {} in the JSON, {} in the event",
        raw(&text),
        raw(&json),
        raw(&event)
    );
    assert!(
        text.contains("guest text"),
        "the guest's message was logged"
    );
    assert!(text.contains("FORGED"), "its text is there, escaped");
    for shown in ["\\u{2028}2026-01-01", "\\u{2029}", "\\u{202e}desrever"] {
        assert!(text.contains(shown), "{shown} is in the text format");
        assert!(
            json.contains(&shown.replace('\\', "\\\\")),
            "{shown} is in the JSON"
        );
    }
    for line in text.lines() {
        assert!(
            !line.starts_with("2026-01-01") && !line.contains(SPOOFING),
            "a forged line, a control, separator or bidi character: {line:?}"
        );
    }
    for line in json.lines() {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object per line ({e}): {line:?}"));
        assert!(value.is_object());
        assert!(!line.contains(SPOOFING), "{line:?}");
    }
}

/// What no log line may hold raw: a carriage return or escape (the cursor), a line or paragraph
/// separator (a line where none is), a bidi override (text shown reversed).
const SPOOFING: &[char] = &['\r', '\u{1b}', '\u{2028}', '\u{2029}', '\u{202e}'];
