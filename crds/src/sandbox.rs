//! The sandbox's part of `process` (SPEC 5.16): what an instance may use,
//! stated for every instance and never inherited from the agent.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A soft and a hard limit. A bound left out is no limit (`infinity`), so
/// `{soft: 0}` is systemd's `0:infinity`; the soft one may not be above
/// the hard one.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(!has(self.soft) || self.soft >= 0) && (!has(self.hard) || self.hard >= 0)").message("a limit must not be negative"))]
#[x_kube(validation = Rule::new("!has(self.hard) || (has(self.soft) && self.soft <= self.hard)").message("a soft limit may not be above its hard limit"))]
pub struct Limit {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hard: Option<i64>,
}

impl Limit {
    /// Both bounds, `None` for no limit.
    pub const fn new(soft: Option<i64>, hard: Option<i64>) -> Limit {
        Limit { soft, hard }
    }
}

/// `process.limits`: resource limits beyond systemd's defaults, which
/// apply to every one left out.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LimitsSpec {
    /// Open files (`RLIMIT_NOFILE`; systemd's default 1024 soft, 524288
    /// hard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nofile: Option<Limit>,
    /// Core dump size in bytes (`RLIMIT_CORE`; default 0 soft, infinity
    /// hard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core: Option<Limit>,
    /// Locked memory in bytes (`RLIMIT_MEMLOCK`; default 8 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memlock: Option<Limit>,
    /// Processes of the instance's user (`RLIMIT_NPROC`; default the
    /// kernel's, half of `kernel.threads-max`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nproc: Option<Limit>,
    /// Stack size in bytes (`RLIMIT_STACK`; default 8 MiB soft, infinity
    /// hard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack: Option<Limit>,
}

impl LimitsSpec {
    pub fn is_empty(&self) -> bool {
        self == &LimitsSpec::default()
    }
}

/// A Linux capability, by its name without `CAP_` (as Kubernetes'
/// `securityContext.capabilities` names them); its number is the kernel's.
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Capability {
    Chown = 0,
    DacOverride = 1,
    DacReadSearch = 2,
    Fowner = 3,
    Fsetid = 4,
    Kill = 5,
    Setgid = 6,
    Setuid = 7,
    Setpcap = 8,
    LinuxImmutable = 9,
    NetBindService = 10,
    NetBroadcast = 11,
    NetAdmin = 12,
    NetRaw = 13,
    IpcLock = 14,
    IpcOwner = 15,
    SysModule = 16,
    SysRawio = 17,
    SysChroot = 18,
    SysPtrace = 19,
    SysPacct = 20,
    SysAdmin = 21,
    SysBoot = 22,
    SysNice = 23,
    SysResource = 24,
    SysTime = 25,
    SysTtyConfig = 26,
    Mknod = 27,
    Lease = 28,
    AuditWrite = 29,
    AuditControl = 30,
    Setfcap = 31,
    MacOverride = 32,
    MacAdmin = 33,
    Syslog = 34,
    WakeAlarm = 35,
    BlockSuspend = 36,
    AuditRead = 37,
    Perfmon = 38,
    Bpf = 39,
    CheckpointRestore = 40,
}

impl Capability {
    /// The kernel's number of it.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// Its name as the API writes it.
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// `process.seccomp`: which system calls the instance may make.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SeccompProfile {
    /// genswap's default filter: systemd's `@system-service` allow-list, no
    /// new namespaces, the native architecture only; other calls fail with
    /// `EPERM`.
    #[default]
    RuntimeDefault,
    /// No filter.
    Unconfined,
}

/// `process.filesystem`: what of the node's filesystem the instance sees.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FilesystemProfile {
    /// In a mount namespace of its own: the whole tree read-only except
    /// `process.writablePaths` and its run dir, a private `/tmp` and
    /// `/var/tmp` per generation, `/home`, `/root` and `/run/user` empty
    /// and unreadable, a minimal `/dev`, a `/proc` that shows only its
    /// user's processes, `/proc/sys` and `/sys` read-only (systemd's
    /// `ProtectSystem=strict`, `PrivateTmp=`, `ProtectHome=`,
    /// `PrivateDevices=`, `ProtectProc=invisible`,
    /// `ProtectKernelTunables=`).
    #[default]
    Protected,
    /// The agent's view, writable wherever the instance's user may write.
    Host,
}

/// `process.root`: what the instance sees as `/`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum RootProfile {
    /// The node's own tree, as `process.filesystem` shows it.
    #[default]
    Host,
    /// The build's tree (an image or an archive), read-only, with `/proc`,
    /// a minimal `/dev`, `/sys` read-only, the node's `/etc/resolv.conf`
    /// and `/etc/hosts`, a private `/tmp`, and the run dir, the writable
    /// paths and the managed directories bound in at their node paths
    /// (systemd's `RootDirectory=` with `BindPaths=`). Needs the
    /// `Protected` filesystem.
    Build,
}

/// `process.directories`: directories the agent makes for the instance,
/// owned by its user, writable inside its sandbox, and named to it in
/// systemd's variables (`StateDirectory=`, `CacheDirectory=`,
/// `RuntimeDirectory=`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DirectoriesSpec {
    /// Kept across generations, agent restarts, reboots and the
    /// instance's removal (`STATE_DIRECTORY`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub state: bool,
    /// Kept like `state`, but the instance must cope with losing it
    /// (`CACHE_DIRECTORY`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache: bool,
    /// In the agent's run dir (a tmpfs: gone at a reboot), removed with
    /// the instance (`RUNTIME_DIRECTORY`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub runtime: bool,
}

impl DirectoriesSpec {
    pub fn is_empty(&self) -> bool {
        self == &DirectoriesSpec::default()
    }
}

/// `process.capabilities`.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CapabilitiesSpec {
    /// Kept in the bounding set (which is otherwise emptied) and raised as
    /// ambient, so that a non-root user has them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 41))]
    pub add: Vec<Capability>,
}

impl CapabilitiesSpec {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty()
    }
}
