//! Applying archives and image layers to a tree, in a way an archive
//! cannot turn against the node (SPEC 5.14).
//!
//! The `tar` crate reads the entries (ustar, GNU and PAX long names); every
//! write is ours, relative to a descriptor of the tree's root:
//!
//! - an entry's path is taken apart lexically first: an absolute path or a
//!   `..` component is refused, never silently dropped;
//! - its parent directory is opened one component at a time with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, so nothing is written
//!   through a symlink (`a -> /etc` then `a/passwd` is refused) and nothing
//!   resolves outside the root;
//! - a hard link must name an entry of the tree by the same rules;
//! - device nodes and FIFOs are refused; a symlink is made as it is (its
//!   target is text the unpacker never follows);
//! - files are created by the agent's user (root on a node) with their
//!   final mode at once: 0555 when the archive gave any exec bit, else 0444,
//!   so setuid, setgid and group or world write never exist; directories
//!   are 0700 while layers are applied and 0555 once the tree is sealed;
//! - [`TreeLimits`] count bytes and entries as they are written, and a
//!   file's declared size is checked before any of its bytes are, so a
//!   decompression bomb stops at the limit, not after.
//!
//! Layers are applied in order with OCI whiteouts: `.wh.<name>` removes
//! `<name>` from the layers below, `.wh..wh..opq` empties its directory of
//! what the layers below put there.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fchmod, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, linkat, symlinkat, unlinkat};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// The default of `--max-tree-bytes`: 4 GiB unpacked. A JDK with its
/// application, or Python with its libraries, is a few hundred MiB.
pub const DEFAULT_MAX_TREE_BYTES: u64 = 4 << 30;
/// The default of `--max-tree-entries`: 500,000. A Debian base image has
/// about 10,000 entries; a Python application with its libraries, tens of
/// thousands.
pub const DEFAULT_MAX_TREE_ENTRIES: u64 = 500_000;

/// The mode of a file the archive marked executable.
pub const EXEC_FILE_MODE: u32 = 0o555;
/// The mode of every other file.
pub const FILE_MODE: u32 = 0o444;
/// The mode of a directory once its tree is sealed.
pub const DIR_MODE: u32 = 0o555;
/// A directory's mode while layers are applied to it.
const WORKING_DIR_MODE: u32 = 0o700;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_WHITEOUT: &[u8] = b".wh..wh..opq";

/// What a tree may hold at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeLimits {
    /// Bytes of file contents, all layers together.
    pub max_bytes: u64,
    /// Entries (files, directories, links, whiteouts), all layers together.
    pub max_entries: u64,
}

impl Default for TreeLimits {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_TREE_BYTES,
            max_entries: DEFAULT_MAX_TREE_ENTRIES,
        }
    }
}

/// The rule an archive entry broke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Its path is absolute.
    Absolute,
    /// Its path has a `..` component.
    ParentComponent,
    /// A directory on its path is a symlink: writing would follow it.
    ThroughSymlink,
    /// A component on its path is not a directory.
    ParentNotDirectory,
    /// A character or block device.
    Device,
    /// A FIFO.
    Fifo,
    /// A hard link to an absolute path, through `..`, or through a symlink.
    LinkOutside,
    /// A hard link to nothing the tree holds, or to a directory.
    LinkToMissing,
    /// A name the tree cannot hold (empty, `.`, NUL).
    BadName,
    /// A kind of entry a build has no use for (sparse files, unknown types).
    Unsupported(String),
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::Absolute => f.write_str("an absolute path would be written outside the tree"),
            Rule::ParentComponent => f.write_str("a '..' component would leave the tree"),
            Rule::ThroughSymlink => {
                f.write_str("a directory on its path is a symlink, and nothing is written through one")
            }
            Rule::ParentNotDirectory => f.write_str("a component on its path is not a directory"),
            Rule::Device => f.write_str("device nodes are refused"),
            Rule::Fifo => f.write_str("FIFOs are refused"),
            Rule::LinkOutside => f.write_str(
                "a hard link must name an entry of the tree (no absolute path, no '..', no symlink on the way)",
            ),
            Rule::LinkToMissing => {
                f.write_str("a hard link must name a file the archive already put in the tree")
            }
            Rule::BadName => f.write_str("its name is empty, '.', or holds a NUL byte"),
            Rule::Unsupported(kind) => write!(f, "{kind} entries are not supported"),
        }
    }
}

/// Why a layer could not be applied.
#[derive(Debug, Error)]
pub enum UnpackError {
    /// An entry broke a rule: the archive's fault.
    #[error("{layer}: entry {entry} is refused: {rule}")]
    Refused {
        layer: String,
        entry: String,
        rule: Rule,
    },
    /// The tree would pass `--max-tree-bytes`.
    #[error(
        "{layer}: entry {entry} would take the tree past {limit} bytes (--max-tree-bytes); nothing more was written"
    )]
    TooManyBytes {
        layer: String,
        entry: String,
        limit: u64,
    },
    /// The tree would pass `--max-tree-entries`.
    #[error(
        "{layer}: entry {entry} would take the tree past {limit} entries (--max-tree-entries); nothing more was written"
    )]
    TooManyEntries {
        layer: String,
        entry: String,
        limit: u64,
    },
    /// Reading the archive failed: its format (the archive's fault) or its
    /// source (the caller tells which).
    #[error("{layer}: the archive cannot be read: {source}")]
    Read {
        layer: String,
        #[source]
        source: io::Error,
    },
    /// Writing the tree failed: the host's fault.
    #[error("cannot write {path} in the tree {root}: {source}")]
    Write {
        root: PathBuf,
        path: String,
        #[source]
        source: io::Error,
    },
}

impl UnpackError {
    /// Whether the archive itself is to blame (a refused entry, a limit),
    /// rather than the host or the reading.
    pub fn is_archive_fault(&self) -> bool {
        matches!(
            self,
            UnpackError::Refused { .. }
                | UnpackError::TooManyBytes { .. }
                | UnpackError::TooManyEntries { .. }
        )
    }
}

/// How many bytes and entries a tree holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeCounts {
    pub bytes: u64,
    pub entries: u64,
}

/// Layers applied, in order, to one tree under construction.
pub struct TreeWriter {
    root_path: PathBuf,
    root: OwnedFd,
    limits: TreeLimits,
    counts: TreeCounts,
    /// Paths the current layer wrote: an opaque whiteout keeps them.
    layer_paths: HashSet<PathBuf>,
    /// The digest of every file written, by inode: sealing lists them
    /// without reading the files again.
    digests: HashMap<u64, [u8; 32]>,
    /// The parent directory the previous entry used: archives list a
    /// directory's entries together.
    last_parent: Option<(PathBuf, OwnedFd)>,
}

impl TreeWriter {
    /// A writer over `root`, an empty directory the caller made (and
    /// removes, whatever happens).
    pub fn new(root: &Path, limits: TreeLimits) -> Result<Self, UnpackError> {
        let root_fd = nix::fcntl::open(
            root,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| UnpackError::Write {
            root: root.to_path_buf(),
            path: ".".into(),
            source: errno.into(),
        })?;
        Ok(Self {
            root_path: root.to_path_buf(),
            root: root_fd,
            limits,
            counts: TreeCounts::default(),
            layer_paths: HashSet::new(),
            digests: HashMap::new(),
            last_parent: None,
        })
    }

    /// What the tree holds so far.
    pub fn counts(&self) -> TreeCounts {
        self.counts
    }

    /// Applies one tar stream (already decompressed) named `layer` in
    /// messages. Returns the reader, positioned after the archive's end
    /// marker, so the caller can read what follows (a digest covers it).
    pub fn apply<R: Read>(&mut self, reader: R, layer: &str) -> Result<R, UnpackError> {
        self.layer_paths.clear();
        self.last_parent = None;
        let read_error = |source| UnpackError::Read {
            layer: layer.to_string(),
            source,
        };
        let mut archive = tar::Archive::new(reader);
        for entry in archive.entries().map_err(read_error)? {
            let entry = entry.map_err(read_error)?;
            self.apply_entry(entry, layer)?;
        }
        Ok(archive.into_inner())
    }

    fn apply_entry<R: Read>(
        &mut self,
        mut entry: tar::Entry<'_, R>,
        layer: &str,
    ) -> Result<(), UnpackError> {
        let raw = entry.path_bytes().into_owned();
        let shown = || String::from_utf8_lossy(&raw).into_owned();
        let refuse = |rule| UnpackError::Refused {
            layer: layer.to_string(),
            entry: String::from_utf8_lossy(&raw).into_owned(),
            rule,
        };
        let kind = entry.header().entry_type();
        if matches!(kind, tar::EntryType::XGlobalHeader) {
            return Ok(());
        }
        self.counts.entries += 1;
        if self.counts.entries > self.limits.max_entries {
            return Err(UnpackError::TooManyEntries {
                layer: layer.to_string(),
                entry: shown(),
                limit: self.limits.max_entries,
            });
        }
        let path = relative_path(&raw).map_err(refuse)?;
        let Some(name) = path.file_name().map(OsStr::to_os_string) else {
            // The root itself: its mode is the store's to set.
            return Ok(());
        };
        let parent_path = path.parent().unwrap_or(Path::new("")).to_path_buf();

        if name.as_bytes() == OPAQUE_WHITEOUT {
            let parent = self
                .open_parent(&parent_path, true)
                .map_err(|e| self.fail(e, layer, &raw))?;
            return self
                .opaque(&parent, &parent_path)
                .map_err(|e| self.write_error(e, &parent_path));
        }
        if let Some(hidden) = name.as_bytes().strip_prefix(WHITEOUT_PREFIX) {
            let hidden = OsStr::from_bytes(hidden);
            check_name(hidden).map_err(refuse)?;
            return match self.open_parent(&parent_path, false) {
                Ok(parent) => {
                    self.forget_parent_cache();
                    remove_all_at(parent.as_fd(), hidden)
                        .map_err(|e| self.write_error(e, &parent_path.join(hidden)))
                }
                // Nothing below to hide.
                Err(OpenFailure::Missing) => Ok(()),
                Err(other) => Err(self.fail(other, layer, &raw)),
            };
        }

        let parent = self
            .open_parent(&parent_path, true)
            .map_err(|e| self.fail(e, layer, &raw))?;
        let existing = stat_at(parent.as_fd(), &name).map_err(|e| self.write_error(e, &path))?;
        let is_dir = |stat: &FileStat| {
            SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR
        };
        match kind {
            tar::EntryType::Directory => match existing {
                Some(stat) if is_dir(&stat) => {}
                Some(_) => {
                    self.replace(parent.as_fd(), &name, &path)?;
                    self.mkdir(parent.as_fd(), &name, &path)?;
                }
                None => self.mkdir(parent.as_fd(), &name, &path)?,
            },
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry
                    .header()
                    .entry_size()
                    .map_err(|source| UnpackError::Read {
                        layer: layer.to_string(),
                        source,
                    })?;
                if self.counts.bytes.saturating_add(size) > self.limits.max_bytes {
                    return Err(UnpackError::TooManyBytes {
                        layer: layer.to_string(),
                        entry: shown(),
                        limit: self.limits.max_bytes,
                    });
                }
                let executable = entry.header().mode().unwrap_or(0) & 0o111 != 0;
                if existing.is_some() {
                    self.replace(parent.as_fd(), &name, &path)?;
                }
                self.write_file(
                    parent.as_fd(),
                    &name,
                    &path,
                    &mut entry,
                    size,
                    executable,
                    layer,
                )?;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                if target.is_empty() || target.contains(&0) {
                    return Err(refuse(Rule::BadName));
                }
                if existing.is_some() {
                    self.replace(parent.as_fd(), &name, &path)?;
                }
                symlinkat(OsStr::from_bytes(&target), parent.as_fd(), name.as_os_str())
                    .map_err(|e| self.write_error(e.into(), &path))?;
            }
            tar::EntryType::Link => {
                let target_raw = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                let target = relative_path(&target_raw).map_err(|_| refuse(Rule::LinkOutside))?;
                let Some(target_name) = target.file_name().map(OsStr::to_os_string) else {
                    return Err(refuse(Rule::LinkToMissing));
                };
                let target_parent_path = target.parent().unwrap_or(Path::new("")).to_path_buf();
                let target_parent = match self.open_parent(&target_parent_path, false) {
                    Ok(fd) => fd,
                    Err(OpenFailure::Missing | OpenFailure::NotDirectory) => {
                        return Err(refuse(Rule::LinkToMissing));
                    }
                    Err(OpenFailure::Symlink) => return Err(refuse(Rule::LinkOutside)),
                    Err(OpenFailure::Io(e)) => return Err(self.write_error(e, &target)),
                };
                match stat_at(target_parent.as_fd(), &target_name)
                    .map_err(|e| self.write_error(e, &target))?
                {
                    Some(stat) if !is_dir(&stat) => {}
                    _ => return Err(refuse(Rule::LinkToMissing)),
                }
                if target == path {
                    // A link to itself: what is there stays.
                    self.layer_paths.insert(path);
                    return Ok(());
                }
                if existing.is_some() {
                    self.replace(parent.as_fd(), &name, &path)?;
                }
                linkat(
                    target_parent.as_fd(),
                    target_name.as_os_str(),
                    parent.as_fd(),
                    name.as_os_str(),
                    AtFlags::empty(),
                )
                .map_err(|e| self.write_error(e.into(), &path))?;
            }
            tar::EntryType::Char | tar::EntryType::Block => return Err(refuse(Rule::Device)),
            tar::EntryType::Fifo => return Err(refuse(Rule::Fifo)),
            tar::EntryType::GNUSparse => {
                return Err(refuse(Rule::Unsupported("sparse file".into())));
            }
            other => {
                return Err(refuse(Rule::Unsupported(format!(
                    "type {:?}",
                    other.as_byte() as char
                ))));
            }
        }
        self.layer_paths.insert(path);
        Ok(())
    }

    fn fail(&self, failure: OpenFailure, layer: &str, raw: &[u8]) -> UnpackError {
        let entry = String::from_utf8_lossy(raw).into_owned();
        let refused = |rule| UnpackError::Refused {
            layer: layer.to_string(),
            entry: entry.clone(),
            rule,
        };
        match failure {
            OpenFailure::Symlink => refused(Rule::ThroughSymlink),
            OpenFailure::NotDirectory => refused(Rule::ParentNotDirectory),
            // A parent that was to be made cannot be missing; say what the
            // kernel said.
            OpenFailure::Missing => {
                self.write_error(io::Error::from(io::ErrorKind::NotFound), Path::new(&entry))
            }
            OpenFailure::Io(e) => self.write_error(e, Path::new(&entry)),
        }
    }

    fn write_error(&self, source: io::Error, path: &Path) -> UnpackError {
        UnpackError::Write {
            root: self.root_path.clone(),
            path: path.display().to_string(),
            source,
        }
    }

    fn forget_parent_cache(&mut self) {
        self.last_parent = None;
    }

    /// Removes what is at `name` so an entry of another kind can take it.
    fn replace(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        path: &Path,
    ) -> Result<(), UnpackError> {
        self.forget_parent_cache();
        remove_all_at(parent, name).map_err(|e| self.write_error(e, path))
    }

    fn mkdir(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        path: &Path,
    ) -> Result<(), UnpackError> {
        mkdirat(parent, name, Mode::from_bits_truncate(WORKING_DIR_MODE))
            .map_err(|e| self.write_error(e.into(), path))
    }

    #[allow(clippy::too_many_arguments)]
    fn write_file(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        path: &Path,
        contents: &mut impl Read,
        size: u64,
        executable: bool,
        layer: &str,
    ) -> Result<(), UnpackError> {
        let fd = nix::fcntl::openat(
            parent,
            name,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| self.write_error(e.into(), path))?;
        let mut file = File::from(fd);
        let mut hasher = Sha256::new();
        let mut buffer = vec![0u8; 64 * 1024];
        let mut written = 0u64;
        loop {
            let n = match contents.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(UnpackError::Read {
                        layer: layer.to_string(),
                        source,
                    });
                }
            };
            written += n as u64;
            if written > size {
                // The tar reader never yields more than the header said;
                // this guards the count the limit rests on.
                return Err(UnpackError::Read {
                    layer: layer.to_string(),
                    source: io::Error::new(
                        io::ErrorKind::InvalidData,
                        "an entry is longer than its header says",
                    ),
                });
            }
            hasher.update(&buffer[..n]);
            file.write_all(&buffer[..n])
                .map_err(|e| self.write_error(e, path))?;
        }
        self.counts.bytes += written;
        let mode = if executable {
            EXEC_FILE_MODE
        } else {
            FILE_MODE
        };
        fchmod(file.as_fd(), Mode::from_bits_truncate(mode))
            .map_err(|e| self.write_error(e.into(), path))?;
        let stat =
            nix::sys::stat::fstat(file.as_fd()).map_err(|e| self.write_error(e.into(), path))?;
        self.digests.insert(stat.st_ino, hasher.finalize().into());
        Ok(())
    }

    /// Empties `dir` of what the layers below put there.
    fn opaque(&mut self, dir: &OwnedFd, dir_path: &Path) -> io::Result<()> {
        self.forget_parent_cache();
        for name in list_dir(dir.as_fd())? {
            if !self.layer_paths.contains(&dir_path.join(&name)) {
                remove_all_at(dir.as_fd(), &name)?;
            }
        }
        self.layer_paths.insert(dir_path.to_path_buf());
        Ok(())
    }

    /// Opens the directory `rel` of the tree without following a symlink,
    /// making the missing ones when `create` (an archive may list a file
    /// before, or without, its directory).
    fn open_parent(&mut self, rel: &Path, create: bool) -> Result<OwnedFd, OpenFailure> {
        if let Some((cached, fd)) = &self.last_parent
            && cached == rel
        {
            return fd.try_clone().map_err(OpenFailure::Io);
        }
        let mut current = self.root.try_clone().map_err(OpenFailure::Io)?;
        let mut walked = PathBuf::new();
        for component in rel.components() {
            let name = component.as_os_str();
            walked.push(name);
            current = match open_beneath(current.as_fd(), name) {
                Ok(fd) => fd,
                Err(OpenFailure::Missing) if create => {
                    mkdirat(
                        current.as_fd(),
                        name,
                        Mode::from_bits_truncate(WORKING_DIR_MODE),
                    )
                    .map_err(|e| OpenFailure::Io(e.into()))?;
                    self.counts.entries += 1;
                    self.layer_paths.insert(walked.clone());
                    open_beneath(current.as_fd(), name)?
                }
                Err(other) => return Err(other),
            };
        }
        if let Ok(copy) = current.try_clone() {
            self.last_parent = Some((rel.to_path_buf(), copy));
        }
        Ok(current)
    }

    /// Sets every directory to its final mode, lists the tree, and syncs
    /// its file system. The caller renames it into place afterwards.
    pub fn seal(mut self) -> Result<(TreeCounts, String), UnpackError> {
        self.last_parent = None;
        let mut listing = String::new();
        let digests = std::mem::take(&mut self.digests);
        let root = self
            .root
            .try_clone()
            .map_err(|e| self.write_error(e, Path::new(".")))?;
        // Modes first, so the listing shows them as they stay.
        walk(root.as_fd(), Path::new(""), &mut |event| match event {
            Walked::Leave { dir } => {
                fchmod(dir, Mode::from_bits_truncate(DIR_MODE)).map_err(io::Error::from)
            }
            Walked::Entry { .. } => Ok(()),
        })
        .map_err(|e| self.write_error(e, Path::new(".")))?;
        walk(root.as_fd(), Path::new(""), &mut |event| match event {
            Walked::Entry {
                parent,
                name,
                path,
                stat,
            } => listing_line(&mut listing, parent, name, path, stat, |ino| {
                digests.get(&ino).copied()
            }),
            Walked::Leave { .. } => Ok(()),
        })
        .map_err(|e| self.write_error(e, Path::new(".")))?;
        fchmod(root.as_fd(), Mode::from_bits_truncate(DIR_MODE))
            .map_err(|e| self.write_error(e.into(), Path::new(".")))?;
        nix::unistd::syncfs(root.as_fd())
            .map_err(|e| self.write_error(e.into(), Path::new(".")))?;
        Ok((self.counts, listing))
    }
}

/// Why a directory of the tree could not be opened.
#[derive(Debug)]
enum OpenFailure {
    Missing,
    Symlink,
    NotDirectory,
    Io(io::Error),
}

impl From<OpenFailure> for io::Error {
    fn from(failure: OpenFailure) -> Self {
        match failure {
            OpenFailure::Missing => io::ErrorKind::NotFound.into(),
            OpenFailure::Symlink => io::Error::from_raw_os_error(Errno::ELOOP as i32),
            OpenFailure::NotDirectory => io::Error::from_raw_os_error(Errno::ENOTDIR as i32),
            OpenFailure::Io(e) => e,
        }
    }
}

/// Opens the directory `name` inside `dir`, refusing a symlink anywhere and
/// anything outside `dir`.
fn open_beneath(dir: BorrowedFd<'_>, name: &OsStr) -> Result<OwnedFd, OpenFailure> {
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    openat2(dir, name, how).map_err(|errno| match errno {
        Errno::ENOENT => OpenFailure::Missing,
        Errno::ELOOP => OpenFailure::Symlink,
        Errno::ENOTDIR => {
            // O_NOFOLLOW with O_DIRECTORY on a symlink says ENOTDIR on some
            // kernels; tell the two apart.
            match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(stat)
                    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT
                        == SFlag::S_IFLNK =>
                {
                    OpenFailure::Symlink
                }
                _ => OpenFailure::NotDirectory,
            }
        }
        other => OpenFailure::Io(other.into()),
    })
}

/// The entry's path as components below the root: `./` and empty
/// components dropped, an absolute path or a `..` refused.
pub fn relative_path(raw: &[u8]) -> Result<PathBuf, Rule> {
    if raw.first() == Some(&b'/') {
        return Err(Rule::Absolute);
    }
    if raw.contains(&0) {
        return Err(Rule::BadName);
    }
    let mut path = PathBuf::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err(Rule::ParentComponent),
            name => path.push(OsStr::from_bytes(name)),
        }
    }
    Ok(path)
}

fn check_name(name: &OsStr) -> Result<(), Rule> {
    match name.as_bytes() {
        b"" | b"." => Err(Rule::BadName),
        b".." => Err(Rule::ParentComponent),
        bytes if bytes.contains(&b'/') || bytes.contains(&0) => Err(Rule::BadName),
        _ => Ok(()),
    }
}

fn stat_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<FileStat>> {
    match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) => Ok(Some(stat)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The names in a directory, sorted, without `.` and `..`.
fn list_dir(dir: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    let fd = nix::fcntl::openat(
        dir,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut reader = nix::dir::Dir::from_fd(fd)?;
    let mut names = Vec::new();
    for entry in reader.iter() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    }
    names.sort();
    Ok(names)
}

/// Removes `name` in `dir` and, for a directory, everything below it,
/// never following a symlink. A missing `name` is no error.
pub fn remove_all_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    let Some(stat) = stat_at(dir, name)? else {
        return Ok(());
    };
    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFDIR {
        return unlinkat(dir, name, UnlinkatFlags::NoRemoveDir).map_err(io::Error::from);
    }
    let child = nix::fcntl::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // A sealed tree's directories are 0555: an agent that is not root
    // needs the write bit back to empty them.
    fchmod(child.as_fd(), Mode::from_bits_truncate(WORKING_DIR_MODE))?;
    for entry in list_dir(child.as_fd())? {
        remove_all_at(child.as_fd(), &entry)?;
    }
    unlinkat(dir, name, UnlinkatFlags::RemoveDir).map_err(io::Error::from)
}

/// What a walk of a tree reports.
pub(crate) enum Walked<'a> {
    /// An entry (of any kind), before the walk enters it if a directory.
    Entry {
        parent: BorrowedFd<'a>,
        name: &'a OsStr,
        path: &'a Path,
        stat: &'a FileStat,
    },
    /// A directory, once everything below it was walked.
    Leave { dir: BorrowedFd<'a> },
}

/// Walks the tree below `dir` in name order, never following a symlink.
pub(crate) fn walk(
    dir: BorrowedFd<'_>,
    path: &Path,
    visit: &mut dyn FnMut(Walked<'_>) -> io::Result<()>,
) -> io::Result<()> {
    for name in list_dir(dir)? {
        let child_path = path.join(&name);
        let stat = fstatat(dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)?;
        visit(Walked::Entry {
            parent: dir,
            name: &name,
            path: &child_path,
            stat: &stat,
        })?;
        if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR {
            let child = nix::fcntl::openat(
                dir,
                name.as_os_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            walk(child.as_fd(), &child_path, visit)?;
            visit(Walked::Leave { dir: child.as_fd() })?;
        }
    }
    Ok(())
}

/// Appends the listing line of one entry: its kind, mode, size, content
/// digest (files) or target (symlinks), and path. `known` gives a file's
/// digest by inode when it was hashed as it was written; otherwise it is
/// read and hashed now.
pub(crate) fn listing_line(
    listing: &mut String,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    path: &Path,
    stat: &FileStat,
    known: impl Fn(u64) -> Option<[u8; 32]>,
) -> io::Result<()> {
    use std::fmt::Write as _;
    let kind = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT;
    let mode = stat.st_mode & 0o7777;
    let detail = if kind == SFlag::S_IFREG {
        let digest = match known(stat.st_ino) {
            Some(digest) => digest,
            None => hash_at(parent, name)?,
        };
        hex::encode(digest)
    } else if kind == SFlag::S_IFLNK {
        let target = nix::fcntl::readlinkat(parent, name)?;
        escape(target.as_bytes())
    } else {
        "-".to_string()
    };
    let letter = match kind {
        SFlag::S_IFREG => 'f',
        SFlag::S_IFDIR => 'd',
        SFlag::S_IFLNK => 'l',
        _ => '?',
    };
    let size = if kind == SFlag::S_IFREG {
        stat.st_size
    } else {
        0
    };
    let _ = writeln!(
        listing,
        "{letter} {mode:04o} {size} {detail} {}",
        escape(path.as_os_str().as_bytes())
    );
    Ok(())
}

fn hash_at(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<[u8; 32]> {
    let fd = nix::fcntl::openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut file = File::from(fd);
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buffer[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hasher.finalize().into())
}

/// Bytes as one listing word: printable ASCII as it is, `%` and everything
/// else as `%XX`.
fn escape(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The raw descriptor number, for `/proc/self/fd` look-ups.
pub(crate) fn fd_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_apart_before_anything_is_written() {
        assert_eq!(relative_path(b"./a/b").unwrap(), PathBuf::from("a/b"));
        assert_eq!(relative_path(b"a//b/./c/").unwrap(), PathBuf::from("a/b/c"));
        assert_eq!(relative_path(b"./").unwrap(), PathBuf::new());
        assert_eq!(relative_path(b"/etc/x"), Err(Rule::Absolute));
        assert_eq!(relative_path(b"a/../../x"), Err(Rule::ParentComponent));
        assert_eq!(relative_path(b"../x"), Err(Rule::ParentComponent));
        assert_eq!(relative_path(b"a/..b"), Ok(PathBuf::from("a/..b")));
    }

    #[test]
    fn listing_words_escape_what_is_not_printable() {
        assert_eq!(escape(b"a b%\n"), "a%20b%25%0A");
        assert_eq!(escape(b"usr/lib/x.so"), "usr/lib/x.so");
    }
}
