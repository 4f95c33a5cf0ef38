//! Giving cached memory back to the driver: whole segments (`free_segments`, held by the
//! capture gate of `capturing.rs`, so no free runs while a capture does), the miss path's
//! oversize release, `release_cached` / `release_shard` (`empty_cache`), garbage collection, and
//! what a capture kept from its release, freed with the device core at the end.

use super::state::ReleaseOrder;
use super::{DeviceCore, Shard};
use crate::alloc::history::TraceAction;
use crate::alloc::observers::{SegmentChange, SegmentEvent};
use crate::alloc::size::PoolKind;
use crate::driver::StreamId;
use crate::sync::os::atomic::Ordering;
use crate::sync::os::Mutex;

/// Segments whose release a capture held back: freed by the next release after the captures, or
/// with the device core at the end.
#[derive(Debug, Default)]
pub(super) struct Withheld {
    /// Cached segments taken for release while a capture began: `(stream, base, size)`.
    kept: Mutex<Vec<(StreamId, u64, u64)>>,
    /// Segments a registrar refused while a capture ran: `(base, size)`, never seen by
    /// observers or the trace, freed quietly (`return_unregistered`).
    refused: Mutex<Vec<(u64, u64)>>,
}

impl Withheld {
    /// `segments` of `stream` wait for the next release.
    pub(super) fn keep(&self, stream: StreamId, segments: Vec<(u64, u64)>) {
        self.kept
            .lock()
            .extend(segments.into_iter().map(|(ptr, size)| (stream, ptr, size)));
    }

    /// The segments kept, to free now.
    fn take_kept(&self) -> Vec<(StreamId, u64, u64)> {
        std::mem::take(&mut *self.kept.lock())
    }
}

impl DeviceCore {
    /// Returns segments to the driver (outside every shard lock).
    pub(in crate::alloc) fn free_segments(&self, stream: StreamId, segments: Vec<(u64, u64)>) {
        let Some(_no_capture) = self.wide.capturing.releasing() else {
            // A capture began after these were taken: they wait for the next release.
            self.withheld.keep(stream, segments);
            return;
        };
        self.free_segments_released(stream, segments);
    }

    /// [`Self::free_segments`] for pass-through's frees (`pass_through`), which run on every
    /// free and may run inside the capture gate already: without waiting for the gate, and not
    /// while any capture of the process is under way (a driver free would invalidate it) — then
    /// the segments wait for the next release.
    pub(in crate::alloc) fn free_segments_passing(
        &self,
        stream: StreamId,
        segments: Vec<(u64, u64)>,
    ) {
        if segments.is_empty() {
            return;
        }
        let Some(_no_capture) = self.wide.capturing.releasing_now() else {
            self.withheld.keep(stream, segments);
            return;
        };
        self.free_segments_released(stream, segments);
    }

    /// The driver frees of `segments` and of those withheld before, inside the capture gate.
    fn free_segments_released(&self, stream: StreamId, segments: Vec<(u64, u64)>) {
        self.free_refused();
        let earlier = self.withheld.take_kept();
        let all = earlier
            .into_iter()
            .chain(segments.into_iter().map(|(ptr, size)| (stream, ptr, size)));
        for (stream, ptr, size) in all {
            self.wide.callbacks.registry.unmap(self.device, ptr, size);
            self.wide.callbacks.observers.segment(SegmentEvent {
                change: SegmentChange::Unmap,
                device: self.device,
                base: crate::driver::DeviceAddr(ptr),
                size,
                stream,
            });
            // Traced before the free: NVTX's heap goes before the memory (`nvtx_regions.rs`).
            self.wide
                .trace
                .record(TraceAction::SegmentFree, self.device, ptr, size, stream);
            if let Err(err) = self.driver.free(crate::driver::DeviceAddr(ptr)) {
                tracing::error!(%err, ptr, size, "driver free of a cached segment failed");
            }
            self.reserved.fetch_sub(size, Ordering::SeqCst);
        }
    }

    /// Gives back a segment that a registrar refused before anything else saw it (no observer
    /// was told of it, nothing traced): at once, or with the next release while a capture runs.
    pub(in crate::alloc) fn return_unregistered(&self, ptr: u64, size: u64) {
        self.withheld.refused.lock().push((ptr, size));
        if let Some(_no_capture) = self.wide.capturing.releasing() {
            self.free_refused();
        }
    }

    /// Frees the refused segments waiting (the caller holds the capture gate, or the core is
    /// going away).
    fn free_refused(&self) {
        for (ptr, size) in std::mem::take(&mut *self.withheld.refused.lock()) {
            if let Err(err) = self.driver.free(crate::driver::DeviceAddr(ptr)) {
                tracing::error!(%err, ptr, size, "driver free of a refused segment failed");
            }
            self.reserved.fetch_sub(size, Ordering::SeqCst);
        }
    }

    /// Frees oversize cached segments to make room for `rounded` bytes, as PyTorch's
    /// `release_available_cached_blocks`: the smallest oversize segment of at least `rounded` bytes
    /// if there is one, else oversize segments largest first. Only when `max_split_size` is set.
    /// True when at least `rounded` bytes were freed.
    pub(in crate::alloc) fn release_oversize(&self, rounded: u64) -> bool {
        let max_split = self.config().max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let single = rounded.max(max_split);
        for shard in self.roster.releasable() {
            let taken = self.take_from(
                &shard,
                |b| b.pool == PoolKind::Large && b.size >= single,
                ReleaseOrder::Smallest,
                |f| f > 0,
            );
            if !taken.is_empty() {
                return true;
            }
        }
        let mut freed = 0u64;
        for shard in self.roster.releasable() {
            freed += self
                .take_from(
                    &shard,
                    |b| b.pool == PoolKind::Large && b.size >= max_split,
                    ReleaseOrder::Largest,
                    |f| f + freed >= rounded,
                )
                .iter()
                .map(|s| s.1)
                .sum::<u64>();
            if freed >= rounded {
                break;
            }
        }
        freed >= rounded
    }

    /// Takes cached segments from one shard (see [`ShardState::take_free_segments`]) and returns
    /// them to the driver after unlocking; returns what was released.
    fn take_from(
        &self,
        shard: &Shard,
        select: impl Fn(&crate::alloc::block::Block) -> bool,
        order: ReleaseOrder,
        enough: impl Fn(u64) -> bool,
    ) -> Vec<(u64, u64)> {
        let taken = {
            let mut st = shard.state.lock();
            if !st.releasable() {
                // Retired when listed, taken by a new pool since: the pool's cache now.
                return Vec::new();
            }
            let taken = st.take_free_segments(select, order, enough);
            self.settle(st);
            taken
        };
        self.free_segments(shard.stream(), taken.clone());
        taken
    }

    /// Frees every cached whole segment of the device; with `sync`, first waits for every pending
    /// free's events (PyTorch's `synchronize_and_free_events`). Returns whether anything was freed.
    pub(crate) fn release_cached(&self, sync: bool) -> bool {
        if sync {
            self.counters.count(super::device::Count::SyncAll);
        }
        let mut any = false;
        for shard in self.roster.releasable() {
            any |= self.release_shard(&shard, sync, true);
        }
        self.bury_empty();
        any
    }

    /// Frees every cached whole segment (and free page) of one shard, first waiting for its
    /// pending frees' events with `sync`. Returns whether anything was freed. With
    /// `releasable_only` (a device-wide release over a list of shards made before), nothing when
    /// the shard is a live pool's by the time it is locked ([`ShardState::releasable`]).
    pub(in crate::alloc) fn release_shard(
        &self,
        shard: &Shard,
        sync: bool,
        releasable_only: bool,
    ) -> bool {
        if self.wide.capturing.any() {
            // Releasing synchronizes and frees, which a capture forbids; the next release after
            // the captures gives this memory back.
            return false;
        }
        shard.flush_fronts();
        let taken = {
            let mut st = shard.state.lock();
            if releasable_only && !st.releasable() {
                return false;
            }
            if sync {
                for e in st.pending_events() {
                    if let Err(err) = self.free_events.event_synchronize(e) {
                        tracing::warn!(%err, "event synchronize failed while draining pending frees");
                    }
                }
            }
            self.poll_events(shard, &mut st);
            let taken = st.take_free_segments(|_| true, ReleaseOrder::Largest, |_| false);
            self.settle(st);
            taken
        };
        let any = !taken.is_empty();
        self.free_segments(shard.stream(), taken);
        any | (self.release_pages(shard, |_| true, |_| false, releasable_only) > 0)
    }

    /// Reclaims the oldest cached segments while reserved memory exceeds the threshold share of
    /// the allowed memory (only with `garbage_collection_threshold` and a memory fraction).
    pub(in crate::alloc) fn garbage_collect(&self) {
        let threshold = self.config().garbage_collection_threshold;
        let Some((_, allowed)) = self.fraction().filter(|_| threshold > 0.0) else {
            return;
        };
        let limit = (allowed as f64 * threshold) as u64;
        let reserved = self.reserved.load(Ordering::SeqCst);
        if reserved <= limit {
            return;
        }
        let target = reserved - limit;
        let mut freed = 0u64;
        for shard in self.roster.releasable() {
            freed += self
                .take_from(
                    &shard,
                    |_| true,
                    ReleaseOrder::Oldest,
                    |f| f + freed >= target,
                )
                .iter()
                .map(|s| s.1)
                .sum::<u64>();
            let so_far = freed;
            freed += self.release_pages(&shard, |_| true, |f| f + so_far >= target, true);
            if freed >= target {
                break;
            }
        }
    }
}

impl Drop for DeviceCore {
    /// Segments a capture kept from their release (`unfreed`) go back with the device core.
    fn drop(&mut self) {
        if !self.birth.is_current() {
            return;
        }
        self.free_refused();
        for (stream, ptr, size) in self.withheld.take_kept() {
            self.wide.callbacks.registry.unmap(self.device, ptr, size);
            self.wide
                .trace
                .record(TraceAction::SegmentFree, self.device, ptr, size, stream);
            if let Err(err) = self.driver.free(crate::driver::DeviceAddr(ptr)) {
                tracing::error!(%err, ptr, size, "driver free of a cached segment failed");
            }
        }
    }
}
