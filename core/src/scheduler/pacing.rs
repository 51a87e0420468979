//! Which status writes may wait: a status that only records progress while
//! attempts are still in flight is superseded within seconds by the one
//! that records their outcomes. On a real API server a status write of an
//! InstanceGeneration costs more server CPU than anything else the
//! controller sends (docs/BENCHMARKS.md), so the adapter may put such a
//! write off for a moment and let the next outcome carry it.
//!
//! Never put off: a reservation (a raised `schedRev`), a change of any
//! condition's status or reason (what `kubectl wait`, Argo CD and Flux
//! read), of the desired state, the failure book or the retry token, and
//! anything with a Warning.

use genswap_crds::InstanceGenerationStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::PlanEvent;

/// Whether writing `next` over `previous` may wait for the outcomes of the
/// `in_flight` attempts (a status that does not change has nothing to wait).
pub(super) fn status_may_wait(
    previous: Option<&InstanceGenerationStatus>,
    next: &InstanceGenerationStatus,
    in_flight: usize,
    events: &[PlanEvent],
) -> bool {
    let Some(previous) = previous else {
        return false;
    };
    previous != next
        && in_flight > 0
        && !events.iter().any(|event| event.warning)
        && previous.sched_rev == next.sched_rev
        && previous.observed_generation == next.observed_generation
        && previous.desired == next.desired
        && previous.held_down == next.held_down
        && previous.last_retry == next.last_retry
        && previous.listeners == next.listeners
        && previous.history == next.history
        && same_states(&previous.conditions, &next.conditions)
}

/// The same conditions with the same status and reason (messages and
/// transition times aside).
fn same_states(previous: &[Condition], next: &[Condition]) -> bool {
    let state = |c: &Condition| {
        (
            c.type_.clone(),
            c.status.clone(),
            c.reason.clone(),
            c.observed_generation,
        )
    };
    previous.len() == next.len() && previous.iter().map(state).eq(next.iter().map(state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: Some(1),
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
        }
    }

    fn status(ready: &str, message: &str) -> InstanceGenerationStatus {
        InstanceGenerationStatus {
            sched_rev: 3,
            ready: Some(ready.into()),
            conditions: vec![condition("Ready", "False", "RolloutInProgress", message)],
            ..Default::default()
        }
    }

    #[test]
    fn progress_with_attempts_in_flight_may_wait() {
        let before = status("1/3", "1/3 nodes serve b");
        let after = status("2/3", "2/3 nodes serve b");
        assert!(status_may_wait(Some(&before), &after, 1, &[]));
        assert!(
            !status_may_wait(Some(&before), &before, 1, &[]),
            "nothing to write, nothing put off"
        );
    }

    #[test]
    fn nothing_in_flight_a_new_reservation_a_condition_or_a_warning_goes_out_at_once() {
        let before = status("1/3", "1/3 nodes serve b");
        let after = status("2/3", "2/3 nodes serve b");
        assert!(!status_may_wait(Some(&before), &after, 0, &[]));
        assert!(!status_may_wait(None, &after, 1, &[]));

        let mut reserved = after.clone();
        reserved.sched_rev = 4;
        assert!(!status_may_wait(Some(&before), &reserved, 1, &[]));

        let mut ready = after.clone();
        ready.conditions = vec![condition("Ready", "True", "AllNodesReady", "all")];
        assert!(!status_may_wait(Some(&before), &ready, 1, &[]));

        let warning = PlanEvent {
            warning: true,
            reason: "SwapFailed".into(),
            message: "node a".into(),
        };
        assert!(!status_may_wait(Some(&before), &after, 1, &[warning]));
    }
}
