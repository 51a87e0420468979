//! A generation's stdout and stderr (SPEC 5.11): written by a log shim to
//! `<log dir>/<namespace>_<name>/<N>.log` in CRI format, rotated, dropped
//! and counted on a full disk, readable with `node-agent logs`, and never
//! tied to the agent's own output: the issue's reproduction, a C server
//! with the default SIGPIPE that logs every request, keeps serving after
//! the agent and the reader of its output are killed together, as a
//! DaemonSet pod restart kills them.
//!
//! Real processes throughout: the shims are the built `genswap-helper` (and
//! `node-agent`, which can stand in for it), the instances testapp and a C program compiled here, on real cgroup v2.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use cgroup_guard::{TestCgroupTree, eventually, teardown};
use node_agent::gate::InstanceKey;
use node_agent::logs::file::{current_path, dropped_path, files_of, read_dropped};
use node_agent::logs::{LogError, LogSettings, LogSink, SHIM_CGROUP, cri};
use sha2::{Digest, Sha256};
use swap_host::SwapHost;

const DEADLINE: Duration = Duration::from_secs(30);
const AGENT: &str = env!("CARGO_BIN_EXE_node-agent");
const HELPER: &str = swap_host::HELPER;

fn shim_pids(cgroup_root: &Path) -> Vec<u32> {
    fs::read_to_string(cgroup_root.join(SHIM_CGROUP).join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Every line of `files`, each checked to be a CRI record.
fn records(files: &[PathBuf]) -> Vec<(cri::Stream, bool, String)> {
    let mut out = Vec::new();
    for file in files {
        let text = fs::read(file).expect("a readable log file");
        assert!(
            text.is_empty() || text.ends_with(b"\n"),
            "{} ends inside a record",
            file.display()
        );
        for line in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let record = cri::parse(line).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            out.push((
                record.stream,
                record.full,
                String::from_utf8_lossy(record.text).into_owned(),
            ));
        }
    }
    out
}

fn logs_command(log_dir: &Path, args: &[&str]) -> String {
    let output = Command::new(AGENT)
        .arg("logs")
        .args(args)
        .arg("--log-dir")
        .arg(log_dir)
        .output()
        .expect("run node-agent logs");
    assert!(
        output.status.success(),
        "node-agent logs {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("text")
}

#[tokio::test]
async fn a_generations_output_is_its_own_cri_log_and_logs_reads_it() {
    let host = SwapHost::new("logs-cri");
    let log_dir = host.log_dir();
    host.install(1, "b1").await;
    let first = host.who_serves().await.expect("b1 serves");
    let instance_dir = log_dir.join("default_app");
    eventually(DEADLINE, "testapp's start line in 1.log", || {
        fs::read_to_string(current_path(&instance_dir, "1"))
            .is_ok_and(|text| text.contains(&format!("genswap-testapp[{}]", first.pid)))
    })
    .await;
    let gen1 = records(&files_of(&instance_dir, "1"));
    assert!(
        gen1.iter()
            .all(|(stream, full, _)| *stream == cri::Stream::Stderr && *full),
        "testapp logs whole lines to stderr: {gen1:?}"
    );

    // The overlap's successor gets a log of its own; the retiring
    // generation's drain lines end up in its own file.
    let b2 = host.build("b2");
    let result = host.swap(&host.attempt(2, &b2, "b2")).await;
    assert_eq!(result.outcome, genswap_crds::Outcome::Done, "{result:?}");
    eventually(DEADLINE, "the drain of generation 1 in its log", || {
        fs::read_to_string(current_path(&instance_dir, "1"))
            .is_ok_and(|text| text.contains("drain finished"))
    })
    .await;

    let newest = logs_command(&log_dir, &["default/app"]);
    let second = host.who_serves().await.expect("b2 serves");
    assert!(
        newest.contains(&format!("genswap-testapp[{}]", second.pid)),
        "{newest}"
    );
    assert!(
        !newest.contains(" stderr F "),
        "the text only, without the CRI prefix: {newest}"
    );
    let previous = logs_command(&log_dir, &["default/app", "--previous"]);
    assert!(previous.contains("drain finished"), "{previous}");
    assert_eq!(
        previous,
        logs_command(&log_dir, &["default/app", "--generation", "1"])
    );
    let raw = logs_command(&log_dir, &["default/app", "--raw"]);
    assert!(
        raw.lines().all(|line| cri::parse(line.as_bytes()).is_ok()),
        "{raw}"
    );

    host.tear_down().await;
    let root = host.instance_cgroup();
    let root = root.parent().expect("the cgroup root");
    // The shim started ahead for the next generation has none yet.
    let spare = || host.engine.logs().spare_pid();
    eventually(DEADLINE, "every shim to exit after its generation", || {
        shim_pids(root).into_iter().all(|pid| Some(pid) == spare())
    })
    .await;
    assert!(spare().is_some(), "a shim waits for the next generation");
}

/// A sink over a fresh cgroup tree, for tests that write to a shim directly
/// and count the shims: so without one started ahead.
fn sink(
    tag: &str,
    settings: impl FnOnce(&Path) -> LogSettings,
) -> (TestCgroupTree, LogSink, tempfile::TempDir) {
    let tree = TestCgroupTree::new(tag);
    let dir = tempfile::tempdir().expect("temp dir");
    let sink = LogSink::new(settings(dir.path()), &tree.manager())
        .expect("log sink")
        .without_spare();
    (tree, sink, dir)
}

fn key() -> InstanceKey {
    InstanceKey::new("default", "app").expect("key")
}

/// Writes `lines` to `fd` from a thread: returns once all were written.
fn write_lines(
    fd: std::os::fd::OwnedFd,
    lines: impl Iterator<Item = String> + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut file = fs::File::from(fd);
        for line in lines {
            file.write_all(line.as_bytes()).expect("the shim reads");
        }
    })
}

/// Waits for a [`write_lines`] thread to return: every write returned, so
/// the shim never blocked the writer nor broke its pipe (a Rust writer gets
/// EPIPE, which panics the thread, where a C one would die of SIGPIPE).
async fn writes_return(writer: std::thread::JoinHandle<()>, what: &str) {
    let started = std::time::Instant::now();
    while !writer.is_finished() {
        assert!(started.elapsed() < DEADLINE, "{what}: the writes blocked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writer
        .join()
        .unwrap_or_else(|_| panic!("{what}: a write failed"));
}

#[tokio::test]
async fn the_shim_rotates_by_size_and_keeps_at_most_the_configured_files() {
    let (tree, sink, dir) = sink("logs-rotate", |dir| LogSettings {
        max_size: 4096,
        max_files: 3,
        ..LogSettings::in_dir(dir.join("logs"), HELPER)
    });
    let output = sink.start(&key(), 1, None).expect("shim starts");
    let root = tree.path().join("genswap");
    assert_eq!(
        shim_pids(&root).len(),
        1,
        "the shim is in the shims' cgroup"
    );
    let out = write_lines(output.stdout, (0..2000).map(|i| format!("line {i:05}\n")));
    let err = write_lines(output.stderr, (0..5).map(|i| format!("err {i}\n")));
    writes_return(out, "stdout").await;
    writes_return(err, "stderr").await;
    eventually(DEADLINE, "the shim to exit once both pipes closed", || {
        shim_pids(&root).is_empty()
    })
    .await;

    let instance_dir = dir.path().join("logs").join("default_app");
    let files = files_of(&instance_dir, "1");
    assert_eq!(files.len(), 3, "{files:?}");
    for file in &files {
        assert!(fs::metadata(file).expect("exists").len() <= 4096);
    }
    let kept: Vec<u32> = records(&files)
        .into_iter()
        .filter(|(stream, _, _)| *stream == cri::Stream::Stdout)
        .map(|(_, full, text)| {
            assert!(full);
            text.strip_prefix("line ")
                .and_then(|n| n.parse().ok())
                .expect("a numbered line")
        })
        .collect();
    assert_eq!(kept.last(), Some(&1999), "the newest line is kept");
    assert!(
        kept.windows(2).all(|w| w[1] == w[0] + 1),
        "what is kept is contiguous: rotation lost nothing it kept"
    );
    assert_eq!(read_dropped(&dropped_path(&instance_dir, "1")), 0);
}

/// A small tmpfs, unmounted on drop.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(at: &Path, size: &str) -> SmallDisk {
        fs::create_dir_all(at).expect("mount point");
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "genswap-test-logs",
            ])
            .arg(at)
            .status()
            .expect("run mount");
        assert!(status.success(), "mounting a tmpfs (the tests run as root)");
        SmallDisk(at.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_full_disk_drops_whole_records_counts_them_and_never_blocks_the_writer() {
    let (tree, sink, dir) = sink("logs-full", |dir| {
        LogSettings::in_dir(dir.join("logs"), HELPER)
    });
    let disk = SmallDisk::mount(&dir.path().join("logs"), "64k");
    let output = sink.start(&key(), 1, None).expect("shim starts");
    // About 2 MB into 64 KiB: most records cannot be written.
    let writer = write_lines(
        output.stdout,
        (0..50_000).map(|i| format!("a line of output that fills the disk {i:06}\n")),
    );
    drop(output.stderr);
    writes_return(writer, "a full disk").await;
    let root = tree.path().join("genswap");
    eventually(DEADLINE, "the shim to exit", || shim_pids(&root).is_empty()).await;

    let instance_dir = dir.path().join("logs").join("default_app");
    let dropped = read_dropped(&dropped_path(&instance_dir, "1"));
    let kept = records(&files_of(&instance_dir, "1"));
    assert!(dropped > 0, "records were dropped and counted");
    assert!(!kept.is_empty(), "what fitted was written");
    assert_eq!(
        kept.len() as u64 + dropped,
        50_000,
        "every record is either in the file, whole, or counted"
    );
    let metrics = node_agent::metrics::AgentMetrics::new().with_log_dir(dir.path().join("logs"));
    let text = metrics.encode().expect("metrics encode");
    assert!(
        text.contains(&format!(
            "genswap_agent_log_records_dropped_total{{instance=\"default/app\"}} {dropped}"
        )),
        "{text}"
    );
    drop(disk);
}

/// The issue's server: a C program with the default SIGPIPE disposition,
/// serving HTTP on `GENSWAP_SOCKET` and logging a line per request to
/// stdout, flushed at once, as a Go, C or Python daemon does.
const SIGPIPE_SERVER: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int main(void) {
    const char *path = getenv("GENSWAP_SOCKET");
    if (!path) return 2;
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    unlink(path);
    if (bind(s, (struct sockaddr *)&addr, sizeof addr) < 0) { perror("bind"); return 1; }
    if (listen(s, 64) < 0) { perror("listen"); return 1; }
    printf("listening on %s\n", path);
    fflush(stdout);
    unsigned long served = 0;
    for (;;) {
        int c = accept(s, NULL, NULL);
        if (c < 0) continue;
        char buf[4096];
        if (read(c, buf, sizeof buf) < 0) { close(c); continue; }
        served++;
        printf("request %lu\n", served);
        fflush(stdout);
        const char *reply = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
        if (write(c, reply, strlen(reply)) < 0) perror("write");
        close(c);
    }
}
"#;

fn compile_server(dir: &Path) -> PathBuf {
    let source = dir.join("sigpipe-server.c");
    let binary = dir.join("sigpipe-server");
    fs::write(&source, SIGPIPE_SERVER).expect("write the C source");
    let status = Command::new("cc")
        .arg("-O1")
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .status()
        .expect("run cc (the machine has a C compiler)");
    assert!(status.success(), "cc compiles the server");
    binary
}

/// One GET through `socket`; the status line, or why there was none.
fn get(socket: &Path) -> Result<String, String> {
    let mut stream = UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: genswap\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut reply = String::new();
    stream
        .read_to_string(&mut reply)
        .map_err(|e| format!("read: {e}"))?;
    reply
        .lines()
        .next()
        .filter(|line| !line.is_empty())
        .map(str::to_string)
        .ok_or_else(|| "an empty reply".into())
}

fn requests_logged(log: &Path) -> usize {
    fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains(" stdout F request "))
        .count()
}

fn kill_cgroup(cgroup: &Path) {
    fs::write(cgroup.join("cgroup.kill"), "1").expect("cgroup.kill");
}

fn populated(cgroup: &Path) -> bool {
    fs::read_to_string(cgroup.join("cgroup.events"))
        .unwrap_or_default()
        .contains("populated 1")
}

#[tokio::test]
async fn an_instance_with_default_sigpipe_keeps_serving_when_the_agent_and_its_log_reader_die() {
    let tree = TestCgroupTree::new("logs-sigpipe");
    let temp = tempfile::Builder::new()
        .prefix("genswap-logs-sigpipe-")
        .tempdir()
        .expect("temp dir");
    // The instance runs as nobody: it must reach the store and the run dir.
    fs::set_permissions(temp.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let [manifests, staging, logs] = ["manifests", "staging", "logs"].map(|d| temp.path().join(d));
    for dir in [&manifests, &staging] {
        fs::create_dir(dir).expect("dir");
    }
    // A run dir must be short for its sockets; the temp dir's name is not.
    let run = node_agent::sandbox::short_dir("gs-").expect("run dir");
    let binary = compile_server(temp.path());
    let artifact = staging.join("sigpipe-server");
    fs::copy(&binary, &artifact).expect("stage the build");
    let sha256 = hex::encode(Sha256::digest(fs::read(&artifact).expect("read the build")));
    fs::write(
        manifests.join("server.yaml"),
        format!(
            "apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata: {{name: server, namespace: default}}
spec:
  build:
    id: c-1
    artifact: {{path: {}}}
    sha256: {sha256}
  process: {{user: 65534, group: 65534}}
  health: {{path: /, timeoutSeconds: 10}}
",
            artifact.display()
        ),
    )
    .expect("write the manifest");

    // The "pod": the agent and the reader of its output in one cgroup of
    // their own, as a DaemonSet pod's container and the runtime's log pipe.
    let pod = tree.path().join("pod");
    fs::create_dir(&pod).expect("the pod cgroup");
    let agent = format!(
        "'{AGENT}' '{}' 2>&1 | cat > /dev/null",
        agent_args(&manifests, &tree, temp.path(), run.path(), &staging, &logs).join("' '")
    );
    let mut pod_shell = cgroup_guard::start_in(&pod, &agent);
    let current = run.path().join("default.server/current.sock");
    eventually(
        DEADLINE,
        "the C server to serve through current.sock",
        || get(&current).is_ok_and(|status| status.starts_with("HTTP/1.1 200")),
    )
    .await;
    let log = current_path(&logs.join("default_server"), "1");
    let pid: u32 = fs::read_to_string(
        tree.path()
            .join("genswap/default.server/gen-1/cgroup.procs"),
    )
    .expect("the generation's processes")
    .lines()
    .next()
    .and_then(|l| l.trim().parse().ok())
    .expect("the server's pid");

    let shims_root = tree.path().join("genswap");
    eventually(
        DEADLINE,
        "generation 1's shim and one started ahead",
        || shim_pids(&shims_root).len() == 2,
    )
    .await;

    // The pod restarts: everything in its cgroup is killed at once.
    let killed_at = std::time::SystemTime::now();
    kill_cgroup(&pod);
    eventually(DEADLINE, "the pod cgroup to empty", || !populated(&pod)).await;
    let _ = pod_shell.wait().await;
    // The shim that waited for the agent's next generation saw its agent go.
    eventually(DEADLINE, "the shim started ahead to exit", || {
        shim_pids(&shims_root).len() == 1
    })
    .await;

    for round in 0..5 {
        let status =
            get(&current).unwrap_or_else(|e| panic!("request {round} after the agent died: {e}"));
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    }
    assert!(
        swap_host::alive(pid),
        "the server is alive, not killed by SIGPIPE"
    );
    // The health check's and ours: every line, also those written while
    // no agent ran, is in its log.
    eventually(
        DEADLINE,
        "the requests after the agent's death in the log",
        || requests_logged(&log) >= 6,
    )
    .await;
    assert!(
        records(std::slice::from_ref(&log))
            .iter()
            .all(|(stream, _, _)| *stream == cri::Stream::Stdout),
        "the server wrote to stdout"
    );

    // The next agent recovers the node and adopts the server; its shim is
    // left alone, and the server's lines keep reaching its log.
    // Killed by pid if the test fails before it is stopped below.
    let mut next = tokio::process::Command::new(AGENT)
        .args(agent_args(
            &manifests,
            &tree,
            temp.path(),
            run.path(),
            &staging,
            &logs,
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the next agent");
    let status = manifests.join("status/server.yaml");
    eventually(DEADLINE, "the next agent to report the server", || {
        fs::read_to_string(&status).is_ok_and(|s| s.contains("AllNodesReady"))
            && fs::metadata(&status)
                .and_then(|m| m.modified())
                .is_ok_and(|at| at > killed_at)
    })
    .await;
    let logged = requests_logged(&log);
    for round in 0..3 {
        let status =
            get(&current).unwrap_or_else(|e| panic!("request {round} after recovery: {e}"));
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    }
    eventually(DEADLINE, "the requests after recovery in the log", || {
        requests_logged(&log) >= logged + 3
    })
    .await;
    assert!(swap_host::alive(pid), "the same process serves");
    let agent_pid = next.id().expect("the next agent runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(agent_pid).expect("a pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("stop the next agent");
    let _ = next.wait().await;
    // The tree's teardown kills the instance and its shim.
}

fn agent_args(
    manifests: &Path,
    tree: &TestCgroupTree,
    temp: &Path,
    run: &Path,
    staging: &Path,
    logs: &Path,
) -> Vec<String> {
    [
        "standalone".to_string(),
        "--dir".into(),
        manifests.display().to_string(),
        "--node-name".into(),
        "node-a".into(),
        "--cgroup-root".into(),
        tree.path().join("genswap").display().to_string(),
        "--run-dir".into(),
        run.display().to_string(),
        "--state-dir".into(),
        temp.join("state").display().to_string(),
        "--staging-root".into(),
        staging.display().to_string(),
        "--log-dir".into(),
        logs.display().to_string(),
    ]
    .into()
}

#[tokio::test]
async fn logs_follow_prints_every_record_once_across_rotations() {
    let (tree, sink, dir) = sink("logs-follow", |dir| LogSettings {
        max_size: 300,
        max_files: 5,
        ..LogSettings::in_dir(dir.join("logs"), HELPER)
    });
    let output = sink.start(&key(), 1, None).expect("shim starts");
    drop(output.stderr);
    let instance_dir = dir.path().join("logs").join("default_app");
    let mut stdout = fs::File::from(output.stdout);
    let mut write = |i: usize| {
        stdout
            .write_all(format!("line {i:03}\n").as_bytes())
            .expect("the shim reads")
    };
    for i in 0..5 {
        write(i);
    }
    eventually(DEADLINE, "the first lines in the log", || {
        fs::read_to_string(current_path(&instance_dir, "1")).is_ok_and(|t| t.contains("line 004"))
    })
    .await;

    let mut follower = tokio::process::Command::new(AGENT)
        .args(["logs", "default/app", "--follow", "--log-dir"])
        .arg(dir.path().join("logs"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start node-agent logs --follow");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        follower.stdout.take().expect("its stdout"),
    ));
    let mut next_line = async || {
        tokio::time::timeout(DEADLINE, lines.next_line())
            .await
            .expect("the follower printed a line in time")
            .expect("read the follower")
            .expect("the follower is still running")
    };
    // What was there before it started, in order.
    for i in 0..5 {
        assert_eq!(next_line().await, format!("line {i:03}"));
    }
    // Then each record as it is written; a record is about 45 bytes, so the
    // file is rotated every few lines while it is followed.
    for i in 5..60 {
        write(i);
        assert_eq!(
            next_line().await,
            format!("line {i:03}"),
            "after a rotation too"
        );
    }
    assert!(
        files_of(&instance_dir, "1").len() > 2,
        "the writes rotated the file while it was followed"
    );
    follower.start_kill().expect("stop the follower");
    let _ = follower.wait().await;
    drop(stdout);
    let root = tree.path().join("genswap");
    eventually(DEADLINE, "the shim to exit", || shim_pids(&root).is_empty()).await;
}

#[tokio::test]
async fn a_shim_that_cannot_open_its_file_still_reads_so_the_writer_never_breaks() {
    let (tree, sink, dir) = sink("logs-nofile", |dir| {
        LogSettings::in_dir(dir.join("logs"), HELPER)
    });
    // Where the log file would be, a directory: the shim cannot open it.
    let instance_dir = dir.path().join("logs").join("default_app");
    fs::create_dir_all(current_path(&instance_dir, "1")).expect("a directory in the way");
    let output = sink
        .start(&key(), 1, None)
        .expect("the shim starts all the same");
    drop(output.stderr);
    let writer = write_lines(output.stdout, (0..10_000).map(|i| format!("line {i}\n")));
    writes_return(writer, "no log file").await;
    let root = tree.path().join("genswap");
    eventually(DEADLINE, "the shim to exit", || shim_pids(&root).is_empty()).await;
}

/// The shim started ahead is the one that writes the next generation's
/// output; one that died while it waited is replaced without a word to the
/// generation; the one left waiting goes with its sink.
#[tokio::test]
async fn the_shim_started_ahead_writes_the_next_generation_and_a_dead_one_is_replaced() {
    let tree = TestCgroupTree::new("logs-spare");
    let dir = tempfile::tempdir().expect("temp dir");
    let logs = dir.path().join("logs");
    let sink = LogSink::new(LogSettings::in_dir(&logs, HELPER), &tree.manager()).expect("log sink");
    let root = tree.path().join("genswap");
    let instance_dir = logs.join("default_app");
    // A line written to a generation's stdout lands in its own log file.
    let reaches_its_log = async |stdout: std::os::fd::OwnedFd, generation: &str| {
        let line = format!("from generation {generation}");
        fs::File::from(stdout)
            .write_all(format!("{line}\n").as_bytes())
            .expect("the shim reads");
        eventually(DEADLINE, &format!("{line} in its log"), || {
            fs::read_to_string(current_path(&instance_dir, generation))
                .is_ok_and(|text| text.contains(&line))
        })
        .await;
    };

    let first = sink.start(&key(), 1, None).expect("generation 1's shim");
    let spare = async || {
        // The engine asks for one once a generation runs. Awaited, the
        // start's task has let go of its handle on the sink too.
        sink.prepare_spare()
            .expect("a spare is started")
            .await
            .expect("the start's task");
        sink.spare_pid().expect("a spare's pid")
    };
    let ahead = spare().await;
    let second = sink.start(&key(), 2, None).expect("generation 2's shim");
    assert_ne!(sink.spare_pid(), Some(ahead), "taken, not left waiting");
    reaches_its_log(second.stdout, "2").await;
    assert!(
        shim_pids(&root).contains(&ahead),
        "the shim started ahead writes generation 2"
    );
    drop(second.stderr);
    eventually(
        DEADLINE,
        "the shim taken ahead to exit with its pipes",
        || !shim_pids(&root).contains(&ahead),
    )
    .await;

    // A waiting shim killed: the next generation gets a working one.
    let doomed = spare().await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(doomed).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the waiting shim");
    let third = sink.start(&key(), 3, None).expect("generation 3's shim");
    reaches_its_log(third.stdout, "3").await;
    drop((third.stderr, first));

    let waiting = spare().await;
    drop(sink);
    assert!(
        !shim_pids(&root).contains(&waiting),
        "the waiting shim went with its sink"
    );
    eventually(DEADLINE, "every shim to exit", || {
        shim_pids(&root).is_empty()
    })
    .await;
}

/// A closed sink (the agent stopping) ends the shim waiting ahead and starts
/// no other, while a generation's own shim still starts: a cancelled hold
/// restores the old generation on the way out.
#[tokio::test]
async fn a_closed_sink_ends_its_waiting_shim_and_starts_no_other() {
    let tree = TestCgroupTree::new("logs-close");
    let dir = tempfile::tempdir().expect("temp dir");
    let sink = LogSink::new(
        LogSettings::in_dir(dir.path().join("logs"), HELPER),
        &tree.manager(),
    )
    .expect("log sink");
    let root = tree.path().join("genswap");
    sink.prepare_spare()
        .expect("a spare is started")
        .await
        .expect("the start's task");
    let waiting = sink.spare_pid().expect("a shim waits");

    sink.close();
    assert_eq!(sink.spare_pid(), None);
    assert!(
        !shim_pids(&root).contains(&waiting),
        "the waiting shim is gone when close returns"
    );
    assert!(
        sink.prepare_spare().is_none(),
        "no spare is started after close"
    );
    let output = sink.start(&key(), 1, None).expect("a generation's shim");
    drop(output);
    eventually(DEADLINE, "every shim to exit", || {
        shim_pids(&root).is_empty()
    })
    .await;
}

/// A shim is never started into an agent root that is gone (a stopping
/// agent's, or one an operator removed): the start fails naming the
/// shims' cgroup, and the root is not made again behind the agent's back,
/// where nothing would remove it.
#[tokio::test]
async fn a_shim_is_not_started_into_a_removed_agent_root() {
    let (tree, sink, _dir) = sink("logs-gone", |dir| {
        LogSettings::in_dir(dir.join("logs"), HELPER)
    });
    let root = tree.path().join("genswap");
    teardown(&root).expect("remove the agent's root");

    let error = sink.start(&key(), 1, None).expect_err("no root, no shim");
    let shims = root.join(SHIM_CGROUP);
    assert!(
        matches!(&error, LogError::Cgroup { path, .. } if *path == shims),
        "{error}"
    );
    assert!(!root.exists(), "the agent's root is not made again");
}

/// Either program serves as the shim: `genswap-helper`, and the agent's own
/// binary (what an agent without the helper beside it runs); `ps` shows
/// each by its name, with the shim's arguments.
#[tokio::test]
async fn the_helper_and_the_agents_own_binary_each_write_a_generations_log() {
    for (program, name) in [(HELPER, "genswap-helper"), (AGENT, "node-agent")] {
        let (tree, sink, dir) = sink("logs-program", |dir| {
            LogSettings::in_dir(dir.join("logs"), program)
        });
        let root = tree.path().join("genswap");
        let output = sink.start(&key(), 1, None).expect("a shim");
        let pids = shim_pids(&root);
        assert_eq!(pids.len(), 1, "{name}: one shim");
        let cmdline = fs::read(format!("/proc/{}/cmdline", pids[0])).expect("its cmdline");
        let words: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|w| !w.is_empty())
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        assert_eq!(
            words[..2],
            [name.to_owned(), "log-shim".to_owned()],
            "{name}"
        );
        let writer = write_lines(output.stdout, ["to stdout\n".to_owned()].into_iter());
        fs::File::from(output.stderr)
            .write_all(b"to stderr\n")
            .expect("the shim reads stderr");
        writes_return(writer, name).await;
        eventually(DEADLINE, "the shim to exit with its pipes", || {
            shim_pids(&root).is_empty()
        })
        .await;
        let log = current_path(&dir.path().join("logs").join("default_app"), "1");
        let mut lines: Vec<(cri::Stream, String)> = records(&[log])
            .into_iter()
            .map(|(stream, _, text)| (stream, text))
            .collect();
        lines.sort_by_key(|(stream, _)| *stream == cri::Stream::Stderr);
        assert_eq!(
            lines,
            [
                (cri::Stream::Stdout, "to stdout".to_owned()),
                (cri::Stream::Stderr, "to stderr".to_owned())
            ],
            "{name}"
        );
    }
}
