//! The attempt gate (SPEC §5.3) and the names every part uses for an
//! instance and an attempt.
//!
//! The engine asks the gate three times per attempt: at admission, right
//! before the successor's exec, and at the switch. A refusal ends the attempt
//! `abandoned`; nothing of the build may run after one. Both adapters (the
//! Kubernetes intake and the standalone intake) use [`NewestRevisionGate`].
//!
//! Every [`GateRefusal`] is `stale` for the one classifier (SPEC §5.4): the
//! attempt ends `abandoned`, and `executed` is whatever the attempt proved
//! before the refusal.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use thiserror::Error;

/// One instance on this node: an InstanceGeneration's namespace and name.
///
/// Both parts are Kubernetes names (a namespace is a DNS label, a name a DNS
/// subdomain), checked by [`InstanceKey::new`]. Its text form
/// `<namespace>.<name>` parses back unambiguously because a namespace has no
/// dot; it names the instance's directories and files unless it is too long
/// for them ([`crate::disk_name::DiskName`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceKey {
    namespace: String,
    name: String,
}

/// Why a namespace or name cannot name an instance.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum InstanceKeyError {
    #[error(
        "namespace {0:?} is not a Kubernetes namespace name (1-63 of a-z, 0-9, '-', starting and ending alphanumeric)"
    )]
    Namespace(String),
    #[error(
        "name {0:?} is not a Kubernetes object name (1-253 of a-z, 0-9, '-', '.', starting and ending alphanumeric)"
    )]
    Name(String),
    #[error("{0:?} is not an instance key of the form <namespace>.<name>")]
    Form(String),
}

impl InstanceKey {
    /// Checks both parts and builds the key.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
    ) -> Result<Self, InstanceKeyError> {
        let namespace = namespace.into();
        let name = name.into();
        if !is_dns_name(&namespace, 63, false) {
            return Err(InstanceKeyError::Namespace(namespace));
        }
        if !is_dns_name(&name, 253, true) {
            return Err(InstanceKeyError::Name(name));
        }
        Ok(Self { namespace, name })
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The InstanceGeneration's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// A DNS label (no dots) or subdomain (dots allowed between labels), as
/// Kubernetes names are checked.
fn is_dns_name(s: &str, max: usize, dots: bool) -> bool {
    let bytes = s.as_bytes();
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && bytes.len() <= max
        && bytes.first().is_some_and(alnum)
        && bytes.last().is_some_and(alnum)
        && bytes
            .iter()
            .all(|b| alnum(b) || *b == b'-' || (dots && *b == b'.'))
        && !(dots && s.contains(".."))
}

impl fmt::Display for InstanceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.namespace, self.name)
    }
}

impl FromStr for InstanceKey {
    type Err = InstanceKeyError;

    /// Parses `<namespace>.<name>`, splitting at the first dot.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (namespace, name) = s
            .split_once('.')
            .ok_or_else(|| InstanceKeyError::Form(s.to_string()))?;
        Self::new(namespace, name)
    }
}

impl serde::Serialize for InstanceKey {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for InstanceKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Which attempt the gate is asked about.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttemptId {
    pub instance: InstanceKey,
    /// The attempt's scheduler revision; a higher one supersedes it.
    pub sched_rev: i64,
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} schedRev {}", self.instance, self.sched_rev)
    }
}

/// Where in an attempt the gate is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatePoint {
    /// Before anything of the attempt happens on the host.
    Admission,
    /// Immediately before the successor's exec.
    Exec,
    /// Immediately before `current.sock` moves to the successor.
    Switch,
}

impl fmt::Display for GatePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GatePoint::Admission => "admission",
            GatePoint::Exec => "exec",
            GatePoint::Switch => "switch",
        })
    }
}

/// Why the gate refused an attempt. Every refusal is `stale` (SPEC §5.4):
/// the attempt ends `abandoned` and nothing of the build runs after it.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GateRefusal {
    #[error(
        "superseded: a newer attempt (schedRev {newest}) exists for this instance; it replaces this one"
    )]
    Superseded { newest: i64 },
    #[error(
        "this agent does not own the node: another agent holds the node lock (during a rolling update the new agent waits for the old one)"
    )]
    NotOwner,
    #[error("the agent is shutting down; the controller will issue a fresh attempt")]
    ShuttingDown,
    #[error("swaps are off on this node (--swap=off); turn them on to run attempts")]
    SwapsOff,
}

/// The attempt gate the engine calls at each [`GatePoint`].
///
/// Implementations answer from memory and quickly: the engine calls `check`
/// from async code, never across an await.
pub trait AttemptGate: Send + Sync {
    /// `Ok` when the attempt may go on past `point`.
    fn check(&self, point: GatePoint, attempt: &AttemptId) -> Result<(), GateRefusal>;

    /// `Ok` when the supervisor's restart of `instance` may go on past
    /// `point`. No API attempt supersedes a restart: it starts again what
    /// the last `done` installed, and a newer attempt finds the instance
    /// busy or already restarted. By default only the attempts' own gate
    /// decides, at a revision nothing supersedes.
    fn check_restart(&self, point: GatePoint, instance: &InstanceKey) -> Result<(), GateRefusal> {
        self.check(
            point,
            &AttemptId {
                instance: instance.clone(),
                sched_rev: i64::MAX,
            },
        )
    }
}

/// The gate both adapters use: the newest schedRev seen per instance, node
/// ownership, shutdown and the swaps-off switch.
///
/// It starts not owning the node; the holder of the node's `flock` calls
/// [`NewestRevisionGate::set_owner`]. The checks run in a fixed order
/// (swaps off, shutting down, not owner, superseded) so the reason reported
/// is the one a human must fix first.
#[derive(Debug, Default)]
pub struct NewestRevisionGate {
    newest: Mutex<HashMap<InstanceKey, i64>>,
    owner: AtomicBool,
    shutting_down: AtomicBool,
    swaps_off: AtomicBool,
}

impl NewestRevisionGate {
    /// A gate that does not own the node yet, with swaps on or off.
    pub fn new(swaps_enabled: bool) -> Self {
        let gate = Self::default();
        gate.swaps_off.store(!swaps_enabled, Ordering::SeqCst);
        gate
    }

    /// Records that an attempt with `rev` exists for `instance`; returns the
    /// newest revision known for it afterwards. Lower revisions never lower it.
    pub fn observe(&self, instance: &InstanceKey, rev: i64) -> i64 {
        let mut newest = self.lock_newest();
        let entry = newest.entry(instance.clone()).or_insert(rev);
        *entry = (*entry).max(rev);
        *entry
    }

    /// The newest revision seen for `instance`, if any.
    pub fn newest(&self, instance: &InstanceKey) -> Option<i64> {
        self.lock_newest().get(instance).copied()
    }

    /// Forgets an instance (its InstanceGeneration was deleted).
    pub fn forget(&self, instance: &InstanceKey) {
        self.lock_newest().remove(instance);
    }

    /// Set by the holder of the node lock when it gains or loses it.
    pub fn set_owner(&self, owns_node: bool) {
        self.owner.store(owns_node, Ordering::SeqCst);
    }

    /// Set once when the agent begins to shut down.
    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Turns swaps off (`--swap=off`) or on.
    pub fn set_swaps_enabled(&self, enabled: bool) {
        self.swaps_off.store(!enabled, Ordering::SeqCst);
    }

    /// The map holds plain integers, so a panic elsewhere cannot leave it
    /// half-updated: a poisoned lock is still safe to use.
    fn lock_newest(&self) -> std::sync::MutexGuard<'_, HashMap<InstanceKey, i64>> {
        self.newest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl AttemptGate for NewestRevisionGate {
    fn check(&self, _point: GatePoint, attempt: &AttemptId) -> Result<(), GateRefusal> {
        if self.swaps_off.load(Ordering::SeqCst) {
            return Err(GateRefusal::SwapsOff);
        }
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(GateRefusal::ShuttingDown);
        }
        if !self.owner.load(Ordering::SeqCst) {
            return Err(GateRefusal::NotOwner);
        }
        match self.newest(&attempt.instance) {
            Some(newest) if newest > attempt.sched_rev => Err(GateRefusal::Superseded { newest }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> InstanceKey {
        InstanceKey::new("default", "web.app").expect("valid key")
    }

    fn attempt(rev: i64) -> AttemptId {
        AttemptId {
            instance: key(),
            sched_rev: rev,
        }
    }

    fn owned_gate() -> NewestRevisionGate {
        let gate = NewestRevisionGate::new(true);
        gate.set_owner(true);
        gate
    }

    const POINTS: [GatePoint; 3] = [GatePoint::Admission, GatePoint::Exec, GatePoint::Switch];

    #[test]
    fn newest_attempt_passes_at_every_point() {
        let gate = owned_gate();
        gate.observe(&key(), 4);
        for point in POINTS {
            assert_eq!(gate.check(point, &attempt(4)), Ok(()), "{point}");
        }
    }

    #[test]
    fn an_attempt_newer_than_any_seen_passes() {
        let gate = owned_gate();
        gate.observe(&key(), 4);
        assert_eq!(gate.check(GatePoint::Admission, &attempt(5)), Ok(()));
    }

    #[test]
    fn older_revision_is_superseded_naming_the_newest() {
        let gate = owned_gate();
        gate.observe(&key(), 3);
        assert_eq!(gate.check(GatePoint::Exec, &attempt(3)), Ok(()));
        gate.observe(&key(), 7);
        for point in POINTS {
            let refusal = gate.check(point, &attempt(3)).expect_err("superseded");
            assert_eq!(refusal, GateRefusal::Superseded { newest: 7 });
            assert!(refusal.to_string().contains("schedRev 7"), "{refusal}");
        }
    }

    #[test]
    fn observing_an_older_revision_never_lowers_the_newest() {
        let gate = owned_gate();
        assert_eq!(gate.observe(&key(), 9), 9);
        assert_eq!(gate.observe(&key(), 2), 9);
        assert_eq!(gate.newest(&key()), Some(9));
        assert_eq!(
            gate.check(GatePoint::Switch, &attempt(8)),
            Err(GateRefusal::Superseded { newest: 9 })
        );
    }

    #[test]
    fn revisions_are_per_instance() {
        let gate = owned_gate();
        let other = InstanceKey::new("default", "other").expect("valid key");
        gate.observe(&other, 100);
        gate.observe(&key(), 1);
        assert_eq!(gate.check(GatePoint::Admission, &attempt(1)), Ok(()));
        gate.forget(&other);
        assert_eq!(gate.newest(&other), None);
    }

    #[test]
    fn a_gate_that_does_not_own_the_node_refuses() {
        let gate = NewestRevisionGate::new(true);
        gate.observe(&key(), 1);
        let refusal = gate
            .check(GatePoint::Admission, &attempt(1))
            .expect_err("not owner");
        assert_eq!(refusal, GateRefusal::NotOwner);
        assert!(refusal.to_string().contains("node lock"), "{refusal}");
        gate.set_owner(true);
        assert_eq!(gate.check(GatePoint::Admission, &attempt(1)), Ok(()));
        gate.set_owner(false);
        assert_eq!(
            gate.check(GatePoint::Switch, &attempt(1)),
            Err(GateRefusal::NotOwner)
        );
    }

    #[test]
    fn shutting_down_refuses_at_every_point() {
        let gate = owned_gate();
        gate.observe(&key(), 1);
        gate.set_shutting_down();
        for point in POINTS {
            assert_eq!(
                gate.check(point, &attempt(1)),
                Err(GateRefusal::ShuttingDown)
            );
        }
    }

    #[test]
    fn swaps_off_refuses_first() {
        let gate = NewestRevisionGate::new(false);
        gate.set_shutting_down();
        let refusal = gate
            .check(GatePoint::Admission, &attempt(1))
            .expect_err("swaps off");
        assert_eq!(refusal, GateRefusal::SwapsOff);
        assert!(refusal.to_string().contains("--swap=off"), "{refusal}");
        let gate = owned_gate();
        gate.set_swaps_enabled(false);
        assert_eq!(
            gate.check(GatePoint::Exec, &attempt(1)),
            Err(GateRefusal::SwapsOff)
        );
    }

    #[test]
    fn instance_keys_round_trip_and_refuse_unsafe_names() {
        let parsed: InstanceKey = "default.web.app".parse().expect("parses");
        assert_eq!(parsed, key());
        assert_eq!(parsed.to_string(), "default.web.app");
        let json = serde_json::to_string(&parsed).expect("serializes");
        assert_eq!(json, "\"default.web.app\"");
        let back: InstanceKey = serde_json::from_str(&json).expect("deserializes");
        assert_eq!(back, parsed);
        for (ns, name) in [
            ("", "a"),
            ("a", ""),
            ("a.b", "c"),
            ("a", "../etc"),
            ("a", "b/c"),
            ("A", "b"),
            ("a", "b..c"),
            ("a", "-b"),
            ("a", "b."),
        ] {
            assert!(InstanceKey::new(ns, name).is_err(), "{ns:?} {name:?}");
        }
        assert!("nodot".parse::<InstanceKey>().is_err());
    }
}
