//! Idle memory that moves between streams (`cross_stream_reuse`; `off` by default, PyTorch's
//! order).
//!
//! **Why.** A stream's cache serves that stream only. A program that makes a fresh stream per
//! step (vLLM's weight syncs) strands every earlier stream's cache: reserved memory grows by a
//! step's need per step until the device is full, and only the out-of-memory sequence's last step
//! (`release_cached`: wait for every pending free, free every whole cached segment to the driver)
//! gives it back — one driver free per segment, and on CUDA a device synchronization each.
//!
//! **What moves, and what the new owner waits for** (the rule is `handover.rs`'s: the next owner
//! is ordered after every stream that used the bytes, [`DeviceCore::order_after`]):
//!
//! | policy | on a miss, before new driver memory | the asking stream waits for | owner afterwards |
//! |---|---|---|---|
//! | `off` | nothing (other streams' whole idle segments are freed at the out-of-memory sequence's last step, as PyTorch) | — | — |
//! | `segments` | the smallest whole idle segment of the request's pool kind that fits, over every other stream's shard (default pool and retired pools' shards): out of its shard (no driver call), into the asking shard, then split as any new segment | the segment's old stream's work so far (its blocks' other uses completed before they became free) | the asking stream's shard: counted, snapshotted and traced there (`segment_free` on the old stream, `segment_alloc` on the new one) |
//! | `blocks` | the best-fitting free block over every other stream's shard, handed out there and lent (as a `use_on_oom` pool lends, `device_shards.rs`); if none, as `segments` | the block's stream's work so far | the lending shard: the block is recorded as used by the asking stream, so its free waits for that stream's work (an event, as `record_stream`) before the lender reuses it |
//!
//! A stream destroyed through `Runtime::destroy_stream` was synchronized first: its shard is
//! *finished*, retired from the device's map, and its idle memory moves without a wait (under
//! `off` its whole idle segments go back to the driver at once: no stream could reuse them).
//!
//! The wait is made after the memory left its old shard, so no work of the old stream can be
//! enqueued on those bytes between the wait and the hand-out. A stream that cannot be waited for
//! (captured by a capture this allocator did not begin, or destroyed) is skipped before anything
//! is taken; one that fails at the wait itself gives its segment back to the driver with the next
//! release (a free waits for what a wait cannot) or its block back to its pool, and the search
//! goes on. The search holds the capture gate (`capturing.rs`): no capture of this allocator
//! begins while it queries events and orders streams, and none runs when it starts. Private pools
//! keep their memory (a graph's replays use their free blocks' addresses): only the default
//! pool's shards and retired pools' take part, and only for the default pool's misses. Nothing
//! moves while a capture is under way (the miss path does not come here then).
//!
//! Memory taken over this way is not new to the process: the device's reserved counter and the
//! driver call counters do not move; `segment` and `reserved_bytes` move from one shard to the
//! other.

use super::device::Request;
use super::{DeviceCore, Shard, ShardState};
use crate::alloc::block::{Allocated, BlockId};
use crate::alloc::history::TraceAction;
use crate::alloc::size::{self, PoolKind};
use crate::config::CrossStreamReuse;
use crate::driver::StreamId;
use crate::error::Result;
use crate::sync::os::atomic::Ordering;
use crate::sync::os::Arc;

use super::handover::Order;

impl ShardState {
    /// The smallest whole idle segment (a free block spanning its segment, not expandable) of
    /// `pool` that may serve a rounded request under the oversize rules: its block.
    pub(in crate::alloc) fn smallest_idle_segment(
        &self,
        pool: PoolKind,
        rounded: u64,
    ) -> Option<(u64, BlockId)> {
        self.free_blocks()
            .filter(|&id| {
                let b = &self.blocks[id];
                b.pool == pool
                    && !b.is_split()
                    && !self.expandable.contains_key(&b.segment)
                    && b.size >= rounded
                    && size::fits_oversize_rules(b.size, rounded, self.rules)
            })
            .map(|id| (self.blocks[id].size, id))
            .min_by_key(|&(size, id)| (size, self.blocks[id].ptr))
    }
}

impl DeviceCore {
    /// A miss's step before new driver memory, under the `cross_stream_reuse` policy (the module
    /// docs): memory cached under another stream, ordered for `shard`'s stream. The lending
    /// shard comes back with the block when the block stays another stream's (`blocks`).
    pub(super) fn reuse_across_streams(
        &self,
        shard: &Shard,
        req: Request,
    ) -> Option<(Option<Arc<Shard>>, Allocated)> {
        let policy = self.config().cross_stream_reuse;
        if policy == CrossStreamReuse::Off || !shard.state.lock().pool.is_default() {
            return None;
        }
        // Held throughout: no capture of this allocator begins while the search queries events
        // and orders streams (calls a global capture forbids; `capturing.rs`). None while one runs.
        let _no_capture = self.wide.capturing.releasing()?;
        let others: Vec<Arc<Shard>> = self
            .roster
            .releasable()
            .into_iter()
            .filter(|other| !std::ptr::eq(Arc::as_ptr(other), shard))
            .filter(|other| self.can_wait(shard.stream(), other))
            .collect();
        if others.is_empty() {
            return None;
        }
        let borrowed = match policy {
            CrossStreamReuse::Blocks => self
                .borrow_block(shard, &others, req)
                .map(|(lender, hit)| (Some(lender), hit)),
            _ => None,
        };
        let got = borrowed.or_else(|| {
            self.adopt_segment(shard, &others, req)
                .map(|hit| (None, hit))
        });
        if got.is_some() {
            self.counters.count(super::device::Count::CrossStream);
        }
        got
    }

    /// Whether work next enqueued on `to` can be ordered after the work of `used`'s stream (a
    /// finished stream's is all done).
    pub(super) fn can_wait(&self, to: StreamId, used: &Shard) -> bool {
        used.finished.load(Ordering::SeqCst)
            || matches!(self.order(to, used.stream()), Ok(o) if o != Order::Impossible)
    }

    /// Orders `to` after the work of `used`'s stream so far (nothing to wait for when that
    /// stream is finished: synchronized before it was destroyed).
    fn wait_for(&self, to: StreamId, used: &Shard) -> Result<()> {
        if used.own_stream_done() {
            return Ok(());
        }
        self.order_after(to, used.stream())
    }

    /// `blocks`: the best fit over `others`' free blocks, handed out by its shard and lent to
    /// `shard`'s stream.
    fn borrow_block(
        &self,
        shard: &Shard,
        others: &[Arc<Shard>],
        req: Request,
    ) -> Option<(Arc<Shard>, Allocated)> {
        let fits = self.ranked(others, |st| {
            let id = st.find_fit(req.pool(), req.rounded)?;
            Some(st.blocks[id].size)
        });
        for lender in fits {
            let Some(hit) = self.fit_releasable(lender, req) else {
                continue;
            };
            if let Err(err) = self.wait_for(shard.stream(), lender) {
                tracing::warn!(%err, "a borrowed block could not be ordered after its stream's work; it goes back to its pool");
                // Nothing used it: a free with no other stream to wait for.
                lender.free(hit.block);
                continue;
            }
            return Some((Arc::clone(lender), lender.lend(hit, shard.stream())));
        }
        None
    }

    /// The shards of `others` that are, under their locks, still the default pool's or retired
    /// and awake, with what `size` finds in each (their pending frees polled first), smallest
    /// first. A peek: the caller takes under the lock again.
    fn ranked<'a>(
        &self,
        others: &'a [Arc<Shard>],
        size: impl Fn(&ShardState) -> Option<u64>,
    ) -> Vec<&'a Arc<Shard>> {
        let mut fits: Vec<(u64, &Arc<Shard>)> = others
            .iter()
            .filter_map(|other| {
                let mut st = other.state.lock();
                if other.sleeping.load(Ordering::Relaxed) || !st.releasable() {
                    return None;
                }
                self.poll_events(other, &mut st);
                Some((size(&st)?, other))
            })
            .collect();
        fits.sort_by_key(|&(size, _)| size);
        fits.into_iter().map(|(_, shard)| shard).collect()
    }

    /// `try_fit` in `lender`, if under its lock it is still the default pool's or retired (it
    /// may have become a live pool's since the shards were listed) and awake.
    fn fit_releasable(&self, lender: &Shard, req: Request) -> Option<Allocated> {
        let mut st = lender.state.lock();
        if lender.sleeping.load(Ordering::Relaxed) || !st.releasable() {
            return None;
        }
        self.poll_events(lender, &mut st);
        // Two searches (find, then take): not the hot path's one, which stays its caller's alone.
        let found = st.find_fit(req.pool(), req.rounded)?;
        let id = st.allocate(found, req.rounded, req.requested);
        self.hand_out_fit(lender, st, id, req.rounded)
    }

    /// `segments`: the smallest whole idle segment over `others` that fits, moved into `shard`
    /// and allocated from.
    fn adopt_segment(
        &self,
        shard: &Shard,
        others: &[Arc<Shard>],
        req: Request,
    ) -> Option<Allocated> {
        let pool = req.pool();
        let fits = self.ranked(others, |st| {
            let (size, _) = st.smallest_idle_segment(pool, req.rounded)?;
            Some(size)
        });
        for from in fits {
            let taken = {
                let mut st = from.state.lock();
                // Under the lock again: `from` may have become a live pool's meanwhile.
                let found = if st.releasable() {
                    st.smallest_idle_segment(pool, req.rounded)
                } else {
                    None
                };
                let taken = found.map(|(_, id)| st.remove_segment(id));
                self.settle(st);
                taken
            };
            let Some((base, size)) = taken else {
                continue;
            };
            if let Err(err) = self.wait_for(shard.stream(), from) {
                tracing::warn!(%err, "an idle segment could not be ordered after its stream's work; it goes back to the driver");
                from.state.lock().stats.num_device_free += 1;
                // Freed with the next release (the capture gate is held here: no free now).
                self.withheld.keep(from.stream(), vec![(base, size)]);
                continue;
            }
            self.wide
                .callbacks
                .registry
                .rehome(self.device, base, shard.stream());
            self.wide.trace.record(
                TraceAction::SegmentFree,
                self.device,
                base,
                size,
                from.stream(),
            );
            let mut st = shard.state.lock();
            self.wide.trace.record_mapped(
                TraceAction::SegmentAlloc,
                self.device,
                base,
                size,
                shard.stream(),
                st.pool,
            );
            let head = st.enter_segment(base, size, pool);
            let id = st.allocate(head, req.rounded, req.requested);
            let out = st.allocated(id, req.rounded);
            self.settle(st);
            self.record_alloc(shard, base, req.rounded);
            tracing::debug!(
                base,
                size,
                from = from.stream().raw(),
                to = shard.stream().raw(),
                "idle segment handed over between streams"
            );
            return Some(out);
        }
        None
    }
}
