//! A free pool: the free blocks of one size class of one shard, ordered for best fit.
//!
//! Entries are ordered by `(size, address)` — unique within a shard, since free blocks never
//! overlap — so the first entry at or above `(request, 0)` is the smallest block that fits, lowest
//! address on ties (PyTorch's order). The pair is packed into one `u128` (size in the high half), so
//! every comparison is one 128-bit compare; the block id rides along.
//!
//! Representation: a sorted array held inline while the pool is small (the common case: a handful
//! of cached blocks per stream), a `BTreeMap` once it would grow past [`TO_TREE`] entries, and back
//! below [`TO_VEC`]. Inline, because the pool is written on every allocation and free: a heap
//! buffer could share a cache line with another shard's (wherever the heap put them), the
//! shard's own 128-byte alignment does not reach it. Inserting and removing shift the tail by
//! hand: for a few entries that is a handful of moves where a `memmove` call costs more than the
//! move. The tree keeps fragmented pools (thousands of blocks) logarithmic; its nodes are only
//! reached by pools that large.

use std::collections::BTreeMap;

use arrayvec::ArrayVec;

use super::block::{BlockId, FreeKey};

/// Grow into a tree beyond this many entries.
const TO_TREE: usize = 64;
/// Shrink back into a vector below this many entries (hysteresis).
const TO_VEC: usize = 16;

/// `(size, address)` packed so that integer order is best-fit order.
#[inline]
fn pack(size: u64, ptr: u64) -> u128 {
    (u128::from(size) << 64) | u128::from(ptr)
}

#[inline]
fn unpack(key: u128, id: BlockId) -> FreeKey {
    ((key >> 64) as u64, key as u64, id)
}

// The inline array is the point (see the module docs): boxing it would put it back on the heap.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Repr {
    Sorted(ArrayVec<(u128, BlockId), TO_TREE>),
    Tree(BTreeMap<u128, BlockId>),
}

/// The free blocks of one pool.
#[derive(Debug)]
pub(crate) struct FreePool {
    repr: Repr,
}

impl Default for FreePool {
    fn default() -> Self {
        FreePool {
            repr: Repr::Sorted(ArrayVec::new()),
        }
    }
}

/// Index of the first entry whose key is not below `key`.
#[inline]
fn lower_bound(v: &[(u128, BlockId)], key: u128) -> usize {
    v.partition_point(|e| e.0 < key)
}

impl FreePool {
    /// Adds free block `id` of `size` bytes at `ptr`.
    #[inline]
    pub(super) fn insert(&mut self, size: u64, ptr: u64, id: BlockId) {
        let key = pack(size, ptr);
        match &mut self.repr {
            Repr::Sorted(v) => {
                let at = lower_bound(v, key);
                if v.get(at).is_some_and(|e| e.0 == key) {
                    return;
                }
                if v.is_full() {
                    let mut tree: BTreeMap<u128, BlockId> = v.drain(..).collect();
                    tree.insert(key, id);
                    self.repr = Repr::Tree(tree);
                    return;
                }
                // Shift the tail up by one by hand (see the module docs).
                v.push((key, id));
                let mut i = v.len() - 1;
                while i > at {
                    v[i] = v[i - 1];
                    i -= 1;
                }
                v[at] = (key, id);
            }
            Repr::Tree(t) => {
                t.insert(key, id);
            }
        }
    }

    /// Removes the free block of `size` bytes at `ptr`; false if it was not there.
    #[inline]
    pub(super) fn remove(&mut self, size: u64, ptr: u64) -> bool {
        let key = pack(size, ptr);
        match &mut self.repr {
            Repr::Sorted(v) => {
                let at = lower_bound(v, key);
                if v.get(at).is_none_or(|e| e.0 != key) {
                    return false;
                }
                for i in at..v.len() - 1 {
                    v[i] = v[i + 1];
                }
                v.pop();
                true
            }
            Repr::Tree(t) => {
                let removed = t.remove(&key).is_some();
                if t.len() < TO_VEC {
                    self.repr = Repr::Sorted(t.iter().map(|(&k, &id)| (k, id)).collect());
                }
                removed
            }
        }
    }

    /// The smallest block of at least `size` bytes (lowest address on ties).
    #[inline]
    pub(super) fn best_fit(&self, size: u64) -> Option<FreeKey> {
        let key = pack(size, 0);
        match &self.repr {
            Repr::Sorted(v) => v.get(lower_bound(v, key)).map(|&(k, id)| unpack(k, id)),
            Repr::Tree(t) => t.range(key..).next().map(|(&k, &id)| unpack(k, id)),
        }
    }

    /// Takes the best fit for `size` out of the pool if `accept` (given the block's size) agrees:
    /// [`Self::best_fit`] and [`Self::remove`] with one search.
    #[inline]
    pub(super) fn take_best_fit(
        &mut self,
        size: u64,
        accept: impl FnOnce(u64) -> bool,
    ) -> Option<FreeKey> {
        let key = pack(size, 0);
        match &mut self.repr {
            Repr::Sorted(v) => {
                let at = lower_bound(v, key);
                let (found, id) = *v.get(at)?;
                let found = unpack(found, id);
                if !accept(found.0) {
                    return None;
                }
                for i in at..v.len() - 1 {
                    v[i] = v[i + 1];
                }
                v.pop();
                Some(found)
            }
            Repr::Tree(_) => {
                let found = self.best_fit(size)?;
                if !accept(found.0) {
                    return None;
                }
                self.remove(found.0, found.1);
                Some(found)
            }
        }
    }

    /// Every free block, smallest first.
    pub(super) fn iter(&self) -> Box<dyn Iterator<Item = FreeKey> + '_> {
        match &self.repr {
            Repr::Sorted(v) => Box::new(v.iter().map(|&(k, id)| unpack(k, id))),
            Repr::Tree(t) => Box::new(t.iter().map(|(&k, &id)| unpack(k, id))),
        }
    }

    /// Number of free blocks.
    pub(super) fn len(&self) -> usize {
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
        p.insert(4096, 0x3000, 1);
        p.insert(4096, 0x1000, 2);
        p.insert(8192, 0x0, 3);
        assert_eq!(p.best_fit(100), Some((4096, 0x1000, 2)));
        assert_eq!(p.best_fit(4097), Some((8192, 0x0, 3)));
        assert_eq!(p.best_fit(8193), None);
        assert_eq!(p.best_fit(u64::MAX), None);
        assert!(p.remove(4096, 0x1000));
        assert!(!p.remove(4096, 0x1000));
        assert_eq!(p.len(), 2);
        assert_eq!(p.iter().count(), 2);
    }
}

#[cfg(test)]
mod switch_tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn both_representations_agree_across_switches() {
        let mut p = FreePool::default();
        let mut model = BTreeSet::new();
        for i in 0..200u64 {
            let key = (512 * (1 + (i * 7919) % 50), 0x1000 * i, i as usize);
            p.insert(key.0, key.1, key.2);
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
            assert!(p.remove(key.0, key.1));
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
