//! Snapshots: every segment with its blocks and their states (PyTorch's names), and the history
//! recorded so far (`history.rs`). `pytorch_pickle.rs` writes them in PyTorch's layout.

use super::ShardState;
use crate::alloc::block::{BlockId, BlockState};
use crate::alloc::history::TraceEntry;
use crate::alloc::pool_id::MemPoolId;
use crate::alloc::stacks::Frame;
use crate::driver::StreamId;

/// State of a block in a snapshot (PyTorch's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "snake_case")
)]
pub enum SnapshotBlockState {
    /// Handed out.
    ActiveAllocated,
    /// Dropped, waiting for other streams' events.
    ActivePendingFree,
    /// Free.
    Inactive,
}

impl SnapshotBlockState {
    /// PyTorch's string: `active_allocated`, `active_pending_free`, `inactive`.
    pub fn name(self) -> &'static str {
        match self {
            SnapshotBlockState::ActiveAllocated => "active_allocated",
            SnapshotBlockState::ActivePendingFree => "active_pending_free",
            SnapshotBlockState::Inactive => "inactive",
        }
    }
}

/// One block of a snapshot segment.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct SnapshotBlock {
    /// Address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes the caller asked for (0 unless allocated).
    pub requested_size: u64,
    /// State.
    pub state: SnapshotBlockState,
    /// Where it was allocated (with history and stacks on; innermost first).
    pub frames: Vec<Frame>,
}

/// One segment of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct SnapshotSegment {
    /// Device ordinal.
    pub device: usize,
    /// Raw id of the stream that owns the segment.
    pub stream: u64,
    /// Base address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Bytes in allocated blocks.
    pub allocated_size: u64,
    /// Bytes in active (allocated or pending) blocks.
    pub active_size: u64,
    /// `small` or `large`.
    pub segment_type: &'static str,
    /// An expandable segment (its `total_size` is what is mapped now).
    pub is_expandable: bool,
    /// The memory pool the segment belongs to (PyTorch's `segment_pool_id`; `(0, 0)` for the
    /// default pool).
    pub segment_pool_id: MemPoolId,
    /// Blocks in address order.
    pub blocks: Vec<SnapshotBlock>,
}

/// A whole-allocator snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Snapshot {
    /// Every segment of every device and stream, by device then address.
    pub segments: Vec<SnapshotSegment>,
    /// Trace entries (empty unless history is enabled).
    pub trace: Vec<TraceEntry>,
    /// Devices of the allocator (PyTorch's `device_traces` has one list per device).
    pub device_count: usize,
}

/// Appends the segments of one shard to `out`; the blocks of `in_front_caches` (held by threads'
/// front caches: freed, for the program) are inactive.
pub(crate) fn shard_segments(
    state: &ShardState,
    device: usize,
    stream: StreamId,
    in_front_caches: &[BlockId],
    out: &mut Vec<SnapshotSegment>,
) {
    for (&address, seg) in &state.segments {
        if state
            .expandable
            .get(&address)
            .is_some_and(|p| p.asleep.is_some())
        {
            // A sleeping tag's segment holds no memory (`sleep.rs`): as reserved_bytes says.
            continue;
        }
        let mut blocks = Vec::new();
        let mut at = Some(seg.head);
        let (mut allocated_size, mut active_size, mut mapped) = (0, 0, 0);
        while let Some(id) = at {
            let b = &state.blocks[id];
            let st = match b.state {
                BlockState::Allocated if in_front_caches.contains(&id) => {
                    SnapshotBlockState::Inactive
                }
                BlockState::Allocated => SnapshotBlockState::ActiveAllocated,
                BlockState::PendingFree => SnapshotBlockState::ActivePendingFree,
                BlockState::Free => SnapshotBlockState::Inactive,
                // Address space without memory is not part of the segment's blocks.
                BlockState::Unmapped | BlockState::Releasing => {
                    at = b.next;
                    continue;
                }
            };
            mapped += b.size;
            if st == SnapshotBlockState::ActiveAllocated {
                allocated_size += b.size;
            }
            if st != SnapshotBlockState::Inactive {
                active_size += b.size;
            }
            blocks.push(SnapshotBlock {
                addr: b.ptr,
                size: b.size,
                requested_size: b.requested,
                state: st,
                frames: Vec::new(),
            });
            at = b.next;
        }
        if mapped == 0 {
            // An expandable segment with nothing mapped holds no memory.
            continue;
        }
        out.push(SnapshotSegment {
            device,
            stream: stream.raw(),
            address,
            total_size: mapped,
            allocated_size,
            active_size,
            segment_type: match seg.pool {
                crate::alloc::size::PoolKind::Small => "small",
                crate::alloc::size::PoolKind::Large => "large",
            },
            is_expandable: state.expandable.contains_key(&address),
            segment_pool_id: state.pool,
            blocks,
        });
    }
}
