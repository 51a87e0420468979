//! The status file written beside each manifest:
//! `<dir>/status/<manifest file name>`.
//!
//! It holds the InstanceGeneration's `status` exactly as the controller
//! writes it in a cluster (observedGeneration, schedRev, desired, ready,
//! nodes with lastAttempt, heldDown, goodBuild, and the Ready, Reconciling
//! and Stalled conditions), the SwapAttempts kept for the instance with
//! what the engine reported on each (`kubectl get swa -o yaml` in a
//! cluster), the last few the scheduler deleted, and, for a file that is
//! refused, the reason.

use std::fs;
use std::path::Path;

use genswap_crds::conditions::is_true;
use genswap_crds::{
    Cause, ConditionType, InstanceGenerationStatus, LastAttempt, Mode, SwapAttempt,
    SwapAttemptStatus, set_condition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde::{Deserialize, Serialize};

use crate::gate::InstanceKey;

/// The manifest directory's subdirectory for status files.
pub const STATUS_SUBDIR: &str = "status";

/// Condition reasons standalone mode adds to those of the scheduler.
pub mod reasons {
    /// The file does not validate (schema, unknown fields, CEL rules, names).
    pub const INVALID_MANIFEST: &str = "InvalidManifest";
    /// Another file already defines this namespace/name.
    pub const DUPLICATE_NAME: &str = "DuplicateName";
}

/// One status file.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StatusDocument {
    /// The manifest file this status is about (a name in the directory).
    pub file: String,
    /// The instance's namespace, when the file names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The instance's name, when the file names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The `metadata.generation` of the spec in force: 1 for the first,
    /// +1 for every change of the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// Why the file is refused, when it is. A refused edit of a file that
    /// was valid leaves the last valid spec in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The InstanceGeneration status, as in a cluster.
    #[serde(default)]
    pub status: InstanceGenerationStatus,
    /// The instance's attempts, oldest first, with the agent's report.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<AttemptReport>,
    /// The last finished attempts the scheduler deleted once the node's
    /// record held their outcome, oldest first, with the agent's report.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<AttemptReport>,
}

/// One SwapAttempt and what the agent reported on it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AttemptReport {
    /// `<ig>-<node>-<schedRev>`.
    pub name: String,
    /// Its scheduler revision.
    pub sched_rev: i64,
    /// Why it exists.
    pub cause: Cause,
    /// The build id it moves to.
    pub build: String,
    /// The mode asked for (the status says which one ran).
    pub mode: Mode,
    /// In the first rollout cohort (watched for the settle window).
    #[serde(default)]
    pub canary: bool,
    /// Only stages the build ahead of the swap (`rollout.prestage`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stage_only: bool,
    /// The agent's report; empty before the engine took it.
    #[serde(default)]
    pub status: SwapAttemptStatus,
}

impl AttemptReport {
    /// The report of `attempt`.
    pub fn of(attempt: &SwapAttempt) -> AttemptReport {
        AttemptReport {
            name: attempt.metadata.name.clone().unwrap_or_default(),
            sched_rev: attempt.spec.sched_rev,
            cause: attempt.spec.cause,
            build: attempt.spec.build.id.clone(),
            mode: attempt.spec.mode,
            canary: attempt.spec.canary,
            stage_only: attempt.spec.stage_only,
            status: attempt.status.clone().unwrap_or_default(),
        }
    }
}

impl StatusDocument {
    /// Reads a status file.
    pub fn read(path: &Path) -> Result<StatusDocument, String> {
        let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_saphyr::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The condition of `type_`, if present.
    pub fn condition(&self, type_: ConditionType) -> Option<&Condition> {
        self.status
            .conditions
            .iter()
            .find(|c| c.type_ == type_.as_str())
    }

    /// Whether condition `type_` is True.
    pub fn is_true(&self, type_: ConditionType) -> bool {
        is_true(&self.status.conditions, type_)
    }

    /// The newest finished attempt on this host's node.
    pub fn last_attempt(&self) -> Option<&LastAttempt> {
        self.status.nodes.first()?.last_attempt.as_ref()
    }

    /// The attempt with `sched_rev`, while it is kept.
    pub fn attempt(&self, sched_rev: i64) -> Option<&AttemptReport> {
        self.attempts.iter().find(|a| a.sched_rev == sched_rev)
    }

    /// The attempt with `sched_rev`, kept or in the history.
    pub fn attempt_or_past(&self, sched_rev: i64) -> Option<&AttemptReport> {
        self.attempt(sched_rev)
            .or_else(|| self.history.iter().find(|a| a.sched_rev == sched_rev))
    }
}

/// The status of a file in force; `invalid` is the refusal of its current
/// content and since when, if it is refused.
pub(crate) fn for_instance(
    file: &str,
    key: &InstanceKey,
    generation: i64,
    status: &InstanceGenerationStatus,
    attempts: &[SwapAttempt],
    history: &[AttemptReport],
    invalid: Option<(&str, &Time)>,
) -> StatusDocument {
    let mut status = status.clone();
    if let Some((error, since)) = invalid {
        set_condition(
            &mut status.conditions,
            ConditionType::Stalled,
            true,
            reasons::INVALID_MANIFEST,
            &format!(
                "{file} no longer validates ({error}); the last valid spec (generation {generation}) stays in force until the file is fixed"
            ),
            Some(generation),
            since,
        );
    }
    StatusDocument {
        file: file.to_string(),
        namespace: Some(key.namespace().to_string()),
        name: Some(key.name().to_string()),
        generation: Some(generation),
        error: invalid.map(|(error, _)| error.to_string()),
        status,
        attempts: attempts.iter().map(AttemptReport::of).collect(),
        history: history.to_vec(),
    }
}

/// The status of a refused file: `Ready=False`, `Reconciling=False`,
/// `Stalled=True` with `reason` and `message`.
pub(crate) fn for_refused(
    file: &str,
    key: Option<&InstanceKey>,
    reason: &str,
    message: &str,
    now: &Time,
) -> StatusDocument {
    let mut status = InstanceGenerationStatus::default();
    for (type_, value) in [
        (ConditionType::Ready, false),
        (ConditionType::Reconciling, false),
        (ConditionType::Stalled, true),
    ] {
        set_condition(
            &mut status.conditions,
            type_,
            value,
            reason,
            message,
            None,
            now,
        );
    }
    StatusDocument {
        file: file.to_string(),
        namespace: key.map(|k| k.namespace().to_string()),
        name: key.map(|k| k.name().to_string()),
        generation: None,
        error: Some(message.to_string()),
        status,
        attempts: Vec::new(),
        history: Vec::new(),
    }
}

/// The text of a status file.
pub(crate) fn render(document: &StatusDocument) -> Result<String, String> {
    serde_saphyr::to_string(document).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    #[test]
    fn a_refused_file_is_stalled_with_its_reason_and_reads_back() {
        let now = crate::attempt_status::time_of(SystemTime::now());
        let doc = for_refused(
            "bad.yaml",
            None,
            reasons::INVALID_MANIFEST,
            "unknown field(s): spec.bogus",
            &now,
        );
        assert!(doc.is_true(ConditionType::Stalled));
        assert!(!doc.is_true(ConditionType::Ready));
        let stalled = doc.condition(ConditionType::Stalled).expect("Stalled");
        assert_eq!(stalled.reason, "InvalidManifest");
        assert_eq!(stalled.message, "unknown field(s): spec.bogus");

        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("bad.yaml");
        fs::write(&path, render(&doc).expect("render")).expect("write");
        assert_eq!(StatusDocument::read(&path).expect("read back"), doc);
    }
}
