//! Snapshots (segments with their blocks and states) and the allocation trace.
//!
//! The trace is PyTorch's `_record_memory_history`: a bounded ring of entries, one per `alloc`,
//! `free_requested`, `free_completed`, `segment_alloc`, `segment_free`, `oom` and `snapshot`. When
//! history is off, recording costs one relaxed atomic load.

use std::collections::VecDeque;
use std::fmt;

use super::block::BlockState;
use super::shard::ShardState;
use crate::driver::StreamId;
use crate::sync::os::atomic::{AtomicBool, Ordering};
use crate::sync::os::Mutex;

/// What a trace entry records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "snake_case")
)]
pub enum TraceAction {
    /// A block was handed out.
    Alloc,
    /// The owner dropped a block (it may still wait for other streams).
    FreeRequested,
    /// The block became free for reuse.
    FreeCompleted,
    /// A segment was obtained from the driver.
    SegmentAlloc,
    /// A segment was returned to the driver.
    SegmentFree,
    /// An allocation failed with out-of-memory.
    Oom,
    /// A snapshot was taken.
    Snapshot,
}

impl TraceAction {
    /// PyTorch's name of the action.
    pub fn name(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::Oom => "oom",
            TraceAction::Snapshot => "snapshot",
        }
    }
}

impl fmt::Display for TraceAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One trace entry.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Device ordinal.
    pub device: usize,
    /// Address of the block or segment (0 for `oom`/`snapshot`).
    pub addr: u64,
    /// Bytes involved (the request for `oom`).
    pub size: u64,
    /// Raw id of the stream.
    pub stream: u64,
    /// When it happened: microseconds since the Unix epoch (PyTorch's `time_us`).
    pub time_us: u64,
}

impl TraceEntry {
    /// The entry as one line of cudalloc's JSON-lines trace format (what `cudalloc replay`
    /// reads): `{"action":"alloc","device":0,"addr":…,"size":…,"stream":…,"time_us":…}`.
    pub fn to_json_line(&self) -> String {
        format!(
            "{{\"action\":\"{}\",\"device\":{},\"addr\":{},\"size\":{},\"stream\":{},\"time_us\":{}}}",
            self.action.name(),
            self.device,
            self.addr,
            self.size,
            self.stream,
            self.time_us
        )
    }
}

/// `entries` in cudalloc's JSON-lines trace format, one line each (see
/// [`TraceEntry::to_json_line`]).
pub fn trace_json_lines(entries: &[TraceEntry]) -> String {
    let mut out = String::new();
    for e in entries {
        out.push_str(&e.to_json_line());
        out.push('\n');
    }
    out
}

/// Microseconds since the Unix epoch.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The bounded trace ring of one allocator.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    enabled: AtomicBool,
    ring: Mutex<(usize, VecDeque<TraceEntry>)>,
}

impl Trace {
    /// Turns recording on with room for `max_entries`, or off (clearing the ring).
    pub fn configure(&self, enabled: bool, max_entries: usize) {
        let mut ring = self.ring.lock();
        ring.0 = max_entries.max(1);
        if !enabled {
            ring.1.clear();
        }
        self.enabled.store(enabled, Ordering::Relaxed);
    }

    /// Records one entry when enabled.
    #[inline]
    pub fn record(
        &self,
        action: TraceAction,
        device: usize,
        addr: u64,
        size: u64,
        stream: StreamId,
    ) {
        if !self.enabled.load(Ordering::Relaxed) {
            return;
        }
        let time_us = now_us();
        let mut ring = self.ring.lock();
        let cap = ring.0;
        while ring.1.len() >= cap {
            ring.1.pop_front();
        }
        ring.1.push_back(TraceEntry {
            action,
            device,
            addr,
            size,
            stream: stream.raw(),
            time_us,
        });
    }

    /// The entries recorded so far, oldest first.
    pub fn entries(&self) -> Vec<TraceEntry> {
        self.ring.lock().1.iter().cloned().collect()
    }
}

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
pub struct SnapshotBlock {
    /// Address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes the caller asked for (0 unless allocated).
    pub requested_size: u64,
    /// State.
    pub state: SnapshotBlockState,
}

/// One segment of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
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
    /// Blocks in address order.
    pub blocks: Vec<SnapshotBlock>,
}

/// A whole-allocator snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Snapshot {
    /// Every segment of every device and stream, by device then address.
    pub segments: Vec<SnapshotSegment>,
    /// Trace entries (empty unless history is enabled).
    pub trace: Vec<TraceEntry>,
}

/// Appends the segments of one shard to `out`.
pub(crate) fn shard_segments(
    state: &ShardState,
    device: usize,
    stream: StreamId,
    out: &mut Vec<SnapshotSegment>,
) {
    for (&address, seg) in &state.segments {
        let mut blocks = Vec::new();
        let mut at = Some(seg.head);
        let (mut allocated_size, mut active_size, mut mapped) = (0, 0, 0);
        while let Some(id) = at {
            let b = &state.blocks[id];
            let st = match b.state {
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
                super::size::PoolKind::Small => "small",
                super::size::PoolKind::Large => "large",
            },
            is_expandable: state.expandable.contains_key(&address),
            blocks,
        });
    }
}
