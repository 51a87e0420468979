//! Every manifest under `examples/` parses into the types, passes every CEL
//! rule, and keeps its defaults through a serialisation round trip.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::path::{Path, PathBuf};

use genswap_crds::manifest::{ManifestError, parse_instance_generation};
use genswap_crds::{Cause, InstanceKind, Mode, SocketLayout, StopSignal};

fn example_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files: Vec<PathBuf> = walk(&dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("examples/ is readable") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn every_example_parses_and_passes_the_rules() {
    let files = example_files();
    assert!(
        files.len() >= 3,
        "expected the example manifests, found {files:?}"
    );
    for file in files {
        let yaml = std::fs::read_to_string(&file).expect("example is readable");
        // The parser refuses unknown fields and evaluates every CEL rule.
        parse_instance_generation(&yaml).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    }
}

#[test]
fn defaults_are_filled_and_survive_a_round_trip() {
    let yaml = r#"
apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata: {name: minimal}
spec:
  build:
    id: b1
    artifact: {url: "https://example.com/b1"}
    sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
"#;
    let ig = parse_instance_generation(yaml).expect("minimal manifest parses");
    let spec = &ig.spec;
    assert_eq!(spec.kind, InstanceKind::Instance);
    assert_eq!(spec.cause, Cause::Release);
    assert_eq!(spec.mode, Mode::Overlap);
    assert_eq!(
        spec.health.action(),
        genswap_crds::ProbeAction::HttpGet(genswap_crds::HttpGetProbe::default()),
        "no probe at all is GET / over the generation socket"
    );
    assert_eq!(spec.health.timeout_seconds, 30);
    assert_eq!(spec.settle.seconds, 10);
    assert!(!spec.settle.all_nodes);
    assert_eq!(spec.stop.signal, StopSignal::Term);
    assert_eq!(spec.stop.timeout_seconds, 30);
    assert_eq!(spec.rollout.canary_nodes, IntOrString::Int(1));
    assert_eq!(spec.rollout.max_parallel, IntOrString::Int(1));
    assert!(spec.rollout.halt_on_failure);
    assert_eq!(spec.socket.layout, SocketLayout::PerGeneration);

    let json = serde_json::to_value(&ig).expect("serializes");
    assert_eq!(
        json["spec"]["health"]["timeoutSeconds"], 30,
        "defaults are written out"
    );
    assert_eq!(json["spec"]["stop"]["signal"], "SIGTERM");
    assert_eq!(json["spec"]["demand"], "");
    let again: genswap_crds::InstanceGeneration =
        serde_json::from_value(json).expect("parses back");
    assert_eq!(again, ig);
    let yaml_again = serde_saphyr::to_string(&ig).expect("serializes as YAML");
    assert_eq!(
        parse_instance_generation(&yaml_again).expect("YAML parses back"),
        ig
    );
}

#[test]
fn manifests_that_are_not_instance_generations_are_refused() {
    let err = parse_instance_generation("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
        .expect_err("refused");
    assert!(matches!(err, ManifestError::WrongKind { .. }), "{err}");
    let err = parse_instance_generation("spec: [unclosed").expect_err("refused");
    assert!(matches!(err, ManifestError::Yaml(_)), "{err}");
}

#[test]
fn unknown_fields_are_refused() {
    let yaml = r#"
apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata: {name: typo}
spec:
  biuld: {}
  build:
    id: b1
    artifact: {path: /x}
    sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
"#;
    let err = parse_instance_generation(yaml).expect_err("a misspelt field is refused");
    assert!(err.to_string().contains("spec.biuld"), "{err}");
    let nested = yaml
        .replace("  biuld: {}\n", "")
        .replace("id: b1", "id: b1\n    sha265: x");
    let err = parse_instance_generation(&nested).expect_err("a nested misspelt field is refused");
    assert!(err.to_string().contains("spec.build.sha265"), "{err}");
}

#[test]
fn rule_violations_are_refused_with_the_rule_message() {
    let yaml = r#"
apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata: {name: bad}
spec:
  build:
    id: b1
    artifact: {path: relative/x}
    sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
"#;
    let err = parse_instance_generation(yaml).expect_err("a relative path is refused");
    assert!(matches!(err, ManifestError::Rules(_)), "{err}");
    assert!(
        err.to_string()
            .contains("build.artifact.path must be an absolute path"),
        "{err}"
    );
}
