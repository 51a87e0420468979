//! What one try of a probe saw when it was not healthy: the words every
//! probe kind ([`crate::probe`], [`crate::command`], [`crate::notify`])
//! reports in, and [`crate::health`] and the supervisor give as a reason.

use std::fmt;
use std::time::Duration;

use http::StatusCode;

/// What one try saw when it was not healthy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observation {
    /// Nothing at the socket path: the process has not bound it (yet).
    NoSocket,
    /// Nobody accepting at the address.
    Refused,
    /// An HTTP status outside 200 to 399.
    Status(u16),
    /// No answer within the try's timeout.
    Hung(Duration),
    /// The connect failed otherwise.
    Connect(String),
    /// The connection was made, but the HTTP exchange failed (closed early,
    /// not HTTP).
    Http(String),
    /// The gRPC health service answered something other than `SERVING`, or
    /// the call failed.
    Grpc(String),
    /// The exec probe's command ended unhealthy: how, and the start of
    /// what it wrote.
    Command(String),
    /// No `READY=1` yet; the generation's last `STATUS=`, if any.
    NotReady(Option<String>),
    /// No `WATCHDOG=1` since the last try; the last `STATUS=`, if any.
    NoWatchdog(Option<String>),
}

impl Observation {
    /// The try reached the program: what it saw is about the program.
    fn reached(&self) -> bool {
        matches!(
            self,
            Observation::Status(_)
                | Observation::Hung(_)
                | Observation::Http(_)
                | Observation::Grpc(_)
                | Observation::Command(_)
                | Observation::NotReady(Some(_))
                | Observation::NoWatchdog(_)
        )
    }

    /// Whether this try's observation, rather than `last`, is the reason
    /// to give. A hang the deadline cut short may only have been a slow
    /// answer: it says less than an earlier try that reached the program,
    /// but more than one that could not connect at all.
    pub fn outranks(&self, last: Option<&Observation>, cut_short: bool) -> bool {
        match self {
            Observation::Hung(_) if cut_short => !last.is_some_and(Observation::reached),
            // A later wait without news does not hide the last STATUS=.
            Observation::NotReady(None) => !matches!(last, Some(Observation::NotReady(Some(_)))),
            _ => true,
        }
    }
}

impl fmt::Display for Observation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Observation::NoSocket => f.write_str("no socket at the path (not bound)"),
            Observation::Refused => f.write_str("connection refused"),
            Observation::Status(code) => match StatusCode::from_u16(*code)
                .ok()
                .and_then(|s| s.canonical_reason())
            {
                Some(reason) => write!(f, "answered {code} {reason}"),
                None => write!(f, "answered {code}"),
            },
            Observation::Hung(after) => write!(f, "no answer within {after:?}"),
            Observation::Connect(error) => write!(f, "connect failed: {error}"),
            Observation::Http(error) => write!(f, "HTTP exchange failed: {error}"),
            Observation::Grpc(said) => write!(f, "gRPC health check: {said}"),
            Observation::Command(how) => f.write_str(how),
            Observation::NotReady(None) => f.write_str("no READY=1 yet"),
            Observation::NotReady(Some(status)) => {
                write!(f, "no READY=1 yet; it says STATUS={status}")
            }
            Observation::NoWatchdog(None) => f.write_str("no WATCHDOG=1 since the last probe"),
            Observation::NoWatchdog(Some(status)) => {
                write!(
                    f,
                    "no WATCHDOG=1 since the last probe; it says STATUS={status}"
                )
            }
        }
    }
}
