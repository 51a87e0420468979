//! Signatures made as cosign makes them, with real tools, for the signed
//! build tests: no cosign is packaged here, so a key pair and each
//! signature come from `openssl` (ECDSA P-256 over SHA-256, DER, base64:
//! what `cosign sign-blob --key` prints), and an image's signature is the
//! manifest cosign's SIGNATURE_SPEC describes (a simple signing payload
//! layer, its signature in the layer's annotation), written to an OCI
//! layout and pushed by skopeo ([`crate::registry::Registry::push`]) to
//! the `sha256-<digest>.sig` tag.
//!
//! What this cannot catch: a detail of cosign's own output that the spec
//! leaves open (its config blob's exact fields, its optional annotations);
//! the verifier reads neither.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The media type of cosign's simple signing payload layers.
pub const SIMPLE_SIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";

/// An ECDSA P-256 key pair openssl made.
pub struct KeyPair {
    /// `<dir>/<name>.key`, SEC1 PEM.
    pub private: PathBuf,
    /// `<dir>/<name>.pub`, the SubjectPublicKeyInfo PEM cosign writes as
    /// `cosign.pub`.
    pub public: PathBuf,
}

fn run(command: &mut Command) -> Vec<u8> {
    let output = command.output().expect("openssl");
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output.stdout
}

impl KeyPair {
    /// A new key pair `<dir>/<name>.key` and `<dir>/<name>.pub`.
    pub fn generate(dir: &Path, name: &str) -> KeyPair {
        fs::create_dir_all(dir).expect("key dir");
        let private = dir.join(format!("{name}.key"));
        let public = dir.join(format!("{name}.pub"));
        run(Command::new("openssl")
            .args([
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
            ])
            .arg(&private));
        run(Command::new("openssl")
            .args(["ec", "-pubout", "-in"])
            .arg(&private)
            .arg("-out")
            .arg(&public));
        KeyPair { private, public }
    }

    /// The base64 signature of `bytes`, as `cosign sign-blob --key` prints
    /// it.
    pub fn sign(&self, bytes: &[u8]) -> String {
        let dir = tempfile::tempdir().expect("temp dir");
        let message = dir.path().join("message");
        let der = dir.path().join("signature.der");
        fs::write(&message, bytes).expect("message");
        run(Command::new("openssl")
            .args(["dgst", "-sha256", "-sign"])
            .arg(&self.private)
            .arg("-out")
            .arg(&der)
            .arg(&message));
        let encoded = run(Command::new("openssl")
            .args(["base64", "-A", "-in"])
            .arg(&der));
        String::from_utf8(encoded)
            .expect("base64 is text")
            .trim()
            .to_string()
    }
}

/// The simple signing payload cosign signs for an image: its repository
/// and the manifest digest (`sha256:<hex>`) it vouches for.
pub fn simple_signing_payload(docker_reference: &str, manifest_hex: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "critical": {
            "identity": {"docker-reference": docker_reference},
            "image": {"docker-manifest-digest": format!("sha256:{manifest_hex}")},
            "type": "cosign container image signature",
        },
        "optional": null,
    }))
    .expect("payload")
}

/// Writes cosign's signature manifest of `(payload, signature)` layers
/// into the OCI layout `layout`, tagged `name` there: an image config
/// listing the payloads, and each payload a layer whose
/// `dev.cosignproject.cosign/signature` annotation is its signature.
/// Returns the manifest's digest (hex).
pub fn write_signature_manifest(layout: &Path, name: &str, signed: &[(Vec<u8>, String)]) -> String {
    let mut layers = Vec::new();
    for (payload, signature) in signed {
        let mut descriptor = crate::registry::put_blob(layout, SIMPLE_SIGNING, payload);
        descriptor["annotations"] =
            serde_json::json!({"dev.cosignproject.cosign/signature": signature});
        layers.push(descriptor);
    }
    let diff_ids: Vec<serde_json::Value> = layers.iter().map(|l| l["digest"].clone()).collect();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "",
        "created": "0001-01-01T00:00:00Z",
        "history": [{"created": "0001-01-01T00:00:00Z"}],
        "os": "",
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "config": {},
    }))
    .expect("config");
    let config =
        crate::registry::put_blob(layout, "application/vnd.oci.image.config.v1+json", &config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config,
        "layers": layers,
    }))
    .expect("manifest");
    crate::registry::put_tagged(
        layout,
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
        name,
    )
}

/// Signs the image `digest` of `repository` in `registry` as `cosign sign
/// --key` does: a payload vouching for `signed_digest` (the image's own,
/// or another to make a signature over other bytes), signed by `key`,
/// pushed by skopeo to `<repository>:sha256-<digest>.sig`. `dir` holds
/// the layout (created if missing).
pub fn sign_image(
    registry: &crate::registry::Registry,
    dir: &Path,
    repository: &str,
    digest: &str,
    signed_digest: &str,
    key: &KeyPair,
) {
    let layout = dir.join(format!("signature-{digest}"));
    let _ = fs::remove_dir_all(&layout);
    let payload = simple_signing_payload(&format!("{}/{repository}", registry.addr), signed_digest);
    let signature = key.sign(&payload);
    write_signature_manifest(&layout, "sig", &[(payload, signature)]);
    registry.push(
        &layout,
        "sig",
        repository,
        &format!("sha256-{digest}.sig"),
        &[],
    );
}
