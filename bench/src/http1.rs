//! A small blocking HTTP/1.1 client, written for the load generator so that
//! it can tell exactly where a request failed: before it was written (a
//! keep-alive connection the server had closed: a reconnect), or after (no
//! response: a failure). General-purpose clients hide that difference.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use thiserror::Error;

/// Where requests go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A unix socket path (`current.sock`, or the naive restart's socket).
    Unix(PathBuf),
    /// A TCP address, `127.0.0.1:<port>` (nginx).
    Tcp(String),
    /// A UDP address, `127.0.0.1:<port>`: DNS-like queries, not HTTP
    /// (`crate::datagram`).
    Udp(String),
}

impl std::str::FromStr for Target {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(path) = text.strip_prefix("unix:") {
            Ok(Target::Unix(PathBuf::from(path)))
        } else if let Some(address) = text.strip_prefix("tcp:") {
            Ok(Target::Tcp(address.to_string()))
        } else if let Some(address) = text.strip_prefix("udp:") {
            Ok(Target::Udp(address.to_string()))
        } else {
            Err(format!(
                "{text:?} is none of unix:<path>, tcp:<host:port>, udp:<host:port>"
            ))
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Unix(path) => write!(f, "unix:{}", path.display()),
            Target::Tcp(address) => write!(f, "tcp:{address}"),
            Target::Udp(address) => write!(f, "udp:{address}"),
        }
    }
}

/// One open connection.
pub struct Connection {
    reader: BufReader<Stream>,
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
        }
    }
}

/// Why a request got no usable response.
#[derive(Debug, Error)]
pub enum RequestError {
    /// The connection could not be opened.
    #[error("connect: {0}")]
    Connect(#[source] io::Error),
    /// The request could not be written.
    #[error("write: {0}")]
    Write(#[source] io::Error),
    /// The request was written; the connection ended before a whole
    /// response came back.
    #[error("no response: {0}")]
    NoResponse(#[source] io::Error),
    /// No response within the read timeout.
    #[error("timed out")]
    Timeout,
    /// Something came back that is not an HTTP/1.1 response.
    #[error("malformed response: {0}")]
    Malformed(String),
}

impl RequestError {
    /// A short label for the samples file.
    pub fn label(&self) -> &'static str {
        match self {
            RequestError::Connect(e) if e.kind() == io::ErrorKind::ConnectionRefused => "refused",
            RequestError::Connect(e) if e.kind() == io::ErrorKind::NotFound => "nosocket",
            RequestError::Connect(_) => "connect",
            RequestError::Write(_) => "write",
            RequestError::NoResponse(e) if e.kind() == io::ErrorKind::UnexpectedEof => "eof",
            RequestError::NoResponse(_) => "reset",
            RequestError::Timeout => "timeout",
            RequestError::Malformed(_) => "malformed",
        }
    }
}

/// What came back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// `x-genswap-generation`, when present and numeric.
    pub generation: Option<u64>,
    /// The server asked to close the connection after this response.
    pub close: bool,
}

impl Connection {
    /// Opens a connection with `timeout` on reads and writes.
    pub fn open(target: &Target, timeout: Duration) -> Result<Connection, RequestError> {
        let stream = match target {
            Target::Unix(path) => {
                let s = UnixStream::connect(path).map_err(RequestError::Connect)?;
                s.set_read_timeout(Some(timeout))
                    .and_then(|()| s.set_write_timeout(Some(timeout)))
                    .map_err(RequestError::Connect)?;
                Stream::Unix(s)
            }
            Target::Tcp(address) => {
                let s = TcpStream::connect(address).map_err(RequestError::Connect)?;
                s.set_nodelay(true)
                    .and_then(|()| s.set_read_timeout(Some(timeout)))
                    .and_then(|()| s.set_write_timeout(Some(timeout)))
                    .map_err(RequestError::Connect)?;
                Stream::Tcp(s)
            }
            Target::Udp(_) => {
                return Err(RequestError::Connect(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "a UDP target takes datagrams, not HTTP",
                )));
            }
        };
        Ok(Connection {
            reader: BufReader::new(stream),
        })
    }

    /// Whether the server has closed (or reset) this idle connection: it is
    /// readable while no request is outstanding, which for HTTP/1.1 means
    /// EOF or an error.
    pub fn closed_by_peer(&self) -> bool {
        if !self.reader.buffer().is_empty() {
            return true;
        }
        let ready = match self.reader.get_ref() {
            Stream::Unix(s) => readable_now(s.as_fd()),
            Stream::Tcp(s) => readable_now(s.as_fd()),
        };
        ready.unwrap_or(true)
    }

    /// Writes a GET for `/` and reads the response. `close` asks the server
    /// to close the connection after it.
    pub fn get(&mut self, close: bool) -> Result<Response, RequestError> {
        let request: &[u8] = if close {
            b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
        } else {
            b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
        };
        let stream = self.reader.get_mut();
        stream
            .write_all(request)
            .and_then(|()| stream.flush())
            .map_err(RequestError::Write)?;
        self.read_response()
    }

    fn read_response(&mut self) -> Result<Response, RequestError> {
        let status_line = self.line()?;
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or_default();
        let status = parts
            .next()
            .and_then(|code| code.parse::<u16>().ok())
            .filter(|_| version.starts_with("HTTP/1."))
            .ok_or_else(|| RequestError::Malformed(status_line.clone()))?;
        // HTTP/1.0 closes unless it says keep-alive.
        let mut close = version == "HTTP/1.0";
        let mut length: Option<usize> = None;
        let mut chunked = false;
        let mut generation = None;
        loop {
            let line = self.line()?;
            if line.is_empty() {
                break;
            }
            let Some((name, value)) = line.split_once(':') else {
                return Err(RequestError::Malformed(line));
            };
            let value = value.trim();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => {
                    length = Some(
                        value
                            .parse()
                            .map_err(|_| RequestError::Malformed(line.clone()))?,
                    );
                }
                "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                "connection" => {
                    let value = value.to_ascii_lowercase();
                    if value.contains("close") {
                        close = true;
                    } else if value.contains("keep-alive") {
                        close = false;
                    }
                }
                "x-genswap-generation" => generation = value.parse().ok(),
                _ => {}
            }
        }
        if chunked {
            self.skip_chunked()?;
        } else if let Some(length) = length {
            self.skip(length)?;
        } else {
            // Delimited by the end of the connection.
            let mut sink = Vec::new();
            self.reader.read_to_end(&mut sink).map_err(read_error)?;
            close = true;
        }
        Ok(Response {
            status,
            generation,
            close,
        })
    }

    fn line(&mut self) -> Result<String, RequestError> {
        let mut line = String::new();
        let read = self.reader.read_line(&mut line).map_err(read_error)?;
        if read == 0 {
            return Err(RequestError::NoResponse(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before a complete response",
            )));
        }
        Ok(line.trim_end_matches(['\r', '\n']).to_string())
    }

    fn skip(&mut self, mut length: usize) -> Result<(), RequestError> {
        let mut buffer = [0u8; 4096];
        while length > 0 {
            let want = length.min(buffer.len());
            self.reader
                .read_exact(&mut buffer[..want])
                .map_err(read_error)?;
            length -= want;
        }
        Ok(())
    }

    fn skip_chunked(&mut self) -> Result<(), RequestError> {
        loop {
            let line = self.line()?;
            let size_text = line.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| RequestError::Malformed(line.clone()))?;
            if size == 0 {
                // Trailers, then the empty line.
                while !self.line()?.is_empty() {}
                return Ok(());
            }
            self.skip(size)?;
            self.line()?;
        }
    }
}

fn read_error(error: io::Error) -> RequestError {
    match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => RequestError::Timeout,
        _ => RequestError::NoResponse(error),
    }
}

fn readable_now(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<bool> {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN | PollFlags::POLLPRI)];
    let ready = poll(&mut fds, PollTimeout::ZERO).map_err(io::Error::from)?;
    Ok(ready > 0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::thread::JoinHandle;
    use std::time::Instant;

    /// Reads one request head from `stream`.
    pub(crate) fn read_request(stream: &mut UnixStream) -> bool {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => return false,
            }
        }
        true
    }

    /// A unix socket server in `dir` that runs `handle` on each of
    /// `connections` accepted connections, in turn.
    pub(crate) fn serve(
        dir: &std::path::Path,
        connections: usize,
        handle: impl Fn(UnixStream) + Send + 'static,
    ) -> (Target, JoinHandle<()>) {
        let path = dir.join("server.sock");
        let listener = UnixListener::bind(&path).expect("bind the test server");
        let server = std::thread::spawn(move || {
            for stream in listener.incoming().take(connections) {
                handle(stream.expect("accept"));
            }
        });
        (Target::Unix(path), server)
    }

    const OK_KEEP_ALIVE: &[u8] =
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-genswap-generation: 7\r\n\r\nok";

    #[test]
    fn a_keep_alive_connection_the_server_closed_is_seen_before_the_next_request() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (target, server) = serve(dir.path(), 1, |mut stream| {
            assert!(read_request(&mut stream), "a request");
            stream.write_all(OK_KEEP_ALIVE).expect("answer");
            // Dropped: closed between requests.
        });
        let mut connection = Connection::open(&target, Duration::from_secs(10)).expect("open");
        let response = connection.get(false).expect("answered");
        assert_eq!(
            response,
            Response {
                status: 200,
                generation: Some(7),
                close: false
            }
        );
        server.join().expect("server thread");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !connection.closed_by_peer() {
            assert!(Instant::now() < deadline, "the close was never seen");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_live_idle_connection_is_not_taken_for_closed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (target, server) = serve(dir.path(), 1, |mut stream| {
            assert!(read_request(&mut stream), "a request");
            stream.write_all(OK_KEEP_ALIVE).expect("answer");
            // Held open until the client goes.
            let _ = read_request(&mut stream);
        });
        let mut connection = Connection::open(&target, Duration::from_secs(10)).expect("open");
        connection.get(false).expect("answered");
        assert!(!connection.closed_by_peer());
        drop(connection);
        server.join().expect("server thread");
    }

    #[test]
    fn a_request_written_and_never_answered_is_a_failure() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (target, server) = serve(dir.path(), 1, |mut stream| {
            assert!(read_request(&mut stream), "a request");
        });
        let mut connection = Connection::open(&target, Duration::from_secs(10)).expect("open");
        let error = connection.get(false).expect_err("no answer came");
        assert_eq!(error.label(), "eof", "{error}");
        server.join().expect("server thread");
    }

    #[test]
    fn connection_close_and_a_status_are_read() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (target, server) = serve(dir.path(), 1, |mut stream| {
            assert!(read_request(&mut stream), "a request");
            stream
                .write_all(b"HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n2\r\nno\r\n0\r\n\r\n")
                .expect("answer");
        });
        let mut connection = Connection::open(&target, Duration::from_secs(10)).expect("open");
        let response = connection.get(false).expect("answered");
        assert_eq!((response.status, response.close), (502, true));
        server.join().expect("server thread");
    }

    #[test]
    fn nothing_listening_is_refused_or_missing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let missing = Target::Unix(dir.path().join("none.sock"));
        let error = Connection::open(&missing, Duration::from_secs(1))
            .err()
            .expect("no socket");
        assert_eq!(error.label(), "nosocket");
        let path = dir.path().join("closed.sock");
        drop(UnixListener::bind(&path).expect("bind"));
        let error = Connection::open(&Target::Unix(path), Duration::from_secs(1))
            .err()
            .expect("nothing listens");
        assert_eq!(error.label(), "refused");
    }
}
