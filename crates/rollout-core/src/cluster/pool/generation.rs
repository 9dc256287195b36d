//! One generation request across the pool: prompts leased round-robin to the live
//! workers, answers accepted lease by lease, and what a lost worker held leased again.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use rollout_net::messages::{Completion, GenerateRequest, GenerateResponse};

use std::sync::atomic::Ordering;

use super::checks::{Expected, check_group};
use super::{Member, Shared, is_loss, journal_error, lock};
use crate::cluster::remote::send;
use crate::roles::RoleError;

/// One generation request in progress.
pub(super) struct Generation {
    request: GenerateRequest,
    results: Vec<Option<Vec<Completion>>>,
    /// The worker whose answer each prompt's group is.
    producers: Vec<String>,
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

impl Shared {
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
                    ledger.abandoned(group, &reason).map_err(journal_error)?;
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

    /// Why `response` cannot be used for `share` of `request`, if it cannot.
    fn check_answer(
        &self,
        request: &GenerateRequest,
        share: &Share,
        response: &GenerateResponse,
    ) -> Result<(), String> {
        if response.groups.len() != share.positions.len() {
            return Err(format!(
                "{} groups for {} prompts",
                response.groups.len(),
                share.positions.len()
            ));
        }
        let newest_version = share.member.newest_version.load(Ordering::SeqCst);
        for (&position, group) in share.positions.iter().zip(&response.groups) {
            let expected = Expected {
                prompt: &request.prompts[position],
                sampling: &request.sampling,
                newest_version,
                vocabulary: self.settings.vocabulary,
            };
            check_group(&expected, group)
                .map_err(|reason| format!("prompt {position}: {reason}"))?;
        }
        Ok(())
    }

    /// Accepts a worker's checked answer lease by lease; returns the positions whose answer
    /// was rejected as late (to be generated again).
    fn accept(
        &self,
        share: &Share,
        response: GenerateResponse,
        generation: &mut Generation,
    ) -> Result<Vec<usize>, RoleError> {
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
            let tracked = generation.request.prompts[position].group.is_some();
            if !tracked || ledger.complete(lease, now).map_err(journal_error)? {
                completions += group.len() as u64;
                generation.results[position] = Some(group);
                generation.producers[position] = share.member.name.clone();
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

    /// Refuses a malformed answer: its worker is sent away, its leases are revoked and its
    /// prompts leased again; the samples it answered for are counted as excluded.
    fn refuse(
        &self,
        generation: &mut Generation,
        share: Share,
        reason: String,
    ) -> Result<(), RoleError> {
        self.send_away(&share.member, &reason);
        self.revoke(&share, &RoleError::Protocol(reason))?;
        let samples: u64 = share
            .positions
            .iter()
            .map(|&p| u64::from(generation.request.prompts[p].n))
            .sum();
        let mut tally = lock(&self.tally);
        tally.malformed += 1;
        tally.samples_refused += samples;
        drop(tally);
        generation.pending.extend(share.positions);
        Ok(())
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
    pub(super) fn start(&self, request: GenerateRequest) -> Result<Generation, RoleError> {
        let total = request.prompts.len();
        let mut generation = Generation {
            request,
            results: vec![None; total],
            producers: vec![String::new(); total],
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
    pub(super) async fn finish(
        &self,
        mut generation: Generation,
    ) -> Result<GenerateResponse, RoleError> {
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
                    if let Err(reason) = self.check_answer(&generation.request, &share, &response) {
                        self.refuse(&mut generation, share, reason)?;
                        continue;
                    }
                    generation.parts.push(response.metrics.clone());
                    let again = self.accept(&share, response, &mut generation)?;
                    generation.pending.extend(again);
                }
                Err(err) if is_loss(&err) => {
                    self.lose(&share.member, &err);
                    self.revoke(&share, &err)?;
                    generation.pending.extend(share.positions);
                }
                // An answer that does not even decode (a NaN logprob is JSON `null`).
                Err(RoleError::Protocol(reason)) => self.refuse(&mut generation, share, reason)?,
                Err(err) => return Err(err),
            }
        }
        let mut metrics = crate::metrics::merge_metrics(&generation.parts);
        metrics.insert("groups_dropped".into(), generation.dropped as f64);
        Ok(GenerateResponse {
            groups: generation
                .results
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect(),
            metrics,
            producers: generation.producers,
        })
    }
}
