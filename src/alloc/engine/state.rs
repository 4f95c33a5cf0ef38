//! The state under one shard's lock: the blocks, free pools, segments, pending frees and
//! statistics of one (device, stream), and every operation on them. Nothing here takes a lock or
//! calls the driver except through the closures it is given, so the locking policy lives in the
//! files above (`shard.rs`, `device.rs`); `expandable.rs` (pages), `snapshot.rs` and
//! `invariants.rs` add their own operations on this state.
//!
//! Pending frees (`record_stream`): a block freed while other streams used it becomes `PendingFree`
//! and one event per using stream is recorded; the events queue per using stream, in order. They
//! are polled lazily ([`ShardState::complete_events`]) before each allocation of the shard, and
//! waited for in `empty_cache` and the last out-of-memory step.

use crate::alloc::block::{Allocated, Block, BlockId, BlockState, SegmentInfo};
use crate::alloc::pool::FreePool;

use crate::alloc::size::{self, PoolKind};
use crate::alloc::stats;
use crate::config::cell::FitRules;
use crate::driver::{EventId, StreamId};
use crate::error::Result;

use super::ShardState;

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
fn oversize(size: u64, rules: FitRules) -> bool {
    size >= rules.max_split_size
}

impl ShardState {
    /// Whether the device may release or hand over this shard's cache (the default pool's, or a
    /// retired shard's; not a live pool's). Asked under the lock.
    pub(in crate::alloc) fn releasable(&self) -> bool {
        self.pool.is_default() || self.retired
    }

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
    pub(in crate::alloc) fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free_small
            .iter()
            .chain(self.free_large.iter())
            .map(|(_, _, id)| id)
    }

    /// Puts free block `id` in its pool (and counts it as inactive if its segment is split).
    pub(in crate::alloc) fn insert_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        debug_assert_eq!(b.state, BlockState::Free);
        let (pool, size, ptr, split) = (b.pool, b.size, b.ptr, b.is_split());
        self.free_set(pool).insert(size, ptr, id);
        self.account_inactive(split, pool, size, true);
    }

    /// Takes free block `id` out of its pool.
    pub(in crate::alloc) fn remove_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        debug_assert_eq!(b.state, BlockState::Free);
        let (pool, size, ptr, split) = (b.pool, b.size, b.ptr, b.is_split());
        self.account_inactive(split, pool, size, false);
        let removed = self.free_set(pool).remove(size, ptr);
        debug_assert!(removed, "free block {id} missing from its pool");
    }

    /// Best fit in `pool` for a rounded request, under the oversize rules.
    pub(crate) fn find_fit(&self, pool: PoolKind, rounded: u64) -> Option<BlockId> {
        let set = match pool {
            PoolKind::Small => &self.free_small,
            PoolKind::Large => &self.free_large,
        };
        let (block_size, _, id) = set.best_fit(rounded)?;
        size::fits_oversize_rules(block_size, rounded, self.rules).then_some(id)
    }

    /// Registers a new segment from the driver as one free block; returns it.
    pub(crate) fn add_segment(&mut self, ptr: u64, seg_size: u64, pool: PoolKind) -> BlockId {
        self.stats.num_device_alloc += 1;
        self.enter_segment(ptr, seg_size, pool)
    }

    /// Enters a segment (new from the driver, or handed over by another stream's shard:
    /// `cross_stream.rs`) as one free block; returns it.
    pub(in crate::alloc) fn enter_segment(
        &mut self,
        ptr: u64,
        seg_size: u64,
        pool: PoolKind,
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
            counted_oversize: false,
        });
        self.segments.insert(
            ptr,
            SegmentInfo {
                size: seg_size,
                pool,
                counted_oversize: oversize(seg_size, self.rules),
                head: id,
            },
        );
        let counted_oversize = oversize(seg_size, self.rules);
        let s = &mut self.stats;
        self.over_budget |= stats::increase(&mut s.segment, pool, 1);
        self.over_budget |= stats::increase(&mut s.reserved_bytes, pool, seg_size);
        if counted_oversize {
            self.over_budget |= s.oversize_segments.increase(1);
        }
        self.insert_free(id);
        id
    }

    /// Takes the best fit for a rounded request out of `pool` (under the oversize rules) and hands
    /// it out: [`Self::find_fit`] then [`Self::allocate`] with one search of the pool.
    #[inline]
    pub(crate) fn allocate_best_fit(
        &mut self,
        pool: PoolKind,
        rounded: u64,
        requested: u64,
    ) -> Option<BlockId> {
        let rules = self.rules;
        let (found, _, id) = self.free_set(pool).take_best_fit(rounded, |found| {
            size::fits_oversize_rules(found, rounded, rules)
        })?;
        let split = self.blocks[id].is_split();
        self.account_inactive(split, pool, found, false);
        Some(self.hand_out(id, rounded, requested))
    }

    /// Hands out free block `id` for a request (splitting off the remainder when the policy says
    /// so); returns the allocated block (the same id).
    pub(crate) fn allocate(&mut self, id: BlockId, rounded: u64, requested: u64) -> BlockId {
        self.remove_free(id);
        self.hand_out(id, rounded, requested)
    }

    /// [`Self::allocate`] of a block already taken out of its pool.
    #[inline]
    fn hand_out(&mut self, id: BlockId, rounded: u64, requested: u64) -> BlockId {
        let b = &self.blocks[id];
        let (pool, block_size, segment) = (b.pool, b.size, b.segment);
        // The kind of the segment the block lies in, not the setting: `expandable_segments`
        // may have changed since the segment was made (`config/live.rs`).
        let expandable = !self.expandable.is_empty() && self.expandable.contains_key(&segment);
        if !self.pool_options.no_split
            && size::should_split(pool, block_size, rounded, self.rules, expandable)
        {
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
        if oversize(size, self.rules) {
            self.over_budget |= s.oversize_allocations.increase(1);
            self.blocks[id].counted_oversize = true;
        }
        id
    }

    /// Allocated block `id`, handed out for a request of `rounded` bytes.
    #[inline]
    pub(crate) fn allocated(&self, id: BlockId, rounded: u64) -> Allocated {
        Allocated {
            block: id,
            ptr: self.blocks[id].ptr,
            rounded,
            // A block leaves its pool with no stream uses (`release` took them): only a loan
            // records one (`handover.rs`).
            front: true,
        }
    }

    /// Records that `stream` (not the shard's own) used allocated block `id`.
    pub(crate) fn record_use(&mut self, id: BlockId, stream: StreamId) {
        let uses = &mut self.blocks[id].stream_uses;
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// The caller dropped block `id`. Returns the streams that used it (events must be recorded on
    /// each, then [`Self::add_pending`]); when none, the block is free already.
    pub(crate) fn release(&mut self, id: BlockId) -> Vec<StreamId> {
        let b = &mut self.blocks[id];
        debug_assert_eq!(b.state, BlockState::Allocated);
        let (size, pool, requested) = (b.size, b.pool, b.requested);
        let uses = std::mem::take(&mut b.stream_uses);
        let counted_oversize = std::mem::take(&mut b.counted_oversize);
        self.owners -= 1;
        let s = &mut self.stats;
        stats::decrease(&mut s.allocation, pool, 1);
        stats::decrease(&mut s.allocated_bytes, pool, size);
        stats::decrease(&mut s.requested_bytes, pool, requested);
        if counted_oversize {
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
    pub(crate) fn add_pending(&mut self, id: BlockId, stream: StreamId, event: EventId) {
        self.blocks[id].pending_events += 1;
        self.pending
            .entry(stream)
            .or_default()
            .push_back((event, id));
    }

    /// A pending block whose events could not all be recorded: wait is impossible, so the caller
    /// synchronized instead; the block is free now.
    pub(crate) fn finish_pending_without_events(&mut self, id: BlockId) -> bool {
        let free = self.blocks[id].pending_events == 0;
        if free {
            self.finish_free(id);
        }
        free
    }

    /// Splits `len` bytes off the front of block `id`; the rest becomes a new block in `state`
    /// (not put in any pool), returned.
    pub(in crate::alloc) fn split_off(
        &mut self,
        id: BlockId,
        len: u64,
        state: BlockState,
    ) -> BlockId {
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
            counted_oversize: false,
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
    pub(in crate::alloc) fn merge_free(&mut self, id: BlockId) {
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
    pub(in crate::alloc) fn absorb_next(&mut self, id: BlockId) {
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
    pub(crate) fn complete_events(
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
    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Removes free blocks that span a whole segment and satisfy `select`, visited in `order`,
    /// stopping once `enough(freed_bytes)` holds. Returns the segments (base, size) for the caller
    /// to give back to the driver.
    pub(crate) fn take_free_segments(
        &mut self,
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
            let (ptr, size) = self.remove_segment(id);
            self.stats.num_device_free += 1;
            freed += size;
            released.push((ptr, size));
        }
        released
    }

    /// Takes free block `id`, a whole segment, out of the shard (to go back to the driver, or
    /// to another stream's shard: `cross_stream.rs`); returns its (base, size).
    pub(in crate::alloc) fn remove_segment(&mut self, id: BlockId) -> (u64, u64) {
        self.remove_free(id);
        let b = self.blocks.remove(id);
        let counted_oversize = self
            .segments
            .remove(&b.ptr)
            .is_some_and(|info| info.counted_oversize);
        let s = &mut self.stats;
        stats::decrease(&mut s.segment, b.pool, 1);
        stats::decrease(&mut s.reserved_bytes, b.pool, b.size);
        if counted_oversize {
            s.oversize_segments.decrease(1);
        }
        (b.ptr, b.size)
    }

    /// Takes every pending event (for a synchronous drain): the caller synchronizes them and then
    /// calls [`Self::complete_events`] with an always-true query.
    pub(crate) fn pending_events(&self) -> Vec<EventId> {
        self.pending
            .values()
            .flat_map(|q| q.iter().map(|&(e, _)| e))
            .collect()
    }
}
