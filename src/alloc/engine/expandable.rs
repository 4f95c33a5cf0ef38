//! Expandable segments (`expandable_segments:True`): one segment per (shard, pool) that grows by
//! mapping pages of physical memory into a reserved address range, and shrinks by unmapping whole
//! free pages — so freed memory goes back to the device without the stranded remainders that
//! whole-allocation segments leave (PyTorch's answer to fragmentation, on the driver's
//! virtual-memory API).
//!
//! The segment spans the whole reservation; its tiling gains a fourth block state:
//!
//! | state      | backed by memory | in a free pool | becomes                                      |
//! |------------|------------------|----------------|----------------------------------------------|
//! | `Unmapped` | no               | no             | `Free` when a miss maps pages over it (merged with a free block before it) |
//! | `Free`     | yes              | yes            | `Allocated`; its whole pages `Unmapped` on the release paths |
//!
//! Growth (the miss path, before a new whole segment would be allocated): the lowest unmapped block
//! that, together with a free block right before it, can hold the request gets just enough pages
//! mapped at its start. Release (`empty_cache`, the out-of-memory path, garbage collection): every
//! free block gives back the pages that lie wholly inside it. Neighbouring unmapped blocks merge, as
//! free ones do. `reserved_bytes` counts mapped bytes only; the segment counts once.
//!
//! Pages are the driver's granularity (2 MiB on CUDA; PyTorch maps 20 MiB steps in the large
//! pool, which strands up to 18 MiB per segment); each page is one chunk, so a page is mapped and
//! unmapped on its own.

use std::collections::BTreeMap;

use super::device::Request;
use super::ShardState;
use super::{DeviceCore, Shard};
use crate::alloc::block::{Allocated, Block, BlockId, BlockState, ExpandablePages, SegmentInfo};
use crate::alloc::history::TraceAction;
use crate::alloc::observers::{SegmentChange, SegmentEvent};
use crate::alloc::registration::RegionKind;
use crate::alloc::size::PoolKind;
use crate::alloc::stats;
use crate::driver::{ChunkId, DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::Ordering;

/// Pages to unmap: (address, length, the chunk of each page in it).
pub(crate) type PageRelease = (u64, u64, Vec<(u64, ChunkId)>);

/// The pages under an allocated range of an expandable segment (what sharing it across processes
/// hands out): they stay mapped, with the same chunks, while the block is allocated — release
/// paths unmap only pages wholly inside free blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagesUnder {
    /// Bytes per page.
    pub page: u64,
    /// Address of the first page.
    pub first: u64,
    /// The chunk of each page, in address order.
    pub chunks: Vec<ChunkId>,
}

impl Shard {
    /// The pages under `[ptr of block id, + len)` when the block lies in an expandable segment
    /// (`None` for a whole segment). Every page must be mapped: an unmapped one is an error (it
    /// would be a bug of the release paths).
    pub(crate) fn pages_under(&self, id: BlockId, len: u64) -> Result<Option<PagesUnder>> {
        let st = self.state.lock();
        let block = &st.blocks[id];
        let Some(pages) = st.expandable.get(&block.segment) else {
            return Ok(None);
        };
        if pages.asleep.is_some() {
            drop(st);
            return Err(self.core.asleep_error(self, "sharing a storage"));
        }
        let page = pages.page;
        let end = block
            .ptr
            .checked_add(len.max(1))
            .ok_or_else(|| Error::invalid("range overflows the address space"))?;
        let first = block.segment + (block.ptr - block.segment) / page * page;
        let mut chunks = Vec::new();
        let mut at = first;
        while at < end {
            let chunk = pages.chunks.get(&at).copied().ok_or_else(|| {
                Error::invalid(format!(
                    "page {at:#x} under an allocated block is not mapped (allocator bug)"
                ))
            })?;
            chunks.push(chunk);
            at += page;
        }
        Ok(Some(PagesUnder {
            page,
            first,
            chunks,
        }))
    }
}

impl ShardState {
    /// The base of this shard's expandable segment of `pool`, if made.
    pub(crate) fn expandable_base(&self, pool: PoolKind) -> Option<u64> {
        // At most two expandable segments per shard (one per pool): a scan is the lookup.
        self.expandable
            .keys()
            .copied()
            .find(|base| self.segments.get(base).is_some_and(|s| s.pool == pool))
    }

    /// Registers a new expandable segment over the reservation `[base, base + reserved)`: one
    /// unmapped block.
    pub(crate) fn add_expandable(&mut self, base: u64, reserved: u64, pool: PoolKind, page: u64) {
        let id = self.blocks.insert(Block {
            ptr: base,
            size: reserved,
            requested: 0,
            pool,
            state: BlockState::Unmapped,
            prev: None,
            next: None,
            segment: base,
            stream_uses: Vec::new(),
            pending_events: 0,
            freed_at: self.tick,
            counted_oversize: false,
        });
        self.segments.insert(
            base,
            SegmentInfo {
                size: reserved,
                pool,
                counted_oversize: false,
                head: id,
            },
        );
        self.expandable.insert(
            base,
            ExpandablePages {
                page,
                chunks: BTreeMap::new(),
                asleep: None,
            },
        );
        self.over_budget |= stats::increase(&mut self.stats.segment, pool, 1);
    }

    /// Where to map pages so that a request of `rounded` bytes fits: (address, length) — at the
    /// start of the lowest unmapped block that can hold it with the free block before it.
    pub(crate) fn growth_plan(&self, pool: PoolKind, rounded: u64) -> Option<(u64, u64)> {
        let base = self.expandable_base(pool)?;
        let pages = self.expandable.get(&base)?;
        if pages.asleep.is_some() {
            return None;
        }
        let page = pages.page;
        let mut at = Some(self.segments.get(&base)?.head);
        while let Some(id) = at {
            let b = &self.blocks[id];
            if b.state == BlockState::Unmapped {
                let before = b
                    .prev
                    .map(|p| &self.blocks[p])
                    .filter(|p| p.state == BlockState::Free)
                    .map_or(0, |p| p.size);
                let need = rounded.saturating_sub(before);
                let len = need.div_ceil(page).max(1) * page;
                if len <= b.size {
                    return Some((b.ptr, len));
                }
            }
            at = b.next;
        }
        None
    }

    /// Records pages mapped at `[addr, addr + len)` (planned by [`Self::growth_plan`]): the
    /// start of that unmapped block becomes free memory (merged with a free block before it).
    pub(crate) fn commit_growth(&mut self, addr: u64, len: u64, chunks: Vec<(u64, ChunkId)>) {
        let Some(id) = self.block_at(addr) else {
            return;
        };
        let segment = self.blocks[id].segment;
        if let Some(pages) = self.expandable.get_mut(&segment) {
            pages.chunks.extend(chunks);
        }
        let pool = self.blocks[id].pool;
        if self.blocks[id].size > len {
            self.split_off(id, len, BlockState::Unmapped);
        }
        let s = &mut self.stats;
        self.over_budget |= stats::increase(&mut s.reserved_bytes, pool, len);
        s.num_device_alloc += 1;
        let b = &mut self.blocks[id];
        b.state = BlockState::Free;
        b.freed_at = self.tick;
        self.merge_free(id);
    }

    /// Unmaps the whole pages inside free blocks of expandable segments that satisfy `select`,
    /// until `enough(bytes)`; returns the pages for the caller to give back to the driver.
    pub(crate) fn take_free_pages(
        &mut self,
        select: impl Fn(&Block) -> bool,
        enough: impl Fn(u64) -> bool,
    ) -> Vec<PageRelease> {
        let candidates: Vec<BlockId> = self
            .free_blocks()
            .filter(|&id| {
                let b = &self.blocks[id];
                // A sleeping segment's pages are unmapped already (`sleep.rs`).
                self.expandable
                    .get(&b.segment)
                    .is_some_and(|p| p.asleep.is_none())
                    && select(b)
            })
            .collect();
        let mut released = Vec::new();
        let mut freed = 0u64;
        for id in candidates {
            if enough(freed) {
                break;
            }
            let (ptr, size, segment) = {
                let b = &self.blocks[id];
                (b.ptr, b.size, b.segment)
            };
            let Some(page) = self.expandable.get(&segment).map(|p| p.page) else {
                continue;
            };
            let first = segment + (ptr - segment).div_ceil(page) * page;
            let last = segment + (ptr + size - segment) / page * page;
            if first >= last {
                continue;
            }
            self.remove_free(id);
            // [ptr, first) stays free; [first, last) is unmapped; [last, end) stays free.
            let mut middle = id;
            if first > ptr {
                middle = self.split_off(id, first - ptr, BlockState::Free);
                self.insert_free(id);
            }
            if last < ptr + size {
                let tail = self.split_off(middle, last - first, BlockState::Free);
                self.insert_free(tail);
            }
            let pool = self.blocks[middle].pool;
            // Unmapped only once the driver has unmapped the pages (`finish_release`): until
            // then nothing may allocate from them or map over them.
            self.blocks[middle].state = BlockState::Releasing;
            let chunks: Vec<(u64, ChunkId)> = match self.expandable.get_mut(&segment) {
                Some(pages) => {
                    let keys: Vec<u64> = pages.chunks.range(first..last).map(|(&a, _)| a).collect();
                    keys.into_iter()
                        .filter_map(|a| pages.chunks.remove(&a).map(|c| (a, c)))
                        .collect()
                }
                None => Vec::new(),
            };
            let s = &mut self.stats;
            stats::decrease(&mut s.reserved_bytes, pool, last - first);
            s.num_device_free += 1;
            freed += last - first;
            released.push((first, last - first, chunks));
        }
        released
    }

    /// The pages at `[addr, addr + len)` (taken by [`Self::take_free_pages`]) are unmapped now.
    pub(crate) fn finish_release(&mut self, addr: u64) {
        if let Some(id) = self.block_at(addr) {
            if self.blocks[id].state == BlockState::Releasing {
                self.blocks[id].state = BlockState::Unmapped;
                self.merge_unmapped(id);
            }
        }
    }

    /// Removes the expandable segments that are wholly unmapped (shard teardown); returns their
    /// bases for the caller to free the reservations.
    pub(crate) fn take_empty_expandable(&mut self) -> Vec<u64> {
        let empty: Vec<u64> = self
            .expandable
            .keys()
            .copied()
            .filter(|base| {
                self.segments.get(base).is_some_and(|seg| {
                    let head = &self.blocks[seg.head];
                    head.state == BlockState::Unmapped && head.next.is_none()
                })
            })
            .collect();
        for base in &empty {
            if let Some(seg) = self.segments.remove(base) {
                self.blocks.remove(seg.head);
                stats::decrease(&mut self.stats.segment, seg.pool, 1);
            }
            self.expandable.remove(base);
        }
        empty
    }

    /// The free block holding `addr` after a growth, cut to exactly `rounded` bytes from its start
    /// (the rest stays free), ready for `allocate`.
    pub(crate) fn grown_block(&mut self, addr: u64, rounded: u64) -> Option<BlockId> {
        let (&base, seg) = self.segments.range(..=addr).next_back()?;
        let mut at = Some(seg.head);
        while let Some(id) = at {
            let b = &self.blocks[id];
            if b.segment == base && b.ptr <= addr && addr < b.ptr + b.size {
                if b.state != BlockState::Free || b.size < rounded {
                    return None;
                }
                if b.size > rounded {
                    self.remove_free(id);
                    let rest = self.split_off(id, rounded, BlockState::Free);
                    self.insert_free(rest);
                    self.insert_free(id);
                }
                return Some(id);
            }
            at = b.next;
        }
        None
    }

    /// The address of the free block right before the unmapped block starting at `addr`.
    pub(crate) fn block_before_unmapped(&self, addr: u64) -> Option<u64> {
        let id = self.block_at(addr)?;
        let prev = self.blocks[id].prev?;
        (self.blocks[prev].state == BlockState::Free).then_some(self.blocks[prev].ptr)
    }

    /// The block starting at `addr`, if any.
    fn block_at(&self, addr: u64) -> Option<BlockId> {
        let (&base, seg) = self.segments.range(..=addr).next_back()?;
        let mut at = Some(seg.head);
        while let Some(id) = at {
            let b = &self.blocks[id];
            if b.ptr == addr && b.segment == base {
                return Some(id);
            }
            at = b.next;
        }
        None
    }

    /// Merges unmapped block `id` with unmapped neighbours.
    fn merge_unmapped(&mut self, id: BlockId) {
        let mut id = id;
        if let Some(prev) = self.blocks[id]
            .prev
            .filter(|&p| self.blocks[p].state == BlockState::Unmapped)
        {
            self.absorb_next(prev);
            id = prev;
        }
        if self.blocks[id]
            .next
            .is_some_and(|n| self.blocks[n].state == BlockState::Unmapped)
        {
            self.absorb_next(id);
        }
    }
}

/// Page size of expandable segments: the driver's granularity (2 MiB on CUDA). PyTorch maps in
/// its segment sizes (2 MiB small, 20 MiB large); mapping in the smallest unit the driver allows
/// keeps reserved memory within a page of what is allocated, which is the point of the feature.
fn page_size(granularity: u64) -> u64 {
    granularity.max(1)
}

impl DeviceCore {
    /// The expandable miss path: maps just enough pages of the shard's expandable segment of
    /// `pool` (made on first use) for `rounded` bytes, then allocates from it. `Ok(None)` when the
    /// device (or the memory fraction, or the reservation) has no room.
    pub(super) fn grow_expandable(
        &self,
        shard: &Shard,
        req: Request,
        cause: &mut Option<String>,
    ) -> Result<Option<Allocated>> {
        let Request { requested, rounded } = req;
        let pool = req.pool();
        let mut st = shard.state.lock();
        if shard.sleeping.load(Ordering::Relaxed) {
            drop(st);
            return Err(self.asleep_error(shard, "an allocation"));
        }
        if st.expandable_base(pool).is_none() {
            let granularity = self.driver.vm().vm_granularity(self.device)?;
            let page = page_size(granularity);
            // Twice the device's memory: address space is cheap, and the slack keeps holes in the
            // range from exhausting it before the memory itself runs out.
            let reserved = self.capacity.saturating_mul(2).div_ceil(page).max(1) * page;
            let base = self.driver.vm().vm_reserve(self.device, reserved)?;
            st.add_expandable(base.0, reserved, pool, page);
        }
        let full = "no room left in the address range reserved for this stream's memory";
        let Some((addr, len)) = st.growth_plan(pool, rounded) else {
            *cause = Some(full.into());
            return Ok(None);
        };
        // Beyond PyTorch: before mapping new pages, give back the whole free pages the segment
        // holds elsewhere (holes no request has filled), so reserved memory tracks what is in
        // use. Only on this miss path, never per free. The free block the plan grows from stays.
        let keep = st.block_before_unmapped(addr);
        drop(st);
        self.release_pages(
            shard,
            |b| Some(b.ptr) != keep && b.pool == pool,
            |f| f >= len,
            false,
        );
        let mut st = shard.state.lock();
        if shard.sleeping.load(Ordering::Relaxed) {
            drop(st);
            return Err(self.asleep_error(shard, "an allocation"));
        }
        let Some((addr, len)) = st.growth_plan(pool, rounded) else {
            *cause = Some(full.into());
            return Ok(None);
        };
        if !self.try_reserve(len) {
            return Ok(None);
        }
        let page = st
            .expandable_base(pool)
            .and_then(|b| st.expandable.get(&b))
            .map_or(len, |p| p.page);
        let mut mapped: Vec<(u64, ChunkId)> = Vec::new();
        let mut failure = None;
        for at in (addr..addr + len).step_by(page as usize) {
            match self.map_fresh_page(at, page) {
                Ok(chunk) => mapped.push((at, chunk)),
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        if failure.is_none() {
            // Each page a region of its own, registered before the grown block is handed out.
            let pages = mapped.iter().map(|&(at, _)| (at, page));
            if let Err(err) = self.wide.callbacks.registry.map(
                self.device,
                shard.stream(),
                RegionKind::ExpandablePage,
                pages,
            ) {
                failure = Some(err);
            }
        }
        if let Some(err) = failure {
            // Give back what was mapped of this step; the request fails as out of memory (or
            // with the driver's error).
            for &(at, chunk) in &mapped {
                self.unmap_fresh_page(at, page, chunk, "a failed growth");
            }
            self.reserved.fetch_sub(len, Ordering::SeqCst);
            return match err {
                Error::OutOfMemory { message, .. } => {
                    *cause = Some(message);
                    Ok(None)
                }
                other => Err(other),
            };
        }
        st.commit_growth(addr, len, mapped);
        // The grown free block was made for this request: take it even where best fit's oversize
        // rules would refuse it (its remainder can be unmapped again, so splitting is harmless).
        let id = match st.find_fit(pool, rounded) {
            Some(id) => id,
            None => st.grown_block(addr, rounded).ok_or_else(|| {
                Error::invalid("an expandable segment grew but holds no free block for the request")
            })?,
        };
        let id = st.allocate(id, rounded, requested);
        let out = st.allocated(id, rounded);
        let pool_id = st.pool;
        self.settle(st);
        self.wide.callbacks.observers.segment(SegmentEvent {
            change: SegmentChange::Map,
            device: self.device,
            base: DeviceAddr(addr),
            size: len,
            stream: shard.stream(),
        });
        self.wide.trace.record_mapped(
            TraceAction::SegmentMap,
            self.device,
            addr,
            len,
            shard.stream(),
            pool_id,
        );
        self.record_alloc(shard, out.ptr, rounded);
        Ok(Some(out))
    }

    /// A fresh chunk of `page` bytes mapped at `at` (nothing left behind on failure).
    pub(in crate::alloc) fn map_fresh_page(&self, at: u64, page: u64) -> Result<ChunkId> {
        let chunk = self.driver.vm().vm_create_chunk(self.device, page)?;
        match self.driver.vm().vm_map(DeviceAddr(at), chunk) {
            Ok(()) => Ok(chunk),
            Err(err) => {
                if let Err(release_err) = self.driver.vm().vm_release_chunk(chunk) {
                    tracing::error!(err = %release_err, at, page,
                        "releasing a chunk that could not be mapped failed; it leaks");
                }
                Err(err)
            }
        }
    }

    /// Rolls back a page that [`Self::map_fresh_page`] mapped at `at`, for `what` (the step that
    /// failed): unmaps it and releases its chunk, logging what fails (the memory may leak).
    pub(in crate::alloc) fn unmap_fresh_page(
        &self,
        at: u64,
        page: u64,
        chunk: ChunkId,
        what: &str,
    ) {
        if let Err(err) = self.driver.vm().vm_unmap(DeviceAddr(at), page) {
            tracing::error!(%err, at, page, "unmapping a page on the rollback of {what} failed");
        }
        if let Err(err) = self.driver.vm().vm_release_chunk(chunk) {
            tracing::error!(%err, at, page, "releasing a page's chunk on the rollback of {what} failed");
        }
    }

    /// Unmaps pages taken by [`ShardState::take_free_pages`] or a sleep (outside every shard
    /// lock): each release is neighbouring pages, deregistered and told to the observers first,
    /// then unmapped in one call (one drain of the streams) and its chunks released. A failing
    /// unmap or release is logged (the chunks are released anyway: the driver keeps a released
    /// chunk's memory until its last mapping goes).
    pub(in crate::alloc) fn free_pages(&self, stream: StreamId, pages: Vec<PageRelease>) {
        for (addr, len, chunks) in pages {
            self.wide.callbacks.registry.unmap(self.device, addr, len);
            self.wide.callbacks.observers.segment(SegmentEvent {
                change: SegmentChange::Unmap,
                device: self.device,
                base: DeviceAddr(addr),
                size: len,
                stream,
            });
            // Traced before the unmap: NVTX's heap goes before the pages (`nvtx_regions.rs`).
            self.wide
                .trace
                .record(TraceAction::SegmentUnmap, self.device, addr, len, stream);
            if let Err(err) = self.driver.vm().vm_unmap(DeviceAddr(addr), len) {
                tracing::error!(%err, addr, len, "unmapping pages of an expandable segment failed");
            }
            for (at, chunk) in chunks {
                if let Err(err) = self.driver.vm().vm_release_chunk(chunk) {
                    tracing::error!(%err, at, "releasing a page of an expandable segment failed");
                }
            }
            self.reserved.fetch_sub(len, Ordering::SeqCst);
        }
    }

    /// Gives back the free pages of `shard`'s expandable segments that `select` picks, until
    /// `enough`: taken under the shard's lock (marked releasing), unmapped without it (observers
    /// told first), then marked unmapped under the lock again.
    ///
    /// Every cache release calls this for each shard it visits, after its other changes there:
    /// it tells the device's peak book that the shard changed without settling (`peaks.rs`).
    pub(in crate::alloc) fn release_pages(
        &self,
        shard: &Shard,
        select: impl Fn(&crate::alloc::block::Block) -> bool,
        enough: impl Fn(u64) -> bool,
        releasable_only: bool,
    ) -> u64 {
        let freed = self.release_free_pages(shard, select, enough, releasable_only);
        self.tell_peaks(shard);
        freed
    }

    fn release_free_pages(
        &self,
        shard: &Shard,
        select: impl Fn(&crate::alloc::block::Block) -> bool,
        enough: impl Fn(u64) -> bool,
        releasable_only: bool,
    ) -> u64 {
        // Held across the unmaps: a capture does not begin in between (`capturing.rs`).
        let Some(_no_capture) = self.wide.capturing.releasing() else {
            return 0;
        };
        let pages = {
            let mut st = shard.state.lock();
            if releasable_only && !st.releasable() {
                return 0;
            }
            let pages = st.take_free_pages(select, enough);
            self.verify(&st);
            pages
        };
        if pages.is_empty() {
            return 0;
        }
        let freed = pages.iter().map(|p| p.1).sum();
        let starts: Vec<u64> = pages.iter().map(|p| p.0).collect();
        self.free_pages(shard.stream(), pages);
        let mut st = shard.state.lock();
        for addr in starts {
            st.finish_release(addr);
        }
        self.verify(&st);
        freed
    }
}
