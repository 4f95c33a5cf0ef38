//! A free pool: the free blocks of one size class of one shard, ordered for best fit.
//!
//! Keys are `(size, address, block id)`, so the first key at or above `(request, 0, 0)` is the
//! smallest block that fits, lowest address on ties.
//!
//! Representation: a sorted `Vec` while the pool is small (the common case: a handful of cached
//! blocks per stream), a `BTreeSet` once it grows past [`TO_TREE`] entries, and back below
//! [`TO_VEC`]. Profiling the cached alloc/free pair showed the B-tree's insert/remove at ~30 % of
//! the pair; a binary search plus a short `memmove` over a few dozen 24-byte keys is cheaper and
//! allocation-free, while the tree keeps fragmented pools (thousands of blocks) logarithmic.

use std::collections::BTreeSet;

use super::block::FreeKey;

/// Grow into a tree above this many entries.
const TO_TREE: usize = 64;
/// Shrink back into a vector below this many entries (hysteresis).
const TO_VEC: usize = 16;

#[derive(Debug)]
enum Repr {
    Sorted(Vec<FreeKey>),
    Tree(BTreeSet<FreeKey>),
}

/// The free blocks of one pool.
#[derive(Debug)]
pub(crate) struct FreePool {
    repr: Repr,
}

impl Default for FreePool {
    fn default() -> Self {
        FreePool {
            repr: Repr::Sorted(Vec::with_capacity(8)),
        }
    }
}

impl FreePool {
    /// Adds a free block.
    #[inline]
    pub fn insert(&mut self, key: FreeKey) {
        match &mut self.repr {
            Repr::Sorted(v) => {
                if let Err(at) = v.binary_search(&key) {
                    v.insert(at, key);
                }
                if v.len() > TO_TREE {
                    self.repr = Repr::Tree(v.drain(..).collect());
                }
            }
            Repr::Tree(t) => {
                t.insert(key);
            }
        }
    }

    /// Removes a free block; false if it was not there.
    #[inline]
    pub fn remove(&mut self, key: &FreeKey) -> bool {
        match &mut self.repr {
            Repr::Sorted(v) => match v.binary_search(key) {
                Ok(at) => {
                    v.remove(at);
                    true
                }
                Err(_) => false,
            },
            Repr::Tree(t) => {
                let removed = t.remove(key);
                if t.len() < TO_VEC {
                    let mut v = Vec::with_capacity(TO_TREE + 1);
                    v.extend(t.iter().copied());
                    self.repr = Repr::Sorted(v);
                }
                removed
            }
        }
    }

    /// The smallest block of at least `size` bytes (lowest address on ties).
    #[inline]
    pub fn best_fit(&self, size: u64) -> Option<FreeKey> {
        match &self.repr {
            Repr::Sorted(v) => v.get(v.partition_point(|k| k.0 < size)).copied(),
            Repr::Tree(t) => t.range((size, 0, 0)..).next().copied(),
        }
    }

    /// Every free block, smallest first.
    pub fn iter(&self) -> Box<dyn Iterator<Item = &FreeKey> + '_> {
        match &self.repr {
            Repr::Sorted(v) => Box::new(v.iter()),
            Repr::Tree(t) => Box::new(t.iter()),
        }
    }

    /// Number of free blocks.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Sorted(v) => v.len(),
            Repr::Tree(t) => t.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_is_smallest_then_lowest_address() {
        let mut p = FreePool::default();
        assert_eq!(p.best_fit(1), None);
        p.insert((4096, 0x3000, 1));
        p.insert((4096, 0x1000, 2));
        p.insert((8192, 0x0, 3));
        assert_eq!(p.best_fit(100), Some((4096, 0x1000, 2)));
        assert_eq!(p.best_fit(4097), Some((8192, 0x0, 3)));
        assert_eq!(p.best_fit(8193), None);
        assert_eq!(p.best_fit(u64::MAX), None);
        assert!(p.remove(&(4096, 0x1000, 2)));
        assert!(!p.remove(&(4096, 0x1000, 2)));
        assert_eq!(p.len(), 2);
        assert_eq!(p.iter().count(), 2);
    }
}

#[cfg(test)]
mod switch_tests {
    use super::*;

    #[test]
    fn both_representations_agree_across_switches() {
        let mut p = FreePool::default();
        let mut model = BTreeSet::new();
        for i in 0..200u64 {
            let key = (512 * (1 + (i * 7919) % 50), 0x1000 * i, i as usize);
            p.insert(key);
            model.insert(key);
            let probe = 512 * (1 + (i * 31) % 60);
            assert_eq!(
                p.best_fit(probe),
                model.range((probe, 0, 0)..).next().copied()
            );
        }
        assert!(matches!(p.repr, Repr::Tree(_)));
        for i in (0..200u64).step_by(2).chain((1..200u64).step_by(2)) {
            let key = (512 * (1 + (i * 7919) % 50), 0x1000 * i, i as usize);
            assert!(p.remove(&key));
            model.remove(&key);
            assert_eq!(p.len(), model.len());
            assert_eq!(
                p.best_fit(4096),
                model.range((4096, 0, 0)..).next().copied()
            );
        }
        assert!(matches!(p.repr, Repr::Sorted(_)));
    }
}
