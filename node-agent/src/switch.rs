//! Repointing `current.sock` (SPEC §5.5 step 8, §6) and the run-dir layout.
//!
//! Each generation serves on its own socket,
//! `<run dir>/<namespace>.<instance>/gen-<N>.sock` (the instance's part is
//! its [`DiskName`], cut when long). Beside them,
//! `current.sock` is a symlink naming the incumbent's socket by its file name
//! only (a relative target such as `gen-4.sock`), so the instance's run dir
//! can be bind-mounted anywhere and the link still resolves.
//!
//! The switch makes a new link under a temporary name and renames it over
//! `current.sock`. rename(2) replaces the name atomically: a client that
//! connects through `current.sock` at any instant reaches either the old or
//! the new generation, never "no such file". Connections already open stay
//! with the generation they reached, which lets the retiring one drain.
//!
//! A [`SwitchError`] always means that nothing switched: `current.sock` names
//! what it named before. For the one classifier (SPEC §5.4) it is `stale`: a
//! fault of the host, not of the build.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::disk_name::{
    self, DiskName, generation_socket_name, parse_generation_socket_name, temp_name,
};
use crate::gate::InstanceKey;

/// The name of the link that always names the incumbent's socket.
pub const CURRENT_SOCKET: &str = "current.sock";

/// Where the instances' sockets live under the agent's run dir.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunLayout {
    run_dir: PathBuf,
}

impl RunLayout {
    /// A layout rooted at the agent's run dir (for example `/run/genswap`).
    pub fn new(run_dir: impl Into<PathBuf>) -> Self {
        Self {
            run_dir: run_dir.into(),
        }
    }

    /// The agent's run dir.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// `<run dir>/<disk name>`: the instance's run dir.
    pub fn instance_dir(&self, instance: &InstanceKey) -> PathBuf {
        self.run_dir.join(DiskName::of(instance))
    }

    /// `<run dir>/<namespace>.<instance>/gen-<N>.sock`: generation N's socket,
    /// passed to it as `GENSWAP_SOCKET`.
    pub fn generation_socket(&self, instance: &InstanceKey, generation: u64) -> PathBuf {
        self.instance_dir(instance)
            .join(generation_socket_name(generation))
    }

    /// `<run dir>/<namespace>.<instance>/current.sock`: what a front proxy
    /// connects through.
    pub fn current_socket(&self, instance: &InstanceKey) -> PathBuf {
        self.instance_dir(instance).join(CURRENT_SOCKET)
    }

    /// Creates the instance's run dir (and the run dir) if missing, mode
    /// 0755 so that a front proxy running as another user can reach the
    /// sockets, with the record of a cut name, and returns its path.
    pub fn create_instance_dir(&self, instance: &InstanceKey) -> io::Result<PathBuf> {
        let dir = self.instance_dir(instance);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&dir)?;
        disk_name::write_record(&dir, instance)?;
        Ok(dir)
    }

    /// Removes the instance's run dir if nothing but its name record is
    /// left in it (a socket, a link or a leftover keeps it). Gone already is
    /// fine.
    pub fn remove_instance_dir(&self, instance: &InstanceKey) -> io::Result<()> {
        let dir = self.instance_dir(instance);
        let runtime = crate::confine::directories::RUNTIME;
        let only_the_record = match fs::read_dir(&dir) {
            Ok(entries) => entries
                .map(|entry| {
                    entry.map(|e| {
                        e.file_name() == disk_name::RECORD_FILE || e.file_name() == runtime
                    })
                })
                .collect::<io::Result<Vec<bool>>>()?
                .into_iter()
                .all(|record| record),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if only_the_record {
            // Nothing of the instance runs: its runtime directory goes too.
            match fs::remove_dir_all(dir.join(runtime)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            match fs::remove_file(dir.join(disk_name::RECORD_FILE)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        match fs::remove_dir(&dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// The instances that have a run dir, by their names or the records of
    /// cut ones; other names are skipped. Crash recovery walks these.
    pub fn instances(&self) -> io::Result<Vec<InstanceKey>> {
        let entries = match fs::read_dir(&self.run_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut instances = Vec::new();
        for entry in entries {
            let entry = entry?;
            if !entry.file_type()?.is_dir() {
                continue;
            }
            if let Some(key) = disk_name::resolve_dir(&entry.path()) {
                instances.push(key);
            }
        }
        instances.sort();
        Ok(instances)
    }

    /// The generation numbers whose socket file exists in the instance's run
    /// dir, ascending. Crash recovery compares them with the cgroup tree.
    pub fn generation_sockets(&self, instance: &InstanceKey) -> io::Result<Vec<u64>> {
        self.generations_named(instance, parse_generation_socket_name)
    }

    /// The generation numbers that have a private directory
    /// (`gen-<N>.private`, their `/tmp`) in the instance's run dir.
    pub fn generation_private_dirs(&self, instance: &InstanceKey) -> io::Result<Vec<u64>> {
        self.generations_named(instance, |name| {
            let stem = name.strip_suffix(".private")?;
            parse_generation_socket_name(&format!("{stem}.sock"))
        })
    }

    /// The generation numbers `parse` finds in the names of the instance's
    /// run dir, ascending.
    fn generations_named(
        &self,
        instance: &InstanceKey,
        parse: impl Fn(&str) -> Option<u64>,
    ) -> io::Result<Vec<u64>> {
        let entries = match fs::read_dir(self.instance_dir(instance)) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut generations = Vec::new();
        for entry in entries {
            if let Some(n) = entry?.file_name().to_str().and_then(&parse) {
                generations.push(n);
            }
        }
        generations.sort_unstable();
        Ok(generations)
    }
}

/// Why `current.sock` did not move. In every case nothing switched.
#[derive(Debug, Error)]
pub enum SwitchError {
    #[error(
        "nothing switched: the target {target} is not in the instance's run dir {run_dir}; current.sock may only name a generation socket beside it"
    )]
    TargetOutsideRunDir { target: PathBuf, run_dir: PathBuf },
    #[error(
        "nothing switched: the target socket {target} does not exist (the generation has not bound it, or it was removed)"
    )]
    TargetMissing { target: PathBuf },
    #[error("nothing switched: {target} is not a unix socket")]
    TargetNotSocket { target: PathBuf },
    #[error("nothing switched: cannot inspect the target socket {target}: {source}")]
    TargetUnreadable {
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("nothing switched: cannot create the new link {link}: {source}")]
    CreateLink {
        link: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("nothing switched: cannot rename {link} over {current}: {source}")]
    Rename {
        link: PathBuf,
        current: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Points `<instance_run_dir>/current.sock` at `target_socket`, atomically.
///
/// `target_socket` must be a unix socket directly inside `instance_run_dir`
/// (a generation's `gen-<N>.sock`); the link stores only its file name. After
/// the rename the directory is fsynced so the switch survives a crash of the
/// node; a failed fsync is logged, not returned, because the rename has
/// already taken effect for every client and reporting "nothing switched"
/// then would be false.
///
/// On any error the temporary link is removed and `current.sock` is
/// untouched: nothing switched.
pub fn point_current(instance_run_dir: &Path, target_socket: &Path) -> Result<(), SwitchError> {
    point(instance_run_dir, target_socket, true)
}

/// [`point_current`] for a generation that need not bind its own socket (a
/// program judged by another probe, serving the instance's listeners or
/// its own port): a missing target is linked all the same, so that
/// `current.sock` still names the serving generation, for recovery and
/// for anyone who reads the link; a connect through it finds no socket.
pub fn point_current_allowing_unbound(
    instance_run_dir: &Path,
    target_socket: &Path,
) -> Result<(), SwitchError> {
    point(instance_run_dir, target_socket, false)
}

fn point(
    instance_run_dir: &Path,
    target_socket: &Path,
    must_be_bound: bool,
) -> Result<(), SwitchError> {
    let outside = || SwitchError::TargetOutsideRunDir {
        target: target_socket.to_path_buf(),
        run_dir: instance_run_dir.to_path_buf(),
    };
    let target_name = target_socket.file_name().ok_or_else(outside)?;
    if target_socket.parent() != Some(instance_run_dir) || target_name == CURRENT_SOCKET {
        return Err(outside());
    }
    match fs::symlink_metadata(target_socket) {
        Ok(meta) if meta.file_type().is_socket() => {}
        Ok(_) => {
            return Err(SwitchError::TargetNotSocket {
                target: target_socket.to_path_buf(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound && !must_be_bound => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(SwitchError::TargetMissing {
                target: target_socket.to_path_buf(),
            });
        }
        Err(source) => {
            return Err(SwitchError::TargetUnreadable {
                target: target_socket.to_path_buf(),
                source,
            });
        }
    }

    let link = create_temp_link(instance_run_dir, target_name)?;
    let current = instance_run_dir.join(CURRENT_SOCKET);
    if let Err(source) = fs::rename(&link, &current) {
        // Best effort: the link is ours and harmless, but it should not linger.
        let _ = fs::remove_file(&link);
        return Err(SwitchError::Rename {
            link,
            current,
            source,
        });
    }
    if let Err(e) = fsync_dir(instance_run_dir) {
        tracing::warn!(
            dir = %instance_run_dir.display(),
            error = %e,
            "current.sock switched, but the directory could not be fsynced; a node crash may undo the switch"
        );
    }
    Ok(())
}

/// Creates `current.sock.tmp-<unique>` → `target_name`, retrying on the rare
/// name collision with a leftover from a crash.
fn create_temp_link(dir: &Path, target_name: &std::ffi::OsStr) -> Result<PathBuf, SwitchError> {
    let mut attempts = 0;
    loop {
        let link = dir.join(temp_name(CURRENT_SOCKET));
        match std::os::unix::fs::symlink(target_name, &link) {
            Ok(()) => return Ok(link),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 8 => attempts += 1,
            Err(source) => return Err(SwitchError::CreateLink { link, source }),
        }
    }
}

/// fsync of a directory, so a rename or create inside it is durable.
pub(crate) fn fsync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

/// What `<instance_run_dir>/current.sock` points at, as a path inside
/// `instance_run_dir` (for example `<dir>/gen-4.sock`).
///
/// `None` when there is no link, when `current.sock` is not a symlink, or
/// when it cannot be read.
pub fn current_target(instance_run_dir: &Path) -> Option<PathBuf> {
    let target = fs::read_link(instance_run_dir.join(CURRENT_SOCKET)).ok()?;
    Some(instance_run_dir.join(target))
}

/// The generation `current.sock` names, when it names a `gen-<N>.sock`.
pub fn current_generation(instance_run_dir: &Path) -> Option<u64> {
    let target = fs::read_link(instance_run_dir.join(CURRENT_SOCKET)).ok()?;
    if target.parent().is_some_and(|p| !p.as_os_str().is_empty()) {
        return None;
    }
    parse_generation_socket_name(target.to_str()?)
}

/// Removes leftover `current.sock.tmp-*` links from a switch interrupted by a
/// crash. Call only while holding the node lock. Returns how many it removed.
pub fn remove_temp_links(instance_run_dir: &Path) -> io::Result<usize> {
    let prefix = format!("{CURRENT_SOCKET}.tmp-");
    let mut removed = 0;
    let entries = match fs::read_dir(instance_run_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if entry
            .file_name()
            .to_str()
            .is_some_and(|name| name.starts_with(&prefix))
        {
            fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_socket_names_round_trip() {
        assert_eq!(generation_socket_name(4), "gen-4.sock");
        assert_eq!(parse_generation_socket_name("gen-4.sock"), Some(4));
        assert_eq!(
            parse_generation_socket_name("gen-18446744073709551615.sock"),
            Some(u64::MAX)
        );
        for bad in [
            "gen-.sock",
            "gen-4.sockx",
            "gen--4.sock",
            "gen-+4.sock",
            "current.sock",
            "gen-4",
        ] {
            assert_eq!(parse_generation_socket_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn layout_paths() {
        let layout = RunLayout::new("/run/genswap");
        let key = InstanceKey::new("default", "app").expect("valid key");
        assert_eq!(
            layout.instance_dir(&key),
            Path::new("/run/genswap/default.app")
        );
        assert_eq!(
            layout.generation_socket(&key, 3),
            Path::new("/run/genswap/default.app/gen-3.sock")
        );
        assert_eq!(
            layout.current_socket(&key),
            Path::new("/run/genswap/default.app/current.sock")
        );
    }
}
