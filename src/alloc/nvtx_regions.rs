//! NVTX memory regions (`nvtx_regions:True`): the allocator's mapped memory as NVTX heaps and its
//! live blocks as regions of them, so compute-sanitizer's memcheck (`--nvtx yes`) reports an
//! access that leaves its block for a neighbour in the same segment, which is otherwise "valid
//! memory" to it.
//!
//! Fed by the history's one door (`Trace::record` in `history.rs`: every event the allocator
//! traces, whatever the history's own mode), so it follows the allocator by the same events a
//! snapshot replays:
//!
//! | event | heaps | regions |
//! |---|---|---|
//! | `segment_alloc`, `segment_map` | the range becomes heap memory; a heap next to another of the same device and stream is merged with it (the pages of an expandable segment are mapped at different times, and a block may span two mappings): the old heaps unregistered, one registered | the live blocks inside registered again (a heap's unregistering drops its regions) |
//! | `segment_free`, `segment_unmap` (traced **before** the memory goes back to the driver) | the range leaves every heap it touches: those unregistered, what is left of them registered again | the live blocks of what is left registered again; blocks of the range (a sleeping tag's) are kept, to be registered when their pages come back |
//! | `alloc` (a block handed out, front caches included) | — | registered, `[address, address + the rounded request)`, when a heap holds it |
//! | `free_requested` | — | nothing: until its uses on other streams end the block is still valid memory |
//! | `free_completed` (the block is free for reuse, front caches included) | — | unregistered — but in a pool graphs hold, whose replays may still write where the capture's blocks were: kept until that memory is handed out again or goes back (a freed block of a pool no longer held keeps it until then too: a use after free there is not reported) |
//!
//! The bookkeeping is bounded by what is live: one entry per mapped range and one per live block.
//! Every call is made under this module's lock, so the tool sees them in the allocator's order.

use std::collections::BTreeMap;
use std::fmt;

use super::capturing::CaptureRoutes;
use super::pool_id::{MemPoolId, TagPhases};
use crate::driver::StreamId;
use crate::nvtx::{HeapHandle, MemoryTool};
use crate::sync::os::{Arc, Mutex};

/// A registered heap: a maximal mapped range of one device, stream and memory pool.
#[derive(Debug)]
struct Heap {
    size: u64,
    owner: Owner,
    /// The tool's handle (`None`: it answered with a null one; nothing is registered in it).
    handle: Option<HeapHandle>,
}

/// Whose memory a heap is: the stream and the memory pool its segments are cached for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owner {
    stream: StreamId,
    pool: MemPoolId,
}

/// A live block: its registered size, whether a heap holds it now, and whether it is a freed
/// block a graph may still touch (its pool held by graphs: replays write where the capture's
/// blocks were), kept as a region until its memory is handed out again or goes back.
#[derive(Debug)]
struct Live {
    size: u64,
    registered: bool,
    graph_held: bool,
}

#[derive(Debug, Default)]
struct Model {
    /// Heaps by (device, base).
    heaps: BTreeMap<(usize, u64), Heap>,
    /// Live blocks by (device, address).
    live: BTreeMap<(usize, u64), Live>,
}

/// The NVTX heaps and regions of one allocator.
pub(crate) struct NvtxRegions {
    tool: &'static MemoryTool,
    /// The tags, for the names of their heaps.
    tags: Arc<dyn TagPhases>,
    /// The captures, for which pools graphs hold.
    captures: Arc<CaptureRoutes>,
    model: Mutex<Model>,
}

impl fmt::Debug for NvtxRegions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let model = self.model.lock();
        f.debug_struct("NvtxRegions")
            .field("heaps", &model.heaps.len())
            .field("live", &model.live.len())
            .finish()
    }
}

impl NvtxRegions {
    /// The regions of an allocator, when an NVTX tool is attached to the process (`None`: there
    /// is none, nothing to tell).
    pub(crate) fn attach(
        tags: Arc<dyn TagPhases>,
        captures: Arc<CaptureRoutes>,
    ) -> Option<NvtxRegions> {
        Some(NvtxRegions {
            tool: crate::nvtx::tool()?,
            tags,
            captures,
            model: Mutex::new(Model::default()),
        })
    }

    /// `segment_alloc`, `segment_map`: `[base, base + size)` is mapped memory of `stream`'s
    /// cache in `pool`.
    pub(crate) fn mapped(
        &self,
        device: usize,
        base: u64,
        size: u64,
        stream: StreamId,
        pool: MemPoolId,
    ) {
        let owner = Owner { stream, pool };
        self.map(&mut self.model.lock(), device, base, size, owner);
    }

    /// `segment_free`, `segment_unmap`: `[base, base + size)` is about to go back.
    pub(crate) fn unmapping(&self, device: usize, base: u64, size: u64) {
        self.unmap(&mut self.model.lock(), device, base, size);
    }

    /// `alloc`: `size` bytes at `addr` were handed out.
    pub(crate) fn handed_out(&self, device: usize, addr: u64, size: u64) {
        self.hand_out(&mut self.model.lock(), device, addr, size);
    }

    /// `free_completed`: the block at `addr` is free for reuse — but for the graphs that hold its
    /// pool, whose replays may still write it: its region stays until it is handed out again.
    pub(crate) fn freed(&self, device: usize, addr: u64) {
        let mut model = self.model.lock();
        let Some(live) = model.live.get(&(device, addr)) else {
            return;
        };
        let pool = heap_holding(&model, device, addr, live.size).map(|(_, h)| h.owner.pool);
        if pool.is_some_and(|p| self.captures.held_by_graphs(p)) {
            if let Some(live) = model.live.get_mut(&(device, addr)) {
                live.graph_held = true;
            }
            return;
        }
        if model
            .live
            .remove(&(device, addr))
            .is_some_and(|l| l.registered)
        {
            self.tool.unregister_regions(&[addr]);
        }
    }

    fn hand_out(&self, model: &mut Model, device: usize, addr: u64, size: u64) {
        // Regions graphs kept over the memory now handed out give way to the new owner's.
        self.drop_graph_held(model, device, addr, size);
        let heap = heap_holding(model, device, addr, size).and_then(|(_, heap)| heap.handle);
        if let Some(old) = model.live.insert(
            (device, addr),
            Live {
                size,
                registered: heap.is_some(),
                graph_held: false,
            },
        ) {
            // A hand-out over a block never freed: a bug elsewhere; keep the tool consistent.
            tracing::warn!(
                addr,
                size,
                "nvtx_regions: a block handed out twice without a free"
            );
            if old.registered {
                self.tool.unregister_regions(&[addr]);
            }
        }
        if let Some(heap) = heap {
            self.tool.register_regions(heap, &[(addr, size)]);
        }
    }

    /// Unregisters and forgets the graph-held regions overlapping `[addr, addr + size)`.
    fn drop_graph_held(&self, model: &mut Model, device: usize, addr: u64, size: u64) {
        let end = addr.saturating_add(size);
        let first = model
            .live
            .range(..(device, addr))
            .next_back()
            .filter(|((d, a), l)| *d == device && a + l.size > addr)
            .map(|(key, _)| *key);
        let overlapping: Vec<(usize, u64)> = first
            .into_iter()
            .chain(
                model
                    .live
                    .range((device, addr)..(device, end))
                    .map(|(key, _)| *key),
            )
            .filter(|key| model.live.get(key).is_some_and(|l| l.graph_held))
            .collect();
        for key in overlapping {
            if let Some(live) = model.live.remove(&key) {
                if live.registered {
                    self.tool.unregister_regions(&[key.1]);
                }
            }
        }
    }

    fn map(&self, model: &mut Model, device: usize, base: u64, size: u64, owner: Owner) {
        let Some(mut end) = base.checked_add(size) else {
            return;
        };
        // Whatever the range overlaps is not heap memory any more (a bug elsewhere if any).
        self.unmap(model, device, base, size);
        let mut start = base;
        let left = model
            .heaps
            .range(..(device, base))
            .next_back()
            .filter(|((d, b), h)| *d == device && b + h.size == base && h.owner == owner)
            .map(|(key, _)| *key);
        if let Some(key) = left {
            if let Some(heap) = self.drop_heap(model, key) {
                start = key.1;
                debug_assert_eq!(start + heap.size, base);
            }
        }
        let right = model
            .heaps
            .get(&(device, end))
            .is_some_and(|h| h.owner == owner);
        if right {
            if let Some(heap) = self.drop_heap(model, (device, end)) {
                end += heap.size;
            }
        }
        self.register_heap(model, device, start, end - start, owner);
    }

    fn unmap(&self, model: &mut Model, device: usize, base: u64, size: u64) {
        let Some(end) = base.checked_add(size) else {
            return;
        };
        // What graphs kept of freed blocks goes with the memory (a live block's entry stays, for
        // a sleeping tag's pages that come back).
        self.drop_graph_held(model, device, base, size);
        let touched: Vec<(usize, u64)> = model
            .heaps
            .range((device, 0)..(device, end))
            .filter(|((_, b), h)| b + h.size > base)
            .map(|(key, _)| *key)
            .collect();
        for key in touched {
            let Some(heap) = self.drop_heap(model, key) else {
                continue;
            };
            let heap_end = key.1 + heap.size;
            if key.1 < base {
                self.register_heap(model, device, key.1, base - key.1, heap.owner);
            }
            if heap_end > end {
                self.register_heap(model, device, end, heap_end - end, heap.owner);
            }
        }
    }

    /// Unregisters the heap at `key`; the tool drops its regions with it, so the live blocks
    /// inside are unregistered here too.
    fn drop_heap(&self, model: &mut Model, key: (usize, u64)) -> Option<Heap> {
        let heap = model.heaps.remove(&key)?;
        if let Some(handle) = heap.handle {
            self.tool.unregister_heap(handle);
        }
        let (device, base) = key;
        for (_, live) in model
            .live
            .range_mut((device, base)..(device, base + heap.size))
        {
            live.registered = false;
        }
        Some(heap)
    }

    /// Registers a heap over `[base, base + size)` and the live blocks wholly inside it.
    fn register_heap(&self, model: &mut Model, device: usize, base: u64, size: u64, owner: Owner) {
        let end = base + size;
        let handle = self
            .tool
            .register_heap(base, size, &self.name(device, owner));
        model.heaps.insert(
            (device, base),
            Heap {
                size,
                owner,
                handle,
            },
        );
        let Some(handle) = handle else {
            return;
        };
        let mut regions = Vec::new();
        for (&(_, addr), live) in model.live.range_mut((device, base)..(device, end)) {
            if !live.registered && addr + live.size <= end {
                live.registered = true;
                regions.push((addr, live.size));
            }
        }
        self.tool.register_regions(handle, &regions);
    }
}

impl NvtxRegions {
    /// A heap's name: whose cache it is — a stream's, a memory pool's, a graph's or a tag's.
    fn name(&self, device: usize, owner: Owner) -> String {
        let stream = owner.stream.serial();
        let (first, second) = owner.pool.as_pair();
        if owner.pool.is_default() {
            format!("cudalloc: device {device}, stream {stream}")
        } else if let Some(tag) = self.tags.name_of(owner.pool) {
            format!("cudalloc: device {device}, stream {stream}, tag {tag:?}")
        } else if owner.pool.is_user_created() {
            format!("cudalloc: device {device}, stream {stream}, memory pool ({first}, {second})")
        } else {
            format!("cudalloc: device {device}, stream {stream}, graph pool ({first}, {second})")
        }
    }
}

/// The heap of `device` holding `[addr, addr + size)` wholly.
fn heap_holding(model: &Model, device: usize, addr: u64, size: u64) -> Option<(u64, &Heap)> {
    let ((d, base), heap) = model.heaps.range(..=(device, addr)).next_back()?;
    let end = addr.checked_add(size)?;
    (*d == device && end <= base + heap.size).then_some((*base, heap))
}
