//! Listening sockets the agent binds for an instance and holds across its
//! generations (SPEC 6.2): bound once, as root, before the first generation
//! that asks for them; handed to every generation by socket activation
//! ([`crate::spawn::ActivatedSocket`]); closed when the instance is removed.
//! A socket that never closes between generations is what lets a hold drop
//! nothing: connections wait in its backlog while no generation runs.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use genswap_crds::ListenerSpec;
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, SockaddrIn, SockaddrIn6, UnixAddr, bind, listen,
    setsockopt, socket, sockopt,
};
use thiserror::Error;

use crate::gate::InstanceKey;
use crate::listener_keeper::KeeperSite;
use crate::spawn::ActivatedSocket;

/// Why a listener could not be held. Never the build's fault: nothing of
/// it ran, and the address is the host's to give.
#[derive(Debug, Error)]
pub enum ListenerError {
    #[error("listener {name}: {address:?} is not an IP address and port")]
    Address { name: String, address: String },
    #[error("listener {name} is named twice")]
    Duplicate { name: String },
    #[error("listener {name}: {path} exists and is not a socket; it is left alone")]
    NotASocket { name: String, path: PathBuf },
    #[error("listener {name}: cannot {op} {address}: {source}")]
    Socket {
        name: String,
        op: &'static str,
        address: String,
        #[source]
        source: io::Error,
    },
}

/// One held socket and the spec it was bound for.
#[derive(Debug)]
struct Held {
    spec: ListenerSpec,
    fd: Arc<OwnedFd>,
    /// Dropping it removes the unix listener's file: false for a second
    /// copy of a socket already held.
    owns_path: bool,
}

impl Drop for Held {
    fn drop(&mut self) {
        // The socket file of a unix listener goes with it.
        if let (true, Some(path)) = (self.owns_path, &self.spec.unix) {
            let _ = fs::remove_file(path);
        }
    }
}

/// Every instance's held listeners.
#[derive(Debug, Default)]
pub struct Listeners {
    held: Mutex<HashMap<InstanceKey, Vec<Held>>>,
    /// Where copies outlive the agent ([`crate::listener_keeper`]); none
    /// for tests of this registry alone.
    keeper: Option<KeeperSite>,
    /// One keeper change at a time, so a slower one never kills a newer
    /// keeper.
    keeper_turn: tokio::sync::Mutex<()>,
}

/// The most descriptors read from a keeper: more than an instance may have
/// listeners, so a keeper that holds a removed one is read whole.
const KEEPER_FDS_READ: i32 = 64;

impl Listeners {
    /// A registry whose held sockets a keeper process at `site` also holds.
    pub fn with_keeper(site: KeeperSite) -> Listeners {
        Listeners {
            keeper: Some(site),
            ..Listeners::default()
        }
    }

    /// Makes sure each of `specs` is held for `instance`, binding those
    /// that are not (the ones held with the same spec are kept as they
    /// are), and the keeper holds them too. On an error nothing new stays
    /// bound.
    pub async fn hold(
        &self,
        instance: &InstanceKey,
        specs: &[ListenerSpec],
    ) -> Result<(), ListenerError> {
        if self.bind(instance, specs)? {
            self.refresh_keeper(instance).await;
        }
        Ok(())
    }

    /// [`hold`](Self::hold) without the keeper: whether anything was bound.
    fn bind(&self, instance: &InstanceKey, specs: &[ListenerSpec]) -> Result<bool, ListenerError> {
        for (i, spec) in specs.iter().enumerate() {
            if specs[..i].iter().any(|other| other.name == spec.name) {
                return Err(ListenerError::Duplicate {
                    name: spec.name.clone(),
                });
            }
        }
        let mut held = self.lock();
        let have = held.entry(instance.clone()).or_default();
        let mut bound = Vec::new();
        for spec in specs {
            if !have.iter().any(|h| h.spec == *spec) {
                bound.push(Held {
                    fd: Arc::new(bind_listener(spec)?),
                    spec: spec.clone(),
                    owns_path: true,
                });
            }
        }
        let changed = !bound.is_empty();
        have.extend(bound);
        Ok(changed)
    }

    /// The sockets `specs` name, in their order, for a generation's spawn.
    /// Each must have been [held](Self::hold).
    pub fn activated(
        &self,
        instance: &InstanceKey,
        specs: &[ListenerSpec],
    ) -> Vec<ActivatedSocket> {
        let held = self.lock();
        let Some(have) = held.get(instance) else {
            return Vec::new();
        };
        specs
            .iter()
            .filter_map(|spec| {
                have.iter()
                    .find(|h| h.spec == *spec)
                    .map(|h| ActivatedSocket {
                        name: spec.name.clone(),
                        fd: Arc::clone(&h.fd),
                    })
            })
            .collect()
    }

    /// Closes the listeners of `instance` that `specs` no longer names
    /// (after a release that changed them is done).
    pub async fn keep_only(&self, instance: &InstanceKey, specs: &[ListenerSpec]) {
        let closed = self.lock().get_mut(instance).is_some_and(|have| {
            let before = have.len();
            have.retain(|h| specs.contains(&h.spec));
            have.len() != before
        });
        if closed {
            self.refresh_keeper(instance).await;
        }
    }

    /// After an agent restart: takes back from the serving generation `pid`
    /// the sockets `specs` handed it at fds 3.. (`pidfd_getfd(2)`, which
    /// needs ptrace rights over it: root with CAP_SYS_PTRACE), each checked
    /// to be a listening socket on its spec's address. Returns why each one
    /// that could not be taken back could not; the next attempt binds those
    /// anew.
    pub fn take_back(
        &self,
        instance: &InstanceKey,
        pid: u32,
        specs: &[ListenerSpec],
    ) -> Vec<String> {
        if specs.is_empty() {
            return Vec::new();
        }
        let pidfd = match crate::launch::pidfd_open(pid) {
            Ok(pidfd) => pidfd,
            Err(error) => return vec![format!("cannot open a pidfd of {pid}: {error}")],
        };
        let mut problems = Vec::new();
        let mut taken = Vec::new();
        for (fd, spec) in (3..).zip(specs) {
            match take_fd(&pidfd, fd).and_then(|owned| check_is(&owned, spec).map(|()| owned)) {
                Ok(owned) => taken.push(Held {
                    spec: spec.clone(),
                    fd: Arc::new(owned),
                    owns_path: true,
                }),
                Err(why) => {
                    problems.push(format!("listener {} (fd {fd} of {pid}): {why}", spec.name))
                }
            }
        }
        self.adopt(instance, taken);
        problems
    }

    /// After an agent restart: takes back from `instance`'s keepers each
    /// of `specs` one of them holds, in any order; the sockets a keeper
    /// holds that no spec names are left to it (it is replaced next).
    /// Returns why each of `specs` that is still not held is not.
    pub fn take_back_from_keeper(
        &self,
        instance: &InstanceKey,
        specs: &[ListenerSpec],
    ) -> Vec<String> {
        let Some(site) = &self.keeper else {
            return Vec::new();
        };
        let mut taken: Vec<Held> = Vec::new();
        for pid in site.pids(instance) {
            let Ok(pidfd) = crate::launch::pidfd_open(pid) else {
                continue;
            };
            for fd in 3..3 + KEEPER_FDS_READ {
                let Ok(owned) = take_fd(&pidfd, fd) else {
                    continue;
                };
                let named = specs.iter().find(|spec| {
                    !taken.iter().any(|t| t.spec == **spec) && check_is(&owned, spec).is_ok()
                });
                if let Some(spec) = named {
                    taken.push(Held {
                        spec: spec.clone(),
                        fd: Arc::new(owned),
                        owns_path: true,
                    });
                }
            }
        }
        self.adopt(instance, taken);
        let held = self.lock();
        let have = held.get(instance).map(Vec::as_slice).unwrap_or_default();
        specs
            .iter()
            .filter(|spec| !have.iter().any(|h| h.spec == **spec))
            .map(|spec| {
                format!(
                    "listener {}: neither the keeper nor the serving generation holds it",
                    spec.name
                )
            })
            .collect()
    }

    /// Makes `instance`'s keeper hold exactly what is held for it now: a
    /// new keeper replaces the old one, or, with nothing held, the old one
    /// is stopped. A keeper that cannot start is logged, not fatal: the
    /// listeners work, they just close if the agent dies between
    /// generations.
    pub async fn refresh_keeper(&self, instance: &InstanceKey) {
        let Some(site) = &self.keeper else {
            return;
        };
        let _turn = self.keeper_turn.lock().await;
        let sockets = self.all_activated(instance);
        if let Err(error) = site.replace(instance, sockets).await {
            tracing::warn!(instance = %instance, %error, "the listeners have no keeper: they close if the agent dies while no generation holds them");
        }
    }

    /// Stops the keepers of instances nothing is held for (after recovery:
    /// of instances that are gone).
    pub async fn stop_stale_keepers(&self) {
        let Some(site) = &self.keeper else {
            return;
        };
        let _turn = self.keeper_turn.lock().await;
        let live: Vec<String> = self
            .lock()
            .iter()
            .filter(|(_, have)| !have.is_empty())
            .map(|(key, _)| crate::disk_name::DiskName::of(key).as_str().to_owned())
            .collect();
        for name in site.disk_names() {
            if !live.contains(&name)
                && let Err(error) = site.stop_named(&name).await
            {
                tracing::warn!(keeper = %name, %error, "a stale listener keeper could not be stopped");
            }
        }
    }

    /// Every socket held for `instance`, in the order held.
    fn all_activated(&self, instance: &InstanceKey) -> Vec<ActivatedSocket> {
        self.lock()
            .get(instance)
            .map(|have| {
                have.iter()
                    .map(|h| ActivatedSocket {
                        name: h.spec.name.clone(),
                        fd: Arc::clone(&h.fd),
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Adds what was taken back to what is held for `instance`.
    fn adopt(&self, instance: &InstanceKey, taken: Vec<Held>) {
        let mut held = self.lock();
        let have = held.entry(instance.clone()).or_default();
        // One already held stays; dropping either copy of a unix listener
        // would unlink the file both name.
        for mut one in taken {
            if have.iter().any(|h| h.spec == one.spec) {
                one.owns_path = false;
            } else {
                have.push(one);
            }
        }
    }

    /// Closes every listener of `instance` (it is removed), the keeper's
    /// copies too.
    pub async fn release(&self, instance: &InstanceKey) {
        let had = self.lock().remove(instance).is_some();
        if had
            || self
                .keeper
                .as_ref()
                .is_some_and(|s| s.cgroup(instance).exists())
        {
            self.refresh_keeper(instance).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<InstanceKey, Vec<Held>>> {
        // A poisoned lock guards a map a panicking thread left whole.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Binds and listens on what `spec` names.
fn bind_listener(spec: &ListenerSpec) -> Result<OwnedFd, ListenerError> {
    let backlog = Backlog::new(spec.backlog.clamp(1, 65535)).unwrap_or(Backlog::MAXCONN);
    let fail = |op: &'static str, address: &str| {
        let name = spec.name.clone();
        let address = address.to_owned();
        move |errno: nix::Error| ListenerError::Socket {
            name,
            op,
            address,
            source: io::Error::from(errno),
        }
    };
    if let Some(address) = &spec.tcp {
        let parsed: SocketAddr = address.parse().map_err(|_| ListenerError::Address {
            name: spec.name.clone(),
            address: address.clone(),
        })?;
        let family = match parsed {
            SocketAddr::V4(_) => AddressFamily::Inet,
            SocketAddr::V6(_) => AddressFamily::Inet6,
        };
        let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
            .map_err(fail("create a socket for", address))?;
        // A restarted agent rebinds a port its predecessor's connections
        // still linger on.
        setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(fail("set SO_REUSEADDR on", address))?;
        match parsed {
            SocketAddr::V4(v4) => bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(v4)),
            SocketAddr::V6(v6) => {
                bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn6::from(v6))
            }
        }
        .map_err(fail("bind", address))?;
        listen(&fd, backlog).map_err(fail("listen on", address))?;
        return Ok(fd);
    }
    let path = spec.unix.as_deref().unwrap_or_default();
    remove_stale_socket(&spec.name, Path::new(path))?;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(fail("create a socket for", path))?;
    let address = UnixAddr::new(path).map_err(fail("name", path))?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &address).map_err(fail("bind", path))?;
    // Anyone may connect, as systemd's SocketMode default: the instance
    // decides what to serve, and the directory what to reach.
    fs::set_permissions(path, fs::Permissions::from_mode(0o666)).map_err(|source| {
        ListenerError::Socket {
            name: spec.name.clone(),
            op: "open up",
            address: path.to_owned(),
            source,
        }
    })?;
    listen(&fd, backlog).map_err(fail("listen on", path))?;
    Ok(fd)
}

/// A copy of `fd` of the process `pidfd` refers to.
fn take_fd(pidfd: &OwnedFd, fd: i32) -> Result<OwnedFd, String> {
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number of that
    // process and flags, and returns a new descriptor (close-on-exec) that
    // nothing else owns, or -1.
    let raw = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_pidfd_getfd,
            std::os::fd::AsRawFd::as_raw_fd(pidfd),
            fd,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error().to_string());
    }
    let raw = i32::try_from(raw).map_err(|_| "an impossible descriptor".to_string())?;
    // SAFETY: the syscall just returned this descriptor; it is ours alone.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) })
}

/// Whether `fd` is a listening socket on what `spec` names.
fn check_is(fd: &OwnedFd, spec: &ListenerSpec) -> Result<(), String> {
    let listening =
        nix::sys::socket::getsockopt(fd, sockopt::AcceptConn).map_err(|e| e.to_string())?;
    if !listening {
        return Err("not a listening socket".into());
    }
    let local: nix::sys::socket::SockaddrStorage =
        nix::sys::socket::getsockname(std::os::fd::AsRawFd::as_raw_fd(fd))
            .map_err(|e| e.to_string())?;
    let matches = match (&spec.tcp, &spec.unix) {
        (Some(address), _) => {
            let want: Option<SocketAddr> = address.parse().ok();
            let have = local
                .as_sockaddr_in()
                .map(|a| SocketAddr::from(std::net::SocketAddrV4::from(*a)))
                .or_else(|| {
                    local
                        .as_sockaddr_in6()
                        .map(|a| SocketAddr::from(std::net::SocketAddrV6::from(*a)))
                });
            want.is_some() && want == have
        }
        (None, Some(path)) => local
            .as_unix_addr()
            .and_then(UnixAddr::path)
            .is_some_and(|p| p == Path::new(path)),
        (None, None) => false,
    };
    if matches {
        Ok(())
    } else {
        Err(format!("it listens on {local}, not on what the spec names"))
    }
}

/// A socket file left at `path` (by an agent that was killed) is removed;
/// anything else there is refused.
fn remove_stale_socket(name: &str, path: &Path) -> Result<(), ListenerError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            fs::remove_file(path).map_err(|source| ListenerError::Socket {
                name: name.to_owned(),
                op: "remove the stale",
                address: path.display().to_string(),
                source,
            })
        }
        Ok(_) => Err(ListenerError::NotASocket {
            name: name.to_owned(),
            path: path.to_path_buf(),
        }),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> InstanceKey {
        InstanceKey::new("default", "app").expect("key")
    }

    fn tcp(name: &str, address: &str) -> ListenerSpec {
        ListenerSpec {
            name: name.into(),
            tcp: Some(address.into()),
            unix: None,
            backlog: 16,
        }
    }

    #[tokio::test]
    async fn a_held_listener_is_kept_until_released_and_accepts_meanwhile() {
        let listeners = Listeners::default();
        let spec = tcp("web", "127.0.0.1:0");
        listeners
            .hold(&key(), std::slice::from_ref(&spec))
            .await
            .expect("bound");
        let first = listeners.activated(&key(), std::slice::from_ref(&spec));
        listeners
            .hold(&key(), std::slice::from_ref(&spec))
            .await
            .expect("already held");
        let again = listeners.activated(&key(), std::slice::from_ref(&spec));
        assert_eq!(first.len(), 1);
        assert!(Arc::ptr_eq(&first[0].fd, &again[0].fd), "the same socket");
        let address: SockaddrIn =
            nix::sys::socket::getsockname(std::os::fd::AsRawFd::as_raw_fd(first[0].fd.as_ref()))
                .expect("bound address");
        // Nothing accepts, yet a client connects: it waits in the backlog.
        let mut client = std::net::TcpStream::connect(("127.0.0.1", address.port()))
            .expect("queued in the backlog");
        let held = Arc::downgrade(&first[0].fd);
        listeners.release(&key()).await;
        drop((first, again));
        assert!(
            held.upgrade().is_none(),
            "nothing holds the socket any more"
        );
        // Closing a listener resets the connections still in its queue. A
        // fresh connect would prove less: once the port is free, a parallel
        // test may bind it, or the connect may pick it as its own source.
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .expect("read timeout");
        let read = std::io::Read::read(&mut client, &mut [0u8; 1]);
        assert!(
            matches!(&read, Ok(0))
                || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "the queued connection outlived the listener: {read:?}"
        );
    }

    #[tokio::test]
    async fn a_unix_listener_replaces_a_stale_socket_and_refuses_anything_else() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("app.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("a stale socket"));
        let spec = ListenerSpec {
            name: "local".into(),
            tcp: None,
            unix: Some(path.display().to_string()),
            backlog: 8,
        };
        let listeners = Listeners::default();
        listeners
            .hold(&key(), std::slice::from_ref(&spec))
            .await
            .expect("stale socket replaced");
        std::os::unix::net::UnixStream::connect(&path).expect("connects");
        listeners.release(&key()).await;
        assert!(!path.exists(), "its file goes with it");

        fs::write(&path, b"data").expect("a file");
        let error = Listeners::default()
            .hold(&key(), &[spec])
            .await
            .expect_err("not a socket");
        assert!(matches!(error, ListenerError::NotASocket { .. }), "{error}");
        assert!(path.exists());
    }

    #[tokio::test]
    async fn a_taken_port_and_a_duplicate_name_are_refused() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bound");
        let address = taken.local_addr().expect("address").to_string();
        let error = Listeners::default()
            .hold(&key(), &[tcp("web", &address)])
            .await
            .expect_err("in use");
        assert!(error.to_string().contains("cannot bind"), "{error}");
        let error = Listeners::default()
            .hold(
                &key(),
                &[tcp("web", "127.0.0.1:0"), tcp("web", "127.0.0.1:0")],
            )
            .await
            .expect_err("twice");
        assert!(matches!(error, ListenerError::Duplicate { .. }));
    }
}
