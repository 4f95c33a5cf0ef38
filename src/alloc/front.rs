//! Thread front caches (`thread_cache_mb`; off by default): a thread keeps blocks it freed, per
//! (allocator, stream), and gives them back to its own next allocations of the same size without
//! taking the stream's lock.
//!
//! **Why.** A stream's blocks, pools and statistics live under one lock (`shard.rs`). Threads on
//! their own streams never meet, but two threads on one stream — a library that launches
//! everything on the default stream — pass that lock's cache line back and forth on every
//! allocation and free: two threads do 0.7–0.8× the work of one (`docs/benchmarks.md`). PyTorch's exact reuse order
//! (the smallest free block that fits, lowest address first, over all of the stream's free blocks)
//! needs that one shared view, so it cannot scale; a per-thread cache can.
//!
//! **The deviation (why it is a setting).** A block in a thread's front cache is seen by no one
//! else: another thread's allocation of that size on that stream takes a block from the stream's
//! pools (or new memory) instead, and the block does not merge with its free neighbours until the
//! cache gives it back. Memory held this way is bounded — `thread_cache_mb` bytes (counted by the
//! rounded sizes of the requests the blocks served) and [`FRONT_BLOCKS`] blocks per thread and
//! stream — and given back whenever memory is short (the
//! out-of-memory sequence's "free every cached segment" step), on `empty_cache`, when the thread
//! exits, and when the allocator is dropped.
//!
//! **Statistics.** For the shard a cached block is still handed out (its lock never saw the free);
//! the reported statistics subtract what front caches hold, so `allocated_bytes`, `allocation`,
//! `active`, `active_bytes` and `requested_bytes` currents are what the program holds. Peaks are
//! the shard's, which counted cached blocks as allocated: with the cache on they are upper bounds.
//! A block reused from a front cache keeps the requested size of the allocation that took it from
//! the shard (the same rounded size; it differs from the new request by less than the rounding).
//! `allocated`/`freed` totals count trips to the shard, not front-cache hits.
//!
//! | event | front cache (under its own lock) | the stream's shard |
//! |---|---|---|
//! | free of an eligible block (no other stream recorded, cache not retired, room left) | entry pushed | nothing: the block stays handed out, its owner still counted |
//! | allocation of the same size class (rounded size / 512) on this thread and stream | newest such entry popped | nothing |
//! | flush: out of memory, `empty_cache` | every entry taken | each block freed as usual (merges, stats) |
//! | retire: thread exit, allocator drop | every entry taken; no entry accepted again | each block freed as usual |
//! | statistics read | entries read, then the shard's lock taken inside the cache's | the blocks' sizes and requested bytes read there and subtracted from the currents |
//!
//! The cache's lock is taken by its own thread on the hot path (uncontended: its cache line stays
//! in that core) and by other threads only to flush, retire or read statistics — the lock makes
//! those safe against a concurrent push, so a retired cache can never strand a block. A shard's
//! registry of caches is closed (under its lock) before the allocator retires them, so no cache
//! can start after the last retire; a `DataPtr` freed after its allocator is gone goes straight
//! to its (orphaned) shard. Lock order: registry → cache → shard state, never the reverse.
//!
//! A hit costs the thread-local lookups, the size rounding and two uncontended atomics (the
//! cache's lock): ≈ 330 instructions per pair against ≈ 1,185 through the shard, 37–39 ns in the
//! criterion pair at every size (`docs/benchmarks.md`).

use std::num::NonZeroU32;
use std::ptr::NonNull;

use arrayvec::ArrayVec;

use super::block::BlockId;
use super::shard::Shard;
use super::stats::{self, DeviceStats};
use crate::process::Birth;
use crate::sync::os::{Arc, Mutex};

/// Most blocks a front cache holds.
pub(crate) const FRONT_BLOCKS: usize = 32;

/// Granule of size classes: every rounded size is a multiple of it.
const CLASS_BYTES: u64 = super::size::MIN_BLOCK_SIZE;

/// The size class of a rounded request: its size in 512-byte units, when that fits in 32 bits
/// (requests up to 2 TiB); larger requests never use front caches.
#[inline]
pub(crate) fn class_of(rounded: u64) -> Option<NonZeroU32> {
    u32::try_from(rounded / CLASS_BYTES)
        .ok()
        .and_then(NonZeroU32::new)
}

/// A block held by a front cache: enough to hand it out again without the shard. Its size and
/// requested bytes stay in the shard (read under the shard's lock when statistics are taken).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FrontEntry {
    pub block: BlockId,
    pub ptr: u64,
    /// Size class of the request the block was handed out for ([`class_of`]).
    pub class: NonZeroU32,
}

impl FrontEntry {
    /// The rounded size of the request the block served.
    pub fn bytes(&self) -> u64 {
        u64::from(self.class.get()) * CLASS_BYTES
    }
}

#[derive(Debug)]
struct FrontState {
    /// Oldest first; a hit takes the newest entry of its class. Inline (not a heap buffer), so
    /// that two threads' caches never share a cache line.
    entries: ArrayVec<FrontEntry, FRONT_BLOCKS>,
    bytes: u64,
    retired: bool,
}

/// One thread's front cache for one shard. Aligned to 128 bytes like shards: its owner thread
/// writes it on every hit, so no other thread's data may share its lines.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct FrontCache {
    shard: NonNull<Shard>,
    /// The shard's serial: a later shard at the same address is not this cache's.
    serial: u64,
    /// The shard's process: a forked child's copy of the cache flushes nothing (`process`).
    birth: Birth,
    state: Mutex<FrontState>,
}

// SAFETY: the shard pointer is only dereferenced to free the blocks this cache holds, which keep
// the shard alive (they are counted among its owners); the state is behind a lock.
unsafe impl Send for FrontCache {}
// SAFETY: as for `Send`; every access to the entries takes the lock.
unsafe impl Sync for FrontCache {}

impl FrontCache {
    /// An empty cache for `shard`.
    pub fn new(shard: &Shard) -> Self {
        FrontCache {
            shard: NonNull::from(shard),
            serial: shard.serial,
            birth: shard.birth,
            state: Mutex::new(FrontState {
                entries: ArrayVec::new(),
                bytes: 0,
                retired: false,
            }),
        }
    }

    /// Whether this is the cache of `shard`.
    pub fn serves(&self, shard: &Shard) -> bool {
        std::ptr::eq(self.shard.as_ptr(), shard) && self.serial == shard.serial
    }

    /// Takes the newest block held for requests of size class `class`.
    #[inline]
    pub fn take(&self, class: NonZeroU32) -> Option<FrontEntry> {
        let mut st = self.state.lock();
        let at = st.entries.iter().rposition(|e| e.class == class)?;
        // Usually the newest entry (a free, then an allocation of the same size): a pop.
        let entry = if at + 1 == st.entries.len() {
            st.entries.pop()?
        } else {
            st.entries.remove(at)
        };
        st.bytes -= entry.bytes();
        Some(entry)
    }

    /// Keeps `entry` if the cache is open and has room within `limit` bytes (counted by the
    /// rounded sizes of the requests the blocks served).
    #[inline]
    pub fn keep(&self, entry: FrontEntry, limit: u64) -> bool {
        let mut st = self.state.lock();
        let room = st.entries.len() < FRONT_BLOCKS
            && st
                .bytes
                .checked_add(entry.bytes())
                .is_some_and(|b| b <= limit);
        if st.retired || !room {
            return false;
        }
        if st.entries.try_push(entry).is_err() {
            return false;
        }
        st.bytes += entry.bytes();
        true
    }

    /// Gives every held block back to the shard (`retire`: and accepts none again).
    pub fn flush(&self, retire: bool) {
        if !self.birth.is_current() {
            return;
        }
        let entries = {
            let mut st = self.state.lock();
            st.retired |= retire;
            st.bytes = 0;
            std::mem::take(&mut st.entries)
        };
        for e in entries {
            // SAFETY: the block was handed out by this shard and is still counted among its
            // owners (the cache took it over from its `BlockOwner`), so the shard is alive, and
            // the block is freed exactly once: it was just taken out of the cache.
            unsafe { Shard::free_and_release(self.shard, e.block) };
        }
    }

    /// Whether the cache was retired and holds nothing (safe to forget).
    pub fn is_retired(&self) -> bool {
        let st = self.state.lock();
        st.retired && st.entries.is_empty()
    }

    /// Subtracts the blocks held here from `stats` (see the module docs). Takes the shard's lock
    /// inside this cache's (the only place both are held, always in this order).
    pub fn hide_from(&self, stats: &mut DeviceStats, max_split_size: u64) {
        let st = self.state.lock();
        if st.entries.is_empty() {
            return;
        }
        // SAFETY: the held blocks are counted among the shard's owners, so it is alive.
        let shard = unsafe { self.shard.as_ref() };
        let blocks = &shard.state.lock().blocks;
        for e in &st.entries {
            let Some(b) = blocks.get(e.block) else {
                continue;
            };
            stats::hide(&mut stats.allocation, b.pool, 1);
            stats::hide(&mut stats.allocated_bytes, b.pool, b.size);
            stats::hide(&mut stats.active, b.pool, 1);
            stats::hide(&mut stats.active_bytes, b.pool, b.size);
            stats::hide(&mut stats.requested_bytes, b.pool, b.requested);
            if b.size >= max_split_size {
                stats.oversize_allocations.current -= 1;
            }
        }
    }
}

/// A shard's front caches, one per thread that freed into it.
#[derive(Debug, Default)]
pub(crate) struct FrontRegistry {
    caches: Vec<Arc<FrontCache>>,
    /// The allocator is going away: no new cache may start.
    closed: bool,
}

/// A new front cache for the calling thread on `shard`, registered with it; `None` once the
/// allocator is shutting down (checked under the registry's lock, which `retire_all` takes too, so
/// no cache can start after the last retire).
pub(crate) fn register(shard: &Shard) -> Option<Arc<FrontCache>> {
    let mut registry = shard.fronts.lock();
    if registry.closed {
        return None;
    }
    registry.caches.retain(|c| !c.is_retired());
    let cache = Arc::new(FrontCache::new(shard));
    registry.caches.push(Arc::clone(&cache));
    Some(cache)
}

/// Flushes every front cache of `shard` (out of memory, `empty_cache`).
pub(crate) fn flush_all(shard: &Shard) {
    let caches = shard.fronts.lock().caches.clone();
    for cache in caches {
        cache.flush(false);
    }
}

/// Closes `shard` to new front caches and retires every one it has (allocator drop).
pub(crate) fn retire_all(shard: &Shard) {
    let caches = {
        let mut registry = shard.fronts.lock();
        registry.closed = true;
        std::mem::take(&mut registry.caches)
    };
    for cache in caches {
        cache.flush(true);
    }
}

/// Subtracts what `shard`'s front caches hold from `stats`.
pub(crate) fn hide_all(shard: &Shard, stats: &mut DeviceStats, max_split_size: u64) {
    for cache in &shard.fronts.lock().caches {
        cache.hide_from(stats, max_split_size);
    }
}

#[cfg(test)]
mod layout_tests {
    //! The cache-line isolation and the 40-byte `DataPtr` that issue 14's figures rest on: a
    //! change that breaks either fails here, not in a noisy benchmark.
    use super::*;
    use crate::alloc::block::Block;
    use crate::alloc::{BlockOwner, DataPtr};

    #[test]
    fn hot_state_owns_its_cache_lines_and_a_data_ptr_stays_small() {
        assert!(std::mem::align_of::<Shard>() >= 128);
        assert!(std::mem::align_of::<FrontCache>() >= 128);
        assert_eq!(std::mem::align_of::<Block>(), 128);
        assert_eq!(std::mem::size_of::<Block>() % 128, 0);
        assert_eq!(std::mem::size_of::<BlockOwner>(), 16);
        assert_eq!(std::mem::size_of::<DataPtr>(), 40);
    }

    #[test]
    fn size_classes_cover_requests_up_to_two_tebibytes() {
        assert_eq!(class_of(512).map(NonZeroU32::get), Some(1));
        assert_eq!(class_of(64 << 20).map(NonZeroU32::get), Some(131_072));
        assert!(class_of((1 << 41) - 512).is_some());
        assert!(class_of(1 << 41).is_none());
        assert!(class_of(0).is_none());
    }
}
