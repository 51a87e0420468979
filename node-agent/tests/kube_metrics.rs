//! The agent's operations endpoints over real HTTP on loopback: `/metrics`
//! in the OpenMetrics format with the agent's metric names, `/healthz`, and
//! `/readyz` following node ownership and the intake's first read.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use genswap_crds::{Mode, Outcome};
use node_agent::classify::StepOutcome;
use node_agent::engine::{Step, StepRecord, SwapResult};
use node_agent::metrics::{self, AgentMetrics, CONTENT_TYPE, Readiness};

const DEADLINE: Duration = Duration::from_secs(30);

/// The endpoints on an ephemeral loopback port, stopped on drop.
struct Endpoints {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), metrics::HttpError>>,
}

impl Endpoints {
    async fn start(metrics: Arc<AgentMetrics>, readiness: Readiness) -> Endpoints {
        let listener = metrics::bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind loopback");
        let base = format!("http://{}", listener.local_addr().expect("local addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(metrics::serve(listener, metrics, readiness, async move {
            let _ = stopped.await;
        }));
        Endpoints {
            base,
            stop: Some(stop),
            task,
        }
    }

    async fn get(&self, path: &str) -> (u16, String, String) {
        genswap_store::install_crypto_provider();
        let response = tokio::time::timeout(DEADLINE, reqwest::get(format!("{}{path}", self.base)))
            .await
            .expect("answered in time")
            .expect("a response");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        (status, content_type, response.text().await.expect("a body"))
    }
}

impl Drop for Endpoints {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

fn result(outcome: Outcome, mode: Mode) -> SwapResult {
    SwapResult {
        outcome,
        effective_mode: mode,
        generation: Some(3),
        reason: String::new(),
        executed: true,
        clean_exit: false,
        drain: Some(Duration::from_millis(20)),
        listener_handover: None,
        steps: vec![
            StepRecord {
                step: Step::Health,
                result: StepOutcome::Ok,
                duration: Duration::from_millis(300),
            },
            StepRecord {
                step: Step::Retire,
                result: StepOutcome::Ok,
                duration: Duration::from_millis(20),
            },
        ],
        started_at: SystemTime::now(),
        finished_at: SystemTime::now(),
    }
}

#[tokio::test]
async fn metrics_name_attempts_steps_generations_handovers_and_backlog() {
    let metrics = Arc::new(AgentMetrics::new());
    metrics.record_result(&result(Outcome::Done, Mode::Overlap));
    metrics.record_result(&SwapResult {
        listener_handover: Some(genswap_crds::ListenerHandover::Steered),
        ..result(Outcome::Done, Mode::Overlap)
    });
    metrics.record_outcome(Outcome::Abandoned, Mode::Hold);
    metrics.set_generations_running(2);
    metrics.backlog_added();
    let endpoints = Endpoints::start(metrics.clone(), Readiness::new()).await;

    let (status, content_type, text) = endpoints.get("/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(content_type, CONTENT_TYPE);
    for line in [
        r#"genswap_agent_attempts_total{outcome="done",mode="overlap"} 2"#,
        r#"genswap_agent_attempts_total{outcome="abandoned",mode="hold"} 1"#,
        r#"genswap_agent_step_duration_seconds_count{step="health"} 2"#,
        r#"genswap_agent_step_duration_seconds_bucket{le="0.512",step="health"} 2"#,
        r#"genswap_agent_step_duration_seconds_bucket{le="0.256",step="health"} 0"#,
        "genswap_agent_generations_running 2",
        r#"genswap_agent_listener_handovers_total{handover="steered"} 1"#,
        "genswap_agent_journal_backlog 1",
        "# EOF",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} not in:\n{text}");
    }
    metrics.backlog_removed();
    let (_, _, text) = endpoints.get("/metrics").await;
    assert!(
        text.lines().any(|l| l == "genswap_agent_journal_backlog 0"),
        "{text}"
    );
}

#[tokio::test]
async fn healthz_answers_and_readyz_waits_for_the_node_and_the_first_read() {
    let readiness = Readiness::new();
    let endpoints = Endpoints::start(Arc::new(AgentMetrics::new()), readiness.clone()).await;
    assert_eq!(endpoints.get("/healthz").await.0, 200);

    let (status, _, body) = endpoints.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(
        body.contains("node lock") && body.contains("not read"),
        "{body}"
    );
    readiness.set_synced(true);
    let (status, _, body) = endpoints.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("another agent owns this node"), "{body}");
    readiness.set_owner(true);
    assert_eq!(endpoints.get("/readyz").await.0, 200);
    readiness.set_owner(false);
    assert_eq!(endpoints.get("/readyz").await.0, 503, "losing the node");
}

/// A UDP listener no generation reads fills its buffer, and the kernel
/// drops what does not fit: the counter follows `/proc/net/udp`.
#[tokio::test]
async fn datagrams_a_full_udp_listener_dropped_are_counted() {
    use node_agent::gate::InstanceKey;
    use node_agent::listeners::Listeners;
    use std::os::fd::AsRawFd;

    let listeners = Arc::new(Listeners::default());
    let key = InstanceKey::new("default", "cache").expect("key");
    let spec = genswap_crds::ListenerSpec {
        name: "dns".into(),
        tcp: None,
        udp: Some("127.0.0.1:0".into()),
        unix: None,
        backlog: 16,
    };
    listeners
        .hold(&key, std::slice::from_ref(&spec))
        .await
        .expect("held");
    let socket = &listeners.activated(&key, std::slice::from_ref(&spec))[0];
    // A small buffer, so that a few datagrams fill it.
    nix::sys::socket::setsockopt(socket.fd.as_ref(), nix::sys::socket::sockopt::RcvBuf, &4096)
        .expect("SO_RCVBUF");
    let local: nix::sys::socket::SockaddrIn =
        nix::sys::socket::getsockname(socket.fd.as_raw_fd()).expect("bound");
    let sender = std::net::UdpSocket::bind("127.0.0.1:0").expect("a sender");
    for _ in 0..200 {
        sender
            .send_to(&[0u8; 1000], ("127.0.0.1", local.port()))
            .expect("sent");
    }
    let source = Arc::clone(&listeners);
    let metrics =
        AgentMetrics::new().with_datagram_drops(Arc::new(move || source.datagram_drops()));
    let text = metrics.encode().expect("metrics encode");
    let dropped: u64 = text
        .lines()
        .find_map(|line| {
            line.strip_prefix(
                r#"genswap_agent_listener_datagrams_dropped_total{instance="default/cache",listener="dns"} "#,
            )
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no drop count in:\n{text}"));
    assert!(
        (100..200).contains(&dropped),
        "200 datagrams of 1000 bytes into a 4 KiB buffer: {dropped} dropped"
    );
    // Counted once: a second scrape adds nothing new.
    let again = metrics.encode().expect("metrics encode");
    assert!(
        again.contains(&format!("listener=\"dns\"}} {dropped}")),
        "{again}"
    );
    listeners.release(&key).await;
}
