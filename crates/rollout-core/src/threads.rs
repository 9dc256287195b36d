//! CPU threads for processes that compute at the same time on one machine: torch left to
//! itself gives every process one thread per core, and processes computing at once then
//! slow each other down many times over (docs/distributed.md).

use std::num::NonZeroUsize;

/// The environment variable torch (through OpenMP) reads its thread count from at start.
pub const THREADS_VARIABLE: &str = "OMP_NUM_THREADS";

/// The cores this process may run on (its CPU affinity and quota); 1 if unknown.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
}

/// Whether this process's environment sets torch's threads (which its children inherit).
pub fn set_in_environment() -> bool {
    std::env::var_os(THREADS_VARIABLE).is_some()
}

/// `cores` shared by `processes` computing at once: at least one thread each.
pub fn share(cores: usize, processes: usize) -> usize {
    (cores / processes.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn each_process_gets_its_share_and_at_least_one() {
        assert_eq!(share(16, 4), 4);
        assert_eq!(share(16, 3), 5);
        assert_eq!(share(2, 3), 1);
        assert_eq!(share(2, 0), 2);
        assert_eq!(share(0, 2), 1);
    }
}
