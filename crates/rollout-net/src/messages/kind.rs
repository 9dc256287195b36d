//! The wire tag of every message: the numbered [`MessageKind`] in a frame's preamble, its
//! limits, and the [`Message`] trait tying each message type to its kind.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::*;

/// The type of a frame, written as a `u16` in its preamble. Numbers are part of the wire
/// protocol: never reuse or renumber one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum MessageKind {
    Hello = 1,
    Heartbeat = 2,
    Error = 3,
    GenerateRequest = 4,
    GenerateResponse = 5,
    ScoreRequest = 6,
    ScoreResponse = 7,
    TrainRequest = 8,
    TrainResponse = 9,
    WeightsUpdate = 10,
    Welcome = 11,
    TokenizerRequest = 12,
    TokenizerResponse = 13,
    CheckpointRequest = 14,
    Done = 15,
    PublishWeights = 16,
    WeightsReport = 17,
    SyncWeights = 18,
    PullWeights = 19,
    WeightsBucket = 20,
    Shutdown = 21,
    ValuesRequest = 22,
    ValuesResponse = 23,
    GeneratorMemory = 24,
    SealWeights = 25,
    Loaded = 26,
}

impl MessageKind {
    pub const ALL: [MessageKind; 26] = [
        MessageKind::Hello,
        MessageKind::Heartbeat,
        MessageKind::Error,
        MessageKind::GenerateRequest,
        MessageKind::GenerateResponse,
        MessageKind::ScoreRequest,
        MessageKind::ScoreResponse,
        MessageKind::TrainRequest,
        MessageKind::TrainResponse,
        MessageKind::WeightsUpdate,
        MessageKind::Welcome,
        MessageKind::TokenizerRequest,
        MessageKind::TokenizerResponse,
        MessageKind::CheckpointRequest,
        MessageKind::Done,
        MessageKind::PublishWeights,
        MessageKind::WeightsReport,
        MessageKind::SyncWeights,
        MessageKind::PullWeights,
        MessageKind::WeightsBucket,
        MessageKind::Shutdown,
        MessageKind::ValuesRequest,
        MessageKind::ValuesResponse,
        MessageKind::GeneratorMemory,
        MessageKind::SealWeights,
        MessageKind::Loaded,
    ];

    /// The kind numbered `n`, if there is one.
    pub fn from_u16(n: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.as_u16() == n)
    }

    pub fn as_u16(self) -> u16 {
        self as u16
    }

    /// The largest header a frame of this kind needs: control messages are small, bulk
    /// messages (prompts, completions, batches) are bounded by the link's limit alone.
    pub fn max_header_bytes(self) -> u32 {
        use MessageKind::*;
        match self {
            Hello | Heartbeat | Done | Shutdown | PublishWeights | WeightsReport | SyncWeights
            | PullWeights | CheckpointRequest | GeneratorMemory | SealWeights | Loaded => 64 << 10,
            Error => 4 << 20,
            Welcome | WeightsBucket | WeightsUpdate => 16 << 20,
            GenerateRequest | GenerateResponse | ScoreRequest | ScoreResponse | TrainRequest
            | TrainResponse | TokenizerRequest | TokenizerResponse | ValuesRequest
            | ValuesResponse => u32::MAX,
        }
    }

    /// Whether frames of this kind carry a payload (tensor bytes); others must not.
    pub fn carries_payload(self) -> bool {
        matches!(
            self,
            MessageKind::WeightsBucket | MessageKind::WeightsUpdate
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MessageKind::Hello => "Hello",
            MessageKind::Heartbeat => "Heartbeat",
            MessageKind::Error => "Error",
            MessageKind::GenerateRequest => "GenerateRequest",
            MessageKind::GenerateResponse => "GenerateResponse",
            MessageKind::ScoreRequest => "ScoreRequest",
            MessageKind::ScoreResponse => "ScoreResponse",
            MessageKind::TrainRequest => "TrainRequest",
            MessageKind::TrainResponse => "TrainResponse",
            MessageKind::WeightsUpdate => "WeightsUpdate",
            MessageKind::Welcome => "Welcome",
            MessageKind::TokenizerRequest => "TokenizerRequest",
            MessageKind::TokenizerResponse => "TokenizerResponse",
            MessageKind::CheckpointRequest => "CheckpointRequest",
            MessageKind::Done => "Done",
            MessageKind::PublishWeights => "PublishWeights",
            MessageKind::WeightsReport => "WeightsReport",
            MessageKind::SyncWeights => "SyncWeights",
            MessageKind::PullWeights => "PullWeights",
            MessageKind::WeightsBucket => "WeightsBucket",
            MessageKind::Shutdown => "Shutdown",
            MessageKind::ValuesRequest => "ValuesRequest",
            MessageKind::ValuesResponse => "ValuesResponse",
            MessageKind::GeneratorMemory => "GeneratorMemory",
            MessageKind::SealWeights => "SealWeights",
            MessageKind::Loaded => "Loaded",
        }
    }
}

impl std::fmt::Display for MessageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A message that travels as the JSON header of a frame of kind [`Message::KIND`].
pub trait Message: Serialize + DeserializeOwned {
    const KIND: MessageKind;
}

macro_rules! impl_message {
    ($($ty:ident => $kind:ident),* $(,)?) => {
        $(impl Message for $ty {
            const KIND: MessageKind = MessageKind::$kind;
        })*
    };
}

impl_message! {
    Hello => Hello,
    Heartbeat => Heartbeat,
    ErrorMessage => Error,
    GenerateRequest => GenerateRequest,
    GenerateResponse => GenerateResponse,
    ScoreRequest => ScoreRequest,
    ScoreResponse => ScoreResponse,
    TrainRequest => TrainRequest,
    TrainResponse => TrainResponse,
    WeightsUpdate => WeightsUpdate,
    Welcome => Welcome,
    TokenizerRequest => TokenizerRequest,
    TokenizerResponse => TokenizerResponse,
    CheckpointRequest => CheckpointRequest,
    Done => Done,
    PublishWeights => PublishWeights,
    WeightsReport => WeightsReport,
    SyncWeights => SyncWeights,
    PullWeights => PullWeights,
    WeightsBucket => WeightsBucket,
    Shutdown => Shutdown,
    ValuesRequest => ValuesRequest,
    ValuesResponse => ValuesResponse,
    GeneratorMemory => GeneratorMemory,
    SealWeights => SealWeights,
    Loaded => Loaded,
}
