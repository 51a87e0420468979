//! The per-instance intent journal (SPEC §5.5 step 4, §5.7).
//!
//! One file per instance, `<state dir>/journal/<namespace>.<instance>.json`,
//! holds everything the agent must know about that instance after a crash:
//!
//! - the generation counter: the next N to hand out, strictly above every N
//!   ever handed out or seen on the host, across restarts;
//! - the serving generation, so a restarted agent adopts it;
//! - the attempt in flight, as a [`Record`] the engine advances step by step
//!   ([`Phase`]), written before the step it announces takes effect on the
//!   host; and, once it ended, its outcome until the adapter acknowledges
//!   that the API server (or the standalone status file) accepted it;
//! - outcomes of earlier attempts not yet acknowledged when a newer attempt
//!   began (`unreported`), so no outcome is ever lost.
//!
//! Every write replaces the whole file: a temp file in the same directory is
//! written and fsynced, renamed over the file, and (for a [`Durability::Durable`]
//! write) the directory is fsynced. A reader sees the old file or the new
//! one, never a mix; a crash leaves at most a `*.tmp-*` file that readers
//! ignore and [`Journal::remove_temp_files`] deletes.
//!
//! # Which writes are durable
//!
//! Every write survives the agent's own death: the rename is visible to the
//! next agent at once. What a crash of the whole node may undo is a rename
//! whose directory was not fsynced. A [`Durability::Ordered`] write skips
//! that fsync: after a node crash the file is that version or an earlier
//! one, each whole (its bytes were synced before the rename). The engine
//! uses it for phases whose loss a node crash makes harmless, because the
//! crash stops every generation and recovery's decision for an earlier
//! phase with nothing running is the same: admitted, a parent raise (the
//! cgroup is gone too), spawned, healthy, the switch's serving record. Two
//! writes stay durable: the intent before the exec (`spawning`: a build may
//! have run, so `executed` can never be read back as false) and the outcome
//! with the lineage (what was reported `done` is what is started again).
//!
//! Each file carries a `checksum`, the sha256 of the entry's compact JSON,
//! so damage that still leaves well-formed JSON (a flipped digit, a letter
//! changed inside a string) is found too; a file without one (written before
//! checksums) is read as it stands. A file that cannot be read back
//! (truncated by a disk fault, garbage, a checksum that does not match,
//! another format version) is reported as a [`CorruptEntry`] by
//! [`Journal::load_all`] and never hides other instances. Writes to that
//! instance are refused until recovery quarantines the file
//! ([`Journal::quarantine`]); the generation counter is then rebuilt with
//! [`Journal::observe_generation`] from what the host shows.
//!
//! Calls are blocking file I/O (each write is one fsync'd file and one
//! fsync'd directory): async callers run them in `spawn_blocking`. Calls for
//! the same instance are serialized inside the journal, so the adapter may
//! acknowledge while the engine records. Open the journal only while holding
//! the node lock: one agent writes it at a time.
//!
//! For the one classifier (SPEC §5.4) a [`JournalError`] before the exec is
//! `stale`: the host refused, nothing of the build ran.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use genswap_crds::ServingState;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::disk_name::temp_name;
use crate::disk_name::{self, DiskName};
use crate::gate::InstanceKey;
use crate::switch::fsync_dir;

mod record;

pub use record::{
    AttemptRef, CorruptEntry, ExitRecord, FIRST_GENERATION, FORMAT_VERSION, GenerationRecord,
    InstanceEntry, Lineage, OutcomeRecord, Phase, Record, SavedLimits, Supervised, builds_of,
    unix_millis_now,
};

/// How far a write must have reached the disk before it returns (see the
/// module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Survives a crash of the node: the file and its directory are fsynced.
    #[default]
    Durable,
    /// Survives the agent's death; a node crash leaves this version or an
    /// earlier one, whole: the file is fsynced, its directory is not.
    Ordered,
}

/// One write of an attempt's record, and what else it changes in the same
/// file.
#[derive(Clone, Debug, Default)]
pub struct AttemptWrite {
    pub durability: Durability,
    /// What the attempt's end does to the supervised lineage.
    pub lineage: Lineage,
    /// `Some`: the generation serving now (`Some(None)`: nothing serves).
    pub serving: Option<Option<GenerationRecord>>,
}

/// The journal's directory under the agent's state dir.
pub const JOURNAL_DIR: &str = "journal";

/// Why a journal operation failed.
#[derive(Debug, Error)]
pub enum JournalError {
    #[error("cannot create the journal directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the journal directory {path}: {source}")]
    ReadDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the journal file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the journal file {path} is corrupt ({error}); recovery must quarantine it before this instance can swap"
    )]
    Corrupt { path: PathBuf, error: String },
    #[error("cannot write the journal file {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot encode the journal entry for {instance}: {source}")]
    Encode {
        instance: InstanceKey,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "attempt {in_flight} (schedRev {sched_rev}, phase {phase}) of {instance} is still in flight; it must finish or be recovered before another is journaled"
    )]
    InFlight {
        instance: InstanceKey,
        in_flight: String,
        sched_rev: i64,
        phase: &'static str,
    },
    #[error("the generation counter of {instance} is exhausted")]
    GenerationsExhausted { instance: InstanceKey },
}

/// The intent journal under `<state dir>/journal`.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    /// One lock per instance: read-modify-write of one file is atomic
    /// against other calls for the same instance.
    locks: Mutex<HashMap<InstanceKey, Arc<Mutex<()>>>>,
}

impl Journal {
    /// Opens (creating, mode 0700) `<state_dir>/journal`.
    pub fn open(state_dir: &Path) -> Result<Self, JournalError> {
        let dir = state_dir.join(JOURNAL_DIR);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|source| JournalError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        Ok(Self {
            dir,
            locks: Mutex::new(HashMap::new()),
        })
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<journal dir>/<disk name>.json`.
    pub fn path_of(&self, instance: &InstanceKey) -> PathBuf {
        self.dir.join(file_name(instance))
    }

    /// [`Journal::path_of`] for the journal of `state_dir`, without opening it.
    pub fn path_in(state_dir: &Path, instance: &InstanceKey) -> PathBuf {
        state_dir.join(JOURNAL_DIR).join(file_name(instance))
    }

    /// Writes `record` as the instance's attempt (durably, before returning).
    ///
    /// The same attempt (same name and schedRev) is replaced. A different
    /// attempt replaces a finished one, whose outcome moves to `unreported`;
    /// it is refused with [`JournalError::InFlight`] while the one on file
    /// has not finished. The generation counter is kept above the record's
    /// generations.
    pub fn record(&self, record: &Record) -> Result<(), JournalError> {
        self.write_attempt(record, AttemptWrite::default())
    }

    /// [`record`](Self::record), and in the same write what the attempt's
    /// end does to the supervised lineage.
    pub fn finish(&self, record: &Record, lineage: Lineage) -> Result<(), JournalError> {
        self.write_attempt(
            record,
            AttemptWrite {
                lineage,
                ..AttemptWrite::default()
            },
        )
    }

    /// [`record`](Self::record) with the durability and the other changes
    /// `write` asks for, all in one write of the file.
    pub fn write_attempt(&self, record: &Record, write: AttemptWrite) -> Result<(), JournalError> {
        let AttemptWrite {
            durability,
            lineage,
            serving,
        } = write;
        self.update_with(&record.instance, durability, |entry| {
            if let Some(current) = entry.attempt.take() {
                if current.same_attempt(record) {
                    // Replaced below.
                } else if current.outcome.is_some() {
                    entry.unreported.push(current);
                } else {
                    let err = JournalError::InFlight {
                        instance: record.instance.clone(),
                        in_flight: current.attempt.name.clone(),
                        sched_rev: current.attempt.sched_rev,
                        phase: current.phase.name(),
                    };
                    entry.attempt = Some(current);
                    return Err(err);
                }
            }
            entry.attempt = Some(record.clone());
            if let Some(serving) = serving {
                entry.serving = serving;
            }
            entry.bump_above_known();
            if record.restart.is_some() && record.outcome.is_some() {
                // Nobody reports a restart: once it ended, the lineage is
                // what is kept of it.
                entry.attempt = None;
            }
            match lineage {
                Lineage::Keep => {}
                Lineage::Set(supervised) => {
                    entry.last_exit = None;
                    if let Some(replaced) = &entry.supervised
                        && replaced.spec.build.sha256 != supervised.spec.build.sha256
                    {
                        entry.previous_builds = record::builds_of(&replaced.spec);
                    }
                    entry.supervised = Some(*supervised);
                }
                Lineage::Restarted {
                    restarts,
                    generation,
                } => {
                    if let Some(supervised) = entry.supervised.as_mut() {
                        supervised.restarts = restarts;
                        supervised.generation = generation;
                        supervised.state = ServingState::Running;
                        supervised.restart_at_ms = None;
                        supervised.message = None;
                    }
                }
                Lineage::End => entry.supervised = None,
            }
            Ok(((), true))
        })
    }

    /// Changes the instance's supervised lineage with `change` and returns
    /// the entry as written; `None` when there is no lineage.
    ///
    /// Ordered, not durable: the supervisor's state between an exit and its
    /// restart (state, backoff, message) is worked out again from the host
    /// after a node crash, which stops every generation anyway.
    pub fn update_supervised(
        &self,
        instance: &InstanceKey,
        change: impl FnOnce(&mut Supervised),
    ) -> Result<Option<InstanceEntry>, JournalError> {
        self.update_with(instance, Durability::Ordered, |entry| {
            let Some(supervised) = entry.supervised.as_mut() else {
                return Ok((None, false));
            };
            change(supervised);
            Ok((Some(entry.clone()), true))
        })
    }

    /// Nothing serves by intent (the instance was stopped): no generation
    /// and no lineage to restart.
    /// No file is written for an instance that has none.
    pub fn stopped(&self, instance: &InstanceKey) -> Result<(), JournalError> {
        self.locked(instance, || {
            let Some(mut entry) = self.read_entry(instance)? else {
                return Ok(());
            };
            if entry.serving.is_none() && entry.supervised.is_none() {
                return Ok(());
            }
            entry.serving = None;
            entry.supervised = None;
            self.write_entry(&entry, Durability::Durable)
        })
    }

    /// The instance's current attempt record (in flight, or finished and
    /// unacknowledged); `None` when there is none or no file.
    pub fn load(&self, instance: &InstanceKey) -> Result<Option<Record>, JournalError> {
        let entry = self.locked(instance, || self.read_entry(instance))?;
        Ok(entry.and_then(|entry| entry.attempt))
    }

    /// Everything on file for the instance.
    pub fn load_entry(
        &self,
        instance: &InstanceKey,
    ) -> Result<Option<InstanceEntry>, JournalError> {
        self.locked(instance, || self.read_entry(instance))
    }

    /// Every instance's entry, sorted by instance, and every file that could
    /// not be read back. One bad file never hides the others; only a
    /// journal directory that cannot be listed is an error. Temp files of
    /// interrupted writes and quarantined files are skipped.
    pub fn load_all(&self) -> Result<(Vec<InstanceEntry>, Vec<CorruptEntry>), JournalError> {
        let read_dir_err = |source| JournalError::ReadDir {
            path: self.dir.clone(),
            source,
        };
        let mut entries = Vec::new();
        let mut corrupt = Vec::new();
        for dir_entry in fs::read_dir(&self.dir).map_err(read_dir_err)? {
            let dir_entry = dir_entry.map_err(read_dir_err)?;
            let file_name = dir_entry.file_name();
            let path = dir_entry.path();
            let Some(name) = file_name.to_str() else {
                corrupt.push(CorruptEntry {
                    path,
                    instance: None,
                    error: "the file name is not UTF-8".into(),
                });
                continue;
            };
            if is_temp_name(name) || is_quarantined_name(name) {
                continue;
            }
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            // A cut name does not say its key; the file does.
            let Some(instance) = disk_name::resolve_name(stem, || named_in(&path)) else {
                corrupt.push(CorruptEntry {
                    path,
                    instance: None,
                    error: "the file name is not the disk name of an instance (whole, or cut for the instance the file names)".into(),
                });
                continue;
            };
            match self.locked(&instance, || self.read_entry(&instance)) {
                Ok(Some(entry)) => entries.push(entry),
                Ok(None) => {}
                Err(e) => corrupt.push(CorruptEntry {
                    path,
                    instance: Some(instance),
                    error: match e {
                        JournalError::Corrupt { error, .. } => error,
                        other => other.to_string(),
                    },
                }),
            }
        }
        entries.sort_by(|a, b| a.instance.cmp(&b.instance));
        corrupt.sort_by(|a, b| a.path.cmp(&b.path));
        Ok((entries, corrupt))
    }

    /// Drops the outcome of the instance's attempt with `sched_rev` once the
    /// API server accepted it. A no-op (`Ok(false)`) when no finished record
    /// of that revision is on file: a newer attempt replaced it and it was
    /// acknowledged before, or it has not finished.
    pub fn acknowledge(
        &self,
        instance: &InstanceKey,
        sched_rev: i64,
    ) -> Result<bool, JournalError> {
        self.update(instance, |entry| {
            let before = entry.unreported.len();
            entry
                .unreported
                .retain(|r| r.attempt.sched_rev != sched_rev);
            let mut changed = entry.unreported.len() != before;
            if entry
                .attempt
                .as_ref()
                .is_some_and(|r| r.attempt.sched_rev == sched_rev && r.outcome.is_some())
            {
                entry.attempt = None;
                changed = true;
            }
            Ok((changed, changed))
        })
    }

    /// Every finished, unacknowledged record of every readable instance,
    /// oldest first per instance. Corrupt files are skipped here;
    /// [`Journal::load_all`] reports them.
    pub fn pending_reports(&self) -> Result<Vec<Record>, JournalError> {
        let (entries, _corrupt) = self.load_all()?;
        Ok(entries
            .iter()
            .flat_map(InstanceEntry::pending_reports)
            .collect())
    }

    /// The number the instance's next generation takes, without a write:
    /// the first record that names it as a successor moves the counter past
    /// it (every write keeps the counter above the generations it names).
    /// Nothing may use the number on the host before such a record is on
    /// file; until then, handing it out again is harmless.
    pub fn next_generation(&self, instance: &InstanceKey) -> Result<u64, JournalError> {
        let entry = self.locked(instance, || self.read_entry(instance))?;
        let mut entry = entry.unwrap_or_else(|| InstanceEntry::new(instance.clone()));
        entry.bump_above_known();
        if entry.next_generation == u64::MAX {
            return Err(JournalError::GenerationsExhausted {
                instance: instance.clone(),
            });
        }
        Ok(entry.next_generation)
    }

    /// Keeps the instance's counter above `generation`, a number seen on the
    /// host (a `gen-<N>` cgroup or socket). Recovery calls it for each one.
    pub fn observe_generation(
        &self,
        instance: &InstanceKey,
        generation: u64,
    ) -> Result<(), JournalError> {
        self.update(instance, |entry| {
            let above = generation.saturating_add(1);
            let changed = above > entry.next_generation;
            entry.next_generation = entry.next_generation.max(above);
            Ok(((), changed))
        })
    }

    /// Records the generation serving now (`None`: nothing serves).
    pub fn set_serving(
        &self,
        instance: &InstanceKey,
        serving: Option<GenerationRecord>,
    ) -> Result<(), JournalError> {
        self.update(instance, |entry| {
            entry.serving = serving;
            entry.bump_above_known();
            Ok(((), true))
        })
    }

    /// Records that the serving generation `exit.generation` exited between
    /// attempts: nothing serves, and how it ended. Does nothing when another
    /// generation is recorded as serving.
    ///
    /// Ordered, not durable: undone by a node crash, the entry still names
    /// a generation that is not running after it, which recovery treats as
    /// an exit it did not see.
    pub fn record_exit(
        &self,
        instance: &InstanceKey,
        exit: ExitRecord,
    ) -> Result<(), JournalError> {
        self.update_with(instance, Durability::Ordered, |entry| {
            if entry
                .serving
                .as_ref()
                .is_some_and(|serving| serving.n != exit.generation)
            {
                return Ok(((), false));
            }
            entry.serving = None;
            entry.last_exit = Some(exit);
            Ok(((), true))
        })
    }

    /// The generation serving, as recorded.
    pub fn serving(
        &self,
        instance: &InstanceKey,
    ) -> Result<Option<GenerationRecord>, JournalError> {
        Ok(self.load_entry(instance)?.and_then(|entry| entry.serving))
    }

    /// Deletes the instance's file: its InstanceGeneration is gone and
    /// nothing of it runs. Refused while an attempt is in flight; pending
    /// outcomes are lost, so acknowledge them first.
    pub fn remove_instance(&self, instance: &InstanceKey) -> Result<(), JournalError> {
        self.locked(instance, || self.remove_instance_locked(instance))
    }

    fn remove_instance_locked(&self, instance: &InstanceKey) -> Result<(), JournalError> {
        if let Some(entry) = self.read_entry(instance)?
            && let Some(current) = entry.attempt.filter(|r| r.outcome.is_none())
        {
            return Err(JournalError::InFlight {
                instance: instance.clone(),
                in_flight: current.attempt.name,
                sched_rev: current.attempt.sched_rev,
                phase: current.phase.name(),
            });
        }
        let path = self.path_of(instance);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(source) => return Err(JournalError::Write { path, source }),
        }
        fsync_dir(&self.dir).map_err(|source| JournalError::Write {
            path: self.dir.clone(),
            source,
        })
    }

    /// Renames a corrupt file to `<name>.corrupt-<unix millis>` (kept for a
    /// human to read) so the instance can be journaled again from scratch.
    /// Returns the new path.
    pub fn quarantine(&self, corrupt: &CorruptEntry) -> Result<PathBuf, JournalError> {
        let name = corrupt
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = self
            .dir
            .join(format!("{name}.corrupt-{}", unix_millis_now()));
        fs::rename(&corrupt.path, &target).map_err(|source| JournalError::Write {
            path: corrupt.path.clone(),
            source,
        })?;
        fsync_dir(&self.dir).map_err(|source| JournalError::Write {
            path: self.dir.clone(),
            source,
        })?;
        Ok(target)
    }

    /// Deletes temp files left by writes a crash interrupted; returns how
    /// many. Call only while holding the node lock.
    pub fn remove_temp_files(&self) -> Result<usize, JournalError> {
        let read_dir_err = |source| JournalError::ReadDir {
            path: self.dir.clone(),
            source,
        };
        let mut removed = 0;
        for dir_entry in fs::read_dir(&self.dir).map_err(read_dir_err)? {
            let dir_entry = dir_entry.map_err(read_dir_err)?;
            if dir_entry.file_name().to_str().is_some_and(is_temp_name) {
                let path = dir_entry.path();
                fs::remove_file(&path).map_err(|source| JournalError::Write { path, source })?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Read, change, and (when `change` says so) write back one instance's
    /// entry under its lock. `change` returns its result and whether the
    /// entry changed.
    fn update<T>(
        &self,
        instance: &InstanceKey,
        change: impl FnOnce(&mut InstanceEntry) -> Result<(T, bool), JournalError>,
    ) -> Result<T, JournalError> {
        self.update_with(instance, Durability::Durable, change)
    }

    fn update_with<T>(
        &self,
        instance: &InstanceKey,
        durability: Durability,
        change: impl FnOnce(&mut InstanceEntry) -> Result<(T, bool), JournalError>,
    ) -> Result<T, JournalError> {
        self.locked(instance, || {
            let mut entry = self
                .read_entry(instance)?
                .unwrap_or_else(|| InstanceEntry::new(instance.clone()));
            let (result, changed) = change(&mut entry)?;
            if changed {
                self.write_entry(&entry, durability)?;
            }
            Ok(result)
        })
    }

    fn read_entry(&self, instance: &InstanceKey) -> Result<Option<InstanceEntry>, JournalError> {
        let path = self.path_of(instance);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(JournalError::Read { path, source }),
        };
        let corrupt = |error: String| JournalError::Corrupt {
            path: path.clone(),
            error,
        };
        let entry: InstanceEntry = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(format!("not a journal entry: {e}")))?;
        if entry.version != FORMAT_VERSION {
            return Err(corrupt(format!(
                "format version {} is not the supported {FORMAT_VERSION}",
                entry.version
            )));
        }
        let records = entry.attempt.iter().chain(entry.unreported.iter());
        if entry.instance != *instance || records.clone().any(|r| r.instance != *instance) {
            return Err(corrupt(format!(
                "it names instance {} but the file is {instance}'s",
                entry.instance
            )));
        }
        verify_checksum(&bytes, &entry).map_err(corrupt)?;
        Ok(Some(entry))
    }

    /// Temp file, write, fsync, rename, and for a durable write fsync the
    /// directory.
    fn write_entry(
        &self,
        entry: &InstanceEntry,
        durability: Durability,
    ) -> Result<(), JournalError> {
        let path = self.path_of(&entry.instance);
        let encode_err = |source| JournalError::Encode {
            instance: entry.instance.clone(),
            source,
        };
        let on_disk = OnDisk {
            entry,
            checksum: checksum(entry).map_err(encode_err)?,
        };
        let bytes = serde_json::to_vec_pretty(&on_disk).map_err(encode_err)?;
        let temp = self.dir.join(temp_name(&file_name(&entry.instance)));
        let write_err = |source| JournalError::Write {
            path: path.clone(),
            source,
        };
        let written = (|| {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            fs::rename(&temp, &path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(write_err(e));
        }
        match durability {
            Durability::Durable => fsync_dir(&self.dir).map_err(write_err),
            Durability::Ordered => Ok(()),
        }
    }

    /// Runs `f` holding the instance's lock.
    fn locked<T>(&self, instance: &InstanceKey, f: impl FnOnce() -> T) -> T {
        let lock = self
            .locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(instance.clone())
            .or_default()
            .clone();
        // The mutex guards `()`: a poisoned lock carries no broken state.
        let _guard = lock.lock().unwrap_or_else(PoisonError::into_inner);
        f()
    }
}

/// `<disk name>.json`.
fn file_name(instance: &InstanceKey) -> String {
    format!("{}.json", DiskName::of(instance))
}

/// The instance a journal file says it is about, however broken the rest.
fn named_in(path: &Path) -> Option<InstanceKey> {
    #[derive(Deserialize)]
    struct Named {
        instance: InstanceKey,
    }
    let bytes = fs::read(path).ok()?;
    serde_json::from_slice::<Named>(&bytes)
        .ok()
        .map(|named| named.instance)
}

/// A journal file: the entry and the checksum of its content.
#[derive(Serialize)]
struct OnDisk<'a> {
    #[serde(flatten)]
    entry: &'a InstanceEntry,
    checksum: String,
}

/// The name of the checksum member of a journal file.
const CHECKSUM_FIELD: &str = "checksum";

/// Checks the file's checksum against the entry read from it. A file
/// without one (written before checksums) is accepted only when it holds
/// nothing but the entry's own members: a checksum member whose name was
/// damaged shows up as an unknown member, and so cannot pass for one.
fn verify_checksum(bytes: &[u8], entry: &InstanceEntry) -> Result<(), String> {
    let file: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|e| format!("not a journal entry: {e}"))?;
    match file.get(CHECKSUM_FIELD) {
        Some(serde_json::Value::String(recorded)) => {
            let actual = checksum(entry).map_err(|e| format!("cannot re-encode it: {e}"))?;
            if actual != *recorded {
                return Err(format!(
                    "its content does not match its checksum (sha256 {actual}, recorded {recorded}): damaged on disk"
                ));
            }
            Ok(())
        }
        Some(other) => Err(format!("its checksum is not a string: {other}")),
        None => {
            let own =
                serde_json::to_value(entry).map_err(|e| format!("cannot re-encode it: {e}"))?;
            match file.keys().find(|key| own.get(key.as_str()).is_none()) {
                Some(unknown) => Err(format!(
                    "it has no checksum and an unknown member {unknown:?}: damaged on disk"
                )),
                None => Ok(()),
            }
        }
    }
}

/// The sha256 of the entry's compact JSON: the same for the entry however
/// the file around it is laid out.
fn checksum(entry: &InstanceEntry) -> Result<String, serde_json::Error> {
    use sha2::Digest;
    let canonical = serde_json::to_vec(entry)?;
    Ok(hex::encode(sha2::Sha256::digest(&canonical)))
}

fn is_temp_name(name: &str) -> bool {
    name.contains(".json.tmp-")
}

fn is_quarantined_name(name: &str) -> bool {
    name.contains(".json.corrupt-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_names_are_the_names_on_file() {
        let phases = [
            Phase::Admitted,
            Phase::ParentRaised {
                saved: SavedLimits::default(),
            },
            Phase::Spawning,
            Phase::Spawned { pid: 1 },
            Phase::Healthy,
            Phase::Switched,
            Phase::IncumbentStopped,
            Phase::Finished,
        ];
        for phase in phases {
            let json = serde_json::to_value(&phase).expect("serializes");
            assert_eq!(json["name"], phase.name(), "{json}");
        }
    }
}
