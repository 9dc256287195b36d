//! Sequences: one prompt's tokens and generated tokens, their place in the cache, and the
//! slab that stores them under stable ids.

use std::sync::Arc;

use super::blocks::{BlockHash, BlockId, ROOT_HASH, block_hash};
use super::config::{Request, SampleParams};
use super::ngram::NgramIndex;

/// Identifies a request added to a [`super::Scheduler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Identifies a live sequence; stale ids (of finished sequences) are recognised as such.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId {
    index: u32,
    generation: u32,
}

/// What the samples of one request share.
#[derive(Debug)]
pub(super) struct RequestInfo {
    pub id: RequestId,
    pub prompt_len: usize,
    pub params: SampleParams,
    pub stop_token_ids: Vec<u32>,
    pub max_new_tokens: Vec<u32>,
    pub seeds: Vec<u64>,
}

impl RequestInfo {
    pub fn new(id: RequestId, request: &Request) -> Self {
        RequestInfo {
            id,
            prompt_len: request.prompt.len(),
            params: request.params,
            stop_token_ids: request.stop_token_ids.clone(),
            max_new_tokens: request.max_new_tokens.clone(),
            seeds: request.seeds.clone(),
        }
    }
}

/// A prompt with its generated tokens. Before its group forks, a sequence stands for all the
/// samples of its request (`samples` has `n` entries); afterwards for exactly one.
#[derive(Debug)]
pub(super) struct Sequence {
    pub id: SeqId,
    pub request: Arc<RequestInfo>,
    pub samples: Vec<usize>,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// Leading tokens whose keys and values are in the cache.
    pub computed: usize,
    /// Block table: position `p` lives in `blocks[p / block_size]`.
    pub blocks: Vec<BlockId>,
    /// Chained hashes of the full blocks of `tokens` (filled lazily, prefix caching only).
    pub hashes: Vec<BlockHash>,
    /// Leading blocks already offered to the prefix cache.
    pub registered: usize,
    pub running: bool,
    pub ngram: NgramIndex,
}

impl Sequence {
    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.request.prompt_len
    }

    /// The sample this sequence stands for (the first one before its group forks).
    pub fn sample(&self) -> usize {
        self.samples.first().copied().unwrap_or(0)
    }

    /// Whether the next step feeds only the last token (plus drafts).
    pub fn is_decoding(&self) -> bool {
        self.computed + 1 == self.tokens.len()
    }

    /// Extends `hashes` to the first `blocks` full blocks of `tokens`.
    pub fn hash_blocks(&mut self, blocks: usize, block_size: usize) {
        let blocks = blocks.min(self.tokens.len() / block_size);
        while self.hashes.len() < blocks {
            let i = self.hashes.len();
            let parent = self.hashes.last().copied().unwrap_or(ROOT_HASH);
            let chunk = &self.tokens[i * block_size..(i + 1) * block_size];
            self.hashes.push(block_hash(parent, chunk));
        }
    }

    /// Slot of position `pos`, whose block must be allocated.
    pub fn slot(&self, pos: usize, block_size: usize) -> usize {
        self.blocks[pos / block_size] as usize * block_size + pos % block_size
    }
}

/// Sequences by [`SeqId`], with slot reuse.
#[derive(Debug, Default)]
pub(super) struct SeqSlab {
    entries: Vec<(u32, Option<Sequence>)>,
    vacant: Vec<u32>,
}

impl SeqSlab {
    /// Stores the sequence `make` builds for its new id.
    pub fn insert(&mut self, make: impl FnOnce(SeqId) -> Sequence) -> SeqId {
        let index = match self.vacant.pop() {
            Some(index) => index,
            None => {
                self.entries.push((0, None));
                (self.entries.len() - 1) as u32
            }
        };
        let entry = &mut self.entries[index as usize];
        let id = SeqId {
            index,
            generation: entry.0,
        };
        entry.1 = Some(make(id));
        id
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        match self.entries.get(id.index as usize) {
            Some((generation, seq)) if *generation == id.generation => seq.as_ref(),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        match self.entries.get_mut(id.index as usize) {
            Some((generation, seq)) if *generation == id.generation => seq.as_mut(),
            _ => None,
        }
    }

    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let entry = self.entries.get_mut(id.index as usize)?;
        if entry.0 != id.generation {
            return None;
        }
        let seq = entry.1.take()?;
        entry.0 = entry.0.wrapping_add(1);
        self.vacant.push(id.index);
        Some(seq)
    }

    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.entries.iter().filter_map(|(_, seq)| seq.as_ref())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn seq(id: SeqId) -> Sequence {
        let request = Request {
            prompt: vec![1, 2, 3, 4, 5],
            n: 1,
            max_new_tokens: vec![4],
            params: SampleParams::default(),
            stop_token_ids: vec![],
            seeds: vec![0],
        };
        Sequence {
            id,
            request: Arc::new(RequestInfo::new(RequestId(0), &request)),
            samples: vec![0],
            tokens: request.prompt.clone(),
            logprobs: vec![],
            computed: 0,
            blocks: vec![],
            hashes: vec![],
            registered: 0,
            running: false,
            ngram: NgramIndex::default(),
        }
    }

    #[test]
    fn stale_ids_are_not_resolved() {
        let mut slab = SeqSlab::default();
        let a = slab.insert(seq);
        assert!(slab.remove(a).is_some());
        let b = slab.insert(seq);
        assert_ne!(a, b);
        assert!(slab.get(a).is_none() && slab.remove(a).is_none());
        assert_eq!(slab.get(b).unwrap().id, b);
    }

    #[test]
    fn hashes_cover_full_blocks_only() {
        let mut slab = SeqSlab::default();
        let id = slab.insert(seq);
        let s = slab.get_mut(id).unwrap();
        s.hash_blocks(10, 2);
        assert_eq!(s.hashes.len(), 2);
        assert_eq!(
            s.hashes[1],
            block_hash(block_hash(ROOT_HASH, &[1, 2]), &[3, 4])
        );
    }
}
