//! A SwapAttempt as the attempt index keeps it between reconciles: the
//! fields the scheduler reads, in a struct a tenth the size of a
//! `SwapAttempt`, built straight from each attempt the watch delivers
//! ([`crate::observe::trim_attempt`] is the same cut as a `SwapAttempt`,
//! plus the metadata, for the bench and the tests to compare against).
//!
//! The index holds every attempt for the replica's life, so its entry is
//! the controller's memory per attempt. A `SwapAttempt` is 1.9 KB before
//! any of its strings (the spec's settings are inline even when trimmed to
//! their defaults), and its labels, owners and record each add a map or a
//! vector: about 5 KiB an attempt measured, where the goal is under 3. The
//! plan still reads `SwapAttempt`s: [`CachedAttempt::to_attempt`] builds
//! one per cached attempt for the reconcile that plans, and drops it after.

use genswap_crds::{
    ANNOTATION_RECORD, Artifact, BuildSpec, Cause, Demand, InstanceKind, Mode, Outcome,
    RestartPolicy, ServingStatus, SocketLayout, SocketSpec, StageProgress, SwapAttempt,
    SwapAttemptSpec, SwapAttemptStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

/// What the scheduler reads of one attempt. Labels and owners are read
/// once, when the index files the attempt; they, the uid, resourceVersion
/// and deletionTimestamp are not kept.
#[derive(Clone, Debug, PartialEq)]
pub struct CachedAttempt {
    name: Box<str>,
    creation_timestamp: Option<Time>,
    record: Option<Box<str>>,
    instance: Box<str>,
    node_name: Box<str>,
    build_id: Box<str>,
    sha256: Box<str>,
    config_rev: Box<str>,
    restart_id: Box<str>,
    sched_rev: i64,
    cause: Cause,
    kind: InstanceKind,
    mode: Mode,
    demand: Demand,
    canary: bool,
    stage_only: bool,
    restart_policy: Option<RestartPolicy>,
    socket_layout: SocketLayout,
    /// Boxed: an attempt not yet taken by its agent has none.
    status: Option<Box<CachedStatus>>,
}

/// What the scheduler reads of an attempt's status: the agent's report
/// without its step timings, conditions, start and listener handover
/// (a `SwapAttemptStatus` is 344 bytes before any of them).
#[derive(Clone, Debug, PartialEq)]
struct CachedStatus {
    outcome: Option<Outcome>,
    effective_mode: Option<Mode>,
    executed: Option<bool>,
    clean_exit: Option<bool>,
    generation: Option<i64>,
    drain_ms: Option<i64>,
    reason: Option<Box<str>>,
    finished_at: Option<Time>,
    /// Bytes staging fetched (a `stageOnly` attempt's progress).
    stage: Option<StageProgress>,
    /// Boxed: only the node's newest `done` attempt has one.
    serving: Option<Box<ServingStatus>>,
}

impl CachedStatus {
    fn of(status: &SwapAttemptStatus) -> CachedStatus {
        CachedStatus {
            outcome: status.outcome,
            effective_mode: status.effective_mode,
            executed: status.executed,
            clean_exit: status.clean_exit,
            generation: status.generation,
            drain_ms: status.drain_ms,
            reason: status.reason.as_deref().map(Box::from),
            finished_at: status.finished_at.clone(),
            stage: status.stage,
            serving: status.serving.clone().map(Box::new),
        }
    }

    fn to_status(&self) -> SwapAttemptStatus {
        SwapAttemptStatus {
            outcome: self.outcome,
            effective_mode: self.effective_mode,
            generation: self.generation,
            reason: self.reason.as_deref().map(str::to_string),
            executed: self.executed,
            clean_exit: self.clean_exit,
            drain_ms: self.drain_ms,
            started_at: None,
            finished_at: self.finished_at.clone(),
            listener_handover: None,
            steps: Vec::new(),
            conditions: Vec::new(),
            stage: self.stage,
            serving: self.serving.as_deref().cloned(),
        }
    }
}

impl CachedAttempt {
    /// The entry for `attempt`.
    pub fn of(attempt: &SwapAttempt) -> CachedAttempt {
        let spec = &attempt.spec;
        CachedAttempt {
            name: attempt.metadata.name.as_deref().unwrap_or_default().into(),
            creation_timestamp: attempt.metadata.creation_timestamp.clone(),
            record: attempt
                .metadata
                .annotations
                .as_ref()
                .and_then(|annotations| annotations.get(ANNOTATION_RECORD))
                .map(|record| record.as_str().into()),
            instance: spec.instance.as_str().into(),
            node_name: spec.node_name.as_str().into(),
            build_id: spec.build.id.as_str().into(),
            sha256: spec.build.sha256.as_str().into(),
            config_rev: spec.config_rev.as_str().into(),
            restart_id: spec.restart_id.as_str().into(),
            sched_rev: spec.sched_rev,
            cause: spec.cause,
            kind: spec.kind,
            mode: spec.mode,
            demand: spec.demand,
            canary: spec.canary,
            stage_only: spec.stage_only,
            restart_policy: spec.restart_policy,
            socket_layout: spec.socket.layout,
            status: attempt
                .status
                .as_ref()
                .map(|status| Box::new(CachedStatus::of(status))),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    pub fn sched_rev(&self) -> i64 {
        self.sched_rev
    }

    /// The node record annotation, if the attempt carries one.
    pub fn record(&self) -> Option<&str> {
        self.record.as_deref()
    }

    /// The attempt as the scheduler reads it: name, namespace, creation
    /// time and record of the metadata; the spec's identity, revision and
    /// desired tuple; the status without steps and conditions.
    pub fn to_attempt(&self, namespace: &str) -> SwapAttempt {
        SwapAttempt {
            metadata: ObjectMeta {
                name: Some(self.name.to_string()),
                namespace: Some(namespace.to_string()),
                creation_timestamp: self.creation_timestamp.clone(),
                annotations: self
                    .record
                    .as_ref()
                    .map(|record| [(ANNOTATION_RECORD.to_string(), record.to_string())].into()),
                ..ObjectMeta::default()
            },
            spec: SwapAttemptSpec {
                instance: self.instance.to_string(),
                node_name: self.node_name.to_string(),
                sched_rev: self.sched_rev,
                cause: self.cause,
                kind: self.kind,
                build: BuildSpec {
                    signed_by: None,
                    signature: None,
                    id: self.build_id.to_string(),
                    sha256: self.sha256.to_string(),
                    artifact: Artifact::default(),
                    entrypoint: None,
                },
                mode: self.mode,
                demand: self.demand,
                config_rev: self.config_rev.to_string(),
                restart_id: self.restart_id.to_string(),
                canary: self.canary,
                restart_policy: self.restart_policy,
                socket: SocketSpec {
                    layout: self.socket_layout,
                },
                process: Default::default(),
                health: Default::default(),
                liveness: None,
                lifecycle: None,
                settle: Default::default(),
                stop: Default::default(),
                resources: Default::default(),
                listeners: Default::default(),
                sidecars: Default::default(),
                stage_only: self.stage_only,
            },
            status: self.status.as_deref().map(CachedStatus::to_status),
        }
    }
}
