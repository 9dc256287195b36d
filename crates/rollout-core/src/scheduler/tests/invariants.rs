//! The scheduler's bookkeeping, recounted from scratch.

use crate::scheduler::Scheduler;

impl Scheduler {
    /// Checks the cache bookkeeping against the sequences' block tables.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut holders = vec![0u32; self.pool.num_blocks()];
        let mut live = 0;
        for seq in self.seqs.iter() {
            live += 1;
            seq.blocks.iter().for_each(|&b| holders[b as usize] += 1);
            if !seq.running && !seq.blocks.is_empty() {
                return Err("a waiting sequence holds blocks".into());
            }
            let block_size = self.config.block_size;
            if seq.computed > seq.tokens.len() || seq.blocks.len() * block_size < seq.computed {
                return Err(format!(
                    "computed {} of {} tokens",
                    seq.computed,
                    seq.tokens.len()
                ));
            }
            for (i, &block) in seq.blocks.iter().enumerate() {
                // Between steps, exactly the computed positions hold keys and values (the
                // largest count among the holders of a shared block).
                let computed = seq.computed.saturating_sub(i * block_size).min(block_size);
                let fill = self.pool.fill(block);
                if fill < computed
                    || (self.in_flight.is_none()
                        && fill > computed
                        && self.pool.refcount(block) == 1)
                {
                    return Err(format!(
                        "block {block} has fill {fill}, {computed} computed"
                    ));
                }
                let hash = self.pool.hash_of(block);
                if hash.is_some() && (i >= seq.hashes.len() || hash != Some(seq.hashes[i])) {
                    return Err(format!("block {i} of a sequence caches another prefix"));
                }
            }
        }
        if live != self.running.len() + self.waiting.len() {
            return Err(format!(
                "{live} live sequences, {} running and {} waiting",
                self.running.len(),
                self.waiting.len()
            ));
        }
        if self
            .running
            .iter()
            .any(|&id| !self.seqs.get(id).is_some_and(|s| s.running))
        {
            return Err("the running queue holds a sequence that is not running".into());
        }
        self.pool.check(&holders)
    }
}
