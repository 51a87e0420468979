//! Which watched SwapAttempt runs when (SPEC §5.1, §5.3): a synchronous
//! state machine with no I/O. The agent feeds it what the watch sees and
//! what finished, and carries out the [`Decision`]s it returns.
//!
//! Rules:
//! - Every attempt seen raises the gate's newest revision for its instance
//!   ([`NewestRevisionGate::observe`]): a newer attempt arriving while an
//!   older one runs is what makes the gate refuse the older one at its next
//!   check.
//! - At most one attempt per instance runs; different instances run in
//!   parallel. A newer attempt that arrives while one runs waits (only the
//!   newest waits); one it displaces from the queue is abandoned unrun.
//! - An attempt older than the newest seen never runs: it is abandoned with
//!   `executed: false`, reason "superseded by schedRev N".
//! - An attempt that has `status.outcome`, whose outcome the journal holds
//!   ([`Intake::mark_decided`]), or that this agent already took, never runs
//!   again.
//! - Until the agent owns the node ([`Intake::open`]) nothing is decided:
//!   the watch stays warm and only the gate learns revisions. After a
//!   shutdown begins ([`Intake::close`]) nothing new runs.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use genswap_crds::SwapAttempt;

use crate::gate::{InstanceKey, NewestRevisionGate};

/// What the agent must do next.
#[derive(Clone, Debug)]
pub enum Decision {
    /// Run this attempt now.
    Run {
        instance: InstanceKey,
        attempt: Arc<SwapAttempt>,
    },
    /// Report this attempt abandoned without running it (`executed: false`).
    Abandon {
        /// `None` when the attempt names no valid instance.
        instance: Option<InstanceKey>,
        attempt: Arc<SwapAttempt>,
        reason: String,
    },
    /// End the running attempt `sched_rev` of `instance` through its cancel
    /// token.
    Cancel {
        instance: InstanceKey,
        sched_rev: i64,
        why: String,
    },
}

/// One instance's attempts.
#[derive(Debug, Default)]
struct Slot {
    /// The revision running now.
    running: Option<i64>,
    /// The newest attempt, waiting for the running one to end.
    queued: Option<Arc<SwapAttempt>>,
    /// Revisions that will never run here: taken, reported, or finished.
    decided: BTreeSet<i64>,
}

impl Slot {
    fn is_idle(&self) -> bool {
        self.running.is_none() && self.queued.is_none() && self.decided.is_empty()
    }
}

/// The intake's memory. See the module docs.
#[derive(Debug)]
pub struct Intake {
    node: String,
    gate: Arc<NewestRevisionGate>,
    open: bool,
    slots: HashMap<InstanceKey, Slot>,
    /// `<namespace>/<name>` of attempts that name no valid instance and were
    /// reported once.
    refused: HashSet<String>,
}

impl Intake {
    /// A closed intake for `node`, observing revisions into `gate`.
    pub fn new(node: impl Into<String>, gate: Arc<NewestRevisionGate>) -> Self {
        Self {
            node: node.into(),
            gate,
            open: false,
            slots: HashMap::new(),
            refused: HashSet::new(),
        }
    }

    /// Whether attempts are being decided (the node is owned, no shutdown).
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// The agent owns the node: decide from now on. The caller offers every
    /// attempt the watch holds again right after.
    pub fn open(&mut self) {
        self.open = true;
    }

    /// Shutdown: nothing new runs; queued attempts are left for the next
    /// agent, unreported.
    pub fn close(&mut self) {
        self.open = false;
        for slot in self.slots.values_mut() {
            slot.queued = None;
        }
    }

    /// `instance`'s attempt `sched_rev` must never run here (the journal
    /// holds its outcome, or it was in flight when the last agent stopped).
    pub fn mark_decided(&mut self, instance: &InstanceKey, sched_rev: i64) {
        self.gate.observe(instance, sched_rev);
        self.slots
            .entry(instance.clone())
            .or_default()
            .decided
            .insert(sched_rev);
    }

    /// Whether `instance`'s attempt `sched_rev` is running.
    pub fn is_running(&self, instance: &InstanceKey, sched_rev: i64) -> bool {
        self.slots
            .get(instance)
            .is_some_and(|slot| slot.running == Some(sched_rev))
    }

    /// Only teaches the gate `attempt`'s revision (an attempt of the
    /// initial list, decided once the list is complete).
    pub fn observe(&mut self, attempt: &SwapAttempt) {
        if attempt.spec.node_name != self.node {
            return;
        }
        let namespace = attempt.metadata.namespace.clone().unwrap_or_default();
        if let Ok(instance) = InstanceKey::new(namespace, attempt.spec.instance.clone()) {
            self.gate.observe(&instance, attempt.spec.sched_rev);
        }
    }

    /// The watch saw `attempt` (added, changed, or listed).
    pub fn offer(&mut self, attempt: Arc<SwapAttempt>) -> Vec<Decision> {
        if attempt.spec.node_name != self.node {
            return Vec::new();
        }
        let namespace = attempt.metadata.namespace.clone().unwrap_or_default();
        let instance = match InstanceKey::new(namespace.clone(), attempt.spec.instance.clone()) {
            Ok(instance) => instance,
            Err(error) => return self.refuse(attempt, &namespace, error.to_string()),
        };
        let rev = attempt.spec.sched_rev;
        let newest = self.gate.observe(&instance, rev);
        if !self.open {
            return Vec::new();
        }
        let slot = self.slots.entry(instance.clone()).or_default();
        if attempt
            .status
            .as_ref()
            .is_some_and(|status| status.outcome.is_some())
        {
            slot.decided.insert(rev);
            if slot
                .queued
                .as_ref()
                .is_some_and(|q| q.spec.sched_rev == rev)
            {
                slot.queued = None;
            }
            return Vec::new();
        }
        if slot.decided.contains(&rev) || slot.running == Some(rev) {
            return Vec::new();
        }
        if let Some(queued) = slot.queued.as_mut()
            && queued.spec.sched_rev == rev
        {
            *queued = attempt;
            return Vec::new();
        }
        if rev < newest {
            slot.decided.insert(rev);
            return vec![superseded(instance, attempt, newest)];
        }
        if slot.running.is_some() {
            let displaced = slot.queued.replace(attempt);
            return match displaced {
                Some(older) => {
                    slot.decided.insert(older.spec.sched_rev);
                    vec![superseded(instance, older, rev)]
                }
                None => Vec::new(),
            };
        }
        slot.running = Some(rev);
        slot.decided.insert(rev);
        vec![Decision::Run { instance, attempt }]
    }

    /// The watch saw `attempt` deleted: a queued one is dropped, a running
    /// one is cancelled (nobody can read its outcome any more).
    pub fn delete(&mut self, attempt: &SwapAttempt) -> Vec<Decision> {
        let namespace = attempt.metadata.namespace.clone().unwrap_or_default();
        let Ok(instance) = InstanceKey::new(namespace.clone(), attempt.spec.instance.clone())
        else {
            let name = attempt.metadata.name.clone().unwrap_or_default();
            self.refused.remove(&format!("{namespace}/{name}"));
            return Vec::new();
        };
        let rev = attempt.spec.sched_rev;
        let Some(slot) = self.slots.get_mut(&instance) else {
            return Vec::new();
        };
        if slot
            .queued
            .as_ref()
            .is_some_and(|q| q.spec.sched_rev == rev)
        {
            slot.queued = None;
        }
        let mut decisions = Vec::new();
        if slot.running == Some(rev) {
            decisions.push(Decision::Cancel {
                instance: instance.clone(),
                sched_rev: rev,
                why: "the SwapAttempt was deleted while it ran".into(),
            });
        }
        // A deleted attempt never comes back under the same name and
        // revision: forgetting it keeps the memory bounded.
        slot.decided.remove(&rev);
        self.forget_if_idle(&instance);
        decisions
    }

    /// Drops `instance`'s slot once none of its attempts is left to run,
    /// wait or be remembered, and the gate's newest revision with it: every
    /// attempt it had is deleted, and a re-created InstanceGeneration of
    /// the same name issues revisions from 1 again.
    fn forget_if_idle(&mut self, instance: &InstanceKey) {
        if self.slots.get(instance).is_some_and(Slot::is_idle) {
            self.slots.remove(instance);
            self.gate.forget(instance);
        }
    }

    /// `instance`'s running attempt `sched_rev` ended (whether or not it ran):
    /// the queued one, if any, runs next.
    pub fn finished(&mut self, instance: &InstanceKey, sched_rev: i64) -> Vec<Decision> {
        let Some(slot) = self.slots.get_mut(instance) else {
            return Vec::new();
        };
        if slot.running == Some(sched_rev) {
            slot.running = None;
        }
        if !self.open || slot.running.is_some() {
            return Vec::new();
        }
        let Some(next) = slot.queued.take() else {
            // Its attempt may have been deleted while it ran.
            self.forget_if_idle(instance);
            return Vec::new();
        };
        let rev = next.spec.sched_rev;
        let newest = self.gate.newest(instance).unwrap_or(rev);
        slot.decided.insert(rev);
        if rev < newest {
            return vec![superseded(instance.clone(), next, newest)];
        }
        slot.running = Some(rev);
        vec![Decision::Run {
            instance: instance.clone(),
            attempt: next,
        }]
    }

    fn refuse(
        &mut self,
        attempt: Arc<SwapAttempt>,
        namespace: &str,
        error: String,
    ) -> Vec<Decision> {
        let has_outcome = attempt
            .status
            .as_ref()
            .is_some_and(|status| status.outcome.is_some());
        let name = attempt.metadata.name.clone().unwrap_or_default();
        if !self.open || has_outcome || !self.refused.insert(format!("{namespace}/{name}")) {
            return Vec::new();
        }
        vec![Decision::Abandon {
            instance: None,
            attempt,
            reason: format!("this attempt names no valid instance: {error}"),
        }]
    }
}

fn superseded(instance: InstanceKey, attempt: Arc<SwapAttempt>, newest: i64) -> Decision {
    Decision::Abandon {
        instance: Some(instance),
        attempt,
        reason: format!("superseded by schedRev {newest}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NODE: &str = "node-a";

    fn attempt(instance: &str, rev: i64) -> Arc<SwapAttempt> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "genswap.dev/v1alpha1",
                "kind": "SwapAttempt",
                "metadata": { "name": format!("{instance}-{NODE}-{rev}"), "namespace": "apps" },
                "spec": {
                    "instance": instance,
                    "nodeName": NODE,
                    "schedRev": rev,
                    "cause": "release",
                    "build": { "id": "b", "artifact": { "path": "/b" }, "sha256": "a".repeat(64) },
                    "mode": "overlap",
                },
            }))
            .expect("fixture attempt"),
        )
    }

    fn with_outcome(attempt: &SwapAttempt) -> Arc<SwapAttempt> {
        let mut attempt = attempt.clone();
        attempt.status = Some(genswap_crds::SwapAttemptStatus {
            outcome: Some(genswap_crds::Outcome::Done),
            ..Default::default()
        });
        Arc::new(attempt)
    }

    fn key(instance: &str) -> InstanceKey {
        InstanceKey::new("apps", instance).expect("key")
    }

    fn open_intake() -> (Intake, Arc<NewestRevisionGate>) {
        let gate = Arc::new(NewestRevisionGate::new(true));
        let mut intake = Intake::new(NODE, gate.clone());
        intake.open();
        (intake, gate)
    }

    /// The decisions as short words, to compare whole sequences.
    fn words(decisions: &[Decision]) -> Vec<String> {
        decisions
            .iter()
            .map(|d| match d {
                Decision::Run { attempt, .. } => format!("run {}", attempt.spec.sched_rev),
                Decision::Abandon {
                    attempt, reason, ..
                } => format!("abandon {}: {reason}", attempt.spec.sched_rev),
                Decision::Cancel { sched_rev, .. } => format!("cancel {sched_rev}"),
            })
            .collect()
    }

    #[test]
    fn one_attempt_per_instance_and_instances_in_parallel() {
        let (mut intake, _) = open_intake();
        assert_eq!(words(&intake.offer(attempt("web", 1))), ["run 1"]);
        assert_eq!(words(&intake.offer(attempt("db", 7))), ["run 7"]);
        assert!(intake.is_running(&key("web"), 1));
        assert!(intake.is_running(&key("db"), 7));
    }

    #[test]
    fn a_newer_attempt_waits_raises_the_gate_and_runs_after() {
        let (mut intake, gate) = open_intake();
        intake.offer(attempt("web", 1));
        assert!(intake.offer(attempt("web", 2)).is_empty());
        assert_eq!(gate.newest(&key("web")), Some(2));
        assert_eq!(words(&intake.finished(&key("web"), 1)), ["run 2"]);
    }

    #[test]
    fn a_queued_attempt_displaced_by_a_newer_one_is_abandoned_unrun() {
        let (mut intake, _) = open_intake();
        intake.offer(attempt("web", 1));
        intake.offer(attempt("web", 2));
        assert_eq!(
            words(&intake.offer(attempt("web", 3))),
            ["abandon 2: superseded by schedRev 3"]
        );
        assert_eq!(words(&intake.finished(&key("web"), 1)), ["run 3"]);
    }

    #[test]
    fn an_attempt_older_than_the_newest_is_abandoned_once() {
        let (mut intake, _) = open_intake();
        intake.offer(attempt("web", 5));
        assert_eq!(
            words(&intake.offer(attempt("web", 4))),
            ["abandon 4: superseded by schedRev 5"]
        );
        assert!(intake.offer(attempt("web", 4)).is_empty(), "reported once");
    }

    #[test]
    fn an_attempt_is_taken_once_and_never_again() {
        let (mut intake, _) = open_intake();
        intake.offer(attempt("web", 1));
        assert!(intake.offer(attempt("web", 1)).is_empty());
        assert!(intake.finished(&key("web"), 1).is_empty());
        assert!(intake.offer(attempt("web", 1)).is_empty(), "not rerun");
    }

    #[test]
    fn an_attempt_with_an_outcome_or_in_the_journal_never_runs() {
        let (mut intake, _) = open_intake();
        assert!(intake.offer(with_outcome(&attempt("web", 1))).is_empty());
        assert!(intake.offer(attempt("web", 1)).is_empty(), "a stale copy");
        intake.mark_decided(&key("db"), 3);
        assert!(intake.offer(attempt("db", 3)).is_empty());
    }

    #[test]
    fn nothing_is_decided_until_open_but_the_gate_learns() {
        let gate = Arc::new(NewestRevisionGate::new(true));
        let mut intake = Intake::new(NODE, gate.clone());
        assert!(intake.offer(attempt("web", 1)).is_empty());
        assert!(intake.offer(attempt("web", 2)).is_empty());
        assert_eq!(gate.newest(&key("web")), Some(2));
        intake.open();
        assert_eq!(
            words(&intake.offer(attempt("web", 1))),
            ["abandon 1: superseded by schedRev 2"]
        );
        assert_eq!(words(&intake.offer(attempt("web", 2))), ["run 2"]);
    }

    #[test]
    fn deleting_drops_a_queued_attempt_and_cancels_a_running_one() {
        let (mut intake, _) = open_intake();
        intake.offer(attempt("web", 1));
        intake.offer(attempt("web", 2));
        assert!(intake.delete(&attempt("web", 2)).is_empty());
        assert!(intake.finished(&key("web"), 1).is_empty(), "2 was dropped");
        intake.offer(attempt("web", 3));
        assert_eq!(words(&intake.delete(&attempt("web", 3))), ["cancel 3"]);
    }

    #[test]
    fn once_every_attempt_is_deleted_a_recreated_object_starts_again_at_1() {
        let (mut intake, gate) = open_intake();
        assert_eq!(words(&intake.offer(attempt("web", 6))), ["run 6"]);
        intake.offer(attempt("web", 7));
        assert_eq!(gate.newest(&key("web")), Some(7));
        // Both go with their object: the running one is cancelled first.
        assert_eq!(words(&intake.delete(&attempt("web", 6))), ["cancel 6"]);
        assert!(intake.delete(&attempt("web", 7)).is_empty());
        assert_eq!(gate.newest(&key("web")), Some(7), "6 is still running");
        assert!(intake.finished(&key("web"), 6).is_empty());
        assert_eq!(gate.newest(&key("web")), None, "nothing of web is left");
        assert_eq!(words(&intake.offer(attempt("web", 1))), ["run 1"]);
    }

    #[test]
    fn closing_runs_nothing_more() {
        let (mut intake, _) = open_intake();
        intake.offer(attempt("web", 1));
        intake.offer(attempt("web", 2));
        intake.close();
        assert!(intake.finished(&key("web"), 1).is_empty());
        assert!(intake.offer(attempt("db", 1)).is_empty());
    }

    #[test]
    fn an_attempt_naming_no_valid_instance_is_abandoned_once() {
        let (mut intake, _) = open_intake();
        let bad = attempt("Not_Valid", 1);
        let decisions = words(&intake.offer(bad.clone()));
        assert_eq!(decisions.len(), 1);
        assert!(
            decisions[0].starts_with("abandon 1: this attempt names no valid instance"),
            "{decisions:?}"
        );
        assert!(intake.offer(bad).is_empty());
    }

    #[test]
    fn attempts_of_other_nodes_are_ignored() {
        let (mut intake, gate) = open_intake();
        let mut other = (*attempt("web", 1)).clone();
        other.spec.node_name = "node-b".into();
        assert!(intake.offer(Arc::new(other)).is_empty());
        assert_eq!(gate.newest(&key("web")), None);
    }
}
