//! Bad artifacts through the whole engine, each against a serving
//! incumbent: the attempt ends `abandoned` with `executed: false` at a
//! `stale` stage step, the reason names the file or URL and the rule, the
//! incumbent keeps serving, and nothing of the refused build is left (no
//! generation cgroup, socket, process or store file). `swap_refusals.rs`
//! has the digest, outside-the-root, escaping-symlink, missing and
//! not-executable rows; `stage_path.rs` and `stage_url.rs` test the stager
//! alone. Last, an artifact replaced between its hashing and the exec: the
//! verified store copy is what runs, as `/proc/<pid>/exe` shows.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::convert::Infallible;
use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use genswap_crds::{Artifact, Outcome};
use genswap_store::{Stager, StagerConfig, Store};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use node_agent::cgroup::CgroupManager;
use node_agent::classify::StepOutcome;
use node_agent::engine::{Attempt, Cancel, Engine, EngineConfig, EngineParts, Step, SwapResult};
use node_agent::gate::{AttemptGate, AttemptId, GatePoint, GateRefusal};
use node_agent::journal::Journal;
use node_agent::switch::RunLayout;
use sha2::{Digest, Sha256};
use swap_host::{NOBODY, OpenGate, SwapHost};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The cap of the engine the URL tests build: above a debug testapp (the
/// installed incumbent is staged under it too).
const CAP: u64 = 64 << 20;

/// Runs `attempt` on `engine` against a serving incumbent and checks the
/// refusal: abandoned, executed false, a stale stage step last, every
/// phrase of `says` in the reason, the incumbent still serving, and only
/// its generation left.
async fn assert_refused(
    host: &SwapHost,
    engine: &Engine,
    attempt: &Attempt,
    says: &[&str],
) -> SwapResult {
    let before = host.who_serves().await.expect("the incumbent serves");
    let result = engine.swap(attempt, &OpenGate, &Cancel::new()).await;
    check_refusal(host, &result, says);
    host.assert_still_serves(&before).await;
    result
}

fn check_refusal(host: &SwapHost, result: &SwapResult, says: &[&str]) {
    eprintln!("reason: {}", result.reason);
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed, "nothing of the build ran: {result:?}");
    let last = result.steps.last().expect("a step record");
    assert_eq!(
        (last.step, last.result),
        (Step::Stage, StepOutcome::Stale),
        "{result:?}"
    );
    assert!(
        result
            .reason
            .starts_with("stage: staging refused the artifact: "),
        "{}",
        result.reason
    );
    swap_host::assert_says(&result.reason, says);
    assert_eq!(result.generation, None, "no generation was reserved");
    assert_no_partial_store_files(host);
}

/// The store holds only complete, verified entries: no temp file of a
/// refused copy.
fn assert_no_partial_store_files(host: &SwapHost) {
    let leftovers: Vec<String> = fs::read_dir(store_dir(host))
        .expect("the store")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !name.starts_with("sha256-"))
        .collect();
    assert!(leftovers.is_empty(), "partial store files: {leftovers:?}");
}

fn store_dir(host: &SwapHost) -> PathBuf {
    host.staging.parent().expect("the host dir").join("store")
}

fn store_entries(host: &SwapHost) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(store_dir(host))
        .expect("the store")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[tokio::test]
async fn an_empty_artifact_is_refused() {
    let host = SwapHost::new("bad-empty");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    fs::write(&b2.path, b"").expect("empty it");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.build.sha256 = sha256(b"");
    let path = b2.path.display().to_string();
    assert_refused(&host, &host.engine, &attempt, &[&path, "is empty"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn a_directory_is_refused() {
    let host = SwapHost::new("bad-dir");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    let dir = host.staging.join("b2.d");
    fs::create_dir(&dir).expect("a directory");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.build.artifact.path = Some(dir.display().to_string());
    let path = dir.display().to_string();
    assert_refused(&host, &host.engine, &attempt, &[&path, "is a directory"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn a_dot_dot_path_is_refused_even_when_it_lands_inside_the_root() {
    let host = SwapHost::new("bad-dotdot");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    let name = b2.path.file_name().expect("a file name").to_string_lossy();
    let sneaky = format!("{}/../staging/{name}", host.staging.display());
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.build.artifact.path = Some(sneaky.clone());
    assert_refused(&host, &host.engine, &attempt, &[&sneaky, "'..'"]).await;
    host.tear_down().await;
}

/// The agent stages with its own credentials; as root it reads any file.
/// This runs the attempt on a runtime whose blocking threads (where the
/// engine does its file work: journal and staging) have the filesystem uid
/// `nobody`, so opening a mode 0111 artifact really fails with EACCES, as
/// it would for an agent that a permission or an LSM denies. The journal is
/// handed to `nobody` first so that only the artifact is out of reach.
#[tokio::test]
async fn an_unreadable_artifact_is_refused() {
    let host = SwapHost::new("bad-unreadable");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");
    let b2 = host.build("b2");
    fs::set_permissions(&b2.path, fs::Permissions::from_mode(0o111)).expect("chmod 0111");
    let nobody = u32::try_from(NOBODY).expect("a uid");
    give_to(&host.state_dir, nobody);
    let attempt = host.attempt(2, &b2, "b2");

    let result = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .on_thread_start(|| {
                        nix::unistd::setfsuid(nix::unistd::Uid::from_raw(65534));
                    })
                    .build()
                    .expect("a runtime");
                runtime.block_on(host.engine.swap(&attempt, &OpenGate, &Cancel::new()))
            })
            .join()
            .expect("the swap thread")
    });

    let path = b2.path.display().to_string();
    check_refusal(
        &host,
        &result,
        &[&path, "is not readable", "Permission denied"],
    );
    host.assert_still_serves(&before).await;
    give_to(&host.state_dir, 0);
    host.tear_down().await;
}

/// Chowns `dir` and everything under it.
fn give_to(dir: &Path, uid: u32) {
    chown(dir, Some(uid), Some(uid)).expect("chown");
    for entry in fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            give_to(&path, uid);
        } else {
            chown(&path, Some(uid), Some(uid)).expect("chown");
        }
    }
}

/// An engine over `host`'s own cgroup subtree, run dir, journal and store,
/// with the stager settings `tune` picks; the URL tests use it instead of
/// `host.engine` (whose stager has the production defaults: 1 GiB, 5 min).
fn engine_with(host: &SwapHost, tune: impl FnOnce(&mut StagerConfig)) -> Engine {
    let mut config = StagerConfig::new(&host.staging);
    tune(&mut config);
    let stager = Stager::new(Store::open(store_dir(host)).expect("store"), config).expect("stager");
    let cgroups = CgroupManager::open(
        host.instance_cgroup()
            .parent()
            .expect("the instance cgroup's parent"),
    )
    .expect("the cgroup manager");
    let logs = swap_host::test_log_sink(&host.log_dir(), &cgroups);
    Engine::new(
        EngineParts {
            logs,
            cgroups,
            layout: RunLayout::new(&host.run_dir),
            stager,
            journal: Journal::open(&host.state_dir).expect("journal"),
        },
        EngineConfig::default(),
    )
}

/// A host whose URL engine has a 1 MiB cap and 1 s timeouts, serving b1.
async fn url_host(tag: &str) -> (SwapHost, Engine) {
    let host = SwapHost::new(tag);
    let engine = engine_with(&host, |config| {
        config.max_bytes = CAP;
        config.connect_timeout = Duration::from_secs(1);
        config.download_timeout = Duration::from_secs(1);
    });
    let b1 = host.build("b1");
    let result = engine
        .swap(&host.attempt(1, &b1, "b1"), &OpenGate, &Cancel::new())
        .await;
    assert_eq!(result.outcome, Outcome::Done, "install: {result:?}");
    (host, engine)
}

async fn url_tear_down(host: &SwapHost, engine: &Engine) {
    engine
        .stop_instance(&host.instance, &Default::default())
        .await
        .expect("stop the instance");
    host.assert_only(None);
}

fn url_attempt(host: &SwapHost, url: &str) -> Attempt {
    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.build.artifact = Artifact {
        path: None,
        url: Some(url.to_string()),
        image: None,
        unpack: None,
    };
    attempt
}

/// An HTTP server on loopback, aborted on drop.
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

async fn route(request: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let chunk = Bytes::from(vec![1u8; 1 << 20]);
    let chunks_past_the_cap = usize::try_from(CAP >> 20).expect("cap fits") + 2;
    let response = match request.uri().path() {
        // A declared length above the cap (the body would never come).
        "/big" => {
            let never = futures::stream::pending::<Result<Frame<Bytes>, Infallible>>();
            let mut response = Response::new(StreamBody::new(never).boxed_unsync());
            response
                .headers_mut()
                .insert(http::header::CONTENT_LENGTH, (CAP + 1).into());
            response
        }
        // No declared length: too big only while streaming.
        "/stream-big" => {
            let chunks = (0..chunks_past_the_cap).map(move |_| Ok(Frame::data(chunk.clone())));
            Response::new(StreamBody::new(futures::stream::iter(chunks)).boxed_unsync())
        }
        // Headers, then a body that never ends.
        "/trickle" => {
            let never = futures::stream::pending::<Result<Frame<Bytes>, Infallible>>();
            Response::new(StreamBody::new(never).boxed_unsync())
        }
        _ => {
            let mut response = Response::new(Empty::new().boxed_unsync());
            *response.status_mut() = StatusCode::NOT_FOUND;
            response
        }
    };
    Ok(response)
}

async fn serve() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(route))
                    .await;
            });
        }
    });
    Server { addr, task }
}

/// Accepts connections, reads nothing, answers nothing.
async fn serve_nothing() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    Server { addr, task }
}

#[tokio::test]
async fn a_url_that_answers_404_is_refused_with_the_status() {
    let (host, engine) = url_host("bad-url-404").await;
    let server = serve().await;
    let url = format!("http://{}/builds/b2", server.addr);
    let attempt = url_attempt(&host, &url);
    let entries = store_entries(&host);
    assert_refused(&host, &engine, &attempt, &[&url, "answered 404"]).await;
    assert_eq!(store_entries(&host), entries, "nothing was stored");
    url_tear_down(&host, &engine).await;
}

#[tokio::test]
async fn a_url_that_never_answers_times_out() {
    let (host, engine) = url_host("bad-url-silent").await;
    let server = serve_nothing().await;
    let url = format!("http://{}/builds/b2", server.addr);
    let attempt = url_attempt(&host, &url);
    assert_refused(
        &host,
        &engine,
        &attempt,
        &[&url, "did not deliver within 1s"],
    )
    .await;
    url_tear_down(&host, &engine).await;
}

#[tokio::test]
async fn a_url_whose_body_never_ends_times_out_and_leaves_no_partial_file() {
    let (host, engine) = url_host("bad-url-trickle").await;
    let server = serve().await;
    let url = format!("http://{}/trickle", server.addr);
    let attempt = url_attempt(&host, &url);
    let entries = store_entries(&host);
    assert_refused(&host, &engine, &attempt, &[&url, "within 1s"]).await;
    assert_eq!(store_entries(&host), entries);
    url_tear_down(&host, &engine).await;
}

#[tokio::test]
async fn a_url_larger_than_the_cap_is_refused_declared_or_streamed() {
    let (host, engine) = url_host("bad-url-big").await;
    let server = serve().await;
    let entries = store_entries(&host);
    for path in ["big", "stream-big"] {
        let url = format!("http://{}/{path}", server.addr);
        let attempt = url_attempt(&host, &url);
        assert_refused(
            &host,
            &engine,
            &attempt,
            &[&url, &format!("larger than the limit of {CAP} bytes")],
        )
        .await;
    }
    assert_eq!(store_entries(&host), entries, "nothing was stored");
    url_tear_down(&host, &engine).await;
}

/// Replaces the artifact's source file when the gate is asked right before
/// the exec: after staging hashed and copied it, before anything runs.
struct ReplaceAtExec {
    source: PathBuf,
    replaced: Mutex<bool>,
}

impl AttemptGate for ReplaceAtExec {
    fn check(&self, point: GatePoint, _attempt: &AttemptId) -> Result<(), GateRefusal> {
        if point == GatePoint::Exec {
            let temp = self.source.with_extension("evil");
            fs::write(&temp, b"#!/bin/sh\nexit 3\n").expect("write the replacement");
            fs::set_permissions(&temp, fs::Permissions::from_mode(0o755)).expect("chmod");
            fs::rename(&temp, &self.source).expect("replace the source");
            *self.replaced.lock().expect("flag") = true;
        }
        Ok(())
    }
}

#[tokio::test]
async fn an_artifact_replaced_between_hashing_and_exec_does_not_matter() {
    let host = SwapHost::new("bad-replaced");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    let gate = ReplaceAtExec {
        source: b2.path.clone(),
        replaced: Mutex::new(false),
    };
    let result = host
        .engine
        .swap(&host.attempt(2, &b2, "b2"), &gate, &Cancel::new())
        .await;

    assert!(*gate.replaced.lock().expect("flag"), "the gate ran at exec");
    assert_ne!(
        sha256(&fs::read(&b2.path).expect("the source")),
        b2.sha256,
        "the source now holds other bytes"
    );
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let serving = host.who_serves().await.expect("b2 serves");
    assert_eq!(
        (serving.build.as_str(), Some(serving.generation)),
        ("b2", result.generation)
    );
    // The kernel's word on what runs: the store copy, with the pinned digest.
    let exe = fs::read_link(format!("/proc/{}/exe", serving.pid)).expect("/proc/<pid>/exe");
    assert_eq!(exe, store_dir(&host).join(format!("sha256-{}", b2.sha256)));
    let running = fs::read(format!("/proc/{}/exe", serving.pid)).expect("the running file");
    assert_eq!(sha256(&running), b2.sha256);
    assert!(!exe.starts_with(&host.staging), "never run from staging");
    host.assert_only(result.generation);
    host.tear_down().await;
}
