//! Signed builds (SPEC 5.15) against real signatures: key pairs and
//! signatures from openssl as `cosign sign-blob --key` makes them, an
//! image's signature manifest as cosign's SIGNATURE_SPEC lays it out,
//! pushed by skopeo to a real registry (Debian's docker-registry) at the
//! `sha256-<digest>.sig` tag, and verified by the sigstore crate. Each
//! refusal names which of the three it is (no signature, another key,
//! other bytes) and is the build's fault: `failed`, never retried, and
//! nothing of the build runs.
//!
//! Where the fakes stop: no cosign binary is here, so a detail of its own
//! output beyond the spec is not covered; distribution 2.8 has no
//! referrers API, so the referrers form is read only through oci-client's
//! fallback to the tag (an empty answer), never with a referrer present.

mod support;

use std::fs;
use std::path::{Path, PathBuf};

use genswap_crds::{Artifact, BuildSpec, Unpack};
use genswap_store::{
    RegistrySettings, StageError, Staged, Stager, StagerConfig, Store, TrustError, TrustPolicy,
};
use support::Fixture;
use test_cluster::registry::{Access, Registry, Umoci};
use test_cluster::signing::{self, KeyPair};

/// A stager of `fx`'s store that reaches `registry` plainly and trusts the
/// keys in `trust`.
fn stager(fx: &Fixture, registry: Option<&Registry>, trust: TrustPolicy) -> Stager {
    let mut config = StagerConfig::new(&fx.staging);
    if let Some(registry) = registry {
        config.registries = RegistrySettings {
            insecure: vec![registry.addr.clone()],
            ..RegistrySettings::default()
        };
    }
    config.trust = trust;
    Stager::new(Store::open(&fx.store_dir).expect("store"), config).expect("stager")
}

fn trusting(dir: &Path) -> TrustPolicy {
    TrustPolicy {
        keys: Some(dir.to_path_buf()),
        require_signatures: false,
    }
}

/// A registry holding a one-layer image `team/app`, a store, and the
/// node's trust keys directory.
struct SignedImage {
    registry: Registry,
    fx: Fixture,
    trust: PathBuf,
    digest: String,
}

impl SignedImage {
    /// `None` (after the skip line) where the registry's tools are missing.
    fn start() -> Option<SignedImage> {
        let registry = Registry::start(Access::Plain)?;
        let fx = Fixture::new();
        let trust = fx.outside("trust");
        let image = Umoci::new(&fx.outside("build"), "app");
        let rootfs = image.rootfs();
        fs::create_dir_all(rootfs.join("app")).expect("app");
        fs::write(rootfs.join("app/main.sh"), "#!/bin/sh\necho hi\n").expect("main");
        fs::set_permissions(
            rootfs.join("app/main.sh"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        image.layer();
        image.config(&["--config.entrypoint", "/app/main.sh"]);
        let digest = registry.push(&image.layout, image.tag(), "team/app", "1.0", &[]);
        Some(SignedImage {
            registry,
            fx,
            trust,
            digest,
        })
    }

    /// A key pair the node trusts, `<trust>/<name>.pub`.
    fn trusted_key(&self, name: &str) -> KeyPair {
        KeyPair::generate(&self.trust, name)
    }

    /// Pushes cosign's signature manifest for the image, vouching for
    /// `signed_digest`, made by `key`.
    fn sign(&self, signed_digest: &str, key: &KeyPair) {
        signing::sign_image(
            &self.registry,
            &self.fx.outside("signatures"),
            "team/app",
            &self.digest,
            signed_digest,
            key,
        );
    }

    /// A stager trusting the keys, and requiring signatures when `require`.
    fn stager(&self, require: bool) -> Stager {
        stager(
            &self.fx,
            Some(&self.registry),
            TrustPolicy {
                keys: Some(self.trust.clone()),
                require_signatures: require,
            },
        )
    }

    /// Stages the image, naming `signed_by`.
    async fn stage(
        &self,
        stager: &Stager,
        signed_by: Option<&str>,
    ) -> Result<genswap_store::Staged, StageError> {
        let reference = format!("{}/team/app@sha256:{}", self.registry.addr, self.digest);
        stager
            .stage(&BuildSpec {
                id: "signed-1".into(),
                artifact: Artifact {
                    image: Some(reference),
                    ..Artifact::default()
                },
                sha256: self.digest.clone(),
                entrypoint: None,
                signed_by: signed_by.map(str::to_string),
                signature: None,
            })
            .await
    }
}

/// The signature refusal `result` is, and whether it is the build's fault.
fn trust_error(result: Result<genswap_store::Staged, StageError>) -> (TrustError, bool) {
    let error = match result {
        Ok(staged) => panic!("expected a signature refusal, staged {staged:?}"),
        Err(error) => error,
    };
    let build_fault = error.is_build_fault();
    match error {
        StageError::Trust(error) => (error, build_fault),
        other => panic!("expected a signature refusal, got {other}"),
    }
}

#[tokio::test]
async fn an_image_signed_by_the_named_key_stages_and_is_not_fetched_again_to_swap_back() {
    let Some(mut case) = SignedImage::start() else {
        return;
    };
    let release = case.trusted_key("release");
    case.sign(&case.digest, &release);
    let stager = case.stager(false);

    let staged = case
        .stage(&stager, Some("release"))
        .await
        .expect("a signed image stages");
    assert_eq!(staged.sha256, case.digest);

    // The registry gone: the image is stored and its signature was
    // verified by this process, so swapping back to it needs no network.
    case.registry.stop();
    let again = case
        .stage(&stager, Some("release"))
        .await
        .expect("staged again without the registry");
    assert!(staged.fetched > 0, "the first stage fetched it: {staged:?}");
    assert_eq!(
        Staged {
            fetched: staged.fetched,
            ..again
        },
        staged,
        "the same entry, and nothing fetched"
    );

    // A restarted agent (a new stager over the same store) reads the
    // verification from the store: still no network needed.
    let restarted = case.stager(false);
    let after_restart = case
        .stage(&restarted, Some("release"))
        .await
        .expect("staged after a restart without the registry");
    assert_eq!(after_restart.sha256, staged.sha256);

    // A key rotated under the same name is another key: its signature is
    // looked for again, and the registry is gone.
    case.trusted_key("release");
    let rotated = case.stager(false);
    assert!(
        case.stage(&rotated, Some("release")).await.is_err(),
        "a record of the old key does not vouch for the new one"
    );
}

#[tokio::test]
async fn a_signature_made_for_another_digest_is_refused_as_over_other_bytes() {
    let Some(case) = SignedImage::start() else {
        return;
    };
    let release = case.trusted_key("release");
    let other = "0".repeat(64);
    // A real signature by the right key, stored under this image's tag,
    // vouching for another manifest.
    case.sign(&other, &release);

    let (error, build_fault) = trust_error(case.stage(&case.stager(false), Some("release")).await);
    assert!(build_fault, "{error}");
    let TrustError::OtherBytes { signed, actual, .. } = &error else {
        panic!("expected over other bytes: {error}");
    };
    assert_eq!(signed, &format!("sha256:{other}"));
    assert_eq!(actual, &format!("sha256:{}", case.digest));
    assert!(error.to_string().contains("over other bytes"), "{error}");
}

#[tokio::test]
async fn a_signature_by_another_key_is_refused_and_names_the_key_that_made_it() {
    let Some(case) = SignedImage::start() else {
        return;
    };
    let _release = case.trusted_key("release");
    // Another key the node also trusts, for other builds.
    let staging_key = case.trusted_key("staging");
    // And one it does not know at all.
    let stranger = KeyPair::generate(&case.fx.outside("elsewhere"), "stranger");
    case.sign(&case.digest, &staging_key);
    let stager = case.stager(false);

    let (error, build_fault) = trust_error(case.stage(&stager, Some("release")).await);
    assert!(build_fault, "{error}");
    let TrustError::OtherKey { key, signer, .. } = &error else {
        panic!("expected another key: {error}");
    };
    assert_eq!(key, "release");
    assert_eq!(signer.as_deref(), Some("staging"), "{error}");

    // Signed by a key the node does not hold: still another key, unnamed.
    case.sign(&case.digest, &stranger);
    let (error, _) = trust_error(case.stage(&stager, Some("release")).await);
    assert!(
        matches!(&error, TrustError::OtherKey { signer: None, .. }),
        "{error}"
    );
}

#[tokio::test]
async fn an_image_with_no_signature_is_refused_and_unsigned_builds_never_reach_the_registry() {
    let Some(mut case) = SignedImage::start() else {
        return;
    };
    let _release = case.trusted_key("release");
    let stager = case.stager(true);

    let (error, build_fault) = trust_error(case.stage(&stager, Some("release")).await);
    assert!(build_fault, "{error}");
    let TrustError::Missing { looked, .. } = &error else {
        panic!("expected no signature: {error}");
    };
    assert!(
        looked.contains(&format!("sha256-{}.sig", case.digest)),
        "{looked}"
    );
    assert!(
        case.fx.trees().is_empty(),
        "the signature is checked before the layers are fetched: {:?}",
        case.fx.trees()
    );

    // Naming no key under --require-signatures is refused before any
    // fetch: the registry is stopped and the refusal is the same.
    case.registry.stop();
    let (error, build_fault) = trust_error(case.stage(&stager, None).await);
    assert!(build_fault);
    assert!(matches!(error, TrustError::Unsigned { .. }), "{error}");
    assert!(
        case.fx.trees().is_empty(),
        "nothing of it was fetched: {:?}",
        case.fx.trees()
    );
}

/// An executable file in the staging root; its path and digest.
fn file_build(fx: &Fixture, name: &str, body: &str) -> (String, String) {
    let path = fx.staging.join(name);
    fs::write(&path, body).expect("artifact");
    fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    (path.display().to_string(), support::sha256_file(&path))
}

fn signed_file(path: &str, sha256: &str, signature: Option<String>) -> BuildSpec {
    BuildSpec {
        id: "blob-1".into(),
        artifact: Artifact {
            path: Some(path.into()),
            ..Artifact::default()
        },
        sha256: sha256.into(),
        entrypoint: None,
        signed_by: Some("release".into()),
        signature,
    }
}

#[tokio::test]
async fn a_file_signed_as_sign_blob_stages_and_a_wrong_signature_says_which_key() {
    if !test_cluster::registry::tools_installed() {
        return;
    }
    let fx = Fixture::new();
    let trust = fx.outside("trust");
    let release = KeyPair::generate(&trust, "release");
    let staging_key = KeyPair::generate(&trust, "staging");
    let body = "#!/bin/sh\necho v1\n";
    let (path, sha256) = file_build(&fx, "app-v1", body);

    // The signature beside the file, as `cosign sign-blob --output-signature`.
    fs::write(format!("{path}.sig"), release.sign(body.as_bytes())).expect("sig");
    let stager = stager(&fx, None, trusting(&trust));
    let staged = stager
        .stage(&signed_file(&path, &sha256, None))
        .await
        .expect("a signed file stages");
    assert_eq!(staged.sha256, sha256);

    // Inline in the spec, by the other trusted key.
    let (path2, sha2) = file_build(&fx, "app-v2", "#!/bin/sh\necho v2\n");
    let by_staging = staging_key.sign(b"#!/bin/sh\necho v2\n");
    let (error, build_fault) = trust_error(
        stager
            .stage(&signed_file(&path2, &sha2, Some(by_staging)))
            .await,
    );
    assert!(build_fault);
    assert!(
        matches!(&error, TrustError::OtherKey { signer: Some(s), .. } if s == "staging"),
        "{error}"
    );

    // By the right key over other bytes: a signature cannot say which of
    // the two it is, and the message names both.
    let over_v1 = release.sign(body.as_bytes());
    let (error, _) = trust_error(
        stager
            .stage(&signed_file(&path2, &sha2, Some(over_v1)))
            .await,
    );
    assert!(matches!(&error, TrustError::Unverified { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("another key, or over other bytes"),
        "{error}"
    );

    // No signature anywhere.
    let (error, _) = trust_error(stager.stage(&signed_file(&path2, &sha2, None)).await);
    assert!(matches!(&error, TrustError::Missing { .. }), "{error}");
}

#[tokio::test]
async fn keys_the_node_does_not_hold_are_refused_before_any_fetch() {
    let fx = Fixture::new();
    let trust = fx.outside("trust");
    fs::write(trust.join("README"), "not a key").expect("readme");
    let (path, sha256) = file_build(&fx, "app", "#!/bin/sh\n");

    let none = stager(&fx, None, TrustPolicy::default());
    let (error, build_fault) = trust_error(none.stage(&signed_file(&path, &sha256, None)).await);
    assert!(build_fault);
    assert!(matches!(error, TrustError::NoTrustKeys { .. }), "{error}");

    let empty = stager(&fx, None, trusting(&trust));
    let (error, _) = trust_error(empty.stage(&signed_file(&path, &sha256, None)).await);
    let TrustError::UnknownKey { known, .. } = &error else {
        panic!("expected an unknown key: {error}");
    };
    assert_eq!(known, "none");

    // A file that is not a key, named as one.
    fs::write(
        trust.join("release.pub"),
        "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
    )
    .expect("bad key");
    fs::write(format!("{path}.sig"), "MEUCIQ==").expect("sig");
    let (error, build_fault) = trust_error(empty.stage(&signed_file(&path, &sha256, None)).await);
    assert!(build_fault);
    assert!(matches!(error, TrustError::BadKey { .. }), "{error}");
    assert!(
        error.to_string().contains("release.pub"),
        "names the file: {error}"
    );
}

#[tokio::test]
async fn a_signed_archive_is_verified_over_the_bytes_it_unpacks_and_a_bad_one_unpacks_nothing() {
    if !test_cluster::registry::tools_installed() {
        return;
    }
    let fx = Fixture::new();
    let trust = fx.outside("trust");
    let release = KeyPair::generate(&trust, "release");
    let stranger = KeyPair::generate(&fx.outside("elsewhere"), "stranger");
    let src = fx.outside("src");
    support::app_tree(&src);
    let archive = fx.staging.join("app.tar.gz");
    support::gnu_tar(&src, &archive, Unpack::TarGzip);
    let sha256 = support::sha256_file(&archive);
    let bytes = fs::read(&archive).expect("archive");
    let build = |signature: String| BuildSpec {
        signed_by: Some("release".into()),
        signature: Some(signature),
        ..support::archive_build(&archive, Unpack::TarGzip, &sha256, "bin/app")
    };
    let stager = stager(&fx, None, trusting(&trust));

    // By another key: refused before anything is unpacked.
    let (error, build_fault) = trust_error(stager.stage(&build(stranger.sign(&bytes))).await);
    assert!(build_fault);
    assert!(matches!(error, TrustError::Unverified { .. }), "{error}");
    assert!(fx.trees().is_empty(), "nothing unpacked: {:?}", fx.trees());

    // By the named key: the tree is unpacked from the verified entry.
    let staged = stager
        .stage(&build(release.sign(&bytes)))
        .await
        .expect("a signed archive stages");
    assert_eq!(staged.sha256, sha256);
    assert!(staged.tree.is_some());
    assert_eq!(fx.trees().len(), 1, "{:?}", fx.trees());
    assert!(fx.leftovers().is_empty(), "{:?}", fx.leftovers());
}
