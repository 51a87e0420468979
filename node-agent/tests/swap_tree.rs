//! Tree builds through the whole engine (SPEC 5.14): a Python application
//! that imports its own module, shipped as archives made by the real GNU
//! tar, gzip and zstd, overlapped onto a serving test app and then onto
//! another tree, run as nobody from the read-only store; an archive that
//! cannot run, or that attacks the node, fails the build with nothing run
//! and the incumbent serving.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use genswap_crds::{Outcome, Unpack};
use node_agent::classify::StepOutcome;
use node_agent::engine::{Attempt, Step};
use sha2::{Digest, Sha256};
use swap_host::SwapHost;

/// The application's entry script: it serves `GET /` on `GENSWAP_SOCKET`
/// with the test app's identity line and the greeting of its own module.
const MAIN: &str = r#"#!/usr/bin/env python3
import os, socketserver, http.server
from greeting import text

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = "build={} generation={} pid={} greeting={}\n".format(
            os.environ["GENSWAP_BUILD"], os.environ["GENSWAP_GENERATION"], os.getpid(), text()
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

Server(os.environ["GENSWAP_SOCKET"], Handler).serve_forever()
"#;

/// Makes the app's tree with `greeting`, archives it in `format` with the
/// real tools into the staging root, and returns the archive and digest.
fn python_archive(
    host: &SwapHost,
    name: &str,
    greeting: &str,
    format: Unpack,
) -> (PathBuf, String) {
    let src = host
        .staging
        .parent()
        .expect("temp dir")
        .join(format!("src-{name}"));
    fs::create_dir_all(src.join("app")).expect("app dir");
    fs::write(src.join("app/main.py"), MAIN).expect("main");
    fs::set_permissions(src.join("app/main.py"), fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::write(
        src.join("app/greeting.py"),
        format!("def text():\n    return {greeting:?}\n"),
    )
    .expect("module");
    fs::create_dir_all(src.join("bin")).expect("bin");
    std::os::unix::fs::symlink("../app/main.py", src.join("bin/serve")).expect("symlink");
    let archive = host.staging.join(name);
    let digest = swap_host::tar_tree(&src, &archive, format);
    (archive, digest)
}

/// An overlap attempt of the archive at `archive`, running `bin/serve`.
fn tree_attempt(
    host: &SwapHost,
    rev: i64,
    id: &str,
    archive: &Path,
    sha256: &str,
    format: Unpack,
) -> Attempt {
    host.attempt_of(
        rev,
        swap_host::archive_build(id, archive, sha256, format, "bin/serve"),
    )
}

async fn greeting(host: &SwapHost) -> String {
    let (_, body) = node_agent::health::get_within(
        &host.current_sock(),
        "/",
        std::time::Duration::from_secs(10),
    )
    .await
    .expect("an answer through current.sock");
    let body = String::from_utf8_lossy(&body).into_owned();
    body.split_whitespace()
        .find_map(|f| f.strip_prefix("greeting="))
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn a_python_tree_overlaps_a_file_build_and_then_another_tree() {
    let host = SwapHost::new("tree-overlap");
    host.install(1, "b1").await;

    let (archive, digest) = python_archive(&host, "app-2.tar.gz", "hello", Unpack::TarGzip);
    let result = host
        .swap(&tree_attempt(
            &host,
            2,
            "tree-2",
            &archive,
            &digest,
            Unpack::TarGzip,
        ))
        .await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let serving = host.who_serves().await.expect("the tree serves");
    assert_eq!((serving.build.as_str(), serving.generation), ("tree-2", 2));
    assert_eq!(
        greeting(&host).await,
        "hello",
        "its own module was imported"
    );

    // What runs is the script inside the stored, read-only tree, as nobody.
    let cmdline = fs::read(format!("/proc/{}/cmdline", serving.pid)).expect("cmdline");
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    let tree = fs::canonicalize(host.staging.parent().expect("temp dir").join("store"))
        .expect("store")
        .join(format!("tree-sha256-{digest}/rootfs"));
    assert!(
        cmdline.contains(&tree.join("app/main.py").display().to_string()),
        "{cmdline}"
    );
    let status = fs::read_to_string(format!("/proc/{}/status", serving.pid)).expect("status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Uid:") && l.contains("65534")),
        "{status}"
    );
    // Python could not write its bytecode cache into the tree.
    assert!(!tree.join("app/__pycache__").exists());

    let (archive, digest3) = python_archive(&host, "app-3.tar.zst", "bonjour", Unpack::TarZstd);
    let result = host
        .swap(&tree_attempt(
            &host,
            3,
            "tree-3",
            &archive,
            &digest3,
            Unpack::TarZstd,
        ))
        .await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(greeting(&host).await, "bonjour");
    host.assert_only(Some(3));
    host.tear_down().await;
}

#[tokio::test]
async fn a_tree_that_cannot_run_or_attacks_the_node_fails_with_nothing_run() {
    let host = SwapHost::new("tree-refused");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    // A missing entrypoint.
    let (archive, digest) = python_archive(&host, "app.tar", "hello", Unpack::Tar);
    let mut attempt = tree_attempt(&host, 2, "tree-2", &archive, &digest, Unpack::Tar);
    attempt.spec.build.entrypoint = Some("bin/missing".into());
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(!result.executed, "{result:?}");
    let last = result.steps.last().expect("a step");
    assert_eq!((last.step, last.result), (Step::Stage, StepOutcome::Failed));
    swap_host::assert_says(&result.reason, &["bin/missing", "nothing is at that path"]);
    host.assert_still_serves(&before).await;

    // An archive that writes through a symlink out of the tree.
    let outside = host.staging.parent().expect("temp dir").join("outside");
    fs::create_dir_all(&outside).expect("outside");
    let src = host.staging.parent().expect("temp dir").join("src-evil");
    fs::create_dir_all(src.join("b")).expect("src");
    std::os::unix::fs::symlink(&outside, src.join("a")).expect("a -> outside");
    fs::write(src.join("b/payload"), "x").expect("payload");
    let evil = host.staging.join("evil.tar");
    let name = evil.to_str().expect("utf-8");
    for args in [
        vec!["-cf", name, "a"],
        vec!["-rf", name, "--transform", "s|^b/|a/|", "b/payload"],
    ] {
        assert!(
            Command::new("tar")
                .current_dir(&src)
                .args(&args)
                .status()
                .expect("tar")
                .success()
        );
    }
    let digest = hex::encode(Sha256::digest(fs::read(&evil).expect("archive")));
    let result = host
        .swap(&tree_attempt(
            &host,
            3,
            "evil-3",
            &evil,
            &digest,
            Unpack::Tar,
        ))
        .await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(!result.executed);
    swap_host::assert_says(&result.reason, &["a/payload", "symlink"]);
    assert!(fs::read_dir(&outside).expect("outside").next().is_none());
    host.assert_still_serves(&before).await;
    host.assert_only(Some(1));
    host.tear_down().await;
}

/// An entrypoint that is a link to a multi-call program (busybox's
/// `/bin/sh`, as in Alpine's images) runs as the name the build gives it:
/// `argv[0]` is the entrypoint as named, not the link's target, or busybox
/// would take `-c` for the applet to run.
#[tokio::test]
async fn an_entrypoint_linked_to_a_multi_call_program_runs_as_named() {
    let busybox = Path::new("/bin/busybox");
    if !busybox.exists() {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI installs busybox-static"
        );
        eprintln!("SKIP: no /bin/busybox (apt-get install busybox-static)");
        return;
    }
    let host = SwapHost::new("tree-multi-call");
    let src = host.staging.parent().expect("temp dir").join("src-busybox");
    fs::create_dir_all(src.join("bin")).expect("bin");
    fs::copy(busybox, src.join("bin/busybox")).expect("busybox");
    std::os::unix::fs::symlink("busybox", src.join("bin/sh")).expect("sh");
    let archive = host.staging.join("busybox.tar");
    let digest = swap_host::tar_tree(&src, &archive, Unpack::Tar);
    let mut attempt = host.attempt_of(
        1,
        swap_host::archive_build("bb-1", &archive, &digest, Unpack::Tar, "/bin/sh"),
    );
    // A one-shot: it exits 0 only when it was called /bin/sh.
    attempt.spec.kind = genswap_crds::InstanceKind::Worker;
    attempt.spec.process.args = vec!["-c".into(), r#"test "$0" = /bin/sh"#.into()];
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(result.clean_exit, "it ran and exited 0: {result:?}");
    host.assert_only(None);
}
