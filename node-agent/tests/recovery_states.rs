//! Crash recovery (SPEC 5.7) in one process: each test leaves the host the
//! way an agent killed at one step leaves it (real testapp generations in
//! real cgroups, their sockets, `current.sock`, and the intent journal as
//! the engine writes it), then a second engine over the same directories —
//! a restarted agent — runs [`Engine::recover`]. Each asserts the outcome
//! given to the interrupted attempt, who answers through `current.sock`,
//! that exactly the serving generation's cgroup, socket and processes are
//! left, and that the outcome waits in the journal once.
//!
//! The kill tests (`crash_matrix.rs`) reach the same states by stopping a
//! real agent process dead at each crash point.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use genswap_crds::{Cause, InstanceKind, Mode, Outcome, StopSignal, StopSpec};
use node_agent::cgroup::Tier;
use node_agent::disk_name::DiskName;
use node_agent::engine::{Engine, EngineConfig, RecoveryReport, SwapResult};
use node_agent::gate::InstanceKey;
use node_agent::journal::{AttemptRef, GenerationRecord, Phase, Record};
use node_agent::spawn::{SpawnSpec, Spawned};
use node_agent::switch::{current_generation, point_current};
use swap_host::{NOBODY, OpenGate, SwapHost, alive, ask, eventually};

/// A second engine over `host`'s directories: the restarted agent.
fn restarted(host: &SwapHost) -> std::sync::Arc<Engine> {
    host.next_agent(EngineConfig::default())
}

/// Starts generation `n` of `build` the way the engine's spawn step does:
/// a fresh `gen-<n>` cgroup, its own socket, as nobody, then waits until it
/// answers.
async fn start_generation(
    host: &SwapHost,
    key: &InstanceKey,
    n: u64,
    build: &testapp::Build,
    id: &str,
) -> (GenerationRecord, Spawned) {
    let instance = host
        .engine
        .cgroups()
        .instance(key)
        .expect("the instance cgroup");
    let cgroup = instance
        .create_generation(n, &Tier::default())
        .await
        .expect("a fresh generation cgroup");
    let run_dir = host
        .engine
        .layout()
        .create_instance_dir(key)
        .expect("the run dir");
    let socket = host.engine.layout().generation_socket(key, n);
    let mut spec = SpawnSpec::new(&build.path, cgroup.clone(), &socket, n, id);
    spec.uid = Some(NOBODY as u32);
    spec.gid = Some(NOBODY as u32);
    spec.working_dir = Some(run_dir);
    let child = node_agent::spawn::spawn(spec)
        .await
        .expect("start the generation");
    let probe = socket.clone();
    let mut answered = false;
    for _ in 0..1500 {
        if ask(&probe).await.is_some() {
            answered = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(answered, "generation {n} answers on its socket");
    let record = GenerationRecord {
        n,
        build: id.into(),
        sha256: build.sha256.clone(),
        store_path: Some(build.path.clone()),
        cgroup: cgroup.path().to_path_buf(),
        socket,
        config_rev: String::new(),
        restart_id: String::new(),
        serving_since_ms: None,
        stop: None,
    };
    (record, child)
}

/// The release attempt (schedRev 2, generation 1 → 2) as the engine's
/// journal holds it after `phases`.
fn release_record(
    key: &InstanceKey,
    mode: Mode,
    incumbent: Option<GenerationRecord>,
    successor: GenerationRecord,
    phases: &[Phase],
) -> Record {
    let mut record = Record::admitted(
        key.clone(),
        AttemptRef {
            name: format!("{}-node-a-2", key.name()),
            uid: None,
            sched_rev: 2,
        },
        Cause::Release,
        InstanceKind::Instance,
        mode,
        mode,
    );
    record.incumbent = incumbent;
    record.successor = Some(successor);
    record.stop = Some(StopSpec {
        signal: StopSignal::Term,
        timeout_seconds: 10,
    });
    for phase in phases {
        record.advance(phase.clone());
    }
    record
}

/// Installs build `v1` (generation 1) and lets the journal forget the
/// install's outcome, as the adapter does once it is reported.
async fn installed(host: &SwapHost) -> GenerationRecord {
    host.install(1, "v1").await;
    let journal = host.engine.journal();
    journal
        .acknowledge(&host.instance, 1)
        .expect("acknowledge the install");
    journal
        .serving(&host.instance)
        .expect("read the journal")
        .expect("generation 1 serves")
}

/// Writes `record` as the attempt in flight, naming the generation the
/// engine would have numbered next.
fn journal_in_flight(host: &SwapHost, record: &Record) {
    let journal = host.engine.journal();
    let n = journal
        .next_generation(&host.instance)
        .expect("the successor's number");
    assert_eq!(Some(n), record.successor.as_ref().map(|g| g.n));
    journal.record(record).expect("journal the attempt");
}

/// A next engine over `host` that has run recovery, its report, and the
/// outcome it gave the instance's attempt (see [`recovered`]).
async fn restart_and_recover(
    host: &SwapHost,
) -> (std::sync::Arc<Engine>, RecoveryReport, (Outcome, bool)) {
    let engine = restarted(host);
    let report = engine.recover().await;
    let outcome = recovered(&report, &engine, &host.instance);
    (engine, report, outcome)
}

/// The outcome recovery gave the instance's attempt, checked against the
/// journal: finished there, and pending exactly once.
fn recovered(report: &RecoveryReport, engine: &Engine, key: &InstanceKey) -> (Outcome, bool) {
    assert!(report.is_clean(), "recovery errors: {:?}", report.errors);
    let recovery = report.instance(key).expect("the instance was recovered");
    let attempt = recovery
        .attempt
        .as_ref()
        .expect("an attempt was found in flight");
    assert_eq!(attempt.attempt.sched_rev, 2);
    let pending = engine
        .journal()
        .pending_reports()
        .expect("read the journal");
    let mine: Vec<_> = pending.iter().filter(|r| &r.instance == key).collect();
    assert_eq!(mine.len(), 1, "the outcome waits once: {pending:?}");
    assert_eq!(mine[0].phase, Phase::Finished);
    assert_eq!(mine[0].outcome.as_ref(), Some(&attempt.outcome));
    assert!(!attempt.outcome.reason.is_empty());
    (attempt.outcome.outcome, attempt.outcome.executed)
}

/// Who serves through `current.sock`: (build, generation).
/// Runs attempt `rev` of a new build `name` on `engine`, nothing gating it.
async fn swap_build(engine: &Engine, host: &SwapHost, rev: i64, name: &str) -> SwapResult {
    let build = host.build(name);
    engine
        .swap(
            &host.attempt(rev, &build, name),
            &OpenGate,
            &node_agent::engine::Cancel::new(),
        )
        .await
}

async fn serving(host: &SwapHost) -> Option<(String, u64)> {
    host.who_serves().await.map(|id| (id.build, id.generation))
}

fn current_link(host: &SwapHost) -> PathBuf {
    host.current_sock()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_adopts_what_serves_and_swaps_it_away() {
    let host = SwapHost::new("rec-adopt");
    let v1 = installed(&host).await;
    let before = host.who_serves().await.expect("v1 answers");

    let engine = restarted(&host);
    assert_eq!(engine.serving(&host.instance), None, "memory starts empty");
    let report = engine.recover().await;
    assert!(report.is_clean(), "{:?}", report.errors);
    let adopted = engine
        .serving(&host.instance)
        .expect("generation 1 adopted");
    assert_eq!(
        (adopted.generation, adopted.build.as_str(), adopted.pid),
        (1, "v1", before.pid),
        "the adopted generation is the process that answers"
    );
    assert_eq!(adopted.socket, v1.socket);
    assert!(report.recovered().next().is_none(), "nothing was in flight");
    host.assert_only(Some(1));

    // The adopted generation is the incumbent of the next overlap, and its
    // retirement works through its cgroup alone.
    let result = swap_build(&engine, &host, 2, "v2").await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(!alive(before.pid), "the adopted generation was retired");
    assert_eq!(serving(&host).await, Some(("v2".into(), 2)));
    host.assert_only(Some(2));

    // And a hold stops an adopted generation before it starts the next.
    let again = restarted(&host);
    again.recover().await;
    let v3 = host.build("v3");
    let mut hold = host.attempt(3, &v3, "v3");
    hold.spec.mode = Mode::Hold;
    let result = again
        .swap(&hold, &OpenGate, &node_agent::engine::Cancel::new())
        .await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(serving(&host).await, Some(("v3".into(), 3)));
    host.assert_only(Some(3));
    again
        .stop_instance(&host.instance, &StopSpec::default())
        .await
        .expect("stop");
    host.assert_only(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generations_stop_settings_are_journaled_with_it_and_survive_a_restart() {
    let host = SwapHost::new("rec-stop-spec");
    let v1 = host.build("v1");
    let mut attempt = host.attempt(1, &v1, "v1");
    attempt.spec.stop = StopSpec {
        signal: StopSignal::Quit,
        timeout_seconds: 7,
    };
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let serving = host.engine.serving(&host.instance).expect("v1 serves");
    assert_eq!(serving.stop, attempt.spec.stop);

    let engine = restarted(&host);
    engine.recover().await;
    let adopted = engine.serving(&host.instance).expect("v1 adopted");
    assert_eq!(
        adopted.stop, attempt.spec.stop,
        "a restarted agent stops it as its attempt said"
    );
    engine
        .stop_instance(&host.instance, &adopted.stop)
        .await
        .expect("stop");
    host.assert_only(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlap_cut_before_the_switch_stops_the_successor_and_keeps_the_incumbent() {
    let host = SwapHost::new("rec-ov-before");
    let v1 = installed(&host).await;
    let v2 = host.build("v2");
    let (successor, child) = start_generation(&host, &host.instance, 2, &v2, "v2").await;
    let successor_pid = child.pid();
    let record = release_record(
        &host.instance,
        Mode::Overlap,
        Some(v1),
        successor,
        &[
            Phase::Spawning,
            Phase::Spawned {
                pid: successor_pid as i32,
            },
            Phase::Healthy,
        ],
    );
    journal_in_flight(&host, &record);

    let (engine, _, outcome) = restart_and_recover(&host).await;
    assert_eq!(outcome, (Outcome::Abandoned, true));
    assert!(!alive(successor_pid), "the successor was stopped");
    assert_eq!(serving(&host).await, Some(("v1".into(), 1)));
    assert_eq!(
        engine.serving(&host.instance).map(|s| s.generation),
        Some(1)
    );
    host.assert_only(Some(1));

    // The next attempt gets a number above the stopped successor's.
    let result = swap_build(&engine, &host, 3, "v3").await;
    assert_eq!(
        (result.outcome, result.generation),
        (Outcome::Done, Some(3))
    );
    host.assert_only(Some(3));
    drop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlap_cut_before_the_exec_was_not_executed() {
    let host = SwapHost::new("rec-ov-admitted");
    let v1 = installed(&host).await;
    let layout = host.engine.layout();
    let successor = GenerationRecord {
        n: 2,
        build: "v2".into(),
        sha256: "ab".repeat(32),
        store_path: None,
        cgroup: host.instance_cgroup().join("gen-2"),
        socket: layout.generation_socket(&host.instance, 2),
        config_rev: String::new(),
        restart_id: String::new(),
        serving_since_ms: None,
        stop: None,
    };
    let record = release_record(&host.instance, Mode::Overlap, Some(v1), successor, &[]);
    journal_in_flight(&host, &record);

    let (_engine, _, outcome) = restart_and_recover(&host).await;
    assert_eq!(
        outcome,
        (Outcome::Abandoned, false),
        "the journal never reached spawning"
    );
    assert_eq!(serving(&host).await, Some(("v1".into(), 1)));
    host.assert_only(Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlap_cut_after_the_switch_completes_the_retirement() {
    let host = SwapHost::new("rec-ov-after");
    let v1 = installed(&host).await;
    let incumbent_pid = host.who_serves().await.expect("v1 answers").pid;
    let v2 = host.build("v2");
    let (successor, child) = start_generation(&host, &host.instance, 2, &v2, "v2").await;
    let record = release_record(
        &host.instance,
        Mode::Overlap,
        Some(v1),
        successor.clone(),
        &[
            Phase::Spawning,
            Phase::Spawned {
                pid: child.pid() as i32,
            },
            Phase::Healthy,
            Phase::Switched,
        ],
    );
    journal_in_flight(&host, &record);
    let run_dir = host.engine.layout().instance_dir(&host.instance);
    point_current(&run_dir, &successor.socket).expect("the switch happened");

    let (engine, report, outcome) = restart_and_recover(&host).await;
    assert_eq!(outcome, (Outcome::Done, true));
    let recovery = report.instance(&host.instance).expect("recovered");
    assert_eq!(
        recovery
            .stopped
            .iter()
            .map(|s| s.generation)
            .collect::<Vec<_>>(),
        vec![1],
        "the former incumbent was retired"
    );
    assert!(
        recovery
            .attempt
            .as_ref()
            .and_then(|a| a.outcome.drain_ms)
            .is_some(),
        "the drain is reported"
    );
    assert!(!alive(incumbent_pid));
    assert_eq!(serving(&host).await, Some(("v2".into(), 2)));
    assert_eq!(
        engine
            .journal()
            .serving(&host.instance)
            .expect("journal")
            .map(|g| g.n),
        Some(2),
        "the journal says generation 2 serves"
    );
    assert_eq!(
        engine.serving(&host.instance).map(|s| s.generation),
        Some(2)
    );
    host.assert_only(Some(2));
    drop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_cut_while_stopping_the_incumbent_finishes_the_stop() {
    let host = SwapHost::new("rec-hold-stop");
    let v1 = installed(&host).await;
    let incumbent_pid = host.who_serves().await.expect("v1 answers").pid;
    let successor = GenerationRecord {
        n: 2,
        build: "v2".into(),
        sha256: "ab".repeat(32),
        store_path: None,
        cgroup: host.instance_cgroup().join("gen-2"),
        socket: host.engine.layout().generation_socket(&host.instance, 2),
        config_rev: String::new(),
        restart_id: String::new(),
        serving_since_ms: None,
        stop: None,
    };
    let record = release_record(
        &host.instance,
        Mode::Hold,
        Some(v1),
        successor,
        &[Phase::IncumbentStopped],
    );
    journal_in_flight(&host, &record);

    let (engine, _, outcome) = restart_and_recover(&host).await;
    assert_eq!(
        outcome,
        (Outcome::Abandoned, false),
        "the new build never ran"
    );
    assert!(!alive(incumbent_pid), "the stop the hold began is complete");
    assert_eq!(serving(&host).await, None);
    assert!(
        fs::symlink_metadata(current_link(&host)).is_err(),
        "current.sock names nothing dead"
    );
    assert_eq!(engine.serving(&host.instance), None);
    host.assert_only(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_cut_before_the_new_build_was_healthy_is_down() {
    let host = SwapHost::new("rec-hold-down");
    let v1 = installed(&host).await;
    // The hold stopped generation 1 with proof (its cgroup and socket gone).
    let incumbent_pid = host.who_serves().await.expect("v1 answers").pid;
    stop_by_hand(&host, 1).await;
    assert!(!alive(incumbent_pid));
    let v2 = host.build("v2");
    let (successor, child) = start_generation(&host, &host.instance, 2, &v2, "v2").await;
    let successor_pid = child.pid();
    let record = release_record(
        &host.instance,
        Mode::Hold,
        Some(v1),
        successor,
        &[
            Phase::IncumbentStopped,
            Phase::Spawning,
            Phase::Spawned {
                pid: successor_pid as i32,
            },
        ],
    );
    journal_in_flight(&host, &record);

    let (_engine, _, outcome) = restart_and_recover(&host).await;
    assert_eq!(outcome, (Outcome::Down, true));
    assert!(!alive(successor_pid), "the unproven successor was stopped");
    assert_eq!(serving(&host).await, None);
    assert!(fs::symlink_metadata(current_link(&host)).is_err());
    host.assert_only(None);
    drop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_cut_after_the_new_build_was_healthy_is_done() {
    let host = SwapHost::new("rec-hold-done");
    let v1 = installed(&host).await;
    stop_by_hand(&host, 1).await;
    let v2 = host.build("v2");
    let (successor, child) = start_generation(&host, &host.instance, 2, &v2, "v2").await;
    let record = release_record(
        &host.instance,
        Mode::Hold,
        Some(v1),
        successor,
        &[
            Phase::IncumbentStopped,
            Phase::Spawning,
            Phase::Spawned {
                pid: child.pid() as i32,
            },
            Phase::Healthy,
        ],
    );
    journal_in_flight(&host, &record);
    // current.sock still names the stopped generation 1.
    let run_dir = host.engine.layout().instance_dir(&host.instance);
    assert_eq!(current_generation(&run_dir), Some(1));

    let (engine, report, outcome) = restart_and_recover(&host).await;
    assert_eq!(outcome, (Outcome::Done, true));
    assert!(
        report
            .instance(&host.instance)
            .is_some_and(|r| r.current_fixed),
        "current.sock was repointed"
    );
    assert_eq!(current_generation(&run_dir), Some(2));
    assert_eq!(serving(&host).await, Some(("v2".into(), 2)));
    assert_eq!(
        engine
            .serving(&host.instance)
            .map(|s| (s.generation, s.pid)),
        Some((2, child.pid())),
        "the main process is the one the journal recorded"
    );
    host.assert_only(Some(2));
    drop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strays_are_stopped_and_removed_and_the_serving_generation_is_untouched() {
    let host = SwapHost::new("rec-strays");
    installed(&host).await;
    let serving_pid = host.who_serves().await.expect("v1 answers").pid;
    let instance_cgroup = host.instance_cgroup();
    let root = instance_cgroup.parent().expect("root").to_path_buf();

    // A live generation no journal entry describes.
    let untracked = instance_cgroup.join("gen-9");
    fs::create_dir(&untracked).expect("gen-9");
    let mut sleeper = cgroup_guard::start_in(&untracked, "sleep 600");
    let sleeper_pid = sleeper.id().expect("the sleeper's pid");
    cgroup_guard::eventually(swap_host::DEADLINE, "the sleeper in gen-9", || {
        fs::read_to_string(untracked.join("cgroup.procs"))
            .is_ok_and(|procs| procs.contains(&sleeper_pid.to_string()))
    })
    .await;
    // A child cgroup of the instance that is no generation, with a process.
    let extra = instance_cgroup.join("extra");
    fs::create_dir(&extra).expect("extra");
    let mut extra_sleeper = cgroup_guard::start_in(&extra, "sleep 600");
    let extra_pid = extra_sleeper.id().expect("pid");
    cgroup_guard::eventually(swap_host::DEADLINE, "the sleeper in extra", || {
        fs::read_to_string(extra.join("cgroup.procs"))
            .is_ok_and(|procs| procs.contains(&extra_pid.to_string()))
    })
    .await;
    // An empty generation cgroup and a leftover socket and link.
    fs::create_dir(instance_cgroup.join("gen-7")).expect("gen-7");
    let run_dir = host.engine.layout().instance_dir(&host.instance);
    let leftover_socket = run_dir.join("gen-5.sock");
    drop(UnixListener::bind(&leftover_socket).expect("a leftover socket"));
    std::os::unix::fs::symlink("gen-5.sock", run_dir.join("current.sock.tmp-1-2-3"))
        .expect("a leftover temp link");
    // An instance nobody journaled, with an empty cgroup and a run dir.
    let ghost = root.join("default.ghost");
    fs::create_dir_all(ghost.join("gen-3")).expect("a ghost instance");
    fs::create_dir_all(host.run_dir.join("default.ghost")).expect("a ghost run dir");
    // A cgroup under the root that is no instance at all, with a process.
    let junk = root.join("junk");
    fs::create_dir(&junk).expect("junk");
    let mut junk_sleeper = cgroup_guard::start_in(&junk, "sleep 600");
    let junk_pid = junk_sleeper.id().expect("pid");
    cgroup_guard::eventually(swap_host::DEADLINE, "the sleeper in junk", || {
        fs::read_to_string(junk.join("cgroup.procs"))
            .is_ok_and(|procs| procs.contains(&junk_pid.to_string()))
    })
    .await;

    let engine = restarted(&host);
    let report = engine.recover().await;
    assert!(report.is_clean(), "{:?}", report.errors);
    let untracked_paths: Vec<&Path> = report
        .untracked
        .iter()
        .map(|u| u.cgroup.as_path())
        .collect();
    assert!(
        untracked_paths.contains(&untracked.as_path()),
        "{untracked_paths:?}"
    );
    assert!(
        untracked_paths.contains(&junk.as_path()),
        "{untracked_paths:?}"
    );
    assert!(
        untracked_paths.contains(&extra.as_path()),
        "{untracked_paths:?}"
    );
    assert!(report.untracked.iter().all(|u| u.stopped));
    let _ = sleeper.wait().await;
    let _ = junk_sleeper.wait().await;
    let _ = extra_sleeper.wait().await;
    for gone in [
        &untracked,
        &extra,
        &instance_cgroup.join("gen-7"),
        &ghost,
        &junk,
    ] {
        assert!(!gone.exists(), "{} was removed", gone.display());
    }
    assert!(!leftover_socket.exists());
    assert!(!run_dir.join("current.sock.tmp-1-2-3").exists());
    assert!(!host.run_dir.join("default.ghost").exists());
    assert!(alive(serving_pid), "the serving generation was not touched");
    assert_eq!(serving(&host).await, Some(("v1".into(), 1)));
    host.assert_only(Some(1));
    assert!(
        engine
            .journal()
            .load_entry(&InstanceKey::new("default", "ghost").expect("key"))
            .expect("journal")
            .is_none(),
        "no journal file is made for an instance nobody journaled"
    );
}

/// Cuts the journal file at `path` short, as a disk fault would, and runs
/// the next agent's recovery, which must quarantine it (and only it).
async fn recover_after_cutting_short(
    host: &SwapHost,
    path: &Path,
) -> (std::sync::Arc<Engine>, RecoveryReport) {
    let text = fs::read(path).expect("the journal file");
    fs::write(path, &text[..text.len() / 2]).expect("truncate it");
    let engine = restarted(host);
    let report = engine.recover().await;
    assert!(report.is_clean(), "{:?}", report.errors);
    assert_eq!(report.quarantined.len(), 1, "{:?}", report.quarantined);
    (engine, report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_journal_file_is_quarantined_and_hides_no_other_instance() {
    let host = SwapHost::new("rec-corrupt");
    installed(&host).await;
    let app_pid = host.who_serves().await.expect("v1 answers").pid;
    // A second instance, journaled normally.
    let other = InstanceKey::new("default", "other").expect("key");
    let w1 = host.build("w1");
    let mut attempt = host.attempt(1, &w1, "w1");
    attempt.instance = other.clone();
    attempt.spec.instance = "other".into();
    assert_eq!(host.swap(&attempt).await.outcome, Outcome::Done);
    host.engine
        .journal()
        .acknowledge(&other, 1)
        .expect("acknowledge");
    let path = host.engine.journal().path_of(&host.instance);
    let (engine, report) = recover_after_cutting_short(&host, &path).await;
    let quarantined = &report.quarantined[0];
    assert_eq!(quarantined.entry.instance.as_ref(), Some(&host.instance));
    let moved = quarantined.moved_to.as_ref().expect("moved aside");
    assert!(moved.exists(), "the corrupt file is kept for a human");
    assert_ne!(moved, &path);

    // The app keeps what current.sock names, its identity read from /proc.
    let app = engine.serving(&host.instance).expect("the app is adopted");
    assert_eq!(
        (app.generation, app.build.as_str(), app.pid),
        (1, "v1", app_pid)
    );
    assert_eq!(
        engine
            .journal()
            .serving(&host.instance)
            .expect("a fresh journal file")
            .map(|g| g.n),
        Some(1)
    );
    // The other instance is recovered from its own file.
    let other_serving = engine.serving(&other).expect("the other is adopted");
    assert_eq!(
        (other_serving.generation, other_serving.build.as_str()),
        (1, "w1")
    );
    // The counter was rebuilt above what the host shows.
    let result = swap_build(&engine, &host, 2, "v2").await;
    assert_eq!(
        (result.outcome, result.generation),
        (Outcome::Done, Some(2))
    );
    engine
        .stop_instance(&other, &StopSpec::default())
        .await
        .expect("stop the other instance");
    host.assert_only(Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_generation_that_died_while_the_agent_was_away_is_cleaned_up_and_journaled() {
    let host = SwapHost::new("rec-died");
    installed(&host).await;
    let pid = host.who_serves().await.expect("v1 answers").pid;
    // It dies without anyone stopping it (its cgroup and socket stay).
    let cgroup = node_agent::cgroup::Cgroup::at(host.instance_cgroup().join("gen-1"), None);
    cgroup
        .kill(std::time::Duration::from_secs(10))
        .await
        .expect("kill generation 1");
    eventually("generation 1 to be gone", || !alive(pid)).await;

    let engine = restarted(&host);
    let report = engine.recover().await;
    assert!(report.is_clean(), "{:?}", report.errors);
    assert_eq!(engine.serving(&host.instance), None);
    assert_eq!(
        engine.journal().serving(&host.instance).expect("journal"),
        None
    );
    let last_exit = engine
        .journal()
        .load_entry(&host.instance)
        .expect("journal")
        .and_then(|entry| entry.last_exit)
        .expect("the exit is journaled, not only forgotten");
    assert_eq!((last_exit.generation, last_exit.build.as_str()), (1, "v1"));
    assert_eq!(
        (last_exit.exit_code, last_exit.signal),
        (None, None),
        "its status died with the agent that was its parent"
    );
    assert!(fs::symlink_metadata(current_link(&host)).is_err());
    host.assert_only(None);
}

/// Stops generation `n` as a hold's stop step does: proof of exit, then
/// its cgroup and socket removed.
async fn stop_by_hand(host: &SwapHost, n: u64) {
    let cgroup =
        node_agent::cgroup::Cgroup::at(host.instance_cgroup().join(format!("gen-{n}")), None);
    cgroup
        .stop(
            nix::sys::signal::Signal::SIGTERM,
            std::time::Duration::from_secs(10),
        )
        .await
        .expect("stop with proof");
    cgroup.remove().expect("remove its cgroup");
    let _ = fs::remove_file(host.engine.layout().generation_socket(&host.instance, n));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_leaves_alone_what_this_engine_already_runs() {
    let host = SwapHost::new("rec-twice");
    installed(&host).await;
    let before = host.who_serves().await.expect("v1 answers");
    // Recovery called while this engine's own swap is in its health step
    // must not take that attempt for a crashed one.
    let v2 = host.build("v2");
    let mut attempt = host.attempt(2, &v2, "v2");
    swap_host::knob(&mut attempt, "TESTAPP_BOOT_DELAY_MS", "1500");
    let recover = async {
        eventually("the successor to be spawned", || {
            host.engine
                .journal()
                .load(&host.instance)
                .is_ok_and(|r| r.is_some_and(|r| matches!(r.phase, Phase::Spawned { .. })))
        })
        .await;
        host.engine.recover().await
    };
    let (result, report) = tokio::join!(host.swap(&attempt), recover);
    assert!(report.is_clean(), "{:?}", report.errors);
    let recovery = report.instance(&host.instance).expect("listed");
    assert!(
        recovery.stopped.is_empty() && recovery.attempt.is_none(),
        "{recovery:?}"
    );
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(!alive(before.pid));
    assert_eq!(serving(&host).await, Some(("v2".into(), 2)));
    host.assert_only(Some(2));
    host.tear_down().await;
}

/// A cut disk name does not say its key: with its journal file broken, the
/// record in its run dir still does, so the instance is adopted, not
/// stopped as a stranger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_name_with_a_corrupt_journal_file_is_adopted_through_its_run_dir_record() {
    let host = SwapHost::new("rec-cut");
    let long = InstanceKey::new("n".repeat(63), "l".repeat(253)).expect("the longest key");
    let v1 = host.build("v1");
    let mut attempt = host.attempt(1, &v1, "v1");
    attempt.instance = long.clone();
    attempt.spec.instance = long.name().into();
    assert_eq!(host.swap(&attempt).await.outcome, Outcome::Done);
    host.engine
        .journal()
        .acknowledge(&long, 1)
        .expect("acknowledge");
    let pid = ask(&host.engine.layout().current_socket(&long))
        .await
        .expect("the long-named instance answers")
        .pid;
    let path = host.engine.journal().path_of(&long);
    let disk = DiskName::of(&long);
    assert_eq!(
        path.file_name().and_then(|n| n.to_str()),
        Some(format!("{disk}.json").as_str())
    );
    let (engine, report) = recover_after_cutting_short(&host, &path).await;
    assert_eq!(report.quarantined[0].entry.instance.as_ref(), Some(&long));
    assert!(report.untracked.is_empty(), "{:?}", report.untracked);
    let serving = engine.serving(&long).expect("adopted");
    assert_eq!((serving.generation, serving.pid), (1, pid));
    assert!(alive(pid));
    engine
        .stop_instance(&long, &StopSpec::default())
        .await
        .expect("stop it");
    assert_eq!(host.pids_in_tree(), Vec::<u32>::new());
}
