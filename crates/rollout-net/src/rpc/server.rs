//! The answering side of a connection: requests in (at most `credits` queued), answers out
//! in the order given.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

use super::{Envelope, EnvelopeHead, HashedFrame, Sink, Stream, decode_envelope, split};
use crate::frame::{Frame, FrameCodec, FrameError};
use crate::link::{LinkLimits, NetError};
use crate::messages::{ErrorMessage, Heartbeat, Hello, Message, MessageKind};
use crate::tls::Stream as LinkStream;

/// Starts the tasks of the answering side of `framed`.
pub(super) fn start_server(
    framed: Framed<LinkStream, FrameCodec>,
    peer: String,
    hello: Hello,
    limits: &LinkLimits,
) -> RpcServer {
    let (sink, stream) = split(framed);
    let (outgoing, queue) = mpsc::unbounded_channel::<Outgoing>();
    let (incoming, requests) = mpsc::channel(limits.credits.max(1) as usize);
    let (reader_done, stop_writing) = tokio::sync::oneshot::channel::<()>();
    let writer = tokio::spawn(server_writer(sink, queue, limits.heartbeat, stop_writing));
    let reader_peer = peer.clone();
    let timeout = limits.peer_timeout;
    let closed = Arc::new(Mutex::new(None));
    let closed_by_reader = closed.clone();
    tokio::spawn(async move {
        let reason = server_reader(stream, incoming, &reader_peer, timeout).await;
        if let Ok(mut slot) = closed_by_reader.lock() {
            *slot = Some(reason);
        }
        // A connection that can no longer be read is closed, not kept alive by heartbeats.
        let _ = reader_done.send(());
    });
    RpcServer {
        requests,
        responder: Responder { outgoing, peer },
        hello,
        closed,
        writer,
    }
}

/// A request that arrived, and the call to answer.
#[derive(Debug)]
pub struct Incoming {
    pub call: u64,
    pub frame: Frame,
}

impl Incoming {
    pub fn decode<M: Message>(&self) -> Result<M, FrameError> {
        decode_envelope(&self.frame).map(|envelope| envelope.body)
    }
}

/// An answer waiting to be written.
enum Outgoing {
    Plain(Frame),
    Hashed(HashedFrame),
}

/// Sends answers; cheap to clone, usable from any task.
#[derive(Clone, Debug)]
pub struct Responder {
    outgoing: mpsc::UnboundedSender<Outgoing>,
    peer: String,
}

impl Responder {
    /// Answers `call`; with `more`, further answers to the same call follow.
    pub fn reply<M: Message>(
        &self,
        call: u64,
        message: &M,
        payload: Bytes,
        more: bool,
    ) -> Result<(), NetError> {
        let frame = answer_frame(call, message, payload, more)?;
        self.queue(Outgoing::Plain(frame))
    }

    /// Answers `call` with a payload sent from `pieces` back to back, hashed as it is
    /// written and followed by its digest, which `written` gets once the frame is out (it
    /// is dropped uncalled if the connection ends first). The pieces are held, not copied,
    /// until then.
    pub fn reply_hashed<M: Message>(
        &self,
        call: u64,
        message: &M,
        pieces: Vec<Bytes>,
        more: bool,
        written: impl FnOnce(u128) + Send + 'static,
    ) -> Result<(), NetError> {
        let frame = answer_frame(call, message, Bytes::new(), more)?;
        self.queue(Outgoing::Hashed(HashedFrame {
            kind: frame.kind,
            header: frame.header,
            pieces,
            written: Box::new(written),
        }))
    }

    fn queue(&self, outgoing: Outgoing) -> Result<(), NetError> {
        self.outgoing
            .send(outgoing)
            .map_err(|_| NetError::PeerLost {
                peer: self.peer.clone(),
                reason: "connection closed".into(),
            })
    }

    /// Answers `call` with an error; the caller sees [`NetError::Remote`].
    pub fn fail(&self, call: u64, message: impl Into<String>) -> Result<(), NetError> {
        self.reply(
            call,
            &ErrorMessage {
                message: message.into(),
            },
            Bytes::new(),
            false,
        )
    }
}

fn answer_frame<M: Message>(
    call: u64,
    message: &M,
    payload: Bytes,
    more: bool,
) -> Result<Frame, NetError> {
    let envelope = Envelope {
        call,
        more,
        body: message,
    };
    Frame::encode_message(M::KIND, &envelope, payload).map_err(|err| NetError::BadFrame {
        peer: "this process".into(),
        reason: err.to_string(),
    })
}

/// The answering side of a connection.
#[derive(Debug)]
pub struct RpcServer {
    pub requests: mpsc::Receiver<Incoming>,
    pub responder: Responder,
    pub hello: Hello,
    closed: Arc<Mutex<Option<String>>>,
    writer: tokio::task::JoinHandle<()>,
}

impl RpcServer {
    /// Why the connection ended, once `requests` has run dry.
    pub fn closed_reason(&self) -> String {
        self.closed
            .lock()
            .ok()
            .and_then(|reason| reason.clone())
            .unwrap_or_else(|| "connection closed".into())
    }

    /// Closes the connection once every answer already given is written (waiting at most
    /// `grace` for other holders of the responder to let go).
    pub async fn close(self, grace: Duration) {
        let RpcServer {
            requests,
            responder,
            writer,
            ..
        } = self;
        drop((requests, responder));
        let _ = tokio::time::timeout(grace, writer).await;
    }
}

async fn server_writer(
    mut sink: Sink,
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
    beat: Duration,
    mut reader_done: tokio::sync::oneshot::Receiver<()>,
) {
    let mut ticks = tokio::time::interval(beat);
    let mut seq = 0;
    loop {
        let result = tokio::select! {
            _ = &mut reader_done => break,
            next = queue.recv() => match next {
                Some(Outgoing::Plain(frame)) => sink.send(frame).await,
                Some(Outgoing::Hashed(frame)) => sink.send_hashed(frame).await,
                None => break,
            },
            _ = ticks.tick() => {
                seq += 1;
                match Frame::from_message(&Heartbeat { seq }, Bytes::new()) {
                    Ok(frame) => sink.send(frame).await,
                    Err(err) => Err(err),
                }
            }
        };
        if result.is_err() {
            break;
        }
    }
    let _ = sink.close().await;
}

async fn server_reader(
    mut stream: Stream,
    incoming: mpsc::Sender<Incoming>,
    peer: &str,
    timeout: Duration,
) -> String {
    loop {
        let frame = match tokio::time::timeout(timeout, stream.next()).await {
            Err(_) => return format!("{peer} sent nothing for {timeout:?}"),
            Ok(None) => return format!("{peer} closed the connection"),
            Ok(Some(Err(FrameError::Io(err)))) => {
                return format!("the connection to {peer} broke: {err}");
            }
            Ok(Some(Err(err))) => {
                tracing::warn!("{peer} sent a bad frame, closing: {err}");
                return format!("{peer} sent a bad frame: {err}");
            }
            Ok(Some(Ok(frame))) => frame,
        };
        if frame.kind == MessageKind::Heartbeat {
            continue;
        }
        let call = match EnvelopeHead::read(&frame) {
            Ok(head) => head.call,
            Err(err) => {
                tracing::warn!("{peer} sent a bad {} frame, closing: {err}", frame.kind);
                return format!("{peer} sent a bad frame: {err}");
            }
        };
        if incoming.send(Incoming { call, frame }).await.is_err() {
            return "the server stopped".into();
        }
    }
}
