//! Archives by URL, unpacked as they download: a server on loopback that
//! stops mid-body is the source's fault (never the build's), leaves nothing
//! in the store, and the next stage, once it serves whole, succeeds.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use genswap_crds::{Artifact, BuildSpec, Unpack};
use genswap_store::StageError;
use support::{Fixture, app_tree, gnu_tar, sha256_file};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Serves `body` over plain HTTP/1.1; the first `cut` requests get the
/// headers and half the body, then the connection closes.
async fn serve(body: Vec<u8>, cut: usize) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request).await;
            let n = count.fetch_add(1, Ordering::SeqCst);
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let part = if n < cut {
                &body[..body.len() / 2]
            } else {
                &body[..]
            };
            let _ = stream.write_all(part).await;
            let _ = stream.shutdown().await;
        }
    });
    (format!("http://{addr}/app.tar.gz"), served)
}

#[tokio::test]
async fn a_download_cut_mid_archive_is_the_sources_fault_and_the_next_one_succeeds() {
    let fx = Fixture::new();
    let src = fx.outside("src");
    app_tree(&src);
    // Enough bytes that half of them end inside the archive's entries.
    std::fs::write(src.join("lib/app/blob"), vec![7u8; 256 * 1024]).expect("blob");
    let archive = fx.outside("out").join("app.tar.gz");
    gnu_tar(&src, &archive, Unpack::TarGzip);
    let digest = sha256_file(&archive);
    let (url, served) = serve(std::fs::read(&archive).expect("archive"), 1).await;
    let build = BuildSpec {
        signed_by: None,
        signature: None,
        id: "tree-1".into(),
        artifact: Artifact {
            path: None,
            url: Some(url.clone()),
            image: None,
            unpack: Some(Unpack::TarGzip),
        },
        sha256: digest.clone(),
        entrypoint: Some("bin/app".into()),
    };

    let error = fx.stager.stage(&build).await.expect_err("cut short");
    assert!(!error.is_build_fault(), "{error:?}");
    assert!(
        matches!(error, StageError::Download { .. }),
        "the download's own error: {error:?}"
    );
    assert!(error.to_string().contains(&url), "{error}");
    assert!(fx.leftovers().is_empty() && fx.trees().is_empty());

    let staged = fx.stager.stage(&build).await.expect("whole this time");
    assert_eq!(staged.sha256, digest);
    assert!(staged.path.ends_with("lib/app/main.sh"));
    // Staged again: the stored tree, no request.
    let before = served.load(Ordering::SeqCst);
    fx.stager.stage(&build).await.expect("from the store");
    assert_eq!(served.load(Ordering::SeqCst), before);
}
