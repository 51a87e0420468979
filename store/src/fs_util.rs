//! Small file-system steps the store's writers share: temporary names that
//! no two writers pick alike, and directory syncs.

use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The prefix of every temporary name in the store: a crash leaves at most
/// names that start with it, and the next start removes them.
pub const TEMP_PREFIX: &str = ".incoming";

/// A name no other writer of this process, or of an earlier one, picks:
/// `<base>.tmp-<pid>-<count>-<nanos>`.
pub fn temp_name(base: &str) -> OsString {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    OsString::from(format!("{base}.tmp-{}-{count}-{nanos}", std::process::id()))
}

/// fsyncs a directory, so a rename or a removal inside it survives a crash
/// of the node.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}
