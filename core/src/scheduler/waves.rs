//! Waves (SPEC 4.2): the canary cohort first, then the other nodes one
//! value of `rollout.waves.byLabel` at a time, each wave finished (every
//! node serving the desired state, or held when the rollout does not halt)
//! and baked for `rollout.bakeSeconds` before the next one starts. Without
//! `rollout.waves` the nodes after the canaries are one wave.
//!
//! The order is a pure function of the nodes' labels and the spec, and a
//! wave's end is read from the records (the newest `since` of its nodes),
//! so a restarted controller or a new leader finds the same wave without
//! any state of its own.

use std::collections::BTreeSet;

use genswap_crds::WavesSpec;

/// The canary cohort's wave.
pub const CANARY: &str = "canary";
/// The wave of every node after the canaries, without `rollout.waves`.
pub const ALL: &str = "all";
/// The wave of the nodes without the label, which go last.
pub const UNLABELLED: &str = "(unlabelled)";

/// The waves of one plan: their names in order (the canaries' first) and
/// each selected node's place among them.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Waves {
    pub names: Vec<String>,
    /// Parallel to the selected nodes.
    pub of_node: Vec<usize>,
}

/// The waves of the selected nodes, given in name order with their value
/// of the waves' label; the first `canaries` of them are the canaries.
pub(super) fn assign(spec: Option<&WavesSpec>, values: &[Option<&str>], canaries: usize) -> Waves {
    let Some(spec) = spec else {
        return Waves {
            names: vec![CANARY.to_string(), ALL.to_string()],
            of_node: (0..values.len())
                .map(|index| usize::from(index >= canaries))
                .collect(),
        };
    };
    let present: BTreeSet<&str> = values
        .iter()
        .skip(canaries)
        .filter_map(|value| *value)
        .collect();
    let mut order: Vec<&str> = Vec::with_capacity(present.len() + 1);
    for value in &spec.order {
        if present.contains(value.as_str()) && !order.contains(&value.as_str()) {
            order.push(value);
        }
    }
    for value in &present {
        if !spec.order.iter().any(|listed| listed == value) {
            order.push(value);
        }
    }
    let unlabelled = order.len() + 1;
    let of_node = values
        .iter()
        .enumerate()
        .map(|(index, value)| {
            if index < canaries {
                return 0;
            }
            match value {
                Some(value) => order
                    .iter()
                    .position(|listed| listed == value)
                    .map_or(unlabelled, |place| place + 1),
                None => unlabelled,
            }
        })
        .collect::<Vec<_>>();
    let mut names = vec![CANARY.to_string()];
    names.extend(order.iter().map(|value| value.to_string()));
    if of_node.contains(&unlabelled) {
        names.push(UNLABELLED.to_string());
    }
    Waves { names, of_node }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waves(order: &[&str]) -> WavesSpec {
        WavesSpec {
            by_label: "topology.kubernetes.io/zone".into(),
            order: order.iter().map(|v| v.to_string()).collect(),
        }
    }

    #[test]
    fn without_waves_everything_after_the_canaries_is_one_wave() {
        let assigned = assign(None, &[None, Some("a"), None], 1);
        assert_eq!(assigned.names, ["canary", "all"]);
        assert_eq!(assigned.of_node, [0, 1, 1]);
    }

    #[test]
    fn values_go_by_name_after_those_listed_and_unlabelled_nodes_go_last() {
        let values = [
            Some("zone-c"),
            Some("zone-b"),
            None,
            Some("zone-a"),
            Some("zone-c"),
            Some("zone-b"),
        ];
        let assigned = assign(Some(&waves(&["zone-c", "zone-x"])), &values, 1);
        assert_eq!(
            assigned.names,
            ["canary", "zone-c", "zone-a", "zone-b", "(unlabelled)"]
        );
        assert_eq!(assigned.of_node, [0, 3, 4, 2, 1, 3]);
    }

    #[test]
    fn a_value_only_the_canaries_have_makes_no_wave() {
        let assigned = assign(Some(&waves(&[])), &[Some("z1"), Some("z2")], 1);
        assert_eq!(assigned.names, ["canary", "z2"]);
        assert_eq!(assigned.of_node, [0, 1]);
    }
}
