//! Staging: resolve an artifact, copy it into the agent's content-addressed
//! store while hashing it, and refuse anything that is not exactly the build
//! the attempt pinned (SPEC §5.5 step 1, §5.14, §7).
//!
//! A single-file build is copied whole; an archive (`artifact.unpack`) is
//! hashed and unpacked in the same pass into a tree ([`crate::tree`],
//! [`crate::unpack`]), and what runs is its `build.entrypoint`.
//!
//! The bytes hashed are the bytes executed. A path artifact is opened once
//! and read from that one descriptor into a temp file in the store; a URL
//! artifact is streamed into one. The temp file is fsynced, its digest
//! compared with the pinned one, made mode 0555 and only then given its
//! name, `<store>/sha256-<hex>`, in a directory only the agent's user can
//! write (0711). The engine executes that store path, never the source, so
//! replacing or rewriting the source after staging changes nothing.
//!
//! Every [`StageError`] is a refusal before anything of the build ran, and
//! its message names the file or URL and the rule it broke.
//! [`StageError::is_build_fault`] tells the one classifier (SPEC §5.4)
//! which refusals are the build's own (bytes that are not the pinned ones,
//! an archive entry refused, an entrypoint that cannot run: `failed`, held
//! down) and which are the host's or the source's (a missing file, a server
//! that does not answer: `abandoned`, tried again).

mod trees;

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use genswap_crds::{Artifact, BuildSpec};
use tokio::sync::mpsc;

use crate::archive::Chunk;
use crate::error::StageError;
use crate::progress::{self, FetchProgress};
use crate::registry::{Registries, RegistrySettings};
use crate::retention::{RetentionPolicy, RetentionReport};
use crate::store::EntryWriter;
use crate::store::Store;
use crate::trust::{self, TrustError, TrustPolicy, TrustedKey};
use crate::unpack::TreeLimits;

/// The default cap on an artifact's size.
pub const DEFAULT_MAX_ARTIFACT_BYTES: u64 = 1 << 30;

pub(crate) const COPY_BUFFER: usize = 64 * 1024;

/// The largest detached signature read: a base64 ECDSA or RSA signature
/// is well under 1 KiB.
const MAX_SIGNATURE_BYTES: u64 = 64 * 1024;

/// What staging produced: the store file the engine executes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Staged {
    /// What the engine executes: `<store>/sha256-<hex>` for a single file,
    /// the entrypoint's real path inside a stored tree for an archive.
    pub path: PathBuf,
    /// Lowercase hex sha256 of the artifact, equal to the pinned digest.
    pub sha256: String,
    /// The artifact's size; for a tree, the bytes of its files.
    pub bytes: u64,
    /// For a tree build: the tree's root (`<store>/tree-sha256-<hex>/rootfs`).
    pub tree: Option<PathBuf>,
    /// What an image's config adds to the spec's process.
    pub run: RunDefaults,
    /// Bytes this stage fetched from a URL or a registry: 0 when the store
    /// held the build (or it was read from a path on the node).
    pub fetched: u64,
}

/// What an image's config gives a generation unless the spec says
/// otherwise, as a container runtime uses it: the rest of `Entrypoint`
/// always, `Cmd` when `process.args` is empty, `Env` under the spec's
/// variables, `WorkingDir` (inside the tree) when the spec has none. A
/// `build.entrypoint` replaces `Entrypoint` and `Cmd`, as a pod's `command`
/// does. The image's `User` is never used.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunDefaults {
    /// The program as the build names it (`build.entrypoint`, or the
    /// config's first word), given to it as `argv[0]` as a container
    /// runtime does: a multi-call program reached through a link (busybox's
    /// `/bin/sh` in Alpine's images) learns from it what to be.
    pub argv0: Option<String>,
    /// Arguments that always follow the executable (`Entrypoint[1..]`).
    pub args: Vec<String>,
    /// Arguments used when the spec gives none (`Cmd`).
    pub cmd: Vec<String>,
    /// `Env`, in order.
    pub env: Vec<(String, String)>,
    /// `WorkingDir`, resolved inside the tree.
    pub working_dir: Option<PathBuf>,
}

impl Staged {
    /// The arguments after the executable, given the spec's.
    pub fn args(&self, spec_args: &[String]) -> Vec<String> {
        let mut args = self.run.args.clone();
        if spec_args.is_empty() {
            args.extend(self.run.cmd.iter().cloned());
        } else {
            args.extend(spec_args.iter().cloned());
        }
        args
    }

    /// The environment, given the spec's: the image's variables first, each
    /// replaced by the spec's of the same name.
    pub fn env(&self, spec_env: Vec<(String, String)>) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = self
            .run
            .env
            .iter()
            .filter(|(name, _)| !spec_env.iter().any(|(theirs, _)| theirs == name))
            .cloned()
            .collect();
        env.extend(spec_env);
        env
    }
}

/// How the [`Stager`] resolves and fetches artifacts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagerConfig {
    /// Path artifacts must resolve inside this directory.
    pub staging_root: PathBuf,
    /// The largest artifact accepted, path or URL.
    pub max_bytes: u64,
    /// TCP (and TLS) connect timeout for URL artifacts.
    pub connect_timeout: Duration,
    /// The whole download of a URL artifact, headers and body.
    pub download_timeout: Duration,
    /// What an unpacked tree may hold (`--max-tree-bytes`,
    /// `--max-tree-entries`).
    pub tree_limits: TreeLimits,
    /// Credentials, CA and plain-HTTP hosts for images.
    pub registries: RegistrySettings,
    /// What the store keeps (`--store-keep`, `--store-max-bytes`).
    pub retention: RetentionPolicy,
    /// The signatures builds must carry (`--trust-keys`,
    /// `--require-signatures`).
    pub trust: TrustPolicy,
}

impl StagerConfig {
    /// Defaults: a 1 GiB cap on what is read, 10 s to connect, 5 min to
    /// download, and [`TreeLimits::default`].
    pub fn new(staging_root: impl Into<PathBuf>) -> Self {
        Self {
            staging_root: staging_root.into(),
            max_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
            connect_timeout: Duration::from_secs(10),
            download_timeout: Duration::from_secs(300),
            tree_limits: TreeLimits::default(),
            registries: RegistrySettings::default(),
            retention: RetentionPolicy::default(),
            trust: TrustPolicy::default(),
        }
    }
}

/// Resolves, verifies and stores artifacts. Cheap to clone (shared inside).
#[derive(Clone, Debug)]
pub struct Stager {
    inner: Arc<StagerInner>,
}

#[derive(Debug)]
struct StagerInner {
    store: Store,
    config: StagerConfig,
    /// The staging root with every symlink resolved.
    root: PathBuf,
    http: reqwest::Client,
    /// One unpack at a time per digest: two instances naming the same
    /// archive wait for one tree instead of making two.
    tree_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    registries: Registries,
    /// The builds whose signature this process has verified, by digest and
    /// key: a swap back to one needs no registry.
    verified: Mutex<HashSet<(String, [u8; 32])>>,
}

impl Stager {
    /// A stager over `store`. The staging root must exist.
    pub fn new(store: Store, config: StagerConfig) -> Result<Self, StageError> {
        let root =
            fs::canonicalize(&config.staging_root).map_err(|source| StageError::StagingRoot {
                root: config.staging_root.clone(),
                source,
            })?;
        install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .timeout(config.download_timeout)
            .build()
            .map_err(StageError::Client)?;
        let registries = Registries::new(config.registries.clone(), config.connect_timeout)?;
        Ok(Self {
            inner: Arc::new(StagerInner {
                store,
                config,
                root,
                http,
                tree_locks: Mutex::new(HashMap::new()),
                registries,
                verified: Mutex::new(HashSet::new()),
            }),
        })
    }

    /// The store entries are written to.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The configuration.
    pub fn config(&self) -> &StagerConfig {
        &self.inner.config
    }

    /// Stages `build` (its path or its URL; a file, or an archive unpacked
    /// into a tree) and verifies it against its pinned digest. The file
    /// I/O runs on tokio's blocking pool.
    ///
    /// A build that must be signed (`build.signedBy`, or the node's
    /// `--require-signatures`) is refused before anything is fetched when
    /// it names no key or a key the node lacks, and after staging unless
    /// its signature verifies over the staged bytes.
    pub async fn stage(&self, build: &BuildSpec) -> Result<Staged, StageError> {
        self.stage_watched(build, &FetchProgress::new()).await
    }

    /// [`Stager::stage`], counting what it fetches into `progress` as the
    /// bytes arrive.
    pub async fn stage_watched(
        &self,
        build: &BuildSpec,
        progress: &FetchProgress,
    ) -> Result<Staged, StageError> {
        let before = progress.fetched();
        let mut staged = progress.scope(self.stage_counted(build)).await?;
        staged.fetched = progress.fetched().saturating_sub(before);
        Ok(staged)
    }

    async fn stage_counted(&self, build: &BuildSpec) -> Result<Staged, StageError> {
        let key = self.inner.config.trust.requirement(build)?;
        // An image's signature vouches for the digest its manifest is
        // pinned by, which staging then holds every byte to: it is checked
        // first, so nothing of an image signed wrongly is fetched. A file's
        // signature is over its bytes, checked on the entry that runs.
        // An archive's is over the archive's bytes, which unpacking does
        // not keep: it is stored whole first, verified, and the tree
        // unpacked from that entry, so what is verified is what is
        // unpacked and nothing of a wrongly signed archive is unpacked.
        let mut verified_archive = None;
        match (&key, &build.artifact.image, build.artifact.unpack) {
            (Some(key), Some(image), _) => self.verify_image_signature(build, image, key).await?,
            (Some(key), None, Some(_)) => {
                verified_archive = self.verified_archive(build, key).await?;
            }
            _ => {}
        }
        let staged = self.stage_build(build, verified_archive.as_deref()).await?;
        if let (Some(key), None, None) = (&key, &build.artifact.image, build.artifact.unpack) {
            self.verify_file_signature(build, &staged, key).await?;
        }
        self.inner.store.used(&staged.sha256);
        Ok(staged)
    }

    /// Whether `sha256` was verified with `key` already: by this process,
    /// or into the store by one before it.
    fn verified(&self, sha256: &str, key: &TrustedKey) -> bool {
        let fingerprint = key.fingerprint();
        let mut verified = self
            .inner
            .verified
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if verified.contains(&(sha256.to_string(), fingerprint)) {
            return true;
        }
        let recorded = self
            .inner
            .store
            .signature_verified(sha256, &hex::encode(fingerprint));
        if recorded {
            verified.insert((sha256.to_string(), fingerprint));
        }
        recorded
    }

    fn remember_verified(&self, sha256: &str, key: &TrustedKey) {
        let fingerprint = key.fingerprint();
        self.inner
            .store
            .remember_signature(sha256, &hex::encode(fingerprint));
        self.inner
            .verified
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((sha256.to_string(), fingerprint));
    }

    async fn verify_image_signature(
        &self,
        build: &BuildSpec,
        image: &str,
        key: &TrustedKey,
    ) -> Result<(), StageError> {
        if self.verified(&build.sha256, key) {
            return Ok(());
        }
        let name = format!("image {image}");
        let (fetched, looked) = self
            .inner
            .registries
            .signatures(image, &build.sha256)
            .await
            .map_err(|reason| TrustError::Fetch {
                build: name.clone(),
                reason,
            })?;
        trust::judge_image(
            &self.inner.config.trust,
            &name,
            key,
            &build.sha256,
            fetched,
            &looked,
        )?;
        self.remember_verified(&build.sha256, key);
        Ok(())
    }

    /// The store entry of a signed archive, verified; none when this
    /// process verified its digest with `key` already.
    async fn verified_archive(
        &self,
        build: &BuildSpec,
        key: &TrustedKey,
    ) -> Result<Option<PathBuf>, StageError> {
        if self.verified(&build.sha256, key) {
            return Ok(None);
        }
        let entry = match (&build.artifact.path, &build.artifact.url) {
            (Some(path), None) => {
                let this = self.clone();
                let (path, expected) = (path.clone(), build.sha256.clone());
                tokio::task::spawn_blocking(move || {
                    this.store_path_blocking(&path, &expected, false)
                })
                .await
                .map_err(|e| StageError::Task(e.to_string()))??
            }
            (None, Some(url)) => self.stage_url(url, &build.sha256).await?,
            (Some(_), Some(_)) => return Err(StageError::BothSources),
            (None, None) => return Err(StageError::NoSource),
        };
        self.verify_file_signature(build, &entry, key).await?;
        Ok(Some(entry.path))
    }

    async fn verify_file_signature(
        &self,
        build: &BuildSpec,
        staged: &Staged,
        key: &TrustedKey,
    ) -> Result<(), StageError> {
        if self.verified(&staged.sha256, key) {
            return Ok(());
        }
        let (signature, source_name) = self.blob_signature(build).await?;
        let this = self.clone();
        let (key, entry) = (key.clone(), staged.path.clone());
        let name = artifact_name(&build.artifact);
        let sha256 = staged.sha256.clone();
        tokio::task::spawn_blocking(move || {
            let file = File::open(&entry).map_err(|source| StageError::Unreadable {
                path: entry.display().to_string(),
                source,
            })?;
            // SAFETY: the entry is a finished store file, mode 0555 in a
            // directory only the agent writes; the store never writes an
            // entry in place (a new one is renamed over the name), so the
            // mapped bytes cannot change while they are read.
            let bytes =
                unsafe { memmap2::Mmap::map(&file) }.map_err(|source| StageError::Unreadable {
                    path: entry.display().to_string(),
                    source,
                })?;
            trust::judge_blob(
                &this.inner.config.trust,
                &name,
                &key,
                &signature,
                &source_name,
                &bytes,
            )?;
            this.remember_verified(&sha256, &key);
            Ok::<(), StageError>(())
        })
        .await
        .map_err(|e| StageError::Task(e.to_string()))?
    }

    /// A file's detached signature: `build.signature`, else the file
    /// beside the artifact (`<url>.sig`, `<path>.sig`).
    async fn blob_signature(&self, build: &BuildSpec) -> Result<(String, String), StageError> {
        if let Some(signature) = &build.signature {
            return Ok((signature.clone(), "build.signature".into()));
        }
        let missing = |looked: String| TrustError::Missing {
            build: artifact_name(&build.artifact),
            looked,
        };
        if let Some(path) = &build.artifact.path {
            let sig_path = format!("{path}.sig");
            let this = self.clone();
            let read = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, StageError> {
                let (mut file, _) = this.open_checked(&sig_path, false)?;
                let mut bytes = Vec::new();
                (&mut file)
                    .take(MAX_SIGNATURE_BYTES)
                    .read_to_end(&mut bytes)
                    .map_err(|source| StageError::Unreadable {
                        path: sig_path.clone(),
                        source,
                    })?;
                Ok(bytes)
            })
            .await
            .map_err(|e| StageError::Task(e.to_string()))?;
            return match read {
                Ok(bytes) => Ok((
                    String::from_utf8_lossy(&bytes).into_owned(),
                    format!("{path}.sig"),
                )),
                Err(StageError::Missing { path }) => Err(missing(format!(
                    "{path} does not exist, and build.signature is not set"
                ))
                .into()),
                Err(other) => Err(other),
            };
        }
        let Some(url) = &build.artifact.url else {
            return Err(StageError::NoSource);
        };
        let (mut parsed, _) = parse_url(url)?;
        parsed.set_path(&format!("{}.sig", parsed.path()));
        let shown = redacted(&parsed);
        let fetch = |reason: String| TrustError::Fetch {
            build: artifact_name(&build.artifact),
            reason: format!("{shown}: {reason}"),
        };
        let response = self
            .inner
            .http
            .get(parsed.clone())
            .send()
            .await
            .map_err(|e| fetch(e.without_url().to_string()))?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Err(missing(format!(
                "{shown} answered 404, and build.signature is not set"
            ))
            .into());
        }
        if !response.status().is_success() {
            return Err(fetch(format!("answered {}", response.status().as_u16())).into());
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| fetch(e.without_url().to_string()))?;
        if bytes.len() as u64 > MAX_SIGNATURE_BYTES {
            return Err(TrustError::Malformed {
                build: artifact_name(&build.artifact),
                source_name: shown,
                reason: format!("it is larger than {MAX_SIGNATURE_BYTES} bytes"),
            }
            .into());
        }
        Ok((String::from_utf8_lossy(&bytes).into_owned(), shown))
    }

    /// Removes what the store's retention policy does not keep (see
    /// [`crate::retention`]): never a digest in `protected`, nor a tree
    /// being staged now. Blocking file I/O.
    pub fn collect(&self, protected: &HashSet<String>) -> io::Result<RetentionReport> {
        let mut protected = protected.clone();
        {
            let locks = self
                .inner
                .tree_locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (sha256, lock) in locks.iter() {
                if lock.try_lock().is_err() {
                    protected.insert(sha256.clone());
                }
            }
        }
        self.inner
            .store
            .collect(&protected, self.inner.config.retention)
    }

    /// `verified_archive`: the store entry of an archive whose signature
    /// was verified, unpacked instead of its source.
    async fn stage_build(
        &self,
        build: &BuildSpec,
        verified_archive: Option<&Path>,
    ) -> Result<Staged, StageError> {
        let artifact = &build.artifact;
        let entrypoint = build.entrypoint.as_deref();
        if artifact.image.is_some() {
            return self
                .stage_tree(artifact, None, &build.sha256, entrypoint, None)
                .await;
        }
        match (artifact.unpack, entrypoint) {
            (None, None) => self.stage_file(artifact, &build.sha256).await,
            (None, Some(_)) => Err(StageError::EntrypointWithoutTree),
            (Some(format), entrypoint) => {
                self.stage_tree(
                    artifact,
                    Some(format),
                    &build.sha256,
                    entrypoint,
                    verified_archive,
                )
                .await
            }
        }
    }

    /// Stages a single-file artifact (its path or its URL).
    pub async fn stage_file(
        &self,
        artifact: &Artifact,
        expected_sha256: &str,
    ) -> Result<Staged, StageError> {
        match (&artifact.path, &artifact.url) {
            (Some(path), None) => {
                let this = self.clone();
                let path = path.clone();
                let expected = expected_sha256.to_string();
                tokio::task::spawn_blocking(move || this.stage_path_blocking(&path, &expected))
                    .await
                    .map_err(|e| StageError::Task(e.to_string()))?
            }
            (None, Some(url)) => self.stage_url(url, expected_sha256).await,
            (Some(_), Some(_)) => Err(StageError::BothSources),
            (None, None) => Err(StageError::NoSource),
        }
    }

    /// Stages a path artifact on the calling thread (blocking file I/O).
    ///
    /// The rules, each its own refusal: absolute; no `..` component;
    /// resolving every symlink, inside the staging root (a symlink that
    /// stays inside is fine); exists; a regular file; readable; an exec bit;
    /// not empty; not above the size cap; the pinned digest. The file is
    /// opened once, and the checks after the open and the copy read that one
    /// descriptor, so a file swapped after the checks is not what is copied.
    pub fn stage_path_blocking(
        &self,
        path: &str,
        expected_sha256: &str,
    ) -> Result<Staged, StageError> {
        self.store_path_blocking(path, expected_sha256, true)
    }

    /// [`Stager::stage_path_blocking`]; an archive (`executable: false`)
    /// needs no exec bit.
    fn store_path_blocking(
        &self,
        path: &str,
        expected_sha256: &str,
        executable: bool,
    ) -> Result<Staged, StageError> {
        check_digest(expected_sha256)?;
        let (file, size) = self.open_checked(path, executable)?;
        // Every check of the source above still runs; what a hit skips is
        // reading it. The entry, not the source, is what runs, and it still
        // holds the bytes hashed as the pinned digest.
        if let Some(staged) = self.inner.store.verified_hit(expected_sha256, size) {
            return Ok(staged);
        }
        let mut entry = self
            .inner
            .store
            .begin(self.inner.config.max_bytes, path.to_string())?;
        copy_into(file, size, path, &mut entry)?;
        entry.finish(expected_sha256)
    }

    /// Resolves `path` under the staging root and opens it for the copy.
    /// An archive (`executable: false`) needs no exec bit.
    fn open_checked(&self, path: &str, executable: bool) -> Result<(File, u64), StageError> {
        let owned = || path.to_string();
        let lexical = Path::new(path);
        if !lexical.is_absolute() {
            return Err(StageError::NotAbsolute { path: owned() });
        }
        if lexical.components().any(|c| c == Component::ParentDir) {
            return Err(StageError::ParentComponent { path: owned() });
        }
        let resolved = fs::canonicalize(lexical).map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => StageError::Missing { path: owned() },
            _ => StageError::Inaccessible {
                path: owned(),
                source,
            },
        })?;
        self.check_inside_root(path, &resolved)?;

        // O_NOFOLLOW: the last component cannot have become a symlink since
        // it was resolved. O_NONBLOCK: opening a FIFO does not wait for a
        // writer (it is then refused as not a regular file).
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(&resolved)
            .map_err(|source| match source.kind() {
                io::ErrorKind::NotFound => StageError::Missing { path: owned() },
                _ => StageError::Unreadable {
                    path: owned(),
                    source,
                },
            })?;
        // Where the descriptor really points, in case a directory on the
        // way was swapped for a symlink after the resolve.
        if let Ok(opened) = fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
            self.check_inside_root(path, &opened)?;
        }
        let meta = file.metadata().map_err(|source| StageError::Unreadable {
            path: owned(),
            source,
        })?;
        let kind = meta.file_type();
        if kind.is_dir() {
            return Err(StageError::IsDirectory { path: owned() });
        }
        if !kind.is_file() {
            return Err(StageError::NotRegularFile {
                path: owned(),
                kind: file_kind(&kind),
            });
        }
        if meta.len() == 0 {
            return Err(StageError::Empty { path: owned() });
        }
        if executable && meta.mode() & 0o111 == 0 {
            return Err(StageError::NotExecutable {
                path: owned(),
                mode: meta.mode() & 0o7777,
            });
        }
        if meta.len() > self.inner.config.max_bytes {
            return Err(StageError::TooLarge {
                source_name: owned(),
                limit: self.inner.config.max_bytes,
                size: Some(meta.len()),
            });
        }
        Ok((file, meta.len()))
    }

    fn check_inside_root(&self, path: &str, resolved: &Path) -> Result<(), StageError> {
        let root = &self.inner.root;
        if resolved.starts_with(root) {
            return Ok(());
        }
        let lexical = Path::new(path);
        if lexical.starts_with(&self.inner.config.staging_root) || lexical.starts_with(root) {
            Err(StageError::EscapingSymlink {
                path: path.to_string(),
                resolved: resolved.to_path_buf(),
                root: self.inner.config.staging_root.clone(),
            })
        } else {
            Err(StageError::OutsideRoot {
                path: path.to_string(),
                root: self.inner.config.staging_root.clone(),
            })
        }
    }

    /// Downloads an http or https artifact into the store, refusing a
    /// non-2xx answer, a declared or streamed size above the cap, and a
    /// download that exceeds its timeouts.
    pub async fn stage_url(&self, url: &str, expected_sha256: &str) -> Result<Staged, StageError> {
        check_digest(expected_sha256)?;
        let (parsed, shown) = parse_url(url)?;
        let limit = self.inner.config.max_bytes;

        // The writer runs on the blocking pool and finishes only on `Done`:
        // a download that fails leaves it to delete its temp file.
        let (chunks, mut received) = mpsc::channel::<Chunk>(16);
        let inner = self.inner.clone();
        let expected = expected_sha256.to_string();
        let source_name = shown.clone();
        let writer = tokio::task::spawn_blocking(move || {
            let mut entry = inner.store.begin(limit, source_name)?;
            while let Some(chunk) = received.blocking_recv() {
                match chunk {
                    Chunk::Data(bytes) => entry.write(&bytes)?,
                    Chunk::Done => return entry.finish(&expected).map(Some),
                }
            }
            Ok(None)
        });

        let after = self.inner.config.download_timeout;
        let download = tokio::time::timeout(after, self.download(parsed, &shown, &chunks)).await;
        drop(chunks);
        let written = writer.await.map_err(|e| StageError::Task(e.to_string()))?;
        match download {
            Err(_) => Err(StageError::Timeout { url: shown, after }),
            Ok(Err(download_error)) => Err(written.err().unwrap_or(download_error)),
            Ok(Ok(())) => written?.ok_or_else(|| {
                StageError::Task("the store writer stopped before the download ended".into())
            }),
        }
    }

    /// Streams the body into `chunks`, then sends `Done`.
    async fn download(
        &self,
        url: reqwest::Url,
        shown: &str,
        chunks: &mpsc::Sender<Chunk>,
    ) -> Result<(), StageError> {
        let limit = self.inner.config.max_bytes;
        let after = self.inner.config.download_timeout;
        let fail = |source: reqwest::Error| {
            if source.is_timeout() {
                StageError::Timeout {
                    url: shown.to_string(),
                    after,
                }
            } else {
                StageError::Download {
                    url: shown.to_string(),
                    source: source.without_url(),
                }
            }
        };
        let mut response = self.inner.http.get(url).send().await.map_err(fail)?;
        let status = response.status();
        if !status.is_success() {
            return Err(StageError::HttpStatus {
                url: shown.to_string(),
                status: status.as_u16(),
            });
        }
        if let Some(declared) = response.content_length() {
            progress::expect(declared);
        }
        if let Some(declared) = response.content_length()
            && declared > limit
        {
            return Err(StageError::TooLarge {
                source_name: shown.to_string(),
                limit,
                size: Some(declared),
            });
        }
        let mut total = 0u64;
        while let Some(bytes) = response.chunk().await.map_err(fail)? {
            progress::fetched(bytes.len());
            total = total.saturating_add(u64::try_from(bytes.len()).unwrap_or(u64::MAX));
            if total > limit {
                return Err(StageError::TooLarge {
                    source_name: shown.to_string(),
                    limit,
                    size: None,
                });
            }
            if chunks.send(Chunk::Data(bytes)).await.is_err() {
                // The writer stopped; its error is the one reported.
                return Err(StageError::Task("the store writer stopped".into()));
            }
        }
        if total == 0 {
            return Err(StageError::Empty {
                path: shown.to_string(),
            });
        }
        let _ = chunks.send(Chunk::Done).await;
        Ok(())
    }
}

/// A path or URL artifact as messages name it.
fn artifact_name(artifact: &Artifact) -> String {
    match (&artifact.path, &artifact.url) {
        (Some(path), _) => format!("artifact {path}"),
        (None, Some(url)) => match parse_url(url) {
            Ok((_, shown)) => format!("artifact {shown}"),
            Err(_) => "the artifact".into(),
        },
        (None, None) => "the artifact".into(),
    }
}

/// An http or https URL, and the way messages show it.
pub(crate) fn parse_url(url: &str) -> Result<(reqwest::Url, String), StageError> {
    let parsed = reqwest::Url::parse(url).map_err(|e| StageError::UnsupportedUrl {
        url: url.to_string(),
        reason: e.to_string(),
    })?;
    let shown = redacted(&parsed);
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(StageError::UnsupportedUrl {
            url: shown,
            reason: format!("scheme {:?} is not http or https", parsed.scheme()),
        });
    }
    Ok((parsed, shown))
}

/// Reads `file` to its end into `entry`. `size` is only the expected length:
/// the cap is enforced on what is actually read.
fn copy_into(
    mut file: File,
    size: u64,
    path: &str,
    entry: &mut EntryWriter<'_>,
) -> Result<(), StageError> {
    let mut buffer =
        vec![0u8; COPY_BUFFER.min(usize::try_from(size).unwrap_or(COPY_BUFFER).max(1))];
    loop {
        match file.read(&mut buffer) {
            Ok(0) => return Ok(()),
            Ok(n) => entry.write(&buffer[..n])?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(StageError::Unreadable {
                    path: path.to_string(),
                    source,
                });
            }
        }
    }
}

pub(crate) fn check_digest(expected: &str) -> Result<(), StageError> {
    let valid = expected.len() == 64
        && expected
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if valid {
        Ok(())
    } else {
        Err(StageError::InvalidDigest {
            expected: expected.to_string(),
        })
    }
}

fn file_kind(kind: &fs::FileType) -> &'static str {
    if kind.is_fifo() {
        "FIFO"
    } else if kind.is_socket() {
        "socket"
    } else if kind.is_block_device() {
        "block device"
    } else if kind.is_char_device() {
        "character device"
    } else if kind.is_symlink() {
        "symlink"
    } else {
        "special file"
    }
}

/// The URL as messages show it: no credentials, no query (a signed URL's
/// query is a secret), no fragment.
fn redacted(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.set_query(None);
    shown.set_fragment(None);
    shown.to_string()
}

/// Installs aws-lc-rs as the process's rustls crypto provider unless one
/// is already installed. reqwest is built without a provider of its own
/// (see the workspace's Cargo.toml), so anything that builds a reqwest
/// client calls this first.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_must_be_64_lowercase_hex() {
        assert!(check_digest(&"a".repeat(64)).is_ok());
        for bad in [
            "",
            "A".repeat(64).as_str(),
            "g".repeat(64).as_str(),
            "a".repeat(63).as_str(),
        ] {
            assert!(
                matches!(check_digest(bad), Err(StageError::InvalidDigest { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn urls_in_messages_carry_no_secrets() {
        let url = reqwest::Url::parse("https://user:pw@example.invalid/a/b?sig=secret#frag")
            .expect("url");
        assert_eq!(redacted(&url), "https://example.invalid/a/b");
    }
}
