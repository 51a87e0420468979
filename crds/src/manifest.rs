//! Reading InstanceGeneration manifests from YAML the way the API server would
//! take them: the same schema, unknown fields refused (as `kubectl apply`'s
//! strict field validation does) and every CEL rule evaluated.

use std::sync::LazyLock;

use kube::core::CustomResourceExt;
use serde_json::Value;
use thiserror::Error;

use crate::instance_generation::InstanceGeneration;

/// Why a manifest was refused. Each message names the field or the rule.
#[derive(Debug, Error)]
pub enum ManifestError {
    #[error("not valid YAML: {0}")]
    Yaml(String),
    #[error("apiVersion/kind is {found:?}, expected \"genswap.dev/v1alpha1 InstanceGeneration\"")]
    WrongKind { found: String },
    #[error("unknown field(s): {}", .0.join(", "))]
    UnknownFields(Vec<String>),
    #[error("does not match the InstanceGeneration schema: {0}")]
    Schema(String),
    /// What the structural schema refuses beyond types: a string outside
    /// its enum; strings, lists and maps past their `maxLength`, `maxItems`
    /// or `maxProperties`, and two
    /// entries of a list-map with the same key; one line each, in the API
    /// server's words.
    #[error("{}", .0.join("; "))]
    Structural(Vec<String>),
    #[error("metadata.name is missing")]
    MissingName,
    #[error("{0}")]
    Rules(String),
}

/// Parses and validates one InstanceGeneration from YAML.
pub fn parse_instance_generation(yaml: &str) -> Result<InstanceGeneration, ManifestError> {
    let value: Value =
        serde_saphyr::from_str(yaml).map_err(|e| ManifestError::Yaml(e.to_string()))?;
    let api_version = value
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = value
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let expected = InstanceGeneration::api_resource();
    if api_version != expected.api_version || kind != expected.kind {
        return Err(ManifestError::WrongKind {
            found: format!("{api_version} {kind}"),
        });
    }
    let schema = &*INSTANCE_GENERATION_SCHEMA;
    let mut unknown = Vec::new();
    unknown_fields(&value, &schema.openapi, "", &mut unknown);
    if !unknown.is_empty() {
        return Err(ManifestError::UnknownFields(unknown));
    }
    let mut structural = Vec::new();
    structural_errors(&value, &schema.openapi, "", &mut structural);
    let parsed = serde_json::from_value::<InstanceGeneration>(value);
    // The API server checks the structural schema first and evaluates no
    // CEL rule of an object that fails it; so does this. A value outside
    // an enum fails both: the schema's words are the server's.
    if !structural.is_empty() {
        return Err(ManifestError::Structural(structural));
    }
    let ig = parsed.map_err(|e| ManifestError::Schema(e.to_string()))?;
    if ig.metadata.name.as_deref().unwrap_or_default().is_empty() {
        return Err(ManifestError::MissingName);
    }
    // What kube's `validate_cel` checks (the typed object, serialized
    // again, against the derived schema's rules), with the rules compiled
    // once: tests/fuzz_manifest.rs holds the two to the same verdicts.
    let object = serde_json::to_value(&ig).map_err(|e| ManifestError::Schema(e.to_string()))?;
    kube_cel::Validator::new()
        .validate_compiled(&schema.rules, &object, None)
        .map_err(|errors| ManifestError::Rules(rules_message(&errors)))?;
    Ok(ig)
}

/// kube-cel's own text for `errors`, one line per broken rule, with the
/// lines sorted. kube-cel keeps a schema's properties in a HashMap, so it
/// finds two broken rules in an order that changes from one process to the
/// next; sorted by field path, the same manifest is always refused in the
/// same words.
pub fn rules_message(errors: &kube_cel::ValidationErrors) -> String {
    let mut lines: Vec<String> = errors
        .as_slice()
        .iter()
        .map(|error| format!("  - {error}"))
        .collect();
    lines.sort();
    format!("{} validation error(s):\n{}", lines.len(), lines.join("\n"))
}

/// The InstanceGeneration schema, derived once per process: deriving it
/// takes about 5 ms and compiling its CEL rules about 6 ms, against well
/// under a millisecond for the rest of a manifest's parse.
struct ManifestSchema {
    openapi: Value,
    rules: kube_cel::CompiledSchema,
}

static INSTANCE_GENERATION_SCHEMA: LazyLock<ManifestSchema> = LazyLock::new(|| {
    let openapi = openapi_schema::<InstanceGeneration>();
    let rules = kube_cel::compile_schema(&openapi);
    ManifestSchema { openapi, rules }
});

/// The openAPIV3Schema of a derived CRD, as JSON.
fn openapi_schema<K: CustomResourceExt>() -> Value {
    K::crd()
        .spec
        .versions
        .first()
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(Value::Null)
}

/// Collects the paths of fields that the structural schema does not declare.
/// `apiVersion`, `kind` and `metadata` are the API server's and are not
/// described by a CRD schema.
fn unknown_fields(value: &Value, schema: &Value, path: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            let properties = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            for (key, child) in map {
                let child_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                if path.is_empty() && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                    continue;
                }
                match (properties.and_then(|p| p.get(key)), additional) {
                    (Some(child_schema), _) | (None, Some(child_schema)) => {
                        unknown_fields(child, child_schema, &child_path, out)
                    }
                    (None, None) if properties.is_some() => out.push(child_path),
                    (None, None) => {}
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    unknown_fields(item, item_schema, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// Collects, in the API server's words, every string outside its `enum`
/// or longer than its `maxLength` (counted in characters, as the server
/// counts), list longer
/// than its `maxItems`, map with more entries than its `maxProperties`, and
/// list-map entry whose key an earlier entry has.
fn structural_errors(value: &Value, schema: &Value, path: &str, out: &mut Vec<String>) {
    let limit = |key: &str| schema.get(key).and_then(Value::as_u64);
    // A list's maxItems and a map's maxProperties, in the same words.
    let too_many = |key: &str, count: usize, out: &mut Vec<String>| {
        if let Some(max) = limit(key)
            && count as u64 > max
        {
            out.push(format!(
                "{path}: Too many: {count}: must have at most {max} items"
            ));
        }
    };
    match value {
        Value::String(text) => {
            if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
                && !allowed.iter().any(|a| a.as_str() == Some(text))
            {
                let listed: Vec<String> = allowed.iter().map(Value::to_string).collect();
                out.push(format!(
                    "{path}: Unsupported value: {}: supported values: {}",
                    Value::String(text.clone()),
                    listed.join(", ")
                ));
            }
            if let Some(max) = limit("maxLength")
                && text.chars().count() as u64 > max
            {
                out.push(format!(
                    "{path}: Too long: may not be more than {max} bytes"
                ));
            }
        }
        Value::Array(items) => {
            too_many("maxItems", items.len(), out);
            duplicate_keys(items, schema, path, out);
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    structural_errors(item, item_schema, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::Object(map) => {
            too_many("maxProperties", map.len(), out);
            let properties = schema.get("properties");
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            for (key, child) in map {
                let child_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                if let Some(child_schema) = properties.and_then(|p| p.get(key)).or(additional) {
                    structural_errors(child, child_schema, &child_path, out);
                }
            }
        }
        _ => {}
    }
}

/// The entries of an `x-kubernetes-list-type: map` list whose key fields
/// repeat an earlier entry's.
fn duplicate_keys(items: &[Value], schema: &Value, path: &str, out: &mut Vec<String>) {
    if schema.get("x-kubernetes-list-type").and_then(Value::as_str) != Some("map") {
        return;
    }
    let keys: Vec<&str> = schema
        .get("x-kubernetes-list-map-keys")
        .and_then(Value::as_array)
        .map(|keys| keys.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut seen = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let key: serde_json::Map<String, Value> = keys
            .iter()
            .filter_map(|k| Some(((*k).to_string(), item.get(*k)?.clone())))
            .collect();
        if seen.contains(&key) {
            out.push(format!(
                "{path}[{i}]: Duplicate value: {}",
                Value::Object(key)
            ));
        } else {
            seen.push(key);
        }
    }
}
