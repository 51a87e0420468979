//! Staging path artifacts into the store, and every refusal of SPEC §7.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use genswap_crds::Artifact;
use genswap_store::{ENTRY_MODE, StageError, Staged, Stager, StagerConfig, Store};
use sha2::{Digest, Sha256};

struct Fixture {
    temp: tempfile::TempDir,
    root: PathBuf,
    stager: Stager,
}

impl Fixture {
    fn new() -> Self {
        Self::with_cap(genswap_store::DEFAULT_MAX_ARTIFACT_BYTES)
    }

    fn with_cap(max_bytes: u64) -> Self {
        let temp = tempfile::tempdir().expect("temp dir");
        let root = temp.path().join("staging");
        fs::create_dir(&root).expect("staging root");
        let store = Store::open(temp.path().join("agent/store")).expect("open the store");
        let mut config = StagerConfig::new(&root);
        config.max_bytes = max_bytes;
        let stager = Stager::new(store, config).expect("stager");
        Self { temp, root, stager }
    }

    /// A file with `bytes` and `mode` at `path`.
    fn put(&self, path: &Path, bytes: &[u8], mode: u32) -> PathBuf {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("parent dirs");
        }
        fs::write(path, bytes).expect("write the artifact");
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
        path.to_path_buf()
    }

    fn stage(&self, path: &Path, sha256: &str) -> Result<Staged, StageError> {
        self.stager
            .stage_path_blocking(path.to_str().expect("utf-8 path"), sha256)
    }

    fn store_files(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.stager.store().dir())
            .expect("read the store")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

/// Runs `path`, retrying while another thread's fork still holds a write
/// descriptor of the freshly written file (ETXTBSY), as any spawner must.
fn run(path: &Path) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match Command::new(path).status() {
            Err(e)
                if e.raw_os_error() == Some(nix::libc::ETXTBSY)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            other => return other.expect("exec the store copy"),
        }
    }
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn true_binary() -> Vec<u8> {
    fs::read("/bin/true").expect("/bin/true exists")
}

fn script(exit_code: u8) -> Vec<u8> {
    format!("#!/bin/sh\nexit {exit_code}\n").into_bytes()
}

#[tokio::test]
async fn a_good_artifact_lands_in_the_store_read_only_and_runs() {
    let fx = Fixture::new();
    let bytes = true_binary();
    let digest = sha256(&bytes);
    let source = fx.put(&fx.root.join("builds/true"), &bytes, 0o755);

    let artifact = Artifact {
        path: Some(source.to_string_lossy().into_owned()),
        url: None,
        image: None,
        unpack: None,
    };
    let staged = fx
        .stager
        .stage_file(&artifact, &digest)
        .await
        .expect("staged");

    assert_eq!(staged.sha256, digest);
    assert_eq!(staged.bytes, bytes.len() as u64);
    assert_eq!(
        staged.path,
        fx.stager.store().dir().join(format!("sha256-{digest}"))
    );
    let meta = fs::symlink_metadata(&staged.path).expect("store entry");
    assert!(meta.file_type().is_file());
    assert_eq!(meta.mode() & 0o7777, ENTRY_MODE);
    assert_eq!(meta.uid(), 0, "owned by the agent (root)");
    let store_dir = fs::metadata(fx.stager.store().dir()).expect("store dir");
    assert_eq!(store_dir.mode() & 0o7777, 0o711);
    assert_eq!(
        sha256(&fs::read(&staged.path).expect("read the entry")),
        digest
    );
    let status = run(&staged.path);
    assert!(status.success(), "{status}");

    // Staging the same build again keeps the same, intact file.
    let again = fx.stage(&source, &digest).expect("staged again");
    assert_eq!(again, staged);
    let meta_again = fs::metadata(&again.path).expect("entry");
    assert_eq!(meta_again.ino(), meta.ino(), "an intact entry is kept");
    assert_eq!(fx.store_files(), vec![format!("sha256-{digest}")]);
}

#[test]
fn a_digest_mismatch_names_both_digests_and_stores_nothing() {
    let fx = Fixture::new();
    let source = fx.put(&fx.root.join("app"), &script(0), 0o755);
    let expected = sha256(b"some other build");
    let actual = sha256(&script(0));

    let err = fx.stage(&source, &expected).expect_err("mismatch");
    assert!(matches!(err, StageError::DigestMismatch { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains(&expected)
            && message.contains(&actual)
            && message.contains(&source.display().to_string()),
        "{message}"
    );
    assert!(
        fx.store_files().is_empty(),
        "no entry, no temp file: {:?}",
        fx.store_files()
    );
}

#[test]
fn a_path_outside_the_staging_root_is_refused() {
    let fx = Fixture::new();
    let outside = fx.put(&fx.temp.path().join("elsewhere/app"), &script(0), 0o755);
    let err = fx
        .stage(&outside, &sha256(&script(0)))
        .expect_err("outside");
    assert!(matches!(err, StageError::OutsideRoot { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "artifact {} is outside the staging root {}",
            outside.display(),
            fx.root.display()
        )
    );
}

#[test]
fn any_dot_dot_component_is_refused() {
    let fx = Fixture::new();
    fx.put(&fx.temp.path().join("elsewhere/app"), &script(0), 0o755);
    fx.put(&fx.root.join("app"), &script(0), 0o755);
    fs::create_dir(fx.root.join("sub")).expect("sub");
    for path in [
        format!("{}/../elsewhere/app", fx.root.display()),
        // Even one that would land back inside the root.
        format!("{}/sub/../app", fx.root.display()),
    ] {
        let err = fx
            .stager
            .stage_path_blocking(&path, &sha256(&script(0)))
            .expect_err("dot-dot");
        assert!(matches!(err, StageError::ParentComponent { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&path) && err.to_string().contains("'..'"),
            "{err}"
        );
    }
}

#[test]
fn a_relative_path_is_refused() {
    let fx = Fixture::new();
    let err = fx
        .stager
        .stage_path_blocking("staging/app", &sha256(b"x"))
        .expect_err("relative");
    assert!(matches!(err, StageError::NotAbsolute { .. }), "{err:?}");
}

#[test]
fn a_symlink_that_leaves_the_root_is_refused() {
    let fx = Fixture::new();
    let target = fx.put(&fx.temp.path().join("elsewhere/app"), &script(0), 0o755);
    let link = fx.root.join("app");
    symlink(&target, &link).expect("symlink");
    let err = fx.stage(&link, &sha256(&script(0))).expect_err("escapes");
    assert!(matches!(err, StageError::EscapingSymlink { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains(&link.display().to_string())
            && message.contains("symlink that leaves the staging root")
            && message.contains(&target.display().to_string()),
        "{message}"
    );

    // A symlinked directory on the way escapes just the same.
    symlink(fx.temp.path().join("elsewhere"), fx.root.join("dir")).expect("dir symlink");
    let err = fx
        .stage(&fx.root.join("dir/app"), &sha256(&script(0)))
        .expect_err("escapes through a directory");
    assert!(matches!(err, StageError::EscapingSymlink { .. }), "{err:?}");
}

#[test]
fn a_symlink_that_stays_inside_the_root_is_followed() {
    let fx = Fixture::new();
    let bytes = script(0);
    fx.put(&fx.root.join("builds/v1/app"), &bytes, 0o755);
    let link = fx.root.join("current");
    symlink("builds/v1/app", &link).expect("relative symlink");
    let staged = fx.stage(&link, &sha256(&bytes)).expect("inside is fine");
    assert_eq!(staged.sha256, sha256(&bytes));
}

#[test]
fn a_missing_artifact_is_refused() {
    let fx = Fixture::new();
    let missing = fx.root.join("nope");
    let err = fx.stage(&missing, &sha256(b"x")).expect_err("missing");
    assert!(matches!(err, StageError::Missing { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains(&format!("artifact {} does not exist", missing.display())),
        "{err}"
    );
    let dangling = fx.root.join("dangling");
    symlink(fx.root.join("gone"), &dangling).expect("symlink");
    let err = fx.stage(&dangling, &sha256(b"x")).expect_err("dangling");
    assert!(matches!(err, StageError::Missing { .. }), "{err:?}");
}

#[test]
fn an_empty_artifact_is_refused() {
    let fx = Fixture::new();
    let empty = fx.put(&fx.root.join("empty"), b"", 0o755);
    let err = fx.stage(&empty, &sha256(b"")).expect_err("empty");
    assert!(matches!(err, StageError::Empty { .. }), "{err:?}");
    assert!(err.to_string().ends_with("is empty"), "{err}");
}

#[test]
fn a_directory_is_refused() {
    let fx = Fixture::new();
    let dir = fx.root.join("dir");
    fs::create_dir(&dir).expect("mkdir");
    let err = fx.stage(&dir, &sha256(b"x")).expect_err("directory");
    assert!(matches!(err, StageError::IsDirectory { .. }), "{err:?}");
    assert!(err.to_string().contains("is a directory"), "{err}");
}

#[test]
fn a_fifo_is_refused_without_waiting_for_a_writer() {
    let fx = Fixture::new();
    let fifo = fx.root.join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o755)).expect("mkfifo");
    let err = fx.stage(&fifo, &sha256(b"x")).expect_err("fifo");
    assert!(
        matches!(err, StageError::NotRegularFile { kind: "FIFO", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("is a FIFO, not a regular file"),
        "{err}"
    );
}

#[test]
fn a_file_without_an_exec_bit_is_refused() {
    let fx = Fixture::new();
    let plain = fx.put(&fx.root.join("app"), &script(0), 0o644);
    let err = fx
        .stage(&plain, &sha256(&script(0)))
        .expect_err("not executable");
    assert!(matches!(err, StageError::NotExecutable { .. }), "{err:?}");
    assert!(err.to_string().contains("mode 0644"), "{err}");
}

/// Tests run as root, which reads any file. The agent's own credentials are
/// what staging uses, so this test stages from a thread whose filesystem uid
/// is `nobody`: setfsuid(2) is per thread, and moving the fsuid off 0 drops
/// CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from that thread. The open(2)
/// of a mode 0111 file then really fails with EACCES, as it would for an
/// agent an LSM or a permission denies.
#[test]
fn an_unreadable_artifact_is_refused() {
    let fx = Fixture::new();
    // Let `nobody` walk to the file; only the file itself is unreadable.
    for dir in [fx.temp.path(), fx.root.as_path()] {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).expect("chmod dir");
    }
    let secret = fx.put(&fx.root.join("secret"), &script(0), 0o111);
    let stager = fx.stager.clone();
    let path = secret.to_string_lossy().into_owned();
    let expected = sha256(&script(0));
    let result = std::thread::spawn(move || {
        nix::unistd::setfsuid(nix::unistd::Uid::from_raw(65534));
        stager.stage_path_blocking(&path, &expected)
    })
    .join()
    .expect("staging thread");
    let err = result.expect_err("unreadable");
    assert!(matches!(err, StageError::Unreadable { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains(&format!("artifact {} is not readable", secret.display())),
        "{err}"
    );
}

#[test]
fn an_artifact_above_the_cap_is_refused() {
    let fx = Fixture::with_cap(16);
    let big = fx.put(&fx.root.join("big"), &[b'x'; 17], 0o755);
    let err = fx.stage(&big, &sha256(&[b'x'; 17])).expect_err("too large");
    assert!(
        matches!(
            err,
            StageError::TooLarge {
                limit: 16,
                size: Some(17),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(fx.store_files().is_empty());
}

#[test]
fn replacing_the_source_after_staging_changes_nothing_that_runs() {
    let fx = Fixture::new();
    let good = script(0);
    let source = fx.put(&fx.root.join("app"), &good, 0o755);
    let staged = fx.stage(&source, &sha256(&good)).expect("staged");

    // Rewritten in place, then replaced by another file.
    fs::write(&source, script(3)).expect("rewrite");
    let replacement = fx.put(&fx.root.join("app.new"), &script(4), 0o755);
    fs::rename(&replacement, &source).expect("replace");

    assert_eq!(
        sha256(&fs::read(&staged.path).expect("read")),
        sha256(&good)
    );
    let status = run(&staged.path);
    assert_eq!(status.code(), Some(0), "the verified bytes run");
}

#[test]
fn a_source_swapped_while_staging_never_yields_a_wrong_entry() {
    let fx = Fixture::new();
    let good = script(0);
    let bad = script(7);
    let good_digest = sha256(&good);
    let source = fx.put(&fx.root.join("app"), &good, 0o755);
    let good_copy = fx.put(&fx.root.join("good"), &good, 0o755);
    let bad_copy = fx.put(&fx.root.join("bad"), &bad, 0o755);

    // Another writer flips the source between the two builds by rename.
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = std::thread::spawn({
        let stop = stop.clone();
        let source = source.clone();
        move || {
            let mut flips = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let from = if flips.is_multiple_of(2) {
                    &bad_copy
                } else {
                    &good_copy
                };
                let temp = source.with_extension(format!("tmp{flips}"));
                fs::copy(from, &temp).expect("copy");
                fs::rename(&temp, &source).expect("flip");
                flips += 1;
            }
            flips
        }
    });
    let (mut staged, mut refused) = (0, 0);
    for _ in 0..300 {
        match fx.stage(&source, &good_digest) {
            Ok(entry) => {
                staged += 1;
                assert_eq!(
                    sha256(&fs::read(&entry.path).expect("read")),
                    good_digest,
                    "an entry always holds the bytes that were verified"
                );
            }
            Err(StageError::DigestMismatch { .. }) => refused += 1,
            Err(other) => panic!("unexpected refusal: {other}"),
        }
    }
    stop.store(true, Ordering::SeqCst);
    let flips = flipper.join().expect("flipper");
    assert!(flips > 0);
    assert_eq!(staged + refused, 300);
    let leftovers: Vec<_> = fx
        .store_files()
        .into_iter()
        .filter(|name| name.contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_tampered_store_entry_is_replaced_by_a_verified_copy() {
    let fx = Fixture::new();
    let good = script(0);
    let source = fx.put(&fx.root.join("app"), &good, 0o755);
    let staged = fx.stage(&source, &sha256(&good)).expect("staged");
    fs::set_permissions(&staged.path, fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::write(&staged.path, script(9)).expect("tamper");

    let again = fx.stage(&source, &sha256(&good)).expect("staged again");
    assert_eq!(again.path, staged.path);
    assert_eq!(sha256(&fs::read(&again.path).expect("read")), sha256(&good));
    let meta = fs::metadata(&again.path).expect("entry");
    assert_eq!(meta.mode() & 0o7777, ENTRY_MODE);
    assert_eq!(run(&again.path).code(), Some(0));
}

#[test]
fn the_store_refuses_a_directory_it_does_not_own_or_that_is_not_one() {
    let temp = tempfile::tempdir().expect("temp dir");
    let foreign = temp.path().join("foreign");
    fs::create_dir(&foreign).expect("mkdir");
    nix::unistd::chown(&foreign, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
    let err = Store::open(&foreign).expect_err("foreign owner");
    assert!(err.to_string().contains("owned by uid 65534"), "{err}");

    let real = temp.path().join("real");
    fs::create_dir(&real).expect("mkdir");
    let link = temp.path().join("link");
    symlink(&real, &link).expect("symlink");
    let err = Store::open(&link).expect_err("a symlink");
    assert!(err.to_string().contains("is not a directory"), "{err}");

    // An existing directory of ours gets the store's mode.
    fs::set_permissions(&real, fs::Permissions::from_mode(0o777)).expect("chmod");
    let store = Store::open(&real).expect("open");
    assert_eq!(
        fs::metadata(store.dir()).expect("dir").mode() & 0o7777,
        0o711
    );
    fs::write(real.join(".incoming.tmp-1-2-3"), b"partial").expect("leftover");
    assert_eq!(store.remove_temp_files().expect("clean"), 1);
}

/// A store hit (issue 17): once this process has hashed an entry that has
/// not changed since, staging the same digest again checks the source but
/// does not read it: a source rewritten to other bytes of the same size is
/// staged as the entry's verified bytes, which is what runs. Any change to
/// the entry (here chmod and a write) sends staging down the copying path
/// again, which hashes the source and refuses it.
#[test]
fn a_store_hit_runs_the_verified_entry_and_a_changed_entry_is_hashed_again() {
    let fx = Fixture::new();
    let good = script(0);
    let other = script(5);
    assert_eq!(good.len(), other.len(), "same size, other bytes");
    let digest = sha256(&good);
    let source = fx.put(&fx.root.join("app"), &good, 0o755);
    let staged = fx.stage(&source, &digest).expect("staged");

    // The stamp is remembered once the entry is older than its margin:
    // poll until a stage of the other bytes is taken from the store.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        fx.put(&source, &good, 0o755);
        fx.stage(&source, &digest).expect("staged again");
        fx.put(&source, &other, 0o755);
        match fx.stage(&source, &digest) {
            Ok(hit) => {
                assert_eq!(hit.path, staged.path);
                break;
            }
            Err(StageError::DigestMismatch { .. }) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no store hit within 10 s"
                );
            }
            Err(other) => panic!("unexpected refusal: {other}"),
        }
    }
    assert_eq!(run(&staged.path).code(), Some(0), "the verified bytes run");

    fs::set_permissions(&staged.path, fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::write(&staged.path, &other).expect("tamper");
    match fx.stage(&source, &digest) {
        Err(StageError::DigestMismatch { .. }) => {}
        other => panic!("a changed entry is no hit: {other:?}"),
    }
    fx.put(&source, &good, 0o755);
    let again = fx
        .stage(&source, &digest)
        .expect("staged from the good source");
    assert_eq!(sha256(&fs::read(&again.path).expect("read")), digest);
    assert_eq!(run(&again.path).code(), Some(0));
}
