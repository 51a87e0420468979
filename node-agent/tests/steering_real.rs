//! Steered listeners on this machine's kernel (SPEC 6.3): real sockets in
//! a real `SO_REUSEPORT` group, the real `sk_reuseport` program, real
//! connections and datagrams over loopback. Each test first shows what the
//! kernel does with the group alone where that is the point (new
//! connections spread over every socket), so a program that chose nothing
//! could not pass.
//!
//! Needs `CAP_BPF` or root: CI runs as root, here and again in the pure
//! cgroup v2 guest (`tests/tests/vm_cgroup_v2.rs`), whose kernel is
//! Debian's rather than the host's. The last test takes those rights away
//! to check the agent's fallback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, SockaddrIn, SockaddrStorage, accept4, bind,
    connect, getsockname, getsockopt, listen, setsockopt, socket, sockopt,
};
use node_agent::steering::{SERVING_SLOT, Steering, socket_cookie};

const DEADLINE: Duration = Duration::from_secs(20);

/// A socket of the group on 127.0.0.1:`port` (0: any), listening for TCP
/// or bound for UDP, non-blocking.
fn member(kind: SockType, port: u16) -> OwnedFd {
    let fd = socket(
        AddressFamily::Inet,
        kind,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .expect("a socket");
    setsockopt(&fd, sockopt::ReusePort, &true).expect("SO_REUSEPORT");
    bind(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port)).expect("bind");
    if kind == SockType::Stream {
        listen(&fd, Backlog::new(256).expect("backlog")).expect("listen");
    }
    fd
}

fn port_of(fd: &OwnedFd) -> u16 {
    let local: SockaddrIn = getsockname(fd.as_raw_fd()).expect("bound");
    local.port()
}

/// Connections accepted from `fd` until none is waiting.
fn accept_all(fd: &OwnedFd) -> Vec<TcpStream> {
    let mut accepted = Vec::new();
    while let Ok(raw) = accept4(fd.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
        // SAFETY: accept4 just returned this descriptor; it is ours alone.
        accepted.push(unsafe { TcpStream::from_raw_fd(raw) });
    }
    accepted
}

/// Accepts from each of `members` until `total` connections were accepted
/// in all; returns how many each accepted.
fn accept_until(members: &[&OwnedFd], total: usize) -> Vec<Vec<TcpStream>> {
    let mut got: Vec<Vec<TcpStream>> = members.iter().map(|_| Vec::new()).collect();
    let started = Instant::now();
    while got.iter().map(Vec::len).sum::<usize>() < total {
        assert!(
            started.elapsed() < DEADLINE,
            "accepted {:?} of {total}",
            got.iter().map(Vec::len).collect::<Vec<_>>()
        );
        for (fd, into) in members.iter().zip(got.iter_mut()) {
            into.extend(accept_all(fd));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    got
}

fn connect_many(port: u16, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).expect("connects"))
        .collect()
}

fn loaded() -> Steering {
    Steering::load().expect("this kernel loads the sk_reuseport program (run as root)")
}

#[test]
fn without_the_program_the_kernel_spreads_new_connections_over_the_group() {
    let a = member(SockType::Stream, 0);
    let b = member(SockType::Stream, port_of(&a));
    let _clients = connect_many(port_of(&a), 200);
    let got = accept_until(&[&a, &b], 200);
    assert!(
        got.iter().all(|g| !g.is_empty()),
        "both sockets took some: {:?}",
        got.iter().map(Vec::len).collect::<Vec<_>>()
    );
}

#[test]
fn new_connections_reach_only_the_socket_in_the_serving_slot_and_switch_with_one_update() {
    let steering = loaded();
    let a = member(SockType::Stream, 0);
    let b = member(SockType::Stream, port_of(&a));
    steering.attach(a.as_fd()).expect("attach");
    steering.place(SERVING_SLOT, a.as_fd()).expect("serve a");
    assert_eq!(
        steering.cookie_in(SERVING_SLOT).expect("read"),
        Some(socket_cookie(&a).expect("cookie"))
    );

    let _clients = connect_many(port_of(&a), 200);
    let got = accept_until(&[&a, &b], 200);
    assert_eq!((got[0].len(), got[1].len()), (200, 0));

    steering
        .place(SERVING_SLOT, b.as_fd())
        .expect("switch to b");
    let _more = connect_many(port_of(&a), 200);
    let got = accept_until(&[&a, &b], 200);
    assert_eq!((got[0].len(), got[1].len()), (0, 200));
}

#[test]
fn a_probe_from_its_source_reaches_the_probed_slot_while_everyone_else_reaches_the_serving_one() {
    let steering = loaded();
    let serving = member(SockType::Stream, 0);
    let port = port_of(&serving);
    let probed = member(SockType::Stream, port);
    steering.attach(serving.as_fd()).expect("attach");
    steering
        .place(SERVING_SLOT, serving.as_fd())
        .expect("serve");
    steering.place(1, probed.as_fd()).expect("probe slot");

    // The agent binds its probe's source first: the port is then its own.
    let probe = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("a socket");
    bind(probe.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, 0)).expect("bind the source");
    let source: SockaddrStorage = getsockname(probe.as_raw_fd()).expect("bound");
    let source = SocketAddr::from(std::net::SocketAddrV4::from(
        *source.as_sockaddr_in().expect("IPv4"),
    ));
    steering.steer_probes(source, 1).expect("steer the probe");
    connect(probe.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port)).expect("probe connects");
    let _clients = connect_many(port, 100);

    let got = accept_until(&[&serving, &probed], 101);
    assert_eq!((got[0].len(), got[1].len()), (100, 1));
    let peer = got[1][0].peer_addr().expect("peer");
    assert_eq!(peer, source, "the probed socket got the probe, and only it");

    // Forgotten, the same source reaches the serving socket like anyone.
    steering.forget_probes(source).expect("forget");
    drop(probe);
    let _later = connect_many(port, 20);
    let got = accept_until(&[&serving, &probed], 20);
    assert_eq!((got[0].len(), got[1].len()), (20, 0));
}

#[test]
fn an_empty_serving_slot_refuses_rather_than_spreading() {
    let steering = loaded();
    let a = member(SockType::Stream, 0);
    let _b = member(SockType::Stream, port_of(&a));
    steering.attach(a.as_fd()).expect("attach");
    let refused = TcpStream::connect(("127.0.0.1", port_of(&a))).expect_err("refused");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(accept_all(&a).is_empty());
    assert!(accept_all(&_b).is_empty());
}

#[test]
fn a_closing_sockets_queued_connections_move_to_the_serving_one() {
    let steering = loaded();
    assert_eq!(
        steering.migrates(),
        Some(true),
        "this kernel (5.14 or later) migrates a closing listener's queue"
    );
    let retiring = member(SockType::Stream, 0);
    let port = port_of(&retiring);
    let serving = member(SockType::Stream, port);
    steering.attach(retiring.as_fd()).expect("attach");
    steering
        .place(SERVING_SLOT, retiring.as_fd())
        .expect("serve");

    // Queued on the retiring socket, never accepted from it.
    let mut clients = connect_many(port, 30);
    let started = Instant::now();
    while queued(&retiring) < 30 {
        assert!(started.elapsed() < DEADLINE, "the queue never filled");
        std::thread::sleep(Duration::from_millis(5));
    }
    steering
        .place(SERVING_SLOT, serving.as_fd())
        .expect("switch");
    drop(retiring);

    let got = accept_until(&[&serving], 30);
    // Every client writes first: a migrated queue need not keep the order
    // of the connects, so the n-th accepted is not the n-th client's.
    for client in &mut clients {
        client
            .write_all(b"x")
            .expect("the client's connection lives");
    }
    for mut server in got.into_iter().flatten() {
        server.set_nonblocking(false).expect("blocking");
        let mut byte = [0u8; 1];
        server
            .set_read_timeout(Some(DEADLINE))
            .expect("read timeout");
        server
            .read_exact(&mut byte)
            .expect("read on the new socket");
        assert_eq!(&byte, b"x");
    }
}

/// Connections waiting in the accept queues of every listener on `fd`'s
/// port (`ss`'s Recv-Q): the group's sockets share the port, and the
/// caller knows which of them can hold any.
fn queued(fd: &OwnedFd) -> u32 {
    let port = port_of(fd);
    // /proc/net/tcp's rx_queue of a listener is its accept queue length.
    let text = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = fields.get(1)?;
            let state = fields.get(3)?;
            let queues = fields.get(4)?;
            let local_port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            (local_port == port && *state == "0A").then(|| {
                queues
                    .split(':')
                    .nth(1)
                    .and_then(|rx| u32::from_str_radix(rx, 16).ok())
                    .unwrap_or(0)
            })
        })
        .sum()
}

#[test]
fn datagrams_reach_only_the_serving_socket() {
    let steering = loaded();
    let a = member(SockType::Datagram, 0);
    let port = port_of(&a);
    let b = member(SockType::Datagram, port);
    steering.attach(a.as_fd()).expect("attach");
    steering.place(SERVING_SLOT, a.as_fd()).expect("serve a");
    let a = UdpSocket::from(a);
    let b = UdpSocket::from(b);

    // Many senders: the kernel's spread goes by the source port.
    let senders: Vec<UdpSocket> = (0..50)
        .map(|_| UdpSocket::bind("127.0.0.1:0").expect("a sender"))
        .collect();
    for sender in &senders {
        sender.send_to(b"ping", ("127.0.0.1", port)).expect("send");
    }
    assert_eq!(received(&a, 50), 50);
    assert_eq!(waiting(&b), 0);

    steering.place(SERVING_SLOT, b.as_fd()).expect("switch");
    for sender in &senders {
        sender.send_to(b"ping", ("127.0.0.1", port)).expect("send");
    }
    assert_eq!(received(&b, 50), 50);
    assert_eq!(waiting(&a), 0);
}

/// Datagrams read from `socket` until `want` arrived.
fn received(socket: &UdpSocket, want: usize) -> usize {
    let mut got = 0;
    let mut buf = [0u8; 16];
    let started = Instant::now();
    while got < want {
        assert!(started.elapsed() < DEADLINE, "received {got} of {want}");
        match socket.recv(&mut buf) {
            Ok(_) => got += 1,
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    got
}

/// Datagrams waiting on `socket` now (every one sent was delivered before
/// its send returned: loopback queues synchronously).
fn waiting(socket: &UdpSocket) -> usize {
    let mut buf = [0u8; 16];
    std::iter::from_fn(|| socket.recv(&mut buf).ok()).count()
}

/// Where the kernel refuses BPF (here: `CAP_BPF` and `CAP_SYS_ADMIN` taken
/// from the process by `setpriv`), a listener is held all the same, shared.
#[test]
fn without_the_rights_to_load_bpf_a_listener_is_held_shared() {
    let exe = std::env::current_exe().expect("this test binary");
    let output = std::process::Command::new("setpriv")
        .args(["--bounding-set", "-bpf,-sys_admin,-perfmon,-net_admin"])
        .arg(exe)
        .args([
            "--ignored",
            "--exact",
            "inner_a_listener_without_bpf_rights_is_shared",
        ])
        .output()
        .expect("setpriv (util-linux) runs");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && said.contains("1 passed"),
        "{said}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
#[ignore = "run by without_the_rights_to_load_bpf_a_listener_is_held_shared, under setpriv"]
async fn inner_a_listener_without_bpf_rights_is_shared() {
    use node_agent::gate::InstanceKey;
    use node_agent::listeners::Listeners;
    use node_agent::steering::Handover;

    let refused = Steering::load().expect_err("no rights to load BPF");
    assert!(refused.to_string().contains("refused"), "{refused}");
    let key = InstanceKey::new("default", "shared").expect("key");
    let spec = genswap_crds::ListenerSpec {
        name: "web".into(),
        tcp: Some("127.0.0.1:0".into()),
        udp: None,
        unix: None,
        backlog: 16,
    };
    let listeners = Listeners::default();
    listeners
        .hold(&key, std::slice::from_ref(&spec))
        .await
        .expect("held without steering");
    assert_eq!(
        listeners.handover_of(&key, std::slice::from_ref(&spec)),
        Some(Handover::Shared)
    );
    let socket = &listeners.activated(&key, std::slice::from_ref(&spec))[0];
    let local: SockaddrIn = getsockname(socket.fd.as_raw_fd()).expect("bound");
    assert!(
        !getsockopt(socket.fd.as_ref(), sockopt::ReusePort).expect("SO_REUSEPORT readable"),
        "a shared listener is in no SO_REUSEPORT group another process could join"
    );
    TcpStream::connect(("127.0.0.1", local.port())).expect("it accepts into its backlog");
    listeners.release(&key).await;
}
