//! The controller's side of remote roles: generation workers and trainer ranks reached over
//! authenticated connections, behind the same traits as the in-process roles.

use std::collections::BTreeMap;
use std::path::PathBuf;

use bytes::Bytes;
use rollout_net::NetError;
use rollout_net::messages::{
    CheckpointRequest, Done, GenerateRequest, GenerateResponse, Message, PublishWeights, Shutdown,
    SyncWeights, TokenizerRequest, TokenizerResponse, TrainRequest, TrainResponse, WeightsReport,
};
use rollout_net::rpc::{Call, RpcClient};

use crate::roles::{Generator, Learner, RoleError, RoleFuture, Tokenizer};

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
fn send<Req: Message + 'static, Resp: Message + Send + 'static>(
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

/// Generation workers: a step's prompts are dealt round-robin among them, and weight
/// versions travel along a chain of them.
pub struct RemoteWorkers {
    workers: Vec<RpcClient>,
}

impl RemoteWorkers {
    pub fn new(workers: Vec<RpcClient>) -> Self {
        Self { workers }
    }

    /// The address a worker serves weights on, as it announced in its greeting.
    fn weights_address(worker: &RpcClient) -> String {
        worker.peer().info["weights_address"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    pub async fn shutdown(&self, reason: &str) {
        for worker in &self.workers {
            let _ = send::<_, Done>(
                worker,
                &Shutdown {
                    reason: reason.into(),
                },
            )
            .await;
        }
    }

    fn tokenizer(&self) -> Result<&RpcClient, RoleError> {
        self.workers
            .first()
            .ok_or_else(|| RoleError::Protocol("no generation worker".into()))
    }
}

impl Generator for RemoteWorkers {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let count = self.workers.len().max(1);
        let mut shares: Vec<(Vec<usize>, GenerateRequest)> = (0..count)
            .map(|_| {
                (
                    Vec::new(),
                    GenerateRequest {
                        prompts: Vec::new(),
                        sampling: request.sampling.clone(),
                    },
                )
            })
            .collect();
        let total = request.prompts.len();
        for (index, prompt) in request.prompts.into_iter().enumerate() {
            let (positions, share) = &mut shares[index % count];
            positions.push(index);
            share.prompts.push(prompt);
        }
        let calls: Vec<_> = shares
            .into_iter()
            .zip(&self.workers)
            .filter(|((positions, _), _)| !positions.is_empty())
            .map(|((positions, share), worker)| {
                (positions, send::<_, GenerateResponse>(worker, &share))
            })
            .collect();
        Box::pin(async move {
            let mut groups = vec![Vec::new(); total];
            let mut parts = Vec::new();
            for (positions, call) in calls {
                let response = call.await?;
                if response.groups.len() != positions.len() {
                    return Err(RoleError::Protocol(format!(
                        "a generation worker answered {} groups for {} prompts",
                        response.groups.len(),
                        positions.len()
                    )));
                }
                for (position, group) in positions.into_iter().zip(response.groups) {
                    groups[position] = group;
                }
                parts.push(response.metrics);
            }
            Ok(GenerateResponse {
                groups,
                metrics: crate::generation::merge_metrics(&parts),
            })
        })
    }

    fn load_weights(&self, weights: WeightsReport) -> RoleFuture<'_, Vec<WeightsReport>> {
        let mut source = weights.source.clone();
        let calls: Vec<_> = self
            .workers
            .iter()
            .map(|worker| {
                let request = SyncWeights {
                    weights: WeightsReport {
                        source: std::mem::replace(&mut source, Self::weights_address(worker)),
                        ..weights.clone()
                    },
                };
                (
                    worker.describe().to_owned(),
                    send::<_, WeightsReport>(worker, &request),
                )
            })
            .collect();
        Box::pin(async move {
            let mut reports = Vec::with_capacity(calls.len());
            for (name, call) in calls {
                let report = call.await?;
                if report.version != weights.version || report.checksum != weights.checksum {
                    return Err(RoleError::Protocol(format!(
                        "{name} serves weight version {} with checksum {}, but version {} with \
                         checksum {} was published",
                        report.version, report.checksum, weights.version, weights.checksum
                    )));
                }
                reports.push(report);
            }
            Ok(reports)
        })
    }
}

impl Tokenizer for RemoteWorkers {
    fn encode(&self, texts: Vec<String>, continuation: bool) -> RoleFuture<'_, Vec<Vec<u32>>> {
        let request = TokenizerRequest::Encode {
            texts,
            continuation,
        };
        let call = self.tokenizer().map(|worker| send(worker, &request));
        Box::pin(async move {
            match call?.await? {
                TokenizerResponse::Ids { ids } => Ok(ids),
                other => Err(RoleError::Protocol(format!(
                    "asked to encode, the worker answered {other:?}"
                ))),
            }
        })
    }

    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>> {
        let call = self
            .tokenizer()
            .map(|worker| send(worker, &TokenizerRequest::Decode { sequences }));
        Box::pin(async move {
            match call?.await? {
                TokenizerResponse::Texts { texts } => Ok(texts),
                other => Err(RoleError::Protocol(format!(
                    "asked to decode, the worker answered {other:?}"
                ))),
            }
        })
    }

    fn eos_token_ids(&self) -> RoleFuture<'_, Vec<u32>> {
        let call = self
            .tokenizer()
            .map(|worker| send(worker, &TokenizerRequest::EosTokenIds));
        Box::pin(async move {
            match call?.await? {
                TokenizerResponse::Ids { mut ids } if ids.len() == 1 => Ok(ids.remove(0)),
                other => Err(RoleError::Protocol(format!(
                    "asked for end-of-sequence ids, the worker answered {other:?}"
                ))),
            }
        })
    }
}

/// Data-parallel trainer ranks, `ranks[r]` being rank `r`.
pub struct RemoteTrainers {
    ranks: Vec<RpcClient>,
}

impl RemoteTrainers {
    pub fn new(ranks: Vec<RpcClient>) -> Self {
        Self { ranks }
    }

    pub async fn shutdown(&self, reason: &str) {
        for rank in &self.ranks {
            let _ = send::<_, Done>(
                rank,
                &Shutdown {
                    reason: reason.into(),
                },
            )
            .await;
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

/// Merges the ranks' metrics: means weighted by each rank's loss tokens, times as the
/// slowest rank's (the update waits for it).
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
            let entry = merged.entry(name.clone()).or_insert(0.0);
            if name.ends_with("_seconds") {
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
            })
            .collect();
        for (index, batch) in request.micro_batches.into_iter().enumerate() {
            shards[index % world].micro_batches.push(batch);
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
            })
        })
    }

    fn save(&self, directory: PathBuf) -> RoleFuture<'_, ()> {
        let directory = directory.to_string_lossy().into_owned();
        let done = self
            .ranks
            .first()
            .map(|rank0| send::<_, Done>(rank0, &CheckpointRequest::Save { directory }));
        Box::pin(async move {
            done.ok_or_else(|| RoleError::Protocol("no trainer rank".into()))?
                .await?;
            Ok(())
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

    fn publish_weights(&self, bucket_bytes: u64) -> RoleFuture<'_, WeightsReport> {
        let requests = vec![PublishWeights { bucket_bytes }; self.ranks.len()];
        let reports = self.on_every_rank::<_, WeightsReport>(requests);
        Box::pin(async move {
            let mut reports = reports.await?;
            if reports.is_empty() {
                return Err(RoleError::Protocol("no trainer rank".into()));
            }
            let rank0 = reports.remove(0);
            for (rank, report) in reports.iter().enumerate() {
                if report.checksum != rank0.checksum || report.version != rank0.version {
                    return Err(RoleError::Protocol(format!(
                        "trainer rank {} holds weights {} (version {}) but rank 0 holds {} \
                         (version {}): the data-parallel ranks diverged",
                        rank + 1,
                        report.checksum,
                        report.version,
                        rank0.checksum,
                        rank0.version
                    )));
                }
            }
            Ok(rank0)
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
        }
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
}
