//! A generation worker without a model that answers over a real authenticated link, for
//! tests of the generation pool and the controller capacity benchmark.

use std::ops::ControlFlow;
use std::sync::Arc;

use bytes::Bytes;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{
    Completion, Done, FinishReason, GenerateRequest, GenerateResponse, GeneratorMemory, Hello,
    MessageKind, PromptRequest, SealWeights, SyncWeights, TokenizerRequest, TokenizerResponse,
};
use rollout_net::rpc::{Incoming, Responder, RpcClient};
use rollout_net::{ClusterKey, NetError};
use tokio::net::TcpListener;

/// How a fake worker behaves once a generation request arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Answers every request at once.
    Healthy,
    /// Closes its connection when its first generation request arrives.
    DiesOnRequest,
    /// Never answers (its heartbeats go on).
    Hangs,
    /// Answers at once, with its first completion broken this way.
    Malformed(Malformation),
    /// Closes its connection as soon as it is made, before any request (a worker killed
    /// while the run does something else).
    Leaves,
}

/// How a [`Behaviour::Malformed`] worker breaks its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformation {
    /// One logprob fewer than tokens.
    ShortLogprobs,
    /// A token id of `u32::MAX`, past any vocabulary.
    OutOfVocabulary,
    /// A weight version one past the newest it was sent.
    ForgedVersion,
    /// A NaN logprob.
    NanLogprob,
    /// A logprob of -95, finite but below any a sampler gives: `exp(-(-95))` overflows
    /// float32, so an importance ratio over it would be infinite.
    PoisonedLogprob,
}

/// The logprob a [`Malformation::PoisonedLogprob`] worker reports.
pub const POISONED_LOGPROB: f32 = -95.0;

impl Malformation {
    pub const ALL: [Malformation; 5] = [
        Self::ShortLogprobs,
        Self::OutOfVocabulary,
        Self::ForgedVersion,
        Self::NanLogprob,
        Self::PoisonedLogprob,
    ];

    fn apply(self, completion: &mut Completion) {
        match self {
            Self::ShortLogprobs => {
                completion.logprobs.pop();
            }
            Self::OutOfVocabulary => completion.token_ids[0] = u32::MAX,
            Self::ForgedVersion => completion.weight_version += 1,
            Self::NanLogprob => completion.logprobs[0] = f32::NAN,
            Self::PoisonedLogprob => completion.logprobs[0] = POISONED_LOGPROB,
        }
    }
}

/// How a healthy fake worker answers a request.
pub type Answer = Arc<dyn Fn(&GenerateRequest) -> GenerateResponse + Send + Sync>;

/// The greeting of a process of `role` named `name`, of this build.
pub fn hello(role: &str, name: &str) -> Hello {
    Hello {
        role: role.into(),
        name: name.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        credits: 64,
        info: serde_json::Value::Null,
    }
}

/// A completion of one token that names its prompt (its seed).
pub fn seed_completion(prompt: &PromptRequest) -> Completion {
    Completion {
        token_ids: vec![prompt.seed.unwrap_or(0) as u32],
        logprobs: vec![-0.5],
        finish_reason: FinishReason::Stop,
        weight_version: 0,
    }
}

/// Answers every prompt with `n` copies of [`seed_completion`].
pub fn seed_answers() -> Answer {
    Arc::new(|request: &GenerateRequest| GenerateResponse {
        groups: request
            .prompts
            .iter()
            .map(|p| vec![seed_completion(p); p.n as usize])
            .collect(),
        metrics: Default::default(),
        producers: Vec::new(),
    })
}

/// Accepts one authenticated connection on `listener` (as worker `name`) and serves it as
/// `behaviour` says until it closes. A weight sync is taken at its word (nothing is pulled,
/// an unsealed version is answered once sealed): later completions carry its version. Memory released (colocated) is taken at its word too,
/// but a generation asked for before it is restored is refused. Anything else is refused.
pub async fn serve(
    listener: TcpListener,
    key: ClusterKey,
    name: String,
    behaviour: Behaviour,
    answer: Answer,
) {
    let Ok((stream, _)) = listener.accept().await else {
        return;
    };
    let limits = LinkLimits::default();
    let Ok(link) = Link::accept(stream, &key, &hello("worker", &name), &limits).await else {
        return;
    };
    if behaviour == Behaviour::Leaves {
        return;
    }
    let mut server = link.server();
    let mut worker = FakeWorker {
        behaviour,
        answer,
        held: Vec::new(),
        version: 0,
        released: false,
        unsealed: None,
    };
    while let Some(incoming) = server.requests.recv().await {
        if worker.handle(&server.responder, incoming).is_break() {
            return;
        }
    }
}

/// What a fake worker remembers between requests.
struct FakeWorker {
    behaviour: Behaviour,
    answer: Answer,
    /// Requests a [`Behaviour::Hangs`] worker never answers (kept so they stay open).
    held: Vec<Incoming>,
    /// The weight version its completions carry.
    version: u64,
    released: bool,
    unsealed: Option<u64>,
}

impl FakeWorker {
    /// Serves one request; breaks when the connection should close.
    fn handle(&mut self, responder: &Responder, incoming: Incoming) -> ControlFlow<()> {
        match incoming.frame.kind {
            MessageKind::GeneratorMemory => return self.memory(responder, &incoming),
            _ if self.released => {
                let _ = responder.fail(incoming.call, "asked to work with its memory released");
            }
            MessageKind::SyncWeights | MessageKind::SealWeights => {
                match sync_weights(responder, &incoming, &mut self.unsealed) {
                    Ok(Some(synced)) => self.version = synced,
                    Ok(None) => {}
                    Err(_) => return ControlFlow::Break(()),
                }
            }
            MessageKind::GenerateRequest => return self.generate(responder, incoming),
            MessageKind::TokenizerRequest => self.tokenize(responder, &incoming),
            _ => {
                let _ = responder.fail(incoming.call, "a fake worker only generates");
            }
        }
        ControlFlow::Continue(())
    }

    fn memory(&mut self, responder: &Responder, incoming: &Incoming) -> ControlFlow<()> {
        let answered = match incoming.decode::<GeneratorMemory>() {
            Ok(action) => {
                self.released = action == GeneratorMemory::Release;
                responder.reply(incoming.call, &Done {}, Bytes::new(), false)
            }
            Err(err) => responder.fail(incoming.call, err.to_string()),
        };
        if answered.is_err() {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }

    /// Encodes each text as its bytes (the first id `u32::MAX` when it sends ids past any
    /// vocabulary), decodes ids as their numbers; its end-of-sequence id is 0.
    fn tokenize(&self, responder: &Responder, incoming: &Incoming) {
        let answer = match incoming.decode::<TokenizerRequest>() {
            Ok(TokenizerRequest::Encode { texts, .. }) => {
                let mut ids: Vec<Vec<u32>> = texts
                    .iter()
                    .map(|text| text.bytes().map(u32::from).collect())
                    .collect();
                let outside = Behaviour::Malformed(Malformation::OutOfVocabulary);
                if let (true, Some(first)) = (self.behaviour == outside, ids.first_mut()) {
                    first.insert(0, u32::MAX);
                }
                TokenizerResponse::Ids { ids }
            }
            Ok(TokenizerRequest::Decode { sequences }) => TokenizerResponse::Texts {
                texts: sequences.iter().map(|ids| format!("{ids:?}")).collect(),
            },
            Ok(TokenizerRequest::EosTokenIds) => TokenizerResponse::Ids { ids: vec![vec![0]] },
            Err(err) => {
                let _ = responder.fail(incoming.call, err.to_string());
                return;
            }
        };
        let _ = responder.reply(incoming.call, &answer, Bytes::new(), false);
    }

    fn generate(&mut self, responder: &Responder, incoming: Incoming) -> ControlFlow<()> {
        let malformation = match self.behaviour {
            Behaviour::DiesOnRequest | Behaviour::Leaves => return ControlFlow::Break(()),
            Behaviour::Hangs => {
                self.held.push(incoming);
                return ControlFlow::Continue(());
            }
            Behaviour::Healthy => None,
            Behaviour::Malformed(how) => Some(how),
        };
        let Ok(request) = incoming.decode::<GenerateRequest>() else {
            let _ = responder.fail(incoming.call, "not a GenerateRequest");
            return ControlFlow::Continue(());
        };
        let mut response = (self.answer)(&request);
        for completion in response.groups.iter_mut().flatten() {
            completion.weight_version = self.version;
        }
        if let (Some(how), Some(first)) =
            (malformation, response.groups.iter_mut().flatten().next())
        {
            how.apply(first);
        }
        if responder
            .reply(incoming.call, &response, Bytes::new(), false)
            .is_err()
        {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }
}

/// Takes a weight sync at its word: a sealed one is answered at once, an unsealed one once
/// its [`SealWeights`] arrives (held in `unsealed` until then). Returns the version now
/// served, if it changed.
fn sync_weights(
    responder: &Responder,
    incoming: &Incoming,
    unsealed: &mut Option<u64>,
) -> Result<Option<u64>, NetError> {
    let weights = match incoming.frame.kind {
        MessageKind::SyncWeights => incoming.decode::<SyncWeights>().map(|sync| sync.weights),
        _ => incoming.decode::<SealWeights>().map(|seal| seal.weights),
    };
    let weights = match weights {
        Ok(weights) => weights,
        Err(err) => {
            return responder
                .fail(incoming.call, err.to_string())
                .map(|()| None);
        }
    };
    if incoming.frame.kind == MessageKind::SealWeights {
        responder.reply(incoming.call, &Done {}, Bytes::new(), false)?;
        let Some(call) = unsealed.take() else {
            return Ok(None);
        };
        responder.reply(call, &weights, Bytes::new(), false)?;
        return Ok(Some(weights.version));
    }
    if !weights.is_sealed() {
        *unsealed = Some(incoming.call);
        return Ok(None);
    }
    responder.reply(incoming.call, &weights, Bytes::new(), false)?;
    Ok(Some(weights.version))
}

/// Starts a fake worker on loopback that answers with [`seed_answers`], and connects to it
/// as the controller.
pub async fn fake_worker(
    key: &ClusterKey,
    name: &str,
    behaviour: Behaviour,
) -> Result<RpcClient, rollout_net::NetError> {
    let listener = rollout_net::link::listen("127.0.0.1:0").await?;
    let address = listener
        .local_addr()
        .map_err(|err| rollout_net::NetError::Connect {
            addr: "127.0.0.1:0".into(),
            reason: err.to_string(),
        })?
        .to_string();
    tokio::spawn(serve(
        listener,
        key.clone(),
        name.to_owned(),
        behaviour,
        seed_answers(),
    ));
    let limits = LinkLimits::default();
    Ok(
        Link::connect(&address, key, &hello("controller", "controller"), &limits)
            .await?
            .client(),
    )
}
