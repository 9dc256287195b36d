//! When a connection last delivered a frame, for health reports (`/metrics`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The wall-clock time of the last frame a connection delivered, heartbeats included. Cheap
/// to clone, and holding one does not keep the connection open.
#[derive(Debug, Clone)]
pub struct HeardClock(Arc<AtomicU64>);

impl HeardClock {
    /// A clock that heard its peer just now (a connection starts with its greeting).
    pub fn starting_now() -> Self {
        let clock = HeardClock(Arc::new(AtomicU64::new(0)));
        clock.heard();
        clock
    }

    /// Records a frame arriving now.
    pub fn heard(&self) {
        let millis = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        self.0.store(millis, Ordering::Relaxed);
    }

    /// Whether `other` is this clock (of the same connection), not just a clock that reads the
    /// same time.
    pub fn is(&self, other: &HeardClock) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// When the last frame arrived (to the millisecond).
    pub fn last(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_moves_forward_when_heard_and_is_shared_by_its_clones() {
        let clock = HeardClock::starting_now();
        let first = clock.last();
        assert!(SystemTime::now().duration_since(first).unwrap() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
        let copy = clock.clone();
        copy.heard();
        assert!(clock.last() > first);
        assert!(clock.is(&copy) && !clock.is(&HeardClock::starting_now()));
    }
}
