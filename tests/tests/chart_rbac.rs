//! Least privilege, checked on what the chart renders: for every values set,
//! each service account's rights (its bindings' rules, where they apply)
//! are exactly the ones docs/CONTROLLER.md and docs/AGENT.md list. A right
//! beyond the allow-list fails, a wildcard fails, a missing right fails, and
//! a binding to a role the chart does not render fails.

mod chart_support;

use std::collections::{BTreeMap, BTreeSet};

use chart_support::{Doc, NAMESPACE, every_values_set, render};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, PolicyRule, RoleBinding, RoleRef, Subject};

/// One right: where it applies (`*cluster*` or a namespace), API group,
/// resource, verb.
type Right = (String, String, String, String);

const CLUSTER: &str = "*cluster*";

fn rights(scope: &str, group: &str, resource: &str, verbs: &[&str]) -> Vec<Right> {
    verbs
        .iter()
        .map(|verb| (scope.into(), group.into(), resource.into(), (*verb).into()))
        .collect()
}

/// What the controller may do, given where it watches and whether the
/// finalizers right is asked for.
fn controller_allowed(watch: Option<&str>, finalizers: bool) -> BTreeSet<Right> {
    let objects = watch.unwrap_or(CLUSTER);
    let mut allowed = Vec::new();
    allowed.extend(rights(
        objects,
        "genswap.dev",
        "instancegenerations",
        &["get", "list", "watch"],
    ));
    allowed.extend(rights(
        objects,
        "genswap.dev",
        "instancegenerations/status",
        &["patch"],
    ));
    if finalizers {
        allowed.extend(rights(
            objects,
            "genswap.dev",
            "instancegenerations/finalizers",
            &["update"],
        ));
    }
    allowed.extend(rights(
        objects,
        "genswap.dev",
        "swapattempts",
        &["get", "list", "watch", "create", "patch", "delete"],
    ));
    allowed.extend(rights(objects, "events.k8s.io", "events", &["create"]));
    allowed.extend(rights(CLUSTER, "", "nodes", &["get", "list", "watch"]));
    allowed.extend(rights(
        NAMESPACE,
        "coordination.k8s.io",
        "leases",
        &["get", "list", "watch", "create", "patch"],
    ));
    allowed.extend(rights(
        NAMESPACE,
        "",
        "configmaps",
        &["get", "list", "create", "patch", "delete"],
    ));
    allowed.into_iter().collect()
}

/// What the agent may do: read its inbox and attempts, patch their status, and read
/// an InstanceGeneration and its Node to tell whether an instance without
/// attempts is still wanted.
fn agent_allowed(watch: Option<&str>) -> BTreeSet<Right> {
    let objects = watch.unwrap_or(CLUSTER);
    let mut allowed = rights(
        objects,
        "genswap.dev",
        "swapattempts",
        &["get", "list", "watch"],
    );
    allowed.extend(rights(
        objects,
        "genswap.dev",
        "swapattempts/status",
        &["patch"],
    ));
    allowed.extend(rights(
        objects,
        "genswap.dev",
        "instancegenerations",
        &["get"],
    ));
    allowed.extend(rights(CLUSTER, "", "nodes", &["get"]));
    allowed.extend(rights(CLUSTER, "", "namespaces", &["get"]));
    allowed.extend(rights(
        NAMESPACE,
        "",
        "configmaps",
        &["get", "list", "watch"],
    ));
    allowed.into_iter().collect()
}

/// The rights each subject (`namespace:name` of a ServiceAccount) is
/// granted by the rendered bindings. Errors: wildcards, non-resource URLs,
/// a subject that is not a ServiceAccount, a binding to a role the chart
/// does not render.
fn granted(docs: &[Doc]) -> Result<BTreeMap<String, BTreeSet<Right>>, Vec<String>> {
    let mut errors = Vec::new();
    let mut roles: BTreeMap<(String, Option<String>, String), Vec<PolicyRule>> = BTreeMap::new();
    for doc in docs {
        if doc.kind == "ClusterRole" || doc.kind == "Role" {
            if doc.value.get("aggregationRule").is_some() {
                errors.push(format!(
                    "{}: aggregationRule grants whatever it selects",
                    doc.id()
                ));
            }
            let rules: Vec<PolicyRule> =
                serde_json::from_value(doc.value.get("rules").cloned().unwrap_or_default())
                    .unwrap_or_else(|e| panic!("{}: rules do not parse: {e}", doc.id()));
            roles.insert(
                (doc.kind.clone(), doc.namespace.clone(), doc.name.clone()),
                rules,
            );
        }
    }
    let mut grants: BTreeMap<String, BTreeSet<Right>> = BTreeMap::new();
    for doc in docs {
        let (role_ref, subjects, binding_namespace): (RoleRef, Vec<Subject>, Option<String>) =
            match doc.kind.as_str() {
                "ClusterRoleBinding" => {
                    let b: ClusterRoleBinding =
                        serde_json::from_value(doc.value.clone()).expect("ClusterRoleBinding");
                    (b.role_ref, b.subjects.unwrap_or_default(), None)
                }
                "RoleBinding" => {
                    let b: RoleBinding =
                        serde_json::from_value(doc.value.clone()).expect("RoleBinding");
                    (
                        b.role_ref,
                        b.subjects.unwrap_or_default(),
                        doc.namespace.clone(),
                    )
                }
                _ => continue,
            };
        let role_namespace = match role_ref.kind.as_str() {
            "ClusterRole" => None,
            "Role" => binding_namespace.clone(),
            other => {
                errors.push(format!("{}: roleRef kind {other}", doc.id()));
                continue;
            }
        };
        let Some(rules) =
            roles.get(&(role_ref.kind.clone(), role_namespace, role_ref.name.clone()))
        else {
            errors.push(format!(
                "{} binds {} {}, which the chart does not render",
                doc.id(),
                role_ref.kind,
                role_ref.name
            ));
            continue;
        };
        // A ClusterRole bound by a RoleBinding applies in that namespace only.
        let scope = binding_namespace.unwrap_or_else(|| CLUSTER.to_string());
        for subject in subjects {
            if subject.kind != "ServiceAccount" {
                errors.push(format!(
                    "{}: subject {} {}",
                    doc.id(),
                    subject.kind,
                    subject.name
                ));
                continue;
            }
            let who = format!(
                "{}:{}",
                subject.namespace.as_deref().unwrap_or("<none>"),
                subject.name
            );
            let set = grants.entry(who).or_default();
            for rule in rules {
                if rule.non_resource_urls.is_some() {
                    errors.push(format!("{}: nonResourceURLs", doc.id()));
                }
                let groups = rule.api_groups.clone().unwrap_or_default();
                let resources = rule.resources.clone().unwrap_or_default();
                for item in groups.iter().chain(&resources).chain(&rule.verbs) {
                    if item.contains('*') {
                        errors.push(format!("{}: wildcard {item:?} in {rule:?}", role_ref.name));
                    }
                }
                for group in &groups {
                    for resource in &resources {
                        for verb in &rule.verbs {
                            set.insert((
                                scope.clone(),
                                group.clone(),
                                resource.clone(),
                                verb.clone(),
                            ));
                        }
                    }
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(grants)
    } else {
        Err(errors)
    }
}

fn service_account_name(docs: &[Doc], component: &str) -> String {
    let account = docs
        .iter()
        .find(|d| {
            d.kind == "ServiceAccount"
                && d.value
                    .pointer("/metadata/labels/app.kubernetes.io~1component")
                    .and_then(|v| v.as_str())
                    == Some(component)
        })
        .unwrap_or_else(|| panic!("the {component} ServiceAccount"));
    format!(
        "{}:{}",
        account.namespace.as_deref().unwrap_or(NAMESPACE),
        account.name
    )
}

fn describe(rights: &BTreeSet<Right>) -> String {
    rights
        .iter()
        .map(|(scope, group, resource, verb)| format!("  {scope} {group}/{resource} {verb}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_service_account_has_exactly_the_documented_rights() {
    let mut failures = Vec::new();
    for values_set in every_values_set() {
        let set = &values_set.name;
        let docs = &values_set.docs;
        let watch = values_set
            .set("/watchNamespace")
            .and_then(|v| v.as_str())
            .filter(|ns| !ns.is_empty());
        let finalizers = values_set
            .set("/controller/rbac/ownerReferencesPermissionEnforcement")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let grants = match granted(docs) {
            Ok(grants) => grants,
            Err(errors) => {
                failures.push(format!("{set}:\n  {}", errors.join("\n  ")));
                continue;
            }
        };
        let controller = service_account_name(docs, "controller");
        let agent = service_account_name(docs, "node-agent");
        let expected: BTreeMap<String, BTreeSet<Right>> = [
            (controller, controller_allowed(watch, finalizers)),
            (agent, agent_allowed(watch)),
        ]
        .into();
        for (who, allowed) in &expected {
            let have = grants.get(who).cloned().unwrap_or_default();
            let extra: BTreeSet<Right> = have.difference(allowed).cloned().collect();
            let missing: BTreeSet<Right> = allowed.difference(&have).cloned().collect();
            if !extra.is_empty() {
                failures.push(format!(
                    "{set}: {who} has more than allowed:\n{}",
                    describe(&extra)
                ));
            }
            if !missing.is_empty() {
                failures.push(format!("{set}: {who} lacks:\n{}", describe(&missing)));
            }
        }
        for who in grants.keys().filter(|who| !expected.contains_key(*who)) {
            failures.push(format!(
                "{set}: {who} is granted rights but is not the chart's"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_wildcard_or_an_extra_verb_is_caught() {
    let mut docs = render(&[], &[]);
    let agent_role = docs
        .iter_mut()
        .find(|d| d.kind == "ClusterRole" && d.name.ends_with("node-agent"))
        .expect("the agent's ClusterRole");
    agent_role.value["rules"][0]["verbs"] = serde_json::json!(["get", "list", "watch", "update"]);
    let grants = granted(&docs).expect("no wildcard yet");
    let agent = service_account_name(&docs, "node-agent");
    let extra: BTreeSet<Right> = grants[&agent]
        .difference(&agent_allowed(None))
        .cloned()
        .collect();
    assert_eq!(
        extra,
        rights(CLUSTER, "genswap.dev", "swapattempts", &["update"])
            .into_iter()
            .collect()
    );

    let mut docs = render(&[], &[]);
    let controller_role = docs
        .iter_mut()
        .find(|d| d.kind == "ClusterRole" && d.name.ends_with("controller"))
        .expect("the controller's ClusterRole");
    controller_role.value["rules"][0]["resources"] = serde_json::json!(["*"]);
    let errors = granted(&docs).expect_err("a wildcard resource");
    assert!(errors.iter().any(|e| e.contains("wildcard")), "{errors:?}");
}

#[test]
fn no_rbac_objects_when_rbac_is_off() {
    let docs = render(&[], &["rbac.create=false"]);
    let rbac: Vec<String> = docs
        .iter()
        .filter(|d| d.api_version.starts_with("rbac.authorization.k8s.io/"))
        .map(Doc::id)
        .collect();
    assert!(rbac.is_empty(), "{rbac:?}");
}
