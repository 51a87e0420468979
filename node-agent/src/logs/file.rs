//! One generation's log file, rotated by size, written record by record.
//!
//! `<dir>/<N>.log` is the file being written (`<N>-<sidecar>.log` for a
//! sidecar of generation N: the stem is [`stem`]); a rotation renames it to
//! `<N>.log.1` (older ones move up one: `.1` to `.2`, ...) and starts an
//! empty one, keeping `max_files` in all, as the kubelet's
//! `containerLogMaxFiles` counts the current file too. A record that cannot
//! be written (a full disk) is dropped whole: the file is cut back to where
//! the record began, so every line stays a record, and the drop is counted
//! in `<dir>/<N>.dropped`, a fixed-width number rewritten in place (which
//! needs no new disk blocks).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Digits of the drop counter file.
const COUNTER_WIDTH: usize = 20;

/// The name the files of generation N's output start with: `N`, or
/// `N-<sidecar>` for one of its sidecars. A sidecar's name is a DNS label,
/// so the first `-` ends the number.
pub fn stem(generation: u64, sidecar: Option<&str>) -> String {
    match sidecar {
        None => generation.to_string(),
        Some(name) => format!("{generation}-{name}"),
    }
}

/// `<stem>.log` in `dir`.
pub fn current_path(dir: &Path, stem: &str) -> PathBuf {
    dir.join(format!("{stem}.log"))
}

/// `<stem>.log.<k>`, the k-th newest rotated file.
pub fn rotated_path(dir: &Path, stem: &str, k: u32) -> PathBuf {
    dir.join(format!("{stem}.log.{k}"))
}

/// `<stem>.dropped`, the count of records dropped.
pub fn dropped_path(dir: &Path, stem: &str) -> PathBuf {
    dir.join(format!("{stem}.dropped"))
}

/// Reads a drop counter file; 0 when there is none.
pub fn read_dropped(path: &Path) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0)
}

/// The writer of one generation's log.
#[derive(Debug)]
pub struct RotatingFile {
    dir: PathBuf,
    stem: String,
    max_size: u64,
    max_files: u32,
    file: Option<File>,
    size: u64,
    dropped: u64,
    counter: Option<File>,
}

impl RotatingFile {
    /// Opens (appending) `<dir>/<stem>.log`, creating `dir`.
    /// `max_files` is at least 2 (the current file and one rotated).
    pub fn open(dir: &Path, stem: &str, max_size: u64, max_files: u32) -> io::Result<RotatingFile> {
        fs::create_dir_all(dir)?;
        let counter = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o640)
            .open(dropped_path(dir, stem))?;
        let mut log = RotatingFile {
            dir: dir.to_path_buf(),
            stem: stem.to_string(),
            max_size: max_size.max(1),
            max_files: max_files.max(2),
            file: None,
            size: 0,
            dropped: read_dropped(&dropped_path(dir, stem)),
            counter: Some(counter),
        };
        log.store_counter();
        log.reopen()?;
        Ok(log)
    }

    /// Records dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Writes one whole record (its newline included), rotating first when
    /// it would take the file past the size limit. Never fails: a record
    /// that cannot be written is dropped and counted.
    pub fn write_record(&mut self, record: &[u8]) {
        if self.size > 0 && self.size + record.len() as u64 > self.max_size {
            // A failed rotation keeps writing to the file it has.
            let _ = self.rotate();
        }
        if self.file.is_none() {
            // Without a file (a reopen failed): try again for this record.
            let _ = self.reopen();
        }
        let Some(file) = self.file.as_mut() else {
            self.drop_record();
            return;
        };
        match file.write_all(record) {
            Ok(()) => self.size += record.len() as u64,
            Err(_) => {
                // Cut a half-written record off; if even that fails, start
                // the next record on a fresh file.
                if file.set_len(self.size).is_err() {
                    self.file = None;
                }
                self.drop_record();
            }
        }
    }

    fn drop_record(&mut self) {
        self.dropped += 1;
        self.store_counter();
    }

    fn store_counter(&mut self) {
        if let Some(counter) = &self.counter {
            let text = format!("{:0width$}\n", self.dropped, width = COUNTER_WIDTH);
            let _ = counter.write_all_at(text.as_bytes(), 0);
        }
    }

    fn reopen(&mut self) -> io::Result<()> {
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .open(current_path(&self.dir, &self.stem))?;
        self.size = file.metadata()?.len();
        self.file = Some(file);
        Ok(())
    }

    fn rotate(&mut self) -> io::Result<()> {
        let oldest = rotated_path(&self.dir, &self.stem, self.max_files - 1);
        match fs::remove_file(&oldest) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        for k in (1..self.max_files - 1).rev() {
            let from = rotated_path(&self.dir, &self.stem, k);
            if from.exists() {
                fs::rename(&from, rotated_path(&self.dir, &self.stem, k + 1))?;
            }
        }
        fs::rename(
            current_path(&self.dir, &self.stem),
            rotated_path(&self.dir, &self.stem, 1),
        )?;
        self.file = None;
        self.reopen()
    }
}

/// The log files of `stem` in `dir`, oldest first.
pub fn files_of(dir: &Path, stem: &str) -> Vec<PathBuf> {
    let mut rotated: Vec<(u32, PathBuf)> = Vec::new();
    let prefix = format!("{stem}.log.");
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(k) = name
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .and_then(|k| k.parse::<u32>().ok())
            else {
                continue;
            };
            rotated.push((k, entry.path()));
        }
    }
    rotated.sort_by_key(|entry| std::cmp::Reverse(entry.0));
    let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, path)| path).collect();
    let current = current_path(dir, stem);
    if current.exists() {
        files.push(current);
    }
    files
}

/// The stems (`N`, `N-<sidecar>`) of the log files in `dir`.
fn stems_in(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let name = name.to_str()?;
            let is_log =
                name.ends_with(".log") || name.contains(".log.") || name.ends_with(".dropped");
            is_log.then(|| name.split('.').next().map(str::to_string))?
        })
        .collect()
}

/// Sorted and without repeats.
fn ascending(mut found: Vec<u64>) -> Vec<u64> {
    found.sort_unstable();
    found.dedup();
    found
}

/// The generations with a log in `dir`, ascending.
pub fn generations_in(dir: &Path) -> Vec<u64> {
    ascending(
        stems_in(dir)
            .iter()
            .filter_map(|stem| stem.parse().ok())
            .collect(),
    )
}

/// The generations with a log of sidecar `name` in `dir`, ascending.
pub fn sidecar_generations_in(dir: &Path, name: &str) -> Vec<u64> {
    ascending(
        sidecar_logs_in(dir)
            .into_iter()
            .filter(|(_, sidecar)| sidecar == name)
            .map(|(generation, _)| generation)
            .collect(),
    )
}

/// Every (generation, sidecar) with a file in `dir`.
fn sidecar_logs_in(dir: &Path) -> Vec<(u64, String)> {
    stems_in(dir)
        .iter()
        .filter_map(|stem| {
            let (generation, sidecar) = stem.split_once('-')?;
            Some((generation.parse().ok()?, sidecar.to_string()))
        })
        .collect()
}

/// Deletes the files of every generation in `dir` but `keep`, its
/// sidecars' with them.
pub fn prune(dir: &Path, keep: &[u64]) {
    let sidecars = sidecar_logs_in(dir);
    let stems = generations_in(dir)
        .into_iter()
        .map(|generation| (generation, stem(generation, None)))
        .chain(
            sidecars
                .iter()
                .map(|(generation, name)| (*generation, stem(*generation, Some(name)))),
        );
    for (generation, stem) in stems {
        if keep.contains(&generation) {
            continue;
        }
        for path in files_of(dir, &stem) {
            let _ = fs::remove_file(path);
        }
        let _ = fs::remove_file(dropped_path(dir, &stem));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: usize) -> Vec<u8> {
        format!("2026-12-01T07:34:50Z stdout F line {i:04}\n").into_bytes()
    }

    #[test]
    fn rotation_keeps_at_most_max_files_and_loses_no_record_it_keeps() {
        let dir = tempfile::tempdir().expect("temp dir");
        let one = record(0).len() as u64;
        let mut log = RotatingFile::open(dir.path(), &stem(7, None), one * 10, 3).expect("opens");
        for i in 0..100 {
            log.write_record(&record(i));
        }
        let files = files_of(dir.path(), &stem(7, None));
        assert_eq!(
            files,
            vec![
                rotated_path(dir.path(), &stem(7, None), 2),
                rotated_path(dir.path(), &stem(7, None), 1),
                current_path(dir.path(), &stem(7, None))
            ]
        );
        let text: String = files
            .iter()
            .map(|f| fs::read_to_string(f).expect("readable"))
            .collect();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 30, "three files of ten records");
        assert!(lines[0].ends_with("line 0070") && lines[29].ends_with("line 0099"));
        for file in &files {
            assert!(fs::metadata(file).expect("exists").len() <= one * 10);
        }
        assert_eq!(log.dropped(), 0);
    }

    #[test]
    fn a_reopened_log_appends() {
        let dir = tempfile::tempdir().expect("temp dir");
        RotatingFile::open(dir.path(), &stem(1, None), 1 << 20, 5)
            .expect("opens")
            .write_record(&record(1));
        RotatingFile::open(dir.path(), &stem(1, None), 1 << 20, 5)
            .expect("opens")
            .write_record(&record(2));
        let text = fs::read_to_string(current_path(dir.path(), &stem(1, None))).expect("readable");
        assert_eq!(text.lines().count(), 2);
    }

    #[test]
    fn pruning_keeps_only_the_named_generations() {
        let dir = tempfile::tempdir().expect("temp dir");
        for generation in 1..=4 {
            RotatingFile::open(dir.path(), &stem(generation, None), 1 << 20, 5)
                .expect("opens")
                .write_record(&record(0));
        }
        prune(dir.path(), &[2, 4]);
        assert_eq!(generations_in(dir.path()), vec![2, 4]);
    }

    #[test]
    fn a_sidecars_log_is_its_generations_and_goes_with_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        for (generation, sidecar) in [
            (1, None),
            (1, Some("exporter")),
            (2, None),
            (2, Some("exporter")),
            (2, Some("shipper")),
        ] {
            RotatingFile::open(dir.path(), &stem(generation, sidecar), 1 << 20, 5)
                .expect("opens")
                .write_record(&record(0));
        }
        assert!(dir.path().join("2-exporter.log").exists());
        assert_eq!(generations_in(dir.path()), vec![1, 2]);
        assert_eq!(sidecar_generations_in(dir.path(), "exporter"), vec![1, 2]);
        assert_eq!(sidecar_generations_in(dir.path(), "shipper"), vec![2]);
        prune(dir.path(), &[2]);
        assert_eq!(generations_in(dir.path()), vec![2]);
        assert_eq!(sidecar_generations_in(dir.path(), "exporter"), vec![2]);
        assert!(!dir.path().join("1-exporter.log").exists());
    }

    #[test]
    fn the_drop_counter_reads_back() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut log = RotatingFile::open(dir.path(), &stem(3, None), 1 << 20, 5).expect("opens");
        log.file = None;
        // No file and none can be opened: the directory is gone.
        fs::remove_file(current_path(dir.path(), &stem(3, None))).expect("remove");
        let counter = dropped_path(dir.path(), &stem(3, None));
        log.dir = dir.path().join("missing");
        log.write_record(&record(0));
        log.write_record(&record(1));
        assert_eq!(log.dropped(), 2);
        assert_eq!(read_dropped(&counter), 2);
    }
}
