//! Counters the engine reports.

/// Cache and scheduling statistics since the scheduler was created.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Steps planned.
    pub steps: u64,
    /// Blocks in the cache.
    pub blocks_total: usize,
    /// Blocks held by sequences now.
    pub blocks_used: usize,
    /// Most blocks held at once (measured at each plan).
    pub blocks_peak: usize,
    /// Blocks nobody holds that still cache a prefix (reusable by prefix caching).
    pub blocks_cached: usize,
    /// Mean over steps of the fraction of the whole cache holding a live token during the
    /// step's forward pass (shared slots counted once).
    pub kv_occupancy_mean: f64,
    /// Peak over steps of that fraction.
    pub kv_occupancy_peak: f64,
    /// Mean over steps of the fraction of the slots in blocks held by sequences that hold a
    /// live token: what paging leaves unwasted (internal fragmentation is the rest).
    pub kv_utilisation_mean: f64,
    /// Sequences preempted (their cache freed, to be recomputed).
    pub preemptions: u64,
    /// Prompt tokens taken from the prefix cache instead of being computed.
    pub prefix_cache_hit_tokens: u64,
    /// Prompt tokens of the requests added, once per request (not per sample).
    pub prompt_tokens_requested: u64,
    /// Prompt tokens fed to the model (shared prompts once per group, recomputation after
    /// preemption included, prefix-cache hits excluded).
    pub prompt_tokens_computed: u64,
    /// Generated tokens fed again to recompute a preempted sequence.
    pub recomputed_tokens: u64,
    /// Tokens emitted.
    pub generated_tokens: u64,
    /// Draft tokens proposed and verified.
    pub drafted_tokens: u64,
    /// Draft tokens accepted.
    pub accepted_tokens: u64,
    /// Query tokens fed to the model.
    pub query_tokens: u64,
}
