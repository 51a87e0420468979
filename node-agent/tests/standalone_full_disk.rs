//! A full state filesystem (issue 14): standalone mode fails closed. No
//! attempt runs under a revision its state does not hold, no outcome is
//! shown that nothing keeps, and no revision ever has two outcomes, across
//! a restart too. The state dir is a small real tmpfs, filled up.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use genswap_crds::{ConditionType, Outcome};
use node_agent::standalone::StatusDocument;
use standalone_support::{Manifest, StandaloneHost, key};

/// A small tmpfs, unmounted on drop. The host holds it and drops it before
/// its temp dir, which cannot be removed while the tmpfs is mounted in it.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(at: &Path) -> SmallDisk {
        std::fs::create_dir_all(at).expect("mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2m", "genswap-test-state"])
            .arg(at)
            .status()
            .expect("run mount");
        assert!(status.success(), "mounting a tmpfs (the tests run as root)");
        SmallDisk(at.to_path_buf())
    }
}

/// Writes a file into `dir` until its disk is full; returns its path.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    std::fs::File::create(&path).expect("the filler");
    top_up(&path);
    path
}

/// Appends to `filler` until its disk is full again.
fn top_up(filler: &Path) {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(filler)
        .expect("the filler");
    let chunk = vec![0u8; 4096];
    while file.write_all(&chunk).is_ok() {}
    let _ = file.sync_all();
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Every (revision, outcome) a status document shows.
fn outcomes(doc: &StatusDocument, seen: &mut BTreeMap<i64, Outcome>) {
    for attempt in &doc.attempts {
        if let Some(outcome) = attempt.status.outcome {
            let first = *seen.entry(attempt.sched_rev).or_insert(outcome);
            assert_eq!(
                first, outcome,
                "revision {} showed {first:?} and then {outcome:?}",
                attempt.sched_rev
            );
        }
    }
}

fn stalled_reason(doc: &StatusDocument) -> Option<String> {
    doc.status
        .conditions
        .iter()
        .find(|c| c.type_ == "Stalled" && c.status == "True")
        .map(|c| c.reason.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_state_disk_runs_nothing_unreserved_and_never_gives_a_revision_two_outcomes() {
    let mut host = StandaloneHost::start_prepared("full-state", false, BTreeMap::new(), |state| {
        Some(Box::new(SmallDisk::mount(state)))
    });
    let mut seen = BTreeMap::new();
    let one = host.build("build-1");
    let two = host.build("build-2");
    let web = key("web");
    host.write("web.yaml", &Manifest::new("web", "build-1", &one).yaml());
    let doc = host
        .status("web.yaml", "build-1 to serve", |doc| {
            doc.is_true(ConditionType::Ready)
        })
        .await;
    outcomes(&doc, &mut seen);
    let before = host.who_serves(&web).await.expect("build-1 serves");

    let filler = fill(host.state_dir());
    host.write("web.yaml", &Manifest::new("web", "build-2", &two).yaml());
    let doc = host
        .status("web.yaml", "Stalled=True StateUnwritable", |doc| {
            stalled_reason(doc).as_deref() == Some("StateUnwritable")
        })
        .await;
    outcomes(&doc, &mut seen);
    assert!(
        doc.error
            .as_deref()
            .unwrap_or_default()
            .contains("cannot be written"),
        "{:?}",
        doc.error
    );
    assert!(
        doc.attempts.iter().all(|a| a.sched_rev == 1),
        "no revision the state does not hold is shown or run: {:?}",
        doc.attempts
    );
    assert_eq!(
        host.who_serves(&web).await,
        Some(before.clone()),
        "build-1 keeps serving"
    );

    // A restart while the disk is still full: still nothing runs. Stopping
    // frees a little of the disk, so it is filled again before the new run,
    // and the old run's status document goes so that only the new run's
    // can answer.
    host.restart_after(|host| {
        top_up(&filler);
        std::fs::remove_file(host.status_path("web.yaml")).expect("the old run's status");
    })
    .await;
    let doc = host
        .status(
            "web.yaml",
            "Stalled=True StateUnwritable after the restart",
            |doc| stalled_reason(doc).as_deref() == Some("StateUnwritable"),
        )
        .await;
    outcomes(&doc, &mut seen);
    assert_eq!(
        host.who_serves(&web).await.map(|i| i.build),
        Some("build-1".into())
    );

    // Room again: the release runs under a revision on disk, once.
    std::fs::remove_file(&filler).expect("free the disk");
    let doc = host
        .status("web.yaml", "build-2 to serve", |doc| {
            doc.is_true(ConditionType::Ready)
                && doc.status.nodes.first().and_then(|n| n.build.as_deref()) == Some("build-2")
        })
        .await;
    outcomes(&doc, &mut seen);
    assert!(
        stalled_reason(&doc).is_none(),
        "{:?}",
        doc.status.conditions
    );
    assert_eq!(
        host.who_serves(&web).await.map(|i| i.build),
        Some("build-2".into())
    );
    let release = doc.last_attempt().expect("the release");
    // Revision 2 is the ask to stage build-2 ahead (rollout.prestage), the
    // first revision on disk; the swap follows it.
    assert_eq!(
        (release.sched_rev, release.outcome),
        (3, Outcome::Done),
        "the release ran once, under the first revisions on disk: {:?}",
        doc.attempts
    );
    host.stop().await;
}
