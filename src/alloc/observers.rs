//! Observers: how the rest of an ecosystem follows the allocator without patching it.
//!
//! * **Segment observers** see every segment the allocator maps from the driver and every one it
//!   returns — the hook NCCL/UCX buffer registration needs (PyTorch's allocator trace tracker).
//!   A map is reported after the segment exists; an unmap *before* the driver frees it, so a
//!   registration can be dropped while the memory is still valid.
//! * **Out-of-memory observers** see the facts of a failed allocation before its error returns
//!   (to log, to dump a snapshot, to page someone).
//!
//! Observers run on the thread that caused the event, with no allocator lock held; they may read
//! stats or take a snapshot, but must not allocate or free through the same allocator (an
//! observer that does would recurse into the path that called it). A panicking observer is caught
//! and logged, and the path that told it goes on (a segment mapped is still handed out, one
//! unmapped still freed): the allocator's state never depends on an observer returning.

use crate::driver::{DeviceAddr, StreamId};
use crate::error::caught;
use crate::sync::os::{Arc, RwLock};

/// Whether a segment appeared or is about to go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SegmentChange {
    /// Mapped from the driver (reported after).
    Map,
    /// About to be returned to the driver (reported before, while no stream capture can
    /// begin: an observer must not begin one, nor wait for a thread that does).
    Unmap,
}

/// A segment mapped or unmapped by the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SegmentEvent {
    /// Map or unmap.
    pub change: SegmentChange,
    /// The device.
    pub device: usize,
    /// The segment's base address.
    pub base: DeviceAddr,
    /// Its size in bytes.
    pub size: u64,
    /// The stream whose shard owns it.
    pub stream: StreamId,
}

/// The facts of an allocation that failed for lack of memory (what the error message says):
/// the device's totals, and why this request failed — what its stream's pool had free, what
/// other streams, pools and graphs hold (`alloc/engine/explain.rs`).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct OutOfMemoryEvent {
    /// The device.
    pub device: usize,
    /// Bytes requested.
    pub requested: u64,
    /// The device's capacity.
    pub capacity: u64,
    /// The device's free memory as the driver reports it.
    pub free: u64,
    /// Bytes allocated by this allocator on the device.
    pub allocated: u64,
    /// Bytes reserved (segments held) by this allocator on the device.
    pub reserved: u64,
    /// The per-process cap in force, if any: (fraction, bytes).
    pub fraction: Option<(f64, u64)>,
    /// What the driver said when it refused the last segment.
    pub cause: Option<String>,
    /// The request as the allocator serves it (rounded).
    pub rounded: u64,
    /// The stream that asked.
    pub stream: Option<StreamId>,
    /// The largest free block in the asking stream's pool of the request's size class (small
    /// or large pool; in the memory pool the allocation was routed to).
    pub largest_free_block: u64,
    /// Bytes free in that pool.
    pub free_in_pool: u64,
    /// Bytes cached free under other streams of the device (their default pool).
    pub cached_on_other_streams: u64,
    /// The largest of those free blocks that `cross_stream_reuse:blocks` could have lent to
    /// this request (0: none could — none fits, or the request is a memory pool's or made during
    /// a capture, or its stream cannot wait for theirs).
    pub largest_fit_on_other_streams: u64,
    /// Bytes reserved by private memory pools (`MemPool`, tags), graphs' pools included.
    pub held_by_pools: u64,
    /// Of those, the bytes of pools that live graphs hold.
    pub held_by_graphs: u64,
    /// Address space expandable segments reserve without mapping it (not memory).
    pub reserved_unmapped: u64,
    /// `1 − largest_free_block / free_in_pool`: how far the pool's free memory is from one block
    /// (0 when nothing is free).
    pub fragmentation: f64,
}

/// A segment observer.
pub type SegmentObserver = Arc<dyn Fn(&SegmentEvent) + Send + Sync>;
/// An out-of-memory observer.
pub type OutOfMemoryObserver = Arc<dyn Fn(&OutOfMemoryEvent) + Send + Sync>;

/// The observers of one allocator.
#[derive(Default)]
pub(crate) struct Observers {
    segments: RwLock<Vec<SegmentObserver>>,
    out_of_memory: RwLock<Vec<OutOfMemoryObserver>>,
}

impl std::fmt::Debug for Observers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observers")
            .field("segments", &self.segments.read().len())
            .field("out_of_memory", &self.out_of_memory.read().len())
            .finish()
    }
}

impl Observers {
    pub(crate) fn add_segment(&self, observer: SegmentObserver) {
        self.segments.write().push(observer);
    }

    pub(crate) fn add_out_of_memory(&self, observer: OutOfMemoryObserver) {
        self.out_of_memory.write().push(observer);
    }

    /// Tells every segment observer (a copy of the list: an observer may register another).
    pub(crate) fn segment(&self, event: SegmentEvent) {
        let list: Vec<_> = self.segments.read().clone();
        for observer in list {
            if let Err(panic) = caught(|| observer(&event)) {
                tracing::warn!(%panic, "a segment observer panicked");
            }
        }
    }

    /// Tells every out-of-memory observer.
    pub(crate) fn out_of_memory(&self, event: &OutOfMemoryEvent) {
        let list: Vec<_> = self.out_of_memory.read().clone();
        for observer in list {
            if let Err(panic) = caught(|| observer(event)) {
                tracing::warn!(%panic, "an out-of-memory observer panicked");
            }
        }
    }
}
