//! `rollout worker`: a generation worker. It serves generation and tokenization to the
//! controller, and serves the weight versions it holds to the next worker of the relay.
//!
//! A worker whose connection to the controller breaks connects again (within
//! `--connect-retry`) and rejoins the run with the policy it already loaded. SIGTERM drains
//! it: the generation in progress is finished and answered, requests not yet started are
//! left unanswered (the controller leases their groups to other workers), and it exits.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rollout_core::cluster::weights::{VersionBuffer, WeightStore, seal_of};
use rollout_core::config::LoadedConfig;
use rollout_core::roles::{Generator, RoleError, Tokenizer};
use rollout_net::link::Link;
use rollout_net::messages::{
    Done, GenerateRequest, GeneratorMemory, MessageKind, SealWeights, SyncWeights,
    TokenizerRequest, TokenizerResponse, WeightsReport,
};
use rollout_net::rpc::{Incoming, Responder, RpcServer};
use rollout_python::hosts::PolicyHost;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tracing::{Instrument, Span};

use super::ClusterError;
use super::joining::{
    Loads, RoleArgs, WEIGHT_WAIT, advertised, answer, bad_request, hello, load_policy, welcome,
};

/// How long a worker that lost its controller waits before connecting again (a controller
/// that refuses it at once would otherwise see it back in a tight loop).
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Work a generation worker does strictly in arrival order: generation, and swapping in
/// weight versions between generations. Each carries its request's span (`--trace`), which
/// starts on arrival: its time in the queue is part of it.
enum Ordered {
    Generate(u64, GenerateRequest, Span),
    Swap(u64, Pull, Span),
    /// Colocated: release the device memory generation holds, or take it back.
    Memory(u64, GeneratorMemory, Span),
}

/// A weight pull under way: the verified version, once all of it is in (and sealed), with
/// its sealed report.
type Pull = tokio::task::JoinHandle<Result<(Arc<VersionBuffer>, WeightsReport), ClusterError>>;

/// Why a worker stopped serving a connection.
enum Ended {
    /// The controller shut it down, or SIGTERM drained it: the process exits.
    Done,
    /// The connection broke: connect again.
    Lost(String),
}

/// The policy loaded for a run's config.
struct Loaded {
    /// The config, as [`served_config`] gives it.
    served: String,
    host: Arc<PolicyHost>,
}

/// What a worker's loaded policy depends on: the run's config but for the number of trainer
/// ranks, which `rollout launch` changes when ranks are lost or rejoin.
fn served_config(loaded: &LoadedConfig) -> String {
    let mut config = loaded.config.clone();
    config.cluster.trainers = 0;
    toml::to_string(&config).unwrap_or_default()
}

pub async fn run_worker(args: RoleArgs) -> Result<(), ClusterError> {
    let mut terminate = signal(SignalKind::terminate()).map_err(ClusterError::Io)?;
    let listener = rollout_net::link::listen(&args.listen).await?;
    let weights_address = advertised(&listener, &args.connect)?;
    let info = serde_json::json!({ "weights_address": weights_address });
    let store = WeightStore::default();
    store.serve(
        listener,
        args.key.clone(),
        hello("worker", &args, info.clone()),
        args.limits.clone(),
        WEIGHT_WAIT,
    );
    let mut loaded: Option<Loaded> = None;
    loop {
        let welcomed = match welcome("worker", &args, info.clone()).await {
            Ok(welcomed) => welcomed,
            // Rejoining after the run ended: nothing left to do.
            Err(ClusterError::RunOver) if loaded.is_some() => return Ok(()),
            Err(err) => return Err(err),
        };
        let served = served_config(&welcomed.loaded);
        let host = match &loaded {
            Some(same) if same.served == served => same.host.clone(),
            _ => match load_policy(&welcomed.loaded, Loads::Generator).await {
                Ok(host) => {
                    let host = Arc::new(host);
                    loaded = Some(Loaded {
                        served,
                        host: host.clone(),
                    });
                    host
                }
                Err(err) => {
                    welcomed.answer(Err(&err));
                    return Err(err);
                }
            },
        };
        welcomed.answer(Ok(host.vocabulary()));
        let serving = Serving {
            args: &args,
            host,
            store: store.clone(),
        };
        match serving.serve(welcomed.server, &mut terminate).await? {
            Ended::Done => return Ok(()),
            Ended::Lost(reason) => {
                tracing::warn!("lost the controller ({reason}); connecting again");
                tokio::time::sleep(RECONNECT_PAUSE).await;
            }
        }
    }
}

/// One connection's worth of serving.
struct Serving<'a> {
    args: &'a RoleArgs,
    host: Arc<PolicyHost>,
    store: WeightStore,
}

impl Serving<'_> {
    async fn serve(
        &self,
        mut server: RpcServer,
        terminate: &mut Signal,
    ) -> Result<Ended, ClusterError> {
        let (ordered, queue) = mpsc::unbounded_channel::<Ordered>();
        // The seals of versions announced unsealed; dropped when serving ends, which fails
        // a pull still waiting for one.
        let seals = watch::Sender::new(None);
        let draining = Arc::new(AtomicBool::new(false));
        let executor = tokio::spawn(execute_in_order(
            queue,
            self.host.clone(),
            server.responder.clone(),
            self.args.name.clone(),
            draining.clone(),
        ));
        let ended = loop {
            let incoming = tokio::select! {
                incoming = server.requests.recv() => incoming,
                _ = terminate.recv() => {
                    tracing::info!("draining: finishing the generation in progress, then leaving");
                    draining.store(true, Ordering::SeqCst);
                    break Ended::Done;
                }
            };
            let Some(incoming) = incoming else {
                break Ended::Lost(server.closed_reason());
            };
            let dispatched = self.dispatch(&incoming, &server.responder, &ordered, &seals)?;
            if let ControlFlow::Break(ended) = dispatched {
                break ended;
            }
        };
        drop(ordered);
        drop(seals);
        let _ = executor.await;
        server.close(Duration::from_secs(10)).await;
        Ok(ended)
    }

    /// Handles one request: queues it behind the work in order, or answers it now, or on a
    /// task of its own; breaks once it was the shutdown.
    fn dispatch(
        &self,
        incoming: &Incoming,
        responder: &Responder,
        ordered: &mpsc::UnboundedSender<Ordered>,
        seals: &watch::Sender<Option<WeightsReport>>,
    ) -> Result<ControlFlow<Ended>, ClusterError> {
        let call = incoming.call;
        match incoming.frame.kind {
            MessageKind::GenerateRequest => {
                let request: GenerateRequest = incoming
                    .decode()
                    .map_err(|err| bad_request(incoming, err))?;
                let span = tracing::info_span!("rpc.generate", prompts = request.prompts.len());
                let _ = ordered.send(Ordered::Generate(call, request, span));
            }
            MessageKind::SyncWeights => {
                let SyncWeights { weights } = incoming
                    .decode()
                    .map_err(|err| bad_request(incoming, err))?;
                let span = tracing::info_span!("rpc.sync_weights", version = weights.version);
                let pulled = self.pull(weights, seals.subscribe(), &span);
                let _ = ordered.send(Ordered::Swap(call, pulled, span));
            }
            MessageKind::SealWeights => {
                let SealWeights { weights } = incoming
                    .decode()
                    .map_err(|err| bad_request(incoming, err))?;
                seals.send_replace(Some(weights));
                answer(responder, call, Ok(Done {}));
            }
            MessageKind::GeneratorMemory => {
                let action: GeneratorMemory = incoming
                    .decode()
                    .map_err(|err| bad_request(incoming, err))?;
                let span = tracing::info_span!("rpc.generator_memory", ?action);
                let _ = ordered.send(Ordered::Memory(call, action, span));
            }
            MessageKind::TokenizerRequest => {
                let request: TokenizerRequest = incoming
                    .decode()
                    .map_err(|err| bad_request(incoming, err))?;
                self.spawn_tokenize(call, request, responder);
            }
            MessageKind::Shutdown => {
                answer(responder, call, Ok(Done {}));
                return Ok(ControlFlow::Break(Ended::Done));
            }
            other => {
                let _ = responder.fail(call, format!("a generation worker does not serve {other}"));
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Answers a tokenizer request on a task of its own, out of the generations' order.
    fn spawn_tokenize(&self, call: u64, request: TokenizerRequest, responder: &Responder) {
        let (host, responder) = (self.host.clone(), responder.clone());
        let span = tracing::info_span!("rpc.tokenize");
        tokio::spawn(
            async move {
                answer(&responder, call, tokenize(&host, request).await);
            }
            .instrument(span),
        );
    }

    /// Starts pulling `report`'s weights at once, while earlier generations still run; an
    /// unsealed version is then checked against its seal, when it arrives on `seals`.
    fn pull(
        &self,
        report: WeightsReport,
        mut seals: watch::Receiver<Option<WeightsReport>>,
        request: &Span,
    ) -> Pull {
        let span = tracing::info_span!(parent: request, "weights.pull", bytes = report.bytes);
        let (store, key) = (self.store.clone(), self.args.key.clone());
        let source_hello = hello("worker", self.args, serde_json::Value::Null);
        let limits = self.args.limits.clone();
        tokio::spawn(
            async move {
                let source = Link::connect(&report.source, &key, &source_hello, &limits)
                    .instrument(tracing::info_span!("weights.connect"))
                    .await?
                    .client();
                let buffer = store.pull(&source, &report).await?;
                if report.is_sealed() {
                    return Ok((buffer, report));
                }
                let sealed = seal_of(&buffer, &mut seals, WEIGHT_WAIT)
                    .instrument(tracing::info_span!("weights.seal"))
                    .await?;
                Ok((buffer, sealed))
            }
            .instrument(span),
        )
    }
}

/// Generations and weight swaps, one at a time in arrival order; once `draining`, nothing
/// new is started. A generation that arrives while the weights are torn (a swap's import
/// failed midway) waits for the next swap that succeeds: the pool has the worker pull that
/// version again at once, and the request for it is queued behind the generation.
async fn execute_in_order(
    mut queue: mpsc::UnboundedReceiver<Ordered>,
    host: Arc<PolicyHost>,
    responder: rollout_net::rpc::Responder,
    name: String,
    draining: Arc<AtomicBool>,
) {
    // Whether the memory is released: a generation asked for meanwhile takes it back first.
    let mut released = false;
    let mut deferred = Vec::new();
    while let Some(job) = queue.recv().await {
        if draining.load(Ordering::SeqCst) {
            break;
        }
        match job {
            Ordered::Generate(call, request, span) if !host.serves_whole_version() => {
                tracing::warn!(
                    "a generation arrived while the weights are torn: it runs once a whole \
                     version is swapped in"
                );
                deferred.push((call, request, span));
            }
            Ordered::Generate(call, request, span) => {
                answer_generation(&host, &responder, &mut released, call, request, span).await;
            }
            Ordered::Memory(call, action, span) => {
                let changed = set_memory(&host, action, &mut released)
                    .instrument(span)
                    .await;
                answer(&responder, call, changed.map(|()| Done {}));
            }
            Ordered::Swap(call, pulled, span) => {
                let swapped = swap_in(&host, pulled, &name).instrument(span).await;
                answer(&responder, call, swapped);
                if host.serves_whole_version() {
                    for (call, request, span) in std::mem::take(&mut deferred) {
                        answer_generation(&host, &responder, &mut released, call, request, span)
                            .await;
                    }
                }
            }
        }
    }
}

async fn answer_generation(
    host: &PolicyHost,
    responder: &rollout_net::rpc::Responder,
    released: &mut bool,
    call: u64,
    request: GenerateRequest,
    span: Span,
) {
    let generated = async {
        if *released {
            tracing::warn!("asked to generate with its memory released: restoring it");
            host.restore_memory().await?;
            *released = false;
        }
        host.generate(request).await
    };
    answer(responder, call, generated.instrument(span).await);
}

/// Releases or restores the memory generation holds on its device; asking for the state it
/// is already in does nothing.
async fn set_memory(
    host: &PolicyHost,
    action: GeneratorMemory,
    released: &mut bool,
) -> Result<(), RoleError> {
    let started = std::time::Instant::now();
    match action {
        GeneratorMemory::Release if !*released => host.release_memory().await?,
        GeneratorMemory::Restore if *released => host.restore_memory().await?,
        _ => return Ok(()),
    }
    *released = action == GeneratorMemory::Release;
    tracing::debug!(
        "{action:?} of the generation memory took {:.3} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Imports the pulled version once the pull has verified all of it, so a pull that fails
/// midway leaves the weights as they were.
async fn swap_in(host: &PolicyHost, pull: Pull, name: &str) -> Result<WeightsReport, RoleError> {
    let started = std::time::Instant::now();
    let (buffer, report) = pull
        .await
        .map_err(|err| RoleError::Runtime(format!("the weight pull failed: {err}")))?
        .map_err(|err| RoleError::Protocol(err.to_string()))?;
    host.import_version(&buffer).await?;
    host.serve_version(report.version);
    tracing::debug!(
        "serving weight version {} ({} bytes, {:.3} s after the request)",
        report.version,
        buffer.bytes(),
        started.elapsed().as_secs_f64()
    );
    Ok(WeightsReport {
        holder: name.to_owned(),
        bytes: buffer.bytes(),
        ..report
    })
}

async fn tokenize(
    host: &PolicyHost,
    request: TokenizerRequest,
) -> Result<TokenizerResponse, RoleError> {
    Ok(match request {
        TokenizerRequest::Encode {
            texts,
            continuation,
        } => TokenizerResponse::Ids {
            ids: host.encode(texts, continuation).await?,
        },
        TokenizerRequest::Decode { sequences } => TokenizerResponse::Texts {
            texts: host.decode(sequences).await?,
        },
        TokenizerRequest::EosTokenIds => TokenizerResponse::Ids {
            ids: vec![host.eos_token_ids().await?],
        },
    })
}
