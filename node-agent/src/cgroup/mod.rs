//! The cgroup v2 manager: mount discovery, the instance/generation layout,
//! limits, the parent raise for an overlap, and stop with proof of exit.
//!
//! # Layout
//!
//! ```text
//! <root>/                         CgroupManager (e.g. <mount>/genswap)
//!   <disk name>/                  InstanceCgroup (crate::disk_name): carries the tier limits, never a process
//!     gen-<N>/                    Cgroup: one generation's process tree
//!   logs/                         the log shims (crate::logs), no limits
//! ```
//!
//! Directories are created on demand. Controllers (memory, cpu, pids) are
//! enabled in `cgroup.subtree_control` of the root and of each instance
//! directory when, and only when, the hierarchy offers them there; the
//! manager never touches cgroups above its root.
//!
//! # Proof of exit
//!
//! `populated 0` in a cgroup's `cgroup.events` is the only proof that a
//! generation stopped. Every wait for it ([`Cgroup::wait_empty`],
//! [`Cgroup::stop`], [`Cgroup::kill`]) is driven by inotify on that file,
//! never by polling.
//!
//! # Classifying errors
//!
//! No [`CgroupError`] is ever the build's fault: each one is the host's
//! condition. Met before a spawn ([`CgroupManager::instance`],
//! [`InstanceCgroup::create_generation`], [`InstanceCgroup::begin_raise`],
//! [`ParentRaise::apply`]) it proves nothing of the build ran: the attempt
//! is stale (`abandoned`, `executed: false`). [`CgroupError::LimitNotApplied`]
//! and [`CgroupError::NotFresh`] are the two refusals SPEC 5.4 names.

mod events;
mod fs_util;
pub mod hybrid;
mod limits;
mod quantity;
mod subtree;

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, statfs};
use nix::unistd::{AccessFlags, Pid, access};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::disk_name::DiskName;
use crate::gate::InstanceKey;

pub use limits::{
    CPU_MIN_QUOTA_US, CPU_PERIOD_US, Controller, ParentRaise, RaiseRecord, SavedLimit, Tier,
};
pub use quantity::{QuantityError, parse_cpu_quantity, parse_memory_quantity};
pub use subtree::{processes_in, remove_subtree};

/// The cgroup under the root that holds the log shims (`crate::logs`): the
/// agent's own, no instance's. Its shims outlive the agent on purpose.
pub const SHIM_CGROUP: &str = "logs";

/// The agent's cgroup under the root where the listener keepers
/// (`crate::listener_keeper`) run, one child per instance.
pub const KEEPER_CGROUP: &str = "listeners";

/// Whether a directory under the root is the agent's own rather than an
/// instance's (the log shims', the listener keepers'): never listed as an
/// instance, never stopped by recovery. No disk name can equal one: a disk
/// name has a dot.
pub fn is_agent_cgroup(dir_name: &std::ffi::OsStr) -> bool {
    dir_name == SHIM_CGROUP || dir_name == KEEPER_CGROUP
}

use fs_util::io_error;

/// Where the mount table is read from.
pub const MOUNTINFO: &str = "/proc/self/mountinfo";

/// The cgroup v2 mount preferred when there are several (pure v2 nodes).
pub const PREFERRED_MOUNT: &str = "/sys/fs/cgroup";

/// How long [`InstanceCgroup::create_generation`] waits for a leftover
/// populated generation cgroup to empty after `cgroup.kill`.
pub const DEFAULT_FRESH_KILL_WAIT: Duration = Duration::from_secs(10);

/// How long [`Cgroup::stop`] waits for proof of exit after `cgroup.kill`.
pub const DEFAULT_KILL_WAIT: Duration = Duration::from_secs(30);

/// How often [`Cgroup::signal_all`] re-reads `cgroup.procs` for processes
/// forked while it was signalling; a tree that forks faster than this is
/// left to `cgroup.kill` at the stop timeout.
const MAX_SIGNAL_ROUNDS: usize = 64;

/// What went wrong in the cgroup manager. See the module docs for how each
/// classifies.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The mount table could not be read.
    #[error("cannot read the mount table {path}: {source}")]
    ReadMountinfo {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// No cgroup2 filesystem is mounted.
    #[error(
        "no cgroup v2 filesystem is mounted ({mountinfo} lists no cgroup2 mount); genswap needs cgroup v2"
    )]
    NoCgroup2Mount { mountinfo: PathBuf },
    /// An explicit root is not inside a cgroup v2 filesystem.
    #[error("{path} is not in a cgroup v2 filesystem: {reason}")]
    NotCgroup2 { path: PathBuf, reason: String },
    /// An explicit root is not an absolute, normal path.
    #[error("invalid cgroup root {path}: {reason}")]
    InvalidRoot { path: PathBuf, reason: &'static str },
    /// The hierarchy exists but the agent may not write to it.
    #[error("the cgroup v2 hierarchy at {path} is not writable by the agent: {source}")]
    NotWritable {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    /// A filesystem operation on the hierarchy failed.
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// An interface file holds something the manager does not understand.
    #[error("{path} holds an unexpected value {value:?}")]
    Malformed { path: PathBuf, value: String },
    /// A requested limit cannot be applied: the start is refused before
    /// anything runs. The message names the controller.
    #[error("{controller} limit cannot be applied to {path}: {reason}")]
    LimitNotApplied {
        controller: Controller,
        path: PathBuf,
        reason: String,
        #[source]
        source: Option<io::Error>,
    },
    /// A generation cgroup exists and cannot be made empty and new: the
    /// start is refused before anything runs.
    #[error("cgroup {path} cannot be made fresh: {reason}")]
    NotFresh { path: PathBuf, reason: String },
    /// `cgroup.kill` was written and the cgroup still holds processes.
    #[error("cgroup {path} still holds processes {pids:?} {waited:?} after cgroup.kill")]
    NotProvenStopped {
        path: PathBuf,
        waited: Duration,
        pids: Vec<u32>,
    },
    /// A cgroup to remove still holds processes or child cgroups.
    #[error("cannot remove cgroup {path}: it still holds processes or child cgroups")]
    NotEmpty { path: PathBuf },
    /// The inotify watch on `cgroup.events` could not be set up.
    #[error("cannot watch {path} for changes: {source}")]
    Watch {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    /// A process of the cgroup could not be signalled.
    #[error("cannot signal pid {pid} in {path}: {source}")]
    Signal {
        pid: u32,
        path: PathBuf,
        #[source]
        source: Errno,
    },
}

/// The cgroup2 mount points listed in a mountinfo text, in order.
pub fn cgroup2_mounts(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (mount_fields, fs_fields) = line.split_once(" - ")?;
            if fs_fields.split_whitespace().next()? != "cgroup2" {
                return None;
            }
            let mount_point = mount_fields.split_whitespace().nth(4)?;
            Some(PathBuf::from(unescape_mount_field(mount_point)))
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_field(field: &str) -> OsString {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|digits| bytes[i] == b'\\' && digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match octal {
            Some(digits) => {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    OsString::from_vec(out)
}

/// Finds the cgroup v2 mount of this host in [`MOUNTINFO`]: `/sys/fs/cgroup`
/// when it is cgroup2, else the first cgroup2 mount. Refuses with a clear
/// error when there is none or the agent cannot write to it.
pub fn discover_mount() -> Result<PathBuf, CgroupError> {
    let mounts = read_cgroup2_mounts()?;
    let mount = mounts
        .iter()
        .find(|m| m.as_path() == Path::new(PREFERRED_MOUNT))
        .or_else(|| mounts.first())
        .cloned()
        .ok_or_else(|| CgroupError::NoCgroup2Mount {
            mountinfo: PathBuf::from(MOUNTINFO),
        })?;
    check_writable(&mount)?;
    Ok(mount)
}

fn read_cgroup2_mounts() -> Result<Vec<PathBuf>, CgroupError> {
    let text = fs::read_to_string(MOUNTINFO).map_err(|source| CgroupError::ReadMountinfo {
        path: PathBuf::from(MOUNTINFO),
        source,
    })?;
    Ok(cgroup2_mounts(&text))
}

fn check_writable(dir: &Path) -> Result<(), CgroupError> {
    for path in [dir.to_owned(), dir.join("cgroup.procs")] {
        access(&path, AccessFlags::W_OK)
            .map_err(|source| CgroupError::NotWritable { path, source })?;
    }
    Ok(())
}

/// The genswap subtree of the cgroup v2 hierarchy.
#[derive(Clone, Debug)]
pub struct CgroupManager {
    root: PathBuf,
    mount: Option<PathBuf>,
    fresh_kill_wait: Duration,
}

impl CgroupManager {
    /// A manager over `<discovered mount>/<subdir>` (e.g. `genswap`).
    pub fn discover(subdir: impl AsRef<Path>) -> Result<CgroupManager, CgroupError> {
        let mount = discover_mount()?;
        CgroupManager::open(mount.join(subdir))
    }

    /// A manager over an explicit root such as the agent's `--cgroup-root`.
    /// The root (created on demand) must lie inside a cgroup2 mount that the
    /// agent can write to; anything else is refused.
    pub fn open(root: impl Into<PathBuf>) -> Result<CgroupManager, CgroupError> {
        let root = root.into();
        let invalid = |reason| CgroupError::InvalidRoot {
            path: root.clone(),
            reason,
        };
        if !root.is_absolute() {
            return Err(invalid("it must be an absolute path"));
        }
        if root
            .components()
            .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
        {
            return Err(invalid("it must not contain . or .. components"));
        }
        let mount = read_cgroup2_mounts()?
            .into_iter()
            .filter(|m| root.starts_with(m))
            .max_by_key(|m| m.components().count())
            .ok_or_else(|| CgroupError::NotCgroup2 {
                path: root.clone(),
                reason: format!("no cgroup2 mount in {MOUNTINFO} contains it"),
            })?;
        let existing = root
            .ancestors()
            .find(|dir| dir.exists())
            .unwrap_or(mount.as_path());
        // mountinfo may list a cgroup2 mount that something else covers; the
        // filesystem under the path is what counts.
        let fs = statfs(existing).map_err(|e| io_error("statfs", existing, io::Error::from(e)))?;
        if fs.filesystem_type() != CGROUP2_SUPER_MAGIC {
            return Err(CgroupError::NotCgroup2 {
                path: root.clone(),
                reason: format!("{} is not a cgroup2 filesystem", existing.display()),
            });
        }
        check_writable(existing)?;
        Ok(CgroupManager {
            root,
            mount: Some(mount),
            fresh_kill_wait: DEFAULT_FRESH_KILL_WAIT,
        })
    }

    /// A manager over any directory laid out like cgroupfs, without checks.
    /// For tests of limit writes against a plain directory; the handles it
    /// makes cannot tell where a process should appear in /proc/<pid>/cgroup.
    pub fn open_unchecked(root: impl Into<PathBuf>) -> CgroupManager {
        CgroupManager {
            root: root.into(),
            mount: None,
            fresh_kill_wait: DEFAULT_FRESH_KILL_WAIT,
        }
    }

    /// Sets how long making a generation fresh waits after `cgroup.kill`.
    pub fn with_fresh_kill_wait(mut self, wait: Duration) -> CgroupManager {
        self.fresh_kill_wait = wait;
        self
    }

    /// The root of the genswap subtree.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cgroup2 mount the root lies in (`None` for
    /// [`open_unchecked`](Self::open_unchecked)).
    pub fn mount(&self) -> Option<&Path> {
        self.mount.as_deref()
    }

    /// The instance cgroup `<root>/<disk name>`, creating the root and the
    /// instance directory when missing and enabling the limit controllers
    /// the hierarchy offers for their children.
    pub fn instance(&self, key: &InstanceKey) -> Result<InstanceCgroup, CgroupError> {
        let instance = self.instance_handle(key);
        fs::create_dir_all(&self.root).map_err(|e| io_error("create cgroup", &self.root, e))?;
        enable_controllers(&self.root);
        match fs::create_dir(&instance.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_error("create cgroup", &instance.path, e)),
        }
        enable_controllers(&instance.path);
        Ok(instance)
    }

    /// The handle of an instance cgroup without touching the filesystem
    /// (for recovery from journal records).
    pub fn instance_handle(&self, key: &InstanceKey) -> InstanceCgroup {
        InstanceCgroup {
            path: self.root.join(DiskName::of(key)),
            mount: self.mount.clone(),
            fresh_kill_wait: self.fresh_kill_wait,
        }
    }

    /// Every instance directory under the root with its generations, their
    /// populated state and pids: what a restarted agent adopts. Entries
    /// whose names do not fit the layout are skipped with a warning.
    pub fn list(&self) -> Result<Vec<InstanceListing>, CgroupError> {
        let mut listings = Vec::new();
        for (dir_name, path) in child_dirs(&self.root)? {
            if is_agent_cgroup(dir_name.as_ref()) {
                continue;
            }
            let instance = InstanceCgroup {
                path,
                mount: self.mount.clone(),
                fresh_kill_wait: self.fresh_kill_wait,
            };
            let (generations, others) = instance.list_generations()?;
            listings.push(InstanceListing {
                dir_name,
                path: instance.path,
                generations,
                others,
            });
        }
        listings.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(listings)
    }
}

/// One instance directory as found by [`CgroupManager::list`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceListing {
    /// The directory's name: an instance's [`DiskName`] if genswap made it.
    pub dir_name: String,
    /// The instance directory.
    pub path: PathBuf,
    /// Its `gen-<N>` children, by N.
    pub generations: Vec<GenerationListing>,
    /// Child cgroups that are not `gen-<N>` (not genswap's; reported so
    /// recovery can see processes it does not track).
    pub others: Vec<PathBuf>,
}

/// One generation cgroup as found by [`CgroupManager::list`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerationListing {
    /// N of `gen-<N>`.
    pub generation: u64,
    /// Its handle.
    pub cgroup: Cgroup,
    /// `populated` from its `cgroup.events`.
    pub populated: bool,
    /// Its `cgroup.procs`.
    pub pids: Vec<u32>,
}

/// Enables in `dir/cgroup.subtree_control` every limit controller that
/// `dir/cgroup.controllers` offers and that is not enabled yet. Best effort:
/// a controller that cannot be enabled shows up later as a
/// [`CgroupError::LimitNotApplied`] naming it, and only if a limit asks
/// for it.
fn enable_controllers(dir: &Path) {
    let result = (|| {
        let available = fs_util::read_list(&dir.join("cgroup.controllers"))?;
        let enabled = fs_util::read_list(&dir.join("cgroup.subtree_control"))?;
        for controller in Controller::ALL {
            let name = controller.name();
            if available.iter().any(|a| a == name) && !enabled.iter().any(|e| e == name) {
                let path = dir.join("cgroup.subtree_control");
                if let Err(error) =
                    fs_util::write_value(&path, &format!("+{name}"), "enable a controller in")
                {
                    tracing::warn!(%error, controller = name, "controller not enabled; limits on it will be refused");
                }
            }
        }
        Ok::<(), CgroupError>(())
    })();
    if let Err(error) = result {
        tracing::warn!(%error, dir = %dir.display(), "cannot read the controllers of a cgroup");
    }
}

/// The child directories of `dir` (name, path); empty when `dir` is missing.
fn child_dirs(dir: &Path) -> Result<Vec<(String, PathBuf)>, CgroupError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error("list", dir, e)),
    };
    let mut dirs = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_error("list", dir, e))?;
        let is_dir = entry
            .file_type()
            .map_err(|e| io_error("stat", &entry.path(), e))?
            .is_dir();
        if is_dir {
            dirs.push((
                entry.file_name().to_string_lossy().into_owned(),
                entry.path(),
            ));
        }
    }
    Ok(dirs)
}

/// One instance's directory: the parent of its generations, carrying the
/// tier limits. It never holds a process itself.
#[derive(Clone, Debug)]
pub struct InstanceCgroup {
    path: PathBuf,
    mount: Option<PathBuf>,
    fresh_kill_wait: Duration,
}

impl InstanceCgroup {
    /// The instance directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The handle of `gen-<n>` without touching the filesystem.
    pub fn generation(&self, n: u64) -> Cgroup {
        Cgroup::at(self.path.join(format!("gen-{n}")), self.mount.as_deref())
    }

    /// Refuses a tier whose limits a generation cgroup here could not carry
    /// (its controller not enabled in this directory's
    /// `cgroup.subtree_control`). Reads only.
    pub fn check_generation_limits(&self, n: u64, tier: &Tier) -> Result<(), CgroupError> {
        let mut requested = tier.requested().peekable();
        if requested.peek().is_none() {
            return Ok(());
        }
        let enabled = fs_util::read_list(&self.path.join("cgroup.subtree_control"))?;
        for controller in requested {
            if enabled.iter().any(|e| e == controller.name()) {
                continue;
            }
            let available = fs_util::read_list(&self.path.join("cgroup.controllers"))?;
            let why = if available.iter().any(|a| a == controller.name()) {
                format!(
                    "{}/cgroup.subtree_control does not enable it",
                    self.path.display()
                )
            } else {
                format!(
                    "it is not available to {} (cgroup.controllers lists: {}); enable it in the parent's cgroup.subtree_control, or on a hybrid host it may be bound to cgroup v1",
                    self.path.display(),
                    list_or_none(&available)
                )
            };
            return Err(CgroupError::LimitNotApplied {
                controller,
                path: self.generation(n).path,
                reason: format!(
                    "the {controller} controller is not enabled for it: {why}; {} cannot be applied",
                    controller.max_file()
                ),
                source: None,
            });
        }
        Ok(())
    }

    /// Makes `gen-<n>` fresh and writes the tier's limits into it.
    ///
    /// Order, so that a refusal always comes before anything runs: the
    /// limits are checked first (nothing created on a refusal); then a
    /// leftover `gen-<n>` is removed (killed first with `cgroup.kill` when
    /// populated, waiting up to the manager's fresh-kill wait) and created
    /// anew; then the limits are written, and the new directory is removed
    /// again if a write fails.
    ///
    /// Errors: [`CgroupError::LimitNotApplied`] (names the controller),
    /// [`CgroupError::NotFresh`], or I/O errors; all mean nothing ran.
    pub async fn create_generation(&self, n: u64, tier: &Tier) -> Result<Cgroup, CgroupError> {
        self.check_generation_limits(n, tier)?;
        let cgroup = self.generation(n);
        make_fresh(&cgroup.path, self.fresh_kill_wait).await?;
        if let Err(error) = cgroup.apply_tier(tier) {
            if let Err(remove_error) = cgroup.remove() {
                tracing::warn!(%remove_error, "a generation cgroup whose limits failed was not removed");
            }
            return Err(error);
        }
        Ok(cgroup)
    }

    /// Writes the tier as this instance's own limits: requested values, and
    /// `max` for present controllers the tier does not limit. Every
    /// requested limit is checked before the first write.
    pub fn apply_tier(&self, tier: &Tier) -> Result<(), CgroupError> {
        for controller in tier.requested() {
            require_interface(&self.path, controller)?;
        }
        for controller in Controller::ALL {
            let path = self.path.join(controller.max_file());
            if path.exists() {
                write_limit(&self.path, controller, &tier.render(controller))?;
            }
        }
        Ok(())
    }

    /// Reads this instance's current limits and prepares raising them to fit
    /// `incumbent` plus `successor` (memory and pids: the sum; cpu: the sum
    /// of quotas; `max` stays `max`; a limit already big enough is left
    /// alone). Writes nothing; see [`ParentRaise`].
    pub fn begin_raise(
        &self,
        incumbent: &Tier,
        successor: &Tier,
    ) -> Result<ParentRaise, CgroupError> {
        ParentRaise::prepare(&self.path, incumbent, successor)
    }

    /// The `gen-<N>` children with their state.
    pub fn generations(&self) -> Result<Vec<GenerationListing>, CgroupError> {
        Ok(self.list_generations()?.0)
    }

    fn list_generations(&self) -> Result<(Vec<GenerationListing>, Vec<PathBuf>), CgroupError> {
        let mut generations = Vec::new();
        let mut others = Vec::new();
        for (name, path) in child_dirs(&self.path)? {
            let Some(n) = name
                .strip_prefix("gen-")
                .and_then(|n| n.parse::<u64>().ok())
            else {
                others.push(path);
                continue;
            };
            let cgroup = Cgroup::at(path, self.mount.as_deref());
            generations.push(GenerationListing {
                generation: n,
                populated: cgroup.is_populated()?,
                pids: cgroup.pids()?,
                cgroup,
            });
        }
        generations.sort_by_key(|g| g.generation);
        others.sort();
        Ok((generations, others))
    }

    /// Removes the instance directory (it must hold no generation).
    pub fn remove(&self) -> Result<(), CgroupError> {
        remove_dir(&self.path)
    }
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(" ")
    }
}

fn require_interface(dir: &Path, controller: Controller) -> Result<(), CgroupError> {
    if dir.join(controller.max_file()).exists() {
        return Ok(());
    }
    Err(CgroupError::LimitNotApplied {
        controller,
        path: dir.to_owned(),
        reason: format!(
            "the {controller} controller is not enabled for it ({} does not exist; its parent's cgroup.subtree_control does not list {controller}); {} cannot be applied",
            controller.max_file(),
            controller.max_file()
        ),
        source: None,
    })
}

fn write_limit(dir: &Path, controller: Controller, value: &str) -> Result<(), CgroupError> {
    let path = dir.join(controller.max_file());
    fs_util::write_raw(&path, value).map_err(|source| CgroupError::LimitNotApplied {
        controller,
        path: dir.to_owned(),
        reason: format!(
            "writing {value:?} to {} failed: {source}",
            controller.max_file()
        ),
        source: Some(source),
    })
}

async fn make_fresh(path: &Path, kill_wait: Duration) -> Result<(), CgroupError> {
    let not_fresh = |reason: String| CgroupError::NotFresh {
        path: path.to_owned(),
        reason,
    };
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return fs::create_dir(path).map_err(|e| io_error("create cgroup", path, e));
        }
        Err(e) => return Err(io_error("stat", path, e)),
        Ok(meta) if !meta.is_dir() => {
            return Err(not_fresh("it exists and is not a directory".to_owned()));
        }
        Ok(_) => {}
    }
    if events::populated(path)? {
        let cgroup = Cgroup::at(path, None);
        let pids = cgroup.pids().unwrap_or_default();
        tracing::warn!(path = %path.display(), ?pids, "a generation cgroup to be created still holds processes; killing them");
        fs_util::write_raw(&path.join("cgroup.kill"), "1").map_err(|e| {
            not_fresh(format!(
                "it holds processes {pids:?} and cgroup.kill failed: {e}"
            ))
        })?;
        if !events::wait_unpopulated(path, Instant::now() + kill_wait).await? {
            let left = cgroup.pids().unwrap_or_default();
            return Err(not_fresh(format!(
                "it still holds processes {left:?} {kill_wait:?} after cgroup.kill"
            )));
        }
    }
    remove_tree(path)
        .map_err(|e| not_fresh(format!("the leftover directory could not be removed: {e}")))?;
    fs::create_dir(path).map_err(|e| io_error("create cgroup", path, e))
}

/// Removes a cgroup and its child cgroups bottom-up (each must be empty).
fn remove_tree(path: &Path) -> io::Result<()> {
    let entries = match fs::read_dir(path) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_tree(&entry.path())?;
        }
    }
    match fs::remove_dir(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

fn remove_dir(path: &Path) -> Result<(), CgroupError> {
    match fs::remove_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(code) if code == Errno::EBUSY as i32 || code == Errno::ENOTEMPTY as i32) => {
            Err(CgroupError::NotEmpty {
                path: path.to_owned(),
            })
        }
        Err(e) => Err(io_error("remove cgroup", path, e)),
    }
}

/// How a [`Cgroup::stop`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StopReport {
    /// From the stop signal to proven exit (`populated 0`).
    pub drain: Duration,
    /// The stop timeout passed and `cgroup.kill` ended it.
    pub killed: bool,
    /// How many processes were sent the stop signal.
    pub signalled: usize,
}

/// A cgroup that holds processes: one generation. A plain path handle,
/// serialisable for the journal; every method reads the filesystem afresh.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cgroup {
    path: PathBuf,
    proc_path: Option<String>,
}

impl Cgroup {
    /// A handle on `path`. With the mount it lies in, the handle also knows
    /// how `/proc/<pid>/cgroup` names it.
    pub fn at(path: impl Into<PathBuf>, mount: Option<&Path>) -> Cgroup {
        let path = path.into();
        let proc_path = mount
            .and_then(|m| path.strip_prefix(m).ok())
            .map(|relative| format!("/{}", relative.display()));
        Cgroup { path, proc_path }
    }

    /// The cgroup directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its `cgroup.procs`, which [`crate::spawn`] opens to place a child.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// How `/proc/<pid>/cgroup` names this cgroup (`0::<this>`), when known.
    pub fn proc_path(&self) -> Option<&str> {
        self.proc_path.as_deref()
    }

    /// Whether the directory exists.
    pub fn exists(&self) -> bool {
        self.path.is_dir()
    }

    /// `populated` from `cgroup.events` (a missing cgroup is not populated).
    pub fn is_populated(&self) -> Result<bool, CgroupError> {
        events::populated(&self.path)
    }

    /// The pids in `cgroup.procs` (empty for a missing cgroup).
    pub fn pids(&self) -> Result<Vec<u32>, CgroupError> {
        let path = self.procs_file();
        let Some(text) = fs_util::read_optional(&path, "read")? else {
            return Ok(Vec::new());
        };
        text.lines()
            .map(|line| {
                line.trim().parse().map_err(|_| CgroupError::Malformed {
                    path: path.clone(),
                    value: line.to_owned(),
                })
            })
            .collect()
    }

    /// Whether the kernel's OOM killer killed a process of this cgroup:
    /// `oom_kill` above 0 in its `memory.events` (false where the memory
    /// controller is not enabled). A generation's cgroup is fresh, so any
    /// count is its own.
    pub fn oom_killed(&self) -> bool {
        fs::read_to_string(self.path.join("memory.events"))
            .ok()
            .and_then(|events| {
                events
                    .lines()
                    .find_map(|line| line.strip_prefix("oom_kill "))
                    .and_then(|n| n.trim().parse::<u64>().ok())
            })
            .is_some_and(|kills| kills > 0)
    }

    /// Writes each limit the tier requests. All interface files are checked
    /// before the first write; a missing one (controller not enabled) or a
    /// failed write is [`CgroupError::LimitNotApplied`].
    pub fn apply_tier(&self, tier: &Tier) -> Result<(), CgroupError> {
        for controller in tier.requested() {
            require_interface(&self.path, controller)?;
        }
        for controller in tier.requested() {
            write_limit(&self.path, controller, &tier.render(controller))?;
        }
        Ok(())
    }

    /// Sends `signal` to every process in the cgroup, reading `cgroup.procs`
    /// again until no unsignalled pid appears (children forked meanwhile).
    /// Returns how many were signalled. A pid that exits between the read
    /// and the signal is skipped; its reuse by another process within that
    /// window would need the pid space to wrap and is not guarded against.
    pub fn signal_all(&self, signal: Signal) -> Result<usize, CgroupError> {
        let mut signalled = BTreeSet::new();
        for _ in 0..MAX_SIGNAL_ROUNDS {
            let fresh: Vec<u32> = self
                .pids()?
                .into_iter()
                .filter(|pid| !signalled.contains(pid))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for pid in fresh {
                let raw = i32::try_from(pid).map_err(|_| CgroupError::Malformed {
                    path: self.procs_file(),
                    value: pid.to_string(),
                })?;
                match nix::sys::signal::kill(Pid::from_raw(raw), signal) {
                    Ok(()) | Err(Errno::ESRCH) => {}
                    Err(source) => {
                        return Err(CgroupError::Signal {
                            pid,
                            path: self.path.clone(),
                            source,
                        });
                    }
                }
                signalled.insert(pid);
            }
        }
        Ok(signalled.len())
    }

    /// Waits until the cgroup is empty (`populated 0`) or `deadline`;
    /// returns whether it is. Event-driven (inotify on `cgroup.events`);
    /// cancel it by dropping the future. A cgroup that does not exist is
    /// empty.
    pub async fn wait_empty(&self, deadline: Instant) -> Result<bool, CgroupError> {
        events::wait_unpopulated(&self.path, deadline).await
    }

    /// Stops the generation with proof of exit: `signal` to every process,
    /// wait for `populated 0` up to `timeout`, then `cgroup.kill` and wait
    /// again (up to [`DEFAULT_KILL_WAIT`]). An empty cgroup returns at once
    /// with a zero drain.
    pub async fn stop(&self, signal: Signal, timeout: Duration) -> Result<StopReport, CgroupError> {
        let started = Instant::now();
        if !self.is_populated()? {
            return Ok(StopReport {
                drain: Duration::ZERO,
                killed: false,
                signalled: 0,
            });
        }
        let signalled = self.signal_all(signal)?;
        if self.wait_empty(started + timeout).await? {
            return Ok(StopReport {
                drain: started.elapsed(),
                killed: false,
                signalled,
            });
        }
        tracing::info!(path = %self.path.display(), ?timeout, "generation did not stop in time; killing its cgroup");
        self.kill(DEFAULT_KILL_WAIT).await?;
        Ok(StopReport {
            drain: started.elapsed(),
            killed: true,
            signalled,
        })
    }

    /// Kills every process with `cgroup.kill` and waits up to `wait` for
    /// `populated 0`. Returns the time it took. On kernels without
    /// `cgroup.kill` (before 5.14) it sends SIGKILL to every pid instead.
    pub async fn kill(&self, wait: Duration) -> Result<Duration, CgroupError> {
        let started = Instant::now();
        if !self.path.exists() {
            return Ok(Duration::ZERO);
        }
        let kill_file = self.path.join("cgroup.kill");
        if kill_file.exists() {
            fs_util::write_value(&kill_file, "1", "write")?;
        } else {
            self.signal_all(Signal::SIGKILL)?;
        }
        if !self.wait_empty(started + wait).await? {
            return Err(CgroupError::NotProvenStopped {
                path: self.path.clone(),
                waited: wait,
                pids: self.pids().unwrap_or_default(),
            });
        }
        Ok(started.elapsed())
    }

    /// Removes the cgroup directory; it must be empty
    /// ([`CgroupError::NotEmpty`] otherwise). A missing one is fine.
    pub fn remove(&self) -> Result<(), CgroupError> {
        remove_dir(&self.path)
    }
}

/// The signal for an API `stop.signal`.
pub fn stop_signal(signal: genswap_crds::StopSignal) -> Signal {
    use genswap_crds::StopSignal;
    match signal {
        StopSignal::Term => Signal::SIGTERM,
        StopSignal::Int => Signal::SIGINT,
        StopSignal::Quit => Signal::SIGQUIT,
        StopSignal::Hup => Signal::SIGHUP,
        StopSignal::Usr1 => Signal::SIGUSR1,
        StopSignal::Usr2 => Signal::SIGUSR2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn finds_the_cgroup2_mount_of_a_hybrid_host() {
        assert_eq!(
            cgroup2_mounts(HYBRID),
            vec![PathBuf::from("/sys/fs/cgroup/unified")]
        );
    }

    #[test]
    fn parses_optional_fields_and_escapes() {
        let text = "29 1 0:26 / /sys/fs/cgroup rw,nosuid shared:4 master:1 - cgroup2 cgroup2 rw,nsdelegate\n\
                    50 29 0:40 / /mnt/with\\040space rw - cgroup2 none rw\n\
                    51 29 0:41 / /proc rw - proc proc rw\n";
        assert_eq!(
            cgroup2_mounts(text),
            vec![
                PathBuf::from("/sys/fs/cgroup"),
                PathBuf::from("/mnt/with space")
            ]
        );
        assert!(cgroup2_mounts("").is_empty());
    }
}
