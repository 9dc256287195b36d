//! Optional encryption of every link (`[cluster] tls = true`), with no certificates to manage.
//!
//! Each process makes a fresh self-signed certificate; the client accepts any certificate.
//! That alone would let a man in the middle through, so the secret-based authentication
//! ([`crate::auth`]) then runs inside the TLS session and binds its MACs to the session's
//! exported keying material (RFC 8446 section 7.5): a relay that terminated TLS on both sides
//! would see two different sessions and fail it. Both sides therefore end up holding the
//! cluster secret and the same encrypted session.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rcgen::{CertifiedKey, generate_simple_self_signed};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::Acceptor;
use tokio_rustls::rustls::{ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme};
use tokio_rustls::{LazyConfigAcceptor, TlsConnector};

use crate::handshakes::{Progress, Stage};

const EXPORTER_LABEL: &[u8] = b"EXPORTER-rollout-cluster-auth";
const SERVER_NAME: &str = "rollout";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot set up TLS: {0}")]
    Setup(String),
    #[error("TLS handshake failed (does the peer have `[cluster] tls` set the same way?): {0}")]
    Handshake(std::io::Error),
}

/// When a link is encrypted. Both ends decide from the peer's address alone, so they agree
/// without telling each other: a connection to a loopback address comes from one, and one
/// to any other address comes from a non-loopback one.
#[derive(Debug, Clone)]
pub enum Encryption {
    /// TLS on every link with another machine, plaintext on loopback: the default.
    OffLoopback(TlsContext),
    /// TLS on every link, loopback included (`[cluster] tls = true`, `--tls`).
    Always(TlsContext),
    /// No TLS at all: an explicit opt-out (`[cluster] tls = false`, `--no-tls`).
    Never,
    /// Plaintext on loopback, and no link with another machine: what tests and tools that
    /// build [`crate::LinkLimits::default`] get.
    LoopbackOnly,
}

impl Encryption {
    /// The encryption a process gets from its `tls` setting: `None` (unset) is the default,
    /// encrypted off loopback.
    pub fn from_setting(tls: Option<bool>) -> Result<Self, TlsError> {
        Ok(match tls {
            None => Self::OffLoopback(TlsContext::new()?),
            Some(true) => Self::Always(TlsContext::new()?),
            Some(false) => Self::Never,
        })
    }

    /// The TLS context a link with `peer` uses, `None` for plaintext; an error where this
    /// policy allows no link with that peer.
    pub fn for_peer(&self, peer: IpAddr) -> Result<Option<&TlsContext>, TlsError> {
        let loopback = is_loopback(peer);
        match self {
            Self::Always(tls) => Ok(Some(tls)),
            Self::OffLoopback(tls) if !loopback => Ok(Some(tls)),
            Self::LoopbackOnly if !loopback => Err(TlsError::Setup(format!(
                "{peer} is not a loopback address and this process has no TLS identity"
            ))),
            Self::OffLoopback(_) | Self::LoopbackOnly | Self::Never => Ok(None),
        }
    }

    /// One line for the startup log.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::OffLoopback(_) => {
                "links with other machines are encrypted (TLS 1.3, bound to the cluster secret); \
                 loopback links are not"
            }
            Self::Always(_) => "every link is encrypted (TLS 1.3, bound to the cluster secret)",
            Self::Never => {
                "links are NOT encrypted (`tls = false`): anyone on the path between machines \
                 can read the weights and batches and alter frames after the handshake"
            }
            Self::LoopbackOnly => "loopback links only, not encrypted",
        }
    }
}

/// Loopback, IPv4-mapped IPv6 loopback included.
fn is_loopback(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// This process's TLS identity and settings, shared by all its links.
#[derive(Clone)]
pub struct TlsContext {
    server: Arc<ServerConfig>,
    connector: TlsConnector,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsContext(..)")
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

impl TlsContext {
    /// A fresh self-signed identity (TLS 1.3 only).
    pub fn new() -> Result<Self, TlsError> {
        let setup = |err: &dyn std::fmt::Display| TlsError::Setup(err.to_string());
        let CertifiedKey { cert, signing_key } =
            generate_simple_self_signed(vec![SERVER_NAME.to_owned()]).map_err(|e| setup(&e))?;
        let key = PrivateKeyDer::try_from(signing_key.serialize_der()).map_err(|e| setup(&e))?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&tokio_rustls::rustls::version::TLS13])
            .map_err(|e| setup(&e))?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key)
            .map_err(|e| setup(&e))?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&tokio_rustls::rustls::version::TLS13])
            .map_err(|e| setup(&e))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(SecretBoundVerifier(provider())))
            .with_no_client_auth();
        Ok(Self {
            server: Arc::new(server),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// The server side of a TLS session, and its channel binding.
    pub async fn accept(&self, stream: TcpStream) -> Result<(Stream, Vec<u8>), TlsError> {
        self.accept_watched(stream, &Progress::default()).await
    }

    /// [`TlsContext::accept`], recording in `progress` when the client's whole ClientHello
    /// has arrived and when the handshake is done.
    pub(crate) async fn accept_watched(
        &self,
        stream: TcpStream,
        progress: &Progress,
    ) -> Result<(Stream, Vec<u8>), TlsError> {
        let hello = LazyConfigAcceptor::new(Acceptor::default(), stream)
            .await
            .map_err(TlsError::Handshake)?;
        progress.reach(Stage::Hello);
        let stream = hello
            .into_stream(self.server.clone())
            .await
            .map_err(TlsError::Handshake)?;
        progress.reach(Stage::Encrypted);
        let binding = export(|out| {
            stream
                .get_ref()
                .1
                .export_keying_material(out, EXPORTER_LABEL, None)
        })?;
        Ok((Stream::Server(Box::new(stream)), binding))
    }

    /// The client side of a TLS session, and its channel binding.
    pub async fn connect(&self, stream: TcpStream) -> Result<(Stream, Vec<u8>), TlsError> {
        let name = ServerName::try_from(SERVER_NAME).map_err(|e| TlsError::Setup(e.to_string()))?;
        let stream = self
            .connector
            .connect(name, stream)
            .await
            .map_err(TlsError::Handshake)?;
        let binding = export(|out| {
            stream
                .get_ref()
                .1
                .export_keying_material(out, EXPORTER_LABEL, None)
        })?;
        Ok((Stream::Client(Box::new(stream)), binding))
    }
}

fn export(
    exporter: impl FnOnce(&mut [u8; 32]) -> Result<&mut [u8; 32], tokio_rustls::rustls::Error>,
) -> Result<Vec<u8>, TlsError> {
    let mut binding = [0u8; 32];
    exporter(&mut binding).map_err(|e| TlsError::Setup(format!("no keying material: {e}")))?;
    Ok(binding.to_vec())
}

/// Accepts the server's certificate as it is: who the server is gets proved afterwards, by
/// the secret-based authentication bound to this session. Signatures are still checked, so
/// the server must hold the key of the certificate it sent.
#[derive(Debug)]
struct SecretBoundVerifier(Arc<CryptoProvider>);

impl ServerCertVerifier for SecretBoundVerifier {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, tokio_rustls::rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        tokio_rustls::rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        tokio_rustls::rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A link's byte stream: plain TCP or TLS over it.
pub enum Stream {
    Plain(TcpStream),
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn addr(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_default_encrypts_every_link_off_loopback() {
        let default = Encryption::from_setting(None).unwrap();
        for loopback in ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"] {
            assert!(
                default.for_peer(addr(loopback)).unwrap().is_none(),
                "{loopback}"
            );
        }
        for other in [
            "10.231.7.2",
            "192.168.1.5",
            "::ffff:10.0.0.1",
            "fe80::1",
            "0.0.0.0",
        ] {
            assert!(default.for_peer(addr(other)).unwrap().is_some(), "{other}");
        }
    }

    #[test]
    fn the_settings_force_or_drop_encryption() {
        let always = Encryption::from_setting(Some(true)).unwrap();
        assert!(always.for_peer(addr("127.0.0.1")).unwrap().is_some());
        let never = Encryption::from_setting(Some(false)).unwrap();
        assert!(never.for_peer(addr("10.0.0.1")).unwrap().is_none());
        assert!(never.describe().contains("NOT encrypted"));
    }

    #[test]
    fn without_an_identity_only_loopback_links_are_made() {
        let only = Encryption::LoopbackOnly;
        assert!(only.for_peer(addr("127.0.0.1")).unwrap().is_none());
        let err = only.for_peer(addr("10.0.0.1")).unwrap_err();
        assert!(err.to_string().contains("not a loopback address"), "{err}");
    }
}
