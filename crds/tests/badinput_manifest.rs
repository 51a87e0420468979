//! Bad InstanceGeneration manifests through the one path that reads them,
//! `parse_instance_generation` (standalone mode's reader, validating as the
//! API server would): the shapes that are no object of the schema at all
//! (not YAML, another kind, unknown fields, wrong types, no name) and how
//! broken rules are reported, each an `Err` of the right kind whose
//! message names the field or the rule. What each rule and limit refuses
//! is the schema table's (`schema_table.rs`, refereed by `apiserver.rs`).

use genswap_crds::manifest::{ManifestError, parse_instance_generation};

/// A valid manifest with every optional section spelled out, so each rule
/// can be broken by replacing one line.
const VALID: &str = include_str!("fixtures/every_section.yaml");

/// `VALID` with the one line `from` replaced by `to` (which must exist).
fn with(from: &str, to: &str) -> String {
    assert!(VALID.contains(from), "the fixture has no {from:?}");
    VALID.replacen(from, to, 1)
}

fn refused(yaml: &str) -> ManifestError {
    match parse_instance_generation(yaml) {
        Ok(ig) => panic!("accepted: {ig:?}\n--- from ---\n{yaml}"),
        Err(error) => error,
    }
}

#[test]
fn the_fixture_is_valid() {
    let ig = parse_instance_generation(VALID).expect("the fixture is valid");
    assert_eq!(ig.spec.build.id, "app-1");
}

#[test]
fn two_broken_rules_are_both_named() {
    let yaml = with("path: /healthz", "path: healthz").replace("pidsMax: 64", "pidsMax: 0");
    match refused(&yaml) {
        ManifestError::Rules(text) => {
            assert!(text.contains("health.path must start with /"), "{text}");
            assert!(
                text.contains("resources.pidsMax must be at least 1"),
                "{text}"
            );
        }
        other => panic!("expected CEL refusals, got {other:?}"),
    }
}

#[test]
fn two_broken_rules_are_named_in_field_order_every_time() {
    let sha = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";
    let yaml = with("memoryMax: 512Mi", "memoryMax: lots")
        .replace(&format!("sha256: {sha}"), "sha256: abc");
    match refused(&yaml) {
        ManifestError::Rules(text) => assert_eq!(
            text,
            "2 validation error(s):\n  \
             - spec.build.sha256: build.sha256 must be 64 lowercase hex characters\n  \
             - spec.resources.memoryMax: resources.memoryMax must be a positive quantity such as 512Mi"
        ),
        other => panic!("expected CEL refusals, got {other:?}"),
    }
}

#[test]
fn text_that_is_not_yaml_is_refused_as_such() {
    for text in [
        "kind: [",
        "apiVersion: genswap.dev/v1alpha1\nkind: InstanceGeneration\n  spec: : :\n",
        "spec:\n\tmode: overlap\n",
        "{\"apiVersion\": ",
        "a: 1\na: 2\n",
    ] {
        match refused(text) {
            ManifestError::Yaml(message) => assert!(!message.is_empty(), "{text:?}"),
            other => panic!("{text:?}: expected a YAML error, got {other:?}"),
        }
    }
}

#[test]
fn a_document_that_is_not_an_instance_generation_says_what_it_is() {
    let config_map = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: app}\ndata: {a: b}\n";
    let attempt = VALID.replace("kind: InstanceGeneration", "kind: SwapAttempt");
    let old_version = VALID.replace("genswap.dev/v1alpha1", "genswap.dev/v1");
    for (text, found) in [
        (config_map.to_string(), "v1 ConfigMap"),
        (attempt, "genswap.dev/v1alpha1 SwapAttempt"),
        (old_version, "genswap.dev/v1 InstanceGeneration"),
    ] {
        match refused(&text) {
            error @ ManifestError::WrongKind { .. } => {
                let message = error.to_string();
                assert!(message.contains(found), "{message}");
                assert!(
                    message.contains("genswap.dev/v1alpha1 InstanceGeneration"),
                    "says what is expected: {message}"
                );
            }
            other => panic!("expected WrongKind for {found}, got {other:?}"),
        }
    }
    // Not a mapping at all: a list, a scalar, nothing.
    for text in ["- a\n- b\n", "just words\n", "", "~\n", "42\n"] {
        let error = refused(text);
        assert!(
            matches!(
                error,
                ManifestError::WrongKind { .. } | ManifestError::Yaml(_)
            ),
            "{text:?}: {error:?}"
        );
        assert!(!error.to_string().is_empty());
    }
}

#[test]
fn unknown_fields_are_named_by_their_path_wherever_they_are() {
    for (yaml, path) in [
        (
            with("  mode: overlap", "  mode: overlap\n  replicas: 3"),
            "spec.replicas",
        ),
        (
            with(
                "    timeoutSeconds: 20",
                "    timeoutSeconds: 20\n    port: 80",
            ),
            "spec.health.port",
        ),
        (
            with("      value: info", "      value: info\n      valueFrom: x"),
            "spec.process.env[0].valueFrom",
        ),
        (format!("{VALID}status2: {{}}\n"), "status2"),
    ] {
        match refused(&yaml) {
            ManifestError::UnknownFields(fields) => {
                assert_eq!(fields, vec![path.to_string()], "{yaml}")
            }
            other => panic!("expected unknown field {path}, got {other:?}"),
        }
    }
}

#[test]
fn wrong_types_and_enum_values_are_schema_refusals_naming_the_value() {
    for (yaml, says) in [
        (with("mode: overlap", "mode: sideways"), "sideways"),
        (with("signal: SIGTERM", "signal: SIGFOO"), "SIGFOO"),
        (
            with("timeoutSeconds: 20", "timeoutSeconds: twenty"),
            "twenty",
        ),
        (with("args: [--port, \"0\"]", "args: --port"), "--port"),
        (with("user: 1000", "user: 1.5"), "1.5"),
    ] {
        match refused(&yaml) {
            ManifestError::Schema(message) => assert!(message.contains(says), "{message}"),
            // An enum's value outside it, in the API server's words.
            ManifestError::Structural(lines) => {
                assert!(lines.iter().any(|l| l.contains(says)), "{lines:?}")
            }
            other => panic!("expected a schema refusal naming {says}, got {other:?}"),
        }
    }
    // A required field missing.
    let no_build = "apiVersion: genswap.dev/v1alpha1\nkind: InstanceGeneration\nmetadata: {name: app}\nspec: {mode: overlap}\n";
    match refused(no_build) {
        ManifestError::Schema(message) => assert!(message.contains("build"), "{message}"),
        other => panic!("expected a schema refusal naming build, got {other:?}"),
    }
}

#[test]
fn a_manifest_without_a_name_is_refused() {
    for yaml in [
        with("  name: app\n", ""),
        with("  name: app", "  name: \"\""),
    ] {
        let error = refused(&yaml);
        assert!(matches!(error, ManifestError::MissingName), "{error:?}");
        assert_eq!(error.to_string(), "metadata.name is missing");
    }
}
