//! The report a testapp sidecar writes (see the testapp crate docs, "As a
//! sidecar"): one `start` line per start and one `saw` line per new answer
//! of the generation it follows.
//!
//! Include it with `#[path = "support/sidecar_report.rs"] mod sidecar_report;`.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// `<dir>/<name>`, in a directory `dir` that a `nobody` sidecar may write.
pub fn report_in(dir: &Path, name: &str) -> PathBuf {
    std::fs::create_dir_all(dir).expect("report dir");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).expect("open it");
    dir.join(name)
}

/// The sidecar's arguments: report to `report`, then `extra`.
pub fn args(report: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec![format!("--sidecar-report={}", report.display())];
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

pub fn lines(report: &Path) -> Vec<String> {
    std::fs::read_to_string(report)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `key=value` from a report line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split(' ')
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
}

/// The start lines of generation `n`'s sidecars.
pub fn starts(report: &Path, n: u64) -> Vec<String> {
    lines(report)
        .into_iter()
        .filter(|l| l.starts_with("start ") && field(l, "generation") == Some(&n.to_string()))
        .collect()
}

/// Every start line.
pub fn all_starts(report: &Path) -> Vec<String> {
    lines(report)
        .into_iter()
        .filter(|l| l.starts_with("start "))
        .collect()
}

/// Whether a sidecar of generation `n` saw generation `n` answer.
pub fn saw_own(report: &Path, n: u64) -> bool {
    lines(report).iter().any(|l| {
        l.starts_with("saw ")
            && field(l, "generation") == Some(&n.to_string())
            && answered(l) == Some(n)
    })
}

/// The generation named by the answer a `saw` line quotes.
fn answered(line: &str) -> Option<u64> {
    let (_, answer) = line.split_once(" answer=")?;
    field(answer, "generation")?.parse().ok()
}

/// No sidecar ever reached another generation than its own.
pub fn assert_each_saw_only_its_own(report: &Path) {
    for line in lines(report).iter().filter(|l| l.starts_with("saw ")) {
        let own: Option<u64> = field(line, "generation").and_then(|g| g.parse().ok());
        assert_eq!(
            own,
            answered(line),
            "a sidecar reached another generation: {line}"
        );
    }
}

/// The sidecar's own pid on a report line.
pub fn pid_of(line: &str) -> u32 {
    field(line, "pid")
        .and_then(|p| p.parse().ok())
        .expect("a pid")
}
