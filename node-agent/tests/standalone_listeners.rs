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
#[path = "support/tcp_client.rs"]
mod tcp_client;

use genswap_crds::{ConditionType, HeldListener};
use node_agent::standalone::StatusDocument;
use standalone_support::{Manifest, StandaloneHost};
use tcp_client::{free_port, get};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifests_listener_is_held_across_a_hold_release_and_closed_on_deletion() {
    let host = StandaloneHost::start("sa-listeners");
    let port = free_port();
    let listeners = format!("[{{name: web, tcp: \"127.0.0.1:{port}\"}}]");
    let one = host.build("build-1");
    let mut manifest = Manifest::new("web", "build-1", &one);
    manifest.listeners = Some(listeners.clone());
    host.write("web.yaml", &manifest.yaml());
    let doc = host
        .status("web.yaml", "build-1 to serve, its listener shown", |doc| {
            doc.is_true(ConditionType::Ready) && serving_listeners(doc).is_some()
        })
        .await;
    assert!(get(port).is_ok_and(|b| b.contains("build=build-1")));
    let address = format!("127.0.0.1:{port}");
    assert_eq!(
        doc.status.listeners.as_deref(),
        Some(format!("web={address}").as_str()),
        "the printer column's summary"
    );
    assert_eq!(
        serving_listeners(&doc),
        Some(vec![HeldListener {
            name: "web".into(),
            address: address.clone(),
        }]),
        "the done attempt says what the agent holds"
    );

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
    assert!(get(port).is_ok_and(|b| b.contains("build=build-2")));

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

/// The held listeners the newest done attempt's `serving` block shows.
fn serving_listeners(doc: &StatusDocument) -> Option<Vec<HeldListener>> {
    let rev = doc.last_attempt()?.sched_rev;
    let serving = doc.attempt(rev)?.status.serving.as_ref()?;
    (!serving.listeners.is_empty()).then(|| serving.listeners.clone())
}
