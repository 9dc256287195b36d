//! Packing sequences into micro-batches under a token budget.
//!
//! A micro-batch costs `rows x longest row` padded tokens and at most `budget` of them (a
//! sequence longer than the budget gets a micro-batch of its own). Sequences are sorted by
//! length and cut into consecutive runs by dynamic programming that minimises the number of
//! micro-batches and then the padded tokens, so the row count follows the sequence lengths:
//! many short rows or a few long ones.

/// Indices into `lengths`, grouped into micro-batches.
pub fn pack_by_token_budget(lengths: &[usize], budget: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    let sorted: Vec<usize> = order.iter().map(|&i| lengths[i]).collect();
    let n = sorted.len();
    // best[j]: (micro-batches, padded tokens, start of the last batch) for the first j.
    let mut best: Vec<(usize, usize, usize)> = vec![(0, 0, 0); n + 1];
    for j in 1..=n {
        let mut choice = (usize::MAX, usize::MAX, j - 1);
        // Batch [i, j): its width is sorted[i], the longest; widening it only grows the cost.
        for i in (0..j).rev() {
            let rows = j - i;
            let padded = rows * sorted[i];
            if rows > 1 && padded > budget {
                break;
            }
            let candidate = (best[i].0 + 1, best[i].1 + padded, i);
            if (candidate.0, candidate.1) < (choice.0, choice.1) {
                choice = candidate;
            }
        }
        best[j] = choice;
    }
    let mut batches = Vec::new();
    let mut end = n;
    while end > 0 {
        let start = best[end].2;
        batches.push(order[start..end].to_vec());
        end = start;
    }
    batches.reverse();
    batches
}

/// Padded tokens of a micro-batch made of `indices`.
pub fn padded_tokens(lengths: &[usize], indices: &[usize]) -> usize {
    indices.iter().map(|&i| lengths[i]).max().unwrap_or(0) * indices.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cost(lengths: &[usize], batches: &[Vec<usize>]) -> (usize, usize) {
        (
            batches.len(),
            batches.iter().map(|b| padded_tokens(lengths, b)).sum(),
        )
    }

    #[test]
    fn packs_similar_lengths_together() {
        let lengths = [10, 2, 3, 9, 2];
        let batches = pack_by_token_budget(&lengths, 20);
        assert_eq!(batches, vec![vec![0, 3], vec![2, 1, 4]]);
    }

    #[test]
    fn oversized_sequence_gets_its_own_batch() {
        let batches = pack_by_token_budget(&[50, 5, 5], 16);
        assert_eq!(batches, vec![vec![0], vec![1, 2]]);
    }

    #[test]
    fn a_long_outlier_does_not_pad_the_short_rows() {
        // Greedy filling would put 171 with a 1 (342 padded tokens); the optimum isolates it.
        let lengths = [1, 1, 171];
        let batches = pack_by_token_budget(&lengths, 512);
        assert_eq!(cost(&lengths, &batches), (2, 173));
    }

    #[test]
    fn empty_input_gives_no_batches() {
        assert!(pack_by_token_budget(&[], 16).is_empty());
    }

    /// Every way to split `items` into groups (set partitions), for brute force.
    fn partitions(items: &[usize]) -> Vec<Vec<Vec<usize>>> {
        let Some((&first, rest)) = items.split_first() else {
            return vec![Vec::new()];
        };
        let mut out = Vec::new();
        for partition in partitions(rest) {
            for k in 0..partition.len() {
                let mut with = partition.clone();
                with[k].push(first);
                out.push(with);
            }
            let mut alone = partition;
            alone.push(vec![first]);
            out.push(alone);
        }
        out
    }

    proptest! {
        #[test]
        fn every_sequence_once_and_budget_respected(
            lengths in proptest::collection::vec(1usize..200, 0..200),
            budget in 1usize..2000,
        ) {
            let batches = pack_by_token_budget(&lengths, budget);
            let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
            for batch in &batches {
                prop_assert!(!batch.is_empty());
                prop_assert!(batch.len() == 1 || padded_tokens(&lengths, batch) <= budget);
            }
        }

        #[test]
        fn optimal_against_brute_force(
            lengths in proptest::collection::vec(1usize..40, 1..7),
            budget in 1usize..120,
        ) {
            let indices: Vec<usize> = (0..lengths.len()).collect();
            let best = partitions(&indices)
                .into_iter()
                .filter(|p| p.iter().all(|b| b.len() == 1 || padded_tokens(&lengths, b) <= budget))
                .map(|p| cost(&lengths, &p))
                .min();
            let packed = cost(&lengths, &pack_by_token_budget(&lengths, budget));
            prop_assert_eq!(Some(packed), best);
        }
    }
}
