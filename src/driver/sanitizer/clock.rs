//! Vector clocks: one counter per actor (a stream, or the writes of another process before its
//! event), the happens-before order of the sanitizer.
//!
//! A clock `C` *knows* the access `(actor, epoch)` when `C[actor] ≥ epoch`: everything that actor
//! did up to that epoch is ordered before whatever carries `C`.

/// A vector clock over actor slots (missing entries are 0).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VectorClock(Vec<u64>);

impl VectorClock {
    /// The clock's entry for `slot`.
    pub(super) fn get(&self, slot: usize) -> u64 {
        self.0.get(slot).copied().unwrap_or(0)
    }

    /// Sets the entry of `slot` to at least `epoch`.
    pub(super) fn raise(&mut self, slot: usize, epoch: u64) {
        if self.0.len() <= slot {
            self.0.resize(slot + 1, 0);
        }
        if self.0[slot] < epoch {
            self.0[slot] = epoch;
        }
    }

    /// Advances `slot`'s own entry and returns the new epoch.
    pub(super) fn tick(&mut self, slot: usize) -> u64 {
        let next = self.get(slot) + 1;
        self.raise(slot, next);
        next
    }

    /// Joins `other` into this clock (entry-wise maximum).
    pub(super) fn join(&mut self, other: &VectorClock) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (mine, &theirs) in self.0.iter_mut().zip(&other.0) {
            *mine = (*mine).max(theirs);
        }
    }

    /// Whether the access `(slot, epoch)` is ordered before whatever carries this clock.
    pub(super) fn knows(&self, slot: usize, epoch: u64) -> bool {
        self.get(slot) >= epoch
    }
}

#[cfg(test)]
mod tests {
    use super::VectorClock;

    #[test]
    fn join_is_an_entrywise_maximum_and_knows_compares_one_entry() {
        let mut a = VectorClock::default();
        assert_eq!(a.tick(0), 1);
        assert_eq!(a.tick(0), 2);
        let mut b = VectorClock::default();
        b.tick(3);
        assert!(!b.knows(0, 1));
        b.join(&a);
        assert!(b.knows(0, 2) && !b.knows(0, 3) && b.knows(3, 1));
        a.raise(1, 7);
        a.raise(1, 2);
        assert_eq!(a.get(1), 7);
        assert_eq!(a.get(9), 0);
    }
}
