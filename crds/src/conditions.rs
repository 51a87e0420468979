//! The one way to set a status condition, shared by the controller and the agent.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// The kstatus condition types genswap reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionType {
    /// Every selected node serves the desired state (IG); the successor serves (attempt).
    Ready,
    /// Work is in flight.
    Reconciling,
    /// Progress needs a human.
    Stalled,
}

impl ConditionType {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionType::Ready => "Ready",
            ConditionType::Reconciling => "Reconciling",
            ConditionType::Stalled => "Stalled",
        }
    }
}

/// Sets condition `type_` in `conditions`, keeping `lastTransitionTime` when
/// the status did not change so that dashboards show how long a state has held.
/// Returns whether anything changed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: ConditionType,
    status: bool,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
    now: &Time,
) -> bool {
    let status = if status { "True" } else { "False" }.to_string();
    let next = |last_transition_time: Time| Condition {
        type_: type_.as_str().to_string(),
        status: status.clone(),
        reason: reason.to_string(),
        message: message.to_string(),
        observed_generation,
        last_transition_time,
    };
    match conditions.iter_mut().find(|c| c.type_ == type_.as_str()) {
        Some(existing) => {
            let kept = if existing.status == status {
                existing.last_transition_time.clone()
            } else {
                now.clone()
            };
            let updated = next(kept);
            let changed = *existing != updated;
            *existing = updated;
            changed
        }
        None => {
            conditions.push(next(now.clone()));
            true
        }
    }
}

/// Whether condition `type_` is present with status True.
pub fn is_true(conditions: &[Condition], type_: ConditionType) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_.as_str() && c.status == "True")
}

/// The reason condition `type_` gives while it is True: what a transition
/// into a state is recognised by, once, whoever counts it.
pub fn true_reason(conditions: &[Condition], type_: ConditionType) -> Option<&str> {
    conditions
        .iter()
        .find(|c| c.type_ == type_.as_str() && c.status == "True")
        .map(|c| c.reason.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).expect("valid timestamp"))
    }

    #[test]
    fn keeps_transition_time_when_status_holds() {
        let mut conditions = Vec::new();
        assert!(set_condition(
            &mut conditions,
            ConditionType::Ready,
            false,
            "RolloutInProgress",
            "1/3",
            Some(1),
            &at(100)
        ));
        assert!(set_condition(
            &mut conditions,
            ConditionType::Ready,
            false,
            "RolloutInProgress",
            "2/3",
            Some(1),
            &at(200)
        ));
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time, at(100));
        assert_eq!(conditions[0].message, "2/3");
    }

    #[test]
    fn moves_transition_time_when_status_flips() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            ConditionType::Ready,
            false,
            "RolloutInProgress",
            "",
            Some(1),
            &at(100),
        );
        set_condition(
            &mut conditions,
            ConditionType::Ready,
            true,
            "AllNodesReady",
            "",
            Some(2),
            &at(300),
        );
        assert_eq!(conditions[0].last_transition_time, at(300));
        assert_eq!(conditions[0].status, "True");
        assert_eq!(conditions[0].observed_generation, Some(2));
    }

    #[test]
    fn reports_no_change_for_an_identical_condition() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            ConditionType::Stalled,
            true,
            "BuildFailed",
            "b2",
            None,
            &at(1),
        );
        assert!(!set_condition(
            &mut conditions,
            ConditionType::Stalled,
            true,
            "BuildFailed",
            "b2",
            None,
            &at(9)
        ));
        assert!(is_true(&conditions, ConditionType::Stalled));
        assert!(!is_true(&conditions, ConditionType::Ready));
    }

    #[test]
    fn gives_a_reason_only_while_the_condition_is_true() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            ConditionType::Stalled,
            false,
            "ProgressDeadlineExceeded",
            "",
            None,
            &at(1),
        );
        assert_eq!(true_reason(&conditions, ConditionType::Stalled), None);
        set_condition(
            &mut conditions,
            ConditionType::Stalled,
            true,
            "ProgressDeadlineExceeded",
            "",
            None,
            &at(2),
        );
        assert_eq!(
            true_reason(&conditions, ConditionType::Stalled),
            Some("ProgressDeadlineExceeded")
        );
        assert_eq!(true_reason(&conditions, ConditionType::Ready), None);
    }
}
