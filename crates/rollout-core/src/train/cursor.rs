//! A seeded walk over the data: every epoch visits every record once in a shuffled order.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::state::DataPosition;
use crate::seeds::mix;

pub struct DataCursor {
    len: usize,
    seed: u64,
    shuffle: bool,
    position: DataPosition,
    order: Vec<usize>,
}

impl DataCursor {
    pub fn new(len: usize, seed: u64, shuffle: bool, position: DataPosition) -> Self {
        let mut cursor = DataCursor {
            len,
            seed,
            shuffle,
            position,
            order: Vec::new(),
        };
        cursor.order = cursor.epoch_order(position.epoch);
        cursor
    }

    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(mix(self.seed, epoch)));
        }
        order
    }

    pub fn position(&self) -> DataPosition {
        self.position
    }

    /// The next `count` record indices, continuing into the next epoch when one ends.
    pub fn take(&mut self, count: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(count);
        while out.len() < count && self.len > 0 {
            let offset = self.position.offset as usize;
            if offset >= self.len {
                self.position = DataPosition {
                    epoch: self.position.epoch + 1,
                    offset: 0,
                };
                self.order = self.epoch_order(self.position.epoch);
                continue;
            }
            out.push(self.order[offset]);
            self.position.offset += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_visits_every_record_once() {
        let mut cursor = DataCursor::new(10, 3, true, DataPosition::default());
        let mut first: Vec<usize> = cursor.take(10);
        let mut second: Vec<usize> = cursor.take(10);
        assert_ne!(first, second, "epochs should be shuffled differently");
        first.sort_unstable();
        second.sort_unstable();
        assert_eq!(first, (0..10).collect::<Vec<_>>());
        assert_eq!(second, (0..10).collect::<Vec<_>>());
        assert_eq!(
            cursor.position(),
            DataPosition {
                epoch: 1,
                offset: 10
            }
        );
    }

    #[test]
    fn resuming_from_a_position_continues_identically() {
        let mut straight = DataCursor::new(7, 11, true, DataPosition::default());
        straight.take(9);
        let saved = straight.position();
        let expected = straight.take(12);
        let mut resumed = DataCursor::new(7, 11, true, saved);
        assert_eq!(resumed.take(12), expected);
    }

    #[test]
    fn unshuffled_keeps_source_order() {
        let mut cursor = DataCursor::new(3, 0, false, DataPosition::default());
        assert_eq!(cursor.take(5), vec![0, 1, 2, 0, 1]);
    }
}
