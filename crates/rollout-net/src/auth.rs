//! Mutual challenge-response authentication, run on a fresh byte stream before any frame.
//!
//! Both sides know a cluster secret; neither sends it. The exchange has fixed sizes, so an
//! unauthenticated peer can make the listener read at most [`CLIENT_PROOF_LEN`] bytes and
//! parse nothing:
//!
//! 1. server -> client: `b"RLTAUTH1"` and a 32-byte random nonce;
//! 2. client -> server: `b"RLTAUTH1"`, its own 32-byte nonce and
//!    `MAC(key, "client" | server nonce | client nonce)`;
//! 3. server -> client, only if that MAC is right: `MAC(key, "server" | server nonce | client
//!    nonce)`, so the client knows the server holds the secret too; if it is wrong, the
//!    fixed [`REFUSED`] instead, so that the client can tell a refused secret (final) from a
//!    connection closed by a busy listener before it answered (worth trying again).
//!
//! The MAC is BLAKE3 in keyed mode (a PRF), the key derived from the secret with BLAKE3's
//! key derivation; comparisons are constant-time (`blake3::Hash`'s equality). Over TLS, both
//! MACs also cover the session's channel binding (see [`crate::tls`]); over plain TCP it is
//! empty.

use std::time::Duration;

use rand::RngCore;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The greeting both sides send first.
pub const AUTH_MAGIC: [u8; 8] = *b"RLTAUTH1";
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
/// What the server answers a wrong proof with: not a MAC (one would match it with
/// probability 2^-256), and the same whatever the client sent.
pub const REFUSED: [u8; MAC_LEN] = *b"RLTAUTH1 refused: wrong secret\r\n";
/// What the server reads from an unauthenticated client, all of it.
pub const CLIENT_PROOF_LEN: usize = AUTH_MAGIC.len() + NONCE_LEN + MAC_LEN;
/// The shortest secret accepted.
pub const MIN_SECRET_BYTES: usize = 16;

/// A cluster secret, as the key its MACs are computed with.
#[derive(Clone)]
pub struct ClusterKey([u8; 32]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

impl ClusterKey {
    /// Derives the key from a shared secret (surrounding whitespace ignored).
    pub fn from_secret(secret: &[u8]) -> Result<Self, AuthError> {
        let secret = secret.trim_ascii();
        if secret.len() < MIN_SECRET_BYTES {
            return Err(AuthError::WeakSecret {
                len: secret.len(),
                min: MIN_SECRET_BYTES,
            });
        }
        Ok(Self(blake3::derive_key(
            "rollout cluster authentication v1",
            secret,
        )))
    }

    /// A fresh random secret, hex-encoded (for `rollout launch` when none is configured).
    pub fn random_secret() -> String {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(
        &self,
        label: &[u8],
        server_nonce: &[u8],
        client_nonce: &[u8],
        binding: &[u8],
    ) -> blake3::Hash {
        let mut hasher = blake3::Hasher::new_keyed(&self.0);
        hasher.update(label);
        hasher.update(server_nonce);
        hasher.update(client_nonce);
        hasher.update(binding);
        hasher.finalize()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("the cluster secret has {len} bytes; at least {min} are needed")]
    WeakSecret { len: usize, min: usize },
    #[error("the peer is not a Rollout peer (bad greeting)")]
    BadGreeting,
    #[error("the peer does not know the cluster secret")]
    WrongSecret,
    /// The listener answered this side's proof with [`REFUSED`].
    #[error("the listener refused this process's proof: different secrets, or a relay between")]
    SecretRefused,
    #[error("authentication did not finish within {0:?}")]
    Timeout(Duration),
    /// The listener closed the connection before it sent its challenge: it sheds
    /// connections while it is busy, so this one is worth trying again.
    #[error("the listener closed the connection before its challenge: {0}")]
    NoChallenge(std::io::Error),
    /// The listener closed the connection after its challenge, without answering the proof
    /// (neither its own proof nor [`REFUSED`]): it also closes handshakes that have made the
    /// least progress while busy, so this one too is worth trying again.
    #[error("the listener closed the connection before answering: {0}")]
    NoAnswer(std::io::Error),
    #[error("connection closed during authentication: {0}")]
    Io(#[from] std::io::Error),
}

fn nonce() -> [u8; NONCE_LEN] {
    let mut nonce = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut nonce);
    nonce
}

async fn within<T>(
    limit: Duration,
    work: impl Future<Output = Result<T, AuthError>>,
) -> Result<T, AuthError> {
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| AuthError::Timeout(limit))?
}

/// The listening side: proves nothing until the client has proved it knows the secret.
pub async fn authenticate_client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &ClusterKey,
    binding: &[u8],
    limit: Duration,
) -> Result<(), AuthError> {
    within(limit, async {
        let server_nonce = nonce();
        let mut challenge = Vec::with_capacity(AUTH_MAGIC.len() + NONCE_LEN);
        challenge.extend_from_slice(&AUTH_MAGIC);
        challenge.extend_from_slice(&server_nonce);
        stream.write_all(&challenge).await?;
        let mut proof = [0u8; CLIENT_PROOF_LEN];
        stream.read_exact(&mut proof).await?;
        let (greeting, rest) = proof.split_at(AUTH_MAGIC.len());
        if greeting != AUTH_MAGIC {
            return Err(AuthError::BadGreeting);
        }
        let (client_nonce, mac) = rest.split_at(NONCE_LEN);
        let mac: [u8; MAC_LEN] = mac.try_into().map_err(|_| AuthError::BadGreeting)?;
        if key.mac(b"client", &server_nonce, client_nonce, binding) != blake3::Hash::from_bytes(mac)
        {
            // Best effort: a client that hung up needs no answer.
            if stream.write_all(&REFUSED).await.is_ok() {
                let _ = stream.flush().await;
            }
            return Err(AuthError::WrongSecret);
        }
        let answer = key.mac(b"server", &server_nonce, client_nonce, binding);
        stream.write_all(answer.as_bytes()).await?;
        Ok(())
    })
    .await
}

/// The connecting side: answers the challenge, then checks the server's own proof.
pub async fn authenticate_server<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &ClusterKey,
    binding: &[u8],
    limit: Duration,
) -> Result<(), AuthError> {
    within(limit, async {
        let mut challenge = [0u8; AUTH_MAGIC.len() + NONCE_LEN];
        stream
            .read_exact(&mut challenge)
            .await
            .map_err(AuthError::NoChallenge)?;
        let (greeting, server_nonce) = challenge.split_at(AUTH_MAGIC.len());
        if greeting != AUTH_MAGIC {
            return Err(AuthError::BadGreeting);
        }
        let client_nonce = nonce();
        let mut proof = Vec::with_capacity(CLIENT_PROOF_LEN);
        proof.extend_from_slice(&AUTH_MAGIC);
        proof.extend_from_slice(&client_nonce);
        proof.extend_from_slice(
            key.mac(b"client", server_nonce, &client_nonce, binding)
                .as_bytes(),
        );
        stream
            .write_all(&proof)
            .await
            .map_err(AuthError::NoAnswer)?;
        let mut answer = [0u8; MAC_LEN];
        stream
            .read_exact(&mut answer)
            .await
            .map_err(AuthError::NoAnswer)?;
        if answer == REFUSED {
            return Err(AuthError::SecretRefused);
        }
        if key.mac(b"server", server_nonce, &client_nonce, binding)
            != blake3::Hash::from_bytes(answer)
        {
            return Err(AuthError::WrongSecret);
        }
        Ok(())
    })
    .await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const LIMIT: Duration = Duration::from_secs(5);

    fn key(secret: &str) -> ClusterKey {
        ClusterKey::from_secret(secret.as_bytes()).unwrap()
    }

    #[tokio::test]
    async fn same_secret_authenticates_both_ways() {
        let (mut a, mut b) = tokio::io::duplex(256);
        let server = key("correct horse battery staple");
        let client = server.clone();
        let (s, c) = tokio::join!(
            authenticate_client(&mut a, &server, b"", LIMIT),
            authenticate_server(&mut b, &client, b"", LIMIT)
        );
        s.unwrap();
        c.unwrap();
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_by_both() {
        let (mut a, mut b) = tokio::io::duplex(256);
        let (right, wrong) = (
            key("correct horse battery staple"),
            key("incorrect horse battery staple"),
        );
        let (s, c) = tokio::join!(authenticate_client(&mut a, &right, b"", LIMIT), async {
            let result = authenticate_server(&mut b, &wrong, b"", LIMIT).await;
            drop(b);
            result
        });
        assert!(matches!(s, Err(AuthError::WrongSecret)), "{s:?}");
        assert!(matches!(c, Err(AuthError::SecretRefused)), "{c:?}");
    }

    #[tokio::test]
    async fn a_listener_that_closes_after_its_challenge_is_worth_trying_again() {
        // What a busy gate closing a handshake looks like from the connecting side.
        let (mut a, mut b) = tokio::io::duplex(256);
        let client = key("correct horse battery staple");
        let (c, _) = tokio::join!(authenticate_server(&mut b, &client, b"", LIMIT), async {
            let mut challenge = AUTH_MAGIC.to_vec();
            challenge.extend_from_slice(&[7; NONCE_LEN]);
            a.write_all(&challenge).await.unwrap();
            let mut proof = [0; CLIENT_PROOF_LEN];
            a.read_exact(&mut proof).await.unwrap();
            drop(a);
        });
        assert!(matches!(c, Err(AuthError::NoAnswer(_))), "{c:?}");
    }

    #[tokio::test]
    async fn garbage_is_a_bad_greeting() {
        let (mut a, mut b) = tokio::io::duplex(256);
        let server = key("correct horse battery staple");
        let (s, _) = tokio::join!(authenticate_client(&mut a, &server, b"", LIMIT), async {
            b.write_all(&[b'G'; CLIENT_PROOF_LEN]).await.unwrap();
        });
        assert!(matches!(s, Err(AuthError::BadGreeting)), "{s:?}");
    }

    #[tokio::test]
    async fn a_silent_peer_times_out() {
        let (mut a, _b) = tokio::io::duplex(256);
        let server = key("correct horse battery staple");
        let result = authenticate_client(&mut a, &server, b"", Duration::from_millis(50)).await;
        assert!(matches!(result, Err(AuthError::Timeout(_))), "{result:?}");
    }

    #[tokio::test]
    async fn different_channel_bindings_fail_even_with_the_right_secret() {
        // What a relay terminating TLS on both sides would see: two sessions.
        let (mut a, mut b) = tokio::io::duplex(256);
        let server = key("correct horse battery staple");
        let client = server.clone();
        let (s, _) = tokio::join!(
            authenticate_client(&mut a, &server, b"session one", LIMIT),
            authenticate_server(&mut b, &client, b"session two", LIMIT)
        );
        assert!(matches!(s, Err(AuthError::WrongSecret)), "{s:?}");
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(matches!(
            ClusterKey::from_secret(b"  short \n"),
            Err(AuthError::WeakSecret { len: 5, .. })
        ));
        assert_eq!(ClusterKey::random_secret().len(), 64);
    }
}
