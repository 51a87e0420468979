//! What the store keeps (SPEC 5.14): every build a generation runs or may
//! run again (the caller names them: the journal knows what serves, what
//! retires, each instance's previous build, and what attempts in flight
//! stage), then the newest `--store-keep` others, as long as everything
//! kept fits in `--store-max-bytes`. The rest is removed. A protected entry
//! is never removed, even when the protected ones alone pass the limit.
//!
//! [`plan`] decides and is pure; [`crate::Store::collect`] lists the store
//! and removes what the plan says.

use std::collections::HashSet;
use std::time::SystemTime;

/// The default of `--store-keep`.
pub const DEFAULT_STORE_KEEP: usize = 3;
/// The default of `--store-max-bytes`: 10 GiB.
pub const DEFAULT_STORE_MAX_BYTES: u64 = 10 << 30;

/// How much the store keeps beyond what is protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Unprotected entries kept, newest used first.
    pub keep: usize,
    /// What everything kept may add up to; protected entries count.
    pub max_bytes: u64,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        Self {
            keep: DEFAULT_STORE_KEEP,
            max_bytes: DEFAULT_STORE_MAX_BYTES,
        }
    }
}

/// The two kinds of entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntryKind {
    /// `sha256-<hex>`: a single-file build.
    File,
    /// `tree-sha256-<hex>`: an archive's or an image's tree.
    Tree,
}

/// One entry of the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredEntry {
    pub sha256: String,
    pub kind: EntryKind,
    /// Its size on disk (a tree's file contents).
    pub bytes: u64,
    /// When it was last staged by this agent, else when it was stored.
    pub last_used: SystemTime,
}

/// What one collection did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// Entries kept, and their bytes.
    pub kept: usize,
    pub kept_bytes: u64,
    /// Entries removed (`sha256-<hex>` or `tree-sha256-<hex>`), and the
    /// bytes that freed.
    pub removed: Vec<String>,
    pub freed_bytes: u64,
    /// Entries that could not be removed, with why.
    pub failed: Vec<String>,
}

/// The entries to remove: everything but the protected ones and the
/// newest `keep` others that fit, with the protected ones, in `max_bytes`.
pub fn plan<'a>(
    entries: &'a [StoredEntry],
    protected: &HashSet<String>,
    policy: RetentionPolicy,
) -> Vec<&'a StoredEntry> {
    let mut total: u64 = entries
        .iter()
        .filter(|e| protected.contains(&e.sha256))
        .map(|e| e.bytes)
        .sum();
    let mut others: Vec<&StoredEntry> = entries
        .iter()
        .filter(|e| !protected.contains(&e.sha256))
        .collect();
    others.sort_by(|a, b| {
        b.last_used
            .cmp(&a.last_used)
            .then_with(|| a.sha256.cmp(&b.sha256))
    });
    let mut kept = 0;
    let mut remove = Vec::new();
    for entry in others {
        if kept < policy.keep && total.saturating_add(entry.bytes) <= policy.max_bytes {
            kept += 1;
            total = total.saturating_add(entry.bytes);
        } else {
            remove.push(entry);
        }
    }
    remove
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn entry(name: &str, bytes: u64, age_secs: u64) -> StoredEntry {
        StoredEntry {
            sha256: name.into(),
            kind: EntryKind::Tree,
            bytes,
            last_used: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 - age_secs),
        }
    }

    fn names(removed: Vec<&StoredEntry>) -> Vec<&str> {
        let mut names: Vec<&str> = removed.iter().map(|e| e.sha256.as_str()).collect();
        names.sort();
        names
    }

    #[test]
    fn the_newest_unprotected_are_kept_up_to_the_count() {
        let entries = [
            entry("a", 1, 1),
            entry("b", 1, 2),
            entry("c", 1, 3),
            entry("d", 1, 4),
        ];
        let protected = HashSet::from(["d".to_string()]);
        let policy = RetentionPolicy {
            keep: 2,
            max_bytes: 100,
        };
        assert_eq!(names(plan(&entries, &protected, policy)), vec!["c"]);
    }

    #[test]
    fn the_byte_limit_counts_protected_entries_and_never_removes_them() {
        let entries = [
            entry("serving", 80, 9),
            entry("new", 30, 1),
            entry("older", 10, 2),
        ];
        let protected = HashSet::from(["serving".to_string()]);
        let policy = RetentionPolicy {
            keep: 5,
            max_bytes: 100,
        };
        // 80 + 30 passes 100; 80 + 10 fits.
        assert_eq!(names(plan(&entries, &protected, policy)), vec!["new"]);
        // Protected alone past the limit: kept, and nothing else.
        let policy = RetentionPolicy {
            keep: 5,
            max_bytes: 50,
        };
        assert_eq!(
            names(plan(&entries, &protected, policy)),
            vec!["new", "older"]
        );
    }

    #[test]
    fn keep_zero_keeps_only_what_is_protected() {
        let entries = [entry("a", 1, 1), entry("b", 1, 2)];
        let protected = HashSet::from(["b".to_string()]);
        let policy = RetentionPolicy {
            keep: 0,
            max_bytes: u64::MAX,
        };
        assert_eq!(names(plan(&entries, &protected, policy)), vec!["a"]);
    }
}
