//! A deterministic generator for the seeded suites (`interplay.rs`, `model_exits.rs`): a seed
//! replays the same choices.

use cudalloc::internals::pattern;

/// Splitmix over the pattern hash: `Rng(seed, start)` gives the words after `start`.
pub(crate) struct Rng(pub(crate) u64, pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.1 += 1;
        pattern::word(self.0, self.1)
    }

    /// A number below `n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// One of `from` (not empty).
    pub(crate) fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }
}
