//! Staging: resolve an artifact, copy it into the agent's content-addressed
//! store while hashing it, and refuse anything that is not exactly the build
//! the attempt pinned (SPEC §5.5 step 1, §5.14, §7).
//!
//! A single-file build is copied whole; an archive (`artifact.unpack`) is
//! hashed and unpacked in the same pass into a tree ([`crate::tree`],
//! [`crate::unpack`]), and what runs is its `build.entrypoint`.
//!
//! The bytes hashed are the bytes executed. A path artifact is opened once
//! and read from that one descriptor into a temp file in the store; a URL
//! artifact is streamed into one. The temp file is fsynced, its digest
//! compared with the pinned one, made mode 0555 and only then given its
//! name, `<store>/sha256-<hex>`, in a directory only the agent's user can
//! write (0711). The engine executes that store path, never the source, so
//! replacing or rewriting the source after staging changes nothing.
//!
//! Every [`StageError`] is a refusal before anything of the build ran, and
//! its message names the file or URL and the rule it broke.
//! [`StageError::is_build_fault`] tells the one classifier (SPEC §5.4)
//! which refusals are the build's own (bytes that are not the pinned ones,
//! an archive entry refused, an entrypoint that cannot run: `failed`, held
//! down) and which are the host's or the source's (a missing file, a server
//! that does not answer: `abandoned`, tried again).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use genswap_crds::{Artifact, BuildSpec, Unpack};
use sha2::{Digest, Sha256};
use thiserror::Error;
use tokio::sync::mpsc;

use crate::archive::{self, Chunk, ChunkReader, Hashing};
use crate::fs_util::{TEMP_PREFIX, fsync_dir, temp_name};
use crate::registry::{ImageConfig, Registries, RegistryError, RegistrySettings, Resolved};
use crate::retention::{self, EntryKind, RetentionPolicy, RetentionReport, StoredEntry};
use crate::tree::{self, EntrypointProblem, TREE_PREFIX, TreeBuild, TreeRecord, TreeStamps};
use crate::unpack::{TreeLimits, UnpackError};

/// The prefix of every store entry's file name.
pub const ENTRY_PREFIX: &str = "sha256-";
/// The store directory's mode: only its owner lists or writes it.
pub const STORE_DIR_MODE: u32 = 0o711;
/// A store entry's mode: readable and executable by all, writable by none.
pub const ENTRY_MODE: u32 = 0o555;
/// The default cap on an artifact's size.
pub const DEFAULT_MAX_ARTIFACT_BYTES: u64 = 1 << 30;

const COPY_BUFFER: usize = 64 * 1024;

/// What staging produced: the store file the engine executes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Staged {
    /// What the engine executes: `<store>/sha256-<hex>` for a single file,
    /// the entrypoint's real path inside a stored tree for an archive.
    pub path: PathBuf,
    /// Lowercase hex sha256 of the artifact, equal to the pinned digest.
    pub sha256: String,
    /// The artifact's size; for a tree, the bytes of its files.
    pub bytes: u64,
    /// For a tree build: the tree's root (`<store>/tree-sha256-<hex>/rootfs`).
    pub tree: Option<PathBuf>,
    /// What an image's config adds to the spec's process.
    pub run: RunDefaults,
}

/// What an image's config gives a generation unless the spec says
/// otherwise, as a container runtime uses it: the rest of `Entrypoint`
/// always, `Cmd` when `process.args` is empty, `Env` under the spec's
/// variables, `WorkingDir` (inside the tree) when the spec has none. A
/// `build.entrypoint` replaces `Entrypoint` and `Cmd`, as a pod's `command`
/// does. The image's `User` is never used.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunDefaults {
    /// Arguments that always follow the executable (`Entrypoint[1..]`).
    pub args: Vec<String>,
    /// Arguments used when the spec gives none (`Cmd`).
    pub cmd: Vec<String>,
    /// `Env`, in order.
    pub env: Vec<(String, String)>,
    /// `WorkingDir`, resolved inside the tree.
    pub working_dir: Option<PathBuf>,
}

impl Staged {
    /// The arguments after the executable, given the spec's.
    pub fn args(&self, spec_args: &[String]) -> Vec<String> {
        let mut args = self.run.args.clone();
        if spec_args.is_empty() {
            args.extend(self.run.cmd.iter().cloned());
        } else {
            args.extend(spec_args.iter().cloned());
        }
        args
    }

    /// The environment, given the spec's: the image's variables first, each
    /// replaced by the spec's of the same name.
    pub fn env(&self, spec_env: Vec<(String, String)>) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = self
            .run
            .env
            .iter()
            .filter(|(name, _)| !spec_env.iter().any(|(theirs, _)| theirs == name))
            .cloned()
            .collect();
        env.extend(spec_env);
        env
    }
}

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

/// Why an artifact was refused. Every variant is `stale` for the one
/// classifier: nothing of the build ran (see the module docs).
#[derive(Debug, Error)]
pub enum StageError {
    #[error(
        "the pinned digest {expected:?} is not 64 lowercase hex characters (build.sha256 must be a sha256)"
    )]
    InvalidDigest { expected: String },
    #[error("the artifact names neither a path nor a url (build.artifact needs exactly one)")]
    NoSource,
    #[error("the artifact names both a path and a url (build.artifact needs exactly one)")]
    BothSources,
    #[error("artifact {path} is not an absolute path")]
    NotAbsolute { path: String },
    #[error(
        "artifact {path} contains a '..' component; name it by its path under the staging root"
    )]
    ParentComponent { path: String },
    #[error("artifact {path} does not exist (or is a symlink to nothing)")]
    Missing { path: String },
    #[error("artifact {path} is outside the staging root {root}")]
    OutsideRoot { path: String, root: PathBuf },
    #[error(
        "artifact {path} is reached through a symlink that leaves the staging root {root} (it resolves to {resolved})"
    )]
    EscapingSymlink {
        path: String,
        resolved: PathBuf,
        root: PathBuf,
    },
    #[error("artifact {path} cannot be resolved: {source}")]
    Inaccessible {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("artifact {path} is not readable: {source}")]
    Unreadable {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("artifact {path} is a directory, not an executable file")]
    IsDirectory { path: String },
    #[error("artifact {path} is a {kind}, not a regular file")]
    NotRegularFile { path: String, kind: &'static str },
    #[error("artifact {path} is empty")]
    Empty { path: String },
    #[error("artifact {path} is not executable (mode {mode:04o} has no exec bit)")]
    NotExecutable { path: String, mode: u32 },
    #[error("artifact {source_name} is larger than the limit of {limit} bytes{}", declared_size(*.size))]
    TooLarge {
        source_name: String,
        limit: u64,
        size: Option<u64>,
    },
    #[error(
        "artifact {source_name} does not match the pinned digest: expected sha256 {expected}, got {actual}"
    )]
    DigestMismatch {
        source_name: String,
        expected: String,
        actual: String,
    },
    #[error("artifact URL {url} is not usable: {reason}")]
    UnsupportedUrl { url: String, reason: String },
    #[error("artifact URL {url} answered {status}")]
    HttpStatus { url: String, status: u16 },
    #[error("artifact URL {url} did not deliver within {after:?}")]
    Timeout { url: String, after: Duration },
    #[error("artifact URL {url} could not be downloaded: {source}")]
    Download {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("the staging root {root} is unusable: {source}")]
    StagingRoot {
        root: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the HTTP client for artifact URLs could not be built: {0}")]
    Client(#[source] reqwest::Error),
    #[error("archive {source_name} ({format}) cannot be unpacked: {error}")]
    Unpack {
        source_name: String,
        format: &'static str,
        #[source]
        error: UnpackError,
    },
    #[error("build.entrypoint {entrypoint:?} cannot run from the tree of {source_name}: {}", entrypoint_problem(.problem))]
    Entrypoint {
        source_name: String,
        entrypoint: String,
        problem: EntrypointProblem,
    },
    #[error("{source_name} names nothing to run: {why}")]
    NoEntrypoint {
        source_name: String,
        why: &'static str,
    },
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(
        "build.entrypoint names a file inside a tree, and this artifact is a single file (set artifact.unpack)"
    )]
    EntrypointWithoutTree,
    #[error("the stored tree {path} could not be made or read: {source}")]
    Tree {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the staging task ended abnormally: {0}")]
    Task(String),
}

impl StageError {
    /// Whether the build itself is at fault: its bytes are not the pinned
    /// ones, its archive breaks a rule or a limit, its entrypoint cannot
    /// run. Retrying cannot help; the rest (a missing or unreadable source,
    /// a server that fails, the store's own trouble) may pass.
    pub fn is_build_fault(&self) -> bool {
        match self {
            StageError::DigestMismatch { .. }
            | StageError::Entrypoint { .. }
            | StageError::NoEntrypoint { .. }
            | StageError::EntrypointWithoutTree => true,
            StageError::Registry(error) => error.is_build_fault(),
            // A read error that reaches here is the archive's format: an
            // interrupted source is reported as its own error instead.
            StageError::Unpack { error, .. } => {
                error.is_archive_fault() || matches!(error, UnpackError::Read { .. })
            }
            _ => false,
        }
    }
}

fn entrypoint_problem(problem: &EntrypointProblem) -> String {
    match problem {
        EntrypointProblem::Missing => "nothing is at that path in the tree".into(),
        EntrypointProblem::NotExecutable(what) => format!("it is {what}"),
        EntrypointProblem::NotRelative => "it is not a relative path inside the tree".into(),
    }
}

fn declared_size(size: Option<u64>) -> String {
    size.map(|n| format!(" (it is {n} bytes)"))
        .unwrap_or_default()
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
    fn verified_hit(&self, sha256: &str, size: u64) -> Option<Staged> {
        let path = self.entry_path(sha256);
        let now = EntryStamp::of(&path)?;
        let remembered = self.lock_verified().get(sha256).copied()?;
        (now == remembered && now.size == size && now.mode & 0o7777 == ENTRY_MODE).then(|| Staged {
            path,
            sha256: sha256.to_string(),
            bytes: size,
            tree: None,
            run: RunDefaults::default(),
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
    fn used(&self, sha256: &str) {
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
    fn tree_hit(&self, sha256: &str) -> Result<Option<TreeRecord>, StageError> {
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
    fn begin(&self, limit: u64, source_name: String) -> Result<EntryWriter<'_>, StoreError> {
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
struct EntryWriter<'a> {
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

    fn write(&mut self, chunk: &[u8]) -> Result<(), StageError> {
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
    fn finish(mut self, expected: &str) -> Result<Staged, StageError> {
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

/// How the [`Stager`] resolves and fetches artifacts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagerConfig {
    /// Path artifacts must resolve inside this directory.
    pub staging_root: PathBuf,
    /// The largest artifact accepted, path or URL.
    pub max_bytes: u64,
    /// TCP (and TLS) connect timeout for URL artifacts.
    pub connect_timeout: Duration,
    /// The whole download of a URL artifact, headers and body.
    pub download_timeout: Duration,
    /// What an unpacked tree may hold (`--max-tree-bytes`,
    /// `--max-tree-entries`).
    pub tree_limits: TreeLimits,
    /// Credentials, CA and plain-HTTP hosts for images.
    pub registries: RegistrySettings,
    /// What the store keeps (`--store-keep`, `--store-max-bytes`).
    pub retention: RetentionPolicy,
}

impl StagerConfig {
    /// Defaults: a 1 GiB cap on what is read, 10 s to connect, 5 min to
    /// download, and [`TreeLimits::default`].
    pub fn new(staging_root: impl Into<PathBuf>) -> Self {
        Self {
            staging_root: staging_root.into(),
            max_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
            connect_timeout: Duration::from_secs(10),
            download_timeout: Duration::from_secs(300),
            tree_limits: TreeLimits::default(),
            registries: RegistrySettings::default(),
            retention: RetentionPolicy::default(),
        }
    }
}

/// Resolves, verifies and stores artifacts. Cheap to clone (shared inside).
#[derive(Clone, Debug)]
pub struct Stager {
    inner: Arc<StagerInner>,
}

#[derive(Debug)]
struct StagerInner {
    store: Store,
    config: StagerConfig,
    /// The staging root with every symlink resolved.
    root: PathBuf,
    http: reqwest::Client,
    /// One unpack at a time per digest: two instances naming the same
    /// archive wait for one tree instead of making two.
    tree_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    registries: Registries,
}

impl Stager {
    /// A stager over `store`. The staging root must exist.
    pub fn new(store: Store, config: StagerConfig) -> Result<Self, StageError> {
        let root =
            fs::canonicalize(&config.staging_root).map_err(|source| StageError::StagingRoot {
                root: config.staging_root.clone(),
                source,
            })?;
        install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .timeout(config.download_timeout)
            .build()
            .map_err(StageError::Client)?;
        let registries = Registries::new(config.registries.clone(), config.connect_timeout)?;
        Ok(Self {
            inner: Arc::new(StagerInner {
                store,
                config,
                root,
                http,
                tree_locks: Mutex::new(HashMap::new()),
                registries,
            }),
        })
    }

    /// The store entries are written to.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The configuration.
    pub fn config(&self) -> &StagerConfig {
        &self.inner.config
    }

    /// Stages `build` (its path or its URL; a file, or an archive unpacked
    /// into a tree) and verifies it against its pinned digest. The file
    /// I/O runs on tokio's blocking pool.
    pub async fn stage(&self, build: &BuildSpec) -> Result<Staged, StageError> {
        let staged = self.stage_build(build).await?;
        self.inner.store.used(&staged.sha256);
        Ok(staged)
    }

    /// Removes what the store's retention policy does not keep (see
    /// [`crate::retention`]): never a digest in `protected`, nor a tree
    /// being staged now. Blocking file I/O.
    pub fn collect(&self, protected: &HashSet<String>) -> io::Result<RetentionReport> {
        let mut protected = protected.clone();
        {
            let locks = self
                .inner
                .tree_locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (sha256, lock) in locks.iter() {
                if lock.try_lock().is_err() {
                    protected.insert(sha256.clone());
                }
            }
        }
        self.inner
            .store
            .collect(&protected, self.inner.config.retention)
    }

    async fn stage_build(&self, build: &BuildSpec) -> Result<Staged, StageError> {
        let artifact = &build.artifact;
        let entrypoint = build.entrypoint.as_deref();
        if artifact.image.is_some() {
            return self
                .stage_tree(artifact, None, &build.sha256, entrypoint)
                .await;
        }
        match (artifact.unpack, entrypoint) {
            (None, None) => self.stage_file(artifact, &build.sha256).await,
            (None, Some(_)) => Err(StageError::EntrypointWithoutTree),
            (Some(format), entrypoint) => {
                self.stage_tree(artifact, Some(format), &build.sha256, entrypoint)
                    .await
            }
        }
    }

    /// Stages a single-file artifact (its path or its URL).
    pub async fn stage_file(
        &self,
        artifact: &Artifact,
        expected_sha256: &str,
    ) -> Result<Staged, StageError> {
        match (&artifact.path, &artifact.url) {
            (Some(path), None) => {
                let this = self.clone();
                let path = path.clone();
                let expected = expected_sha256.to_string();
                tokio::task::spawn_blocking(move || this.stage_path_blocking(&path, &expected))
                    .await
                    .map_err(|e| StageError::Task(e.to_string()))?
            }
            (None, Some(url)) => self.stage_url(url, expected_sha256).await,
            (Some(_), Some(_)) => Err(StageError::BothSources),
            (None, None) => Err(StageError::NoSource),
        }
    }

    /// Stages an archive (`format`) or an image into a tree, unless the
    /// tree of its digest is stored and whole already (then no source is
    /// read), and resolves what to run in it.
    async fn stage_tree(
        &self,
        artifact: &Artifact,
        format: Option<Unpack>,
        expected_sha256: &str,
        entrypoint: Option<&str>,
    ) -> Result<Staged, StageError> {
        check_digest(expected_sha256)?;
        let lock = {
            let mut locks = self
                .inner
                .tree_locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            locks
                .entry(expected_sha256.to_string())
                .or_default()
                .clone()
        };
        let _one_at_a_time = lock.lock().await;
        let this = self.clone();
        let expected = expected_sha256.to_string();
        let hit = tokio::task::spawn_blocking(move || this.inner.store.tree_hit(&expected))
            .await
            .map_err(|e| StageError::Task(e.to_string()))??;
        let record = match hit {
            Some(record) => record,
            None => match (&artifact.path, &artifact.url, &artifact.image, format) {
                (Some(path), None, None, Some(format)) => {
                    let this = self.clone();
                    let (path, expected) = (path.clone(), expected_sha256.to_string());
                    tokio::task::spawn_blocking(move || {
                        this.unpack_path_blocking(&path, format, &expected)
                    })
                    .await
                    .map_err(|e| StageError::Task(e.to_string()))??
                }
                (None, Some(url), None, Some(format)) => {
                    self.unpack_url(url, format, expected_sha256).await?
                }
                (None, None, Some(image), None) => {
                    self.unpack_image(image, expected_sha256).await?
                }
                (None, None, None, _) => return Err(StageError::NoSource),
                _ => return Err(StageError::BothSources),
            },
        };
        let tree = self.inner.store.tree_path(expected_sha256);
        let rootfs =
            fs::canonicalize(tree.join(tree::ROOTFS)).map_err(|source| StageError::Tree {
                path: tree.clone(),
                source,
            })?;
        let (path, run) = run_in_tree(&rootfs, &record, entrypoint)?;
        Ok(Staged {
            path,
            sha256: record.sha256,
            bytes: record.bytes,
            tree: Some(rootfs),
            run,
        })
    }

    /// Pulls an image's layers into a new tree, one after the other, each
    /// streamed from the registry through its hash and decompressor into
    /// the unpacker.
    async fn unpack_image(
        &self,
        image: &str,
        expected_sha256: &str,
    ) -> Result<TreeRecord, StageError> {
        use futures::StreamExt;
        let registries = &self.inner.registries;
        let resolved = registries.resolve(image, expected_sha256).await?;
        let Resolved {
            reference,
            layers,
            config,
            platform,
            ..
        } = &resolved;
        let (config, platform) = (config.clone(), platform.clone());
        let store_dir = self.inner.store.dir().to_path_buf();
        let tree_error = |source| StageError::Tree {
            path: store_dir.clone(),
            source,
        };
        let mut build =
            TreeBuild::begin(&store_dir, self.inner.config.tree_limits).map_err(tree_error)?;
        let unavailable = |answered: String| {
            StageError::Registry(RegistryError::Unavailable {
                registry: reference.resolve_registry().to_string(),
                reference: image.to_string(),
                answered,
            })
        };
        let after = self.inner.config.download_timeout;
        for layer in layers {
            let size = u64::try_from(layer.descriptor.size).unwrap_or(0);
            let limit = size.min(self.inner.config.max_bytes);
            if size > self.inner.config.max_bytes {
                return Err(StageError::TooLarge {
                    source_name: format!("{image} {}", layer.name),
                    limit: self.inner.config.max_bytes,
                    size: Some(size),
                });
            }
            let (chunks, received) = mpsc::channel::<Chunk>(16);
            let (format, name) = (layer.format, layer.name.clone());
            let source_name = format!("{image} {}", layer.name);
            let writer = tokio::task::spawn_blocking(move || {
                let reader = ChunkReader::new(received);
                let interrupted = reader.interrupted_flag();
                let result =
                    archive::unpack_stream(Hashing::new(reader, limit), format, &mut build, &name)
                        .and_then(|rest| {
                            rest.finish().map_err(|source| UnpackError::Read {
                                layer: name.clone(),
                                source,
                            })
                        });
                let interrupted = interrupted.load(std::sync::atomic::Ordering::Relaxed);
                (build, result, interrupted)
            });
            let download = async {
                let mut stream = resolved.layer_stream(layer).await?;
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.map_err(unavailable)?;
                    if chunks.send(Chunk::Data(chunk)).await.is_err() {
                        return Err(StageError::Task("the layer writer stopped".into()));
                    }
                }
                let _ = chunks.send(Chunk::Done).await;
                Ok(())
            };
            let downloaded = tokio::time::timeout(after, download).await;
            drop(chunks);
            let (returned, written, interrupted) =
                writer.await.map_err(|e| StageError::Task(e.to_string()))?;
            build = returned;
            let unpack_error = |error| StageError::Unpack {
                source_name: source_name.clone(),
                format: archive::format_name(format),
                error,
            };
            let (actual, bytes) = match (downloaded, written) {
                (Err(_), _) => {
                    return Err(unavailable(format!(
                        "{} did not arrive within {after:?}",
                        layer.name
                    )));
                }
                // The layer's own fault stopped the writer first.
                (_, Err(error)) if !interrupted && error.is_archive_fault() => {
                    return Err(unpack_error(error));
                }
                (Ok(Err(download_error)), _) => return Err(download_error),
                (Ok(Ok(())), Err(error)) => return Err(unpack_error(error)),
                (Ok(Ok(())), Ok(done)) => done,
            };
            let want = layer
                .descriptor
                .digest
                .strip_prefix("sha256:")
                .unwrap_or_default();
            if actual != want || bytes != size {
                return Err(unavailable(format!(
                    "served {bytes} bytes of sha256:{actual} for {}, not its {size} bytes",
                    layer.name
                )));
            }
        }
        let mut record = TreeRecord {
            sha256: expected_sha256.to_string(),
            source: image.to_string(),
            format: if config.is_some() {
                "image"
            } else {
                "artifact"
            }
            .to_string(),
            bytes: 0,
            entries: 0,
            image: config,
            platform,
        };
        let this_store = store_dir.clone();
        tokio::task::spawn_blocking(move || build.finish(&mut record).map(|_| record))
            .await
            .map_err(|e| StageError::Task(e.to_string()))?
            .map_err(|error| match error {
                tree::FinishError::Unpack(error) => StageError::Unpack {
                    source_name: image.to_string(),
                    format: "image",
                    error,
                },
                tree::FinishError::Io(source) => StageError::Tree {
                    path: this_store,
                    source,
                },
            })
    }

    /// Unpacks an archive at `path` (under the staging root, by the same
    /// rules as a file, less the exec bit) into the store.
    fn unpack_path_blocking(
        &self,
        path: &str,
        format: Unpack,
        expected_sha256: &str,
    ) -> Result<TreeRecord, StageError> {
        let (file, _) = self.open_checked(path, false)?;
        let source = Hashing::new(file, self.inner.config.max_bytes);
        let over_limit = source.over_limit_flag();
        let result = self.unpack_blocking(source, format, expected_sha256, path);
        result.map_err(|error| match error {
            StageError::Unpack {
                error: UnpackError::Read { source, .. },
                ..
            } if over_limit.load(std::sync::atomic::Ordering::Relaxed) => {
                let _ = source;
                StageError::TooLarge {
                    source_name: path.to_string(),
                    limit: self.inner.config.max_bytes,
                    size: None,
                }
            }
            other => other,
        })
    }

    /// Applies one archive stream to a new tree, checks its digest, and
    /// puts the tree in place.
    fn unpack_blocking<R: Read>(
        &self,
        source: Hashing<R>,
        format: Unpack,
        expected_sha256: &str,
        source_name: &str,
    ) -> Result<TreeRecord, StageError> {
        let store = &self.inner.store;
        let tree_error = |source| StageError::Tree {
            path: store.dir().to_path_buf(),
            source,
        };
        let format_name = archive::format_name(format);
        let unpack_error = |error| StageError::Unpack {
            source_name: source_name.to_string(),
            format: format_name,
            error,
        };
        let mut build =
            TreeBuild::begin(store.dir(), self.inner.config.tree_limits).map_err(tree_error)?;
        let source = archive::unpack_stream(source, format, &mut build, "the archive")
            .map_err(unpack_error)?;
        let (actual, _) = source.finish().map_err(|source| {
            unpack_error(UnpackError::Read {
                layer: "the archive".into(),
                source,
            })
        })?;
        if actual != expected_sha256 {
            return Err(StageError::DigestMismatch {
                source_name: source_name.to_string(),
                expected: expected_sha256.to_string(),
                actual,
            });
        }
        let mut record = TreeRecord {
            sha256: actual,
            source: source_name.to_string(),
            format: format_name.to_string(),
            bytes: 0,
            entries: 0,
            image: None,
            platform: None,
        };
        build.finish(&mut record).map_err(|error| match error {
            tree::FinishError::Unpack(error) => unpack_error(error),
            tree::FinishError::Io(source) => tree_error(source),
        })?;
        Ok(record)
    }

    /// Downloads an archive and unpacks it as it arrives.
    async fn unpack_url(
        &self,
        url: &str,
        format: Unpack,
        expected_sha256: &str,
    ) -> Result<TreeRecord, StageError> {
        let (parsed, shown) = parse_url(url)?;
        let (chunks, received) = mpsc::channel::<Chunk>(16);
        let this = self.clone();
        let expected = expected_sha256.to_string();
        let source_name = shown.clone();
        let writer = tokio::task::spawn_blocking(move || {
            let reader = ChunkReader::new(received);
            let interrupted = reader.interrupted_flag();
            let source = Hashing::new(reader, this.inner.config.max_bytes);
            let result = this.unpack_blocking(source, format, &expected, &source_name);
            (
                result,
                interrupted.load(std::sync::atomic::Ordering::Relaxed),
            )
        });
        let after = self.inner.config.download_timeout;
        let download = tokio::time::timeout(after, self.download(parsed, &shown, &chunks)).await;
        drop(chunks);
        let (written, interrupted) = writer.await.map_err(|e| StageError::Task(e.to_string()))?;
        match download {
            Err(_) => Err(StageError::Timeout { url: shown, after }),
            // The writer stopped first on the archive's own fault: that is
            // the reason. A writer that saw the download stop reports the
            // download's.
            Ok(Err(download_error)) => match written {
                Err(error) if !interrupted => Err(error),
                _ => Err(download_error),
            },
            Ok(Ok(())) => written,
        }
    }

    /// Stages a path artifact on the calling thread (blocking file I/O).
    ///
    /// The rules, each its own refusal: absolute; no `..` component;
    /// resolving every symlink, inside the staging root (a symlink that
    /// stays inside is fine); exists; a regular file; readable; an exec bit;
    /// not empty; not above the size cap; the pinned digest. The file is
    /// opened once, and the checks after the open and the copy read that one
    /// descriptor, so a file swapped after the checks is not what is copied.
    pub fn stage_path_blocking(
        &self,
        path: &str,
        expected_sha256: &str,
    ) -> Result<Staged, StageError> {
        check_digest(expected_sha256)?;
        let (file, size) = self.open_checked(path, true)?;
        // Every check of the source above still runs; what a hit skips is
        // reading it. The entry, not the source, is what runs, and it still
        // holds the bytes hashed as the pinned digest.
        if let Some(staged) = self.inner.store.verified_hit(expected_sha256, size) {
            return Ok(staged);
        }
        let mut entry = self
            .inner
            .store
            .begin(self.inner.config.max_bytes, path.to_string())?;
        copy_into(file, size, path, &mut entry)?;
        entry.finish(expected_sha256)
    }

    /// Resolves `path` under the staging root and opens it for the copy.
    /// An archive (`executable: false`) needs no exec bit.
    fn open_checked(&self, path: &str, executable: bool) -> Result<(File, u64), StageError> {
        let owned = || path.to_string();
        let lexical = Path::new(path);
        if !lexical.is_absolute() {
            return Err(StageError::NotAbsolute { path: owned() });
        }
        if lexical.components().any(|c| c == Component::ParentDir) {
            return Err(StageError::ParentComponent { path: owned() });
        }
        let resolved = fs::canonicalize(lexical).map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => StageError::Missing { path: owned() },
            _ => StageError::Inaccessible {
                path: owned(),
                source,
            },
        })?;
        self.check_inside_root(path, &resolved)?;

        // O_NOFOLLOW: the last component cannot have become a symlink since
        // it was resolved. O_NONBLOCK: opening a FIFO does not wait for a
        // writer (it is then refused as not a regular file).
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(&resolved)
            .map_err(|source| match source.kind() {
                io::ErrorKind::NotFound => StageError::Missing { path: owned() },
                _ => StageError::Unreadable {
                    path: owned(),
                    source,
                },
            })?;
        // Where the descriptor really points, in case a directory on the
        // way was swapped for a symlink after the resolve.
        if let Ok(opened) = fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
            self.check_inside_root(path, &opened)?;
        }
        let meta = file.metadata().map_err(|source| StageError::Unreadable {
            path: owned(),
            source,
        })?;
        let kind = meta.file_type();
        if kind.is_dir() {
            return Err(StageError::IsDirectory { path: owned() });
        }
        if !kind.is_file() {
            return Err(StageError::NotRegularFile {
                path: owned(),
                kind: file_kind(&kind),
            });
        }
        if meta.len() == 0 {
            return Err(StageError::Empty { path: owned() });
        }
        if executable && meta.mode() & 0o111 == 0 {
            return Err(StageError::NotExecutable {
                path: owned(),
                mode: meta.mode() & 0o7777,
            });
        }
        if meta.len() > self.inner.config.max_bytes {
            return Err(StageError::TooLarge {
                source_name: owned(),
                limit: self.inner.config.max_bytes,
                size: Some(meta.len()),
            });
        }
        Ok((file, meta.len()))
    }

    fn check_inside_root(&self, path: &str, resolved: &Path) -> Result<(), StageError> {
        let root = &self.inner.root;
        if resolved.starts_with(root) {
            return Ok(());
        }
        let lexical = Path::new(path);
        if lexical.starts_with(&self.inner.config.staging_root) || lexical.starts_with(root) {
            Err(StageError::EscapingSymlink {
                path: path.to_string(),
                resolved: resolved.to_path_buf(),
                root: self.inner.config.staging_root.clone(),
            })
        } else {
            Err(StageError::OutsideRoot {
                path: path.to_string(),
                root: self.inner.config.staging_root.clone(),
            })
        }
    }

    /// Downloads an http or https artifact into the store, refusing a
    /// non-2xx answer, a declared or streamed size above the cap, and a
    /// download that exceeds its timeouts.
    pub async fn stage_url(&self, url: &str, expected_sha256: &str) -> Result<Staged, StageError> {
        check_digest(expected_sha256)?;
        let (parsed, shown) = parse_url(url)?;
        let limit = self.inner.config.max_bytes;

        // The writer runs on the blocking pool and finishes only on `Done`:
        // a download that fails leaves it to delete its temp file.
        let (chunks, mut received) = mpsc::channel::<Chunk>(16);
        let inner = self.inner.clone();
        let expected = expected_sha256.to_string();
        let source_name = shown.clone();
        let writer = tokio::task::spawn_blocking(move || {
            let mut entry = inner.store.begin(limit, source_name)?;
            while let Some(chunk) = received.blocking_recv() {
                match chunk {
                    Chunk::Data(bytes) => entry.write(&bytes)?,
                    Chunk::Done => return entry.finish(&expected).map(Some),
                }
            }
            Ok(None)
        });

        let after = self.inner.config.download_timeout;
        let download = tokio::time::timeout(after, self.download(parsed, &shown, &chunks)).await;
        drop(chunks);
        let written = writer.await.map_err(|e| StageError::Task(e.to_string()))?;
        match download {
            Err(_) => Err(StageError::Timeout { url: shown, after }),
            Ok(Err(download_error)) => Err(written.err().unwrap_or(download_error)),
            Ok(Ok(())) => written?.ok_or_else(|| {
                StageError::Task("the store writer stopped before the download ended".into())
            }),
        }
    }

    /// Streams the body into `chunks`, then sends `Done`.
    async fn download(
        &self,
        url: reqwest::Url,
        shown: &str,
        chunks: &mpsc::Sender<Chunk>,
    ) -> Result<(), StageError> {
        let limit = self.inner.config.max_bytes;
        let after = self.inner.config.download_timeout;
        let fail = |source: reqwest::Error| {
            if source.is_timeout() {
                StageError::Timeout {
                    url: shown.to_string(),
                    after,
                }
            } else {
                StageError::Download {
                    url: shown.to_string(),
                    source: source.without_url(),
                }
            }
        };
        let mut response = self.inner.http.get(url).send().await.map_err(fail)?;
        let status = response.status();
        if !status.is_success() {
            return Err(StageError::HttpStatus {
                url: shown.to_string(),
                status: status.as_u16(),
            });
        }
        if let Some(declared) = response.content_length()
            && declared > limit
        {
            return Err(StageError::TooLarge {
                source_name: shown.to_string(),
                limit,
                size: Some(declared),
            });
        }
        let mut total = 0u64;
        while let Some(bytes) = response.chunk().await.map_err(fail)? {
            total = total.saturating_add(u64::try_from(bytes.len()).unwrap_or(u64::MAX));
            if total > limit {
                return Err(StageError::TooLarge {
                    source_name: shown.to_string(),
                    limit,
                    size: None,
                });
            }
            if chunks.send(Chunk::Data(bytes)).await.is_err() {
                // The writer stopped; its error is the one reported.
                return Err(StageError::Task("the store writer stopped".into()));
            }
        }
        if total == 0 {
            return Err(StageError::Empty {
                path: shown.to_string(),
            });
        }
        let _ = chunks.send(Chunk::Done).await;
        Ok(())
    }
}

/// What runs in a stored tree, and with what defaults: `build.entrypoint`
/// when given, else the image config's `Entrypoint` (or `Cmd`), looked up
/// as a container runtime would (a bare name through the image's `PATH`).
fn run_in_tree(
    rootfs: &Path,
    record: &TreeRecord,
    entrypoint: Option<&str>,
) -> Result<(PathBuf, RunDefaults), StageError> {
    let config = record.image.clone().unwrap_or_default();
    let env: Vec<(String, String)> = config
        .env
        .iter()
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) => (name.to_string(), value.to_string()),
            None => (pair.clone(), String::new()),
        })
        .collect();
    let path_var = env
        .iter()
        .find(|(name, _)| name == "PATH")
        .map_or(DEFAULT_IMAGE_PATH, |(_, value)| value.as_str());
    let entrypoint_error = |entrypoint: &str, problem| StageError::Entrypoint {
        source_name: record.source.clone(),
        entrypoint: entrypoint.to_string(),
        problem,
    };
    let (exe, args, cmd) = match entrypoint {
        Some(entrypoint) => (
            tree::resolve_entrypoint(rootfs, entrypoint)
                .map_err(|p| entrypoint_error(entrypoint, p))?,
            Vec::new(),
            Vec::new(),
        ),
        None => {
            let ImageConfig {
                entrypoint: ep,
                cmd,
                ..
            } = &config;
            let (command, args, cmd) = match (ep.split_first(), cmd.split_first()) {
                (Some((command, rest)), _) => (command, rest.to_vec(), cmd.clone()),
                (None, Some((command, rest))) => (command, Vec::new(), rest.to_vec()),
                (None, None) => {
                    return Err(StageError::NoEntrypoint {
                        source_name: record.source.clone(),
                        why: if record.image.is_some() {
                            "its config has neither Entrypoint nor Cmd; set build.entrypoint"
                        } else {
                            "it has no image config; set build.entrypoint"
                        },
                    });
                }
            };
            let exe = tree::resolve_command(rootfs, command, path_var)
                .map_err(|p| entrypoint_error(command, p))?;
            (exe, args, cmd)
        }
    };
    let working_dir = (!config.working_dir.is_empty())
        .then(|| tree::resolve_dir(rootfs, &config.working_dir))
        .flatten();
    Ok((
        exe,
        RunDefaults {
            args,
            cmd,
            env,
            working_dir,
        },
    ))
}

/// The `PATH` a command is looked up in when the image sets none.
const DEFAULT_IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// An http or https URL, and the way messages show it.
fn parse_url(url: &str) -> Result<(reqwest::Url, String), StageError> {
    let parsed = reqwest::Url::parse(url).map_err(|e| StageError::UnsupportedUrl {
        url: url.to_string(),
        reason: e.to_string(),
    })?;
    let shown = redacted(&parsed);
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(StageError::UnsupportedUrl {
            url: shown,
            reason: format!("scheme {:?} is not http or https", parsed.scheme()),
        });
    }
    Ok((parsed, shown))
}

/// Reads `file` to its end into `entry`. `size` is only the expected length:
/// the cap is enforced on what is actually read.
fn copy_into(
    mut file: File,
    size: u64,
    path: &str,
    entry: &mut EntryWriter<'_>,
) -> Result<(), StageError> {
    let mut buffer =
        vec![0u8; COPY_BUFFER.min(usize::try_from(size).unwrap_or(COPY_BUFFER).max(1))];
    loop {
        match file.read(&mut buffer) {
            Ok(0) => return Ok(()),
            Ok(n) => entry.write(&buffer[..n])?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(StageError::Unreadable {
                    path: path.to_string(),
                    source,
                });
            }
        }
    }
}

fn check_digest(expected: &str) -> Result<(), StageError> {
    let valid = expected.len() == 64
        && expected
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if valid {
        Ok(())
    } else {
        Err(StageError::InvalidDigest {
            expected: expected.to_string(),
        })
    }
}

fn file_kind(kind: &fs::FileType) -> &'static str {
    if kind.is_fifo() {
        "FIFO"
    } else if kind.is_socket() {
        "socket"
    } else if kind.is_block_device() {
        "block device"
    } else if kind.is_char_device() {
        "character device"
    } else if kind.is_symlink() {
        "symlink"
    } else {
        "special file"
    }
}

/// The URL as messages show it: no credentials, no query (a signed URL's
/// query is a secret), no fragment.
fn redacted(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.set_query(None);
    shown.set_fragment(None);
    shown.to_string()
}

/// Installs ring as the process's rustls crypto provider unless one is
/// already installed. reqwest is built without a provider of its own (kube
/// brings ring; two providers make rustls refuse to pick one), so anything
/// that builds a reqwest client calls this first.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_must_be_64_lowercase_hex() {
        assert!(check_digest(&"a".repeat(64)).is_ok());
        for bad in [
            "",
            "A".repeat(64).as_str(),
            "g".repeat(64).as_str(),
            "a".repeat(63).as_str(),
        ] {
            assert!(
                matches!(check_digest(bad), Err(StageError::InvalidDigest { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn urls_in_messages_carry_no_secrets() {
        let url = reqwest::Url::parse("https://user:pw@example.invalid/a/b?sig=secret#frag")
            .expect("url");
        assert_eq!(redacted(&url), "https://example.invalid/a/b");
    }
}
