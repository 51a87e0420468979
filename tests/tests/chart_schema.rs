//! A wrong value fails at install, not at run time: each file in
//! `tests/chart-bad-values/` names, on its first line
//! (`# expect: <text>`), what helm's refusal must say, and `helm template`
//! with it must fail saying so. The schema (values.schema.json) catches
//! types, enums, patterns and unknown keys; the templates catch what spans
//! several values.

mod chart_support;

use std::fs;
use std::path::PathBuf;

use chart_support::try_render;

fn bad_values_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("chart-bad-values");
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("tests/chart-bad-values exists")
        .map(|entry| entry.expect("a readable entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_bad_values_file_fails_with_a_message_naming_the_value() {
    let files = bad_values_files();
    assert!(
        files.len() >= 10,
        "expected the bad values files, found {files:?}"
    );
    let mut failures = Vec::new();
    for file in &files {
        let text = fs::read_to_string(file).expect("read a bad values file");
        let expected = text
            .lines()
            .next()
            .and_then(|line| line.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} must start with '# expect: <text>'", file.display()));
        match try_render(&[file], &[]) {
            Ok(_) => failures.push(format!("{}: rendered, but must fail", file.display())),
            Err(error) if !error.contains(expected) => failures.push(format!(
                "{}: failed without saying {expected:?}:\n{error}",
                file.display()
            )),
            Err(_) => {}
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_defaults_and_every_ci_values_file_pass_the_schema() {
    try_render(&[], &[]).expect("the default values render");
    for file in chart_support::ci_values_files() {
        if let Err(error) = try_render(&[&file], &[]) {
            panic!("{}: {error}", file.display());
        }
    }
}
