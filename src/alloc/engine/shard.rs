//! One (device, stream) shard's own paths: the free of a handed-out block, the shard's life
//! after its allocator (orphaning, the last free's release, its teardown), and the helpers of the
//! front caches registered with it. The shard's fields are in `engine/mod.rs`, the state under its lock
//! and that state's operations in `state.rs`.
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
//!
//! A free that is not the last owns nothing of the shard once it unlocks it: another thread's
//! last free may then drop the shard (and, its allocator gone, the device core). So what a free
//! does after the unlock goes through a reference taken under the lock
//! (`DeviceCore::settle_leaving`; `tests/shard_lifetime.rs`).

use std::ptr::NonNull;

use super::handover::FreePlan;
use super::snapshot::SnapshotSegment;
use super::state::ReleaseOrder;
use super::{DeviceCore, Shard};
use crate::alloc::block::{Allocated, BlockId};
use crate::alloc::front::FrontCache;
use crate::alloc::history::TraceAction;
use crate::alloc::pool_id::MemPoolId;
use crate::alloc::stats::{self, DeviceStats};
use crate::driver::StreamId;
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::atomic::Ordering;
use crate::sync::os::Arc;

/// The shard's face to the rest of `alloc/`: its fields are the engine's own.
impl Shard {
    /// The stream whose blocks this shard holds.
    #[inline]
    pub(in crate::alloc) fn stream(&self) -> StreamId {
        StreamId(self.stream.load(Ordering::Acquire))
    }

    /// The shard's serial (see [`Shard`]'s field): changes only when an empty shard of a
    /// destroyed stream is recycled for another stream.
    #[inline]
    pub(in crate::alloc) fn serial(&self) -> u64 {
        self.serial.load(Ordering::Acquire)
    }

    /// The device of the shard.
    #[inline]
    pub(in crate::alloc) fn device(&self) -> usize {
        self.core.device
    }

    /// `thread_cache_mb` in bytes (0: no front caches).
    #[inline]
    pub(in crate::alloc) fn front_limit(&self) -> u64 {
        self.front_limit.load(Ordering::Relaxed)
    }

    /// The process of the allocator: a forked child's blocks release nothing.
    #[inline]
    pub(in crate::alloc) fn birth(&self) -> Birth {
        self.birth
    }

    /// Whether the shard's pool is a tag that sleeps (`sleep.rs`).
    #[inline]
    pub(in crate::alloc) fn is_sleeping(&self) -> bool {
        self.sleeping.load(Ordering::SeqCst)
    }

    /// The error of a refused use of this shard's sleeping memory: `what` was refused.
    #[cold]
    pub(in crate::alloc) fn asleep_error(&self, what: &str) -> Error {
        self.core.asleep_error(self, what)
    }

    /// A block for `requested` bytes from the calling thread's front cache of this shard.
    #[inline]
    pub(in crate::alloc) fn take_from_front(&self, requested: u64) -> Option<Allocated> {
        self.core.take_from_front(self, requested)
    }

    /// Allocates `requested` bytes on this shard's stream: PyTorch's whole sequence on a miss
    /// (`device.rs`); `lender` as [`DeviceCore::allocate`] says.
    #[inline]
    pub(in crate::alloc) fn allocate(
        &self,
        requested: u64,
        lender: &mut Option<Arc<Shard>>,
    ) -> Result<Allocated> {
        self.core.allocate(self, requested, lender)
    }

    /// Appends this shard's segments to `out` (a snapshot). The blocks threads' front caches
    /// hold are inactive there, as in the statistics ([`Shard::hide_fronts`]): for the program
    /// they were freed (registry → cache → shard state, the lock order of `front.rs`).
    pub(in crate::alloc) fn segments_into(&self, out: &mut Vec<SnapshotSegment>) {
        let registry = self.fronts.lock();
        let mut held: Vec<BlockId> = Vec::new();
        for cache in &registry.caches {
            cache.with_entries(|entries| held.extend(entries.iter().map(|e| e.block)));
        }
        let st = self.state.lock();
        super::snapshot::shard_segments(&st, self.core.device, self.stream(), &held, out);
    }

    /// This shard's statistics as its pool's: the accumulated counts of earlier pools that held
    /// the shard left out.
    pub(in crate::alloc) fn pool_stats(&self) -> DeviceStats {
        let st = self.state.lock();
        let mut own = st.stats.clone();
        own.subtract_accumulated(&st.pool_base);
        own
    }
}

/// Segments a pass-through free leaves (base, size), with the core and stream that give them
/// back after the shard's unlock.
type PassedThrough = (Arc<DeviceCore>, StreamId, Vec<(u64, u64)>);

impl Shard {
    /// The owner dropped block `id` (the `DataPtr` free path). Returns true when this released
    /// the last block of an orphaned shard: the caller then calls [`Shard::release_orphan`].
    pub(crate) fn free(&self, id: BlockId) -> bool {
        let core = &self.core;
        let mut st = self.state.lock();
        let (ptr, size) = (st.blocks[id].ptr, st.blocks[id].size);
        core.wide.trace.record(
            TraceAction::FreeRequested,
            core.device,
            ptr,
            size,
            self.stream(),
        );
        // What the block's next owner waits for is decided in `handover.rs`; carried out here.
        match self.leave(&mut st, id) {
            FreePlan::Now => core.wide.trace.record(
                TraceAction::FreeCompleted,
                core.device,
                ptr,
                size,
                self.stream(),
            ),
            FreePlan::AfterCaptures(waits) => st.deferred.push((id, waits)),
            FreePlan::AfterEvents(waits) => {
                // Events on other streams: no capture of this allocator may begin between the
                // decision and their records (found by review) — the gate is taken here, off the
                // hot path, and a capture begun since the decision defers them as `leave` would.
                let _ordering = core.wide.capturing.ordering();
                if core.wide.capturing.any() {
                    st.deferred.push((id, waits));
                } else {
                    core.insert_free_events(&mut st, self.stream(), id, waits);
                }
            }
        }
        // Passing through, the free's memory goes back to the driver once its waits are over
        // (now, or at a later poll of its events).
        let released = if core.config.pass_through() {
            self.passed_through(&mut st)
        } else {
            None
        };
        let orphan_released = st.orphaned && st.owners == 0;
        st.orphaned &= !orphan_released;
        // A free can grow statistics too (inactive split blocks): settle checks the budget. The
        // caller owns nothing of the shard any more, so once the lock is gone another thread's
        // last free may drop the shard, and with it the core when the allocator is gone: what
        // runs after the unlock holds a reference of its own.
        DeviceCore::settle_leaving(&self.core, st);
        if let Some((core, stream, freed)) = released {
            core.free_segments_passing(stream, freed);
        }
        orphan_released
    }

    /// Under `pass_through`, the free segments a free leaves in a shard of the default pool (its
    /// events polled first), with what gives them back after the unlock — off the free's hot path.
    #[cold]
    #[inline(never)]
    fn passed_through(&self, st: &mut super::ShardState) -> Option<PassedThrough> {
        if !st.releasable() {
            return None;
        }
        self.core.poll_events(self, st);
        let freed = st.take_free_segments(|_| true, ReleaseOrder::Largest, |_| false);
        Some((Arc::clone(&self.core), self.stream(), freed))
    }

    /// Leaves `shard` to its handed-out blocks (allocator teardown): dropped now when none is out,
    /// else kept alive by one leaked reference that the last block's release gives back.
    pub(crate) fn orphan(shard: Arc<Shard>) {
        let mut st = shard.state.lock();
        if st.owners == 0 {
            drop(st);
            return;
        }
        st.orphaned = true;
        drop(st);
        // Leaked on purpose: reclaimed by `release_orphan`, called once by the owner whose `free`
        // cleared the flag.
        let _ = Arc::into_raw(shard);
    }

    /// Frees handed-out block `id` of `shard` and, if that was the last block of an orphaned
    /// shard, releases the shard.
    ///
    /// # Safety
    /// `block` must be handed out by `shard` and owned by the caller, who gives it up here (it is
    /// counted among the shard's owners, which keeps the pointer valid until this call).
    pub(crate) unsafe fn free_and_release(shard: NonNull<Shard>, block: BlockId) {
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
    unsafe fn release_orphan(shard: NonNull<Shard>) {
        // SAFETY: `orphan` leaked exactly one `Arc` of this shard and set `orphaned`; the one
        // `free` that found `orphaned` with no owner left cleared it, so this runs once per leak.
        drop(unsafe { Arc::from_raw(shard.as_ptr().cast_const()) });
    }

    /// Gives back block `id`, just handed out, that no owner can name (its index does not fit
    /// 32 bits): the error the allocation returns instead.
    #[cold]
    pub(crate) fn refuse_block(&self, id: BlockId) -> Error {
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
                self.stream().raw(),
                u32::MAX
            ),
        }
    }

    /// Whether the shard's blocks are the default pool's (not a private pool's, which graphs may
    /// hold and replays write outside stream order).
    pub(in crate::alloc) fn serves_default_pool(&self) -> bool {
        self.state.lock().pool == MemPoolId::DEFAULT
    }

    /// Base address and size of the segment holding block `id`.
    pub(crate) fn segment_of(&self, id: BlockId) -> (u64, u64) {
        let st = self.state.lock();
        let base = st.blocks[id].segment;
        (base, st.segments.get(&base).map_or(0, |s| s.size))
    }

    /// Marks block `id` as used by `stream` (`record_stream`).
    pub(crate) fn record_use(&self, id: BlockId, stream: StreamId) -> Result<()> {
        if stream == self.stream() {
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

impl Shard {
    /// A buried shard (of a destroyed stream, holding nothing: `DeviceCore::bury_empty`)
    /// becomes the shard of `stream` with `fresh` (the state a new shard gets: its new serial,
    /// pool and fit rules), so that the shards a device keeps are bounded by the streams alive
    /// at once. Its accumulated statistics stay
    /// (the device's totals keep counting them; its currents are zero), as does its entry in the
    /// peak book. Thread caches that still point at it compare its serial and miss
    /// (`thread.rs`); its front caches, flushed when its stream was destroyed, are retired.
    pub(in crate::alloc) fn recycle(
        &self,
        stream: StreamId,
        front_limit: u64,
        sleeping: bool,
        mut fresh: super::ShardState,
    ) {
        self.detach_fronts(false);
        let serial = fresh.serial;
        let mut st = self.state.lock();
        debug_assert!(st.owners == 0 && st.segments.is_empty() && !st.has_pending());
        // The accumulated counts and the age clock go on; everything else is the new shard's.
        fresh.stats = std::mem::take(&mut st.stats);
        fresh.tick = st.tick;
        if fresh.pooled {
            fresh.pool_base = fresh.stats.clone();
        }
        *st = fresh;
        drop(st);
        self.stream.store(stream.raw(), Ordering::Release);
        self.front_limit.store(front_limit, Ordering::Relaxed);
        self.sleeping.store(sleeping, Ordering::SeqCst);
        self.finished.store(false, Ordering::SeqCst);
        self.serial.store(serial, Ordering::Release);
    }
}

/// The front caches registered with a shard (`front.rs`): what the allocator does to all of them,
/// and a thread's give-back of one.
impl Shard {
    /// A new front cache for the calling thread, registered with this shard; `None` once the
    /// allocator is shutting down (checked under the registry's lock, which
    /// [`Self::retire_fronts`] takes too, so no cache can start after the last retire).
    pub(crate) fn register_front(&self) -> Option<Arc<FrontCache>> {
        let mut registry = self.fronts.lock();
        if registry.closed {
            return None;
        }
        registry.caches.retain(|c| !c.is_retired());
        let cache = Arc::new(FrontCache::new(self.serial(), self.birth));
        registry.caches.push(Arc::clone(&cache));
        Some(cache)
    }

    /// Gives every block `cache` holds back to `shard` (`retire`: and closes the cache).
    ///
    /// # Safety
    /// `cache` must be a front cache of `shard` (its blocks are counted among the shard's owners,
    /// which keeps the pointer valid while any is held).
    pub(crate) unsafe fn flush_front(shard: NonNull<Shard>, cache: &FrontCache, retire: bool) {
        for e in cache.take_all(retire) {
            // SAFETY: the block was handed out by this shard and is still counted among its
            // owners (the cache took it over from its `BlockOwner`), so the shard is alive, and
            // the block is freed exactly once: it was just taken out of the cache.
            unsafe { Shard::free_and_release(shard, e.block) };
        }
    }

    /// Flushes every front cache of this shard (out of memory, `empty_cache`).
    pub(crate) fn flush_fronts(&self) {
        let caches = self.fronts.lock().caches.clone();
        for cache in caches {
            // SAFETY: a cache registered with this shard; the caller's reference keeps the shard
            // alive in any case.
            unsafe { Shard::flush_front(NonNull::from(self), &cache, false) };
        }
    }

    /// Closes this shard to new front caches and retires every one it has (allocator drop).
    pub(crate) fn retire_fronts(&self) {
        self.detach_fronts(true);
    }

    /// Takes every front cache off this shard, their blocks back into it; with `close`, no cache
    /// registers again (teardown), else the next thread's may (a recycled shard's).
    fn detach_fronts(&self, close: bool) {
        let caches = {
            let mut registry = self.fronts.lock();
            registry.closed |= close;
            std::mem::take(&mut registry.caches)
        };
        for cache in caches {
            // SAFETY: a cache registered with this shard, which `self` keeps alive.
            unsafe { Shard::flush_front(NonNull::from(self), &cache, true) };
        }
    }

    /// Subtracts what this shard's front caches hold from `stats` (registry → cache → shard
    /// state, the lock order of `front.rs`).
    pub(crate) fn hide_fronts(&self, stats: &mut DeviceStats) {
        for cache in &self.fronts.lock().caches {
            cache.with_entries(|entries| {
                let blocks = &self.state.lock().blocks;
                for e in entries {
                    let Some(b) = blocks.get(e.block) else {
                        continue;
                    };
                    stats::hide(&mut stats.allocation, b.pool, 1);
                    stats::hide(&mut stats.allocated_bytes, b.pool, b.size);
                    stats::hide(&mut stats.active, b.pool, 1);
                    stats::hide(&mut stats.active_bytes, b.pool, b.size);
                    stats::hide(&mut stats.requested_bytes, b.pool, b.requested);
                    if b.counted_oversize {
                        stats.oversize_allocations.current -= 1;
                    }
                }
            });
        }
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child's copy: its segments and events are the parent's.
            return;
        }
        // Only reached after the allocator shut down and the last block of this shard was freed.
        let stream = self.stream();
        let st = self.state.get_mut();
        let free_events = &self.core.free_events;
        for e in st.pending_events() {
            if let Err(err) = free_events.event_synchronize(e) {
                tracing::warn!(%err, "synchronizing a pending free at a shard's teardown failed; its segment is released anyway");
            }
        }
        // The allocator's event pool was emptied at its shutdown: the completed events are
        // destroyed here. The freed ranges are traced (NVTX regions follow the trace).
        let (completed, freed) = st.complete_events(|_| Ok(true));
        for (addr, size) in freed {
            let trace = &self.core.wide.trace;
            trace.record(
                TraceAction::FreeCompleted,
                self.core.device,
                addr,
                size,
                stream,
            );
        }
        for e in completed {
            if let Err(err) = free_events.event_destroy(e) {
                tracing::debug!(%err, "destroying a pending free's event at a shard's teardown failed");
            }
        }
        let taken = st.take_free_segments(|_| true, ReleaseOrder::Largest, |_| false);
        self.core.free_segments(stream, taken);
        let pages = st.take_free_pages(|_| true, |_| false);
        let starts: Vec<u64> = pages.iter().map(|p| p.0).collect();
        self.core.free_pages(stream, pages);
        for addr in starts {
            st.finish_release(addr);
        }
        let mut bases = st.take_empty_expandable();
        // Segments of a tag still asleep map nothing: their reservations go back too, and the
        // sanitizer forgets that they slept (the addresses may serve anyone next).
        for (base, size) in st.take_asleep_segments() {
            if let Some(sanitizer) = &self.sanitizer {
                sanitizer.awake(base, size);
            }
            bases.push(base);
        }
        for base in bases {
            if let Err(err) = self
                .core
                .driver
                .vm()
                .vm_free_reservation(crate::driver::DeviceAddr(base))
            {
                tracing::error!(%err, base, "freeing an expandable segment's reservation failed");
            }
        }
    }
}
