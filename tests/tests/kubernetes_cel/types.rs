//! CEL types as the Kubernetes type checker sees them, and how a schema
//! node becomes one.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

#[derive(Clone, Debug, PartialEq)]
pub enum Type {
    /// Unknown until run time: matches every parameter.
    Dyn,
    Null,
    Bool,
    Int,
    Uint,
    Double,
    String,
    Bytes,
    Duration,
    Timestamp,
    List(Box<Type>),
    Map(Box<Type>, Box<Type>),
    /// A schema object with declared properties (or a declared record such
    /// as an admission request): only those fields can be selected.
    Object(Object),
    /// A library's own type, by the name Kubernetes gives it.
    Opaque(&'static str),
    Optional(Box<Type>),
    /// A type as a value: what `type(x)` or a type name such as `int` is.
    Kind,
    /// A type parameter of a declaration (`A` in `list(A)`).
    Param(&'static str),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Object {
    /// Where it comes from, for messages: a schema path.
    pub name: String,
    pub fields: BTreeMap<String, Type>,
}

pub fn list(element: Type) -> Type {
    Type::List(Box::new(element))
}

pub fn map(key: Type, value: Type) -> Type {
    Type::Map(Box::new(key), Box::new(value))
}

pub fn optional(inner: Type) -> Type {
    Type::Optional(Box::new(inner))
}

pub fn object(name: impl Into<String>, fields: &[(&str, Type)]) -> Type {
    Type::Object(Object {
        name: name.into(),
        fields: fields
            .iter()
            .map(|(field, ty)| ((*field).to_string(), ty.clone()))
            .collect(),
    })
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Dyn => f.write_str("dyn"),
            Type::Null => f.write_str("null_type"),
            Type::Bool => f.write_str("bool"),
            Type::Int => f.write_str("int"),
            Type::Uint => f.write_str("uint"),
            Type::Double => f.write_str("double"),
            Type::String => f.write_str("string"),
            Type::Bytes => f.write_str("bytes"),
            Type::Duration => f.write_str("google.protobuf.Duration"),
            Type::Timestamp => f.write_str("google.protobuf.Timestamp"),
            Type::List(element) => write!(f, "list({element})"),
            Type::Map(key, value) => write!(f, "map({key}, {value})"),
            Type::Object(object) => write!(f, "object({})", object.name),
            Type::Opaque(name) => f.write_str(name),
            Type::Optional(inner) => write!(f, "optional_type({inner})"),
            Type::Kind => f.write_str("type"),
            Type::Param(name) => f.write_str(name),
        }
    }
}

impl Type {
    pub fn contains_dyn(&self) -> bool {
        match self {
            Type::Dyn => true,
            Type::List(element) | Type::Optional(element) => element.contains_dyn(),
            Type::Map(key, value) => key.contains_dyn() || value.contains_dyn(),
            _ => false,
        }
    }
}

/// Whether a value of `actual` may stand where `expected` is wanted,
/// binding type parameters on the way (`dyn` on either side matches).
pub fn assignable(
    expected: &Type,
    actual: &Type,
    bindings: &mut BTreeMap<&'static str, Type>,
) -> bool {
    match (expected, actual) {
        (Type::Param(name), _) => match bindings.get(name).cloned() {
            None => {
                bindings.insert(name, actual.clone());
                true
            }
            Some(bound) => {
                let mut inner = BTreeMap::new();
                if !assignable(&bound, actual, &mut inner)
                    && !assignable(actual, &bound, &mut inner)
                {
                    return false;
                }
                if bound.contains_dyn() && !actual.contains_dyn() {
                    bindings.insert(name, actual.clone());
                }
                true
            }
        },
        (Type::Dyn, _) => true,
        (_, Type::Dyn) => {
            bind_all(expected, bindings);
            true
        }
        (Type::List(e), Type::List(a)) | (Type::Optional(e), Type::Optional(a)) => {
            assignable(e, a, bindings)
        }
        (Type::Map(ek, ev), Type::Map(ak, av)) => {
            assignable(ek, ak, bindings) && assignable(ev, av, bindings)
        }
        // Objects and library types are nullable; scalars are not.
        (Type::Object(_) | Type::Opaque(_), Type::Null) => true,
        (Type::Object(e), Type::Object(a)) => e.name == a.name,
        _ => expected == actual,
    }
}

/// Binds every unbound parameter inside `ty` to `dyn`.
fn bind_all(ty: &Type, bindings: &mut BTreeMap<&'static str, Type>) {
    match ty {
        Type::Param(name) => {
            bindings.entry(name).or_insert(Type::Dyn);
        }
        Type::List(inner) | Type::Optional(inner) => bind_all(inner, bindings),
        Type::Map(key, value) => {
            bind_all(key, bindings);
            bind_all(value, bindings);
        }
        _ => {}
    }
}

/// `ty` with its parameters replaced by what they are bound to.
pub fn substitute(ty: &Type, bindings: &BTreeMap<&'static str, Type>) -> Type {
    match ty {
        Type::Param(name) => bindings.get(name).cloned().unwrap_or(Type::Dyn),
        Type::List(inner) => list(substitute(inner, bindings)),
        Type::Optional(inner) => optional(substitute(inner, bindings)),
        Type::Map(key, value) => map(substitute(key, bindings), substitute(value, bindings)),
        other => other.clone(),
    }
}

/// What the root of a CRD's CEL rules may read of `metadata`: only the
/// name and generateName (apiextensions' CEL, "metadata" limitation).
pub fn crd_root_metadata() -> Type {
    object(
        "metadata",
        &[("name", Type::String), ("generateName", Type::String)],
    )
}

/// The CEL type of an OpenAPI v3 schema node, as apiextensions maps it
/// (k8s.io/apiserver/pkg/cel/common/schemas.go): int-or-string and
/// preserved unknown fields are `dyn`, `date-time`/`duration`/`byte`
/// strings are timestamps, durations and bytes, objects with properties
/// are records, objects with additionalProperties are maps.
pub fn schema_type(node: &Value, path: &str) -> Type {
    if node["x-kubernetes-int-or-string"] == Value::Bool(true) {
        return Type::Dyn;
    }
    let properties = node["properties"].as_object();
    let declared = node["type"].as_str();
    match declared {
        Some("string") => match node["format"].as_str() {
            Some("date-time" | "datetime") => Type::Timestamp,
            Some("duration") => Type::Duration,
            Some("byte") => Type::Bytes,
            _ => Type::String,
        },
        Some("integer") => Type::Int,
        Some("number") => Type::Double,
        Some("boolean") => Type::Bool,
        Some("array") => list(schema_type(&node["items"], &format!("{path}.@items"))),
        Some("object") | None => {
            if let Some(properties) = properties {
                let fields = properties
                    .iter()
                    .map(|(name, child)| {
                        (name.clone(), schema_type(child, &format!("{path}.{name}")))
                    })
                    .collect();
                return Type::Object(Object {
                    name: path.to_string(),
                    fields,
                });
            }
            match &node["additionalProperties"] {
                Value::Object(_) => map(
                    Type::String,
                    schema_type(&node["additionalProperties"], &format!("{path}.@values")),
                ),
                Value::Bool(true) => map(Type::String, Type::Dyn),
                _ if node["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true) => Type::Dyn,
                _ if declared.is_none() => Type::Dyn,
                _ => Type::Object(Object {
                    name: path.to_string(),
                    fields: BTreeMap::new(),
                }),
            }
        }
        Some(_) => Type::Dyn,
    }
}
