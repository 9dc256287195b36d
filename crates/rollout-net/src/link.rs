//! Connections between roles: TCP (optionally TLS), authenticated before anything is
//! parsed, then greeted (`Hello` both ways), then frames. [`crate::rpc`] turns a link into
//! calls and answers ([`Link::client`], [`Link::server`]).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Framed;

use crate::auth::{AuthError, ClusterKey, authenticate_client, authenticate_server};
use crate::frame::{Frame, FrameCodec};
use crate::handshakes::{Progress, Stage};
use crate::messages::Hello;
use crate::payload::BufferPool;
use crate::tls::{Encryption, Stream as LinkStream};

/// Sizes, times and encryption every connection of a run agrees on.
#[derive(Debug, Clone)]
pub struct LinkLimits {
    pub max_header_bytes: u32,
    pub max_payload_bytes: u64,
    /// How often each side sends a heartbeat.
    pub heartbeat: Duration,
    /// A peer silent for this long is lost.
    pub peer_timeout: Duration,
    /// Authentication and greeting must finish within this.
    pub handshake_timeout: Duration,
    /// Requests a server accepts before the client must wait for answers.
    pub credits: u32,
    /// Which links are encrypted (`[cluster] tls`).
    pub encryption: Encryption,
    /// Where links receive large payloads; clones share it, so every link of a process
    /// reuses the buffers of payloads it is done with.
    pub receive_buffers: BufferPool,
}

impl Default for LinkLimits {
    fn default() -> Self {
        Self {
            max_header_bytes: 256 << 20,
            max_payload_bytes: 4 << 30,
            heartbeat: Duration::from_secs(2),
            peer_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            credits: 16,
            encryption: Encryption::LoopbackOnly,
            receive_buffers: BufferPool::default(),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum NetError {
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("{peer}: authentication failed: {reason}")]
    Auth { peer: String, reason: String },
    #[error("{peer}: {reason}")]
    Handshake { peer: String, reason: String },
    #[error("{peer} sent a bad frame: {reason}")]
    BadFrame { peer: String, reason: String },
    #[error("lost {peer}: {reason}")]
    PeerLost { peer: String, reason: String },
    #[error("{peer} sent nothing, not even a heartbeat, for {seconds:.0} s")]
    PeerSilent { peer: String, seconds: f64 },
    #[error("{peer} failed: {message}")]
    Remote { peer: String, message: String },
}

impl NetError {
    fn auth(peer: &str, err: AuthError) -> Self {
        NetError::Auth {
            peer: peer.into(),
            reason: err.to_string(),
        }
    }
}

/// An authenticated connection whose peer has introduced itself.
pub struct Link {
    framed: Framed<LinkStream, FrameCodec>,
    pub peer: Hello,
    pub peer_addr: SocketAddr,
    limits: LinkLimits,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("peer_addr", &self.peer_addr)
            .finish()
    }
}

/// Binds a listener; `addr` defaults to loopback in every caller's config.
pub async fn listen(addr: &str) -> Result<TcpListener, NetError> {
    TcpListener::bind(addr)
        .await
        .map_err(|err| NetError::Connect {
            addr: addr.into(),
            reason: format!("cannot listen: {err}"),
        })
}

fn codec(limits: &LinkLimits) -> FrameCodec {
    FrameCodec::new()
        .with_max_header_bytes(limits.max_header_bytes)
        .with_max_payload_bytes(limits.max_payload_bytes)
        .with_pool(limits.receive_buffers.clone())
}

impl Link {
    /// Connects to `addr`, proves the secret, checks the server's proof and exchanges `Hello`.
    pub async fn connect(
        addr: &str,
        key: &ClusterKey,
        hello: &Hello,
        limits: &LinkLimits,
    ) -> Result<Self, NetError> {
        let failed = |reason: String| NetError::Connect {
            addr: addr.into(),
            reason,
        };
        let stream = tokio::time::timeout(limits.handshake_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| failed("timed out".into()))?
            .map_err(|err| failed(err.to_string()))?;
        let _ = stream.set_nodelay(true);
        let peer_addr = stream.peer_addr().map_err(|err| failed(err.to_string()))?;
        let tls = limits
            .encryption
            .for_peer(peer_addr.ip())
            .map_err(|err| failed(err.to_string()))?;
        let (mut stream, binding) = match tls {
            Some(tls) => tokio::time::timeout(limits.handshake_timeout, tls.connect(stream))
                .await
                .map_err(|_| failed("the TLS handshake timed out".into()))?
                .map_err(|err| failed(err.to_string()))?,
            None => (LinkStream::Plain(stream), Vec::new()),
        };
        authenticate_server(&mut stream, key, &binding, limits.handshake_timeout)
            .await
            .map_err(|err| match err {
                // A busy listener sheds connections before they authenticate: try again.
                AuthError::NoChallenge(_) | AuthError::NoAnswer(_) | AuthError::Timeout(_) => {
                    failed(format!("{err} (the listener may be busy)"))
                }
                err => NetError::auth(addr, err),
            })?;
        Self::greet(stream, peer_addr, hello, limits).await
    }

    /// Authenticates an accepted connection: nothing it sends is parsed before it has proved
    /// the secret.
    pub async fn accept(
        stream: TcpStream,
        key: &ClusterKey,
        hello: &Hello,
        limits: &LinkLimits,
    ) -> Result<Self, NetError> {
        Self::accept_watched(stream, key, hello, limits, &Progress::default()).await
    }

    /// [`Link::accept`], recording in `progress` how far the handshake has got.
    pub(crate) async fn accept_watched(
        stream: TcpStream,
        key: &ClusterKey,
        hello: &Hello,
        limits: &LinkLimits,
        progress: &Progress,
    ) -> Result<Self, NetError> {
        let peer_addr = stream.peer_addr().map_err(|err| NetError::Handshake {
            peer: "unknown peer".into(),
            reason: err.to_string(),
        })?;
        let peer = peer_addr.to_string();
        let _ = stream.set_nodelay(true);
        let handshake_failed = |reason: String| NetError::Handshake {
            peer: peer.clone(),
            reason,
        };
        let tls = limits
            .encryption
            .for_peer(peer_addr.ip())
            .map_err(|err| handshake_failed(err.to_string()))?;
        let (mut stream, binding) = match tls {
            Some(tls) => {
                let accepted = tls.accept_watched(stream, progress);
                tokio::time::timeout(limits.handshake_timeout, accepted)
                    .await
                    .map_err(|_| handshake_failed("the TLS handshake timed out".into()))?
                    .map_err(|err| handshake_failed(err.to_string()))?
            }
            None => (LinkStream::Plain(stream), Vec::new()),
        };
        authenticate_client(&mut stream, key, &binding, limits.handshake_timeout)
            .await
            .map_err(|err| NetError::auth(&peer, err))?;
        progress.reach(Stage::Authenticated);
        Self::greet(stream, peer_addr, hello, limits).await
    }

    async fn greet(
        stream: LinkStream,
        peer_addr: SocketAddr,
        hello: &Hello,
        limits: &LinkLimits,
    ) -> Result<Self, NetError> {
        let peer = peer_addr.to_string();
        let mut framed = Framed::new(stream, codec(limits));
        let bad = |reason: String| NetError::Handshake {
            peer: peer.clone(),
            reason,
        };
        let frame = Frame::from_message(hello, Bytes::new()).map_err(|err| bad(err.to_string()))?;
        framed
            .send(frame)
            .await
            .map_err(|err| bad(err.to_string()))?;
        let reply = tokio::time::timeout(limits.handshake_timeout, framed.next())
            .await
            .map_err(|_| bad("no greeting in time".into()))?
            .ok_or_else(|| bad("closed before greeting".into()))?
            .map_err(|err| bad(err.to_string()))?;
        let their: Hello = reply.decode_message().map_err(|err| bad(err.to_string()))?;
        if their.version != hello.version {
            return Err(bad(format!(
                "runs rollout {} but this is rollout {}; every process of a run must be the same build",
                their.version, hello.version
            )));
        }
        Ok(Link {
            framed,
            peer: their,
            peer_addr,
            limits: limits.clone(),
        })
    }

    /// Whether the link runs TLS.
    pub fn encrypted(&self) -> bool {
        !matches!(self.framed.get_ref(), LinkStream::Plain(_))
    }

    /// A name for logs: the peer's role and name and address.
    pub fn describe(&self) -> String {
        format!(
            "{} `{}` ({})",
            self.peer.role, self.peer.name, self.peer_addr
        )
    }

    /// The connection's frames, its description for logs, the peer's greeting and the
    /// limits: what [`Link::client`] and [`Link::server`] start from.
    pub(crate) fn into_parts(self) -> (Framed<LinkStream, FrameCodec>, String, Hello, LinkLimits) {
        let peer = self.describe();
        (self.framed, peer, self.peer, self.limits)
    }
}
