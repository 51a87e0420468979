//! A revision is never issued twice: across plans whose creates fail after
//! the reservation, across controller restarts (a new process that knows only
//! the stored objects), and across a long mixed run of edits, outcomes and
//! node changes.
//!
//! [`World`] applies plans as the adapter does (status write first, then
//! creates) and fails the test the moment a revision repeats, a create
//! carries a revision at or below the reserved one, or `schedRev` goes back.

mod scheduler_support;

use genswap_core::scheduler::effective_mode;
use genswap_crds::{Cause, Mode};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use scheduler_support::*;

/// A controller restart: a new process builds its view from the stored
/// objects alone (its reservation in hand is gone). Everything `plan` reads
/// is in them.
fn restart(world: &World) -> World {
    let mut fresh = World::new(world.ig.clone(), world.nodes.clone());
    fresh.attempts = world.attempts.clone();
    fresh.now = world.now;
    fresh.ahead = world.ahead;
    // Kept only to go on checking uniqueness; the scheduler never sees it.
    fresh.issued = world.issued.clone();
    fresh.issued_in_hand = world.issued_in_hand;
    fresh.put_off = world.put_off;
    fresh
}

#[test]
fn a_failed_create_burns_its_revision_and_a_restart_does_not_reuse_it() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b"]));

    // The reservation (status write) succeeds, the create fails.
    let lost = world.reconcile_dropping_creates();
    assert_eq!(created(&lost), ["a rev1 install canary"]);
    assert_eq!(world.status().sched_rev, 1);
    assert!(world.attempts.is_empty());

    // A new controller process sees schedRev 1 and no attempt: rev 2 next.
    let mut world = restart(&world);
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev2 install canary"]);

    // Its reservation succeeds, the create fails again, and it restarts again.
    world.finish("a", done());
    let lost = world.reconcile_dropping_creates();
    assert_eq!(created(&lost), ["b rev3 install"]);
    let mut world = restart(&world);
    assert_eq!(created(&world.reconcile()), ["b rev4 install"]);
    assert_eq!(world.issued, [2, 4]);
}

#[test]
fn a_plan_whose_reservation_fails_issued_nothing() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    // The status write conflicts: the adapter creates nothing and replans.
    let refused = world.plan();
    assert_eq!(created(&refused), ["a rev1 install canary"]);
    // Revision 1 was never reserved nor created, so handing it out now is
    // its first issue, not a reuse.
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev1 install canary"]);
    assert_eq!(world.issued, [1]);
}

#[test]
fn a_plan_is_a_function_of_the_stored_objects() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b", "c"]));
    world.roll_out();
    world.edit(|s| s.config_rev = "c2".into());
    world.reconcile();
    world.finish("a", failed("unhealthy"));
    assert_eq!(world.plan(), restart(&world).plan());
}

/// xorshift64*: a fixed seed gives the same run every time.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("fits")
    }
}

#[test]
fn revisions_stay_unique_through_a_long_mixed_run() {
    for seed in [1_u64, 7, 42, 1234, 99_991] {
        run_mixed(seed, 1500, false);
    }
}

/// The same, as the controller plans: reserving ahead, issuing from its
/// reservation in hand, progress writes put off at random, restarts
/// losing the reservation.
#[test]
fn revisions_stay_unique_and_increasing_when_reserved_ahead_and_progress_waits() {
    for seed in [3_u64, 11, 42, 4321, 77_777] {
        run_mixed(seed, 1500, true);
    }
}

const ZONE: &str = "topology.kubernetes.io/zone";

fn run_mixed(seed: u64, steps: usize, ahead: bool) {
    let mut rng = Rng(seed);
    let mut s = spec("b1");
    s.rollout.canary_nodes = IntOrString::Int(1);
    s.rollout.max_parallel = IntOrString::Int(2);
    let zoned = |name: &str| node(name, &[(ZONE, ["z1", "z2"][usize::from(name < "c")])]);
    let mut world = World::new(ig(s), ["a", "b", "c", "d"].map(zoned).to_vec());
    world.ahead = ahead;
    let mut builds = 1;
    // Ahead, a third of the steps more end an attempt done, so rollouts
    // get past their canary and issue from the reservation in hand.
    let kinds = if ahead { 18 } else { 12 };
    for step in 0..steps {
        match rng.below(kinds) {
            0 => {
                builds += 1;
                let build = format!("b{builds}");
                world.edit(|s| s.build = spec(&build).build);
            }
            1 => world.edit(|s| s.config_rev = format!("c{step}")),
            2 => world.edit(|s| s.restart_id = format!("r{step}")),
            3 => world.edit(|s| s.retry = format!("t{step}")),
            4 => world.edit(|s| {
                s.mode = if s.mode == Mode::Hold {
                    Mode::Overlap
                } else {
                    Mode::Hold
                }
            }),
            5 => {
                // The rollout's knobs: the revisions must not care.
                let knob = rng.below(5);
                let parallel = rng.below(3);
                world.edit(|s| match knob {
                    0 | 1 => s.rollout.halt_on_failure = !s.rollout.halt_on_failure,
                    2 => {
                        s.rollout.waves = match s.rollout.waves {
                            Some(_) => None,
                            None => Some(genswap_crds::WavesSpec {
                                by_label: ZONE.into(),
                                order: vec!["z2".into()],
                            }),
                        }
                    }
                    3 => {
                        s.rollout.max_parallel = match parallel {
                            0 => IntOrString::String("50%".into()),
                            1 => IntOrString::String("1%".into()),
                            _ => IntOrString::Int(2),
                        }
                    }
                    _ => s.rollout.bake_seconds = if s.rollout.bake_seconds == 0 { 60 } else { 0 },
                })
            }
            6 => {
                let name = ["a", "b", "c", "d", "e"][rng.below(5)];
                if world
                    .nodes
                    .iter()
                    .any(|n| n.metadata.name.as_deref() == Some(name))
                {
                    world
                        .nodes
                        .retain(|n| n.metadata.name.as_deref() != Some(name));
                } else {
                    world.nodes.push(zoned(name));
                }
            }
            7 | 8 => {
                let open: Vec<i64> = world
                    .attempts
                    .iter()
                    .filter(|a| a.status.is_none())
                    .map(|a| a.spec.sched_rev)
                    .collect();
                if !open.is_empty() {
                    let rev = open[rng.below(open.len())];
                    let finish = match rng.below(6) {
                        0 | 1 => done(),
                        2 => failed("unhealthy"),
                        3 => down("exited after the stop"),
                        4 => abandoned(false),
                        _ => abandoned(true),
                    };
                    world.finish_rev(rev, finish);
                }
            }
            9 => {
                world.reconcile_dropping_creates();
            }
            10 if ahead && rng.below(2) == 0 => {
                // An attempt ends, and another replica leads for the
                // reconcile that issues the next wave, knowing nothing of
                // this one's reservation in hand (its creates may fail,
                // leaving only its raised schedRev); then this one leads
                // again, still remembering it.
                finish_oldest_open(&mut world);
                let remembered = world.own.take();
                if rng.below(2) == 0 {
                    world.reconcile();
                } else {
                    world.reconcile_dropping_creates();
                }
                world.own = remembered;
            }
            10 => world = restart(&world),
            11 => world.advance(i64::try_from(rng.below(400)).expect("small")),
            _ => finish_oldest_open(&mut world),
        }
        world.put_off_progress = ahead && rng.below(2) == 0;
        let plan = world.reconcile();
        check_no_held_build_started(&world, &plan, seed, step);
    }
    check_one_attempt_per_node_at_rest(&mut world, seed);
    assert!(
        world.issued.windows(2).all(|w| w[0] < w[1]),
        "seed {seed}: revisions out of order: {:?}",
        world.issued
    );
    assert!(
        world.issued.len() > 50,
        "seed {seed}: the run should issue many attempts, issued {}",
        world.issued.len()
    );
    if ahead {
        assert!(
            world.issued_in_hand > 10 && world.put_off > 10,
            "seed {seed}: the run should issue from reservations in hand ({}) and put progress off ({})",
            world.issued_in_hand,
            world.put_off
        );
    }
}

/// Once everything in flight ends `done` and the plans go quiet, a node
/// keeps one attempt (the one carrying its record), and beside it its
/// newest attempt when that one failed (held down, nothing replaced it).
fn check_one_attempt_per_node_at_rest(world: &mut World, seed: u64) {
    // Each wave may bake before the next: one rollout per wave, an hour
    // apart.
    for _ in 0..4 {
        world.advance(3600);
        world.roll_out();
    }
    let mut per_node: std::collections::BTreeMap<&str, Vec<&genswap_crds::SwapAttempt>> =
        Default::default();
    for attempt in &world.attempts {
        per_node
            .entry(attempt.spec.node_name.as_str())
            .or_default()
            .push(attempt);
    }
    for (node, mut attempts) in per_node {
        attempts.sort_by_key(|a| a.spec.sched_rev);
        let newest_failed = attempts
            .last()
            .and_then(|a| a.status.as_ref())
            .and_then(|s| s.outcome)
            == Some(genswap_crds::Outcome::Failed);
        let allowed = if newest_failed { 2 } else { 1 };
        assert!(
            attempts.len() <= allowed,
            "seed {seed}: node {node} keeps {} attempts at rest (revision, outcome): {:?}",
            attempts.len(),
            attempts
                .iter()
                .map(|a| (a.spec.sched_rev, a.status.as_ref().and_then(|s| s.outcome)))
                .collect::<Vec<_>>(),
        );
    }
}

fn finish_oldest_open(world: &mut World) {
    let open = world
        .attempts
        .iter()
        .filter(|a| a.status.is_none())
        .map(|a| a.spec.sched_rev)
        .min();
    if let Some(rev) = open {
        world.finish_rev(rev, done());
    }
}

/// Outside an armed retry no attempt starts a (build, mode) the plan's own
/// failure book holds down on that node.
fn check_no_held_build_started(
    world: &World,
    plan: &genswap_core::scheduler::Plan,
    seed: u64,
    step: usize,
) {
    let halt = world.ig.spec.rollout.halt_on_failure;
    for attempt in &plan.create {
        if attempt.spec.cause == Cause::Retry {
            continue;
        }
        let mode = effective_mode(
            attempt.spec.mode,
            attempt.spec.demand,
            attempt.spec.socket.layout,
            attempt.spec.kind,
        );
        let blocked = plan.status.held_down.iter().any(|h| {
            h.build == attempt.spec.build.id
                && h.mode == mode
                && (halt || h.node == attempt.spec.node_name)
        });
        assert!(
            !blocked,
            "seed {seed} step {step}: {} started held-down {} ({mode:?}); book {:?}",
            attempt.spec.node_name, attempt.spec.build.id, plan.status.held_down
        );
    }
}
