//! The chart on a real kube-apiserver v1.32 (`test_cluster`; without
//! `../shared/kube` these tests print one line and pass). The other
//! `chart_*` tests read what helm renders; this one has the server take
//! it: `helm install`, `helm upgrade` through every values file of the
//! chart's `ci/`, `helm uninstall`, every object accepted and every object
//! gone after; the admission policy type-checked by the server with no
//! warning; and the policy and RBAC enforced on real ServiceAccount
//! tokens.

mod chart_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use chart_support::{ci_values_files, parse_docs, render};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use test_cluster::ControlPlane;
use test_cluster::chart::ChartRelease;

/// `(kind, namespace, name)` of every object in a helm manifest.
fn objects(manifest: &str) -> BTreeSet<(String, String, String)> {
    parse_docs(manifest)
        .into_iter()
        .map(|doc| (doc.kind, doc.namespace.unwrap_or_default(), doc.name))
        .collect()
}

/// Whether `kubectl get` finds the object.
fn exists(plane: &ControlPlane, (kind, namespace, name): &(String, String, String)) -> bool {
    let mut args = vec!["get", kind.as_str(), name.as_str(), "-o", "name"];
    if !namespace.is_empty() {
        args.extend(["-n", namespace.as_str()]);
    }
    plane.kubectl(&args).status.success()
}

#[test]
fn the_chart_installs_upgrades_through_every_ci_values_file_and_uninstalls() {
    let Some(plane) = ControlPlane::own() else {
        return;
    };
    // The namespaces values files name (the one genswap is limited to, the
    // dashboards' namespace) are the user's, and exist before the chart.
    let files = ci_values_files();
    let named: BTreeSet<String> = files
        .iter()
        .flat_map(|file| render(&[file.as_path()], &[]))
        .filter_map(|doc| doc.namespace)
        .filter(|namespace| namespace != "genswap-system")
        .collect();
    for namespace in &named {
        plane.kubectl_ok(&["create", "namespace", namespace]);
    }
    let release = ChartRelease::install(&plane, "genswap", "genswap-system", &[]);
    let mut current = objects(&release.manifest());
    assert!(current.len() >= 10, "{current:?}");
    let missing: Vec<_> = current.iter().filter(|o| !exists(&plane, o)).collect();
    assert!(
        missing.is_empty(),
        "installed but not on the server: {missing:?}"
    );

    for file in &files {
        let path = file.to_string_lossy();
        let output = release.upgrade(&["--values", &path]);
        assert!(
            output.status.success(),
            "helm upgrade --values {path} was refused: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let next = objects(&release.manifest());
        let missing: Vec<_> = next.iter().filter(|o| !exists(&plane, o)).collect();
        assert!(missing.is_empty(), "{path}: not on the server: {missing:?}");
        let left: Vec<_> = current
            .difference(&next)
            .filter(|o| exists(&plane, o))
            .collect();
        assert!(
            left.is_empty(),
            "{path}: no longer rendered but still there: {left:?}"
        );
        current = next;
    }
    println!(
        "helm upgrade through {} values files: accepted",
        files.len()
    );

    release.uninstall();
    let left: Vec<_> = current.iter().filter(|o| exists(&plane, o)).collect();
    assert!(
        left.is_empty(),
        "still there after helm uninstall: {left:?}"
    );
}

#[test]
fn the_admission_policy_type_checks_on_the_server_without_a_warning() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    // The server type-checks a policy when it is created or changed, and
    // only against kinds whose schema it already publishes: the CRDs go
    // first, as docs/INSTALL.md says.
    install_crds_first(plane);
    let release = ChartRelease::install(plane, "genswap", "genswap-typecheck", &[]);
    let policy = parse_docs(&release.manifest())
        .into_iter()
        .find(|doc| doc.kind == "ValidatingAdmissionPolicy")
        .expect("the chart renders the policy");
    let warnings = type_checking_warnings(plane, &policy.name);
    assert!(warnings.is_empty(), "type-checking warnings: {warnings:?}");

    // The checker checks this policy at all: the server skips a policy
    // whose kinds it cannot resolve (a subresource alone, a version "*")
    // and leaves typeChecking empty. The same policy with one field
    // misspelt must be warned about.
    let mut probe = policy.value.clone();
    probe["metadata"] = json!({"name": "genswap-typecheck-probe"});
    let misspelt = serde_json::to_string(&probe)
        .expect("serializes")
        .replace("object.spec.nodeName", "object.spec.noSuchField");
    let file = plane.dir().join("typecheck-probe.json");
    std::fs::write(&file, misspelt).expect("write the probe policy");
    plane.kubectl_ok(&["apply", "-f", &file.to_string_lossy()]);
    let warnings = type_checking_warnings(plane, "genswap-typecheck-probe");
    assert!(
        warnings
            .iter()
            .any(|w| w.to_string().contains("noSuchField")),
        "the server did not type-check the policy: {warnings:?}"
    );
    plane.kubectl_ok(&[
        "delete",
        "validatingadmissionpolicy",
        "genswap-typecheck-probe",
    ]);
    release.uninstall();
}

/// `kubectl apply --server-side` of the chart's CRDs, then a wait until the
/// server publishes their schema in OpenAPI v3.
fn install_crds_first(plane: &ControlPlane) {
    let crds = test_cluster::workspace().join("charts/genswap/crds");
    plane.kubectl_ok(&["apply", "--server-side", "-f", &crds.to_string_lossy()]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !plane
        .kubectl(&["get", "--raw", "/openapi/v3/apis/genswap.dev/v1alpha1"])
        .status
        .success()
    {
        assert!(
            Instant::now() < deadline,
            "the CRDs' schema was not published"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The warnings the controller-manager's policy status controller wrote
/// once it type-checked the policy's current generation.
fn type_checking_warnings(plane: &ControlPlane, name: &str) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = plane.kubectl_ok(&["get", "validatingadmissionpolicy", name, "-o", "json"]);
        let policy: Value = serde_json::from_str(&text).expect("the policy as JSON");
        let checked = policy["status"]["observedGeneration"] == policy["metadata"]["generation"];
        if checked && policy["status"].get("typeChecking").is_some() {
            return policy["status"]["typeChecking"]["expressionWarnings"]
                .as_array()
                .cloned()
                .unwrap_or_default();
        }
        assert!(
            Instant::now() < deadline,
            "{name} was not type-checked: {policy}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test]
async fn an_agent_writes_the_status_of_its_own_nodes_attempts_only() {
    let Some(plane) = ControlPlane::shared() else {
        return;
    };
    let release = ChartRelease::install(plane, "genswap", "genswap-policy", &[]);
    let node_a = plane.create_node("policy-node-a", &[]).await;
    let node_b = plane.create_node("policy-node-b", &[]).await;
    let namespace = "policy-apps";
    plane.kubectl_ok(&["create", "namespace", namespace]);

    // The controller's token creates the attempt: its RBAC allows it.
    let controller = test_cluster::client_for(&release.controller_kubeconfig()).await;
    let attempts: Api<genswap_crds::SwapAttempt> = Api::namespaced(controller, namespace);
    let attempt: genswap_crds::SwapAttempt = serde_json::from_value(
        test_cluster::objects::swap_attempt("web-policy-node-b-1", "policy-node-b", 1),
    )
    .expect("a SwapAttempt");
    attempts
        .create(&PostParams::default(), &attempt)
        .await
        .expect("the controller's ServiceAccount creates a SwapAttempt");

    let status = json!({
        "apiVersion": "genswap.dev/v1alpha1", "kind": "SwapAttempt",
        "status": {"outcome": "done", "executed": true},
    });
    let write_as = |kubeconfig: std::path::PathBuf| {
        let status = status.clone();
        async move {
            let client = test_cluster::client_for(&kubeconfig).await;
            let attempts: Api<genswap_crds::SwapAttempt> = Api::namespaced(client, namespace);
            attempts
                .patch_status(
                    "web-policy-node-b-1",
                    &PatchParams::apply("genswap-node-agent").force(),
                    &Patch::Apply(&status),
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    };

    // The API server enforces a policy once its policy source has seen the
    // policy and its binding, a moment after they are created (sooner or
    // later with the machine's load): until then a write passes. The
    // refusal must come, and within the deadline.
    let deadline = Instant::now() + Duration::from_secs(60);
    let refusal = loop {
        match write_as(release.agent_kubeconfig(&node_a)).await {
            Err(refusal) => break refusal,
            Ok(()) => {
                assert!(
                    Instant::now() < deadline,
                    "node-a's agent may not write node-b's attempt, and still could after 60 s"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert!(
        refusal.contains(
            "the node agent on policy-node-a may not write the status of SwapAttempt web-policy-node-b-1, which belongs to node policy-node-b"
        ),
        "{refusal}"
    );
    let unbound =
        plane.service_account_kubeconfig(&release.namespace, &release.agent_account(), None);
    let refusal = write_as(unbound)
        .await
        .expect_err("a token that names no node is refused");
    assert!(
        refusal.contains("the node agent's credentials name no node"),
        "{refusal}"
    );
    write_as(release.agent_kubeconfig(&node_b))
        .await
        .expect("node-b's agent writes its own node's attempt");

    // The agent's RBAC: it reads attempts and writes their status, and
    // creates none.
    let agent = test_cluster::client_for(&release.agent_kubeconfig(&node_b)).await;
    let agent_attempts: Api<genswap_crds::SwapAttempt> = Api::namespaced(agent, namespace);
    let mut another = attempt.clone();
    another.metadata.name = Some("web-policy-node-b-2".into());
    another.spec.sched_rev = 2;
    let error = agent_attempts
        .create(&PostParams::default(), &another)
        .await
        .expect_err("an agent creates no attempts");
    assert!(
        matches!(error, kube::Error::Api(ref s) if s.code == 403),
        "{error}"
    );
    release.uninstall();
}
