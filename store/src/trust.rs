//! Signed builds (SPEC 5.15): the node's trust keys, and whether a staged
//! build carries a signature one of them made over exactly its bytes.
//!
//! The cryptography and the formats are the sigstore project's own crate:
//! an image's signatures are cosign's keyed ones (the simple signing
//! payload in a layer of the `sha256-<digest>.sig` manifest, or of a
//! referrer), judged by its [`PublicKeyVerifier`] and its payload's
//! manifest digest; a file's is a detached `cosign sign-blob` signature,
//! checked by its [`CosignVerificationKey`] over the store entry that will
//! run, never over a second download.
//!
//! What is decided here is which key a build must be signed by
//! ([`TrustPolicy::requirement`]) and, from what the registry or the file
//! gave, which of the three refusals applies: no signature, a signature by
//! another key, or a signature by the key over other bytes.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use genswap_crds::BuildSpec;
use sigstore::cosign::signature_layers::SignatureLayer;
use sigstore::cosign::simple_signing::SimpleSigning;
use sigstore::cosign::verification_constraint::{PublicKeyVerifier, VerificationConstraint};
use sigstore::crypto::{CosignVerificationKey, Signature};

/// The media type of cosign's simple signing payload layers.
pub const SIMPLE_SIGNING_MEDIA_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation cosign keeps the base64 signature in.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The artifact type of a cosign signature stored as a referrer.
pub const REFERRER_ARTIFACT_TYPE: &str = "application/vnd.dev.cosign.artifact.sig.v1+json";

/// What the node demands of a build's signature (`--trust-keys`,
/// `--require-signatures`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustPolicy {
    /// A directory of PEM public keys, each named by its file name without
    /// `.pub` or `.pem`. Read at each verification, so a changed ConfigMap
    /// needs no restart.
    pub keys: Option<PathBuf>,
    /// Refuse every build that names no key.
    pub require_signatures: bool,
}

/// A key a build must be signed by.
#[derive(Clone, Debug)]
pub struct TrustedKey {
    /// Its name (`build.signedBy`).
    pub name: String,
    /// Its file.
    pub path: PathBuf,
    pem: Vec<u8>,
}

/// Why a build's signature was refused. Every one is the build's fault
/// except [`TrustError::Keys`] (the node's directory cannot be read) and
/// [`TrustError::Fetch`] (the signature's source did not answer).
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error(
        "build {build} names no signing key (build.signedBy) and this node requires signatures (--require-signatures): nothing unsigned runs here"
    )]
    Unsigned { build: String },
    #[error("build.signedBy {key:?} cannot be checked: this node has no trust keys (--trust-keys)")]
    NoTrustKeys { key: String },
    #[error("build.signedBy {key:?} is not among this node's trust keys in {dir} (it has {known})")]
    UnknownKey {
        key: String,
        dir: PathBuf,
        known: String,
    },
    #[error("the trust keys in {dir} cannot be read: {source}")]
    Keys {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("trust key {key:?} ({path}) is not a PEM public key sigstore can use: {reason}")]
    BadKey {
        key: String,
        path: PathBuf,
        reason: String,
    },
    #[error("{build} has no signature: {looked}")]
    Missing { build: String, looked: String },
    #[error(
        "{build} is not signed by key {key:?}: {found} signature(s) found, none made by that key{}",
        other_key(.signer)
    )]
    OtherKey {
        build: String,
        key: String,
        found: usize,
        signer: Option<String>,
    },
    #[error(
        "{build} has a signature by key {key:?} over other bytes: it signs {signed}, and this build is {actual}"
    )]
    OtherBytes {
        build: String,
        key: String,
        signed: String,
        actual: String,
    },
    #[error(
        "{build}'s signature {source_name} does not verify with key {key:?} over the staged bytes: it was made by another key, or over other bytes"
    )]
    Unverified {
        build: String,
        key: String,
        source_name: String,
    },
    #[error("{build}'s signature {source_name} is not usable: {reason}")]
    Malformed {
        build: String,
        source_name: String,
        reason: String,
    },
    #[error("{build}'s signature could not be fetched: {reason}")]
    Fetch { build: String, reason: String },
}

fn other_key(signer: &Option<String>) -> String {
    match signer {
        Some(name) => format!(" (it is signed by this node's key {name:?})"),
        None => String::new(),
    }
}

impl TrustError {
    /// Whether the build is to blame: retrying cannot help until the spec
    /// (or the node's keys) change.
    pub fn is_build_fault(&self) -> bool {
        !matches!(self, TrustError::Keys { .. } | TrustError::Fetch { .. })
    }
}

impl TrustPolicy {
    /// The key `build` must be signed by, or none when it need not be.
    /// Refuses before anything is fetched: an unsigned build where
    /// signatures are required, a key the node does not hold.
    pub fn requirement(&self, build: &BuildSpec) -> Result<Option<TrustedKey>, TrustError> {
        let Some(name) = &build.signed_by else {
            if self.require_signatures {
                return Err(TrustError::Unsigned {
                    build: build.id.clone(),
                });
            }
            return Ok(None);
        };
        let Some(dir) = &self.keys else {
            return Err(TrustError::NoTrustKeys { key: name.clone() });
        };
        let keys = read_keys(dir)?;
        match keys.get(name) {
            Some(path) => {
                let pem = fs::read(path).map_err(|source| TrustError::Keys {
                    dir: dir.clone(),
                    source,
                })?;
                Ok(Some(TrustedKey {
                    name: name.clone(),
                    path: path.clone(),
                    pem,
                }))
            }
            None => Err(TrustError::UnknownKey {
                key: name.clone(),
                dir: dir.clone(),
                known: if keys.is_empty() {
                    "none".into()
                } else {
                    keys.keys().cloned().collect::<Vec<_>>().join(", ")
                },
            }),
        }
    }

    /// Every key of the directory but `except`, for naming who did sign.
    fn others(&self, except: &str) -> Vec<TrustedKey> {
        let Some(dir) = &self.keys else {
            return Vec::new();
        };
        read_keys(dir)
            .unwrap_or_default()
            .into_iter()
            .filter(|(name, _)| name != except)
            .filter_map(|(name, path)| {
                fs::read(&path)
                    .ok()
                    .map(|pem| TrustedKey { name, path, pem })
            })
            .collect()
    }
}

/// The keys of `dir` by name: `<name>.pub` or `<name>.pem`, regular files
/// (a ConfigMap's entries are symlinks to them), dot files skipped.
fn read_keys(dir: &Path) -> Result<BTreeMap<String, PathBuf>, TrustError> {
    let entries = fs::read_dir(dir).map_err(|source| TrustError::Keys {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut keys = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(|source| TrustError::Keys {
            dir: dir.to_path_buf(),
            source,
        })?;
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        if file_name.starts_with('.') {
            continue;
        }
        let Some(name) = file_name
            .strip_suffix(".pub")
            .or_else(|| file_name.strip_suffix(".pem"))
        else {
            continue;
        };
        let path = entry.path();
        if fs::metadata(&path).map(|m| m.is_file()).unwrap_or(false) {
            keys.insert(name.to_string(), path);
        }
    }
    Ok(keys)
}

impl TrustedKey {
    /// The sha256 of the key's file: what a verification is remembered by.
    pub(crate) fn fingerprint(&self) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(&self.pem).into()
    }

    fn verifier(&self) -> Result<PublicKeyVerifier, TrustError> {
        PublicKeyVerifier::try_from(&self.pem).map_err(|e| self.bad(e))
    }

    fn verification_key(&self) -> Result<CosignVerificationKey, TrustError> {
        CosignVerificationKey::try_from_pem(&self.pem).map_err(|e| self.bad(e))
    }

    fn bad(&self, error: sigstore::errors::SigstoreError) -> TrustError {
        TrustError::BadKey {
            key: self.name.clone(),
            path: self.path.clone(),
            reason: error.to_string(),
        }
    }
}

/// One signature layer as the registry gave it: the payload (already
/// checked against its layer digest) and the annotation's signature.
pub(crate) struct FetchedSignature {
    pub layer_digest: String,
    pub payload: Vec<u8>,
    pub signature: Option<String>,
    /// Where it was found, for messages.
    pub source: String,
}

/// Judges an image's signatures: one by `key` whose payload names the
/// pinned manifest digest `sha256:<expected>` passes.
pub(crate) fn judge_image(
    policy: &TrustPolicy,
    build: &str,
    key: &TrustedKey,
    expected: &str,
    fetched: Vec<FetchedSignature>,
    looked: &str,
) -> Result<(), TrustError> {
    if fetched.is_empty() {
        return Err(TrustError::Missing {
            build: build.to_string(),
            looked: looked.to_string(),
        });
    }
    let verifier = key.verifier()?;
    let actual = format!("sha256:{expected}");
    let mut layers = Vec::with_capacity(fetched.len());
    for sig in fetched {
        let simple_signing: SimpleSigning =
            serde_json::from_slice(&sig.payload).map_err(|e| TrustError::Malformed {
                build: build.to_string(),
                source_name: sig.source.clone(),
                reason: format!("its payload is not a simple signing document: {e}"),
            })?;
        layers.push(SignatureLayer {
            simple_signing,
            oci_digest: sig.layer_digest,
            certificate_signature: None,
            bundle: None,
            signature: sig.signature,
            raw_data: sig.payload,
        });
    }
    let mut signed_elsewhere = None;
    for layer in &layers {
        if !verifier.verify(layer).unwrap_or(false) {
            continue;
        }
        if layer.simple_signing.satisfies_manifest_digest(&actual) {
            return Ok(());
        }
        signed_elsewhere = Some(
            layer
                .simple_signing
                .critical
                .image
                .docker_manifest_digest
                .clone(),
        );
    }
    if let Some(signed) = signed_elsewhere {
        return Err(TrustError::OtherBytes {
            build: build.to_string(),
            key: key.name.clone(),
            signed,
            actual,
        });
    }
    let signer = policy.others(&key.name).into_iter().find_map(|other| {
        let verifier = other.verifier().ok()?;
        layers
            .iter()
            .any(|layer| verifier.verify(layer).unwrap_or(false))
            .then_some(other.name)
    });
    Err(TrustError::OtherKey {
        build: build.to_string(),
        key: key.name.clone(),
        found: layers.len(),
        signer,
    })
}

/// Judges a file's detached signature (base64, as `cosign sign-blob`
/// prints it) over `bytes`, the store entry that will run.
pub(crate) fn judge_blob(
    policy: &TrustPolicy,
    build: &str,
    key: &TrustedKey,
    signature: &str,
    source_name: &str,
    bytes: &[u8],
) -> Result<(), TrustError> {
    let signature = signature.trim();
    if signature.is_empty() {
        return Err(TrustError::Missing {
            build: build.to_string(),
            looked: format!("{source_name} is empty"),
        });
    }
    let verify = |key: &CosignVerificationKey| {
        key.verify_signature(Signature::Base64Encoded(signature.as_bytes()), bytes)
    };
    match verify(&key.verification_key()?) {
        Ok(()) => Ok(()),
        Err(sigstore::errors::SigstoreError::PublicKeyVerificationError) => {
            let signer = policy.others(&key.name).into_iter().find_map(|other| {
                let other_key = other.verification_key().ok()?;
                verify(&other_key).is_ok().then_some(other.name)
            });
            match signer {
                Some(_) => Err(TrustError::OtherKey {
                    build: build.to_string(),
                    key: key.name.clone(),
                    found: 1,
                    signer,
                }),
                // A signature over a digest cannot say which of the two it
                // is: the message names both.
                None => Err(TrustError::Unverified {
                    build: build.to_string(),
                    key: key.name.clone(),
                    source_name: source_name.to_string(),
                }),
            }
        }
        Err(e) => Err(TrustError::Malformed {
            build: build.to_string(),
            source_name: source_name.to_string(),
            reason: e.to_string(),
        }),
    }
}
