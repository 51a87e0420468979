//! The genswap chart installed into a control plane with a real helm, and
//! the credentials of its ServiceAccounts: what the controller and the
//! agents run under in a cluster, so a test that runs them as processes
//! meets the chart's RBAC and admission policy, not admin's.

use std::path::PathBuf;
use std::process::{Command, Output};

use k8s_openapi::api::core::v1::Node;

use crate::helm::helm;
use crate::{ControlPlane, workspace};

/// A helm release of `charts/genswap`.
pub struct ChartRelease<'a> {
    plane: &'a ControlPlane,
    /// The release name.
    pub name: String,
    /// The release namespace (the controller's Lease and both
    /// ServiceAccounts live there).
    pub namespace: String,
}

impl<'a> ChartRelease<'a> {
    /// `helm install NAME charts/genswap -n NAMESPACE --create-namespace
    /// ARGS`; panics with helm's words when the server refuses anything.
    pub fn install(
        plane: &'a ControlPlane,
        name: &str,
        namespace: &str,
        args: &[&str],
    ) -> ChartRelease<'a> {
        let release = ChartRelease {
            plane,
            name: name.to_string(),
            namespace: namespace.to_string(),
        };
        let chart = workspace().join("charts/genswap");
        let mut install = vec!["install", name];
        let chart = chart.to_string_lossy().into_owned();
        install.extend([chart.as_str(), "--create-namespace"]);
        install.extend(args);
        release.helm_ok(&install);
        release
    }

    /// `helm upgrade NAME charts/genswap ARGS`.
    pub fn upgrade(&self, args: &[&str]) -> Output {
        let chart = workspace().join("charts/genswap");
        let chart = chart.to_string_lossy().into_owned();
        let mut upgrade = vec!["upgrade", self.name.as_str(), chart.as_str()];
        upgrade.extend(args);
        self.helm(&upgrade)
    }

    /// `helm uninstall NAME --wait`.
    pub fn uninstall(&self) {
        self.helm_ok(&["uninstall", &self.name, "--wait", "--timeout", "120s"]);
    }

    /// The objects helm applied, as it rendered them (`helm get manifest`).
    pub fn manifest(&self) -> String {
        self.helm_ok(&["get", "manifest", &self.name])
    }

    /// helm against the control plane, in the release namespace.
    pub fn helm(&self, args: &[&str]) -> Output {
        Command::new(helm())
            .args(args)
            .args(["--namespace", &self.namespace])
            .arg("--kubeconfig")
            .arg(self.plane.kubeconfig())
            .output()
            .unwrap_or_else(|e| panic!("run helm: {e}"))
    }

    fn helm_ok(&self, args: &[&str]) -> String {
        let output = self.helm(args);
        assert!(
            output.status.success(),
            "helm {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The controller's ServiceAccount.
    pub fn controller_account(&self) -> String {
        self.service_account("controller")
    }

    /// The node agent's ServiceAccount.
    pub fn agent_account(&self) -> String {
        self.service_account("node-agent")
    }

    /// The name of the release's ServiceAccount of `component`, as the
    /// server has it (the chart decides names; the test does not repeat
    /// how).
    fn service_account(&self, component: &str) -> String {
        let selector = format!(
            "app.kubernetes.io/instance={},app.kubernetes.io/component={component}",
            self.name
        );
        let names = self.plane.kubectl_ok(&[
            "get",
            "serviceaccounts",
            "-n",
            &self.namespace,
            "-l",
            &selector,
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ]);
        match names.split_whitespace().collect::<Vec<_>>().as_slice() {
            [name] => (*name).to_string(),
            other => panic!(
                "release {}: {component} ServiceAccounts {other:?}",
                self.name
            ),
        }
    }

    /// A kubeconfig with a token of the controller's ServiceAccount.
    pub fn controller_kubeconfig(&self) -> PathBuf {
        self.plane
            .service_account_kubeconfig(&self.namespace, &self.controller_account(), None)
    }

    /// A kubeconfig with a token of the agent's ServiceAccount bound to
    /// `node`, as the token projected into the agent's pod there is.
    pub fn agent_kubeconfig(&self, node: &Node) -> PathBuf {
        self.plane
            .service_account_kubeconfig(&self.namespace, &self.agent_account(), Some(node))
    }
}
