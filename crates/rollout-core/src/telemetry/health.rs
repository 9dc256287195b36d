//! The health of a distributed run's role processes: up or down, when last heard, joins,
//! losses and restarts, per process.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rollout_net::heard::HeardClock;

use super::series::FloatGauge;

/// Which kind of role process.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum RoleKind {
    /// A generation worker (label `role="worker"`).
    Worker,
    /// A trainer rank (label `role="trainer"`).
    Trainer,
}

impl RoleKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RoleKind::Worker => "worker",
            RoleKind::Trainer => "trainer",
        }
    }
}

impl EncodeLabelValue for RoleKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct RoleLabels {
    role: RoleKind,
    worker: String,
}

#[derive(Default)]
struct Board {
    /// The connection clock of each process that ever joined (kept after it is lost).
    clocks: Mutex<BTreeMap<RoleLabels, HeardClock>>,
    up: Family<RoleLabels, Gauge>,
    last_heard: Family<RoleLabels, FloatGauge>,
    joins: Family<RoleLabels, Counter>,
    losses: Family<RoleLabels, Counter>,
    restarts: Family<RoleLabels, Counter>,
}

/// Where the generation pool, the controller and `rollout launch` report what happens to
/// the role processes. Cheap to clone; the default one (no `/metrics` server) records
/// nothing.
#[derive(Clone, Default)]
pub struct WorkerHealth {
    board: Option<Arc<Board>>,
}

impl std::fmt::Debug for WorkerHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHealth")
            .field("recording", &self.board.is_some())
            .finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn labels(role: RoleKind, name: &str) -> RoleLabels {
    RoleLabels {
        role,
        worker: name.to_owned(),
    }
}

impl WorkerHealth {
    /// A recording handle whose series are registered in `registry`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let board = Board::default();
        registry.register(
            "rollout_worker_up",
            "Whether the role process is connected and part of the run (1) or not (0)",
            board.up.clone(),
        );
        registry.register(
            "rollout_worker_last_heard_seconds",
            "Seconds since the controller last received anything from the role process, \
             heartbeats included",
            board.last_heard.clone(),
        );
        registry.register(
            "rollout_worker_joins",
            "Times the role process joined the run (its first join included)",
            board.joins.clone(),
        );
        registry.register(
            "rollout_worker_losses",
            "Times the role process was lost (connection dropped, silent, or a lease timed out)",
            board.losses.clone(),
        );
        registry.register(
            "rollout_worker_restarts",
            "Times rollout launch started the role process again after it died",
            board.restarts.clone(),
        );
        WorkerHealth {
            board: Some(Arc::new(board)),
        }
    }

    /// `name` joined (or joined again); `heard` is its connection's clock.
    pub fn joined(&self, role: RoleKind, name: &str, heard: HeardClock) {
        let Some(board) = &self.board else { return };
        let key = labels(role, name);
        board.up.get_or_create(&key).set(1);
        board.joins.get_or_create(&key).inc();
        // Every series of a process exists from its first join, at 0 until it happens.
        board.losses.get_or_create(&key).inc_by(0);
        board.restarts.get_or_create(&key).inc_by(0);
        lock(&board.clocks).insert(key, heard);
    }

    /// The connection of `name` whose clock is `heard` was lost: it is down until it joins
    /// again. (A process that rejoined under the same name before its old connection was
    /// found lost stays up.)
    pub fn lost(&self, role: RoleKind, name: &str, heard: &HeardClock) {
        let Some(board) = &self.board else { return };
        let key = labels(role, name);
        board.losses.get_or_create(&key).inc();
        self.down_if_current(board, key, heard);
    }

    /// The connection of `name` was shut down with the run (not a loss).
    pub fn left(&self, role: RoleKind, name: &str, heard: &HeardClock) {
        let Some(board) = &self.board else { return };
        self.down_if_current(board, labels(role, name), heard);
    }

    fn down_if_current(&self, board: &Board, key: RoleLabels, heard: &HeardClock) {
        let current = lock(&board.clocks)
            .get(&key)
            .is_none_or(|clock| clock.is(heard));
        if current {
            board.up.get_or_create(&key).set(0);
        }
    }

    /// `rollout launch` started the process of `name` again.
    pub fn restarted(&self, role: RoleKind, name: &str) {
        let Some(board) = &self.board else { return };
        board.restarts.get_or_create(&labels(role, name)).inc();
    }

    /// Sets each process's last-heard age as of `now` (before the registry is encoded).
    pub(super) fn refresh(&self, now: SystemTime) {
        let Some(board) = &self.board else { return };
        for (key, clock) in lock(&board.clocks).iter() {
            let age = now
                .duration_since(clock.last())
                .map_or(0.0, |age| age.as_secs_f64());
            board.last_heard.get_or_create(key).set(age);
        }
    }
}
