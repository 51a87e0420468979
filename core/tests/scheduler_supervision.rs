//! The scheduler reads what the agents' supervisors report between
//! attempts (SPEC 5.10): a node whose generation exited is not ready, gets
//! no attempt (the agent restarts it), and the conditions say why.

mod scheduler_support;

use genswap_crds::{
    LastExit, RestartPolicy, ServingState, ServingStatus, SidecarExit, SidecarState, SidecarStatus,
};
use scheduler_support::*;

/// One node serving `b1` as generation 1.
fn serving_b1() -> World {
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    world.roll_out();
    world
}

fn killed(generation: i64, at: i64) -> LastExit {
    LastExit {
        generation,
        exit_code: None,
        signal: Some(9),
        oom_killed: false,
        at: time(at),
        liveness_failed: None,
    }
}

fn block(
    state: ServingState,
    generation: i64,
    restarts: i32,
    exit: Option<LastExit>,
) -> ServingStatus {
    ServingStatus {
        state,
        generation,
        restarts,
        last_exit: exit,
        restart_at: None,
        message: Some(format!("generation {generation} is {state:?}")),
        listeners: Vec::new(),
        sidecars: Vec::new(),
    }
}

#[test]
fn an_exited_generation_makes_the_node_not_ready_without_an_attempt() {
    let mut world = serving_b1();
    assert_eq!(
        kstatus(&world.status()),
        "Ready=True AllNodesReady | Reconciling=False AllNodesReady | Stalled=False AllNodesReady"
    );
    let exit = killed(1, T0 + 5);
    world.report_serving("a", block(ServingState::Exited, 1, 0, Some(exit.clone())));
    let plan = world.reconcile();
    assert!(
        plan.create.is_empty(),
        "the agent restarts it, not the controller"
    );
    let status = world.status();
    assert_eq!(
        kstatus(&status),
        "Ready=False GenerationExited | Reconciling=False GenerationExited | Stalled=False GenerationExited"
    );
    assert!(
        message(&status, "Ready").contains("down between attempts: a (generation 1 is Exited)")
    );
    let node = entry(&status, "a");
    assert_eq!(node.serving, Some(false));
    assert_eq!(node.last_exit.as_ref(), Some(&exit));
    assert_eq!(status.ready.as_deref(), Some("0/1"));
    assert_eq!(
        events(&plan),
        ["!GenerationExited: node a: generation 1 exited between attempts with signal 9 (SIGKILL)"]
    );

    // Backing off: CrashLoopBackOff. The same exit is not told again.
    world.report_serving("a", block(ServingState::BackOff, 1, 0, Some(exit.clone())));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(
        condition(&world.status(), "Ready"),
        "False CrashLoopBackOff"
    );
    assert!(plan.events.is_empty(), "{:?}", events(&plan));

    // Restarted and healthy: ready again, the restart counted once.
    world.report_serving("a", block(ServingState::Running, 2, 1, Some(exit.clone())));
    let plan = world.reconcile();
    let status = world.status();
    assert_eq!(condition(&status, "Ready"), "True AllNodesReady");
    let node = entry(&status, "a");
    assert_eq!(
        (node.serving, node.restarts, node.generation),
        (Some(true), Some(1), Some(2))
    );
    assert_eq!(
        node.last_exit.as_ref(),
        Some(&exit),
        "the last exit stays for a human to read"
    );
    assert_eq!(
        events(&plan),
        ["GenerationRestarted: node a: restarted as generation 2 (restart 1)"]
    );
    assert!(
        world.reconcile().events.is_empty(),
        "each restart is told once"
    );
}

#[test]
fn never_is_stalled_until_a_human_acts() {
    let mut world = World::new(
        ig({
            let mut spec = spec("b1");
            spec.restart_policy = Some(RestartPolicy::Never);
            spec
        }),
        nodes(&["a"]),
    );
    world.roll_out();
    world.report_serving(
        "a",
        block(ServingState::Exited, 1, 0, Some(killed(1, T0 + 5))),
    );
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    let status = world.status();
    assert_eq!(
        kstatus(&status),
        "Ready=False GenerationExited | Reconciling=False GenerationExited | Stalled=True GenerationExited"
    );
    assert!(
        message(&status, "Stalled").contains("change spec.restartID"),
        "{}",
        message(&status, "Stalled")
    );
    // A new restartID is a new desired state: an attempt starts it again.
    world.edit(|spec| spec.restart_id = "r2".into());
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev2 restart canary"]);
}

#[test]
fn a_worker_that_exited_0_under_on_failure_is_done_not_down() {
    let mut world = World::new(
        ig({
            let mut spec = spec("b1");
            spec.kind = genswap_crds::InstanceKind::Worker;
            spec
        }),
        nodes(&["a"]),
    );
    world.roll_out();
    let clean = LastExit {
        exit_code: Some(0),
        signal: None,
        ..killed(1, T0 + 5)
    };
    world.report_serving("a", block(ServingState::Exited, 1, 0, Some(clean)));
    world.reconcile();
    let status = world.status();
    assert_eq!(condition(&status, "Ready"), "True AllNodesReady");
    assert_eq!(condition(&status, "Stalled"), "False AllNodesReady");
    assert_eq!(
        entry(&status, "a").serving,
        Some(false),
        "nothing runs: the job is done"
    );
}

fn sidecar(state: SidecarState, restarts: i32, exit_code: Option<i32>) -> SidecarStatus {
    SidecarStatus {
        name: "exporter".into(),
        state,
        generation: 1,
        restarts,
        last_exit: exit_code.map(|code| SidecarExit {
            exit_code: Some(code),
            signal: None,
            at: time(T0 + 5),
        }),
        restart_at: None,
        message: None,
    }
}

#[test]
fn a_sidecar_down_keeps_the_node_ready_and_says_so() {
    let mut world = serving_b1();
    let mut running = block(ServingState::Running, 1, 0, None);
    running.sidecars = vec![sidecar(SidecarState::Running, 0, None)];
    world.report_serving("a", running.clone());
    let plan = world.reconcile();
    let status = world.status();
    assert_eq!(condition(&status, "Ready"), "True AllNodesReady");
    assert_eq!(entry(&status, "a").sidecars, running.sidecars);
    assert!(plan.events.is_empty(), "{:?}", events(&plan));

    // Its sidecar crash-loops: the instance still serves, Ready stays True
    // and names the sidecar; no attempt is issued for it.
    let mut down = running.clone();
    down.sidecars = vec![sidecar(SidecarState::BackOff, 3, Some(2))];
    world.report_serving("a", down.clone());
    let plan = world.reconcile();
    assert!(
        plan.create.is_empty(),
        "a sidecar's restarts are the agent's"
    );
    let status = world.status();
    assert_eq!(condition(&status, "Ready"), "True SidecarDown");
    assert!(
        message(&status, "Ready")
            .contains("SidecarDown: a: exporter BackOff (exit code 2, 3 restarts)"),
        "{}",
        message(&status, "Ready")
    );
    assert_eq!(status.ready.as_deref(), Some("1/1"));
    assert_eq!(entry(&status, "a").serving, Some(true));
    assert_eq!(
        events(&plan),
        [
            "!SidecarDown: node a: sidecar exporter BackOff (exit code 2, 3 restarts) of generation 1"
        ]
    );
    world.report_serving("a", down);
    assert!(
        world.reconcile().events.is_empty(),
        "the same state is told once"
    );

    // Up again: plain ready.
    world.report_serving("a", running);
    world.reconcile();
    assert_eq!(condition(&world.status(), "Ready"), "True AllNodesReady");
}
