//! `kubectl genswap` against a mocked API server (kube's `tower-test`
//! pattern): the tree of a mid-rollout object (golden text), each verb's
//! exact request, and the refusals a human must be able to act on.
//!
//! What the mock cannot catch: what a real API server makes of each write
//! (the schema, managed fields, what other fields keep). `apiserver.rs`
//! runs every verb after every other against a real one.

use std::sync::{Arc, Mutex};

use genswap_crds::{InstanceGeneration, SwapAttempt};
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::client::Body;
use kubectl_genswap::render::Colour;
use kubectl_genswap::{Command, Output, Terminal, run};
use serde_json::{Value, json};

const NAMESPACE: &str = "prod";
const IG_PATH: &str = "/apis/genswap.dev/v1alpha1/namespaces/prod/instancegenerations/web";
const IG_LIST_PATH: &str = "/apis/genswap.dev/v1alpha1/namespaces/prod/instancegenerations";
const ATTEMPTS_PATH: &str = "/apis/genswap.dev/v1alpha1/namespaces/prod/swapattempts";
/// 2027-01-15T08:00:00Z: every age in the fixture is counted from here.
const NOW: i64 = 1_800_000_000;

fn now() -> Timestamp {
    Timestamp::from_second(NOW).unwrap_or(Timestamp::UNIX_EPOCH)
}

fn token() -> String {
    "token-2".into()
}

fn sha(build: &str) -> String {
    let hex: String = build.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{hex:0<64}")
}

fn at(seconds_before_now: i64) -> String {
    let t = Timestamp::from_second(NOW - seconds_before_now).unwrap_or(Timestamp::UNIX_EPOCH);
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// `web` in `prod`, three nodes, b2 released over b1: the canary `a` is
/// done, `b` runs its attempt, `c` waits; `b` restarted once after a kill.
fn mid_rollout() -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": "web", "namespace": NAMESPACE, "uid": "u1", "generation": 2, "resourceVersion": "10"},
        "spec": {
            "build": {"id": "b2", "artifact": {"path": "/srv/builds/b2"}, "sha256": sha("b2")},
            "retry": "token-1",
            "rollout": {"canaryNodes": 1, "maxParallel": "10%",
                        "waves": {"byLabel": "topology.kubernetes.io/zone"}}
        },
        "status": {
            "observedGeneration": 2,
            "schedRev": 5,
            "ready": "1/3",
            "goodBuild": "b1",
            "history": [
                {"build": "b1", "sha256": sha("b1"), "artifact": {"url": "https://builds.example/b1"}, "at": at(7200)}
            ],
            "nodes": [
                {"name": "a", "generation": 4, "build": "b2", "serving": true,
                 "sidecars": [{"name": "exporter", "state": "Running", "generation": 4}]},
                {"name": "b", "generation": 2, "build": "b1", "serving": true, "restarts": 1,
                 "lastExit": {"generation": 2, "signal": 9, "at": at(600)},
                 "sidecars": [{"name": "exporter", "state": "BackOff", "generation": 2, "restarts": 3,
                               "lastExit": {"exitCode": 1, "at": at(30)},
                               "message": "exit code 1, 3 in a row; starting it again in 40.0s"}]},
                {"name": "c", "generation": 3, "build": "b1", "serving": true}
            ],
            "rollout": {"wave": "zone-b", "waveIndex": 2, "waves": 3, "lastProgressTime": at(60),
                        "analysis": {"build": "b2", "wave": "zone-a", "waveIndex": 1, "phase": "Passed",
                                     "measurements": 3, "failures": 1, "lastMeasuredTime": at(70),
                                     "message": "query error-rate gave 0.02 for {}, above its max 0.01"}},
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "RolloutInProgress", "message": "1/3 nodes serve build b2; not yet: b, c", "lastTransitionTime": at(60)},
                {"type": "Reconciling", "status": "True", "reason": "RolloutInProgress", "message": "moving to build b2: 1 attempt(s) in flight, 1 node(s) waiting their turn", "lastTransitionTime": at(60)},
                {"type": "Stalled", "status": "False", "reason": "RolloutInProgress", "message": "progress needs no human", "lastTransitionTime": at(60)}
            ]
        }
    })
}

fn attempt(
    node: &str,
    rev: i64,
    cause: &str,
    build: &str,
    age: i64,
    status: Option<Value>,
) -> Value {
    let mut attempt = json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "SwapAttempt",
        "metadata": {
            "name": format!("web-{node}-{rev}"), "namespace": NAMESPACE,
            "labels": {"genswap.dev/instance": "web", "genswap.dev/node": node},
            "creationTimestamp": at(age)
        },
        "spec": {
            "instance": "web", "nodeName": node, "schedRev": rev, "cause": cause,
            "build": {"id": build, "artifact": {"path": format!("/srv/builds/{build}")}, "sha256": sha(build)},
            "mode": "overlap"
        }
    });
    if let Some(status) = status {
        attempt["status"] = status;
    }
    attempt
}

fn attempts() -> Vec<Value> {
    let done = |drain: i64| json!({"outcome": "done", "effectiveMode": "overlap", "executed": true, "drainMs": drain});
    vec![
        attempt("a", 1, "install", "b1", 7300, Some(done(0))),
        attempt("a", 4, "release", "b2", 50, Some(done(3))),
        attempt("b", 2, "install", "b1", 7250, Some(done(0))),
        attempt("b", 5, "release", "b2", 5, None),
        attempt(
            "c",
            3,
            "install",
            "b1",
            7200,
            Some(
                json!({"outcome": "abandoned", "effectiveMode": "hold", "executed": false, "reason": "superseded by rev 6"}),
            ),
        ),
    ]
}

/// A request as the mock saw it.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    uri: String,
    content_type: Option<String>,
    body: Option<Value>,
}

/// How the mock answers.
#[derive(Clone)]
struct Script {
    ig: Option<Value>,
    /// Answer writes with 403.
    forbid_writes: bool,
    /// Answer the attempts' list with 403.
    forbid_attempts: bool,
    /// The attempts the list answers with, two to a page.
    attempts: Vec<Value>,
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message})
}

/// A client whose API server answers from `script` and records requests.
fn mocked(script: Script) -> (Client, Arc<Mutex<Vec<Seen>>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        // Watches of attempts stay open and silent: kept, never answered.
        let mut open_watches = Vec::new();
        let mut held_ig_watch = None;
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body: Option<Value> = serde_json::from_slice(&bytes).ok();
            let uri = parts.uri.to_string();
            record.lock().unwrap_or_else(|e| e.into_inner()).push(Seen {
                method: parts.method.clone(),
                uri: uri.clone(),
                content_type: parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
                body: body.clone(),
            });
            let path = parts.uri.path();
            let query = parts.uri.query().unwrap_or_default();
            if query.contains("watch=true") {
                // The IG's watch reports one change (the rollout paused),
                // and only once the attempts' watch is open: both lists
                // have been drawn by then, so the first frame is the listed
                // state and the second the change.
                if path == ATTEMPTS_PATH {
                    open_watches.push(send);
                    if let Some(ig_watch) = held_ig_watch.take() {
                        answer_ig_watch(&script, ig_watch);
                    }
                } else if open_watches.is_empty() {
                    held_ig_watch = Some(send);
                } else {
                    answer_ig_watch(&script, send);
                }
                continue;
            }
            let (code, answer) = match (&parts.method, path) {
                (&Method::GET, IG_LIST_PATH) => (
                    200,
                    json!({"apiVersion": "genswap.dev/v1alpha1", "kind": "InstanceGenerationList", "metadata": {"resourceVersion": "10"}, "items": script.ig.iter().cloned().collect::<Vec<_>>()}),
                ),
                (&Method::GET, IG_PATH) => match &script.ig {
                    Some(ig) => (200, ig.clone()),
                    None => (
                        404,
                        status(
                            404,
                            "NotFound",
                            "instancegenerations.genswap.dev \"web\" not found",
                        ),
                    ),
                },
                (&Method::GET, ATTEMPTS_PATH) if script.forbid_attempts => (
                    403,
                    status(
                        403,
                        "Forbidden",
                        "swapattempts.genswap.dev is forbidden: User \"dev\" cannot list resource \"swapattempts\"",
                    ),
                ),
                (&Method::GET, ATTEMPTS_PATH) => {
                    // Two to a page, as a server paging a fleet's attempts.
                    let page: usize = query
                        .split('&')
                        .find_map(|pair| pair.strip_prefix("continue=page"))
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0);
                    let items: Vec<Value> = script
                        .attempts
                        .iter()
                        .skip(page * 2)
                        .take(2)
                        .cloned()
                        .collect();
                    let more = script.attempts.len() > (page + 1) * 2;
                    let token = if more {
                        format!("page{}", page + 1)
                    } else {
                        String::new()
                    };
                    (
                        200,
                        json!({"apiVersion": "genswap.dev/v1alpha1", "kind": "SwapAttemptList", "metadata": {"resourceVersion": "11", "continue": token}, "items": items}),
                    )
                }
                (&Method::PATCH, IG_PATH) if script.forbid_writes => (
                    403,
                    status(
                        403,
                        "Forbidden",
                        "instancegenerations.genswap.dev \"web\" is forbidden: User \"dev\" cannot patch resource \"instancegenerations\"",
                    ),
                ),
                (&Method::PATCH, IG_PATH) => (200, script.ig.clone().unwrap_or_default()),
                _ => (404, status(404, "NotFound", "no such path in the mock")),
            };
            let response = Response::builder()
                .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(&answer).unwrap_or_default()))
                .expect("a well-formed response");
            send.send_response(response);
        }
    });
    (Client::new(service, NAMESPACE), seen)
}

fn answer_ig_watch(script: &Script, send: tower_test::mock::SendResponse<Response<Body>>) {
    let mut ig = script.ig.clone().unwrap_or_default();
    ig["spec"]["rollout"]["paused"] = json!(true);
    ig["metadata"]["resourceVersion"] = json!("12");
    let event = json!({"type": "MODIFIED", "object": ig});
    let mut line = serde_json::to_vec(&event).unwrap_or_default();
    line.push(b'\n');
    let response = Response::builder()
        .status(StatusCode::OK)
        .body(Body::from(line))
        .expect("a well-formed response");
    send.send_response(response);
}

/// Runs `command` against the mock; returns what it printed, or its error.
async fn plugin(command: Command, script: Script) -> (Result<String, String>, Vec<Seen>) {
    let (client, seen) = mocked(script);
    let mut out = Vec::new();
    let result = {
        let mut terminal = Terminal {
            out: &mut out,
            colour: Colour::Off,
            redraw: false,
            now,
            token,
        };
        run(command, client, NAMESPACE, &mut terminal).await
    };
    let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (
        result
            .map(|()| String::from_utf8_lossy(&out).into_owned())
            .map_err(|e| e.to_string()),
        seen,
    )
}

fn serving() -> Script {
    Script {
        ig: Some(mid_rollout()),
        forbid_writes: false,
        forbid_attempts: false,
        attempts: attempts(),
    }
}

fn get(name: &str) -> Command {
    Command::Get {
        name: name.into(),
        watch: false,
        node: None,
        output: Output::Text,
    }
}

/// The one write a verb made: its uri and its body.
fn the_write(seen: &[Seen]) -> (&str, &Value) {
    let writes: Vec<&Seen> = seen.iter().filter(|s| s.method != Method::GET).collect();
    assert_eq!(writes.len(), 1, "exactly one write: {seen:?}");
    let write = writes[0];
    assert_eq!(write.method, Method::PATCH);
    assert_eq!(
        write.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    (
        write.uri.as_str(),
        write.body.as_ref().expect("a JSON body"),
    )
}

const PATCH_QUERY: &str = "?&fieldManager=kubectl-genswap";

#[tokio::test]
async fn get_draws_the_mid_rollout_tree() {
    let (printed, seen) = plugin(get("web"), serving()).await;
    let printed = printed.expect("get succeeds");
    let golden = include_str!("golden/get_mid_rollout.txt");
    assert_eq!(printed, golden, "the tree changed; got:\n{printed}");
    let uris: Vec<&str> = seen.iter().map(|s| s.uri.as_str()).collect();
    let list = format!("{ATTEMPTS_PATH}?&labelSelector=genswap.dev%2Finstance%3Dweb&limit=500");
    assert_eq!(
        uris,
        [
            IG_PATH.to_string(),
            list.clone(),
            format!("{list}&continue=page1"),
            format!("{list}&continue=page2"),
        ],
        "the attempts are read page by page"
    );
}

#[tokio::test]
async fn get_in_colour_is_the_same_tree_with_styles() {
    let (client, _) = mocked(serving());
    let mut out = Vec::new();
    let mut terminal = Terminal {
        out: &mut out,
        colour: Colour::On,
        redraw: false,
        now,
        token,
    };
    run(get("web"), client, NAMESPACE, &mut terminal)
        .await
        .expect("get succeeds");
    let coloured = String::from_utf8_lossy(&out).into_owned();
    assert!(coloured.contains("\x1b["), "no styles: {coloured}");
    let plain: String = strip_ansi(&coloured);
    assert_eq!(plain, include_str!("golden/get_mid_rollout.txt"));
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[tokio::test]
async fn get_node_reads_that_nodes_record_from_its_attempt_in_pages() {
    // Node d is past the status's listing: its record is on its attempt.
    let mut script = serving();
    let mut on_d = attempt(
        "d",
        6,
        "release",
        "b2",
        30,
        Some(
            json!({"outcome": "failed", "effectiveMode": "overlap", "executed": true, "reason": "unhealthy"}),
        ),
    );
    let record = json!({
        "node": {"name": "d", "build": "b1", "generation": 3, "serving": true},
        "heldDown": [{"build": "b2", "mode": "overlap", "node": "d", "reason": "unhealthy", "since": at(30)}],
    });
    on_d["metadata"]["annotations"] = json!({"genswap.dev/record": record.to_string()});
    script.attempts.push(on_d);
    let command = Command::Get {
        name: "web".into(),
        watch: false,
        node: Some("d".into()),
        output: Output::Text,
    };
    let (printed, seen) = plugin(command, script).await;
    let printed = printed.expect("get succeeds");
    assert!(
        printed.contains("node d  rest  serving b1 as generation 3\n"),
        "{printed}"
    );
    assert!(
        printed.contains("rev 6  release  overlap  failed"),
        "{printed}"
    );
    assert!(!printed.contains("node a"), "one node only: {printed}");
    let lists: Vec<&str> = seen
        .iter()
        .filter(|s| s.uri.starts_with(ATTEMPTS_PATH))
        .map(|s| s.uri.as_str())
        .collect();
    assert_eq!(lists.len(), 3, "six attempts in pages of two: {lists:?}");
    assert!(
        lists.iter().all(|uri| uri.contains("limit=500")
            && uri.contains("labelSelector=genswap.dev%2Finstance%3Dweb%2Cgenswap.dev%2Fnode%3Dd")),
        "{lists:?}"
    );
}

#[tokio::test]
async fn get_as_json_carries_the_same_facts() {
    let command = Command::Get {
        name: "web".into(),
        watch: false,
        node: None,
        output: Output::Json,
    };
    let (printed, _) = plugin(command, serving()).await;
    let tree: Value = serde_json::from_str(&printed.expect("get succeeds")).expect("JSON");
    assert_eq!(tree["build"], "b2");
    assert_eq!(tree["nodes"][0]["cohort"], "canary");
    assert_eq!(tree["nodes"][1]["attempts"][0]["outcome"], "running");
    assert_eq!(
        tree["nodes"][1]["lastExit"],
        "generation 2 signal 9 (SIGKILL)"
    );
    assert_eq!(tree["nodes"][2]["attempts"][0]["mode"], "hold");
    assert_eq!(tree["history"], json!(["b1"]));
}

#[tokio::test]
async fn retry_writes_a_fresh_token_when_the_build_is_held_down() {
    let mut ig = mid_rollout();
    ig["status"]["heldDown"] = json!([{"build": "b2", "mode": "overlap", "node": "a", "reason": "unhealthy", "since": at(30)}]);
    let script = Script {
        ig: Some(ig),
        forbid_writes: false,
        forbid_attempts: false,
        attempts: attempts(),
    };
    let (printed, seen) = plugin(Command::Retry { name: "web".into() }, script).await;
    assert_eq!(
        printed.expect("retry succeeds"),
        "prod/web: spec.retry is token-2: one more attempt of a held-down build is armed\n"
    );
    let (uri, body) = the_write(&seen);
    assert_eq!(uri, format!("{IG_PATH}{PATCH_QUERY}"));
    assert_eq!(body, &json!({"spec": {"retry": "token-2"}}));
}

#[tokio::test]
async fn retry_says_there_is_nothing_to_retry_and_writes_nothing() {
    let (result, seen) = plugin(Command::Retry { name: "web".into() }, serving()).await;
    assert_eq!(
        result.expect_err("nothing is held down"),
        "prod/web: nothing to retry: build b2 is not held down (status.heldDown is empty)"
    );
    assert!(seen.iter().all(|s| s.method == Method::GET), "no write");

    // Held down is another build, not the one the spec asks for.
    let mut ig = mid_rollout();
    ig["status"]["heldDown"] = json!([{"build": "b0", "mode": "overlap", "node": "c", "reason": "unhealthy", "since": at(900)}]);
    let script = Script {
        ig: Some(ig),
        forbid_writes: false,
        forbid_attempts: false,
        attempts: attempts(),
    };
    let (result, _) = plugin(Command::Retry { name: "web".into() }, script).await;
    assert_eq!(
        result.expect_err("b2 is not held down"),
        "prod/web: nothing to retry: build b2 is not held down (status.heldDown has b0 on c)"
    );
}

#[tokio::test]
async fn undo_writes_the_previous_good_build_back_as_it_was_released() {
    let command = Command::Undo {
        name: "web".into(),
        to_build: None,
    };
    let (printed, seen) = plugin(command, serving()).await;
    assert_eq!(
        printed.expect("undo succeeds"),
        "prod/web: spec.build is b1 again (sha256 623100000000); it rolls out as a release\n"
    );
    let (uri, body) = the_write(&seen);
    assert_eq!(uri, format!("{IG_PATH}{PATCH_QUERY}"));
    assert_eq!(
        body,
        &json!({
            "metadata": {"resourceVersion": "10"},
            // Every source field is written, the unused ones null (a merge
            // patch removes them), and the entrypoint with them: nothing of
            // the build being replaced is left over.
            "spec": {"build": {
                "id": "b1",
                "artifact": {"path": null, "url": "https://builds.example/b1", "image": null, "unpack": null},
                "sha256": sha("b1"),
                "entrypoint": null,
            }},
        })
    );
}

#[tokio::test]
async fn undo_refuses_when_the_history_has_nothing_to_go_back_to() {
    let mut ig = mid_rollout();
    ig["status"]["history"] = json!([{"build": "b2", "sha256": sha("b2"), "artifact": {"path": "/srv/builds/b2"}, "at": at(10)}]);
    let script = Script {
        ig: Some(ig),
        forbid_writes: false,
        forbid_attempts: false,
        attempts: attempts(),
    };
    let command = Command::Undo {
        name: "web".into(),
        to_build: None,
    };
    let (result, seen) = plugin(command, script.clone()).await;
    assert_eq!(
        result.expect_err("nothing to undo to"),
        "prod/web: no build before b2 to go back to; status.history has b2"
    );
    assert!(seen.iter().all(|s| s.method == Method::GET), "no write");

    let command = Command::Undo {
        name: "web".into(),
        to_build: Some("b0".into()),
    };
    let (result, _) = plugin(command, script).await;
    assert_eq!(
        result.expect_err("b0 is not there"),
        "prod/web: build b0 is not in the history to go back to; status.history has b2"
    );
}

#[tokio::test]
async fn pause_and_resume_patch_rollout_paused_alone() {
    for (command, paused, said) in [
        (
            Command::Pause { name: "web".into() },
            true,
            "prod/web: paused: no new attempts; attempts in flight finish\n",
        ),
        (
            Command::Resume { name: "web".into() },
            false,
            "prod/web: resumed\n",
        ),
    ] {
        let (printed, seen) = plugin(command, serving()).await;
        assert_eq!(printed.expect("the verb succeeds"), said);
        let (uri, body) = the_write(&seen);
        assert_eq!(uri, format!("{IG_PATH}{PATCH_QUERY}"));
        assert_eq!(body, &json!({"spec": {"rollout": {"paused": paused}}}));
    }
}

#[tokio::test]
async fn refusals_are_one_line_naming_what_to_do() {
    let missing = Script {
        ig: None,
        forbid_writes: false,
        forbid_attempts: false,
        attempts: attempts(),
    };
    let (result, _) = plugin(get("web"), missing).await;
    assert_eq!(
        result.expect_err("not found"),
        "instancegeneration prod/web not found"
    );

    let forbidden = Script {
        ig: Some(mid_rollout()),
        forbid_writes: true,
        forbid_attempts: false,
        attempts: attempts(),
    };
    let (result, _) = plugin(Command::Pause { name: "web".into() }, forbidden).await;
    assert_eq!(
        result.expect_err("forbidden"),
        "forbidden: you may not patch instancegenerations in namespace prod (ask for that RBAC verb on genswap.dev)"
    );
}

/// `get --watch` against the mock until `frames` frames are drawn: what
/// it printed, or its error, and the requests it made.
async fn watch_frames(
    script: Script,
    frames: usize,
) -> (
    Result<String, kubectl_genswap::error::PluginError>,
    Vec<Seen>,
) {
    let (client, seen) = mocked(script);
    let target = kubectl_genswap::api::Target::new(client, NAMESPACE, "web");
    let mut out = Vec::new();
    let mut terminal = Terminal {
        out: &mut out,
        colour: Colour::Off,
        redraw: false,
        now,
        token,
    };
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        kubectl_genswap::watch::run(&target, Output::Text, &mut terminal, Some(frames)),
    )
    .await
    .expect("the watch answers within the deadline");
    let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (
        result.map(|()| String::from_utf8_lossy(&out).into_owned()),
        seen,
    )
}

#[tokio::test]
async fn get_watch_draws_again_on_a_watch_event() {
    let (printed, seen) = watch_frames(serving(), 2).await;
    let printed = printed.expect("the watch runs");
    let golden = include_str!("golden/get_mid_rollout.txt");
    let (first, second) = printed.split_at(golden.len());
    assert_eq!(first, golden, "the first frame is the listed state");
    assert!(
        second.starts_with("InstanceGeneration prod/web  build b2 (overlap)  paused\n"),
        "the second frame shows the change: {second}"
    );
    // Two lists (the attempts' in three pages) and two watches, no
    // polling: no other GET.
    let lists = seen
        .iter()
        .filter(|s| !s.uri.contains("watch=true"))
        .count();
    assert_eq!(lists, 4, "{seen:?}");
}

#[tokio::test]
async fn get_watch_names_the_resource_whose_watch_was_refused() {
    let script = Script {
        forbid_attempts: true,
        ..serving()
    };
    let (result, _) = watch_frames(script, 1).await;
    assert_eq!(
        result
            .expect_err("the attempts cannot be listed")
            .to_string(),
        "forbidden: you may not watch swapattempts in namespace prod (ask for that RBAC verb on genswap.dev)"
    );
}

#[test]
fn the_fixtures_are_the_crate_types() {
    let ig: InstanceGeneration = serde_json::from_value(mid_rollout()).expect("an IG");
    assert_eq!(ig.status.map(|s| s.history.len()), Some(1));
    for attempt in attempts() {
        let _: SwapAttempt = serde_json::from_value(attempt).expect("a SwapAttempt");
    }
}
