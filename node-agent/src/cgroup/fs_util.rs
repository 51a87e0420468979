//! Small reads and writes of cgroupfs interface files, with errors that name
//! the file.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use super::CgroupError;

pub(super) fn io_error(op: &'static str, path: &Path, source: io::Error) -> CgroupError {
    CgroupError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// The file's content without the trailing newline; `None` when the file
/// does not exist.
pub(super) fn read_optional(path: &Path, op: &'static str) -> Result<Option<String>, CgroupError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text.trim_end().to_owned())),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(io_error(op, path, source)),
    }
}

/// One write of `value` to an existing interface file. Never creates the
/// file: a missing interface file means the controller is not there.
/// O_TRUNC keeps a plain file (a test's fake cgroupfs) exact; cgroupfs
/// ignores it.
pub(super) fn write_raw(path: &Path, value: &str) -> io::Result<()> {
    let mut file = OpenOptions::new().write(true).truncate(true).open(path)?;
    file.write_all(value.as_bytes())
}

pub(super) fn write_value(path: &Path, value: &str, op: &'static str) -> Result<(), CgroupError> {
    write_raw(path, value).map_err(|source| io_error(op, path, source))
}

/// The space-separated names in `cgroup.controllers` or
/// `cgroup.subtree_control`; empty when the file does not exist.
pub(super) fn read_list(path: &Path) -> Result<Vec<String>, CgroupError> {
    Ok(read_optional(path, "read")?
        .map(|text| text.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default())
}

/// `populated` from a `cgroup.events` text.
pub(super) fn populated_in(events: &str) -> Option<bool> {
    events.lines().find_map(|line| match line.split_once(' ') {
        Some(("populated", "1")) => Some(true),
        Some(("populated", "0")) => Some(false),
        _ => None,
    })
}
