//! Kubernetes mode with the API server unreachable for five minutes, on a
//! real node (real engine, cgroup v2, testapp processes, sockets) and a
//! fake API server behind `tower_test` that can go down.
//!
//! Two attempts are admitted (handed to the engine as watched) when the
//! server goes down: an overlap that will succeed and one whose build
//! answers 500. While it is down every request fails in turn with a 503
//! `Status`, a refused connection, a 502 from a proxy, or no answer at all,
//! and open watches are cut. The test asserts that:
//!
//! - both swaps complete on the node while the server is down, and the
//!   serving generations are what the outcomes say (the successful one
//!   switched, the failed one's incumbent the same process as before);
//! - after recovery each outcome is accepted exactly once, and nothing is
//!   written for an attempt after its outcome was accepted;
//! - the agent does not spin: the outcome writes and the watch restarts
//!   during the outage stay within what their backoff schedules allow
//!   (and the writes never stop);
//! - no attempt is read or run again.
//!
//! The swaps run in real time; once both have ended the clock is paused, so
//! the minutes of outage and the backoff sleeps pass in tokio's virtual time
//! (the whole test takes a few seconds).

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "kube_support/node.rs"]
mod kube_node;
mod kube_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use genswap_crds::EnvVar;
use genswap_runtime::watch_backoff;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use kube::Client;
use kube_node::TestNode;
use kube_support::{GROUP_PATH, NAMESPACE, NODE, attempt_object, start_agent};
use node_agent::kube::report::REQUEST_TIMEOUT;
use node_agent::kube::{KubeAgentConfig, ReportBackoff};
use serde_json::{Value, json};
use tokio::time::Instant;

/// How long the API server is unreachable.
const OUTAGE: Duration = Duration::from_secs(5 * 60);
/// Generous real-time bound for the phases that run real swaps.
const REAL_DEADLINE: Duration = Duration::from_secs(30);
/// Once the API server is back, how long until every outcome it missed is
/// accepted (the report backoff's 4 s ceiling, the watch backoff's 5 s).
const CONVERGENCE: Duration = Duration::from_secs(10);

type ResponseBody = BoxBody<Bytes, Infallible>;
type Handle = tower_test::mock::Handle<Request<kube::client::Body>, Response<ResponseBody>>;
type Responder = tower_test::mock::SendResponse<Response<ResponseBody>>;

/// What a request was.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    List,
    Watch,
    Get(String),
    /// A status write without an outcome (the attempt started).
    Running(String),
    /// A status write carrying an outcome.
    Outcome(String),
    Other(String),
}

/// How it was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Ok,
    Failed(&'static str),
    /// Never answered while the server was down.
    Held,
    /// Arrived after the agent stopped.
    Late,
}

#[derive(Clone, Debug)]
struct Seen {
    kind: Kind,
    at: Instant,
    answer: Answer,
    body: Value,
}

/// A fake API server for SwapAttempts in one namespace: lists, watches,
/// reads and status writes while up; failures while down. Every request is
/// logged with the (tokio) time it arrived.
struct FakeApi {
    handle: Handle,
    objects: BTreeMap<String, Value>,
    resource_version: u64,
    watches: Vec<mpsc::UnboundedSender<Result<Frame<Bytes>, Infallible>>>,
    down: bool,
    failures: usize,
    held: Vec<Responder>,
    log: Vec<Seen>,
}

impl FakeApi {
    fn new(handle: Handle, objects: &[Value]) -> FakeApi {
        let mut api = FakeApi {
            handle,
            objects: BTreeMap::new(),
            resource_version: 100,
            watches: Vec::new(),
            down: false,
            failures: 0,
            held: Vec::new(),
            log: Vec::new(),
        };
        for object in objects {
            api.put(object.clone());
        }
        api
    }

    fn put(&mut self, mut object: Value) -> Value {
        self.resource_version += 1;
        object["metadata"]["resourceVersion"] = self.resource_version.to_string().into();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("a name")
            .to_string();
        self.objects.insert(name, object.clone());
        object
    }

    /// A new attempt, as the controller creates it.
    fn create(&mut self, object: Value) {
        let object = self.put(object);
        self.broadcast("ADDED", &object);
    }

    fn broadcast(&mut self, kind: &str, object: &Value) {
        let mut line =
            serde_json::to_vec(&json!({ "type": kind, "object": object })).expect("event");
        line.push(b'\n');
        self.watches.retain(|feed| {
            feed.unbounded_send(Ok(Frame::data(Bytes::from(line.clone()))))
                .is_ok()
        });
    }

    /// The server goes away: open watches end, every request fails.
    fn go_down(&mut self) {
        self.down = true;
        self.watches.clear();
    }

    /// The server is back; requests that were never answered fail now, as
    /// their connections would.
    fn come_back(&mut self) {
        self.down = false;
        self.held.clear();
    }

    /// Waits for the next request until `until`; `None` when none came.
    async fn next(&mut self, until: Instant) -> Option<(Kind, Value, Responder)> {
        let (request, respond) = tokio::time::timeout_at(until, self.handle.next_request())
            .await
            .ok()
            .flatten()?;
        let (kind, body) = classify(request).await;
        Some((kind, body, respond))
    }

    /// Answers one request as the server is now.
    fn answer(&mut self, kind: Kind, body: Value, respond: Responder) {
        let at = Instant::now();
        let answer = if self.down {
            self.fail(respond)
        } else {
            self.serve(&kind, &body, respond);
            Answer::Ok
        };
        self.log.push(Seen {
            kind,
            at,
            answer,
            body,
        });
    }

    fn serve(&mut self, kind: &Kind, body: &Value, respond: Responder) {
        match kind {
            Kind::List => {
                let items: Vec<Value> = self.objects.values().cloned().collect();
                respond_json(
                    respond,
                    StatusCode::OK,
                    &json!({
                        "apiVersion": "genswap.dev/v1alpha1",
                        "kind": "SwapAttemptList",
                        "metadata": { "resourceVersion": self.resource_version.to_string() },
                        "items": items,
                    }),
                );
            }
            Kind::Watch => {
                let (sender, receiver) = mpsc::unbounded();
                self.watches.push(sender);
                let response = Response::builder()
                    .status(StatusCode::OK)
                    .header("content-type", "application/json")
                    .body(StreamBody::new(receiver).boxed())
                    .expect("response");
                respond.send_response(response);
            }
            Kind::Get(name) => match self.objects.get(name) {
                Some(object) => respond_json(respond, StatusCode::OK, object),
                None => respond_status(respond, StatusCode::NOT_FOUND, "NotFound"),
            },
            Kind::Running(name) | Kind::Outcome(name) => match self.objects.get(name).cloned() {
                Some(mut object) => {
                    object["status"] = body["status"].clone();
                    let object = self.put(object);
                    self.broadcast("MODIFIED", &object);
                    respond_json(respond, StatusCode::OK, &object);
                }
                None => respond_status(respond, StatusCode::NOT_FOUND, "NotFound"),
            },
            Kind::Other(line) => panic!("the agent sent an unexpected request: {line}"),
        }
    }

    /// One failure, in turn: a 503 Status, a refused connection, a proxy's
    /// 502 page, no answer.
    fn fail(&mut self, respond: Responder) -> Answer {
        self.failures += 1;
        match self.failures % 4 {
            0 => {
                respond_status(
                    respond,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailable",
                );
                Answer::Failed("503")
            }
            1 => {
                respond.send_error(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "connection refused",
                ));
                Answer::Failed("connection refused")
            }
            2 => {
                let response = Response::builder()
                    .status(StatusCode::BAD_GATEWAY)
                    .header("content-type", "text/html")
                    .body(Full::new(Bytes::from_static(b"<html>502 Bad Gateway</html>")).boxed())
                    .expect("response");
                respond.send_response(response);
                Answer::Failed("502")
            }
            _ => {
                self.held.push(respond);
                Answer::Held
            }
        }
    }

    /// Serves requests until `done` holds (checked between requests and
    /// every 20 ms), failing the test at `deadline`.
    async fn serve_until(
        &mut self,
        what: &str,
        deadline: Instant,
        mut done: impl FnMut(&FakeApi) -> bool,
    ) {
        while !done(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            let tick = (Instant::now() + Duration::from_millis(20)).min(deadline);
            if let Some((kind, body, respond)) = self.next(tick).await {
                self.answer(kind, body, respond);
            }
        }
    }

    /// Serves whatever comes until `until`.
    async fn serve_for(&mut self, until: Instant) {
        while let Some((kind, body, respond)) = self.next(until).await {
            self.answer(kind, body, respond);
        }
    }

    fn outcomes_accepted(&self, name: &str) -> usize {
        self.log
            .iter()
            .filter(|s| s.kind == Kind::Outcome(name.into()) && s.answer == Answer::Ok)
            .count()
    }

    fn count(&self, kind: &Kind) -> usize {
        self.log.iter().filter(|s| s.kind == *kind).count()
    }

    fn seen(&self, kind: &Kind) -> bool {
        self.count(kind) > 0
    }
}

fn respond_json(respond: Responder, code: StatusCode, body: &Value) {
    let response = Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).expect("json"))).boxed())
        .expect("response");
    respond.send_response(response);
}

fn respond_status(respond: Responder, code: StatusCode, reason: &str) {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("{reason} (the fake API server)"), "reason": reason, "code": code.as_u16(),
    });
    respond_json(respond, code, &body);
}

async fn classify(request: Request<kube::client::Body>) -> (Kind, Value) {
    let (parts, body) = request.into_parts();
    let bytes = body.collect_bytes().await.expect("request body");
    let body: Value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("a JSON body")
    };
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().unwrap_or_default();
    let collection = format!("{GROUP_PATH}/swapattempts");
    let prefix = format!("{GROUP_PATH}/namespaces/{NAMESPACE}/swapattempts/");
    let kind = if parts.method == Method::GET && path == collection {
        if query
            .split('&')
            .any(|p| p == "watch=true" || p == "watch=1")
        {
            Kind::Watch
        } else {
            Kind::List
        }
    } else if let Some(rest) = path.strip_prefix(&prefix) {
        match (parts.method.clone(), rest.strip_suffix("/status")) {
            (Method::GET, None) => Kind::Get(rest.to_string()),
            (Method::PATCH, Some(name)) if body["status"]["outcome"].is_null() => {
                Kind::Running(name.to_string())
            }
            (Method::PATCH, Some(name)) => Kind::Outcome(name.to_string()),
            _ => Kind::Other(format!("{} {path}?{query}", parts.method)),
        }
    } else {
        Kind::Other(format!("{} {path}?{query}", parts.method))
    };
    (kind, body)
}

/// The most tries a backoff allows in `window`: the first at once, then
/// one after each sleep, each sleep at least `shortest(i)`.
fn most_tries(window: Duration, shortest: impl Fn(u32) -> Duration) -> usize {
    let mut slept = Duration::ZERO;
    let mut tries = 1;
    for retry in 0u32.. {
        slept += shortest(retry);
        if slept > window {
            break;
        }
        tries += 1;
    }
    tries
}

fn name(instance: &str, rev: i64) -> String {
    format!("{instance}-{NODE}-{rev}")
}

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: value.into(),
    }
}

#[tokio::test]
async fn an_api_server_unreachable_for_minutes_loses_and_duplicates_no_outcome() {
    let node = TestNode::new("api-outage");
    let b1 = node.build("b1");
    let b2 = node.build("b2");
    let d1 = node.build("d1");
    let d2 = node.build("d2");
    let web1 = attempt_object(
        NAMESPACE,
        &name("web", 1),
        &node.spec("web", 1, &b1, "b1"),
        None,
    );
    let db1 = attempt_object(
        NAMESPACE,
        &name("db", 1),
        &node.spec("db", 1, &d1, "d1"),
        None,
    );
    // web rev 2 boots slowly: it is mid-swap when the server goes down.
    let mut slow = node.spec("web", 2, &b2, "b2");
    slow.process.env.push(env("TESTAPP_BOOT_DELAY_MS", "1500"));
    let web2 = attempt_object(NAMESPACE, &name("web", 2), &slow, None);
    // db rev 2 answers 500 to its health check: failed, d1 keeps serving.
    let mut broken = node.spec("db", 2, &d2, "d2");
    broken.process.env.push(env("TESTAPP_STATUS", "500"));
    broken.health.timeout_seconds = 2;
    let db2 = attempt_object(NAMESPACE, &name("db", 2), &broken, None);

    let (service, handle) =
        tower_test::mock::pair::<Request<kube::client::Body>, Response<ResponseBody>>();
    let mut api = FakeApi::new(handle, &[web1, db1]);
    let mut config = KubeAgentConfig::new(NODE, &node.lock_path);
    config.shutdown_timeout = REAL_DEADLINE;
    // The server goes down as the running statuses are written.
    config.running_report_delay = std::time::Duration::ZERO;
    // The production schedule: 200 ms doubling to 4 s.
    let backoff = ReportBackoff::default();
    assert_eq!(config.report_backoff, backoff);
    let agent = start_agent(
        Client::new(service, "default"),
        node.engine.clone(),
        node.gate.clone(),
        config,
    );

    // Up: both installs run and are reported.
    let deadline = Instant::now() + REAL_DEADLINE;
    api.serve_until("the installs to be reported", deadline, |api| {
        api.outcomes_accepted(&name("web", 1)) == 1 && api.outcomes_accepted(&name("db", 1)) == 1
    })
    .await;
    api.serve_until("the installs acknowledged", deadline, |_| {
        node.pending().is_empty()
    })
    .await;
    let db_before = node.who_serves("db").await.expect("d1 serves");
    let web_before = node.who_serves("web").await.expect("b1 serves");
    assert_eq!(
        (web_before.build.as_str(), db_before.build.as_str()),
        ("b1", "d1")
    );

    // Two attempts arrive and start; the server goes down
    // as their running status is written.
    api.create(web2);
    api.create(db2);
    let admitted = |api: &FakeApi| {
        api.seen(&Kind::Running(name("web", 2))) && api.seen(&Kind::Running(name("db", 2)))
    };
    while !admitted(&api) {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the admissions"
        );
        if let Some((kind, body, respond)) = api.next(deadline).await {
            let second = matches!(&kind, Kind::Running(n) if *n == name("web", 2) || *n == name("db", 2))
                && (api.seen(&Kind::Running(name("web", 2)))
                    || api.seen(&Kind::Running(name("db", 2))));
            if second {
                api.go_down();
            }
            api.answer(kind, body, respond);
        }
    }
    assert!(api.down);
    let outage_start = Instant::now();

    // Down, in real time: both swaps end on the node without the server.
    api.serve_until(
        "both swaps to end while the server is down",
        deadline,
        |_| {
            let pending = node.pending();
            pending.contains(&("web".into(), 2)) && pending.contains(&("db".into(), 2))
        },
    )
    .await;
    let web_after = node.who_serves("web").await.expect("b2 serves");
    assert_eq!(
        (web_after.build.as_str(), web_after.generation),
        ("b2", 2),
        "the admitted overlap completed while the server was down"
    );
    assert!(!swap_host::alive(web_before.pid), "b1 retired");
    assert_eq!(
        node.who_serves("db").await,
        Some(db_before.clone()),
        "d1 keeps serving: same process"
    );
    assert!(!node.generation_cgroup("db", 2).exists(), "d2 left nothing");

    // Down, for the rest of the five minutes, in virtual time.
    tokio::time::pause();
    let outage_end = outage_start + OUTAGE;
    while let Some((kind, body, respond)) = api.next(outage_end).await {
        api.answer(kind, body, respond);
    }
    assert!(Instant::now() >= outage_end);
    let during: Vec<Seen> = api
        .log
        .iter()
        .filter(|s| s.at >= outage_start)
        .cloned()
        .collect();
    assert!(
        node.pending().contains(&("web".into(), 2)) && node.pending().contains(&("db".into(), 2)),
        "the outcomes wait in the journal: {:?}",
        node.pending()
    );

    // Back up (still in virtual time, so backoff sleeps pass at once): each
    // outcome goes through once, and is acknowledged.
    api.come_back();
    let recovered_at = Instant::now();
    let deadline = recovered_at + Duration::from_secs(10 * 60);
    api.serve_until("both outcomes accepted and acknowledged", deadline, |api| {
        api.outcomes_accepted(&name("web", 2)) == 1
            && api.outcomes_accepted(&name("db", 2)) == 1
            && node.pending().is_empty()
    })
    .await;
    // Let the agent run on a while: a duplicate would show up now.
    api.serve_for(Instant::now() + Duration::from_secs(60))
        .await;
    // Converged soon after the server came back: the outcomes written and
    // the watch open again, each within its backoff's ceiling.
    let accepted_at = |kind: &dyn Fn(&Kind) -> bool| {
        api.log
            .iter()
            .find(|s| s.at >= recovered_at && kind(&s.kind) && s.answer == Answer::Ok)
            .map(|s| s.at - recovered_at)
            .expect("answered after recovery")
    };
    let outcomes_after = [name("web", 2), name("db", 2)]
        .iter()
        .map(|attempt| accepted_at(&|k| *k == Kind::Outcome(attempt.clone())))
        .max()
        .expect("two outcomes");
    let watch_after = accepted_at(&|k| matches!(k, Kind::Watch));
    eprintln!(
        "after the outage: outcomes accepted {outcomes_after:?} and the watch open {watch_after:?} after the server came back"
    );
    assert!(
        outcomes_after <= CONVERGENCE,
        "the outcomes took {outcomes_after:?} to reach the server after it came back"
    );
    assert!(
        watch_after <= CONVERGENCE,
        "the watch took {watch_after:?} to reopen after the server came back"
    );
    tokio::time::resume();

    let mut agent = agent;
    agent.begin_stop();
    let stopping = tokio::spawn(async move { agent.stop().await });
    let far = Instant::now() + REAL_DEADLINE;
    while let Some((kind, body, _respond)) = api.next(far).await {
        api.log.push(Seen {
            kind,
            at: Instant::now(),
            answer: Answer::Late,
            body,
        });
    }
    stopping
        .await
        .expect("the stop task")
        .expect("the agent stops cleanly");

    // Each outcome accepted exactly once, and nothing written after it.
    for attempt in [name("web", 1), name("db", 1), name("web", 2), name("db", 2)] {
        let writes: Vec<&Seen> = api
            .log
            .iter()
            .filter(|s| matches!(&s.kind, Kind::Outcome(n) | Kind::Running(n) if *n == attempt))
            .collect();
        let accepted: Vec<usize> = writes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind == Kind::Outcome(attempt.clone()) && s.answer == Answer::Ok)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(accepted.len(), 1, "{attempt}: {writes:#?}");
        assert_eq!(
            accepted[0],
            writes.len() - 1,
            "{attempt}: nothing written after the outcome was accepted: {writes:#?}"
        );
        assert_eq!(
            api.count(&Kind::Get(attempt.clone())),
            0,
            "{attempt} runs on its watched copy, never read"
        );
    }
    let outcome_of = |attempt: &str| {
        api.log
            .iter()
            .find(|s| s.kind == Kind::Outcome(attempt.into()) && s.answer == Answer::Ok)
            .map(|s| s.body["status"].clone())
            .expect("an accepted outcome")
    };
    let web = outcome_of(&name("web", 2));
    assert_eq!(
        (web["outcome"].as_str(), web["generation"].as_u64()),
        (Some("done"), Some(2)),
        "{web:#}"
    );
    let db = outcome_of(&name("db", 2));
    assert_eq!(db["outcome"], "failed", "{db:#}");
    assert!(
        db["reason"]
            .as_str()
            .is_some_and(|r| r.contains("answered 500")),
        "{db:#}"
    );

    // No spinning during the outage: the outcome writes stay within the
    // report backoff (each sleep at least half its ceiling) and never stop
    // for long (a sleep is at most the 4 s ceiling, a hung write is cut at
    // REQUEST_TIMEOUT).
    for attempt in [name("web", 2), name("db", 2)] {
        let tries: Vec<Instant> = during
            .iter()
            .filter(|s| s.kind == Kind::Outcome(attempt.clone()))
            .map(|s| s.at)
            .collect();
        let first = *tries.first().expect("outcome writes during the outage");
        let last = *tries.last().expect("outcome writes during the outage");
        let window = last - first + Duration::from_millis(100);
        let allowed = most_tries(window, |retry| backoff.ceiling(retry) / 2);
        assert!(
            tries.len() <= allowed,
            "{attempt}: {} writes in {window:?}, the backoff allows {allowed}",
            tries.len()
        );
        let longest_gap = backoff.max + REQUEST_TIMEOUT + Duration::from_secs(1);
        let gaps_end = outage_end - last;
        assert!(
            gaps_end <= longest_gap,
            "{attempt}: the writes stopped {gaps_end:?} before the outage ended"
        );
        for pair in tries.windows(2) {
            assert!(
                pair[1] - pair[0] <= longest_gap,
                "{attempt}: a gap of {:?}",
                pair[1] - pair[0]
            );
        }
        eprintln!(
            "{attempt}: {} outcome writes over the {OUTAGE:?} outage",
            tries.len()
        );
    }
    // The watch restarts stay within the watcher's backoff.
    let restarts = during
        .iter()
        .filter(|s| matches!(s.kind, Kind::List | Kind::Watch))
        .count();
    let allowed = 1 + most_tries(OUTAGE, |retry| {
        watch_backoff::FIRST
            .saturating_mul(1u32.checked_shl(retry.min(16)).unwrap_or(u32::MAX))
            .min(watch_backoff::CEILING)
    });
    assert!(
        restarts <= allowed,
        "{restarts} list/watch requests in {OUTAGE:?}, allowed {allowed}"
    );
    // Nothing else was asked while down: no reads, no running writes after
    // the swaps ended.
    let others: Vec<&Seen> = during
        .iter()
        .filter(|s| matches!(s.kind, Kind::Get(_) | Kind::Other(_)))
        .collect();
    assert!(others.is_empty(), "{others:#?}");
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    for seen in &during {
        *answers.entry(format!("{:?}", seen.answer)).or_default() += 1;
    }
    eprintln!(
        "{} requests during the outage ({restarts} list/watch; answered {answers:?}), {} after recovery",
        during.len(),
        api.log.iter().filter(|s| s.at >= recovered_at).count()
    );

    // The agent is gone; the generations keep serving.
    assert_eq!(node.who_serves("web").await, Some(web_after));
    assert_eq!(node.who_serves("db").await, Some(db_before));
    node.tear_down(&["web", "db"]).await;
}
