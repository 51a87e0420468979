//! `current.sock`: the atomic switch between real unix listeners.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use node_agent::gate::InstanceKey;
use node_agent::switch::{
    CURRENT_SOCKET, RunLayout, SwitchError, current_generation, current_target, point_current,
    remove_temp_links,
};

/// A real listener on `path` that answers every connection with one byte,
/// `tag`, then closes it. Stopped (and joined) on drop.
struct TaggedServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

impl TaggedServer {
    fn start(path: &Path, tag: u8) -> Self {
        let listener = UnixListener::bind(path).expect("bind the generation socket");
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            let accepted = accepted.clone();
            move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(mut stream) = stream {
                        accepted.fetch_add(1, Ordering::SeqCst);
                        let _ = stream.write_all(&[tag]);
                    }
                }
            }
        });
        Self {
            path: path.to_path_buf(),
            stop,
            accepted,
            thread: Some(thread),
        }
    }
}

impl Drop for TaggedServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = UnixStream::connect(&self.path);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn instance_dir(root: &Path) -> (RunLayout, InstanceKey, PathBuf) {
    let layout = RunLayout::new(root.join("run"));
    let key = InstanceKey::new("default", "web").expect("valid key");
    let dir = layout
        .create_instance_dir(&key)
        .expect("create the instance run dir");
    (layout, key, dir)
}

#[test]
fn the_first_switch_creates_a_relative_link() {
    let temp = tempfile::tempdir().expect("temp dir");
    let (layout, key, dir) = instance_dir(temp.path());
    assert_eq!(
        fs::metadata(&dir).expect("dir").permissions().mode() & 0o777,
        0o755
    );
    let socket = layout.generation_socket(&key, 1);
    let _server = TaggedServer::start(&socket, b'1');
    assert_eq!(current_target(&dir), None);

    point_current(&dir, &socket).expect("switch");

    let link = fs::read_link(layout.current_socket(&key)).expect("current.sock is a symlink");
    assert_eq!(link, Path::new("gen-1.sock"), "the link target is relative");
    assert_eq!(current_target(&dir), Some(socket.clone()));
    assert_eq!(current_generation(&dir), Some(1));
    let mut answer = [0u8; 1];
    UnixStream::connect(layout.current_socket(&key))
        .expect("connect through current.sock")
        .read_exact(&mut answer)
        .expect("read the tag");
    assert_eq!(&answer, b"1");
    assert_eq!(layout.instances().expect("list"), vec![key.clone()]);
    assert_eq!(layout.generation_sockets(&key).expect("list"), vec![1]);
}

#[test]
fn clients_connecting_during_200_switches_never_miss() {
    let temp = tempfile::tempdir().expect("temp dir");
    let (layout, key, dir) = instance_dir(temp.path());
    let first = layout.generation_socket(&key, 1);
    let second = layout.generation_socket(&key, 2);
    let server_one = TaggedServer::start(&first, b'1');
    let server_two = TaggedServer::start(&second, b'2');
    point_current(&dir, &first).expect("first switch");

    let done = Arc::new(AtomicBool::new(false));
    let current = layout.current_socket(&key);
    let client = std::thread::spawn({
        let done = done.clone();
        move || {
            let (mut ok, mut failures, mut seen) = (0usize, Vec::new(), [false; 2]);
            // Keeps going until the switching is over, and at least 2000 times.
            while !done.load(Ordering::SeqCst) || ok + failures.len() < 2000 {
                let attempt = UnixStream::connect(&current).and_then(|mut stream| {
                    let mut tag = [0u8; 1];
                    stream.read_exact(&mut tag).map(|()| tag[0])
                });
                match attempt {
                    Ok(tag @ (b'1' | b'2')) => {
                        ok += 1;
                        seen[usize::from(tag - b'1')] = true;
                    }
                    Ok(other) => failures.push(format!("unexpected tag {other}")),
                    Err(e) => failures.push(e.to_string()),
                }
            }
            (ok, failures, seen)
        }
    });

    for flip in 0..200u32 {
        let target = if flip.is_multiple_of(2) {
            &second
        } else {
            &first
        };
        point_current(&dir, target).expect("switch");
        std::thread::yield_now();
    }
    done.store(true, Ordering::SeqCst);
    let (ok, failures, seen) = client.join().expect("client thread");

    assert!(
        failures.is_empty(),
        "{} failed connects, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(ok >= 2000, "only {ok} connects");
    assert!(
        seen[0] && seen[1],
        "the client reached both generations: {seen:?}"
    );
    assert!(server_one.accepted.load(Ordering::SeqCst) > 0);
    assert!(server_two.accepted.load(Ordering::SeqCst) > 0);
    // 200 flips from gen-1 end on gen-1.
    assert_eq!(current_generation(&dir), Some(1));
    let leftovers: Vec<_> = fs::read_dir(&dir)
        .expect("read dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .filter(|name| name.to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "temporary links left: {leftovers:?}");
}

#[test]
fn a_switch_to_a_missing_socket_leaves_the_old_link() {
    let temp = tempfile::tempdir().expect("temp dir");
    let (layout, key, dir) = instance_dir(temp.path());
    let first = layout.generation_socket(&key, 1);
    let _server = TaggedServer::start(&first, b'1');
    point_current(&dir, &first).expect("first switch");

    let missing = layout.generation_socket(&key, 2);
    let err = point_current(&dir, &missing).expect_err("no socket there");
    assert!(matches!(err, SwitchError::TargetMissing { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("nothing switched") && message.contains("gen-2.sock"),
        "{message}"
    );
    assert_eq!(current_generation(&dir), Some(1));

    let plain_file = dir.join("gen-3.sock");
    fs::write(&plain_file, b"not a socket").expect("write");
    let err = point_current(&dir, &plain_file).expect_err("not a socket");
    assert!(
        matches!(err, SwitchError::TargetNotSocket { .. }),
        "{err:?}"
    );
    assert_eq!(current_generation(&dir), Some(1));
}

#[test]
fn a_target_outside_the_run_dir_is_refused() {
    let temp = tempfile::tempdir().expect("temp dir");
    let (layout, key, dir) = instance_dir(temp.path());
    let elsewhere = temp.path().join("gen-1.sock");
    let _server = TaggedServer::start(&elsewhere, b'x');
    let err = point_current(&dir, &elsewhere).expect_err("outside");
    assert!(
        matches!(err, SwitchError::TargetOutsideRunDir { .. }),
        "{err:?}"
    );
    let err = point_current(&dir, &layout.current_socket(&key)).expect_err("itself");
    assert!(
        matches!(err, SwitchError::TargetOutsideRunDir { .. }),
        "{err:?}"
    );
    assert!(
        fs::symlink_metadata(layout.current_socket(&key)).is_err(),
        "no link was made"
    );
}

#[test]
fn a_failed_rename_reports_nothing_switched_and_leaves_no_temp_link() {
    let temp = tempfile::tempdir().expect("temp dir");
    let (layout, key, dir) = instance_dir(temp.path());
    let first = layout.generation_socket(&key, 1);
    let _server = TaggedServer::start(&first, b'1');
    // A non-empty directory where current.sock belongs: rename(2) cannot
    // replace it with a symlink.
    let current = dir.join(CURRENT_SOCKET);
    fs::create_dir(&current).expect("mkdir");
    fs::write(current.join("keep"), b"x").expect("write");

    let err = point_current(&dir, &first).expect_err("rename fails");
    assert!(matches!(err, SwitchError::Rename { .. }), "{err:?}");
    assert!(err.to_string().starts_with("nothing switched"), "{err}");
    assert!(current.join("keep").is_file(), "the directory is untouched");
    assert_eq!(
        remove_temp_links(&dir).expect("scan"),
        0,
        "no temp link left"
    );
}

#[test]
fn leftover_temp_links_from_a_crash_are_removed() {
    let temp = tempfile::tempdir().expect("temp dir");
    let (layout, key, dir) = instance_dir(temp.path());
    let first = layout.generation_socket(&key, 1);
    let _server = TaggedServer::start(&first, b'1');
    point_current(&dir, &first).expect("switch");
    std::os::unix::fs::symlink("gen-1.sock", dir.join("current.sock.tmp-1-2-3")).expect("leftover");
    assert_eq!(remove_temp_links(&dir).expect("clean"), 1);
    assert_eq!(
        current_generation(&dir),
        Some(1),
        "current.sock itself stays"
    );
}
