//! The tree sources of the stager: archives by path or URL and images
//! from a registry, each unpacked in one pass into a tree of the store,
//! and what runs in a stored tree.

use std::fs::{self};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::PoisonError;

use genswap_crds::{Artifact, Unpack};
use tokio::sync::mpsc;

use crate::archive::{self, Chunk, ChunkReader, Hashing};
use crate::error::StageError;
use crate::progress;
use crate::registry::{ImageConfig, RegistryError, Resolved};
use crate::tree::{self, TreeBuild, TreeRecord};
use crate::unpack::UnpackError;

use super::{RunDefaults, Staged, Stager, check_digest, parse_url};

impl Stager {
    /// Stages an archive (`format`) or an image into a tree, unless the
    /// tree of its digest is stored and whole already (then no source is
    /// read), and resolves what to run in it.
    pub(super) async fn stage_tree(
        &self,
        artifact: &Artifact,
        format: Option<Unpack>,
        expected_sha256: &str,
        entrypoint: Option<&str>,
        verified_archive: Option<&Path>,
    ) -> Result<Staged, StageError> {
        check_digest(expected_sha256)?;
        let lock = {
            let mut locks = self
                .inner
                .tree_locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            locks
                .entry(expected_sha256.to_string())
                .or_default()
                .clone()
        };
        let _one_at_a_time = lock.lock().await;
        let this = self.clone();
        let expected = expected_sha256.to_string();
        let hit = tokio::task::spawn_blocking(move || this.inner.store.tree_hit(&expected))
            .await
            .map_err(|e| StageError::Task(e.to_string()))??;
        let record = match (hit, verified_archive, format) {
            (Some(record), _, _) => record,
            (None, Some(entry), Some(format)) => {
                self.unpack_entry(entry, format, expected_sha256, artifact)
                    .await?
            }
            (None, _, _) => match (&artifact.path, &artifact.url, &artifact.image, format) {
                (Some(path), None, None, Some(format)) => {
                    let this = self.clone();
                    let (path, expected) = (path.clone(), expected_sha256.to_string());
                    tokio::task::spawn_blocking(move || {
                        this.unpack_path_blocking(&path, format, &expected)
                    })
                    .await
                    .map_err(|e| StageError::Task(e.to_string()))??
                }
                (None, Some(url), None, Some(format)) => {
                    self.unpack_url(url, format, expected_sha256).await?
                }
                (None, None, Some(image), None) => {
                    self.unpack_image(image, expected_sha256).await?
                }
                (None, None, None, _) => return Err(StageError::NoSource),
                _ => return Err(StageError::BothSources),
            },
        };
        let tree = self.inner.store.tree_path(expected_sha256);
        let rootfs =
            fs::canonicalize(tree.join(tree::ROOTFS)).map_err(|source| StageError::Tree {
                path: tree.clone(),
                source,
            })?;
        let (path, run) = run_in_tree(&rootfs, &record, entrypoint)?;
        Ok(Staged {
            path,
            sha256: record.sha256,
            bytes: record.bytes,
            tree: Some(rootfs),
            run,
            fetched: 0,
        })
    }

    /// Pulls an image's layers into a new tree, one after the other, each
    /// streamed from the registry through its hash and decompressor into
    /// the unpacker.
    async fn unpack_image(
        &self,
        image: &str,
        expected_sha256: &str,
    ) -> Result<TreeRecord, StageError> {
        use futures::StreamExt;
        let registries = &self.inner.registries;
        let resolved = registries.resolve(image, expected_sha256).await?;
        let Resolved {
            reference,
            layers,
            config,
            platform,
            ..
        } = &resolved;
        let (config, platform) = (config.clone(), platform.clone());
        let store_dir = self.inner.store.dir().to_path_buf();
        let tree_error = |source| StageError::Tree {
            path: store_dir.clone(),
            source,
        };
        let mut build =
            TreeBuild::begin(&store_dir, self.inner.config.tree_limits).map_err(tree_error)?;
        let unavailable = |answered: String| {
            StageError::Registry(RegistryError::Unavailable {
                registry: reference.resolve_registry().to_string(),
                reference: image.to_string(),
                answered,
            })
        };
        let after = self.inner.config.download_timeout;
        for layer in layers {
            progress::expect(u64::try_from(layer.descriptor.size).unwrap_or(0));
        }
        for layer in layers {
            let size = u64::try_from(layer.descriptor.size).unwrap_or(0);
            let limit = size.min(self.inner.config.max_bytes);
            if size > self.inner.config.max_bytes {
                return Err(StageError::TooLarge {
                    source_name: format!("{image} {}", layer.name),
                    limit: self.inner.config.max_bytes,
                    size: Some(size),
                });
            }
            let (chunks, received) = mpsc::channel::<Chunk>(16);
            let (format, name) = (layer.format, layer.name.clone());
            let source_name = format!("{image} {}", layer.name);
            let writer = tokio::task::spawn_blocking(move || {
                let reader = ChunkReader::new(received);
                let interrupted = reader.interrupted_flag();
                let result =
                    archive::unpack_stream(Hashing::new(reader, limit), format, &mut build, &name)
                        .and_then(|rest| {
                            rest.finish().map_err(|source| UnpackError::Read {
                                layer: name.clone(),
                                source,
                            })
                        });
                let interrupted = interrupted.load(std::sync::atomic::Ordering::Relaxed);
                (build, result, interrupted)
            });
            let download = async {
                let mut stream = resolved.layer_stream(layer).await?;
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.map_err(unavailable)?;
                    progress::fetched(chunk.len());
                    if chunks.send(Chunk::Data(chunk)).await.is_err() {
                        return Err(StageError::Task("the layer writer stopped".into()));
                    }
                }
                let _ = chunks.send(Chunk::Done).await;
                Ok(())
            };
            let downloaded = tokio::time::timeout(after, download).await;
            drop(chunks);
            let (returned, written, interrupted) =
                writer.await.map_err(|e| StageError::Task(e.to_string()))?;
            build = returned;
            let unpack_error = |error| StageError::Unpack {
                source_name: source_name.clone(),
                format: archive::format_name(format),
                error,
            };
            let (actual, bytes) = match (downloaded, written) {
                (Err(_), _) => {
                    return Err(unavailable(format!(
                        "{} did not arrive within {after:?}",
                        layer.name
                    )));
                }
                // The layer's own fault stopped the writer first.
                (_, Err(error)) if !interrupted && error.is_archive_fault() => {
                    return Err(unpack_error(error));
                }
                (Ok(Err(download_error)), _) => return Err(download_error),
                (Ok(Ok(())), Err(error)) => return Err(unpack_error(error)),
                (Ok(Ok(())), Ok(done)) => done,
            };
            let want = layer
                .descriptor
                .digest
                .strip_prefix("sha256:")
                .unwrap_or_default();
            if actual != want || bytes != size {
                return Err(unavailable(format!(
                    "served {bytes} bytes of sha256:{actual} for {}, not its {size} bytes",
                    layer.name
                )));
            }
        }
        let mut record = TreeRecord {
            sha256: expected_sha256.to_string(),
            source: image.to_string(),
            format: if config.is_some() {
                "image"
            } else {
                "artifact"
            }
            .to_string(),
            bytes: 0,
            entries: 0,
            image: config,
            platform,
        };
        let this_store = store_dir.clone();
        tokio::task::spawn_blocking(move || build.finish(&mut record).map(|_| record))
            .await
            .map_err(|e| StageError::Task(e.to_string()))?
            .map_err(|error| match error {
                tree::FinishError::Unpack(error) => StageError::Unpack {
                    source_name: image.to_string(),
                    format: "image",
                    error,
                },
                tree::FinishError::Io(source) => StageError::Tree {
                    path: this_store,
                    source,
                },
            })
    }

    /// Unpacks an archive already in the store (an entry whose signature
    /// was verified), named in messages by its source.
    async fn unpack_entry(
        &self,
        entry: &Path,
        format: Unpack,
        expected_sha256: &str,
        artifact: &Artifact,
    ) -> Result<TreeRecord, StageError> {
        let source_name = match (&artifact.path, &artifact.url) {
            (Some(path), _) => path.clone(),
            (None, Some(url)) => parse_url(url)?.1,
            (None, None) => return Err(StageError::NoSource),
        };
        let this = self.clone();
        let (entry, expected) = (entry.to_path_buf(), expected_sha256.to_string());
        tokio::task::spawn_blocking(move || {
            let file = fs::File::open(&entry).map_err(|source| StageError::Unreadable {
                path: entry.display().to_string(),
                source,
            })?;
            let source = Hashing::new(file, this.inner.config.max_bytes);
            this.unpack_blocking(source, format, &expected, &source_name)
        })
        .await
        .map_err(|e| StageError::Task(e.to_string()))?
    }

    /// Unpacks an archive at `path` (under the staging root, by the same
    /// rules as a file, less the exec bit) into the store.
    fn unpack_path_blocking(
        &self,
        path: &str,
        format: Unpack,
        expected_sha256: &str,
    ) -> Result<TreeRecord, StageError> {
        let (file, _) = self.open_checked(path, false)?;
        let source = Hashing::new(file, self.inner.config.max_bytes);
        let over_limit = source.over_limit_flag();
        let result = self.unpack_blocking(source, format, expected_sha256, path);
        result.map_err(|error| match error {
            StageError::Unpack {
                error: UnpackError::Read { source, .. },
                ..
            } if over_limit.load(std::sync::atomic::Ordering::Relaxed) => {
                let _ = source;
                StageError::TooLarge {
                    source_name: path.to_string(),
                    limit: self.inner.config.max_bytes,
                    size: None,
                }
            }
            other => other,
        })
    }

    /// Applies one archive stream to a new tree, checks its digest, and
    /// puts the tree in place.
    fn unpack_blocking<R: Read>(
        &self,
        source: Hashing<R>,
        format: Unpack,
        expected_sha256: &str,
        source_name: &str,
    ) -> Result<TreeRecord, StageError> {
        let store = &self.inner.store;
        let tree_error = |source| StageError::Tree {
            path: store.dir().to_path_buf(),
            source,
        };
        let format_name = archive::format_name(format);
        let unpack_error = |error| StageError::Unpack {
            source_name: source_name.to_string(),
            format: format_name,
            error,
        };
        let mut build =
            TreeBuild::begin(store.dir(), self.inner.config.tree_limits).map_err(tree_error)?;
        let source = archive::unpack_stream(source, format, &mut build, "the archive")
            .map_err(unpack_error)?;
        let (actual, _) = source.finish().map_err(|source| {
            unpack_error(UnpackError::Read {
                layer: "the archive".into(),
                source,
            })
        })?;
        if actual != expected_sha256 {
            return Err(StageError::DigestMismatch {
                source_name: source_name.to_string(),
                expected: expected_sha256.to_string(),
                actual,
            });
        }
        let mut record = TreeRecord {
            sha256: actual,
            source: source_name.to_string(),
            format: format_name.to_string(),
            bytes: 0,
            entries: 0,
            image: None,
            platform: None,
        };
        build.finish(&mut record).map_err(|error| match error {
            tree::FinishError::Unpack(error) => unpack_error(error),
            tree::FinishError::Io(source) => tree_error(source),
        })?;
        Ok(record)
    }

    /// Downloads an archive and unpacks it as it arrives.
    async fn unpack_url(
        &self,
        url: &str,
        format: Unpack,
        expected_sha256: &str,
    ) -> Result<TreeRecord, StageError> {
        let (parsed, shown) = parse_url(url)?;
        let (chunks, received) = mpsc::channel::<Chunk>(16);
        let this = self.clone();
        let expected = expected_sha256.to_string();
        let source_name = shown.clone();
        let writer = tokio::task::spawn_blocking(move || {
            let reader = ChunkReader::new(received);
            let interrupted = reader.interrupted_flag();
            let source = Hashing::new(reader, this.inner.config.max_bytes);
            let result = this.unpack_blocking(source, format, &expected, &source_name);
            (
                result,
                interrupted.load(std::sync::atomic::Ordering::Relaxed),
            )
        });
        let after = self.inner.config.download_timeout;
        let download = tokio::time::timeout(after, self.download(parsed, &shown, &chunks)).await;
        drop(chunks);
        let (written, interrupted) = writer.await.map_err(|e| StageError::Task(e.to_string()))?;
        match download {
            Err(_) => Err(StageError::Timeout { url: shown, after }),
            // The writer stopped first on the archive's own fault: that is
            // the reason. A writer that saw the download stop reports the
            // download's.
            Ok(Err(download_error)) => match written {
                Err(error) if !interrupted => Err(error),
                _ => Err(download_error),
            },
            Ok(Ok(())) => written,
        }
    }
}

/// What runs in a stored tree, and with what defaults: `build.entrypoint`
/// when given, else the image config's `Entrypoint` (or `Cmd`), looked up
/// as a container runtime would (a bare name through the image's `PATH`).
fn run_in_tree(
    rootfs: &Path,
    record: &TreeRecord,
    entrypoint: Option<&str>,
) -> Result<(PathBuf, RunDefaults), StageError> {
    let config = record.image.clone().unwrap_or_default();
    let env: Vec<(String, String)> = config
        .env
        .iter()
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) => (name.to_string(), value.to_string()),
            None => (pair.clone(), String::new()),
        })
        .collect();
    let path_var = env
        .iter()
        .find(|(name, _)| name == "PATH")
        .map_or(DEFAULT_IMAGE_PATH, |(_, value)| value.as_str());
    let entrypoint_error = |entrypoint: &str, problem| StageError::Entrypoint {
        source_name: record.source.clone(),
        entrypoint: entrypoint.to_string(),
        problem,
    };
    let (exe, argv0, args, cmd) = match entrypoint {
        Some(entrypoint) => (
            tree::resolve_entrypoint(rootfs, entrypoint)
                .map_err(|p| entrypoint_error(entrypoint, p))?,
            entrypoint.to_string(),
            Vec::new(),
            Vec::new(),
        ),
        None => {
            let ImageConfig {
                entrypoint: ep,
                cmd,
                ..
            } = &config;
            let (command, args, cmd) = match (ep.split_first(), cmd.split_first()) {
                (Some((command, rest)), _) => (command, rest.to_vec(), cmd.clone()),
                (None, Some((command, rest))) => (command, Vec::new(), rest.to_vec()),
                (None, None) => {
                    return Err(StageError::NoEntrypoint {
                        source_name: record.source.clone(),
                        why: if record.image.is_some() {
                            "its config has neither Entrypoint nor Cmd; set build.entrypoint"
                        } else {
                            "it has no image config; set build.entrypoint"
                        },
                    });
                }
            };
            let exe = tree::resolve_command(rootfs, command, path_var)
                .map_err(|p| entrypoint_error(command, p))?;
            (exe, command.clone(), args, cmd)
        }
    };
    let working_dir = (!config.working_dir.is_empty())
        .then(|| tree::resolve_dir(rootfs, &config.working_dir))
        .flatten();
    Ok((
        exe,
        RunDefaults {
            argv0: Some(argv0),
            args,
            cmd,
            env,
            working_dir,
        },
    ))
}

/// The `PATH` a command is looked up in when the image sets none.
const DEFAULT_IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
