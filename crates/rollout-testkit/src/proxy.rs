//! The fault proxy: every accepted connection is forwarded to one upstream address, with
//! latency, a bandwidth limit and the byte-count faults of a [`Schedule`].
//!
//! Each direction of a connection is a reader and a writer joined by a queue: the reader
//! stamps every chunk with the time it may leave (`delay` after it arrived), so latency
//! does not limit throughput; the writer applies the schedule's faults and the pacing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::schedule::{Action, Admission, ByteFaults, Direction, Pacer, Schedule, chunk_size};

/// What the proxy does to the connections it forwards.
#[derive(Debug, Clone, Default)]
pub struct ProxyConfig {
    /// Where every connection is forwarded (`host:port`).
    pub upstream: String,
    /// Added to every chunk, each way.
    pub delay: Duration,
    /// Each direction of each connection is limited to this.
    pub bytes_per_sec: Option<u64>,
    /// Faults at byte offsets of every forwarded connection.
    pub faults: ByteFaults,
    /// Connections accepted and closed (reset) at once, before any are forwarded.
    pub drop_first: u64,
    /// Only the first this many forwarded connections suffer `faults` (all when `None`).
    pub faulty_connections: Option<u64>,
}

/// Writes a log line to stderr, stamped with the seconds since the proxy started.
pub fn log(message: impl std::fmt::Display) {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    eprintln!(
        "fault-proxy {:9.3}s: {message}",
        start.elapsed().as_secs_f64()
    );
}

/// How a connection, or one direction of it, ended.
#[derive(Debug)]
enum End {
    /// End of stream, passed on (as a FIN).
    Closed,
    /// The schedule reset it.
    Reset,
    /// A read or write failed (e.g. a peer reset it); the other side is reset too.
    Failed(std::io::Error),
}

/// Accepts connections on `listener` and forwards them until the task is dropped.
pub async fn serve(listener: TcpListener, config: ProxyConfig) -> std::io::Result<()> {
    let config = Arc::new(config);
    let mut admission = Admission::new(config.drop_first);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                // Too many open files and the like: back off rather than spin.
                log(format_args!("accept failed: {err}"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (number, admitted) = admission.admit();
        if !admitted {
            log(format_args!(
                "connection {number} from {peer}: dropped (--drop-first-connections {})",
                config.drop_first
            ));
            reset(&stream);
            drop(stream);
            continue;
        }
        let config = config.clone();
        tokio::spawn(async move { forward(number, peer, stream, &config).await });
    }
}

/// Closes `stream` with a reset (RST) rather than an orderly FIN when it is dropped.
fn reset(stream: &TcpStream) {
    if let Err(err) = stream.set_zero_linger() {
        log(format_args!("cannot arm a reset: {err}"));
    }
}

async fn forward(
    number: u64,
    peer: std::net::SocketAddr,
    mut downstream: TcpStream,
    config: &ProxyConfig,
) {
    let mut upstream = match TcpStream::connect(&config.upstream).await {
        Ok(stream) => stream,
        Err(err) => {
            log(format_args!(
                "connection {number} from {peer}: cannot reach upstream {}: {err}; resetting it",
                config.upstream
            ));
            reset(&downstream);
            return;
        }
    };
    let _ = downstream.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    log(format_args!(
        "connection {number} from {peer}: forwarding to {}",
        config.upstream
    ));
    let faulty = config
        .faulty_connections
        .is_none_or(|first| number - config.drop_first <= first);
    let faults = if faulty {
        config.faults.clone()
    } else {
        ByteFaults::default()
    };
    let schedule = Mutex::new(Schedule::new(faults));
    let (up_bytes, down_bytes) = (AtomicU64::new(0), AtomicU64::new(0));
    let end = {
        let (down_read, down_write) = downstream.split();
        let (up_read, up_write) = upstream.split();
        let up = pump(
            Direction::Up,
            down_read,
            up_write,
            &schedule,
            config,
            &up_bytes,
        );
        let down = pump(
            Direction::Down,
            up_read,
            down_write,
            &schedule,
            config,
            &down_bytes,
        );
        both(up, down).await
    };
    let (up_bytes, down_bytes) = (up_bytes.into_inner(), down_bytes.into_inner());
    let totals = format!("{up_bytes} bytes client->upstream, {down_bytes} bytes upstream->client");
    close(number, end, &downstream, &upstream, &totals);
}

/// Ends a forwarded connection as `end` says: a reset of both sides unless it closed.
fn close(number: u64, end: End, downstream: &TcpStream, upstream: &TcpStream, totals: &str) {
    match end {
        End::Closed => log(format_args!("connection {number}: closed ({totals})")),
        End::Reset => {
            reset(downstream);
            reset(upstream);
            log(format_args!(
                "connection {number}: RESET by --reset-after-bytes ({totals})"
            ));
        }
        End::Failed(err) => {
            reset(downstream);
            reset(upstream);
            log(format_args!(
                "connection {number}: {err}; resetting both sides ({totals})"
            ));
        }
    }
}

/// Runs both directions: until both have closed, or until either is reset or fails.
async fn both(up: impl Future<Output = End>, down: impl Future<Output = End>) -> End {
    let (mut up, mut down) = (std::pin::pin!(up), std::pin::pin!(down));
    let (mut up_open, mut down_open) = (true, true);
    while up_open || down_open {
        let end = tokio::select! {
            end = &mut up, if up_open => {
                up_open = false;
                end
            }
            end = &mut down, if down_open => {
                down_open = false;
                end
            }
        };
        if !matches!(end, End::Closed) {
            return end;
        }
    }
    End::Closed
}

/// One direction's writing side, applying the fault schedule's actions to each chunk.
struct Sending<'a, W> {
    direction: Direction,
    writer: &'a mut W,
    pacer: Option<&'a mut Pacer>,
    forwarded: &'a AtomicU64,
}

impl<W: AsyncWrite + Unpin> Sending<'_, W> {
    /// Forwards, corrupts or stalls `chunk` as `actions` say; how the connection ends if it
    /// does.
    async fn chunk(&mut self, mut chunk: Vec<u8>, actions: Vec<Action>) -> Option<End> {
        let direction = self.direction;
        let chunk_start = self.forwarded.load(Ordering::Relaxed);
        for action in actions {
            match action {
                Action::Forward(range) => {
                    if let Some(pacer) = self.pacer.as_mut() {
                        let at = pacer.reserve(Instant::now(), range.len());
                        tokio::time::sleep_until(at.into()).await;
                    }
                    let bytes = range.len() as u64;
                    if let Err(err) = self.writer.write_all(&chunk[range]).await {
                        return Some(End::Failed(err));
                    }
                    self.forwarded.fetch_add(bytes, Ordering::Relaxed);
                }
                Action::Flip(at) => {
                    log(format_args!(
                        "flipping byte {} {direction}",
                        chunk_start + at as u64
                    ));
                    if let Some(byte) = chunk.get_mut(at) {
                        *byte ^= 0xFF;
                    }
                }
                Action::Stall(pause) => {
                    log(format_args!(
                        "stalling {direction} for {} ms after {} bytes",
                        pause.as_millis(),
                        self.forwarded.load(Ordering::Relaxed)
                    ));
                    tokio::time::sleep(pause).await;
                }
                Action::Reset => return Some(End::Reset),
            }
        }
        None
    }
}

/// Forwards one direction of a connection until it ends.
async fn pump<R, W>(
    direction: Direction,
    mut reader: R,
    mut writer: W,
    schedule: &Mutex<Schedule>,
    config: &ProxyConfig,
    forwarded: &AtomicU64,
) -> End
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (chunks, mut queue) = mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(64);
    let delay = config.delay;
    let read = async move {
        let mut buffer = vec![0u8; chunk_size(config.bytes_per_sec)];
        loop {
            match reader.read(&mut buffer).await {
                Ok(0) => break,
                Ok(n) => {
                    let due = tokio::time::Instant::now() + delay;
                    if chunks.send((due, buffer[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
                Err(err) => return End::Failed(err),
            }
        }
        // End of stream: the writer passes it on once the queue is drained.
        drop(chunks);
        std::future::pending().await
    };
    let write = async {
        let mut pacer = config.bytes_per_sec.map(Pacer::new);
        while let Some((due, chunk)) = queue.recv().await {
            tokio::time::sleep_until(due).await;
            let actions = schedule
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .plan(direction, chunk.len());
            let mut sending = Sending {
                direction,
                writer: &mut writer,
                pacer: pacer.as_mut(),
                forwarded,
            };
            if let Some(end) = sending.chunk(chunk, actions).await {
                return end;
            }
        }
        // The other side may already be gone: that is the other direction's story.
        let _ = writer.shutdown().await;
        End::Closed
    };
    tokio::select! {
        end = read => end,
        end = write => end,
    }
}
