//! The controller's side of remote trainer ranks, reached over authenticated connections
//! behind the same trait as the in-process learner, and the call helpers every remote role
//! uses (generation workers are in [`super::pool`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use bytes::Bytes;
use rollout_net::NetError;
use rollout_net::messages::{
    CheckpointRequest, Done, ExcludedRow, Message, MicroBatch, PublishWeights, Shutdown,
    TrainRequest, TrainResponse, ValuesRequest, ValuesResponse, WeightsReport,
};
use rollout_net::rpc::{Call, RpcClient};

use crate::config::Sharding;
use crate::mismatch;
use crate::roles::{Learner, Publication, RoleError, RoleFuture, SaveWritten};

fn role_error(err: NetError) -> RoleError {
    match err {
        NetError::Remote { peer, message } => RoleError::Plugin(format!("{peer}: {message}")),
        NetError::PeerLost { peer, reason } => RoleError::WorkerLost { role: peer, reason },
        NetError::PeerSilent { peer, seconds } => RoleError::TimedOut {
            role: peer,
            seconds,
        },
        other => RoleError::Protocol(other.to_string()),
    }
}

/// Sends `request` now (so calls reach each peer in the order they are made) and returns
/// its answer as a future.
pub(super) fn send<Req: Message + 'static, Resp: Message + Send + 'static>(
    peer: &RpcClient,
    request: &Req,
) -> impl Future<Output = Result<Resp, RoleError>> + Send + 'static + use<Req, Resp> {
    let call: Result<Call, NetError> = peer.call(request, Bytes::new());
    async move {
        let (response, _) = call
            .map_err(role_error)?
            .answer()
            .await
            .map_err(role_error)?;
        Ok(response)
    }
}

/// Data-parallel trainer ranks, `ranks[r]` being rank `r`.
pub struct RemoteTrainers {
    ranks: Vec<RpcClient>,
    /// The ranks shard the policy (`[train] sharding = "fsdp"`): each holds part of the
    /// state, so every rank saves its part, only rank 0 holds whole weights to publish, and
    /// every rank must run as many forward passes as the others (its collectives with them).
    sharded: bool,
}

impl RemoteTrainers {
    pub fn new(ranks: Vec<RpcClient>, sharding: Sharding) -> Self {
        Self {
            ranks,
            sharded: sharding == Sharding::Fsdp,
        }
    }

    /// Rank 0, or every rank when each holds a part of the state.
    fn savers(&self) -> &[RpcClient] {
        let count = if self.sharded { self.ranks.len() } else { 1 };
        &self.ranks[..count.min(self.ranks.len())]
    }

    /// Shuts every rank down at once: ranks leave their process group together, at a
    /// barrier, so none may wait for another's shutdown.
    pub async fn shutdown(&self, reason: &str) {
        let shutdown = Shutdown {
            reason: reason.into(),
        };
        let answers: Vec<_> = self
            .ranks
            .iter()
            .map(|rank| send::<_, Done>(rank, &shutdown))
            .collect();
        for answer in answers {
            let _ = answer.await;
        }
    }

    /// Sends `requests[r]` to rank `r`.
    fn on_every_rank<Req: Message + 'static, Resp: Message + Send + 'static>(
        &self,
        requests: Vec<Req>,
    ) -> impl Future<Output = Result<Vec<Resp>, RoleError>> + Send + 'static + use<Req, Resp> {
        let calls: Vec<_> = self
            .ranks
            .iter()
            .zip(&requests)
            .map(|(client, request)| send::<_, Resp>(client, request))
            .collect();
        async move {
            let mut answers = Vec::with_capacity(calls.len());
            for call in calls {
                answers.push(call.await?);
            }
            Ok(answers)
        }
    }
}

/// The next report a rank answers a `PublishWeights` with, and whether another follows.
async fn next_report(call: &mut Call) -> Result<(WeightsReport, bool), RoleError> {
    let frame = call
        .next_frame()
        .await
        .map_err(role_error)?
        .ok_or_else(|| RoleError::Protocol("a trainer rank ended its publish unanswered".into()))?;
    let (report, more, _) = call.decode::<WeightsReport>(frame).map_err(role_error)?;
    Ok((report, more))
}

/// Checks that every other data-parallel rank holds rank 0's weights.
fn agree(rank0: &WeightsReport, others: &[WeightsReport]) -> Result<(), RoleError> {
    for (rank, report) in others.iter().enumerate() {
        if report.checksum != rank0.checksum || report.version != rank0.version {
            return Err(RoleError::Protocol(format!(
                "trainer rank {} holds weights {} (version {}) but rank 0 holds {} (version \
                 {}): the data-parallel ranks diverged",
                rank + 1,
                report.checksum,
                report.version,
                rank0.checksum,
                rank0.version
            )));
        }
    }
    Ok(())
}

/// The ranks' excluded rows by their place in the whole request: rank `r`'s micro-batch
/// `i` is the request's `i * world + r` (padding passes past the request's `count` are
/// dropped).
fn excluded_in_request(answers: &[TrainResponse], count: usize) -> Vec<ExcludedRow> {
    let world = answers.len().max(1);
    let mut excluded: Vec<ExcludedRow> = answers
        .iter()
        .enumerate()
        .flat_map(|(rank, answer)| {
            answer.excluded.iter().filter_map(move |row| {
                let index = (row.micro_batch as usize).checked_mul(world)? + rank;
                let micro_batch = u32::try_from(index).ok().filter(|_| index < count)?;
                Some(ExcludedRow {
                    micro_batch,
                    ..*row
                })
            })
        })
        .collect();
    excluded.sort_unstable();
    excluded.dedup();
    excluded
}

/// A pass that contributes nothing but its collectives: `batch` with no token in its loss.
fn padding_pass(batch: &MicroBatch) -> MicroBatch {
    let mut padding = batch.clone();
    padding.loss_mask.iter_mut().for_each(|m| *m = 0.0);
    padding.loss_scale = 0.0;
    padding
}

/// Merges the ranks' metrics: means weighted by each rank's loss tokens, times as the
/// slowest rank's (the update waits for it), samples each rank left out added up, updates
/// skipped as any rank counts them (the ranks skip together), and the raw mismatch
/// measurements by their own rules (`crate::mismatch`).
fn merge_rank_metrics(answers: &[TrainResponse], tokens: &[usize]) -> BTreeMap<String, f64> {
    let total: usize = tokens.iter().sum();
    let mut merged: BTreeMap<String, f64> = BTreeMap::new();
    for (answer, &rank_tokens) in answers.iter().zip(tokens) {
        let weight = if total == 0 {
            1.0 / answers.len() as f64
        } else {
            rank_tokens as f64 / total as f64
        };
        for (name, &value) in &answer.metrics {
            if let Some(rule) = mismatch::rule(name) {
                mismatch::merge(&mut merged, name, value, rule);
                continue;
            }
            let entry = merged.entry(name.clone()).or_insert(0.0);
            if name.starts_with("samples_excluded_") {
                *entry += value;
            } else if name.ends_with("_seconds") || name.starts_with("updates_skipped_") {
                *entry = entry.max(value);
            } else if total > 0 && rank_tokens == 0 {
                // A rank without tokens reports zeros for token means.
            } else {
                *entry += value * weight;
            }
        }
    }
    merged
}

impl Learner for RemoteTrainers {
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse> {
        let world = self.ranks.len().max(1);
        let mut shards: Vec<TrainRequest> = (0..world)
            .map(|_| TrainRequest {
                micro_batches: Vec::new(),
                learning_rate: request.learning_rate,
                epochs: request.epochs,
            })
            .collect();
        let count = request.micro_batches.len();
        let padding = self
            .sharded
            .then(|| request.micro_batches.first().map(padding_pass))
            .flatten();
        for (index, batch) in request.micro_batches.into_iter().enumerate() {
            shards[index % world].micro_batches.push(batch);
        }
        if let Some(padding) = padding {
            let longest = shards.iter().map(|s| s.micro_batches.len()).max();
            for shard in &mut shards {
                shard
                    .micro_batches
                    .resize(longest.unwrap_or(0), padding.clone());
            }
        }
        let tokens: Vec<usize> = shards
            .iter()
            .map(|s| s.micro_batches.iter().map(|b| b.loss_tokens()).sum())
            .collect();
        let answers = self.on_every_rank::<_, TrainResponse>(shards);
        Box::pin(async move {
            let answers = answers.await?;
            let Some(first) = answers.first() else {
                return Err(RoleError::Protocol("no trainer rank".into()));
            };
            let weight_version = first.weight_version;
            if let Some(other) = answers.iter().find(|a| a.weight_version != weight_version) {
                return Err(RoleError::Protocol(format!(
                    "trainer ranks disagree on the weight version ({} vs {})",
                    weight_version, other.weight_version
                )));
            }
            Ok(TrainResponse {
                metrics: merge_rank_metrics(&answers, &tokens),
                weight_version,
                excluded: excluded_in_request(&answers, count),
            })
        })
    }

    /// Micro-batches are dealt to the ranks as `train` deals them; a rank dealt none gets a
    /// copy of the first (its answer dropped), so every rank builds its value head before
    /// the update all-reduces its gradients. Sharded ranks are all given as many as the
    /// busiest one, since each forward pass gathers with the others.
    fn values(&self, request: ValuesRequest) -> RoleFuture<'_, ValuesResponse> {
        let world = self.ranks.len().max(1);
        let count = request.micro_batches.len();
        let mut shards: Vec<ValuesRequest> = (0..world)
            .map(|rank| ValuesRequest {
                micro_batches: request
                    .micro_batches
                    .iter()
                    .skip(rank)
                    .step_by(world)
                    .cloned()
                    .collect(),
            })
            .collect();
        if let Some(first) = request.micro_batches.first() {
            let longest = shards.iter().map(|s| s.micro_batches.len()).max();
            let wanted = if self.sharded {
                longest.unwrap_or(1)
            } else {
                1
            };
            for shard in &mut shards {
                while shard.micro_batches.len() < wanted {
                    shard.micro_batches.push(first.clone());
                }
            }
        }
        let answers = self.on_every_rank::<_, ValuesResponse>(shards);
        Box::pin(async move {
            let mut per_rank: Vec<_> = answers
                .await?
                .into_iter()
                .map(|answer| answer.values.into_iter())
                .collect();
            let values = (0..count)
                .map(|index| per_rank.get_mut(index % world).and_then(Iterator::next))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    RoleError::Protocol("a trainer rank left out micro-batches' values".into())
                })?;
            Ok(ValuesResponse { values })
        })
    }

    /// Rank 0 writes the policy's files; sharded, every rank writes its part.
    fn save(&self, directory: PathBuf) -> RoleFuture<'_, ()> {
        let directory = directory.to_string_lossy().into_owned();
        let done: Vec<_> = self
            .savers()
            .iter()
            .map(|rank| {
                let request = CheckpointRequest::Save {
                    directory: directory.clone(),
                };
                send::<_, Done>(rank, &request)
            })
            .collect();
        Box::pin(async move {
            if done.is_empty() {
                return Err(RoleError::Protocol("no trainer rank".into()));
            }
            futures_util::future::try_join_all(done).await?;
            Ok(())
        })
    }

    /// The saving ranks copy their state and answer; `Written` is sent at once, queued
    /// behind it, and answered when a rank's writer finishes (it keeps training meanwhile).
    fn save_in_background(&self, directory: PathBuf) -> RoleFuture<'_, SaveWritten> {
        let directory = directory.to_string_lossy().into_owned();
        let (copied, written): (Vec<_>, Vec<_>) = self
            .savers()
            .iter()
            .map(|rank| {
                let copy = CheckpointRequest::SaveInBackground {
                    directory: directory.clone(),
                };
                let copied = send::<_, Done>(rank, &copy);
                let written = CheckpointRequest::Written {
                    directory: directory.clone(),
                };
                (copied, send::<_, Done>(rank, &written))
            })
            .unzip();
        Box::pin(async move {
            if copied.is_empty() {
                return Err(RoleError::Protocol("no trainer rank".into()));
            }
            futures_util::future::try_join_all(copied).await?;
            let written = futures_util::future::try_join_all(written);
            Ok(Box::pin(async move { written.await.map(drop) }) as SaveWritten)
        })
    }

    fn restore(&self, directory: PathBuf, weight_version: u64) -> RoleFuture<'_, ()> {
        let directory = directory.to_string_lossy().into_owned();
        let requests = self
            .ranks
            .iter()
            .map(|_| CheckpointRequest::Restore {
                directory: directory.clone(),
                weight_version,
            })
            .collect();
        let done = self.on_every_rank::<_, Done>(requests);
        Box::pin(async move {
            done.await?;
            Ok(())
        })
    }

    /// Rank 0 announces the version as soon as it can be pulled and seals it once its
    /// checksum is known; the seal also waits for the other ranks' checksums, which must
    /// agree with rank 0's unless the ranks shard the weights.
    fn publish_weights(&self, bucket_bytes: u64) -> RoleFuture<'_, Publication> {
        let request = PublishWeights { bucket_bytes };
        let calls: Vec<_> = self
            .ranks
            .iter()
            .map(|rank| rank.call(&request, Bytes::new()))
            .collect();
        let sharded = self.sharded;
        Box::pin(async move {
            let mut calls = calls
                .into_iter()
                .collect::<Result<Vec<Call>, NetError>>()
                .map_err(role_error)?;
            if calls.is_empty() {
                return Err(RoleError::Protocol("no trainer rank".into()));
            }
            let mut rank0 = calls.remove(0);
            let (first, more) = next_report(&mut rank0).await?;
            let announced = first.clone();
            let sealed = async move {
                let rank0 = if more {
                    let (sealed, _) = next_report(&mut rank0).await?;
                    sealed
                } else {
                    first
                };
                let mut reports = Vec::with_capacity(calls.len());
                for call in calls {
                    let (report, _) = call.answer::<WeightsReport>().await.map_err(role_error)?;
                    reports.push(report);
                }
                if !sharded {
                    // Only rank 0 gathers whole weights when the ranks shard them.
                    agree(&rank0, &reports)?;
                }
                Ok(rank0)
            };
            Ok(Publication {
                announced,
                sealed: Box::pin(sealed),
            })
        })
    }

    fn needs_weight_sync(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(pairs: &[(&str, f64)]) -> TrainResponse {
        TrainResponse {
            metrics: pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            weight_version: 1,
            excluded: Vec::new(),
        }
    }

    fn excluded(micro_batch: u32, row: u32) -> ExcludedRow {
        ExcludedRow {
            micro_batch,
            row,
            reason: rollout_net::messages::Exclusion::NonFinite,
        }
    }

    #[test]
    fn excluded_rows_are_placed_back_in_the_request_and_counts_add_up() {
        let mut ranks = [
            answer(&[
                ("samples_excluded_nonfinite", 2.0),
                ("updates_skipped_nonfinite", 1.0),
            ]),
            answer(&[
                ("samples_excluded_nonfinite", 1.0),
                ("updates_skipped_nonfinite", 1.0),
            ]),
        ];
        ranks[0].excluded = vec![excluded(0, 1), excluded(1, 0)];
        // Rank 1's second micro-batch is a padding pass past the request's 3.
        ranks[1].excluded = vec![excluded(0, 4), excluded(1, 2)];
        assert_eq!(
            excluded_in_request(&ranks, 3),
            [excluded(0, 1), excluded(1, 4), excluded(2, 0)]
        );
        let merged = merge_rank_metrics(&ranks, &[10, 0]);
        assert_eq!(merged["samples_excluded_nonfinite"], 3.0);
        assert_eq!(
            merged["updates_skipped_nonfinite"], 1.0,
            "the ranks skip together"
        );
    }

    #[test]
    fn a_padding_pass_keeps_the_shape_and_trains_on_nothing() {
        let batch = MicroBatch {
            rows: 1,
            width: 3,
            input_ids: vec![5, 6, 7],
            attention_mask: vec![1, 1, 1],
            loss_mask: vec![0.0, 1.0, 1.0],
            advantages: vec![0.0, 0.5, 0.5],
            old_logprobs: vec![0.0, -1.0, -1.0],
            loss_scale: 0.5,
            objective: rollout_net::messages::Objective::Sft,
            returns: Vec::new(),
            old_values: Vec::new(),
            row_staleness: Vec::new(),
        };
        let padding = padding_pass(&batch);
        assert_eq!(padding.loss_tokens(), 0);
        assert_eq!(padding.loss_scale, 0.0);
        assert_eq!(padding.input_ids, batch.input_ids);
        assert_eq!(padding.padded_tokens(), batch.padded_tokens());
    }

    #[test]
    fn rank_metrics_are_token_weighted_and_times_are_the_slowest() {
        let merged = merge_rank_metrics(
            &[
                answer(&[("loss", 1.0), ("train_seconds", 2.0), ("grad_norm", 3.0)]),
                answer(&[("loss", 4.0), ("train_seconds", 5.0), ("grad_norm", 3.0)]),
            ],
            &[30, 10],
        );
        assert_eq!(merged["loss"], 1.0 * 0.75 + 4.0 * 0.25);
        assert_eq!(merged["train_seconds"], 5.0);
        assert_eq!(merged["grad_norm"], 3.0);
    }

    #[test]
    fn a_rank_without_tokens_does_not_dilute_the_means() {
        let merged = merge_rank_metrics(
            &[answer(&[("loss", 2.0)]), answer(&[("loss", 0.0)])],
            &[12, 0],
        );
        assert_eq!(merged["loss"], 2.0);
    }

    #[test]
    fn raw_mismatch_measurements_add_up_over_ranks_whatever_their_loss_tokens() {
        let merged = merge_rank_metrics(
            &[
                answer(&[
                    ("mismatch/tokens", 3.0),
                    ("mismatch/k3_sum", 0.3),
                    ("mismatch/ratio_min", 0.9),
                ]),
                answer(&[
                    ("mismatch/tokens", 1.0),
                    ("mismatch/k3_sum", 0.1),
                    ("mismatch/ratio_min", 0.7),
                ]),
            ],
            &[10, 30],
        );
        assert_eq!(merged["mismatch/tokens"], 4.0);
        assert!((merged["mismatch/k3_sum"] - 0.4).abs() < 1e-12);
        assert_eq!(merged["mismatch/ratio_min"], 0.7);
    }
}
