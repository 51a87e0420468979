//! `InstanceGeneration`: the build a user wants running on a set of nodes.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::analysis::{AnalysisSpec, AnalysisStatus, OnFailure};
use crate::probes::{HealthSpec, LifecycleSpec, LivenessSpec};
use crate::settings::{
    Artifact, BuildSpec, Cause, Demand, InstanceKind, Listeners, Mode, NodeSelector, Outcome,
    ProcessSpec, ResourcesSpec, RestartPolicy, SettleSpec, SocketSpec, StopSpec, Unpack,
};
use crate::sidecars::{SIDECAR_LISTENERS_RULE, SidecarStatus, Sidecars};
use crate::swap_attempt::LastExit;

/// The desired state of one host process identity on every node its selector picks.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "genswap.dev",
    version = "v1alpha1",
    kind = "InstanceGeneration",
    doc = "The build a user wants running as a host process on every node the selector picks.",
    plural = "instancegenerations",
    shortname = "ig",
    category = "genswap",
    namespaced,
    status = "InstanceGenerationStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Build","type":"string","jsonPath":".spec.build.id"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.mode"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","description":"nodes ready / nodes selected","jsonPath":".status.ready"}"#,
    printcolumn = r#"{"name":"Status","type":"string","description":"the Ready condition's reason","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Listeners","type":"string","description":"name=address of each listener the agents hold","jsonPath":".status.listeners"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new(PROBE_LISTENERS_RULE).message("a probe's listener must name one of spec.listeners"))]
#[x_kube(validation = Rule::new(SIDECAR_LISTENERS_RULE).message("a sidecar's listener must name one of spec.listeners"))]
#[x_kube(validation = Rule::new(ROOT_BUILD_RULE).message("process.root: build needs a tree build: build.artifact.image, or an archive (artifact.unpack), and so does a sidecar's own build"))]
#[x_kube(validation = Rule::new(WATCHDOG_RULE).message("liveness.watchdog needs health.notify: WATCHDOG=1 arrives on the NOTIFY_SOCKET the agent gives a generation whose health probe is notify"))]
#[serde(rename_all = "camelCase")]
pub struct InstanceGenerationSpec {
    /// Node labels; one instance runs on each matching node. Empty selects every node.
    #[serde(default, skip_serializing_if = "NodeSelector::is_empty")]
    #[schemars(extend("maxProperties" = 64, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    pub node_selector: NodeSelector,
    #[serde(default)]
    pub kind: InstanceKind,
    pub build: BuildSpec,
    #[serde(default)]
    pub cause: Cause,
    #[serde(default)]
    pub mode: Mode,
    #[serde(default)]
    pub demand: Demand,
    /// Opaque; a change with the same build is a new desired state (cause `config`).
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub config_rev: String,
    /// Opaque; a change with the same build is a new desired state (cause `restart`).
    #[serde(default, rename = "restartID")]
    #[schemars(length(max = 256))]
    pub restart_id: String,
    /// Opaque; a change re-arms one attempt of a held-down build.
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub retry: String,
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
    pub rollout: RolloutSpec,
    #[serde(default)]
    pub socket: SocketSpec,
    /// Sockets the agent binds and holds for every generation (SPEC 6.2).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub listeners: Listeners,
    /// What the agent does when a serving generation exits between
    /// attempts; unset: `Always` for an instance, `OnFailure` for a worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// Processes that follow the serving generation (SPEC 5.13): each
    /// generation gets its own once it serves, and they stop with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub sidecars: Sidecars,
}

/// Every probe that names a listener names one of `spec.listeners`.
const PROBE_LISTENERS_RULE: &str = concat!(
    "(!has(self.health) || !has(self.health.httpGet) || !has(self.health.httpGet.listener) || (has(self.listeners) && self.listeners.exists(l, l.name == self.health.httpGet.listener)))",
    " && (!has(self.health) || !has(self.health.grpc) || !has(self.health.grpc.listener) || (has(self.listeners) && self.listeners.exists(l, l.name == self.health.grpc.listener)))",
    " && (!has(self.liveness) || !has(self.liveness.httpGet) || !has(self.liveness.httpGet.listener) || (has(self.listeners) && self.listeners.exists(l, l.name == self.liveness.httpGet.listener)))",
    " && (!has(self.liveness) || !has(self.liveness.grpc) || !has(self.liveness.grpc.listener) || (has(self.listeners) && self.listeners.exists(l, l.name == self.liveness.grpc.listener)))",
);

/// `process.root: build` runs in a tree: the generation in its build's,
/// a sidecar (in its generation's sandbox) in its own build's when it has
/// one.
const ROOT_BUILD_RULE: &str = concat!(
    "!has(self.process) || !has(self.process.root) || self.process.root != 'build' || (",
    "(has(self.build.artifact.image) || has(self.build.artifact.unpack))",
    " && (!has(self.sidecars) || self.sidecars.all(s, !has(s.build) || has(s.build.artifact.image) || has(s.build.artifact.unpack))))",
);

/// The watchdog's messages come on the notify socket, which only a
/// `notify` health probe makes.
const WATCHDOG_RULE: &str = "!has(self.liveness) || !has(self.liveness.watchdog) || !self.liveness.watchdog || (has(self.health) && has(self.health.notify))";

/// How a new desired state rolls across the selected nodes.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// The first cohort, which must be done before the rest start: a number
    /// of nodes, or a percentage of the selected nodes ("10%"), rounded up.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new(CANARY_NODES_RULE).message("rollout.canaryNodes must be an integer of at least 0 or a percentage from 0% to 100%"))]
    pub canary_nodes: IntOrString,
    /// Attempts in flight at once after the canaries: a number, or a
    /// percentage of the selected nodes ("10%"), rounded up, at least 1.
    #[serde(default = "one")]
    #[x_kube(validation = Rule::new(MAX_PARALLEL_RULE).message("rollout.maxParallel must be an integer of at least 1 or a percentage from 1% to 100%"))]
    pub max_parallel: IntOrString,
    /// A failed or down outcome stops the rollout of that build.
    #[serde(default = "yes")]
    pub halt_on_failure: bool,
    /// No new attempts while true; attempts in flight finish (SPEC 4.5).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// After the canaries, the nodes go one value of a node label at a
    /// time, each wave done before the next starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waves: Option<WavesSpec>,
    /// How long a finished wave (the canaries' too) runs before the next
    /// one starts.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 604800").message("rollout.bakeSeconds must be from 0 to 604800 (a week)"))]
    pub bake_seconds: i64,
    /// A rollout that makes no progress this long is `Stalled` with reason
    /// `ProgressDeadlineExceeded` (as a Deployment's).
    #[serde(default = "progress_deadline_seconds")]
    #[x_kube(validation = Rule::new("self >= 1").message("rollout.progressDeadlineSeconds must be at least 1"))]
    pub progress_deadline_seconds: i64,
    /// Metrics that judge the canaries (and with `everyWave` each wave)
    /// before the next wave starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analysis: Option<AnalysisSpec>,
    /// What becomes of a node whose attempt failed, or whose wave failed
    /// its analysis: `hold` (left as it is) or `restore` (the good build
    /// back).
    #[serde(default)]
    pub on_failure: OnFailure,
    /// Every selected node that serves another build stages the desired
    /// one (fetch, verify, unpack) before the first swap of its rollout,
    /// so no wave waits on a download (SPEC 5.15).
    #[serde(default = "yes")]
    pub prestage: bool,
    /// Pre-staging that has not finished on every node this long after it
    /// began is `Stalled` with reason `PrestageDeadlineExceeded`; the
    /// rollout keeps waiting for it.
    #[serde(default = "progress_deadline_seconds")]
    #[x_kube(validation = Rule::new("self >= 1").message("rollout.prestageDeadlineSeconds must be at least 1"))]
    pub prestage_deadline_seconds: i64,
}

/// Waves by a node label (SPEC 3.1 `rollout.waves`).
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct WavesSpec {
    /// The node label whose values make the waves, such as
    /// `topology.kubernetes.io/zone`. Nodes without it go last.
    #[schemars(length(max = 317))]
    #[x_kube(validation = Rule::new("size(self) > 0").message("rollout.waves.byLabel must name a node label"))]
    pub by_label: String,
    /// Values that go first, in this order; the others follow by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(v, size(v) <= 63)").message("rollout.waves.order holds label values, at most 63 characters each"))]
    pub order: Vec<String>,
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            canary_nodes: one(),
            max_parallel: one(),
            halt_on_failure: yes(),
            paused: false,
            waves: None,
            bake_seconds: 0,
            progress_deadline_seconds: progress_deadline_seconds(),
            analysis: None,
            on_failure: OnFailure::default(),
            prestage: yes(),
            prestage_deadline_seconds: progress_deadline_seconds(),
        }
    }
}

fn progress_deadline_seconds() -> i64 {
    600
}

fn is_zero(value: &i64) -> bool {
    *value == 0
}

fn one() -> IntOrString {
    IntOrString::Int(1)
}

// `string(self)`, not `type(self)`: kube-cel, which checks manifests in
// standalone mode, has no `type()`. A number in quotes is that number.
const CANARY_NODES_RULE: &str = "string(self).matches('^(0|[1-9][0-9]*|(100|[1-9]?[0-9])%)$')";
const MAX_PARALLEL_RULE: &str = "string(self).matches('^([1-9][0-9]*|(100|[1-9][0-9]?)%)$')";

/// How many of `selected` nodes `value` names: an integer as it is (none
/// when negative; a number in quotes too), a percentage rounded up as
/// Deployments round `maxSurge`, and at least one when it is above 0%.
/// `None` for other text (the schema refuses it).
pub fn scaled_count(value: &IntOrString, selected: usize) -> Option<usize> {
    match value {
        IntOrString::Int(count) => Some(usize::try_from(*count).unwrap_or(0)),
        IntOrString::String(text) => {
            let Some(percent) = text.strip_suffix('%') else {
                return text.parse().ok();
            };
            let percent: usize = percent.parse().ok()?;
            if percent > 100 {
                return None;
            }
            let count = (selected * percent).div_ceil(100);
            Some(if percent > 0 { count.max(1) } else { 0 })
        }
    }
}

impl RolloutSpec {
    /// The canary cohort's size on a fleet of `selected` nodes.
    pub fn canaries(&self, selected: usize) -> usize {
        scaled_count(&self.canary_nodes, selected).unwrap_or(1)
    }

    /// Attempts in flight at once after the canaries, on a fleet of
    /// `selected` nodes.
    pub fn parallel(&self, selected: usize) -> usize {
        scaled_count(&self.max_parallel, selected)
            .unwrap_or(1)
            .max(1)
    }
}
fn yes() -> bool {
    true
}

/// What the controller observed and decided.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InstanceGenerationStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The newest scheduler revision reserved: written before an attempt
    /// carrying it is created, and possibly ahead of the nodes still
    /// waiting their turn; a reservation left unused is never issued.
    #[serde(default)]
    pub sched_rev: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired: Option<DesiredState>,
    /// Nodes ready / nodes selected, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// `name=address` of each of `spec.listeners`, for `kubectl get`; what
    /// a node holds is in its attempt's `status.serving.listeners`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listeners: Option<String>,
    /// How many selected nodes are where, whatever the fleet's size:
    /// `nodes` and `heldDown` list at most 100 entries each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counts: Option<NodeCounts>,
    /// At most 100 nodes (fewer when their entries are long): those that
    /// need attention first, with `attention` saying why, then the rest by
    /// name. Every node's record is on its newest finished SwapAttempt
    /// (annotation `genswap.dev/record`); `kubectl genswap get` reads it
    /// there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub nodes: Vec<NodeGeneration>,
    /// At most 100 entries of the failure book, those of nodes without a
    /// record first; `counts.heldDown` says how many there are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub held_down: Vec<HeldDown>,
    /// The `spec.retry` token the controller last acted on. A different token
    /// in the spec arms one attempt of a held-down build; absent until the
    /// first plan, so a new object never retries by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_retry: Option<String>,
    /// The newest build that reached `done` on every selected node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub good_build: Option<String>,
    /// The last few desired states every selected node served, newest
    /// first: what `kubectl genswap undo` writes back (SPEC 4.5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5))]
    pub history: Vec<HistoryEntry>,
    /// Where the rollout stands: its wave, a bake, its last progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,
    /// `Ready`, `Reconciling` and `Stalled`, with their kstatus meanings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// Where a rollout stands, bounded whatever the fleet.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// The wave whose nodes go now, or that bakes: `canary`, a value of
    /// `rollout.waves.byLabel`, or `(unlabelled)` for nodes without it;
    /// absent once every wave is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub wave: Option<String>,
    /// Its place: 0 for the canaries, then 1 to `waves`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave_index: Option<i32>,
    /// How many waves follow the canaries (1 without `rollout.waves`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waves: Option<i32>,
    /// The finished wave bakes until then (`rollout.bakeSeconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baking_until: Option<Time>,
    /// When the rollout last moved: a node's attempt issued or finished,
    /// a node newly serving, a new desired state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_time: Option<Time>,
    /// The newest wave's analysis (`rollout.analysis`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analysis: Option<AnalysisStatus>,
    /// The nodes staging the desired build ahead of its first swap
    /// (`rollout.prestage`); kept once they all hold it, until the next
    /// build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prestage: Option<PrestageStatus>,
}

/// Pre-staging of one build across the selected nodes (SPEC 5.15).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PrestageStatus {
    /// The build staged ahead.
    #[schemars(length(max = 253))]
    pub build: String,
    /// Its digest: a new one under the same `build` starts a new record.
    /// Absent in records written before it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub sha256: Option<String>,
    /// When the nodes were first asked to stage it.
    pub since: Time,
    /// When the last of them held it; absent while any stages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_at: Option<Time>,
    /// Nodes that hold it, of `needed`.
    pub staged: i64,
    /// Nodes that serve another build and must hold this one first.
    pub needed: i64,
    /// Bytes the nodes fetched to stage it, as they reported: 0 when every
    /// store held it already (an undo to a build kept staged).
    #[serde(default)]
    pub fetched_bytes: i64,
    /// At most 100 nodes that do not hold it yet, those that cannot
    /// first, with the bytes fetched so far.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub nodes: Vec<StagingNode>,
}

/// One node that does not hold the build yet.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StagingNode {
    #[schemars(length(max = 253))]
    pub name: String,
    /// `Waiting` (asked, not begun), `Staging`, `Failed` (the build's fault:
    /// waits for a new build or `spec.retry`) or `Abandoned` (the source's
    /// or host's: tried again with backoff).
    pub state: StagingState,
    #[serde(default)]
    pub fetched_bytes: i64,
    /// What the fetch needs in all, once the source has said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub reason: Option<String>,
}

/// Where one node's pre-staging stands.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StagingState {
    #[default]
    Waiting,
    Staging,
    Failed,
    Abandoned,
}

impl StagingState {
    /// As status and messages spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            StagingState::Waiting => "Waiting",
            StagingState::Staging => "Staging",
            StagingState::Failed => "Failed",
            StagingState::Abandoned => "Abandoned",
        }
    }
}

/// The desired tuple the controller compares every node against.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub struct DesiredState {
    pub build: String,
    pub sha256: String,
    #[serde(default)]
    pub config_rev: String,
    #[serde(default, rename = "restartID")]
    pub restart_id: String,
    #[serde(default)]
    pub mode: Mode,
}

/// How many entries `status.nodes` and `status.heldDown` list at most: an
/// InstanceGeneration's status stays a few dozen KiB whatever the fleet.
pub const NODES_LISTED: usize = 100;

/// The annotation on a node's newest finished SwapAttempt that carries the
/// controller's record of that node ([`NodeRecord`], JSON).
pub const ANNOTATION_RECORD: &str = "genswap.dev/record";

/// Counts of the selected nodes, as a DaemonSet reports them.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeCounts {
    /// Nodes the selector picks.
    pub selected: i64,
    /// Nodes that run the desired state (ready, or down between attempts).
    pub updated: i64,
    /// Nodes that serve the desired state and answer.
    pub ready: i64,
    /// Nodes with an attempt in flight.
    pub in_flight: i64,
    /// Nodes waiting for the canaries, `maxParallel`, a backoff or a pause.
    pub waiting: i64,
    /// Nodes the failure book stops until a human acts.
    pub stalled: i64,
    /// Entries in the failure book, listed or not.
    pub held_down: i64,
    /// Nodes that need attention, listed or not.
    pub attention: i64,
    /// Nodes that hold the desired build: serve it, or staged it ahead
    /// (`rollout.prestage`).
    #[serde(default)]
    pub staged: i64,
}

/// What the controller remembers of one node, kept on the node's newest
/// finished SwapAttempt (annotation [`ANNOTATION_RECORD`]) rather than in
/// the InstanceGeneration's status, so the status does not grow with the
/// fleet and older attempts can go.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeRecord {
    pub node: NodeGeneration,
    /// This node's entries of the failure book.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_down: Vec<HeldDown>,
}

impl NodeRecord {
    /// The annotation's value.
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The record `attempt` carries for `node`. One that does not parse is
    /// no record: the controller's next write replaces it.
    pub fn on(attempt: &crate::SwapAttempt, node: &str) -> Option<Self> {
        let raw = attempt
            .metadata
            .annotations
            .as_ref()?
            .get(ANNOTATION_RECORD)?;
        serde_json::from_str::<Self>(raw)
            .ok()
            .filter(|record| record.node.name == node)
    }
}

/// What one node runs.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeGeneration {
    pub name: String,
    /// Why this node needs attention (in `status.nodes` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
    /// The serving generation N; absent before the first `done`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// The serving build id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
    /// The serving build's sha256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_rev: Option<String>,
    #[serde(default, rename = "restartID", skip_serializing_if = "Option::is_none")]
    pub restart_id: Option<String>,
    /// When the serving generation took over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// A generation of the desired state runs and answers there; false
    /// while it is down between attempts (exited, backing off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<bool>,
    /// Restarts by the agent since the attempt that installed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarts: Option<i32>,
    /// How the last generation that exited between attempts ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<LastExit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempt: Option<LastAttempt>,
    /// The serving generation's sidecars, as its agent reports them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4))]
    pub sidecars: Vec<SidecarStatus>,
}

impl NodeGeneration {
    /// A node the controller knows nothing of yet.
    pub fn fresh(name: &str) -> Self {
        Self {
            name: name.to_string(),
            attention: None,
            generation: None,
            build: None,
            sha256: None,
            config_rev: None,
            restart_id: None,
            since: None,
            serving: None,
            restarts: None,
            last_exit: None,
            last_attempt: None,
            sidecars: Vec::new(),
        }
    }
}

/// The newest finished attempt on a node.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LastAttempt {
    pub sched_rev: i64,
    pub cause: Cause,
    pub mode: Mode,
    pub outcome: Outcome,
    #[serde(default)]
    pub reason: String,
    pub executed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_ms: Option<i64>,
}

/// A (build, mode) that failed and is not attempted again on its own.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HeldDown {
    pub build: String,
    pub mode: Mode,
    pub node: String,
    pub reason: String,
    pub since: Time,
    /// A change of `spec.retry` armed one more attempt of this build.
    #[serde(default)]
    pub retry_armed: bool,
}

/// A desired state that every selected node served, and since when.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEntry {
    /// The build id.
    pub build: String,
    pub sha256: String,
    /// Where the build came from, so it can be released again as it was.
    pub artifact: HistoryArtifact,
    /// What ran in its tree, for a tree build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config_rev: String,
    #[serde(
        default,
        rename = "restartID",
        skip_serializing_if = "String::is_empty"
    )]
    pub restart_id: String,
    /// When every selected node first served it (this time round).
    pub at: Time,
}

/// `spec.build.artifact` as it was, without the spec's CEL rules: the
/// status repeats what the spec already passed, and rules inside a list
/// would count against the API server's cost budget once per entry.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HistoryArtifact {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpack: Option<Unpack>,
}

impl From<&Artifact> for HistoryArtifact {
    fn from(artifact: &Artifact) -> Self {
        Self {
            path: artifact.path.clone(),
            url: artifact.url.clone(),
            image: artifact.image.clone(),
            unpack: artifact.unpack,
        }
    }
}

impl From<&HistoryArtifact> for Artifact {
    fn from(artifact: &HistoryArtifact) -> Self {
        Self {
            path: artifact.path.clone(),
            url: artifact.url.clone(),
            image: artifact.image.clone(),
            unpack: artifact.unpack,
        }
    }
}

impl InstanceGenerationSpec {
    /// The tuple every node is compared against.
    pub fn desired(&self) -> DesiredState {
        DesiredState {
            build: self.build.id.clone(),
            sha256: self.build.sha256.clone(),
            config_rev: self.config_rev.clone(),
            restart_id: self.restart_id.clone(),
            mode: self.mode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_scale_as_deployments_round_max_surge() {
        let of = |value: IntOrString, selected| scaled_count(&value, selected);
        let text = |t: &str| IntOrString::String(t.into());
        assert_eq!(of(IntOrString::Int(3), 10), Some(3));
        assert_eq!(of(IntOrString::Int(-1), 10), Some(0));
        assert_eq!(of(text("7"), 10), Some(7), "a number in quotes");
        assert_eq!(of(text("10%"), 25), Some(3), "2.5 rounds up");
        assert_eq!(of(text("10%"), 5_000), Some(500));
        assert_eq!(of(text("1%"), 3), Some(1), "at least one above 0%");
        assert_eq!(of(text("0%"), 100), Some(0));
        assert_eq!(of(text("100%"), 7), Some(7));
        assert_eq!(
            of(text("10%"), 0),
            Some(1),
            "of no nodes: one, which finds none"
        );
        assert_eq!(of(text("101%"), 10), None);
        assert_eq!(of(text("ten"), 10), None);
        let rollout = RolloutSpec {
            max_parallel: text("0%"),
            ..RolloutSpec::default()
        };
        assert_eq!(rollout.parallel(10), 1, "never below one in flight");
        assert_eq!(rollout.canaries(10), 1, "the default cohort");
    }
}
