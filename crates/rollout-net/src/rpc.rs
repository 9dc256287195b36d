//! Calls and answers over an authenticated [`crate::link::Link`]: each request travels in
//! an [`Envelope`] naming its call, so a server may answer out of order and stream several
//! frames for one call (weight buckets); heartbeats both ways, a peer timeout, and credits
//! (requests the server accepts before the client waits).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::codec::Framed;

use crate::frame::{Frame, FrameCodec, FrameError};
use crate::heard::HeardClock;
use crate::link::{Link, LinkLimits, NetError};
use crate::messages::{ErrorMessage, Heartbeat, Hello, Message, MessageKind};
use crate::read::FrameReader;
use crate::tls::Stream as LinkStream;

/// A request or response: the call it belongs to, whether more frames follow for it, and
/// the message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    pub call: u64,
    #[serde(default)]
    pub more: bool,
    pub body: T,
}

#[derive(Deserialize)]
struct EnvelopeHead {
    call: u64,
    #[serde(default)]
    more: bool,
}

impl EnvelopeHead {
    /// Reads `call` and `more` from the start of a header. [`Envelope`] serialises them
    /// first (`{"call":N,"more":B,...`), so the body is not parsed twice; any other layout
    /// falls back to a full JSON parse.
    fn read(frame: &Frame) -> Result<Self, FrameError> {
        Self::from_prefix(&frame.header).map_or_else(|| frame.decode_header(), Ok)
    }

    fn from_prefix(header: &[u8]) -> Option<Self> {
        let rest = header.strip_prefix(b"{\"call\":")?;
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let call = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
        let rest = rest[digits..].strip_prefix(b",\"more\":")?;
        let (more, rest) = match rest {
            [b't', b'r', b'u', b'e', rest @ ..] => (true, rest),
            [b'f', b'a', b'l', b's', b'e', rest @ ..] => (false, rest),
            _ => return None,
        };
        rest.starts_with(b",").then_some(Self { call, more })
    }
}

impl Link {
    /// The calling side of this connection.
    pub fn client(self) -> RpcClient {
        let (framed, peer, hello, limits) = self.into_parts();
        start_client(framed, peer, hello, &limits)
    }

    /// The answering side: requests arrive on `requests` (at most `credits` queued; then
    /// the socket is not read, so the peer's writes back up), answers go through `responder`.
    pub fn server(self) -> RpcServer {
        let (framed, peer, hello, limits) = self.into_parts();
        start_server(framed, peer, hello, &limits)
    }
}

/// Starts the tasks of the calling side of `framed`, whose peer greeted with `hello`.
fn start_client(
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

/// Starts the tasks of the answering side of `framed`.
fn start_server(
    framed: Framed<LinkStream, FrameCodec>,
    peer: String,
    hello: Hello,
    limits: &LinkLimits,
) -> RpcServer {
    let (sink, stream) = split(framed);
    let (outgoing, queue) = mpsc::unbounded_channel::<Frame>();
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

/// The frames a link reads: those the greeting already read ahead, then the socket's.
type Stream = FrameReader<ReadHalf<LinkStream>>;

/// Writes frames with their payloads sent straight from their buffers (a weight bucket is
/// not copied into a write buffer first).
struct Sink {
    stream: WriteHalf<LinkStream>,
    codec: FrameCodec,
    head: BytesMut,
}

impl Sink {
    async fn send(&mut self, frame: Frame) -> Result<(), FrameError> {
        self.head.clear();
        self.codec.encode_head(&frame, &mut self.head)?;
        self.stream.write_all(&self.head).await?;
        if !frame.payload.is_empty() {
            self.stream.write_all(&frame.payload).await?;
        }
        // TLS holds records back until flushed: without this a frame could wait for the
        // next one (the next heartbeat, seconds later).
        self.stream.flush().await?;
        Ok(())
    }

    async fn close(&mut self) -> Result<(), FrameError> {
        self.stream.shutdown().await?;
        Ok(())
    }
}

/// Splits a link's framed stream into its reading and writing halves, keeping what the
/// greeting read ahead (the reader decodes those bytes before it waits on the socket).
fn split(framed: Framed<LinkStream, FrameCodec>) -> (Sink, Stream) {
    let parts = framed.into_parts();
    let (read, write) = tokio::io::split(parts.io);
    // The writer's codec has the same limits and no state; the reader keeps the one that
    // read the greeting: it may hold the start of a large payload from the read-ahead.
    let codec = FrameCodec::new()
        .with_max_header_bytes(parts.codec.max_header_bytes())
        .with_max_payload_bytes(parts.codec.max_payload_bytes());
    let sink = Sink {
        stream: write,
        codec,
        head: BytesMut::new(),
    };
    (sink, FrameReader::new(read, parts.codec, parts.read_buf))
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

/// Parses a frame carrying an `Envelope<M>`, after checking its kind.
pub fn decode_envelope<M: Message>(frame: &Frame) -> Result<Envelope<M>, FrameError> {
    if frame.kind != M::KIND {
        return Err(FrameError::KindMismatch {
            expected: M::KIND,
            found: frame.kind,
        });
    }
    frame.decode_header()
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

/// Sends answers; cheap to clone, usable from any task.
#[derive(Clone, Debug)]
pub struct Responder {
    outgoing: mpsc::UnboundedSender<Frame>,
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
        let frame = Frame::encode_message(
            M::KIND,
            &Envelope {
                call,
                more,
                body: message,
            },
            payload,
        )
        .map_err(|err| NetError::BadFrame {
            peer: "this process".into(),
            reason: err.to_string(),
        })?;
        self.outgoing.send(frame).map_err(|_| NetError::PeerLost {
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
    mut queue: mpsc::UnboundedReceiver<Frame>,
    beat: Duration,
    mut reader_done: tokio::sync::oneshot::Receiver<()>,
) {
    let mut ticks = tokio::time::interval(beat);
    let mut seq = 0;
    loop {
        let result = tokio::select! {
            _ = &mut reader_done => break,
            next = queue.recv() => match next {
                Some(frame) => sink.send(frame).await,
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

#[cfg(test)]
#[path = "rpc_tests.rs"]
mod tests;
