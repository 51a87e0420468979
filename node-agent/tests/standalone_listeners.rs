//! Listeners in standalone mode (SPEC 6.2): a manifest's `spec.listeners`
//! reach every attempt the scheduler issues, the instance serves on the
//! held TCP port, a hold release keeps serving on it, and deleting the
//! file closes it. Real processes, a real port on 127.0.0.1.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::io::{Read, Write};
use std::time::Duration;

use genswap_crds::ConditionType;
use standalone_support::{Manifest, StandaloneHost};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The body `GET /` gets on the port, if anything answers.
fn body(port: u16) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.starts_with("HTTP/1.1 200").then_some(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifests_listener_is_held_across_a_hold_release_and_closed_on_deletion() {
    let host = StandaloneHost::start("sa-listeners");
    let port = free_port();
    let listeners = format!("[{{name: web, tcp: \"127.0.0.1:{port}\"}}]");
    let one = host.build("build-1");
    let mut manifest = Manifest::new("web", "build-1", &one);
    manifest.listeners = Some(listeners.clone());
    host.write("web.yaml", &manifest.yaml());
    host.status("web.yaml", "build-1 to serve", |doc| {
        doc.is_true(ConditionType::Ready)
    })
    .await;
    assert!(body(port).is_some_and(|b| b.contains("build=build-1")));

    let two = host.build("build-2");
    let mut release = Manifest::new("web", "build-2", &two);
    release.mode = "hold";
    release.listeners = Some(listeners);
    host.write("web.yaml", &release.yaml());
    host.status("web.yaml", "build-2 to serve", |doc| {
        doc.is_true(ConditionType::Ready)
            && doc.status.nodes.first().and_then(|n| n.build.as_deref()) == Some("build-2")
    })
    .await;
    assert!(body(port).is_some_and(|b| b.contains("build=build-2")));

    host.remove("web.yaml");
    node_agent::standalone::wait_for_no_status(&host.dir, "web.yaml", swap_host::DEADLINE)
        .await
        .expect("the instance is removed");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the port closed with the instance"
    );
    host.stop().await;
}
