//! Trees in the store: unpacked once per digest, read-only, shared by every
//! instance and generation that names the digest (SPEC 5.14).
//!
//! A tree is built in `<store>/.incoming.tmp-…/` and only once every layer
//! was applied, verified and sealed ([`crate::unpack::TreeWriter::seal`])
//! is that directory renamed to `<store>/tree-sha256-<hex>/`. A crash before
//! the rename leaves a temporary directory nothing ever uses, which the next
//! start removes; after it, the tree is whole. It holds:
//!
//! - `rootfs/`: the tree itself (directories 0555, files 0444 or 0555,
//!   owned by the agent's user);
//! - `listing`: one line per entry of `rootfs/` (kind, mode, size, the
//!   sha256 of a file's bytes or a symlink's target, path), written at
//!   unpack from the bytes as they were hashed;
//! - `build.json`: what the tree was made from.
//!
//! A hit is re-verified cheaply, as file entries are: the stamps (device,
//! inode, size, mode, ctime) of every entry, taken when this process last
//! verified the tree, must be unchanged; the kernel moves an entry's ctime
//! on every change of its bytes, mode or links, and a directory's on every
//! entry added or removed. A tree this process has not verified yet (after
//! an agent restart) is hashed once against its `listing` first.

use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{Mode, SFlag};
use serde::{Deserialize, Serialize};

use crate::fs_util::{TEMP_PREFIX, fsync_dir, temp_name};
use crate::unpack::{self, TreeCounts, TreeLimits, TreeWriter, UnpackError, Walked};

/// The prefix of a tree entry's directory name.
pub const TREE_PREFIX: &str = "tree-sha256-";
/// The tree itself, inside its entry.
pub const ROOTFS: &str = "rootfs";
/// The root of the stored tree that `path` lies in
/// (`<store>/tree-sha256-<hex>/rootfs`), if it lies in one: the outermost,
/// so a tree's own directories of those names do not count.
pub fn rootfs_of(path: &Path) -> Option<&Path> {
    path.ancestors()
        .filter(|dir| {
            dir.file_name() == Some(ROOTFS.as_ref())
                && dir
                    .parent()
                    .and_then(Path::file_name)
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| name.starts_with(TREE_PREFIX))
        })
        .last()
}

/// The entry's listing of `rootfs/`.
pub const LISTING: &str = "listing";
/// What the tree was made from.
pub const BUILD_FILE: &str = "build.json";

/// How much older than the start of a verification the newest change in a
/// tree must be for its stamps to be remembered: a change within the same
/// clock tick as an earlier one may keep its ctime (see the file store's
/// stamps).
const STAMP_MARGIN: Duration = Duration::from_millis(25);

/// What a stored tree was made from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TreeRecord {
    /// The pinned digest the tree is stored under.
    pub sha256: String,
    /// The source, as messages show it.
    pub source: String,
    /// The archive's format.
    pub format: String,
    /// Bytes of file contents.
    pub bytes: u64,
    /// Entries.
    pub entries: u64,
    /// An image's run defaults (an artifact's config gives none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<crate::registry::ImageConfig>,
    /// The platform chosen from an image index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
}

/// One entry's stamp: what says it did not change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    dev: u64,
    ino: u64,
    size: i64,
    mode: u32,
    ctime: i64,
    ctime_nsec: i64,
}

/// The stamps of every entry of a tree entry, in walk order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TreeStamps(Vec<Stamp>);

impl TreeStamps {
    /// Takes the stamps of everything in `entry` (the directory
    /// `tree-sha256-<hex>` itself included).
    pub(crate) fn of(entry: &Path) -> io::Result<TreeStamps> {
        let dir = open_dir(entry)?;
        let mut stamps = vec![stamp(&nix::sys::stat::fstat(dir.as_fd())?)];
        unpack::walk(dir.as_fd(), Path::new(""), &mut |event| {
            if let Walked::Entry { stat, .. } = event {
                stamps.push(stamp(stat));
            }
            Ok(())
        })?;
        Ok(TreeStamps(stamps))
    }

    /// When the newest of these entries last changed.
    fn newest_change(&self) -> Option<SystemTime> {
        self.0
            .iter()
            .map(|s| (s.ctime, s.ctime_nsec))
            .max()
            .and_then(|(secs, nanos)| {
                Some(
                    UNIX_EPOCH
                        + Duration::new(u64::try_from(secs).ok()?, u32::try_from(nanos).ok()?),
                )
            })
    }

    /// Whether these stamps, taken before a verification that began at
    /// `began`, may stand for it later.
    pub(crate) fn settled_before(&self, began: SystemTime) -> bool {
        self.newest_change()
            .is_some_and(|at| at + STAMP_MARGIN < began)
    }
}

fn stamp(stat: &nix::sys::stat::FileStat) -> Stamp {
    Stamp {
        dev: stat.st_dev,
        ino: stat.st_ino,
        size: stat.st_size,
        mode: stat.st_mode,
        ctime: stat.st_ctime,
        ctime_nsec: stat.st_ctime_nsec,
    }
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?)
}

/// A tree under construction in the store. Dropped unfinished, it removes
/// its temporary directory.
pub struct TreeBuild {
    store_dir: PathBuf,
    temp: Option<PathBuf>,
    writer: Option<TreeWriter>,
}

impl TreeBuild {
    /// A fresh temporary entry in `store_dir`.
    pub(crate) fn begin(store_dir: &Path, limits: TreeLimits) -> io::Result<TreeBuild> {
        let temp = store_dir.join(temp_name(TEMP_PREFIX));
        fs::DirBuilder::new().mode(0o700).create(&temp)?;
        let mut build = TreeBuild {
            store_dir: store_dir.to_path_buf(),
            temp: Some(temp.clone()),
            writer: None,
        };
        let rootfs = temp.join(ROOTFS);
        fs::DirBuilder::new().mode(0o700).create(&rootfs)?;
        build.writer = Some(TreeWriter::new(&rootfs, limits).map_err(io::Error::other)?);
        Ok(build)
    }

    /// Applies one archive stream to the tree ([`TreeWriter::apply`]).
    pub(crate) fn apply<R: std::io::Read>(
        &mut self,
        reader: R,
        layer: &str,
    ) -> Result<R, UnpackError> {
        match self.writer.as_mut() {
            Some(writer) => writer.apply(reader, layer),
            None => Err(UnpackError::Write {
                root: self.store_dir.clone(),
                path: layer.to_string(),
                source: io::Error::other("the tree was already finished"),
            }),
        }
    }

    /// Seals the tree, writes its listing and record, and renames it to
    /// `tree-sha256-<record.sha256>`. When that name is taken (another
    /// stage of the same digest finished first) this one is dropped and
    /// the caller uses what is there.
    pub(crate) fn finish(mut self, record: &mut TreeRecord) -> Result<PathBuf, FinishError> {
        let temp = self.temp.clone().unwrap_or_default();
        let writer = self
            .writer
            .take()
            .ok_or(FinishError::Io(io::Error::other("finished twice")))?;
        let (counts, listing): (TreeCounts, String) = writer.seal().map_err(FinishError::Unpack)?;
        record.bytes = counts.bytes;
        record.entries = counts.entries;
        let text = serde_json::to_string_pretty(record)
            .map_err(|e| FinishError::Io(io::Error::other(e)))?;
        write_read_only(&temp.join(LISTING), listing.as_bytes()).map_err(FinishError::Io)?;
        write_read_only(&temp.join(BUILD_FILE), text.as_bytes()).map_err(FinishError::Io)?;
        fs::set_permissions(&temp, fs::Permissions::from_mode(unpack::DIR_MODE))
            .map_err(FinishError::Io)?;
        fs::File::open(&temp)
            .and_then(|d| d.sync_all())
            .map_err(FinishError::Io)?;
        let entry = self
            .store_dir
            .join(format!("{TREE_PREFIX}{}", record.sha256));
        match fs::rename(&temp, &entry) {
            Ok(()) => {
                self.temp = None;
            }
            // rename(2) over a non-empty directory fails: another stage of
            // the same digest is in place, and this copy goes.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(nix::libc::ENOTEMPTY | nix::libc::EEXIST)
                ) => {}
            Err(e) => return Err(FinishError::Io(e)),
        }
        fsync_dir(&self.store_dir).map_err(FinishError::Io)?;
        Ok(entry)
    }
}

impl Drop for TreeBuild {
    fn drop(&mut self) {
        self.writer = None;
        if let Some(temp) = self.temp.take() {
            let _ = remove_entry(&temp);
        }
    }
}

/// Why a tree could not be finished.
#[derive(Debug)]
pub(crate) enum FinishError {
    Unpack(UnpackError),
    Io(io::Error),
}

fn write_read_only(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    file.write_all(bytes)?;
    file.set_permissions(fs::Permissions::from_mode(unpack::FILE_MODE))?;
    file.sync_all()
}

/// Removes a tree entry (or a temporary one) whatever its modes.
pub fn remove_entry(path: &Path) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Ok(());
    };
    let parent = open_dir(parent)?;
    unpack::remove_all_at(parent.as_fd(), name)
}

/// Checks a tree entry against its listing, hashing every file: the
/// verification of a tree this process has not seen yet. Returns the
/// record when it is whole.
pub(crate) fn verify(entry: &Path) -> io::Result<Option<TreeRecord>> {
    let Ok(expected) = fs::read_to_string(entry.join(LISTING)) else {
        return Ok(None);
    };
    let Ok(record_text) = fs::read_to_string(entry.join(BUILD_FILE)) else {
        return Ok(None);
    };
    let Ok(record) = serde_json::from_str::<TreeRecord>(&record_text) else {
        return Ok(None);
    };
    let rootfs = open_dir(&entry.join(ROOTFS))?;
    let mut listing = String::new();
    unpack::walk(rootfs.as_fd(), Path::new(""), &mut |event| match event {
        Walked::Entry {
            parent,
            name,
            path,
            stat,
        } => unpack::listing_line(&mut listing, parent, name, path, stat, |_| None),
        Walked::Leave { .. } => Ok(()),
    })?;
    Ok((listing == expected).then_some(record))
}

/// Reads a tree entry's record.
pub(crate) fn read_record(entry: &Path) -> Option<TreeRecord> {
    let text = fs::read_to_string(entry.join(BUILD_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Why an entrypoint cannot run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntrypointProblem {
    /// Nothing is at that path in the tree.
    Missing,
    /// Something is, but not a regular file with an exec bit.
    NotExecutable(String),
    /// The path is not a relative path inside the tree.
    NotRelative,
}

/// Resolves a command as a container runtime does, inside the tree: a
/// name with a `/` as a path from the tree's root, a bare name through
/// each directory of `path` (the image's `PATH`) in turn.
pub fn resolve_command(
    rootfs: &Path,
    command: &str,
    path: &str,
) -> Result<PathBuf, EntrypointProblem> {
    if command.contains('/') {
        return resolve_entrypoint(rootfs, command);
    }
    let mut first_problem = EntrypointProblem::Missing;
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        match resolve_entrypoint(rootfs, &format!("{}/{command}", dir.trim_end_matches('/'))) {
            Ok(found) => return Ok(found),
            Err(EntrypointProblem::Missing | EntrypointProblem::NotRelative) => {}
            Err(other) => first_problem = other,
        }
    }
    Err(first_problem)
}

/// The real path of the directory `dir` inside the tree, resolved as
/// [`resolve_entrypoint`] resolves a file; `None` when it is not one.
pub fn resolve_dir(rootfs: &Path, dir: &str) -> Option<PathBuf> {
    let relative = dir.trim_start_matches('/');
    if relative.is_empty() {
        return Some(rootfs.to_path_buf());
    }
    unpack::relative_path(relative.as_bytes()).ok()?;
    let root = open_dir(rootfs).ok()?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let found = openat2(root.as_fd(), relative, how).ok()?;
    let real = fs::read_link(unpack::fd_path(found.as_fd())).ok()?;
    real.starts_with(rootfs).then_some(real)
}

/// Resolves `entrypoint` inside the tree `rootfs` as a process whose root
/// is the tree would: symlinks are followed, an absolute one from the
/// tree's root, and nothing resolves outside it. Returns the real path of
/// a regular file with an exec bit.
pub fn resolve_entrypoint(rootfs: &Path, entrypoint: &str) -> Result<PathBuf, EntrypointProblem> {
    let relative = entrypoint.trim_start_matches('/');
    if relative.is_empty() || unpack::relative_path(relative.as_bytes()).is_err() {
        return Err(EntrypointProblem::NotRelative);
    }
    let root = open_dir(rootfs).map_err(|_| EntrypointProblem::Missing)?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let file = openat2(root.as_fd(), relative, how).map_err(|_| EntrypointProblem::Missing)?;
    let stat = nix::sys::stat::fstat(file.as_fd()).map_err(|_| EntrypointProblem::Missing)?;
    let kind = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT;
    if kind != SFlag::S_IFREG {
        return Err(EntrypointProblem::NotExecutable(
            if kind == SFlag::S_IFDIR {
                "a directory".into()
            } else {
                "not a regular file".into()
            },
        ));
    }
    if stat.st_mode & 0o111 == 0 {
        return Err(EntrypointProblem::NotExecutable(format!(
            "a file of mode {:04o}, without an exec bit",
            stat.st_mode & 0o7777
        )));
    }
    let real =
        fs::read_link(unpack::fd_path(file.as_fd())).map_err(|_| EntrypointProblem::Missing)?;
    if !real.starts_with(rootfs) {
        return Err(EntrypointProblem::Missing);
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_of_a_stored_tree_is_the_outermost_of_its_shape() {
        let store = Path::new("/var/lib/genswap/store");
        let exe = store.join("tree-sha256-ab/rootfs/usr/tree-sha256-x/rootfs/bin/app");
        assert_eq!(
            rootfs_of(&exe),
            Some(store.join("tree-sha256-ab/rootfs").as_path())
        );
        assert_eq!(rootfs_of(&store.join("sha256-ab")), None);
        assert_eq!(rootfs_of(&store.join("trees/rootfs/bin/app")), None);
    }
}
