//! A real OCI registry on loopback for the image tests, and images pushed
//! to it by real tools.
//!
//! The registry is Debian's `docker-registry` (CNCF distribution 2.8), on
//! `127.0.0.1` with TLS from a CA the test makes (openssl) and htpasswd
//! basic auth, or plain and anonymous. Images are built as OCI layouts by
//! umoci (layers and their whiteouts diffed from a rootfs, as a build
//! tool makes them) or written by the test where no tool makes what it
//! needs (an index of two platforms, an artifact), and pushed by skopeo:
//! never by the code under test. Where the tools are not installed a test
//! prints [`SKIP_LINE`] and checks nothing; `GENSWAP_REGISTRY=required`
//! (CI sets it, after `.ci/install-registry`) makes that a failure.
//!
//! The registry is stopped by PID when the [`Registry`] drops, and its
//! storage and certificates live in a temp dir removed with it.

use std::fs;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::ChildGuard;

/// What a test prints when there is no registry to run.
pub const SKIP_LINE: &str = "SKIP: no OCI registry here";

const TOOLS: [(&str, &str); 5] = [
    ("/usr/bin/docker-registry", "docker-registry"),
    ("/usr/bin/skopeo", "skopeo"),
    ("/usr/bin/umoci", "umoci"),
    ("/usr/bin/htpasswd", "apache2-utils"),
    ("/usr/bin/openssl", "openssl"),
];

/// The user and password of a registry with auth.
pub const USER: &str = "genswap";
/// Its password.
pub const PASSWORD: &str = "s3cret-pull";

/// How a registry is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// TLS from the test's CA, and htpasswd basic auth.
    TlsWithAuth,
    /// Plain HTTP, anonymous.
    Plain,
}

/// A registry the test started.
pub struct Registry {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// The CA that signed its certificate (TLS only).
    pub ca: PathBuf,
    pub access: Access,
    dir: tempfile::TempDir,
    guard: Option<ChildGuard>,
}

/// Whether the tools are here; `None` after the skip line when they are
/// not and not required.
pub fn tools_installed() -> bool {
    let missing: Vec<&str> = TOOLS
        .iter()
        .filter(|(path, _)| !Path::new(path).exists())
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("GENSWAP_REGISTRY").as_deref() == Ok("required") {
        panic!(
            "the registry tests need {}: run .ci/install-registry",
            missing.join(", ")
        );
    }
    eprintln!(
        "{SKIP_LINE}: apt-get install {} (or run .ci/install-registry)",
        missing.join(" ")
    );
    false
}

impl Registry {
    /// Starts a registry, or `None` (after the skip line) when the tools
    /// are missing and not required.
    pub fn start(access: Access) -> Option<Registry> {
        if !tools_installed() {
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("genswap-registry-")
            .tempdir()
            .expect("temp dir");
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let ca = dir.path().join("ca.crt");
        if access == Access::TlsWithAuth {
            make_certificates(dir.path());
            let output = Command::new("htpasswd")
                .args(["-Bbn", USER, PASSWORD])
                .output()
                .expect("htpasswd");
            assert!(output.status.success(), "htpasswd failed");
            fs::write(dir.path().join("htpasswd"), output.stdout).expect("htpasswd file");
        }
        let d = dir.path().display();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {d}/data\nhttp:\n  addr: {addr}\n"
        );
        if access == Access::TlsWithAuth {
            config.push_str(&format!(
                "  tls:\n    certificate: {d}/server.crt\n    key: {d}/server.key\nauth:\n  htpasswd:\n    realm: genswap-test\n    path: {d}/htpasswd\n"
            ));
        }
        fs::write(dir.path().join("config.yml"), config).expect("registry config");
        let mut registry = Registry {
            addr,
            ca,
            access,
            dir,
            guard: None,
        };
        registry.run();
        Some(registry)
    }

    /// Starts (again) the registry process on the same port and storage.
    pub fn run(&mut self) {
        let mut command = Command::new("docker-registry");
        command.arg("serve").arg(self.dir.path().join("config.yml"));
        let mut guard = ChildGuard::spawn(
            "docker-registry",
            command,
            self.dir.path().join("registry.log"),
        );
        let addr: SocketAddr = self.addr.parse().expect("addr");
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            guard.assert_running();
            assert!(
                Instant::now() < deadline,
                "the registry did not listen on {addr}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.guard = Some(guard);
    }

    /// Stops the registry process (its storage stays).
    pub fn stop(&mut self) {
        if let Some(mut guard) = self.guard.take() {
            guard.stop();
        }
    }

    /// The registry's PID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.guard.as_ref().map(ChildGuard::pid)
    }

    /// Kills the registry at once (SIGKILL), as a crash would, and waits
    /// for it: connections in flight are cut. Its storage stays.
    pub fn kill(&mut self) {
        if let Some(mut guard) = self.guard.take() {
            guard.signal(nix::sys::signal::Signal::SIGKILL);
            guard.stop();
        }
    }

    /// Pushes the image `reference` of the OCI layout `layout` to
    /// `<addr>/<repository>:<tag>` with skopeo, and returns the digest the
    /// registry holds it under (hex). `extra` are more skopeo flags
    /// (`--all` for an index, `--dest-compress-format zstd`).
    pub fn push(
        &self,
        layout: &Path,
        reference: &str,
        repository: &str,
        tag: &str,
        extra: &[&str],
    ) -> String {
        let digest_file = self
            .dir
            .path()
            .join(format!("digest-{repository}-{tag}").replace('/', "_"));
        let mut command = Command::new("skopeo");
        command
            .args(["copy", "-q", "--digestfile"])
            .arg(&digest_file);
        match self.access {
            Access::TlsWithAuth => {
                let certs = self.dir.path().join("skopeo-certs");
                fs::create_dir_all(&certs).expect("certs dir");
                fs::copy(&self.ca, certs.join("ca.crt")).expect("ca");
                command
                    .arg("--dest-cert-dir")
                    .arg(&certs)
                    .arg("--dest-creds")
                    .arg(format!("{USER}:{PASSWORD}"));
            }
            Access::Plain => {
                command.arg("--dest-tls-verify=false");
            }
        }
        command.args(extra);
        command
            .arg(format!("oci:{}:{reference}", layout.display()))
            .arg(format!("docker://{}/{repository}:{tag}", self.addr));
        let output = command.output().expect("skopeo");
        assert!(
            output.status.success(),
            "skopeo copy failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let digest = fs::read_to_string(&digest_file).expect("digest file");
        digest
            .trim()
            .strip_prefix("sha256:")
            .expect("a sha256 digest")
            .to_string()
    }

    /// A docker `config.json` with `user:password` for this registry, at
    /// `path`.
    pub fn write_docker_config(&self, path: &Path, user: &str, password: &str) {
        let auth = base64(format!("{user}:{password}").as_bytes());
        fs::write(
            path,
            format!(
                "{{\"auths\": {{\"{}\": {{\"auth\": \"{auth}\"}}}}}}",
                self.addr
            ),
        )
        .expect("docker config");
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A CA, and a server certificate for 127.0.0.1 it signed.
fn make_certificates(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=genswap test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n",
    )
    .expect("extensions");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(TABLE[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// An OCI image layout built with umoci: layers diffed from a rootfs the
/// test changes between them, as a build tool makes them.
pub struct Umoci {
    /// The layout directory.
    pub layout: PathBuf,
    bundle: PathBuf,
    tag: String,
}

fn umoci(args: &[&str]) {
    let output = Command::new("umoci").args(args).output().expect("umoci");
    assert!(
        output.status.success(),
        "umoci {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

impl Umoci {
    /// A new layout in `dir` with an empty image `tag`, unpacked to a bundle
    /// whose rootfs the test fills.
    pub fn new(dir: &Path, tag: &str) -> Umoci {
        let layout = dir.join("layout");
        let bundle = dir.join("bundle");
        let l = layout.display().to_string();
        umoci(&["init", "--layout", &l]);
        umoci(&["new", "--image", &format!("{l}:{tag}")]);
        umoci(&[
            "unpack",
            "--image",
            &format!("{l}:{tag}"),
            &bundle.display().to_string(),
        ]);
        Umoci {
            layout,
            bundle,
            tag: tag.to_string(),
        }
    }

    /// The bundle's rootfs: what the next layer is diffed from.
    pub fn rootfs(&self) -> PathBuf {
        self.bundle.join("rootfs")
    }

    /// A new layer of what changed in the rootfs since the last one.
    pub fn layer(&self) {
        umoci(&[
            "repack",
            "--refresh-bundle",
            "--image",
            &format!("{}:{}", self.layout.display(), self.tag),
            &self.bundle.display().to_string(),
        ]);
    }

    /// Appends an uncompressed tar layer the test wrote (umoci makes no
    /// opaque whiteouts of its own).
    pub fn raw_layer(&self, tar: &Path) {
        umoci(&[
            "raw",
            "add-layer",
            "--image",
            &format!("{}:{}", self.layout.display(), self.tag),
            &tar.display().to_string(),
        ]);
    }

    /// Sets the image config: `--config.entrypoint` and the like.
    pub fn config(&self, args: &[&str]) {
        let image = format!("{}:{}", self.layout.display(), self.tag);
        let mut all = vec!["config", "--image", &image];
        all.extend_from_slice(args);
        umoci(&all);
    }

    /// The tag in the layout.
    pub fn tag(&self) -> &str {
        &self.tag
    }
}

/// One blob of a layout the test writes: its media type and bytes.
pub struct Blob {
    pub media_type: String,
    pub bytes: Vec<u8>,
}

impl Blob {
    pub fn new(media_type: &str, bytes: Vec<u8>) -> Blob {
        Blob {
            media_type: media_type.to_string(),
            bytes,
        }
    }
}

/// Writes `bytes` into the layout's blobs; returns its descriptor JSON.
pub(crate) fn put_blob(layout: &Path, media_type: &str, bytes: &[u8]) -> serde_json::Value {
    use sha2::Digest;
    let hex = hex::encode(sha2::Sha256::digest(bytes));
    let dir = layout.join("blobs/sha256");
    fs::create_dir_all(&dir).expect("blobs dir");
    fs::write(dir.join(&hex), bytes).expect("blob");
    serde_json::json!({"mediaType": media_type, "digest": format!("sha256:{hex}"), "size": bytes.len()})
}

/// Adds `descriptor` to the layout's `index.json` under `name`.
fn tag_in_layout(layout: &Path, mut descriptor: serde_json::Value, name: &str) {
    let index_path = layout.join("index.json");
    let mut index: serde_json::Value = fs::read(&index_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| serde_json::json!({"schemaVersion": 2, "manifests": []}));
    descriptor["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": name});
    index["manifests"]
        .as_array_mut()
        .expect("manifests")
        .push(descriptor);
    fs::write(&index_path, serde_json::to_vec(&index).expect("index")).expect("index.json");
    fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .expect("oci-layout");
}

/// Writes an OCI image manifest (an artifact when `artifact_type` is set)
/// of `config` and `layers` into the layout at `layout`, tagged `name`
/// there, for layouts no tool here makes (zstd layers, artifacts as oras
/// pushes them). Returns the manifest's digest (hex).
pub fn write_manifest(
    layout: &Path,
    name: &str,
    config: Blob,
    layers: Vec<Blob>,
    artifact_type: Option<&str>,
) -> String {
    let config = put_blob(layout, &config.media_type, &config.bytes);
    let layers: Vec<serde_json::Value> = layers
        .iter()
        .map(|blob| put_blob(layout, &blob.media_type, &blob.bytes))
        .collect();
    let mut manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config,
        "layers": layers,
    });
    if let Some(kind) = artifact_type {
        manifest["artifactType"] = serde_json::json!(kind);
    }
    let bytes = serde_json::to_vec(&manifest).expect("manifest");
    put_tagged(
        layout,
        "application/vnd.oci.image.manifest.v1+json",
        &bytes,
        name,
    )
}

/// Puts a manifest or index blob into the layout and tags it `name`;
/// returns its digest (hex).
pub(crate) fn put_tagged(layout: &Path, media_type: &str, bytes: &[u8], name: &str) -> String {
    let descriptor = put_blob(layout, media_type, bytes);
    let digest = descriptor["digest"]
        .as_str()
        .expect("digest")
        .trim_start_matches("sha256:")
        .to_string();
    tag_in_layout(layout, descriptor, name);
    digest
}

/// Writes an image index of the layout's manifests `entries` (the name
/// each is tagged with in the layout, and its `os/arch[/variant]`), tagged
/// `name`. Returns the index's digest (hex).
pub fn write_index(layout: &Path, name: &str, entries: &[(&str, &str)]) -> String {
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).expect("index.json"))
            .expect("index");
    let manifests: Vec<serde_json::Value> = entries
        .iter()
        .map(|(tag, platform)| {
            let found = index["manifests"]
                .as_array()
                .expect("manifests")
                .iter()
                .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == *tag)
                .unwrap_or_else(|| panic!("no {tag} in the layout"))
                .clone();
            let mut parts = platform.split('/');
            let mut entry = serde_json::json!({
                "mediaType": found["mediaType"],
                "digest": found["digest"],
                "size": found["size"],
                "platform": {"os": parts.next(), "architecture": parts.next()},
            });
            if let Some(variant) = parts.next() {
                entry["platform"]["variant"] = serde_json::json!(variant);
            }
            entry
        })
        .collect();
    let bytes = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests,
    }))
    .expect("index");
    put_tagged(
        layout,
        "application/vnd.oci.image.index.v1+json",
        &bytes,
        name,
    )
}
