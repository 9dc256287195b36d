//! The torch threads of the role processes `rollout launch` starts on this machine when the
//! policy leaves the count to torch (no `torch_threads` option) and `OMP_NUM_THREADS` is not
//! set: torch would give each process one thread per core, and processes computing at the
//! same time would then each run as many threads as there are cores. On 2 cores,
//! `configs/distributed.toml` without `torch_threads` took 1.0-1.5 s per step against
//! 0.15-0.17 s with one thread each.

use rollout_core::config::Config;
use rollout_core::threads::{available_cores, set_in_environment, share};

/// `OMP_NUM_THREADS` of each generation worker and each trainer rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadShares {
    pub worker: usize,
    pub trainer: usize,
}

impl ThreadShares {
    /// This machine's `cores` shared by the processes that compute at the same time: with
    /// `overlapping` (`max_staleness` above 0) the workers and the trainer ranks together,
    /// otherwise the workers while they generate, then the ranks while they train.
    pub fn of(cores: usize, workers: usize, trainers: usize, overlapping: bool) -> Self {
        if overlapping {
            let each = share(cores, workers + trainers);
            Self {
                worker: each,
                trainer: each,
            }
        } else {
            Self {
                worker: share(cores, workers),
                trainer: share(cores, trainers),
            }
        }
    }

    /// The shares for `config`'s local roles, unless the policy or the environment sets
    /// torch's threads.
    pub fn for_local_roles(config: &Config) -> Option<Self> {
        if config.policy.torch_threads().is_some() || set_in_environment() {
            return None;
        }
        let cores = available_cores();
        let cluster = &config.cluster;
        let shares = Self::of(
            cores,
            cluster.workers as usize,
            cluster.trainers as usize,
            cluster.max_staleness > 0,
        );
        tracing::info!(
            "torch threads per process: {} for each generation worker, {} for each trainer \
             rank, this machine's {cores} cores shared (set the policy's `torch_threads` or \
             OMP_NUM_THREADS to choose)",
            shares.worker,
            shares.trainer
        );
        Some(shares)
    }
}

#[cfg(test)]
mod tests {
    use super::ThreadShares;

    #[test]
    fn processes_computing_at_once_share_the_cores() {
        let shares = |cores, workers, trainers, overlapping| {
            let ThreadShares { worker, trainer } =
                ThreadShares::of(cores, workers, trainers, overlapping);
            (worker, trainer)
        };
        // configs/distributed.toml's two workers and two ranks, overlapping, on 2 cores.
        assert_eq!(shares(2, 2, 2, true), (1, 1));
        assert_eq!(shares(16, 2, 2, true), (4, 4));
        assert_eq!(shares(16, 3, 1, true), (4, 4));
        // Synchronous: the workers generate, then the ranks train, each phase on every core.
        assert_eq!(shares(16, 2, 1, false), (8, 16));
        assert_eq!(shares(2, 1, 1, false), (2, 2));
        // Never below one thread, whatever the counts.
        assert_eq!(shares(2, 4, 2, true), (1, 1));
        assert_eq!(shares(1, 0, 0, false), (1, 1));
    }
}
