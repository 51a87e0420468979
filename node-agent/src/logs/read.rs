//! `node-agent logs`: prints a generation's log, oldest line first.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use thiserror::Error;

use super::cri;
use super::file::{current_path, files_of, generations_in, sidecar_generations_in, stem};
use super::{DEFAULT_LOG_DIR, instance_dir};
use crate::gate::InstanceKey;

/// `node-agent logs NAMESPACE/NAME`.
#[derive(clap::Args, Debug, Clone)]
pub struct LogsArgs {
    /// The instance, as `NAMESPACE/NAME`.
    pub instance: String,
    /// Which generation (default: the newest with a log).
    #[arg(long, conflicts_with = "previous")]
    pub generation: Option<u64>,
    /// The generation before the newest.
    #[arg(long)]
    pub previous: bool,
    /// Keep printing lines as they are written.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// A sidecar's output (SPEC 5.13): of the newest generation with one
    /// of that name, or of the one `--generation` names.
    #[arg(long, value_name = "NAME")]
    pub sidecar: Option<String>,
    /// Print the CRI records as stored (time, stream, tag, text).
    #[arg(long)]
    pub raw: bool,
    /// The agent's log directory.
    #[arg(long, env = "GENSWAP_LOG_DIR", value_name = "DIR", default_value = DEFAULT_LOG_DIR)]
    pub log_dir: PathBuf,
}

#[derive(Debug, Error)]
pub enum ReadError {
    #[error("{0:?} is not NAMESPACE/NAME")]
    BadInstance(String),
    #[error("no logs of {instance} in {dir}")]
    NoLogs { instance: String, dir: PathBuf },
    #[error("no logs of sidecar {sidecar} of {instance} in {dir}")]
    NoSidecar {
        instance: String,
        sidecar: String,
        dir: PathBuf,
    },
    #[error("{instance} has no {which} generation with a log (it has: {have:?})")]
    NoGeneration {
        instance: String,
        which: String,
        have: Vec<u64>,
    },
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Prints what `args` asks for to `out`.
pub fn print(args: &LogsArgs, out: &mut impl Write) -> Result<(), ReadError> {
    let (namespace, name) = args
        .instance
        .split_once('/')
        .filter(|(ns, n)| !ns.is_empty() && !n.is_empty())
        .ok_or_else(|| ReadError::BadInstance(args.instance.clone()))?;
    let key = InstanceKey::new(namespace, name)
        .map_err(|_| ReadError::BadInstance(args.instance.clone()))?;
    let dir = instance_dir(&args.log_dir, &key);
    let sidecar = args.sidecar.as_deref();
    let have = match sidecar {
        None => generations_in(&dir),
        Some(name) => sidecar_generations_in(&dir, name),
    };
    if let (true, Some(name)) = (have.is_empty(), sidecar) {
        return Err(ReadError::NoSidecar {
            instance: args.instance.clone(),
            sidecar: name.to_string(),
            dir,
        });
    }
    if have.is_empty() {
        return Err(ReadError::NoLogs {
            instance: args.instance.clone(),
            dir,
        });
    }
    let generation = match (args.generation, args.previous) {
        (Some(n), _) => have.contains(&n).then_some(n),
        (None, true) => have.len().checked_sub(2).map(|i| have[i]),
        (None, false) => have.last().copied(),
    }
    .ok_or_else(|| ReadError::NoGeneration {
        instance: args.instance.clone(),
        which: match (args.generation, args.previous) {
            (Some(n), _) => format!("{n}th"),
            (None, true) => "previous".into(),
            (None, false) => "newest".into(),
        },
        have: have.clone(),
    })?;
    let stem = stem(generation, sidecar);
    let mut last = None;
    for path in files_of(&dir, &stem) {
        let file = File::open(&path).map_err(|source| ReadError::Io {
            path: path.clone(),
            source,
        })?;
        let consumed = copy_lines(BufReader::new(&file), args.raw, out, &path)?;
        last = Some((file, consumed));
    }
    if args.follow {
        // On from exactly where the read stopped: nothing appended since
        // is skipped, and a record half-written then is read whole.
        // The newest file read may have been rotated away since: follow
        // drains it before it moves on to the current one.
        let (file, position) = match last {
            Some((file, consumed)) => (file, consumed),
            None => {
                let path = current_path(&dir, &stem);
                let file = File::open(&path).map_err(|source| ReadError::Io { path, source })?;
                (file, 0)
            }
        };
        follow(&dir, &stem, file, position, args.raw, out)?;
    }
    Ok(())
}

/// Prints the complete records `reader` holds; returns the bytes they took.
fn copy_lines(
    mut reader: impl BufRead,
    raw: bool,
    out: &mut impl Write,
    path: &Path,
) -> Result<u64, ReadError> {
    let io = |source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut line = Vec::new();
    let mut consumed = 0u64;
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line).map_err(io)? == 0 {
            return Ok(consumed);
        }
        if !line.ends_with(b"\n") {
            // A record still being written: the follower reads it whole.
            return Ok(consumed);
        }
        consumed += line.len() as u64;
        write_line(&line[..line.len() - 1], raw, out).map_err(io)?;
    }
}

fn write_line(line: &[u8], raw: bool, out: &mut impl Write) -> io::Result<()> {
    if raw {
        out.write_all(line)?;
        return out.write_all(b"\n");
    }
    match cri::parse(line) {
        Ok(record) => {
            out.write_all(record.text)?;
            if record.full {
                out.write_all(b"\n")?;
            }
            Ok(())
        }
        // Not a record: print it as it is rather than hide it.
        Err(_) => {
            out.write_all(line)?;
            out.write_all(b"\n")
        }
    }
}

/// Prints what is appended to `file` from `position` on, then to the new
/// current file after each rotation, until interrupted. Driven by inotify
/// on the directory: the watch is set before the first read, so no write
/// between the two goes unnoticed.
fn follow(
    dir: &Path,
    stem: &str,
    mut file: File,
    position: u64,
    raw: bool,
    out: &mut impl Write,
) -> Result<(), ReadError> {
    let path = current_path(dir, stem);
    let io = |source| ReadError::Io {
        path: path.clone(),
        source,
    };
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC).map_err(|e| io(e.into()))?;
    inotify
        .add_watch(
            dir,
            AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO,
        )
        .map_err(|e| io(e.into()))?;
    file.seek(SeekFrom::Start(position)).map_err(io)?;
    let mut pending = Vec::new();
    loop {
        // Whether a rotation moved `file` away is asked before it is read
        // to its end: whatever was written to it before the rename is read
        // now, and the new file from its start after.
        let rotated = File::open(&path)
            .and_then(|current| Ok(!same_file(&current, &file)?))
            .unwrap_or(false);
        let mut chunk = Vec::new();
        file.read_to_end(&mut chunk).map_err(io)?;
        pending.extend_from_slice(&chunk);
        while let Some(newline) = pending.iter().position(|b| *b == b'\n') {
            write_line(&pending[..newline], raw, out).map_err(io)?;
            pending.drain(..=newline);
        }
        if rotated && let Ok(current) = File::open(&path) {
            file = current;
            pending.clear();
            continue;
        }
        out.flush().map_err(io)?;
        inotify.read_events().map_err(|e| io(e.into()))?;
    }
}

fn same_file(a: &File, b: &File) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let (a, b) = (a.metadata()?, b.metadata()?);
    Ok(a.ino() == b.ino() && a.dev() == b.dev())
}
