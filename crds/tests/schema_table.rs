//! The schema table (`fixtures/schema_table.yaml`) through standalone
//! mode's reader, `parse_instance_generation`: every refused case refused
//! by the same part of the schema the API server refuses it with
//! (`apiserver.rs` holds the table to the real server), in words that
//! contain the table's; every accepted case accepted.

mod support;

use genswap_crds::manifest::{ManifestError, parse_instance_generation};
use support::schema_table::{self, By};

#[test]
fn every_refused_case_is_refused_by_the_part_the_table_names() {
    let mut wrong = Vec::new();
    for case in schema_table::refused() {
        let (by, says) = case.refusal.as_ref().expect("a refusal");
        let text = serde_json::to_string(&case.object).expect("serializes");
        let verdict = match parse_instance_generation(&text) {
            Ok(_) => "accepted".to_string(),
            Err(ManifestError::Rules(message)) if *by == By::Rule && message.contains(says) => {
                continue;
            }
            Err(ManifestError::Structural(lines))
                if *by == By::Schema && lines.iter().any(|l| l.contains(says)) =>
            {
                continue;
            }
            Err(other) => format!("{other:?}"),
        };
        wrong.push(format!(
            "{}: expected {by:?} saying {says:?}, got {verdict}",
            case.what
        ));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_accepted_case_is_accepted() {
    let mut wrong = Vec::new();
    for case in schema_table::accepted() {
        let text = serde_json::to_string(&case.object).expect("serializes");
        if let Err(error) = parse_instance_generation(&text) {
            wrong.push(format!("{}: {error}", case.what));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
