//! `status.history`: the desired states every selected node served, newest
//! first, kept so a rollback can release one of them again (SPEC 4.5).
//!
//! An entry is written when the desired state is served everywhere, not when
//! it is applied: a build that never got past its canary is not a rollback
//! target. A state served again (a rollback, or a return to it) moves to the
//! front with the new time rather than appearing twice.

use genswap_crds::{HistoryEntry, InstanceGenerationSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// How many entries are kept.
pub const HISTORY_KEPT: usize = 5;

/// Whether `entry` is `spec`'s desired state.
pub(super) fn is_desired(entry: &HistoryEntry, spec: &InstanceGenerationSpec) -> bool {
    entry.build == spec.build.id
        && entry.sha256 == spec.build.sha256
        && entry.config_rev == spec.config_rev
        && entry.restart_id == spec.restart_id
}

/// Records that every selected node serves `spec`'s desired state now.
pub(super) fn record(history: &mut Vec<HistoryEntry>, spec: &InstanceGenerationSpec, now: &Time) {
    let same = |entry: &HistoryEntry| is_desired(entry, spec);
    if history.first().is_some_and(same) {
        return;
    }
    history.retain(|entry| !same(entry));
    history.insert(
        0,
        HistoryEntry {
            build: spec.build.id.clone(),
            sha256: spec.build.sha256.clone(),
            artifact: (&spec.build.artifact).into(),
            entrypoint: spec.build.entrypoint.clone(),
            config_rev: spec.config_rev.clone(),
            restart_id: spec.restart_id.clone(),
            at: now.clone(),
        },
    );
    history.truncate(HISTORY_KEPT);
}
