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

/// Code points besides `char::is_control` (general category Cc) that guest text may not carry
/// into the host's log, events or errors: every format character (Cf) and the line and paragraph
/// separators (Zl, Zp): every such code point of Unicode 18.0 (checked against its data).
/// They reorder what a reader sees (the bidi embeddings, overrides and isolates U+202A-202E,
/// U+2066-2069, marks U+200E/200F and U+061C), break a line where no `\n` is (U+2028, U+2029:
/// JSON leaves them raw, JavaScript and some viewers end a line there), or hide text (zero-width
/// U+200B-200D, U+2060-2064, U+FEFF, the soft hyphen, tags U+E0000-E007F). Escaping every Cf
/// costs a rare joined emoji its looks (U+200D shows as `\u{200d}`); other invisible characters
/// (spaces Zs, variation selectors, fillers) can neither reorder text nor start a line, and stay.
const ESCAPED_FORMAT: &[(u32, u32)] = &[
    (0x00AD, 0x00AD),   // soft hyphen
    (0x0600, 0x0605),   // Arabic number signs
    (0x061C, 0x061C),   // Arabic letter mark (bidi)
    (0x06DD, 0x06DD),   // Arabic end of ayah
    (0x070F, 0x070F),   // Syriac abbreviation mark
    (0x0890, 0x0891),   // Arabic pound and piastre marks above
    (0x08E2, 0x08E2),   // Arabic disputed end of ayah
    (0x180E, 0x180E),   // Mongolian vowel separator
    (0x200B, 0x200F),   // zero width space, non-joiner, joiner; LRM, RLM (bidi)
    (0x2028, 0x202E),   // line (Zl) and paragraph (Zp) separators; LRE, RLE, PDF, LRO, RLO
    (0x2060, 0x2064),   // word joiner, invisible operators
    (0x2066, 0x206F),   // LRI, RLI, FSI, PDI (bidi isolates); deprecated format characters
    (0xFEFF, 0xFEFF),   // zero width no-break space (byte order mark)
    (0xFFF9, 0xFFFB),   // interlinear annotation
    (0x110BD, 0x110BD), // Kaithi number sign
    (0x110CD, 0x110CD), // Kaithi number sign above
    (0x13430, 0x1343F), // Egyptian hieroglyph format controls
    (0x1BCA0, 0x1BCA3), // shorthand format controls
    (0x1D173, 0x1D17A), // musical symbol beams, ties, slurs, phrases
    (0xE0001, 0xE0001), // language tag
    (0xE0020, 0xE007F), // tag characters
];

/// Whether [`printable`] escapes `c`: a control character (Cc: `\n`, `\r`, ESC, NEL, ...), a
/// format character (Cf: the bidi controls, zero-width characters) or a line or paragraph
/// separator (U+2028, U+2029).
pub fn escaped(c: char) -> bool {
    let c = c as u32;
    if c < 0xAD {
        return c < 0x20 || (0x7F..=0x9F).contains(&c);
    }
    ESCAPED_FORMAT
        .iter()
        .any(|&(first, last)| (first..=last).contains(&c))
}

/// Guest text as it may appear in the host's log, events and errors: control characters
/// (newline, carriage return, escape, ...), format characters (the bidi overrides and isolates,
/// zero-width characters) and the line and paragraph separators escaped (`\n`, `\r`,
/// `\u{1b}`, `\u{202e}`, `\u{2028}`), so a guest can never start a line of its own, reorder
/// what a reader sees or move the cursor, in the text format or the JSON one (serde_json
/// leaves U+2028 and U+2029 raw). Escaping twice changes nothing.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(escaped) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if escaped(c) {
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

    #[test]
    fn printable_escapes_controls_formats_and_separators() {
        for (text, shown) in [
            ("plain text", "plain text"),
            ("a\nb\r\tc", "a\\nb\\r\\tc"),
            ("\u{1b}[2K", "\\u{1b}[2K"),
            ("\u{7f}\u{85}\u{9f}", "\\u{7f}\\u{85}\\u{9f}"),
            ("user\u{202e}fdp.exe", "user\\u{202e}fdp.exe"),
            (
                "\u{202a}\u{202b}\u{202c}\u{202d}",
                "\\u{202a}\\u{202b}\\u{202c}\\u{202d}",
            ),
            (
                "\u{2066}\u{2067}\u{2068}\u{2069}",
                "\\u{2066}\\u{2067}\\u{2068}\\u{2069}",
            ),
            ("\u{200e}\u{200f}\u{61c}", "\\u{200e}\\u{200f}\\u{61c}"),
            ("line\u{2028}para\u{2029}", "line\\u{2028}para\\u{2029}"),
            ("zero\u{200b}width\u{feff}", "zero\\u{200b}width\\u{feff}"),
            ("soft\u{ad}hyphen", "soft\\u{ad}hyphen"),
            ("tag\u{e0041}", "tag\\u{e0041}"),
            // Kept: letters of any script, spaces, marks, symbols, emoji.
            (
                "d\u{e9}j\u{e0} \u{4e2d}\u{6587} \u{627}\u{644}",
                "d\u{e9}j\u{e0} \u{4e2d}\u{6587} \u{627}\u{644}",
            ),
            ("no\u{a0}break\u{3000}", "no\u{a0}break\u{3000}"),
            ("e\u{301} \u{1f44d}\u{fe0f}", "e\u{301} \u{1f44d}\u{fe0f}"),
            ("back\\slash \\u{202e}", "back\\slash \\u{202e}"),
        ] {
            assert_eq!(printable(text), shown, "{text:?}");
            assert_eq!(printable(&printable(text)), shown, "twice: {text:?}");
        }
    }

    #[test]
    fn the_table_is_sorted_and_every_edge_is_exact() {
        for pair in ESCAPED_FORMAT.windows(2) {
            assert!(pair[0].1 + 1 < pair[1].0, "sorted, apart: {pair:?}");
        }
        for &(first, last) in ESCAPED_FORMAT {
            for c in [first, last] {
                assert!(escaped(char::from_u32(c).unwrap()), "{c:#x}");
            }
            for c in [first - 1, last + 1] {
                assert!(!escaped(char::from_u32(c).unwrap()), "{c:#x}");
            }
        }
        // Cc exactly as the standard library has it.
        for c in (0..0x2000).filter_map(char::from_u32) {
            if c.is_control() {
                assert!(escaped(c), "{c:?}");
            }
        }
        assert!(!escaped(' ') && !escaped('~') && !escaped('\u{a0}'));
    }
}
