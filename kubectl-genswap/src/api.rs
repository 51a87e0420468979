//! The requests each verb makes, and what their failures mean to a human.

use genswap_core::scheduler::{LABEL_INSTANCE, label_value};
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
}

impl Target {
    pub fn new(client: Client, namespace: &str, name: &str) -> Target {
        Target {
            igs: Api::namespaced(client.clone(), namespace),
            attempts: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    pub fn object(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The label selector of this instance's attempts.
    pub fn attempt_selector(&self) -> String {
        format!("{LABEL_INSTANCE}={}", label_value(&self.name))
    }

    pub async fn get(&self) -> Result<InstanceGeneration, PluginError> {
        self.igs
            .get(&self.name)
            .await
            .map_err(|e| self.explain(e, "get", "instancegenerations"))
    }

    pub async fn list_attempts(&self) -> Result<Vec<SwapAttempt>, PluginError> {
        let params = ListParams::default().labels(&self.attempt_selector());
        self.attempts
            .list(&params)
            .await
            .map(|list| list.items)
            .map_err(|e| self.explain(e, "list", "swapattempts"))
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
