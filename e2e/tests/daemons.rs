//! A program that knows nothing of genswap, in Kubernetes mode on a real
//! API server (support/mod.rs says which): the test app as a classic
//! daemon (it forks, its start exits 0, its child writes a pid file) that
//! never binds `GENSWAP_SOCKET` and serves only an agent-held listener. Its
//! InstanceGeneration asks for every part of SPEC 5.12 a stock daemon needs
//! (`process.pidFile`, `httpGet` through the listener in a hold, an exec
//! `liveness`, a `lifecycle.preStop` hook), so the real API server's schema
//! takes each field and the agent acts on what the controller copied into
//! the SwapAttempt: the install becomes Ready, a liveness failure shows in
//! the node's `lastExit` after the hook ran before the stop signal, and the
//! restart serves again.

mod support;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use genswap_crds::InstanceGeneration;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use support::{Cluster, INSTANCE_ID, Stack, apply_crds, path_str};

const IG: &str = "stock";
const FIELD_MANAGER: &str = "genswap-e2e";
const STEP_DEADLINE: Duration = Duration::from_secs(120);

/// `GET /` on 127.0.0.1:`port`: the body, or why not.
fn get(port: u16) -> Result<String, String> {
    let mut stream =
        std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: stock\r\nconnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .map_err(|e| e.to_string())?;
    Ok(answer)
}

/// Whether `pid` runs (an orphan's zombie, left to whoever reaps for the
/// host, counts as gone).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Polls the IG until `done` holds.
async fn wait_ig(
    igs: &Api<InstanceGeneration>,
    stack: &mut Stack,
    what: &str,
    done: impl Fn(&InstanceGeneration) -> bool,
) -> InstanceGeneration {
    let deadline = Instant::now() + STEP_DEADLINE;
    let mut last = None;
    while Instant::now() < deadline {
        stack.assert_running();
        if let Ok(ig) = igs.get(IG).await {
            if done(&ig) {
                return ig;
            }
            last = Some(ig);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!(
        "{what}: not within {STEP_DEADLINE:?}; last status: {}{}",
        last.and_then(|ig| serde_json::to_string_pretty(&ig.status).ok())
            .unwrap_or_else(|| "none".into()),
        stack.diagnosis()
    );
}

fn ready_on_generation(ig: &InstanceGeneration, at_least: i64) -> bool {
    let Some(status) = ig.status.as_ref() else {
        return false;
    };
    let ready = status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    ready
        && !status.nodes.is_empty()
        && status.nodes.iter().all(|node| {
            node.generation.is_some_and(|n| n >= at_least) && node.serving == Some(true)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forking_daemon_runs_by_its_probes_and_hooks_in_kubernetes_mode() {
    let Some(cluster) = Cluster::find().await else {
        return;
    };
    apply_crds(&cluster);
    let mut stack = Stack::start(&cluster, "daemon").await;
    let igs: Api<InstanceGeneration> =
        Api::namespaced(cluster.client().await, &stack.namespace.name);
    // Written by the instance (nobody) and its commands.
    let shared = stack.dir.path().join("shared");
    std::fs::create_dir_all(&shared).expect("shared dir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).expect("open it");
    let (pid_file, order, sick) = (
        shared.join("stock.pid"),
        shared.join("order"),
        shared.join("sick"),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let build = testapp::make_build(&stack.staging, "stock-1").expect("stage the build");
    let env = |name: &str, value: &str| json!({"name": name, "value": value});
    let object = json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": IG, "namespace": stack.namespace.name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": stack.hostname},
            "build": {"id": "stock-1", "artifact": {"path": path_str(&build.path)}, "sha256": build.sha256},
            "mode": "hold",
            "process": {
                "user": INSTANCE_ID,
                "group": INSTANCE_ID,
                "pidFile": path_str(&pid_file),
                // The daemon, its probes and hooks write there, through
                // the sandbox's private /tmp.
                "writablePaths": [path_str(&shared)],
                "env": [
                    env(testapp::knob::NEVER_BIND, "1"),
                    env(testapp::knob::DAEMONIZE, "1"),
                    env(testapp::knob::PID_FILE, &path_str(&pid_file)),
                    env(testapp::knob::TERM_LOG, &path_str(&order)),
                ],
            },
            "listeners": [{"name": "web", "tcp": format!("127.0.0.1:{port}")}],
            "health": {"httpGet": {"path": "/", "listener": "web"}, "timeoutSeconds": 20},
            "liveness": {
                "exec": {"command": ["sh", "-c", format!("test ! -e {}", path_str(&sick))]},
                "periodSeconds": 1,
                "failureThreshold": 2,
            },
            "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", format!("kill -0 \"$MAINPID\" && echo preStop >> {}", path_str(&order))]}}},
            "settle": {"seconds": 0},
            "stop": {"timeoutSeconds": 5},
        },
    });
    igs.patch(
        IG,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&object),
    )
    .await
    .unwrap_or_else(|e| panic!("the API server takes every field: {e}"));

    wait_ig(&igs, &mut stack, "the daemon's install to Ready", |ig| {
        ready_on_generation(ig, 1)
    })
    .await;
    let answer = get(port).expect("the daemon answers on its listener");
    assert!(answer.contains("build=stock-1 generation=1"), "{answer}");
    let daemon: u32 = std::fs::read_to_string(&pid_file)
        .expect("its pid file")
        .trim()
        .parse()
        .expect("a pid");
    assert!(
        answer.contains(&format!("pid={daemon}")),
        "the forked child serves: {answer}"
    );

    // Sick: two failed tries stop it (the hook first), and the node's
    // lastExit says why.
    std::fs::write(&sick, "").expect("make it sick");
    let failed = wait_ig(
        &igs,
        &mut stack,
        "lastExit to show the liveness failure",
        |ig| {
            ig.status.as_ref().is_some_and(|s| {
                s.nodes.iter().any(|node| {
                    node.last_exit
                        .as_ref()
                        .and_then(|exit| exit.liveness_failed.as_deref())
                        .is_some_and(|failed| failed.contains("failed 2 times in a row"))
                })
            })
        },
    )
    .await;
    assert!(
        !alive(daemon),
        "the daemon was stopped: {:?}",
        failed.status
    );
    assert_eq!(
        lines(&order).get(..2),
        Some(&["preStop".to_string(), "SIGTERM".to_string()][..]),
        "the hook ran against the running daemon, then its stop signal came"
    );

    std::fs::remove_file(&sick).expect("make it well");
    wait_ig(&igs, &mut stack, "a restart to Ready", |ig| {
        ready_on_generation(ig, 2)
    })
    .await;
    let answer = get(port).expect("the restart answers on the listener");
    assert!(answer.contains("build=stock-1"), "{answer}");
    stack.assert_running();
}
