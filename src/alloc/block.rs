//! Blocks: address ranges inside a segment, linked to their neighbours.
//!
//! A segment (one driver allocation) is tiled by blocks linked through `prev`/`next`. Block states:
//!
//! | state          | in its pool's free set | counted in stats as                      | next states |
//! |----------------|------------------------|------------------------------------------|-------------|
//! | `Free`         | yes                    | `inactive_split` if its segment is split | `Allocated` (best fit, maybe split), released with its segment |
//! | `Allocated`    | no                     | `allocation`, `active`, `allocated_bytes` | `Free`, or `PendingFree` if used by other streams |
//! | `PendingFree`  | no                     | `active` (waiting for stream events)     | `Free` when its last event completes |
//! | `Releasing`    | no                     | nothing (expandable segments only)       | `Unmapped` once the driver unmapped its pages |
//! | `Unmapped`     | no                     | nothing (expandable segments only)       | `Free` when pages are mapped over it (`expandable.rs`) |
//!
//! Invariants (checked by the scanner in `invariants.rs`): blocks tile their segment exactly; no two
//! neighbouring blocks are both `Free` (they merge); a block is in a free set iff it is `Free`.

use std::collections::BTreeMap;

use super::size::PoolKind;
use crate::driver::{ChunkId, StreamId};

/// Index of a block in its shard's slab.
pub(crate) type BlockId = usize;

/// A block's life-cycle state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    Free,
    Allocated,
    PendingFree,
    /// Whole free pages of an expandable segment on their way back to the driver: neither
    /// allocated from nor mapped over until the unmap is done (`expandable.rs`).
    Releasing,
    /// Address space of an expandable segment with no memory mapped (`expandable.rs`).
    Unmapped,
}

/// One block. 128 bytes, aligned: the shard's slab of blocks is written on every allocation and
/// free, and with aligned entries its heap buffer shares no cache line with anything else
/// (another shard's blocks included), wherever the heap puts it.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Block {
    pub ptr: u64,
    pub size: u64,
    /// Bytes the caller asked for (0 when free).
    pub requested: u64,
    pub pool: PoolKind,
    pub state: BlockState,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    /// Base address of the segment this block belongs to.
    pub segment: u64,
    /// Other streams that used this block (`record_stream`), cleared when it is freed.
    pub stream_uses: Vec<StreamId>,
    /// Events still pending before a `PendingFree` block becomes `Free`.
    pub pending_events: u32,
    /// Shard allocation counter when the block last became free (garbage collection age).
    pub freed_at: u64,
    /// Counted in `oversize_allocations` when handed out (by the `max_split_size` then in force;
    /// its release takes back what was counted, whatever the setting is by then).
    pub counted_oversize: bool,
}

impl Block {
    /// Whether the block shares its segment with others (the segment is split).
    pub(super) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// Key of a free block in a pool: best fit is the first key ≥ (size, 0, 0), so the smallest block
/// that fits wins and the lowest address breaks ties.
pub(crate) type FreeKey = (u64, u64, BlockId);

/// A segment owned by a shard.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SegmentInfo {
    pub size: u64,
    pub pool: PoolKind,
    /// Counted in `oversize_segments` when entered (as `Block::counted_oversize`).
    pub counted_oversize: bool,
    /// First block of the segment.
    pub head: BlockId,
}

/// The pages of one expandable segment (`expandable.rs`).
#[derive(Debug, Default)]
pub(crate) struct ExpandablePages {
    /// Bytes per page.
    pub page: u64,
    /// Mapped pages: address → chunk.
    pub chunks: BTreeMap<u64, ChunkId>,
    /// The segment sleeps (`sleep.rs`): the pages to map back at wake, in address order
    /// (`chunks` is empty meanwhile).
    pub asleep: Option<Vec<u64>>,
}

/// A block handed out by a shard, its address and the rounded size of the request it serves.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Allocated {
    pub block: BlockId,
    pub ptr: u64,
    pub rounded: u64,
    /// Whether its free may go to a thread's front cache: only its shard's stream uses it so far
    /// (`false` once another stream is recorded on it, as for a lent block: `engine/handover.rs`).
    pub front: bool,
}
