//! Guest text in the host's log: never a line of its own, in the text format or JSON.

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
    tracing::warn!(%error, "provision failed");
    let (text, json) = (text.text(), json.text());
    println!("text format:\n{text}\njson format:\n{json}");
    assert!(
        text.contains("guest text"),
        "the guest's message was logged"
    );
    assert!(text.contains("FORGED"), "its text is there, escaped");
    for line in text.lines() {
        assert!(
            !line.starts_with("2026-01-01") && !line.contains('\r') && !line.contains('\u{1b}'),
            "a forged line or control character: {line:?}"
        );
    }
    for line in json.lines() {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object per line ({e}): {line:?}"));
        assert!(value.is_object());
        assert!(!line.contains('\r') && !line.contains('\u{1b}'), "{line:?}");
    }
}
