//! The content-addressed store: single-file entries (`sha256-<hex>`) and
//! trees (`tree-sha256-<hex>`), verified on a hit by their stamps, cleaned
//! of what a crash left, and collected by retention.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::error::StageError;
use crate::fs_util::{TEMP_PREFIX, fsync_dir, temp_name};
use crate::retention::{self, EntryKind, RetentionPolicy, RetentionReport, StoredEntry};
use crate::stager::{COPY_BUFFER, RunDefaults, Staged, check_digest};
use crate::tree::{self, TREE_PREFIX, TreeRecord, TreeStamps};

/// The prefix of every store entry's file name.
pub const ENTRY_PREFIX: &str = "sha256-";
/// The store directory's mode: only its owner lists or writes it.
pub const STORE_DIR_MODE: u32 = 0o711;
/// A store entry's mode: readable and executable by all, writable by none.
pub const ENTRY_MODE: u32 = 0o555;

/// Why the store could not be opened or written.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("cannot create the artifact store {dir}: {source}")]
    Create {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the artifact store {dir} is not a directory (a symlink or a file is there)")]
    NotADirectory { dir: PathBuf },
    #[error(
        "the artifact store {dir} is owned by uid {owner}, not by the agent (uid {agent}); someone else could change what runs"
    )]
    WrongOwner {
        dir: PathBuf,
        owner: u32,
        agent: u32,
    },
    #[error("cannot write the store entry {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The agent's content-addressed artifact store.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    /// Entries this process hashed, by digest, with the stamp they had.
    verified: Mutex<HashMap<String, EntryStamp>>,
    /// Trees this process verified, by digest, with their stamps.
    verified_trees: Mutex<HashMap<String, TreeStamps>>,
    /// When this process last staged each entry: retention keeps the
    /// newest.
    last_used: Mutex<HashMap<String, SystemTime>>,
}

/// What says an entry's bytes are still the ones hashed: the kernel sets a
/// file's ctime to the current time on every change of its bytes or mode
/// (write, a write through a mapping, truncate, chmod; a rename over it
/// makes a new inode), and no system call sets ctime to a chosen value. So
/// the same device, inode, size, mode and ctime as when its bytes were
/// hashed mean no one, root included, changed it since, provided the
/// change would have got a later ctime; [`Store::remember`] makes sure of
/// that (see [`STAMP_MARGIN`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct EntryStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mode: u32,
    ctime: i64,
    ctime_nsec: i64,
}

impl EntryStamp {
    fn of(path: &Path) -> Option<EntryStamp> {
        let meta = fs::symlink_metadata(path).ok()?;
        meta.file_type().is_file().then(|| EntryStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mode: meta.mode(),
            ctime: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
        })
    }

    /// Its ctime as a wall-clock instant.
    fn changed_at(&self) -> Option<SystemTime> {
        let secs = u64::try_from(self.ctime).ok()?;
        let nanos = u32::try_from(self.ctime_nsec).ok()?;
        Some(UNIX_EPOCH + Duration::new(secs, nanos))
    }
}

/// The store's directory of verified-signature records
/// ([`Store::remember_signature`]).
const SIGNATURES_DIR: &str = "signatures";

/// How much older than the start of its hash an entry's ctime must be for
/// the stamp to be remembered. The kernel may take ctime from a coarse
/// clock (one tick, 10 ms at the lowest HZ): a change within the tick of
/// the entry's last change could keep its ctime. An entry changed that
/// recently is hashed again next time instead.
const STAMP_MARGIN: Duration = Duration::from_millis(25);

impl Store {
    /// Opens the store at `dir`, creating it mode 0711 if missing. It must be
    /// a real directory owned by the agent's user; its mode is set to 0711.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let dir = dir.into();
        let create = |source| StoreError::Create {
            dir: dir.clone(),
            source,
        };
        if let Some(parent) = dir.parent() {
            fs::create_dir_all(parent).map_err(create)?;
        }
        match fs::DirBuilder::new().mode(STORE_DIR_MODE).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(create(e)),
        }
        let meta = fs::symlink_metadata(&dir).map_err(create)?;
        if !meta.file_type().is_dir() {
            return Err(StoreError::NotADirectory { dir });
        }
        let agent = nix::unistd::geteuid().as_raw();
        if meta.uid() != agent {
            return Err(StoreError::WrongOwner {
                owner: meta.uid(),
                agent,
                dir,
            });
        }
        fs::set_permissions(&dir, fs::Permissions::from_mode(STORE_DIR_MODE)).map_err(create)?;
        Ok(Self {
            dir,
            verified: Mutex::new(HashMap::new()),
            verified_trees: Mutex::new(HashMap::new()),
            last_used: Mutex::new(HashMap::new()),
        })
    }

    /// The entry of `sha256` without reading it, when this process hashed
    /// it and its stamp has not changed since ([`EntryStamp`]), and it has
    /// `size` bytes; `None` sends the caller down the copying path, which
    /// hashes everything again.
    pub(crate) fn verified_hit(&self, sha256: &str, size: u64) -> Option<Staged> {
        let path = self.entry_path(sha256);
        let now = EntryStamp::of(&path)?;
        let remembered = self.lock_verified().get(sha256).copied()?;
        (now == remembered && now.size == size && now.mode & 0o7777 == ENTRY_MODE).then(|| Staged {
            path,
            sha256: sha256.to_string(),
            bytes: size,
            tree: None,
            run: RunDefaults::default(),
            fetched: 0,
        })
    }

    /// Remembers the stamp `before` of the entry of `sha256`, whose bytes
    /// were hashed from `hashing_began` and matched, if it is unchanged
    /// after the hash (`after`) and old enough ([`STAMP_MARGIN`]).
    fn remember(
        &self,
        sha256: &str,
        before: Option<EntryStamp>,
        after: Option<EntryStamp>,
        hashing_began: SystemTime,
    ) {
        let (Some(before), Some(after)) = (before, after) else {
            return;
        };
        let settled = before
            .changed_at()
            .is_some_and(|at| at + STAMP_MARGIN < hashing_began);
        if before == after && settled {
            self.lock_verified().insert(sha256.to_string(), before);
        }
    }

    fn lock_verified(&self) -> std::sync::MutexGuard<'_, HashMap<String, EntryStamp>> {
        // A poisoned lock guards a map a panicking thread left whole.
        self.verified.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<store>/signatures/`: an empty file `<hex>.<key>` for each digest
    /// whose signature by a key (the hex of its fingerprint) was verified,
    /// so a restarted agent swaps back to a signed build it stores without
    /// the registry. Only the agent writes the store; the digest pins the
    /// bytes, and a stored entry is verified again on each hit.
    fn signature_mark(&self, sha256: &str, key: &str) -> PathBuf {
        self.dir
            .join(SIGNATURES_DIR)
            .join(format!("{sha256}.{key}"))
    }

    /// Whether a signature of `sha256` by `key` was verified into this
    /// store (by this process or one before it).
    pub(crate) fn signature_verified(&self, sha256: &str, key: &str) -> bool {
        check_digest(sha256).is_ok() && self.signature_mark(sha256, key).is_file()
    }

    /// Records that a signature of `sha256` by `key` verified. A record
    /// that cannot be written only costs a verification after a restart.
    pub(crate) fn remember_signature(&self, sha256: &str, key: &str) {
        if check_digest(sha256).is_err() {
            return;
        }
        let dir = self.dir.join(SIGNATURES_DIR);
        let written = fs::DirBuilder::new()
            .mode(STORE_DIR_MODE)
            .create(&dir)
            .or_else(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .and_then(|()| {
                fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o400)
                    .open(self.signature_mark(sha256, key))
                    .map(drop)
            });
        if let Err(error) = written {
            tracing::debug!(sha256, %error, "the verified signature is remembered by this process only");
        }
    }

    /// Drops the signature records of digests the store does not hold
    /// (`kept`): removed entries, and stages that never finished.
    fn prune_signatures(&self, kept: &HashSet<&str>) {
        let Ok(records) = fs::read_dir(self.dir.join(SIGNATURES_DIR)) else {
            return;
        };
        for record in records.flatten() {
            let name = record.file_name();
            let name = name.to_string_lossy();
            let sha256 = name.split('.').next().unwrap_or_default();
            if !kept.contains(sha256) {
                let _ = fs::remove_file(record.path());
            }
        }
    }

    /// `<store>/sha256-<hex>`, whether or not it exists.
    pub fn entry_path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{ENTRY_PREFIX}{sha256}"))
    }

    /// Deletes the temp files and temp trees of copies and unpacks a crash
    /// interrupted; returns how many. Call only while holding the node lock
    /// (another agent's copy in flight would lose its temp file).
    pub fn remove_temp_files(&self) -> io::Result<usize> {
        let mut removed = 0;
        let prefix = format!("{TEMP_PREFIX}.tmp-");
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            if entry
                .file_name()
                .to_str()
                .is_some_and(|name| name.starts_with(&prefix))
            {
                tree::remove_entry(&entry.path())?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Notes that `sha256` was staged now.
    pub(crate) fn used(&self, sha256: &str) {
        self.last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sha256.to_string(), SystemTime::now());
    }

    /// Every entry of the store, with its size and when it was last used
    /// (staged by this process, else stored).
    pub fn entries(&self) -> io::Result<Vec<StoredEntry>> {
        let used = self
            .last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut entries = Vec::new();
        for item in fs::read_dir(&self.dir)? {
            let item = item?;
            let name = item.file_name();
            let Some(name) = name.to_str() else { continue };
            let (kind, sha256) = if let Some(hex) = name.strip_prefix(TREE_PREFIX) {
                (EntryKind::Tree, hex)
            } else if let Some(hex) = name.strip_prefix(ENTRY_PREFIX) {
                (EntryKind::File, hex)
            } else {
                continue;
            };
            if check_digest(sha256).is_err() {
                continue;
            }
            let meta = fs::symlink_metadata(item.path())?;
            let bytes = match kind {
                EntryKind::File => meta.len(),
                EntryKind::Tree => tree::read_record(&item.path()).map_or(0, |r| r.bytes),
            };
            let stored = meta.modified().unwrap_or(UNIX_EPOCH);
            entries.push(StoredEntry {
                sha256: sha256.to_string(),
                kind,
                bytes,
                last_used: used.get(sha256).copied().unwrap_or(stored).max(stored),
            });
        }
        Ok(entries)
    }

    /// Removes what `policy` does not keep, never an entry in `protected`
    /// (digests) and never a tree being staged right now.
    pub fn collect(
        &self,
        protected: &HashSet<String>,
        policy: RetentionPolicy,
    ) -> io::Result<RetentionReport> {
        let entries = self.entries()?;
        let remove = retention::plan(&entries, protected, policy);
        let mut report = RetentionReport::default();
        let removed_names: HashSet<(&str, EntryKind)> =
            remove.iter().map(|e| (e.sha256.as_str(), e.kind)).collect();
        for entry in &entries {
            if !removed_names.contains(&(entry.sha256.as_str(), entry.kind)) {
                report.kept += 1;
                report.kept_bytes += entry.bytes;
            }
        }
        let kept: HashSet<&str> = entries
            .iter()
            .filter(|e| !removed_names.contains(&(e.sha256.as_str(), e.kind)))
            .map(|e| e.sha256.as_str())
            .collect();
        self.prune_signatures(&kept);
        for entry in remove {
            let (name, result) = match entry.kind {
                EntryKind::File => {
                    self.lock_verified().remove(&entry.sha256);
                    let path = self.entry_path(&entry.sha256);
                    (path.clone(), fs::remove_file(&path))
                }
                EntryKind::Tree => {
                    self.lock_trees().remove(&entry.sha256);
                    let path = self.tree_path(&entry.sha256);
                    (path.clone(), tree::remove_entry(&path))
                }
            };
            let shown = name
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            match result {
                Ok(()) => {
                    report.removed.push(shown);
                    report.freed_bytes += entry.bytes;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => report.failed.push(format!("{shown}: {e}")),
            }
        }
        if !report.removed.is_empty() {
            fsync_dir(&self.dir)?;
        }
        Ok(report)
    }

    /// `<store>/tree-sha256-<hex>`, whether or not it exists.
    pub fn tree_path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{TREE_PREFIX}{sha256}"))
    }

    /// The stored tree of `sha256`, when it is there and whole: unchanged
    /// since this process verified it (its stamps), or verified now against
    /// its listing. A tree that fails the check is moved aside (removed at
    /// the next start) and `None` sends the caller to unpack it again.
    pub(crate) fn tree_hit(&self, sha256: &str) -> Result<Option<TreeRecord>, StageError> {
        let entry = self.tree_path(sha256);
        let tree_error = |source| StageError::Tree {
            path: entry.clone(),
            source,
        };
        if fs::symlink_metadata(&entry).is_err() {
            return Ok(None);
        }
        let remembered = self.lock_trees().get(sha256).cloned();
        if let Some(remembered) = remembered
            && TreeStamps::of(&entry).ok().as_ref() == Some(&remembered)
            && let Some(record) = tree::read_record(&entry)
        {
            return Ok(Some(record));
        }
        let began = SystemTime::now();
        let before = TreeStamps::of(&entry).map_err(tree_error)?;
        let verified = tree::verify(&entry).map_err(tree_error)?;
        let after = TreeStamps::of(&entry).map_err(tree_error)?;
        match verified {
            Some(record) if record.sha256 == sha256 => {
                if before == after && before.settled_before(began) {
                    self.lock_trees().insert(sha256.to_string(), before);
                }
                Ok(Some(record))
            }
            _ => {
                tracing::warn!(tree = %entry.display(), "stored tree does not match its listing; moving it aside and unpacking it again");
                self.lock_trees().remove(sha256);
                let aside = self.dir.join(temp_name(TEMP_PREFIX));
                fs::rename(&entry, &aside).map_err(tree_error)?;
                Ok(None)
            }
        }
    }

    fn lock_trees(&self) -> std::sync::MutexGuard<'_, HashMap<String, TreeStamps>> {
        // A poisoned lock guards a map a panicking thread left whole.
        self.verified_trees
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Deletes an entry no generation runs any more (garbage collection).
    pub fn remove(&self, sha256: &str) -> io::Result<()> {
        self.lock_verified().remove(sha256);
        self.lock_trees().remove(sha256);
        match tree::remove_entry(&self.tree_path(sha256)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        match fs::remove_file(self.entry_path(sha256)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// A new temp file in the store that hashes what is written to it.
    pub(crate) fn begin(
        &self,
        limit: u64,
        source_name: String,
    ) -> Result<EntryWriter<'_>, StoreError> {
        let temp = self.dir.join(temp_name(TEMP_PREFIX));
        let file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)
            .map_err(|source| StoreError::Write {
                path: temp.clone(),
                source,
            })?;
        Ok(EntryWriter {
            store: self,
            dir: self.dir.clone(),
            temp: Some(temp),
            file,
            hasher: Sha256::new(),
            bytes: 0,
            limit,
            source_name,
        })
    }
}

/// A copy in progress. Dropped unfinished, it deletes its temp file.
pub(crate) struct EntryWriter<'a> {
    store: &'a Store,
    dir: PathBuf,
    temp: Option<PathBuf>,
    file: File,
    hasher: Sha256,
    bytes: u64,
    limit: u64,
    source_name: String,
}

impl EntryWriter<'_> {
    fn temp_path(&self) -> PathBuf {
        self.temp.clone().unwrap_or_default()
    }

    pub(crate) fn write(&mut self, chunk: &[u8]) -> Result<(), StageError> {
        let len = u64::try_from(chunk.len()).unwrap_or(u64::MAX);
        self.bytes = self.bytes.saturating_add(len);
        if self.bytes > self.limit {
            return Err(StageError::TooLarge {
                source_name: self.source_name.clone(),
                limit: self.limit,
                size: None,
            });
        }
        self.hasher.update(chunk);
        self.file
            .write_all(chunk)
            .map_err(|source| StoreError::Write {
                path: self.temp_path(),
                source,
            })?;
        Ok(())
    }

    /// fsync, compare with `expected`, chmod 0555, and name it. An existing
    /// entry of the same digest is re-hashed: kept when intact (so the inode
    /// of a running generation's executable stays the same), replaced by this
    /// verified copy when not.
    pub(crate) fn finish(mut self, expected: &str) -> Result<Staged, StageError> {
        let actual = hex::encode(std::mem::take(&mut self.hasher).finalize());
        if actual != expected {
            return Err(StageError::DigestMismatch {
                source_name: self.source_name.clone(),
                expected: expected.to_string(),
                actual,
            });
        }
        let temp = self.temp_path();
        let write_err = |path: &Path, source| StoreError::Write {
            path: path.to_path_buf(),
            source,
        };
        self.file.sync_all().map_err(|e| write_err(&temp, e))?;
        self.file
            .set_permissions(fs::Permissions::from_mode(ENTRY_MODE))
            .map_err(|e| write_err(&temp, e))?;
        let entry = self.dir.join(format!("{ENTRY_PREFIX}{actual}"));
        // link(2) names the entry only if the name is free: a concurrent
        // stage of the same build cannot swap an inode under a running one.
        match fs::hard_link(&temp, &entry) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let hashing_began = SystemTime::now();
                let before = EntryStamp::of(&entry);
                let intact = entry_intact(&entry, &actual);
                if intact {
                    self.store
                        .remember(&actual, before, EntryStamp::of(&entry), hashing_began);
                } else {
                    tracing::warn!(
                        entry = %entry.display(),
                        "store entry does not match its name; replacing it with the verified copy"
                    );
                    fs::rename(&temp, &entry).map_err(|e| write_err(&entry, e))?;
                    self.temp = None;
                }
            }
            Err(e) => return Err(write_err(&entry, e).into()),
        }
        if let Some(temp) = self.temp.take() {
            fs::remove_file(&temp).map_err(|e| write_err(&temp, e))?;
        }
        fsync_dir(&self.dir).map_err(|e| write_err(&self.dir, e))?;
        Ok(Staged {
            path: entry,
            sha256: actual,
            bytes: self.bytes,
            tree: None,
            run: RunDefaults::default(),
            fetched: 0,
        })
    }
}

impl Drop for EntryWriter<'_> {
    fn drop(&mut self) {
        if let Some(temp) = self.temp.take() {
            let _ = fs::remove_file(temp);
        }
    }
}

/// An existing entry is intact when it is a regular file of mode 0555 whose
/// bytes hash to its name.
fn entry_intact(entry: &Path, sha256: &str) -> bool {
    let Ok(meta) = fs::symlink_metadata(entry) else {
        return false;
    };
    if !meta.file_type().is_file() || meta.mode() & 0o7777 != ENTRY_MODE {
        return false;
    }
    let Ok(mut file) = File::open(entry) else {
        return false;
    };
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; COPY_BUFFER];
    loop {
        match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buffer[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    hex::encode(hasher.finalize()) == sha256
}
