//! `node-agent paths NAMESPACE/NAME`: where an instance's sockets,
//! cgroup, journal, state and logs are, under the same flags the agent
//! runs with. A long name's paths use its cut disk name
//! ([`crate::disk_name`]), which an operator cannot work out by hand; a
//! front proxy's `current.sock` path is the usual question.

use std::fmt::Write as _;
use std::path::Path;

use thiserror::Error;

use crate::cgroup::discover_mount;
use crate::disk_name::{self, DiskName};
use crate::gate::InstanceKey;
use crate::host::{DEFAULT_CGROUP_SUBDIR, HostArgs};
use crate::journal::Journal;
use crate::logs;
use crate::standalone::state::StateStore;
use crate::switch::RunLayout;

/// `node-agent paths`.
#[derive(clap::Args, Debug)]
pub struct PathsArgs {
    /// The instance, as `NAMESPACE/NAME`.
    pub instance: String,
    #[command(flatten)]
    pub host: HostArgs,
}

#[derive(Debug, Error)]
pub enum PathsError {
    #[error("{0:?} is not NAMESPACE/NAME of an InstanceGeneration")]
    BadInstance(String),
}

/// The text `node-agent paths` prints: one `what  path` line each.
pub fn render(args: &PathsArgs) -> Result<String, PathsError> {
    let key = args
        .instance
        .split_once('/')
        .and_then(|(namespace, name)| InstanceKey::new(namespace, name).ok())
        .ok_or_else(|| PathsError::BadInstance(args.instance.clone()))?;
    let settings = args.host.settings();
    let cgroup_root = settings.cgroup_root.clone().or_else(|| {
        discover_mount()
            .ok()
            .map(|mount| mount.join(DEFAULT_CGROUP_SUBDIR))
    });
    Ok(lines(
        &key,
        &settings.run_dir,
        cgroup_root.as_deref(),
        &settings.state_dir,
        &settings.logs.dir,
    ))
}

fn lines(
    key: &InstanceKey,
    run_dir: &Path,
    cgroup_root: Option<&Path>,
    state_dir: &Path,
    log_dir: &Path,
) -> String {
    let disk = DiskName::of(key);
    let layout = RunLayout::new(run_dir);
    let cgroup = cgroup_root.map_or_else(
        || format!("<cgroup v2 mount>/{DEFAULT_CGROUP_SUBDIR}/{disk}"),
        |root| root.join(&disk).display().to_string(),
    );
    let run = layout.instance_dir(key);
    let name = if disk.is_cut() {
        format!(
            "{disk} (cut to fit; the file `{}` in its run and log dirs names it)",
            disk_name::RECORD_FILE
        )
    } else {
        disk.to_string()
    };
    let rows: [(&str, String); 8] = [
        ("instance", format!("{}/{}", key.namespace(), key.name())),
        ("disk name", name),
        ("run dir", shown(&run)),
        ("current.sock", shown(&layout.current_socket(key))),
        ("cgroup", cgroup),
        ("journal", shown(&Journal::path_in(state_dir, key))),
        (
            "state",
            format!(
                "{} (standalone mode)",
                shown(&StateStore::path_in(state_dir, key))
            ),
        ),
        ("logs", shown(&logs::instance_dir(log_dir, key))),
    ];
    let mut text = String::new();
    for (what, path) in rows {
        let _ = writeln!(text, "{what:<13} {path}");
    }
    text
}

fn shown(path: &Path) -> String {
    path.display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_name_is_shown_with_every_path_and_where_its_record_is() {
        let key = InstanceKey::new("payments", "c".repeat(120)).expect("key");
        let disk = DiskName::of(&key);
        let text = lines(
            &key,
            Path::new("/run/genswap"),
            Some(Path::new("/sys/fs/cgroup/genswap")),
            Path::new("/var/lib/genswap"),
            Path::new("/var/log/genswap"),
        );
        for expected in [
            format!("instance      payments/{}", key.name()),
            format!("current.sock  /run/genswap/{disk}/current.sock"),
            format!("cgroup        /sys/fs/cgroup/genswap/{disk}"),
            format!("journal       /var/lib/genswap/journal/{disk}.json"),
            format!("state         /var/lib/genswap/standalone/{disk}.yaml"),
            format!("logs          /var/log/genswap/{}", disk.log_dir_name()),
            "cut to fit; the file `instance` in its run and log dirs".to_string(),
        ] {
            assert!(text.contains(&expected), "{expected:?} not in\n{text}");
        }
    }

    #[test]
    fn a_short_name_is_its_own_disk_name() {
        let key = InstanceKey::new("default", "web").expect("key");
        let text = lines(
            &key,
            Path::new("/run/genswap"),
            None,
            Path::new("/var/lib/genswap"),
            Path::new("/var/log/genswap"),
        );
        assert!(text.contains("disk name     default.web\n"), "{text}");
        assert!(
            text.contains("<cgroup v2 mount>/genswap/default.web"),
            "{text}"
        );
        assert!(text.contains("/var/log/genswap/default_web"), "{text}");
    }
}
