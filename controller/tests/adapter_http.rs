//! The operations endpoints over real HTTP on loopback.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_controller::shutdown;
use genswap_runtime::http::{self, Readiness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(20);

struct Reply {
    status: u16,
    headers: String,
    body: String,
}

/// One HTTP/1.1 GET, read to the end (the request asks to close).
async fn get(addr: SocketAddr, path: &str) -> Reply {
    let exchange = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .expect("connect to the server");
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .expect("send the request");
        let mut raw = String::new();
        stream
            .read_to_string(&mut raw)
            .await
            .expect("read the reply");
        raw
    };
    let raw = tokio::time::timeout(DEADLINE, exchange)
        .await
        .expect("the server answered in time");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a head and a body");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status code");
    Reply {
        status,
        headers: head.to_ascii_lowercase(),
        body: body.to_string(),
    }
}

#[tokio::test]
async fn health_readiness_and_metrics_are_served_until_shutdown() {
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    let readiness = Readiness::default();
    let listener = http::bind("127.0.0.1:0".parse().expect("loopback address"))
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("bound address");
    let (stop, stopped) = shutdown::channel();
    let server = tokio::spawn(http::serve(
        listener,
        http::router(metrics.clone(), readiness.clone()),
        stopped.wait(),
    ));

    let health = get(addr, "/healthz").await;
    assert_eq!(health.status, 200, "alive from the start");

    let ready = get(addr, "/readyz").await;
    assert_eq!(ready.status, 503, "not ready before the caches sync");
    readiness.set_ready();
    assert_eq!(get(addr, "/readyz").await.status, 200, "ready once synced");

    let scraped = get(addr, "/metrics").await;
    assert_eq!(scraped.status, 200);
    assert!(
        scraped
            .headers
            .contains("content-type: application/openmetrics-text"),
        "OpenMetrics content type: {}",
        scraped.headers
    );
    assert!(
        scraped.body.contains("genswap_controller_leader 0"),
        "{}",
        scraped.body
    );
    assert!(
        scraped
            .body
            .contains("# TYPE genswap_controller_reconcile_duration_seconds histogram")
    );

    leadership.set(true);
    drop(metrics.reconcile_started());
    let scraped = get(addr, "/metrics").await;
    assert!(
        scraped.body.contains("genswap_controller_leader 1"),
        "{}",
        scraped.body
    );
    assert!(
        scraped
            .body
            .contains("genswap_controller_reconciles_total 1")
    );

    assert_eq!(get(addr, "/nope").await.status, 404);

    stop.fire();
    tokio::time::timeout(DEADLINE, server)
        .await
        .expect("the server stops on shutdown")
        .expect("server task joined")
        .expect("server ended cleanly");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "nothing listens after shutdown"
    );
}
