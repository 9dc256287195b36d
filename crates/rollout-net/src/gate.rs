//! Accepting connections from whoever can reach a port, at a bounded cost. At most
//! [`MAX_HANDSHAKES`] connections authenticate at once (more are closed as they arrive);
//! each has one deadline for TLS, authentication and greeting together, cut to
//! [`BUSY_HANDSHAKE_TIMEOUT`] while more than [`BUSY_HANDSHAKES`] are in flight, so idle
//! connections cannot hold the slots a joining role needs; accept errors (out of file
//! descriptors) back off instead of spinning, and refusals are logged at a bounded rate.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::auth::ClusterKey;
use crate::link::{Link, LinkLimits};
use crate::messages::Hello;

/// Connections authenticating at once; more are closed as they arrive.
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
    in_flight: Arc<Semaphore>,
    refusals: Arc<Mutex<Refusals>>,
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
            in_flight: Arc::new(Semaphore::new(MAX_HANDSHAKES)),
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
                let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
                    drop(stream);
                    self.refused(Some(addr), "too many connections are authenticating");
                    continue;
                };
                let busy = MAX_HANDSHAKES - self.in_flight.available_permits() > BUSY_HANDSHAKES;
                let deadline = if busy {
                    self.limits.handshake_timeout.min(BUSY_HANDSHAKE_TIMEOUT)
                } else {
                    self.limits.handshake_timeout
                };
                let (gate, on_link) = (self.clone(), on_link.clone());
                tokio::spawn(async move {
                    let accepted = Link::accept(stream, &gate.key, &gate.hello, &gate.limits);
                    let accepted = tokio::time::timeout(deadline, accepted).await;
                    drop(permit);
                    match accepted {
                        Ok(Ok(link)) => on_link(link).await,
                        Ok(Err(err)) => gate.refused(Some(addr), &err.to_string()),
                        Err(_) => gate.refused(
                            Some(addr),
                            &format!("no handshake within {:.0} s", deadline.as_secs_f64()),
                        ),
                    }
                });
            }
        })
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
    use super::*;

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
