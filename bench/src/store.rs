//! Staging an image (SPEC 5.14), side by side with what a user does by hand
//! with the real tools: `skopeo copy` of the image to a directory, then
//! `tar -x` of each of its layers. Both pull the same ~100 MB three-layer
//! image from a real registry on loopback (Debian's docker-registry),
//! built by umoci and pushed by skopeo, in alternating rounds.
//!
//! genswap's side runs in its own process (`genswap-bench stage-image`), so
//! its memory is its own: the resident size once its stager is built
//! (idle), and the peak (`VmHWM`) once the pull is done. That process then
//! stages the stored digest again, many times: the hit's latency.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use test_cluster::registry::{Access, Registry, Umoci};

use crate::BenchError;

/// `genswap-bench store`.
#[derive(Clone, Debug, clap::Args)]
pub struct StoreArgs {
    /// Rounds of each side (alternating).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Stages of the stored digest, for the hit's latency.
    #[arg(long, default_value_t = 500)]
    pub restages: usize,
    /// Overlaps under load of each of an image build and a file build.
    #[arg(long, default_value_t = 20)]
    pub swaps: usize,
}

/// `genswap-bench stage-image`: one stager, one pull, then the hits.
#[derive(Clone, Debug, clap::Args)]
pub struct StageImageArgs {
    #[arg(long)]
    pub image: String,
    #[arg(long)]
    pub sha256: String,
    #[arg(long)]
    pub store: PathBuf,
    #[arg(long)]
    pub insecure: String,
    #[arg(long, default_value_t = 0)]
    pub restages: usize,
}

/// What one `stage-image` process measured.
#[derive(Serialize, Deserialize, Debug)]
pub struct StageImageReport {
    pub pull_ms: f64,
    pub idle_rss_kib: u64,
    pub peak_rss_kib: u64,
    pub bytes: u64,
    pub restage_us: Vec<u64>,
}

fn status_kib(field: &str) -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

/// The body of `stage-image`.
pub async fn stage_image(args: &StageImageArgs) -> Result<StageImageReport, BenchError> {
    genswap_store::install_crypto_provider();
    let staging = args.store.with_extension("staging");
    fs::create_dir_all(&staging).map_err(|source| BenchError::Setup {
        what: "make a staging root".into(),
        source,
    })?;
    let mut config = genswap_store::StagerConfig::new(&staging);
    config.registries.insecure = vec![args.insecure.clone()];
    let store =
        genswap_store::Store::open(&args.store).map_err(|e| BenchError::Agent(e.to_string()))?;
    let stager =
        genswap_store::Stager::new(store, config).map_err(|e| BenchError::Agent(e.to_string()))?;
    let build = genswap_crds::BuildSpec {
        signed_by: None,
        signature: None,
        id: "bench".into(),
        artifact: genswap_crds::Artifact {
            path: None,
            url: None,
            image: Some(args.image.clone()),
            unpack: None,
        },
        sha256: args.sha256.clone(),
        entrypoint: Some("bin/app".into()),
    };
    let idle_rss_kib = status_kib("VmRSS:");
    let began = Instant::now();
    let staged = stager
        .stage(&build)
        .await
        .map_err(|e| BenchError::Agent(format!("staging the image: {e}")))?;
    let pull_ms = began.elapsed().as_secs_f64() * 1000.0;
    let peak_rss_kib = status_kib("VmHWM:");
    let mut restage_us = Vec::with_capacity(args.restages);
    for _ in 0..args.restages {
        let began = Instant::now();
        stager
            .stage(&build)
            .await
            .map_err(|e| BenchError::Agent(format!("staging the stored image: {e}")))?;
        restage_us.push(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX));
    }
    Ok(StageImageReport {
        pull_ms,
        idle_rss_kib,
        peak_rss_kib,
        bytes: staged.bytes,
        restage_us,
    })
}

/// A deterministic stream of bytes that do not compress.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Text-like bytes that compress about as source code does.
fn text(seed: u64, len: usize) -> Vec<u8> {
    const WORDS: [&str; 16] = [
        "fn ", "let ", "return ", "match ", "self", "value", "error", "Some(", "None", "=> ",
        "{\n", "}\n", "config", "stream", "bytes", ";\n",
    ];
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(WORDS[(state % 16) as usize].as_bytes());
        out.extend_from_slice(format!("{}", state % 1000).as_bytes());
    }
    out.truncate(len);
    out
}

/// The image: a base of text-like files (a runtime's libraries), a layer
/// of binaries that do not compress, and an application layer with a
/// whiteout; about 100 MB unpacked.
fn build_image(dir: &Path) -> Result<Umoci, BenchError> {
    let image = Umoci::new(dir, "bench");
    let rootfs = image.rootfs();
    let write = |path: PathBuf, bytes: Vec<u8>| -> Result<(), BenchError> {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|source| BenchError::Setup {
                what: format!("make {}", parent.display()),
                source,
            })?;
        }
        fs::write(&path, bytes).map_err(|source| BenchError::Setup {
            what: format!("write {}", path.display()),
            source,
        })
    };
    for n in 0..2_000u64 {
        write(
            rootfs.join(format!("usr/lib/runtime/{}/mod{n}.py", n % 40)),
            text(n, 20 * 1024),
        )?;
    }
    image.layer();
    for n in 0..6u64 {
        write(
            rootfs.join(format!("usr/lib/native/lib{n}.so")),
            noise(1_000 + n, 5 << 20),
        )?;
    }
    image.layer();
    for n in 0..500u64 {
        write(
            rootfs.join(format!("app/assets/{n}.dat")),
            noise(9_000 + n, 40 * 1024),
        )?;
    }
    write(
        rootfs.join("bin/app"),
        b"#!/bin/sh\nexec sleep 1000\n".to_vec(),
    )?;
    fs::set_permissions(
        rootfs.join("bin/app"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .map_err(|source| BenchError::Setup {
        what: "chmod bin/app".into(),
        source,
    })?;
    let _ = fs::remove_file(rootfs.join("usr/lib/runtime/0/mod0.py"));
    image.layer();
    Ok(image)
}

/// `skopeo copy` to a directory, then `tar -x` of each layer into a
/// rootfs: the same pull and unpack by hand.
fn by_hand(reference: &str, work: &Path) -> Result<Duration, BenchError> {
    let copy = work.join("copy");
    let rootfs = work.join("rootfs");
    fs::create_dir_all(&rootfs).map_err(|source| BenchError::Setup {
        what: "make the rootfs".into(),
        source,
    })?;
    let began = Instant::now();
    let status = Command::new("skopeo")
        .args(["copy", "-q", "--src-tls-verify=false"])
        .arg(format!("docker://{reference}"))
        .arg(format!("dir:{}", copy.display()))
        .status()
        .map_err(|source| BenchError::Setup {
            what: "run skopeo".into(),
            source,
        })?;
    if !status.success() {
        return Err(BenchError::Missing("skopeo copy failed".into()));
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(copy.join("manifest.json")).map_err(|source| {
            BenchError::Setup {
                what: "read the copied manifest".into(),
                source,
            }
        })?)
        .map_err(|e| BenchError::Agent(e.to_string()))?;
    for layer in manifest["layers"].as_array().into_iter().flatten() {
        let digest = layer["digest"].as_str().unwrap_or_default();
        let blob = copy.join(digest.trim_start_matches("sha256:"));
        let status = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-xzf")
            .arg(&blob)
            .status()
            .map_err(|source| BenchError::Setup {
                what: "run tar".into(),
                source,
            })?;
        if !status.success() {
            return Err(BenchError::Agent(format!("tar -x of {digest} failed")));
        }
    }
    // Both sides end with their bytes on disk.
    let _ = Command::new("sync").status();
    Ok(began.elapsed())
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn percentile(values: &mut [u64], p: f64) -> u64 {
    values.sort_unstable();
    let at = ((values.len() as f64 - 1.0) * p).round() as usize;
    values.get(at).copied().unwrap_or(0)
}

/// `genswap-bench store`: prints the figures.
pub async fn run(args: &StoreArgs, bench: &Path) -> Result<(), BenchError> {
    let Some(registry) = Registry::start(Access::Plain) else {
        return Err(BenchError::Missing(
            "docker-registry, skopeo, umoci (run .ci/install-registry)".into(),
        ));
    };
    let work = tempfile::Builder::new()
        .prefix("genswap-bench-store-")
        .tempdir()
        .map_err(|source| BenchError::Setup {
            what: "make a temp dir".into(),
            source,
        })?;
    let image = build_image(&work.path().join("image"))?;
    let digest = registry.push(&image.layout, image.tag(), "bench/app", "1", &[]);
    // skopeo 1.9 takes a tag or a digest, not both.
    let reference = format!("{}/bench/app@sha256:{digest}", registry.addr);
    let mut genswap_ms = Vec::new();
    let mut hand_ms = Vec::new();
    let mut memory = Vec::new();
    let mut restage_us = Vec::new();
    let mut bytes = 0;
    for round in 0..args.rounds {
        let store = work.path().join(format!("store-{round}"));
        let _ = Command::new("sync").status();
        let output = Command::new(bench)
            .args([
                "stage-image",
                "--image",
                &reference,
                "--sha256",
                &digest,
                "--insecure",
                &registry.addr,
            ])
            .arg("--store")
            .arg(&store)
            .args([
                "--restages",
                &if round + 1 == args.rounds {
                    args.restages
                } else {
                    0
                }
                .to_string(),
            ])
            .output()
            .map_err(|source| BenchError::Setup {
                what: "run stage-image".into(),
                source,
            })?;
        if !output.status.success() {
            return Err(BenchError::Agent(
                String::from_utf8_lossy(&output.stderr).into_owned(),
            ));
        }
        let report: StageImageReport = serde_json::from_slice(&output.stdout)
            .map_err(|e| BenchError::Agent(format!("stage-image said: {e}")))?;
        genswap_ms.push(report.pull_ms);
        memory.push(report.peak_rss_kib.saturating_sub(report.idle_rss_kib));
        restage_us.extend(report.restage_us);
        bytes = report.bytes;
        let hand = by_hand(&reference, &work.path().join(format!("hand-{round}")))?;
        hand_ms.push(hand.as_secs_f64() * 1000.0);
        for dir in [store, work.path().join(format!("hand-{round}"))] {
            let _ = genswap_store::tree::remove_entry(&dir);
        }
    }
    let genswap = median(&mut genswap_ms);
    let hand = median(&mut hand_ms);
    println!(
        "== staging a three-layer image of {:.1} MB from a registry on loopback ({} rounds, medians)",
        bytes as f64 / 1e6,
        args.rounds
    );
    println!("genswap (pull, verify, unpack into the store)   {genswap:>9.1} ms");
    println!("skopeo copy to a dir + tar -x of each layer      {hand:>9.1} ms");
    println!(
        "ratio                                            {:>9.2}x",
        genswap / hand
    );
    println!(
        "genswap's peak memory above idle during the pull {:>9.1} MiB (largest of the rounds)",
        memory.iter().copied().max().unwrap_or(0) as f64 / 1024.0
    );
    println!(
        "staging the stored digest again ({} times)       p50 {:.2} ms, p99 {:.2} ms",
        restage_us.len(),
        percentile(&mut restage_us, 0.5) as f64 / 1000.0,
        percentile(&mut restage_us, 0.99) as f64 / 1000.0
    );
    if args.swaps > 0 {
        crate::image_overlap::run(&registry, work.path(), args.swaps).await?;
    }
    Ok(())
}
