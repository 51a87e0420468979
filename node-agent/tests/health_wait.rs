//! The health check against the real test application on temp unix sockets.

#[path = "support/test_app.rs"]
mod test_app;

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use node_agent::health::{HealthError, get, wait_healthy};
use node_agent::observation::Observation;
use node_agent::probe::ProbeError;
use test_app::TestApp;

fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("gen-1.sock")
}

/// Generous: only failures wait this long.
const PATIENCE: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_serving_app_is_healthy_and_get_reads_its_body() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let _app = TestApp::start(&socket, &[]);

    let report = wait_healthy(&socket, "/", PATIENCE, std::future::pending())
        .await
        .expect("healthy");
    assert_eq!(report.healthy.status(), Some(200));
    assert!(report.attempts >= 1);

    let (status, body) = get(&socket, "/anything").await.expect("get");
    assert_eq!(status, 200);
    let body = String::from_utf8_lossy(&body);
    assert!(
        body.starts_with("build=health-test generation=1 pid="),
        "{body}"
    );
}

#[tokio::test]
async fn a_redirect_is_healthy_as_the_kubelet_says() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let _app = TestApp::start(&socket, &[(testapp::knob::STATUS, "302")]);
    let report = wait_healthy(&socket, "/healthz", PATIENCE, std::future::pending())
        .await
        .expect("302 is from 200 to 399");
    assert_eq!(report.healthy.status(), Some(302));
}

#[tokio::test]
async fn a_client_error_is_unhealthy_as_the_kubelet_says() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let _app = TestApp::start(&socket, &[(testapp::knob::STATUS, "404")]);
    let result = wait_healthy(
        &socket,
        "/healthz",
        Duration::from_millis(800),
        std::future::pending(),
    )
    .await;
    match result {
        Err(HealthError::Timeout { last, .. }) => assert_eq!(last, Observation::Status(404)),
        other => panic!("404 is not healthy: {other:?}"),
    }
}

#[tokio::test]
async fn a_socket_that_appears_late_is_waited_for() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let mut wait = std::pin::pin!(wait_healthy(&socket, "/", PATIENCE, std::future::pending()));
    // The first try runs now, while no process exists to bind the socket.
    assert!(futures::poll!(&mut wait).is_pending());
    assert!(!socket.exists());

    let _app = TestApp::start(&socket, &[(testapp::knob::BOOT_DELAY_MS, "300")]);
    let report = wait.await.expect("healthy once bound");
    assert_eq!(report.healthy.status(), Some(200));
    assert!(
        report.attempts >= 2,
        "the missing socket was retried: {report:?}"
    );
}

#[tokio::test]
async fn answering_500_until_the_deadline_times_out_naming_500() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let _app = TestApp::start(&socket, &[(testapp::knob::STATUS, "500")]);
    poll_until_bound(&socket).await;
    let err = wait_healthy(
        &socket,
        "/",
        Duration::from_millis(1500),
        std::future::pending(),
    )
    .await
    .expect_err("never healthy");
    match &err {
        HealthError::Timeout { last, attempts, .. } => {
            assert_eq!(*last, Observation::Status(500));
            assert!(*attempts >= 2, "5xx answers are retried");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains(&socket.display().to_string())
            && message.contains("last attempt: answered 500"),
        "{message}"
    );
}

#[tokio::test]
async fn a_hung_app_times_out_as_hung() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let _app = TestApp::start(&socket, &[(testapp::knob::HANG, "1")]);
    // Wait until it accepts, so the timeout below is spent on a hung request.
    poll_until_bound(&socket).await;
    let err = wait_healthy(&socket, "/", Duration::from_secs(1), std::future::pending())
        .await
        .expect_err("never answers");
    assert!(
        matches!(
            err,
            HealthError::Timeout {
                last: Observation::Hung(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("no answer within"), "{err}");
}

#[tokio::test]
async fn an_app_that_binds_late_and_hangs_times_out_as_hung_not_unbound() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    // Shorter than one try's own timeout: the deadline cuts the hang short.
    let mut wait = std::pin::pin!(wait_healthy(
        &socket,
        "/",
        Duration::from_secs(2),
        std::future::pending()
    ));
    // The first try runs now and finds no socket.
    assert!(futures::poll!(&mut wait).is_pending());
    assert!(!socket.exists());

    let _app = TestApp::start(&socket, &[(testapp::knob::HANG, "1")]);
    let err = wait.await.expect_err("never answers");
    assert!(
        matches!(
            err,
            HealthError::Timeout {
                last: Observation::Hung(_),
                ..
            }
        ),
        "the hang, not the missing socket before it, is the reason: {err:?}"
    );
}

#[tokio::test]
async fn an_app_that_never_binds_times_out_naming_the_missing_socket() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let _app = TestApp::start(&socket, &[(testapp::knob::NEVER_BIND, "1")]);
    let err = wait_healthy(
        &socket,
        "/",
        Duration::from_millis(500),
        std::future::pending(),
    )
    .await
    .expect_err("never bound");
    assert!(
        matches!(
            err,
            HealthError::Timeout {
                last: Observation::NoSocket,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("no socket"), "{err}");
}

#[tokio::test]
async fn a_socket_nobody_accepts_on_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    // Bound then closed: the file stays, nobody listens.
    drop(UnixListener::bind(&socket).expect("bind"));
    let err = wait_healthy(
        &socket,
        "/",
        Duration::from_millis(300),
        std::future::pending(),
    )
    .await
    .expect_err("refused");
    assert!(
        matches!(
            err,
            HealthError::Timeout {
                last: Observation::Refused,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("connection refused"), "{err}");
}

#[tokio::test]
async fn cancelling_ends_the_wait_promptly_and_is_not_a_timeout() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = socket_in(&dir);
    let _app = TestApp::start(&socket, &[(testapp::knob::STATUS, "503")]);
    let (cancel, cancelled) = tokio::sync::oneshot::channel::<()>();
    let waiter = tokio::spawn({
        let socket = socket.clone();
        async move {
            wait_healthy(&socket, "/", Duration::from_secs(600), async {
                let _ = cancelled.await;
            })
            .await
        }
    });
    cancel.send(()).expect("the waiter listens");
    // Far below the 600 s health timeout.
    let result = tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("the wait ends promptly after cancel")
        .expect("no panic");
    assert!(
        matches!(result, Err(HealthError::Cancelled { .. })),
        "{result:?}"
    );

    // A lifetime that already ended makes no try at all past the first poll.
    let result = wait_healthy(&socket, "/", PATIENCE, std::future::ready(())).await;
    assert!(
        matches!(result, Err(HealthError::Cancelled { .. })),
        "{result:?}"
    );
}

#[tokio::test]
async fn a_relative_health_path_is_refused_before_any_try() {
    let dir = tempfile::tempdir().expect("temp dir");
    let result = wait_healthy(
        &socket_in(&dir),
        "healthz",
        PATIENCE,
        std::future::pending(),
    )
    .await;
    assert!(
        matches!(
            result,
            Err(HealthError::Invalid(ProbeError::InvalidPath { .. }))
        ),
        "{result:?}"
    );
}

async fn poll_until_bound(socket: &Path) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while tokio::net::UnixStream::connect(socket).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} never accepted",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
