//! `SwapAttempt`: one try at moving one instance on one node to a new generation.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::probes::{HealthSpec, LifecycleSpec, LivenessSpec};
use crate::settings::{
    BuildSpec, Cause, Demand, InstanceKind, Listeners, Mode, Outcome, ProcessSpec, ResourcesSpec,
    RestartPolicy, SettleSpec, SocketSpec, StopSpec,
};
use crate::sidecars::{SidecarStatus, Sidecars};

/// An attempt as the controller issued it. It never changes after creation.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "genswap.dev",
    version = "v1alpha1",
    kind = "SwapAttempt",
    doc = "One try at moving one instance on one node to a new generation.",
    plural = "swapattempts",
    shortname = "swa",
    category = "genswap",
    namespaced,
    status = "SwapAttemptStatus",
    derive = "PartialEq",
    selectable = ".spec.nodeName",
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.nodeName"}"#,
    printcolumn = r#"{"name":"Rev","type":"integer","jsonPath":".spec.schedRev"}"#,
    printcolumn = r#"{"name":"Outcome","type":"string","jsonPath":".status.outcome"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","description":"the mode that ran","jsonPath":".status.effectiveMode"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("SwapAttempt spec is immutable"))]
#[serde(rename_all = "camelCase")]
pub struct SwapAttemptSpec {
    /// The InstanceGeneration this attempt moves.
    #[schemars(length(max = 253))]
    pub instance: String,
    #[schemars(length(max = 253))]
    pub node_name: String,
    /// Strictly increasing per InstanceGeneration; a higher one supersedes every lower one.
    #[x_kube(validation = Rule::new("self >= 1").message("schedRev must be at least 1"))]
    pub sched_rev: i64,
    pub cause: Cause,
    #[serde(default)]
    pub kind: InstanceKind,
    pub build: BuildSpec,
    pub mode: Mode,
    #[serde(default)]
    pub demand: Demand,
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub config_rev: String,
    #[serde(default, rename = "restartID")]
    #[schemars(length(max = 256))]
    pub restart_id: String,
    /// In the first rollout cohort: watched for the settle window.
    #[serde(default)]
    pub canary: bool,
    #[serde(default)]
    pub process: ProcessSpec,
    #[serde(default)]
    pub health: HealthSpec,
    /// Probing of the serving generation between attempts; none: only its
    /// exit is noticed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<LivenessSpec>,
    /// Hooks at points of a generation's life: `preStop`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<LifecycleSpec>,
    #[serde(default)]
    pub settle: SettleSpec,
    #[serde(default)]
    pub stop: StopSpec,
    #[serde(default)]
    pub resources: ResourcesSpec,
    #[serde(default)]
    pub socket: SocketSpec,
    /// Sockets the agent binds and holds for every generation (SPEC 6.2).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub listeners: Listeners,
    /// What the agent does when the generation this attempt installs exits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// Processes that follow each generation this attempt's lineage runs
    /// (SPEC 5.13).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub sidecars: Sidecars,
    /// Only stage the build into the node's store and report it: nothing
    /// starts, stops or is superseded (`rollout.prestage`, SPEC 5.15).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stage_only: bool,
}

/// What the node agent reports. Written only by the agent.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SwapAttemptStatus {
    /// Absent while the attempt runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// The mode that actually ran: an overlap runs as a hold for a fixed
    /// socket layout or a hold demand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_mode: Option<Mode>,
    /// The generation N the attempt started (or would have).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// False only when it is proven that no process of the build started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executed: Option<bool>,
    /// A worker's new build exited 0 inside the settle window: a one-shot's success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clean_exit: Option<bool>,
    /// From the stop signal to the retiring generation's proven exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// How new connections to the instance's TCP listeners reached the
    /// generations during this attempt (SPEC 6.3); absent without listeners.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listener_handover: Option<ListenerHandover>,
    /// How long each step took and how it ended, in the order they ran.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<StepTiming>,
    /// `Ready` on done, `Reconciling` while running, `Stalled` on failed or down.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// What staging the build fetched: while a `stageOnly` attempt runs,
    /// written at most every few seconds; on an outcome, the bytes fetched
    /// in all (0: the node's store held the build).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<StageProgress>,
    /// On the node's newest `done` attempt: the generation it installed and
    /// the agent's restarts since, kept current between attempts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<ServingStatus>,
}

/// Bytes an attempt's stage step fetched.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StageProgress {
    pub fetched_bytes: i64,
    /// What the fetch needs in all, once the source has said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<i64>,
}

/// The state of what a `done` attempt installed (SPEC 5.10).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ServingStatus {
    pub state: ServingState,
    /// The generation serving (Running) or the one that exited.
    pub generation: i64,
    /// Restarts by the agent since this attempt.
    #[serde(default)]
    pub restarts: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<LastExit>,
    /// BackOff: when the next restart is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_at: Option<Time>,
    /// Why it is not running, in words a human can act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The listening sockets the agent holds for the instance (SPEC 6.2):
    /// handed to the serving generation, and open even while none runs,
    /// so connections wait in their backlog.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<HeldListener>,
    /// The serving generation's sidecars (SPEC 5.13).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4))]
    pub sidecars: Vec<SidecarStatus>,
}

/// How new connections of a listener reach generations (SPEC 6.2, 6.3).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum ListenerHandover {
    /// Each generation has its own socket, and a BPF program the agent
    /// writes picks the serving one: a successor takes no connection
    /// before the switch.
    Steered,
    /// One socket shared by every generation that runs: a successor may
    /// accept connections before its health check ends.
    Shared,
}

impl ListenerHandover {
    /// As status, logs and metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            ListenerHandover::Steered => "steered",
            ListenerHandover::Shared => "shared",
        }
    }
}

/// A listener held by the agent.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HeldListener {
    pub name: String,
    /// The `tcp`, `udp` or `unix` address it is bound to.
    pub address: String,
}

/// Running, or down between attempts.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ServingState {
    /// Serving and healthy.
    Running,
    /// Exited: being restarted now, or left down by the restart policy.
    Exited,
    /// Exited, and the next restart waits for its backoff.
    BackOff,
}

/// How a generation ended between attempts.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LastExit {
    pub generation: i64,
    /// Its exit code, when it exited on its own and the agent saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that killed it, when one did and the agent saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// The kernel's OOM killer killed a process of its cgroup.
    #[serde(default)]
    pub oom_killed: bool,
    pub at: Time,
    /// Set when the agent stopped it because its liveness probe failed: the
    /// probe, the failures in a row and what the last one saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub liveness_failed: Option<String>,
}

impl LastExit {
    /// An exit 0.
    pub fn clean(&self) -> bool {
        exited_clean(self.exit_code, self.signal)
    }

    /// `exit code 1`, `signal 9 (SIGKILL)`, with `, OOM-killed`.
    pub fn describe(&self) -> String {
        let how = describe_exit(self.exit_code, self.signal, self.oom_killed);
        match &self.liveness_failed {
            Some(failure) => format!("{how} after its {failure}"),
            None => how,
        }
    }
}

/// An exit 0, not by a signal.
pub fn exited_clean(code: Option<i32>, signal: Option<i32>) -> bool {
    code == Some(0) && signal.is_none()
}

/// [`exit_text`], with `, OOM-killed` when the kernel's OOM killer did it.
pub fn describe_exit(code: Option<i32>, signal: Option<i32>, oom_killed: bool) -> String {
    let how = exit_text(code, signal);
    if oom_killed {
        format!("{how}, OOM-killed")
    } else {
        how
    }
}

/// How a process ended, in words: `exit code 1`, `signal 9 (SIGKILL)`.
pub fn exit_text(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (_, Some(signal)) => match signal_name(signal) {
            Some(name) => format!("signal {signal} ({name})"),
            None => format!("signal {signal}"),
        },
        (Some(code), None) => format!("exit code {code}"),
        (None, None) => "an exit status this agent cannot know (it adopted the process)".into(),
    }
}

/// The usual name of a Linux signal number.
pub fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => return None,
    })
}

/// One step of an attempt.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StepTiming {
    /// stage, admit, raise, journal, spawn, health, settle, switch, retire or stop.
    pub step: String,
    /// ok, cancelled, stale or failed.
    pub result: String,
    pub millis: i64,
}
