//! The handshakes under way at a [`crate::gate::Gate`]: how far each has got, and which one
//! makes room for a new connection when too many are under way.
//!
//! A handshake moves through the [`Stage`]s in order; of them, only
//! [`Stage::Authenticated`] needs the cluster secret. A new connection that would put more
//! than [`MAX_HANDSHAKES_PER_SOURCE`] under way from its source address, or more than
//! [`MAX_HANDSHAKES`] in all, closes one handshake in that scope: the one that has made the
//! least progress; among equals, one from the source with the most handshakes under way;
//! among those, the oldest. An authenticated handshake is never closed; where every one in
//! the scope is, the new connection is refused instead, before it is sent a byte.

use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// Connections authenticating at once, from all sources together.
pub const MAX_HANDSHAKES: usize = 128;
/// Connections authenticating at once from one source address (an IPv6 /64).
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 16;

/// How far a handshake has got, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Connected, nothing more: on a plaintext link the challenge is sent and the proof has
    /// not arrived; on a TLS link no whole TLS ClientHello has arrived.
    Accepted,
    /// TLS links: a whole ClientHello arrived and the TLS handshake is under way.
    Hello,
    /// TLS links: the TLS handshake is done and the challenge is under way.
    Encrypted,
    /// The peer proved the secret; the greeting is under way.
    Authenticated,
}

impl Stage {
    const ALL: [Stage; 4] = [
        Stage::Accepted,
        Stage::Hello,
        Stage::Encrypted,
        Stage::Authenticated,
    ];
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Accepted => "connected, nothing more",
            Stage::Hello => "in the TLS handshake",
            Stage::Encrypted => "TLS done, not authenticated",
            Stage::Authenticated => "authenticated",
        })
    }
}

/// The stage one handshake has reached, shared between its task and the gate.
#[derive(Debug, Clone, Default)]
pub struct Progress(Arc<AtomicU8>);

impl Progress {
    /// Records that the handshake reached `stage` (a later stage stays).
    pub fn reach(&self, stage: Stage) {
        self.0.fetch_max(stage as u8, Ordering::Relaxed);
    }

    pub fn stage(&self) -> Stage {
        let reached = usize::from(self.0.load(Ordering::Relaxed));
        Stage::ALL
            .get(reached)
            .copied()
            .unwrap_or(Stage::Authenticated)
    }
}

/// What the per-source cap counts by: an IPv4 address (IPv4-mapped ones included) as it
/// is, an IPv6 address by its /64 prefix, which one host usually holds whole.
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let [a, b, c, d, ..] = v6.segments();
                IpAddr::V6(Ipv6Addr::new(a, b, c, d, 0, 0, 0, 0))
            }
        },
    }
}

/// Which cap a new connection met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    /// [`MAX_HANDSHAKES_PER_SOURCE`] from its source address.
    Source(IpAddr),
    /// [`MAX_HANDSHAKES`] in all.
    All,
}

impl std::fmt::Display for Cap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cap::Source(source) => write!(
                f,
                "{MAX_HANDSHAKES_PER_SOURCE} connections from {source} authenticating"
            ),
            Cap::All => write!(f, "{MAX_HANDSHAKES} connections authenticating"),
        }
    }
}

/// A handshake closed to make room for a new connection.
#[derive(Debug)]
pub struct Closed<T> {
    pub addr: SocketAddr,
    pub stage: Stage,
    pub cap: Cap,
    /// What closes it (its task's abort handle, at a gate).
    pub handle: T,
}

struct Entry<T> {
    id: u64,
    addr: SocketAddr,
    source: IpAddr,
    progress: Progress,
    handle: T,
}

/// The handshakes under way, oldest first, and how many come from each source.
pub struct Handshakes<T> {
    next: u64,
    entries: VecDeque<Entry<T>>,
    per_source: HashMap<IpAddr, usize>,
}

impl<T> Default for Handshakes<T> {
    fn default() -> Self {
        Self {
            next: 0,
            entries: VecDeque::new(),
            per_source: HashMap::new(),
        }
    }
}

impl<T> Handshakes<T> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Handshakes under way from `source` (as [`source_of`] gives it).
    pub fn count_from(&self, source: IpAddr) -> usize {
        self.per_source.get(&source).copied().unwrap_or(0)
    }

    /// Makes room for a new connection from `addr`: `Ok(None)` if there is room, the
    /// handshake taken out to make it (for the caller to close), or the cap that leaves no
    /// room, for the caller to refuse the new connection.
    pub fn make_room(&mut self, addr: SocketAddr) -> Result<Option<Closed<T>>, Cap> {
        let source = source_of(addr.ip());
        let cap = if self.count_from(source) >= MAX_HANDSHAKES_PER_SOURCE {
            Cap::Source(source)
        } else if self.entries.len() >= MAX_HANDSHAKES {
            Cap::All
        } else {
            return Ok(None);
        };
        let scope = match cap {
            Cap::Source(source) => Some(source),
            Cap::All => None,
        };
        let index = self.victim(scope).ok_or(cap)?;
        let entry = self.entries.remove(index).ok_or(cap)?;
        self.forget(entry.source);
        Ok(Some(Closed {
            addr: entry.addr,
            stage: entry.progress.stage(),
            cap,
            handle: entry.handle,
        }))
    }

    /// The handshake to close among those from `scope` (all if `None`): the least progress,
    /// then the most crowded source, then the oldest; never an authenticated one.
    fn victim(&self, scope: Option<IpAddr>) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, entry)| scope.is_none_or(|source| entry.source == source))
            .map(|(index, entry)| (entry.progress.stage(), entry.source, index))
            .filter(|(stage, _, _)| *stage < Stage::Authenticated)
            .min_by_key(|(stage, source, index)| {
                (*stage, Reverse(self.count_from(*source)), *index)
            })
            .map(|(_, _, index)| index)
    }

    /// The stage of the handshake with `addr`, if one is under way.
    #[cfg(test)]
    pub fn stage(&self, addr: SocketAddr) -> Option<Stage> {
        self.entries
            .iter()
            .find(|entry| entry.addr == addr)
            .map(|entry| entry.progress.stage())
    }

    /// The id the next [`Self::insert`] returns.
    pub fn next_id(&self) -> u64 {
        self.next
    }

    /// Adds a handshake (after [`Self::make_room`]); returns the id that removes it.
    pub fn insert(&mut self, addr: SocketAddr, progress: Progress, handle: T) -> u64 {
        let id = self.next;
        self.next += 1;
        let source = source_of(addr.ip());
        *self.per_source.entry(source).or_insert(0) += 1;
        self.entries.push_back(Entry {
            id,
            addr,
            source,
            progress,
            handle,
        });
        id
    }

    /// Removes handshake `id`, if it is still here.
    pub fn remove(&mut self, id: u64) {
        if let Ok(index) = self.entries.binary_search_by_key(&id, |entry| entry.id) {
            if let Some(entry) = self.entries.remove(index) {
                self.forget(entry.source);
            }
        }
    }

    fn forget(&mut self, source: IpAddr) {
        if let Some(count) = self.per_source.get_mut(&source) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.per_source.remove(&source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn addr(ip: &str, port: u16) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), port)
    }

    /// Adds a handshake from `ip` at `stage`, its handle the order it was added in.
    fn add(table: &mut Handshakes<u32>, ip: &str, stage: Stage) -> u32 {
        let progress = Progress::default();
        progress.reach(stage);
        let handle = u32::try_from(table.next).unwrap();
        table.insert(addr(ip, 1000), progress, handle);
        handle
    }

    fn closed(table: &mut Handshakes<u32>, ip: &str) -> Result<Option<u32>, Cap> {
        table
            .make_room(addr(ip, 2000))
            .map(|closed| closed.map(|c| c.handle))
    }

    #[test]
    fn progress_only_moves_forward() {
        let progress = Progress::default();
        assert_eq!(progress.stage(), Stage::Accepted);
        progress.reach(Stage::Encrypted);
        progress.reach(Stage::Hello);
        assert_eq!(progress.stage(), Stage::Encrypted);
        progress.reach(Stage::Authenticated);
        assert_eq!(progress.stage(), Stage::Authenticated);
    }

    #[test]
    fn sources_are_addresses_and_ipv6_slash_64s() {
        let v4: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(source_of(v4), v4);
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert_eq!(source_of(mapped), v4);
        let (one, other) = ("2001:db8:1:2::5", "2001:db8:1:2:ffff::9");
        let v6 = |ip: &str| source_of(ip.parse().unwrap());
        assert_eq!(v6(one), v6(other));
        assert_ne!(v6(one), v6("2001:db8:1:3::5"));
    }

    #[test]
    fn below_both_caps_nothing_is_closed() {
        let mut table = Handshakes::default();
        for index in 0..MAX_HANDSHAKES - 1 {
            let ip = format!("10.0.{}.{}", index / 8, index % 8);
            add(&mut table, &ip, Stage::Accepted);
        }
        assert_eq!(closed(&mut table, "10.9.9.9"), Ok(None));
        assert_eq!(table.len(), MAX_HANDSHAKES - 1);
    }

    #[test]
    fn the_least_progress_is_closed_first_then_the_oldest() {
        let mut table = Handshakes::default();
        // One handshake per source, so that only progress and age decide.
        let stages = [
            Stage::Encrypted,
            Stage::Hello,
            Stage::Accepted,
            Stage::Hello,
        ];
        for index in 0..MAX_HANDSHAKES {
            let stage = stages.get(index).copied().unwrap_or(Stage::Authenticated);
            add(
                &mut table,
                &format!("10.0.{}.{}", index / 200, index % 200),
                stage,
            );
        }
        let order: Vec<_> = (0..4)
            .map(|_| {
                let closed = closed(&mut table, "10.9.9.9").unwrap();
                add(&mut table, "10.9.9.9", Stage::Authenticated);
                closed
            })
            .collect();
        assert_eq!(order, [Some(2), Some(1), Some(3), Some(0)]);
        // Every one left is authenticated: the new connection is refused.
        assert_eq!(closed(&mut table, "10.9.9.7"), Err(Cap::All));
        assert_eq!(table.len(), MAX_HANDSHAKES);
    }

    #[test]
    fn among_equals_the_most_crowded_source_loses_one() {
        let mut table = Handshakes::default();
        let lone = add(&mut table, "10.0.0.1", Stage::Accepted);
        let sources = 12;
        for index in 1..MAX_HANDSHAKES {
            add(
                &mut table,
                &format!("10.0.1.{}", index % sources),
                Stage::Accepted,
            );
        }
        // The lone connection is the oldest, yet while another source holds more than one,
        // that source loses one first.
        let crowded = MAX_HANDSHAKES - 1 - sources;
        for index in 0..crowded {
            let closed = closed(&mut table, "10.0.2.1").unwrap();
            assert!(closed.is_some_and(|handle| handle != lone), "{closed:?}");
            add(&mut table, &format!("10.0.3.{index}"), Stage::Encrypted);
        }
        let left = |source: usize| table.count_from(format!("10.0.1.{source}").parse().unwrap());
        assert!((0..sources).all(|source| left(source) == 1));
        // Now every source holds one: the oldest goes.
        assert_eq!(closed(&mut table, "10.0.2.1"), Ok(Some(lone)));
    }

    #[test]
    fn one_source_past_its_cap_closes_its_own_least_progress() {
        let mut table = Handshakes::default();
        add(&mut table, "10.0.0.2", Stage::Accepted);
        let handles: Vec<_> = (0..MAX_HANDSHAKES_PER_SOURCE)
            .map(|_| add(&mut table, "10.0.0.1", Stage::Hello))
            .collect();
        let source: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(table.count_from(source), MAX_HANDSHAKES_PER_SOURCE);
        // The other source's idle connection has made less progress, but is not this
        // source's to close: the oldest from this one goes.
        assert_eq!(closed(&mut table, "10.0.0.1"), Ok(Some(handles[0])));
        assert_eq!(table.count_from(source), MAX_HANDSHAKES_PER_SOURCE - 1);
        assert_eq!(closed(&mut table, "10.0.0.1"), Ok(None));
        let authenticated = add(&mut table, "10.0.0.1", Stage::Authenticated);
        assert_eq!(closed(&mut table, "10.0.0.1"), Ok(Some(handles[1])));
        table.remove(u64::from(handles[2]));
        table.remove(u64::from(handles[2]));
        assert_eq!(table.count_from(source), MAX_HANDSHAKES_PER_SOURCE - 2);
        assert_eq!(table.len(), MAX_HANDSHAKES_PER_SOURCE - 1);
        assert!(
            table
                .entries
                .iter()
                .any(|entry| entry.handle == authenticated)
        );
    }

    #[test]
    fn a_source_whose_handshakes_are_all_authenticated_refuses_the_next() {
        let mut table = Handshakes::default();
        for _ in 0..MAX_HANDSHAKES_PER_SOURCE {
            add(&mut table, "::1", Stage::Authenticated);
        }
        let source = source_of("::1".parse().unwrap());
        assert_eq!(closed(&mut table, "::1"), Err(Cap::Source(source)));
        assert_eq!(closed(&mut table, "::2"), Err(Cap::Source(source)));
        assert_eq!(closed(&mut table, "127.0.0.1"), Ok(None));
        for id in 0..MAX_HANDSHAKES_PER_SOURCE as u64 {
            table.remove(id);
        }
        assert_eq!((table.len(), table.per_source.len()), (0, 0));
    }
}
