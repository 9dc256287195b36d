//! The calling side of a connection: requests out in order, each holding a credit until its
//! last answer arrives, and answers routed back to their calls.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::codec::Framed;

use super::{Envelope, EnvelopeHead, Sink, Stream, decode_envelope, split};
use crate::frame::{Frame, FrameCodec, FrameError};
use crate::heard::HeardClock;
use crate::link::{LinkLimits, NetError};
use crate::messages::{ErrorMessage, Heartbeat, Hello, Message, MessageKind};
use crate::tls::Stream as LinkStream;

/// Starts the tasks of the calling side of `framed`, whose peer greeted with `hello`.
pub(super) fn start_client(
    framed: Framed<LinkStream, FrameCodec>,
    peer: String,
    hello: Hello,
    limits: &LinkLimits,
) -> RpcClient {
    let credits = hello.credits.max(1) as usize;
    let shared = Arc::new(ClientShared {
        pending: Mutex::new(HashMap::new()),
        lost: Mutex::new(None),
        ended: Notify::new(),
        closing: Notify::new(),
        peer: peer.clone(),
        heard: HeardClock::starting_now(),
    });
    let (outgoing, queue) = mpsc::unbounded_channel::<Outgoing>();
    let (sink, stream) = split(framed);
    let credits = Arc::new(Semaphore::new(credits));
    tokio::spawn(client_writer(
        sink,
        queue,
        credits,
        shared.clone(),
        limits.heartbeat,
    ));
    tokio::spawn(client_reader(stream, shared.clone(), limits.peer_timeout));
    RpcClient {
        shared,
        outgoing,
        next_call: Arc::new(AtomicU64::new(1)),
        hello,
    }
}

type Replies = mpsc::UnboundedSender<Result<Frame, NetError>>;

struct Outgoing {
    call: u64,
    frame: Frame,
}

struct Pending {
    replies: Replies,
    permit: Option<OwnedSemaphorePermit>,
}

struct ClientShared {
    pending: Mutex<HashMap<u64, Pending>>,
    /// Why the connection ended, once it has.
    lost: Mutex<Option<NetError>>,
    /// Woken when the connection ends.
    ended: Notify,
    /// Tells the writer to close the connection ([`RpcClient::close`]).
    closing: Notify,
    peer: String,
    heard: HeardClock,
}

impl ClientShared {
    fn lost_because(&self, reason: String) -> NetError {
        NetError::PeerLost {
            peer: self.peer.clone(),
            reason,
        }
    }

    /// Ends the connection with `err`: every pending call, and every later one, fails with it.
    fn lose(&self, err: NetError) {
        if let Ok(mut lost) = self.lost.lock() {
            lost.get_or_insert(err.clone());
        }
        let pending: Vec<Pending> = match self.pending.lock() {
            Ok(mut pending) => pending.drain().map(|(_, p)| p).collect(),
            Err(_) => Vec::new(),
        };
        for entry in pending {
            let _ = entry.replies.send(Err(err.clone()));
        }
        self.ended.notify_waiters();
    }

    fn lost(&self) -> Option<NetError> {
        self.lost.lock().ok().and_then(|lost| lost.clone())
    }
}

async fn client_writer(
    mut sink: Sink,
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
    credits: Arc<Semaphore>,
    shared: Arc<ClientShared>,
    heartbeat: Duration,
) {
    let mut ticks = tokio::time::interval(heartbeat);
    let mut seq = 0;
    loop {
        let result = tokio::select! {
            next = queue.recv() => {
                let Some(Outgoing { call, frame }) = next else { break };
                // Requests go out in the order they were made; each holds a credit until
                // its last answer arrives.
                let Ok(permit) = credits.clone().acquire_owned().await else { break };
                let still_waiting = match shared.pending.lock() {
                    Ok(mut pending) => pending
                        .get_mut(&call)
                        .map(|entry| entry.permit = Some(permit))
                        .is_some(),
                    Err(_) => false,
                };
                if !still_waiting {
                    continue;
                }
                sink.send(frame).await
            }
            _ = ticks.tick() => {
                seq += 1;
                match Frame::from_message(&Heartbeat { seq }, Bytes::new()) {
                    Ok(frame) => sink.send(frame).await,
                    Err(err) => Err(err),
                }
            }
            () = shared.closing.notified() => break,
        };
        if let Err(err) = result {
            shared.lose(shared.lost_because(format!("cannot send: {err}")));
            break;
        }
    }
    let _ = sink.close().await;
}

async fn client_reader(mut stream: Stream, shared: Arc<ClientShared>, timeout: Duration) {
    let reason = loop {
        let frame = match tokio::time::timeout(timeout, stream.next()).await {
            Err(_) => {
                // Silence, not a closed socket: the peer hangs or cannot be reached.
                shared.lose(NetError::PeerSilent {
                    peer: shared.peer.clone(),
                    seconds: timeout.as_secs_f64(),
                });
                return;
            }
            Ok(None) => break "connection closed".to_string(),
            Ok(Some(Err(FrameError::Io(err)))) => break format!("connection broken: {err}"),
            Ok(Some(Err(err))) => break format!("bad frame: {err}"),
            Ok(Some(Ok(frame))) => frame,
        };
        shared.heard.heard();
        if frame.kind == MessageKind::Heartbeat {
            continue;
        }
        let head = match EnvelopeHead::read(&frame) {
            Ok(head) => head,
            Err(err) => break format!("bad {} frame: {err}", frame.kind),
        };
        let entry = match shared.pending.lock() {
            Ok(pending) if head.more => pending
                .get(&head.call)
                .map(|entry| (entry.replies.clone(), None)),
            Ok(mut pending) => pending
                .remove(&head.call)
                .map(|entry| (entry.replies, entry.permit)),
            Err(_) => break "internal lock poisoned".to_string(),
        };
        match entry {
            Some((replies, _permit)) => {
                let _ = replies.send(Ok(frame));
            }
            None => break format!("an answer to call {} that was not made", head.call),
        }
    };
    shared.lose(shared.lost_because(reason));
}

/// The calling side of a connection. Cheap to clone; calls go out in the order made.
#[derive(Clone)]
pub struct RpcClient {
    shared: Arc<ClientShared>,
    outgoing: mpsc::UnboundedSender<Outgoing>,
    next_call: Arc<AtomicU64>,
    hello: Hello,
}

impl RpcClient {
    /// Resolves when the connection ends (closed, broken, silent past the peer timeout),
    /// with the reason; at once if it has.
    pub async fn lost(&self) -> NetError {
        loop {
            let ended = self.shared.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if let Some(err) = self.shared.lost() {
                return err;
            }
            ended.await;
        }
    }

    /// Closes the connection, however many clones of this client remain: pending and later
    /// calls fail with `reason`, and the peer reads the end of the stream.
    pub fn close(&self, reason: &str) {
        self.shared
            .lose(self.shared.lost_because(reason.to_owned()));
        self.shared.closing.notify_one();
    }

    /// Who answers.
    pub fn peer(&self) -> &Hello {
        &self.hello
    }

    pub fn describe(&self) -> &str {
        &self.shared.peer
    }

    /// When the peer last sent anything (an answer or a heartbeat).
    pub fn heard(&self) -> HeardClock {
        self.shared.heard.clone()
    }

    /// Sends `request` now (in call order, when a credit is free) and returns the call whose
    /// answers to await.
    pub fn call<M: Message>(&self, request: &M, payload: Bytes) -> Result<Call, NetError> {
        if let Some(err) = self.shared.lost() {
            return Err(err);
        }
        let call = self.next_call.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::encode_message(
            M::KIND,
            &Envelope {
                call,
                more: false,
                body: request,
            },
            payload,
        )
        .map_err(|err| NetError::BadFrame {
            peer: "this process".into(),
            reason: err.to_string(),
        })?;
        let (replies, answers) = mpsc::unbounded_channel();
        if let Ok(mut pending) = self.shared.pending.lock() {
            pending.insert(
                call,
                Pending {
                    replies,
                    permit: None,
                },
            );
        }
        self.outgoing
            .send(Outgoing { call, frame })
            .map_err(|_| self.shared.lost_because("connection closed".into()))?;
        Ok(Call {
            answers,
            peer: self.shared.peer.clone(),
        })
    }

    /// One request, one answer.
    pub async fn request<Req: Message, Resp: Message>(
        &self,
        request: &Req,
        payload: Bytes,
    ) -> Result<(Resp, Bytes), NetError> {
        self.call(request, payload)?.answer().await
    }
}

/// The answers to one request.
pub struct Call {
    answers: mpsc::UnboundedReceiver<Result<Frame, NetError>>,
    peer: String,
}

impl Call {
    /// The next answer frame: `None` once the last one has been taken. An error message from
    /// the peer is returned as [`NetError::Remote`].
    pub async fn next_frame(&mut self) -> Result<Option<Frame>, NetError> {
        match self.answers.recv().await {
            None => Ok(None),
            Some(Err(err)) => Err(err),
            Some(Ok(frame)) if frame.kind == MessageKind::Error => {
                let message = frame
                    .decode_header::<Envelope<ErrorMessage>>()
                    .map(|e| e.body.message)
                    .unwrap_or_else(|err| format!("an unreadable error ({err})"));
                Err(NetError::Remote {
                    peer: self.peer.clone(),
                    message,
                })
            }
            Some(Ok(frame)) => Ok(Some(frame)),
        }
    }

    /// Decodes one answer frame as `M` (with its envelope's `more` flag and payload).
    pub fn decode<M: Message>(&self, frame: Frame) -> Result<(M, bool, Bytes), NetError> {
        let envelope = decode_envelope::<M>(&frame).map_err(|err| NetError::BadFrame {
            peer: self.peer.clone(),
            reason: err.to_string(),
        })?;
        Ok((envelope.body, envelope.more, frame.payload))
    }

    /// The single answer of a request.
    pub async fn answer<M: Message>(mut self) -> Result<(M, Bytes), NetError> {
        let frame = self.next_frame().await?.ok_or_else(|| NetError::PeerLost {
            peer: self.peer.clone(),
            reason: "the call ended without an answer".into(),
        })?;
        let (message, _, payload) = self.decode(frame)?;
        Ok((message, payload))
    }
}
