//! Archives built to hurt the node, staged through the whole stager: each
//! is refused naming the entry and the rule, is the build's fault (held
//! down, never retried on its own), writes nothing outside the tree, and
//! leaves nothing in the store. Most are made by the real GNU tar (`-P`
//! keeps `..` and absolute names, `--transform` writes through a symlink);
//! the hard links that GNU tar will not write are raw headers.

mod support;

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use genswap_crds::Unpack;
use genswap_store::{Rule, StageError, TreeLimits, UnpackError};
use support::{Fixture, run, sha256_file};

/// Stages `archive` and checks the refusal: the rule, the entry named in
/// the message, the build's fault, nothing left in the store.
async fn assert_refused(fx: &Fixture, archive: &Path, format: Unpack, entry: &str, rule: Rule) {
    let error = fx
        .stage(archive, format, &sha256_file(archive), "app")
        .await
        .expect_err("refused");
    match &error {
        StageError::Unpack {
            error:
                UnpackError::Refused {
                    entry: named,
                    rule: broken,
                    ..
                },
            ..
        } => {
            assert_eq!(named, entry, "{error}");
            assert_eq!(broken, &rule, "{error}");
        }
        other => panic!("expected {rule:?} for {entry}, got {other:?}"),
    }
    assert!(error.is_build_fault(), "{error}");
    let text = error.to_string();
    assert!(
        text.contains(entry) && text.contains(&rule.to_string()),
        "{text}"
    );
    assert!(fx.leftovers().is_empty(), "{:?}", fx.leftovers());
    assert!(fx.trees().is_empty(), "{:?}", fx.trees());
}

fn tar_in(dir: &Path, args: &[&str]) {
    run(Command::new("tar").current_dir(dir).args(args));
}

#[tokio::test]
async fn a_dot_dot_entry_is_refused_and_nothing_lands_beside_the_tree() {
    let fx = Fixture::new();
    let work = fx.outside("work/inner");
    let sentinel = work.parent().expect("work").join("x");
    fs::write(&sentinel, "original").expect("sentinel");
    let archive = fx.staging.join("dotdot.tar");
    tar_in(&work, &["-cPf", archive.to_str().expect("utf-8"), "../x"]);
    fs::write(&sentinel, "untouched").expect("sentinel");
    assert_refused(&fx, &archive, Unpack::Tar, "../x", Rule::ParentComponent).await;
    assert_eq!(
        fs::read_to_string(&sentinel).expect("sentinel"),
        "untouched"
    );
}

#[tokio::test]
async fn an_absolute_entry_is_refused_and_its_target_is_untouched() {
    let fx = Fixture::new();
    let outside = fx.outside("etc");
    let target = outside.join("passwd");
    fs::write(&target, "from the archive").expect("target");
    let archive = fx.staging.join("absolute.tar");
    tar_in(
        &fx.staging,
        &[
            "-cPf",
            archive.to_str().expect("utf-8"),
            target.to_str().expect("utf-8"),
        ],
    );
    fs::write(&target, "untouched").expect("target");
    assert_refused(
        &fx,
        &archive,
        Unpack::Tar,
        target.to_str().expect("utf-8"),
        Rule::Absolute,
    )
    .await;
    assert_eq!(fs::read_to_string(&target).expect("target"), "untouched");
}

#[tokio::test]
async fn a_write_through_a_symlink_is_refused() {
    let fx = Fixture::new();
    let outside = fx.outside("etc");
    let src = fx.outside("src");
    std::os::unix::fs::symlink(&outside, src.join("a")).expect("a -> outside");
    fs::create_dir(src.join("b")).expect("b");
    fs::write(src.join("b/passwd"), "root::0:0::/:/bin/sh\n").expect("payload");
    let archive = fx.staging.join("symlink.tar");
    let name = archive.to_str().expect("utf-8");
    tar_in(&src, &["-cf", name, "a"]);
    tar_in(&src, &["-rf", name, "--transform", "s|^b/|a/|", "b/passwd"]);
    assert_refused(&fx, &archive, Unpack::Tar, "a/passwd", Rule::ThroughSymlink).await;
    assert!(
        fs::read_dir(&outside).expect("outside").next().is_none(),
        "nothing written outside"
    );
}

/// One raw entry: its name, kind, link name and contents.
type RawEntry<'a> = (&'a [u8], tar::EntryType, &'a [u8], &'a [u8]);

/// A tar with raw headers, as GNU tar will not write them.
fn raw_tar(path: &Path, entries: &[RawEntry<'_>]) {
    let mut builder = tar::Builder::new(fs::File::create(path).expect("archive"));
    for (name, kind, link, data) in entries {
        let mut header = tar::Header::new_old();
        {
            let old = header.as_old_mut();
            old.name[..name.len()].copy_from_slice(name);
            old.linkname[..link.len()].copy_from_slice(link);
        }
        header.set_entry_type(*kind);
        header.set_mode(0o644);
        header.set_size(data.len() as u64);
        header.set_cksum();
        builder.append(&header, *data).expect("append");
    }
    builder
        .into_inner()
        .expect("finish")
        .flush()
        .expect("flush");
}

#[tokio::test]
async fn hard_links_out_of_the_tree_are_refused() {
    let fx = Fixture::new();
    let outside = fx.outside("etc");
    let secret = outside.join("shadow");
    fs::write(&secret, "secret").expect("secret");
    let absolute = secret.to_str().expect("utf-8").as_bytes().to_vec();
    let cases: [(&str, Vec<RawEntry<'_>>, &str); 3] = [
        (
            "absolute",
            vec![(b"h", tar::EntryType::Link, &absolute, b"")],
            "h",
        ),
        (
            "dotdot",
            vec![(b"h", tar::EntryType::Link, b"../etc/shadow", b"")],
            "h",
        ),
        (
            "through-symlink",
            vec![
                (
                    b"a",
                    tar::EntryType::Symlink,
                    outside.to_str().expect("utf-8").as_bytes(),
                    b"",
                ),
                (b"h", tar::EntryType::Link, b"a/shadow", b""),
            ],
            "h",
        ),
    ];
    for (name, entries, entry) in cases {
        let archive = fx.staging.join(format!("{name}.tar"));
        raw_tar(&archive, &entries);
        assert_refused(&fx, &archive, Unpack::Tar, entry, Rule::LinkOutside).await;
        assert_eq!(
            fs::metadata(&secret).expect("secret").nlink(),
            1,
            "{name}: no new link to it"
        );
    }
    // A link to an entry the archive never made.
    let archive = fx.staging.join("missing.tar");
    raw_tar(&archive, &[(b"h", tar::EntryType::Link, b"nothing", b"")]);
    assert_refused(&fx, &archive, Unpack::Tar, "h", Rule::LinkToMissing).await;
}

#[tokio::test]
async fn device_nodes_and_fifos_are_refused() {
    let fx = Fixture::new();
    let src = fx.outside("src");
    run(Command::new("mknod")
        .arg(src.join("null"))
        .args(["c", "1", "3"]));
    let archive = fx.staging.join("device.tar");
    tar_in(&src, &["-cf", archive.to_str().expect("utf-8"), "null"]);
    assert_refused(&fx, &archive, Unpack::Tar, "null", Rule::Device).await;

    let src = fx.outside("src-fifo");
    nix::unistd::mkfifo(
        &src.join("pipe"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .expect("mkfifo");
    let archive = fx.staging.join("fifo.tar");
    tar_in(&src, &["-cf", archive.to_str().expect("utf-8"), "pipe"]);
    assert_refused(&fx, &archive, Unpack::Tar, "pipe", Rule::Fifo).await;
}

#[tokio::test]
async fn a_gzip_bomb_stops_at_the_byte_limit_before_its_first_byte() {
    let limit = 64 << 20;
    let fx = Fixture::with_limits(TreeLimits {
        max_bytes: limit,
        ..TreeLimits::default()
    });
    let src = fx.outside("src");
    // 1 GiB of zeros (sparse on disk), tarred and gzipped by the real tools.
    let zeros = fs::File::create(src.join("zeros")).expect("zeros");
    zeros.set_len(1 << 30).expect("1 GiB");
    fs::write(src.join("small"), "x").expect("small");
    let archive = fx.staging.join("bomb.tar.gz");
    tar_in(
        &src,
        &["-czf", archive.to_str().expect("utf-8"), "small", "zeros"],
    );
    let size = fs::metadata(&archive).expect("bomb").len();
    assert!(size < 4 << 20, "1 GiB in {size} bytes");
    let error = fx
        .stage(&archive, Unpack::TarGzip, &sha256_file(&archive), "app")
        .await
        .expect_err("refused");
    match &error {
        StageError::Unpack {
            error: UnpackError::TooManyBytes {
                entry, limit: said, ..
            },
            ..
        } => {
            assert_eq!(entry, "zeros");
            assert_eq!(*said, limit);
        }
        other => panic!("{other:?}"),
    }
    assert!(error.is_build_fault());
    assert!(error.to_string().contains("--max-tree-bytes"), "{error}");
    assert!(fx.leftovers().is_empty() && fx.trees().is_empty());
}

#[tokio::test]
async fn two_hundred_thousand_tiny_entries_stop_at_the_entry_limit() {
    let limit = 50_000;
    let fx = Fixture::with_limits(TreeLimits {
        max_entries: limit,
        ..TreeLimits::default()
    });
    let archive = fx.staging.join("many.tar.zst");
    let file = fs::File::create(&archive).expect("archive");
    let encoder = zstd::stream::write::Encoder::new(file, 3).expect("zstd");
    let mut builder = tar::Builder::new(encoder);
    for n in 0..200_000u32 {
        let mut header = tar::Header::new_gnu();
        header.set_size(1);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, format!("d{}/f{n}", n / 1000), &b"x"[..])
            .expect("append");
    }
    builder
        .into_inner()
        .expect("tar")
        .finish()
        .expect("zstd")
        .flush()
        .expect("flush");
    let error = fx
        .stage(&archive, Unpack::TarZstd, &sha256_file(&archive), "app")
        .await
        .expect_err("refused");
    assert!(
        matches!(&error, StageError::Unpack { error: UnpackError::TooManyEntries { limit: l, .. }, .. } if *l == limit),
        "{error:?}"
    );
    assert!(error.is_build_fault());
    assert!(error.to_string().contains("--max-tree-entries"), "{error}");
    assert!(fx.leftovers().is_empty() && fx.trees().is_empty());
}

#[tokio::test]
async fn a_wrong_digest_or_a_cut_archive_is_the_builds_fault_and_keeps_nothing() {
    let fx = Fixture::new();
    let src = fx.outside("src");
    support::app_tree(&src);
    let archive = fx.staging.join("app.tar.gz");
    support::gnu_tar(&src, &archive, Unpack::TarGzip);
    let error = fx
        .stage(&archive, Unpack::TarGzip, &"0".repeat(64), "bin/app")
        .await
        .expect_err("mismatch");
    assert!(
        matches!(error, StageError::DigestMismatch { .. }),
        "{error:?}"
    );
    assert!(error.is_build_fault());
    assert!(fx.leftovers().is_empty() && fx.trees().is_empty());

    let bytes = fs::read(&archive).expect("archive");
    let cut = fx.staging.join("cut.tar.gz");
    fs::write(&cut, &bytes[..bytes.len() / 2]).expect("cut");
    let error = fx
        .stage(&cut, Unpack::TarGzip, &sha256_file(&cut), "bin/app")
        .await
        .expect_err("cut");
    assert!(
        matches!(
            &error,
            StageError::Unpack {
                error: UnpackError::Read { .. },
                ..
            }
        ),
        "{error:?}"
    );
    assert!(error.is_build_fault(), "{error}");
    assert!(fx.leftovers().is_empty() && fx.trees().is_empty());
}
