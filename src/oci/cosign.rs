//! Cosign key-based signatures of a guest's OCI artifact, verified against the public key its
//! grant file pins, offline.
//!
//! Cosign (`cosign sign --key`) signs an artifact's *manifest* digest: it pushes a "simple
//! signing" payload (JSON naming `docker-manifest-digest`) as a layer of an image tagged
//! `sha256-<manifest hex>.sig` in the same repository, with the ECDSA signature (base64, DER)
//! in the layer's `dev.cosignproject.cosign/signature` annotation. The chain checked here:
//! signature over the payload → the payload names the manifest's digest → the manifest's
//! `application/wasm` layer is the module's SHA-256. `pull` keeps that evidence next to the
//! module (`.NAME.sig.json`), so a load can check it again with no registry, across an air gap.
//! Only ECDSA P-256 keys (cosign's default `cosign.pub`) are read.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// The annotation cosign puts the base64 signature in.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The media type of cosign's payload layer.
pub const PAYLOAD_MEDIA_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The payload `critical.type` cosign writes.
const PAYLOAD_TYPE: &str = "cosign container image signature";
/// DER prefix of a P-256 SubjectPublicKeyInfo (id-ecPublicKey, prime256v1, a 66-byte BIT
/// STRING), followed by the 65-byte uncompressed point.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// Why a signature does not hold.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    /// The grant's key is not a PEM P-256 public key.
    #[error("the pinned key is not an ECDSA P-256 public key in PEM (cosign.pub): {0}")]
    Key(&'static str),
    /// No signature of the artifact was found.
    #[error("no cosign signature for {0}")]
    Missing(String),
    /// The signature does not verify under the pinned key.
    #[error("the signature does not verify with the pinned key")]
    Bad,
    /// The signed payload is not about this artifact.
    #[error("the signed payload {0}")]
    Payload(String),
    /// The manifest does not name the module's bytes.
    #[error("the signed manifest {0}")]
    Manifest(String),
}

/// What `pull` keeps beside a module so that every load can verify it again offline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// The artifact's manifest, as the registry served it (its digest is what was signed).
    pub manifest: String,
    /// Cosign's simple signing payload, as signed.
    pub payload: String,
    /// The base64 DER ECDSA signature of `payload`.
    pub signature: String,
}

/// The file beside `NAME.wasm` that holds its evidence (hidden: the plugins scan skips it).
pub fn evidence_file(name: &str) -> String {
    format!(".{name}.sig.json")
}

/// The tag cosign stores the signature of the manifest with digest `sha256:<hex>` under.
pub fn signature_tag(manifest_hex: &str) -> String {
    format!("sha256-{manifest_hex}.sig")
}

/// Verifies `evidence` for the module with SHA-256 `module_hex` under the PEM `public_key`.
pub fn verify(
    evidence: &Evidence,
    public_key: &str,
    module_hex: &str,
) -> Result<(), SignatureError> {
    let point = p256_point(public_key)?;
    use base64::Engine as _;
    let signature = base64::engine::general_purpose::STANDARD
        .decode(evidence.signature.trim())
        .map_err(|_| SignatureError::Bad)?;
    ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_ASN1, &point)
        .verify(evidence.payload.as_bytes(), &signature)
        .map_err(|_| SignatureError::Bad)?;
    let payload: Payload = serde_json::from_str(&evidence.payload)
        .map_err(|e| SignatureError::Payload(format!("is not cosign's: {e}")))?;
    if payload.critical.kind != PAYLOAD_TYPE {
        return Err(SignatureError::Payload(format!(
            "has type {:?}, not {PAYLOAD_TYPE:?}",
            payload.critical.kind
        )));
    }
    let manifest_digest = format!(
        "sha256:{}",
        hex::encode(Sha256::digest(evidence.manifest.as_bytes()))
    );
    if payload.critical.image.digest != manifest_digest {
        return Err(SignatureError::Payload(format!(
            "names manifest {}, not {manifest_digest}",
            payload.critical.image.digest
        )));
    }
    let manifest: Manifest = serde_json::from_str(&evidence.manifest)
        .map_err(|e| SignatureError::Manifest(format!("is not an OCI manifest: {e}")))?;
    let wasm: Vec<&Layer> = manifest
        .layers
        .iter()
        .filter(|l| l.media_type == "application/wasm")
        .collect();
    match wasm.as_slice() {
        [layer] if layer.digest == format!("sha256:{module_hex}") => Ok(()),
        [layer] => Err(SignatureError::Manifest(format!(
            "names module {}, not sha256:{module_hex}",
            layer.digest
        ))),
        _ => Err(SignatureError::Manifest(
            "does not have exactly one application/wasm layer".into(),
        )),
    }
}

/// The uncompressed point of a PEM P-256 SubjectPublicKeyInfo.
fn p256_point(pem: &str) -> Result<Vec<u8>, SignatureError> {
    let body = pem
        .trim()
        .strip_prefix("-----BEGIN PUBLIC KEY-----")
        .and_then(|rest| rest.trim_end().strip_suffix("-----END PUBLIC KEY-----"))
        .ok_or(SignatureError::Key("no PUBLIC KEY block"))?;
    let text: String = body.chars().filter(|c| !c.is_whitespace()).collect();
    use base64::Engine as _;
    let der = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|_| SignatureError::Key("its base64 does not decode"))?;
    match der.strip_prefix(&P256_SPKI_PREFIX[..]) {
        Some(point) if point.len() == 65 && point[0] == 4 => Ok(point.to_vec()),
        _ => Err(SignatureError::Key("not a P-256 key")),
    }
}

#[derive(Deserialize)]
struct Payload {
    critical: Critical,
}

#[derive(Deserialize)]
struct Critical {
    image: Image,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct Image {
    #[serde(rename = "docker-manifest-digest")]
    digest: String,
}

#[derive(Deserialize)]
struct Manifest {
    #[serde(default)]
    layers: Vec<Layer>,
}

#[derive(Deserialize)]
struct Layer {
    #[serde(rename = "mediaType")]
    media_type: String,
    digest: String,
}

/// The largest signature evidence file read: a manifest, a payload and a signature.
const MAX_EVIDENCE_BYTES: u64 = 256 * 1024;

/// Whether the evidence `pull` kept beside `NAME.wasm` shows a signature by `key` of the
/// artifact whose module has SHA-256 `module_hex`.
pub fn verify_beside(
    dir: &std::path::Path,
    name: &str,
    key: &str,
    module_hex: &str,
) -> Result<(), String> {
    use std::io::Read as _;
    let path = dir.join(evidence_file(name));
    let mut text = String::new();
    std::fs::File::open(&path)
        .and_then(|file| file.take(MAX_EVIDENCE_BYTES).read_to_string(&mut text))
        .map_err(|e| {
            format!(
                "its grant names a cosign-key and its signature evidence {} cannot be read ({e}): pull it with `wasm-provisioner pull --grant` or load it from a `save` tarball",
                path.display()
            )
        })?;
    let evidence: Evidence = serde_json::from_str(&text)
        .map_err(|e| format!("signature evidence {}: {e}", path.display()))?;
    verify(&evidence, key, module_hex).map_err(|e| e.to_string())
}

/// Why no verified signature could be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The registry failed.
    #[error(transparent)]
    Registry(#[from] super::registry::RegistryError),
    /// Nothing there verifies.
    #[error(transparent)]
    Signature(#[from] SignatureError),
}

/// The largest cosign payload fetched (a payload is a few hundred bytes).
const MAX_PAYLOAD_BYTES: u64 = 64 * 1024;
/// Signatures tried per artifact (cosign appends one layer per signing).
const MAX_SIGNATURES: usize = 16;

/// Fetches the cosign signatures of `pulled` (the manifest `reference` named) from its
/// repository's `sha256-<hex>.sig` tag and returns the evidence of the first one that verifies
/// under `key` for the module `module`.
pub async fn fetch(
    registry: &mut super::registry::Registry,
    reference: &super::Reference,
    pulled: &super::registry::PulledManifest,
    module: &super::Digest,
    key: &str,
) -> Result<Evidence, FetchError> {
    let manifest = String::from_utf8(pulled.raw.to_vec())
        .map_err(|_| SignatureError::Manifest("is not UTF-8".into()))?;
    let signatures = super::Reference {
        tag: Some(signature_tag(pulled.digest.hex())),
        digest: None,
        ..reference.clone()
    };
    let listed = match registry.manifest(&signatures).await {
        Ok(listed) => listed,
        Err(super::registry::RegistryError::NotFound { .. }) => {
            return Err(SignatureError::Missing(format!("{reference} (no {signatures})")).into());
        }
        Err(error) => return Err(error.into()),
    };
    let mut last =
        SignatureError::Missing(format!("{reference} (no signature layer in {signatures})"));
    for layer in listed
        .manifest
        .layers
        .iter()
        .filter(|l| l.media_type == PAYLOAD_MEDIA_TYPE)
        .take(MAX_SIGNATURES)
    {
        let Some(signature) = layer
            .annotations
            .as_ref()
            .and_then(|a| a.get(SIGNATURE_ANNOTATION))
        else {
            continue;
        };
        // A payload is a few hundred bytes: a larger one is not fetched at all.
        if layer.size > MAX_PAYLOAD_BYTES {
            continue;
        }
        let payload = registry.blob(&signatures, layer).await?;
        let Ok(payload) = String::from_utf8(payload.to_vec()) else {
            continue;
        };
        let evidence = Evidence {
            manifest: manifest.clone(),
            payload,
            signature: signature.clone(),
        };
        match verify(&evidence, key, module.hex()) {
            Ok(()) => return Ok(evidence),
            Err(error) => last = error,
        }
    }
    Err(last.into())
}

/// Cosign's payload for the manifest with digest `sha256:<hex>` in `repository`, as it writes it.
pub fn payload_for(repository: &str, manifest_hex: &str) -> String {
    serde_json::json!({
        "critical": {
            "identity": {"docker-reference": repository},
            "image": {"docker-manifest-digest": format!("sha256:{manifest_hex}")},
            "type": PAYLOAD_TYPE,
        },
        "optional": null,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::rand::SystemRandom;
    use ring::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};

    struct Signer {
        pair: EcdsaKeyPair,
        pem: String,
    }

    fn signer() -> Signer {
        use base64::Engine as _;
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref(), &rng)
            .unwrap();
        let mut der = P256_SPKI_PREFIX.to_vec();
        der.extend_from_slice(pair.public_key().as_ref());
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let pem = format!("-----BEGIN PUBLIC KEY-----\n{b64}\n-----END PUBLIC KEY-----\n");
        Signer { pair, pem }
    }

    fn evidence(signer: &Signer, module_hex: &str) -> Evidence {
        use base64::Engine as _;
        let manifest = format!(
            r#"{{"schemaVersion":2,"layers":[{{"mediaType":"application/wasm","digest":"sha256:{module_hex}","size":3}}]}}"#
        );
        let manifest_hex = hex::encode(Sha256::digest(manifest.as_bytes()));
        let payload = payload_for("registry.local/guests/hostpath", &manifest_hex);
        let signature = signer
            .pair
            .sign(&SystemRandom::new(), payload.as_bytes())
            .unwrap();
        Evidence {
            manifest,
            payload,
            signature: base64::engine::general_purpose::STANDARD.encode(signature.as_ref()),
        }
    }

    #[test]
    fn a_signature_of_the_manifest_that_names_the_module_verifies_and_nothing_else_does() {
        let module = hex::encode(Sha256::digest(b"abc"));
        let key = signer();
        let good = evidence(&key, &module);
        assert_eq!(verify(&good, &key.pem, &module), Ok(()));

        let other_key = signer();
        assert_eq!(
            verify(&good, &other_key.pem, &module),
            Err(SignatureError::Bad)
        );
        let other_module = hex::encode(Sha256::digest(b"abd"));
        assert!(matches!(
            verify(&good, &key.pem, &other_module),
            Err(SignatureError::Manifest(_))
        ));
        let mut swapped_manifest = good.clone();
        swapped_manifest.manifest = swapped_manifest
            .manifest
            .replace("\"size\":3", "\"size\":4");
        assert!(matches!(
            verify(&swapped_manifest, &key.pem, &module),
            Err(SignatureError::Payload(_))
        ));
        let mut edited_payload = good.clone();
        edited_payload.payload = edited_payload.payload.replace("hostpath", "other");
        assert_eq!(
            verify(&edited_payload, &key.pem, &module),
            Err(SignatureError::Bad)
        );
        let mut garbage = good;
        garbage.signature = "%%%".into();
        assert_eq!(
            verify(&garbage, &key.pem, &module),
            Err(SignatureError::Bad)
        );
    }

    #[test]
    fn keys_that_are_not_pem_p256_are_refused_with_why() {
        for pem in [
            "",
            "-----BEGIN PUBLIC KEY-----\n%%%\n-----END PUBLIC KEY-----",
            "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----",
        ] {
            assert!(
                matches!(p256_point(pem), Err(SignatureError::Key(_))),
                "{pem:?}"
            );
        }
    }
}
