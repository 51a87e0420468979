//! Every CEL rule of both CRDs, evaluated offline against valid and invalid
//! objects with kube's client-side CEL validator: fast, and refereed by the
//! real API server (`apiserver.rs` runs the same schema table there).

mod support;

use genswap_crds::manifest::parse_instance_generation;
use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::core::cel::{validate_cel, validate_cel_update};
use support::schema_table::{self, By};

const VALID: &str = r#"
apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata: {name: app, namespace: default}
spec:
  build:
    id: app-1
    artifact: {path: /var/lib/genswap/staging/app-1}
    sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
"#;

/// Every case of the schema table that a CEL rule refuses, refused by
/// kube's `validate_cel` of the typed object in the table's words (the
/// table's cases that the structural schema refuses are not CEL's; the
/// standalone reader checks those, `schema_table.rs`).
#[test]
fn every_rule_of_the_schema_table_is_enforced_on_typed_objects() {
    let mut wrong = Vec::new();
    for case in schema_table::refused() {
        let Some((By::Rule, says)) = &case.refusal else {
            continue;
        };
        let verdict = serde_json::from_value::<InstanceGeneration>(case.object.clone())
            .map_err(|e| format!("type: {e}"))
            .and_then(|ig| validate_cel(&ig).map_err(|e| e.to_string()));
        match verdict {
            Err(message) if message.contains(says.as_str()) => {}
            other => wrong.push(format!("{}: expected {says:?}, got {other:?}", case.what)),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_accepted_case_of_the_schema_table_passes_every_rule() {
    for case in schema_table::accepted() {
        let ig: InstanceGeneration = serde_json::from_value(case.object.clone())
            .unwrap_or_else(|e| panic!("{}: {e}", case.what));
        validate_cel(&ig).unwrap_or_else(|e| panic!("{}: {e}", case.what));
    }
}

fn attempt() -> SwapAttempt {
    let ig = parse_instance_generation(VALID).expect("fixture parses");
    let spec = genswap_crds::SwapAttemptSpec {
        instance: "app".into(),
        node_name: "node-a".into(),
        sched_rev: 3,
        cause: genswap_crds::Cause::Install,
        kind: ig.spec.kind,
        build: ig.spec.build.clone(),
        mode: ig.spec.mode,
        demand: ig.spec.demand,
        config_rev: ig.spec.config_rev.clone(),
        restart_id: ig.spec.restart_id.clone(),
        canary: true,
        process: ig.spec.process.clone(),
        health: ig.spec.health.clone(),
        liveness: None,
        lifecycle: None,
        settle: ig.spec.settle.clone(),
        stop: ig.spec.stop.clone(),
        resources: ig.spec.resources.clone(),
        socket: ig.spec.socket.clone(),
        listeners: ig.spec.listeners.clone(),
        restart_policy: ig.spec.restart_policy,
        sidecars: ig.spec.sidecars.clone(),
        stage_only: false,
    };
    SwapAttempt::new("app-node-a-3", spec)
}

#[test]
fn swap_attempt_spec_is_immutable() {
    let old = attempt();
    validate_cel(&old).expect("a fresh attempt passes");
    validate_cel_update(&old, &old).expect("an unchanged spec passes");
    let mut changed = old.clone();
    changed.spec.sched_rev = 4;
    let err = validate_cel_update(&changed, &old).expect_err("a changed spec is refused");
    assert!(
        err.to_string().contains("SwapAttempt spec is immutable"),
        "{err}"
    );
}

#[test]
fn swap_attempt_sched_rev_starts_at_one() {
    let mut a = attempt();
    a.spec.sched_rev = 0;
    let err = validate_cel(&a).expect_err("revision 0 is refused");
    assert!(
        err.to_string().contains("schedRev must be at least 1"),
        "{err}"
    );
}

#[test]
fn swap_attempt_carries_the_same_build_rules() {
    let mut a = attempt();
    a.spec.build.sha256 = "nope".into();
    let err = validate_cel(&a).expect_err("a bad digest is refused on attempts too");
    assert!(err.to_string().contains("build.sha256"), "{err}");
}
