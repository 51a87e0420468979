//! Property tests of the manifest path (`parse_instance_generation`: YAML,
//! kind, unknown fields, schema, name, every CEL rule) over arbitrary text,
//! YAML-shaped text, byte edits of a valid manifest, and structured
//! mutations of its object. Whatever comes in: no panic; a refusal is an
//! `Err` whose message is not empty; an acceptance is an object that passes
//! every CEL rule again and survives a round trip through YAML. The CEL
//! verdict (rules compiled once per process) is kube's own `validate_cel`
//! (compiled per call) both ways: what one refuses, the other refuses with
//! the same words.
//!
//! CI runs proptest's default case count. A longer campaign:
//! `PROPTEST_CASES=100000 cargo test --release -p crds --test fuzz_manifest`.

use genswap_crds::InstanceGeneration;
use genswap_crds::manifest::{ManifestError, parse_instance_generation, rules_message};
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{Map, Value, json};

/// The valid manifest every mutation starts from: every section present.
const VALID: &str = include_str!("fixtures/every_section.yaml");

/// Fewer cases than proptest's default: each case checks kube's own CEL
/// verdict, which builds the CRD schema and compiles its rules per call
/// and is slow in a debug build. `PROPTEST_CASES` still wins.
fn config() -> Config {
    let mut config = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = 64;
    }
    config
}

/// The property every input must satisfy.
fn check(text: &str) -> Result<(), TestCaseError> {
    match parse_instance_generation(text) {
        Err(error) => {
            let message = error.to_string();
            prop_assert!(
                !message.trim().is_empty(),
                "an empty refusal ({error:?}) for {text:?}"
            );
            if let ManifestError::Rules(ours) = &error {
                let typed: InstanceGeneration = serde_saphyr::from_str::<Value>(text)
                    .map_err(|e| e.to_string())
                    .and_then(|value| serde_json::from_value(value).map_err(|e| e.to_string()))
                    .map_err(|e| {
                        TestCaseError::fail(format!(
                            "refused by a rule but not typed ({e}): {text:?}"
                        ))
                    })?;
                match kube::core::cel::validate_cel(&typed) {
                    Ok(()) => {
                        return Err(TestCaseError::fail(format!(
                            "refused ({ours}) what kube's validate_cel accepts: {text:?}"
                        )));
                    }
                    // The same lines; ours sorted, kube's in the order
                    // its HashMap of properties gave this process.
                    Err(theirs) => prop_assert_eq!(ours, &rules_message(&theirs)),
                }
            }
        }
        Ok(ig) => {
            prop_assert!(
                ig.metadata.name.as_deref().is_some_and(|n| !n.is_empty()),
                "accepted without a name: {text:?}"
            );
            if let Err(error) = kube::core::cel::validate_cel(&ig) {
                return Err(TestCaseError::fail(format!(
                    "accepted an object that breaks a rule ({error}): {text:?}"
                )));
            }
            let again = serde_saphyr::to_string(&ig)
                .map_err(|e| TestCaseError::fail(format!("cannot write it back: {e}")))?;
            match parse_instance_generation(&again) {
                Ok(reread) => prop_assert_eq!(reread, ig, "round trip of {:?}", text),
                Err(error) => {
                    return Err(TestCaseError::fail(format!(
                        "accepted {text:?} but not its own YAML {again:?}: {error}"
                    )));
                }
            }
        }
    }
    Ok(())
}

fn valid_object() -> Value {
    let ig: InstanceGeneration = parse_instance_generation(VALID).expect("the fixture is valid");
    serde_json::to_value(ig).expect("it serializes")
}

/// Scalars chosen to hit the rules' edges: YAML's special words, numbers at
/// and past the integer limits, quantities, paths, URLs, digests.
fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop_oneof![
            Just(0i64),
            Just(-1),
            Just(1),
            Just(i64::from(i32::MAX)),
            Just(i64::from(i32::MAX) + 1),
            Just(4_294_967_294),
            Just(4_294_967_295),
            Just(i64::MIN),
            Just(i64::MAX),
        ]
        .prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        prop_oneof![
            Just("".to_string()),
            Just("512Mi".to_string()),
            Just("0".to_string()),
            Just("-1".to_string()),
            Just("1e999999999".to_string()),
            Just("9999999999999999999999999999Ei".to_string()),
            Just("0.000000000000000000001m".to_string()),
            Just("1.5e-9999".to_string()),
            Just(".inf".to_string()),
            Just("NaN".to_string()),
            Just("/".to_string()),
            Just("//".to_string()),
            Just("http://".to_string()),
            Just("https://x".to_string()),
            Just("file:///etc/passwd".to_string()),
            Just("a".repeat(64)),
            Just("A".repeat(64)),
            Just("x".repeat(129)),
            Just("SIGKILL".to_string()),
            Just("hold".to_string()),
            Just("worker".to_string()),
            "[ -~]{0,40}",
            "[0-9.eE+-]{1,30}[kKMGTPEimun]?[i]?",
            "\\PC{0,20}",
        ]
        .prop_map(Value::from),
    ]
}

/// Any JSON value, a few levels deep.
fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{1,12}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// One change to the object at the node chosen by `pick`.
#[derive(Clone, Debug)]
enum Mutation {
    /// Drop the chosen member.
    Remove,
    /// Replace the chosen node with a value.
    Set(Value),
    /// Add a member (to a mapping) or an item (to a list).
    Add(String, Value),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => Just(Mutation::Remove),
        5 => value().prop_map(Mutation::Set),
        2 => ("[a-zA-Z]{1,12}", value()).prop_map(|(k, v)| Mutation::Add(k, v)),
    ]
}

/// Every node of `value` as a path of keys and indices.
fn paths(value: &Value, here: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(here.clone());
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                here.push(Step::Key(key.clone()));
                paths(child, here, out);
                here.pop();
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                here.push(Step::Index(i));
                paths(child, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn node<'a>(value: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    let mut here = value;
    for step in path {
        here = match (step, here) {
            (Step::Key(key), Value::Object(map)) => map.get_mut(key)?,
            (Step::Index(i), Value::Array(items)) => items.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(here)
}

fn apply(object: &mut Value, pick: prop::sample::Index, mutation: Mutation) {
    let mut all = Vec::new();
    paths(object, &mut Vec::new(), &mut all);
    let path = pick.get(&all).clone();
    match mutation {
        Mutation::Set(new) => {
            if let Some(target) = node(object, &path) {
                *target = new;
            }
        }
        Mutation::Add(key, new) => match node(object, &path) {
            Some(Value::Object(map)) => {
                map.insert(key, new);
            }
            Some(Value::Array(items)) => items.push(new),
            _ => {}
        },
        Mutation::Remove => {
            let Some((last, parent)) = path.split_last() else {
                return;
            };
            match (node(object, parent), last) {
                (Some(Value::Object(map)), Step::Key(key)) => {
                    map.remove(key);
                }
                (Some(Value::Array(items)), Step::Index(i)) if *i < items.len() => {
                    items.remove(*i);
                }
                _ => {}
            }
        }
    }
}

/// One edit of the text at a relative position.
#[derive(Clone, Debug)]
enum Edit {
    Delete(prop::sample::Index, usize),
    Insert(prop::sample::Index, String),
    Flip(prop::sample::Index, u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<prop::sample::Index>(), 1usize..12).prop_map(|(i, n)| Edit::Delete(i, n)),
        (
            any::<prop::sample::Index>(),
            prop_oneof![
                "[ :\\-\\[\\]{}#&*!|>'\"%@`,?\n\t]{1,4}",
                "[a-zA-Z0-9]{1,8}",
                Just("\n  bogus: 1".to_string()),
                Just(": ".to_string()),
                Just("&a ".to_string()),
                Just("*a".to_string()),
                Just("!!binary ".to_string()),
                Just("<<: *a\n".to_string()),
                Just("\n---\n".to_string()),
            ]
        )
            .prop_map(|(i, s)| Edit::Insert(i, s)),
        (any::<prop::sample::Index>(), 0u8..8).prop_map(|(i, bit)| Edit::Flip(i, bit)),
    ]
}

fn apply_edit(bytes: &mut Vec<u8>, edit: &Edit) {
    if bytes.is_empty() {
        if let Edit::Insert(_, text) = edit {
            bytes.extend_from_slice(text.as_bytes());
        }
        return;
    }
    match edit {
        Edit::Delete(at, n) => {
            let start = at.index(bytes.len());
            let end = (start + n).min(bytes.len());
            bytes.drain(start..end);
        }
        Edit::Insert(at, text) => {
            let at = at.index(bytes.len() + 1);
            bytes.splice(at..at, text.bytes());
        }
        Edit::Flip(at, bit) => {
            let at = at.index(bytes.len());
            bytes[at] ^= 1 << bit;
        }
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_text_never_panics(text in any::<String>()) {
        check(&text)?;
    }

    #[test]
    fn yaml_shaped_text_never_panics(
        text in "(([a-zA-Z]{1,10}|\"[^\"\n]{0,10}\"|-|[0-9]{1,5}): ?([ -~]{0,20}|\\{[^}\n]{0,20}\\}|\\[[^\\]\n]{0,20}\\])?\n {0,6}){0,12}",
    ) {
        check(&format!("apiVersion: genswap.dev/v1alpha1\nkind: InstanceGeneration\n{text}"))?;
        check(&text)?;
    }

    #[test]
    fn edits_of_a_valid_manifest_never_panic(edits in prop::collection::vec(edit(), 1..6)) {
        let mut bytes = VALID.as_bytes().to_vec();
        for edit in &edits {
            apply_edit(&mut bytes, edit);
        }
        // The reader takes text; standalone mode refuses non-UTF-8 before it.
        check(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn structured_mutations_never_panic(
        mutations in prop::collection::vec((any::<prop::sample::Index>(), mutation()), 1..5),
    ) {
        let mut object = valid_object();
        for (pick, change) in mutations {
            apply(&mut object, pick, change);
        }
        let as_json = serde_json::to_string(&object).expect("JSON text");
        check(&as_json)?;
        if let Ok(as_yaml) = serde_saphyr::to_string(&object) {
            check(&as_yaml)?;
        }
    }
}

#[test]
fn the_fixture_is_accepted_and_round_trips() {
    check(VALID).expect("the fixture holds the property");
    check(&serde_json::to_string(&valid_object()).expect("JSON")).expect("as JSON too");
}
