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
use crate::stage::ENTRY_PREFIX;
use crate::switch::{
    CURRENT_SOCKET, SwitchError, current_generation, point_current_allowing_unbound,
    remove_temp_links,
};

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

    async fn recover_instance(
        &self,
        key: InstanceKey,
        found: Found,
        journal_readable: bool,
    ) -> InstanceWork {
        let mut work = InstanceWork {
            recovery: InstanceRecovery {
                instance: key.clone(),
                serving: None,
                attempt: None,
                stopped: Vec::new(),
                current_fixed: false,
                parent_restored: false,
            },
            untracked: Vec::new(),
            removed: Vec::new(),
            errors: Vec::new(),
        };
        // Recovery is for what a previous process left. An instance this
        // engine already runs or swaps (recovery called late, or twice) is
        // its own, and is left alone.
        if let Some(state) = self.lock_instances().get(&key)
            && (state.busy || state.serving.is_some())
        {
            tracing::warn!(instance = %key, "recovery skips an instance this engine already runs");
            work.recovery.serving = state.info.clone();
            return work;
        }
        let run_dir = self.layout.instance_dir(&key);
        match remove_temp_links(&run_dir) {
            Ok(0) => {}
            Ok(_) => work
                .removed
                .push(run_dir.join(format!("{CURRENT_SOCKET}.tmp-*"))),
            Err(source) => work.errors.push(RecoveryError::Remove {
                path: run_dir.clone(),
                source,
            }),
        }
        let listing = found.listing;
        let generations: BTreeMap<u64, GenerationListing> = listing
            .iter()
            .flat_map(|l| l.generations.iter().cloned())
            .map(|g| (g.generation, g))
            .collect();
        let sockets = match self.layout.generation_sockets(&key) {
            Ok(sockets) => sockets,
            Err(source) => {
                work.errors.push(RecoveryError::RunDir {
                    path: run_dir.clone(),
                    source,
                });
                Vec::new()
            }
        };
        let host = HostView {
            live: generations
                .values()
                .filter(|g| g.populated)
                .map(|g| g.generation)
                .collect(),
            current: current_generation(&run_dir),
        };

        if !journal_readable {
            // Never act on a guess: adopt what current.sock names, touch
            // nothing else.
            if let Some(n) = host.current.filter(|n| host.live.contains(n))
                && let Some(listing) = generations.get(&n)
                && let Some(record) = record_from_host(&self.layout, &key, listing)
            {
                self.adopt(
                    &key,
                    record,
                    listing,
                    Adoption {
                        kind: InstanceKind::Instance,
                        preferred_pid: None,
                        lineage: None,
                    },
                    &mut work,
                );
            }
            return work;
        }

        // The counter stays above every number the host shows (an instance
        // the journal does not know gets no journal file for it).
        let journaled = found.entry.is_some() || found.quarantined;
        if journaled && let Some(highest) = generations.keys().chain(sockets.iter()).max().copied()
        {
            let journal = Arc::clone(&self.journal);
            let owned = key.clone();
            if let Err(source) =
                parts::blocking(move || journal.observe_generation(&owned, highest)).await
            {
                work.errors.push(RecoveryError::JournalWrite {
                    instance: key.clone(),
                    source,
                });
            }
        }

        let entry = found.entry;
        let in_flight = entry
            .as_ref()
            .and_then(|e| e.attempt.clone())
            .filter(|r| r.outcome.is_none());
        // The listeners the attempt in flight handed its successor.
        let successor_listeners = in_flight.as_ref().and_then(|r| {
            let n = r.successor.as_ref()?.n;
            Some((n, r.spec.as_deref()?.listeners.clone()))
        });
        let kind = entry
            .as_ref()
            .and_then(|e| e.attempt.as_ref().or(e.unreported.last()))
            .map_or(InstanceKind::Instance, |r| r.kind);
        // Generations the journal describes: stopping one is not
        // "untracked".
        let described: BTreeSet<u64> = entry
            .iter()
            .flat_map(|e| {
                let attempt = e.attempt.as_ref();
                [
                    e.serving.as_ref(),
                    attempt.and_then(|r| r.incumbent.as_ref()),
                    attempt.and_then(|r| r.successor.as_ref()),
                ]
            })
            .flatten()
            .map(|g| g.n)
            .collect();

        let decision = in_flight.as_ref().map(|record| decide(record, &host));
        let keep: Option<GenerationRecord> = match (&decision, &entry) {
            (Some(decision), _) => decision.keep.clone(),
            (None, Some(entry)) => settled_serving(entry, &host),
            (None, None) if found.quarantined => host
                .current
                .filter(|n| host.live.contains(n))
                .and_then(|n| generations.get(&n))
                .and_then(|listing| record_from_host(&self.layout, &key, listing)),
            (None, None) => None,
        };
        let keep_n = keep.as_ref().map(|g| g.n);
        let stop = in_flight
            .as_ref()
            .and_then(|r| r.stop.clone())
            .unwrap_or_default();

        // Every other live generation stops; empty ones and their sockets go.
        let mut notes = Vec::new();
        let mut drain = None;
        for (n, listing) in &generations {
            if Some(*n) == keep_n {
                continue;
            }
            let socket = self.layout.generation_socket(&key, *n);
            if listing.populated {
                let tracked = described.contains(n);
                match stop_generation(listing, &stop).await {
                    Ok(stopped) => {
                        if tracked {
                            if stopped.killed {
                                notes.push(format!(
                                    "generation {n} did not stop within {}s of the stop signal; its cgroup was killed",
                                    stop.timeout_seconds
                                ));
                            }
                            if record_is_incumbent(in_flight.as_ref(), *n) {
                                drain = Some(stopped.drain);
                            }
                            work.recovery.stopped.push(StoppedGeneration {
                                generation: *n,
                                cgroup: listing.cgroup.path().to_path_buf(),
                                pids: listing.pids.clone(),
                                killed: stopped.killed,
                            });
                        } else {
                            tracing::warn!(instance = %key, generation = n, pids = ?listing.pids, "a generation no journal entry describes was running; stopped");
                            work.untracked.push(UntrackedCgroup {
                                cgroup: listing.cgroup.path().to_path_buf(),
                                pids: listing.pids.clone(),
                                stopped: true,
                            });
                        }
                    }
                    Err(source) => {
                        notes.push(format!(
                            "generation {n} could not be proven stopped: {}",
                            reason_of(&source)
                        ));
                        if !tracked {
                            work.untracked.push(UntrackedCgroup {
                                cgroup: listing.cgroup.path().to_path_buf(),
                                pids: listing.pids.clone(),
                                stopped: false,
                            });
                        }
                        work.errors.push(RecoveryError::Stop {
                            cgroup: listing.cgroup.path().to_path_buf(),
                            source,
                        });
                        continue;
                    }
                }
            }
            match listing.cgroup.remove() {
                Ok(()) => work.removed.push(listing.cgroup.path().to_path_buf()),
                Err(source) => work.errors.push(RecoveryError::RemoveCgroup {
                    path: listing.cgroup.path().to_path_buf(),
                    source,
                }),
            }
            if socket.exists() {
                parts::remove_socket(&socket);
                work.removed.push(socket);
            }
        }
        for n in &sockets {
            if Some(*n) != keep_n && !generations.contains_key(n) {
                let socket = self.layout.generation_socket(&key, *n);
                parts::remove_socket(&socket);
                work.removed.push(socket);
            }
        }

        // current.sock names the one generation that serves, or nothing.
        match &keep {
            Some(kept) if host.current != Some(kept.n) => {
                // Proven healthy before the crash, by whichever probe.
                match point_current_allowing_unbound(&run_dir, &kept.socket) {
                    Ok(()) => work.recovery.current_fixed = true,
                    Err(source) => work.errors.push(RecoveryError::Switch {
                        instance: key.clone(),
                        generation: kept.n,
                        source,
                    }),
                }
            }
            Some(_) => {}
            None => {
                let link = run_dir.join(CURRENT_SOCKET);
                if fs::symlink_metadata(&link).is_ok() {
                    parts::remove_current_link(&self.layout, &key);
                    work.recovery.current_fixed = true;
                    work.removed.push(link);
                }
            }
        }

        // Parent limits go back only now that the extra generation has left.
        if let Some(saved) = in_flight.as_ref().and_then(|r| r.raised_parent.as_ref()) {
            let instance = self.cgroups.instance_handle(&key);
            let raise = raise_record(instance.path(), saved);
            match raise.restore() {
                Ok(()) => work.recovery.parent_restored = true,
                Err(source) => {
                    notes.push(format!(
                        "the instance cgroup's raised limits could not be restored: {}",
                        reason_of(&source)
                    ));
                    work.errors.push(RecoveryError::Restore {
                        path: instance.path().to_path_buf(),
                        source,
                    });
                }
            }
        }
        // An overlap that completed leaves the instance cgroup on the new
        // tier, as the engine would have.
        if let (Some(decision), Some(kept)) = (&decision, &keep)
            && decision.outcome == Outcome::Done
            && in_flight
                .as_ref()
                .is_some_and(|r| r.effective_mode == Mode::Overlap)
            && let Err(error) = self
                .cgroups
                .instance_handle(&key)
                .apply_tier(&tier_of(&kept.cgroup))
        {
            notes.push(reason_of(&error));
        }

        // The journal: what serves, then the outcome, last.
        let mut serving_record = keep.clone();
        if let Some(record) = serving_record.as_mut()
            && record.serving_since_ms.is_none()
        {
            record.serving_since_ms = Some(unix_millis_now());
        }
        let needs_serving_write = in_flight.is_some()
            || found.quarantined
            || entry.as_ref().map(|e| e.serving.as_ref().map(|g| g.n)) != Some(keep_n);
        // The journal's serving generation is gone and nothing was in
        // flight: it died while no agent ran. Say so, not only that
        // nothing serves (its exit status died with the agent).
        let died_away = match (
            &in_flight,
            &keep,
            entry.as_ref().and_then(|e| e.serving.as_ref()),
        ) {
            (None, None, Some(gone)) => Some(ExitRecord {
                generation: gone.n,
                build: gone.build.clone(),
                exit_code: None,
                signal: None,
                oom_killed: false,
                at_ms: unix_millis_now(),
                serving_since_ms: gone.serving_since_ms,
                liveness_failed: None,
            }),
            _ => None,
        };
        if needs_serving_write && (entry.is_some() || found.quarantined || keep.is_some()) {
            let journal = Arc::clone(&self.journal);
            let owned = key.clone();
            let serving = serving_record.clone();
            let write = move || match died_away {
                Some(exit) => journal.record_exit(&owned, exit),
                None => journal.set_serving(&owned, serving),
            };
            if let Err(source) = parts::blocking(write).await {
                work.errors.push(RecoveryError::JournalWrite {
                    instance: key.clone(),
                    source,
                });
            }
        }
        if let (Some(mut record), Some(decision)) = (in_flight, decision) {
            let mut reason = decision.reason;
            for note in notes {
                reason.push_str("; ");
                reason.push_str(&note);
            }
            let outcome = OutcomeRecord {
                outcome: decision.outcome,
                effective_mode: record.effective_mode,
                generation: record.successor.as_ref().map(|g| g.n),
                reason,
                executed: decision.executed,
                clean_exit: false,
                drain_ms: drain.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
                steps: Vec::new(),
                started_at_ms: record.started_at_ms,
                finished_at_ms: unix_millis_now(),
            };
            let phase = record.phase.name();
            if work.recovery.parent_restored {
                record.parent_restored();
            }
            record.finish(outcome.clone());
            tracing::info!(
                instance = %key,
                attempt = %record.attempt.name,
                phase,
                outcome = ?outcome.outcome,
                executed = outcome.executed,
                reason = %outcome.reason,
                "recovered an attempt left in flight"
            );
            let journal = Arc::clone(&self.journal);
            let to_write = record.clone();
            let lineage = record.lineage_after(serving_record.as_ref().map(|g| g.n));
            if let Err(source) = parts::blocking(move || journal.finish(&to_write, lineage)).await {
                work.errors.push(RecoveryError::JournalWrite {
                    instance: key.clone(),
                    source,
                });
            }
            work.recovery.attempt = Some(RecoveredAttempt {
                attempt: record.attempt,
                phase,
                outcome,
            });
        }

        if let Some(kept) = serving_record
            && let Some(listing) = generations.get(&kept.n)
        {
            let preferred = record_successor_pid(entry.as_ref(), kept.n);
            // The spec that started the generation kept: the attempt's in
            // flight if it is its successor, else the lineage's.
            let listeners = successor_listeners
                .filter(|(n, _)| *n == kept.n)
                .map(|(_, listeners)| listeners)
                .or_else(|| {
                    entry
                        .as_ref()
                        .and_then(|e| e.supervised.as_ref())
                        .map(|s| s.spec.listeners.clone())
                })
                .unwrap_or_default();
            let lineage = entry
                .as_ref()
                .and_then(|e| e.supervised.as_ref())
                .map(|s| &s.spec);
            let found = Adoption {
                kind,
                preferred_pid: preferred,
                lineage,
            };
            let pid = self.adopt(&key, kept, listing, found, &mut work);
            if let Some(pid) = pid {
                for problem in self.listeners.take_back(&key, pid, &listeners) {
                    tracing::debug!(instance = %key, %problem, "a listener the serving generation does not hold");
                }
            }
        }
        // The keeper holds them even when no generation does (an agent
        // killed in a hold's gap); a fresh keeper then holds what is held.
        let specs = journaled_listeners(entry.as_ref());
        for problem in self.listeners.take_back_from_keeper(&key, &specs) {
            tracing::warn!(instance = %key, %problem, "a listener could not be taken back; the next attempt binds it anew");
        }
        self.listeners.refresh_keeper(&key).await;

        // An instance the journal knows nothing of and that runs nothing
        // leaves no directory behind.
        if entry.is_none() && !found.quarantined && work.recovery.serving.is_none() {
            if let Some(listing) = &listing
                && listing.others.is_empty()
            {
                match Cgroup::at(&listing.path, self.cgroups.mount()).remove() {
                    Ok(()) => work.removed.push(listing.path.clone()),
                    Err(source) => work.errors.push(RecoveryError::RemoveCgroup {
                        path: listing.path.clone(),
                        source,
                    }),
                }
            }
            let existed = run_dir.exists();
            match self.layout.remove_instance_dir(&key) {
                Ok(()) if existed => work.removed.push(run_dir.clone()),
                Ok(()) => {}
                Err(source) => work.errors.push(RecoveryError::Remove {
                    path: run_dir.clone(),
                    source,
                }),
            }
        }
        // Child cgroups that are no generation are never genswap's.
        for other in listing.iter().flat_map(|l| l.others.iter()) {
            let mut sub = RecoveryReport::default();
            self.stop_untracked(other, &mut sub).await;
            work.untracked.extend(sub.untracked);
            work.removed.extend(sub.removed);
            work.errors.extend(sub.errors);
        }
        work
    }

    /// The cgroup tree, after the commands an earlier agent ran against its
    /// generations (exec probes, hooks) are killed with proof (SPEC 5.12):
    /// they are never adopted, and no generation looks alive for them.
    async fn list_without_commands(
        &self,
    ) -> Result<Vec<crate::cgroup::InstanceListing>, crate::cgroup::CgroupError> {
        let listings = self.cgroups.list()?;
        let mut killed = 0;
        for generation in listings.iter().flat_map(|listing| &listing.generations) {
            match crate::command::kill_commands(&generation.cgroup).await {
                Ok(n) => killed += n,
                Err(error) => tracing::error!(
                    cgroup = %generation.cgroup.path().display(),
                    error = %reason_of(&error),
                    "a command an earlier agent left could not be proven gone"
                ),
            }
        }
        if killed == 0 {
            return Ok(listings);
        }
        tracing::info!(
            killed,
            "recovery killed the commands an earlier agent left running"
        );
        self.cgroups.list()
    }

    /// Makes `record` the instance's serving generation in the engine, with
    /// its main process found in its cgroup; returns that process's pid.
    fn adopt(
        &self,
        key: &InstanceKey,
        record: GenerationRecord,
        listing: &GenerationListing,
        found: Adoption<'_>,
        work: &mut InstanceWork,
    ) -> Option<u32> {
        let Adoption {
            kind,
            preferred_pid,
            lineage,
        } = found;
        // A daemon's pid file names its main process better than the pid
        // journaled at the exec, which was its start's.
        let named = lineage
            .and_then(super::lifecycle::pid_file_of)
            .and_then(|file| super::lifecycle::named_process(&file, &listing.cgroup).ok());
        let pid = main_pid(&listing.pids, record.n, named.or(preferred_pid));
        let mut running = Running {
            tier: tier_of(listing.cgroup.path()),
            cgroup: listing.cgroup.clone(),
            kind,
            process: Process::Adopted { pid },
            notify: None,
            liveness: None,
            liveness_task: None,
            pre_stop: None,
            pid_file: None,
            record,
        };
        if let Some(spec) = lineage {
            // Its NOTIFY_SOCKET is bound again at the same path, which the
            // generation's next message finds: its watchdog is still heard.
            match parts::bind_notify(self, key, spec, running.record.n, &running.cgroup) {
                Ok(notify) => running.notify = notify,
                Err(error) => {
                    tracing::warn!(instance = %key, generation = running.record.n, error = %super::flow::reason_of(&error), "the adopted generation's notify socket cannot be bound again")
                }
            }
            running.pre_stop = super::lifecycle::PreStop::of(self, key, spec, &running);
        }
        // Probed again as its lineage asks: an agent restart does not end it.
        running.liveness = lineage.and_then(|spec| parts::liveness_of(self, key, spec, &running));
        let info = running.serving();
        let mut instances = self.lock_instances();
        let state = instances.entry(key.clone()).or_default();
        if state.busy {
            work.errors.push(RecoveryError::Busy {
                instance: key.clone(),
                generation: info.generation,
            });
            return None;
        }
        tracing::info!(instance = %key, generation = info.generation, pid, build = %info.build, "adopted the serving generation");
        state.info = Some(info.clone());
        state.serving = Some(running);
        self.watch_serving(key, state);
        work.recovery.serving = Some(info);
        Some(pid)
    }
}

/// The serving generation of an instance with no attempt in flight: the
/// journal's, while it runs. A generation the last finished attempt made
/// serve is taken when the journal could not record it and `current.sock`
/// names it.
/// Every listener the journal says the instance may hold: its lineage's
/// and its newest attempt's.
fn journaled_listeners(entry: Option<&InstanceEntry>) -> Vec<ListenerSpec> {
    let mut specs: Vec<ListenerSpec> = Vec::new();
    let Some(entry) = entry else {
        return specs;
    };
    let lineage = entry.supervised.iter().map(|s| &s.spec.listeners);
    let attempt = entry
        .attempt
        .iter()
        .filter_map(|r| r.spec.as_deref())
        .map(|spec| &spec.listeners);
    for spec in lineage.chain(attempt).flatten() {
        if !specs.contains(spec) {
            specs.push(spec.clone());
        }
    }
    specs
}

fn settled_serving(entry: &InstanceEntry, host: &HostView) -> Option<GenerationRecord> {
    if let Some(serving) = &entry.serving {
        return host.live.contains(&serving.n).then(|| serving.clone());
    }
    let finished = entry.attempt.as_ref()?;
    let successor = finished.successor.as_ref()?;
    let done = finished
        .outcome
        .as_ref()
        .is_some_and(|o| o.outcome == Outcome::Done && !o.clean_exit);
    (done && host.current == Some(successor.n) && host.live.contains(&successor.n))
        .then(|| successor.clone())
}

fn record_is_incumbent(record: Option<&Record>, n: u64) -> bool {
    record
        .and_then(|r| r.incumbent.as_ref())
        .is_some_and(|g| g.n == n)
}

/// The pid the journal recorded for generation `n`, if it started it.
fn record_successor_pid(entry: Option<&InstanceEntry>, n: u64) -> Option<u32> {
    let record = entry?.attempt.as_ref()?;
    if record.successor.as_ref()?.n != n {
        return None;
    }
    u32::try_from(record.successor_pid?).ok()
}

/// Stops a generation with proof of exit and removes its cgroup.
async fn stop_generation(
    listing: &GenerationListing,
    stop: &StopSpec,
) -> Result<StopReport, CgroupError> {
    let timeout = Duration::from_secs(u64::try_from(stop.timeout_seconds).unwrap_or(0));
    tracing::info!(cgroup = %listing.cgroup.path().display(), pids = ?listing.pids, "stopping a generation that must not serve");
    listing.cgroup.stop(stop_signal(stop.signal), timeout).await
}

/// The journal's saved parent limits as the cgroup manager restores them.
fn raise_record(instance: &Path, saved: &SavedLimits) -> RaiseRecord {
    let limits = [
        (Controller::Memory, &saved.memory_max),
        (Controller::Cpu, &saved.cpu_max),
        (Controller::Pids, &saved.pids_max),
    ];
    RaiseRecord {
        instance: instance.to_path_buf(),
        saved: limits
            .into_iter()
            .filter_map(|(controller, previous)| {
                Some(SavedLimit {
                    controller,
                    previous: previous.clone()?,
                    // Not needed to restore.
                    raised_to: String::new(),
                })
            })
            .collect(),
    }
}

/// The tier a generation cgroup carries, read back from its limit files
/// (absent files and `max` are unlimited).
fn tier_of(cgroup: &Path) -> Tier {
    let read = |controller: Controller| {
        fs::read_to_string(cgroup.join(controller.max_file()))
            .ok()
            .map(|text| text.trim().to_string())
    };
    let number = |text: Option<String>| text.and_then(|t| t.parse::<u64>().ok());
    let cpu = read(Controller::Cpu).and_then(|text| {
        let (quota, period) = text.split_once(' ')?;
        let (quota, period) = (quota.parse::<u64>().ok()?, period.parse::<u64>().ok()?);
        (period > 0).then(|| quota.saturating_mul(1000) / period)
    });
    Tier {
        memory_max_bytes: number(read(Controller::Memory)),
        cpu_max_millicores: cpu,
        pids_max: number(read(Controller::Pids)),
    }
}

/// The generation's main process: the one whose parent is outside its
/// cgroup (the tree's root), preferring the pid the journal recorded and
/// then the one whose `GENSWAP_GENERATION` is `n`.
fn main_pid(pids: &[u32], n: u64, preferred: Option<u32>) -> u32 {
    if let Some(pid) = preferred.filter(|p| pids.contains(p)) {
        return pid;
    }
    let set: BTreeSet<u32> = pids.iter().copied().collect();
    let roots: Vec<u32> = pids
        .iter()
        .copied()
        .filter(|pid| parent_of(*pid).is_none_or(|parent| !set.contains(&parent)))
        .collect();
    let generation = n.to_string();
    roots
        .iter()
        .copied()
        .find(|pid| environ_of(*pid).get("GENSWAP_GENERATION") == Some(&generation))
        .or_else(|| roots.iter().copied().min())
        .or_else(|| pids.iter().copied().min())
        .unwrap_or(0)
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the
    // last ')'. They are: state, ppid, ...
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn environ_of(pid: u32) -> HashMap<String, String> {
    fs::read(format!("/proc/{pid}/environ"))
        .map(|bytes| {
            bytes
                .split(|b| *b == 0)
                .filter_map(|var| std::str::from_utf8(var).ok())
                .filter_map(|var| var.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// A generation's record rebuilt from what the kernel says about its main
/// process, for an instance whose journal file was lost.
fn record_from_host(
    layout: &crate::switch::RunLayout,
    key: &InstanceKey,
    listing: &GenerationListing,
) -> Option<GenerationRecord> {
    let n = listing.generation;
    let pid = main_pid(&listing.pids, n, None);
    let env = environ_of(pid);
    let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
    let sha256 = exe
        .as_deref()
        .and_then(Path::file_name)
        .and_then(|name| name.to_str())
        .and_then(|name| name.strip_prefix(ENTRY_PREFIX))
        .unwrap_or_default()
        .to_string();
    let socket = layout.generation_socket(key, n);
    (env.get("GENSWAP_SOCKET").map(PathBuf::from).as_ref() == Some(&socket)).then(|| {
        GenerationRecord {
            n,
            build: env
                .get("GENSWAP_BUILD")
                .cloned()
                .unwrap_or_else(|| "unknown".into()),
            sha256,
            store_path: exe,
            cgroup: listing.cgroup.path().to_path_buf(),
            socket,
            config_rev: String::new(),
            restart_id: String::new(),
            serving_since_ms: None,
            // Not on the host: the defaults stop it.
            stop: None,
        }
    })
}

/// Every pid in a cgroup subtree.
fn pids_in_tree(dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = fs::read_to_string(dir.join("cgroup.procs"))
        .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default();
    for child in child_dirs(dir) {
        pids.extend(pids_in_tree(&child));
    }
    pids
}

fn child_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

/// The instance already found whose disk name is `name` (how a cut name is
/// resolved without a record of its own).
fn known_by_disk_name(found: &BTreeMap<InstanceKey, Found>, name: &str) -> Option<InstanceKey> {
    found
        .keys()
        .find(|key| DiskName::of(key).as_str() == name)
        .cloned()
}

/// Removes an empty cgroup subtree bottom-up.
fn remove_tree(dir: &Path) -> io::Result<()> {
    for child in child_dirs(dir) {
        remove_tree(&child)?;
    }
    match fs::remove_dir(dir) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
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
