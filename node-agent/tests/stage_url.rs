//! Staging URL artifacts from a real HTTP server on loopback.

use std::convert::Infallible;
use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use genswap_crds::Artifact;
use genswap_store::{ENTRY_MODE, StageError, Stager, StagerConfig, Store};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The cap the stager runs with in these tests.
const CAP: u64 = 1 << 20;
/// Generous: only failures wait this long.
const PATIENCE: Duration = Duration::from_secs(30);

/// Runs `path`, retrying while another thread's fork still holds a write
/// descriptor of the freshly written file (ETXTBSY), as any spawner must.
fn run(path: &Path) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match Command::new(path).status() {
            Err(e)
                if e.raw_os_error() == Some(nix::libc::ETXTBSY)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            other => return other.expect("exec the store copy"),
        }
    }
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Aborts a server task on drop.
struct Server {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

async fn route(request: Request<Incoming>, payload: Bytes) -> Result<Response<Body>, Infallible> {
    let cap = usize::try_from(CAP).expect("cap fits");
    let response = match request.uri().path() {
        "/good" => Response::new(Full::new(payload).boxed_unsync()),
        "/empty" => Response::new(Full::new(Bytes::new()).boxed_unsync()),
        // A declared length above the cap.
        "/big" => Response::new(Full::new(Bytes::from(vec![0u8; cap + 1])).boxed_unsync()),
        // No declared length; the body only turns out too big while streaming.
        "/stream-big" => {
            let chunks = (0..16).map(move |_| Ok(Frame::data(Bytes::from(vec![1u8; cap / 8]))));
            Response::new(StreamBody::new(futures::stream::iter(chunks)).boxed_unsync())
        }
        _ => {
            let mut response = Response::new(Empty::new().boxed_unsync());
            *response.status_mut() = StatusCode::NOT_FOUND;
            response
        }
    };
    Ok(response)
}

async fn serve(payload: Bytes) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let payload = payload.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| route(request, payload.clone()));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Server { addr, task }
}

/// Accepts connections and never answers.
async fn serve_nothing() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    Server { addr, task }
}

struct Fixture {
    _temp: tempfile::TempDir,
    stager: Stager,
}

fn fixture() -> Fixture {
    let temp = tempfile::tempdir().expect("temp dir");
    let root = temp.path().join("staging");
    fs::create_dir(&root).expect("staging root");
    let store = Store::open(temp.path().join("store")).expect("store");
    let mut config = StagerConfig::new(&root);
    config.max_bytes = CAP;
    config.connect_timeout = Duration::from_secs(1);
    config.download_timeout = Duration::from_secs(1);
    let stager = Stager::new(store, config).expect("stager");
    Fixture {
        _temp: temp,
        stager,
    }
}

fn store_files(stager: &Stager) -> Vec<PathBuf> {
    fs::read_dir(stager.store().dir())
        .expect("read the store")
        .map(|e| e.expect("entry").path())
        .collect()
}

#[tokio::test]
async fn a_good_url_is_stored_and_runs() {
    let fx = fixture();
    let payload = Bytes::from(fs::read("/bin/true").expect("/bin/true"));
    let server = serve(payload.clone()).await;
    let artifact = Artifact {
        path: None,
        url: Some(format!("http://{}/good", server.addr)),
        image: None,
        unpack: None,
    };
    let staged = fx
        .stager
        .stage_file(&artifact, &sha256(&payload))
        .await
        .expect("staged");
    assert_eq!(staged.sha256, sha256(&payload));
    assert_eq!(staged.bytes, payload.len() as u64);
    assert_eq!(
        fs::metadata(&staged.path).expect("entry").mode() & 0o7777,
        ENTRY_MODE
    );
    assert!(run(&staged.path).success());
    assert_eq!(store_files(&fx.stager), vec![staged.path]);
}

#[tokio::test]
async fn a_404_is_refused_with_its_status() {
    let fx = fixture();
    let server = serve(Bytes::from_static(b"x")).await;
    let url = format!("http://{}/missing", server.addr);
    let err = fx
        .stager
        .stage_url(&url, &sha256(b"x"))
        .await
        .expect_err("404");
    assert!(
        matches!(err, StageError::HttpStatus { status: 404, .. }),
        "{err:?}"
    );
    assert_eq!(err.to_string(), format!("artifact URL {url} answered 404"));
    assert!(store_files(&fx.stager).is_empty());
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let fx = fixture();
    let server = serve_nothing().await;
    let url = format!("http://{}/artifact", server.addr);
    let result = tokio::time::timeout(PATIENCE, fx.stager.stage_url(&url, &sha256(b"x")))
        .await
        .expect("the configured 1 s timeout ends it");
    let err = result.expect_err("timeout");
    assert!(matches!(err, StageError::Timeout { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&url) && err.to_string().contains("did not deliver within 1s"),
        "{err}"
    );
    assert!(store_files(&fx.stager).is_empty());
}

#[tokio::test]
async fn a_declared_length_above_the_cap_is_refused_up_front() {
    let fx = fixture();
    let server = serve(Bytes::new()).await;
    let url = format!("http://{}/big", server.addr);
    let err = fx
        .stager
        .stage_url(&url, &sha256(b"x"))
        .await
        .expect_err("too large");
    assert!(
        matches!(err, StageError::TooLarge { limit: CAP, size: Some(size), .. } if size == CAP + 1),
        "{err:?}"
    );
    assert!(err.to_string().contains("larger than the limit"), "{err}");
    assert!(store_files(&fx.stager).is_empty());
}

#[tokio::test]
async fn a_streamed_body_crossing_the_cap_is_refused() {
    let fx = fixture();
    let server = serve(Bytes::new()).await;
    let url = format!("http://{}/stream-big", server.addr);
    let err = fx
        .stager
        .stage_url(&url, &sha256(b"x"))
        .await
        .expect_err("too large");
    assert!(
        matches!(
            err,
            StageError::TooLarge {
                limit: CAP,
                size: None,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        store_files(&fx.stager).is_empty(),
        "the partial copy is deleted"
    );
}

#[tokio::test]
async fn a_wrong_digest_over_http_is_refused() {
    let fx = fixture();
    let server = serve(Bytes::from_static(b"#!/bin/sh\nexit 0\n")).await;
    let url = format!("http://{}/good?token=secret", server.addr);
    let expected = sha256(b"another build");
    let err = fx
        .stager
        .stage_url(&url, &expected)
        .await
        .expect_err("mismatch");
    assert!(matches!(err, StageError::DigestMismatch { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains(&expected), "{message}");
    assert!(
        !message.contains("secret"),
        "a URL's query is never shown: {message}"
    );
    assert!(store_files(&fx.stager).is_empty());
}

#[tokio::test]
async fn an_empty_body_and_other_schemes_are_refused() {
    let fx = fixture();
    let server = serve(Bytes::new()).await;
    let err = fx
        .stager
        .stage_url(&format!("http://{}/empty", server.addr), &sha256(b""))
        .await
        .expect_err("empty");
    assert!(matches!(err, StageError::Empty { .. }), "{err:?}");
    for url in ["file:///bin/true", "ftp://127.0.0.1/x", "not a url"] {
        let err = fx
            .stager
            .stage_url(url, &sha256(b"x"))
            .await
            .expect_err("unsupported");
        assert!(
            matches!(err, StageError::UnsupportedUrl { .. }),
            "{url}: {err:?}"
        );
    }
}
