//! Names, labels and the complete SwapAttempt object.

use std::collections::BTreeMap;

use genswap_crds::{BuildSpec, Cause, GROUP, HistoryEntry, SwapAttempt, SwapAttemptSpec, VERSION};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::Context;

/// Label on every attempt: the InstanceGeneration's name.
pub const LABEL_INSTANCE: &str = "genswap.dev/instance";
/// Label on every attempt: the node it is for.
pub const LABEL_NODE: &str = "genswap.dev/node";

/// Object names are DNS subdomains: at most 253 characters.
const MAX_NAME_LEN: usize = 253;
/// Label values: at most 63 characters.
const MAX_LABEL_VALUE_LEN: usize = 63;
/// 16 hex digits of a 64-bit digest.
const DIGEST_LEN: usize = 16;

/// `<ig>-<node>-<schedRev>`. Node names may be 253 characters long, so a
/// name that would not fit keeps a readable prefix and ends with a digest of
/// the (instance, node) pair, keeping it unique and the revision visible.
pub fn attempt_name(instance: &str, node: &str, sched_rev: i64) -> String {
    let name = format!("{instance}-{node}-{sched_rev}");
    if name.len() <= MAX_NAME_LEN {
        return name;
    }
    let suffix = format!("-{:016x}-{sched_rev}", digest(&[instance, node]));
    let room = MAX_NAME_LEN - suffix.len();
    let prefix: String = format!("{instance}-{node}").chars().take(room).collect();
    let prefix = prefix.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    format!("{prefix}{suffix}")
}

/// Label on every inbox ConfigMap: the node it is for.
pub const LABEL_INBOX: &str = "genswap.dev/inbox-node";
const INBOX_PREFIX: &str = "genswap-inbox-";

/// The ConfigMap that lists `node`'s attempts for its agent
/// (the controller's `inbox`): `genswap-inbox-<node>`, or a readable prefix and a
/// digest of the node when that would pass 253 characters.
pub fn inbox_name(node: &str) -> String {
    let name = format!("{INBOX_PREFIX}{node}");
    if name.len() <= MAX_NAME_LEN {
        return name;
    }
    let suffix = format!("-{:016x}", digest(&[node]));
    let prefix: String = name.chars().take(MAX_NAME_LEN - suffix.len()).collect();
    let prefix = prefix.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    format!("{prefix}{suffix}")
}

/// An inbox entry's value: the attempt as `<namespace>/<name>` (its key is
/// the attempt's uid, always a valid ConfigMap key).
pub fn inbox_entry(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The (namespace, name) of an inbox entry's value.
pub fn parse_inbox_entry(value: &str) -> Option<(&str, &str)> {
    value
        .split_once('/')
        .filter(|(namespace, name)| !namespace.is_empty() && !name.is_empty())
}

/// `value` when it is a valid label value; otherwise a valid one made from
/// it (allowed characters, at most 63, a digest of the whole for uniqueness).
/// Instance and node names are DNS subdomains and may be too long for a label.
pub fn label_value(value: &str) -> String {
    if is_label_value(value) {
        return value.to_string();
    }
    let allowed: String = value
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(MAX_LABEL_VALUE_LEN - DIGEST_LEN - 1)
        .collect();
    let allowed = allowed.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let digest = format!("{:016x}", digest(&[value]));
    if allowed.is_empty() {
        digest
    } else {
        format!("{allowed}-{digest}")
    }
}

fn is_label_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    value.is_empty()
        || (bytes.len() <= MAX_LABEL_VALUE_LEN
            && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
            && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')))
}

/// FNV-1a over the parts with a separator: stable across Rust releases and
/// platforms, unlike the std hasher, so names never change under an upgrade.
fn digest(parts: &[&str]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for (index, part) in parts.iter().enumerate() {
        if index > 0 {
            hash = (hash ^ 0xff).wrapping_mul(PRIME);
        }
        for byte in part.bytes() {
            hash = (hash ^ u64::from(byte)).wrapping_mul(PRIME);
        }
    }
    hash
}

/// The complete attempt: metadata the adapter creates as is, and a snapshot
/// of the spec as it is now (an attempt never changes after creation).
pub(super) fn build_attempt(
    ctx: &Context<'_>,
    node: &str,
    sched_rev: i64,
    cause: Cause,
    canary: bool,
    restore: Option<&HistoryEntry>,
    stage_only: bool,
) -> SwapAttempt {
    let spec = ctx.spec;
    // A restore runs the good build as it was, with today's settings.
    let (build, config_rev, restart_id) = match restore {
        Some(good) => (
            BuildSpec {
                signed_by: None,
                signature: None,
                id: good.build.clone(),
                artifact: (&good.artifact).into(),
                sha256: good.sha256.clone(),
                entrypoint: good.entrypoint.clone(),
            },
            good.config_rev.clone(),
            good.restart_id.clone(),
        ),
        None => (
            spec.build.clone(),
            spec.config_rev.clone(),
            spec.restart_id.clone(),
        ),
    };
    let labels = BTreeMap::from([
        (LABEL_INSTANCE.to_string(), label_value(ctx.name)),
        (LABEL_NODE.to_string(), label_value(node)),
    ]);
    // Without a uid (standalone mode reads YAML files) there is no owner to
    // reference; the API server always sets one.
    let owner_references = ctx.uid.map(|uid| {
        vec![OwnerReference {
            api_version: format!("{GROUP}/{VERSION}"),
            kind: "InstanceGeneration".into(),
            name: ctx.name.to_string(),
            uid: uid.to_string(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]
    });
    SwapAttempt {
        metadata: ObjectMeta {
            name: Some(attempt_name(ctx.name, node, sched_rev)),
            namespace: ctx.namespace.map(str::to_string),
            labels: Some(labels),
            owner_references,
            ..ObjectMeta::default()
        },
        spec: SwapAttemptSpec {
            instance: ctx.name.to_string(),
            node_name: node.to_string(),
            sched_rev,
            cause,
            kind: spec.kind,
            build,
            mode: spec.mode,
            demand: spec.demand,
            config_rev,
            restart_id,
            canary,
            process: spec.process.clone(),
            health: spec.health.clone(),
            liveness: spec.liveness.clone(),
            lifecycle: spec.lifecycle.clone(),
            settle: spec.settle.clone(),
            stop: spec.stop.clone(),
            resources: spec.resources.clone(),
            socket: spec.socket.clone(),
            listeners: spec.listeners.clone(),
            restart_policy: spec.restart_policy,
            sidecars: spec.sidecars.clone(),
            stage_only,
        },
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_are_the_plain_triple() {
        assert_eq!(attempt_name("web", "node-a", 7), "web-node-a-7");
    }

    #[test]
    fn long_names_fit_stay_unique_and_keep_the_revision() {
        let node_a = format!("{}a", "n".repeat(250));
        let node_b = format!("{}b", "n".repeat(250));
        let a = attempt_name("web", &node_a, 12);
        let b = attempt_name("web", &node_b, 12);
        assert!(a.len() <= MAX_NAME_LEN, "{} chars", a.len());
        assert!(a.ends_with("-12"), "{a}");
        assert!(a.starts_with("web-nnnn"), "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn label_values_are_kept_when_valid_and_repaired_when_not() {
        assert_eq!(
            label_value("ip-10-0-0-1.ec2.internal"),
            "ip-10-0-0-1.ec2.internal"
        );
        let long = format!("{}.example", "x".repeat(80));
        let repaired = label_value(&long);
        assert!(is_label_value(&repaired), "{repaired}");
        assert_ne!(
            repaired,
            label_value(&format!("{}.example", "x".repeat(81)))
        );
    }

    #[test]
    fn inbox_names_fit_and_stay_unique() {
        assert_eq!(inbox_name("node-a"), "genswap-inbox-node-a");
        let a = inbox_name(&format!("{}a", "n".repeat(250)));
        let b = inbox_name(&format!("{}b", "n".repeat(250)));
        assert!(a.len() <= MAX_NAME_LEN, "{} chars", a.len());
        assert!(a.starts_with("genswap-inbox-nnnn"), "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn inbox_entries_round_trip_and_refuse_a_missing_half() {
        let entry = inbox_entry("apps", "web-node-a-3");
        assert_eq!(parse_inbox_entry(&entry), Some(("apps", "web-node-a-3")));
        assert_eq!(parse_inbox_entry("apps"), None);
        assert_eq!(parse_inbox_entry("/web"), None);
        assert_eq!(parse_inbox_entry("apps/"), None);
    }
}
