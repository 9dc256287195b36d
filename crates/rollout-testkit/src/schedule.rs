//! The pure part of the fault proxy: where in a connection's byte stream each fault
//! happens, how bandwidth is paced, and which connections are dropped outright.

use std::ops::Range;
use std::time::{Duration, Instant};

/// Which way bytes travel through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the client that connected to the proxy to the upstream server.
    Up,
    /// From the upstream server back to the client.
    Down,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::Up => "client->upstream",
            Direction::Down => "upstream->client",
        })
    }
}

/// Which bytes the byte-count faults (`reset`, `stall`, `corrupt`) count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Scope {
    /// Only bytes from the client to the upstream server.
    Up,
    /// Only bytes from the upstream server to the client.
    Down,
    /// Bytes either way, counted together.
    #[default]
    Both,
}

impl Scope {
    /// Whether bytes travelling `direction` count towards the faults' thresholds.
    pub fn counts(self, direction: Direction) -> bool {
        matches!(
            (self, direction),
            (Scope::Both, _) | (Scope::Up, Direction::Up) | (Scope::Down, Direction::Down)
        )
    }
}

/// Faults placed at byte offsets of one connection (each happens at most once).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ByteFaults {
    /// Reset the connection (both sides) once this many counted bytes were forwarded.
    pub reset_after: Option<u64>,
    /// Pause forwarding for `stall` once this many counted bytes were forwarded.
    pub stall_after: Option<u64>,
    pub stall: Duration,
    /// Flip every bit of the counted byte at this offset (the one after this many bytes).
    pub corrupt_after: Option<u64>,
    pub scope: Scope,
}

impl ByteFaults {
    pub fn is_empty(&self) -> bool {
        self.reset_after.is_none() && self.stall_after.is_none() && self.corrupt_after.is_none()
    }
}

/// What the proxy does with (part of) a chunk it read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write these bytes of the chunk on.
    Forward(Range<usize>),
    /// Flip the bits of this byte of the chunk (before it is forwarded).
    Flip(usize),
    /// Wait this long before forwarding more.
    Stall(Duration),
    /// Reset the connection: forward nothing more either way.
    Reset,
}

/// One connection's faults and how far along its byte stream it is. Both directions of a
/// connection share one schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    faults: ByteFaults,
    counted: u64,
    stalled: bool,
    corrupted: bool,
    reset: bool,
}

/// The order of faults placed at the same offset: a reset first (the bytes at and after
/// its offset are never forwarded), then the stall, then the flip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Reset,
    Stall,
    Flip,
}

impl Schedule {
    pub fn new(faults: ByteFaults) -> Self {
        Self {
            faults,
            counted: 0,
            stalled: false,
            corrupted: false,
            reset: false,
        }
    }

    /// Counted bytes planned for forwarding so far.
    pub fn counted(&self) -> u64 {
        self.counted
    }

    /// Whether the connection has been reset.
    pub fn is_reset(&self) -> bool {
        self.reset
    }

    /// Plans a chunk of `len` bytes read travelling `direction`: the actions, in order, that
    /// forward it with its faults. After a `Reset` nothing more is forwarded either way.
    pub fn plan(&mut self, direction: Direction, len: usize) -> Vec<Action> {
        if self.reset {
            return vec![Action::Reset];
        }
        if len == 0 {
            return Vec::new();
        }
        if !self.faults.scope.counts(direction) {
            return vec![Action::Forward(0..len)];
        }
        let start = self.counted;
        let end = start + len as u64;
        let events = self.events(start, end);
        let mut actions = Vec::with_capacity(2 * events.len() + 1);
        let mut cursor = 0usize;
        for (at, event) in events {
            // `at - start` is at most `len`, a usize.
            let offset = usize::try_from(at - start).unwrap_or(len);
            if offset > cursor {
                actions.push(Action::Forward(cursor..offset));
                cursor = offset;
            }
            match event {
                Event::Reset => {
                    self.reset = true;
                    self.counted = start + cursor as u64;
                    actions.push(Action::Reset);
                    return actions;
                }
                Event::Stall => {
                    self.stalled = true;
                    actions.push(Action::Stall(self.faults.stall));
                }
                Event::Flip => {
                    self.corrupted = true;
                    actions.push(Action::Flip(offset));
                }
            }
        }
        if cursor < len {
            actions.push(Action::Forward(cursor..len));
        }
        self.counted = end;
        actions
    }

    /// The faults still to come that fall on counted bytes `start..end`, in order of offset.
    fn events(&self, start: u64, end: u64) -> Vec<(u64, Event)> {
        let mut events = Vec::new();
        if let Some(at) = self.faults.reset_after {
            // A reset whose offset ends this chunk happens right after it, without waiting
            // for more bytes.
            if at <= end {
                events.push((at.max(start), Event::Reset));
            }
        }
        if let Some(at) = self.faults.stall_after
            && !self.stalled
            && (start..end).contains(&at)
        {
            events.push((at, Event::Stall));
        }
        if let Some(at) = self.faults.corrupt_after
            && !self.corrupted
            && (start..end).contains(&at)
        {
            events.push((at, Event::Flip));
        }
        events.sort();
        events
    }
}

/// How long `bytes` take at `bytes_per_sec`.
pub fn transmit_time(bytes: usize, bytes_per_sec: u64) -> Duration {
    if bytes_per_sec == 0 {
        return Duration::ZERO;
    }
    Duration::from_secs_f64(bytes as f64 / bytes_per_sec as f64)
}

/// Paces one direction of a connection to a bandwidth: each write may start once the
/// previous ones would have finished at that rate.
#[derive(Debug, Clone)]
pub struct Pacer {
    bytes_per_sec: u64,
    next_free: Option<Instant>,
}

impl Pacer {
    pub fn new(bytes_per_sec: u64) -> Self {
        Self {
            bytes_per_sec,
            next_free: None,
        }
    }

    /// Reserves the link for `bytes` asked for at `now`: returns when they may be sent.
    pub fn reserve(&mut self, now: Instant, bytes: usize) -> Instant {
        let start = match self.next_free {
            Some(free) if free > now => free,
            _ => now,
        };
        self.next_free = Some(start + transmit_time(bytes, self.bytes_per_sec));
        start
    }
}

/// The most bytes the proxy reads (and so forwards) at once: small under a bandwidth
/// limit, so that pacing is smooth (about 20 chunks a second).
pub fn chunk_size(bytes_per_sec: Option<u64>) -> usize {
    const MAX: usize = 16 * 1024;
    match bytes_per_sec {
        Some(rate) => usize::try_from(rate / 20).unwrap_or(MAX).clamp(1, MAX),
        None => MAX,
    }
}

/// Which accepted connections the proxy drops before forwarding anything.
#[derive(Debug, Clone)]
pub struct Admission {
    drop_first: u64,
    accepted: u64,
}

impl Admission {
    pub fn new(drop_first: u64) -> Self {
        Self {
            drop_first,
            accepted: 0,
        }
    }

    /// Counts an accepted connection: its 1-based number, and whether to forward it.
    pub fn admit(&mut self) -> (u64, bool) {
        self.accepted += 1;
        (self.accepted, self.accepted > self.drop_first)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn reset_after(n: u64, scope: Scope) -> Schedule {
        Schedule::new(ByteFaults {
            reset_after: Some(n),
            scope,
            ..ByteFaults::default()
        })
    }

    /// Applies `actions` to `chunk`: the bytes written on, and whether it ended in a reset.
    fn apply(chunk: &[u8], actions: &[Action]) -> (Vec<u8>, bool) {
        let mut data = chunk.to_vec();
        let mut out = Vec::new();
        for action in actions {
            match action {
                Action::Forward(range) => out.extend_from_slice(&data[range.clone()]),
                Action::Flip(at) => data[*at] ^= 0xFF,
                Action::Stall(_) => {}
                Action::Reset => return (out, true),
            }
        }
        (out, false)
    }

    #[test]
    fn without_faults_everything_is_forwarded() {
        let mut schedule = Schedule::new(ByteFaults::default());
        assert_eq!(
            schedule.plan(Direction::Up, 10),
            vec![Action::Forward(0..10)]
        );
        assert_eq!(
            schedule.plan(Direction::Down, 7),
            vec![Action::Forward(0..7)]
        );
        assert_eq!(schedule.counted(), 17);
        assert!(schedule.plan(Direction::Up, 0).is_empty());
        assert!(!schedule.is_reset());
    }

    #[test]
    fn reset_forwards_exactly_n_bytes_across_chunks_and_directions() {
        let mut schedule = reset_after(25, Scope::Both);
        assert_eq!(
            schedule.plan(Direction::Up, 10),
            vec![Action::Forward(0..10)]
        );
        assert_eq!(
            schedule.plan(Direction::Down, 10),
            vec![Action::Forward(0..10)]
        );
        assert_eq!(
            schedule.plan(Direction::Up, 10),
            vec![Action::Forward(0..5), Action::Reset]
        );
        assert!(schedule.is_reset());
        assert_eq!(schedule.counted(), 25);
        // Nothing more either way.
        assert_eq!(schedule.plan(Direction::Down, 3), vec![Action::Reset]);
        assert_eq!(schedule.plan(Direction::Up, 3), vec![Action::Reset]);
    }

    #[test]
    fn reset_at_a_chunk_boundary_happens_without_waiting_for_more_bytes() {
        let mut schedule = reset_after(10, Scope::Both);
        assert_eq!(
            schedule.plan(Direction::Down, 10),
            vec![Action::Forward(0..10), Action::Reset]
        );
        let mut immediately = reset_after(0, Scope::Both);
        assert_eq!(immediately.plan(Direction::Up, 4), vec![Action::Reset]);
    }

    #[test]
    fn a_one_way_scope_ignores_the_other_direction_until_the_reset() {
        let mut schedule = reset_after(8, Scope::Down);
        assert_eq!(
            schedule.plan(Direction::Up, 100),
            vec![Action::Forward(0..100)]
        );
        assert_eq!(schedule.counted(), 0);
        assert_eq!(
            schedule.plan(Direction::Down, 20),
            vec![Action::Forward(0..8), Action::Reset]
        );
        // Once reset, the uncounted direction stops too.
        assert_eq!(schedule.plan(Direction::Up, 1), vec![Action::Reset]);
        assert!(Scope::Up.counts(Direction::Up) && !Scope::Up.counts(Direction::Down));
    }

    #[test]
    fn stall_and_flip_happen_once_at_their_offsets() {
        let mut schedule = Schedule::new(ByteFaults {
            stall_after: Some(6),
            stall: Duration::from_millis(300),
            corrupt_after: Some(13),
            ..ByteFaults::default()
        });
        let first = schedule.plan(Direction::Up, 10);
        assert_eq!(
            first,
            vec![
                Action::Forward(0..6),
                Action::Stall(Duration::from_millis(300)),
                Action::Forward(6..10)
            ]
        );
        let chunk: Vec<u8> = (10..20).collect();
        let second = schedule.plan(Direction::Down, chunk.len());
        let (out, reset) = apply(&chunk, &second);
        assert!(!reset);
        // Offset 13 is the fourth byte of the second chunk.
        let mut expected = chunk.clone();
        expected[3] ^= 0xFF;
        assert_eq!(out, expected);
        // Neither happens again.
        assert_eq!(
            schedule.plan(Direction::Up, 50),
            vec![Action::Forward(0..50)]
        );
    }

    #[test]
    fn faults_at_one_offset_reset_first() {
        let mut schedule = Schedule::new(ByteFaults {
            reset_after: Some(4),
            stall_after: Some(4),
            stall: Duration::from_secs(1),
            corrupt_after: Some(4),
            scope: Scope::Both,
        });
        assert_eq!(
            schedule.plan(Direction::Up, 8),
            vec![Action::Forward(0..4), Action::Reset]
        );
    }

    #[test]
    fn every_byte_is_forwarded_once_in_order_whatever_the_chunking() {
        let data: Vec<u8> = (0..=255).cycle().take(1000).collect();
        for chunk in [1, 3, 7, 64, 999, 1000] {
            let mut schedule = Schedule::new(ByteFaults {
                stall_after: Some(500),
                stall: Duration::from_millis(1),
                corrupt_after: Some(321),
                ..ByteFaults::default()
            });
            let mut out = Vec::new();
            for piece in data.chunks(chunk) {
                let (forwarded, reset) = apply(piece, &schedule.plan(Direction::Up, piece.len()));
                assert!(!reset);
                out.extend(forwarded);
            }
            let mut expected = data.clone();
            expected[321] ^= 0xFF;
            assert_eq!(out, expected, "chunks of {chunk}");
        }
    }

    #[test]
    fn pacing_spaces_writes_at_the_rate() {
        let now = Instant::now();
        let mut pacer = Pacer::new(1000);
        assert_eq!(pacer.reserve(now, 500), now);
        assert_eq!(pacer.reserve(now, 500), now + Duration::from_millis(500));
        assert_eq!(pacer.reserve(now, 10), now + Duration::from_millis(1000));
        // After an idle gap, the link is free at once.
        let later = now + Duration::from_secs(5);
        assert_eq!(pacer.reserve(later, 1), later);
        assert_eq!(transmit_time(250, 1000), Duration::from_millis(250));
        assert_eq!(transmit_time(250, 0), Duration::ZERO);
    }

    #[test]
    fn chunks_are_small_under_a_bandwidth_limit() {
        assert_eq!(chunk_size(None), 16 * 1024);
        assert_eq!(chunk_size(Some(2000)), 100);
        assert_eq!(chunk_size(Some(5)), 1);
        assert_eq!(chunk_size(Some(u64::MAX)), 16 * 1024);
    }

    #[test]
    fn the_first_connections_are_dropped() {
        let mut admission = Admission::new(2);
        assert_eq!(admission.admit(), (1, false));
        assert_eq!(admission.admit(), (2, false));
        assert_eq!(admission.admit(), (3, true));
        assert_eq!(Admission::new(0).admit(), (1, true));
    }
}
