//! Every CEL expression genswap ships compiles in the API server's CEL
//! environment: each `x-kubernetes-validations` rule (and message
//! expression) of the generated CRDs, typed from the schema node it sits
//! on, and each expression of the chart's ValidatingAdmissionPolicy as
//! rendered, typed from the resource it matches.
//!
//! The environment is Kubernetes v1.32's declarations, checked at the
//! compatibility version of the oldest Kubernetes the README supports
//! (see `kubernetes_cel`). Client-side evaluation (crds/tests/cel.rs,
//! chart_admission.rs) checks what the expressions decide; this checks that
//! a server accepts them at all.

mod chart_support;
mod kubernetes_cel;

use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
use kubernetes_cel::declarations::{admission_request, authorizer, object_meta, resource_check};
use kubernetes_cel::types::{Type, crd_root_metadata, schema_type};
use kubernetes_cel::{Environment, TARGET_COMPATIBILITY_VERSION, regex_literals};
use serde_json::Value;

/// One shipped expression and where it is.
struct Shipped {
    place: String,
    source: String,
    environment: Environment,
    returns: Type,
}

/// The generated CRDs as JSON, with their file names.
fn crds() -> Vec<(String, Value)> {
    genswap_crds::crdgen::render()
        .expect("the CRDs render")
        .into_iter()
        .map(|(file, yaml)| {
            let value: Value =
                serde_saphyr::from_str(&yaml).unwrap_or_else(|e| panic!("{file} is not YAML: {e}"));
            (file, value)
        })
        .collect()
}

/// A version's schema as CEL sees `self` at its root.
fn root_type(schema: &Value, path: &str, metadata: Type) -> Type {
    let mut root = schema_type(schema, path);
    if let Type::Object(object) = &mut root {
        object.fields.insert("metadata".into(), metadata);
        object.fields.insert("apiVersion".into(), Type::String);
        object.fields.insert("kind".into(), Type::String);
    }
    root
}

fn crd_rules() -> Vec<Shipped> {
    let mut shipped = Vec::new();
    for (file, crd) in crds() {
        for version in crd["spec"]["versions"].as_array().expect("versions") {
            let name = version["name"].as_str().expect("a version name");
            let schema = &version["schema"]["openAPIV3Schema"];
            walk_rules(
                schema,
                &format!("{file} {name} openAPIV3Schema"),
                true,
                &mut shipped,
            );
        }
    }
    shipped
}

fn walk_rules(node: &Value, path: &str, root: bool, shipped: &mut Vec<Shipped>) {
    let self_type = if root {
        root_type(node, path, crd_root_metadata())
    } else {
        schema_type(node, path)
    };
    for (i, rule) in node["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        // `oldSelf` is declared for every rule: a rule that reads it is a
        // transition rule, which is valid where the object can be compared.
        let environment = || {
            Environment::kubernetes(TARGET_COMPATIBILITY_VERSION)
                .with_variable("self", self_type.clone())
                .with_variable("oldSelf", self_type.clone())
        };
        if let Some(source) = rule["rule"].as_str() {
            shipped.push(Shipped {
                place: format!("{path} x-kubernetes-validations[{i}].rule"),
                source: source.into(),
                environment: environment(),
                returns: Type::Bool,
            });
        }
        if let Some(source) = rule["messageExpression"].as_str() {
            shipped.push(Shipped {
                place: format!("{path} x-kubernetes-validations[{i}].messageExpression"),
                source: source.into(),
                environment: environment(),
                returns: Type::String,
            });
        }
    }
    for (name, child) in node["properties"].as_object().into_iter().flatten() {
        walk_rules(child, &format!("{path}.{name}"), false, shipped);
    }
    if node["items"].is_object() {
        walk_rules(&node["items"], &format!("{path}.@items"), false, shipped);
    }
    if node["additionalProperties"].is_object() {
        walk_rules(
            &node["additionalProperties"],
            &format!("{path}.@values"),
            false,
            shipped,
        );
    }
}

fn admission_policy() -> ValidatingAdmissionPolicy {
    chart_support::typed(&chart_support::render(&[], &[]))
}

/// The one (group, version, resource) the policy matches, with the
/// subresource stripped: what the API server types `object` from.
fn matched_resource(policy: &ValidatingAdmissionPolicy) -> (String, String, String) {
    let spec = policy.spec.as_ref().expect("the policy has a spec");
    let rules = spec
        .match_constraints
        .as_ref()
        .and_then(|m| m.resource_rules.as_ref())
        .expect("the policy matches resource rules");
    let [rule] = rules.as_slice() else {
        panic!("expected one resource rule, found {}", rules.len());
    };
    let one = |list: &Option<Vec<String>>, what: &str| -> String {
        match list.as_deref() {
            Some([only]) => only.clone(),
            other => panic!("the policy must match one {what}, it matches {other:?}"),
        }
    };
    // A resource and its subresources: one kind to type-check against.
    let mut kinds: Vec<String> = rule
        .resources
        .iter()
        .flatten()
        .map(|r| r.split('/').next().unwrap_or_default().to_string())
        .collect();
    kinds.dedup();
    let resource = one(&Some(kinds), "resource");
    (
        one(&rule.api_groups, "API group"),
        one(&rule.api_versions, "API version"),
        resource,
    )
}

fn policy_expressions() -> Vec<Shipped> {
    let policy = admission_policy();
    let (group, version, resource) = matched_resource(&policy);
    let crd = crds()
        .into_iter()
        .map(|(_, crd)| crd)
        .find(|crd| crd["spec"]["group"] == group && crd["spec"]["names"]["plural"] == resource)
        .unwrap_or_else(|| panic!("no generated CRD serves {group}/{resource}"));
    let schema = crd["spec"]["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .find(|v| v["name"] == version.as_str())
        .map(|v| &v["schema"]["openAPIV3Schema"])
        .unwrap_or_else(|| panic!("the {resource} CRD has no version {version}"));
    let object = root_type(schema, &resource, object_meta());
    let spec = policy.spec.expect("the policy has a spec");
    let base = |variables: &[(String, Type)]| {
        let mut environment = Environment::kubernetes(TARGET_COMPATIBILITY_VERSION)
            .with_variable("object", object.clone())
            .with_variable("oldObject", object.clone())
            .with_variable("request", admission_request())
            .with_variable("params", Type::Null)
            .with_variable("namespaceObject", Type::Dyn)
            .with_variable("authorizer", authorizer())
            .with_variable("authorizer.requestResource", resource_check());
        let fields: Vec<(&str, Type)> = variables
            .iter()
            .map(|(name, ty)| (name.as_str(), ty.clone()))
            .collect();
        environment = environment.with_variable(
            "variables",
            kubernetes_cel::types::object("variables", &fields),
        );
        environment
    };
    let mut shipped = Vec::new();
    for condition in spec.match_conditions.iter().flatten() {
        shipped.push(Shipped {
            place: format!("matchConditions[{}]", condition.name),
            source: condition.expression.clone(),
            environment: base(&[]),
            returns: Type::Bool,
        });
    }
    // Each variable sees the ones declared before it.
    let mut variables: Vec<(String, Type)> = Vec::new();
    for variable in spec.variables.iter().flatten() {
        let environment = base(&variables);
        let ty = environment
            .check(&variable.expression)
            .unwrap_or_else(|e| panic!("variables[{}]: {e}", variable.name));
        shipped.push(Shipped {
            place: format!("variables[{}]", variable.name),
            source: variable.expression.clone(),
            environment,
            returns: Type::Dyn,
        });
        variables.push((variable.name.clone(), ty));
    }
    for (i, validation) in spec.validations.iter().flatten().enumerate() {
        shipped.push(Shipped {
            place: format!("validations[{i}].expression"),
            source: validation.expression.clone(),
            environment: base(&variables),
            returns: Type::Bool,
        });
        if let Some(message) = &validation.message_expression {
            shipped.push(Shipped {
                place: format!("validations[{i}].messageExpression"),
                source: message.clone(),
                environment: base(&variables),
                returns: Type::String,
            });
        }
    }
    for annotation in spec.audit_annotations.iter().flatten() {
        shipped.push(Shipped {
            place: format!("auditAnnotations[{}]", annotation.key),
            source: annotation.value_expression.clone(),
            environment: base(&variables),
            returns: Type::String,
        });
    }
    shipped
}

/// Every refusal the API server would give, one line each.
fn refusals(shipped: &[Shipped]) -> Vec<String> {
    let mut refused = Vec::new();
    for expression in shipped {
        if let Err(error) = expression
            .environment
            .check_returns(&expression.source, &expression.returns)
        {
            refused.push(format!(
                "{}: {:?}: {error}",
                expression.place, expression.source
            ));
        }
        for pattern in regex_literals(&expression.source).unwrap_or_default() {
            if let Err(error) = regex::Regex::new(&pattern) {
                refused.push(format!(
                    "{}: the pattern {pattern:?} does not compile: {error}",
                    expression.place
                ));
            }
        }
    }
    refused
}

/// Asserts that `shipped` holds at least `at_least` expressions (a walk that
/// finds fewer has missed where they are) and that the server takes each.
fn assert_all_compile(what: &str, shipped: &[Shipped], at_least: usize) {
    assert!(
        shipped.len() >= at_least,
        "found only {} CEL expressions in {what}",
        shipped.len()
    );
    let refused = refusals(shipped);
    assert!(
        refused.is_empty(),
        "{} of {} expressions in {what} would be refused by the API server:\n{}",
        refused.len(),
        shipped.len(),
        refused.join("\n")
    );
}

#[test]
fn every_crd_rule_compiles_in_the_kubernetes_cel_environment() {
    // Both CRDs carry rules on build, artifact, process, health, stop,
    // resources and rollout.
    assert_all_compile("the CRDs", &crd_rules(), 30);
}

#[test]
fn every_admission_policy_expression_compiles_in_the_kubernetes_cel_environment() {
    assert_all_compile("the admission policy", &policy_expressions(), 4);
}

#[test]
fn the_admission_policy_names_the_version_so_the_server_type_checks_it() {
    // A rule on apiVersions "*" is skipped by the policy type checker
    // (status.typeChecking stays empty): it must name a served version.
    let policy = admission_policy();
    let (_, version, resource) = matched_resource(&policy);
    assert_eq!(version, "v1alpha1");
    assert_eq!(resource, "swapattempts");
    let spec = policy.spec.expect("spec");
    let rules = spec
        .match_constraints
        .and_then(|m| m.resource_rules)
        .expect("resource rules");
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(
            &[
                "swapattempts".to_string(),
                "swapattempts/status".to_string()
            ][..]
        ),
        "the status subresource stays matched, and the main resource is named for the server to type-check the policy"
    );
}

// The checker itself: each of these must refuse what a v1.32 server
// refuses, or the tests above prove nothing.

fn quantity_field() -> Environment {
    // `resources.cpuMax` is an int-or-string quantity: `self` is dyn.
    Environment::kubernetes(TARGET_COMPATIBILITY_VERSION).with_variable("self", Type::Dyn)
}

#[test]
fn the_member_form_of_sign_is_refused_as_the_api_server_refuses_it() {
    let env = quantity_field();
    assert_eq!(
        env.check("isQuantity(string(self)) && quantity(string(self)).sign() > 0"),
        Err("found no matching overload for 'sign' applied to 'kubernetes.Quantity.()'".into()),
        "the rule a v1.32 server refused at CRD install"
    );
    assert_eq!(
        env.check("isQuantity(string(self)) && sign(quantity(string(self))) > 0"),
        Ok(Type::Bool)
    );
    // Members of a quantity stay members.
    assert_eq!(
        env.check("quantity(string(self)).isGreaterThan(quantity('0'))"),
        Ok(Type::Bool)
    );
    assert!(
        env.check("isGreaterThan(quantity(string(self)), quantity('0'))")
            .is_err()
    );
}

#[test]
fn an_unknown_function_is_an_undeclared_reference() {
    let env = quantity_field();
    assert_eq!(
        env.check("isPositive(self)"),
        Err("undeclared reference to 'isPositive' (in container '')".into())
    );
}

#[test]
fn argument_types_are_checked_against_the_declarations() {
    let env =
        Environment::kubernetes(TARGET_COMPATIBILITY_VERSION).with_variable("self", Type::String);
    assert_eq!(env.check("self.startsWith('/')"), Ok(Type::Bool));
    assert_eq!(
        env.check("self.startsWith(1)"),
        Err("found no matching overload for 'startsWith' applied to 'string.(int)'".into())
    );
    assert!(env.check("self > 0").is_err(), "string against int");
    assert!(env.check("self.size() <= 128 && size(self) > 0").is_ok());
    let int =
        Environment::kubernetes(TARGET_COMPATIBILITY_VERSION).with_variable("self", Type::Int);
    assert_eq!(int.check("self >= 0 && self <= 4294967294"), Ok(Type::Bool));
    // Cross-type numeric comparison is on since 1.28; equality is not.
    assert_eq!(int.check("self < 1.5"), Ok(Type::Bool));
    assert!(int.check("self == 1.5").is_err());
}

#[test]
fn fields_are_checked_against_the_schema() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "names": {"type": "array", "items": {"type": "string"}},
            "ports": {"type": "array", "items": {"type": "integer"}},
        },
    });
    let env = Environment::kubernetes(TARGET_COMPATIBILITY_VERSION)
        .with_variable("self", schema_type(&schema, "self"));
    assert_eq!(
        env.check("has(self.path) && self.path != ''"),
        Ok(Type::Bool)
    );
    assert_eq!(
        env.check("has(self.url)"),
        Err("undefined field 'url' (in self)".into())
    );
    assert_eq!(
        env.check("self.names.all(n, n.startsWith('a'))"),
        Ok(Type::Bool)
    );
    assert!(env.check("self.ports.all(p, p.startsWith('a'))").is_err());
    assert_eq!(
        env.check("self.names.map(n, n.size())"),
        Ok(kubernetes_cel::types::list(Type::Int))
    );
    assert_eq!(
        env.check("self.names.all(a, self.names.exists_one(b, b == a))"),
        Ok(Type::Bool)
    );
}

#[test]
fn a_library_newer_than_the_target_version_is_not_there() {
    let at = |version| Environment::kubernetes(version).with_variable("self", Type::String);
    let rule = "!format.dns1123Label().validate(self).hasValue()";
    assert!(
        at((1, 30)).check(rule).is_err(),
        "the format library arrived in 1.31"
    );
    assert_eq!(at((1, 31)).check(rule), Ok(Type::Bool));
    assert!(at((1, 27)).check("isQuantity(self)").is_err());
    assert!(at((1, 28)).check("isQuantity(self)").is_ok());
}

#[test]
fn a_rule_must_evaluate_to_a_bool() {
    let env = quantity_field();
    assert!(env.check_returns("string(self)", &Type::Bool).is_err());
    assert!(
        env.check_returns("string(self) == '1'", &Type::Bool)
            .is_ok()
    );
}

#[test]
fn a_regex_the_server_cannot_compile_is_reported() {
    let rules = [Shipped {
        place: "control".into(),
        source: "self.matches('^(unclosed')".into(),
        environment: Environment::kubernetes(TARGET_COMPATIBILITY_VERSION)
            .with_variable("self", Type::String),
        returns: Type::Bool,
    }];
    let refused = refusals(&rules);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(refused[0].contains("does not compile"), "{refused:?}");
}
