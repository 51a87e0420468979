//! The `Protected` filesystem (SPEC 5.16): each process of a generation in
//! a mount namespace of its own, built from mounts the agent prepares
//! before the fork and the child attaches with one system call each.
//!
//! The agent makes, detached from every tree (`open_tree(OPEN_TREE_CLONE)`
//! and `fsmount`, Linux 5.2), a fresh `/proc` that shows only the
//! instance's user's processes (`hidepid=invisible`, one instance per
//! mount since Linux 5.8), a small `/dev`, the generation's private `/tmp`
//! and `/var/tmp`, an unreadable empty directory and file for what is
//! hidden, and a copy of each path the instance keeps (its writable paths,
//! its run dir, and what it runs from where that lies in a hidden place).
//! The child unshares, makes every mount read-only at once
//! (`mount_setattr(AT_RECURSIVE)`, Linux 5.12) and attaches them. A kernel
//! without one of these refuses the start, naming it; nothing runs less
//! confined than its spec says.
//!
//! The private `/tmp` is a directory on disk beside the generation's
//! socket (`gen-N.private/`, root's, mode 0700), so the generation's
//! sidecars, exec probes and hooks, each in its own namespace, share it
//! with the main process, and it survives an agent restart with them. It
//! is removed with the generation's socket.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::libc;
use thiserror::Error;

use crate::launch::{ChildStep, SETUP_FD_FLOOR, fd_at_least};

/// Why the filesystem a spec asks for cannot be prepared; nothing started.
#[derive(Debug, Error)]
pub enum FsError {
    #[error("cannot {what}: {source}")]
    Prepare {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "this kernel cannot {what} ({source}); the Protected filesystem needs Linux 5.12 or later (process.filesystem: Host runs without it)"
    )]
    Kernel {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{what} {} lies under {}, which the sandbox hides", path.display(), hidden.display())]
    UnderHidden {
        what: &'static str,
        path: PathBuf,
        hidden: PathBuf,
    },
    #[error("process.writablePaths: {} does not exist on this node ({source})", path.display())]
    MissingWritable {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("process.writablePaths: {} is not an absolute path without . or ..", path.display())]
    BadWritable { path: PathBuf },
    #[error("the generation's socket {} does not lie in a run dir of its own that exists", socket.display())]
    NoRunDir { socket: PathBuf },
    #[error("process.root: build cannot mount {} as /: overlayfs takes no path with ':', ',' or '\\' in it", path.display())]
    UnmountablePath { path: PathBuf },
}

/// What one process's namespace is built from.
#[derive(Clone, Debug, Default)]
pub struct FsRequest {
    /// The generation's socket: its directory (the instance's run dir)
    /// stays writable, and its private directory lies beside it.
    pub socket: PathBuf,
    /// Kept writable at the same path besides the run dir: the spec's
    /// writable paths.
    pub writable: Vec<PathBuf>,
    /// Kept readable at the same path where they lie in a hidden place:
    /// the executable and the working directory.
    pub readable: Vec<PathBuf>,
    /// `process.root: build`: the build's tree on the node, which becomes
    /// `/`.
    pub root: Option<PathBuf>,
}

/// The detached mounts (held until the child has its copies) and the
/// child's steps, each with what it does for an error message.
pub(crate) struct PreparedFs {
    pub held: Vec<OwnedFd>,
    pub steps: Vec<(String, ChildStep)>,
}

/// Replaced by the private ones.
const PRIVATE_TMP: [(&str, &str); 2] = [("/tmp", "tmp"), ("/var/tmp", "var-tmp")];
/// Empty and unreadable inside (systemd's `ProtectHome=yes`, and the
/// kernel modules of `ProtectKernelModules=`).
const HIDDEN_DIRS: [&str; 5] = [
    "/home",
    "/root",
    "/run/user",
    "/usr/lib/modules",
    "/lib/modules",
];
/// The kernel's log and memory (`ProtectKernelLogs=`).
const HIDDEN_PROC_FILES: [&str; 3] = ["kmsg", "kcore", "kallsyms"];
/// Read-only inside `/proc` (`ProtectKernelTunables=`); `/sys` is
/// read-only with the rest of the tree.
const READ_ONLY_PROC: [&str; 13] = [
    "sys",
    "sysrq-trigger",
    "irq",
    "bus",
    "fs",
    "acpi",
    "apm",
    "asound",
    "latency_stats",
    "mtrr",
    "scsi",
    "timer_list",
    "timer_stats",
];
/// The node's devices a service may use, bound into the small `/dev`.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];
const DEV_LINKS: [(&str, &str); 5] = [
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
];
/// The host's, kept in the small `/dev`: terminals, POSIX shared memory
/// and message queues.
const DEV_KEPT: [&str; 3] = ["pts", "shm", "mqueue"];

/// The private directory of the generation whose socket is `socket`.
pub fn private_dir_of(socket: &Path) -> PathBuf {
    socket.with_extension("private")
}

/// Removes a stopped generation's private directory, its `/tmp` with it.
pub fn remove_private_dir(socket: &Path) -> io::Result<()> {
    match fs::remove_dir_all(private_dir_of(socket)) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Prepares what `request`'s namespace is built from.
pub(crate) fn prepare(request: &FsRequest) -> Result<PreparedFs, FsError> {
    for path in &request.writable {
        if !is_plain_absolute(path) {
            return Err(FsError::BadWritable { path: path.clone() });
        }
    }
    let run_dir = request
        .socket
        .parent()
        .filter(|dir| dir.components().count() > 1 && dir.is_dir())
        .ok_or_else(|| FsError::NoRunDir {
            socket: request.socket.clone(),
        })?;
    let private_dir = private_dir_of(&request.socket);
    let private = PrivateDir::create(&private_dir)?;
    let mut prepared = PreparedFs {
        held: Vec::new(),
        steps: Vec::new(),
    };
    prepared.step(
        "enter a mount namespace of its own",
        ChildStep::Unshare(libc::CLONE_NEWNS | libc::CLONE_NEWUTS),
    );
    prepared.step(
        "keep its mounts from reaching the host",
        ChildStep::MountsSlave,
    );
    match &request.root {
        None => on_the_node(&mut prepared, request, run_dir, &private)?,
        Some(tree) => in_the_tree(&mut prepared, request, tree, run_dir, &private)?,
    }
    Ok(prepared)
}

/// The node's tree, read-only, with what is kept at the same paths.
fn on_the_node(
    prepared: &mut PreparedFs,
    request: &FsRequest,
    run_dir: &Path,
    private: &PrivateDir,
) -> Result<(), FsError> {
    let root = Path::new("/");
    prepared.step(
        "make the node's filesystem read-only",
        ChildStep::MountAttr {
            path: cstring(root)?,
            set: libc::MOUNT_ATTR_RDONLY,
        },
    );
    kernel_filesystems(prepared, root, private)?;

    // Where the agent's root has no such directory (a minimal image's),
    // neither has the instance.
    let private_tmp: Vec<(&str, &str)> = PRIVATE_TMP
        .into_iter()
        .filter(|(target, _)| Path::new(target).is_dir())
        .collect();
    for (target, sub) in &private_tmp {
        let tmp = clone_tree(&private.dir.join(sub), false)?;
        prepared.attach(tmp, Path::new(target), "mount its private")?;
    }

    let hidden = hidden_dirs();
    for dir in &hidden {
        let cover = clone_tree(&private.hidden_dir, true)?;
        prepared.attach(cover, dir, "hide")?;
    }

    // Parents before what lies inside them.
    let mut kept: Vec<(&Path, bool)> = request
        .writable
        .iter()
        .map(|p| (p.as_path(), true))
        .chain([(run_dir, true)])
        .chain(request.readable.iter().map(|p| (p.as_path(), false)))
        .collect();
    kept.retain(|(path, writable)| {
        *writable
            || !request.writable.iter().any(|w| path.starts_with(w)) && !path.starts_with(run_dir)
    });
    kept.sort_by_key(|(path, _)| parents_first(path));
    kept.dedup_by(|(a, _), (b, _)| a == b);
    for (path, writable) in kept {
        if let Some(dir) = hidden.iter().find(|dir| path.starts_with(dir)) {
            return Err(FsError::UnderHidden {
                what: if writable {
                    "the writable path"
                } else {
                    "the instance's executable or working directory"
                },
                path: path.to_path_buf(),
                hidden: dir.clone(),
            });
        }
        let in_private = private_tmp
            .iter()
            .find(|(tmp, _)| path.starts_with(tmp) && path != Path::new(tmp));
        if in_private.is_none() && !writable {
            continue;
        }
        let is_dir = match fs::metadata(path) {
            Ok(meta) => meta.is_dir(),
            Err(source) if writable => {
                return Err(FsError::MissingWritable {
                    path: path.to_path_buf(),
                    source,
                });
            }
            // Missing: its exec fails as it would outside (the build's).
            Err(_) => continue,
        };
        if let Some((tmp, _)) = in_private {
            prepared.make_in_private_tmp(Path::new("/"), Path::new(tmp), path, is_dir)?;
        }
        let copy = clone_tree(path, !writable)?;
        prepared.attach(copy, path, "keep")?;
    }
    Ok(())
}

/// The node's files a tree gets at the same paths, read-only, where the
/// node has them.
pub(crate) const FROM_THE_NODE: [&str; 2] = ["/etc/resolv.conf", "/etc/hosts"];

/// `process.root: build`: the build's tree as `/`, read-only, and in it
/// the kernel's filesystems, a private `/tmp`, the node's resolver files,
/// the run dir and the writable paths at their node paths. The mount
/// points the tree may lack come from a scaffold the agent lays over it
/// (overlayfs with two lower layers: read-only, nothing written to the
/// store), so a stored tree is never changed.
fn in_the_tree(
    prepared: &mut PreparedFs,
    request: &FsRequest,
    tree: &Path,
    run_dir: &Path,
    private: &PrivateDir,
) -> Result<(), FsError> {
    // Parents before what lies inside them.
    let mut bound: Vec<&Path> = request
        .writable
        .iter()
        .map(PathBuf::as_path)
        .chain([run_dir])
        .collect();
    bound.sort_by_key(|path| parents_first(path));
    bound.dedup();
    let mut points: Vec<(PathBuf, bool)> = ["/proc", "/dev", "/sys", "/tmp", "/var/tmp"]
        .into_iter()
        .map(|dir| (PathBuf::from(dir), true))
        .collect();
    let from_node: Vec<&Path> = FROM_THE_NODE
        .into_iter()
        .map(Path::new)
        .filter(|file| fs::metadata(file).is_ok_and(|m| m.is_file()))
        .collect();
    points.extend(from_node.iter().map(|file| (file.to_path_buf(), false)));
    for path in &bound {
        let meta = fs::metadata(path).map_err(|source| FsError::MissingWritable {
            path: path.to_path_buf(),
            source,
        })?;
        points.push((path.to_path_buf(), meta.is_dir()));
    }
    let scaffold = private.scaffold(&points)?;
    let lower = [scaffold.as_path(), tree]
        .iter()
        .map(|layer| {
            let text = layer.to_str().filter(|t| !t.contains([':', ',', '\\']));
            text.ok_or_else(|| FsError::UnmountablePath {
                path: layer.to_path_buf(),
            })
        })
        .collect::<Result<Vec<&str>, FsError>>()?
        .join(":");
    let lower = CString::new(lower).map_err(|_| FsError::UnmountablePath {
        path: tree.to_path_buf(),
    })?;
    let overlay = new_mount(
        c"overlay",
        &[(c"lowerdir", lower.as_c_str())],
        libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV,
    )
    .map_err(|source| kernel_or(source, format!("mount the tree {} as /", tree.display())))?;
    let root = private.dir.join("root");
    prepared.attach(overlay, &root, "mount the build's tree at")?;

    kernel_filesystems(prepared, &root, private)?;
    // The tree's own homes hidden as the node's are (`ProtectHome=`);
    // only where no link is on the way, which could lead out of the tree.
    for dir in HIDDEN_DIRS {
        let in_tree = under(tree, Path::new(dir));
        if fs::canonicalize(&in_tree).is_ok_and(|real| real == in_tree) {
            let cover = clone_tree(&private.hidden_dir, true)?;
            prepared.attach(cover, &under(&root, Path::new(dir)), "hide")?;
        }
    }
    let sys = clone_tree(Path::new("/sys"), true)?;
    prepared.attach(
        sys,
        &under(&root, Path::new("/sys")),
        "mount /sys read-only at",
    )?;
    for (target, sub) in PRIVATE_TMP {
        let tmp = clone_tree(&private.dir.join(sub), false)?;
        prepared.attach(tmp, &under(&root, Path::new(target)), "mount its private")?;
    }
    for file in from_node {
        let copy = clone_tree(file, true)?;
        prepared.attach(copy, &under(&root, file), "bind the node's")?;
    }
    for (path, is_dir) in &points[points.len() - bound.len()..] {
        let tmp = PRIVATE_TMP
            .into_iter()
            .map(|(tmp, _)| Path::new(tmp))
            .find(|tmp| path.starts_with(tmp) && path != tmp);
        if let Some(tmp) = tmp {
            prepared.make_in_private_tmp(&root, tmp, path, *is_dir)?;
        }
        let copy = clone_tree(path, false)?;
        prepared.attach(copy, &under(&root, path), "bind")?;
    }
    prepared.step(
        &format!("make the tree {} its root", tree.display()),
        ChildStep::PivotRoot(cstring(&root)?),
    );
    Ok(())
}

/// A sort key that puts a directory before what lies inside it, so a
/// mount on it never covers one below it.
fn parents_first(path: &Path) -> (usize, &Path) {
    (path.components().count(), path)
}

/// `path`, absolute, as it lies below `root`.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// `/proc` and `/dev` of its own, below `root`.
fn kernel_filesystems(
    prepared: &mut PreparedFs,
    root: &Path,
    private: &PrivateDir,
) -> Result<(), FsError> {
    let proc = new_proc()?;
    prepared.attach(
        proc,
        &under(root, Path::new("/proc")),
        "mount its own /proc at",
    )?;
    for name in READ_ONLY_PROC {
        let path = Path::new("/proc").join(name);
        if fs::symlink_metadata(&path).is_err() {
            continue;
        }
        let target = cstring(&under(root, &path))?;
        prepared.step(
            &format!("bind {}", path.display()),
            ChildStep::BindSelf(target.clone()),
        );
        prepared.step(
            &format!("make {} read-only", path.display()),
            ChildStep::MountAttr {
                path: target,
                set: libc::MOUNT_ATTR_RDONLY,
            },
        );
    }
    for name in HIDDEN_PROC_FILES {
        let path = Path::new("/proc").join(name);
        if fs::symlink_metadata(&path).is_ok() {
            let hidden = clone_tree(&private.hidden_file, true)?;
            prepared.attach(hidden, &under(root, &path), "hide")?;
        }
    }

    let dev = new_dev()?;
    prepared.attach(
        dev,
        &under(root, Path::new("/dev")),
        "mount its own /dev at",
    )?;
    for name in DEVICES {
        let path = Path::new("/dev").join(name);
        if fs::symlink_metadata(&path).is_err() {
            continue;
        }
        let device = clone_tree(&path, false)?;
        prepared.attach(device, &under(root, &path), "bind the node's")?;
    }
    for name in DEV_KEPT {
        let path = Path::new("/dev").join(name);
        if fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
            let kept = clone_tree(&path, false)?;
            prepared.attach(kept, &under(root, &path), "keep the node's")?;
        }
    }
    Ok(())
}

impl PreparedFs {
    fn step(&mut self, what: &str, step: ChildStep) {
        self.steps.push((what.to_owned(), step));
    }

    /// Steps that make `path` (and the directories above it) inside the
    /// private `tmp` mounted below `root`, for a mount on it.
    fn make_in_private_tmp(
        &mut self,
        root: &Path,
        tmp: &Path,
        path: &Path,
        is_dir: bool,
    ) -> Result<(), FsError> {
        let mut below = tmp.to_path_buf();
        let rest = path.strip_prefix(tmp).unwrap_or(path);
        let parts: Vec<Component<'_>> = rest.components().collect();
        for (i, part) in parts.iter().enumerate() {
            below.push(part);
            let at = cstring(&under(root, &below))?;
            let made = if i + 1 == parts.len() && !is_dir {
                ChildStep::MakeFile(at)
            } else {
                ChildStep::MakeDir(at)
            };
            self.step(
                &format!("make {} in its private {}", below.display(), tmp.display()),
                made,
            );
        }
        Ok(())
    }

    fn attach(&mut self, mount: OwnedFd, target: &Path, what: &str) -> Result<(), FsError> {
        let mount = fd_at_least(&mount, SETUP_FD_FLOOR).map_err(|source| FsError::Prepare {
            what: "move a mount's descriptor".into(),
            source,
        })?;
        self.steps.push((
            format!("{what} {}", target.display()),
            ChildStep::Attach {
                fd: mount.as_raw_fd(),
                target: cstring(target)?,
            },
        ));
        self.held.push(mount);
        Ok(())
    }
}

/// The generation's private directory, made once and kept.
struct PrivateDir {
    dir: PathBuf,
    hidden_dir: PathBuf,
    hidden_file: PathBuf,
}

impl PrivateDir {
    fn create(dir: &Path) -> Result<PrivateDir, FsError> {
        let fail = |what: String| move |source| FsError::Prepare { what, source };
        let make = |path: &Path, mode: u32| -> Result<(), FsError> {
            match fs::DirBuilder::new().mode(mode).create(path) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                    Err(fail(format!("create {}", path.display()))(e))
                }
                _ => fs::set_permissions(path, fs::Permissions::from_mode(mode))
                    .map_err(fail(format!("set the mode of {}", path.display()))),
            }
        };
        // In the instance's run dir, which its user owns: never through a
        // link it put there, and never one it made (it could hold links
        // for the agent to follow); the agent's own, 0700, where the
        // instance cannot reach what is inside.
        let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());
        if let Ok(meta) = fs::symlink_metadata(dir)
            && meta.is_dir()
            && std::os::unix::fs::MetadataExt::uid(&meta) != uid.as_raw()
        {
            fs::remove_dir_all(dir).map_err(fail(format!("remove {}", dir.display())))?;
        }
        super::directories::real_dir(dir, 0o700, Some(uid.as_raw()), Some(gid.as_raw()))
            .map_err(fail(format!("create {}", dir.display())))?;
        for (_, sub) in PRIVATE_TMP {
            make(&dir.join(sub), 0o1777)?;
        }
        let hidden_dir = dir.join("hidden");
        make(&hidden_dir, 0o000)?;
        let hidden_file = dir.join("hidden-file");
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&hidden_file)
            .and_then(|_| fs::set_permissions(&hidden_file, fs::Permissions::from_mode(0o000)))
            .map_err(fail(format!("create {}", hidden_file.display())))?;
        make(&dir.join("root"), 0o755)?;
        Ok(PrivateDir {
            dir: dir.to_path_buf(),
            hidden_dir,
            hidden_file,
        })
    }

    /// A directory holding an empty directory or file at each of
    /// `points` (absolute paths, `true` for a directory), made once per
    /// set and never changed after: overlayfs forbids changing a layer
    /// under a mount.
    fn scaffold(&self, points: &[(PathBuf, bool)]) -> Result<PathBuf, FsError> {
        use sha2::Digest;
        let fail = |what: String| move |source| FsError::Prepare { what, source };
        let mut hash = sha2::Sha256::new();
        for (path, is_dir) in points {
            hash.update(path.as_os_str().as_bytes());
            hash.update(if *is_dir { b"/\0" } else { b"\0\0" });
        }
        let name = format!("scaffold-{}", &hex::encode(hash.finalize())[..16]);
        let scaffold = self.dir.join(&name);
        if scaffold.is_dir() {
            return Ok(scaffold);
        }
        let making = self.dir.join(format!("{name}.new"));
        if fs::symlink_metadata(&making).is_ok() {
            fs::remove_dir_all(&making).map_err(fail(format!("remove {}", making.display())))?;
        }
        for (path, is_dir) in points {
            let at = under(&making, path);
            let parent = if *is_dir {
                Some(at.as_path())
            } else {
                at.parent()
            };
            if let Some(parent) = parent {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(parent)
                    .map_err(fail(format!("create {}", parent.display())))?;
            }
            if !is_dir {
                fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o644)
                    .open(&at)
                    .map_err(fail(format!("create {}", at.display())))?;
            }
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&making)
            .map_err(fail(format!("create {}", making.display())))?;
        match fs::rename(&making, &scaffold) {
            Ok(()) => Ok(scaffold),
            // Another spawn of the generation made the same one first.
            Err(_) if scaffold.is_dir() => {
                let _ = fs::remove_dir_all(&making);
                Ok(scaffold)
            }
            Err(source) => Err(fail(format!("create {}", scaffold.display()))(source)),
        }
    }
}

/// The hidden directories this node has, each once (`/lib/modules` is
/// `/usr/lib/modules` where `/lib` is a link).
fn hidden_dirs() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = Vec::new();
    for dir in HIDDEN_DIRS {
        let path = Path::new(dir);
        if !fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        if fs::canonicalize(path).is_ok_and(|real| real == path) {
            found.push(path.to_path_buf());
        }
    }
    found
}

/// Absolute, with no `.`, `..` or empty component.
fn is_plain_absolute(path: &Path) -> bool {
    path.is_absolute()
        && path.components().count() > 1
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

fn cstring(path: &Path) -> Result<CString, FsError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| FsError::Prepare {
        what: format!("use the path {}", path.display()),
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })
}

/// A raw system call's descriptor as an owned one.
fn owned(result: libc::c_long) -> io::Result<OwnedFd> {
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(result).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned this new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn checked(result: libc::c_long) -> io::Result<()> {
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A detached copy of the mounts at and below `path`; read-only (and
/// without devices, set-id or exec) when `read_only`.
fn clone_tree(path: &Path, read_only: bool) -> Result<OwnedFd, FsError> {
    let c_path = cstring(path)?;
    // SAFETY: open_tree reads a NUL-terminated path that outlives the call.
    let tree = owned(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c_path.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_RECURSIVE as libc::c_uint,
        )
    })
    .map_err(|source| kernel_or(source, format!("copy the mount of {}", path.display())))?;
    if read_only {
        set_attr(
            tree.as_fd(),
            libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV,
        )
        .map_err(|source| kernel_or(source, format!("make {} read-only", path.display())))?;
    }
    Ok(tree)
}

/// `mount_setattr` on a detached tree, every mount of it.
fn set_attr(tree: std::os::fd::BorrowedFd<'_>, set: u64) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads an empty path and one live mount_attr of
    // the size passed.
    checked(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            std::ptr::from_ref(&attr),
            std::mem::size_of::<libc::mount_attr>(),
        )
    })
}

/// An error of a call a kernel may lack said as such.
fn kernel_or(source: io::Error, what: String) -> FsError {
    if source.raw_os_error() == Some(libc::ENOSYS) {
        FsError::Kernel { what, source }
    } else {
        FsError::Prepare { what, source }
    }
}

/// A new filesystem of `kind` with `options`, mounted detached with `attrs`.
fn new_mount(
    kind: &std::ffi::CStr,
    options: &[(&std::ffi::CStr, &std::ffi::CStr)],
    attrs: u64,
) -> io::Result<OwnedFd> {
    // SAFETY: fsopen reads a NUL-terminated name.
    let context =
        owned(unsafe { libc::syscall(libc::SYS_fsopen, kind.as_ptr(), libc::FSOPEN_CLOEXEC) })?;
    for (key, value) in options {
        // SAFETY: fsconfig reads two NUL-terminated strings.
        checked(unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                context.as_raw_fd(),
                libc::FSCONFIG_SET_STRING,
                key.as_ptr(),
                value.as_ptr(),
                0,
            )
        })?;
    }
    // SAFETY: fsconfig with no key or value.
    checked(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            context.as_raw_fd(),
            libc::FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    })?;
    // SAFETY: fsmount takes a descriptor and flags.
    owned(unsafe {
        libc::syscall(
            libc::SYS_fsmount,
            context.as_raw_fd(),
            libc::FSMOUNT_CLOEXEC,
            attrs,
        )
    })
}

/// A `/proc` that lists only the processes of the viewer's user.
fn new_proc() -> Result<OwnedFd, FsError> {
    new_mount(
        c"proc",
        &[(c"hidepid", c"invisible")],
        libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV | libc::MOUNT_ATTR_NOEXEC,
    )
    .map_err(|source| {
        let what = "mount a /proc that hides other users' processes (hidepid=invisible, Linux 5.8)"
            .to_owned();
        match source.raw_os_error() {
            Some(libc::ENOSYS | libc::EINVAL) => FsError::Kernel { what, source },
            _ => FsError::Prepare { what, source },
        }
    })
}

/// A small `/dev` of its own: the harmless devices, the usual links, and
/// mount points for what the host's keeps.
fn new_dev() -> Result<OwnedFd, FsError> {
    let fail = |what: &str| {
        let what = what.to_owned();
        move |source: io::Error| FsError::Prepare { what, source }
    };
    let dev = new_mount(
        c"tmpfs",
        &[(c"mode", c"0755"), (c"size", c"64k")],
        libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NOEXEC,
    )
    .map_err(|source| kernel_or(source, "mount a /dev of its own".into()))?;
    // Mount points for the node's own devices, bound on them in the child:
    // no mknod, so no CAP_MKNOD (a pod's agent lacks it).
    for name in DEVICES {
        nix::fcntl::openat(
            dev.as_fd(),
            name,
            nix::fcntl::OFlag::O_CREAT | nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
        )
        .map(drop)
        .map_err(|e| fail(&format!("create /dev/{name}"))(e.into()))?;
    }
    for (name, target) in DEV_LINKS {
        nix::unistd::symlinkat(target, dev.as_fd(), name)
            .map_err(|e| fail(&format!("link /dev/{name}"))(e.into()))?;
    }
    for name in DEV_KEPT {
        nix::sys::stat::mkdirat(
            dev.as_fd(),
            name,
            nix::sys::stat::Mode::from_bits_truncate(0o755),
        )
        .map_err(|e| fail(&format!("create /dev/{name}"))(e.into()))?;
    }
    Ok(dev)
}
