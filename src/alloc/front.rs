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

use arrayvec::ArrayVec;

use super::block::BlockId;
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
    pub(crate) fn bytes(&self) -> u64 {
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
/// writes it on every hit, so no other thread's data may share its lines. It knows its shard by
/// serial only: what gives blocks back to the shard is a `Shard` method (`shard.rs`) or the
/// thread that holds the cache with its shard's address (`thread.rs`).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct FrontCache {
    /// The shard's serial: a later shard at the same address is not this cache's.
    serial: u64,
    /// The shard's process: a forked child's copy of the cache gives back nothing (`process`).
    birth: Birth,
    state: Mutex<FrontState>,
}

impl FrontCache {
    /// An empty cache for the shard of serial `serial`, made in process `birth`.
    pub(crate) fn new(serial: u64, birth: Birth) -> Self {
        FrontCache {
            serial,
            birth,
            state: Mutex::new(FrontState {
                entries: ArrayVec::new(),
                bytes: 0,
                retired: false,
            }),
        }
    }

    /// Whether this is the cache of the shard of serial `serial` (serials are never reused).
    pub(crate) fn serves(&self, serial: u64) -> bool {
        self.serial == serial
    }

    /// Takes the newest block held for requests of size class `class`.
    #[inline]
    pub(crate) fn take(&self, class: NonZeroU32) -> Option<FrontEntry> {
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
    /// `taken` runs under the cache's lock once the entry is accepted and before any other thread
    /// can see it: what tells the world of the free (history, NVTX regions, the sanitizer) comes
    /// before a flush on another thread frees the block for good and another owner gets it
    /// (found by review: told after, a late free's record removed the next owner's region).
    pub(crate) fn keep(&self, entry: FrontEntry, limit: u64, taken: impl FnOnce()) -> bool {
        let mut st = self.state.lock();
        let room = st.entries.len() < FRONT_BLOCKS
            && st
                .bytes
                .checked_add(entry.bytes())
                .is_some_and(|b| b <= limit);
        if st.retired || !room || st.entries.is_full() {
            return false;
        }
        taken();
        st.entries.push(entry);
        st.bytes += entry.bytes();
        true
    }

    /// Takes every held block, for the caller to give back to the shard (`retire`: and accepts
    /// none again). A forked child's copy gives nothing: the parent's blocks are the parent's.
    pub(crate) fn take_all(&self, retire: bool) -> ArrayVec<FrontEntry, FRONT_BLOCKS> {
        if !self.birth.is_current() {
            return ArrayVec::new();
        }
        let mut st = self.state.lock();
        st.retired |= retire;
        st.bytes = 0;
        std::mem::take(&mut st.entries)
    }

    /// Whether the cache was retired and holds nothing (safe to forget).
    pub(crate) fn is_retired(&self) -> bool {
        let st = self.state.lock();
        st.retired && st.entries.is_empty()
    }

    /// Calls `f` with the held blocks, under this cache's lock (statistics: the shard's lock is
    /// taken inside it, the only place both are held, always in this order).
    pub(crate) fn with_entries(&self, f: impl FnOnce(&[FrontEntry])) {
        let st = self.state.lock();
        if !st.entries.is_empty() {
            f(&st.entries);
        }
    }
}

/// A shard's front caches, one per thread that freed into it (`Shard::register_front` and the
/// other front-cache helpers of `shard.rs` use it under the shard's `fronts` lock).
#[derive(Debug, Default)]
pub(crate) struct FrontRegistry {
    pub caches: Vec<Arc<FrontCache>>,
    /// The allocator is going away: no new cache may start.
    pub closed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_cover_requests_up_to_two_tebibytes() {
        assert_eq!(class_of(512).map(NonZeroU32::get), Some(1));
        assert_eq!(class_of(64 << 20).map(NonZeroU32::get), Some(131_072));
        assert!(class_of((1 << 41) - 512).is_some());
        assert!(class_of(1 << 41).is_none());
        assert!(class_of(0).is_none());
    }
}
