//! `helm template` of the chart with its default values and every values
//! file in `charts/genswap/ci/`: each rendered object is a Kubernetes type
//! the chart is meant to ship (parsed by k8s-openapi, and nothing of it lost
//! in the parse, so a misspelt field fails), and the workloads say what
//! docs/CONTROLLER.md, docs/AGENT.md and SPEC 5.9 ask of them. The rendered
//! command lines are parsed by the binaries' own flag definitions.

mod chart_support;

use std::collections::BTreeSet;
use std::path::Path;

use chart_support::{Doc, NAMESPACE, every_values_set, render, typed};
use clap::Parser;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Parses `doc` as `T` and serializes it back: the result must be the
/// document itself. A field k8s-openapi does not know (a typo, a wrong
/// nesting) would be dropped by the parse and show up as a difference.
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Doc) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.value.clone())
        .map_err(|e| format!("{} does not parse: {e}", doc.id()))?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("{}: {e}", doc.id()))?;
    match first_difference(&doc.value, &back, String::new()) {
        None => Ok(()),
        Some(path) => Err(format!(
            "{}: {path} is lost or changed by the Kubernetes type (unknown or misspelt field?)",
            doc.id()
        )),
    }
}

/// The JSON pointer of the first place where `a` and `b` differ.
fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter()
                .find_map(|key| match (x.get(key), y.get(key)) {
                    (Some(p), Some(q)) => first_difference(p, q, format!("{at}/{key}")),
                    _ => Some(format!("{at}/{key}")),
                })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(p, q, format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some(if at.is_empty() { "/".into() } else { at }),
    }
}

/// Checks one rendered object against its type; unknown kinds are errors.
fn check_document(doc: &Doc) -> Result<(), String> {
    match (doc.api_version.as_str(), doc.kind.as_str()) {
        ("apps/v1", "Deployment") => round_trip::<Deployment>(doc),
        ("apps/v1", "DaemonSet") => round_trip::<DaemonSet>(doc),
        ("v1", "ServiceAccount") => round_trip::<ServiceAccount>(doc),
        ("v1", "Service") => round_trip::<Service>(doc),
        ("v1", "ConfigMap") => round_trip::<ConfigMap>(doc),
        ("policy/v1", "PodDisruptionBudget") => round_trip::<PodDisruptionBudget>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<ClusterRole>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            round_trip::<ClusterRoleBinding>(doc)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<Role>(doc),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<RoleBinding>(doc),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            round_trip::<ValidatingAdmissionPolicy>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            round_trip::<ValidatingAdmissionPolicyBinding>(doc)
        }
        (api_version, kind) => Err(format!(
            "{}: {api_version} {kind} is not a kind this chart is meant to render",
            doc.id()
        )),
    }
}

#[test]
fn every_rendered_object_parses_into_its_kubernetes_type() {
    let mut failures = Vec::new();
    for values_set in every_values_set() {
        let (set, docs) = (&values_set.name, &values_set.docs);
        assert!(!docs.is_empty(), "{set}: nothing rendered");
        for doc in docs {
            if let Err(error) = check_document(doc) {
                failures.push(format!("{set}: {error}"));
            }
            // Namespaced objects go where the release goes (or the watched
            // namespace, or the dashboard's), never to whatever kubectl's
            // context says.
            let cluster_scoped = matches!(
                doc.kind.as_str(),
                "ClusterRole"
                    | "ClusterRoleBinding"
                    | "ValidatingAdmissionPolicy"
                    | "ValidatingAdmissionPolicyBinding"
            );
            if cluster_scoped == doc.namespace.is_some() {
                failures.push(format!(
                    "{set}: {} has namespace {:?}",
                    doc.id(),
                    doc.namespace
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn an_unknown_kind_or_field_is_caught() {
    let docs = chart_support::parse_docs(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: extra\n---\n\
         apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: agent\nautomountToken: false\n",
    );
    let unknown_kind = check_document(&docs[0]).expect_err("a Secret is not in the chart");
    assert!(unknown_kind.contains("not a kind"), "{unknown_kind}");
    let misspelt = check_document(&docs[1]).expect_err("automountToken is not a field");
    assert!(misspelt.contains("/automountToken"), "{misspelt}");
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> &'a Container {
    spec.containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn env_field_ref(container: &Container, name: &str) -> Option<String> {
    container
        .env
        .as_deref()?
        .iter()
        .find(|e| e.name == name)?
        .value_from
        .as_ref()?
        .field_ref
        .as_ref()
        .map(|f| f.field_path.clone())
}

fn probe_path(probe: Option<&k8s_openapi::api::core::v1::Probe>) -> (String, IntOrString) {
    let get = probe
        .and_then(|p| p.http_get.as_ref())
        .expect("an HTTP probe");
    (get.path.clone().unwrap_or_default(), get.port.clone())
}

#[test]
fn the_controller_runs_two_hardened_leader_electing_replicas() {
    let docs = render(&[], &[]);
    let deployment: Deployment = typed(&docs);
    let spec = &deployment.spec;
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.as_ref().expect("pod spec");
    let controller = container(pod, "controller");
    assert_eq!(
        controller.command.as_deref(),
        Some(&["genswap-controller".to_string()][..])
    );

    // Each replica's identity and the Lease namespace from the downward API.
    assert_eq!(
        env_field_ref(controller, "POD_NAME").as_deref(),
        Some("metadata.name")
    );
    assert_eq!(
        env_field_ref(controller, "POD_NAMESPACE").as_deref(),
        Some("metadata.namespace")
    );

    // The binary's own parser accepts the rendered flags.
    let args = controller.args.clone().unwrap_or_default();
    let parsed = genswap_controller::cli::Args::try_parse_from(
        std::iter::once("genswap-controller".to_string()).chain(args.iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("genswap-controller refuses the chart's flags {args:?}: {e}"));
    assert_eq!(parsed.metrics_addr.to_string(), "0.0.0.0:8080");
    assert_eq!(parsed.identity.as_deref(), Some("$(POD_NAME)"));
    assert_eq!(parsed.lease_namespace.as_deref(), Some("$(POD_NAMESPACE)"));
    assert!(parsed.lease_grace_seconds < parsed.lease_duration_seconds);
    assert_eq!(parsed.namespace_scope(), None);
    assert_eq!(
        parsed.event_window(),
        genswap_controller::events::DEFAULT_WINDOW,
        "the chart's Event window is the binary's default"
    );
    assert_eq!(
        parsed.prometheus_url, None,
        "no Prometheus unless one is named"
    );

    // Probes and the metrics port.
    let ports = controller.ports.as_deref().unwrap_or_default();
    assert!(
        ports
            .iter()
            .any(|p| p.name.as_deref() == Some("metrics") && p.container_port == 8080),
        "{ports:?}"
    );
    let metrics = IntOrString::String("metrics".into());
    assert_eq!(
        probe_path(controller.liveness_probe.as_ref()),
        ("/healthz".into(), metrics.clone())
    );
    assert_eq!(
        probe_path(controller.readiness_probe.as_ref()),
        ("/readyz".into(), metrics)
    );

    // Non-root, read-only, no capability, no escalation, seccomp.
    let pod_security = pod.security_context.as_ref().expect("pod securityContext");
    assert_eq!(pod_security.run_as_non_root, Some(true));
    let security = controller
        .security_context
        .as_ref()
        .expect("securityContext");
    assert_eq!(security.run_as_non_root, Some(true));
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_ne!(security.privileged, Some(true));
    let caps = security.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    assert!(caps.add.as_deref().unwrap_or_default().is_empty());
    assert_eq!(
        security.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
        Some("RuntimeDefault")
    );
    let resources = controller.resources.as_ref().expect("resources");
    assert!(resources.requests.is_some() && resources.limits.is_some());

    // The metrics Service selects exactly the controller pods.
    let service: Service = typed(&docs);
    let selector = service
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .expect("a selector");
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    for (key, value) in &selector {
        assert_eq!(pod_labels.get(key), Some(value), "selector {key}");
    }
    assert_eq!(
        selector
            .get("app.kubernetes.io/component")
            .map(String::as_str),
        Some("controller")
    );
}

/// `node-agent run`'s flags, as main.rs composes them: the Kubernetes-mode
/// flags and the host flags every subcommand shares.
#[derive(Parser, Debug)]
struct AgentRun {
    #[command(flatten)]
    kube: node_agent::kube::KubeArgs,
    #[command(flatten)]
    host: node_agent::host::HostArgs,
}

fn agent_daemonset(values: &[&Path]) -> (DaemonSet, Vec<Doc>) {
    let docs = render(values, &[]);
    (typed(&docs), docs)
}

fn parse_agent_args(agent: &Container) -> AgentRun {
    let args = agent.args.clone().unwrap_or_default();
    assert_eq!(args.first().map(String::as_str), Some("run"), "{args:?}");
    // NODE_NAME comes from the pod's environment (checked by the caller).
    AgentRun::try_parse_from(
        std::iter::once("node-agent".to_string())
            .chain(args.iter().skip(1).cloned())
            .chain(["--node-name".to_string(), "node-a".to_string()]),
    )
    .unwrap_or_else(|e| panic!("node-agent run refuses the chart's flags {args:?}: {e}"))
}

#[test]
fn the_agent_runs_on_every_node_with_the_host_access_spec_5_9_needs_and_no_more() {
    let (daemonset, _) = agent_daemonset(&[]);
    let spec = &daemonset.spec;
    let pod = spec.template.spec.as_ref().expect("pod spec");
    assert_eq!(pod.host_pid, Some(true), "hostPID");
    assert_eq!(pod.host_network, Some(true), "hostNetwork");
    let agent = container(pod, "node-agent");
    assert_eq!(
        agent.command.as_deref(),
        Some(&["node-agent".to_string()][..])
    );
    assert_eq!(
        env_field_ref(agent, "NODE_NAME").as_deref(),
        Some("spec.nodeName")
    );
    // Its attempts come through the inbox the controller keeps where its
    // Lease is: the release namespace.
    assert_eq!(
        env_field_ref(agent, "GENSWAP_INBOX_NAMESPACE").as_deref(),
        Some("metadata.namespace")
    );

    // Tolerates every taint.
    let tolerations = pod.tolerations.as_deref().unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "{tolerations:?}"
    );

    // Never two agents on one node: no surge, one node at a time.
    let strategy = spec.update_strategy.as_ref().expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().expect("rollingUpdate");
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(0)));
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(1)));

    // Exactly the documented capabilities, not privileged.
    let security = agent.security_context.as_ref().expect("securityContext");
    assert_ne!(security.privileged, Some(true));
    assert_eq!(security.read_only_root_filesystem, Some(true));
    let caps = security.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    let added: BTreeSet<&str> = caps
        .add
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(String::as_str)
        .collect();
    let expected: BTreeSet<&str> = [
        "SYS_ADMIN",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "KILL",
        "SETUID",
        "SETGID",
        "CHOWN",
        "DAC_OVERRIDE",
        "SETPCAP",
    ]
    .into();
    assert_eq!(added, expected);

    // The flags parse with the agent's own definitions and name the mounted
    // host paths.
    let run = parse_agent_args(agent);
    let settings = run.host.settings();
    assert!(settings.engine.swaps_on);
    assert!(!settings.engine.allow_root);
    assert!(
        !run.host.no_host_namespaces,
        "the pod must join the host's namespaces"
    );
    assert_eq!(run.kube.metrics_addr.to_string(), "127.0.0.1:9090");
    assert_eq!(run.kube.namespace, None);
    let mounts = agent.volume_mounts.as_deref().unwrap_or_default();
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    let host_path_of_mount = |mount_path: &Path| -> Option<String> {
        let mount = mounts
            .iter()
            .find(|m| Path::new(&m.mount_path) == mount_path)?;
        let volume = volumes.iter().find(|v| v.name == mount.name)?;
        volume.host_path.as_ref().map(|h| h.path.clone())
    };
    for path in [
        Path::new("/sys/fs/cgroup"),
        &settings.run_dir,
        &settings.state_dir,
        &settings.staging_root,
        &settings.logs.dir,
    ] {
        assert_eq!(
            host_path_of_mount(path).as_deref().map(Path::new),
            Some(path),
            "{} is mounted from the same host path",
            path.display()
        );
    }

    // Cancelled attempts get their shutdown and flush time before SIGKILL.
    let grace = pod.termination_grace_period_seconds.expect("grace period");
    let needed = run.kube.shutdown_timeout_seconds + run.kube.report_flush_seconds;
    assert!(
        u64::try_from(grace).expect("positive") > needed,
        "grace {grace}s must exceed {needed}s"
    );

    // Probed on the node's loopback (hostNetwork), where the agent listens.
    for (probe, path) in [
        (agent.liveness_probe.as_ref(), "/healthz"),
        (agent.readiness_probe.as_ref(), "/readyz"),
    ] {
        let get = probe.and_then(|p| p.http_get.as_ref()).expect("HTTP probe");
        assert_eq!(get.host.as_deref(), Some("127.0.0.1"));
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::String("metrics".into()));
    }
}

#[test]
fn a_privileged_agent_drops_the_capability_list_and_keeps_its_paths() {
    let file = chart_support::chart_dir().join("ci/privileged-agent-values.yaml");
    let (daemonset, _) = agent_daemonset(&[&file]);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let agent = container(&pod, "node-agent");
    let security = agent.security_context.as_ref().expect("securityContext");
    assert_eq!(security.privileged, Some(true));
    assert!(security.capabilities.is_none());
    let run = parse_agent_args(agent);
    let settings = run.host.settings();
    assert!(settings.engine.allow_root);
    assert_eq!(settings.store_dir(), Path::new("/data/genswap/store"));
    assert_eq!(
        settings.cgroup_root.as_deref(),
        Some(Path::new("/sys/fs/cgroup/edge.slice/genswap"))
    );
    assert_eq!(run.kube.shutdown_timeout_seconds, 120);
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
}

#[test]
fn swap_off_reaches_the_agent_flags() {
    let file = chart_support::chart_dir().join("ci/swap-off-values.yaml");
    let (daemonset, _) = agent_daemonset(&[&file]);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let run = parse_agent_args(container(&pod, "node-agent"));
    assert!(!run.host.settings().engine.swaps_on);
}

#[test]
fn a_private_registry_reaches_the_agent_as_files_it_mounts_read_only() {
    let file = chart_support::chart_dir().join("ci/registry-values.yaml");
    let (daemonset, _) = agent_daemonset(&[&file]);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let agent = container(&pod, "node-agent");
    let settings = parse_agent_args(agent).host.settings();
    assert_eq!(
        settings.registries.config.as_deref(),
        Some(Path::new("/etc/genswap/registry/config.json"))
    );
    assert_eq!(
        settings.registries.ca.as_deref(),
        Some(Path::new("/etc/genswap/registry-ca/ca.crt"))
    );
    assert_eq!(settings.registries.insecure, vec!["10.0.0.9:5000"]);
    assert_eq!(
        settings.trust,
        genswap_store::TrustPolicy {
            keys: Some("/etc/genswap/trust-keys".into()),
            require_signatures: true,
        }
    );
    assert_eq!(
        (settings.retention.keep, settings.retention.max_bytes),
        (2, 20 << 30)
    );
    assert_eq!(
        (
            settings.tree_limits.max_bytes,
            settings.tree_limits.max_entries
        ),
        (2 << 30, 200_000)
    );
    let mounts = agent.volume_mounts.clone().unwrap_or_default();
    for (name, path) in [
        ("registry-config", "/etc/genswap/registry"),
        ("registry-ca", "/etc/genswap/registry-ca"),
        ("trust-keys", "/etc/genswap/trust-keys"),
    ] {
        let mount = mounts
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("no {name} mount"));
        assert_eq!(
            (mount.mount_path.as_str(), mount.read_only),
            (path, Some(true))
        );
    }
    let volumes = pod.volumes.clone().unwrap_or_default();
    let secret = volumes
        .iter()
        .find(|v| v.name == "registry-config")
        .and_then(|v| v.secret.clone())
        .expect("the Secret volume");
    assert_eq!(secret.secret_name.as_deref(), Some("genswap-registry"));
    let keys = volumes
        .iter()
        .find(|v| v.name == "trust-keys")
        .and_then(|v| v.config_map.clone())
        .expect("the trust keys' ConfigMap volume");
    assert_eq!(keys.name, "genswap-trust-keys");
    let items = secret.items.unwrap_or_default();
    assert_eq!(
        items
            .iter()
            .map(|i| (i.key.as_str(), i.path.as_str()))
            .collect::<Vec<_>>(),
        vec![(".dockerconfigjson", "config.json")]
    );
    // Without those values the agent mounts nothing of the kind and
    // pulls anonymously.
    let (daemonset, _) = agent_daemonset(&[]);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let settings = parse_agent_args(container(&pod, "node-agent"))
        .host
        .settings();
    assert_eq!(
        settings.registries,
        genswap_store::RegistrySettings::default()
    );
    assert_eq!(settings.trust, genswap_store::TrustPolicy::default());
    assert!(
        !pod.volumes
            .unwrap_or_default()
            .iter()
            .any(|v| v.name.starts_with("registry"))
    );
}

#[test]
fn one_namespace_scopes_both_binaries() {
    let file = chart_support::chart_dir().join("ci/one-namespace-values.yaml");
    let docs = render(&[&file], &[]);
    let daemonset: DaemonSet = typed(&docs);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let run = parse_agent_args(container(&pod, "node-agent"));
    assert_eq!(run.kube.namespace.as_deref(), Some("edge-apps"));

    let deployment: Deployment = typed(&docs);
    let pod = deployment.spec.template.spec.expect("pod spec");
    let args = container(&pod, "controller")
        .args
        .clone()
        .unwrap_or_default();
    let parsed = genswap_controller::cli::Args::try_parse_from(
        std::iter::once("genswap-controller".to_string()).chain(args),
    )
    .expect("controller flags parse");
    assert_eq!(parsed.namespace_scope(), Some("edge-apps"));

    // The binding of the admission policy is limited to that namespace.
    let binding: ValidatingAdmissionPolicyBinding = typed(&docs);
    let selector = binding
        .spec
        .match_resources
        .and_then(|m| m.namespace_selector)
        .and_then(|s| s.match_labels)
        .expect("a namespace selector");
    assert_eq!(
        selector
            .get("kubernetes.io/metadata.name")
            .map(String::as_str),
        Some("edge-apps")
    );
}

#[test]
fn custom_images_reach_each_component() {
    let file = chart_support::chart_dir().join("ci/custom-images-values.yaml");
    let docs = render(&[&file], &[]);
    let image_of = |pod: &PodSpec, name: &str| {
        let c = container(pod, name);
        (
            c.image.clone().unwrap_or_default(),
            c.image_pull_policy.clone(),
        )
    };
    let deployment: Deployment = typed(&docs);
    let pod = deployment.spec.template.spec.expect("pod spec");
    assert_eq!(
        image_of(&pod, "controller"),
        (
            "platform/genswap-controller@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef".into(),
            Some("Always".into())
        )
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("gs-ctl"));
    assert_eq!(
        pod.image_pull_secrets
            .as_deref()
            .unwrap_or_default()
            .first()
            .map(|s| s.name.as_str()),
        Some("platform-pull")
    );
    let daemonset: DaemonSet = typed(&docs);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    assert_eq!(
        image_of(&pod, "node-agent"),
        (
            "platform/genswap:0.1.0-rc.2".into(),
            Some("IfNotPresent".into())
        )
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("gs-agent"));

    // The default image is the chart's appVersion.
    let docs = render(&[], &[]);
    let daemonset: DaemonSet = typed(&docs);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    assert_eq!(image_of(&pod, "node-agent").0, "genswap:0.1.0");
}

fn env_value(container: &Container, name: &str) -> Option<String> {
    container
        .env
        .as_deref()?
        .iter()
        .find(|e| e.name == name)?
        .value
        .clone()
}

#[test]
fn a_node_without_a_service_route_keeps_both_components_on_its_loopback() {
    let file = chart_support::chart_dir().join("ci/local-node-values.yaml");
    let docs = render(&[&file], &[]);

    let deployment: Deployment = typed(&docs);
    let pod = deployment.spec.template.spec.expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    let controller = container(&pod, "controller");
    let parsed = genswap_controller::cli::Args::try_parse_from(
        std::iter::once("genswap-controller".to_string())
            .chain(controller.args.clone().unwrap_or_default()),
    )
    .expect("controller flags parse");
    assert_eq!(parsed.metrics_addr.to_string(), "127.0.0.1:18080");
    // The kubelet probes the pod's address unless told: loopback is where
    // the controller listens.
    for probe in [&controller.liveness_probe, &controller.readiness_probe] {
        let host = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref()?.host.clone());
        assert_eq!(host.as_deref(), Some("127.0.0.1"));
    }

    let daemonset: DaemonSet = typed(&docs);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let agent = container(&pod, "node-agent");
    assert!(parse_agent_args(agent).host.no_host_namespaces);

    // Both in-cluster clients dial the address given, not the Service's.
    for c in [controller, agent] {
        assert_eq!(
            env_value(c, "KUBERNETES_SERVICE_HOST").as_deref(),
            Some("127.0.0.1"),
            "{}",
            c.name
        );
        assert_eq!(
            env_value(c, "KUBERNETES_SERVICE_PORT").as_deref(),
            Some("6443"),
            "{}",
            c.name
        );
    }

    // By default neither is set, and the agent joins the host's namespaces.
    let docs = render(&[], &[]);
    let daemonset: DaemonSet = typed(&docs);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let agent = container(&pod, "node-agent");
    assert_eq!(env_value(agent, "KUBERNETES_SERVICE_HOST"), None);
    assert!(!parse_agent_args(agent).host.no_host_namespaces);
}

#[test]
fn a_loopback_controller_outside_the_nodes_network_is_refused() {
    let error = chart_support::try_render(&[], &["controller.metrics.host=127.0.0.1"])
        .expect_err("a controller the kubelet could not probe");
    assert!(error.contains("controller.hostNetwork"), "{error}");
}

#[test]
fn service_accounts_live_in_the_release_namespace() {
    let docs = render(&[], &[]);
    let accounts: Vec<&Doc> = docs.iter().filter(|d| d.kind == "ServiceAccount").collect();
    assert_eq!(
        accounts.len(),
        2,
        "one for the controller, one for the agent"
    );
    for account in accounts {
        assert_eq!(account.namespace.as_deref(), Some(NAMESPACE));
    }
}

#[test]
fn exposed_agent_metrics_get_a_headless_service_and_the_dashboard_ships() {
    let file = chart_support::chart_dir().join("ci/observability-values.yaml");
    let docs = render(&[&file], &[]);
    let daemonset: DaemonSet = typed(&docs);
    let pod = daemonset.spec.template.spec.expect("pod spec");
    let run = parse_agent_args(container(&pod, "node-agent"));
    assert_eq!(run.kube.metrics_addr.to_string(), "0.0.0.0:9100");
    let deployment: Deployment = typed(&docs);
    let controller_pod = deployment.spec.template.spec.expect("pod spec");
    let args = container(&controller_pod, "controller")
        .args
        .clone()
        .unwrap_or_default();
    let parsed = genswap_controller::cli::Args::try_parse_from(
        std::iter::once("genswap-controller".to_string()).chain(args.iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("genswap-controller refuses the chart's flags {args:?}: {e}"));
    let prometheus = parsed
        .prometheus()
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("controller.prometheusURL reaches the controller");
    assert_eq!(
        prometheus.endpoint(),
        "http://prometheus-operated.monitoring.svc:9090/api/v1/query"
    );
    let agent_service = docs
        .iter()
        .find(|d| d.kind == "Service" && d.name.contains("node-agent"))
        .expect("the agents' Service");
    let service: Service = serde_json::from_value(agent_service.value.clone()).expect("Service");
    assert_eq!(
        service.spec.and_then(|s| s.cluster_ip).as_deref(),
        Some("None")
    );

    let dashboard: ConfigMap = typed(&docs);
    assert_eq!(dashboard.metadata.namespace.as_deref(), Some("monitoring"));
    assert_eq!(
        dashboard
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("grafana_dashboard"))
            .map(String::as_str),
        Some("1")
    );
    let json = dashboard
        .data
        .as_ref()
        .and_then(|d| d.get("genswap.json"))
        .expect("the dashboard JSON");
    let shipped: Value = serde_json::from_str(json).expect("the shipped dashboard is JSON");
    let source: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_support::chart_dir().join("dashboards/genswap.json"))
            .expect("read the dashboard"),
    )
    .expect("the dashboard is JSON");
    assert_eq!(shipped, source);

    // Off by default.
    let docs = render(&[], &[]);
    assert!(!docs.iter().any(|d| d.kind == "ConfigMap"));
}
