//! Accepting connections from whoever can reach a port, at a bounded cost. At most
//! [`MAX_HANDSHAKES`] connections authenticate at once: a new one past that closes the
//! oldest still authenticating, so connections that sit idle cannot hold the slots a
//! joining role needs (a real peer finishes in milliseconds; a flood evicts itself). Each
//! has one deadline for TLS, authentication and greeting together, cut to
//! [`BUSY_HANDSHAKE_TIMEOUT`] while more than [`BUSY_HANDSHAKES`] are in flight; accept
//! errors (out of file descriptors) back off instead of spinning, and refusals are logged
//! at a bounded rate.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::task::{AbortHandle, JoinHandle};

use crate::auth::ClusterKey;
use crate::link::{Link, LinkLimits};
use crate::messages::Hello;

/// Connections authenticating at once; a new one past this closes the oldest.
pub const MAX_HANDSHAKES: usize = 128;
/// Past this many handshakes in flight, new ones get [`BUSY_HANDSHAKE_TIMEOUT`].
pub const BUSY_HANDSHAKES: usize = 16;
/// A handshake's deadline while the gate is busy: ample for a peer that means it.
pub const BUSY_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Refusals logged in full per [`LOG_WINDOW`]; the rest are counted.
const LOGGED_PER_WINDOW: u32 = 5;
const LOG_WINDOW: Duration = Duration::from_secs(10);
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// What a listener admits: connections that prove `key` (and greet with `hello`), within
/// the bounds above.
#[derive(Clone)]
pub struct Gate {
    key: ClusterKey,
    hello: Hello,
    limits: LinkLimits,
    label: &'static str,
    in_flight: Arc<Mutex<InFlight>>,
    refusals: Arc<Mutex<Refusals>>,
}

/// The handshakes under way, oldest first.
#[derive(Default)]
struct InFlight {
    next: u64,
    handshakes: VecDeque<(u64, SocketAddr, AbortHandle)>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Gate {
    /// A gate proving `key`, greeting with `hello`; `label` prefixes its log lines (`""`,
    /// or e.g. `"weight server: "`).
    pub fn new(key: ClusterKey, hello: Hello, limits: LinkLimits, label: &'static str) -> Self {
        Self {
            key,
            hello,
            limits,
            label,
            in_flight: Arc::default(),
            refusals: Arc::new(Mutex::new(Refusals::default())),
        }
    }

    /// Accepts connections on `listener` until the task is dropped or aborted, handing each
    /// authenticated link to `on_link` (in a task of its own).
    pub fn serve<F, Fut>(self, listener: TcpListener, on_link: F) -> JoinHandle<()>
    where
        F: Fn(Link) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let on_link = Arc::new(on_link);
        tokio::spawn(async move {
            let mut backoff = Duration::ZERO;
            loop {
                let (stream, addr) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        backoff =
                            (backoff * 2).clamp(Duration::from_millis(10), MAX_ACCEPT_BACKOFF);
                        self.refused(
                            None,
                            &format!("accepting failed ({err}); retrying in {backoff:?}"),
                        );
                        tokio::time::sleep(backoff).await;
                        continue;
                    }
                };
                backoff = Duration::ZERO;
                self.admit(stream, addr, on_link.clone());
            }
        })
    }

    /// Starts the handshake of an accepted connection, closing the oldest one under way if
    /// [`MAX_HANDSHAKES`] are.
    fn admit<F, Fut>(&self, stream: tokio::net::TcpStream, addr: SocketAddr, on_link: Arc<F>)
    where
        F: Fn(Link) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut in_flight = lock(&self.in_flight);
        if in_flight.handshakes.len() >= MAX_HANDSHAKES
            && let Some((_, oldest, handshake)) = in_flight.handshakes.pop_front()
        {
            handshake.abort();
            self.refused(
                Some(oldest),
                "closed unauthenticated: the oldest of too many connections authenticating",
            );
        }
        let deadline = if in_flight.handshakes.len() >= BUSY_HANDSHAKES {
            self.limits.handshake_timeout.min(BUSY_HANDSHAKE_TIMEOUT)
        } else {
            self.limits.handshake_timeout
        };
        let id = in_flight.next;
        in_flight.next += 1;
        let gate = self.clone();
        // The handshake is its own task, so that closing it cannot end an authenticated
        // link's work (`on_link` runs in a task of its own).
        let handshake = tokio::spawn(async move {
            let accepted = Link::accept(stream, &gate.key, &gate.hello, &gate.limits);
            let accepted = tokio::time::timeout(deadline, accepted).await;
            lock(&gate.in_flight)
                .handshakes
                .retain(|(other, _, _)| *other != id);
            match accepted {
                Ok(Ok(link)) => {
                    tokio::spawn(on_link(link));
                }
                Ok(Err(err)) => gate.refused(Some(addr), &err.to_string()),
                Err(_) => gate.refused(
                    Some(addr),
                    &format!("no handshake within {:.0} s", deadline.as_secs_f64()),
                ),
            }
        });
        in_flight
            .handshakes
            .push_back((id, addr, handshake.abort_handle()));
    }

    fn refused(&self, addr: Option<SocketAddr>, reason: &str) {
        let mut refusals = self
            .refusals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(quiet) = refusals.count(Instant::now()) {
            tracing::warn!(
                "{}refused {quiet} more connections in the last {} s (not logged one by one)",
                self.label,
                LOG_WINDOW.as_secs()
            );
        }
        if refusals.logged <= LOGGED_PER_WINDOW {
            match addr {
                Some(addr) => {
                    tracing::warn!("{}refused a connection from {addr}: {reason}", self.label)
                }
                None => tracing::warn!("{}{reason}", self.label),
            }
        }
    }
}

/// Refusals in the current log window.
#[derive(Default)]
struct Refusals {
    window: Option<Instant>,
    logged: u32,
    quiet: u64,
}

impl Refusals {
    /// Counts one refusal at `now`; returns how many went unlogged in the window that just
    /// closed, if one did and any were.
    fn count(&mut self, now: Instant) -> Option<u64> {
        let mut closed = None;
        if self
            .window
            .is_none_or(|start| now.duration_since(start) >= LOG_WINDOW)
        {
            closed = (self.quiet > 0).then_some(self.quiet);
            *self = Self {
                window: Some(now),
                ..Self::default()
            };
        }
        self.logged = self.logged.saturating_add(1);
        if self.logged > LOGGED_PER_WINDOW {
            self.quiet += 1;
        }
        closed
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn hello(role: &str) -> Hello {
        Hello {
            role: role.into(),
            name: role.into(),
            version: "test".into(),
            credits: 4,
            info: serde_json::Value::Null,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_holding_every_slot_do_not_keep_a_peer_out() {
        let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (joined, mut links) = tokio::sync::mpsc::channel(1);
        let gate = Gate::new(key.clone(), hello("controller"), LinkLimits::default(), "");
        let serving = gate.clone().serve(listener, move |link| {
            let joined = joined.clone();
            async move {
                let _ = joined.send(link.peer.name.clone()).await;
            }
        });
        // Every slot taken by a connection that never says a word.
        let mut idle = Vec::new();
        for _ in 0..MAX_HANDSHAKES + 10 {
            idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock(&gate.in_flight).handshakes.len() < MAX_HANDSHAKES {
            assert!(
                Instant::now() < deadline,
                "the idle connections were not all accepted"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A real peer gets in at once, well before the idle ones' deadline would free a slot.
        let started = Instant::now();
        let link = Link::connect(&addr, &key, &hello("worker"), &LinkLimits::default()).await;
        assert!(link.is_ok(), "{link:?}");
        let name = tokio::time::timeout(Duration::from_secs(5), links.recv()).await;
        assert_eq!(name.unwrap().as_deref(), Some("worker"));
        assert!(
            started.elapsed() < BUSY_HANDSHAKE_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
        assert!(lock(&gate.in_flight).handshakes.len() <= MAX_HANDSHAKES);
        serving.abort();
    }

    #[test]
    fn refusals_past_the_first_few_are_counted_then_summed_up() {
        let mut refusals = Refusals::default();
        let start = Instant::now();
        for _ in 0..LOGGED_PER_WINDOW + 7 {
            assert_eq!(refusals.count(start), None);
        }
        assert_eq!(refusals.quiet, 7);
        assert_eq!(refusals.count(start + LOG_WINDOW), Some(7));
        assert_eq!((refusals.logged, refusals.quiet), (1, 0));
        assert_eq!(refusals.count(start + LOG_WINDOW * 3), None);
    }
}
