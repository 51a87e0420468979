//! Steered listeners (SPEC 6.3): the sockets of one TCP or UDP address
//! form one `SO_REUSEPORT` group, and a BPF `sk_reuseport` program
//! ([`program`]) picks which of them a new connection reaches from a map
//! the agent writes. Slot [`SERVING_SLOT`] holds the serving generation's
//! socket; a generation being probed has a slot of its own that only the
//! agent's probe connections are steered to (by their source address and
//! port). Switching is one map update. With the program attached for
//! migration (Linux 5.14), the connections queued on a socket that closes
//! move to the serving one instead of being reset.
//!
//! Where the kernel refuses the maps or the program (no `CAP_BPF` or
//! `CAP_SYS_ADMIN`, an old kernel), [`Steering::load`] says why, and the
//! listener is shared between generations as in SPEC 6.2.

mod bpf;
mod program;

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use nix::libc;
use thiserror::Error;

/// The sockets map's slot of the serving generation.
pub const SERVING_SLOT: u32 = 0;
/// Slots in a group's sockets map: the serving one and the generations
/// probed beside it.
pub const SLOTS: u32 = 8;
/// Probe connections steered at once, per address.
const PROBES: u32 = 64;
/// `SO_ATTACH_REUSEPORT_EBPF`.
const SO_ATTACH_REUSEPORT_EBPF: libc::c_int = 52;
/// `SO_DETACH_REUSEPORT_BPF`.
const SO_DETACH_REUSEPORT_BPF: libc::c_int = 68;
/// `SO_COOKIE`.
const SO_COOKIE: libc::c_int = 57;

/// How new connections of a listener reach generations: the API's word.
pub use genswap_crds::ListenerHandover as Handover;

/// Why steering cannot be used or changed.
#[derive(Debug, Error)]
pub enum SteerError {
    #[error("the kernel refused the {what} map: {source}")]
    Map {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the kernel refused the sk_reuseport program: {source}{log}")]
    Program {
        #[source]
        source: io::Error,
        /// The verifier's last lines, `: `-prefixed when there are any.
        log: String,
    },
    #[error("cannot attach the sk_reuseport program to the socket: {0}")]
    Attach(#[source] io::Error),
    #[error("cannot detach the sk_reuseport program from the socket's group: {0}")]
    Detach(#[source] io::Error),
    #[error("the maps taken back do not steer this socket")]
    NotItsMaps,
    #[error("a steering taken back has no program to attach")]
    NoProgram,
    #[error("cannot {op} slot {slot}: {source}")]
    Slot {
        op: &'static str,
        slot: u32,
        #[source]
        source: io::Error,
    },
    #[error("slot {0} is past the map's {SLOTS}")]
    NoSuchSlot(u32),
    #[error("the thread steering the socket did not finish: {0}")]
    Unfinished(#[source] tokio::task::JoinError),
    #[error("cannot {op} probes from {source_address}: {source}")]
    Probe {
        op: &'static str,
        source_address: SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// One group's program and maps.
#[derive(Debug)]
pub struct Steering {
    sockets: OwnedFd,
    probes: OwnedFd,
    /// `None` for maps taken back: their program is the group's already.
    program: Option<OwnedFd>,
    migrates: Option<bool>,
}

/// The maps of a steering, as a keeper holds them across agents.
#[derive(Debug)]
pub struct StoredMaps {
    pub sockets: OwnedFd,
    pub probes: OwnedFd,
}

impl Steering {
    /// Creates the maps and loads the program (for migration too where the
    /// kernel knows it).
    pub fn load() -> Result<Steering, SteerError> {
        let sockets = bpf::map_create(
            bpf::BPF_MAP_TYPE_REUSEPORT_SOCKARRAY,
            4,
            8,
            SLOTS,
            "genswap_socks",
        )
        .map_err(|source| SteerError::Map {
            what: "reuseport sockets",
            source,
        })?;
        let probes = bpf::map_create(
            bpf::BPF_MAP_TYPE_HASH,
            program::PROBE_KEY_SIZE,
            4,
            PROBES,
            "genswap_probes",
        )
        .map_err(|source| SteerError::Map {
            what: "probes",
            source,
        })?;
        let insns = program::instructions(sockets.as_raw_fd(), probes.as_raw_fd());
        let load = |attach_type| {
            bpf::prog_load(
                bpf::BPF_PROG_TYPE_SK_REUSEPORT,
                attach_type,
                &insns,
                "genswap_steer",
            )
        };
        let (program, migrates) = match load(bpf::BPF_SK_REUSEPORT_SELECT_OR_MIGRATE) {
            Ok(program) => (program, true),
            // Before 5.14 the attach type is unknown: select only.
            Err(_) => match load(bpf::BPF_SK_REUSEPORT_SELECT) {
                Ok(program) => (program, false),
                Err(refused) => {
                    return Err(SteerError::Program {
                        source: refused.error,
                        log: if refused.log.is_empty() {
                            String::new()
                        } else {
                            format!(": {}", refused.log)
                        },
                    });
                }
            },
        };
        Ok(Steering {
            sockets,
            probes,
            program: Some(program),
            migrates: Some(migrates),
        })
    }

    /// The maps a keeper held for the group `serving` is in, with
    /// `serving` made the serving socket. They are the group's own only if
    /// they hold `serving` in some slot (a socket sits in one sockets map
    /// at most): the serving slot, or the one of a generation started
    /// beside when an agent died between `current.sock` and the map. The
    /// program that reads them is still the group's: nothing is attached.
    pub fn adopt(maps: StoredMaps, serving: BorrowedFd<'_>) -> Result<Steering, SteerError> {
        let steering = Steering {
            sockets: maps.sockets,
            probes: maps.probes,
            program: None,
            migrates: None,
        };
        let cookie = socket_cookie(serving).map_err(SteerError::Attach)?;
        let mut slot_of_serving = None;
        for slot in 0..SLOTS {
            if steering.cookie_in(slot)? == Some(cookie) {
                slot_of_serving = Some(slot);
            }
        }
        match slot_of_serving {
            None => Err(SteerError::NotItsMaps),
            Some(SERVING_SLOT) => Ok(steering),
            Some(slot) => {
                steering.clear(slot)?;
                steering.place(SERVING_SLOT, serving)?;
                Ok(steering)
            }
        }
    }

    /// Copies of the maps, for a keeper to hold across agents.
    pub fn stored_maps(&self) -> io::Result<StoredMaps> {
        Ok(StoredMaps {
            sockets: self.sockets.try_clone()?,
            probes: self.probes.try_clone()?,
        })
    }

    /// Whether a closing socket's queued connections move to the serving
    /// one (else they are reset, or spread by `net.ipv4.tcp_migrate_req`);
    /// `None` for maps taken back, whose program another agent loaded.
    pub fn migrates(&self) -> Option<bool> {
        self.migrates
    }

    /// Attaches the program to the group `socket` (bound with
    /// `SO_REUSEPORT`) is in: from now on only the map chooses.
    pub fn attach(&self, socket: BorrowedFd<'_>) -> Result<(), SteerError> {
        let program = self
            .program
            .as_ref()
            .ok_or(SteerError::NoProgram)?
            .as_raw_fd();
        set_int_option(socket, SO_ATTACH_REUSEPORT_EBPF, program).map_err(SteerError::Attach)
    }

    /// Takes any program off the group `socket` is in: until one is
    /// attached again the kernel spreads new connections over the group,
    /// and the maps the old one read are freed once nothing else holds
    /// them (a socket may sit in one sockets map only).
    pub fn detach(socket: BorrowedFd<'_>) -> Result<(), SteerError> {
        match set_int_option(socket, SO_DETACH_REUSEPORT_BPF, 0) {
            // ENOENT: no program was attached.
            Err(error) if error.raw_os_error() != Some(libc::ENOENT) => {
                Err(SteerError::Detach(error))
            }
            _ => Ok(()),
        }
    }

    /// Puts `socket` in `slot`, in place of what was there. A socket is in
    /// one slot at most: [`clear`](Self::clear) its old one first.
    pub fn place(&self, slot: u32, socket: BorrowedFd<'_>) -> Result<(), SteerError> {
        let fd = u64::try_from(socket.as_raw_fd()).map_err(|_| SteerError::NoSuchSlot(slot))?;
        self.check(slot)?;
        bpf::map_update(self.sockets.as_fd(), &slot.to_ne_bytes(), &fd.to_ne_bytes()).map_err(
            |source| SteerError::Slot {
                op: "fill",
                slot,
                source,
            },
        )
    }

    /// Empties `slot`: what would reach it is dropped.
    pub fn clear(&self, slot: u32) -> Result<(), SteerError> {
        self.check(slot)?;
        bpf::map_delete(self.sockets.as_fd(), &slot.to_ne_bytes()).map_err(|source| {
            SteerError::Slot {
                op: "empty",
                slot,
                source,
            }
        })
    }

    /// The cookie of the socket in `slot` (see [`socket_cookie`]), if any.
    pub fn cookie_in(&self, slot: u32) -> Result<Option<u64>, SteerError> {
        self.check(slot)?;
        let mut cookie = [0u8; 8];
        let found = bpf::map_lookup(self.sockets.as_fd(), &slot.to_ne_bytes(), &mut cookie)
            .map_err(|source| SteerError::Slot {
                op: "read",
                slot,
                source,
            })?;
        Ok(found.map(|()| u64::from_ne_bytes(cookie)))
    }

    /// Steers new connections from `source` (a socket the agent bound
    /// before connecting, so no other local one has its port) to `slot`.
    pub fn steer_probes(&self, source: SocketAddr, slot: u32) -> Result<(), SteerError> {
        self.check(slot)?;
        bpf::map_update(
            self.probes.as_fd(),
            &program::probe_key(source),
            &slot.to_ne_bytes(),
        )
        .map_err(|error| SteerError::Probe {
            op: "steer",
            source_address: source,
            source: error,
        })
    }

    /// Stops steering connections from `source`.
    pub fn forget_probes(&self, source: SocketAddr) -> Result<(), SteerError> {
        bpf::map_delete(self.probes.as_fd(), &program::probe_key(source)).map_err(|error| {
            SteerError::Probe {
                op: "forget",
                source_address: source,
                source: error,
            }
        })
    }

    fn check(&self, slot: u32) -> Result<(), SteerError> {
        if slot < SLOTS {
            Ok(())
        } else {
            Err(SteerError::NoSuchSlot(slot))
        }
    }
}

/// Where the agent's probes of a generation that does not serve yet are
/// steered: its slot in a listener's map.
#[derive(Clone, Debug)]
pub struct ProbeRoute {
    steering: Arc<Steering>,
    slot: u32,
}

impl PartialEq for ProbeRoute {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.steering, &other.steering) && self.slot == other.slot
    }
}

impl Eq for ProbeRoute {}

impl ProbeRoute {
    /// Probes steered to `slot` of `steering`'s map.
    pub fn new(steering: Arc<Steering>, slot: u32) -> ProbeRoute {
        ProbeRoute { steering, slot }
    }

    /// Connects to `addr` from a source bound first, so that its port is
    /// this socket's alone on the host, and steered to the route's slot
    /// for as long as the returned guard lives (a SYN cookie's ACK is
    /// steered again, so not only until the connect).
    pub async fn connect(
        &self,
        addr: SocketAddr,
    ) -> io::Result<(tokio::net::TcpStream, SteeredSource)> {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // The listener's own address is a local one: the source is too,
        // and no other host can send from it.
        socket.bind(SocketAddr::new(addr.ip(), 0))?;
        let source = socket.local_addr()?;
        self.steering
            .steer_probes(source, self.slot)
            .map_err(io::Error::other)?;
        let guard = SteeredSource {
            steering: Arc::clone(&self.steering),
            source,
        };
        let stream = socket.connect(addr).await?;
        Ok((stream, guard))
    }
}

/// A probe source steered to a slot; dropping it forgets the steering.
#[derive(Debug)]
pub struct SteeredSource {
    steering: Arc<Steering>,
    source: SocketAddr,
}

impl Drop for SteeredSource {
    fn drop(&mut self) {
        if let Err(error) = self.steering.forget_probes(self.source) {
            tracing::warn!(%error, "a probe's source stays in the steering map");
        }
    }
}

/// Sets a `SOL_SOCKET` option whose value is a C int.
fn set_int_option(
    socket: BorrowedFd<'_>,
    option: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `socket` is a live descriptor, and the option's value is a
    // live c_int whose size is passed with it; the kernel only reads it.
    let result = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            std::ptr::from_ref(&value).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The kernel's lifelong number of the socket `fd` refers to: what a slot
/// of the sockets map reads back as.
pub fn socket_cookie(fd: impl AsFd) -> io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `fd` is live; `cookie` and `len` are live and sized for the
    // option, and the kernel writes no more than `len` bytes.
    let result = unsafe {
        libc::getsockopt(
            fd.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            SO_COOKIE,
            std::ptr::from_mut(&mut cookie).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}
