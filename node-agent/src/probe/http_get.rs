//! The `httpGet` probe: one HTTP/1.1 `GET` over a unix or TCP stream.
//! Healthy is a status from 200 to 399, the kubelet's rule.

use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::task::JoinHandle;

use super::{Endpoint, ProbeError, Stream};
use crate::observation::Observation;

/// The `Host` header every request carries.
pub const HOST: &str = "localhost";

/// The request target for `path`: only an absolute path is sent.
pub fn request_uri(path: &str) -> Result<Uri, ProbeError> {
    let invalid = || ProbeError::InvalidPath {
        path: path.to_string(),
    };
    if !path.starts_with('/') {
        return Err(invalid());
    }
    Uri::builder()
        .path_and_query(path)
        .build()
        .map_err(|_| invalid())
}

/// `Ok` for 200 to 399, else the status as an observation.
pub(crate) fn healthy_status(status: StatusCode) -> Result<u16, Observation> {
    let code = status.as_u16();
    if (200..400).contains(&code) {
        Ok(code)
    } else {
        Err(Observation::Status(code))
    }
}

/// The status line of `GET uri`; the body is not read.
pub(crate) async fn status(endpoint: &Endpoint, uri: &Uri) -> Result<StatusCode, Observation> {
    exchange(endpoint, uri, false)
        .await
        .map(|(status, _)| status)
}

/// Aborts the connection's driver task when the exchange ends, however it
/// ends, so a hung peer leaves no task behind.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `GET uri` on `endpoint`: the status, and the whole body when asked.
pub(crate) async fn exchange(
    endpoint: &Endpoint,
    uri: &Uri,
    read_body: bool,
) -> Result<(StatusCode, Bytes), Observation> {
    let stream: Stream = endpoint.connect().await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| Observation::Http(e.to_string()))?;
    let _driver = AbortOnDrop(tokio::spawn(async move {
        // Its error surfaces through send_request below.
        let _ = connection.await;
    }));
    let request = Request::builder()
        .method(Method::GET)
        .uri(uri.clone())
        .header(header::HOST, HOST)
        .header(header::USER_AGENT, "genswap-node-agent")
        .header(header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| Observation::Http(e.to_string()))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| Observation::Http(e.to_string()))?;
    let status = response.status();
    if !read_body {
        return Ok((status, Bytes::new()));
    }
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| Observation::Http(e.to_string()))?
        .to_bytes();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_absolute_paths_are_sent() {
        assert!(request_uri("/healthz?x=1").is_ok());
        for bad in ["healthz", "", "http://x/", "/a b"] {
            assert!(
                matches!(request_uri(bad), Err(ProbeError::InvalidPath { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn healthy_is_200_to_399_as_the_kubelet_says() {
        for code in [200, 204, 301, 302, 399] {
            assert_eq!(
                healthy_status(StatusCode::from_u16(code).unwrap()),
                Ok(code)
            );
        }
        for code in [100, 199, 400, 404, 500, 503] {
            assert_eq!(
                healthy_status(StatusCode::from_u16(code).unwrap()),
                Err(Observation::Status(code))
            );
        }
    }
}
