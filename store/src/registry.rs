//! Images and OCI artifacts from a registry (SPEC 5.14), through the oras
//! project's `oci-client`.
//!
//! The manifest is fetched by the pinned digest and its bytes are hashed
//! here (whatever the registry claims); an index is resolved to this
//! node's platform and the chosen manifest is checked against the digest
//! the index gives. Each layer is streamed from the socket through its
//! hash and its decompressor into the unpacker, in order, never held whole
//! and never read twice (`pull()` would buffer whole layers). The config of
//! an image gives the run defaults ([`ImageConfig`]); an artifact's (what
//! `oras push` makes) gives none.
//!
//! Credentials are the node's, as the kubelet has them: a docker
//! `config.json` ([`RegistryAuths`]) read at each pull, so a rotated
//! Secret takes effect without a restart.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use futures::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::manifest::{
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, ImageIndexEntry,
    OCI_IMAGE_INDEX_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest, OciManifest,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use genswap_crds::Unpack;

use crate::trust::{
    FetchedSignature, REFERRER_ARTIFACT_TYPE, SIGNATURE_ANNOTATION, SIMPLE_SIGNING_MEDIA_TYPE,
};

/// Where the node's registry settings come from (`--registry-config`,
/// `--registry-ca`, `--insecure-registry`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistrySettings {
    /// A docker `config.json`: `auths` by registry host, each with `auth`
    /// (base64 of `user:password`) or `username` and `password`.
    pub config: Option<PathBuf>,
    /// PEM certificates trusted besides the system's roots.
    pub ca: Option<PathBuf>,
    /// `host:port`s reached over plain HTTP.
    pub insecure: Vec<String>,
}

/// The run defaults an image's config gives, as a container runtime uses
/// them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ImageConfig {
    /// `Entrypoint`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    /// `Cmd`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// `Env`, `NAME=value` each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// `WorkingDir`, a path inside the image.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub working_dir: String,
    /// `User`: recorded, never used (`process.user` decides).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub user: String,
}

/// The config blob's own shape (the OCI image spec's field names).
#[derive(Deserialize)]
struct ConfigFile {
    #[serde(default)]
    config: Option<ContainerConfig>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ContainerConfig {
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

/// The largest config blob read: configs are a few KiB.
const MAX_CONFIG_BYTES: u64 = 4 << 20;
const ACCEPTED_MANIFESTS: &[&str] = &[
    OCI_IMAGE_MEDIA_TYPE,
    OCI_IMAGE_INDEX_MEDIA_TYPE,
    IMAGE_MANIFEST_MEDIA_TYPE,
    IMAGE_MANIFEST_LIST_MEDIA_TYPE,
];

/// Why an image could not be had. [`RegistryError::is_build_fault`] tells
/// the image's own faults from the registry's.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry did not give what was asked: unreachable, refused,
    /// unauthorized, not found, or bytes that are not the pinned ones.
    #[error("registry {registry} did not give {reference}: {answered}")]
    Unavailable {
        registry: String,
        reference: String,
        answered: String,
    },
    /// The image is there, and cannot run here.
    #[error("image {reference} cannot be used: {problem}")]
    Unusable { reference: String, problem: String },
    /// The node's registry settings cannot be read.
    #[error("the registry settings cannot be used: {0}")]
    Settings(String),
}

impl RegistryError {
    /// Whether the image itself is at fault (no manifest for this node's
    /// platform, a layer that is not a tar): retrying cannot help.
    pub fn is_build_fault(&self) -> bool {
        matches!(self, RegistryError::Unusable { .. })
    }
}

/// The registry settings of one stager. Each pull gets a client of its
/// own: `oci-client` keeps the first credentials it was given for a
/// registry, and `--registry-config` is read at each pull so that a
/// rotated Secret takes effect.
pub(crate) struct Registries {
    settings: RegistrySettings,
    ca: Option<Vec<u8>>,
    connect_timeout: std::time::Duration,
}

impl std::fmt::Debug for Registries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registries")
            .field("settings", &self.settings)
            .finish()
    }
}

/// One layer to apply: its descriptor and format.
pub(crate) struct Layer {
    pub descriptor: OciDescriptor,
    pub format: Unpack,
    /// "layer 2 of 3 (sha256:…)", for messages.
    pub name: String,
}

/// What a manifest says to unpack and run.
pub(crate) struct Resolved {
    /// The client of this pull, with its credentials.
    pub client: Client,
    pub auth: RegistryAuth,
    pub reference: Reference,
    pub layers: Vec<Layer>,
    pub config: Option<ImageConfig>,
    /// The platform chosen from an index, `os/arch[/variant]`.
    pub platform: Option<String>,
}

impl Registries {
    pub(crate) fn new(
        settings: RegistrySettings,
        connect_timeout: std::time::Duration,
    ) -> Result<Self, RegistryError> {
        let ca = match &settings.ca {
            Some(path) => Some(fs::read(path).map_err(|e| {
                RegistryError::Settings(format!("--registry-ca {}: {e}", path.display()))
            })?),
            None => None,
        };
        Ok(Self {
            settings,
            ca,
            connect_timeout,
        })
    }

    /// A client for one pull.
    fn client(&self) -> Client {
        let mut config = ClientConfig {
            protocol: ClientProtocol::HttpsExcept(self.settings.insecure.clone()),
            platform_resolver: Some(Box::new(|entries| {
                node_platform_entry(entries).map(|e| e.digest.clone())
            })),
            connect_timeout: Some(self.connect_timeout),
            ..ClientConfig::default()
        };
        if let Some(data) = &self.ca {
            config.extra_root_certificates.push(Certificate {
                encoding: CertificateEncoding::Pem,
                data: data.clone(),
            });
        }
        Client::new(config)
    }

    /// The credentials `--registry-config` holds for `registry`.
    fn auth_for(&self, registry: &str) -> Result<RegistryAuth, RegistryError> {
        let Some(path) = &self.settings.config else {
            return Ok(RegistryAuth::Anonymous);
        };
        let auths = RegistryAuths::read(path)?;
        Ok(match auths.credentials(registry) {
            Some((user, password)) => RegistryAuth::Basic(user, password),
            None => RegistryAuth::Anonymous,
        })
    }

    /// Fetches and checks the manifest the reference is pinned by (and,
    /// for an index, this node's), and the image's config.
    pub(crate) async fn resolve(
        &self,
        image: &str,
        expected: &str,
    ) -> Result<Resolved, RegistryError> {
        let unusable = |problem: String| RegistryError::Unusable {
            reference: image.to_string(),
            problem,
        };
        let reference: Reference = image
            .parse()
            .map_err(|e| unusable(format!("not an image reference: {e}")))?;
        if reference.digest() != Some(format!("sha256:{expected}").as_str()) {
            return Err(unusable(format!(
                "its digest is not build.sha256 {expected}"
            )));
        }
        let registry = reference.resolve_registry().to_string();
        let unavailable = |answered: String| RegistryError::Unavailable {
            registry: registry.clone(),
            reference: image.to_string(),
            answered,
        };
        let auth = self.auth_for(&registry)?;
        let client = self.client();
        let (body, _) = client
            .pull_manifest_raw(&reference, &auth, ACCEPTED_MANIFESTS)
            .await
            .map_err(|e| unavailable(answer_of(&e)))?;
        check_bytes(&body, expected).map_err(&unavailable)?;
        let manifest: OciManifest = serde_json::from_slice(&body)
            .map_err(|e| unusable(format!("its manifest cannot be read: {e}")))?;
        let (manifest, platform, manifest_reference) = match manifest {
            OciManifest::Image(manifest) => (manifest, None, reference.clone()),
            OciManifest::ImageIndex(index) => {
                let entry = node_platform_entry(&index.manifests).ok_or_else(|| {
                    unusable(format!(
                        "its index has no manifest for this node's platform {} (it has {})",
                        node_platform(),
                        platforms_of(&index.manifests)
                    ))
                })?;
                let digest = entry.digest.clone();
                let hex = digest
                    .strip_prefix("sha256:")
                    .ok_or_else(|| {
                        unusable(format!("its index names {digest}, not a sha256 digest"))
                    })?
                    .to_string();
                let chosen = reference.clone_with_digest(digest.clone());
                let (body, _) = client
                    .pull_manifest_raw(&chosen, &auth, ACCEPTED_MANIFESTS)
                    .await
                    .map_err(|e| unavailable(answer_of(&e)))?;
                check_bytes(&body, &hex).map_err(&unavailable)?;
                let manifest: OciImageManifest = serde_json::from_slice(&body)
                    .map_err(|e| unusable(format!("its manifest {digest} cannot be read: {e}")))?;
                let platform = entry.platform.as_ref().map(|p| {
                    let mut text = format!("{}/{}", p.os, p.architecture);
                    if let Some(variant) = &p.variant {
                        text.push('/');
                        text.push_str(variant);
                    }
                    text
                });
                (manifest, platform, chosen)
            }
        };
        let total = manifest.layers.len();
        let mut layers = Vec::with_capacity(total);
        for (i, descriptor) in manifest.layers.iter().enumerate() {
            let format = layer_format(&descriptor.media_type).ok_or_else(|| {
                unusable(format!(
                    "layer {} of {total} ({}) is of media type {:?}, not a tar, tar+gzip or tar+zstd layer",
                    i + 1,
                    descriptor.digest,
                    descriptor.media_type
                ))
            })?;
            layers.push(Layer {
                descriptor: descriptor.clone(),
                format,
                name: format!("layer {} of {total} ({})", i + 1, descriptor.digest),
            });
        }
        if layers.is_empty() {
            return Err(unusable("its manifest has no layers".into()));
        }
        let config = if is_image_config(&manifest.config.media_type) {
            let bytes = blob(
                &client,
                &manifest_reference,
                &manifest.config,
                MAX_CONFIG_BYTES,
                &auth,
            )
            .await
            .map_err(&unavailable)?;
            let file: ConfigFile = serde_json::from_slice(&bytes)
                .map_err(|e| unusable(format!("its config cannot be read: {e}")))?;
            Some(file.config.map(ImageConfig::from).unwrap_or_default())
        } else {
            None
        };
        Ok(Resolved {
            client,
            auth,
            reference: manifest_reference,
            layers,
            config,
            platform,
        })
    }
}

/// The largest signature payload read: cosign's are a few hundred bytes.
const MAX_SIGNATURE_PAYLOAD_BYTES: u64 = 1 << 20;
/// The most signature manifests and layers looked at for one image.
const MAX_SIGNATURES: usize = 32;

impl Registries {
    /// The cosign signatures stored for the image pinned by `expected`:
    /// its referrers of cosign's signature type where the registry has
    /// the referrers API, and the layers of the `sha256-<hex>.sig`
    /// manifest beside it. Each payload is checked against its layer's
    /// digest. Returns them and where they were looked for; an error is
    /// a registry that did not answer (not a missing signature).
    pub(crate) async fn signatures(
        &self,
        image: &str,
        expected: &str,
    ) -> Result<(Vec<FetchedSignature>, String), String> {
        let reference: Reference = image
            .parse()
            .map_err(|e| format!("{image} is not an image reference: {e}"))?;
        let registry = reference.resolve_registry().to_string();
        let auth = self.auth_for(&registry).map_err(|e| e.to_string())?;
        let client = self.client();
        let subject = Reference::with_digest(
            reference.registry().to_string(),
            reference.repository().to_string(),
            format!("sha256:{expected}"),
        );
        let tag = format!("sha256-{expected}.sig");
        let sig_reference = Reference::with_tag(
            reference.registry().to_string(),
            reference.repository().to_string(),
            tag.clone(),
        );
        let looked = format!(
            "no referrer of type {REFERRER_ARTIFACT_TYPE} and no tag {}:{tag} in {registry}",
            reference.repository()
        );

        let mut manifests = Vec::new();
        client.store_auth_if_needed(&registry, &auth).await;
        // A registry without the referrers API (distribution 2.8) answers
        // 404, and oci-client then reads the referrers tag: nothing there
        // is an empty index. Any other failure leaves the cosign tag.
        match client
            .pull_referrers(&subject, Some(REFERRER_ARTIFACT_TYPE))
            .await
        {
            Ok(index) => {
                for entry in index.manifests.iter().take(MAX_SIGNATURES) {
                    manifests.push(subject.clone_with_digest(entry.digest.clone()));
                }
            }
            Err(e) => tracing::debug!(image, error = %e, "no referrers"),
        }
        manifests.push(sig_reference);

        let mut found = Vec::new();
        for manifest_reference in manifests {
            let body = match client
                .pull_manifest_raw(
                    &manifest_reference,
                    &auth,
                    &[OCI_IMAGE_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE],
                )
                .await
            {
                Ok((body, _)) => body,
                Err(e) if is_not_found(&e) => continue,
                Err(e) => {
                    return Err(format!("{} {}", manifest_reference.whole(), answer_of(&e)));
                }
            };
            let manifest: OciImageManifest = serde_json::from_slice(&body).map_err(|e| {
                format!(
                    "the signature manifest {} cannot be read: {e}",
                    manifest_reference.whole()
                )
            })?;
            for layer in manifest
                .layers
                .iter()
                .filter(|l| l.media_type == SIMPLE_SIGNING_MEDIA_TYPE)
                .take(MAX_SIGNATURES)
            {
                let payload = blob(
                    &client,
                    &manifest_reference,
                    layer,
                    MAX_SIGNATURE_PAYLOAD_BYTES,
                    &auth,
                )
                .await?;
                found.push(FetchedSignature {
                    layer_digest: layer.digest.clone(),
                    payload,
                    signature: layer
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(SIGNATURE_ANNOTATION))
                        .cloned(),
                    source: format!("{} ({})", manifest_reference.whole(), layer.digest),
                });
            }
        }
        Ok((found, looked))
    }
}

/// Whether the registry said that the manifest is not there.
fn is_not_found(error: &oci_client::errors::OciDistributionError) -> bool {
    use oci_client::errors::OciDistributionError as E;
    match error {
        E::RegistryError { envelope, .. } => envelope.errors.iter().any(|e| {
            matches!(
                serde_json::to_string(&e.code)
                    .unwrap_or_default()
                    .trim_matches('"'),
                "MANIFEST_UNKNOWN" | "NAME_UNKNOWN"
            )
        }),
        E::ServerError { code, .. } => *code == 404,
        E::ImageManifestNotFoundError(_) => true,
        _ => false,
    }
}

/// A small blob, whole, checked against its descriptor.
async fn blob(
    client: &Client,
    reference: &Reference,
    descriptor: &OciDescriptor,
    limit: u64,
    auth: &RegistryAuth,
) -> Result<Vec<u8>, String> {
    client
        .store_auth_if_needed(reference.resolve_registry(), auth)
        .await;
    let mut stream = client
        .pull_blob_stream(reference, descriptor)
        .await
        .map_err(|e| answer_of(&e))?;
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("the blob {} stopped: {e}", descriptor.digest))?;
        bytes.extend_from_slice(&chunk);
        if bytes.len() as u64 > limit {
            return Err(format!(
                "the blob {} is larger than {limit} bytes",
                descriptor.digest
            ));
        }
    }
    let hex = descriptor
        .digest
        .strip_prefix("sha256:")
        .unwrap_or_default();
    check_bytes(&bytes, hex)?;
    Ok(bytes)
}

impl Resolved {
    /// The stream of one layer's bytes, through this pull's client.
    pub(crate) async fn layer_stream(
        &self,
        layer: &Layer,
    ) -> Result<impl futures::Stream<Item = Result<bytes::Bytes, String>> + use<>, RegistryError>
    {
        let registry = self.reference.resolve_registry().to_string();
        self.client
            .store_auth_if_needed(&registry, &self.auth)
            .await;
        let stream = self
            .client
            .pull_blob_stream(&self.reference, &layer.descriptor)
            .await
            .map_err(|e| RegistryError::Unavailable {
                registry: registry.clone(),
                reference: self.reference.whole(),
                answered: answer_of(&e),
            })?;
        let name = layer.name.clone();
        Ok(stream.map(move |chunk| chunk.map_err(|e| format!("{name} stopped: {e}"))))
    }
}

/// What the registry answered, in words: the status and message it gave,
/// or why there was no answer.
pub(crate) fn answer_of(error: &oci_client::errors::OciDistributionError) -> String {
    use oci_client::errors::OciDistributionError as E;
    match error {
        E::RequestError(e) => {
            let mut text = if e.is_connect() {
                "could not be connected to".to_string()
            } else if e.is_timeout() {
                "did not answer in time".to_string()
            } else {
                "did not answer".to_string()
            };
            let mut source = std::error::Error::source(e);
            while let Some(cause) = source {
                text.push_str(": ");
                text.push_str(&cause.to_string());
                source = cause.source();
            }
            text
        }
        E::UnauthorizedError { url } => {
            format!(
                "answered 401 Unauthorized for {url} (check the credentials in --registry-config)"
            )
        }
        E::AuthenticationFailure(reason) => format!("refused the credentials: {}", reason.trim()),
        E::RegistryError { envelope, url } => {
            let errors: Vec<String> = envelope
                .errors
                .iter()
                .map(|e| {
                    // The distribution spec's spelling, and the status it
                    // comes with.
                    let code = serde_json::to_string(&e.code)
                        .unwrap_or_default()
                        .trim_matches('"')
                        .to_string();
                    let status = match code.as_str() {
                        "MANIFEST_UNKNOWN" | "BLOB_UNKNOWN" | "NAME_UNKNOWN" => "404 ",
                        "UNAUTHORIZED" => "401 ",
                        "DENIED" => "403 ",
                        "TOOMANYREQUESTS" => "429 ",
                        _ => "",
                    };
                    format!("{status}{code} ({})", e.message)
                })
                .collect();
            format!("answered {} for {url}", errors.join("; "))
        }
        E::ServerError { code, url, message } => {
            format!("answered {code} for {url}: {}", message.trim())
        }
        other => format!("answered what cannot be used: {other}"),
    }
}

/// Checks that `bytes` hash to `expected` (hex).
fn check_bytes(bytes: &[u8], expected: &str) -> Result<(), String> {
    let actual = hex::encode(Sha256::digest(bytes));
    if actual == expected {
        Ok(())
    } else {
        Err(format!(
            "served bytes whose sha256 is {actual}, not the pinned sha256:{expected}"
        ))
    }
}

impl From<ContainerConfig> for ImageConfig {
    fn from(config: ContainerConfig) -> Self {
        Self {
            entrypoint: config.entrypoint.unwrap_or_default(),
            cmd: config.cmd.unwrap_or_default(),
            env: config.env.unwrap_or_default(),
            working_dir: config.working_dir.unwrap_or_default(),
            user: config.user.unwrap_or_default(),
        }
    }
}

fn is_image_config(media_type: &str) -> bool {
    matches!(
        media_type,
        oci_client::manifest::IMAGE_CONFIG_MEDIA_TYPE
            | oci_client::manifest::IMAGE_DOCKER_CONFIG_MEDIA_TYPE
    )
}

/// The archive format a layer's media type names: OCI's and Docker's tar
/// layers, plain, gzip or zstd (non-distributable ones too).
pub fn layer_format(media_type: &str) -> Option<Unpack> {
    match media_type {
        "application/vnd.oci.image.layer.v1.tar"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar"
        | "application/vnd.docker.image.rootfs.diff.tar"
        | "application/x-tar" => Some(Unpack::Tar),
        "application/vnd.oci.image.layer.v1.tar+gzip"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
        | "application/vnd.docker.image.rootfs.diff.tar.gzip"
        | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Some(Unpack::TarGzip),
        "application/vnd.oci.image.layer.v1.tar+zstd"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => Some(Unpack::TarZstd),
        _ => None,
    }
}

/// This node's platform as OCI names it: `linux/<GOARCH>[/<variant>]`.
pub fn node_platform() -> String {
    let (arch, variant) = oci_arch();
    match variant {
        Some(variant) => format!("linux/{arch}/{variant}"),
        None => format!("linux/{arch}"),
    }
}

fn oci_arch() -> (&'static str, Option<&'static str>) {
    match std::env::consts::ARCH {
        "x86_64" => ("amd64", None),
        "aarch64" => ("arm64", Some("v8")),
        "arm" => ("arm", Some("v7")),
        "x86" => ("386", None),
        "powerpc64" => ("ppc64le", None),
        "s390x" => ("s390x", None),
        "riscv64" => ("riscv64", None),
        other => (other, None),
    }
}

/// The index entry for this node: linux, its architecture, and its variant
/// where the entry names one (an arm64 entry without one is v8).
fn node_platform_entry(entries: &[ImageIndexEntry]) -> Option<&ImageIndexEntry> {
    let (arch, variant) = oci_arch();
    entries.iter().find(|entry| {
        entry.platform.as_ref().is_some_and(|p| {
            p.os.to_string() == "linux"
                && p.architecture.to_string() == arch
                && match (&p.variant, variant) {
                    (None, _) => true,
                    (Some(theirs), Some(ours)) => theirs == ours,
                    (Some(_), None) => false,
                }
        })
    })
}

fn platforms_of(entries: &[ImageIndexEntry]) -> String {
    let names: Vec<String> = entries
        .iter()
        .map(|e| match &e.platform {
            Some(p) => match &p.variant {
                Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                None => format!("{}/{}", p.os, p.architecture),
            },
            None => "no platform".into(),
        })
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// A docker `config.json`'s credentials, as a `kubernetes.io/dockerconfigjson`
/// Secret holds them.
#[derive(Deserialize, Default, Debug)]
pub struct RegistryAuths {
    #[serde(default)]
    auths: HashMap<String, AuthEntry>,
}

#[derive(Deserialize, Debug)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

impl RegistryAuths {
    /// Reads `path`.
    pub fn read(path: &Path) -> Result<RegistryAuths, RegistryError> {
        let text = fs::read_to_string(path).map_err(|e| {
            RegistryError::Settings(format!("--registry-config {}: {e}", path.display()))
        })?;
        Self::parse(&text).map_err(|e| {
            RegistryError::Settings(format!("--registry-config {}: {e}", path.display()))
        })
    }

    /// Parses a config's text.
    pub fn parse(text: &str) -> Result<RegistryAuths, String> {
        serde_json::from_str(text).map_err(|e| format!("not a docker config.json: {e}"))
    }

    /// The user and password for `registry` (`host[:port]`), matching keys
    /// written as a host or as a URL (`https://host/v1/`).
    pub fn credentials(&self, registry: &str) -> Option<(String, String)> {
        let entry = self
            .auths
            .iter()
            .find(|(key, _)| registry_of_key(key) == registry)
            .map(|(_, entry)| entry)?;
        if let (Some(user), Some(password)) = (&entry.username, &entry.password) {
            return Some((user.clone(), password.clone()));
        }
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(entry.auth.as_deref()?.trim())
            .ok()?;
        let text = String::from_utf8(decoded).ok()?;
        let (user, password) = text.split_once(':')?;
        Some((user.to_string(), password.to_string()))
    }
}

fn registry_of_key(key: &str) -> &str {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    key.split('/').next().unwrap_or(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_found_by_host_whatever_the_key_looks_like() {
        let auths = RegistryAuths::parse(
            r#"{"auths": {
                "https://127.0.0.1:5000/v1/": {"auth": "dXNlcjpwYXNz"},
                "127.0.0.1:6000": {"username": "u2", "password": "p:2"}
            }}"#,
        )
        .expect("parse");
        assert_eq!(
            auths.credentials("127.0.0.1:5000"),
            Some(("user".into(), "pass".into()))
        );
        assert_eq!(
            auths.credentials("127.0.0.1:6000"),
            Some(("u2".into(), "p:2".into()))
        );
        assert_eq!(auths.credentials("127.0.0.1:7000"), None);
        assert!(RegistryAuths::parse("not json").is_err());
    }

    #[test]
    fn layer_media_types_name_their_format() {
        assert_eq!(
            layer_format("application/vnd.oci.image.layer.v1.tar+zstd"),
            Some(Unpack::TarZstd)
        );
        assert_eq!(
            layer_format("application/vnd.docker.image.rootfs.diff.tar.gzip"),
            Some(Unpack::TarGzip)
        );
        assert_eq!(
            layer_format("application/vnd.oci.image.layer.v1.tar"),
            Some(Unpack::Tar)
        );
        assert_eq!(
            layer_format("application/vnd.wasm.content.layer.v1+wasm"),
            None
        );
    }
}
