//! The HTTP side: a plain HTTP/1 server on the run's tokio runtime that answers
//! `GET /metrics` with the registry's text, and 404 to anything else.
//!
//! It serves at most [`MAX_CONNECTIONS`] connections at once, each for
//! [`CONNECTION_LIFETIME`] at most: a new connection past the cap closes the oldest open
//! one, so that connections held open and idle cannot keep a scraper out (a scraper's
//! request takes milliseconds; one whose kept-alive connection was closed opens another).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

use super::{CONTENT_TYPE, Telemetry, TelemetryError};

/// A client that sends no complete request head within this long is disconnected.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; a new one past this closes the oldest.
pub(super) const MAX_CONNECTIONS: usize = 32;
/// How long a connection is served, kept-alive idle time included.
pub(super) const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// Connections closed for newer ones are logged once per this long, summed up.
const LOG_WINDOW: Duration = Duration::from_secs(10);

/// How many connections are served at once, and for how long.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub max_connections: usize,
    pub lifetime: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            lifetime: CONNECTION_LIFETIME,
        }
    }
}

/// The connections being served, oldest first.
#[derive(Default)]
struct Open {
    next: u64,
    connections: VecDeque<(u64, AbortHandle)>,
    /// Connections closed for newer ones: in all, and since the last log line.
    closed: u64,
    unlogged: u64,
    logged_at: Option<Instant>,
}

impl Open {
    /// Counts a connection closed for a newer one; returns how many to log now, if any.
    fn closed_one(&mut self, now: Instant) -> Option<u64> {
        self.closed += 1;
        self.unlogged += 1;
        if self
            .logged_at
            .is_some_and(|at| now.duration_since(at) < LOG_WINDOW)
        {
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }

    fn remove(&mut self, id: u64) {
        if let Ok(index) = self
            .connections
            .binary_search_by_key(&id, |(other, _)| *other)
        {
            self.connections.remove(index);
        }
    }
}

fn lock(open: &Mutex<Open>) -> MutexGuard<'_, Open> {
    open.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The `/metrics` endpoint, serving until dropped.
pub struct MetricsServer {
    address: SocketAddr,
    telemetry: Telemetry,
    accepting: JoinHandle<()>,
    open: Arc<Mutex<Open>>,
}

impl MetricsServer {
    /// Listens on `listen` (`IP:PORT`; port 0 picks a free one) and serves `telemetry`.
    pub async fn start(listen: &str, telemetry: Telemetry) -> Result<Self, TelemetryError> {
        Self::start_with(listen, telemetry, Limits::default()).await
    }

    /// [`MetricsServer::start`] within `limits`.
    pub(super) async fn start_with(
        listen: &str,
        telemetry: Telemetry,
        limits: Limits,
    ) -> Result<Self, TelemetryError> {
        let address: SocketAddr =
            listen
                .parse()
                .map_err(|err: std::net::AddrParseError| TelemetryError::Address {
                    address: listen.to_owned(),
                    reason: err.to_string(),
                })?;
        let bind_error = |source| TelemetryError::Bind {
            address: listen.to_owned(),
            source,
        };
        let listener = TcpListener::bind(address).await.map_err(bind_error)?;
        let address = listener.local_addr().map_err(bind_error)?;
        tracing::info!("serving Prometheus metrics at http://{address}/metrics");
        let open = Arc::new(Mutex::new(Open::default()));
        let accepting = tokio::spawn(accept(listener, telemetry.clone(), open.clone(), limits));
        Ok(MetricsServer {
            address,
            telemetry,
            accepting,
            open,
        })
    }

    /// Connections being served now.
    #[cfg(test)]
    pub(super) fn open_connections(&self) -> usize {
        lock(&self.open).connections.len()
    }

    /// Connections closed so far to make room for newer ones.
    #[cfg(test)]
    pub(super) fn closed_connections(&self) -> u64 {
        lock(&self.open).closed
    }

    /// Where it listens (with the port picked when `listen` asked for port 0).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The registry it serves.
    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.accepting.abort();
        for (_, connection) in lock(&self.open).connections.drain(..) {
            connection.abort();
        }
    }
}

async fn accept(
    listener: TcpListener,
    telemetry: Telemetry,
    open: Arc<Mutex<Open>>,
    limits: Limits,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => admit(&open, limits, stream, peer, &telemetry),
            Err(err) => {
                // Out of file descriptors, typically: wait rather than spin.
                tracing::warn!("/metrics: accepting a connection failed: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves a new connection in a task of its own, for `limits.lifetime` at most, first
/// closing the oldest open one if `limits.max_connections` are open.
fn admit(
    open: &Arc<Mutex<Open>>,
    limits: Limits,
    stream: TcpStream,
    peer: SocketAddr,
    telemetry: &Telemetry,
) {
    let mut guard = lock(open);
    while guard.connections.len() >= limits.max_connections.max(1) {
        let Some((_, oldest)) = guard.connections.pop_front() else {
            break;
        };
        oldest.abort();
        if let Some(closed) = guard.closed_one(Instant::now()) {
            tracing::warn!(
                "/metrics: closed {closed} connection(s) for newer ones since the last such \
                 line (at most {} are served at once)",
                limits.max_connections
            );
        }
    }
    let id = guard.next;
    guard.next += 1;
    let (telemetry, open_now) = (telemetry.clone(), open.clone());
    // The task removes itself once done; it cannot before it is added, below under the
    // same lock.
    let task = tokio::spawn(async move {
        let served = serve_connection(stream, peer, telemetry);
        if tokio::time::timeout(limits.lifetime, served).await.is_err() {
            tracing::debug!("/metrics: closed the connection from {peer} at its lifetime's end");
        }
        lock(&open_now).remove(id);
    });
    guard.connections.push_back((id, task.abort_handle()));
}

async fn serve_connection(stream: TcpStream, peer: SocketAddr, telemetry: Telemetry) {
    let service = service_fn(move |request: Request<Incoming>| {
        let response = respond(&telemetry, request.method(), request.uri().path());
        async move { Ok::<_, Infallible>(response) }
    });
    let served = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service)
        .await;
    if let Err(err) = served {
        tracing::debug!("/metrics: connection from {peer}: {err}");
    }
}

/// The answer to `method path`.
pub(super) fn respond(telemetry: &Telemetry, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if path != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "not found: the metrics are at /metrics\n",
        );
    }
    if method != Method::GET && method != Method::HEAD {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match telemetry.render() {
        Ok(text) => {
            let mut response = Response::new(Full::new(Bytes::from(text)));
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
            response
        }
        Err(err) => {
            tracing::warn!("/metrics: {err}");
            plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                "cannot encode the metrics\n",
            )
        }
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
