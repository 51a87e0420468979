//! The vocabulary and the per-instance settings shared by both resources.
//!
//! A SwapAttempt carries a copy of these settings as they were when it was
//! issued, so both specs embed the same types.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Why an attempt exists.
#[derive(
    Serialize,
    Deserialize,
    JsonSchema,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
)]
#[serde(rename_all = "camelCase")]
pub enum Cause {
    /// A new build was asked for.
    #[default]
    Release,
    /// The node runs no generation of the instance yet.
    Install,
    /// `spec.retry` changed and re-armed a held-down build.
    Retry,
    /// Only `spec.restartID` changed.
    Restart,
    /// Only `spec.configRev` changed.
    Config,
    /// `rollout.onFailure: restore` takes the node back to the last build
    /// every node served, after the desired one failed there or failed its
    /// analysis.
    Rollback,
}

impl Cause {
    /// The wire spelling, for messages and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Release => "release",
            Cause::Install => "install",
            Cause::Retry => "retry",
            Cause::Restart => "restart",
            Cause::Config => "config",
            Cause::Rollback => "rollback",
        }
    }
}

/// How an instance moves to a new generation.
#[derive(
    Serialize,
    Deserialize,
    JsonSchema,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    /// The successor starts beside the incumbent, is health-checked, and takes over.
    #[default]
    Overlap,
    /// The incumbent stops, then the successor starts: a gap in service.
    Hold,
}

impl Mode {
    /// The wire spelling, for messages and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Overlap => "overlap",
            Mode::Hold => "hold",
        }
    }
}

/// What an artifact demands of the way it is started.
#[derive(
    Serialize,
    Deserialize,
    JsonSchema,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
)]
pub enum Demand {
    /// No demand: the spec's mode applies.
    #[default]
    #[serde(rename = "")]
    None,
    /// The artifact may only ever be started in hold mode.
    #[serde(rename = "hold")]
    Hold,
}

/// What kind of process an instance is.
#[derive(
    Serialize,
    Deserialize,
    JsonSchema,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
)]
#[serde(rename_all = "camelCase")]
pub enum InstanceKind {
    /// A server: it may overlap.
    #[default]
    Instance,
    /// Always stop-then-start; may be a one-shot that exits 0.
    Worker,
}

/// How an attempt ended.
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    /// The successor serves (overlap: switched; hold: started healthy).
    Done,
    /// Overlap: the successor failed health or settle; the incumbent still serves.
    Failed,
    /// Superseded, refused by a gate, or cancelled; never the build's fault.
    Abandoned,
    /// Hold: the new build failed after the old one stopped; nothing serves.
    Down,
}

impl Outcome {
    /// The wire spelling, for messages and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed => "failed",
            Outcome::Abandoned => "abandoned",
            Outcome::Down => "down",
        }
    }

    /// `failed` and `down` are the build's fault and hold the build down.
    pub fn is_build_failure(self) -> bool {
        matches!(self, Outcome::Failed | Outcome::Down)
    }
}

/// Where each generation of an instance listens.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum SocketLayout {
    /// Each generation binds its own socket; generations can coexist.
    #[default]
    PerGeneration,
    /// The process binds one fixed address; an overlap runs as a hold.
    Fixed,
}

/// The signal that asks a generation to stop.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StopSignal {
    #[default]
    #[serde(rename = "SIGTERM")]
    Term,
    #[serde(rename = "SIGINT")]
    Int,
    #[serde(rename = "SIGQUIT")]
    Quit,
    #[serde(rename = "SIGHUP")]
    Hup,
    #[serde(rename = "SIGUSR1")]
    Usr1,
    #[serde(rename = "SIGUSR2")]
    Usr2,
}

/// The build an instance runs: an immutable artifact pinned by its digest,
/// a single executable file or an archive of a tree.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.entrypoint) ? (has(self.artifact.unpack) || has(self.artifact.image)) : !has(self.artifact.unpack)").message("build.entrypoint names what to run in a tree: required for an archive (artifact.unpack), optional for an image, not allowed for a single file"))]
#[x_kube(validation = Rule::new("!has(self.artifact.image) || self.artifact.image.endsWith('@sha256:' + self.sha256)").message("build.sha256 must be the digest the image reference is pinned by"))]
#[x_kube(validation = Rule::new("!has(self.signature) || has(self.signedBy)").message("build.signature needs build.signedBy: the key it is checked with"))]
#[x_kube(validation = Rule::new("!has(self.signature) || !has(self.artifact.image)").message("build.signature is for files and archives: an image's signatures are in its registry"))]
pub struct BuildSpec {
    /// The build's name, reported in status and to the process as GENSWAP_BUILD.
    #[schemars(length(max = 128))]
    #[x_kube(validation = Rule::new("self.size() > 0").message("build.id must be 1 to 128 characters"))]
    pub id: String,
    /// Where the artifact comes from.
    pub artifact: Artifact,
    /// The sha256 of the artifact as its source gives it, 64 lowercase hex
    /// characters: of the file; of an archive as stored or downloaded
    /// (compressed); of an image, the manifest (or index) digest its
    /// reference is pinned by.
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.matches('^[0-9a-f]{64}$')").message("build.sha256 must be 64 lowercase hex characters"))]
    pub sha256: String,
    /// What to run in a tree build: a path relative to the tree's root,
    /// without `..`; a symlink on the way is followed as inside the tree.
    /// Required for an archive; for an image, its config's `Entrypoint`
    /// (else `Cmd`) by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.size() > 0 && !self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')").message("build.entrypoint must be a relative path inside the tree, without '..'"))]
    pub entrypoint: Option<String>,
    /// The name of the node's trust key the build must be signed by (a
    /// file `<name>.pub` or `<name>.pem` in the agent's `--trust-keys`):
    /// an image by cosign's keyed signature, a file by a detached
    /// `cosign sign-blob` signature (`signature`, else `<url>.sig` or
    /// `<path>.sig`). A build whose signature is missing, by another key
    /// or over other bytes fails before anything of it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9][A-Za-z0-9._-]*$')").message("build.signedBy must name a trust key: letters, digits, '.', '_' and '-', starting with a letter or digit"))]
    pub signed_by: Option<String>,
    /// A single file's detached signature as `cosign sign-blob` prints it
    /// (base64), instead of the one fetched beside the artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9+/=\\\\s]+$')").message("build.signature must be base64, as cosign sign-blob prints it"))]
    pub signature: Option<String>,
}

/// The format of an archive build: the tree it holds is unpacked into the
/// agent's store and run from there.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unpack {
    /// An uncompressed tar.
    #[serde(rename = "tar")]
    Tar,
    /// A gzip-compressed tar.
    #[serde(rename = "tar+gzip")]
    TarGzip,
    /// A zstd-compressed tar.
    #[serde(rename = "tar+zstd")]
    TarZstd,
}

/// Where an artifact comes from: exactly one of `path`, `url` and `image`.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.path) ? 1 : 0) + (has(self.url) ? 1 : 0) + (has(self.image) ? 1 : 0) == 1").message("build.artifact needs exactly one of path, url and image"))]
#[x_kube(validation = Rule::new("!has(self.image) || !has(self.unpack)").message("build.artifact.unpack is for path and url archives: an image's layers carry their own format"))]
pub struct Artifact {
    /// An absolute path on the node, under the agent's staging root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("build.artifact.path must be an absolute path"))]
    pub path: Option<String>,
    /// An http or https URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.matches('^https?://[^/]+')").message("build.artifact.url must be an http or https URL"))]
    pub url: Option<String>,
    /// An OCI image or artifact in a registry, pinned by digest:
    /// `registry/repository[:tag]@sha256:<hex>` (a tag is allowed and
    /// ignored; a tag alone is refused). Its layers are unpacked in order
    /// into a tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.matches('^[^@\\\\s]+@sha256:[0-9a-f]{64}$')").message("build.artifact.image must be pinned by digest: registry/repository[:tag]@sha256:<64 lowercase hex>"))]
    pub image: Option<String>,
    /// The artifact is an archive in this format, unpacked into a tree;
    /// absent, it is a single executable file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpack: Option<Unpack>,
}

/// One environment variable of the process.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
pub struct EnvVar {
    #[schemars(length(max = 256))]
    pub name: String,
    #[serde(default)]
    #[schemars(length(max = 32768))]
    pub value: String,
}

/// How the process is started.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq, Eq)]
#[x_kube(validation = Rule::new("!has(self.root) || self.root != 'build' || !has(self.filesystem) || self.filesystem != 'Host'").message("process.root: build needs the Protected filesystem: the build's tree is mounted as / in a mount namespace of the instance's own"))]
#[serde(rename_all = "camelCase")]
pub struct ProcessSpec {
    /// Arguments after the executable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), inner(length(max = 4096)))]
    pub args: Vec<String>,
    /// Environment; GENSWAP_SOCKET, GENSWAP_GENERATION and GENSWAP_BUILD are added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub env: Vec<EnvVar>,
    /// Working directory, absolute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("process.workingDir must be an absolute path"))]
    pub working_dir: Option<String>,
    /// Numeric uid. 0 is refused unless the agent allows root instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 4294967294").message("process.user must be a non-negative numeric uid"))]
    pub user: Option<i64>,
    /// Numeric gid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 4294967294").message("process.group must be a non-negative numeric gid"))]
    pub group: Option<i64>,
    /// For a program that daemonizes (systemd's `Type=forking` with
    /// `PIDFile=`): once the started process exits 0, the generation is the
    /// process whose pid this file names, which must be in its cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("process.pidFile must be an absolute path"))]
    pub pid_file: Option<String>,
    /// Resource limits; systemd's defaults for each one left out, never the
    /// agent's own.
    #[serde(default, skip_serializing_if = "crate::LimitsSpec::is_empty")]
    pub limits: crate::LimitsSpec,
    /// Capabilities kept; every other one is dropped from the bounding set.
    #[serde(default, skip_serializing_if = "crate::CapabilitiesSpec::is_empty")]
    pub capabilities: crate::CapabilitiesSpec,
    /// The system calls allowed: `RuntimeDefault` (the default) or
    /// `Unconfined`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seccomp: Option<crate::SeccompProfile>,
    /// The file mode creation mask, octal (systemd's `UMask=`; default
    /// `0022`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4))]
    #[x_kube(validation = Rule::new("self.matches('^0?[0-7]{3}$')").message("process.umask must be an octal mask such as 0022"))]
    pub umask: Option<String>,
    /// What of the node's filesystem the instance sees: `Protected` (the
    /// default) or `Host`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<crate::FilesystemProfile>,
    /// Absolute paths the instance may write under the `Protected`
    /// filesystem (systemd's `ReadWritePaths=`); each must exist on the
    /// node. Not under `/proc`, `/sys` or `/dev`, nor under the hidden
    /// `/home`, `/root` and `/run/user`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 1024)))]
    #[x_kube(validation = Rule::new("self.all(p, p.startsWith('/') && p != '/' && !p.matches('(^|/)[.][.]?(/|$)') && !p.matches('^/(proc|sys|dev|home|root|run/user)(/|$)'))").message("process.writablePaths must be absolute paths other than /, without . or .., not under /proc, /sys, /dev, /home, /root or /run/user"))]
    pub writable_paths: Vec<String>,
    /// Directories the agent makes and keeps for the instance.
    #[serde(default, skip_serializing_if = "crate::DirectoriesSpec::is_empty")]
    pub directories: crate::DirectoriesSpec,
    /// `/` of the instance: `host` (the default) or `build`, the build's
    /// own tree (an image or an archive build).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<crate::RootProfile>,
}

/// The settle window after a successor is healthy.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SettleSpec {
    /// How long a canary is watched; an exit inside it fails the attempt.
    #[serde(default = "ten")]
    #[x_kube(validation = Rule::new("self >= 0").message("settle.seconds must not be negative"))]
    pub seconds: i32,
    /// Watch every attempt, not only canaries.
    #[serde(default)]
    pub all_nodes: bool,
}

impl Default for SettleSpec {
    fn default() -> Self {
        Self {
            seconds: ten(),
            all_nodes: false,
        }
    }
}

/// How a generation is stopped.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StopSpec {
    #[serde(default)]
    pub signal: StopSignal,
    /// After this the generation's cgroup is killed.
    #[serde(default = "thirty")]
    #[x_kube(validation = Rule::new("self > 0").message("stop.timeoutSeconds must be greater than 0"))]
    pub timeout_seconds: i32,
}

impl Default for StopSpec {
    fn default() -> Self {
        Self {
            signal: StopSignal::default(),
            timeout_seconds: thirty(),
        }
    }
}

/// The generation's cgroup tier.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ResourcesSpec {
    /// memory.max, a Kubernetes quantity of bytes such as `512Mi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxLength" = 64))]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && sign(quantity(string(self))) > 0").message("resources.memoryMax must be a positive quantity such as 512Mi"))]
    pub memory_max: Option<Quantity>,
    /// cpu.max in cores, a Kubernetes quantity such as `500m` or `2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxLength" = 64))]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && sign(quantity(string(self))) > 0").message("resources.cpuMax must be a positive quantity of cores such as 500m"))]
    pub cpu_max: Option<Quantity>,
    /// pids.max.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("resources.pidsMax must be at least 1"))]
    pub pids_max: Option<i64>,
}

impl ResourcesSpec {
    /// Whether any limit is asked for.
    pub fn is_empty(&self) -> bool {
        self.memory_max.is_none() && self.cpu_max.is_none() && self.pids_max.is_none()
    }
}

/// Where generations listen.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SocketSpec {
    #[serde(default)]
    pub layout: SocketLayout,
}

/// A listening socket the agent binds once, holds for the instance's life
/// and hands to every generation by systemd's socket activation (SPEC 6.2):
/// exactly one of `tcp`, `udp` and `unix`.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.tcp) ? 1 : 0) + (has(self.udp) ? 1 : 0) + (has(self.unix) ? 1 : 0) == 1").message("a listener needs exactly one of tcp, udp and unix"))]
pub struct ListenerSpec {
    /// Its name in `LISTEN_FDNAMES`, unique among the listeners.
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$')").message("a listener's name must be 1 to 63 of a-z, 0-9 and '-', starting and ending alphanumeric"))]
    pub name: String,
    /// `<IPv4>:<port>` or `[<IPv6>]:<port>`, such as `0.0.0.0:53` or
    /// `[::1]:8080`; port 1 to 65535. The agent binds it as root, so a
    /// privileged port serves an unprivileged instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new(LISTENER_TCP_RULE).message("listener tcp must be <IPv4>:<port> or [<IPv6>]:<port> with a port from 1 to 65535"))]
    pub tcp: Option<String>,
    /// A UDP socket's address, written as `tcp` is (`0.0.0.0:53`): its
    /// datagrams reach the serving generation, and wait in the socket's
    /// buffer while none runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new(LISTENER_TCP_RULE).message("listener udp must be <IPv4>:<port> or [<IPv6>]:<port> with a port from 1 to 65535"))]
    pub udp: Option<String>,
    /// An absolute path for a unix stream socket, at most 107 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 107))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("listener unix must be an absolute path"))]
    pub unix: Option<String>,
    /// The listen(2) backlog: connections that wait while no generation
    /// accepts (a hold's gap).
    #[serde(default = "default_backlog")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("listener backlog must be from 1 to 65535"))]
    pub backlog: i32,
}

/// An IP literal (dotted IPv4, or IPv6 in brackets) and a port of 1 to
/// 65535; the agent parses the address itself and refuses what this lets
/// through but no address is. `\\[` is the regex's `\[` in a CEL string.
const LISTENER_TCP_RULE: &str = r"self.matches('^([0-9]{1,3}([.][0-9]{1,3}){3}|\\[[0-9a-fA-F:.]+\\]):([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$')";

fn default_backlog() -> i32 {
    4096
}

impl ListenerSpec {
    /// Its `tcp`, `udp` or `unix` address, as written.
    pub fn address(&self) -> &str {
        self.tcp
            .as_deref()
            .or(self.udp.as_deref())
            .or(self.unix.as_deref())
            .unwrap_or_default()
    }

    /// Its IP address and port, `tcp` or `udp`: what steering applies to.
    pub fn ip_address(&self) -> Option<&str> {
        self.tcp.as_deref().or(self.udp.as_deref())
    }
}

/// `name=address` of each listener, comma-separated, for a printer column;
/// `None` without listeners.
pub fn listeners_summary(listeners: &[ListenerSpec]) -> Option<String> {
    let summary: Vec<String> = listeners
        .iter()
        .map(|l| format!("{}={}", l.name, l.address()))
        .collect();
    (!summary.is_empty()).then(|| summary.join(","))
}

/// The listeners of an instance: at most eight, by unique name.
pub type Listeners = Vec<ListenerSpec>;

/// Node labels that select nodes; empty selects every node.
pub type NodeSelector = BTreeMap<String, String>;

fn thirty() -> i32 {
    30
}
fn ten() -> i32 {
    10
}

/// What the agent does when a serving generation exits between attempts
/// (SPEC 5.10). Unset means the kind's default: `Always` for an instance,
/// `OnFailure` for a worker.
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
pub enum RestartPolicy {
    /// Restart after every exit, a clean one included.
    Always,
    /// Restart unless it exited 0.
    OnFailure,
    /// Leave it down and report it: a human must act.
    Never,
}

impl RestartPolicy {
    /// The policy that applies: `set`, or the kind's default.
    pub fn effective(set: Option<RestartPolicy>, kind: InstanceKind) -> RestartPolicy {
        set.unwrap_or(match kind {
            InstanceKind::Instance => RestartPolicy::Always,
            InstanceKind::Worker => RestartPolicy::OnFailure,
        })
    }

    /// Whether an exit is followed by a restart; `clean` is an exit 0.
    pub fn restarts_after(self, clean: bool) -> bool {
        match self {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => !clean,
            RestartPolicy::Never => false,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RestartPolicy::Always => "Always",
            RestartPolicy::OnFailure => "OnFailure",
            RestartPolicy::Never => "Never",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(value: impl Serialize) -> String {
        serde_json::to_value(value)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }

    #[test]
    fn as_str_is_the_wire_spelling() {
        for cause in [
            Cause::Release,
            Cause::Install,
            Cause::Retry,
            Cause::Restart,
            Cause::Config,
        ] {
            assert_eq!(cause.as_str(), wire(cause));
        }
        for mode in [Mode::Overlap, Mode::Hold] {
            assert_eq!(mode.as_str(), wire(mode));
        }
        for outcome in [
            Outcome::Done,
            Outcome::Failed,
            Outcome::Abandoned,
            Outcome::Down,
        ] {
            assert_eq!(outcome.as_str(), wire(outcome));
        }
    }
}
