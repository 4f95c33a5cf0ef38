//! One (device, stream) shard: [`Shard`] (its lock, its stream, its device) and the state under
//! that lock. The state of one shard — the blocks, free pools, segments, pending frees and stats of one
//! (device, stream) — and every operation on it. All methods run under the shard's lock and never
//! call the driver except through the closures they are given, so the locking policy lives in one
//! place (`device.rs`).
//!
//! Pending frees (`record_stream`): a block freed while other streams used it becomes `PendingFree`
//! and one event per using stream is recorded; the events queue per using stream, in order. They
//! are polled lazily ([`ShardState::complete_events`]) before each allocation of the shard, and
//! waited for in `empty_cache` and the last out-of-memory step.
//!
//! **Lifetime without reference counts on the hot path** (issue 14). A `BlockOwner` (inside a
//! `DataPtr`) points at its shard with a plain pointer; the shard counts its handed-out blocks in
//! `ShardState::owners`, under the lock that allocation and free take anyway. Thread caches of
//! shard pointers are keyed by never-reused allocator ids (`thread.rs`). Shards are 128-byte
//! aligned, so two shards' locks and hot state never share a cache line.
//!
//! | shard state | kept alive by | next |
//! |---|---|---|
//! | live | its device's map (one `Arc`), for the allocator's whole life | allocator drop: front caches retired, cache emptied, then [`Shard::orphan`] |
//! | dropped at once | — | when `owners == 0` at the allocator's drop |
//! | orphaned | one leaked `Arc` (`orphaned = true`) | the free that brings `owners` to 0 clears the flag (under the lock, so exactly once) and gives the reference back ([`Shard::free_and_release`]); `Drop` returns the segments |

use std::collections::{BTreeMap, HashMap, VecDeque};

use slab::Slab;

use super::block::{Block, BlockId, BlockState, SegmentInfo};
use super::device::DeviceCore;
use super::history::TraceAction;
use super::pool::FreePool;
use super::size::{self, PoolKind};
use super::stats::{self, DeviceStats};
use crate::config::AllocatorConfig;
use crate::driver::{EventId, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::{Arc, Mutex};

/// One (device, stream) shard. Aligned to 128 bytes (two cache lines: the adjacent-line
/// prefetcher pairs them) so that two shards' locks and hot state never share a line, wherever the
/// heap puts them.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Shard {
    pub stream: StreamId,
    /// Unique in the process, never reused: tells this shard from a later one at the same address
    /// (thread-local caches compare it; `thread.rs`).
    pub serial: u64,
    /// `thread_cache_mb` in bytes (0: no front caches), next to the lock the free path takes.
    pub front_limit: u64,
    /// The process the allocator belongs to, next to the hot fields: a forked child's frees
    /// release nothing (`process`).
    pub birth: Birth,
    /// The stream sanitizer (when on), next to the hot fields: told of hand-outs and frees.
    pub sanitizer: Option<Arc<crate::driver::Sanitizer>>,
    pub state: Mutex<ShardState>,
    pub core: Arc<DeviceCore>,
    /// Every thread's front cache of this shard (`front.rs`; empty unless `thread_cache_mb`).
    pub fronts: Mutex<super::front::FrontRegistry>,
}

/// The mutable state of one shard.
#[derive(Debug, Default)]
pub(crate) struct ShardState {
    /// The shard's serial ([`Shard::serial`]), for what knows only the state (`peaks.rs`).
    pub serial: u64,
    pub blocks: Slab<Block>,
    pub free_small: FreePool,
    pub free_large: FreePool,
    pub segments: BTreeMap<u64, SegmentInfo>,
    /// Pending-free events, per stream that used the blocks, oldest first.
    pub pending: HashMap<StreamId, VecDeque<(EventId, BlockId)>>,
    pub stats: DeviceStats,
    /// Allocations served so far (age clock of garbage collection).
    pub tick: u64,
    /// The pages of each expandable segment (at most one per pool), by base (`expandable.rs`).
    pub expandable: HashMap<u64, super::expandable::ExpandablePages>,
    /// A statistic went past its limit since the flag was last taken (`peaks.rs`).
    pub over_budget: bool,
    /// Blocks handed out and not yet released: each has a `BlockOwner` pointing at this shard.
    pub owners: u64,
    /// The allocator is gone while blocks were out: the last release drops the shard.
    pub orphaned: bool,
}

/// The order in which [`ShardState::take_free_segments`] visits candidate segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReleaseOrder {
    /// Least recently freed first (garbage collection).
    Oldest,
    /// Biggest first (oversize release when no single block suffices).
    Largest,
    /// Smallest first, lowest address on ties (the one oversize block that suffices).
    Smallest,
}

/// Whether a block of this size counts as oversize.
fn oversize(size: u64, config: &AllocatorConfig) -> bool {
    size >= config.max_split_size
}

impl ShardState {
    fn free_set(&mut self, pool: PoolKind) -> &mut FreePool {
        match pool {
            PoolKind::Small => &mut self.free_small,
            PoolKind::Large => &mut self.free_large,
        }
    }

    /// Adds (`add`) or removes a free block's contribution to the inactive-split stats.
    #[inline]
    fn account_inactive(&mut self, split: bool, pool: PoolKind, size: u64, add: bool) {
        if split {
            let s = &mut self.stats;
            if add {
                self.over_budget |= stats::increase(&mut s.inactive_split, pool, 1);
                self.over_budget |= stats::increase(&mut s.inactive_split_bytes, pool, size);
            } else {
                stats::decrease(&mut s.inactive_split, pool, 1);
                stats::decrease(&mut s.inactive_split_bytes, pool, size);
            }
        }
    }

    /// Every free block, small pool first.
    pub(super) fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free_small
            .iter()
            .chain(self.free_large.iter())
            .map(|(_, _, id)| id)
    }

    /// Puts free block `id` in its pool (and counts it as inactive if its segment is split).
    pub(super) fn insert_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        debug_assert_eq!(b.state, BlockState::Free);
        let (pool, size, ptr, split) = (b.pool, b.size, b.ptr, b.is_split());
        self.free_set(pool).insert(size, ptr, id);
        self.account_inactive(split, pool, size, true);
    }

    /// Takes free block `id` out of its pool.
    pub(super) fn remove_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        debug_assert_eq!(b.state, BlockState::Free);
        let (pool, size, ptr, split) = (b.pool, b.size, b.ptr, b.is_split());
        self.account_inactive(split, pool, size, false);
        let removed = self.free_set(pool).remove(size, ptr);
        debug_assert!(removed, "free block {id} missing from its pool");
    }

    /// Best fit in `pool` for a rounded request, under the oversize rules.
    pub fn find_fit(
        &self,
        pool: PoolKind,
        rounded: u64,
        config: &AllocatorConfig,
    ) -> Option<BlockId> {
        let set = match pool {
            PoolKind::Small => &self.free_small,
            PoolKind::Large => &self.free_large,
        };
        let (block_size, _, id) = set.best_fit(rounded)?;
        size::fits_oversize_rules(block_size, rounded, config).then_some(id)
    }

    /// Registers a new segment as one free block; returns it.
    pub fn add_segment(
        &mut self,
        ptr: u64,
        seg_size: u64,
        pool: PoolKind,
        config: &AllocatorConfig,
    ) -> BlockId {
        let id = self.blocks.insert(Block {
            ptr,
            size: seg_size,
            requested: 0,
            pool,
            state: BlockState::Free,
            prev: None,
            next: None,
            segment: ptr,
            stream_uses: Vec::new(),
            pending_events: 0,
            freed_at: self.tick,
        });
        self.segments.insert(
            ptr,
            SegmentInfo {
                size: seg_size,
                pool,
                head: id,
            },
        );
        let s = &mut self.stats;
        self.over_budget |= stats::increase(&mut s.segment, pool, 1);
        self.over_budget |= stats::increase(&mut s.reserved_bytes, pool, seg_size);
        s.num_device_alloc += 1;
        if oversize(seg_size, config) {
            self.over_budget |= s.oversize_segments.increase(1);
        }
        self.insert_free(id);
        id
    }

    /// Takes the best fit for a rounded request out of `pool` (under the oversize rules) and hands
    /// it out: [`Self::find_fit`] then [`Self::allocate`] with one search of the pool.
    #[inline]
    pub fn allocate_best_fit(
        &mut self,
        pool: PoolKind,
        rounded: u64,
        requested: u64,
        config: &AllocatorConfig,
    ) -> Option<BlockId> {
        let (found, _, id) = self.free_set(pool).take_best_fit(rounded, |found| {
            size::fits_oversize_rules(found, rounded, config)
        })?;
        let split = self.blocks[id].is_split();
        self.account_inactive(split, pool, found, false);
        Some(self.hand_out(id, rounded, requested, config))
    }

    /// Hands out free block `id` for a request (splitting off the remainder when the policy says
    /// so); returns the allocated block (the same id).
    pub fn allocate(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
        config: &AllocatorConfig,
    ) -> BlockId {
        self.remove_free(id);
        self.hand_out(id, rounded, requested, config)
    }

    /// [`Self::allocate`] of a block already taken out of its pool.
    #[inline]
    fn hand_out(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
        config: &AllocatorConfig,
    ) -> BlockId {
        let (pool, block_size) = (self.blocks[id].pool, self.blocks[id].size);
        if size::should_split(pool, block_size, rounded, config) {
            let rest = self.split_off(id, rounded, BlockState::Free);
            self.blocks[rest].freed_at = self.tick;
            self.insert_free(rest);
        }
        self.tick += 1;
        self.owners += 1;
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (size, pool) = (b.size, b.pool);
        let s = &mut self.stats;
        self.over_budget |= stats::increase(&mut s.allocation, pool, 1);
        self.over_budget |= stats::increase(&mut s.allocated_bytes, pool, size);
        self.over_budget |= stats::increase(&mut s.active, pool, 1);
        self.over_budget |= stats::increase(&mut s.active_bytes, pool, size);
        self.over_budget |= stats::increase(&mut s.requested_bytes, pool, requested);
        if oversize(size, config) {
            self.over_budget |= s.oversize_allocations.increase(1);
        }
        id
    }

    /// Allocated block `id`, handed out for a request of `rounded` bytes.
    #[inline]
    pub fn allocated(&self, id: BlockId, rounded: u64) -> super::device::Allocated {
        super::device::Allocated {
            block: id,
            ptr: self.blocks[id].ptr,
            rounded,
        }
    }

    /// Records that `stream` (not the shard's own) used allocated block `id`.
    pub fn record_use(&mut self, id: BlockId, stream: StreamId) {
        let uses = &mut self.blocks[id].stream_uses;
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// The caller dropped block `id`. Returns the streams that used it (events must be recorded on
    /// each, then [`Self::add_pending`]); when none, the block is free already.
    pub fn release(&mut self, id: BlockId, config: &AllocatorConfig) -> Vec<StreamId> {
        let b = &mut self.blocks[id];
        debug_assert_eq!(b.state, BlockState::Allocated);
        let (size, pool, requested) = (b.size, b.pool, b.requested);
        let uses = std::mem::take(&mut b.stream_uses);
        self.owners -= 1;
        let s = &mut self.stats;
        stats::decrease(&mut s.allocation, pool, 1);
        stats::decrease(&mut s.allocated_bytes, pool, size);
        stats::decrease(&mut s.requested_bytes, pool, requested);
        if oversize(size, config) {
            s.oversize_allocations.decrease(1);
        }
        if uses.is_empty() {
            self.finish_free(id);
        } else {
            self.blocks[id].state = BlockState::PendingFree;
        }
        uses
    }

    /// Queues `event` (recorded on `stream`) as one of the waits of pending block `id`.
    pub fn add_pending(&mut self, id: BlockId, stream: StreamId, event: EventId) {
        self.blocks[id].pending_events += 1;
        self.pending
            .entry(stream)
            .or_default()
            .push_back((event, id));
    }

    /// A pending block whose events could not all be recorded: wait is impossible, so the caller
    /// synchronized instead; the block is free now.
    pub fn finish_pending_without_events(&mut self, id: BlockId) {
        if self.blocks[id].pending_events == 0 {
            self.finish_free(id);
        }
    }

    /// Splits `len` bytes off the front of block `id`; the rest becomes a new block in `state`
    /// (not put in any pool), returned.
    pub(super) fn split_off(&mut self, id: BlockId, len: u64, state: BlockState) -> BlockId {
        let b = &self.blocks[id];
        let rest = Block {
            ptr: b.ptr + len,
            size: b.size - len,
            requested: 0,
            pool: b.pool,
            state,
            prev: Some(id),
            next: b.next,
            segment: b.segment,
            stream_uses: Vec::new(),
            pending_events: 0,
            freed_at: b.freed_at,
        };
        let rest_id = self.blocks.insert(rest);
        if let Some(next) = self.blocks[rest_id].next {
            self.blocks[next].prev = Some(rest_id);
        }
        let b = &mut self.blocks[id];
        b.next = Some(rest_id);
        b.size = len;
        rest_id
    }

    /// Makes block `id` free: merges it with free neighbours and returns it to its pool.
    fn finish_free(&mut self, id: BlockId) {
        {
            let b = &mut self.blocks[id];
            let (pool, size) = (b.pool, b.size);
            b.state = BlockState::Free;
            b.requested = 0;
            b.stream_uses.clear();
            b.freed_at = self.tick;
            stats::decrease(&mut self.stats.active, pool, 1);
            stats::decrease(&mut self.stats.active_bytes, pool, size);
        }
        self.merge_free(id);
    }

    /// Merges free block `id` (not yet in a pool) with free neighbours and puts the result in its
    /// pool.
    pub(super) fn merge_free(&mut self, id: BlockId) {
        let mut id = id;
        if let Some(prev) = self.blocks[id]
            .prev
            .filter(|&p| self.blocks[p].state == BlockState::Free)
        {
            self.remove_free(prev);
            let freed_at = self.blocks[id].freed_at;
            self.absorb_next(prev);
            self.blocks[prev].freed_at = freed_at;
            id = prev;
        }
        if let Some(next) = self.blocks[id]
            .next
            .filter(|&n| self.blocks[n].state == BlockState::Free)
        {
            self.remove_free(next);
            self.absorb_next(id);
        }
        self.insert_free(id);
    }

    /// Block `id` takes over the block after it.
    pub(super) fn absorb_next(&mut self, id: BlockId) {
        let Some(next) = self.blocks[id].next else {
            return;
        };
        let n = self.blocks.remove(next);
        let b = &mut self.blocks[id];
        b.size += n.size;
        b.next = n.next;
        if let Some(after) = n.next {
            self.blocks[after].prev = Some(id);
        }
    }

    /// Polls the pending events of every using stream in order; frees blocks whose last event
    /// completed. Returns the completed events (for reuse) and the (address, size) of each block
    /// that became free. A failing query stops that stream's queue (the blocks stay pending).
    pub fn complete_events(
        &mut self,
        mut query: impl FnMut(EventId) -> Result<bool>,
    ) -> (Vec<EventId>, Vec<(u64, u64)>) {
        let mut done = Vec::new();
        let mut ready = Vec::new();
        for queue in self.pending.values_mut() {
            while let Some(&(event, block)) = queue.front() {
                match query(event) {
                    Ok(true) => {
                        queue.pop_front();
                        done.push(event);
                        ready.push(block);
                    }
                    Ok(false) => break,
                    Err(err) => {
                        tracing::warn!(%err, "event query failed; pending frees stay pending");
                        break;
                    }
                }
            }
        }
        self.pending.retain(|_, q| !q.is_empty());
        let mut freed = Vec::new();
        for block in ready {
            let b = &mut self.blocks[block];
            b.pending_events -= 1;
            if b.pending_events == 0 {
                freed.push((b.ptr, b.size));
                self.finish_free(block);
            }
        }
        (done, freed)
    }

    /// Whether any free is waiting for events.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Removes free blocks that span a whole segment and satisfy `select`, visited in `order`,
    /// stopping once `enough(freed_bytes)` holds. Returns the segments (base, size) for the caller
    /// to give back to the driver.
    pub fn take_free_segments(
        &mut self,
        config: &AllocatorConfig,
        select: impl Fn(&Block) -> bool,
        order: ReleaseOrder,
        enough: impl Fn(u64) -> bool,
    ) -> Vec<(u64, u64)> {
        let mut candidates: Vec<BlockId> = self
            .free_blocks()
            .filter(|&id| {
                let b = &self.blocks[id];
                // Expandable segments give back pages, never the whole segment (`expandable.rs`).
                !b.is_split() && !self.expandable.contains_key(&b.segment) && select(b)
            })
            .collect();
        match order {
            ReleaseOrder::Oldest => candidates.sort_by_key(|&id| self.blocks[id].freed_at),
            ReleaseOrder::Largest => {
                candidates.sort_by_key(|&id| std::cmp::Reverse(self.blocks[id].size))
            }
            ReleaseOrder::Smallest => {
                candidates.sort_by_key(|&id| (self.blocks[id].size, self.blocks[id].ptr))
            }
        }
        let mut released = Vec::new();
        let mut freed = 0u64;
        for id in candidates {
            if enough(freed) {
                break;
            }
            self.remove_free(id);
            let b = self.blocks.remove(id);
            self.segments.remove(&b.ptr);
            let s = &mut self.stats;
            stats::decrease(&mut s.segment, b.pool, 1);
            stats::decrease(&mut s.reserved_bytes, b.pool, b.size);
            s.num_device_free += 1;
            if oversize(b.size, config) {
                s.oversize_segments.decrease(1);
            }
            freed += b.size;
            released.push((b.ptr, b.size));
        }
        released
    }

    /// Takes every pending event (for a synchronous drain): the caller synchronizes them and then
    /// calls [`Self::complete_events`] with an always-true query.
    pub fn pending_events(&self) -> Vec<EventId> {
        self.pending
            .values()
            .flat_map(|q| q.iter().map(|&(e, _)| e))
            .collect()
    }
}

impl Shard {
    /// The owner dropped block `id` (the `DataPtr` free path). Returns true when this released
    /// the last block of an orphaned shard: the caller then calls [`Shard::release_orphan`].
    pub fn free(&self, id: BlockId) -> bool {
        let core = &self.core;
        let mut st = self.state.lock();
        let (ptr, size) = (st.blocks[id].ptr, st.blocks[id].size);
        core.trace.record(
            TraceAction::FreeRequested,
            core.device,
            ptr,
            size,
            self.stream,
        );
        let uses = st.release(id, &core.config);
        if let Some(sanitizer) = &self.sanitizer {
            sanitizer.free(ptr, size, self.stream, &uses);
        }
        if uses.is_empty() {
            core.trace.record(
                TraceAction::FreeCompleted,
                core.device,
                ptr,
                size,
                self.stream,
            );
        } else {
            for stream in uses {
                match core.record_free_event(stream) {
                    Ok(event) => st.add_pending(id, stream, event),
                    Err(err) => {
                        tracing::warn!(%err, "could not record a free event; synchronizing the stream instead");
                        if let Err(err) = core.free_events.stream_synchronize(stream) {
                            tracing::error!(%err, "stream synchronize failed too; freeing anyway");
                        }
                    }
                }
            }
            st.finish_pending_without_events(id);
        }
        let orphan_released = st.orphaned && st.owners == 0;
        st.orphaned &= !orphan_released;
        // A free can grow statistics too (inactive split blocks): settle checks the budget. The
        // caller owns nothing of the shard any more, so once the lock is gone another thread's
        // last free may drop the shard, and with it the core when the allocator is gone: what
        // runs after the unlock holds a reference of its own.
        DeviceCore::settle_leaving(&self.core, st);
        orphan_released
    }

    /// Leaves `shard` to its handed-out blocks (allocator teardown): dropped now when none is out,
    /// else kept alive by one leaked reference that the last block's release gives back.
    pub fn orphan(shard: Arc<Shard>) {
        let mut st = shard.state.lock();
        if st.owners == 0 {
            drop(st);
            return;
        }
        st.orphaned = true;
        drop(st);
        // Reclaimed by `release_orphan`, called once by the owner whose `free` cleared the flag.
        let _ = Arc::into_raw(shard);
    }

    /// Frees handed-out block `id` of `shard` and, if that was the last block of an orphaned
    /// shard, releases the shard.
    ///
    /// # Safety
    /// `block` must be handed out by `shard` and owned by the caller, who gives it up here (it is
    /// counted among the shard's owners, which keeps the pointer valid until this call).
    pub unsafe fn free_and_release(shard: std::ptr::NonNull<Shard>, block: BlockId) {
        // SAFETY: the caller's block keeps the shard alive until `free` has released it.
        let orphan_released = unsafe { shard.as_ref() }.free(block);
        if orphan_released {
            // SAFETY: `free` just reported (once, under the shard's lock) that the allocator's
            // leaked reference is ours to give back; nothing uses the shard after this.
            unsafe { Shard::release_orphan(shard) };
        }
    }

    /// Gives back the reference [`Shard::orphan`] leaked (which may drop the shard).
    ///
    /// # Safety
    /// `shard` must come from a `BlockOwner` whose [`Shard::free`] just returned true, and nothing
    /// may use the shard through that owner afterwards.
    unsafe fn release_orphan(shard: std::ptr::NonNull<Shard>) {
        // SAFETY: `orphan` leaked exactly one `Arc` of this shard and set `orphaned`; the one
        // `free` that found `orphaned` with no owner left cleared it, so this runs once per leak.
        drop(unsafe { Arc::from_raw(shard.as_ptr().cast_const()) });
    }

    /// Gives back block `id`, just handed out, that no owner can name (its index does not fit
    /// 32 bits): the error the allocation returns instead.
    #[cold]
    pub fn refuse_block(&self, id: BlockId) -> Error {
        let orphan_released = self.free(id);
        debug_assert!(
            !orphan_released,
            "a live allocator's shard is never orphaned"
        );
        Error::OutOfMemory {
            device: self.core.device,
            requested: 0,
            message: format!(
                "stream {} has more than {} blocks; free some memory first",
                self.stream.raw(),
                u32::MAX
            ),
        }
    }

    /// Base address and size of the segment holding block `id`.
    pub fn segment_of(&self, id: BlockId) -> (u64, u64) {
        let st = self.state.lock();
        let base = st.blocks[id].segment;
        (base, st.segments.get(&base).map_or(0, |s| s.size))
    }

    /// Marks block `id` as used by `stream` (`record_stream`).
    pub fn record_use(&self, id: BlockId, stream: StreamId) -> Result<()> {
        if stream == self.stream {
            return Ok(());
        }
        let device = self.core.driver.stream_device(stream)?;
        if device != self.core.device {
            return Err(Error::invalid(format!(
                "record_stream: stream {} is on device {device}, the block on device {}",
                stream.raw(),
                self.core.device
            )));
        }
        self.state.lock().record_use(id, stream);
        Ok(())
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child's copy: its segments and events are the parent's.
            return;
        }
        // Only reached after the allocator shut down and the last block of this shard was freed.
        let st = self.state.get_mut();
        for e in st.pending_events() {
            let _ = self.core.free_events.event_synchronize(e);
        }
        let _ = st.complete_events(|_| Ok(true));
        let taken = st.take_free_segments(
            &self.core.config,
            |_| true,
            ReleaseOrder::Largest,
            |_| false,
        );
        self.core.free_segments(self.stream, taken);
        let pages = st.take_free_pages(|_| true, |_| false);
        let starts: Vec<u64> = pages.iter().map(|p| p.0).collect();
        self.core.free_pages(self.stream, pages);
        for addr in starts {
            st.finish_release(addr);
        }
        for base in st.take_empty_expandable() {
            if let Err(err) = self
                .core
                .driver
                .vm_free_reservation(crate::driver::DeviceAddr(base))
            {
                tracing::error!(%err, base, "freeing an expandable segment's reservation failed");
            }
        }
    }
}
