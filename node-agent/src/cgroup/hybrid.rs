//! Hybrid hosts: cgroup v1 controllers mounted beside the cgroup v2 tree
//! (Ubuntu 20.04, RHEL 8, and any node booted without
//! `systemd.unified_cgroup_hierarchy=1`).
//!
//! On such a host the kubelet and the runtime put a pod's processes in v1
//! cgroups too (`<hierarchy>/kubepods/<qos>/pod<uid>/<container>`), and a
//! child inherits every v1 cgroup of its parent. When the agent's container
//! stops, containerd kills every process left in the container's cgroup (a
//! hostPID container has no pid namespace that would do it) and the kubelet
//! kills what is left in the pod's: the instances the agent started would
//! die with its pod, whatever their v2 cgroup. So every child the agent
//! starts leaves the pod's v1 cgroups before its first instruction of its
//! own: in each v1 hierarchy where the agent sits under the kubelet's
//! `kubepods` cgroup, it joins `genswap`, a sibling of `kubepods` (as
//! Docker's `docker/` is). A hierarchy whose `genswap` is not reachable
//! through this mount namespace (a pod that mounts only the runtime's view
//! of its own cgroups) makes the agent refuse to start.
//!
//! Outside a pod (a host service, standalone mode, the tests) no v1 path
//! is under `kubepods` and nothing moves. The v1 directories are never
//! removed: they hold no limits and may hold instances of a later agent.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use super::unescape_mount_field;

/// Where a process reads its own cgroups.
pub const PROC_SELF_CGROUP: &str = "/proc/self/cgroup";

/// The v1 cgroup the agent's children join, beside the kubelet's.
pub const V1_HOME: &str = "genswap";

/// Why the agent's children cannot be given homes outside its pod's v1
/// cgroups.
#[derive(Debug, thiserror::Error)]
pub enum HybridError {
    /// `/proc/self/cgroup` or the mount table could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The agent is in a pod's v1 cgroup and no mount of that hierarchy
    /// reaches the place its children should go.
    #[error(
        "this host is hybrid (cgroup v1 controllers beside cgroup v2) and the agent runs in its pod's v1 cgroup {pod_path} of the {hierarchy} hierarchy; the runtime and the kubelet kill every process in it when the pod's container stops, so its instances must leave it for {target}, but no {hierarchy} mount in this mount namespace reaches it: mount the host's whole /sys/fs/cgroup into the agent's pod (the chart's agent.hostPaths.cgroup default), or move the node to cgroup v2"
    )]
    Unreachable {
        hierarchy: String,
        pod_path: String,
        target: String,
    },
    /// The home directory could not be made ready or opened.
    #[error("cannot prepare the v1 cgroup {path} for the agent's children: {source}")]
    Prepare {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// One v1 hierarchy's line of `/proc/<pid>/cgroup`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V1Membership {
    /// Its controllers as the kernel lists them (`cpu,cpuacct`,
    /// `name=systemd`).
    pub hierarchy: String,
    /// The cgroup's path from the hierarchy's root.
    pub path: String,
}

/// The v1 lines of a `/proc/<pid>/cgroup` text (the v2 line, `0::`, is
/// left out).
pub fn v1_memberships(proc_cgroup: &str) -> Vec<V1Membership> {
    proc_cgroup
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let id = fields.next()?;
            let hierarchy = fields.next()?;
            let path = fields.next()?;
            (id != "0" && !hierarchy.is_empty()).then(|| V1Membership {
                hierarchy: hierarchy.to_owned(),
                path: path.to_owned(),
            })
        })
        .collect()
}

/// A cgroup v1 mount from the mount table.
#[derive(Clone, Debug, PartialEq, Eq)]
struct V1Mount {
    /// The cgroup of the hierarchy it shows at its mount point.
    root: String,
    mount_point: PathBuf,
    /// Its super options: `rw`, the controllers, `name=…`.
    options: Vec<String>,
}

impl V1Mount {
    fn mounts(&self, hierarchy: &str) -> bool {
        hierarchy
            .split(',')
            .all(|controller| self.options.iter().any(|option| option == controller))
    }
}

/// The cgroup v1 mounts of a mountinfo text that are visible: where several
/// are mounted on one point, the last covers the others.
fn visible_v1_mounts(mountinfo: &str) -> Vec<V1Mount> {
    let mut by_point: BTreeMap<PathBuf, V1Mount> = BTreeMap::new();
    for line in mountinfo.lines() {
        let Some((mount_fields, fs_fields)) = line.split_once(" - ") else {
            continue;
        };
        let mut mount_fields = mount_fields.split_whitespace();
        let (Some(root), Some(mount_point)) = (mount_fields.nth(3), mount_fields.next()) else {
            continue;
        };
        let mount_point = PathBuf::from(unescape_mount_field(mount_point));
        let mut fs_fields = fs_fields.split_whitespace();
        if fs_fields.next() != Some("cgroup") {
            // Anything else mounted here covers an earlier cgroup mount.
            by_point.remove(&mount_point);
            continue;
        }
        let options = fs_fields
            .nth(1)
            .unwrap_or_default()
            .split(',')
            .map(str::to_owned)
            .collect();
        let root = unescape_mount_field(root).to_string_lossy().into_owned();
        by_point.insert(
            mount_point.clone(),
            V1Mount {
                root,
                mount_point,
                options,
            },
        );
    }
    by_point.into_values().collect()
}

/// Where a child should live instead of `path`, when `path` lies under the
/// kubelet's pod cgroups (`kubepods` with the cgroupfs driver,
/// `kubepods.slice` with systemd's): `genswap` beside that cgroup.
pub fn outside_the_pods(path: &str) -> Option<String> {
    let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let at = components
        .iter()
        .position(|c| *c == "kubepods" || c.starts_with("kubepods."))?;
    let mut target = String::new();
    for component in &components[..at] {
        target.push('/');
        target.push_str(component);
    }
    target.push('/');
    target.push_str(V1_HOME);
    Some(target)
}

/// One hierarchy's home for the agent's children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V1Home {
    pub hierarchy: String,
    /// The agent's own (pod) cgroup in it.
    pub pod_path: String,
    /// The directory its children join.
    pub dir: PathBuf,
}

/// The homes the agent's children need, from its `/proc/self/cgroup` and
/// mount table: empty unless the agent is in a pod's v1 cgroups.
pub fn plan_homes(proc_cgroup: &str, mountinfo: &str) -> Result<Vec<V1Home>, HybridError> {
    let mounts = visible_v1_mounts(mountinfo);
    let mut homes = Vec::new();
    for membership in v1_memberships(proc_cgroup) {
        let Some(target) = outside_the_pods(&membership.path) else {
            continue;
        };
        let dir = mounts
            .iter()
            .filter(|mount| mount.mounts(&membership.hierarchy))
            .find_map(|mount| {
                let below = Path::new(&target)
                    .strip_prefix(&mount.root)
                    .ok()?
                    .to_path_buf();
                Some(mount.mount_point.join(below))
            })
            .ok_or_else(|| HybridError::Unreachable {
                hierarchy: membership.hierarchy.clone(),
                pod_path: membership.path.clone(),
                target: target.clone(),
            })?;
        homes.push(V1Home {
            hierarchy: membership.hierarchy,
            pod_path: membership.path,
            dir,
        });
    }
    Ok(homes)
}

/// Creates each home and opens its `cgroup.procs` for writing. A new
/// cpuset cgroup has no CPUs or memory nodes, and the kernel refuses a
/// process there: it gets its parent's.
pub fn open_homes(homes: &[V1Home]) -> Result<Vec<OwnedFd>, HybridError> {
    homes
        .iter()
        .map(|home| {
            let fail = |source| HybridError::Prepare {
                path: home.dir.clone(),
                source,
            };
            fs::create_dir_all(&home.dir).map_err(fail)?;
            if let Some(parent) = home.dir.parent() {
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    inherit_if_empty(&home.dir.join(file), &parent.join(file)).map_err(fail)?;
                }
            }
            let procs = fs::OpenOptions::new()
                .write(true)
                .open(home.dir.join("cgroup.procs"))
                .map_err(fail)?;
            Ok(OwnedFd::from(procs))
        })
        .collect()
}

/// Copies `parent` into `file` when `file` exists and is empty.
fn inherit_if_empty(file: &Path, parent: &Path) -> io::Result<()> {
    match fs::read_to_string(file) {
        Ok(own) if own.trim().is_empty() => fs::write(file, fs::read_to_string(parent)?.trim()),
        Ok(_) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error),
    }
}

/// Reads this process's cgroups and mounts, prepares the homes its
/// children need and has every later launch join them. Returns the homes
/// (none outside a pod on a hybrid host).
pub fn leave_pod_cgroups_v1() -> Result<Vec<V1Home>, HybridError> {
    let read = |path: &str| {
        fs::read_to_string(path).map_err(|source| HybridError::Read {
            path: PathBuf::from(path),
            source,
        })
    };
    let homes = plan_homes(&read(PROC_SELF_CGROUP)?, &read(super::MOUNTINFO)?)?;
    if !homes.is_empty() {
        crate::launch::join_also(open_homes(&homes)?);
    }
    Ok(homes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent's pod on this repository's hybrid test host, as the kubelet
    /// (cgroupfs driver) and runc place it.
    const POD: &str = "/kubepods/besteffort/pod0f3e/5d1c";
    fn pod_cgroup() -> String {
        format!(
            "9:name=systemd:{POD}\n8:pids:{POD}\n4:memory:/session/1{POD}\n2:cpu,cpuacct:{POD}\n0::/\n"
        )
    }
    const HOST_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn the_v1_lines_of_proc_cgroup_name_their_hierarchies() {
        let lines = v1_memberships(&pod_cgroup());
        let hierarchies: Vec<&str> = lines.iter().map(|l| l.hierarchy.as_str()).collect();
        assert_eq!(
            hierarchies,
            ["name=systemd", "pids", "memory", "cpu,cpuacct"]
        );
        assert!(v1_memberships("0::/kubepods/x\n").is_empty(), "pure v2");
    }

    #[test]
    fn a_pod_path_is_left_for_a_sibling_of_kubepods() {
        assert_eq!(outside_the_pods(POD).as_deref(), Some("/genswap"));
        assert_eq!(
            outside_the_pods("/session/1/kubepods/burstable/pod1/c").as_deref(),
            Some("/session/1/genswap")
        );
        assert_eq!(
            outside_the_pods(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-1.scope"
            )
            .as_deref(),
            Some("/genswap")
        );
        assert_eq!(outside_the_pods("/system.slice/genswap.service"), None);
        assert_eq!(outside_the_pods("/"), None);
    }

    #[test]
    fn every_pod_hierarchy_gets_a_home_through_the_hosts_mounts() {
        let homes = plan_homes(&pod_cgroup(), HOST_MOUNTS).expect("reachable");
        let dirs: Vec<(&str, &Path)> = homes
            .iter()
            .map(|h| (h.hierarchy.as_str(), h.dir.as_path()))
            .collect();
        assert_eq!(
            dirs,
            [
                ("name=systemd", Path::new("/sys/fs/cgroup/systemd/genswap")),
                ("pids", Path::new("/sys/fs/cgroup/pids/genswap")),
                (
                    "memory",
                    Path::new("/sys/fs/cgroup/memory/session/1/genswap")
                ),
                (
                    "cpu,cpuacct",
                    Path::new("/sys/fs/cgroup/cpu,cpuacct/genswap")
                ),
            ]
        );
    }

    #[test]
    fn a_host_process_needs_no_home() {
        let host = "4:memory:/session/1\n8:pids:/\n0::/\n";
        assert_eq!(plan_homes(host, HOST_MOUNTS).expect("plan"), []);
    }

    #[test]
    fn a_pod_that_sees_only_its_own_cgroups_is_refused_with_the_remedy() {
        // The runtime's own view: each hierarchy bind-mounted from the
        // container's cgroup, so no root above it is reachable.
        let container_view = format!(
            "50 49 0:28 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n\
             51 50 0:36 {POD} /sys/fs/cgroup/pids ro - cgroup cgroup rw,pids\n"
        );
        let error =
            plan_homes(&format!("8:pids:{POD}\n"), &container_view).expect_err("no reachable home");
        let message = error.to_string();
        assert!(message.contains("hybrid"), "{message}");
        assert!(message.contains("agent.hostPaths.cgroup"), "{message}");
        assert!(message.contains(POD), "{message}");
    }

    #[test]
    fn a_mount_covering_another_on_the_same_point_wins() {
        // The runtime mounts its view of /sys/fs/cgroup/pids, then the pod's
        // hostPath of the host's /sys/fs/cgroup covers it.
        let both = format!(
            "51 50 0:36 {POD} /sys/fs/cgroup/pids ro - cgroup cgroup rw,pids\n\
             61 60 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
        );
        let homes = plan_homes(&format!("8:pids:{POD}\n"), &both).expect("the host's mount");
        assert_eq!(homes[0].dir, Path::new("/sys/fs/cgroup/pids/genswap"));
        let covered = format!("{both}62 60 0:99 / /sys/fs/cgroup/pids rw - tmpfs tmpfs rw\n");
        assert!(plan_homes(&format!("8:pids:{POD}\n"), &covered).is_err());
    }

    #[test]
    fn a_new_cpuset_home_gets_its_parents_cpus_and_an_existing_one_keeps_its_own() {
        let dir = tempfile::tempdir().expect("temp dir");
        let parent = dir.path();
        let home = parent.join(V1_HOME);
        fs::create_dir(&home).expect("home");
        fs::write(parent.join("cpuset.cpus"), "0-1\n").expect("parent cpus");
        fs::write(home.join("cpuset.cpus"), "\n").expect("empty cpus");
        inherit_if_empty(&home.join("cpuset.cpus"), &parent.join("cpuset.cpus")).expect("copy");
        assert_eq!(
            fs::read_to_string(home.join("cpuset.cpus")).expect("read"),
            "0-1"
        );
        fs::write(home.join("cpuset.cpus"), "1").expect("own cpus");
        inherit_if_empty(&home.join("cpuset.cpus"), &parent.join("cpuset.cpus")).expect("keep");
        assert_eq!(
            fs::read_to_string(home.join("cpuset.cpus")).expect("read"),
            "1"
        );
        inherit_if_empty(&home.join("cpuset.mems"), &parent.join("cpuset.mems"))
            .expect("no cpuset controller, nothing to do");
    }
}
