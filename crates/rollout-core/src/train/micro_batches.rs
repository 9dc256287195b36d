//! Turning trajectories into training micro-batches.

use rollout_net::messages::{MicroBatch, Objective};

use super::packing::pack_by_token_budget;

/// One sequence to train on: its tokens and, aligned with them, which tokens the loss covers,
/// their behaviour logprobs and their advantage.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSequence {
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<bool>,
    pub logprobs: Vec<f32>,
    pub advantage: f32,
    /// Weight versions between the trainer's before the update and the one that generated
    /// the sequence (0 for data the trainer did not sample).
    pub staleness: u32,
}

impl TrainSequence {
    pub fn loss_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }
}

/// Packing statistics for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PackingStats {
    pub micro_batches: usize,
    pub rows: usize,
    pub skipped_rows: usize,
    pub padded_tokens: usize,
    pub real_tokens: usize,
}

/// Micro-batches of at most `budget` padded tokens. The loss is normalised by the masked
/// tokens of *all* sequences; sequences whose gradient is exactly zero (`skip_zero_advantage`
/// with a zero advantage and no KL term) are left out of the compute but not of that count.
pub fn micro_batches(
    sequences: &[TrainSequence],
    objective: &Objective,
    budget: usize,
    skip_zero_advantage: bool,
) -> (Vec<MicroBatch>, PackingStats) {
    let (batches, stats, _) =
        laid_out_micro_batches(sequences, objective, budget, skip_zero_advantage);
    (batches, stats)
}

/// [`micro_batches`], and for each micro-batch the sequence (index into `sequences`) of
/// each of its rows.
pub fn laid_out_micro_batches(
    sequences: &[TrainSequence],
    objective: &Objective,
    budget: usize,
    skip_zero_advantage: bool,
) -> (Vec<MicroBatch>, PackingStats, Vec<Vec<usize>>) {
    let total_loss_tokens: usize = sequences.iter().map(TrainSequence::loss_tokens).sum();
    let loss_scale = if total_loss_tokens > 0 {
        1.0 / total_loss_tokens as f32
    } else {
        0.0
    };
    let kept: Vec<usize> = (0..sequences.len())
        .filter(|&i| {
            let s = &sequences[i];
            !(skip_zero_advantage && s.advantage == 0.0) && s.loss_tokens() > 0
        })
        .collect();
    let lengths: Vec<usize> = kept.iter().map(|&i| sequences[i].tokens.len()).collect();
    let layout: Vec<Vec<usize>> = pack_by_token_budget(&lengths, budget)
        .into_iter()
        .map(|indices| indices.into_iter().map(|i| kept[i]).collect())
        .collect();
    let mut stats = PackingStats {
        micro_batches: layout.len(),
        rows: kept.len(),
        skipped_rows: sequences.len() - kept.len(),
        ..PackingStats::default()
    };
    let batches = layout
        .iter()
        .map(|indices| {
            let rows: Vec<&TrainSequence> = indices.iter().map(|&i| &sequences[i]).collect();
            filled_batch(&rows, objective, loss_scale, &mut stats)
        })
        .collect();
    (batches, stats, layout)
}

/// DPO's micro-batches: each pair's chosen and rejected sequences as two adjacent rows, pairs
/// kept whole within `budget` padded tokens (a pair longer than half of it gets a micro-batch
/// of its own), the loss normalised by the number of pairs.
pub fn pair_micro_batches(
    pairs: &[(TrainSequence, TrainSequence)],
    objective: &Objective,
    budget: usize,
) -> (Vec<MicroBatch>, PackingStats) {
    let loss_scale = if pairs.is_empty() {
        0.0
    } else {
        1.0 / pairs.len() as f32
    };
    let lengths: Vec<usize> = pairs
        .iter()
        .map(|(chosen, rejected)| chosen.tokens.len().max(rejected.tokens.len()))
        .collect();
    let groups = pack_by_token_budget(&lengths, (budget / 2).max(1));
    let mut stats = PackingStats {
        micro_batches: groups.len(),
        rows: 2 * pairs.len(),
        ..PackingStats::default()
    };
    let batches = groups
        .iter()
        .map(|indices| {
            let rows: Vec<&TrainSequence> = indices
                .iter()
                .flat_map(|&i| [&pairs[i].0, &pairs[i].1])
                .collect();
            filled_batch(&rows, objective, loss_scale, &mut stats)
        })
        .collect();
    (batches, stats)
}

/// One right-padded micro-batch of `rows`, in order.
fn filled_batch(
    rows: &[&TrainSequence],
    objective: &Objective,
    loss_scale: f32,
    stats: &mut PackingStats,
) -> MicroBatch {
    let width = rows.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    let size = rows.len() * width;
    let mut batch = MicroBatch {
        rows: rows.len(),
        width,
        input_ids: vec![0; size],
        attention_mask: vec![0; size],
        loss_mask: vec![0.0; size],
        advantages: vec![0.0; size],
        old_logprobs: vec![0.0; size],
        loss_scale,
        objective: objective.clone(),
        returns: Vec::new(),
        old_values: Vec::new(),
        row_staleness: rows.iter().map(|s| s.staleness).collect(),
    };
    for (row, sequence) in rows.iter().enumerate() {
        let start = row * width;
        for (t, &token) in sequence.tokens.iter().enumerate() {
            batch.input_ids[start + t] = token;
            batch.attention_mask[start + t] = 1;
            if sequence.loss_mask[t] {
                batch.loss_mask[start + t] = 1.0;
                batch.advantages[start + t] = sequence.advantage;
                batch.old_logprobs[start + t] = sequence.logprobs[t];
            }
        }
        stats.real_tokens += sequence.tokens.len();
    }
    stats.padded_tokens += size;
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sequence(prompt: usize, completion: usize, advantage: f32) -> TrainSequence {
        let len = prompt + completion;
        TrainSequence {
            tokens: (1..=len as u32).collect(),
            loss_mask: (0..len).map(|t| t >= prompt).collect(),
            logprobs: (0..len)
                .map(|t| if t >= prompt { -0.5 } else { 0.0 })
                .collect(),
            advantage,
            staleness: 0,
        }
    }

    #[test]
    fn aligns_masks_logprobs_and_advantages() {
        let seqs = [sequence(2, 3, 1.5)];
        let (batches, stats) = micro_batches(&seqs, &Objective::Sft, 100, false);
        assert_eq!(batches.len(), 1);
        let b = &batches[0];
        assert_eq!((b.rows, b.width), (1, 5));
        assert_eq!(b.input_ids, [1, 2, 3, 4, 5]);
        assert_eq!(b.loss_mask, [0.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(b.advantages, [0.0, 0.0, 1.5, 1.5, 1.5]);
        assert_eq!(b.old_logprobs, [0.0, 0.0, -0.5, -0.5, -0.5]);
        assert_eq!(b.row_staleness, [0]);
        assert!((b.loss_scale - 1.0 / 3.0).abs() < 1e-7);
        assert_eq!(stats.real_tokens, 5);
    }

    #[test]
    fn right_pads_shorter_rows() {
        let seqs = [sequence(1, 1, 1.0), sequence(1, 3, -1.0)];
        let (batches, stats) = micro_batches(&seqs, &Objective::Sft, 100, false);
        let b = &batches[0];
        assert_eq!((b.rows, b.width), (2, 4));
        // Longest first; the short row is padded on the right.
        assert_eq!(&b.attention_mask[4..], [1, 1, 0, 0]);
        assert_eq!(&b.loss_mask[4..], [0.0, 1.0, 0.0, 0.0]);
        assert_eq!(stats.padded_tokens, 8);
        assert_eq!(stats.real_tokens, 6);
    }

    #[test]
    fn zero_advantage_rows_are_skipped_but_still_normalise() {
        let seqs = [sequence(2, 2, 0.0), sequence(2, 2, 1.0)];
        let (batches, stats) = micro_batches(&seqs, &Objective::Sft, 100, true);
        assert_eq!(stats.skipped_rows, 1);
        assert_eq!(batches.iter().map(|b| b.rows).sum::<usize>(), 1);
        assert!((batches[0].loss_scale - 0.25).abs() < 1e-7);
        let (kept, _) = micro_batches(&seqs, &Objective::Sft, 100, false);
        assert_eq!(kept.iter().map(|b| b.rows).sum::<usize>(), 2);
    }

    #[test]
    fn pairs_stay_adjacent_and_whole_and_normalise_by_pairs() {
        let pairs: Vec<_> = (0..3)
            .map(|i| (sequence(2, 2 + i, 1.0), sequence(2, 1, -1.0)))
            .collect();
        let objective = Objective::Dpo { beta: 0.1 };
        let (batches, stats) = pair_micro_batches(&pairs, &objective, 20);
        assert_eq!(stats.rows, 6);
        assert_eq!(batches.len(), 2);
        let fits = |b: &MicroBatch| b.rows % 2 == 0 && b.padded_tokens() <= 20;
        assert!(batches.iter().all(fits));
        assert_eq!(batches.iter().map(|b| b.rows).sum::<usize>(), 6);
        for batch in &batches {
            assert!((batch.loss_scale - 1.0 / 3.0).abs() < 1e-7);
            for pair in 0..batch.rows / 2 {
                let rejected = &batch.loss_mask[(2 * pair + 1) * batch.width..][..batch.width];
                // The rejected row of every pair is the one-token completion.
                assert_eq!(rejected.iter().filter(|&&m| m > 0.0).count(), 1);
            }
        }
    }

    #[test]
    fn each_row_carries_its_sequences_staleness() {
        let mut stale = sequence(1, 3, 1.0);
        stale.staleness = 2;
        let seqs = [sequence(1, 1, 1.0), stale];
        let (batches, _) = micro_batches(&seqs, &Objective::Sft, 100, false);
        // Longest first: the stale sequence is row 0.
        assert_eq!(batches[0].row_staleness, [2, 0]);
    }

    #[test]
    fn budget_splits_batches() {
        let seqs: Vec<_> = (0..6).map(|_| sequence(2, 2, 1.0)).collect();
        let (batches, stats) = micro_batches(&seqs, &Objective::Sft, 8, false);
        assert_eq!(batches.len(), 3);
        assert!(batches.iter().all(|b| b.padded_tokens() <= 8));
        assert_eq!(stats.micro_batches, 3);
    }
}
