//! A loopback TCP port in front of a server whose answers arrive at a set
//! rate per connection: what a node's link to a registry is, for the
//! pre-staging figures (docs/BENCHMARKS.md). It paces only the server's
//! bytes to the client, chunk by chunk; it adds no latency, loss or
//! congestion between connections, so it shows the cost of the bytes, not
//! of a real WAN's behaviour. Stops when dropped.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// The pacing step: at most this much is sent before the clock is checked.
const CHUNK: usize = 64 * 1024;

pub struct SlowLink {
    /// `127.0.0.1:<port>`.
    pub address: String,
    task: tokio::task::JoinHandle<()>,
}

impl SlowLink {
    /// Carries each connection to `upstream`, its answers at
    /// `bytes_per_second`.
    pub async fn start(upstream: String, bytes_per_second: u64) -> SlowLink {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind a slow link: {e}"));
        let address = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("the slow link's address: {e}"))
            .to_string();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        carry(client, server, bytes_per_second).await;
                    }
                });
            }
        });
        SlowLink { address, task }
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn carry(client: TcpStream, server: TcpStream, bytes_per_second: u64) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    };
    let down = async {
        // When the link is free again; an idle connection earns no burst.
        let mut free_at = Instant::now();
        let mut buffer = vec![0u8; CHUNK];
        loop {
            let read = match server_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            };
            if client_write.write_all(&buffer[..read]).await.is_err() {
                break;
            }
            let takes = Duration::from_secs_f64(read as f64 / bytes_per_second.max(1) as f64);
            free_at = free_at.max(Instant::now()) + takes;
            tokio::time::sleep_until(free_at).await;
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(up, down);
}
