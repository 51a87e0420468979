//! The node lock (SPEC §5.1): one holder at a time, a waiter gets it only
//! once the holder lets go, and a holder's death frees it. Checked with two
//! open file descriptions in one process (flock is per open file
//! description) and with a second real process.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use node_agent::ownership::{NODE_LOCK_FILE, NodeLock, default_lock_path};

const DEADLINE: Duration = Duration::from_secs(30);
const CHILD_ENV: &str = "GENSWAP_TEST_LOCK_CHILD";
const CHILD_PREFIX: &str = "LOCK-CHILD ";

fn lock_path(dir: &tempfile::TempDir) -> PathBuf {
    default_lock_path(&dir.path().join("state"))
}

#[tokio::test]
async fn a_second_open_file_description_waits_until_the_first_lets_go() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = lock_path(&dir);
    assert!(path.ends_with(NODE_LOCK_FILE));
    let first = NodeLock::try_acquire(&path)
        .expect("lock file")
        .expect("a free lock is taken");
    assert_eq!(
        std::fs::read_to_string(&path).expect("lock file").trim(),
        std::process::id().to_string(),
        "the holder's pid is in the file"
    );
    assert!(
        NodeLock::try_acquire(&path).expect("lock file").is_none(),
        "held"
    );

    let waiter = tokio::spawn({
        let path = path.clone();
        async move { NodeLock::acquire(&path).await }
    });
    // Not a timing assertion: whatever the scheduling, the waiter cannot
    // have the lock while `first` holds it.
    tokio::task::yield_now().await;
    assert!(NodeLock::try_acquire(&path).expect("lock file").is_none());
    assert!(
        !waiter.is_finished(),
        "the waiter has nothing while the first holds it"
    );

    drop(first);
    let second = tokio::time::timeout(DEADLINE, waiter)
        .await
        .expect("the waiter gets the lock once it is free")
        .expect("waiter task")
        .expect("lock taken");
    assert!(
        NodeLock::try_acquire(&path).expect("lock file").is_none(),
        "now the second holds it"
    );
    drop(second);
    assert!(NodeLock::try_acquire(&path).expect("lock file").is_some());
}

#[tokio::test]
async fn giving_up_the_wait_leaves_the_lock_free() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = lock_path(&dir);
    let first = NodeLock::try_acquire(&path)
        .expect("lock file")
        .expect("free");
    let waiter = tokio::spawn({
        let path = path.clone();
        async move { NodeLock::acquire(&path).await }
    });
    tokio::task::yield_now().await;
    waiter.abort();
    let _ = waiter.await;
    drop(first);
    // The abandoned waiter thread may take the lock for an instant and must
    // let it go at once: the lock is free again within the deadline.
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        if let Some(_lock) = NodeLock::try_acquire(&path).expect("lock file") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the lock stayed held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A second agent process, killed by its pid on drop.
struct LockChild {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl LockChild {
    fn spawn(path: &Path) -> LockChild {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "lock_holder_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the second process");
        let stdout = child.stdout.take().expect("child stdout");
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may have begun the line with the test's name.
                if let Some((_, said)) = line.split_once(CHILD_PREFIX)
                    && sender.send(said.to_string()).is_err()
                {
                    break;
                }
            }
        });
        LockChild { child, lines }
    }

    fn expect(&self, what: &str) {
        match self.lines.recv_timeout(DEADLINE) {
            Ok(said) => assert_eq!(said, what),
            Err(error) => panic!("the second process did not say {what:?}: {error}"),
        }
    }

    fn said_nothing_yet(&self) -> bool {
        matches!(self.lines.try_recv(), Err(mpsc::TryRecvError::Empty))
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LockChild {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test]
async fn a_second_process_owns_the_node_only_after_the_first_releases_and_a_dead_holder_frees_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = lock_path(&dir);
    let mine = NodeLock::try_acquire(&path)
        .expect("lock file")
        .expect("free");

    let mut other = LockChild::spawn(&path);
    other.expect("waiting");
    assert!(
        other.said_nothing_yet(),
        "the second process holds nothing while this one does"
    );
    drop(mine);
    other.expect("acquired");
    assert!(
        NodeLock::try_acquire(&path).expect("lock file").is_none(),
        "the other process holds it"
    );

    // SIGKILL: no chance to unlock; the kernel frees the lock with the process.
    other.kill();
    let again = tokio::time::timeout(DEADLINE, NodeLock::acquire(&path))
        .await
        .expect("the dead holder's lock is free")
        .expect("lock taken");
    drop(again);
}

/// The second process of the test above; does nothing in a normal run.
#[tokio::test]
async fn lock_holder_child() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let path = PathBuf::from(path);
    let say = |what: &str| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{CHILD_PREFIX}{what}").expect("stdout");
        out.flush().expect("stdout");
    };
    if let Some(_lock) = NodeLock::try_acquire(&path).expect("lock file") {
        say("acquired-at-once");
        return;
    }
    say("waiting");
    let _lock = NodeLock::acquire(&path).await.expect("lock taken");
    say("acquired");
    // Hold it until the parent kills this process or closes stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}
