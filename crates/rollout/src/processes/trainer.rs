//! `rollout trainer`: one data-parallel rank, answering the controller's training,
//! checkpoint and weight requests in order until it is shut down.

use std::collections::HashMap;
use std::ops::ControlFlow;

use bytes::Bytes;
use rollout_core::cluster::buckets::Serving;
use rollout_core::cluster::weights::WeightStore;
use rollout_core::config::{LoadedConfig, Sharding};
use rollout_core::roles::{Learner, SaveWritten};
use rollout_net::messages::{
    CheckpointRequest, Done, MessageKind, PublishWeights, TrainRequest, ValuesRequest,
    WeightsReport,
};
use rollout_net::rpc::{Incoming, Responder, RpcServer};
use rollout_python::hosts::PolicyHost;
use tracing::Instrument;

use super::ClusterError;
use super::joining::{RoleArgs, WEIGHT_WAIT, advertised, answer, bad_request, hello, join};

/// `rollout trainer`: one data-parallel rank, answering in order until shut down.
pub async fn run_trainer(args: RoleArgs) -> Result<(), ClusterError> {
    let listener = if args.rank == 0 {
        Some(rollout_net::link::listen(&args.listen).await?)
    } else {
        None
    };
    let weights_address = match &listener {
        Some(listener) => advertised(listener, &args.connect)?,
        None => String::new(),
    };
    let info = serde_json::json!({
        "rank": args.rank,
        "world_size": args.world_size,
        "weights_address": weights_address,
    });
    let (mut server, loaded, host) = join("trainer", &args, info.clone()).await?;
    join_process_group(&host, &args, &loaded).await?;
    let store = WeightStore::default();
    if let Some(listener) = listener {
        store.serve(
            listener,
            args.key.clone(),
            hello("trainer", &args, info),
            args.limits.clone(),
            WEIGHT_WAIT,
        );
    }
    let rank = Rank {
        args: &args,
        host: &host,
        store: &store,
        weights_address: &weights_address,
        writes: HashMap::new(),
    };
    rank.serve(&mut server).await
}

/// Joins the data-parallel process group of the trainer ranks, where there is one.
async fn join_process_group(
    host: &PolicyHost,
    args: &RoleArgs,
    loaded: &LoadedConfig,
) -> Result<(), ClusterError> {
    let (cluster, train) = (&loaded.config.cluster, &loaded.config.train);
    // A sharded policy is sharded over a group even of one rank.
    if args.world_size > 1 || train.sharding == Sharding::Fsdp {
        host.join_data_parallel(args.rank, args.world_size, cluster.clone(), train.clone())
            .await?;
        tracing::info!(
            "trainer rank {} of {} joined the process group",
            args.rank,
            args.world_size
        );
    }
    Ok(())
}

/// A joined rank serving the controller's requests.
struct Rank<'a> {
    args: &'a RoleArgs,
    host: &'a PolicyHost,
    store: &'a WeightStore,
    /// Where the rank serves its weights (empty: it serves none).
    weights_address: &'a str,
    /// The background saves not yet asked about, by directory.
    writes: HashMap<String, SaveWritten>,
}

impl Rank<'_> {
    /// Answers the controller's requests in order until it shuts this rank down.
    async fn serve(mut self, server: &mut RpcServer) -> Result<(), ClusterError> {
        loop {
            let Some(incoming) = server.requests.recv().await else {
                return Err(ClusterError::ControllerLost(server.closed_reason()));
            };
            let served = self.answer_request(&incoming, &server.responder).await?;
            if served.is_break() {
                return Ok(());
            }
        }
    }

    /// Answers one request; breaks once it was the shutdown.
    async fn answer_request(
        &mut self,
        incoming: &Incoming,
        responder: &Responder,
    ) -> Result<ControlFlow<()>, ClusterError> {
        let (call, host) = (incoming.call, self.host);
        match incoming.frame.kind {
            // Each request in a span of its own (`--trace`), decoding included.
            MessageKind::TrainRequest => {
                let span = tracing::info_span!("rpc.train");
                let request: TrainRequest = span
                    .in_scope(|| incoming.decode())
                    .map_err(|err| bad_request(incoming, err))?;
                answer(responder, call, host.train(request).instrument(span).await);
            }
            MessageKind::ValuesRequest => {
                let span = tracing::info_span!("rpc.values");
                let request: ValuesRequest = span
                    .in_scope(|| incoming.decode())
                    .map_err(|err| bad_request(incoming, err))?;
                answer(responder, call, host.values(request).instrument(span).await);
            }
            MessageKind::CheckpointRequest => {
                let request: CheckpointRequest = incoming
                    .decode()
                    .map_err(|err| bad_request(incoming, err))?;
                let span =
                    tracing::info_span!("rpc.checkpoint", request = checkpoint_kind(&request));
                checkpoint(host, &mut self.writes, request, responder, call)
                    .instrument(span)
                    .await;
            }
            MessageKind::PublishWeights => {
                let request: PublishWeights = incoming
                    .decode()
                    .map_err(|err| bad_request(incoming, err))?;
                let target = Publisher {
                    store: self.store,
                    address: self.weights_address,
                    name: &self.args.name,
                };
                publish(host, target, request, responder, call)
                    .instrument(tracing::info_span!("rpc.publish_weights"))
                    .await;
            }
            MessageKind::Shutdown => {
                self.shut_down(responder, call).await;
                return Ok(ControlFlow::Break(()));
            }
            other => {
                let _ = responder.fail(call, format!("a trainer does not serve {other}"));
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Logs the rank's peak memory, leaves the process group and answers the shutdown.
    async fn shut_down(&self, responder: &Responder, call: u64) {
        if let Some(peak) = peak_resident_bytes() {
            tracing::info!(
                "trainer rank {} of {}: peak resident memory {peak} bytes",
                self.args.rank,
                self.args.world_size
            );
        }
        answer(
            responder,
            call,
            self.host.leave_data_parallel().await.map(|()| Done {}),
        );
    }
}

fn checkpoint_kind(request: &CheckpointRequest) -> &'static str {
    match request {
        CheckpointRequest::Save { .. } => "save",
        CheckpointRequest::SaveInBackground { .. } => "save_in_background",
        CheckpointRequest::Written { .. } => "written",
        CheckpointRequest::Restore { .. } => "restore",
    }
}

/// Serves a checkpoint request. A background save's writer is kept in `writes` until the
/// controller asks whether it finished; that answer waits on its own task, so training
/// requests are served meanwhile.
async fn checkpoint(
    host: &PolicyHost,
    writes: &mut HashMap<String, SaveWritten>,
    request: CheckpointRequest,
    responder: &Responder,
    call: u64,
) {
    let done = match request {
        CheckpointRequest::Save { directory } => host.save(directory.into()).await,
        CheckpointRequest::Restore {
            directory,
            weight_version,
        } => host.restore(directory.into(), weight_version).await,
        CheckpointRequest::SaveInBackground { directory } => {
            match host.save_in_background(directory.clone().into()).await {
                Ok(written) => {
                    writes.insert(directory, written);
                    Ok(())
                }
                Err(err) => Err(err),
            }
        }
        CheckpointRequest::Written { directory } => {
            let Some(written) = writes.remove(&directory) else {
                let _ = responder.fail(
                    call,
                    format!("no checkpoint is being written to {directory}"),
                );
                return;
            };
            let responder = responder.clone();
            let waiting = async move { answer(&responder, call, written.await.map(|()| Done {})) };
            tokio::spawn(waiting.in_current_span());
            return;
        }
    };
    answer(responder, call, done.map(|()| Done {}));
}

/// Where a rank publishes its versions: its weight store, served at `address` (empty: it
/// serves none), and its name.
struct Publisher<'a> {
    store: &'a WeightStore,
    address: &'a str,
    name: &'a str,
}

/// Snapshots the weights: rank 0 serves them, and announces the version as soon as its
/// buckets can be pulled (while they are still filled and checksummed), then answers the
/// sealed report once every bucket is in; every other rank answers its checksum, so the
/// controller can check that the ranks agree.
async fn publish(
    host: &PolicyHost,
    publisher: Publisher<'_>,
    request: PublishWeights,
    responder: &Responder,
    call: u64,
) {
    let serving = !publisher.address.is_empty();
    let serving = serving.then(|| Serving::InPlace(publisher.store.retire()));
    let exported = match host.export_weights(request.bucket_bytes, serving).await {
        Ok(exported) => exported,
        Err(err) => return answer(responder, call, Err::<WeightsReport, _>(err)),
    };
    let report = WeightsReport {
        version: exported.version,
        checksum: exported.checksum.unwrap_or_default(),
        bytes: exported.bytes,
        source: publisher.address.to_owned(),
        holder: publisher.name.to_owned(),
    };
    let Some(buffer) = exported.buffer else {
        return answer(responder, call, Ok(report));
    };
    publisher.store.publish(buffer.clone());
    if report.is_sealed() {
        return answer(responder, call, Ok(report));
    }
    if responder.reply(call, &report, Bytes::new(), true).is_err() {
        return;
    }
    let responder = responder.clone();
    let sealing = async move {
        let sealed = buffer.sealed_report(report, WEIGHT_WAIT).await;
        answer(&responder, call, sealed);
    };
    tokio::spawn(sealing.in_current_span());
}

/// The kernel's high-water mark of this process's resident memory (`VmHWM`), in bytes.
fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))?;
    let kib: u64 = kib.trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}
