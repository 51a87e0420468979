//! Crash recovery (SPEC 5.7): what a restarted agent does once it holds the
//! node lock and before it runs any attempt.
//!
//! The agent can be killed at any instant; the instances it started keep
//! running in their own cgroups. [`Engine::recover`] reads the intent
//! journal, the cgroup tree and the run dir, and leaves each instance with
//! exactly one generation serving (or none), adopted into the engine so the
//! next attempt treats it as the incumbent:
//!
//! | journal says (in flight) | host shows | recovery | outcome |
//! |---|---|---|---|
//! | overlap, before `switched` | | successor stopped with proof | `abandoned`; `executed` unless the journal never reached `spawning` |
//! | overlap `switched` | `current.sock` still names the incumbent | as before the switch | `abandoned`, executed |
//! | overlap `switched` / `incumbentStopped` | the switch happened, successor alive | retirement completed | `done` |
//! | overlap `switched` | the switch happened, successor gone, incumbent alive | `current.sock` back to the incumbent | `failed` |
//! | overlap `incumbentStopped` | successor gone | the incumbent's stop completed | `down` |
//! | hold `admitted` | | nothing happened; the incumbent keeps serving | `abandoned`, not executed |
//! | hold `incumbentStopped` | | the incumbent's stop completed (it may have been signalled) | `abandoned`, not executed; nothing serves until the retry |
//! | hold `spawning` / `spawned` | | successor stopped | `down` (an install: `abandoned`), executed |
//! | hold `healthy` / `switched` | successor alive | `current.sock` names it | `done` |
//! | hold `healthy` / `switched` | successor gone | | `down` (an install: `failed`) |
//!
//! With no attempt in flight the journal's serving generation is adopted
//! when it is still alive. Around that, on every instance:
//!
//! - every other live generation is stopped with proof (signal, stop
//!   timeout, `cgroup.kill`, `populated 0`); one the journal does not
//!   describe is reported as untracked;
//! - empty generation cgroups, sockets of generations that do not serve,
//!   and leftover `current.sock.tmp-*` links are removed;
//! - `current.sock` is repointed to the serving generation when it names
//!   another, and removed when nothing serves;
//! - parent limits an overlap raised are restored from the journal;
//! - the counter is kept above every `gen-<N>` seen on the host;
//! - the recovered outcome is written into the attempt's record
//!   ([`Phase::Finished`]), where the adapter finds it among the pending
//!   reports and delivers it once.
//!
//! A journal file that cannot be read back is quarantined and reported; its
//! instance keeps the generation `current.sock` names (identity read from
//! `/proc`) and nothing else. Cgroups under the root that no journal entry
//! accounts for are stopped when they hold processes and removed. When the
//! journal directory itself cannot be read, recovery adopts what
//! `current.sock` names and stops or removes nothing: it never acts on a
//! guess.
//!
//! Every host action is idempotent and the record is finished last, so a
//! crash during recovery is recovered by the next start.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use genswap_crds::{InstanceKind, ListenerSpec, Mode, Outcome, StopSpec};
use thiserror::Error;

use super::flow::reason_of;
use super::{Engine, Process, Running, ServingGeneration, parts};
use crate::cgroup::{
    Cgroup, CgroupError, Controller, GenerationListing, InstanceListing, RaiseRecord, SavedLimit,
    StopReport, Tier, stop_signal,
};
use crate::disk_name::DiskName;
use crate::gate::InstanceKey;
use crate::journal::{
    AttemptRef, CorruptEntry, ExitRecord, GenerationRecord, InstanceEntry, JournalError,
    OutcomeRecord, Phase, Record, SavedLimits, unix_millis_now,
};
use crate::switch::{
    CURRENT_SOCKET, SwitchError, current_generation, point_current_allowing_unbound,
    remove_temp_links,
};
use genswap_store::ENTRY_PREFIX;

mod host;
mod instance;

use host::*;

/// How long an untracked cgroup is given after `cgroup.kill` to empty.
const UNTRACKED_KILL_WAIT: Duration = Duration::from_secs(30);

/// What crash recovery found and did. A problem never stops it: each one is
/// in `errors` and the rest went on.
#[derive(Debug, Default)]
pub struct RecoveryReport {
    /// Every instance found in the journal, the cgroup tree or the run dir.
    pub instances: Vec<InstanceRecovery>,
    /// Journal files that could not be read back, moved aside.
    pub quarantined: Vec<QuarantinedEntry>,
    /// Cgroups under the genswap root that held processes no journal entry
    /// accounts for: reported, and stopped.
    pub untracked: Vec<UntrackedCgroup>,
    /// Leftovers removed: empty cgroups, sockets and links of generations
    /// that do not serve.
    pub removed: Vec<PathBuf>,
    /// What could not be done.
    pub errors: Vec<RecoveryError>,
}

impl RecoveryReport {
    /// Every attempt recovery found in flight and ended, with its outcome.
    pub fn recovered(&self) -> impl Iterator<Item = &RecoveredAttempt> {
        self.instances.iter().filter_map(|i| i.attempt.as_ref())
    }

    /// The recovery of `instance`, if it was found.
    pub fn instance(&self, instance: &InstanceKey) -> Option<&InstanceRecovery> {
        self.instances.iter().find(|i| &i.instance == instance)
    }

    /// Nothing went wrong.
    pub fn is_clean(&self) -> bool {
        self.errors.is_empty()
    }
}

/// What recovery did for one instance.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceRecovery {
    /// The instance.
    pub instance: InstanceKey,
    /// The generation adopted as serving; `None` when nothing serves.
    pub serving: Option<ServingGeneration>,
    /// The attempt found in flight, and the outcome recovery gave it.
    pub attempt: Option<RecoveredAttempt>,
    /// Generations the journal describes that were stopped with proof.
    pub stopped: Vec<StoppedGeneration>,
    /// `current.sock` was repointed, or removed because nothing serves.
    pub current_fixed: bool,
    /// Parent limits an overlap had raised were written back.
    pub parent_restored: bool,
}

/// An attempt recovery found in flight and ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RecoveredAttempt {
    /// Which attempt.
    pub attempt: AttemptRef,
    /// The last phase its journal record reached.
    pub phase: &'static str,
    /// The outcome written into its record.
    pub outcome: OutcomeRecord,
}

/// A generation stopped with proof of exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoppedGeneration {
    /// N.
    pub generation: u64,
    /// Its cgroup.
    pub cgroup: PathBuf,
    /// The processes it held.
    pub pids: Vec<u32>,
    /// It did not stop within the stop timeout: `cgroup.kill` ended it.
    pub killed: bool,
}

/// Processes in a cgroup no journal entry accounts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UntrackedCgroup {
    /// The cgroup.
    pub cgroup: PathBuf,
    /// The processes it held.
    pub pids: Vec<u32>,
    /// They were proven stopped.
    pub stopped: bool,
}

/// A journal file that could not be read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantinedEntry {
    /// What is wrong with it.
    pub entry: CorruptEntry,
    /// Where it was moved (`<file>.corrupt-<unix millis>`); `None` when the
    /// move failed (see the report's errors).
    pub moved_to: Option<PathBuf>,
}

/// Something recovery could not do.
#[derive(Debug, Error)]
pub enum RecoveryError {
    /// The journal directory could not be read: nothing was stopped or
    /// removed.
    #[error("cannot read the intent journal ({0}); recovery stopped and removed nothing")]
    Journal(#[source] JournalError),
    /// A journal write of recovery failed.
    #[error("cannot record the recovery of {instance} in the intent journal: {source}")]
    JournalWrite {
        instance: InstanceKey,
        #[source]
        source: JournalError,
    },
    /// A corrupt journal file could not be moved aside.
    #[error("cannot quarantine the corrupt journal file {path}: {source}")]
    Quarantine {
        path: PathBuf,
        #[source]
        source: JournalError,
    },
    /// The cgroup tree could not be read: nothing was adopted.
    #[error("cannot read the cgroup tree ({0}); no generation was adopted")]
    Cgroups(#[source] CgroupError),
    /// The run dir could not be read.
    #[error("cannot read the run dir {path}: {source}")]
    RunDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A cgroup could not be proven stopped; it is left as it is.
    #[error("{cgroup} could not be proven stopped: {source}")]
    Stop {
        cgroup: PathBuf,
        #[source]
        source: CgroupError,
    },
    /// An empty cgroup could not be removed.
    #[error("cannot remove the cgroup {path}: {source}")]
    RemoveCgroup {
        path: PathBuf,
        #[source]
        source: CgroupError,
    },
    /// A leftover file or directory could not be removed.
    #[error("cannot remove {path}: {source}")]
    Remove {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `current.sock` could not be pointed at the serving generation.
    #[error("cannot point current.sock of {instance} at generation {generation}: {source}")]
    Switch {
        instance: InstanceKey,
        generation: u64,
        #[source]
        source: SwitchError,
    },
    /// Raised parent limits could not be written back.
    #[error("cannot restore the raised limits of {path}: {source}")]
    Restore {
        path: PathBuf,
        #[source]
        source: CgroupError,
    },
    /// The instance was mid-operation, so nothing was adopted into it.
    #[error("{instance} is mid-operation; generation {generation} was not adopted")]
    Busy {
        instance: InstanceKey,
        generation: u64,
    },
}

/// What the host shows of one instance's generations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct HostView {
    /// Generations whose cgroup holds processes.
    live: BTreeSet<u64>,
    /// The generation `current.sock` names.
    current: Option<u64>,
}

/// What recovery makes of an attempt left in flight.
#[derive(Clone, Debug, PartialEq)]
struct Decision {
    /// The generation that serves afterwards.
    keep: Option<GenerationRecord>,
    outcome: Outcome,
    executed: bool,
    reason: String,
}

/// SPEC 5.7 for one attempt in flight: the journal's record and what the
/// host shows. Pure; the table is in the module docs.
fn decide(record: &Record, host: &HostView) -> Decision {
    let phase = record.phase.name();
    let incumbent = record.incumbent.as_ref();
    let successor = record.successor.as_ref();
    let alive = |g: Option<&GenerationRecord>| g.filter(|g| host.live.contains(&g.n)).cloned();
    let (incumbent_alive, successor_alive) = (alive(incumbent), alive(successor));
    let n_of =
        |g: Option<&GenerationRecord>| g.map_or_else(|| "?".to_string(), |g| g.n.to_string());
    let restart = match (&record.phase, successor) {
        (Phase::Healthy, Some(s)) => format!(
            "the agent restarted in phase {phase} (generation {} had passed its health check)",
            s.n
        ),
        _ => format!("the agent restarted in phase {phase}"),
    };
    let still_serves = |kept: &Option<GenerationRecord>| match (kept, incumbent) {
        (Some(kept), _) => format!("generation {} keeps serving", kept.n),
        (None, Some(gone)) => format!("nothing serves: generation {} is no longer running", gone.n),
        (None, None) => "nothing served before it".to_string(),
    };
    match record.effective_mode {
        Mode::Overlap => {
            let link_moved = successor.is_some_and(|s| host.current == Some(s.n));
            let retiring = record.phase == Phase::IncumbentStopped;
            if !(retiring || link_moved) {
                let stopped = successor
                    .map(|s| format!("; successor generation {} is stopped", s.n))
                    .unwrap_or_default();
                return Decision {
                    reason: format!(
                        "{restart}, before the switch{stopped}; {}",
                        still_serves(&incumbent_alive)
                    ),
                    keep: incumbent_alive,
                    outcome: Outcome::Abandoned,
                    executed: record.exec_may_have_run,
                };
            }
            match successor_alive {
                Some(kept) => Decision {
                    reason: match incumbent {
                        Some(old) => format!(
                            "completed by recovery ({restart}, after the switch): generation {} retired",
                            old.n
                        ),
                        None => format!("completed by recovery ({restart}, after the switch)"),
                    },
                    keep: Some(kept),
                    outcome: Outcome::Done,
                    executed: true,
                },
                None if !retiring && incumbent_alive.is_some() => Decision {
                    reason: format!(
                        "generation {} exited after the switch (its exit status is unknown: {restart}); current.sock names generation {} again",
                        n_of(successor),
                        n_of(incumbent)
                    ),
                    keep: incumbent_alive,
                    outcome: Outcome::Failed,
                    executed: true,
                },
                None => Decision {
                    reason: format!(
                        "generation {} exited after the switch (its exit status is unknown: {restart}) and the former generation was stopping; nothing serves",
                        n_of(successor)
                    ),
                    keep: None,
                    outcome: Outcome::Down,
                    executed: true,
                },
            }
        }
        Mode::Hold => match record.phase {
            Phase::Admitted | Phase::ParentRaised { .. } => Decision {
                reason: format!(
                    "{restart}, before anything was stopped or started; {}",
                    still_serves(&incumbent_alive)
                ),
                keep: incumbent_alive,
                outcome: Outcome::Abandoned,
                executed: record.exec_may_have_run,
            },
            Phase::IncumbentStopped => Decision {
                reason: match incumbent {
                    Some(old) => format!(
                        "{restart}: generation {} was being stopped and generation {} had not started; its stop is completed and nothing serves until the attempt is retried",
                        old.n,
                        n_of(successor)
                    ),
                    None => format!("{restart}, before generation {} started", n_of(successor)),
                },
                keep: None,
                outcome: Outcome::Abandoned,
                executed: record.exec_may_have_run,
            },
            Phase::Spawning | Phase::Spawned { .. } => Decision {
                reason: format!(
                    "{restart}: generation {} may have started and was never proven healthy; it is stopped and nothing serves",
                    n_of(successor)
                ),
                keep: None,
                outcome: if incumbent.is_some() {
                    Outcome::Down
                } else {
                    Outcome::Abandoned
                },
                executed: true,
            },
            Phase::Healthy | Phase::Switched | Phase::Finished => match successor_alive {
                Some(kept) => Decision {
                    reason: format!(
                        "completed by recovery ({restart}, after generation {} was healthy)",
                        kept.n
                    ),
                    keep: Some(kept),
                    outcome: Outcome::Done,
                    executed: true,
                },
                None => Decision {
                    reason: format!(
                        "generation {} exited after it was healthy (its exit status is unknown: {restart}); nothing serves",
                        n_of(successor)
                    ),
                    keep: None,
                    outcome: if incumbent.is_some() {
                        Outcome::Down
                    } else {
                        Outcome::Failed
                    },
                    executed: true,
                },
            },
        },
    }
}

/// One instance as found on the host and in the journal.
#[derive(Default)]
struct Found {
    entry: Option<InstanceEntry>,
    /// Its journal file was corrupt and moved aside.
    quarantined: bool,
    listing: Option<InstanceListing>,
}

/// One instance's share of the report.
struct InstanceWork {
    recovery: InstanceRecovery,
    untracked: Vec<UntrackedCgroup>,
    removed: Vec<PathBuf>,
    errors: Vec<RecoveryError>,
}

impl Engine {
    /// Crash recovery: adopts every live generation and finishes or rolls
    /// back every attempt a previous agent left in flight (SPEC 5.7; the
    /// table is in this module's docs). Call it once, while holding the
    /// node lock and before any attempt runs; afterwards
    /// [`crate::journal::Journal::pending_reports`] holds every recovered
    /// outcome for the adapter to deliver.
    pub async fn recover(&self) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        let journal = Arc::clone(&self.journal);
        let read = parts::blocking(move || {
            let temp_files = journal.remove_temp_files();
            journal.load_all().map(|loaded| (loaded, temp_files))
        })
        .await;
        let mut found: BTreeMap<InstanceKey, Found> = BTreeMap::new();
        // Run dirs first: the records of cut names in them say whose a
        // cgroup or a corrupt journal file is when the journal cannot.
        match self.layout.instances() {
            Ok(keys) => {
                for key in keys {
                    found.entry(key).or_default();
                }
            }
            Err(source) => report.errors.push(RecoveryError::RunDir {
                path: self.layout.run_dir().to_path_buf(),
                source,
            }),
        }
        let journal_readable = match read {
            Ok(((entries, corrupt), temp_files)) => {
                if let Err(error) = temp_files {
                    report.errors.push(RecoveryError::Journal(error));
                }
                for entry in entries {
                    let key = entry.instance.clone();
                    found.entry(key).or_default().entry = Some(entry);
                }
                for mut bad in corrupt {
                    if bad.instance.is_none() {
                        let stem = bad.path.file_stem().and_then(|s| s.to_str());
                        bad.instance = stem.and_then(|stem| known_by_disk_name(&found, stem));
                    }
                    self.quarantine(bad, &mut found, &mut report).await;
                }
                true
            }
            Err(error) => {
                tracing::error!(error = %reason_of(&error), "recovery cannot read the intent journal; it stops and removes nothing");
                report.errors.push(RecoveryError::Journal(error));
                false
            }
        };

        let listings = match self.list_without_commands().await {
            Ok(listings) => listings,
            Err(error) => {
                tracing::error!(error = %reason_of(&error), "recovery cannot read the cgroup tree; nothing is adopted");
                report.errors.push(RecoveryError::Cgroups(error));
                return report;
            }
        };
        let mut listed_paths = BTreeSet::new();
        for listing in listings {
            listed_paths.insert(listing.path.clone());
            let key = DiskName::key_spelled_by(&listing.dir_name)
                .or_else(|| known_by_disk_name(&found, &listing.dir_name));
            match key {
                Some(key) => found.entry(key).or_default().listing = Some(listing),
                None if journal_readable => {
                    self.stop_untracked(&listing.path, &mut report).await;
                }
                None => {}
            }
        }
        if journal_readable {
            // Directories `list` skips that are no instance and not the
            // agent's own (the log shims'): never genswap's, so nothing in
            // them is tracked.
            for path in child_dirs(self.cgroups.root()) {
                let own = path.file_name().is_some_and(crate::cgroup::is_agent_cgroup);
                if !listed_paths.contains(&path) && !own {
                    self.stop_untracked(&path, &mut report).await;
                }
            }
        }

        let works = futures::future::join_all(
            found
                .into_iter()
                .map(|(key, found)| self.recover_instance(key, found, journal_readable)),
        )
        .await;
        if journal_readable {
            // Keepers of instances that are gone hold their ports.
            self.listeners.stop_stale_keepers().await;
        }
        for work in works {
            report.instances.push(work.recovery);
            report.untracked.extend(work.untracked);
            report.removed.extend(work.removed);
            report.errors.extend(work.errors);
        }
        for error in &report.errors {
            tracing::error!(error = %reason_of(error), "recovery could not do everything");
        }
        tracing::info!(
            instances = report.instances.len(),
            serving = report
                .instances
                .iter()
                .filter(|i| i.serving.is_some())
                .count(),
            recovered = report.recovered().count(),
            untracked = report.untracked.len(),
            quarantined = report.quarantined.len(),
            errors = report.errors.len(),
            "crash recovery done"
        );
        // The store after a crash: unfinished copies and unpacks go, then
        // what retention does not keep (SPEC 5.14).
        let store = self.stager.clone();
        match parts::blocking(move || store.store().remove_temp_files()).await {
            Ok(0) => {}
            Ok(removed) => {
                tracing::info!(removed, "removed the store's unfinished copies and trees")
            }
            Err(error) => tracing::warn!(%error, "cannot remove the store's unfinished copies"),
        }
        if journal_readable {
            self.collect_store().await;
        }
        report
    }

    /// Moves a corrupt journal file aside; its instance is then recovered
    /// from the host alone.
    async fn quarantine(
        &self,
        bad: CorruptEntry,
        found: &mut BTreeMap<InstanceKey, Found>,
        report: &mut RecoveryReport,
    ) {
        let journal = Arc::clone(&self.journal);
        let entry = bad.clone();
        let moved = parts::blocking(move || journal.quarantine(&entry)).await;
        tracing::error!(path = %bad.path.display(), error = %bad.error, "a journal file cannot be read back; it is quarantined and its instance recovered from the host");
        let moved_to = match moved {
            Ok(path) => Some(path),
            Err(source) => {
                report.errors.push(RecoveryError::Quarantine {
                    path: bad.path.clone(),
                    source,
                });
                None
            }
        };
        if let Some(key) = &bad.instance {
            found.entry(key.clone()).or_default().quarantined = true;
        }
        report.quarantined.push(QuarantinedEntry {
            entry: bad,
            moved_to,
        });
    }

    /// Kills everything in a cgroup subtree no journal entry accounts for,
    /// and removes it.
    async fn stop_untracked(&self, path: &Path, report: &mut RecoveryReport) {
        let cgroup = Cgroup::at(path, self.cgroups.mount());
        let pids = pids_in_tree(path);
        let mut stopped = true;
        if !pids.is_empty() {
            tracing::warn!(cgroup = %path.display(), ?pids, "processes in a cgroup no journal entry accounts for; stopping them");
            if let Err(source) = cgroup.kill(UNTRACKED_KILL_WAIT).await {
                stopped = false;
                report.errors.push(RecoveryError::Stop {
                    cgroup: path.to_path_buf(),
                    source,
                });
            }
            report.untracked.push(UntrackedCgroup {
                cgroup: path.to_path_buf(),
                pids,
                stopped,
            });
        }
        if stopped {
            match remove_tree(path) {
                Ok(()) => report.removed.push(path.to_path_buf()),
                Err(source) => report.errors.push(RecoveryError::Remove {
                    path: path.to_path_buf(),
                    source,
                }),
            }
        }
    }
}

/// What recovery knows of a generation it adopts besides its record: its
/// kind, the pid the journal names, and the spec of the lineage it serves.
struct Adoption<'a> {
    kind: InstanceKind,
    preferred_pid: Option<u32>,
    lineage: Option<&'a genswap_crds::SwapAttemptSpec>,
}

#[cfg(test)]
mod tests {
    use super::instance::settled_serving;
    use super::*;
    use genswap_crds::{Cause, InstanceKind};

    fn generation(n: u64) -> GenerationRecord {
        GenerationRecord {
            n,
            build: format!("b{n}"),
            sha256: "ab".repeat(32),
            store_path: None,
            cgroup: format!("/cg/default.app/gen-{n}").into(),
            socket: format!("/run/default.app/gen-{n}.sock").into(),
            config_rev: String::new(),
            restart_id: String::new(),
            serving_since_ms: None,
            stop: None,
        }
    }

    /// An attempt from generation 1 to 2 of `mode`, advanced through
    /// `phases`.
    fn record(mode: Mode, incumbent: bool, phases: &[Phase]) -> Record {
        let mut record = Record::admitted(
            InstanceKey::new("default", "app").expect("key"),
            AttemptRef {
                name: "app-node-a-2".into(),
                uid: None,
                sched_rev: 2,
            },
            Cause::Release,
            InstanceKind::Instance,
            mode,
            mode,
        );
        record.incumbent = incumbent.then(|| generation(1));
        record.successor = Some(generation(2));
        for phase in phases {
            record.advance(phase.clone());
        }
        record
    }

    fn host(live: &[u64], current: Option<u64>) -> HostView {
        HostView {
            live: live.iter().copied().collect(),
            current,
        }
    }

    fn verdict(record: &Record, host: &HostView) -> (Option<u64>, Outcome, bool) {
        let decision = decide(record, host);
        assert!(!decision.reason.is_empty());
        (
            decision.keep.map(|g| g.n),
            decision.outcome,
            decision.executed,
        )
    }

    #[test]
    fn overlap_before_the_switch_keeps_the_incumbent() {
        use Outcome::Abandoned;
        let admitted = record(Mode::Overlap, true, &[]);
        assert_eq!(
            verdict(&admitted, &host(&[1], Some(1))),
            (Some(1), Abandoned, false)
        );
        let raised = record(
            Mode::Overlap,
            true,
            &[Phase::ParentRaised {
                saved: SavedLimits::default(),
            }],
        );
        assert_eq!(
            verdict(&raised, &host(&[1], Some(1))),
            (Some(1), Abandoned, false)
        );
        for phases in [
            vec![Phase::Spawning],
            vec![Phase::Spawning, Phase::Spawned { pid: 7 }],
            vec![Phase::Spawning, Phase::Spawned { pid: 7 }, Phase::Healthy],
            // Journaled, but the link never moved.
            vec![Phase::Spawning, Phase::Healthy, Phase::Switched],
        ] {
            let record = record(Mode::Overlap, true, &phases);
            assert_eq!(
                verdict(&record, &host(&[1, 2], Some(1))),
                (Some(1), Abandoned, true),
                "{phases:?}"
            );
        }
        // An install before the switch leaves nothing serving.
        let install = record(Mode::Overlap, false, &[Phase::Spawning, Phase::Healthy]);
        assert_eq!(
            verdict(&install, &host(&[2], None)),
            (None, Abandoned, true)
        );
    }

    #[test]
    fn overlap_after_the_switch_completes() {
        let switched = record(Mode::Overlap, true, &[Phase::Spawning, Phase::Switched]);
        assert_eq!(
            verdict(&switched, &host(&[1, 2], Some(2))),
            (Some(2), Outcome::Done, true)
        );
        let retiring = record(
            Mode::Overlap,
            true,
            &[Phase::Spawning, Phase::Switched, Phase::IncumbentStopped],
        );
        assert_eq!(
            verdict(&retiring, &host(&[2], Some(2))),
            (Some(2), Outcome::Done, true)
        );
        // The successor died after the switch: back to a live incumbent
        // that was never signalled, else nothing serves.
        assert_eq!(
            verdict(&switched, &host(&[1], Some(2))),
            (Some(1), Outcome::Failed, true)
        );
        assert_eq!(
            verdict(&retiring, &host(&[1], Some(2))),
            (None, Outcome::Down, true)
        );
    }

    #[test]
    fn hold_is_down_once_the_new_build_may_have_run_unproven() {
        let admitted = record(Mode::Hold, true, &[]);
        assert_eq!(
            verdict(&admitted, &host(&[1], Some(1))),
            (Some(1), Outcome::Abandoned, false)
        );
        let stopping = record(Mode::Hold, true, &[Phase::IncumbentStopped]);
        assert_eq!(
            verdict(&stopping, &host(&[1], Some(1))),
            (None, Outcome::Abandoned, false)
        );
        for phases in [
            vec![Phase::IncumbentStopped, Phase::Spawning],
            vec![
                Phase::IncumbentStopped,
                Phase::Spawning,
                Phase::Spawned { pid: 7 },
            ],
        ] {
            let record = record(Mode::Hold, true, &phases);
            assert_eq!(
                verdict(&record, &host(&[2], None)),
                (None, Outcome::Down, true),
                "{phases:?}"
            );
        }
        let install = record(
            Mode::Hold,
            false,
            &[Phase::IncumbentStopped, Phase::Spawning],
        );
        assert_eq!(
            verdict(&install, &host(&[2], None)),
            (None, Outcome::Abandoned, true)
        );
    }

    #[test]
    fn hold_proven_healthy_is_done_while_it_runs() {
        for last in [Phase::Healthy, Phase::Switched] {
            let record = record(
                Mode::Hold,
                true,
                &[Phase::IncumbentStopped, Phase::Spawning, last.clone()],
            );
            assert_eq!(
                verdict(&record, &host(&[2], None)),
                (Some(2), Outcome::Done, true),
                "{last:?}"
            );
            assert_eq!(
                verdict(&record, &host(&[], Some(2))),
                (None, Outcome::Down, true),
                "{last:?}"
            );
        }
    }

    #[test]
    fn the_journal_serving_generation_is_kept_only_while_it_runs() {
        let mut entry: InstanceEntry = serde_json::from_value(serde_json::json!({
            "version": 1,
            "instance": "default.app",
            "nextGeneration": 3,
        }))
        .expect("an entry");
        entry.serving = Some(generation(2));
        assert_eq!(
            settled_serving(&entry, &host(&[2], Some(2))).map(|g| g.n),
            Some(2)
        );
        assert_eq!(settled_serving(&entry, &host(&[], Some(2))), None);
    }

    #[test]
    fn tiers_are_read_back_from_limit_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(tier_of(dir.path()), Tier::default());
        fs::write(dir.path().join("memory.max"), "268435456\n").expect("write");
        fs::write(dir.path().join("cpu.max"), "50000 100000\n").expect("write");
        fs::write(dir.path().join("pids.max"), "max\n").expect("write");
        assert_eq!(
            tier_of(dir.path()),
            Tier {
                memory_max_bytes: Some(268_435_456),
                cpu_max_millicores: Some(500),
                pids_max: None,
            }
        );
    }

    #[test]
    fn saved_limits_restore_what_they_saved() {
        let dir = tempfile::tempdir().expect("temp dir");
        fs::write(dir.path().join("memory.max"), "999").expect("write");
        let saved = SavedLimits {
            memory_max: Some("100".into()),
            cpu_max: None,
            pids_max: None,
        };
        raise_record(dir.path(), &saved).restore().expect("restore");
        assert_eq!(
            fs::read_to_string(dir.path().join("memory.max"))
                .expect("read")
                .trim(),
            "100"
        );
    }
}
