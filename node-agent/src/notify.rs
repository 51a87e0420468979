//! systemd's notify protocol (`sd_notify(3)`) for one generation: the
//! `notify` health probe (SPEC 5.12).
//!
//! Each generation gets its own datagram socket, `gen-<N>.notify` in the
//! instance's run dir, named by `NOTIFY_SOCKET`. The kernel attaches the
//! sender's credentials to every message (`SO_PASSCRED`), and a message
//! counts only when that pid is in the generation's cgroup subtree: another
//! generation, a command of the agent's or any other process on the host
//! cannot declare it ready. `READY=1` makes it healthy; `STATUS=` is kept
//! for the reason while it waits; `WATCHDOG=1` pings are counted.
//!
//! A sender that exits before its message is read cannot be placed (its
//! `/proc` entry is gone) and is ignored, as systemd's `NotifyAccess=main`
//! would: a daemon says `READY=1` from its own long-lived process.

use std::fs;
use std::io::{self, IoSliceMut};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg, setsockopt, sockopt};
use tokio::io::Interest;
use tokio::net::UnixDatagram;
use tokio::sync::watch;

use crate::cgroup::Cgroup;
use crate::observation::Observation;

/// The variable that names the socket.
pub const ENV_NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";
/// The watchdog's interval, in microseconds, as `sd_watchdog_enabled(3)`
/// reads it.
pub const ENV_WATCHDOG_USEC: &str = "WATCHDOG_USEC";

/// What a generation has said so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NotifyState {
    /// `READY=1` arrived.
    pub ready: bool,
    /// The last `STATUS=`.
    pub status: Option<String>,
    /// `WATCHDOG=1` pings.
    pub watchdog_pings: u64,
    /// Messages from processes outside the generation's cgroup.
    pub ignored: u64,
}

/// A generation's notify socket and what arrived on it. Clones share it;
/// the last one dropped stops the reader and removes the socket file.
#[derive(Clone, Debug)]
pub struct NotifyWatch {
    inner: Arc<Inner>,
    state: watch::Receiver<NotifyState>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.reader.abort();
        let _ = fs::remove_file(&self.path);
    }
}

impl NotifyWatch {
    /// Binds `path` (replacing a stale socket there) for the generation in
    /// `cgroup`, writable by `owner` (uid, gid) when given. Must be called
    /// inside a tokio runtime.
    pub fn bind(
        path: &Path,
        cgroup: &Cgroup,
        owner: (Option<u32>, Option<u32>),
    ) -> io::Result<NotifyWatch> {
        let member_of = cgroup
            .proc_path()
            .ok_or_else(|| {
                io::Error::other(format!(
                    "the cgroup {} is not known by its /proc name, so senders cannot be checked",
                    cgroup.path().display()
                ))
            })?
            .to_string();
        match fs::symlink_metadata(path) {
            Ok(meta) if std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) => {
                fs::remove_file(path)?;
            }
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        let socket = UnixDatagram::bind(path)?;
        setsockopt(&socket, sockopt::PassCred, &true).map_err(io::Error::from)?;
        if owner.0.is_some() || owner.1.is_some() {
            std::os::unix::fs::chown(path, owner.0, owner.1)?;
        }
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
        let (publish, state) = watch::channel(NotifyState::default());
        let reader = tokio::spawn(read_messages(socket, member_of, publish));
        Ok(NotifyWatch {
            inner: Arc::new(Inner {
                path: path.to_path_buf(),
                reader,
            }),
            state,
        })
    }

    /// The socket's path, for `NOTIFY_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// What has arrived so far.
    pub fn state(&self) -> NotifyState {
        self.state.borrow().clone()
    }

    /// Resolves once `READY=1` has arrived, or after `limit` with the last
    /// `STATUS=`.
    pub async fn ready_within(&self, limit: Duration) -> Result<(), Observation> {
        let mut state = self.state.clone();
        let ready = tokio::time::timeout(limit, state.wait_for(|s| s.ready)).await;
        match ready {
            Ok(Ok(_)) => Ok(()),
            _ => Err(Observation::NotReady(self.state.borrow().status.clone())),
        }
    }

    /// Resolves with the count of `WATCHDOG=1` pings once it is above
    /// `after`, or after `limit` with the last `STATUS=`.
    pub async fn pinged_after(&self, after: u64, limit: Duration) -> Result<u64, Observation> {
        let mut state = self.state.clone();
        let pinged =
            tokio::time::timeout(limit, state.wait_for(|s| s.watchdog_pings > after)).await;
        match pinged {
            Ok(Ok(state)) => Ok(state.watchdog_pings),
            _ => Err(Observation::NoWatchdog(self.state.borrow().status.clone())),
        }
    }
}

async fn read_messages(
    socket: UnixDatagram,
    member_of: String,
    publish: watch::Sender<NotifyState>,
) {
    let mut buffer = vec![0u8; 4096];
    loop {
        let received = socket
            .async_io(Interest::READABLE, || receive(&socket, &mut buffer))
            .await;
        let (len, pid) = match received {
            Ok(message) => message,
            Err(error) => {
                tracing::warn!(%error, "a notify socket cannot be read; it is no longer watched");
                return;
            }
        };
        let from_generation = pid.is_some_and(|pid| in_subtree(pid, &member_of));
        let text = String::from_utf8_lossy(&buffer[..len]).into_owned();
        publish.send_modify(|state| {
            if !from_generation {
                state.ignored += 1;
                return;
            }
            apply(state, &text);
        });
    }
}

/// One datagram: its length and the sender's pid.
fn receive(socket: &UnixDatagram, buffer: &mut [u8]) -> io::Result<(usize, Option<i32>)> {
    let mut space = nix::cmsg_space!(nix::sys::socket::UnixCredentials);
    let mut iov = [IoSliceMut::new(buffer)];
    let message = recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let mut pid = None;
    if let Ok(cmsgs) = message.cmsgs() {
        for cmsg in cmsgs {
            if let ControlMessageOwned::ScmCredentials(credentials) = cmsg {
                pid = Some(credentials.pid());
            }
        }
    }
    Ok((message.bytes, pid))
}

/// Whether `pid` is in the cgroup `/proc` names `member_of`, or below it.
fn in_subtree(pid: i32, member_of: &str) -> bool {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return false;
    };
    text.lines()
        .filter_map(|line| line.strip_prefix("0::"))
        .any(|path| {
            path == member_of
                || path
                    .strip_prefix(member_of)
                    .is_some_and(|rest| rest.starts_with('/'))
        })
}

/// `sd_notify`'s newline-separated assignments.
fn apply(state: &mut NotifyState, text: &str) {
    for line in text.lines() {
        match line.split_once('=') {
            Some(("READY", "1")) => state.ready = true,
            Some(("STATUS", status)) => state.status = Some(status.to_string()),
            Some(("WATCHDOG", "1")) => state.watchdog_pings += 1,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignments_are_read_line_by_line() {
        let mut state = NotifyState::default();
        apply(&mut state, "STATUS=loading 1/3\nWATCHDOG=1");
        assert_eq!(state.status.as_deref(), Some("loading 1/3"));
        assert!(!state.ready);
        apply(&mut state, "READY=1\nSTATUS=serving\nMAINPID=42\nX");
        assert!(state.ready);
        assert_eq!(state.status.as_deref(), Some("serving"));
        assert_eq!(state.watchdog_pings, 1);
        apply(&mut state, "READY=0");
        assert!(state.ready, "once ready, a generation stays proven ready");
    }

    #[test]
    fn the_agent_itself_is_not_in_a_generation_cgroup() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(!in_subtree(me, "/genswap/no-such/gen-1"));
        assert!(!in_subtree(i32::MAX, "/"));
    }
}
