//! Listening sockets the agent binds for an instance and holds across its
//! generations (SPEC 6.2): bound once, as root, before the first generation
//! that asks for them; handed to every generation by socket activation
//! ([`crate::spawn::ActivatedSocket`]); closed when the instance is removed.
//! A socket that never closes between generations is what lets a hold drop
//! nothing: connections wait in its backlog while no generation runs.
//!
//! Where the kernel allows it, a TCP listener is steered (SPEC 6.3,
//! [`crate::steering`]): a generation started beside the serving one gets
//! a socket of its own in the same `SO_REUSEPORT` group, which receives no
//! connection until [`Listeners::switch_to`] makes it the serving socket.
//! Otherwise, and for unix listeners, every generation shares one socket.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use genswap_crds::ListenerSpec;
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, SockaddrIn, SockaddrIn6, SockaddrStorage, UnixAddr,
    bind, connect, getsockname, listen, setsockopt, socket, sockopt,
};
use thiserror::Error;

use crate::gate::InstanceKey;
use crate::listener_keeper::KeeperSite;
use crate::spawn::ActivatedSocket;
use crate::steering::{Handover, ProbeRoute, SERVING_SLOT, SteerError, Steering, StoredMaps};

/// The sockets map's slot of a generation started beside the serving one:
/// an instance has one such generation at a time.
const BESIDE_SLOT: u32 = 1;
/// The keeper's names of a steered listener's maps: `<name>+socks`,
/// `<name>+probes` in its `LISTEN_FDNAMES` (a listener name has no `+`).
const SOCKETS_MAP_SUFFIX: &str = "+socks";
const PROBES_MAP_SUFFIX: &str = "+probes";
/// How long a fresh steering waits for the maps of a program it replaced
/// to be freed (the kernel frees them in the background).
const OLD_MAPS_FREED: std::time::Duration = std::time::Duration::from_secs(2);

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
    #[error("listener {name}: {source}")]
    Steer {
        name: String,
        #[source]
        source: SteerError,
    },
}

/// One held socket and the spec it was bound for.
#[derive(Debug)]
struct Held {
    spec: ListenerSpec,
    /// The serving generation's socket; every generation's when shared.
    fd: Arc<OwnedFd>,
    /// Dropping it removes the unix listener's file: false for a second
    /// copy of a socket already held.
    owns_path: bool,
    /// The program and maps that pick the serving socket, when steered.
    steering: Option<Arc<Steering>>,
    /// The socket of a generation started beside the serving one.
    beside: Option<Beside>,
}

/// A steered listener's socket for a generation not serving yet.
#[derive(Debug)]
struct Beside {
    generation: u64,
    fd: Arc<OwnedFd>,
}

impl Held {
    fn new(spec: ListenerSpec, fd: OwnedFd, steering: Option<Steering>) -> Held {
        Held {
            spec,
            fd: Arc::new(fd),
            owns_path: true,
            steering: steering.map(Arc::new),
            beside: None,
        }
    }

    fn handover(&self) -> Handover {
        if self.steering.is_some() {
            Handover::Steered
        } else {
            Handover::Shared
        }
    }
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
#[derive(Debug)]
pub struct Listeners {
    held: Mutex<HashMap<InstanceKey, Vec<Held>>>,
    /// Whether TCP listeners are to be steered where the kernel allows it.
    wanted: Handover,
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

impl Default for Listeners {
    fn default() -> Self {
        Listeners {
            held: Mutex::default(),
            wanted: Handover::Steered,
            keeper: None,
            keeper_turn: tokio::sync::Mutex::default(),
        }
    }
}

impl Listeners {
    /// A registry whose held sockets a keeper process at `site` also holds.
    pub fn with_keeper(site: KeeperSite) -> Listeners {
        Listeners {
            keeper: Some(site),
            ..Listeners::default()
        }
    }

    /// The same registry, steering TCP listeners only if `wanted` says so
    /// (`shared`: never, whatever the kernel allows).
    pub fn handover(mut self, wanted: Handover) -> Listeners {
        self.wanted = wanted;
        self
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
                bound.push(self.bind_one(spec)?);
            }
        }
        let changed = !bound.is_empty();
        have.extend(bound);
        Ok(changed)
    }

    /// Binds `spec`, steered when wanted and the kernel allows it; shared
    /// otherwise, and then the log says why.
    fn bind_one(&self, spec: &ListenerSpec) -> Result<Held, ListenerError> {
        let steering = match (self.wanted, spec.ip_address()) {
            (Handover::Steered, Some(_)) => match Steering::load() {
                Ok(steering) => Some(steering),
                Err(error) => {
                    tracing::warn!(listener = %spec.name, %error, "listener handover: shared (a successor may accept connections before its health check ends)");
                    None
                }
            },
            _ => None,
        };
        let Some(steering) = steering else {
            return Ok(Held::new(spec.clone(), bind_listener(spec, false)?, None));
        };
        let fd = bind_listener(spec, true)?;
        match steer_serving(&steering, &fd) {
            Ok(()) => Ok(Held::new(spec.clone(), fd, Some(steering))),
            Err(error) => {
                tracing::warn!(listener = %spec.name, %error, "listener handover: shared (a successor may accept connections before its health check ends)");
                // Bound again without SO_REUSEPORT: a group nothing steers
                // would let another process of the same user bind the port
                // and take a share of its connections.
                drop(fd);
                Ok(Held::new(spec.clone(), bind_listener(spec, false)?, None))
            }
        }
    }

    /// How new connections of `instance`'s listeners in `specs` reach its
    /// generations: steered only if every TCP and UDP one is (a unix one
    /// is always shared); `None` without listeners.
    pub fn handover_of(&self, instance: &InstanceKey, specs: &[ListenerSpec]) -> Option<Handover> {
        if specs.is_empty() {
            return None;
        }
        let held = self.lock();
        let have = held.get(instance)?;
        let ip: Vec<&Held> = have
            .iter()
            .filter(|h| h.spec.ip_address().is_some() && specs.contains(&h.spec))
            .collect();
        if !ip.is_empty() && ip.iter().all(|h| h.handover() == Handover::Steered) {
            Some(Handover::Steered)
        } else {
            Some(Handover::Shared)
        }
    }

    /// The sockets `specs` name for generation `generation`, started while
    /// another serves: a steered listener's is a new socket in its group
    /// that receives nothing until [`switch_to`](Self::switch_to); a shared
    /// one's is the serving socket.
    pub fn activated_beside(
        &self,
        instance: &InstanceKey,
        specs: &[ListenerSpec],
        generation: u64,
    ) -> Result<Vec<ActivatedSocket>, ListenerError> {
        let mut held = self.lock();
        let Some(have) = held.get_mut(instance) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for spec in specs {
            let Some(h) = have.iter_mut().find(|h| h.spec == *spec) else {
                continue;
            };
            let fd = match &h.steering {
                Some(steering) => {
                    let fd = Arc::new(bind_listener(spec, true)?);
                    steering.place(BESIDE_SLOT, fd.as_fd()).map_err(|source| {
                        ListenerError::Steer {
                            name: spec.name.clone(),
                            source,
                        }
                    })?;
                    h.beside = Some(Beside {
                        generation,
                        fd: Arc::clone(&fd),
                    });
                    fd
                }
                None => Arc::clone(&h.fd),
            };
            out.push(ActivatedSocket {
                name: spec.name.clone(),
                fd,
            });
        }
        Ok(out)
    }

    /// The switch of `instance`'s steered listeners to `generation`'s
    /// sockets: each one map update. Either every listener switches or,
    /// on an error, each is put back and nothing did. The serving sockets
    /// they replace are let go: the retiring generation keeps its own
    /// copies until it exits, and then its queued connections move to the
    /// serving socket ([`Steering::migrates`]).
    pub async fn switch_to(
        &self,
        instance: &InstanceKey,
        generation: u64,
    ) -> Result<(), ListenerError> {
        let switched = {
            let mut held = self.lock();
            let Some(have) = held.get_mut(instance) else {
                return Ok(());
            };
            switch_all(have, generation)?
        };
        if switched {
            self.refresh_keeper(instance).await;
        }
        Ok(())
    }

    /// How the agent's probes reach `generation`, started beside the
    /// serving one, through each steered listener: by listener name.
    pub fn probe_routes(
        &self,
        instance: &InstanceKey,
        generation: u64,
    ) -> std::collections::BTreeMap<String, ProbeRoute> {
        let held = self.lock();
        held.get(instance)
            .into_iter()
            .flatten()
            .filter_map(|h| {
                let steering = h.steering.as_ref()?;
                let beside = h.beside.as_ref()?;
                (beside.generation == generation).then(|| {
                    (
                        h.spec.name.clone(),
                        ProbeRoute::new(Arc::clone(steering), BESIDE_SLOT),
                    )
                })
            })
            .collect()
    }

    /// Lets go of the sockets of generations started beside the serving
    /// one that did not become it (their generation failed or was
    /// stopped); what was queued on them was only the agent's own.
    pub fn forget_beside(&self, instance: &InstanceKey) {
        let mut held = self.lock();
        for h in held.get_mut(instance).into_iter().flatten() {
            let Some(beside) = h.beside.take() else {
                continue;
            };
            if let Some(steering) = &h.steering
                && let Err(error) = steering.clear(BESIDE_SLOT)
            {
                tracing::warn!(listener = %h.spec.name, %error, "a failed generation's socket is left in the steering map");
            }
            stop_matching_datagrams(&h.spec, &beside.fd);
        }
    }

    /// The kernel's drop counts of every UDP listener's sockets (serving,
    /// and beside it during an overlap), from `/proc/net/udp` and `udp6`.
    pub fn datagram_drops(&self) -> Vec<crate::metrics::DatagramDrops> {
        let mut drops_by_inode = HashMap::new();
        for table in ["/proc/net/udp", "/proc/net/udp6"] {
            for line in fs::read_to_string(table)
                .unwrap_or_default()
                .lines()
                .skip(1)
            {
                let fields: Vec<&str> = line.split_whitespace().collect();
                if let (Some(inode), Some(drops)) = (
                    fields.get(9).and_then(|f| f.parse::<u64>().ok()),
                    fields.last().and_then(|f| f.parse::<u64>().ok()),
                ) {
                    drops_by_inode.insert(inode, drops);
                }
            }
        }
        let held = self.lock();
        let mut out = Vec::new();
        for (key, have) in held.iter() {
            for h in have.iter().filter(|h| h.spec.udp.is_some()) {
                let sockets = std::iter::once(&h.fd).chain(h.beside.as_ref().map(|b| &b.fd));
                for fd in sockets {
                    let Ok(stat) = nix::sys::stat::fstat(fd.as_ref()) else {
                        continue;
                    };
                    let Some(&drops) = drops_by_inode.get(&stat.st_ino) else {
                        continue;
                    };
                    out.push(crate::metrics::DatagramDrops {
                        instance: format!("{}/{}", key.namespace(), key.name()),
                        listener: h.spec.name.clone(),
                        socket: stat.st_ino,
                        drops,
                    });
                }
            }
        }
        out
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
        self.forget_beside(instance);
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
                Ok(owned) => taken.push(Held::new(spec.clone(), owned, None)),
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
    pub async fn take_back_from_keeper(
        &self,
        instance: &InstanceKey,
        specs: &[ListenerSpec],
    ) -> Vec<String> {
        let Some(site) = &self.keeper else {
            self.steer_again(instance, HashMap::new()).await;
            return Vec::new();
        };
        let mut taken: Vec<Held> = Vec::new();
        let mut maps: HashMap<String, (Option<OwnedFd>, Option<OwnedFd>)> = HashMap::new();
        for pid in site.pids(instance) {
            let Ok(pidfd) = crate::launch::pidfd_open(pid) else {
                continue;
            };
            let names = fd_names(pid);
            for fd in 3..3 + KEEPER_FDS_READ {
                let Ok(owned) = take_fd(&pidfd, fd) else {
                    continue;
                };
                let name = usize::try_from(fd - 3)
                    .ok()
                    .and_then(|i| names.get(i))
                    .map(String::as_str)
                    .unwrap_or_default();
                if let Some(listener) = name.strip_suffix(SOCKETS_MAP_SUFFIX) {
                    maps.entry(listener.to_owned()).or_default().0 = Some(owned);
                    continue;
                }
                if let Some(listener) = name.strip_suffix(PROBES_MAP_SUFFIX) {
                    maps.entry(listener.to_owned()).or_default().1 = Some(owned);
                    continue;
                }
                let named = specs.iter().find(|spec| {
                    !taken.iter().any(|t| t.spec == **spec) && check_is(&owned, spec).is_ok()
                });
                if let Some(spec) = named {
                    taken.push(Held::new(spec.clone(), owned, None));
                }
            }
        }
        self.adopt(instance, taken);
        let kept = maps
            .into_iter()
            .filter_map(|(name, pair)| match pair {
                (Some(sockets), Some(probes)) => Some((name, StoredMaps { sockets, probes })),
                _ => None,
            })
            .collect();
        self.steer_again(instance, kept).await;
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

    /// Every socket held for `instance`, in the order held, each steered
    /// one's maps after it: what its keeper holds.
    fn all_activated(&self, instance: &InstanceKey) -> Vec<ActivatedSocket> {
        let held = self.lock();
        let mut out = Vec::new();
        for h in held.get(instance).into_iter().flatten() {
            out.push(ActivatedSocket {
                name: h.spec.name.clone(),
                fd: Arc::clone(&h.fd),
            });
            let Some(steering) = &h.steering else {
                continue;
            };
            match steering.stored_maps() {
                Ok(maps) => out.extend([
                    ActivatedSocket {
                        name: format!("{}{SOCKETS_MAP_SUFFIX}", h.spec.name),
                        fd: Arc::new(maps.sockets),
                    },
                    ActivatedSocket {
                        name: format!("{}{PROBES_MAP_SUFFIX}", h.spec.name),
                        fd: Arc::new(maps.probes),
                    },
                ]),
                Err(error) => {
                    tracing::warn!(listener = %h.spec.name, %error, "the keeper does not hold the steering maps: the next agent steers the listener anew");
                }
            }
        }
        out
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

    /// After the take-backs: each held listener its last agent bound for
    /// steering is steered again, through the maps the keeper kept (the
    /// group's program still reads them) when they name the socket taken
    /// back as serving, else through a fresh program and maps.
    async fn steer_again(&self, instance: &InstanceKey, mut kept: HashMap<String, StoredMaps>) {
        // Decided without the lock: a fresh steering may wait for the maps
        // of the program it replaces to be freed.
        let unsteered: Vec<(ListenerSpec, Arc<OwnedFd>)> = self
            .lock()
            .get(instance)
            .into_iter()
            .flatten()
            .filter(|h| h.steering.is_none() && h.spec.ip_address().is_some())
            .map(|h| (h.spec.clone(), Arc::clone(&h.fd)))
            .collect();
        let mut steered = Vec::new();
        for (spec, fd) in unsteered {
            let reuseport =
                nix::sys::socket::getsockopt(fd.as_ref(), sockopt::ReusePort).unwrap_or(false);
            if !reuseport {
                continue;
            }
            if self.wanted != Handover::Steered {
                // Told to share: whatever program the group has goes.
                if let Err(error) = Steering::detach(fd.as_fd()) {
                    tracing::warn!(listener = %spec.name, %error, "a listener taken back is still steered by its last agent's map");
                }
                continue;
            }
            let adopted = kept
                .remove(&spec.name)
                .map(|maps| Steering::adopt(maps, fd.as_fd()));
            let steering = match adopted {
                Some(Ok(steering)) => steering,
                other => {
                    if let Some(Err(error)) = other {
                        tracing::info!(listener = %spec.name, %error, "the kept maps do not steer this listener; steering it anew");
                    }
                    // It may wait up to OLD_MAPS_FREED for the kernel.
                    let anew = Arc::clone(&fd);
                    let steered_anew = tokio::task::spawn_blocking(move || steer_anew(&anew))
                        .await
                        .unwrap_or_else(|joined| Err(SteerError::Unfinished(joined)));
                    match steered_anew {
                        Ok(steering) => steering,
                        Err(error) => {
                            tracing::warn!(listener = %spec.name, %error, "listener handover: shared (a successor may accept connections before its health check ends)");
                            continue;
                        }
                    }
                }
            };
            steered.push((fd, steering));
        }
        let mut held = self.lock();
        for (fd, steering) in steered {
            let one = held
                .get_mut(instance)
                .into_iter()
                .flatten()
                .find(|h| Arc::ptr_eq(&h.fd, &fd));
            if let Some(h) = one {
                h.steering = Some(Arc::new(steering));
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

/// Attaches `steering` to the group `fd` founded and makes it the serving
/// socket.
fn steer_serving(steering: &Steering, fd: &OwnedFd) -> Result<(), SteerError> {
    steering.attach(fd.as_fd())?;
    steering.place(SERVING_SLOT, fd.as_fd())
}

/// A fresh program and maps for the group `fd` is in, with `fd` serving:
/// the group's old program is taken off first, and its maps freed, since a
/// socket sits in one sockets map at most. Until the new program is on,
/// the kernel spreads over the group: at an agent's start, that is the
/// serving socket and at most a generation's that recovery stops.
fn steer_anew(fd: &OwnedFd) -> Result<Steering, SteerError> {
    let steering = Steering::load()?;
    Steering::detach(fd.as_fd())?;
    let started = std::time::Instant::now();
    loop {
        match steering.place(SERVING_SLOT, fd.as_fd()) {
            Ok(()) => break,
            Err(SteerError::Slot { source, .. })
                if source.raw_os_error() == Some(nix::libc::EBUSY)
                    && started.elapsed() < OLD_MAPS_FREED =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(error) => return Err(error),
        }
    }
    steering.attach(fd.as_fd())?;
    Ok(steering)
}

/// The names a process got its descriptors 3.. under (`LISTEN_FDNAMES`).
fn fd_names(pid: u32) -> Vec<String> {
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let prefix = format!("{}=", crate::spawn::ENV_LISTEN_FDNAMES);
    environ
        .split(|b| *b == 0)
        .filter_map(|entry| std::str::from_utf8(entry).ok())
        .find_map(|entry| entry.strip_prefix(prefix.as_str()))
        .map(|names| names.split(':').map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Makes each steered listener's socket of `generation` the serving one;
/// on an error puts back those already switched. Whether any switched.
fn switch_all(have: &mut [Held], generation: u64) -> Result<bool, ListenerError> {
    let steer_error = |h: &Held| {
        let name = h.spec.name.clone();
        move |source| ListenerError::Steer { name, source }
    };
    let mut done: Vec<usize> = Vec::new();
    for (i, h) in have.iter().enumerate() {
        let (Some(steering), Some(beside)) = (&h.steering, &h.beside) else {
            continue;
        };
        if beside.generation != generation {
            continue;
        }
        // A socket is in one slot at most: out of its own first.
        let switched = steering
            .clear(BESIDE_SLOT)
            .and_then(|()| steering.place(SERVING_SLOT, beside.fd.as_fd()));
        if let Err(error) = switched {
            for j in done {
                let back = &have[j];
                if let Some(steering) = &back.steering
                    && let Err(again) = steering.place(SERVING_SLOT, back.fd.as_fd())
                {
                    tracing::error!(listener = %back.spec.name, error = %again, "a listener could not be switched back to the serving generation");
                }
            }
            return Err(steer_error(h)(error));
        }
        done.push(i);
    }
    for &i in &done {
        if let Some(beside) = have[i].beside.take() {
            let retired = std::mem::replace(&mut have[i].fd, beside.fd);
            stop_matching_datagrams(&have[i].spec, &retired);
        }
    }
    Ok(!done.is_empty())
}

/// Takes a UDP socket that leaves its steered group out of the kernel's
/// choice before it closes, by connecting it to its own address: a
/// connected socket matches only datagrams from its peer. Without it, a
/// socket found first in the port's hash chain while it closes is chosen
/// directly (its group already left, the program not run), and a
/// datagram queued on it then is lost. What it has queued stays readable
/// for the generation draining it.
fn stop_matching_datagrams(spec: &ListenerSpec, fd: &OwnedFd) {
    if spec.udp.is_none() {
        return;
    }
    let connected = getsockname::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(fd))
        .and_then(|own| connect(std::os::fd::AsRawFd::as_raw_fd(fd), &own));
    if let Err(error) = connected {
        tracing::warn!(listener = %spec.name, %error, "a retired UDP socket could not be taken out of the steering; a datagram may reach it as it closes");
    }
}

/// Binds and listens on what `spec` names; a TCP socket `steered` joins
/// (or founds) the `SO_REUSEPORT` group of its address.
fn bind_listener(spec: &ListenerSpec, steered: bool) -> Result<OwnedFd, ListenerError> {
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
    if let Some(address) = spec.ip_address() {
        let datagram = spec.tcp.is_none();
        let parsed: SocketAddr = address.parse().map_err(|_| ListenerError::Address {
            name: spec.name.clone(),
            address: address.to_owned(),
        })?;
        let family = match parsed {
            SocketAddr::V4(_) => AddressFamily::Inet,
            SocketAddr::V6(_) => AddressFamily::Inet6,
        };
        let kind = if datagram {
            SockType::Datagram
        } else {
            SockType::Stream
        };
        let fd = socket(family, kind, SockFlag::SOCK_CLOEXEC, None)
            .map_err(fail("create a socket for", address))?;
        // A restarted agent rebinds a port its predecessor's connections
        // still linger on.
        setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(fail("set SO_REUSEADDR on", address))?;
        // Only then: a group nothing steers would let any root process
        // bind the port too and take a share of its connections.
        if steered {
            setsockopt(&fd, sockopt::ReusePort, &true)
                .map_err(fail("set SO_REUSEPORT on", address))?;
        }
        match parsed {
            SocketAddr::V4(v4) => bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(v4)),
            SocketAddr::V6(v6) => {
                bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn6::from(v6))
            }
        }
        .map_err(fail("bind", address))?;
        // A UDP socket takes datagrams once bound; its buffer is what waits
        // while no generation reads.
        if !datagram {
            listen(&fd, backlog).map_err(fail("listen on", address))?;
        }
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

/// Whether `fd` is a listening socket (a bound UDP socket for `udp`) on
/// what `spec` names.
fn check_is(fd: &OwnedFd, spec: &ListenerSpec) -> Result<(), String> {
    let kind = nix::sys::socket::getsockopt(fd, sockopt::SockType).map_err(|e| e.to_string())?;
    if spec.udp.is_some() {
        if kind != SockType::Datagram {
            return Err("not a UDP socket".into());
        }
        // One retired by a switch: it takes no datagram any more.
        if nix::sys::socket::getpeername::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(fd))
            .is_ok()
        {
            return Err("a UDP socket retired by a switch (connected), not a serving one".into());
        }
    } else {
        let listening =
            nix::sys::socket::getsockopt(fd, sockopt::AcceptConn).map_err(|e| e.to_string())?;
        if kind != SockType::Stream || !listening {
            return Err("not a listening socket".into());
        }
    }
    let local: nix::sys::socket::SockaddrStorage =
        nix::sys::socket::getsockname(std::os::fd::AsRawFd::as_raw_fd(fd))
            .map_err(|e| e.to_string())?;
    let matches = match (spec.ip_address(), &spec.unix) {
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
            udp: None,
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

    /// A UDP socket a switch retires keeps what was queued for the
    /// generation draining it, and is never taken back as a serving one.
    #[test]
    fn a_retired_udp_socket_keeps_its_queue_and_is_not_taken_back() {
        let spec = ListenerSpec {
            name: "dns".into(),
            tcp: None,
            udp: Some("127.0.0.1:0".into()),
            unix: None,
            backlog: 16,
        };
        let fd = bind_listener(&spec, false).expect("bound");
        let socket = std::net::UdpSocket::from(fd.try_clone().expect("a copy"));
        let own = socket.local_addr().expect("its address");
        let client = std::net::UdpSocket::bind("127.0.0.1:0").expect("a client");
        client.send_to(b"queued", own).expect("sent");
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .expect("read timeout");
        let mut buf = [0u8; 16];
        socket.peek_from(&mut buf).expect("the datagram is queued");
        let bound = ListenerSpec {
            udp: Some(own.to_string()),
            ..spec
        };
        check_is(&fd, &bound).expect("a serving socket is taken back");

        stop_matching_datagrams(&bound, &fd);
        let peer: SockaddrStorage =
            nix::sys::socket::getpeername(std::os::fd::AsRawFd::as_raw_fd(&fd)).expect("connected");
        assert_eq!(peer.to_string(), own.to_string(), "to its own address");
        let (n, from) = socket.recv_from(&mut buf).expect("the queued datagram");
        assert_eq!(
            (&buf[..n], from),
            (&b"queued"[..], client.local_addr().expect("client"))
        );
        let refused = check_is(&fd, &bound).expect_err("a retired socket is refused");
        assert!(refused.contains("retired"), "{refused}");
    }

    #[tokio::test]
    async fn a_unix_listener_replaces_a_stale_socket_and_refuses_anything_else() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("app.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("a stale socket"));
        let spec = ListenerSpec {
            name: "local".into(),
            tcp: None,
            udp: None,
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
