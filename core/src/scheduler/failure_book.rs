//! The failure book: which (build, mode) failed where, and the one-attempt
//! retry allowance that a change of `spec.retry` arms.

use genswap_crds::{HeldDown, Mode};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// `status.heldDown`, one entry per (build, mode, node) that failed.
pub(super) struct FailureBook {
    entries: Vec<HeldDown>,
}

/// A failure to book.
pub(super) struct Failure<'a> {
    pub build: &'a str,
    pub mode: Mode,
    pub node: &'a str,
    pub reason: &'a str,
    pub since: &'a Time,
    /// The failed attempt was the armed retry: its allowance is spent.
    pub was_retry: bool,
}

impl FailureBook {
    pub(super) fn new(entries: Vec<HeldDown>) -> Self {
        Self { entries }
    }

    pub(super) fn entries(&self) -> &[HeldDown] {
        &self.entries
    }

    pub(super) fn into_entries(self) -> Vec<HeldDown> {
        self.entries
    }

    /// Entries of (build, mode), in booking order.
    pub(super) fn holds<'s>(
        &'s self,
        build: &'s str,
        mode: Mode,
    ) -> impl Iterator<Item = &'s HeldDown> + 's {
        self.entries
            .iter()
            .filter(move |e| e.build == build && e.mode == mode)
    }

    /// Whether (build, mode) may not be started on `node` on its own: with
    /// `halt` any entry stops every node, without it only the failed node.
    pub(super) fn blocks(&self, build: &str, mode: Mode, node: &str, halt: bool) -> bool {
        self.holds(build, mode).any(|e| halt || e.node == node)
    }

    /// Whether a retry allowance covers `node` (see [`Self::blocks`]).
    pub(super) fn armed_for(&self, build: &str, mode: Mode, node: &str, halt: bool) -> bool {
        self.holds(build, mode)
            .any(|e| e.retry_armed && (halt || e.node == node))
    }

    /// Books a failed or down outcome. A node that fails again keeps one
    /// entry with the newest reason.
    pub(super) fn book(&mut self, failure: Failure<'_>, halt: bool) {
        if failure.was_retry {
            self.disarm(failure.build, failure.mode, failure.node, halt);
        }
        let existing = self
            .entries
            .iter_mut()
            .find(|e| e.build == failure.build && e.mode == failure.mode && e.node == failure.node);
        match existing {
            Some(entry) => {
                entry.reason = failure.reason.to_string();
                entry.since = failure.since.clone();
                entry.retry_armed = false;
            }
            None => self.entries.push(HeldDown {
                build: failure.build.to_string(),
                mode: failure.mode,
                node: failure.node.to_string(),
                reason: failure.reason.to_string(),
                since: failure.since.clone(),
                retry_armed: false,
            }),
        }
    }

    /// A `done` of (build, mode) on `node` proves the build works there: its
    /// entry goes. A done retry under `halt` lifts the whole hold, since that
    /// hold stopped every node.
    pub(super) fn lift(&mut self, build: &str, mode: Mode, node: &str, whole: bool) {
        self.entries
            .retain(|e| !(e.build == build && e.mode == mode && (whole || e.node == node)));
    }

    /// Spends the retry allowance that covered `node`.
    pub(super) fn disarm(&mut self, build: &str, mode: Mode, node: &str, halt: bool) {
        for entry in &mut self.entries {
            if entry.build == build && entry.mode == mode && (halt || entry.node == node) {
                entry.retry_armed = false;
            }
        }
    }

    /// Arms every entry of (build, mode). Returns how many there are.
    pub(super) fn arm(&mut self, build: &str, mode: Mode) -> usize {
        let mut armed = 0;
        for entry in &mut self.entries {
            if entry.build == build && entry.mode == mode {
                entry.retry_armed = true;
                armed += 1;
            }
        }
        armed
    }
}

/// Records `token` (the spec's `retry`) in `status.lastRetry` and says
/// whether it differs from the one recorded before. No record yet means no
/// change: a fresh object never arms a retry by itself.
pub(super) fn observe_retry_token(last_retry: &mut Option<String>, token: &str) -> bool {
    let changed = last_retry.as_deref().is_some_and(|last| last != token);
    if last_retry.as_deref() != Some(token) {
        *last_retry = Some(token.to_string());
    }
    changed
}
