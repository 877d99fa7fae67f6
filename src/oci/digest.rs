//! Content digests (`sha256:<64 lowercase hex>`), the only algorithm this client speaks, and the
//! running hash every manifest and blob is checked against while it streams in.

use sha2::{Digest as _, Sha256};

/// Why a digest string was refused.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    /// Not `sha256:` followed by 64 lowercase hex digits.
    #[error(
        "{text:?} is not a sha256 digest (expected sha256: and 64 lowercase hex digits; other algorithms are not supported)"
    )]
    Malformed { text: String },
}

/// A sha256 content digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<hex>`.
    pub fn parse(text: &str) -> Result<Digest, DigestError> {
        match text.strip_prefix("sha256:") {
            Some(hex) if is_sha256_hex(hex) => Ok(Digest(text.to_string())),
            _ => Err(DigestError::Malformed {
                text: text.to_string(),
            }),
        }
    }

    /// From the bare 64 hex digits (a grant's `[module] sha256`, the air-gap index).
    pub fn from_hex(hex: &str) -> Result<Digest, DigestError> {
        Digest::parse(&format!("sha256:{hex}"))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(format!("sha256:{}", hex::encode(Sha256::digest(bytes))))
    }

    /// The 64 hex digits, without the algorithm.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// 64 lowercase hex digits: upper case is refused so one blob has one spelling.
pub fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A running sha256 over bytes as they arrive.
#[derive(Default)]
pub struct Hasher {
    hash: Sha256,
    len: u64,
}

impl Hasher {
    pub fn update(&mut self, bytes: &[u8]) {
        self.hash.update(bytes);
        self.len += bytes.len() as u64;
    }

    /// Bytes seen so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn finish(self) -> Digest {
        Digest(format!("sha256:{}", hex::encode(self.hash.finalize())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_only_lowercase_sha256() {
        let hex = "a".repeat(64);
        assert_eq!(Digest::parse(&format!("sha256:{hex}")).unwrap().hex(), hex);
        assert!(Digest::parse(&format!("sha256:{}", "A".repeat(64))).is_err());
        assert!(Digest::parse(&format!("sha512:{hex}")).is_err());
        assert!(Digest::parse("sha256:abc").is_err());
        assert!(Digest::from_hex(&hex).is_ok());
    }

    #[test]
    fn the_running_hash_equals_the_one_shot_hash() {
        let mut hasher = Hasher::default();
        hasher.update(b"hello ");
        hasher.update(b"world");
        assert_eq!(hasher.len(), 11);
        assert_eq!(hasher.finish(), Digest::of(b"hello world"));
    }
}
