//! What each component asked of the API server, read from its audit log
//! (`../shared/kube/up` writes every request at level Metadata): requests
//! by user, verb and resource within a window, and how long the server
//! took to answer the writes.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::stats::Spread;

/// One answered request.
#[derive(Clone, Debug)]
pub struct Request {
    pub user: String,
    pub verb: String,
    /// `resource` or `resource/subresource`.
    pub resource: String,
    pub received: Timestamp,
    /// From received to answered, ms.
    pub millis: f64,
    /// The HTTP status it was answered with.
    pub code: Option<u16>,
}

impl Request {
    fn parse(line: &str) -> Option<Request> {
        let entry: serde_json::Value = serde_json::from_str(line).ok()?;
        if entry["stage"] != "ResponseComplete" {
            return None;
        }
        let received: Timestamp = entry["requestReceivedTimestamp"].as_str()?.parse().ok()?;
        let answered: Timestamp = entry["stageTimestamp"].as_str()?.parse().ok()?;
        let object = &entry["objectRef"];
        let mut resource = object["resource"].as_str().unwrap_or("-").to_string();
        if let Some(sub) = object["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        Some(Request {
            user: entry["user"]["username"].as_str()?.to_string(),
            verb: entry["verb"].as_str()?.to_string(),
            resource,
            received,
            millis: answered.duration_since(received).as_secs_f64() * 1000.0,
            code: entry["responseStatus"]["code"]
                .as_u64()
                .and_then(|c| u16::try_from(c).ok()),
        })
    }

    /// A write (not a read, not a watch).
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }
}

/// Every answered request received in `[from, to]`, from `log` and the
/// files the API server rotated it into (`audit-<time>.log` beside it,
/// once it passes `--audit-log-maxsize`): a 5,000-node release writes
/// more than the 500 MB `../shared/kube/up` allows one file, and reading
/// `log` alone counted a fifth of its creates missing.
pub fn read(log: &Path, from: Timestamp, to: Timestamp) -> Vec<Request> {
    logs(log)
        .iter()
        .filter_map(|path| fs::File::open(path).ok())
        .flat_map(|file| BufReader::new(file).lines().map_while(Result::ok))
        .filter_map(|line| Request::parse(&line))
        .filter(|r| r.received >= from && r.received <= to)
        .collect()
}

/// `log` and its rotated files (lumberjack names them `<stem>-<time><ext>`).
fn logs(log: &Path) -> Vec<PathBuf> {
    let (Some(dir), Some(stem), Some(ext)) = (
        log.parent(),
        log.file_stem().and_then(|s| s.to_str()),
        log.extension().and_then(|s| s.to_str()),
    ) else {
        return vec![log.to_path_buf()];
    };
    let prefix = format!("{stem}-");
    let suffix = format!(".{ext}");
    let mut found: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|entry| entry.path())
                .filter(|path| {
                    path.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(&suffix))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.push(log.to_path_buf());
    found
}

/// One component's requests in a window.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Tally {
    /// `verb resource` → count; watches are left out (one per stream,
    /// long-running, not work per attempt).
    pub by_kind: BTreeMap<String, usize>,
    pub total: usize,
}

impl Tally {
    /// The requests of the users `user` matches, watches left out.
    pub fn of(requests: &[Request], user: impl Fn(&str) -> bool) -> Tally {
        let mut tally = Tally::default();
        for request in requests
            .iter()
            .filter(|r| user(&r.user) && r.verb != "watch")
        {
            *tally
                .by_kind
                .entry(format!("{} {}", request.verb, request.resource))
                .or_default() += 1;
            tally.total += 1;
        }
        tally
    }

    /// Per attempt, to two places.
    pub fn per(&self, attempts: usize) -> f64 {
        self.total as f64 / attempts.max(1) as f64
    }

    /// `create swapattempts 600, patch instancegenerations/status 710, ...`
    pub fn text(&self) -> String {
        self.by_kind
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// How many of one `verb resource`.
    pub fn count(&self, kind: &str) -> usize {
        self.by_kind.get(kind).copied().unwrap_or(0)
    }
}

/// How long the server took to answer the writes of the users `user`
/// matches.
pub fn write_latency(requests: &[Request], user: impl Fn(&str) -> bool) -> Spread {
    Spread::of(
        requests
            .iter()
            .filter(|r| user(&r.user) && r.is_write())
            .map(|r| r.millis)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_complete_line_is_read_with_its_subresource_and_latency() {
        let line = r#"{"stage":"ResponseComplete","verb":"patch","user":{"username":"system:serviceaccount:ns:agent"},"objectRef":{"resource":"swapattempts","subresource":"status"},"requestReceivedTimestamp":"2026-12-03T15:35:01.500000Z","stageTimestamp":"2026-12-03T15:35:01.750000Z"}"#;
        let request = Request::parse(line).expect("a request");
        assert_eq!(request.resource, "swapattempts/status");
        assert_eq!(request.user, "system:serviceaccount:ns:agent");
        assert!((request.millis - 250.0).abs() < 1e-6, "{}", request.millis);
        assert!(request.is_write());
        let started = line.replace("ResponseComplete", "ResponseStarted");
        assert!(Request::parse(&started).is_none());
    }

    #[test]
    fn a_tally_counts_by_verb_and_resource_without_watches() {
        let at: Timestamp = "2026-12-03T15:35:01Z".parse().expect("a time");
        let request = |user: &str, verb: &str, resource: &str| Request {
            user: user.into(),
            verb: verb.into(),
            resource: resource.into(),
            received: at,
            millis: 1.0,
            code: Some(201),
        };
        let requests = [
            request("c", "create", "swapattempts"),
            request("c", "create", "swapattempts"),
            request("c", "watch", "swapattempts"),
            request("a", "patch", "swapattempts/status"),
        ];
        let tally = Tally::of(&requests, |u| u == "c");
        assert_eq!(tally.total, 2);
        assert_eq!(tally.count("create swapattempts"), 2);
        assert_eq!(tally.per(4), 0.5);
    }

    #[test]
    fn requests_are_read_from_the_rotated_files_too() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let line = |verb: &str, at: &str| {
            format!(
                r#"{{"stage":"ResponseComplete","verb":"{verb}","user":{{"username":"c"}},"objectRef":{{"resource":"swapattempts"}},"requestReceivedTimestamp":"{at}","stageTimestamp":"{at}"}}"#
            )
        };
        let write = |name: &str, lines: &[String]| {
            fs::write(dir.path().join(name), lines.join("\n")).expect("write a log");
        };
        write(
            "audit-2026-12-06T19-20-00.000.log",
            &[
                line("create", "2026-12-06T19:10:00Z"),
                line("create", "2026-12-06T19:19:00Z"),
            ],
        );
        write("audit.log", &[line("delete", "2026-12-06T19:21:00Z")]);
        write(
            "other-2026-12-06T19-20-00.000.log",
            &[line("get", "2026-12-06T19:19:30Z")],
        );
        let from: Timestamp = "2026-12-06T19:15:00Z".parse().expect("a time");
        let to: Timestamp = "2026-12-06T19:30:00Z".parse().expect("a time");
        let verbs: Vec<String> = read(&dir.path().join("audit.log"), from, to)
            .into_iter()
            .map(|r| r.verb)
            .collect();
        assert_eq!(verbs, ["create", "delete"]);
    }
}
