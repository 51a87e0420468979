//! The committed CRD YAML must be exactly what the types generate.

use std::path::Path;

#[test]
fn committed_crds_match_the_types() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rendered = genswap_crds::crdgen::render().expect("CRDs render");
    let mut drift = Vec::new();
    for dir in genswap_crds::crdgen::OUTPUT_DIRS {
        for (file, yaml) in &rendered {
            let path = root.join(dir).join(file);
            match std::fs::read_to_string(&path) {
                Ok(committed) if &committed == yaml => {}
                Ok(_) => drift.push(format!("{dir}/{file} differs")),
                Err(e) => drift.push(format!("{dir}/{file}: {e}")),
            }
        }
    }
    assert!(
        drift.is_empty(),
        "generated CRDs drifted from the types: {drift:?}\nregenerate with: cargo run -p crds --bin crdgen -- --write"
    );
}

#[test]
fn crds_declare_what_kubectl_relies_on() {
    let rendered = genswap_crds::crdgen::render().expect("CRDs render");
    let all: String = rendered.iter().map(|(_, y)| y.as_str()).collect();
    for needle in [
        "selectableFields:\n    - jsonPath: .spec.nodeName",
        "rule: self == oldSelf",
        "shortNames:\n    - ig",
        "shortNames:\n    - swa",
        "x-kubernetes-list-type: map",
        "status: {}",
        "jsonPath: .status.conditions[?(@.type==\"Ready\")].reason",
    ] {
        assert!(all.contains(needle), "generated CRDs lack {needle:?}");
    }
}

#[test]
fn crdgen_stdout_is_the_committed_files_concatenated() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_crdgen"))
        .output()
        .expect("crdgen runs");
    assert!(output.status.success(), "crdgen failed: {:?}", output);
    let mut committed = String::new();
    for (file, _) in genswap_crds::crdgen::render().expect("CRDs render") {
        committed += &std::fs::read_to_string(root.join("crds").join(file)).expect("committed CRD");
    }
    assert_eq!(String::from_utf8_lossy(&output.stdout), committed);
}
