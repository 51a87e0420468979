//! Limit writes and the overlap parent raise/restore against a temp
//! directory laid out like cgroupfs (this host's cgroup v2 tree has no
//! memory, cpu or pids controller, so the files are plain files here).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use node_agent::cgroup::{
    Cgroup, CgroupError, CgroupManager, Controller, InstanceCgroup, ParentRaise, RaiseRecord, Tier,
};
use node_agent::gate::InstanceKey;

fn key(namespace: &str, name: &str) -> InstanceKey {
    InstanceKey::new(namespace, name).expect("a valid instance key")
}

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// `<tmp>/root` with the three controllers offered and enabled, and the
/// instance `default.app` carrying `memory.max`, `cpu.max`, `pids.max`.
struct FakeCgroupfs {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl FakeCgroupfs {
    fn new(memory: &str, cpu: &str, pids: &str) -> FakeCgroupfs {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("root");
        write_files(
            &root,
            &[
                ("cgroup.controllers", "cpu memory pids\n"),
                ("cgroup.subtree_control", "cpu memory pids\n"),
            ],
        );
        write_files(
            &root.join("default.app"),
            &[
                ("cgroup.controllers", "cpu memory pids\n"),
                ("cgroup.subtree_control", "cpu memory pids\n"),
                ("cgroup.events", "populated 0\nfrozen 0\n"),
                ("memory.max", &format!("{memory}\n")),
                ("cpu.max", &format!("{cpu}\n")),
                ("pids.max", &format!("{pids}\n")),
            ],
        );
        FakeCgroupfs { _dir: dir, root }
    }

    fn manager(&self) -> CgroupManager {
        CgroupManager::open_unchecked(&self.root)
    }

    fn instance(&self) -> InstanceCgroup {
        self.manager()
            .instance(&key("default", "app"))
            .expect("instance over the fake tree")
    }

    fn instance_file(&self, name: &str) -> String {
        read(&self.root.join("default.app").join(name))
    }
}

fn write_files(dir: &Path, files: &[(&str, &str)]) {
    fs::create_dir_all(dir).expect("create fake cgroup dir");
    for (name, content) in files {
        fs::write(dir.join(name), content).expect("write fake interface file");
    }
}

fn read(path: &Path) -> String {
    fs::read_to_string(path)
        .expect("read fake interface file")
        .trim_end()
        .to_owned()
}

fn tier(memory: Option<u64>, cpu_millicores: Option<u64>, pids: Option<u64>) -> Tier {
    Tier {
        memory_max_bytes: memory,
        cpu_max_millicores: cpu_millicores,
        pids_max: pids,
    }
}

/// A fake generation directory with fresh (`max`) interface files.
fn fake_generation(fs_: &FakeCgroupfs, n: u64) -> Cgroup {
    let dir = fs_.root.join(format!("default.app/gen-{n}"));
    write_files(
        &dir,
        &[
            ("cgroup.events", "populated 0\nfrozen 0\n"),
            ("memory.max", "max\n"),
            ("cpu.max", "max 100000\n"),
            ("pids.max", "max\n"),
        ],
    );
    Cgroup::at(dir, None)
}

#[test]
fn generation_limits_are_written_as_the_kernel_expects() {
    let fake = FakeCgroupfs::new("max", "max 100000", "max");
    let generation = fake_generation(&fake, 1);
    generation
        .apply_tier(&tier(Some(512 * MIB), Some(500), Some(64)))
        .expect("limits written");
    assert_eq!(read(&generation.path().join("memory.max")), "536870912");
    assert_eq!(read(&generation.path().join("cpu.max")), "50000 100000");
    assert_eq!(read(&generation.path().join("pids.max")), "64");

    let other = fake_generation(&fake, 2);
    other
        .apply_tier(&tier(None, Some(2000), None))
        .expect("cpu only");
    assert_eq!(read(&other.path().join("cpu.max")), "200000 100000");
    assert_eq!(
        read(&other.path().join("memory.max")),
        "max",
        "not requested, untouched"
    );
}

#[test]
fn a_missing_interface_file_refuses_before_any_write() {
    let fake = FakeCgroupfs::new("max", "max 100000", "max");
    let generation = fake_generation(&fake, 1);
    fs::remove_file(generation.path().join("pids.max")).expect("no pids controller here");
    let err = generation
        .apply_tier(&tier(Some(GIB), None, Some(10)))
        .expect_err("pids.max is missing");
    match &err {
        CgroupError::LimitNotApplied { controller, .. } => {
            assert_eq!(*controller, Controller::Pids)
        }
        other => panic!("expected LimitNotApplied, got {other:?}"),
    }
    assert!(err.to_string().contains("pids"), "{err}");
    assert_eq!(
        read(&generation.path().join("memory.max")),
        "max",
        "nothing written"
    );
}

#[tokio::test]
async fn a_controller_missing_from_subtree_control_refuses_the_generation() {
    let fake = FakeCgroupfs::new("max", "max 100000", "max");
    fs::write(
        fake.root.join("default.app/cgroup.subtree_control"),
        "cpu pids\n",
    )
    .expect("write");
    fs::write(
        fake.root.join("default.app/cgroup.controllers"),
        "cpu pids\n",
    )
    .expect("write");
    let instance = fake.instance();
    let err = instance
        .create_generation(1, &tier(Some(GIB), Some(100), None))
        .await
        .expect_err("memory is not enabled for children");
    assert!(
        matches!(
            err,
            CgroupError::LimitNotApplied {
                controller: Controller::Memory,
                ..
            }
        ),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("memory controller is not enabled"),
        "{message}"
    );
    assert!(
        message.contains("cgroup.controllers lists: cpu pids"),
        "{message}"
    );
    assert!(
        !fake.root.join("default.app/gen-1").exists(),
        "nothing created"
    );
    instance
        .check_generation_limits(1, &tier(None, Some(100), Some(5)))
        .expect("cpu and pids are enabled");
}

#[test]
fn the_instance_carries_its_tier_with_max_for_what_is_not_limited() {
    let fake = FakeCgroupfs::new("1000", "5000 100000", "7");
    let instance = fake.instance();
    instance
        .apply_tier(&tier(Some(2 * GIB), None, None))
        .expect("tier applied");
    assert_eq!(fake.instance_file("memory.max"), (2 * GIB).to_string());
    assert_eq!(fake.instance_file("cpu.max"), "max 100000");
    assert_eq!(fake.instance_file("pids.max"), "max");
}

#[test]
fn raise_sums_incumbent_and_successor_and_restore_puts_the_old_values_back() {
    let fake = FakeCgroupfs::new("536870912", "50000 100000", "100");
    let instance = fake.instance();
    let incumbent = tier(Some(512 * MIB), Some(500), Some(100));
    let successor = tier(Some(GIB), Some(1000), Some(200));
    let mut raise = instance
        .begin_raise(&incumbent, &successor)
        .expect("prepared");
    assert!(!raise.needs_restore(), "nothing written yet");
    assert_eq!(
        fake.instance_file("memory.max"),
        "536870912",
        "begin writes nothing"
    );

    raise.apply().expect("raised");
    assert!(raise.needs_restore());
    assert_eq!(
        fake.instance_file("memory.max"),
        (512 * MIB + GIB).to_string()
    );
    assert_eq!(fake.instance_file("cpu.max"), "150000 100000");
    assert_eq!(fake.instance_file("pids.max"), "300");

    raise.restore().expect("restored");
    assert!(!raise.needs_restore());
    assert_eq!(fake.instance_file("memory.max"), "536870912");
    assert_eq!(fake.instance_file("cpu.max"), "50000 100000");
    assert_eq!(fake.instance_file("pids.max"), "100");
}

#[test]
fn max_stays_max_and_an_unlimited_side_makes_the_sum_max() {
    let fake = FakeCgroupfs::new("max", "50000 100000", "100");
    let instance = fake.instance();
    let incumbent = tier(Some(GIB), Some(500), Some(100));
    let successor = tier(Some(GIB), None, Some(50));
    let mut raise = instance
        .begin_raise(&incumbent, &successor)
        .expect("prepared");
    let controllers: Vec<Controller> = raise.record().saved.iter().map(|s| s.controller).collect();
    assert_eq!(
        controllers,
        vec![Controller::Cpu, Controller::Pids],
        "memory is already max"
    );
    raise.apply().expect("raised");
    assert_eq!(fake.instance_file("memory.max"), "max");
    assert_eq!(
        fake.instance_file("cpu.max"),
        "max 100000",
        "the successor runs unlimited"
    );
    assert_eq!(fake.instance_file("pids.max"), "150");
    raise.restore().expect("restored");
    assert_eq!(fake.instance_file("cpu.max"), "50000 100000");
    assert_eq!(fake.instance_file("pids.max"), "100");

    // Limits that already fit are left alone.
    let roomy = FakeCgroupfs::new("10000000000", "max 100000", "1000");
    let raise = roomy
        .instance()
        .begin_raise(&incumbent, &tier(Some(MIB), Some(1), Some(1)))
        .expect("prepared");
    assert!(raise.is_noop());
}

#[test]
fn a_raise_that_fails_halfway_still_restores_what_it_wrote() {
    let fake = FakeCgroupfs::new("536870912", "50000 100000", "100");
    let instance = fake.instance();
    let mut raise = instance
        .begin_raise(
            &tier(Some(512 * MIB), Some(500), Some(100)),
            &tier(Some(GIB), Some(500), Some(100)),
        )
        .expect("prepared");
    // pids.max turns into something no write can go to, after it was read.
    let pids = fake.root.join("default.app/pids.max");
    fs::remove_file(&pids).expect("remove pids.max");
    fs::create_dir(&pids).expect("pids.max as a directory");

    let err = raise.apply().expect_err("the pids.max write fails");
    assert!(err.to_string().contains("pids.max"), "{err}");
    assert!(
        raise.needs_restore(),
        "marked changed before the first write"
    );
    assert_eq!(
        fake.instance_file("memory.max"),
        (512 * MIB + GIB).to_string(),
        "memory was raised"
    );

    let err = raise
        .restore()
        .expect_err("pids.max still cannot be written");
    assert!(err.to_string().contains("pids.max"), "{err}");
    assert_eq!(
        fake.instance_file("memory.max"),
        "536870912",
        "memory restored anyway"
    );
    assert_eq!(
        fake.instance_file("cpu.max"),
        "50000 100000",
        "cpu restored anyway"
    );
    assert!(raise.needs_restore(), "a failed restore is still owed");

    fs::remove_dir(&pids).expect("remove the directory");
    fs::write(&pids, "300\n").expect("pids.max back as a file");
    raise.restore().expect("the retry restores");
    assert_eq!(fake.instance_file("pids.max"), "100");
    assert!(!raise.needs_restore());
}

#[test]
fn a_dropped_raise_restores_and_a_journal_record_restores_after_a_restart() {
    let fake = FakeCgroupfs::new("1000", "max 100000", "10");
    let instance = fake.instance();
    let incumbent = tier(Some(1000), None, Some(10));
    let successor = tier(Some(3000), None, Some(5));
    {
        let mut raise = instance
            .begin_raise(&incumbent, &successor)
            .expect("prepared");
        raise.apply().expect("raised");
        assert_eq!(fake.instance_file("memory.max"), "4000");
    }
    assert_eq!(fake.instance_file("memory.max"), "1000", "restored on drop");
    assert_eq!(fake.instance_file("pids.max"), "10");

    // The journal persists the record before the first write; a new agent
    // restores from it.
    let mut raise = instance
        .begin_raise(&incumbent, &successor)
        .expect("prepared");
    let persisted = serde_json::to_string(raise.record()).expect("serialise");
    raise.apply().expect("raised");
    let _ = raise.disarm(); // the agent "crashes": nobody restores
    assert_eq!(fake.instance_file("memory.max"), "4000");
    let record: RaiseRecord = serde_json::from_str(&persisted).expect("deserialise");
    assert_eq!(record.instance, fake.root.join("default.app"));
    let mut recovered = ParentRaise::from_record(record);
    assert!(recovered.needs_restore());
    recovered.restore().expect("restored from the record");
    assert_eq!(fake.instance_file("memory.max"), "1000");
    assert_eq!(fake.instance_file("pids.max"), "10");
    assert!(
        persisted.contains(r#""controller":"memory""#),
        "{persisted}"
    );
}

#[tokio::test]
async fn a_populated_generation_that_will_not_empty_is_refused_as_not_fresh() {
    let fake = FakeCgroupfs::new("max", "max 100000", "max");
    let gen_dir = fake.root.join("default.app/gen-3");
    // A plain file never reports the kill's effect: the wait times out.
    write_files(
        &gen_dir,
        &[
            ("cgroup.events", "populated 1\nfrozen 0\n"),
            ("cgroup.kill", ""),
            ("cgroup.procs", "4242\n"),
        ],
    );
    let instance = fake
        .manager()
        .with_fresh_kill_wait(Duration::from_millis(200))
        .instance(&key("default", "app"))
        .expect("instance");
    let err = instance
        .create_generation(3, &Tier::default())
        .await
        .expect_err("it cannot be made fresh");
    assert!(matches!(err, CgroupError::NotFresh { .. }), "{err:?}");
    assert!(err.to_string().contains("4242"), "{err}");
    assert_eq!(
        read(&gen_dir.join("cgroup.kill")),
        "1",
        "cgroup.kill was tried"
    );
}
