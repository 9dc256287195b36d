//! The KV block pool: a fixed number of blocks with reference counts, a free list and a
//! prefix cache.
//!
//! A block is *used* while some sequence holds it (refcount > 0), *free* when nobody holds it
//! and it caches nothing, and *evictable* when nobody holds it but it still caches a full
//! block of tokens under its prefix hash. Evictable blocks sit in an LRU list and are reused
//! (their hash dropped) only when the free list is empty, so a later request whose prompt
//! starts with the same tokens can take them back instead of recomputing them.
//!
//! The hash of a full block is BLAKE3 over its parent block's hash and its own tokens, so equal
//! hashes mean equal token prefixes, hence equal keys and values (for fixed weights).

use std::collections::HashMap;

use super::EngineError;

/// Index of a block in the pool.
pub(super) type BlockId = u32;

/// Chained hash of a full block: identifies the token prefix up to the end of the block.
pub(super) type BlockHash = u128;

/// The parent hash of a sequence's first block.
pub(super) const ROOT_HASH: BlockHash = 0;

const NIL: u32 = u32::MAX;

/// The hash of a full block with `tokens`, following the block whose hash is `parent`.
pub(super) fn block_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&parent.to_le_bytes());
    for token in tokens {
        hasher.update(&token.to_le_bytes());
    }
    let digest = hasher.finalize();
    let mut head = [0u8; 16];
    head.copy_from_slice(&digest.as_bytes()[..16]);
    u128::from_le_bytes(head)
}

/// Fixed pool of KV blocks.
#[derive(Debug)]
pub(super) struct BlockPool {
    block_size: usize,
    refcount: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    /// Slots of the block that hold written keys and values (for the utilisation metric).
    fill: Vec<u32>,
    free: Vec<BlockId>,
    cached: HashMap<BlockHash, BlockId>,
    /// Intrusive doubly linked LRU list of evictable blocks; `lru_head` is evicted first.
    lru_prev: Vec<u32>,
    lru_next: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    evictable: usize,
    /// Sum of `fill` over used blocks.
    live_slots: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` slots.
    pub(super) fn new(num_blocks: usize, block_size: usize) -> Self {
        let num_blocks = num_blocks.min(NIL as usize);
        BlockPool {
            block_size,
            refcount: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            fill: vec![0; num_blocks],
            // Popped from the end: block 0 is handed out first.
            free: (0..num_blocks as BlockId).rev().collect(),
            cached: HashMap::new(),
            lru_prev: vec![NIL; num_blocks],
            lru_next: vec![NIL; num_blocks],
            lru_head: NIL,
            lru_tail: NIL,
            evictable: 0,
            live_slots: 0,
        }
    }

    /// Blocks in the pool.
    pub(super) fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks nobody holds that cache nothing.
    #[cfg(test)]
    pub(super) fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks nobody holds that still cache a prefix.
    pub(super) fn num_evictable(&self) -> usize {
        self.evictable
    }

    /// Blocks an allocation can return: free plus evictable.
    pub(super) fn available(&self) -> usize {
        self.free.len() + self.evictable
    }

    /// Blocks some sequence holds.
    pub(super) fn used(&self) -> usize {
        self.num_blocks() - self.available()
    }

    /// Slots of used blocks that hold written keys and values.
    pub(super) fn live_slots(&self) -> usize {
        self.live_slots
    }

    /// Sequences holding `block`.
    pub(super) fn refcount(&self, block: BlockId) -> u32 {
        self.refcount[block as usize]
    }

    /// Takes a block, preferring the free list and else evicting the least recently cached
    /// block; `None` when every block is used. The block comes with refcount 1.
    pub(super) fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(block) => block,
            None => {
                let block = self.lru_head;
                if block == NIL {
                    return None;
                }
                self.lru_unlink(block);
                if let Some(hash) = self.hash[block as usize].take() {
                    self.cached.remove(&hash);
                }
                block
            }
        };
        self.refcount[block as usize] = 1;
        self.fill[block as usize] = 0;
        Some(block)
    }

    /// One more holder of `block` (a shared prefix, a fork or a prefix-cache hit).
    pub(super) fn retain(&mut self, block: BlockId) {
        let b = block as usize;
        if self.refcount[b] == 0 {
            // Only cached blocks are looked up while nobody holds them.
            self.lru_unlink(block);
            self.live_slots += self.fill[b] as usize;
        }
        self.refcount[b] += 1;
    }

    /// One holder fewer; a block nobody holds returns to the LRU when it caches a prefix and
    /// to the free list otherwise.
    pub(super) fn release(&mut self, block: BlockId) -> Result<(), EngineError> {
        let b = block as usize;
        if self.refcount[b] == 0 {
            return Err(EngineError::DoubleFree(block));
        }
        self.refcount[b] -= 1;
        if self.refcount[b] == 0 {
            self.live_slots -= self.fill[b] as usize;
            if self.hash[b].is_some() {
                self.lru_push_tail(block);
            } else {
                self.free.push(block);
            }
        }
        Ok(())
    }

    /// The block caching the prefix whose last full block hashes to `hash`.
    pub(super) fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Whether `block` would stop being available if retained (it is cached and unheld).
    pub(super) fn is_evictable(&self, block: BlockId) -> bool {
        self.refcount[block as usize] == 0
    }

    /// Offers the full, computed `block` to the prefix cache under `hash`; a prefix cached
    /// already (by a block computed concurrently) keeps its block.
    pub(super) fn register(&mut self, block: BlockId, hash: BlockHash) {
        let b = block as usize;
        if self.hash[b].is_some() || self.cached.contains_key(&hash) {
            return;
        }
        self.hash[b] = Some(hash);
        self.cached.insert(hash, block);
    }

    /// Forgets every cached prefix (e.g. after a weight update): evictable blocks become free
    /// and used blocks stop being offered to later requests.
    pub(super) fn clear_cache(&mut self) {
        while self.lru_head != NIL {
            let block = self.lru_head;
            self.lru_unlink(block);
            self.free.push(block);
        }
        self.cached.clear();
        self.hash.iter_mut().for_each(|h| *h = None);
    }

    /// Records that slots `0..fill` of the used `block` hold keys and values.
    pub(super) fn set_fill(&mut self, block: BlockId, fill: usize) {
        let b = block as usize;
        let fill = fill.min(self.block_size) as u32;
        if self.refcount[b] > 0 {
            self.live_slots = self.live_slots + fill as usize - self.fill[b] as usize;
        }
        self.fill[b] = fill;
    }

    /// Slots of `block` that hold keys and values.
    pub(super) fn fill(&self, block: BlockId) -> usize {
        self.fill[block as usize] as usize
    }

    /// The prefix hash `block` caches.
    #[cfg(test)]
    pub(super) fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.hash[block as usize]
    }

    fn lru_unlink(&mut self, block: BlockId) {
        let b = block as usize;
        let (prev, next) = (self.lru_prev[b], self.lru_next[b]);
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.lru_next[prev as usize] = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.lru_prev[next as usize] = prev;
        }
        self.lru_prev[b] = NIL;
        self.lru_next[b] = NIL;
        self.evictable -= 1;
    }

    fn lru_push_tail(&mut self, block: BlockId) {
        let b = block as usize;
        self.lru_prev[b] = self.lru_tail;
        self.lru_next[b] = NIL;
        if self.lru_tail == NIL {
            self.lru_head = block;
        } else {
            self.lru_next[self.lru_tail as usize] = block;
        }
        self.lru_tail = block;
        self.evictable += 1;
    }

    /// Checks the pool's internal consistency against `holders[b]`, the number of references
    /// to block `b` that the sequences hold.
    #[cfg(test)]
    pub(super) fn check(&self, holders: &[u32]) -> Result<(), String> {
        if holders != self.refcount.as_slice() {
            return Err(format!(
                "refcounts {:?} != holders {holders:?}",
                self.refcount
            ));
        }
        self.check_unheld()?;
        self.check_cache()?;
        let live: usize = (0..self.num_blocks())
            .filter(|&b| self.refcount[b] > 0)
            .map(|b| self.fill[b] as usize)
            .sum();
        if live != self.live_slots {
            return Err(format!("live slots {} != recount {live}", self.live_slots));
        }
        Ok(())
    }

    /// Every block nobody holds is either free (unhashed) or evictable (hashed, in the LRU
    /// list), never both, and the list's length is the evictable count.
    #[cfg(test)]
    fn check_unheld(&self) -> Result<(), String> {
        let mut seen = vec![false; self.num_blocks()];
        for &b in &self.free {
            if std::mem::replace(&mut seen[b as usize], true) {
                return Err(format!("block {b} twice on the free list"));
            }
            if self.refcount[b as usize] != 0 || self.hash[b as usize].is_some() {
                return Err(format!("free block {b} is held or hashed"));
            }
        }
        let (mut block, mut count) = (self.lru_head, 0);
        while block != NIL {
            if std::mem::replace(&mut seen[block as usize], true) {
                return Err(format!(
                    "block {block} free and evictable, or in the LRU twice"
                ));
            }
            if self.refcount[block as usize] != 0 || self.hash[block as usize].is_none() {
                return Err(format!("evictable block {block} is held or not hashed"));
            }
            count += 1;
            block = self.lru_next[block as usize];
        }
        if count != self.evictable {
            return Err(format!(
                "LRU has {count} blocks, counted {}",
                self.evictable
            ));
        }
        let unaccounted = (0..self.num_blocks())
            .filter(|&b| !seen[b] && self.refcount[b] == 0)
            .count();
        if unaccounted != 0 {
            return Err(format!(
                "{unaccounted} blocks are neither held, free nor evictable"
            ));
        }
        Ok(())
    }

    /// Every cache entry names a fully written block carrying its hash, and only those do.
    #[cfg(test)]
    fn check_cache(&self) -> Result<(), String> {
        for (&hash, &block) in &self.cached {
            if self.hash[block as usize] != Some(hash) {
                return Err(format!(
                    "cache entry for block {block} does not match its hash"
                ));
            }
            if self.fill[block as usize] as usize != self.block_size {
                return Err(format!("cached block {block} is not fully written"));
            }
        }
        if self.hash.iter().flatten().count() != self.cached.len() {
            return Err("hashed blocks and cache entries differ".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn never_allocates_beyond_the_pool() {
        let mut pool = BlockPool::new(3, 4);
        let blocks: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        assert_eq!(blocks, vec![0, 1, 2]);
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.used(), 3);
        pool.release(1).unwrap();
        assert_eq!(pool.allocate(), Some(1));
    }

    #[test]
    fn double_free_is_an_error() {
        let mut pool = BlockPool::new(2, 4);
        let b = pool.allocate().unwrap();
        pool.release(b).unwrap();
        assert_eq!(pool.release(b), Err(EngineError::DoubleFree(b)));
        pool.check(&[0, 0]).unwrap();
    }

    #[test]
    fn cached_blocks_are_evicted_only_when_nothing_is_free_and_in_lru_order() {
        let mut pool = BlockPool::new(3, 2);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        let (ha, hb) = (
            block_hash(ROOT_HASH, &[1, 2]),
            block_hash(ROOT_HASH, &[3, 4]),
        );
        pool.set_fill(a, 2);
        pool.set_fill(b, 2);
        pool.register(a, ha);
        pool.register(b, hb);
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        assert_eq!((pool.num_free(), pool.num_evictable()), (1, 2));
        // The free block goes first; then `a`, released before `b`.
        assert_eq!(pool.allocate(), Some(2));
        assert_eq!(pool.lookup(ha), Some(a));
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(pool.lookup(ha), None);
        // `b` is taken back from the cache rather than evicted.
        assert_eq!(pool.lookup(hb), Some(b));
        pool.retain(b);
        assert_eq!(pool.allocate(), None);
        pool.check(&[1, 1, 1]).unwrap();
    }

    #[test]
    fn a_prefix_is_cached_by_one_block_only() {
        let mut pool = BlockPool::new(2, 2);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        let h = block_hash(ROOT_HASH, &[7, 7]);
        pool.set_fill(a, 2);
        pool.register(a, h);
        pool.register(b, h);
        pool.release(b).unwrap();
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.lookup(h), Some(a));
    }

    #[test]
    fn hashes_chain_over_the_prefix() {
        let first = block_hash(ROOT_HASH, &[1, 2]);
        assert_ne!(block_hash(first, &[3, 4]), block_hash(ROOT_HASH, &[3, 4]));
        assert_ne!(
            block_hash(ROOT_HASH, &[1, 2]),
            block_hash(ROOT_HASH, &[2, 1])
        );
        assert_eq!(
            block_hash(first, &[3, 4]),
            block_hash(block_hash(0, &[1, 2]), &[3, 4])
        );
    }

    #[test]
    fn clearing_the_cache_frees_evictable_blocks() {
        let mut pool = BlockPool::new(2, 2);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.set_fill(a, 2);
        pool.set_fill(b, 2);
        pool.register(a, 1);
        pool.register(b, 2);
        pool.release(a).unwrap();
        pool.clear_cache();
        assert_eq!((pool.num_free(), pool.num_evictable()), (1, 0));
        assert_eq!(pool.lookup(2), None);
        pool.release(b).unwrap();
        assert_eq!(pool.num_free(), 2);
        pool.check(&[0, 0]).unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A sequence takes `len` blocks, reusing cached ones for the prefix `key` when it can.
        Admit { key: u8, len: usize },
        /// A sequence shares all blocks of another (a fork).
        Fork(usize),
        /// A sequence ends, caching its blocks.
        Finish(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4, 1usize..5).prop_map(|(key, len)| Op::Admit { key, len }),
            (0usize..16).prop_map(Op::Fork),
            (0usize..16).prop_map(Op::Finish),
        ]
    }

    proptest! {
        #[test]
        fn random_workloads_respect_the_budget_and_leak_nothing(
            num_blocks in 1usize..12,
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let mut pool = BlockPool::new(num_blocks, 4);
            let mut seqs: Vec<Vec<BlockId>> = Vec::new();
            let holders = |seqs: &Vec<Vec<BlockId>>| {
                let mut h = vec![0u32; num_blocks];
                seqs.iter().flatten().for_each(|&b| h[b as usize] += 1);
                h
            };
            for op in ops {
                match op {
                    Op::Admit { key, len } => {
                        let mut blocks = Vec::new();
                        let mut parent = ROOT_HASH;
                        let mut hit = true;
                        for i in 0..len {
                            let hash = block_hash(parent, &[u32::from(key), i as u32]);
                            parent = hash;
                            let cached = if hit { pool.lookup(hash) } else { None };
                            match cached {
                                Some(b) => { pool.retain(b); blocks.push(b); }
                                None => {
                                    hit = false;
                                    match pool.allocate() {
                                        Some(b) => { pool.set_fill(b, 4); pool.register(b, hash); blocks.push(b); }
                                        None => break,
                                    }
                                }
                            }
                        }
                        seqs.push(blocks);
                    }
                    Op::Fork(i) if !seqs.is_empty() => {
                        let blocks = seqs[i % seqs.len()].clone();
                        blocks.iter().for_each(|&b| pool.retain(b));
                        seqs.push(blocks);
                    }
                    Op::Finish(i) if !seqs.is_empty() => {
                        let blocks = seqs.swap_remove(i % seqs.len());
                        for &b in blocks.iter().rev() { pool.release(b).unwrap(); }
                    }
                    _ => {}
                }
                prop_assert!(pool.used() <= num_blocks);
                prop_assert_eq!(pool.used() + pool.available(), num_blocks);
                pool.check(&holders(&seqs)).map_err(TestCaseError::fail)?;
            }
            for blocks in seqs.drain(..) {
                for &b in blocks.iter().rev() { pool.release(b).unwrap(); }
            }
            pool.check(&holders(&seqs)).map_err(TestCaseError::fail)?;
            prop_assert_eq!(pool.available(), num_blocks);
            prop_assert_eq!(pool.live_slots(), 0);
        }
    }
}
