//! `rollout.analysis` and `rollout.onFailure` (SPEC 4.3): a canary judged
//! by its metrics before the rest of the fleet gets its build, and what
//! becomes of a node whose attempt failed.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// PromQL queries, each with the bound its result must stay within, run
/// against the controller's `--prometheus-url` after a wave is healthy and
/// before the next wave starts.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.failureLimit) || self.failureLimit < (has(self.count) ? self.count : 3)").message("rollout.analysis.failureLimit must be below count: a limit of count or more can never fail"))]
pub struct AnalysisSpec {
    /// What is measured. `$node` becomes a regular expression matching the
    /// wave's nodes (use it with `=~`), `$build` the build judged and
    /// `$instance` the InstanceGeneration's name.
    #[schemars(length(max = 8))]
    #[x_kube(validation = Rule::new("size(self) > 0").message("rollout.analysis needs at least one query"))]
    pub queries: Vec<AnalysisQuery>,
    /// Seconds from the wave being healthy to the first measurement, and
    /// between measurements.
    #[serde(default = "sixty")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 3600").message("rollout.analysis.intervalSeconds must be from 1 to 3600"))]
    pub interval_seconds: i64,
    /// How many measurements judge a wave.
    #[serde(default = "three")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("rollout.analysis.count must be from 1 to 100"))]
    pub count: i32,
    /// How many measurements may cross a bound before the analysis fails.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[x_kube(validation = Rule::new("self >= 0").message("rollout.analysis.failureLimit must be at least 0"))]
    pub failure_limit: i32,
    /// Judge every wave but the last too, not only the canaries.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub every_wave: bool,
    /// What a measurement that could not be taken (Prometheus unreachable,
    /// a query refused, no data) makes of the analysis.
    #[serde(default)]
    pub inconclusive: Inconclusive,
}

/// One query and its bound.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.min) || has(self.max)").message("an analysis query needs a bound: min, max or both"))]
#[x_kube(validation = Rule::new("!has(self.min) || !has(self.max) || self.min <= self.max").message("an analysis query's min must not be above its max"))]
pub struct AnalysisQuery {
    /// Names the query in the status, messages and Events.
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("size(self) > 0").message("an analysis query needs a name"))]
    pub name: String,
    /// An instant PromQL query; every sample it returns is judged.
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("size(self) > 0").message("an analysis query needs its PromQL"))]
    pub query: String,
    /// The lowest value that passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    /// The highest value that passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
}

/// What an inconclusive measurement makes of the analysis.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Inconclusive {
    /// The analysis ends `Inconclusive` and the rollout halts (`Stalled`
    /// with `AnalysisInconclusive`) until `spec.retry` changes: a canary
    /// nobody could measure is not promoted.
    #[default]
    Halt,
    /// The measurement counts as passed: the rollout goes on without
    /// metrics (a Warning Event says so).
    Proceed,
}

/// What becomes of a node whose attempt ended `failed` or `down`, or whose
/// wave failed its analysis.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum OnFailure {
    /// It stays as the failure left it until a human acts.
    #[default]
    Hold,
    /// It gets the last build every node served (`status.history[0]`)
    /// back by an ordinary attempt (cause `rollback`); the failed build
    /// stays held down.
    Restore,
}

/// How an analysis stands.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AnalysisPhase {
    #[default]
    Running,
    Passed,
    Failed,
    Inconclusive,
}

impl AnalysisPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            AnalysisPhase::Running => "Running",
            AnalysisPhase::Passed => "Passed",
            AnalysisPhase::Failed => "Failed",
            AnalysisPhase::Inconclusive => "Inconclusive",
        }
    }
}

/// The newest wave's analysis (`status.rollout.analysis`): the record the
/// controller keeps of its measurements, so a restarted controller or a
/// new leader goes on from it.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AnalysisStatus {
    /// The build judged.
    #[schemars(length(max = 253))]
    pub build: String,
    /// The wave judged, and its place (0: the canaries).
    #[schemars(length(max = 63))]
    pub wave: String,
    pub wave_index: i32,
    pub phase: AnalysisPhase,
    /// Measurements taken, those that crossed a bound, and those that
    /// could not be taken.
    pub measurements: i32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failures: i32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inconclusive: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_measured_time: Option<Time>,
    /// The newest crossing or inconclusive measurement: the query, the
    /// value and the bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// The `spec.retry` token it began under: a new token starts a failed
    /// or inconclusive analysis again.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 253))]
    pub retry: String,
}

fn sixty() -> i64 {
    60
}

fn three() -> i32 {
    3
}

fn is_zero(value: &i32) -> bool {
    *value == 0
}
