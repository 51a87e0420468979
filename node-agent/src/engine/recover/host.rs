//! What the host shows of an instance when the journal cannot say: its
//! generations' cgroups and processes, read from cgroupfs and `/proc`.

use super::*;

/// The tier a generation cgroup carries, read back from its limit files
/// (absent files and `max` are unlimited).
pub(super) fn tier_of(cgroup: &Path) -> Tier {
    let read = |controller: Controller| {
        fs::read_to_string(cgroup.join(controller.max_file()))
            .ok()
            .map(|text| text.trim().to_string())
    };
    let number = |text: Option<String>| text.and_then(|t| t.parse::<u64>().ok());
    let cpu = read(Controller::Cpu).and_then(|text| {
        let (quota, period) = text.split_once(' ')?;
        let (quota, period) = (quota.parse::<u64>().ok()?, period.parse::<u64>().ok()?);
        (period > 0).then(|| quota.saturating_mul(1000) / period)
    });
    Tier {
        memory_max_bytes: number(read(Controller::Memory)),
        cpu_max_millicores: cpu,
        pids_max: number(read(Controller::Pids)),
    }
}

/// The journal's saved parent limits as the cgroup manager restores them.
pub(super) fn raise_record(instance: &Path, saved: &SavedLimits) -> RaiseRecord {
    let limits = [
        (Controller::Memory, &saved.memory_max),
        (Controller::Cpu, &saved.cpu_max),
        (Controller::Pids, &saved.pids_max),
    ];
    RaiseRecord {
        instance: instance.to_path_buf(),
        saved: limits
            .into_iter()
            .filter_map(|(controller, previous)| {
                Some(SavedLimit {
                    controller,
                    previous: previous.clone()?,
                    // Not needed to restore.
                    raised_to: String::new(),
                })
            })
            .collect(),
    }
}

/// The generation's main process: the one whose parent is outside its
/// cgroup (the tree's root), preferring the pid the journal recorded and
/// then the one whose `GENSWAP_GENERATION` is `n`.
pub(super) fn main_pid(pids: &[u32], n: u64, preferred: Option<u32>) -> u32 {
    if let Some(pid) = preferred.filter(|p| pids.contains(p)) {
        return pid;
    }
    let set: BTreeSet<u32> = pids.iter().copied().collect();
    let roots: Vec<u32> = pids
        .iter()
        .copied()
        .filter(|pid| parent_of(*pid).is_none_or(|parent| !set.contains(&parent)))
        .collect();
    let generation = n.to_string();
    roots
        .iter()
        .copied()
        .find(|pid| environ_of(*pid).get("GENSWAP_GENERATION") == Some(&generation))
        .or_else(|| roots.iter().copied().min())
        .or_else(|| pids.iter().copied().min())
        .unwrap_or(0)
}

pub(super) fn parent_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the
    // last ')'. They are: state, ppid, ...
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

pub(super) fn environ_of(pid: u32) -> HashMap<String, String> {
    fs::read(format!("/proc/{pid}/environ"))
        .map(|bytes| {
            bytes
                .split(|b| *b == 0)
                .filter_map(|var| std::str::from_utf8(var).ok())
                .filter_map(|var| var.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// A generation's record rebuilt from what the kernel says about its main
/// process, for an instance whose journal file was lost.
pub(super) fn record_from_host(
    layout: &crate::switch::RunLayout,
    key: &InstanceKey,
    listing: &GenerationListing,
) -> Option<GenerationRecord> {
    let n = listing.generation;
    let pid = main_pid(&listing.pids, n, None);
    let env = environ_of(pid);
    let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
    let sha256 = exe
        .as_deref()
        .and_then(Path::file_name)
        .and_then(|name| name.to_str())
        .and_then(|name| name.strip_prefix(ENTRY_PREFIX))
        .unwrap_or_default()
        .to_string();
    let socket = layout.generation_socket(key, n);
    (env.get("GENSWAP_SOCKET").map(PathBuf::from).as_ref() == Some(&socket)).then(|| {
        GenerationRecord {
            n,
            build: env
                .get("GENSWAP_BUILD")
                .cloned()
                .unwrap_or_else(|| "unknown".into()),
            sha256,
            store_path: exe,
            cgroup: listing.cgroup.path().to_path_buf(),
            socket,
            config_rev: String::new(),
            restart_id: String::new(),
            serving_since_ms: None,
            // Not on the host: the defaults stop it.
            stop: None,
        }
    })
}

/// Every pid in a cgroup subtree.
pub(super) fn pids_in_tree(dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = fs::read_to_string(dir.join("cgroup.procs"))
        .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default();
    for child in child_dirs(dir) {
        pids.extend(pids_in_tree(&child));
    }
    pids
}

pub(super) fn child_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

/// The instance already found whose disk name is `name` (how a cut name is
/// resolved without a record of its own).
pub(super) fn known_by_disk_name(
    found: &BTreeMap<InstanceKey, Found>,
    name: &str,
) -> Option<InstanceKey> {
    found
        .keys()
        .find(|key| DiskName::of(key).as_str() == name)
        .cloned()
}

/// Removes an empty cgroup subtree bottom-up.
pub(super) fn remove_tree(dir: &Path) -> io::Result<()> {
    for child in child_dirs(dir) {
        remove_tree(&child)?;
    }
    match fs::remove_dir(dir) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
