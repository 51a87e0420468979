//! Starting a child process inside a given cgroup, with the steps between
//! the fork and the exec written out as data.
//!
//! The child is created by `clone3(CLONE_INTO_CGROUP | CLONE_PIDFD)`, so the
//! kernel places it in its cgroup as it is created. Moving a process by a
//! write to `cgroup.procs` takes the write side of the kernel's global
//! `cgroup_threadgroup_rwsem`, which waits for an RCU grace period: measured
//! here at 10 to 16 ms for the log shim's move on about one swap in three,
//! the largest part of the spawn step's p99. `CLONE_INTO_CGROUP` takes only
//! the read side (kernel commit ef2c41cf38a7, Linux 5.7). Where the kernel
//! or a seccomp filter refuses `clone3`, the child is forked and writes `0`
//! to `cgroup.procs` itself before its first step, as before.
//!
//! Between the fork and the exec the child runs [`ChildStep`]s: one
//! async-signal-safe system call each, on descriptors, ids and strings
//! prepared before the fork. It reports over a close-on-exec status pipe:
//! the code of a step that failed, or [`EXEC_NEXT`] once all passed, then
//! [`EXEC_FAILED`] and the errno if the exec itself failed. End-of-file right
//! after [`EXEC_NEXT`] is a successful exec (the pipe closed with it).
//!
//! The clone3 wrapper is written here rather than taken from the `clone3`
//! crate: that crate wraps only the system call (about ten lines here) and
//! brings a second libc binding with it; the child's side, which is the
//! code that needs care, is ours either way.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::libc;
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid};

/// Reported once every step passed; the exec comes next.
pub(crate) const EXEC_NEXT: u8 = b'x';
/// After [`EXEC_NEXT`]: the exec failed; its errno follows (four bytes,
/// little-endian).
pub(crate) const EXEC_FAILED: u8 = b'e';
/// The report of a failed `cgroup.procs` write on the forked fallback.
pub(crate) const JOIN_CGROUP: u8 = b'c';
/// The report of a failed write to one of [`join_also`]'s cgroups.
pub(crate) const JOIN_V1_CGROUPS: u8 = b'v';

/// `cgroup.procs` of the cgroups every child joins besides its own, written
/// by the child before its steps: the v1 homes of `crate::cgroup::hybrid`.
static ALSO_JOINED: std::sync::OnceLock<Vec<OwnedFd>> = std::sync::OnceLock::new();

/// Has every later child join these cgroups too (each an open
/// `cgroup.procs`), before anything else it does. Set once per process; a
/// second call is ignored, as the agent's own cgroups do not change.
pub(crate) fn join_also(procs: Vec<OwnedFd>) {
    let _ = ALSO_JOINED.set(procs);
}

/// `CLONE_INTO_CGROUP` from the kernel's uapi; libc's constant is a
/// deprecated `c_int` that cannot hold it.
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
/// `CLONE_PIDFD`.
const CLONE_PIDFD: u64 = 0x1000;

/// `struct clone_args` of the kernel's uapi, up to `cgroup` (version 2,
/// 88 bytes). The kernel reads the size it is given, so the layout is a
/// stable ABI.
#[repr(C, align(8))]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// `execve`'s arguments, built before the fork, with an optional slot in
/// the environment the child fills with its own pid (`LISTEN_PID`, which
/// only it knows).
pub(crate) struct ExecImage {
    path: CString,
    _strings: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// `<name>=` and room for the digits and their NUL.
    pid_entry: Option<(Box<[u8; PID_ENTRY_LEN]>, usize)>,
}

/// A short name, `=`, up to 20 digits, NUL.
const PID_ENTRY_LEN: usize = 48;

// SAFETY: the raw pointers point into buffers the image owns (`_strings`'
// and `pid_entry`'s heap allocations, which never move); only the forked
// child reads them or writes the pid digits, and the parent drops the
// image without touching them.
unsafe impl Send for ExecImage {}
// SAFETY: as for Send: no thread of the parent dereferences the pointers.
unsafe impl Sync for ExecImage {}

impl ExecImage {
    /// `exe`, named `argv0` where given (else `exe`), with `args` after it
    /// and exactly `env`, plus `pid_variable` set to the child's pid when
    /// given. `InvalidInput` for a NUL byte.
    pub(crate) fn named(
        exe: &Path,
        argv0: Option<&str>,
        args: &[String],
        env: &[(String, String)],
        pid_variable: Option<&str>,
    ) -> io::Result<ExecImage> {
        let nul = |_| io::Error::from(io::ErrorKind::InvalidInput);
        let path = CString::new(exe.as_os_str().as_bytes()).map_err(nul)?;
        let mut strings = Vec::with_capacity(1 + args.len() + env.len());
        strings.push(match argv0 {
            Some(name) => CString::new(name).map_err(nul)?,
            None => path.clone(),
        });
        for arg in args {
            strings.push(CString::new(arg.as_str()).map_err(nul)?);
        }
        let argc = strings.len();
        for (name, value) in env {
            strings.push(CString::new(format!("{name}={value}")).map_err(nul)?);
        }
        let mut argv: Vec<*const libc::c_char> =
            strings[..argc].iter().map(|s| s.as_ptr()).collect();
        argv.push(std::ptr::null());
        let mut envp: Vec<*const libc::c_char> =
            strings[argc..].iter().map(|s| s.as_ptr()).collect();
        let pid_entry = match pid_variable {
            Some(name) => {
                let prefix = format!("{name}=");
                if prefix.len() + 21 > PID_ENTRY_LEN || prefix.contains('\0') {
                    return Err(io::Error::from(io::ErrorKind::InvalidInput));
                }
                let mut entry = Box::new([0u8; PID_ENTRY_LEN]);
                entry[..prefix.len()].copy_from_slice(prefix.as_bytes());
                envp.push(entry.as_ptr().cast());
                Some((entry, prefix.len()))
            }
            None => None,
        };
        envp.push(std::ptr::null());
        Ok(ExecImage {
            path,
            _strings: strings,
            argv,
            envp,
            pid_entry,
        })
    }

    /// In the child: fills in its pid where asked and execs. Returns only
    /// if the exec failed.
    fn exec(&self) -> Errno {
        if let Some((entry, start)) = &self.pid_entry {
            let mut digits = [0u8; 20];
            let mut pid = nix::unistd::getpid().as_raw().unsigned_abs();
            let mut len = 0;
            loop {
                digits[len] = b'0' + (pid % 10) as u8;
                len += 1;
                pid /= 10;
                if pid == 0 {
                    break;
                }
            }
            let entry = entry.as_ptr().cast_mut();
            for (i, digit) in digits[..len].iter().rev().enumerate() {
                // SAFETY: start + len + 1 <= PID_ENTRY_LEN (checked in new);
                // the child owns its copy of the buffer, and nothing else
                // reads it until execve.
                unsafe { entry.add(start + i).write(*digit) };
            }
            // SAFETY: as above; the NUL ends the entry after the digits.
            unsafe { entry.add(start + len).write(0) };
        }
        // SAFETY: path, argv and envp are NUL-terminated strings and
        // null-terminated pointer arrays built before the fork and alive
        // as long as `self`.
        unsafe { libc::execve(self.path.as_ptr(), self.argv.as_ptr(), self.envp.as_ptr()) };
        Errno::last()
    }
}

/// One thing the child does before the exec.
pub(crate) enum ChildStep {
    /// `dup2(from, to)`; `from` must lie above every `to` of the plan.
    Dup2 {
        from: RawFd,
        to: RawFd,
    },
    Setsid,
    NoNewPrivs,
    Groups(Gid),
    Gid(Gid),
    Uid(Uid),
    Chdir(CString),
    /// `prlimit(0, resource, {soft, hard})`.
    Rlimit {
        resource: u32,
        soft: u64,
        hard: u64,
    },
    Umask(u32),
    /// Drops from the bounding set every capability up to `last` whose bit
    /// is not in `keep`, and clears the ambient set.
    DropBounding {
        keep: u64,
        last: u8,
    },
    /// `PR_SET_KEEPCAPS`: the permitted set survives the setuid that
    /// follows, so [`ChildStep::RaiseAmbient`] has something to raise.
    KeepCaps,
    /// Makes `keep` the permitted, inheritable and effective sets, then
    /// raises each as ambient: an exec'd non-root program has them.
    RaiseAmbient {
        keep: u64,
    },
    /// Installs the filter; `no_new_privs` is set before it.
    Seccomp(Vec<seccompiler::sock_filter>),
    /// `unshare(flags)`.
    Unshare(libc::c_int),
    /// Makes every mount a slave of the host's: the host's later mounts
    /// still appear, the namespace's own never leave it.
    MountsSlave,
    /// Sets `set` on every mount at and below `path` (`mount_setattr`,
    /// `AT_RECURSIVE`).
    MountAttr {
        path: CString,
        set: u64,
    },
    /// Binds `path` onto itself, so that it is a mount of its own.
    BindSelf(CString),
    /// `mkdir(path, 0755)`; one that exists is fine.
    MakeDir(CString),
    /// Creates an empty file unless one exists.
    MakeFile(CString),
    /// Attaches a mount prepared detached before the fork at `target`
    /// (`move_mount`).
    Attach {
        fd: RawFd,
        target: CString,
    },
    /// Makes the mount at `path` the root and lets go of the old one
    /// (`pivot_root(".", ".")` and a lazy unmount of what lies below, as
    /// runc does): nothing of the node's tree stays reachable. Where
    /// `pivot_root` is refused (the agent's own seccomp profile, such as
    /// containerd's RuntimeDefault, may not list it; an initramfs root
    /// cannot be pivoted), the mount is moved onto `/` and made the root
    /// by `chroot`, as systemd and runc fall back to: the node's mounts
    /// stay below it, out of reach of a process that may neither mount nor
    /// chroot.
    PivotRoot(CString),
}

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3`: two data structs, 64 capabilities.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// A raw system call's result as nix's.
fn checked(result: libc::c_long) -> nix::Result<()> {
    if result < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

impl ChildStep {
    fn run(&self) -> nix::Result<()> {
        match self {
            ChildStep::Dup2 { from, to } => {
                // SAFETY: dup2 on two descriptor numbers; the copy it makes
                // is not close-on-exec, which is what the exec is to get.
                if unsafe { libc::dup2(*from, *to) } < 0 {
                    return Err(Errno::last());
                }
                Ok(())
            }
            ChildStep::Setsid => nix::unistd::setsid().map(drop),
            ChildStep::NoNewPrivs => nix::sys::prctl::set_no_new_privs(),
            // Raw system calls, not libc's: libc applies an id change to
            // every thread it knows of, under a lock, and after a raw clone3
            // its thread list and that lock are the parent's copies (a lock
            // another parent thread held would never be released here). The
            // child has one thread, so the raw call is the whole change.
            ChildStep::Groups(gid) => {
                let groups = [gid.as_raw()];
                // SAFETY: one gid in a live array, and its length.
                checked(unsafe { libc::syscall(libc::SYS_setgroups, 1, groups.as_ptr()) })
            }
            // SAFETY: setgid and setuid take one id and touch no memory.
            ChildStep::Gid(gid) => {
                checked(unsafe { libc::syscall(libc::SYS_setgid, gid.as_raw()) })
            }
            // SAFETY: as above.
            ChildStep::Uid(uid) => {
                checked(unsafe { libc::syscall(libc::SYS_setuid, uid.as_raw()) })
            }
            ChildStep::Chdir(dir) => nix::unistd::chdir(dir.as_c_str()),
            ChildStep::Rlimit {
                resource,
                soft,
                hard,
            } => {
                let limit = libc::rlimit64 {
                    rlim_cur: *soft,
                    rlim_max: *hard,
                };
                // SAFETY: prlimit64 of this process (pid 0) reads one live
                // rlimit64 and writes nothing (the old-limit pointer is null).
                checked(unsafe {
                    libc::syscall(
                        libc::SYS_prlimit64,
                        0,
                        *resource,
                        std::ptr::from_ref(&limit),
                        std::ptr::null_mut::<libc::rlimit64>(),
                    )
                })
            }
            ChildStep::Umask(mask) => {
                // SAFETY: umask takes a mode and cannot fail.
                unsafe { libc::syscall(libc::SYS_umask, *mask) };
                Ok(())
            }
            ChildStep::DropBounding { keep, last } => {
                for capability in 0..=*last {
                    if keep & (1 << capability) != 0 {
                        continue;
                    }
                    // SAFETY: prctl with integer arguments only.
                    checked(unsafe {
                        libc::syscall(
                            libc::SYS_prctl,
                            libc::PR_CAPBSET_DROP,
                            libc::c_ulong::from(capability),
                            0,
                            0,
                            0,
                        )
                    })?;
                }
                // SAFETY: as above.
                checked(unsafe {
                    libc::syscall(
                        libc::SYS_prctl,
                        libc::PR_CAP_AMBIENT,
                        libc::PR_CAP_AMBIENT_CLEAR_ALL,
                        0,
                        0,
                        0,
                    )
                })
            }
            // SAFETY: prctl with integer arguments only.
            ChildStep::KeepCaps => checked(unsafe {
                libc::syscall(libc::SYS_prctl, libc::PR_SET_KEEPCAPS, 1, 0, 0, 0)
            }),
            ChildStep::RaiseAmbient { keep } => {
                let header = CapHeader {
                    version: CAPABILITY_VERSION_3,
                    pid: 0,
                };
                let half = |bits: u64| CapData {
                    effective: bits as u32,
                    permitted: bits as u32,
                    inheritable: bits as u32,
                };
                let data = [half(*keep), half(*keep >> 32)];
                // SAFETY: capset reads a live header and the two data
                // structs version 3 asks for.
                checked(unsafe {
                    libc::syscall(libc::SYS_capset, std::ptr::from_ref(&header), data.as_ptr())
                })?;
                for capability in 0..64u64 {
                    if keep & (1 << capability) == 0 {
                        continue;
                    }
                    // SAFETY: prctl with integer arguments only.
                    checked(unsafe {
                        libc::syscall(
                            libc::SYS_prctl,
                            libc::PR_CAP_AMBIENT,
                            libc::PR_CAP_AMBIENT_RAISE,
                            capability,
                            0,
                            0,
                        )
                    })?;
                }
                Ok(())
            }
            ChildStep::Seccomp(program) => {
                let filter = libc::sock_fprog {
                    len: program.len() as libc::c_ushort,
                    filter: program.as_ptr().cast_mut().cast::<libc::sock_filter>(),
                };
                // SAFETY: seccomp(SECCOMP_SET_MODE_FILTER) reads a live
                // sock_fprog whose instructions (seccompiler's sock_filter
                // has the kernel's layout) outlive the call.
                checked(unsafe {
                    libc::syscall(
                        libc::SYS_seccomp,
                        libc::SECCOMP_SET_MODE_FILTER,
                        0,
                        std::ptr::from_ref(&filter),
                    )
                })
            }
            // SAFETY: unshare takes flags only.
            ChildStep::Unshare(flags) => {
                checked(unsafe { libc::syscall(libc::SYS_unshare, *flags) })
            }
            // SAFETY: mount with a NUL-terminated target, null source,
            // type and data, which MS_REC|MS_SLAVE does not read.
            ChildStep::MountsSlave => checked(unsafe {
                libc::syscall(
                    libc::SYS_mount,
                    std::ptr::null::<libc::c_char>(),
                    c"/".as_ptr(),
                    std::ptr::null::<libc::c_char>(),
                    libc::MS_REC | libc::MS_SLAVE,
                    std::ptr::null::<libc::c_void>(),
                )
            }),
            ChildStep::MountAttr { path, set } => {
                let attr = libc::mount_attr {
                    attr_set: *set,
                    attr_clr: 0,
                    propagation: 0,
                    userns_fd: 0,
                };
                // SAFETY: mount_setattr reads a NUL-terminated path and
                // one live mount_attr of the size passed.
                checked(unsafe {
                    libc::syscall(
                        libc::SYS_mount_setattr,
                        libc::AT_FDCWD,
                        path.as_ptr(),
                        libc::AT_RECURSIVE,
                        std::ptr::from_ref(&attr),
                        std::mem::size_of::<libc::mount_attr>(),
                    )
                })
            }
            // SAFETY: mount reads two NUL-terminated paths; a bind reads
            // neither the type nor the data.
            ChildStep::BindSelf(path) => checked(unsafe {
                libc::syscall(
                    libc::SYS_mount,
                    path.as_ptr(),
                    path.as_ptr(),
                    std::ptr::null::<libc::c_char>(),
                    libc::MS_BIND | libc::MS_REC,
                    std::ptr::null::<libc::c_void>(),
                )
            }),
            ChildStep::MakeDir(path) => {
                // SAFETY: mkdir reads a NUL-terminated path.
                match checked(unsafe { libc::syscall(libc::SYS_mkdir, path.as_ptr(), 0o755) }) {
                    Err(Errno::EEXIST) => Ok(()),
                    other => other,
                }
            }
            ChildStep::MakeFile(path) => {
                // SAFETY: open reads a NUL-terminated path; the descriptor
                // it returns is closed at once.
                let fd = unsafe {
                    libc::syscall(
                        libc::SYS_openat,
                        libc::AT_FDCWD,
                        path.as_ptr(),
                        libc::O_CREAT | libc::O_RDONLY | libc::O_CLOEXEC,
                        0o644,
                    )
                };
                checked(fd)?;
                // SAFETY: close of the descriptor just opened.
                unsafe { libc::syscall(libc::SYS_close, fd) };
                Ok(())
            }
            // SAFETY: move_mount reads an empty source path and a
            // NUL-terminated target; the descriptor is the parent's copy
            // of a detached mount, alive until the child execs.
            ChildStep::Attach { fd, target } => checked(unsafe {
                libc::syscall(
                    libc::SYS_move_mount,
                    *fd,
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    target.as_ptr(),
                    libc::MOVE_MOUNT_F_EMPTY_PATH,
                )
            }),
            ChildStep::PivotRoot(path) => {
                // SAFETY: chdir reads a NUL-terminated path.
                checked(unsafe { libc::syscall(libc::SYS_chdir, path.as_ptr()) })?;
                // SAFETY: pivot_root reads two NUL-terminated paths.
                match checked(unsafe {
                    libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr())
                }) {
                    // SAFETY: umount2 reads a NUL-terminated path; the old
                    // root now lies on top of the new one at ".".
                    Ok(()) => checked(unsafe {
                        libc::syscall(libc::SYS_umount2, c".".as_ptr(), libc::MNT_DETACH)
                    })?,
                    Err(Errno::EPERM | Errno::EINVAL) => {
                        // SAFETY: mount reads two NUL-terminated paths; a
                        // move reads neither the type nor the data.
                        checked(unsafe {
                            libc::syscall(
                                libc::SYS_mount,
                                c".".as_ptr(),
                                c"/".as_ptr(),
                                std::ptr::null::<libc::c_char>(),
                                libc::MS_MOVE,
                                std::ptr::null::<libc::c_void>(),
                            )
                        })?;
                        // SAFETY: chroot reads a NUL-terminated path.
                        checked(unsafe { libc::syscall(libc::SYS_chroot, c".".as_ptr()) })?;
                    }
                    Err(other) => return Err(other),
                }
                // SAFETY: chdir reads a NUL-terminated path.
                checked(unsafe { libc::syscall(libc::SYS_chdir, c"/".as_ptr()) })
            }
        }
    }
}

/// A child to start: where, what it does first, and what it execs.
pub(crate) struct Launch {
    /// The cgroup directory it starts in.
    pub cgroup: PathBuf,
    /// Each step with the code the child reports if it fails.
    pub steps: Vec<(u8, ChildStep)>,
    pub image: ExecImage,
}

/// Why no child was started.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LaunchError {
    /// The cgroup directory (or, on the fallback, its `cgroup.procs`)
    /// could not be opened.
    #[error("cannot open {}: {source}", path.display())]
    OpenCgroup {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The kernel would not create the child in the cgroup (not a cgroup
    /// directory, removed, or one that cannot hold processes).
    #[error("the kernel would not create a process in {}: {source}", path.display())]
    Refused {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The status pipe, or the clone or fork itself.
    #[error("{0}")]
    Start(#[source] io::Error),
}

/// How a launch ended.
pub(crate) enum Launched {
    /// The exec succeeded.
    Running(Child),
    /// A step failed (its code; [`JOIN_CGROUP`] for the fallback's move);
    /// the child exited without exec. `None`: it said no errno.
    StepFailed { code: u8, errno: Option<Errno> },
    /// The exec failed.
    ExecFailed(Errno),
    /// The child ended before it reported anything (killed at once).
    Vanished,
}

/// A started child: its pid and, where the kernel gave one, its pidfd.
#[derive(Debug)]
pub(crate) struct Child {
    pub pid: u32,
    pub pidfd: Option<OwnedFd>,
}

impl Launch {
    /// Starts the child and waits for its report. An error means no child
    /// was made: nothing ran.
    pub(crate) fn start(&self) -> Result<Launched, LaunchError> {
        self.start_with(true)
    }

    /// [`start`](Self::start), trying `clone3` first only when `clone3`.
    fn start_with(&self, clone3: bool) -> Result<Launched, LaunchError> {
        let open_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source: io::Error| LaunchError::OpenCgroup { path, source }
        };
        let cgroup: OwnedFd = nix::fcntl::open(
            &self.cgroup,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| open_err(&self.cgroup)(errno.into()))?;
        let (status_read, status_low) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| LaunchError::Start(e.into()))?;
        // Above every descriptor a step writes to. No other write end may
        // stay open here, or the read below never sees end-of-file.
        let status_write = fd_at_least(&status_low, SETUP_FD_FLOOR).map_err(LaunchError::Start)?;
        drop(status_low);
        let cloned = if clone3 {
            self.clone_into_cgroup(cgroup.as_fd(), status_write.as_fd())
        } else {
            Err(Errno::ENOSYS)
        };
        let started = match cloned {
            Err(errno) if refused_clone3(errno) => {
                let procs_path = self.cgroup.join("cgroup.procs");
                let procs: OwnedFd = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&procs_path)
                    .map_err(open_err(&procs_path))?
                    .into();
                let procs = fd_at_least(&procs, SETUP_FD_FLOOR).map_err(LaunchError::Start)?;
                self.fork_and_join(status_write.as_fd(), procs.as_fd())
            }
            other => other,
        };
        // Only the child's copy may keep the pipe open now.
        drop(status_write);
        let child = started.map_err(|errno| match errno {
            Errno::EAGAIN | Errno::ENOMEM => LaunchError::Start(errno.into()),
            _ => LaunchError::Refused {
                path: self.cgroup.clone(),
                source: errno.into(),
            },
        })?;
        Ok(match read_report(&status_read) {
            Report::ExecNext => Launched::Running(child),
            failed => {
                reap_now(child.pid);
                match failed {
                    Report::ExecFailed(errno) => Launched::ExecFailed(errno),
                    Report::Step { code, errno } => Launched::StepFailed { code, errno },
                    Report::ExecNext | Report::Nothing => Launched::Vanished,
                }
            }
        })
    }

    fn clone_into_cgroup(
        &self,
        cgroup: BorrowedFd<'_>,
        status: BorrowedFd<'_>,
    ) -> Result<Child, Errno> {
        let mut pidfd: RawFd = -1;
        let args = CloneArgs {
            flags: CLONE_INTO_CGROUP | CLONE_PIDFD,
            pidfd: std::ptr::addr_of_mut!(pidfd) as u64,
            exit_signal: libc::SIGCHLD as u64,
            cgroup: u64::try_from(cgroup.as_raw_fd()).map_err(|_| Errno::EBADF)?,
            ..CloneArgs::default()
        };
        // SAFETY: clone3 without CLONE_VM is a fork: the child gets a copy
        // of this address space and runs on from here. `args` is a valid
        // clone_args of the size passed, alive for the call; the kernel
        // writes the pidfd into `pidfd`. In the child only `child_main`
        // runs, which makes async-signal-safe calls only and never returns.
        let pid = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                std::ptr::addr_of!(args),
                std::mem::size_of::<CloneArgs>(),
            )
        };
        match pid {
            0 => self.child_main(status, None),
            pid if pid < 0 => Err(Errno::last()),
            pid => {
                let pid = u32::try_from(pid).map_err(|_| Errno::EOVERFLOW)?;
                // SAFETY: CLONE_PIDFD made the kernel store a new descriptor
                // (close-on-exec) that nothing else owns.
                let pidfd = (pidfd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(pidfd) });
                Ok(Child { pid, pidfd })
            }
        }
    }

    fn fork_and_join(&self, status: BorrowedFd<'_>, procs: BorrowedFd<'_>) -> Result<Child, Errno> {
        // SAFETY: as for clone3 above: the child runs only `child_main`.
        match unsafe { nix::unistd::fork() }? {
            nix::unistd::ForkResult::Child => self.child_main(status, Some(procs)),
            nix::unistd::ForkResult::Parent { child } => {
                let pid = u32::try_from(child.as_raw()).map_err(|_| Errno::EOVERFLOW)?;
                Ok(Child {
                    pid,
                    pidfd: pidfd_open(pid).ok(),
                })
            }
        }
    }

    /// The child's whole life before the exec: async-signal-safe calls only
    /// (write, sigprocmask, signal, the steps' calls, execve, _exit), on
    /// values prepared before the fork; nothing allocates or locks.
    fn child_main(&self, status: BorrowedFd<'_>, procs: Option<BorrowedFd<'_>>) -> ! {
        let report = |bytes: &[u8]| {
            let _ = nix::unistd::write(status, bytes);
        };
        // What a new program expects of its signals: none blocked, and
        // SIGPIPE at its default (the agent ignores it).
        // SAFETY: an empty set and a null old-set pointer are valid
        // arguments; signal takes a signal number and a handler constant.
        unsafe {
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
        let failed = |code: u8, errno: Errno| -> ! {
            let [a, b, c, d] = (errno as i32).to_le_bytes();
            report(&[code, a, b, c, d]);
            exit_child(126)
        };
        if let Some(procs) = procs
            && let Err(errno) = nix::unistd::write(procs, b"0")
        {
            failed(JOIN_CGROUP, errno);
        }
        for procs in ALSO_JOINED.get().map(Vec::as_slice).unwrap_or_default() {
            if let Err(errno) = nix::unistd::write(procs, b"0") {
                failed(JOIN_V1_CGROUPS, errno);
            }
        }
        for (code, step) in &self.steps {
            if let Err(errno) = step.run() {
                failed(*code, errno);
            }
        }
        report(&[EXEC_NEXT]);
        let errno = self.image.exec() as i32;
        let [a, b, c, d] = errno.to_le_bytes();
        report(&[EXEC_FAILED, a, b, c, d]);
        exit_child(127)
    }
}

/// Descriptors the child's steps use are moved at least this high, so a
/// step that places descriptors at 0.. cannot overwrite them.
pub(crate) const SETUP_FD_FLOOR: RawFd = 100;

/// A close-on-exec copy of `fd` at `floor` or above.
pub(crate) fn fd_at_least(fd: &impl AsFd, floor: RawFd) -> io::Result<OwnedFd> {
    let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(floor))?;
    // SAFETY: fcntl just returned this new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// The kernel has no clone3, or no `CLONE_INTO_CGROUP` (a seccomp filter
/// answers ENOSYS or EPERM; kernels before 5.7 refuse the larger struct).
fn refused_clone3(errno: Errno) -> bool {
    matches!(
        errno,
        Errno::ENOSYS | Errno::E2BIG | Errno::EINVAL | Errno::EPERM
    )
}

fn exit_child(code: i32) -> ! {
    // SAFETY: _exit ends the child at once, without running the parent's
    // atexit handlers or flushing its buffers.
    unsafe { libc::_exit(code) }
}

/// What the child reported before its exec closed the pipe or it exited.
enum Report {
    /// Every step passed and the exec succeeded.
    ExecNext,
    ExecFailed(Errno),
    Step {
        code: u8,
        errno: Option<Errno>,
    },
    Nothing,
}

/// Reads the child's report to end-of-file.
fn read_report(status: &OwnedFd) -> Report {
    let mut bytes = [0u8; 6];
    let mut len = 0;
    while len < bytes.len() {
        match nix::unistd::read(status, &mut bytes[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    let errno_at = |at: usize| {
        (len >= at + 4).then(|| {
            Errno::from_raw(i32::from_le_bytes([
                bytes[at],
                bytes[at + 1],
                bytes[at + 2],
                bytes[at + 3],
            ]))
        })
    };
    match bytes[..len] {
        [] => Report::Nothing,
        [EXEC_NEXT] => Report::ExecNext,
        [EXEC_NEXT, EXEC_FAILED, ..] => {
            Report::ExecFailed(errno_at(2).unwrap_or(Errno::UnknownErrno))
        }
        [code, ..] => Report::Step {
            code,
            errno: errno_at(1),
        },
    }
}

/// Reaps a child that reported a failure: it exits right after.
fn reap_now(pid: u32) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    }
}

/// A descriptor for `pid` that stays bound to that process (never to a
/// later one reusing the number): pidfd_open(2).
pub(crate) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = nix::libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // (close-on-exec) or -1; no memory is passed.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned this descriptor and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    //! Real processes in a real cgroup v2 directory, started both ways.
    //! Skipped, with one line, where cgroup v2 cannot be written (not root).

    use std::time::{Duration, Instant};

    use super::*;

    /// A fresh cgroup under the mount, killed and removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Option<Scratch> {
            let mount = match crate::cgroup::discover_mount() {
                Ok(mount) => mount,
                Err(error) => {
                    eprintln!("skipped: no cgroup v2 mount: {error}");
                    return None;
                }
            };
            let dir = mount.join(format!("genswap-unit-{tag}-{}", std::process::id()));
            match std::fs::create_dir(&dir) {
                Ok(()) => Some(Scratch(dir)),
                Err(error) => {
                    eprintln!(
                        "skipped: cannot create a cgroup under {}: {error}",
                        mount.display()
                    );
                    None
                }
            }
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::write(self.0.join("cgroup.kill"), "1");
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::fs::remove_dir(&self.0).is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    fn sleeper(cgroup: &Path, steps: Vec<(u8, ChildStep)>) -> Launch {
        Launch {
            cgroup: cgroup.to_path_buf(),
            steps,
            image: ExecImage::named(Path::new("/bin/sleep"), None, &["30".into()], &[], None)
                .expect("image"),
        }
    }

    #[test]
    fn either_way_the_child_starts_inside_its_cgroup() {
        let Some(scratch) = Scratch::new("launch") else {
            return;
        };
        let name = scratch
            .0
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        for clone3 in [true, false] {
            let launched = sleeper(&scratch.0, Vec::new())
                .start_with(clone3)
                .expect("started");
            let Launched::Running(child) = launched else {
                panic!("clone3 {clone3}: not running");
            };
            let cgroup = std::fs::read_to_string(format!("/proc/{}/cgroup", child.pid))
                .expect("its /proc cgroup");
            let line = cgroup
                .lines()
                .find(|l| l.starts_with("0::"))
                .unwrap_or_default();
            let pid = nix::unistd::Pid::from_raw(i32::try_from(child.pid).expect("pid"));
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, None);
            assert!(
                line.ends_with(&format!("/{name}")),
                "clone3 {clone3}: {line}"
            );
        }
    }

    #[test]
    fn a_failed_step_is_reported_with_its_code_and_nothing_is_exec_d() {
        let Some(scratch) = Scratch::new("launch-step") else {
            return;
        };
        for clone3 in [true, false] {
            let bad_dir = CString::new("/nonexistent/genswap").expect("cstring");
            let launched = sleeper(&scratch.0, vec![(b'w', ChildStep::Chdir(bad_dir))])
                .start_with(clone3)
                .expect("a child was made");
            match launched {
                Launched::StepFailed { code, errno } => {
                    assert_eq!(code, b'w', "clone3 {clone3}");
                    assert_eq!(errno, Some(Errno::ENOENT), "clone3 {clone3}");
                }
                _ => panic!("clone3 {clone3}: the step did not fail"),
            }
        }
    }
}
