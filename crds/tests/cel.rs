//! Every CEL rule of both CRDs, evaluated offline against valid and invalid
//! objects with kube's client-side CEL validator (the same rules the API
//! server runs on `kubectl apply`).

use genswap_crds::manifest::parse_instance_generation;
use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::core::cel::{validate_cel, validate_cel_update};

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

fn valid() -> serde_json::Value {
    let ig = parse_instance_generation(VALID).expect("the valid fixture parses");
    serde_json::to_value(ig).expect("serializes")
}

/// Applies `edit` to the valid object and returns the CEL verdict as text.
fn verdict(edit: impl FnOnce(&mut serde_json::Value)) -> Result<(), String> {
    let mut v = valid();
    edit(&mut v);
    let ig: InstanceGeneration = serde_json::from_value(v).map_err(|e| format!("type: {e}"))?;
    validate_cel(&ig).map_err(|e| e.to_string())
}

fn assert_refused(edit: impl FnOnce(&mut serde_json::Value), message: &str) {
    match verdict(edit) {
        Ok(()) => panic!("expected a refusal naming {message:?}, the object passed"),
        Err(e) => assert!(
            e.contains(message),
            "refusal {e:?} does not name {message:?}"
        ),
    }
}

#[test]
fn the_valid_fixture_passes() {
    verdict(|_| {}).expect("valid object passes every rule");
}

#[test]
fn sha256_must_be_64_lowercase_hex() {
    let msg = "build.sha256 must be 64 lowercase hex characters";
    assert_refused(|v| v["spec"]["build"]["sha256"] = "abc".into(), msg);
    assert_refused(
        |v| {
            v["spec"]["build"]["sha256"] =
                "2C26B46B68FFC68FF99B453C1D30413413422D706483BFA0F98A5E886266E7AE".into()
        },
        msg,
    );
    assert_refused(
        |v| v["spec"]["build"]["sha256"] = format!("{}0", "a".repeat(64)).into(),
        msg,
    );
}

#[test]
fn build_id_must_not_be_empty() {
    assert_refused(
        |v| v["spec"]["build"]["id"] = "".into(),
        "build.id must be 1 to 128 characters",
    );
}

#[test]
fn artifact_needs_exactly_one_of_path_and_url() {
    let msg = "build.artifact needs exactly one of path and url";
    assert_refused(
        |v| v["spec"]["build"]["artifact"] = serde_json::json!({}),
        msg,
    );
    assert_refused(
        |v| {
            v["spec"]["build"]["artifact"] = serde_json::json!({"path": "/a", "url": "https://x/a"})
        },
        msg,
    );
    verdict(|v| {
        v["spec"]["build"]["artifact"] = serde_json::json!({"url": "http://example.com/a"})
    })
    .expect("a url alone passes");
}

#[test]
fn artifact_path_must_be_absolute() {
    assert_refused(
        |v| v["spec"]["build"]["artifact"]["path"] = "staging/app".into(),
        "build.artifact.path must be an absolute path",
    );
}

#[test]
fn artifact_url_must_be_http_or_https() {
    let msg = "build.artifact.url must be an http or https URL";
    for url in [
        "ftp://example.com/a",
        "file:///etc/passwd",
        "https://",
        "example.com/a",
    ] {
        assert_refused(
            |v| v["spec"]["build"]["artifact"] = serde_json::json!({ "url": url }),
            msg,
        );
    }
}

#[test]
fn timeouts_must_be_positive() {
    assert_refused(
        |v| v["spec"]["health"]["timeoutSeconds"] = 0.into(),
        "health.timeoutSeconds must be greater than 0",
    );
    assert_refused(
        |v| v["spec"]["stop"]["timeoutSeconds"] = (-1).into(),
        "stop.timeoutSeconds must be greater than 0",
    );
    assert_refused(
        |v| v["spec"]["settle"]["seconds"] = (-1).into(),
        "settle.seconds must not be negative",
    );
    verdict(|v| v["spec"]["settle"]["seconds"] = 0.into()).expect("no settle window is allowed");
}

#[test]
fn health_path_must_start_with_a_slash() {
    assert_refused(
        |v| v["spec"]["health"]["path"] = "healthz".into(),
        "health.path must start with /",
    );
}

#[test]
fn rollout_bounds() {
    assert_refused(
        |v| v["spec"]["rollout"]["maxParallel"] = 0.into(),
        "rollout.maxParallel must be at least 1",
    );
    assert_refused(
        |v| v["spec"]["rollout"]["canaryNodes"] = (-1).into(),
        "rollout.canaryNodes must not be negative",
    );
    verdict(|v| v["spec"]["rollout"]["canaryNodes"] = 0.into())
        .expect("no canary cohort is allowed");
}

#[test]
fn user_and_group_must_be_non_negative() {
    assert_refused(
        |v| v["spec"]["process"]["user"] = (-1).into(),
        "process.user must be a non-negative numeric uid",
    );
    assert_refused(
        |v| v["spec"]["process"]["group"] = (-5).into(),
        "process.group must be a non-negative numeric gid",
    );
    verdict(|v| v["spec"]["process"]["user"] = 0.into())
        .expect("uid 0 is the agent's call, not the schema's");
}

#[test]
fn working_dir_must_be_absolute() {
    assert_refused(
        |v| v["spec"]["process"]["workingDir"] = "srv".into(),
        "process.workingDir must be an absolute path",
    );
}

#[test]
fn resource_limits_must_be_positive_quantities() {
    assert_refused(
        |v| v["spec"]["resources"]["memoryMax"] = "lots".into(),
        "resources.memoryMax must be a positive quantity",
    );
    assert_refused(
        |v| v["spec"]["resources"]["memoryMax"] = "0".into(),
        "resources.memoryMax must be a positive quantity",
    );
    assert_refused(
        |v| v["spec"]["resources"]["cpuMax"] = "-1".into(),
        "resources.cpuMax must be a positive quantity",
    );
    assert_refused(
        |v| v["spec"]["resources"]["pidsMax"] = 0.into(),
        "resources.pidsMax must be at least 1",
    );
    verdict(|v| {
        v["spec"]["resources"] =
            serde_json::json!({"memoryMax": "512Mi", "cpuMax": "500m", "pidsMax": 64})
    })
    .expect("well-formed limits pass");
    verdict(|v| v["spec"]["resources"]["memoryMax"] = 1048576.into())
        .expect("a plain byte count passes");
}

#[test]
fn listeners_are_validated() {
    let listener = |json: serde_json::Value| {
        move |v: &mut serde_json::Value| v["spec"]["listeners"] = serde_json::json!([json])
    };
    verdict(|v| {
        v["spec"]["listeners"] = serde_json::json!([
            {"name": "dns", "tcp": "0.0.0.0:53"},
            {"name": "admin", "tcp": "[::1]:8080", "backlog": 128},
            {"name": "local", "unix": "/run/app/app.sock"},
        ])
    })
    .expect("well-formed listeners pass");
    assert_refused(
        listener(serde_json::json!({"name": "both", "tcp": "127.0.0.1:80", "unix": "/run/a.sock"})),
        "a listener needs exactly one of tcp and unix",
    );
    assert_refused(
        listener(serde_json::json!({"name": "none"})),
        "a listener needs exactly one of tcp and unix",
    );
    for bad in [
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "localhost:80",
        "127.0.0.1",
        "::1:80",
    ] {
        assert_refused(
            listener(serde_json::json!({"name": "web", "tcp": bad})),
            "listener tcp must be <IPv4>:<port> or [<IPv6>]:<port>",
        );
    }
    assert_refused(
        listener(serde_json::json!({"name": "web", "unix": "run/app.sock"})),
        "listener unix must be an absolute path",
    );
    assert_refused(
        listener(serde_json::json!({"name": "web", "unix": format!("/{}", "s".repeat(107))})),
        "listener unix must be an absolute path of at most 107 bytes",
    );
    assert_refused(
        listener(serde_json::json!({"name": "Web_1", "tcp": "127.0.0.1:80"})),
        "a listener's name must be 1 to 63",
    );
    assert_refused(
        listener(serde_json::json!({"name": "web", "tcp": "127.0.0.1:80", "backlog": 0})),
        "listener backlog must be from 1 to 65535",
    );
    assert_refused(
        |v| {
            v["spec"]["listeners"] = (0..9)
                .map(|n| serde_json::json!({"name": format!("l{n}"), "tcp": format!("127.0.0.1:{}", 8000 + n)}))
                .collect()
        },
        "at most 8 listeners",
    );
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
        settle: ig.spec.settle.clone(),
        stop: ig.spec.stop.clone(),
        resources: ig.spec.resources.clone(),
        socket: ig.spec.socket.clone(),
        listeners: ig.spec.listeners.clone(),
        restart_policy: ig.spec.restart_policy,
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
