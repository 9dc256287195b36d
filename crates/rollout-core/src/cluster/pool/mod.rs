//! Generation workers as a pool that changes during a run.
//!
//! A step's prompt groups are dealt round-robin among the live workers, each as a lease in
//! the [`Ledger`]. A worker that is lost (connection dropped, heartbeats missed) or misses
//! its lease deadline leaves the pool; its groups are leased to the others, up to
//! `max_attempts` times each. Group seeds travel with the prompts, so a group generated
//! again elsewhere is the same samples. Workers that connect mid-run are welcomed, pull the
//! newest weights, and only then get work. Weight versions travel along a chain of the
//! live workers.

mod checks;
mod generation;
mod memory;
mod sync;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rollout_net::link::Link;
use rollout_net::messages::{
    Done, GenerateRequest, GenerateResponse, GeneratorMemory, Loaded, Shutdown, SyncWeights,
    TokenizerRequest, TokenizerResponse, WeightsReport, Welcome,
};
use rollout_net::rpc::RpcClient;
use tokio::sync::{Notify, mpsc};

use super::ledger::{Ledger, LedgerCounts, LedgerError};
use super::remote::send;
use crate::roles::{Generator, Publication, RoleError, RoleFuture, StepGroups, Tokenizer};
use crate::telemetry::{RoleKind, WorkerHealth};
use sync::verify;

pub use checks::{MAX_LOGPROB, MIN_LOGPROB};

/// How the pool treats slow, lost and late workers.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// A worker that holds a lease this long without answering is treated as lost.
    pub lease_timeout: Duration,
    /// How long generation waits for a worker when none is left.
    pub join_timeout: Duration,
    /// Leases per group before it is dropped.
    pub max_attempts: u32,
    /// Where joins and losses are reported (`/metrics`); the default records nothing.
    pub health: WorkerHealth,
    /// The policy's vocabulary size: completions with token ids past it are refused.
    pub vocabulary: Option<u64>,
    /// The workers share the trainers' devices (`[cluster.devices] colocate`): they are told
    /// to release their device memory before each update and to take it back after.
    pub colocated: bool,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            lease_timeout: Duration::from_secs(600),
            join_timeout: Duration::from_secs(300),
            max_attempts: 3,
            health: WorkerHealth::default(),
            vocabulary: None,
            colocated: false,
        }
    }
}

struct Member {
    name: String,
    client: RpcClient,
    /// The newest weight version sent to it: its completions may not claim a newer one.
    newest_version: AtomicU64,
}

impl Member {
    fn new(client: RpcClient) -> Arc<Self> {
        Arc::new(Self {
            name: client.peer().name.clone(),
            client,
            newest_version: AtomicU64::new(0),
        })
    }

    fn sent_version(&self, version: u64) {
        self.newest_version.fetch_max(version, Ordering::SeqCst);
    }

    /// The address this worker serves weights on, as it announced in its greeting.
    fn weights_address(&self) -> String {
        self.client.peer().info["weights_address"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// Joins and losses since the last report, answers refused as malformed (and the samples
/// they held), and completions per worker.
#[derive(Default)]
struct Tally {
    joined: u64,
    lost: u64,
    malformed: u64,
    samples_refused: u64,
    completions: BTreeMap<String, u64>,
}

/// How long `shutdown` waits for workers still joining to be turned away.
const ADMIT_GRACE: Duration = Duration::from_secs(10);

struct Shared {
    members: Mutex<Vec<Arc<Member>>>,
    /// Set once the run is over: workers that connect now are sent away.
    closed: AtomicBool,
    /// Late workers being admitted now; `shutdown` waits for them to be turned away.
    admitting: tokio::sync::watch::Sender<usize>,
    /// The newest weights published (what a joining worker pulls, once sealed).
    latest: tokio::sync::watch::Sender<Option<WeightsReport>>,
    arrived: Notify,
    ledger: Mutex<Ledger>,
    tally: Mutex<Tally>,
    settings: PoolSettings,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn journal_error(err: LedgerError) -> RoleError {
    RoleError::Runtime(err.to_string())
}

/// A failure that takes the worker out of the pool (rather than ending the run).
fn is_loss(err: &RoleError) -> bool {
    matches!(
        err,
        RoleError::WorkerLost { .. } | RoleError::TimedOut { .. }
    )
}

/// Generation workers, joined before and during the run.
pub struct RemoteWorkers {
    shared: Arc<Shared>,
}

impl RemoteWorkers {
    pub fn new(workers: Vec<RpcClient>, ledger: Ledger, settings: PoolSettings) -> Self {
        for client in &workers {
            let name = &client.peer().name;
            settings
                .health
                .joined(RoleKind::Worker, name, client.heard());
        }
        let members: Vec<Arc<Member>> = workers.into_iter().map(Member::new).collect();
        let shared = Arc::new(Shared {
            members: Mutex::new(members.clone()),
            closed: AtomicBool::new(false),
            admitting: tokio::sync::watch::channel(0).0,
            latest: tokio::sync::watch::channel(None).0,
            arrived: Notify::new(),
            ledger: Mutex::new(ledger),
            tally: Mutex::new(Tally::default()),
            settings,
        });
        for member in members {
            shared.watch(member);
        }
        Self { shared }
    }

    /// Welcomes generation workers that connect from now on (`links`), loads the newest
    /// weights into each, then gives it work.
    pub fn admit_late_workers(&self, mut links: mpsc::Receiver<Link>, config_toml: String) {
        let shared = self.shared.clone();
        tokio::spawn(async move {
            while let Some(link) = links.recv().await {
                if link.peer.role != "worker" {
                    tracing::warn!(
                        "refused {}: only generation workers can join a running run",
                        link.describe()
                    );
                    continue;
                }
                let (shared, config_toml) = (shared.clone(), config_toml.clone());
                shared.admitting.send_modify(|n| *n += 1);
                tokio::spawn(async move {
                    let member = Member::new(link.client());
                    let admitted = shared.admit(member.clone(), config_toml).await;
                    shared.admitting.send_modify(|n| *n = n.saturating_sub(1));
                    if let Err(err) = admitted {
                        tracing::warn!("{} could not join: {err}", member.name);
                    }
                });
            }
        });
    }

    /// Closes every worker's connection without shutting the worker down: it connects
    /// again, to the next controller. For a controller abandoned mid-run.
    pub fn disconnect(&self, reason: &str) {
        self.shared.closed.store(true, Ordering::SeqCst);
        for member in lock(&self.shared.members).iter() {
            member.client.close(reason);
        }
        self.report_left();
    }

    pub async fn shutdown(&self, reason: &str) {
        self.shared.closed.store(true, Ordering::SeqCst);
        let members = lock(&self.shared.members).clone();
        for member in members {
            let reason = reason.to_owned();
            let _ = send::<_, Done>(&member.client, &Shutdown { reason }).await;
        }
        // A worker still joining is turned away once its weights are in; were the process to
        // exit first, it would take the closed link for a lost controller and keep retrying.
        let mut admitting = self.shared.admitting.subscribe();
        let settled = admitting.wait_for(|&n| n == 0);
        if tokio::time::timeout(ADMIT_GRACE, settled).await.is_err() {
            tracing::warn!("workers still joining after {ADMIT_GRACE:?}; leaving them");
        }
        self.report_left();
    }

    /// Reports every worker still in the pool as down: the run is over.
    pub fn report_left(&self) {
        let health = &self.shared.settings.health;
        for member in lock(&self.shared.members).iter() {
            health.left(RoleKind::Worker, &member.name, &member.client.heard());
        }
    }
}

/// Tells a worker that arrived after the run ended to leave.
async fn turn_away(member: &Member) -> Result<(), RoleError> {
    let reason = "the run is over".to_owned();
    let _ = send::<_, Done>(&member.client, &Shutdown { reason }).await;
    Ok(())
}

impl Shared {
    /// Takes `member` out of the pool as soon as its connection ends, in whatever phase
    /// the run is (a warm start, a weight sync, generation), not at the next call to it.
    fn watch(self: &Arc<Self>, member: Arc<Member>) {
        let shared = Arc::downgrade(self);
        tokio::spawn(async move {
            let err = member.client.lost().await;
            if let Some(shared) = shared.upgrade()
                && !shared.closed.load(Ordering::SeqCst)
            {
                let err = RoleError::WorkerLost {
                    role: member.name.clone(),
                    reason: err.to_string(),
                };
                shared.lose(&member, &err);
            }
        });
    }

    async fn admit(
        self: &Arc<Self>,
        member: Arc<Member>,
        config_toml: String,
    ) -> Result<(), RoleError> {
        if self.closed.load(Ordering::SeqCst) {
            return turn_away(&member).await;
        }
        let welcome = Welcome {
            config_toml,
            assignment: serde_json::json!({ "late": true }),
        };
        let limit = self.settings.join_timeout;
        tokio::time::timeout(limit, send::<_, Loaded>(&member.client, &welcome))
            .await
            .map_err(|_| self.timed_out(&member, limit))??;
        loop {
            let latest = self.sealed_latest(&member, limit).await?;
            if let Some(weights) = &latest {
                match self.pull_from_any(&member, weights, limit).await {
                    Ok(()) => {}
                    // A newer version replaced this one mid-pull: pull that one instead.
                    Err(err) if !is_loss(&err) && *self.latest.borrow() != latest => {
                        tracing::debug!("{}: {err}; pulling the newer version", member.name);
                        continue;
                    }
                    Err(err) => return Err(err),
                }
            }
            let mut members = lock(&self.members);
            // Checked under the lock `shutdown` takes after closing the pool: a worker that
            // finished joining as the run ended is either among those it shuts down or
            // turned away here, never left connected to a controller about to exit.
            if self.closed.load(Ordering::SeqCst) {
                drop(members);
                return turn_away(&member).await;
            }
            if *self.latest.borrow() == latest {
                members.push(member.clone());
                break;
            }
        }
        self.watch(member.clone());
        lock(&self.tally).joined += 1;
        let heard = member.client.heard();
        self.settings
            .health
            .joined(RoleKind::Worker, &member.name, heard);
        self.arrived.notify_waiters();
        tracing::info!("{} joined the run's generation workers", member.name);
        Ok(())
    }

    /// The newest weights published, once their checksum is known (a version is announced
    /// before it is sealed; a joining worker pulls it sealed).
    async fn sealed_latest(
        &self,
        member: &Member,
        limit: Duration,
    ) -> Result<Option<WeightsReport>, RoleError> {
        let mut latest = self.latest.subscribe();
        let sealed =
            latest.wait_for(|weights| weights.as_ref().is_none_or(WeightsReport::is_sealed));
        match tokio::time::timeout(limit, sealed).await {
            Ok(Ok(weights)) => Ok(weights.clone()),
            _ => Err(self.timed_out(member, limit)),
        }
    }

    /// Has a joining `member` pull `weights` from their publisher, else from each live
    /// worker in turn (a source may have died since it was announced).
    async fn pull_from_any(
        &self,
        member: &Member,
        weights: &WeightsReport,
        limit: Duration,
    ) -> Result<(), RoleError> {
        let peers: Vec<String> = lock(&self.members)
            .iter()
            .map(|m| m.weights_address())
            .filter(|address| !address.is_empty() && *address != weights.source)
            .collect();
        let mut failed = match self.pull_latest(member, weights, limit).await {
            Err(err) if !is_loss(&err) => err,
            done => return done,
        };
        for source in peers {
            tracing::info!(
                "{}: could not pull weight version {} ({failed}); pulling from {source}",
                member.name,
                weights.version
            );
            let elsewhere = WeightsReport {
                source,
                ..weights.clone()
            };
            failed = match self.pull_latest(member, &elsewhere, limit).await {
                Err(err) if !is_loss(&err) => err,
                done => return done,
            };
        }
        Err(failed)
    }

    async fn pull_latest(
        &self,
        member: &Member,
        weights: &WeightsReport,
        limit: Duration,
    ) -> Result<(), RoleError> {
        let request = SyncWeights {
            weights: weights.clone(),
        };
        let pull = send::<_, WeightsReport>(&member.client, &request);
        member.sent_version(weights.version);
        let report = tokio::time::timeout(limit, pull)
            .await
            .map_err(|_| self.timed_out(member, limit))??;
        verify(&member.name, &report, weights)
    }

    fn timed_out(&self, member: &Member, limit: Duration) -> RoleError {
        RoleError::TimedOut {
            role: member.name.clone(),
            seconds: limit.as_secs_f64(),
        }
    }

    /// Takes `member` out of the pool (once, however many calls report it).
    fn lose(&self, member: &Arc<Member>, err: &RoleError) {
        let mut members = lock(&self.members);
        let before = members.len();
        members.retain(|m| !Arc::ptr_eq(m, member));
        if members.len() < before {
            lock(&self.tally).lost += 1;
            let heard = member.client.heard();
            let health = &self.settings.health;
            health.lost(RoleKind::Worker, &member.name, &heard);
            tracing::warn!(
                "{} left the generation pool ({err}); {} workers remain",
                member.name,
                members.len()
            );
        }
    }

    /// Takes `member` out of the pool for a malformed answer and shuts it down: an
    /// authenticated worker that breaks the protocol is not trusted with more work.
    fn send_away(&self, member: &Arc<Member>, reason: &str) {
        let err = RoleError::Protocol(format!("sent a malformed answer: {reason}"));
        self.lose(member, &err);
        let (member, reason) = (member.clone(), err.to_string());
        tokio::spawn(async move {
            let _ = send::<_, Done>(&member.client, &Shutdown { reason }).await;
        });
    }

    /// The live workers, waiting up to the join timeout for one when none is left.
    async fn live_members(&self) -> Result<Vec<Arc<Member>>, RoleError> {
        let deadline = tokio::time::Instant::now() + self.settings.join_timeout;
        loop {
            let arrived = self.arrived.notified();
            let members = lock(&self.members).clone();
            if !members.is_empty() {
                return Ok(members);
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return Err(RoleError::WorkerLost {
                    role: "every generation worker".into(),
                    reason: format!(
                        "none joined within {:.0} s (cluster.join_timeout_seconds)",
                        self.settings.join_timeout.as_secs_f64()
                    ),
                });
            }
        }
    }

    /// Runs a tokenizer call on some live worker, moving on when one is lost or answers
    /// token ids outside the vocabulary (it is sent away, as for any malformed answer).
    async fn tokenize(&self, request: TokenizerRequest) -> Result<TokenizerResponse, RoleError> {
        loop {
            let members = self.live_members().await?;
            let member = &members[0];
            match send::<_, TokenizerResponse>(&member.client, &request).await {
                Err(err) if is_loss(&err) => self.lose(member, &err),
                Ok(answer) => match self.outside_vocabulary(&answer) {
                    Some(reason) => {
                        self.send_away(member, &reason);
                        lock(&self.tally).malformed += 1;
                    }
                    None => return Ok(answer),
                },
                answer => return answer,
            }
        }
    }

    /// Why a tokenizer's answer cannot be used: an id past the policy's vocabulary.
    fn outside_vocabulary(&self, answer: &TokenizerResponse) -> Option<String> {
        let (TokenizerResponse::Ids { ids }, Some(vocabulary)) = (answer, self.settings.vocabulary)
        else {
            return None;
        };
        let id = ids
            .iter()
            .flatten()
            .find(|&&id| u64::from(id) >= vocabulary)?;
        Some(format!(
            "the tokenizer answered token id {id}, outside the vocabulary of {vocabulary}"
        ))
    }

    /// Pool metrics since the last call: `workers`, joins and losses, the ledger's counts,
    /// and each worker's completions.
    fn report(&self) -> BTreeMap<String, f64> {
        let LedgerCounts {
            leased,
            revoked,
            rejected,
        } = lock(&self.ledger).take_counts();
        let tally = std::mem::take(&mut *lock(&self.tally));
        let mut metrics = BTreeMap::from([
            ("workers".to_owned(), lock(&self.members).len() as f64),
            ("workers_joined".to_owned(), tally.joined as f64),
            ("workers_lost".to_owned(), tally.lost as f64),
            ("leases".to_owned(), leased as f64),
            ("leases_revoked".to_owned(), revoked as f64),
            ("answers_rejected".to_owned(), rejected as f64),
            ("answers_malformed".to_owned(), tally.malformed as f64),
            (
                "samples_excluded_malformed".to_owned(),
                tally.samples_refused as f64,
            ),
        ]);
        for (name, count) in tally.completions {
            metrics.insert(format!("worker_completions/{name}"), count as f64);
        }
        metrics
    }
}

impl Generator for RemoteWorkers {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let started = self.shared.start(request);
        Box::pin(async move { self.shared.finish(started?).await })
    }

    fn load_weights(&self, weights: Publication) -> RoleFuture<'_, Vec<WeightsReport>> {
        Box::pin(self.shared.load_weights(weights))
    }

    /// Journals what became of the groups of `step` (fsynced) and reports the pool's
    /// metrics.
    fn step_trained(
        &self,
        step: u64,
        groups: &StepGroups,
    ) -> RoleFuture<'_, BTreeMap<String, f64>> {
        let trained = lock(&self.shared.ledger).trained(step, groups);
        let report = self.shared.report();
        Box::pin(async move { trained.map(|()| report).map_err(journal_error) })
    }

    fn resumed_from(&self, step: u64) -> RoleFuture<'_, ()> {
        let journaled = lock(&self.shared.ledger).rolled_back(step);
        Box::pin(async move { journaled.map_err(journal_error) })
    }

    fn release_memory(&self) -> RoleFuture<'_, ()> {
        Box::pin(self.shared.set_memory(GeneratorMemory::Release))
    }

    fn restore_memory(&self) -> RoleFuture<'_, ()> {
        Box::pin(self.shared.set_memory(GeneratorMemory::Restore))
    }

    /// Sends away the named workers still in the pool, as for a malformed answer (each
    /// counted in `answers_malformed`).
    fn send_away(&self, workers: Vec<String>, reason: String) -> RoleFuture<'_, ()> {
        let members = lock(&self.shared.members).clone();
        for member in members.iter().filter(|m| workers.contains(&m.name)) {
            self.shared.send_away(member, &reason);
            lock(&self.shared.tally).malformed += 1;
        }
        Box::pin(async { Ok(()) })
    }
}

impl Tokenizer for RemoteWorkers {
    fn encode(&self, texts: Vec<String>, continuation: bool) -> RoleFuture<'_, Vec<Vec<u32>>> {
        let request = TokenizerRequest::Encode {
            texts,
            continuation,
        };
        Box::pin(async move {
            match self.shared.tokenize(request).await? {
                TokenizerResponse::Ids { ids } => Ok(ids),
                other => Err(RoleError::Protocol(format!(
                    "asked to encode, the worker answered {other:?}"
                ))),
            }
        })
    }

    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>> {
        Box::pin(async move {
            match self
                .shared
                .tokenize(TokenizerRequest::Decode { sequences })
                .await?
            {
                TokenizerResponse::Texts { texts } => Ok(texts),
                other => Err(RoleError::Protocol(format!(
                    "asked to decode, the worker answered {other:?}"
                ))),
            }
        })
    }

    fn eos_token_ids(&self) -> RoleFuture<'_, Vec<u32>> {
        Box::pin(async move {
            match self.shared.tokenize(TokenizerRequest::EosTokenIds).await? {
                TokenizerResponse::Ids { mut ids } if ids.len() == 1 => Ok(ids.remove(0)),
                other => Err(RoleError::Protocol(format!(
                    "asked for the end-of-sequence ids, the worker answered {other:?}"
                ))),
            }
        })
    }
}
