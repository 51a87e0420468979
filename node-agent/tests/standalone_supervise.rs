//! Standalone mode supervises between attempts (SPEC 5.10): a SIGKILLed
//! serving generation is restarted by the agent on its own, and the status
//! file goes `Ready=False GenerationExited`, then `Ready=True` with the
//! restart counted and the exit named. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{ConditionType, ServingState};
use standalone_support::{Manifest, StandaloneHost, key};

fn reason(doc: &node_agent::standalone::StatusDocument, type_: &str) -> String {
    doc.status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.reason.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_comes_back_and_the_status_file_says_what_happened() {
    let host = StandaloneHost::start("supervise");
    let build = host.build("b1");
    let web = key("web");
    let mut manifest = Manifest::new("web", "b1", &build);
    // Each generation takes a moment to boot, so the down state is seen.
    manifest.env = vec![("TESTAPP_BOOT_DELAY_MS".into(), "1500".into())];
    host.write("web.yaml", &manifest.yaml());
    host.status("web.yaml", "b1 to serve", |doc| {
        doc.is_true(ConditionType::Ready)
    })
    .await;
    let before = host.who_serves(&web).await.expect("b1 serves");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(before.pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the serving generation");

    let down = host
        .status("web.yaml", "Ready=False GenerationExited", |doc| {
            !doc.is_true(ConditionType::Ready) && reason(doc, "Ready") == "GenerationExited"
        })
        .await;
    let node = &down.status.nodes[0];
    assert_eq!(node.serving, Some(false), "{node:?}");
    let exit = node.last_exit.as_ref().expect("the exit is reported");
    assert_eq!(
        (exit.generation, exit.signal, exit.exit_code),
        (1, Some(9), None)
    );
    assert!(
        !down.is_true(ConditionType::Stalled),
        "Always restarts: no human is needed"
    );

    let up = host
        .status("web.yaml", "Ready=True after the restart", |doc| {
            doc.is_true(ConditionType::Ready)
                && doc.status.nodes.first().and_then(|n| n.restarts) == Some(1)
        })
        .await;
    let node = &up.status.nodes[0];
    assert_eq!((node.serving, node.generation), (Some(true), Some(2)));
    assert_eq!(node.last_exit.as_ref().map(|e| e.signal), Some(Some(9)));
    let install = up.last_attempt().expect("the install");
    assert_eq!(
        up.attempts.len(),
        1,
        "the restart is no attempt: {:?}",
        up.attempts
    );
    let serving = up
        .attempt(install.sched_rev)
        .and_then(|a| a.status.serving.clone())
        .expect("the install carries the serving block");
    assert_eq!(
        (serving.state, serving.generation, serving.restarts),
        (ServingState::Running, 2, 1)
    );
    let after = host.who_serves(&web).await.expect("the restart answers");
    assert_eq!((after.build.as_str(), after.generation), ("b1", 2));
    assert!(
        !std::path::Path::new(&format!("/proc/{}", before.pid)).exists(),
        "the killed process was reaped"
    );
    host.stop().await;
}
