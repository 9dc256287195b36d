//! Generation workers as a pool that changes during a run.
//!
//! A step's prompt groups are dealt round-robin among the live workers, each as a lease in
//! the [`Ledger`]. A worker that is lost (connection dropped, heartbeats missed) or misses
//! its lease deadline leaves the pool; its groups are leased to the others, up to
//! `max_attempts` times each. Group seeds travel with the prompts, so a group generated
//! again elsewhere is the same samples. Workers that connect mid-run are welcomed, pull the
//! newest weights, and only then get work. Weight versions travel along a chain of the
//! live workers.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use rollout_net::link::Link;
use rollout_net::messages::{
    Completion, Done, GenerateRequest, GenerateResponse, Shutdown, SyncWeights, TokenizerRequest,
    TokenizerResponse, WeightsReport, Welcome,
};
use rollout_net::rpc::RpcClient;
use tokio::sync::{Notify, mpsc};

use super::ledger::{Ledger, LedgerCounts, LedgerError};
use super::remote::send;
use crate::roles::{Generator, RoleError, RoleFuture, Tokenizer};

/// How the pool treats slow, lost and late workers.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// A worker that holds a lease this long without answering is treated as lost.
    pub lease_timeout: Duration,
    /// How long generation waits for a worker when none is left.
    pub join_timeout: Duration,
    /// Leases per group before it is dropped.
    pub max_attempts: u32,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            lease_timeout: Duration::from_secs(600),
            join_timeout: Duration::from_secs(300),
            max_attempts: 3,
        }
    }
}

struct Member {
    name: String,
    client: RpcClient,
}

impl Member {
    fn new(client: RpcClient) -> Arc<Self> {
        Arc::new(Self {
            name: client.peer().name.clone(),
            client,
        })
    }

    /// The address this worker serves weights on, as it announced in its greeting.
    fn weights_address(&self) -> String {
        self.client.peer().info["weights_address"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// Joins and losses since the last report, and completions per worker.
#[derive(Default)]
struct Tally {
    joined: u64,
    lost: u64,
    completions: BTreeMap<String, u64>,
}

struct Shared {
    members: Mutex<Vec<Arc<Member>>>,
    /// The newest weights published (what a joining worker pulls).
    latest: Mutex<Option<WeightsReport>>,
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

/// One generation request in progress.
struct Generation {
    request: GenerateRequest,
    results: Vec<Option<Vec<Completion>>>,
    /// Leases so far, per prompt.
    attempts: Vec<u32>,
    /// Prompts to lease (again).
    pending: Vec<usize>,
    in_flight: FuturesUnordered<Answer>,
    parts: Vec<BTreeMap<String, f64>>,
    dropped: usize,
}

type Answer = Pin<Box<dyn Future<Output = (Share, Result<GenerateResponse, RoleError>)> + Send>>;

/// One generation call to one worker: which prompts of the request, under which leases.
struct Share {
    member: Arc<Member>,
    positions: Vec<usize>,
    leases: Vec<u64>,
}

impl RemoteWorkers {
    pub fn new(workers: Vec<RpcClient>, ledger: Ledger, settings: PoolSettings) -> Self {
        Self {
            shared: Arc::new(Shared {
                members: Mutex::new(workers.into_iter().map(Member::new).collect()),
                latest: Mutex::new(None),
                arrived: Notify::new(),
                ledger: Mutex::new(ledger),
                tally: Mutex::new(Tally::default()),
                settings,
            }),
        }
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
                tokio::spawn(async move {
                    let member = Member::new(link.client());
                    if let Err(err) = shared.admit(member.clone(), config_toml).await {
                        tracing::warn!("{} could not join: {err}", member.name);
                    }
                });
            }
        });
    }

    pub async fn shutdown(&self, reason: &str) {
        let members = lock(&self.shared.members).clone();
        for member in members {
            let reason = reason.to_owned();
            let _ = send::<_, Done>(&member.client, &Shutdown { reason }).await;
        }
    }
}

impl Shared {
    async fn admit(&self, member: Arc<Member>, config_toml: String) -> Result<(), RoleError> {
        let welcome = Welcome {
            config_toml,
            assignment: serde_json::json!({ "late": true }),
        };
        let limit = self.settings.join_timeout;
        tokio::time::timeout(limit, send::<_, Done>(&member.client, &welcome))
            .await
            .map_err(|_| self.timed_out(&member, limit))??;
        loop {
            let latest = lock(&self.latest).clone();
            if let Some(weights) = &latest {
                let request = SyncWeights {
                    weights: weights.clone(),
                };
                let pull = send::<_, WeightsReport>(&member.client, &request);
                let report = tokio::time::timeout(limit, pull)
                    .await
                    .map_err(|_| self.timed_out(&member, limit))??;
                verify(&member.name, &report, weights)?;
            }
            let mut members = lock(&self.members);
            if *lock(&self.latest) == latest {
                members.push(member.clone());
                break;
            }
        }
        lock(&self.tally).joined += 1;
        self.arrived.notify_waiters();
        tracing::info!("{} joined the run's generation workers", member.name);
        Ok(())
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
            tracing::warn!(
                "{} left the generation pool ({err}); {} workers remain",
                member.name,
                members.len()
            );
        }
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

    /// Leases `positions` of `request` to `members`, round-robin; positions whose group
    /// ran out of attempts come back as dropped.
    fn deal(
        &self,
        request: &GenerateRequest,
        members: &[Arc<Member>],
        positions: Vec<usize>,
        attempts: &mut [u32],
    ) -> Result<(Vec<Share>, Vec<usize>), RoleError> {
        let mut shares: Vec<Share> = members
            .iter()
            .map(|member| Share {
                member: member.clone(),
                positions: Vec::new(),
                leases: Vec::new(),
            })
            .collect();
        let mut dropped = Vec::new();
        let mut ledger = lock(&self.ledger);
        let now = Instant::now();
        for (turn, position) in positions.into_iter().enumerate() {
            let share = &mut shares[turn % members.len()];
            attempts[position] += 1;
            let group = request.prompts[position].group;
            if attempts[position] > self.settings.max_attempts {
                if let Some(group) = group {
                    let reason = format!("no answer after {} leases", attempts[position] - 1);
                    ledger.dropped(group, &reason).map_err(journal_error)?;
                }
                dropped.push(position);
                continue;
            }
            let lease = match group {
                Some(group) => ledger
                    .lease(
                        group,
                        &share.member.name,
                        attempts[position],
                        now,
                        self.settings.lease_timeout,
                    )
                    .map_err(journal_error)?,
                None => 0,
            };
            share.positions.push(position);
            share.leases.push(lease);
        }
        shares.retain(|share| !share.positions.is_empty());
        Ok((shares, dropped))
    }

    /// Accepts a worker's answer lease by lease; returns the positions whose answer was
    /// rejected (to be generated again).
    fn accept(
        &self,
        request: &GenerateRequest,
        share: &Share,
        response: GenerateResponse,
        results: &mut [Option<Vec<Completion>>],
    ) -> Result<Vec<usize>, RoleError> {
        if response.groups.len() != share.positions.len() {
            return Err(RoleError::Protocol(format!(
                "{} answered {} groups for {} prompts",
                share.member.name,
                response.groups.len(),
                share.positions.len()
            )));
        }
        let mut ledger = lock(&self.ledger);
        let now = Instant::now();
        let mut again = Vec::new();
        let mut completions = 0;
        for ((&position, &lease), group) in share
            .positions
            .iter()
            .zip(&share.leases)
            .zip(response.groups)
        {
            let tracked = request.prompts[position].group.is_some();
            if !tracked || ledger.complete(lease, now).map_err(journal_error)? {
                completions += group.len() as u64;
                results[position] = Some(group);
            } else {
                again.push(position);
            }
        }
        *lock(&self.tally)
            .completions
            .entry(share.member.name.clone())
            .or_default() += completions;
        Ok(again)
    }

    fn revoke(&self, share: &Share, err: &RoleError) -> Result<(), RoleError> {
        let mut ledger = lock(&self.ledger);
        for &lease in &share.leases {
            if lease != 0 {
                ledger
                    .revoke(lease, &err.to_string())
                    .map_err(journal_error)?;
            }
        }
        Ok(())
    }

    /// Starts generating `request`: its prompts are leased and sent now, when a worker is
    /// live, so they reach each worker in the order of the calls (after any weight sync
    /// asked for before).
    fn start(&self, request: GenerateRequest) -> Result<Generation, RoleError> {
        let total = request.prompts.len();
        let mut generation = Generation {
            request,
            results: vec![None; total],
            attempts: vec![0; total],
            pending: (0..total).collect(),
            in_flight: FuturesUnordered::new(),
            parts: Vec::new(),
            dropped: 0,
        };
        let members = lock(&self.members).clone();
        if !members.is_empty() {
            self.dispatch(&mut generation, &members)?;
        }
        Ok(generation)
    }

    /// Leases and sends the pending prompts of `generation` to `members`.
    fn dispatch(
        &self,
        generation: &mut Generation,
        members: &[Arc<Member>],
    ) -> Result<(), RoleError> {
        let pending = std::mem::take(&mut generation.pending);
        let (shares, gone) = self.deal(
            &generation.request,
            members,
            pending,
            &mut generation.attempts,
        )?;
        for &position in &gone {
            generation.results[position] = Some(Vec::new());
        }
        generation.dropped += gone.len();
        let limit = self.settings.lease_timeout;
        for share in shares {
            let call = GenerateRequest {
                prompts: share
                    .positions
                    .iter()
                    .map(|&p| generation.request.prompts[p].clone())
                    .collect(),
                sampling: generation.request.sampling.clone(),
            };
            let answer = send::<_, GenerateResponse>(&share.member.client, &call);
            generation.in_flight.push(Box::pin(async move {
                let result = tokio::time::timeout(limit, answer)
                    .await
                    .unwrap_or_else(|_| {
                        Err(RoleError::TimedOut {
                            role: share.member.name.clone(),
                            seconds: limit.as_secs_f64(),
                        })
                    });
                (share, result)
            }));
        }
        Ok(())
    }

    /// Collects the answers of `generation`, leasing again what a lost worker held.
    async fn finish(&self, mut generation: Generation) -> Result<GenerateResponse, RoleError> {
        loop {
            if !generation.pending.is_empty() {
                let members = self.live_members().await?;
                self.dispatch(&mut generation, &members)?;
            }
            let Some((share, result)) = generation.in_flight.next().await else {
                break;
            };
            match result {
                Ok(response) => {
                    generation.parts.push(response.metrics.clone());
                    let again = self.accept(
                        &generation.request,
                        &share,
                        response,
                        &mut generation.results,
                    )?;
                    generation.pending.extend(again);
                }
                Err(err) if is_loss(&err) => {
                    self.lose(&share.member, &err);
                    self.revoke(&share, &err)?;
                    generation.pending.extend(share.positions);
                }
                Err(err) => return Err(err),
            }
        }
        let mut metrics = crate::generation::merge_metrics(&generation.parts);
        metrics.insert("groups_dropped".into(), generation.dropped as f64);
        Ok(GenerateResponse {
            groups: generation
                .results
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect(),
            metrics,
        })
    }

    /// Sends `weights` along a chain of the live workers now (so the sync reaches each
    /// worker before any generation asked for later); a worker whose pull fails because its
    /// source left is then sent straight to the trainer's copy. Workers lost on the way
    /// leave the pool.
    fn load_weights(
        self: &Arc<Self>,
        weights: WeightsReport,
    ) -> impl Future<Output = Result<Vec<WeightsReport>, RoleError>> + Send + 'static {
        let members = {
            let members = lock(&self.members);
            *lock(&self.latest) = Some(weights.clone());
            members.clone()
        };
        let mut source = weights.source.clone();
        let calls: Vec<_> = members
            .iter()
            .map(|member| {
                let request = SyncWeights {
                    weights: WeightsReport {
                        source: std::mem::replace(&mut source, member.weights_address()),
                        ..weights.clone()
                    },
                };
                (
                    member.clone(),
                    send::<_, WeightsReport>(&member.client, &request),
                )
            })
            .collect();
        let shared = self.clone();
        async move {
            let mut reports = Vec::with_capacity(calls.len());
            for (member, call) in calls {
                let report = match call.await {
                    Ok(report) => report,
                    Err(err) if is_loss(&err) => {
                        shared.lose(&member, &err);
                        continue;
                    }
                    Err(_) => match shared.pull_from_trainer(&member, &weights).await? {
                        Some(report) => report,
                        None => continue,
                    },
                };
                verify(&member.name, &report, &weights)?;
                reports.push(report);
            }
            Ok(reports)
        }
    }

    /// Has `member` pull `weights` from the trainer itself; `None` if the member is lost.
    async fn pull_from_trainer(
        &self,
        member: &Arc<Member>,
        weights: &WeightsReport,
    ) -> Result<Option<WeightsReport>, RoleError> {
        let direct = SyncWeights {
            weights: weights.clone(),
        };
        match send::<_, WeightsReport>(&member.client, &direct).await {
            Ok(report) => Ok(Some(report)),
            Err(err) if is_loss(&err) => {
                self.lose(member, &err);
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }

    /// Runs a tokenizer call on some live worker, moving on when one is lost.
    async fn tokenize(&self, request: TokenizerRequest) -> Result<TokenizerResponse, RoleError> {
        loop {
            let members = self.live_members().await?;
            let member = &members[0];
            match send::<_, TokenizerResponse>(&member.client, &request).await {
                Err(err) if is_loss(&err) => self.lose(member, &err),
                answer => return answer,
            }
        }
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
        ]);
        for (name, count) in tally.completions {
            metrics.insert(format!("worker_completions/{name}"), count as f64);
        }
        metrics
    }
}

fn verify(name: &str, report: &WeightsReport, published: &WeightsReport) -> Result<(), RoleError> {
    if report.version != published.version || report.checksum != published.checksum {
        return Err(RoleError::Protocol(format!(
            "{name} serves weight version {} with checksum {}, but version {} with checksum {} \
             was published",
            report.version, report.checksum, published.version, published.checksum
        )));
    }
    Ok(())
}

impl Generator for RemoteWorkers {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let started = self.shared.start(request);
        Box::pin(async move { self.shared.finish(started?).await })
    }

    fn load_weights(&self, weights: WeightsReport) -> RoleFuture<'_, Vec<WeightsReport>> {
        Box::pin(self.shared.load_weights(weights))
    }

    /// Journals the groups of `step` as trained (fsynced) and reports the pool's metrics.
    fn step_trained(&self, step: u64) -> RoleFuture<'_, BTreeMap<String, f64>> {
        let trained = lock(&self.shared.ledger).trained(step);
        let report = self.shared.report();
        Box::pin(async move { trained.map(|_| report).map_err(journal_error) })
    }

    fn resumed_from(&self, step: u64) -> RoleFuture<'_, ()> {
        let journaled = lock(&self.shared.ledger).rolled_back(step);
        Box::pin(async move { journaled.map_err(journal_error) })
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
