//! One device of the caching allocator: its shards (one per stream) and the device-wide paths that
//! visit them — the cache-miss sequence, garbage collection, `empty_cache`, stats, snapshots.
//!
//! Locking: a thread holds at most one shard lock at a time. The hit path locks only its own shard.
//! The miss path drops its shard lock before any device-wide step (callbacks, garbage collection,
//! releasing other shards' cached segments), so two threads on different streams never wait for
//! each other except while both are short of memory. Driver `free` calls happen outside every shard
//! lock (on the host backend `free` drains every stream).
//!
//! Miss path (PyTorch's order): poll completed events → best fit → free-memory callbacks, and best
//! fit again if one freed something → garbage collection (when a threshold and a memory fraction
//! are set) → with `cross_stream_reuse` on, another stream's idle memory (`cross_stream.rs`) →
//! driver malloc (within the per-process fraction) → free oversize cached segments and
//! malloc again → wait for every pending event, free every cached segment of the device, best fit
//! and malloc again → out-of-memory error.

use crate::driver::capability::relaxed;

use super::snapshot::SnapshotSegment;
use super::state::ReleaseOrder;
use super::ShardState;
use super::{DeviceCore, Shard};
use crate::alloc::block::{Allocated, BlockId};
use crate::alloc::capturing::CaptureRoutes;
use crate::alloc::history::{Trace, TraceAction};
use crate::alloc::observers::{OutOfMemoryEvent, SegmentChange, SegmentEvent};
use crate::alloc::oom::{self, Callbacks};
use crate::alloc::pool_id::{MemPoolId, TagPhases};
use crate::alloc::registration::RegionKind;
use crate::alloc::size::{self, PoolKind};
use crate::alloc::stats::DeviceStats;
use crate::config::cell::ConfigCell;
use crate::config::AllocatorConfig;
use crate::driver::{Driver, EventFlags, EventId, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, ShortMutexGuard};

/// What an allocator's devices share: callbacks, history, captures and tags.
#[derive(Clone)]
pub(crate) struct AllocatorWide {
    pub callbacks: Arc<Callbacks>,
    pub trace: Arc<Trace>,
    pub capturing: Arc<CaptureRoutes>,
    pub tags: Arc<dyn TagPhases>,
}

/// The device-wide counts no shard keeps, in PyTorch's statistics.
#[derive(Debug, Default)]
pub(super) struct Counters {
    alloc_retries: AtomicU64,
    ooms: AtomicU64,
    sync_all: AtomicU64,
    cross_stream: AtomicU64,
}

/// One of the [`Counters`].
#[derive(Clone, Copy, Debug)]
pub(super) enum Count {
    /// `num_alloc_retries`: a miss that freed cached memory and tried again.
    AllocRetry,
    /// `num_ooms`: an allocation that failed.
    Oom,
    /// `num_sync_all_streams`: a release that waited for every stream.
    SyncAll,
    /// `num_cross_stream_reuses`: idle memory that moved between streams.
    CrossStream,
}

impl Counters {
    /// One more of `which`.
    pub(super) fn count(&self, which: Count) {
        let counter = match which {
            Count::AllocRetry => &self.alloc_retries,
            Count::Oom => &self.ooms,
            Count::SyncAll => &self.sync_all,
            Count::CrossStream => &self.cross_stream,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds the counts to `stats`.
    fn add_to(&self, stats: &mut DeviceStats) {
        stats.num_alloc_retries += self.alloc_retries.load(Ordering::Relaxed);
        stats.num_ooms += self.ooms.load(Ordering::Relaxed);
        stats.num_sync_all_streams += self.sync_all.load(Ordering::Relaxed);
        stats.num_cross_stream_reuses += self.cross_stream.load(Ordering::Relaxed);
    }

    /// Back to zero (`reset_accumulated_memory_stats`).
    fn reset(&self) {
        for counter in [
            &self.alloc_retries,
            &self.ooms,
            &self.sync_all,
            &self.cross_stream,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
    }
}

/// One allocation request, made once at the door ([`DeviceCore::allocate`]) and passed through
/// the whole miss path (PyTorch's `AllocParams`): the size asked for and its rounded size; the
/// pool kind that serves it and the segment size of a miss are derived from them. Two words,
/// passed by value: in registers on the hit path.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    /// The bytes asked for.
    pub(super) requested: u64,
    /// `requested` rounded (`size::round_size`).
    pub(super) rounded: u64,
}

impl Request {
    /// The request for `requested` bytes under `config`'s rounding.
    #[inline]
    pub(super) fn new(requested: u64, core: &DeviceCore) -> Self {
        Request {
            requested,
            rounded: core.round(requested),
        }
    }

    /// The small or large pool.
    #[inline]
    pub(super) fn pool(self) -> PoolKind {
        PoolKind::for_size(self.rounded)
    }
}

impl DeviceCore {
    /// The device this core serves.
    #[inline]
    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// Whether a capture or a live graph holds `pool` (its free blocks are the graphs').
    pub(crate) fn held_by_graphs(&self, pool: MemPoolId) -> bool {
        self.wide.capturing.held_by_graphs(pool)
    }

    pub(crate) fn new(
        device: usize,
        driver: Arc<dyn Driver>,
        config: AllocatorConfig,
        wide: AllocatorWide,
        check_invariants: bool,
    ) -> Result<Self> {
        let capacity = driver.mem_info(device)?.total;
        Ok(DeviceCore {
            device,
            birth: Birth::now(),
            sanitizer: driver.sanitizer(),
            free_events: driver.unsanitized().unwrap_or_else(|| Arc::clone(&driver)),
            driver,
            wide,
            check_invariants,
            capacity,
            withheld: Default::default(),
            reserved: AtomicU64::new(0),
            roster: Default::default(),
            events: Mutex::new(Vec::new()),
            counters: Counters::default(),
            books: Default::default(),
            config: ConfigCell::new(config),
        })
    }

    /// The configuration in force (as of this call), for the paths off the hot one: the hot
    /// paths read the rounding ([`Request::new`]) and, under a shard's lock, its fit rules
    /// (`config/cell.rs`).
    pub(in crate::alloc) fn config(&self) -> Arc<AllocatorConfig> {
        self.config.get()
    }

    /// `requested` rounded by the configuration in force (one atomic load).
    #[inline]
    pub(in crate::alloc) fn round(&self, requested: u64) -> u64 {
        size::round_size_by(requested, |size| self.config.divisions_for(size))
    }

    /// Makes `config` the configuration in force (`alloc/reconfigure.rs`, which checked it):
    /// the device's cell, then every shard's fit rules, under the map's write lock (no shard is
    /// made, retired or taken from the retired list meanwhile; a shard made before reads the new
    /// cell when the lock is released — `shard_in` reads it under the lock).
    pub(in crate::alloc) fn publish_config(&self, config: AllocatorConfig) {
        let rules = config.fit_rules();
        let shards = self.roster.write();
        self.config.publish(config);
        for shard in shards.all() {
            shard.state.lock().rules = rules;
        }
    }

    /// The per-process memory cap in force on this device, if any — (fraction, bytes) — as
    /// the configuration in force says (`AllocatorConfig::memory_fraction`: the setting's one
    /// home, which `set_per_process_memory_fraction` and overrides change).
    pub(in crate::alloc) fn fraction(&self) -> Option<(f64, u64)> {
        let f = self.config().memory_fraction(self.device)?;
        Some((f, (self.capacity as f64 * f) as u64))
    }

    /// Ends a change of a shard's state: checks the invariants (when asked), tells a pool's book
    /// (`pool_peaks.rs`), releases the lock, and reconciles the device's peaks if a statistic
    /// went past its budget (`peaks.rs`).
    pub(in crate::alloc) fn settle(&self, mut state: ShortMutexGuard<'_, ShardState>) {
        self.verify(&state);
        if state.pooled {
            self.books.tell_pool(&mut state);
        }
        let over = state.take_over_budget();
        drop(state);
        if over {
            self.reconcile_peaks();
        }
    }

    /// [`Self::settle`] for a caller that owns nothing of the shard once `state` is unlocked (a
    /// free): the peaks are reconciled through a reference taken under the lock, since the shard
    /// and this core may be dropped by another thread as soon as the lock is released.
    pub(in crate::alloc) fn settle_leaving(
        core: &Arc<Self>,
        mut state: ShortMutexGuard<'_, ShardState>,
    ) {
        core.verify(&state);
        if state.pooled {
            core.books.tell_pool(&mut state);
        }
        let over = state.take_over_budget();
        let kept = over.then(|| Arc::clone(core));
        drop(state);
        if let Some(core) = kept {
            core.reconcile_peaks();
        }
    }

    /// Counts `len` more bytes as reserved on the device, unless that passes the per-process
    /// memory fraction (then `false`, nothing counted).
    pub(in crate::alloc) fn try_reserve(&self, len: u64) -> bool {
        let limit = self.fraction().map_or(u64::MAX, |(_, allowed)| allowed);
        self.reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
                r.checked_add(len).filter(|&n| n <= limit)
            })
            .is_ok()
    }

    pub(in crate::alloc) fn verify(&self, state: &ShardState) {
        if self.check_invariants && !std::thread::panicking() {
            if let Err(broken) = state.check_invariants() {
                // A test asked for this check: a violated invariant is a bug to stop at.
                panic!(
                    "cudalloc invariant violated on device {}: {broken}",
                    self.device
                );
            }
        }
    }

    #[inline]
    pub(in crate::alloc) fn poll_events(&self, shard: &Shard, state: &mut ShardState) {
        // No query while a capture runs: it could be a forbidden call (`capturing.rs`).
        if state.has_pending() && !self.wide.capturing.any() {
            self.complete_pending(shard, state);
        }
    }

    #[cold]
    fn complete_pending(&self, shard: &Shard, state: &mut ShardState) {
        let (events, freed) = state.complete_events(|e| self.free_events.event_query(e));
        self.events.lock().extend(events);
        for (addr, size) in freed {
            self.wide.trace.record(
                TraceAction::FreeCompleted,
                self.device,
                addr,
                size,
                shard.stream(),
            );
        }
    }

    /// Best fit in the shard (after polling its events), allocating on success.
    pub(super) fn try_fit(&self, shard: &Shard, req: Request) -> Option<Allocated> {
        let Request { requested, rounded } = req;
        let pool = req.pool();
        let mut st = shard.state.lock();
        // Under the lock: a tag falling asleep sets the flag before it locks to list what to
        // offload, so this sees it or the sleep sees the block (`sleep.rs`).
        if shard.sleeping.load(Ordering::Relaxed) {
            return None;
        }
        self.poll_events(shard, &mut st);
        if self.config.pass_through() && st.releasable() {
            // Nothing is cached: what the poll freed goes back to the driver, and the request
            // gets memory of its own (`new_memory`).
            let freed = st.take_free_segments(|_| true, ReleaseOrder::Largest, |_| false);
            let stream = shard.stream();
            self.settle(st);
            self.free_segments_passing(stream, freed);
            return None;
        }
        let id = st.allocate_best_fit(pool, rounded, requested)?;
        self.hand_out_fit(shard, st, id, rounded)
    }

    /// The end of a fit: the block `id` just handed out under `st`, settled and recorded.
    #[inline]
    pub(super) fn hand_out_fit(
        &self,
        shard: &Shard,
        st: ShortMutexGuard<'_, ShardState>,
        id: BlockId,
        rounded: u64,
    ) -> Option<Allocated> {
        let out = st.allocated(id, rounded);
        self.settle(st);
        self.record_alloc(shard, out.ptr, rounded);
        Some(out)
    }

    /// Records an allocation of `rounded` bytes at `ptr` in the history (when it is on).
    #[inline]
    pub(in crate::alloc) fn record_alloc(&self, shard: &Shard, ptr: u64, rounded: u64) {
        self.wide.trace.record(
            TraceAction::Alloc,
            self.device,
            ptr,
            rounded,
            shard.stream(),
        );
    }

    /// Records the free of `rounded` bytes at `ptr` that a front cache took (requested and
    /// completed at once, as a free with no other stream is).
    pub(in crate::alloc) fn record_front_free(&self, shard: &Shard, ptr: u64, rounded: u64) {
        for action in [TraceAction::FreeRequested, TraceAction::FreeCompleted] {
            self.wide
                .trace
                .record(action, self.device, ptr, rounded, shard.stream());
        }
    }

    /// A block for `requested` bytes from this thread's front cache of `shard` (`front.rs`).
    #[inline]
    pub(crate) fn take_from_front(&self, shard: &Shard, requested: u64) -> Option<Allocated> {
        if requested > size::MAX_REQUEST {
            return None;
        }
        let rounded = self.round(requested);
        let (block, ptr) =
            super::thread::take_from_front(shard, crate::alloc::front::class_of(rounded)?)?;
        self.record_alloc(shard, ptr, rounded);
        Some(Allocated {
            block,
            ptr,
            rounded,
            // A front cache holds only blocks no other stream used (`handover.rs`).
            front: true,
        })
    }

    /// Allocates `requested` bytes on `shard`'s stream.
    ///
    /// When the whole sequence finds no memory, a pool made with `use_on_oom` may lend a free
    /// block of its own on the same stream: the block is that pool's shard's, which `lender`
    /// then holds (the caller's `DataPtr` must be owned by it).
    pub(crate) fn allocate(
        &self,
        shard: &Shard,
        requested: u64,
        lender: &mut Option<Arc<Shard>>,
    ) -> Result<Allocated> {
        size::check_request(self.device, requested)?;
        // A sleeping tag's shard: `try_fit` finds nothing (it reads the flag under the lock)
        // and the slow path says why — no load here on the hot path.
        let req = Request::new(requested, self);
        if let Some(hit) = self.try_fit(shard, req) {
            return Ok(hit);
        }
        self.allocate_slow(shard, req, lender)
    }

    fn allocate_slow(
        &self,
        shard: &Shard,
        req: Request,
        lender: &mut Option<Arc<Shard>>,
    ) -> Result<Allocated> {
        if shard.sleeping.load(Ordering::Acquire) {
            // The shard's tag sleeps (`try_fit` saw it under the lock): refused, not a miss.
            return Err(self.asleep_error(shard, "an allocation"));
        }
        if self.wide.capturing.any() {
            return self.allocate_while_capturing(shard, req);
        }
        // Passing through, a miss is every allocation's way: no cache to collect, reuse or lend
        // from, and the free-memory callbacks wait for an out-of-memory.
        let passing = self.config.pass_through() && shard.serves_default_pool();
        if !passing {
            if self.wide.callbacks.run() {
                if let Some(hit) = self.try_fit(shard, req) {
                    return Ok(hit);
                }
            }
            self.garbage_collect();
            if let Some((lending, hit)) = self.reuse_across_streams(shard, req) {
                *lender = lending;
                return Ok(hit);
            }
        }
        let mut cause = None;
        if let Some(hit) = self.new_memory(shard, req, &mut cause)? {
            return Ok(hit);
        }
        if self.release_oversize(req.rounded) {
            if let Some(hit) = self.new_memory(shard, req, &mut cause)? {
                return Ok(hit);
            }
        }
        if passing {
            // What the callbacks free (IPC limbo, a library's caches) goes back to the driver
            // with the release below.
            self.wide.callbacks.run();
        }
        self.release_cached(true);
        self.counters.count(Count::AllocRetry);
        if let Some(hit) = self.try_fit(shard, req) {
            return Ok(hit);
        }
        if let Some(hit) = self.new_memory(shard, req, &mut cause)? {
            return Ok(hit);
        }
        if !passing {
            if let Some((lending, hit)) = self.lend(shard, req) {
                *lender = Some(lending);
                return Ok(hit);
            }
        }
        Err(self.out_of_memory(shard, req, cause))
    }

    /// A miss while a capture is under way (`capturing.rs`): the driver's allocation alone —
    /// with this thread's capture mode relaxed when the shard's stream is capturing — and else
    /// out of memory (callbacks, garbage collection and releases would query, synchronize and
    /// free, which a capture forbids).
    #[cold]
    fn allocate_while_capturing(&self, shard: &Shard, req: Request) -> Result<Allocated> {
        let mut cause = None;
        let capturing = self
            .driver
            .graphs()
            .stream_capture_status(shard.stream())
            .is_ok_and(|s| s.is_capturing());
        let got = if capturing {
            relaxed(self.driver.graphs(), || {
                self.new_memory(shard, req, &mut cause)
            })
        } else {
            self.new_memory(shard, req, &mut cause)
        };
        if let Some(hit) = got? {
            return Ok(hit);
        }
        let cause = Some(format!(
            "{} (during a stream capture: cached memory is not released while one is under way)",
            cause.as_deref().unwrap_or("the device has no room")
        ));
        Err(self.out_of_memory(shard, req, cause))
    }

    /// The end of a miss that found no memory: counted, traced, told to the observers, and the
    /// error PyTorch's message describes.
    #[cold]
    fn out_of_memory(&self, shard: &Shard, req: Request, cause: Option<String>) -> Error {
        let requested = req.requested;
        self.counters.count(Count::Oom);
        let stats = self.stats();
        let free = self.driver.mem_info(self.device).map_or(0, |m| m.free);
        self.wide
            .trace
            .record_oom(self.device, requested, shard.stream(), free);
        let mut facts = OutOfMemoryEvent {
            device: self.device,
            requested,
            capacity: self.capacity,
            free,
            allocated: stats.allocated_bytes.all.current as u64,
            reserved: stats.reserved_bytes.all.current as u64,
            fraction: self.fraction(),
            cause,
            ..OutOfMemoryEvent::default()
        };
        self.explain(shard, req, &mut facts);
        self.wide.callbacks.observers.out_of_memory(&facts);
        oom::out_of_memory(&facts, &self.config())
    }

    /// Records the events of block `id` of `st` (the shard of `stream`), freed while used by
    /// `uses` (one per stream); a stream whose event cannot be recorded is synchronized instead —
    /// and when none could be, the block is free now, and traced so.
    pub(in crate::alloc) fn insert_free_events(
        &self,
        st: &mut ShardState,
        stream: StreamId,
        id: BlockId,
        uses: Vec<StreamId>,
    ) {
        let (ptr, size) = (st.blocks[id].ptr, st.blocks[id].size);
        for stream in uses {
            match self.record_free_event(stream) {
                Ok(event) => st.add_pending(id, stream, event),
                Err(err) => {
                    tracing::warn!(%err, "could not record a free event; synchronizing the stream instead");
                    if let Err(err) = self.free_events.stream_synchronize(stream) {
                        tracing::error!(%err, "stream synchronize failed too; freeing anyway");
                    }
                }
            }
        }
        if st.finish_pending_without_events(id) {
            // Found by review: freed here untraced, the block kept its NVTX region.
            self.wide
                .trace
                .record(TraceAction::FreeCompleted, self.device, ptr, size, stream);
        }
    }

    /// The last capture ended: the frees deferred meanwhile get their events now.
    pub(in crate::alloc) fn flush_deferred(&self) {
        for shard in self.roster.all() {
            let mut st = shard.state.lock();
            if st.deferred.is_empty() {
                continue;
            }
            // Under the shard's lock (the order every free takes them in): no capture begins
            // while the events are recorded, and one that began since the last ended keeps them
            // deferred until its own end.
            let _ordering = self.wide.capturing.ordering();
            if self.wide.capturing.any() {
                continue;
            }
            for (id, uses) in std::mem::take(&mut st.deferred) {
                self.insert_free_events(&mut st, shard.stream(), id, uses);
            }
        }
    }

    /// New memory for a miss: a new segment, or with `expandable_segments` more pages of the
    /// shard's expandable segment (`expandable.rs`).
    fn new_memory(
        &self,
        shard: &Shard,
        req: Request,
        cause: &mut Option<String>,
    ) -> Result<Option<Allocated>> {
        if self.config().expandable_segments || shard.state.lock().pool_options.expandable_segments
        {
            self.grow_expandable(shard, req, cause)
        } else {
            self.allocate_segment(shard, req, cause)
        }
    }

    /// Gets a segment from the driver (within the memory fraction) and allocates from it.
    /// `Ok(None)` when the device (or the fraction) is out of memory; the driver's own explanation,
    /// when it gave one, goes to `cause` (the final error quotes it).
    fn allocate_segment(
        &self,
        shard: &Shard,
        req: Request,
        cause: &mut Option<String>,
    ) -> Result<Option<Allocated>> {
        let Request { requested, rounded } = req;
        let pool = req.pool();
        // Passing through, an allocation is a segment of its own size: nothing is left over to
        // cache (memory pools keep their sizes: a graph's replays reuse its memory).
        let seg = if self.config.pass_through() && shard.serves_default_pool() {
            rounded
        } else {
            size::segment_size(rounded)
        };
        let held: Option<ShortMutexGuard<'_, ShardState>> =
            (!self.config().release_lock_on_cudamalloc).then(|| shard.state.lock());
        if !self.try_reserve(seg) {
            return Ok(None);
        }
        let ptr = match self.driver.malloc(self.device, seg) {
            Ok(ptr) => ptr,
            Err(err) => {
                self.reserved.fetch_sub(seg, Ordering::SeqCst);
                return match err {
                    Error::OutOfMemory { message, .. } => {
                        *cause = Some(message);
                        Ok(None)
                    }
                    other => Err(other),
                };
            }
        };
        // Registered before any block of it is handed out (`registration.rs`).
        if let Err(err) = self.wide.callbacks.registry.map(
            self.device,
            shard.stream(),
            RegionKind::Segment,
            [(ptr.0, seg)],
        ) {
            drop(held);
            self.return_unregistered(ptr.0, seg);
            return Err(err);
        }
        let mut st = held.unwrap_or_else(|| shard.state.lock());
        let head = st.add_segment(ptr.0, seg, pool);
        let id = st.allocate(head, rounded, requested);
        let out = st.allocated(id, rounded);
        let pool_id = st.pool;
        self.settle(st);
        self.wide.callbacks.observers.segment(SegmentEvent {
            change: SegmentChange::Map,
            device: self.device,
            base: ptr,
            size: seg,
            stream: shard.stream(),
        });
        self.wide.trace.record_mapped(
            TraceAction::SegmentAlloc,
            self.device,
            ptr.0,
            seg,
            shard.stream(),
            pool_id,
        );
        self.record_alloc(shard, ptr.0, rounded);
        Ok(Some(out))
    }

    /// An event for a pending free, recorded on `stream`.
    pub(crate) fn record_free_event(&self, stream: StreamId) -> Result<EventId> {
        let pooled = self.events.lock().pop();
        let event = match pooled {
            Some(e) => e,
            None => self
                .free_events
                .event_create(self.device, EventFlags::default())?,
        };
        if let Err(err) = self.free_events.event_record(event, stream) {
            self.events.lock().push(event);
            return Err(err);
        }
        Ok(event)
    }

    /// The device's stats: the sum of its shards' plus device-wide counters.
    pub(crate) fn stats(&self) -> DeviceStats {
        let mut total = self.exact_stats(false);
        for shard in self.roster.all() {
            shard.hide_fronts(&mut total);
        }
        self.counters.add_to(&mut total);
        total.max_split_size = i64::try_from(self.config().max_split_size).unwrap_or(-1);
        total
    }

    /// Resets peaks (`peaks`) or accumulated counts (`!peaks`) in every shard.
    pub(crate) fn reset_stats(&self, peaks: bool) {
        if peaks {
            // Peaks are the device's (`peaks.rs`): they restart from the currents there.
            self.exact_stats(true);
            return;
        }
        for shard in self.roster.all() {
            let mut st = shard.state.lock();
            st.stats.reset_accumulated();
            st.pool_base.reset_accumulated();
        }
        self.counters.reset();
        self.books.reset_departed();
    }

    /// Appends every segment of the device to `out`.
    pub(crate) fn snapshot_into(&self, out: &mut Vec<SnapshotSegment>) {
        for shard in self.roster.all() {
            shard.segments_into(out);
        }
    }

    /// Checks every shard's invariants.
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        self.roster
            .all()
            .iter()
            .try_for_each(|s| s.state.lock().check_invariants())
    }

    /// Bytes of segments currently held from the driver.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.reserved.load(Ordering::SeqCst)
    }

    /// Empties the cache and detaches the shards (allocator teardown). Live blocks keep their shard
    /// alive; their segments are returned when the shard drops.
    pub(crate) fn shutdown(&self) {
        for shard in self.roster.all() {
            shard.retire_fronts();
        }
        self.release_cached(true);
        let events: Vec<_> = std::mem::take(&mut *self.events.lock());
        for e in events {
            if let Err(err) = self.free_events.event_destroy(e) {
                tracing::debug!(%err, "destroying a cached event at the allocator's shutdown failed");
            }
        }
        for shard in self.roster.drain() {
            Shard::orphan(shard);
        }
    }
}
