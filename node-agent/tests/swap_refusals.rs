//! Attempts refused before anything of the build runs: staging rules, a
//! limit this host cannot apply, swaps off. Each is `abandoned` with
//! `executed: false` (a digest mismatch, the build's own fault, is
//! `failed`), nothing of the build is spawned, and the incumbent keeps
//! serving.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use genswap_crds::{Outcome, ResourcesSpec};
use node_agent::classify::StepOutcome;
use node_agent::engine::{Attempt, EngineConfig, Step, SwapResult};
use swap_host::SwapHost;

/// Runs `attempt` against an installed b1 and checks the refusal rule:
/// abandoned, executed false, the step that refused is stale, b1 serves,
/// nothing of the new build exists.
async fn assert_refused(
    host: &SwapHost,
    attempt: &Attempt,
    step: Step,
    says: &[&str],
) -> SwapResult {
    let before = host.who_serves().await.expect("b1 serves");
    let result = host.swap(attempt).await;
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed, "nothing ran: {result:?}");
    let last = result.steps.last().expect("a step record");
    assert_eq!(
        (last.step, last.result),
        (step, StepOutcome::Stale),
        "{result:?}"
    );
    swap_host::assert_says(&result.reason, says);
    host.assert_still_serves(&before).await;
    result
}

/// Bytes that are not the pinned ones are the build's own failure (it is
/// held down, SPEC 5.14), though nothing of it ran: `failed`, executed
/// false, the stage step failed, b1 serves.
#[tokio::test]
async fn digest_mismatch_fails_the_build_and_nothing_spawns() {
    let host = SwapHost::new("refuse-digest");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");
    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.build.sha256 = "0".repeat(64);
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(!result.executed, "nothing ran: {result:?}");
    let last = result.steps.last().expect("a step record");
    assert_eq!(
        (last.step, last.result),
        (Step::Stage, StepOutcome::Failed),
        "{result:?}"
    );
    swap_host::assert_says(&result.reason, &["digest", "b2"]);
    host.assert_still_serves(&before).await;
    host.tear_down().await;
}

#[tokio::test]
async fn artifact_outside_the_staging_root_is_refused() {
    let host = SwapHost::new("refuse-outside");
    host.install(1, "b1").await;
    let outside = host.staging.parent().expect("temp dir").join("outside");
    fs::create_dir(&outside).expect("outside dir");
    let b2 = swap_host::testapp_build(&outside, "b2");
    let attempt = host.attempt(2, &b2, "b2");
    assert_refused(&host, &attempt, Step::Stage, &["outside the staging root"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn artifact_through_an_escaping_symlink_is_refused() {
    let host = SwapHost::new("refuse-symlink");
    host.install(1, "b1").await;
    let outside = host.staging.parent().expect("temp dir").join("outside");
    fs::create_dir(&outside).expect("outside dir");
    let real = swap_host::testapp_build(&outside, "b2");
    let link = host.staging.join("b2-link");
    std::os::unix::fs::symlink(&real.path, &link).expect("symlink");
    let mut attempt = host.attempt(2, &real, "b2");
    attempt.spec.build.artifact.path = Some(link.display().to_string());
    assert_refused(&host, &attempt, Step::Stage, &["symlink", "b2-link"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn missing_artifact_is_refused() {
    let host = SwapHost::new("refuse-missing");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    fs::remove_file(&b2.path).expect("remove b2");
    let attempt = host.attempt(2, &b2, "b2");
    assert_refused(&host, &attempt, Step::Stage, &["does not exist", "b2"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn artifact_that_is_not_executable_is_refused() {
    let host = SwapHost::new("refuse-noexec");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    fs::set_permissions(&b2.path, fs::Permissions::from_mode(0o644)).expect("chmod");
    let attempt = host.attempt(2, &b2, "b2");
    assert_refused(&host, &attempt, Step::Stage, &["not executable", "b2"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn a_memory_limit_this_host_cannot_apply_is_refused_naming_the_controller() {
    let host = SwapHost::new("refuse-memory");
    let mount = node_agent::cgroup::discover_mount().expect("cgroup v2 mount");
    let controllers = fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
    if controllers.split_whitespace().any(|c| c == "memory") {
        eprintln!(
            "skipped: the memory controller is enabled in cgroup v2 here, so the limit applies"
        );
        return;
    }
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.resources =
        serde_json::from_value::<ResourcesSpec>(serde_json::json!({ "memoryMax": "64Mi" }))
            .expect("resources");
    assert_refused(&host, &attempt, Step::Admit, &["memory controller"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn uid_0_is_refused_unless_root_instances_are_allowed() {
    let (host, mut attempt) = SwapHost::serving_b1_releasing_b2("refuse-root").await;
    attempt.spec.process.user = Some(0);
    assert_refused(&host, &attempt, Step::Admit, &["root"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn swaps_off_abandons_every_attempt_and_spawns_nothing() {
    let host = SwapHost::with_config(
        "refuse-swaps-off",
        EngineConfig {
            swaps_on: false,
            ..EngineConfig::default()
        },
    );
    let b1 = host.build("b1");
    let result = host.swap(&host.attempt(1, &b1, "b1")).await;
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed);
    assert!(result.reason.contains("swaps are off"), "{}", result.reason);
    assert_eq!(host.who_serves().await, None);
    assert!(!host.instance_cgroup().exists(), "no cgroup was made");
    assert!(!host.run_dir.exists(), "no run dir was made");
    host.assert_only(None);
}

/// A socket path is the agent's choice: one too long to bind (here the run
/// dir of an engine made without the start-up check) refuses the start as
/// the host's fault, before anything runs, instead of blaming the build
/// for the bind it cannot make.
#[tokio::test]
async fn a_generation_socket_path_too_long_to_bind_is_refused_as_the_hosts_fault() {
    let mut host = SwapHost::new("refuse-socket-path");
    host.run_dir = host.run_dir.join("r".repeat(90));
    let engine = host.next_agent(EngineConfig::default());
    let b1 = host.build("b1");
    let attempt = host.attempt(1, &b1, "b1");
    let result = engine
        .swap(
            &attempt,
            &swap_host::OpenGate,
            &node_agent::engine::Cancel::new(),
        )
        .await;
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed, "nothing ran: {result:?}");
    let last = result.steps.last().expect("a step record");
    assert_eq!((last.step, last.result), (Step::Admit, StepOutcome::Stale));
    let socket = engine.layout().generation_socket(&host.instance, 1);
    swap_host::assert_says(
        &result.reason,
        &[
            &socket.display().to_string(),
            "over the 107 a unix socket path may have",
        ],
    );
    assert!(!host.instance_cgroup().exists(), "no cgroup left");
    assert!(
        !engine.layout().instance_dir(&host.instance).exists(),
        "no run dir left"
    );
    host.assert_only(None);
}
