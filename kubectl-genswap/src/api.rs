//! The requests each verb makes, and what their failures mean to a human.

use genswap_core::scheduler::{LABEL_INSTANCE, LABEL_NODE, label_value};
use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::Value;

use crate::edits::FIELD_MANAGER;
use crate::error::PluginError;

/// The InstanceGenerations of one namespace and their attempts.
#[derive(Clone)]
pub struct Target {
    pub igs: Api<InstanceGeneration>,
    pub attempts: Api<SwapAttempt>,
    pub namespace: String,
    pub name: String,
    /// Only this node's attempts (`get --node`).
    pub node: Option<String>,
}

/// Attempts per list request: a fleet's attempts come in pages.
const PAGE: u32 = 500;

impl Target {
    pub fn new(client: Client, namespace: &str, name: &str) -> Target {
        Target {
            igs: Api::namespaced(client.clone(), namespace),
            attempts: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: name.to_string(),
            node: None,
        }
    }

    /// The same, for one node's attempts only.
    pub fn on_node(mut self, node: Option<String>) -> Target {
        self.node = node;
        self
    }

    pub fn object(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The label selector of this instance's attempts (on the node).
    pub fn attempt_selector(&self) -> String {
        let instance = format!("{LABEL_INSTANCE}={}", label_value(&self.name));
        match &self.node {
            Some(node) => format!("{instance},{LABEL_NODE}={}", label_value(node)),
            None => instance,
        }
    }

    pub async fn get(&self) -> Result<InstanceGeneration, PluginError> {
        self.igs
            .get(&self.name)
            .await
            .map_err(|e| self.explain(e, "get", "instancegenerations"))
    }

    /// This instance's attempts, [`PAGE`] at a time.
    pub async fn list_attempts(&self) -> Result<Vec<SwapAttempt>, PluginError> {
        let mut params = ListParams::default()
            .labels(&self.attempt_selector())
            .limit(PAGE);
        let mut attempts = Vec::new();
        loop {
            let page = self
                .attempts
                .list(&params)
                .await
                .map_err(|e| self.explain(e, "list", "swapattempts"))?;
            attempts.extend(page.items);
            match page.metadata.continue_.filter(|token| !token.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => return Ok(attempts),
            }
        }
    }

    /// Merges `patch` (from [`crate::edits`]) into the object: the fields
    /// it names change, no other.
    pub async fn patch(&self, patch: &Value) -> Result<InstanceGeneration, PluginError> {
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        self.igs
            .patch(&self.name, &params, &Patch::Merge(patch))
            .await
            .map_err(|e| self.explain(e, "patch", "instancegenerations"))
    }

    pub fn explain(
        &self,
        error: kube::Error,
        verb: &'static str,
        resource: &'static str,
    ) -> PluginError {
        match error {
            kube::Error::Api(status) if status.code == 404 && resource == "instancegenerations" => {
                PluginError::NotFound {
                    object: self.object(),
                }
            }
            kube::Error::Api(status) if status.code == 403 => PluginError::Forbidden {
                verb,
                resource,
                namespace: self.namespace.clone(),
            },
            kube::Error::Api(status) if status.code == 409 => PluginError::Changed {
                object: self.object(),
            },
            kube::Error::Api(status) => PluginError::Refused {
                verb,
                object: self.object(),
                message: status.message,
            },
            other => PluginError::Unreachable(other.to_string()),
        }
    }
}
