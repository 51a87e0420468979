//! The name an instance goes by in every path the agent makes: its run dir
//! (where its sockets are), its cgroup, its journal and state files, its
//! log dir.
//!
//! It is `<namespace>.<name>` when that is at most [`DiskName::MAX_LEN`]
//! bytes. Kubernetes allows a 63-byte namespace and a 253-byte name, which
//! neither fits a file name (255 bytes) nor leaves a socket path under the
//! 108-byte `sun_path`; such a key is cut to
//! `<namespace prefix>.<name prefix>_<hash>`: at most 24 bytes of the
//! namespace, as much of the name as fits, and 16 hex digits of the SHA-256
//! of `<namespace>.<name>`. A Kubernetes name has no `_`, so a cut name
//! never equals a whole one (nor, in the log dir's `<namespace>_<name>`
//! form, which then has two), and two cut names are equal only if 64 bits
//! of their hashes are.
//!
//! A whole name says its key; a cut one does not, so the key is recorded
//! where the name is used: the journal file, named by it, holds the key,
//! and a file [`RECORD_FILE`] in the instance's run dir and log dir holds
//! `<namespace>/<name>`. Recovery and the metrics read those.
//!
//! The length bounds what a configured directory may be: [`check_run_dir`]
//! refuses, at start-up, a run dir under which a generation socket could
//! not be bound.

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::gate::InstanceKey;

/// `gen-<N>.sock`: generation N's socket in the instance's run dir.
pub fn generation_socket_name(generation: u64) -> String {
    format!("gen-{generation}.sock")
}

/// N from `gen-<N>.sock`; `None` for any other name.
pub fn parse_generation_socket_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("gen-")?.strip_suffix(".sock")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `gen-<N>.notify`: generation N's notify socket in the instance's run dir.
pub fn notify_socket_name(generation: u64) -> String {
    format!("gen-{generation}.notify")
}

/// `<base>.tmp-<pid>-<counter>-<nanos>`: a file's name while it is written,
/// before a rename gives it its own; unique within this process by the
/// counter, across processes by the pid, across restarts by the clock.
pub(crate) fn temp_name(base: &str) -> OsString {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    OsString::from(format!("{base}.tmp-{}-{count}-{nanos}", std::process::id()))
}

/// The file in a cut name's run dir and log dir that says whose they are.
pub const RECORD_FILE: &str = "instance";

/// Bytes of a unix socket path: `sun_path` is 108 bytes with the NUL.
pub const SOCKET_PATH_MAX: usize = 107;

/// The largest generation number [`check_run_dir`] makes room for: ten
/// digits, a restart a second for three centuries. A larger one is still
/// checked before its generation starts.
const CHECKED_GENERATION: u64 = 9_999_999_999;

/// Bytes of a path the kernel accepts (`PATH_MAX` with the NUL).
const PATH_MAX: usize = 4095;

/// Bytes of one file name (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// Hex digits of the hash in a cut name.
const HASH_DIGITS: usize = 16;

/// Bytes of the namespace a cut name keeps at most; the name part gets the
/// rest, at least 14 bytes.
const CUT_NAMESPACE_LEN: usize = 24;

/// The first `max` bytes of a Kubernetes name, without a trailing `.` or
/// `-` (so never empty: a name starts with a letter or digit).
fn cut(text: &str, max: usize) -> &str {
    // Kubernetes names are ASCII, so any byte is a char boundary.
    text.get(..max.min(text.len()))
        .unwrap_or(text)
        .trim_end_matches(['.', '-'])
}

/// An instance's name on disk; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DiskName(String);

impl DiskName {
    /// The longest disk name. With the default run dir every generation
    /// socket fits, whatever the generation number.
    pub const MAX_LEN: usize = 56;

    /// The disk name of `key`.
    pub fn of(key: &InstanceKey) -> DiskName {
        let whole = key.to_string();
        if whole.len() <= Self::MAX_LEN {
            return DiskName(whole);
        }
        let hash = hex::encode(Sha256::digest(whole.as_bytes()));
        // Both parts are kept, so a cut name always has its dot: its log dir
        // name then has two `_` where a whole one has one.
        let namespace = cut(key.namespace(), CUT_NAMESPACE_LEN);
        let name_len = Self::MAX_LEN - namespace.len() - 2 - HASH_DIGITS;
        let name = cut(key.name(), name_len);
        DiskName(format!("{namespace}.{name}_{}", &hash[..HASH_DIGITS]))
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the key was cut to fit, so the name alone does not say it.
    pub fn is_cut(&self) -> bool {
        self.0.contains('_')
    }

    /// The name of the instance's log dir: the disk name with the first dot
    /// as `_`, so that a whole name reads `<namespace>_<name>` (SPEC 5.11).
    pub fn log_dir_name(&self) -> String {
        self.0.replacen('.', "_", 1)
    }

    /// The key a directory or file name spells when it is a whole disk
    /// name; `None` for a cut name or a name no instance has.
    pub fn key_spelled_by(text: &str) -> Option<InstanceKey> {
        let key: InstanceKey = text.parse().ok()?;
        (DiskName::of(&key).0 == text).then_some(key)
    }
}

impl fmt::Display for DiskName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<Path> for DiskName {
    fn as_ref(&self) -> &Path {
        Path::new(&self.0)
    }
}

/// Writes `dir`'s record of `key` when its disk name is cut (a whole name
/// needs none). Atomic, so a reader sees the whole record or none.
pub fn write_record(dir: &Path, key: &InstanceKey) -> io::Result<()> {
    if !DiskName::of(key).is_cut() {
        return Ok(());
    }
    let text = format!("{}/{}\n", key.namespace(), key.name());
    let path = dir.join(RECORD_FILE);
    if fs::read_to_string(&path).is_ok_and(|on_disk| on_disk == text) {
        return Ok(());
    }
    let temp = dir.join(temp_name(RECORD_FILE));
    fs::write(&temp, &text)
        .and_then(|()| fs::rename(&temp, &path))
        .inspect_err(|_| {
            let _ = fs::remove_file(&temp);
        })
}

/// The instance whose disk name `dir` is named by: what a whole name
/// spells, else what the record inside it says, if that instance's disk
/// name is `dir`'s.
pub fn resolve_dir(dir: &Path) -> Option<InstanceKey> {
    let name = dir.file_name()?.to_str()?;
    resolve_name(name, || read_record(dir))
}

/// The instance whose log dir `dir` is ([`DiskName::log_dir_name`]).
pub fn resolve_log_dir(dir: &Path) -> Option<InstanceKey> {
    let name = dir.file_name()?.to_str()?;
    let spelled = name
        .split_once('_')
        .and_then(|(namespace, rest)| InstanceKey::new(namespace, rest).ok());
    [spelled, read_record(dir)]
        .into_iter()
        .flatten()
        .find(|key| DiskName::of(key).log_dir_name() == name)
}

/// The instance whose disk name is `text`: the key it spells, or the one
/// `recorded` names if `text` is that key's cut name.
pub fn resolve_name(
    text: &str,
    recorded: impl FnOnce() -> Option<InstanceKey>,
) -> Option<InstanceKey> {
    if let Some(key) = DiskName::key_spelled_by(text) {
        return Some(key);
    }
    recorded().filter(|key| DiskName::of(key).as_str() == text)
}

fn read_record(dir: &Path) -> Option<InstanceKey> {
    let text = fs::read_to_string(dir.join(RECORD_FILE)).ok()?;
    let (namespace, name) = text.trim_end().split_once('/')?;
    InstanceKey::new(namespace, name).ok()
}

/// A configured directory too long for the paths the agent makes in it.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PathLimitError {
    #[error(
        "the run dir {} is {len} bytes long; a generation socket under it (<run dir>/<instance>/{socket}, with an instance name of up to {} bytes) must fit the {SOCKET_PATH_MAX} bytes of a unix socket path, so the run dir may be at most {max} bytes: choose a shorter --run-dir",
        path.display(),
        DiskName::MAX_LEN
    )]
    RunDir {
        path: PathBuf,
        len: usize,
        max: usize,
        socket: String,
    },
    #[error(
        "the {what} {} is {len} bytes long; the files the agent makes under it need up to {} more bytes of the kernel's {PATH_MAX}: choose a shorter directory",
        path.display(),
        PATH_MAX - max
    )]
    Dir {
        what: &'static str,
        path: PathBuf,
        len: usize,
        max: usize,
    },
}

/// Refuses a run dir under which a generation's sockets (its own and its
/// `NOTIFY_SOCKET`, the longer) of an instance with the longest disk name
/// could not be bound.
pub fn check_run_dir(run_dir: &Path) -> Result<(), PathLimitError> {
    let socket = [
        generation_socket_name(CHECKED_GENERATION),
        notify_socket_name(CHECKED_GENERATION),
    ]
    .into_iter()
    .max_by_key(String::len)
    .unwrap_or_default();
    let max = SOCKET_PATH_MAX - (1 + DiskName::MAX_LEN + 1 + socket.len());
    let len = run_dir.as_os_str().as_bytes().len();
    if len > max {
        return Err(PathLimitError::RunDir {
            path: run_dir.to_path_buf(),
            len,
            max,
            socket,
        });
    }
    Ok(())
}

/// Refuses a directory under which the agent's files (an instance's
/// directory and a file in it, each a file name long) would pass `PATH_MAX`.
pub fn check_dir(what: &'static str, dir: &Path) -> Result<(), PathLimitError> {
    let max = PATH_MAX - 2 * (1 + NAME_MAX);
    let len = dir.as_os_str().as_bytes().len();
    if len > max {
        return Err(PathLimitError::Dir {
            what,
            path: dir.to_path_buf(),
            len,
            max,
        });
    }
    Ok(())
}

/// Whether a socket path can be bound: it fits `sun_path`.
pub fn socket_path_fits(path: &Path) -> bool {
    path.as_os_str().as_bytes().len() <= SOCKET_PATH_MAX
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(namespace: &str, name: &str) -> InstanceKey {
        InstanceKey::new(namespace, name).expect("a valid key")
    }

    fn longest() -> InstanceKey {
        let name = format!("{}.{}", "b".repeat(126), "c".repeat(126));
        key(&"a".repeat(63), &name)
    }

    #[test]
    fn a_short_key_is_its_own_name() {
        let disk = DiskName::of(&key("default", "web.app"));
        assert_eq!(disk.as_str(), "default.web.app");
        assert!(!disk.is_cut());
        assert_eq!(disk.log_dir_name(), "default_web.app");
        assert_eq!(
            DiskName::key_spelled_by("default.web.app"),
            Some(key("default", "web.app"))
        );
    }

    #[test]
    fn a_long_key_is_cut_to_a_readable_prefix_and_a_hash() {
        let long = key("payments", "checkout-".repeat(13).trim_end_matches('-'));
        let disk = DiskName::of(&long);
        assert!(disk.is_cut());
        assert!(disk.as_str().len() <= DiskName::MAX_LEN, "{disk}");
        assert!(
            disk.as_str().starts_with("payments.checkout-checkout"),
            "{disk}"
        );
        assert_eq!(
            disk.log_dir_name().split_once('_').map(|(ns, _)| ns),
            Some("payments")
        );
        let (_, hash) = disk.as_str().rsplit_once('_').expect("a hash");
        assert_eq!(hash.len(), HASH_DIGITS);
        assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(DiskName::key_spelled_by(disk.as_str()), None);
        assert_eq!(DiskName::of(&long), disk, "stable");
    }

    #[test]
    fn the_longest_key_fits_and_keys_that_share_a_prefix_do_not_collide() {
        let a = DiskName::of(&longest());
        assert!(a.as_str().len() <= DiskName::MAX_LEN);
        let mut other = longest().name().to_string();
        other.replace_range(250.., "ccd");
        let b = DiskName::of(&key(&"a".repeat(63), &other));
        assert_ne!(a, b);
        assert_eq!(a.as_str()[..39], b.as_str()[..39]);
    }

    #[test]
    fn a_name_of_exactly_the_limit_stays_whole() {
        let name = "n".repeat(DiskName::MAX_LEN - "default.".len());
        let disk = DiskName::of(&key("default", &name));
        assert!(!disk.is_cut());
        let one_more = DiskName::of(&key("default", &format!("{name}n")));
        assert!(one_more.is_cut());
    }

    #[test]
    fn a_cut_name_resolves_only_through_a_record_of_its_own_key() {
        let dir = tempfile::tempdir().expect("temp dir");
        let long = longest();
        let run = dir.path().join("run").join(DiskName::of(&long).as_str());
        fs::create_dir_all(&run).expect("mkdir");
        assert_eq!(resolve_dir(&run), None, "no record yet");
        write_record(&run, &long).expect("record");
        write_record(&run, &long).expect("rewriting the same record");
        assert_eq!(resolve_dir(&run), Some(long.clone()));
        let logs = dir
            .path()
            .join("logs")
            .join(DiskName::of(&long).log_dir_name());
        fs::create_dir_all(&logs).expect("mkdir");
        write_record(&logs, &long).expect("record");
        assert_eq!(resolve_log_dir(&logs), Some(long.clone()));
        // Its log dir name is no whole key's `<namespace>_<name>`.
        let log_name = DiskName::of(&long).log_dir_name();
        assert_eq!(log_name.matches('_').count(), 2, "{log_name}");
        assert_eq!(resolve_log_dir(&logs.with_file_name("x")), None);
        assert_eq!(
            resolve_dir(&logs),
            None,
            "a log dir is not named by the disk name"
        );

        // A record of another key does not claim the directory.
        let elsewhere = dir.path().join("default.other_0123456789abcdef");
        fs::create_dir(&elsewhere).expect("mkdir");
        fs::copy(run.join(RECORD_FILE), elsewhere.join(RECORD_FILE)).expect("copy");
        assert_eq!(resolve_dir(&elsewhere), None);
        // A whole name needs no record, and writes none.
        let short = dir.path().join("default.app");
        fs::create_dir(&short).expect("mkdir");
        write_record(&short, &key("default", "app")).expect("no-op");
        assert!(!short.join(RECORD_FILE).exists());
        assert_eq!(resolve_dir(&short), Some(key("default", "app")));
        let short_logs = dir.path().join("default_app");
        assert_eq!(resolve_log_dir(&short_logs), Some(key("default", "app")));
        assert_eq!(resolve_name("default_app", || None), None);
    }

    #[test]
    fn a_run_dir_too_long_for_the_sockets_is_refused_with_its_limit() {
        // 107 - ("/" + 56 + "/" + "gen-9999999999.notify"): the notify
        // socket's name is the longer.
        let fits = PathBuf::from(format!("/{}", "r".repeat(27)));
        check_run_dir(&fits).expect("28 bytes fit");
        let long = PathBuf::from(format!("/{}", "r".repeat(28)));
        let error = check_run_dir(&long).expect_err("29 bytes do not");
        let text = error.to_string();
        assert!(text.contains("at most 28 bytes"), "{text}");
        assert!(text.contains("--run-dir"), "{text}");
        let too_deep = PathBuf::from(format!("/{}", "d".repeat(PATH_MAX)));
        assert!(check_dir("state dir", &too_deep).is_err());
        check_dir("state dir", Path::new("/var/lib/genswap")).expect("fits");
    }
}
