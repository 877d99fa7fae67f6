//! Captured guest stdout/stderr with a hard bound: the first bytes and the last few are kept,
//! everything between is counted and dropped, and the guest never notices.
//!
//! wasmtime-wasi's `MemoryOutputPipe` traps the guest once its buffer is full, which would turn
//! a chatty guest into a failed call; a flood here only costs the guest its own CPU time.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Bytes kept from the end of the stream once the head is full (a panic message comes last).
pub const TAIL_BYTES: usize = 2048;

#[derive(Debug, Default)]
struct Captured {
    head: Vec<u8>,
    tail: VecDeque<u8>,
    dropped: u64,
}

/// One bounded capture; clones share the buffer.
#[derive(Debug, Clone)]
pub struct BoundedOutput {
    head_bytes: usize,
    captured: Arc<Mutex<Captured>>,
}

/// What a capture kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputContents {
    /// The kept text: head, then (if anything was dropped) the tail.
    pub text: String,
    /// Bytes dropped between head and tail.
    pub dropped: u64,
}

impl BoundedOutput {
    /// A capture keeping the first `head_bytes` and the last [`TAIL_BYTES`] bytes.
    pub fn new(head_bytes: usize) -> BoundedOutput {
        BoundedOutput {
            head_bytes,
            captured: Arc::default(),
        }
    }

    fn push(&self, mut bytes: &[u8]) {
        let mut c = self.captured.lock().expect("output lock");
        let room = self.head_bytes.saturating_sub(c.head.len());
        let now = room.min(bytes.len());
        c.head.extend_from_slice(&bytes[..now]);
        bytes = &bytes[now..];
        if bytes.len() > TAIL_BYTES {
            let skip = bytes.len() - TAIL_BYTES;
            c.dropped += (skip + c.tail.len()) as u64;
            c.tail.clear();
            bytes = &bytes[skip..];
        }
        let overflow = (c.tail.len() + bytes.len()).saturating_sub(TAIL_BYTES);
        c.tail.drain(..overflow);
        c.dropped += overflow as u64;
        c.tail.extend(bytes);
    }

    /// What was kept so far.
    pub fn contents(&self) -> OutputContents {
        let c = self.captured.lock().expect("output lock");
        let mut text = String::from_utf8_lossy(&c.head).into_owned();
        if !c.tail.is_empty() {
            if c.dropped > 0 {
                text.push_str(&format!("\n[... {} bytes dropped ...]\n", c.dropped));
            }
            let (a, b) = c.tail.as_slices();
            text.push_str(&String::from_utf8_lossy(&[a, b].concat()));
        }
        OutputContents {
            text,
            dropped: c.dropped,
        }
    }
}

impl IsTerminal for BoundedOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for BoundedOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for BoundedOutput {
    async fn ready(&mut self) {}
}

impl OutputStream for BoundedOutput {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // Always ready for a full chunk: the capture never blocks or closes.
        Ok(64 * 1024)
    }
}

impl tokio::io::AsyncWrite for BoundedOutput {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Guest text as it may appear in the host's log and events: control characters (newline,
/// carriage return, escape, ...) escaped (`\n`, `\r`, `\u{1b}`), so a guest can never start a
/// line of its own or move the cursor, in the text format or the JSON one.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(|c| c.is_control()) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_output_is_kept_whole() {
        let out = BoundedOutput::new(16);
        out.push(b"hello ");
        out.push(b"world");
        assert_eq!(
            out.contents(),
            OutputContents {
                text: "hello world".into(),
                dropped: 0
            }
        );
    }

    #[test]
    fn a_flood_keeps_head_and_tail_and_counts_the_rest() {
        let out = BoundedOutput::new(4);
        out.push(b"HEAD");
        for _ in 0..10_000 {
            out.push(b"0123456789");
        }
        out.push(b"panicked at the end");
        let c = out.contents();
        assert!(c.text.starts_with("HEAD\n[... "), "{}", &c.text[..40]);
        assert!(c.text.ends_with("panicked at the end"));
        assert_eq!(c.dropped as usize, 100_000 + 19 - TAIL_BYTES);
        assert!(c.text.len() < 4 + TAIL_BYTES + 64);
        // One write larger than the tail keeps only its end.
        let big = BoundedOutput::new(0);
        big.push(&vec![b'x'; 3 * TAIL_BYTES]);
        assert_eq!(big.contents().dropped as usize, 2 * TAIL_BYTES);
    }
}
