//! `kubectl genswap` against a real kube-apiserver v1.32 (`test_cluster`;
//! without `../shared/kube` these tests print one line and pass): what the
//! server makes of each write, which the mock of `plugin.rs` cannot say.
//!
//! Every verb runs after every other, on an object a user applied with
//! server-side apply and whose status (written here as the controller
//! would) holds a history and a held-down build. After each pair the spec
//! must be the user's with exactly what the two verbs change, and `get`
//! must draw it; then the user's own apply of a new release must keep
//! what the verbs set.

use std::path::Path;
use std::process::{Command, Output};

use genswap_crds::InstanceGeneration;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use test_cluster::ControlPlane;

const USER: &str = "user-apply";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verb {
    Retry,
    Undo,
    Pause,
    Resume,
}

impl Verb {
    const ALL: [Verb; 4] = [Verb::Retry, Verb::Undo, Verb::Pause, Verb::Resume];

    fn arg(self) -> &'static str {
        match self {
            Verb::Retry => "retry",
            Verb::Undo => "undo",
            Verb::Pause => "pause",
            Verb::Resume => "resume",
        }
    }
}

fn sha(build: &str) -> String {
    let digit = match build {
        "b1" => "1",
        "b2" => "2",
        _ => "3",
    };
    digit.repeat(64)
}

/// The user's manifest: build `build` and every section a verb must not
/// touch.
fn manifest(namespace: &str, name: &str, build: &str) -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {"pool": "edge"},
            "build": {"id": build, "artifact": {"url": format!("https://builds.invalid/{build}")}, "sha256": sha(build)},
            "configRev": "c7",
            "process": {"args": ["--port", "8080"], "user": 1000, "group": 1000},
            "health": {"path": "/healthz", "timeoutSeconds": 9},
            "rollout": {"canaryNodes": 1, "maxParallel": 2},
        },
    })
}

/// What the controller would have written: b1 and b2 served everywhere
/// once, and b2 (released again since) now held down on node a.
fn status() -> Value {
    let at = "2026-12-01T10:00:00Z";
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "status": {
            "history": [
                {"build": "b2", "sha256": sha("b2"), "artifact": {"url": "https://builds.invalid/b2"}, "at": at},
                {"build": "b1", "sha256": sha("b1"), "artifact": {"path": "/var/lib/genswap/staging/b1"}, "at": at},
            ],
            "heldDown": [{"build": "b2", "mode": "overlap", "node": "a", "reason": "unhealthy", "since": at}],
        },
    })
}

/// The spec fields the verbs may change, as a model: build id, whether the
/// artifact is a path, the retry token, paused.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Model {
    build: String,
    path_artifact: bool,
    retry: String,
    paused: bool,
}

impl Model {
    fn of(ig: &InstanceGeneration) -> Model {
        Model {
            build: ig.spec.build.id.clone(),
            path_artifact: ig.spec.build.artifact.path.is_some(),
            retry: ig.spec.retry.clone(),
            paused: ig.spec.rollout.paused,
        }
    }

    /// What `verb` does to the model, and whether it succeeds.
    fn after(&self, verb: Verb, ran: &Model) -> (Model, bool) {
        let mut next = self.clone();
        match verb {
            // Only b2 is held down.
            Verb::Retry if self.build != "b2" => return (next, false),
            // A fresh token, whatever it is.
            Verb::Retry => next.retry = ran.retry.clone(),
            // The newest history entry other than the current build.
            Verb::Undo if self.build == "b2" => {
                next.build = "b1".into();
                next.path_artifact = true;
            }
            Verb::Undo => {
                next.build = "b2".into();
                next.path_artifact = false;
            }
            Verb::Pause => next.paused = true,
            Verb::Resume => next.paused = false,
        }
        (next, true)
    }
}

fn plugin(kubeconfig: &Path, namespace: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kubectl-genswap"))
        .args(args)
        .args(["-n", namespace])
        .env("KUBECONFIG", kubeconfig)
        .env("NO_COLOR", "1")
        .output()
        .unwrap_or_else(|e| panic!("run kubectl-genswap: {e}"))
}

/// The CRDs, installed server-side, and a namespace of the test's own:
/// its InstanceGenerations.
async fn installed(plane: &ControlPlane, namespace: &str) -> Api<InstanceGeneration> {
    plane.install_crds();
    plane.kubectl_ok(&["create", "namespace", namespace]);
    Api::namespaced(plane.client().await, namespace)
}

/// `name` as the user applies it (build b2), with the status of
/// [`status`], read back.
async fn applied_with_status(
    igs: &Api<InstanceGeneration>,
    namespace: &str,
    name: &str,
) -> InstanceGeneration {
    let manifest = manifest(namespace, name, "b2");
    igs.patch(name, &PatchParams::apply(USER), &Patch::Apply(&manifest))
        .await
        .unwrap_or_else(|e| panic!("{name}: the user's apply: {e}"));
    igs.patch_status(
        name,
        &PatchParams::apply("controller"),
        &Patch::Apply(&status()),
    )
    .await
    .unwrap_or_else(|e| panic!("{name}: the status: {e}"))
}

#[tokio::test]
async fn every_verb_after_every_other_changes_its_own_field_and_keeps_the_rest() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    let namespace = "verbs";
    let igs = installed(plane, namespace).await;

    let mut wrong = Vec::new();
    for first in Verb::ALL {
        for second in Verb::ALL {
            let name = format!("web-{}-{}", first.arg(), second.arg());
            let before = applied_with_status(&igs, namespace, &name).await;
            let mut model = Model::of(&before);
            for verb in [first, second] {
                let output = plugin(plane.kubeconfig(), namespace, &[verb.arg(), &name]);
                let now = igs.get(&name).await.expect("read it back");
                let (expected, succeeds) = model.after(verb, &Model::of(&now));
                if output.status.success() != succeeds {
                    wrong.push(format!(
                        "{name}: {verb:?} {} ({})",
                        if succeeds { "failed" } else { "succeeded" },
                        String::from_utf8_lossy(&output.stderr).trim()
                    ));
                }
                if verb == Verb::Retry && succeeds && now.spec.retry == model.retry {
                    wrong.push(format!("{name}: retry wrote no fresh token"));
                }
                if Model::of(&now) != expected {
                    wrong.push(format!(
                        "{name}: after {verb:?} expected {expected:?}, the server has {:?}",
                        Model::of(&now)
                    ));
                }
                // Nothing else of the user's spec moved.
                let mut untouched = serde_json::to_value(&now.spec).expect("serializes");
                let mut original = serde_json::to_value(&before.spec).expect("serializes");
                for spec in [&mut untouched, &mut original] {
                    for field in ["build", "retry"] {
                        spec[field] = Value::Null;
                    }
                    spec["rollout"]["paused"] = Value::Null;
                }
                if untouched != original {
                    wrong.push(format!(
                        "{name}: after {verb:?} another field changed: {untouched} from {original}"
                    ));
                }
                model = Model::of(&now);
            }
            let drawn = plugin(plane.kubeconfig(), namespace, &["get", &name]);
            let tree = String::from_utf8_lossy(&drawn.stdout);
            if !drawn.status.success() || !tree.contains(&format!("build {}", model.build)) {
                wrong.push(format!(
                    "{name}: get drew {tree:?} ({})",
                    String::from_utf8_lossy(&drawn.stderr).trim()
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[tokio::test]
async fn a_release_the_user_applies_after_pause_keeps_the_rollout_paused() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    let namespace = "verbs-release";
    let igs = installed(plane, namespace).await;
    let user = PatchParams::apply(USER);
    let name = "paused-release";
    applied_with_status(&igs, namespace, name).await;
    for verb in ["pause", "retry"] {
        let output = plugin(plane.kubeconfig(), namespace, &[verb, name]);
        assert!(
            output.status.success(),
            "{verb}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    // The user's next release, applied from their manifest, which says
    // nothing of paused.
    let released = igs
        .patch(name, &user, &Patch::Apply(&manifest(namespace, name, "b3")))
        .await
        .expect("the user's release");
    assert_eq!(released.spec.build.id, "b3");
    assert!(
        released.spec.rollout.paused,
        "the release keeps the rollout paused"
    );

    // Resume, and the user's apply is still theirs to make.
    let output = plugin(plane.kubeconfig(), namespace, &["resume", name]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let resumed = igs.get(name).await.expect("read it back");
    assert!(!resumed.spec.rollout.paused);
    assert_eq!(resumed.spec.build.id, "b3");
}
