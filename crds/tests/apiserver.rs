//! The CRDs on a real kube-apiserver v1.32 (`test_cluster`: the control
//! plane of `../shared/kube`; without one these tests print one line and
//! pass). The client-side checks (`schema_table.rs`, `cel.rs`) run kube's
//! CEL and standalone mode's reader, which are not the API server's: this
//! is their referee. It checks that the generated CRDs install, every
//! example is accepted, every case of the schema table is refused in the
//! table's words or accepted as the table says, and a SwapAttempt's spec
//! rules hold.

mod support;

use std::path::{Path, PathBuf};

use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::{Value, json};
use support::schema_table;
use test_cluster::{ControlPlane, workspace};

/// Applies `crds/` server-side, as the README's first install step does,
/// and waits until both are established.
fn install_crds(plane: &ControlPlane) {
    plane.install_crds();
}

async fn installed() -> Option<(&'static ControlPlane, Client)> {
    let plane = ControlPlane::shared()?;
    install_crds(plane);
    Some((plane, plane.client().await))
}

fn instance_generations(client: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::erase::<InstanceGeneration>(&()),
    )
}

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        field_manager: None,
    }
}

fn examples() -> Vec<PathBuf> {
    let dir = workspace().join("examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[tokio::test]
async fn the_generated_crds_install_and_every_example_is_applied() {
    let Some((plane, client)) = installed().await else {
        return;
    };
    let files = examples();
    assert!(files.len() >= 3, "expected the examples, found {files:?}");
    for file in files {
        let object = read_yaml(&file);
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let _ = plane.kubectl(&["create", "namespace", &namespace]);
        plane.kubectl_ok(&["apply", "--server-side", "-f", &file.to_string_lossy()]);
        // What the server stored reads back into the types.
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let stored: Api<InstanceGeneration> = Api::namespaced(client.clone(), &namespace);
        let ig = stored
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{}: read it back: {e}", file.display()));
        assert_eq!(
            ig.spec.build.id,
            object["spec"]["build"]["id"].as_str().unwrap_or_default(),
            "{}",
            file.display()
        );
        plane.kubectl_ok(&["delete", "-f", &file.to_string_lossy(), "--wait=false"]);
    }
}

#[tokio::test]
async fn the_api_server_refuses_every_refused_case_in_the_tables_words() {
    let Some((_, client)) = installed().await else {
        return;
    };
    let igs = instance_generations(&client, "default");
    let mut wrong = Vec::new();
    for case in schema_table::refused() {
        let (_, says) = case.refusal.as_ref().expect("a refusal");
        let object: DynamicObject =
            serde_json::from_value(case.object.clone()).expect("a DynamicObject");
        match igs.create(&dry_run(), &object).await {
            Ok(_) => wrong.push(format!("{}: accepted", case.what)),
            Err(kube::Error::Api(status)) if status.message.contains(says) => {}
            Err(other) => wrong.push(format!("{}: expected {says:?}, got: {other}", case.what)),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[tokio::test]
async fn the_api_server_accepts_every_accepted_case() {
    let Some((_, client)) = installed().await else {
        return;
    };
    let igs = instance_generations(&client, "default");
    let mut wrong = Vec::new();
    for case in schema_table::accepted() {
        let object: DynamicObject =
            serde_json::from_value(case.object.clone()).expect("a DynamicObject");
        if let Err(error) = igs.create(&dry_run(), &object).await {
            wrong.push(format!("{}: {error}", case.what));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[tokio::test]
async fn a_swap_attempt_starts_at_revision_one_and_its_spec_never_changes() {
    let Some((_, client)) = installed().await else {
        return;
    };
    let attempts: Api<SwapAttempt> = Api::namespaced(client, "default");
    let attempt = |rev: i64| -> SwapAttempt {
        serde_json::from_value(test_cluster::objects::swap_attempt(
            "web-node-a-1",
            "node-a",
            rev,
        ))
        .expect("a SwapAttempt")
    };
    let error = attempts
        .create(&dry_run(), &attempt(0))
        .await
        .expect_err("revision 0 is refused");
    assert!(
        error.to_string().contains("schedRev must be at least 1"),
        "{error}"
    );
    attempts
        .create(&PostParams::default(), &attempt(1))
        .await
        .expect("revision 1 is accepted");
    let patch = json!({"spec": {"schedRev": 2}});
    let error = attempts
        .patch(
            "web-node-a-1",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect_err("a changed spec is refused");
    assert!(
        error.to_string().contains("SwapAttempt spec is immutable"),
        "{error}"
    );
    // The status is the agent's to write, and changes freely.
    let status = json!({"status": {"outcome": "done", "executed": true}});
    attempts
        .patch_status(
            "web-node-a-1",
            &PatchParams::default(),
            &Patch::Merge(&status),
        )
        .await
        .expect("a status write is accepted");
    attempts
        .delete("web-node-a-1", &Default::default())
        .await
        .expect("delete the attempt");
}

fn read_yaml(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
