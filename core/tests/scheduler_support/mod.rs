//! Builders and a tiny in-memory "API server" for the scheduler scenarios.
//!
//! [`World`] keeps the objects the API server would store (one
//! InstanceGeneration, its SwapAttempts, the Nodes) and applies plans the way
//! the adapter does: status first, then creates, then deletes. Agents are
//! played by [`World::finish`], which writes an outcome on an attempt.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};

use genswap_core::scheduler::{self, OwnReservation, Plan, Revisions};
use genswap_crds::{
    Cause, InstanceGeneration, InstanceGenerationSpec, InstanceGenerationStatus, Mode,
    NodeGeneration, Outcome, ServingStatus, SwapAttempt, SwapAttemptStatus,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use serde_json::json;

/// No attempts, typed for [`scheduler::plan`].
pub const NO_ATTEMPTS: &[SwapAttempt] = &[];

/// Seconds since the epoch where every scenario starts.
pub const T0: i64 = 1_800_000_000;

pub fn at(seconds: i64) -> Timestamp {
    Timestamp::from_second(seconds).expect("a timestamp in range")
}

pub fn time(seconds: i64) -> Time {
    Time(at(seconds))
}

/// A node with labels.
pub fn node(name: &str, labels: &[(&str, &str)]) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// Nodes without labels.
pub fn nodes(names: &[&str]) -> Vec<Node> {
    names.iter().map(|n| node(n, &[])).collect()
}

/// A fake but well-formed digest, distinct per build id.
pub fn sha(build: &str) -> String {
    let hex: String = build.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{hex:0<64}")
}

/// A spec as `kubectl apply` of the smallest object would give: every
/// default filled in by serde, as the API server's defaulting would.
///
/// Without `rollout.prestage`: these scenarios are about the swaps that
/// follow it, and count their revisions; `scheduler_prestage.rs` plans
/// with it, as the default is.
pub fn spec(build: &str) -> InstanceGenerationSpec {
    serde_json::from_value(json!({
        "build": {
            "id": build,
            "artifact": { "path": format!("/srv/builds/{build}") },
            "sha256": sha(build),
        },
        "rollout": { "prestage": false },
    }))
    .expect("a valid spec")
}

/// InstanceGeneration `web` in namespace `prod`, as stored (uid, generation).
pub fn ig(spec: InstanceGenerationSpec) -> InstanceGeneration {
    let mut ig = InstanceGeneration::new("web", spec);
    ig.metadata.namespace = Some("prod".into());
    ig.metadata.uid = Some("uid-web".into());
    ig.metadata.generation = Some(1);
    ig
}

/// A status entry for a node serving `build` (config and restart empty).
pub fn serving(node: &str, build: &str, generation: i64) -> NodeGeneration {
    NodeGeneration {
        name: node.into(),
        attention: None,
        generation: Some(generation),
        build: Some(build.into()),
        sha256: Some(sha(build)),
        config_rev: Some(String::new()),
        restart_id: Some(String::new()),
        since: Some(time(T0 - 3600)),
        serving: Some(true),
        restarts: None,
        last_exit: None,
        last_attempt: None,
        sidecars: Vec::new(),
    }
}

/// How an agent ends an attempt.
#[derive(Clone, Debug)]
pub struct Finish {
    pub outcome: Outcome,
    pub executed: bool,
    pub reason: String,
    /// The mode that ran; the attempt's spec mode when `None`.
    pub mode: Option<Mode>,
}

pub fn done() -> Finish {
    Finish {
        outcome: Outcome::Done,
        executed: true,
        reason: String::new(),
        mode: None,
    }
}

pub fn failed(reason: &str) -> Finish {
    Finish {
        outcome: Outcome::Failed,
        executed: true,
        reason: reason.into(),
        mode: None,
    }
}

pub fn down(reason: &str) -> Finish {
    Finish {
        outcome: Outcome::Down,
        executed: true,
        reason: reason.into(),
        mode: Some(Mode::Hold),
    }
}

pub fn abandoned(executed: bool) -> Finish {
    Finish {
        outcome: Outcome::Abandoned,
        executed,
        reason: "superseded or refused by the gate".into(),
        mode: None,
    }
}

impl Finish {
    pub fn ran_as(mut self, mode: Mode) -> Self {
        self.mode = Some(mode);
        self
    }
}

/// The objects an API server would hold for one InstanceGeneration.
#[derive(Clone)]
pub struct World {
    pub ig: InstanceGeneration,
    pub attempts: Vec<SwapAttempt>,
    pub nodes: Vec<Node>,
    /// Seconds since the epoch.
    pub now: i64,
    /// Every revision ever created, in order: the proof that none repeats.
    pub issued: Vec<i64>,
    /// The generation counter of each node's agent.
    generations: BTreeMap<String, i64>,
    /// Plans reserve ahead and issue from the controller's reservation in
    /// hand (`own`), as the controller does; off: every plan reserves
    /// exactly what it issues, as standalone mode does.
    pub ahead: bool,
    pub own: Option<OwnReservation>,
    /// Whether a status that may wait is put off (the controller's
    /// progress hold still running).
    pub put_off_progress: bool,
    /// Attempts issued with no reservation write, and status writes put
    /// off: what the ahead mode did.
    pub issued_in_hand: usize,
    pub put_off: usize,
}

impl World {
    pub fn new(ig: InstanceGeneration, nodes: Vec<Node>) -> Self {
        Self {
            ig,
            attempts: Vec::new(),
            nodes,
            now: T0,
            issued: Vec::new(),
            generations: BTreeMap::new(),
            ahead: false,
            own: None,
            put_off_progress: false,
            issued_in_hand: 0,
            put_off: 0,
        }
    }

    /// The plan for the stored objects, without applying it.
    pub fn plan(&self) -> Plan {
        if !self.ahead {
            return scheduler::plan(&self.ig, &self.attempts, &self.nodes, at(self.now));
        }
        let revisions = Revisions {
            own: self.own,
            ahead: true,
        };
        scheduler::plan_with(
            &self.ig,
            &self.attempts,
            &self.nodes,
            at(self.now),
            revisions,
        )
    }

    /// One reconcile: plan, write records, status, create, delete.
    pub fn reconcile(&mut self) -> Plan {
        let plan = self.plan();
        self.apply(&plan);
        plan
    }

    /// Applies `plan` as the adapters do: records, status, creates, deletes.
    fn apply(&mut self, plan: &Plan) {
        self.write_records(plan);
        self.write_status(plan);
        for attempt in &plan.create {
            self.store(attempt.clone());
        }
        self.delete(&plan.delete);
    }

    /// One reconcile as the adapters make it with `rollout.analysis`: when
    /// the plan asks for a measurement, `answer` gives Prometheus's answers
    /// to its queries, and the plan is made again from the record that
    /// carries the measurement.
    pub fn reconcile_measuring(
        &mut self,
        mut answer: impl FnMut(&scheduler::AnalysisRequest) -> Vec<scheduler::Answer>,
    ) -> Plan {
        let first = self.plan();
        let Some(request) = first.analysis.clone() else {
            return self.reconcile();
        };
        let verdict = scheduler::judge(&request.queries, &answer(&request));
        let ig = self.ig.clone();
        let plan = scheduler::measured(first, &verdict, &ig, &time(self.now), |measured| {
            let stored = std::mem::replace(&mut self.ig, measured.clone());
            let plan = self.plan();
            self.ig = stored;
            plan
        });
        self.apply(&plan);
        plan
    }

    /// A reconcile whose status write (the reservation) succeeds and whose
    /// creates all fail: the revisions are burned.
    pub fn reconcile_dropping_creates(&mut self) -> Plan {
        let plan = self.plan();
        self.write_records(&plan);
        self.write_status(&plan);
        plan
    }

    /// The status write as the adapter makes it: refused unless every
    /// create is above what was reserved before or within the reservation
    /// in hand; put off when it may wait and the hold runs; then the
    /// reservation in hand updated.
    fn write_status(&mut self, plan: &Plan) {
        let previous = self.status().sched_rev;
        assert!(
            plan.status.sched_rev >= previous,
            "status.schedRev went back from {previous} to {}",
            plan.status.sched_rev
        );
        let own = self.own.filter(|own| own.reserved == previous);
        let lowest_free = own.map_or(previous, |own| own.issued);
        for attempt in &plan.create {
            assert!(
                attempt.spec.sched_rev > lowest_free,
                "rev {} issued at or below {lowest_free}, the newest issued or reserved by another",
                attempt.spec.sched_rev
            );
            assert!(attempt.spec.sched_rev <= plan.status.sched_rev);
        }
        let put_off = self.put_off_progress && plan.status_may_wait;
        if plan.status.sched_rev == previous {
            self.issued_in_hand += plan.create.len();
        }
        if put_off {
            assert_eq!(
                plan.status.sched_rev, previous,
                "a status that may wait reserves nothing"
            );
            self.put_off += 1;
        } else {
            self.ig.status = Some(plan.status.clone());
        }
        let newest_created = plan.create.iter().map(|a| a.spec.sched_rev).max();
        if !put_off && plan.status.sched_rev > previous {
            self.own = Some(OwnReservation {
                issued: newest_created.unwrap_or(plan.status.sched_rev),
                reserved: plan.status.sched_rev,
            });
        } else if let (Some(own), Some(issued)) = (own, newest_created) {
            self.own = Some(OwnReservation { issued, ..own });
        }
    }

    /// Each record onto its attempt's annotations, as the adapter's merge
    /// patch does.
    fn write_records(&mut self, plan: &Plan) {
        for write in &plan.records {
            assert!(
                write.write_onto(&mut self.attempts),
                "a record is written onto an attempt that exists"
            );
        }
    }

    fn store(&mut self, mut attempt: SwapAttempt) {
        let rev = attempt.spec.sched_rev;
        assert!(
            !self.issued.contains(&rev),
            "revision {rev} issued twice (history {:?})",
            self.issued
        );
        self.issued.push(rev);
        attempt.metadata.creation_timestamp = Some(time(self.now));
        self.attempts.push(attempt);
    }

    fn delete(&mut self, names: &[String]) {
        self.attempts
            .retain(|a| !names.contains(a.metadata.name.as_ref().expect("a name")));
    }

    pub fn status(&self) -> InstanceGenerationStatus {
        self.ig.status.clone().unwrap_or_default()
    }

    /// A user edit of the spec: the API server bumps metadata.generation.
    pub fn edit(&mut self, change: impl FnOnce(&mut InstanceGenerationSpec)) {
        change(&mut self.ig.spec);
        self.ig.metadata.generation = Some(self.ig.metadata.generation.unwrap_or(0) + 1);
    }

    pub fn advance(&mut self, seconds: i64) {
        self.now += seconds;
    }

    /// The agent on `node` ends that node's newest attempt.
    pub fn finish(&mut self, node: &str, finish: Finish) {
        let rev = self
            .newest(node)
            .unwrap_or_else(|| panic!("no attempt on {node}"))
            .spec
            .sched_rev;
        self.finish_rev(rev, finish);
    }

    /// The agent ends the attempt with revision `rev`.
    pub fn finish_rev(&mut self, rev: i64, finish: Finish) {
        let now = self.now;
        let attempt = self
            .attempts
            .iter_mut()
            .find(|a| a.spec.sched_rev == rev)
            .unwrap_or_else(|| panic!("no attempt with rev {rev}"));
        assert!(attempt.status.is_none(), "rev {rev} already has an outcome");
        let counter = self
            .generations
            .entry(attempt.spec.node_name.clone())
            .or_insert(0);
        *counter += 1;
        attempt.status = Some(SwapAttemptStatus {
            outcome: Some(finish.outcome),
            effective_mode: Some(finish.mode.unwrap_or(attempt.spec.mode)),
            generation: Some(*counter),
            reason: Some(finish.reason),
            executed: Some(finish.executed),
            finished_at: Some(time(now)),
            ..SwapAttemptStatus::default()
        });
    }

    /// The agent on `node` writes `serving` on that node's newest `done`
    /// attempt, as its supervisor does between attempts.
    pub fn report_serving(&mut self, node: &str, serving: ServingStatus) {
        let attempt = self
            .attempts
            .iter_mut()
            .filter(|a| {
                a.spec.node_name == node
                    && a.status.as_ref().and_then(|s| s.outcome) == Some(Outcome::Done)
            })
            .max_by_key(|a| a.spec.sched_rev)
            .unwrap_or_else(|| panic!("no done attempt on {node}"));
        if let Some(status) = attempt.status.as_mut() {
            status.serving = Some(serving);
        }
    }

    pub fn newest(&self, node: &str) -> Option<&SwapAttempt> {
        self.attempts
            .iter()
            .filter(|a| a.spec.node_name == node)
            .max_by_key(|a| a.spec.sched_rev)
    }

    /// `node rev` of every attempt without an outcome, newest per node only.
    pub fn in_flight(&self) -> Vec<String> {
        let nodes: BTreeSet<&str> = self
            .attempts
            .iter()
            .map(|a| a.spec.node_name.as_str())
            .collect();
        nodes
            .into_iter()
            .filter_map(|n| self.newest(n))
            .filter(|a| a.status.is_none())
            .map(|a| format!("{} rev{}", a.spec.node_name, a.spec.sched_rev))
            .collect()
    }

    /// Ends every in-flight attempt with `done`.
    pub fn finish_all_done(&mut self) {
        let revs: Vec<i64> = self
            .attempts
            .iter()
            .filter(|a| a.status.is_none())
            .map(|a| a.spec.sched_rev)
            .collect();
        for rev in revs {
            self.finish_rev(rev, done());
        }
    }

    /// Reconciles and finishes everything with `done` until a plan has
    /// nothing left to write: nothing issued or in flight, every record
    /// written and every old attempt gone.
    pub fn roll_out(&mut self) {
        for _ in 0..100 {
            let plan = self.reconcile();
            let quiet = plan.create.is_empty() && plan.records.is_empty() && plan.delete.is_empty();
            if quiet && self.in_flight().is_empty() {
                return;
            }
            self.finish_all_done();
        }
        panic!("the rollout did not settle in 100 reconciles");
    }
}

/// `node revN cause [canary]` for each attempt a plan creates.
pub fn created(plan: &Plan) -> Vec<String> {
    plan.create
        .iter()
        .map(|a| {
            let cause = serde_json::to_value(a.spec.cause).expect("a cause serializes");
            let cause = cause.as_str().unwrap_or_default().to_string();
            format!(
                "{} rev{} {cause}{}",
                a.spec.node_name,
                a.spec.sched_rev,
                if a.spec.canary { " canary" } else { "" }
            )
        })
        .collect()
}

/// `Reason: message` of each event.
pub fn events(plan: &Plan) -> Vec<String> {
    plan.events
        .iter()
        .map(|e| {
            format!(
                "{}{}: {}",
                if e.warning { "!" } else { "" },
                e.reason,
                e.message
            )
        })
        .collect()
}

/// The event reasons only, warnings marked with `!`.
pub fn event_reasons(plan: &Plan) -> Vec<String> {
    plan.events
        .iter()
        .map(|e| format!("{}{}", if e.warning { "!" } else { "" }, e.reason))
        .collect()
}

/// `True Reason` / `False Reason` of condition `type_`.
pub fn condition(status: &InstanceGenerationStatus, type_: &str) -> String {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| format!("{} {}", c.status, c.reason))
        .unwrap_or_else(|| "absent".into())
}

/// The message of condition `type_`.
pub fn message(status: &InstanceGenerationStatus, type_: &str) -> String {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.message.clone())
        .unwrap_or_default()
}

/// `Ready / Reconciling / Stalled` in one line.
pub fn kstatus(status: &InstanceGenerationStatus) -> String {
    format!(
        "Ready={} | Reconciling={} | Stalled={}",
        condition(status, "Ready"),
        condition(status, "Reconciling"),
        condition(status, "Stalled")
    )
}

/// `build/mode@node armed?` of each held-down entry.
pub fn held(status: &InstanceGenerationStatus) -> Vec<String> {
    status
        .held_down
        .iter()
        .map(|h| {
            format!(
                "{}/{}@{}{}",
                h.build,
                if h.mode == Mode::Hold {
                    "hold"
                } else {
                    "overlap"
                },
                h.node,
                if h.retry_armed { " armed" } else { "" }
            )
        })
        .collect()
}

/// The node's status entry.
pub fn entry<'s>(status: &'s InstanceGenerationStatus, node: &str) -> &'s NodeGeneration {
    status
        .nodes
        .iter()
        .find(|n| n.name == node)
        .unwrap_or_else(|| panic!("no status entry for {node}"))
}

/// The cause of every created attempt, for tables.
pub fn causes(plan: &Plan) -> Vec<Cause> {
    plan.create.iter().map(|a| a.spec.cause).collect()
}
