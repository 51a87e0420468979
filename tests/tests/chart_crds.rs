//! The CRDs the chart installs are the ones generated from the Rust types,
//! byte for byte, and nothing else is in the chart's crds/.

mod chart_support;

use std::collections::BTreeSet;
use std::fs;

#[test]
fn the_charts_crds_are_the_generated_ones() {
    let dir = chart_support::chart_dir().join("crds");
    let rendered = genswap_crds::crdgen::render().expect("the CRDs render");
    for (file, yaml) in &rendered {
        let committed = fs::read_to_string(dir.join(file))
            .unwrap_or_else(|e| panic!("charts/genswap/crds/{file}: {e}"));
        assert!(
            committed == *yaml,
            "charts/genswap/crds/{file} differs from the generated CRD: run `cargo run -p crds --bin crdgen -- --write`"
        );
    }
    let expected: BTreeSet<String> = rendered.into_iter().map(|(file, _)| file).collect();
    let present: BTreeSet<String> = fs::read_dir(&dir)
        .expect("charts/genswap/crds exists")
        .map(|entry| {
            entry
                .expect("a readable entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(present, expected, "files in charts/genswap/crds");
}

#[test]
fn the_crds_stay_out_of_the_templates() {
    // Helm installs crds/ before the templates and never upgrades it; a CRD
    // among the templates would be upgraded (and deleted on uninstall, with
    // every object of it).
    let docs = chart_support::render(&[], &[]);
    assert!(
        !docs.iter().any(|d| d.kind == "CustomResourceDefinition"),
        "a CRD is rendered from templates/"
    );
}
