//! The sandbox's process contract (SPEC 5.16) on real processes, each
//! test in its own cgroup subtree: resource limits as systemd gives a
//! service, whatever the agent has; an empty bounding set; a capability
//! added in the spec really usable by a non-root user; the umask. Each
//! claim is checked by trying the forbidden thing where there is one.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;

use std::fs;
use std::path::Path;
use std::time::Duration;

use cgroup_guard::{TestCgroupTree, eventually};
use genswap_crds::{Capability, Limit};
use node_agent::cgroup::{Cgroup, Tier};
use node_agent::confine::SandboxSpec;
use node_agent::gate::InstanceKey;
use node_agent::spawn::{SpawnError, SpawnSpec, spawn};

const LONG: Duration = Duration::from_secs(30);
const NOBODY: u32 = 65534;

async fn generation(tree: &TestCgroupTree, n: u64) -> Cgroup {
    tree.manager()
        .instance(&InstanceKey::new("default", "app").expect("a key"))
        .expect("instance")
        .create_generation(n, &Tier::default())
        .await
        .expect("fresh generation")
}

thread_local! {
    /// The test's instance run dir (each test runs on a thread of its
    /// own): its generations' sockets and private `/tmp`s, removed when
    /// the test's thread ends, on failure too.
    static RUN: tempfile::TempDir = tempfile::tempdir().expect("a run dir");
}

fn as_nobody(exe: &str, cgroup: Cgroup, n: u64, sandbox: SandboxSpec) -> SpawnSpec {
    let socket = RUN.with(|run| run.path().join(format!("gen-{n}.sock")));
    let mut spec = SpawnSpec::new(exe, cgroup, socket, n, "build-a");
    spec.uid = Some(NOBODY);
    spec.gid = Some(NOBODY);
    spec.sandbox = Some(sandbox);
    spec
}

fn sh(cgroup: Cgroup, n: u64, script: &str, sandbox: SandboxSpec) -> SpawnSpec {
    let mut spec = as_nobody("/bin/sh", cgroup, n, sandbox);
    spec.args = vec!["-c".into(), script.into()];
    spec
}

/// `/proc/PID/limits`' (soft, hard) for the line starting `name`.
fn limits_of(pid: u32, name: &str) -> (String, String) {
    let text = fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = text
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in {text}"));
    let mut words = line[name.len()..].split_whitespace();
    (
        words.next().unwrap_or_default().to_owned(),
        words.next().unwrap_or_default().to_owned(),
    )
}

fn status_field(pid: u32, field: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("read status")
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{field}:"))
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_else(|| panic!("no {field}"))
}

/// The agent (this test) with an open-files limit no service would get:
/// an instance that inherited it would show it. Its hard limit stays (a
/// host may not let root raise it: no `CAP_SYS_RESOURCE`). Returns the
/// (soft, hard) set.
fn give_the_agent_an_unusual_nofile() -> (u64, u64) {
    let mut limit = nix::libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a live one.
    let got = unsafe { nix::libc::getrlimit(nix::libc::RLIMIT_NOFILE, &mut limit) };
    assert_eq!(got, 0, "{}", std::io::Error::last_os_error());
    limit.rlim_cur = 4321.min(limit.rlim_max);
    // SAFETY: setrlimit reads one live rlimit.
    let set = unsafe { nix::libc::setrlimit(nix::libc::RLIMIT_NOFILE, &limit) };
    assert_eq!(set, 0, "{}", std::io::Error::last_os_error());
    (limit.rlim_cur, limit.rlim_max)
}

#[tokio::test]
async fn an_instance_gets_systemds_limits_not_the_agents() {
    let agent = give_the_agent_an_unusual_nofile();
    let tree = TestCgroupTree::new("sandbox-limits");
    let cgroup = generation(&tree, 1).await;
    let spawned = spawn(sh(cgroup, 1, "exec sleep 1000", SandboxSpec::default()))
        .await
        .expect("spawned");
    let pid = spawned.pid();
    let nofile = limits_of(pid, "Max open files");
    println!("agent nofile {agent:?}, instance {nofile:?}");
    // systemd's 524288, or the agent's own where it is lower and the
    // agent cannot raise it (this host's root lacks CAP_SYS_RESOURCE).
    let can_raise = node_agent::confine::HostFacts::read()
        .expect("host facts")
        .can_raise;
    let hard = if can_raise {
        524_288
    } else {
        agent.1.min(524_288)
    };
    assert_eq!(nofile, ("1024".into(), hard.to_string()));
    assert_eq!(
        limits_of(pid, "Max core file size"),
        ("0".into(), "unlimited".into())
    );
    assert_eq!(
        limits_of(pid, "Max locked memory"),
        ("8388608".into(), "8388608".into())
    );
    assert_eq!(
        limits_of(pid, "Max stack size"),
        ("8388608".into(), "unlimited".into())
    );
    assert_eq!(
        limits_of(pid, "Max nice priority"),
        ("0".into(), "0".into())
    );
}

#[tokio::test]
async fn the_limits_a_spec_gives_are_the_instances_and_it_cannot_raise_them() {
    let tree = TestCgroupTree::new("sandbox-given");
    let cgroup = generation(&tree, 2).await;
    let mut sandbox = SandboxSpec::default();
    sandbox.limits.nofile = Some(Limit::new(Some(200), Some(300)));
    sandbox.limits.core = Some(Limit::new(None, None));
    // Past its hard limit: refused by the kernel, as for any user.
    let script = "ulimit -n 300 && echo raised-to-hard; ulimit -n 301 2>/dev/null && echo raised-past-hard; exec sleep 1000";
    let mut spec = sh(cgroup, 2, script, sandbox);
    let out = tempfile::NamedTempFile::new().expect("an output file");
    spec.stdout = node_agent::spawn::Output::Append(out.path().to_path_buf());
    let spawned = spawn(spec).await.expect("spawned");
    let pid = spawned.pid();
    assert_eq!(
        limits_of(pid, "Max core file size"),
        ("unlimited".into(), "unlimited".into())
    );
    eventually(LONG, "the shell's report", || {
        fs::read_to_string(out.path()).is_ok_and(|t| t.contains("raised-to-hard"))
    })
    .await;
    eventually(LONG, "the limit the shell raised it to", || {
        limits_of(pid, "Max open files") == ("300".into(), "300".into())
    })
    .await;
    let said = fs::read_to_string(out.path()).expect("output");
    assert!(!said.contains("raised-past-hard"), "{said}");
}

#[tokio::test]
async fn no_capability_is_left_unless_the_spec_adds_it() {
    let tree = TestCgroupTree::new("sandbox-caps");
    let cgroup = generation(&tree, 3).await;
    let spawned = spawn(sh(cgroup, 3, "exec sleep 1000", SandboxSpec::default()))
        .await
        .expect("spawned");
    let pid = spawned.pid();
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, set), "0000000000000000", "{set}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "Seccomp"), "2", "a filter is installed");

    let cgroup = generation(&tree, 4).await;
    let mut sandbox = SandboxSpec::default();
    sandbox.capabilities.add = vec![Capability::NetBindService];
    let spawned = spawn(sh(cgroup, 4, "exec sleep 1000", sandbox))
        .await
        .expect("spawned");
    let pid = spawned.pid();
    // NET_BIND_SERVICE is capability 10.
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, set), "0000000000000400", "{set}");
    }
    assert_eq!(
        status_field(pid, "Uid").split_whitespace().next(),
        Some("65534")
    );
}

/// A port below `ip_unprivileged_port_start`, free now.
fn free_privileged_port() -> u16 {
    let start: u16 = fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(1024);
    assert!(
        start > 600,
        "this host lets anyone bind below {start}: nothing to show"
    );
    (600..start)
        .find(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .expect("a free privileged port")
}

#[tokio::test]
async fn an_added_capability_lets_nobody_bind_a_privileged_port() {
    let tree = TestCgroupTree::new("sandbox-bind");
    let port = free_privileged_port();
    let app = testapp::binary().expect("the test app is built");
    let app = app.to_str().expect("a UTF-8 path").to_owned();
    let bind_port = |cgroup: Cgroup, n: u64, sandbox: SandboxSpec| {
        let mut spec = as_nobody(&app, cgroup, n, sandbox);
        spec.env = vec![
            (testapp::knob::NEVER_BIND.into(), "1".into()),
            (testapp::knob::PORT.into(), port.to_string()),
        ];
        spec
    };

    // Without it: the bind is refused and the program exits.
    let mut refused = spawn(bind_port(
        generation(&tree, 5).await,
        5,
        SandboxSpec::default(),
    ))
    .await
    .expect("spawned");
    let status = tokio::time::timeout(LONG, refused.wait())
        .await
        .expect("it exits")
        .expect("its status");
    assert!(!status.success(), "nobody bound port {port}: {status:?}");

    let mut sandbox = SandboxSpec::default();
    sandbox.capabilities.add = vec![Capability::NetBindService];
    let _serving = spawn(bind_port(generation(&tree, 6).await, 6, sandbox))
        .await
        .expect("spawned");
    eventually(LONG, "an answer on the privileged port", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
}

#[tokio::test]
async fn the_umask_is_the_specs_or_systemds() {
    let tree = TestCgroupTree::new("sandbox-umask");
    for (n, umask, expected) in [(7, None, "0022"), (8, Some("0077"), "0077")] {
        let cgroup = generation(&tree, n).await;
        let sandbox = SandboxSpec {
            umask: umask.map(str::to_owned),
            ..SandboxSpec::default()
        };
        let spawned = spawn(sh(cgroup, n, "exec sleep 1000", sandbox))
            .await
            .expect("spawned");
        assert_eq!(status_field(spawned.pid(), "Umask"), expected);
    }
}

#[tokio::test]
async fn a_limit_the_kernel_cannot_give_refuses_the_start_naming_it() {
    let tree = TestCgroupTree::new("sandbox-refused");
    let cgroup = generation(&tree, 9).await;
    let mut sandbox = SandboxSpec::default();
    sandbox.limits.nofile = Some(Limit::new(Some(1024), None));
    let error = spawn(sh(cgroup.clone(), 9, "exec sleep 1000", sandbox))
        .await
        .expect_err("refused");
    assert!(matches!(error, SpawnError::Confine { .. }), "{error:?}");
    assert!(error.is_refusal(), "nothing ran");
    assert!(error.to_string().contains("fs.nr_open"), "{error}");
    assert!(
        cgroup.pids().unwrap_or_default().is_empty(),
        "nothing started"
    );
}

/// What the test app said it got for each thing it tried, in order.
async fn tried(tree: &TestCgroupTree, n: u64, things: &str, sandbox: SandboxSpec) -> Vec<String> {
    tried_by(tree, n, things, sandbox, false).await
}

/// [`tried`], as root when `root` (uid 0 without a capability: the owner
/// of `/etc` and `/usr`, so only the read-only mount can refuse it).
async fn tried_by(
    tree: &TestCgroupTree,
    n: u64,
    things: &str,
    sandbox: SandboxSpec,
    root: bool,
) -> Vec<String> {
    let app = testapp::binary().expect("the test app is built");
    let mut spec = as_nobody(
        app.to_str().expect("a UTF-8 path"),
        generation(tree, n).await,
        n,
        sandbox,
    );
    if root {
        (spec.uid, spec.gid, spec.allow_root) = (Some(0), Some(0), true);
    }
    spec.env = vec![(testapp::knob::TRY.into(), things.into())];
    said_by(spec)
        .await
        .lines()
        .filter_map(|l| l.strip_prefix("tried "))
        .map(str::to_owned)
        .collect()
}

/// What `spec`'s process wrote to its stdout, once it has exited 0.
async fn said_by(mut spec: SpawnSpec) -> String {
    let out = tempfile::NamedTempFile::new().expect("an output file");
    spec.stdout = node_agent::spawn::Output::Append(out.path().to_path_buf());
    let mut spawned = spawn(spec).await.expect("spawned");
    let status = tokio::time::timeout(LONG, spawned.wait())
        .await
        .expect("it exits")
        .expect("its status");
    assert!(status.success(), "{status:?}");
    fs::read_to_string(out.path()).expect("its output")
}

const DENIED: &str = "Operation not permitted (os error 1)";

#[tokio::test]
async fn what_a_service_must_not_do_is_refused_by_default() {
    let tree = TestCgroupTree::new("sandbox-forbidden");
    let open = writable_dir();
    let dir = open.path().display();
    let things = [
        "mount".to_string(),
        "ptrace".into(),
        "unshare-user".into(),
        "raw-socket".into(),
        "packet-socket".into(),
        "vsock-socket".into(),
        "kexec".into(),
        "init-module".into(),
        "personality".into(),
        "realtime".into(),
        format!("setuid-chmod:{dir}"),
        format!("setuid-create:{dir}"),
    ];
    let sandbox = SandboxSpec {
        writable_paths: vec![open.path().to_path_buf()],
        ..SandboxSpec::default()
    };
    let said = tried(&tree, 10, &things.join(","), sandbox).await;
    let expected: Vec<String> = things.iter().map(|t| format!("{t}: {DENIED}")).collect();
    assert_eq!(said, expected);
}

/// A temp dir anyone may write in, as /tmp is.
fn writable_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temp dir");
    fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("open it up");
    dir
}

#[tokio::test]
async fn without_the_filter_a_setuid_file_and_another_personality_are_allowed() {
    let tree = TestCgroupTree::new("sandbox-unfiltered");
    let open = writable_dir();
    let dir = open.path().display();
    let unconfined = SandboxSpec {
        seccomp: genswap_crds::SeccompProfile::Unconfined,
        writable_paths: vec![open.path().to_path_buf()],
        ..SandboxSpec::default()
    };
    let said = tried(
        &tree,
        13,
        &format!("personality,setuid-chmod:{dir},realtime"),
        unconfined,
    )
    .await;
    assert_eq!(
        said,
        vec![
            "personality: ok".to_string(),
            format!("setuid-chmod:{dir}: ok"),
            // Still refused: no CAP_SYS_NICE, and RLIMIT_RTPRIO is 0.
            format!("realtime: {DENIED}"),
        ]
    );
}

#[tokio::test]
async fn what_the_spec_opens_is_allowed() {
    let tree = TestCgroupTree::new("sandbox-opened");
    let mut raw = SandboxSpec::default();
    raw.capabilities.add = vec![Capability::NetRaw];
    assert_eq!(
        tried(&tree, 11, "raw-socket,packet-socket,netlink-socket", raw).await,
        vec![
            "raw-socket: ok".to_string(),
            "packet-socket: ok".to_string(),
            "netlink-socket: ok".to_string()
        ]
    );
    // Any family, without the filter: the kernel answers (a kernel without
    // vsock loaded, as the VM's, says it does not support it).
    let unconfined = SandboxSpec {
        seccomp: genswap_crds::SeccompProfile::Unconfined,
        ..SandboxSpec::default()
    };
    let said = tried(&tree, 14, "vsock-socket", unconfined).await;
    assert!(
        said == ["vsock-socket: ok"]
            || said == ["vsock-socket: Address family not supported by protocol (os error 97)"],
        "{said:?}"
    );

    // A user namespace: refused by the filter alone where the kernel lets
    // any user make one.
    let max: u64 = fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    let unprivileged = fs::read_to_string("/proc/sys/kernel/unprivileged_userns_clone")
        .map(|t| t.trim() == "1")
        .unwrap_or(true);
    if max == 0 || !unprivileged {
        println!(
            "this kernel lets no unprivileged user make a user namespace: the filter's part is not shown"
        );
        return;
    }
    let unconfined = SandboxSpec {
        seccomp: genswap_crds::SeccompProfile::Unconfined,
        ..SandboxSpec::default()
    };
    assert_eq!(
        tried(&tree, 12, "unshare-user", unconfined).await,
        vec!["unshare-user: ok".to_string()]
    );
}

/// `things` tried by a root instance.
async fn tried_as_root(
    tree: &TestCgroupTree,
    n: u64,
    things: &[String],
    sandbox: SandboxSpec,
) -> Vec<String> {
    tried_by(tree, n, &things.join(","), sandbox, true).await
}

const READ_ONLY: &str = "Read-only file system (os error 30)";
const DENIED_ACCESS: &str = "Permission denied (os error 13)";
const NOT_FOUND: &str = "No such file or directory (os error 2)";

#[tokio::test]
async fn the_node_is_read_only_private_and_hidden_except_where_the_spec_opens_it() {
    let tree = TestCgroupTree::new("sandbox-filesystem");
    let declared = tempfile::tempdir().expect("a writable dir");
    let declared_file = declared.path().join("written");
    let neighbour = tempfile::tempdir().expect("another instance's run dir");
    let neighbours_tmp =
        node_agent::confine::filesystem::private_dir_of(&neighbour.path().join("gen-1.sock"))
            .join("tmp");
    fs::create_dir_all(&neighbours_tmp).expect("its /tmp");
    fs::write(neighbours_tmp.join("secret"), "theirs").expect("a file in it");
    let things = [
        "write:/etc/genswap-sandbox-probe".to_string(),
        "write:/usr/genswap-sandbox-probe".into(),
        "write:/proc/sys/kernel/hostname".into(),
        "read:/root".into(),
        "read:/home".into(),
        format!("read:{}", neighbours_tmp.join("secret").display()),
        format!("write:{}", declared_file.display()),
        "write:/tmp/mine".into(),
        "read:/tmp/mine".into(),
        "list:/dev".into(),
    ];
    let sandbox = SandboxSpec {
        writable_paths: vec![declared.path().to_path_buf()],
        ..SandboxSpec::default()
    };
    let said = tried_as_root(&tree, 20, &things, sandbox).await;
    let dev = "fd full mqueue null ptmx pts random shm stderr stdin stdout tty urandom zero";
    let expected: Vec<String> = things
        .iter()
        .zip([
            READ_ONLY,
            READ_ONLY,
            READ_ONLY,
            DENIED_ACCESS,
            DENIED_ACCESS,
            NOT_FOUND,
            "ok",
            "ok",
            "ok",
            dev,
        ])
        .map(|(thing, answer)| format!("{thing}: {answer}"))
        .collect();
    assert_eq!(said, expected);
    assert!(declared_file.exists(), "the declared path was written");
    assert!(!Path::new("/etc/genswap-sandbox-probe").exists());
    // Its /tmp is the generation's private one, on disk beside its socket.
    let private_tmp = RUN.with(|run| {
        node_agent::confine::filesystem::private_dir_of(&run.path().join("gen-20.sock")).join("tmp")
    });
    assert!(
        private_tmp.join("mine").exists(),
        "{}",
        private_tmp.display()
    );

    // The host's view, opted into: /etc is the node's own again.
    let host = SandboxSpec {
        filesystem: genswap_crds::FilesystemProfile::Host,
        ..SandboxSpec::default()
    };
    let said = tried_as_root(&tree, 21, &["read:/root".to_string()], host).await;
    assert_eq!(said, vec!["read:/root: ok".to_string()]);

    // Another user's processes are not in its /proc (this test's, root's).
    let me = std::process::id();
    let said = tried(
        &tree,
        22,
        &format!("read:/proc/{me}/status,read:/proc/self/status"),
        SandboxSpec::default(),
    )
    .await;
    assert_eq!(
        said,
        vec![
            format!("read:/proc/{me}/status: {NOT_FOUND}"),
            "read:/proc/self/status: ok".to_string()
        ]
    );
}

/// The instance owns its run dir, so it could leave a link where the
/// agent (root) makes a generation's private directory: the agent never
/// follows one, and never uses a directory the instance made.
#[tokio::test]
async fn a_link_the_instance_left_in_its_run_dir_is_never_followed() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
    let tree = TestCgroupTree::new("sandbox-links");
    let victim = tempfile::tempdir().expect("a directory to protect");
    fs::set_permissions(victim.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let socket = |n: u64| RUN.with(|run| run.path().join(format!("gen-{n}.sock")));
    let private = |n: u64| node_agent::confine::filesystem::private_dir_of(&socket(n));

    // A link where the private directory goes.
    symlink(victim.path(), private(30)).expect("a link");
    // A directory of the instance's own, with a link inside.
    fs::create_dir(private(31)).expect("the instance's dir");
    std::os::unix::fs::chown(private(31), Some(NOBODY), Some(NOBODY)).expect("chown");
    symlink(victim.path(), private(31).join("tmp")).expect("a link inside");

    for n in [30, 31] {
        let mut started = spawn(sh(
            generation(&tree, n).await,
            n,
            "exit 0",
            SandboxSpec::default(),
        ))
        .await
        .expect("spawned");
        let status = tokio::time::timeout(LONG, started.wait())
            .await
            .expect("it exits")
            .expect("its status");
        assert!(status.success(), "{n}: {status:?}");
        let meta = fs::symlink_metadata(private(n)).expect("the private dir");
        assert!(meta.is_dir(), "{n}: a directory, not a link");
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o700), "{n}");
    }
    let meta = fs::metadata(victim.path()).expect("the victim");
    assert_eq!(meta.mode() & 0o7777, 0o755, "its mode untouched");
    assert_eq!(
        fs::read_dir(victim.path()).expect("list").count(),
        0,
        "nothing made in it"
    );
}

/// Debian's static busybox, which the VM's install puts here; `None`
/// (after a skip line) where it is missing and not required.
fn busybox() -> Option<&'static Path> {
    let busybox = Path::new("/bin/busybox");
    if busybox.exists() {
        return Some(busybox);
    }
    if std::env::var("GENSWAP_VM").as_deref() == Ok("required") {
        panic!("/bin/busybox is missing: apt-get install busybox-static");
    }
    eprintln!("SKIP: no /bin/busybox (apt-get install busybox-static)");
    None
}

/// A tree of a static busybox and its applets' links, and nothing else.
fn busybox_tree(busybox: &Path) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let tree = tempfile::tempdir().expect("a tree");
    let bin = tree.path().join("bin");
    fs::create_dir(&bin).expect("bin");
    fs::copy(busybox, bin.join("busybox")).expect("busybox");
    for applet in [
        "sh", "cat", "ls", "touch", "readlink", "grep", "dirname", "test",
    ] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).expect("an applet");
    }
    for dir in [tree.path(), &bin] {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    tree
}

/// `script` run by the busybox of `build` with `build` as its root, as
/// `nobody`.
fn in_busybox_root(
    cgroup: Cgroup,
    n: u64,
    build: &Path,
    script: &str,
    sandbox: SandboxSpec,
) -> SpawnSpec {
    let sandbox = SandboxSpec {
        root: genswap_crds::RootProfile::Build,
        tree: Some(build.to_path_buf()),
        ..sandbox
    };
    let mut spec = sh(cgroup, n, script, sandbox);
    spec.exe = build.join("bin/busybox");
    spec.args.insert(0, "sh".into());
    spec
}

/// What `ls /` says in a busybox tree as the root: its `bin`, the mount
/// points, and the top directory of the test's temp dirs (the run dir's
/// and a declared path's, bound in at their paths).
fn busybox_root_listing() -> String {
    let temp = RUN.with(|run| {
        run.path()
            .components()
            .nth(1)
            .and_then(|c| c.as_os_str().to_str().map(str::to_owned))
            .expect("a top directory")
    });
    let mut root = vec!["bin", "dev", "etc", "proc", "sys", "tmp", "var", &temp];
    root.sort_unstable();
    root.dedup();
    format!("root: {}", root.join(" "))
}

#[tokio::test]
async fn a_build_root_is_the_trees_with_the_run_dir_tmp_and_declared_paths_bound_in() {
    use std::os::unix::fs::PermissionsExt;
    let Some(busybox) = busybox() else {
        return;
    };
    let tree = TestCgroupTree::new("sandbox-build-root");
    let build = busybox_tree(busybox);
    let declared = writable_dir();
    let run_dir = RUN.with(|run| run.path().to_path_buf());
    fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o777)).expect("its run dir");
    let script = format!(
        "t() {{ if eval \"$2\" >/dev/null 2>&1; then echo \"$1: yes\"; else echo \"$1: no\"; fi; }}\n\
         t node-files 'test -e /usr/bin/env'\n\
         t write-tree 'touch /bin/new'\n\
         t write-run 'touch \"$(dirname \"$GENSWAP_SOCKET\")/from-the-tree\"'\n\
         t write-declared 'touch {declared}/from-the-tree'\n\
         t write-tmp 'touch /tmp/mine'\n\
         t resolver 'cat /etc/resolv.conf > {declared}/resolv.conf'\n\
         t its-proc 'test \"$(readlink /proc/self/exe)\" = /bin/busybox'\n\
         t sys-read-only 'grep -q \" /sys sysfs ro,\" /proc/self/mounts'\n\
         t dev-null 'echo x > /dev/null'\n\
         echo root: $(ls /)\n",
        declared = declared.path().display(),
    );
    let spec = in_busybox_root(
        generation(&tree, 30).await,
        30,
        build.path(),
        &script,
        SandboxSpec {
            writable_paths: vec![declared.path().to_path_buf()],
            ..SandboxSpec::default()
        },
    );
    let said = said_by(spec).await;
    assert_eq!(
        said.lines().collect::<Vec<_>>(),
        vec![
            "node-files: no",
            "write-tree: no",
            "write-run: yes",
            "write-declared: yes",
            "write-tmp: yes",
            "resolver: yes",
            "its-proc: yes",
            "sys-read-only: yes",
            "dev-null: yes",
            &busybox_root_listing(),
        ],
        "{said}"
    );
    assert!(run_dir.join("from-the-tree").exists());
    assert!(declared.path().join("from-the-tree").exists());
    if let Ok(node) = fs::read("/etc/resolv.conf") {
        assert_eq!(
            fs::read(declared.path().join("resolv.conf")).expect("its copy"),
            node,
            "the node's resolver configuration"
        );
    }
    let private_tmp =
        node_agent::confine::filesystem::private_dir_of(&run_dir.join("gen-30.sock")).join("tmp");
    assert!(private_tmp.join("mine").exists());
    assert!(!build.path().join("bin/new").exists());
}

/// Where the agent's own seccomp profile refuses `pivot_root` (containerd's
/// RuntimeDefault does not list it), the tree still becomes the root, by a
/// move onto `/` and a chroot, and what it sees is the same.
#[tokio::test]
async fn a_build_root_needs_no_pivot_root() {
    let Some(busybox) = busybox() else {
        return;
    };
    // This test's thread, which the spawn forks from, may not pivot_root.
    let no_pivot = seccompiler::SeccompFilter::new(
        [(nix::libc::SYS_pivot_root, Vec::new())]
            .into_iter()
            .collect(),
        seccompiler::SeccompAction::Allow,
        seccompiler::SeccompAction::Errno(1),
        std::env::consts::ARCH
            .try_into()
            .expect("a known architecture"),
    )
    .expect("a filter");
    let no_pivot: seccompiler::BpfProgram = no_pivot.try_into().expect("a program");
    seccompiler::apply_filter(&no_pivot).expect("the thread's filter");

    let tree = TestCgroupTree::new("sandbox-no-pivot");
    let build = busybox_tree(busybox);
    let spec = in_busybox_root(
        generation(&tree, 31).await,
        31,
        build.path(),
        "echo root: $(ls /); if touch /bin/new 2>/dev/null; then echo tree writable; fi",
        SandboxSpec::default(),
    );
    assert_eq!(said_by(spec).await.trim(), busybox_root_listing());
}

/// A generation's exec probes and hooks run in its tree too: a bare name
/// is found on the `PATH` inside it, and a multi-call program still gets
/// the name it was called by (busybox's `sh` is a link).
#[tokio::test]
async fn a_generations_commands_run_in_its_build_root() {
    use node_agent::command::{CommandEnd, CommandIdentity, CommandSpec, GenerationCommands};
    let Some(busybox) = busybox() else {
        return;
    };
    let tree = TestCgroupTree::new("sandbox-root-commands");
    let build = busybox_tree(busybox);
    let cgroup = generation(&tree, 32).await;
    let socket = RUN.with(|run| run.path().join("gen-32.sock"));
    let commands = GenerationCommands::new(
        cgroup,
        Some(tree.mount()),
        socket,
        32,
        "build-a",
        CommandIdentity {
            uid: Some(NOBODY),
            gid: Some(NOBODY),
            sandbox: SandboxSpec {
                root: genswap_crds::RootProfile::Build,
                tree: Some(build.path().to_path_buf()),
                ..SandboxSpec::default()
            },
            ..CommandIdentity::default()
        },
    );
    for program in ["sh", "/bin/sh"] {
        let command = CommandSpec::new(&[program.into(), "-c".into(), "echo root: $(ls /)".into()])
            .expect("a command");
        match commands.run(&command, LONG).await.expect("it ran") {
            CommandEnd::Exited { status, output } => {
                assert!(status.success(), "{program}: {status:?} {output}");
                assert_eq!(output.trim(), busybox_root_listing(), "{program}");
            }
            other => panic!("{program}: {other:?}"),
        }
    }
    // Nothing of the node's: its programs are not found.
    let node_only = CommandSpec::new(&["env".into()]).expect("a command");
    let refused = commands
        .run(&node_only, LONG)
        .await
        .expect_err("not in the tree");
    assert!(refused.to_string().contains("in the tree"), "{refused}");
}
