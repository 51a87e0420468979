//! `fixtures/schema_table.yaml` read into objects: what the schema must
//! refuse and accept, shared by the standalone reader's check
//! (`schema_table.rs`) and the real API server's (`apiserver.rs`).

use serde::Deserialize;
use serde_json::{Map, Value};

const TABLE: &str = include_str!("../fixtures/schema_table.yaml");
const FIXTURE: &str = include_str!("../fixtures/every_section.yaml");

/// Which part of the schema refuses a case.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum By {
    /// A CEL rule (`x-kubernetes-validations`).
    Rule,
    /// The structural schema: limits and list-map keys.
    Schema,
}

#[derive(Deserialize)]
struct Table {
    refused: Vec<Entry>,
    accepted: Vec<Entry>,
}

#[derive(Deserialize)]
struct Entry {
    what: String,
    set: Map<String, Value>,
    #[serde(default)]
    by: Option<By>,
    #[serde(default)]
    says: Option<String>,
}

/// One case: the fixture with the edits applied.
pub struct Case {
    pub what: String,
    pub object: Value,
    /// For a refused case: what refuses it, and the words it must use.
    pub refusal: Option<(By, String)>,
}

/// Every case the API server must refuse.
pub fn refused() -> Vec<Case> {
    let cases: Vec<Case> = table().refused.into_iter().map(case).collect();
    assert!(
        cases.iter().all(|c| c.refusal.is_some()),
        "every refused case has `by` and `says`"
    );
    cases
}

/// Every case the API server must accept.
pub fn accepted() -> Vec<Case> {
    table().accepted.into_iter().map(case).collect()
}

fn table() -> Table {
    serde_saphyr::from_str(TABLE).expect("fixtures/schema_table.yaml parses")
}

fn case(entry: Entry) -> Case {
    let mut object: Value =
        serde_saphyr::from_str(FIXTURE).expect("fixtures/every_section.yaml parses");
    for (path, value) in entry.set {
        let target = pointer(&mut object, &path)
            .unwrap_or_else(|| panic!("{}: no {path} in the fixture", entry.what));
        *target = expand(&value, None);
    }
    Case {
        refusal: entry.by.zip(entry.says),
        what: entry.what,
        object,
    }
}

/// The value at dotted `path`; a missing last key is added.
fn pointer<'a>(object: &'a mut Value, path: &str) -> Option<&'a mut Value> {
    let mut here = object;
    for step in path.split('.') {
        here = match here {
            Value::Array(items) => items.get_mut(step.parse::<usize>().ok()?)?,
            Value::Object(map) => map.entry(step).or_insert(Value::Null),
            _ => return None,
        };
    }
    Some(here)
}

/// `value` with its `repeat`, `list` and `entries` forms written out, and
/// `{n}` replaced by `index` where there is one.
fn expand(value: &Value, index: Option<usize>) -> Value {
    let times = |map: &Map<String, Value>| {
        map.get("times")
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
    };
    match value {
        Value::Object(map) if map.len() == 2 && times(map).is_some() => {
            let n = times(map).unwrap_or_default();
            if let Some(text) = map.get("repeat").and_then(Value::as_str) {
                return Value::String(text.repeat(n));
            }
            if let Some(item) = map.get("list") {
                return Value::Array((0..n).map(|i| expand(item, Some(i))).collect());
            }
            if let Some(Value::Object(entry)) = map.get("entries") {
                let mut out = Map::new();
                for i in 0..n {
                    for (key, value) in entry {
                        out.insert(substitute(key, Some(i)), expand(value, Some(i)));
                    }
                }
                return Value::Object(out);
            }
            panic!("a form with `times` needs `repeat`, `list` or `entries`: {value}")
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (substitute(k, index), expand(v, index)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(|v| expand(v, index)).collect()),
        Value::String(text) => Value::String(substitute(text, index)),
        other => other.clone(),
    }
}

fn substitute(text: &str, index: Option<usize>) -> String {
    match index {
        Some(i) => text.replace("{n}", &i.to_string()),
        None => text.to_string(),
    }
}
