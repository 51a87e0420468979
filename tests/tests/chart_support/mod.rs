//! Rendering the Helm chart with a real helm, for the `chart_*` tests.
//!
//! The helm binary is `test_cluster::helm::helm`: `$HELM`, else one
//! `.ci/install-helm` installs under the cargo target directory; the tests
//! never skip for want of helm.

#![allow(dead_code)] // Each test binary uses its own part of this module.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
pub use test_cluster::helm::helm;

/// The release name and namespace every render uses.
pub const RELEASE: &str = "genswap";
/// See [`RELEASE`].
pub const NAMESPACE: &str = "genswap-system";

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lies inside the workspace")
        .to_path_buf()
}

/// The chart directory.
pub fn chart_dir() -> PathBuf {
    workspace().join("charts/genswap")
}

/// The values files CI renders the chart with: `charts/genswap/ci/*-values.yaml`.
pub fn ci_values_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(chart_dir().join("ci"))
        .expect("charts/genswap/ci exists")
        .map(|entry| entry.expect("a readable ci/ entry").path())
        .filter(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with("-values.yaml"))
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 4,
        "expected the chart's ci/ values files, found {files:?}"
    );
    files
}

/// `helm template` of the chart with these values files and `--set`
/// arguments: the rendered YAML, or helm's error output.
pub fn try_render(values: &[&Path], set: &[&str]) -> Result<String, String> {
    let mut command = Command::new(helm());
    command
        .arg("template")
        .arg(RELEASE)
        .arg(chart_dir())
        .args(["--namespace", NAMESPACE]);
    for file in values {
        command.arg("--values").arg(file);
    }
    for assignment in set {
        command.args(["--set", assignment]);
    }
    let output = command.output().expect("run helm template");
    if output.status.success() {
        Ok(String::from_utf8(output.stdout).expect("helm renders UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// One rendered object.
#[derive(Clone, Debug)]
pub struct Doc {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`, when set.
    pub namespace: Option<String>,
    /// The whole object.
    pub value: Value,
}

impl Doc {
    /// `kind/name`, for messages.
    pub fn id(&self) -> String {
        format!("{}/{}", self.kind, self.name)
    }
}

/// Splits rendered YAML into its objects (empty documents dropped).
pub fn parse_docs(yaml: &str) -> Vec<Doc> {
    let values: Vec<Value> =
        serde_saphyr::from_multiple(yaml).expect("helm's output is valid YAML");
    values
        .into_iter()
        .filter(|value| !value.is_null())
        .map(|value| {
            let text = |pointer: &str| {
                value
                    .pointer(pointer)
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            };
            Doc {
                api_version: text("/apiVersion").expect("every object has an apiVersion"),
                kind: text("/kind").expect("every object has a kind"),
                name: text("/metadata/name").expect("every object has a name"),
                namespace: text("/metadata/namespace"),
                value: value.clone(),
            }
        })
        .collect()
}

/// Renders with these values files, panicking with helm's message on failure.
pub fn render(values: &[&Path], set: &[&str]) -> Vec<Doc> {
    match try_render(values, set) {
        Ok(yaml) => parse_docs(&yaml),
        Err(error) => panic!("helm template with {values:?} {set:?} failed:\n{error}"),
    }
}

/// One way CI renders the chart.
pub struct ValuesSet {
    /// The values file's name, or `default values`.
    pub name: String,
    /// What the values file sets (`{}` for the defaults).
    pub values: Value,
    /// What it renders.
    pub docs: Vec<Doc>,
}

impl ValuesSet {
    /// The value at `pointer` (e.g. `/watchNamespace`) the file sets.
    pub fn set(&self, pointer: &str) -> Option<&Value> {
        self.values.pointer(pointer)
    }
}

/// Every values set CI renders: the defaults, then each ci/ file.
pub fn every_values_set() -> Vec<ValuesSet> {
    let mut sets = vec![ValuesSet {
        name: "default values".to_string(),
        values: Value::Object(Default::default()),
        docs: render(&[], &[]),
    }];
    for file in ci_values_files() {
        let text = fs::read_to_string(&file).expect("read a ci values file");
        sets.push(ValuesSet {
            name: file
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string(),
            values: serde_saphyr::from_str(&text).expect("a ci values file is YAML"),
            docs: render(&[&file], &[]),
        });
    }
    sets
}

/// The one object of this kind (and name suffix), panicking when there is
/// not exactly one.
pub fn only<'a>(docs: &'a [Doc], kind: &str) -> &'a Doc {
    let found: Vec<&Doc> = docs.iter().filter(|d| d.kind == kind).collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind}, found {:?}",
        found.iter().map(|d| d.id()).collect::<Vec<_>>()
    );
    found[0]
}

/// The typed object of the one document of type `T`'s kind.
pub fn typed<T>(docs: &[Doc]) -> T
where
    T: k8s_openapi::Resource + serde::de::DeserializeOwned,
{
    let doc = only(docs, T::KIND);
    serde_json::from_value(doc.value.clone())
        .unwrap_or_else(|e| panic!("{} does not parse as {}: {e}", doc.id(), T::KIND))
}
