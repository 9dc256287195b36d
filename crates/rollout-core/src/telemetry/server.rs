//! The HTTP side: a plain HTTP/1 server on the run's tokio runtime that answers
//! `GET /metrics` with the registry's text, and 404 to anything else.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::{CONTENT_TYPE, Telemetry, TelemetryError};

/// A client that sends no complete request head within this long is disconnected.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The `/metrics` endpoint, serving until dropped.
pub struct MetricsServer {
    address: SocketAddr,
    telemetry: Telemetry,
    accepting: JoinHandle<()>,
}

impl MetricsServer {
    /// Listens on `listen` (`IP:PORT`; port 0 picks a free one) and serves `telemetry`.
    pub async fn start(listen: &str, telemetry: Telemetry) -> Result<Self, TelemetryError> {
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
        let accepting = tokio::spawn(accept(listener, telemetry.clone()));
        Ok(MetricsServer {
            address,
            telemetry,
            accepting,
        })
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
    }
}

async fn accept(listener: TcpListener, telemetry: Telemetry) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tokio::spawn(serve_connection(stream, peer, telemetry.clone()));
            }
            Err(err) => {
                // Out of file descriptors, typically: wait rather than spin.
                tracing::warn!("/metrics: accepting a connection failed: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
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
