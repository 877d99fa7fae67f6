//! File names that are not UTF-8, as a guest sees them and hands them back.
//!
//! WASI names are strings, but a tenant's pod can create any byte string (no `/`, no NUL) in
//! its volume. Failing the listing on such a name (`illegal-byte-sequence`) made the volume
//! undeletable. The listing instead hands the guest a *stand-in*: a NUL, which no file name can
//! contain (so no stand-in is ever a real name), then the name with every byte that is not
//! part of a UTF-8 character written `\xNN` and every `\` written `\\`. The filesystem calls a
//! delete makes (`open-at`, `unlink-file-at`, `remove-directory-at`, `rename-at`) map a path
//! that is a stand-in back to its bytes ([`host_path`]).
//!
//! A stand-in names exactly one entry of the directory it is used on: it decodes only to a
//! name that is not UTF-8 and holds neither `/` nor NUL (so never `.` or `..`), and every call
//! taking one resolves it relative to its descriptor, as it does any name. It cannot reach
//! anything a UTF-8 path could not.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use wasmtime_wasi::p2::bindings::filesystem::types::ErrorCode;

/// What starts every stand-in: NUL is in no file name, and no path a guest passes otherwise
/// reaches the filesystem with one.
const MARK: char = '\0';

/// The stand-in for `name`: the name itself when it is UTF-8, else the escaped form.
pub fn stand_in(name: &[u8]) -> String {
    if let Ok(text) = std::str::from_utf8(name) {
        return text.to_owned();
    }
    let mut out = String::with_capacity(name.len() * 2 + 1);
    out.push(MARK);
    for chunk in name.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c == '\\' {
                out.push_str("\\\\");
            } else {
                out.push(c);
            }
        }
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    out
}

/// The bytes a stand-in names; `None` when `text` is no well-formed stand-in of a name that is
/// not UTF-8.
fn decode(text: &str) -> Option<Vec<u8>> {
    let rest = text.strip_prefix(MARK)?;
    let mut bytes = Vec::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                '\\' => bytes.push(b'\\'),
                'x' => {
                    let hex: String = chars.by_ref().take(2).collect();
                    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return None;
                    }
                    bytes.push(u8::from_str_radix(&hex, 16).ok()?);
                }
                _ => return None,
            },
            c => {
                let mut buf = [0; 4];
                bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    let one_name = !bytes.is_empty() && !bytes.contains(&b'/') && !bytes.contains(&0);
    // A UTF-8 name is written as itself: only one stand-in per name, and only for names the
    // guest could not have named otherwise.
    (one_name && std::str::from_utf8(&bytes).is_err()).then_some(bytes)
}

/// The path a guest's `path` names in this process: itself, or, when it is a stand-in, the
/// one name it stands for. A NUL anywhere else is refused here, as the OS would.
pub fn host_path(path: &str) -> Result<PathBuf, ErrorCode> {
    if !path.contains(MARK) {
        return Ok(PathBuf::from(path));
    }
    let bytes = decode(path).ok_or(ErrorCode::IllegalByteSequence)?;
    Ok(PathBuf::from(OsStr::from_bytes(&bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_are_not_utf8_round_trip_and_utf8_names_are_themselves() {
        for name in [
            &b"plain"[..],
            b"caf\xc3\xa9",
            b"\xff",
            b"bad-\xff\xfe-name",
            b"back\\slash-\x80",
            b"\\x41\xc3",
            b"\xed\xa0\x80surrogate",
        ] {
            let shown = stand_in(name);
            let back = host_path(&shown).unwrap();
            assert_eq!(back.as_os_str().as_bytes(), name, "{shown:?}");
            assert_eq!(
                shown.starts_with(MARK),
                std::str::from_utf8(name).is_err(),
                "{shown:?}"
            );
        }
        assert_eq!(stand_in(b"a\xffb\\c"), "\0a\\xffb\\\\c");
    }

    #[test]
    fn a_stand_in_names_one_entry_and_nothing_else() {
        for bad in [
            "\0",             // empty
            "\0..",           // UTF-8: never a stand-in
            "\0plain",        // UTF-8
            "\0a\\x2f\\xff",  // a slash
            "\0\\x00\\xff",   // a NUL
            "\0\\xff/../etc", // a path
            "\0\\xzz",        // malformed
            "\0\\x f",        // malformed
            "\0\\q\\xff",     // unknown escape
            "\0\\",           // dangling escape
            "dir/\0\\xff",    // a stand-in is a whole path, never a part of one
            "\\xff\0",        // NUL elsewhere
        ] {
            assert_eq!(
                host_path(bad).unwrap_err(),
                ErrorCode::IllegalByteSequence,
                "{bad:?}"
            );
        }
        assert_eq!(host_path("a/b").unwrap(), PathBuf::from("a/b"));
    }
}
