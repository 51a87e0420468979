//! A namespace a test owns on the control plane, deleted when the test
//! ends, on failure too.

use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};

/// The namespace `<prefix>-<pid>`, deleted when dropped.
pub struct OwnNamespace {
    api: Api<Namespace>,
    pub name: String,
}

impl OwnNamespace {
    /// Creates it; a test that cannot create it fails here.
    pub async fn create(client: &Client, prefix: &str) -> Self {
        let name = format!("{prefix}-{}", std::process::id());
        let api: Api<Namespace> = Api::all(client.clone());
        let object: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))
                .expect("a Namespace");
        api.create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        Self { api, name }
    }
}

impl Drop for OwnNamespace {
    fn drop(&mut self) {
        let api = self.api.clone();
        let name = self.name.clone();
        // Dropped outside the test's runtime too: a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(runtime) = runtime {
                let _ = runtime.block_on(api.delete(&name, &DeleteParams::default()));
            }
        })
        .join();
    }
}
