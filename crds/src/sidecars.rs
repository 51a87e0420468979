//! Sidecars: processes that follow the serving generation (SPEC 5.13).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::settings::{BuildSpec, ProcessSpec, RestartPolicy};

/// A process that runs beside each serving generation, in a cgroup below
/// it, and stops with it.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SidecarSpec {
    /// Unique among the sidecars; names its cgroup and its log file.
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$')").message("a sidecar's name must be 1 to 63 of a-z, 0-9 and '-', starting and ending alphanumeric"))]
    pub name: String,
    /// Its own artifact, staged and verified like `spec.build`; absent: the
    /// instance's build, run with the sidecar's own arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<BuildSpec>,
    /// Arguments, environment, working directory, user and group. The
    /// agent adds `GENSWAP_TARGET_SOCKET`, `GENSWAP_TARGET_PID`,
    /// `GENSWAP_GENERATION` and `GENSWAP_BUILD`; an unset user or group is
    /// the instance's.
    #[serde(default)]
    pub process: ProcessSpec,
    /// What the agent does when the sidecar exits: `Always` (default),
    /// `OnFailure` or `Never`. A sidecar never stops its generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// Names of `spec.listeners` handed to the sidecar by socket
    /// activation, as to the generation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(max = 63)))]
    pub listeners: Vec<String>,
}

impl SidecarSpec {
    /// The policy that applies: `Always` unless set.
    pub fn effective_restart_policy(&self) -> RestartPolicy {
        self.restart_policy.unwrap_or(RestartPolicy::Always)
    }
}

/// The sidecars of an instance: at most four, by unique name.
pub type Sidecars = Vec<SidecarSpec>;

/// Every listener a sidecar names is one of `spec.listeners`.
pub const SIDECAR_LISTENERS_RULE: &str = "!has(self.sidecars) || self.sidecars.all(s, !has(s.listeners) || s.listeners.all(n, has(self.listeners) && self.listeners.exists(l, l.name == n)))";

/// Where one sidecar of the serving generation is.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SidecarState {
    /// Its build is being staged, or its first start is under way.
    Starting,
    /// Running.
    Running,
    /// Exited; the next start waits for its backoff.
    BackOff,
    /// Exited, and its restart policy leaves it down.
    Exited,
}

impl SidecarState {
    /// As status and `kubectl genswap get` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            SidecarState::Starting => "Starting",
            SidecarState::Running => "Running",
            SidecarState::BackOff => "BackOff",
            SidecarState::Exited => "Exited",
        }
    }
}

/// How one sidecar of the serving generation is doing.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SidecarStatus {
    pub name: String,
    pub state: SidecarState,
    /// The generation it follows.
    pub generation: i64,
    /// Its restarts beside this generation.
    #[serde(default)]
    pub restarts: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<SidecarExit>,
    /// BackOff: when the next start is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_at: Option<Time>,
    /// Why it is not running, in words a human can act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub message: Option<String>,
}

impl SidecarStatus {
    /// Running, or on its way there for the first time.
    pub fn is_up(&self) -> bool {
        matches!(self.state, SidecarState::Running | SidecarState::Starting)
    }

    /// `exporter BackOff (exit code 1, 3 restarts)`, for messages.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(exit) = &self.last_exit {
            parts.push(crate::describe_exit(exit.exit_code, exit.signal, false));
        } else if let Some(message) = &self.message {
            parts.push(message.clone());
        }
        if self.restarts > 0 {
            parts.push(format!("{} restarts", self.restarts));
        }
        if parts.is_empty() {
            format!("{} {}", self.name, self.state.as_str())
        } else {
            format!(
                "{} {} ({})",
                self.name,
                self.state.as_str(),
                parts.join(", ")
            )
        }
    }
}

/// How a sidecar last ended.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SidecarExit {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub at: Time,
}
