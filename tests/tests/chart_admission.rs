//! The admission policy that keeps each agent to its own node's
//! SwapAttempts: its CEL is evaluated (with the `cel` interpreter) against
//! the admission requests an API server would send, and the binding and
//! match rules are checked on the rendered objects.

mod chart_support;

use std::collections::HashMap;

use cel::objects::{Key, Map};
use cel::{Context, Program, Value as CelValue};
use chart_support::{NAMESPACE, render, typed};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding, ValidatingAdmissionPolicySpec,
};
use serde_json::{Value, json};

const NODE_NAME_KEY: &str = "authentication.kubernetes.io/node-name";

fn policy_spec() -> ValidatingAdmissionPolicySpec {
    let policy: ValidatingAdmissionPolicy = typed(&render(&[], &[]));
    policy.spec.expect("the policy has a spec")
}

fn agent_user() -> String {
    format!("system:serviceaccount:{NAMESPACE}:genswap-node-agent")
}

/// What the API server decides for one request.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// The match conditions exclude it: the policy says nothing.
    NotMatched,
    Allowed,
    /// Refused, with the message the user would see.
    Denied(String),
}

fn eval(expression: &str, context: &Context<'_>) -> CelValue {
    let program = Program::compile(expression)
        .unwrap_or_else(|e| panic!("CEL does not compile: {expression}: {e:?}"));
    program
        .execute(context)
        .unwrap_or_else(|e| panic!("CEL fails: {expression}: {e:?}"))
}

/// Evaluates the policy as the API server does: match conditions, then the
/// variables, then each validation in order; the first false one denies.
fn admit(spec: &ValidatingAdmissionPolicySpec, user: &Value, attempt: &Value) -> Verdict {
    let request = json!({
        "operation": "UPDATE",
        "subResource": "status",
        "userInfo": user,
        "namespace": attempt["metadata"]["namespace"],
        "name": attempt["metadata"]["name"],
    });
    let mut context = Context::default();
    context.add_variable("request", &request).expect("request");
    context.add_variable("object", attempt).expect("object");
    context
        .add_variable("oldObject", attempt)
        .expect("oldObject");
    for condition in spec.match_conditions.as_deref().unwrap_or_default() {
        if eval(&condition.expression, &context) != CelValue::Bool(true) {
            return Verdict::NotMatched;
        }
    }
    let mut variables: HashMap<Key, CelValue> = HashMap::new();
    for variable in spec.variables.as_deref().unwrap_or_default() {
        let value = eval(&variable.expression, &context);
        variables.insert(Key::from(variable.name.clone()), value);
        context.add_variable_from_value("variables", CelValue::Map(Map::from(variables.clone())));
    }
    for validation in spec.validations.as_deref().unwrap_or_default() {
        if eval(&validation.expression, &context) == CelValue::Bool(true) {
            continue;
        }
        let message = match &validation.message_expression {
            Some(expression) => match eval(expression, &context) {
                CelValue::String(text) => text.to_string(),
                other => panic!("messageExpression gave {other:?}"),
            },
            None => validation.message.clone().unwrap_or_default(),
        };
        return Verdict::Denied(message);
    }
    Verdict::Allowed
}

fn attempt_on(node: &str) -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "SwapAttempt",
        "metadata": {"name": format!("hello-{node}-7"), "namespace": "default"},
        "spec": {"instance": "hello", "nodeName": node, "schedRev": 7},
        "status": {"outcome": "done"},
    })
}

/// A pod-bound token's user: the pod's node in extra (Kubernetes >= 1.30).
fn pod_token_user(username: &str, node: &str) -> Value {
    json!({
        "username": username,
        "groups": ["system:serviceaccounts", "system:authenticated"],
        "extra": {
            "authentication.kubernetes.io/pod-name": ["genswap-node-agent-x7k2p"],
            NODE_NAME_KEY: [node],
        },
    })
}

#[test]
fn an_agent_may_write_its_own_nodes_attempts() {
    let spec = policy_spec();
    let verdict = admit(
        &spec,
        &pod_token_user(&agent_user(), "node-a"),
        &attempt_on("node-a"),
    );
    assert_eq!(verdict, Verdict::Allowed);
}

#[test]
fn an_agent_may_not_write_another_nodes_attempts() {
    let spec = policy_spec();
    let verdict = admit(
        &spec,
        &pod_token_user(&agent_user(), "node-a"),
        &attempt_on("node-b"),
    );
    let Verdict::Denied(message) = verdict else {
        panic!("node-a's agent wrote node-b's attempt: {verdict:?}");
    };
    assert!(
        message.contains("node-a")
            && message.contains("node-b")
            && message.contains("hello-node-b-7"),
        "{message}"
    );
}

#[test]
fn agent_credentials_without_a_node_are_refused() {
    let spec = policy_spec();
    // A token not bound to a pod (kubectl create token), or a cluster with
    // the node info turned off: no extra at all, or extra without the node.
    for user in [
        json!({"username": agent_user(), "groups": ["system:serviceaccounts"]}),
        json!({"username": agent_user(), "extra": {"authentication.kubernetes.io/credential-id": ["JTI=1"]}}),
        json!({"username": agent_user(), "extra": {NODE_NAME_KEY: []}}),
    ] {
        let verdict = admit(&spec, &user, &attempt_on("node-a"));
        let Verdict::Denied(message) = verdict else {
            panic!("{user} was let through: {verdict:?}");
        };
        assert!(message.contains(NODE_NAME_KEY), "{message}");
    }
}

#[test]
fn other_users_are_not_the_policys_business() {
    let spec = policy_spec();
    for username in [
        // The controller, an administrator, and an account of the same name
        // in another namespace.
        format!("system:serviceaccount:{NAMESPACE}:genswap-controller"),
        "kubernetes-admin".to_string(),
        "system:serviceaccount:default:genswap-node-agent".to_string(),
    ] {
        let verdict = admit(
            &spec,
            &pod_token_user(&username, "node-a"),
            &attempt_on("node-b"),
        );
        assert_eq!(verdict, Verdict::NotMatched, "{username}");
    }
}

#[test]
fn the_policy_covers_status_writes_and_is_bound_to_deny() {
    let docs = render(&[], &[]);
    let policy: ValidatingAdmissionPolicy = typed(&docs);
    let spec = policy.spec.clone().expect("spec");
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let rules = spec
        .match_constraints
        .and_then(|m| m.resource_rules)
        .expect("resource rules");
    assert!(
        rules.iter().any(|rule| {
            rule.api_groups.as_deref() == Some(&["genswap.dev".to_string()][..])
                && rule
                    .resources
                    .as_deref()
                    .is_some_and(|r| r.contains(&"swapattempts/status".to_string()))
                && rule
                    .operations
                    .as_deref()
                    .is_some_and(|o| o.contains(&"UPDATE".to_string()))
        }),
        "{rules:?}"
    );
    let binding: ValidatingAdmissionPolicyBinding = typed(&docs);
    assert_eq!(Some(binding.spec.policy_name), policy.metadata.name);
    assert_eq!(binding.spec.validation_actions, vec!["Deny".to_string()]);
    // All namespaces when the chart watches all of them.
    assert!(binding.spec.match_resources.is_none());
}

#[test]
fn the_switch_turns_the_policy_off() {
    let file = chart_support::chart_dir().join("ci/vap-off-values.yaml");
    let docs = render(&[&file], &[]);
    let admission: Vec<String> = docs
        .iter()
        .filter(|d| d.api_version.starts_with("admissionregistration.k8s.io/"))
        .map(|d| d.id())
        .collect();
    assert!(admission.is_empty(), "{admission:?}");
}

#[test]
fn renamed_service_accounts_are_matched() {
    let file = chart_support::chart_dir().join("ci/custom-images-values.yaml");
    let policy: ValidatingAdmissionPolicy = typed(&render(&[&file], &[]));
    let spec = policy.spec.expect("spec");
    let renamed = format!("system:serviceaccount:{NAMESPACE}:gs-agent");
    assert_eq!(
        admit(&spec, &pod_token_user(&renamed, "node-a"), &attempt_on("node-b")),
        Verdict::Denied(
            "the node agent on node-a may not write the status of SwapAttempt hello-node-b-7, which belongs to node node-b"
                .into()
        )
    );
    assert_eq!(
        admit(
            &spec,
            &pod_token_user(&agent_user(), "node-a"),
            &attempt_on("node-b")
        ),
        Verdict::NotMatched
    );
}
