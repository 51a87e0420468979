//! Images and artifacts from a real registry (Debian's docker-registry,
//! CNCF distribution) on loopback, pushed by skopeo from layouts umoci
//! builds, or that the test writes where no tool here makes one (an index
//! of two platforms, zstd layers, an artifact as oras pushes it). TLS from
//! a CA the test makes, htpasswd basic auth, the credentials from a docker
//! config.json. And a registry that refuses, lacks the digest, or dies
//! mid-layer: the source's fault, nothing kept, and the next stage works.

mod support;

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use genswap_crds::{Artifact, BuildSpec};
use genswap_store::registry::node_platform;
use genswap_store::{
    RegistryError, RegistrySettings, StageError, Staged, Stager, StagerConfig, Store,
};
use support::Fixture;
use test_cluster::registry::{self, Access, Blob, Registry, Umoci};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A stager of `fx`'s store with these registry settings.
fn stager(fx: &Fixture, settings: RegistrySettings) -> Stager {
    let mut config = StagerConfig::new(&fx.staging);
    config.registries = settings;
    Stager::new(Store::open(&fx.store_dir).expect("store"), config).expect("stager")
}

/// The settings that reach `registry` with `user:password` (TLS) or
/// plainly.
fn settings_for(fx: &Fixture, registry: &Registry, password: &str) -> RegistrySettings {
    match registry.access {
        Access::TlsWithAuth => {
            let config = fx.dir.path().join("docker-config.json");
            registry.write_docker_config(&config, registry::USER, password);
            RegistrySettings {
                config: Some(config),
                ca: Some(registry.ca.clone()),
                insecure: Vec::new(),
            }
        }
        Access::Plain => RegistrySettings {
            insecure: vec![registry.addr.clone()],
            ..RegistrySettings::default()
        },
    }
}

fn image_build(reference: &str, digest: &str, entrypoint: Option<&str>) -> BuildSpec {
    BuildSpec {
        signed_by: None,
        signature: None,
        id: "image-1".into(),
        artifact: Artifact {
            path: None,
            url: None,
            image: Some(format!("{reference}@sha256:{digest}")),
            unpack: None,
        },
        sha256: digest.into(),
        entrypoint: entrypoint.map(str::to_string),
    }
}

/// A tar of `(path, contents)` files (mode 0755), uncompressed.
fn tar_of(files: &[(&str, &str)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, body) in files {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o755);
        header.set_size(body.len() as u64);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, path, body.as_bytes())
            .expect("append");
    }
    builder.into_inner().expect("tar")
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Three layers made by umoci from a rootfs changed between them: a file
/// removed (umoci writes its whiteout), a file changed, and a third layer
/// the test writes with an opaque directory.
fn three_layer_image(dir: &Path) -> Umoci {
    let image = Umoci::new(dir, "app");
    let rootfs = image.rootfs();
    fs::create_dir_all(rootfs.join("app")).expect("app");
    fs::create_dir_all(rootfs.join("etc")).expect("etc");
    fs::create_dir_all(rootfs.join("cache")).expect("cache");
    fs::write(
        rootfs.join("app/main.py"),
        "#!/usr/bin/env python3\nprint('hi')\n",
    )
    .expect("main");
    fs::set_permissions(
        rootfs.join("app/main.py"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    fs::write(rootfs.join("app/greeting.py"), "TEXT = 'v1'\n").expect("greeting");
    fs::write(rootfs.join("etc/old.conf"), "old").expect("old");
    fs::write(rootfs.join("cache/a"), "a").expect("a");
    fs::write(rootfs.join("cache/b"), "b").expect("b");
    image.layer();
    fs::remove_file(rootfs.join("etc/old.conf")).expect("remove");
    fs::write(rootfs.join("app/greeting.py"), "TEXT = 'v2'\n").expect("greeting v2");
    image.layer();
    let opaque = dir.join("opaque.tar");
    fs::write(
        &opaque,
        tar_of(&[("cache/c", "c"), ("cache/.wh..wh..opq", "")]),
    )
    .expect("opaque layer");
    image.raw_layer(&opaque);
    image.config(&[
        "--config.entrypoint",
        "/app/main.py",
        "--config.cmd",
        "--serve",
        "--config.env",
        "GREETING_SOURCE=image",
        "--config.env",
        "PATH=/usr/local/bin:/usr/bin:/bin",
        "--config.workingdir",
        "/app",
        "--config.user",
        "0:0",
    ]);
    image
}

#[tokio::test]
async fn a_three_layer_image_over_tls_with_basic_auth_unpacks_with_its_whiteouts() {
    let Some(registry) = Registry::start(Access::TlsWithAuth) else {
        return;
    };
    let fx = Fixture::new();
    let image = three_layer_image(&fx.outside("build"));
    let digest = registry.push(&image.layout, image.tag(), "team/app", "1.0", &[]);
    let stager = stager(&fx, settings_for(&fx, &registry, registry::PASSWORD));
    // A tag before the digest is allowed, and ignored.
    let reference = format!("{}/team/app:1.0", registry.addr);
    let staged = stager
        .stage(&image_build(&reference, &digest, None))
        .await
        .expect("staged");
    let rootfs = staged.tree.clone().expect("a tree");
    assert_eq!(staged.sha256, digest);
    assert_eq!(
        staged.path,
        rootfs.join("app/main.py"),
        "the config's Entrypoint"
    );
    assert_eq!(read(&rootfs.join("app/greeting.py")), "TEXT = 'v2'\n");
    assert!(
        !rootfs.join("etc/old.conf").exists(),
        "umoci's whiteout removed it"
    );
    assert!(rootfs.join("etc").is_dir());
    let mut cache: Vec<String> = fs::read_dir(rootfs.join("cache"))
        .expect("cache")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    cache.sort();
    assert_eq!(
        cache,
        vec!["c"],
        "the opaque directory kept only its own layer's"
    );
    // The config's defaults, as a container runtime uses them; its User is
    // recorded and never used.
    assert_eq!(staged.args(&[]), vec!["--serve"]);
    assert_eq!(staged.args(&["--other".into()]), vec!["--other"]);
    let env = staged.env(vec![("PATH".into(), "/spec".into())]);
    assert!(
        env.contains(&("GREETING_SOURCE".into(), "image".into())),
        "{env:?}"
    );
    assert!(
        env.contains(&("PATH".into(), "/spec".into()))
            && env.iter().filter(|(n, _)| n == "PATH").count() == 1
    );
    assert_eq!(
        staged.run.working_dir.as_deref(),
        Some(rootfs.join("app").as_path())
    );

    // Staged again from the store: no registry needed.
    drop(registry);
    let again = stager
        .stage(&image_build(&reference, &digest, None))
        .await
        .expect("from the store");
    assert!(
        staged.fetched > 0,
        "the pull fetched its layers: {staged:?}"
    );
    assert_eq!(again.fetched, 0, "nothing fetched from the store");
    assert_eq!(
        Staged {
            fetched: staged.fetched,
            ..again
        },
        staged
    );
    assert!(fx.leftovers().is_empty(), "{:?}", fx.leftovers());
}

/// The architecture of another platform than this node's.
fn other_platform() -> &'static str {
    if node_platform().starts_with("linux/amd64") {
        "linux/arm64/v8"
    } else {
        "linux/amd64"
    }
}

#[tokio::test]
async fn an_index_of_two_platforms_resolves_to_this_nodes() {
    let Some(registry) = Registry::start(Access::Plain) else {
        return;
    };
    let fx = Fixture::new();
    let layout = fx.outside("layout");
    let config = |arch: &str| {
        Blob::new(
            "application/vnd.oci.image.config.v1+json",
            format!(r#"{{"architecture":"{arch}","os":"linux","config":{{"Entrypoint":["/bin/which"]}},"rootfs":{{"type":"layers","diff_ids":[]}}}}"#)
                .into_bytes(),
        )
    };
    let mine = node_platform();
    registry::write_manifest(
        &layout,
        "mine",
        config("mine"),
        vec![Blob::new(
            "application/vnd.oci.image.layer.v1.tar",
            tar_of(&[("bin/which", &mine)]),
        )],
        None,
    );
    registry::write_manifest(
        &layout,
        "other",
        config("other"),
        vec![Blob::new(
            "application/vnd.oci.image.layer.v1.tar",
            tar_of(&[("bin/which", other_platform())]),
        )],
        None,
    );
    registry::write_index(
        &layout,
        "multi",
        &[("other", other_platform()), ("mine", &mine)],
    );
    registry::write_index(&layout, "foreign", &[("other", other_platform())]);
    let digest = registry.push(
        &layout,
        "multi",
        "multi",
        "1",
        &["--all", "--preserve-digests"],
    );
    let foreign = registry.push(
        &layout,
        "foreign",
        "foreign",
        "1",
        &["--all", "--preserve-digests"],
    );
    let stager = stager(&fx, settings_for(&fx, &registry, ""));

    let staged = stager
        .stage(&image_build(
            &format!("{}/multi", registry.addr),
            &digest,
            None,
        ))
        .await
        .expect("staged");
    assert_eq!(read(&staged.path), mine, "this node's manifest was chosen");

    let error = stager
        .stage(&image_build(
            &format!("{}/foreign", registry.addr),
            &foreign,
            None,
        ))
        .await
        .expect_err("no manifest for this node");
    assert!(error.is_build_fault(), "{error}");
    let text = error.to_string();
    assert!(
        text.contains(&mine) && text.contains(other_platform()),
        "{text}"
    );
    assert!(fx.leftovers().is_empty(), "{:?}", fx.leftovers());
}

#[tokio::test]
async fn an_oci_artifact_and_a_zstd_image_unpack_too() {
    let Some(registry) = Registry::start(Access::Plain) else {
        return;
    };
    let fx = Fixture::new();
    let layout = fx.outside("layout");
    // An artifact as `oras push bundle.tar` makes it: an empty config and
    // one tar layer.
    registry::write_manifest(
        &layout,
        "artifact",
        Blob::new("application/vnd.oci.empty.v1+json", b"{}".to_vec()),
        vec![Blob::new(
            "application/vnd.oci.image.layer.v1.tar",
            tar_of(&[("bundle/run", "#!/bin/sh\n")]),
        )],
        Some("application/vnd.genswap.test.bundle"),
    );
    let zstd_layer = zstd::encode_all(
        &tar_of(&[("bin/app", "#!/bin/sh\n"), ("share/data", "zstd")])[..],
        3,
    )
    .expect("zstd");
    registry::write_manifest(
        &layout,
        "zstd",
        Blob::new(
            "application/vnd.oci.image.config.v1+json",
            br#"{"architecture":"amd64","os":"linux","config":{"Cmd":["/bin/app","--flag"]},"rootfs":{"type":"layers","diff_ids":[]}}"#.to_vec(),
        ),
        vec![Blob::new("application/vnd.oci.image.layer.v1.tar+zstd", zstd_layer)],
        None,
    );
    let artifact = registry.push(
        &layout,
        "artifact",
        "artifact",
        "1",
        &["--preserve-digests"],
    );
    let zstd_image = registry.push(&layout, "zstd", "zstd", "1", &["--preserve-digests"]);
    let stager = stager(&fx, settings_for(&fx, &registry, ""));

    let reference = format!("{}/artifact", registry.addr);
    let error = stager
        .stage(&image_build(&reference, &artifact, None))
        .await
        .expect_err("an artifact names nothing to run");
    assert!(
        matches!(error, StageError::NoEntrypoint { .. }) && error.is_build_fault(),
        "{error:?}"
    );
    let staged = stager
        .stage(&image_build(&reference, &artifact, Some("bundle/run")))
        .await
        .expect("the artifact with an entrypoint");
    assert!(staged.path.ends_with("bundle/run"));
    assert_eq!(staged.args(&[]), Vec::<String>::new());

    let staged = stager
        .stage(&image_build(
            &format!("{}/zstd", registry.addr),
            &zstd_image,
            None,
        ))
        .await
        .expect("the zstd image");
    assert!(
        staged.path.ends_with("bin/app"),
        "Cmd[0] without an Entrypoint"
    );
    assert_eq!(staged.args(&[]), vec!["--flag"]);
    assert_eq!(
        read(&staged.tree.clone().expect("tree").join("share/data")),
        "zstd"
    );
}

/// Asserts a registry refusal: the source's fault, naming the registry and
/// what it answered, nothing kept.
fn assert_unavailable(fx: &Fixture, error: &StageError, registry: &str, answered: &[&str]) {
    assert!(!error.is_build_fault(), "{error:?}");
    assert!(
        matches!(
            error,
            StageError::Registry(RegistryError::Unavailable { .. })
        ),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(text.contains(registry), "{text}");
    for words in answered {
        assert!(text.contains(words), "{words:?} not in {text}");
    }
    assert!(
        fx.leftovers().is_empty() && fx.trees().is_empty(),
        "{:?}",
        fx.leftovers()
    );
}

#[tokio::test]
async fn wrong_credentials_a_missing_digest_and_an_unknown_ca_are_the_registrys_answers() {
    let Some(registry) = Registry::start(Access::TlsWithAuth) else {
        return;
    };
    let fx = Fixture::new();
    let image = three_layer_image(&fx.outside("build"));
    let digest = registry.push(&image.layout, image.tag(), "team/app", "1.0", &[]);
    let reference = format!("{}/team/app", registry.addr);
    let build = image_build(&reference, &digest, None);

    let wrong = stager(&fx, settings_for(&fx, &registry, "wrong-password"));
    let error = wrong.stage(&build).await.expect_err("401");
    assert_unavailable(&fx, &error, &registry.addr, &["401"]);

    let mut anonymous = settings_for(&fx, &registry, registry::PASSWORD);
    anonymous.config = None;
    let error = stager(&fx, anonymous).stage(&build).await.expect_err("401");
    assert_unavailable(&fx, &error, &registry.addr, &["401"]);

    let mut unknown_ca = settings_for(&fx, &registry, registry::PASSWORD);
    unknown_ca.ca = None;
    let error = stager(&fx, unknown_ca)
        .stage(&build)
        .await
        .expect_err("TLS");
    assert_unavailable(&fx, &error, &registry.addr, &["certificate"]);

    // The same stager once the file holds the right password: the config
    // is read at each pull, so a rotated Secret needs no restart.
    settings_for(&fx, &registry, registry::PASSWORD);
    let good = wrong;
    let missing = "1".repeat(64);
    let error = good
        .stage(&image_build(&reference, &missing, None))
        .await
        .expect_err("404");
    assert_unavailable(
        &fx,
        &error,
        &registry.addr,
        &["404 MANIFEST_UNKNOWN", &missing],
    );
    good.stage(&build).await.expect("the right credentials");
}

/// Forwards loopback connections to `upstream`; once `cut_after` bytes
/// came back on one connection, runs `cut` (which kills the registry) and
/// drops the connection.
async fn cutting_proxy(
    upstream: String,
    cut_after: u64,
    cut: Arc<dyn Fn() + Send + Sync>,
) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let cuts = Arc::new(AtomicU64::new(0));
    let counted = cuts.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let Ok(mut server) = TcpStream::connect(&upstream).await else {
                continue;
            };
            let cut = cut.clone();
            let counted = counted.clone();
            tokio::spawn(async move {
                let (mut client_read, mut client_write) = client.split();
                let (mut server_read, mut server_write) = server.split();
                let up = tokio::io::copy(&mut client_read, &mut server_write);
                let down = async {
                    let mut sent = 0u64;
                    let mut buffer = vec![0u8; 64 * 1024];
                    loop {
                        let n = match server_read.read(&mut buffer).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if client_write.write_all(&buffer[..n]).await.is_err() {
                            return;
                        }
                        sent += n as u64;
                        if sent > cut_after && counted.fetch_add(1, Ordering::SeqCst) == 0 {
                            cut();
                            return;
                        }
                    }
                };
                tokio::select! {
                    _ = up => {}
                    () = down => {}
                }
            });
        }
    });
    (addr, cuts)
}

#[tokio::test]
async fn a_registry_killed_mid_layer_is_the_sources_fault_and_the_next_pull_succeeds() {
    let Some(registry) = Registry::start(Access::Plain) else {
        return;
    };
    let registry = Arc::new(std::sync::Mutex::new(registry));
    let fx = Fixture::new();
    let layout = fx.outside("layout");
    // 8 MiB that do not compress: the cut lands inside the layer.
    let mut noise = vec![0u8; 8 << 20];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for byte in noise.iter_mut() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *byte = state as u8;
    }
    let mut layer = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_mode(0o755);
    header.set_size(noise.len() as u64);
    layer
        .append_data(&mut header, "bin/app", &noise[..])
        .expect("append");
    let layer = layer.into_inner().expect("tar");
    registry::write_manifest(
        &layout,
        "big",
        Blob::new("application/vnd.oci.empty.v1+json", b"{}".to_vec()),
        vec![Blob::new("application/vnd.oci.image.layer.v1.tar", layer)],
        None,
    );
    let (addr, digest) = {
        let registry = registry.lock().expect("registry");
        let digest = registry.push(&layout, "big", "big", "1", &["--preserve-digests"]);
        (registry.addr.clone(), digest)
    };
    let killer = registry.clone();
    let (proxy, cuts) = cutting_proxy(
        addr.clone(),
        2 << 20,
        Arc::new(move || killer.lock().expect("registry").kill()),
    )
    .await;
    let stager = stager(
        &fx,
        RegistrySettings {
            insecure: vec![proxy.clone()],
            ..RegistrySettings::default()
        },
    );
    let build = image_build(&format!("{proxy}/big"), &digest, Some("bin/app"));
    let error = stager.stage(&build).await.expect_err("cut mid-layer");
    assert_eq!(
        cuts.load(Ordering::SeqCst),
        1,
        "the registry was killed mid-layer"
    );
    assert!(registry.lock().expect("registry").pid().is_none());
    assert_unavailable(&fx, &error, &proxy, &[]);

    // Back up: the same stage succeeds.
    registry.lock().expect("registry").run();
    let staged = stager
        .stage(&build)
        .await
        .expect("once the registry is back");
    assert_eq!(fs::read(&staged.path).expect("app"), noise);
}
