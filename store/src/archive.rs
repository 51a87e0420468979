//! Archives, from a file or a download, hashed and unpacked in one pass.
//!
//! The bytes flow once: from the source through the sha256 (and the size
//! cap) into the decompressor and the unpacker. Nothing is held whole in
//! memory and nothing is read twice. What follows the archive's end marker
//! (a tar's padding, a gzip trailer) is read through the hash too, so the
//! digest is of exactly the bytes the source gave. The tree is kept only if
//! that digest is the pinned one.

use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use genswap_crds::Unpack;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::tree::TreeBuild;
use crate::unpack::UnpackError;

/// A reader that hashes and counts what passes through it, and refuses
/// to read past `limit` bytes.
pub(crate) struct Hashing<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
    limit: u64,
    over_limit: Arc<AtomicBool>,
}

impl<R: Read> Hashing<R> {
    pub(crate) fn new(inner: R, limit: u64) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
            limit,
            over_limit: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether the source went past the limit (its read then failed).
    pub(crate) fn over_limit_flag(&self) -> Arc<AtomicBool> {
        self.over_limit.clone()
    }

    /// Reads the rest of the source through the hash, then gives the
    /// digest (lowercase hex) and the byte count.
    pub(crate) fn finish(mut self) -> io::Result<(String, u64)> {
        io::copy(&mut self, &mut io::sink())?;
        Ok((hex::encode(self.hasher.finalize()), self.bytes))
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes = self.bytes.saturating_add(n as u64);
        if self.bytes > self.limit {
            self.over_limit.store(true, Ordering::Relaxed);
            return Err(io::Error::other("the archive is larger than the limit"));
        }
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Applies the archive read from `source` in `format` to `tree`, and
/// returns the hashing reader with everything after the archive read too.
pub(crate) fn unpack_stream<R: Read>(
    source: Hashing<R>,
    format: Unpack,
    tree: &mut TreeBuild,
    name: &str,
) -> Result<Hashing<R>, UnpackError> {
    let read_error = |source| UnpackError::Read {
        layer: name.to_string(),
        source,
    };
    match format {
        Unpack::Tar => tree.apply(source, name),
        Unpack::TarGzip => {
            // Several gzip members in a row are one stream, as gzip -d reads them.
            let decoder = flate2::read::MultiGzDecoder::new(source);
            let mut decoder = tree.apply(decoder, name)?;
            io::copy(&mut decoder, &mut io::sink()).map_err(read_error)?;
            Ok(decoder.into_inner())
        }
        Unpack::TarZstd => {
            let decoder = zstd::stream::read::Decoder::new(source).map_err(read_error)?;
            let mut decoder = tree.apply(decoder, name)?;
            io::copy(&mut decoder, &mut io::sink()).map_err(read_error)?;
            Ok(decoder.finish().into_inner())
        }
    }
}

/// The archive format's name, as messages show it.
pub fn format_name(format: Unpack) -> &'static str {
    match format {
        Unpack::Tar => "tar",
        Unpack::TarGzip => "tar+gzip",
        Unpack::TarZstd => "tar+zstd",
    }
}

/// What the downloader hands the blocking writer.
pub(crate) enum Chunk {
    Data(Bytes),
    Done,
}

/// A blocking reader over a download's chunks. A download that stops
/// without saying it is done is an error, never a short archive.
pub(crate) struct ChunkReader {
    chunks: mpsc::Receiver<Chunk>,
    current: Bytes,
    done: bool,
    interrupted: Arc<AtomicBool>,
}

impl ChunkReader {
    pub(crate) fn new(chunks: mpsc::Receiver<Chunk>) -> Self {
        Self {
            chunks,
            current: Bytes::new(),
            done: false,
            interrupted: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Set once the download stopped before its end.
    pub(crate) fn interrupted_flag(&self) -> Arc<AtomicBool> {
        self.interrupted.clone()
    }
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.done {
                return Ok(0);
            }
            match self.chunks.blocking_recv() {
                Some(Chunk::Data(bytes)) => self.current = bytes,
                Some(Chunk::Done) => self.done = true,
                None => {
                    self.interrupted.store(true, Ordering::Relaxed);
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the download stopped before its end",
                    ));
                }
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}
