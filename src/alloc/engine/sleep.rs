//! Sleep and wake of a tag's shards: every mapped page of their expandable segments unmapped and
//! its physical memory released, the reservations kept — then pages created and mapped back at
//! the same addresses. `tags.rs` runs the protocol over a tag's shards; the runtime copies the
//! offloaded bytes (`runtime/sleep.rs`).
//!
//! A tag's pool always lives on expandable segments (`MemPoolOptions::expandable_segments`),
//! which is what makes this possible: its blocks' addresses are in a reservation, independent of
//! the chunks mapped under them.
//!
//! | segment state | `ExpandablePages` | blocks | reserved bytes (stats, device) | registrars |
//! |---|---|---|---|---|
//! | awake | `chunks`: the mapped pages; `asleep: None` | as ever | count the mapped pages | each page registered |
//! | asleep | `chunks` empty; `asleep`: the pages to map back | unchanged: allocated blocks stay allocated (their owners hold the addresses), free ones stay free but are never handed out (the shard refuses allocations) | no longer count them | deregistered before the unmap |
//!
//! What keeps the segment's free blocks and pages out of every other path while it sleeps: the
//! shard's `sleeping` flag refuses allocations (read under the shard's lock), the release
//! paths skip asleep segments (`take_free_pages`), growth plans skip them, and `pages_under`
//! (sharing) refuses them. Frees proceed: a block freed while asleep becomes free as usual, and
//! the wake leaves its bytes undefined (only blocks still allocated get their bytes back).
//!
//! The stream sanitizer is told of each sleeping range: an access to it is reported and refused
//! (`driver/sanitizer/asleep.rs`).

use std::collections::BTreeMap;

use super::expandable::PageRelease;
use super::ShardState;
use super::{DeviceCore, Shard};
use crate::alloc::block::BlockState;
use crate::alloc::history::TraceAction;
use crate::alloc::observers::{SegmentChange, SegmentEvent};
use crate::alloc::registration::RegionKind;
use crate::alloc::stats;
use crate::driver::{ChunkId, DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::Ordering;

/// The pages of one segment taken for sleep or mapped for a wake: the segment's base, its page
/// size, and `(address, chunk)`s.
type SegmentPages = (u64, u64, Vec<(u64, ChunkId)>);

impl ShardState {
    /// The streams a sleep waits for: `own`, every stream recorded on an allocated or pending
    /// block, every stream with pending-free events.
    pub(crate) fn sleep_streams(&self, own: StreamId) -> Vec<StreamId> {
        let mut streams = vec![own];
        for (_, b) in &self.blocks {
            if matches!(b.state, BlockState::Allocated | BlockState::PendingFree) {
                streams.extend(b.stream_uses.iter().copied());
            }
        }
        streams.extend(self.pending.keys().copied());
        streams.sort_unstable_by_key(|s| s.raw());
        streams.dedup();
        streams
    }

    /// The allocated blocks now, `(address, size)` by address: the bytes a wake restores.
    pub(crate) fn allocated_ranges(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.state == BlockState::Allocated)
            .map(|(_, b)| (b.ptr, b.size))
            .collect();
        out.sort_unstable();
        out
    }

    /// Puts every expandable segment of the shard to sleep: its mapped pages leave `chunks` (for
    /// the caller to unmap and release) and are remembered for the wake; reserved bytes drop by
    /// them.
    pub(crate) fn take_pages_for_sleep(&mut self) -> Vec<SegmentPages> {
        let mut out = Vec::new();
        for (base, pages) in self.expandable.iter_mut() {
            let Some(pool) = self.segments.get(base).map(|s| s.pool) else {
                continue;
            };
            if pages.asleep.is_some() {
                continue;
            }
            let taken: Vec<(u64, ChunkId)> =
                std::mem::take(&mut pages.chunks).into_iter().collect();
            pages.asleep = Some(taken.iter().map(|&(at, _)| at).collect());
            if !taken.is_empty() {
                let len = taken.len() as u64 * pages.page;
                stats::decrease(&mut self.stats.reserved_bytes, pool, len);
                self.stats.num_device_free += 1;
            }
            out.push((*base, pages.page, taken));
        }
        out
    }

    /// The asleep segments' pages to map back: `(base, page size, addresses)`.
    pub(crate) fn pages_to_wake(&self) -> Vec<(u64, u64, Vec<u64>)> {
        self.expandable
            .iter()
            .filter_map(|(&base, p)| p.asleep.as_ref().map(|a| (base, p.page, a.clone())))
            .collect()
    }

    /// The pages of asleep segment `base` are mapped again with `chunks`: awake.
    pub(crate) fn commit_wake(&mut self, base: u64, chunks: Vec<(u64, ChunkId)>) {
        let Some(pool) = self.segments.get(&base).map(|s| s.pool) else {
            return;
        };
        let Some(pages) = self.expandable.get_mut(&base) else {
            return;
        };
        pages.asleep = None;
        let len = chunks.len() as u64 * pages.page;
        pages.chunks.extend(chunks);
        if len > 0 {
            self.over_budget |= stats::increase(&mut self.stats.reserved_bytes, pool, len);
            self.stats.num_device_alloc += 1;
        }
    }

    /// Teardown of a shard whose segments still sleep (the allocator dropped before the wake):
    /// those that hold no allocated block are removed, their `(base, size)` returned for the
    /// caller to free the reservations (no page is mapped) and tell the sanitizer.
    pub(crate) fn take_asleep_segments(&mut self) -> Vec<(u64, u64)> {
        let idle: Vec<u64> = self
            .expandable
            .iter()
            .filter(|(_, p)| p.asleep.is_some())
            .map(|(&base, _)| base)
            .filter(|&base| {
                self.blocks.iter().all(|(_, b)| {
                    b.segment != base || matches!(b.state, BlockState::Free | BlockState::Unmapped)
                })
            })
            .collect();
        let mut out = Vec::with_capacity(idle.len());
        for base in idle {
            if let Some(size) = self.segments.get(&base).map(|s| s.size) {
                out.push((base, size));
            }
            self.remove_segment_blocks(base);
            self.expandable.remove(&base);
        }
        out
    }

    /// Removes segment `base` and all its blocks (free or unmapped), counting it out.
    fn remove_segment_blocks(&mut self, base: u64) {
        let Some(seg) = self.segments.remove(&base) else {
            return;
        };
        let mut at = Some(seg.head);
        while let Some(id) = at {
            at = self.blocks[id].next;
            if self.blocks[id].state == BlockState::Free {
                self.remove_free(id);
            }
            self.blocks.remove(id);
        }
        stats::decrease(&mut self.stats.segment, seg.pool, 1);
    }
}

/// A shard's part in its tag's sleep, for the tag's steps (`tags.rs`).
impl Shard {
    /// Refuses (or admits again) the shard's allocations: its tag falls asleep (or woke).
    pub(crate) fn set_sleeping(&self, asleep: bool) {
        self.sleeping.store(asleep, Ordering::SeqCst);
    }

    /// Bytes of the shard's live segments.
    pub(crate) fn reserved_bytes(&self) -> i64 {
        self.state.lock().stats.reserved_bytes.all.current
    }

    /// The streams a sleep waits for (see [`ShardState::sleep_streams`]), but those destroyed
    /// since they used the shard's memory: nothing of theirs is left to wait for
    /// ([`DeviceCore::stream_gone`]).
    pub(crate) fn sleep_streams(&self) -> Vec<StreamId> {
        let mut streams = self.state.lock().sleep_streams(self.stream());
        streams.retain(|&s| !self.core.stream_gone(s));
        streams
    }

    /// The stream the allocator's own copies of this shard's bytes run on (a tag's offload and
    /// restore): the shard's, unless it was destroyed — its blocks stay valid — and then `live`,
    /// a stream of the device the driver still knows.
    pub(crate) fn copy_stream(&self, live: impl FnOnce() -> Result<StreamId>) -> Result<StreamId> {
        if self.core.stream_gone(self.stream()) {
            live()
        } else {
            Ok(self.stream())
        }
    }

    /// Calls `offload` with `(address, size)` of every allocated block, by address, under the
    /// shard's lock: a free racing the sleep waits for it, and its stream orders it after the
    /// copies `offload` enqueued on the shard's stream.
    pub(crate) fn offload_allocated(
        &self,
        mut offload: impl FnMut(u64, u64) -> Result<()>,
    ) -> Result<()> {
        let st = self.state.lock();
        for (addr, len) in st.allocated_ranges() {
            offload(addr, len)?;
        }
        Ok(())
    }

    /// The allocated blocks now, `(address, size)` by address.
    pub(crate) fn allocated_ranges(&self) -> Vec<(u64, u64)> {
        self.state.lock().allocated_ranges()
    }

    /// Adds the pages mapped now under the shard's expandable segments to `out`: address → chunk.
    pub(crate) fn mapped_pages_into(&self, out: &mut BTreeMap<u64, ChunkId>) {
        let st = self.state.lock();
        for pages in st.expandable.values() {
            out.extend(pages.chunks.iter().map(|(&at, &c)| (at, c)));
        }
    }
}

impl DeviceCore {
    /// The error of a refused use of sleeping memory of `shard`'s pool.
    pub(in crate::alloc) fn asleep_error(&self, shard: &Shard, what: &str) -> Error {
        if shard.finished.load(Ordering::SeqCst) {
            // A buried shard refuses allocations the same way (`DeviceCore::bury_empty`).
            return Error::invalid(format!(
                "{what} on device {}: stream {} was destroyed",
                self.device,
                shard.stream().raw()
            ));
        }
        let pool = shard.state.lock().pool;
        let tag = self
            .wide
            .tags
            .name_of(pool)
            .map_or_else(|| pool.to_string(), |n| n.to_string());
        Error::Asleep {
            tag,
            message: format!(
                "{what} on device {}: the tag's memory is asleep (its pages are given back); \
                 wake_up the tag first",
                self.device
            ),
        }
    }

    /// Unmaps and releases every mapped page of `shard`'s expandable segments, keeping the
    /// reservations (`tag` names them to the sanitizer); returns the bytes given back. Pages
    /// are deregistered first; a failing unmap is logged, as on the release paths.
    pub(in crate::alloc) fn sleep_shard(&self, shard: &Shard, tag: &str) -> u64 {
        let taken = {
            let mut st = shard.state.lock();
            let taken = st.take_pages_for_sleep();
            self.verify(&st);
            taken
        };
        // Runs of neighbouring pages: one release each, unmapped in one call.
        let runs: Vec<PageRelease> = taken
            .iter()
            .flat_map(|&(_, page, ref pages)| {
                pages
                    .chunk_by(move |a, b| b.0 == a.0 + page)
                    .map(move |run| (run[0].0, page * run.len() as u64, run.to_vec()))
            })
            .collect();
        let spans: Vec<(u64, u64)> = runs.iter().map(|&(at, len, _)| (at, len)).collect();
        self.free_pages(shard.stream(), runs);
        if let Some(sanitizer) = &self.sanitizer {
            for &(at, len) in &spans {
                sanitizer.asleep(at, len, tag);
            }
        }
        self.tell_peaks(shard);
        spans.iter().map(|&(_, len)| len).sum()
    }

    /// Maps fresh pages back under `shard`'s asleep segments, at the same addresses, and
    /// registers them; returns the bytes mapped. All or nothing: on a failure (out of memory,
    /// a registrar) what was mapped is given back and the segments stay asleep.
    pub(in crate::alloc) fn wake_shard(&self, shard: &Shard) -> Result<u64> {
        let plan = shard.state.lock().pages_to_wake();
        let total: u64 = plan.iter().map(|(_, page, a)| page * a.len() as u64).sum();
        if !self.try_reserve(total) {
            return Err(Error::OutOfMemory {
                device: self.device,
                requested: total,
                message: format!("waking {total} bytes would pass the per-process memory fraction"),
            });
        }
        let mut mapped: Vec<SegmentPages> = Vec::new();
        let mut failure = None;
        'segments: for (base, page, addresses) in &plan {
            let mut chunks = Vec::with_capacity(addresses.len());
            for &at in addresses {
                match self.map_fresh_page(at, *page) {
                    Ok(chunk) => chunks.push((at, chunk)),
                    Err(err) => {
                        failure = Some(err);
                        mapped.push((*base, *page, chunks));
                        break 'segments;
                    }
                }
            }
            mapped.push((*base, *page, chunks));
        }
        if failure.is_none() {
            let regions = mapped
                .iter()
                .flat_map(|(_, page, chunks)| chunks.iter().map(move |&(at, _)| (at, *page)));
            if let Err(err) = self.wide.callbacks.registry.map(
                self.device,
                shard.stream(),
                RegionKind::ExpandablePage,
                regions,
            ) {
                failure = Some(err);
            }
        }
        if let Some(err) = failure {
            for (_, page, chunks) in &mapped {
                for &(at, chunk) in chunks {
                    self.unmap_fresh_page(at, *page, chunk, "a failed wake");
                }
            }
            self.reserved.fetch_sub(total, Ordering::SeqCst);
            return Err(err);
        }
        let pool_id = shard.state.lock().pool;
        for (_, page, chunks) in &mapped {
            for &(at, _) in chunks {
                if let Some(sanitizer) = &self.sanitizer {
                    sanitizer.awake(at, *page);
                }
                self.wide.callbacks.observers.segment(SegmentEvent {
                    change: SegmentChange::Map,
                    device: self.device,
                    base: DeviceAddr(at),
                    size: *page,
                    stream: shard.stream(),
                });
            }
            // Traced per run of neighbouring pages: NVTX makes one heap of a run at once, not
            // one merge per page (found by review: a wake cost pages × blocks tool calls).
            for (at, len) in page_runs(chunks.iter().map(|&(at, _)| at), *page) {
                self.wide.trace.record_mapped(
                    TraceAction::SegmentMap,
                    self.device,
                    at,
                    len,
                    shard.stream(),
                    pool_id,
                );
            }
        }
        let mut st = shard.state.lock();
        for (base, _, chunks) in mapped {
            st.commit_wake(base, chunks);
        }
        self.settle(st);
        self.tell_peaks(shard);
        Ok(total)
    }
}

/// The runs `(start, bytes)` of neighbouring pages of `page` bytes among `starts` (in address
/// order).
fn page_runs(starts: impl Iterator<Item = u64>, page: u64) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for at in starts {
        match runs.last_mut() {
            Some((start, len)) if *start + *len == at => *len += page,
            _ => runs.push((at, page)),
        }
    }
    runs
}
