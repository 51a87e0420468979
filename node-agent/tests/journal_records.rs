//! The intent journal on a real file system: durability, corruption, acks.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use genswap_crds::{Cause, InstanceKind, Mode, Outcome, StepTiming};
use node_agent::gate::InstanceKey;
use node_agent::journal::{
    AttemptRef, GenerationRecord, Journal, JournalError, OutcomeRecord, Phase, Record, SavedLimits,
    unix_millis_now,
};

fn key(name: &str) -> InstanceKey {
    InstanceKey::new("default", name).expect("valid key")
}

fn generation(n: u64, build: &str) -> GenerationRecord {
    GenerationRecord {
        n,
        build: build.into(),
        sha256: "ab".repeat(32),
        store_path: Some(format!("/var/lib/genswap/store/sha256-{}", "ab".repeat(32)).into()),
        cgroup: format!("/sys/fs/cgroup/genswap/default.app/gen-{n}").into(),
        socket: format!("/run/genswap/default.app/gen-{n}.sock").into(),
        config_rev: "c1".into(),
        restart_id: String::new(),
        serving_since_ms: None,
        stop: None,
    }
}

fn record(instance: &InstanceKey, rev: i64) -> Record {
    let mut record = Record::admitted(
        instance.clone(),
        AttemptRef {
            name: format!("{}-node1-{rev}", instance.name()),
            uid: Some(format!("uid-{rev}")),
            sched_rev: rev,
        },
        Cause::Release,
        InstanceKind::Instance,
        Mode::Overlap,
        Mode::Hold,
    );
    record.incumbent = Some(generation(1, "v1"));
    record.successor = Some(generation(2, "v2"));
    record
}

fn outcome(outcome: Outcome) -> OutcomeRecord {
    OutcomeRecord {
        outcome,
        effective_mode: Mode::Hold,
        generation: Some(2),
        reason: "because".into(),
        executed: true,
        clean_exit: false,
        drain_ms: Some(12),
        listener_handover: None,
        steps: vec![StepTiming {
            step: "stage".into(),
            result: "ok".into(),
            millis: 3,
        }],
        started_at_ms: 1,
        finished_at_ms: unix_millis_now(),
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read journal dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_record_round_trips_through_the_file_and_a_reopen() {
    let state = tempfile::tempdir().expect("temp dir");
    let journal = Journal::open(state.path()).expect("open");
    assert_eq!(
        fs::metadata(journal.dir())
            .expect("dir")
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    let instance = key("app");
    let mut rec = record(&instance, 5);
    journal.record(&rec).expect("admitted");
    rec.advance(Phase::ParentRaised {
        saved: SavedLimits {
            memory_max: Some("max".into()),
            cpu_max: None,
            pids_max: Some("100".into()),
        },
    });
    journal.record(&rec).expect("raised");
    rec.advance(Phase::Spawning);
    rec.advance(Phase::Spawned { pid: 4242 });
    journal.record(&rec).expect("spawned");

    let reopened = Journal::open(state.path()).expect("reopen");
    let loaded = reopened
        .load(&instance)
        .expect("readable")
        .expect("present");
    assert_eq!(loaded, rec);
    assert_eq!(loaded.phase, Phase::Spawned { pid: 4242 });
    assert_eq!(
        loaded.effective_mode,
        Mode::Hold,
        "the effective mode is on file"
    );
    assert_eq!(loaded.requested_mode, Mode::Overlap);
    assert!(loaded.exec_may_have_run);
    assert_eq!(loaded.successor_pid, Some(4242));
    assert_eq!(
        loaded
            .raised_parent
            .as_ref()
            .and_then(|s| s.pids_max.as_deref()),
        Some("100"),
        "the saved limits outlive the ParentRaised phase"
    );
    let file = reopened.path_of(&instance);
    assert_eq!(file, state.path().join("journal/default.app.json"));
    assert_eq!(
        fs::metadata(&file).expect("file").permissions().mode() & 0o777,
        0o600
    );
    let text = fs::read_to_string(&file).expect("read");
    assert!(text.contains("\"effectiveMode\": \"hold\""), "{text}");
    assert!(text.contains("\"name\": \"spawned\""), "{text}");
    assert_eq!(reopened.load(&key("absent")).expect("no file"), None);
}

#[test]
fn corrupt_files_are_reported_and_never_hide_other_instances() {
    let state = tempfile::tempdir().expect("temp dir");
    let journal = Journal::open(state.path()).expect("open");
    let good = key("good");
    let truncated = key("truncated");
    let garbage = key("garbage");
    for instance in [&good, &truncated, &garbage] {
        journal.record(&record(instance, 1)).expect("record");
    }
    let truncated_path = journal.path_of(&truncated);
    let full = fs::read(&truncated_path).expect("read");
    fs::write(&truncated_path, &full[..full.len() / 2]).expect("truncate");
    fs::write(journal.path_of(&garbage), b"\x00\xffnot json at all").expect("garbage");
    fs::write(journal.dir().join("not-a-key.json"), b"{}").expect("bad name");
    let other_instance_inside = fs::read_to_string(journal.path_of(&good))
        .expect("read")
        .replace("default.good", "default.other");
    fs::write(
        journal.dir().join("default.liar.json"),
        other_instance_inside,
    )
    .expect("liar");

    let (entries, corrupt) = journal.load_all().expect("the directory is readable");
    let loaded: Vec<_> = entries.iter().map(|e| e.instance.clone()).collect();
    assert_eq!(loaded, vec![good.clone()]);
    let corrupt_names: Vec<String> = corrupt
        .iter()
        .map(|c| {
            c.path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(
        corrupt_names,
        vec![
            "default.garbage.json",
            "default.liar.json",
            "default.truncated.json",
            "not-a-key.json"
        ]
    );
    for entry in &corrupt {
        assert!(!entry.error.is_empty());
    }
    assert_eq!(corrupt[2].instance, Some(truncated.clone()));

    let err = journal.load(&truncated).expect_err("corrupt");
    assert!(matches!(err, JournalError::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("default.truncated.json"), "{err}");
    let err = journal.record(&record(&truncated, 2)).expect_err("refused");
    assert!(matches!(err, JournalError::Corrupt { .. }), "{err:?}");
    assert_eq!(
        fs::read(&truncated_path).expect("read").len(),
        full.len() / 2,
        "a corrupt file is never overwritten"
    );

    // Recovery quarantines it and rebuilds the counter from the host.
    let moved = journal.quarantine(&corrupt[2]).expect("quarantine");
    assert!(moved.is_file());
    journal.observe_generation(&truncated, 7).expect("observe");
    assert_eq!(journal.next_generation(&truncated).expect("next"), 8);
    let (entries, corrupt) = journal.load_all().expect("readable");
    assert_eq!(entries.len(), 2, "the quarantined file is skipped");
    assert_eq!(corrupt.len(), 3);
}

#[test]
fn writes_leave_no_temp_files_and_crash_leftovers_are_ignored_then_removed() {
    let state = tempfile::tempdir().expect("temp dir");
    let journal = Journal::open(state.path()).expect("open");
    let instance = key("app");
    let mut rec = record(&instance, 3);
    for _ in 0..20 {
        rec.advance(Phase::Healthy);
        journal.record(&rec).expect("record");
        journal.observe_generation(&instance, 5).expect("observe");
    }
    assert_eq!(files_in(journal.dir()), vec!["default.app.json"]);

    // What a crash between create and rename leaves behind.
    let leftover = journal.dir().join("default.app.json.tmp-999-0-1");
    fs::write(&leftover, b"{\"version\":1,\"instance\":\"defa").expect("leftover");
    let (entries, corrupt) = journal.load_all().expect("readable");
    assert_eq!(entries.len(), 1);
    assert!(
        corrupt.is_empty(),
        "a temp file is not an entry: {corrupt:?}"
    );
    assert_eq!(journal.load(&instance).expect("readable"), Some(rec));
    assert_eq!(journal.remove_temp_files().expect("clean"), 1);
    assert_eq!(files_in(journal.dir()), vec!["default.app.json"]);
}

#[test]
fn acknowledge_drops_only_the_accepted_outcome() {
    let state = tempfile::tempdir().expect("temp dir");
    let journal = Journal::open(state.path()).expect("open");
    let instance = key("app");

    let mut first = record(&instance, 5);
    journal.record(&first).expect("record");
    assert!(
        !journal.acknowledge(&instance, 5).expect("ack"),
        "an attempt in flight is not acked"
    );
    assert!(journal.pending_reports().expect("pending").is_empty());

    // A different attempt while one is in flight is refused.
    let err = journal
        .record(&record(&instance, 6))
        .expect_err("in flight");
    assert!(
        matches!(err, JournalError::InFlight { sched_rev: 5, .. }),
        "{err:?}"
    );

    first.finish(outcome(Outcome::Failed));
    journal.record(&first).expect("finished");
    assert_eq!(
        journal.pending_reports().expect("pending"),
        vec![first.clone()]
    );

    // A newer attempt begins before the API accepted the first outcome.
    let second = record(&instance, 6);
    journal.record(&second).expect("newer attempt");
    let entry = journal
        .load_entry(&instance)
        .expect("readable")
        .expect("present");
    assert_eq!(
        entry.unreported,
        vec![first.clone()],
        "the old outcome is kept"
    );
    assert_eq!(entry.attempt, Some(second.clone()));
    assert_eq!(
        journal.pending_reports().expect("pending"),
        vec![first.clone()]
    );

    assert!(
        !journal.acknowledge(&instance, 4).expect("ack"),
        "unknown revision: no-op"
    );
    assert!(
        !journal.acknowledge(&instance, 6).expect("ack"),
        "rev 6 has not finished"
    );
    assert!(journal.acknowledge(&instance, 5).expect("ack"));
    assert!(
        !journal.acknowledge(&instance, 5).expect("ack twice"),
        "acknowledged once"
    );
    let entry = journal
        .load_entry(&instance)
        .expect("readable")
        .expect("present");
    assert!(entry.unreported.is_empty());
    assert_eq!(
        entry.attempt,
        Some(second.clone()),
        "the newer attempt is untouched"
    );

    let mut second = second;
    second.finish(outcome(Outcome::Done));
    journal.record(&second).expect("finished");
    assert!(journal.acknowledge(&instance, 6).expect("ack"));
    assert_eq!(journal.load(&instance).expect("readable"), None);
    assert!(journal.pending_reports().expect("pending").is_empty());
}

#[test]
fn pending_reports_span_instances_and_survive_a_reopen() {
    let state = tempfile::tempdir().expect("temp dir");
    let journal = Journal::open(state.path()).expect("open");
    let mut a = record(&key("a"), 1);
    let b = record(&key("b"), 1);
    a.finish(outcome(Outcome::Abandoned));
    journal.record(&a).expect("a");
    journal.record(&b).expect("b");
    drop(journal);
    let journal = Journal::open(state.path()).expect("reopen");
    assert_eq!(journal.pending_reports().expect("pending"), vec![a]);
}

/// What the engine does with a new generation number: the intent record
/// that names it (phase spawning) is written before anything of it exists.
/// One attempt in flight throughout, its successor renumbered each time.
fn spawn_next(journal: &Journal, instance: &InstanceKey) -> u64 {
    let n = journal.next_generation(instance).expect("next");
    let mut rec = record(instance, 1);
    rec.incumbent = None;
    rec.successor = Some(generation(n, "vN"));
    rec.advance(Phase::Spawning);
    journal.record(&rec).expect("record the intent");
    n
}

#[test]
fn the_generation_counter_strictly_increases_across_reopens() {
    let state = tempfile::tempdir().expect("temp dir");
    let instance = key("app");
    let mut seen = Vec::new();
    for _ in 0..3 {
        let journal = Journal::open(state.path()).expect("open");
        seen.push(spawn_next(&journal, &instance));
        seen.push(spawn_next(&journal, &instance));
    }
    assert_eq!(seen, vec![1, 2, 3, 4, 5, 6]);

    // Read without a record naming it, the number is handed out again:
    // nothing of it exists on the host yet.
    let journal = Journal::open(state.path()).expect("open");
    assert_eq!(journal.next_generation(&instance).expect("next"), 7);
    assert_eq!(journal.next_generation(&instance).expect("next"), 7);

    journal
        .observe_generation(&instance, 3)
        .expect("lower: no change");
    assert_eq!(journal.next_generation(&instance).expect("next"), 7);
    journal.observe_generation(&instance, 40).expect("observe");
    assert_eq!(journal.next_generation(&instance).expect("next"), 41);

    // A record naming a higher generation keeps the counter above it.
    let other = key("other");
    let mut rec = record(&other, 1);
    rec.successor = Some(generation(90, "v9"));
    journal.record(&rec).expect("record");
    assert_eq!(journal.next_generation(&other).expect("next"), 91);
}

#[test]
fn the_serving_generation_is_kept_for_adoption() {
    let state = tempfile::tempdir().expect("temp dir");
    let instance = key("app");
    let journal = Journal::open(state.path()).expect("open");
    assert_eq!(journal.serving(&instance).expect("readable"), None);
    let mut serving = generation(3, "v3");
    serving.serving_since_ms = Some(unix_millis_now());
    journal
        .set_serving(&instance, Some(serving.clone()))
        .expect("set");
    let journal = Journal::open(state.path()).expect("reopen");
    assert_eq!(journal.serving(&instance).expect("readable"), Some(serving));
    assert_eq!(journal.next_generation(&instance).expect("next"), 4);
    journal.set_serving(&instance, None).expect("down");
    assert_eq!(journal.serving(&instance).expect("readable"), None);

    journal.record(&record(&instance, 1)).expect("in flight");
    assert!(matches!(
        journal.remove_instance(&instance),
        Err(JournalError::InFlight { .. })
    ));
    let mut done = record(&instance, 1);
    done.finish(outcome(Outcome::Done));
    journal.record(&done).expect("finished");
    journal.remove_instance(&instance).expect("remove");
    assert!(files_in(journal.dir()).is_empty());
}
