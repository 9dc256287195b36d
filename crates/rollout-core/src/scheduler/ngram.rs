//! Prompt-lookup (n-gram) drafting over a sequence's own token history.
//!
//! The index maps the hash of every `min_ngram`-gram to the latest position where one ends,
//! with a chain to the previous position ending the same hash (as in LZ77 matchers). A lookup
//! walks the chain from the most recent occurrence, measures how many of the sequence's last
//! tokens match there (up to `max_ngram`, by comparing tokens, so hash collisions are
//! harmless), and keeps the longest, most recent match. Updating costs `O(min_ngram)` per new
//! token and a lookup at most [`MAX_CANDIDATES`] candidates, independent of the context length.

use std::collections::HashMap;

/// Occurrences examined per lookup at most.
const MAX_CANDIDATES: usize = 64;

const NONE: u32 = u32::MAX;

/// N-gram positions of one sequence's tokens, built lazily.
#[derive(Debug, Default)]
pub(super) struct NgramIndex {
    /// Gram hash to the latest position ending such a gram.
    latest: HashMap<u64, u32>,
    /// `previous[i]`: the position before `i` that ends a gram with the same hash.
    previous: Vec<u32>,
}

fn gram_hash(gram: &[u32]) -> u64 {
    gram.iter().fold(0x243F_6A88_85A3_08D3, |h, &t| {
        let x = (h ^ u64::from(t)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    })
}

impl NgramIndex {
    /// Appends to `drafts` up to `max_drafts` tokens that followed the most recent earlier
    /// occurrence of the longest suffix of `tokens` (between `min_ngram` and `max_ngram`
    /// tokens long) found.
    pub fn propose(
        &mut self,
        tokens: &[u32],
        min_ngram: usize,
        max_ngram: usize,
        max_drafts: usize,
        drafts: &mut Vec<u32>,
    ) {
        let len = tokens.len();
        if max_drafts == 0 || len <= min_ngram {
            return;
        }
        // Index the grams ending before the last token: those are earlier occurrences.
        while self.previous.len() < len - 1 {
            let end = self.previous.len();
            let link = if end + 1 >= min_ngram {
                let hash = gram_hash(&tokens[end + 1 - min_ngram..=end]);
                self.latest.insert(hash, end as u32).unwrap_or(NONE)
            } else {
                NONE
            };
            self.previous.push(link);
        }
        let last = len - 1;
        let mut candidate = self
            .latest
            .get(&gram_hash(&tokens[len - min_ngram..]))
            .copied()
            .unwrap_or(NONE);
        let (mut best, mut best_len) = (NONE, 0);
        for _ in 0..MAX_CANDIDATES {
            if candidate == NONE {
                break;
            }
            let end = candidate as usize;
            let matched = (0..max_ngram.min(end + 1))
                .take_while(|&k| tokens[end - k] == tokens[last - k])
                .count();
            if matched >= min_ngram && matched > best_len {
                (best, best_len) = (candidate, matched);
                if matched == max_ngram {
                    break;
                }
            }
            candidate = self.previous[end];
        }
        if best != NONE {
            let start = best as usize + 1;
            drafts.extend_from_slice(&tokens[start..(start + max_drafts).min(len)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let mut drafts = Vec::new();
        NgramIndex::default().propose(tokens, min, max, k, &mut drafts);
        drafts
    }

    #[test]
    fn proposes_what_followed_the_most_recent_occurrence() {
        // "1 2" occurs at 0..2 (followed by 3 9) and 4..6 (followed by 7 8).
        let tokens = [1, 2, 3, 9, 1, 2, 7, 8, 5, 1, 2];
        assert_eq!(propose(&tokens, 2, 2, 2), vec![7, 8]);
        assert_eq!(propose(&tokens, 2, 2, 5), vec![7, 8, 5, 1, 2]);
    }

    #[test]
    fn prefers_the_longest_match() {
        // Suffix "5 1 2": the 3-gram occurs at 0..3 only; "1 2" more recently at 5..7.
        let tokens = [5, 1, 2, 3, 0, 1, 2, 4, 5, 1, 2];
        assert_eq!(propose(&tokens, 2, 3, 1), vec![3]);
        assert_eq!(propose(&tokens, 2, 2, 1), vec![4]);
    }

    #[test]
    fn nothing_without_a_match_or_budget() {
        assert!(propose(&[1, 2, 3, 4], 2, 3, 3).is_empty());
        assert!(propose(&[1, 2, 1, 2], 2, 3, 0).is_empty());
        assert!(propose(&[1], 1, 1, 3).is_empty());
    }

    #[test]
    fn the_index_grows_with_the_sequence() {
        let mut index = NgramIndex::default();
        let mut tokens = vec![1, 2, 3];
        let mut drafts = Vec::new();
        index.propose(&tokens, 1, 2, 2, &mut drafts);
        assert!(drafts.is_empty());
        tokens.extend([1, 2]);
        index.propose(&tokens, 1, 2, 2, &mut drafts);
        assert_eq!(drafts, vec![3, 1]);
    }
}
