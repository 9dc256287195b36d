//! Accepting connections from whoever can reach a port, at a bounded cost. At most
//! [`MAX_HANDSHAKES`] connections authenticate at once, and at most
//! [`MAX_HANDSHAKES_PER_SOURCE`] from one source address. A new connection past either cap
//! closes the handshake in that scope that has made the least progress (see
//! [`crate::handshakes`]), so connections that sit idle cannot hold the slots a joining role
//! needs, and one that is authenticating is not closed for them. Each has one deadline for
//! TLS, authentication and greeting together, cut to [`BUSY_HANDSHAKE_TIMEOUT`] while more
//! than [`BUSY_HANDSHAKES`] are in flight; accept errors (out of file descriptors) back off
//! instead of spinning, and refusals are logged at a bounded rate.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

use crate::auth::ClusterKey;
use crate::handshakes::{Closed, Handshakes, Progress, source_of};
pub use crate::handshakes::{MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE, Stage};
use crate::link::{Link, LinkLimits};
use crate::messages::Hello;

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
    in_flight: Arc<Mutex<Handshakes<AbortHandle>>>,
    refusals: Arc<Mutex<Refusals>>,
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

    /// Handshakes under way.
    pub fn in_flight(&self) -> usize {
        lock(&self.in_flight).len()
    }

    /// Handshakes under way from `ip`'s source (its IPv6 /64).
    pub fn in_flight_from(&self, ip: IpAddr) -> usize {
        lock(&self.in_flight).count_from(source_of(ip))
    }

    /// Starts the handshake of an accepted connection, making room for it first: past a
    /// cap, the handshake with the least progress in that scope is closed, or, where every
    /// one there is authenticated, this connection is refused before it is sent a byte.
    fn admit<F, Fut>(&self, stream: TcpStream, addr: SocketAddr, on_link: Arc<F>)
    where
        F: Fn(Link) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut in_flight = lock(&self.in_flight);
        match in_flight.make_room(addr) {
            Ok(None) => {}
            Ok(Some(Closed {
                addr: closed,
                stage,
                cap,
                handle,
            })) => {
                handle.abort();
                self.refused(
                    Some(closed),
                    &format!("closed unauthenticated ({stage}) for a newer one: {cap}"),
                );
            }
            Err(cap) => {
                drop(in_flight);
                drop(stream);
                self.refused(Some(addr), &format!("refused at once: {cap} already"));
                return;
            }
        }
        let deadline = if in_flight.len() >= BUSY_HANDSHAKES {
            self.limits.handshake_timeout.min(BUSY_HANDSHAKE_TIMEOUT)
        } else {
            self.limits.handshake_timeout
        };
        let (id, progress) = (in_flight.next_id(), Progress::default());
        // The handshake is its own task, so that closing it cannot end an authenticated
        // link's work (`on_link` runs in a task of its own). It removes itself from
        // `in_flight` once over, which it cannot do before it is inserted (below, under the
        // same lock).
        let handshake = tokio::spawn(self.clone().handshake(
            (stream, addr, id),
            deadline,
            progress.clone(),
            on_link,
        ));
        let inserted = in_flight.insert(addr, progress, handshake.abort_handle());
        debug_assert_eq!(inserted, id);
    }

    /// One connection's handshake, within `deadline`; an authenticated link goes to
    /// `on_link`.
    async fn handshake<F, Fut>(
        self,
        (stream, addr, id): (TcpStream, SocketAddr, u64),
        deadline: Duration,
        progress: Progress,
        on_link: Arc<F>,
    ) where
        F: Fn(Link) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let accepted =
            Link::accept_watched(stream, &self.key, &self.hello, &self.limits, &progress);
        let accepted = tokio::time::timeout(deadline, accepted).await;
        lock(&self.in_flight).remove(id);
        match accepted {
            Ok(Ok(link)) => {
                tokio::spawn(on_link(link));
            }
            Ok(Err(err)) => self.refused(Some(addr), &err.to_string()),
            Err(_) => self.refused(
                Some(addr),
                &format!(
                    "no handshake within {:.0} s ({})",
                    deadline.as_secs_f64(),
                    progress.stage()
                ),
            ),
        }
    }

    fn refused(&self, addr: Option<SocketAddr>, reason: &str) {
        let mut refusals = lock(&self.refusals);
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

    /// Connections refused or closed so far, logged or not.
    pub fn refusals(&self) -> u64 {
        lock(&self.refusals).total
    }
}

/// Refusals in the current log window.
#[derive(Default)]
struct Refusals {
    window: Option<Instant>,
    logged: u32,
    quiet: u64,
    /// Every refusal since the gate started.
    total: u64,
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
                total: self.total,
                ..Self::default()
            };
        }
        self.total += 1;
        self.logged = self.logged.saturating_add(1);
        if self.logged > LOGGED_PER_WINDOW {
            self.quiet += 1;
        }
        closed
    }
}

#[cfg(test)]
#[path = "gate_tests.rs"]
mod tests;
