//! Memory history: PyTorch's `_record_memory_history` — a bounded ring of timestamped events, and
//! optionally the Rust stack of each allocation (captured as return addresses, symbolized only when
//! a snapshot is taken, each address once).
//!
//! | mode ([`HistoryMode`]) | ring records                                                   | stacks (with `stacks: true`)           |
//! |------------------------|----------------------------------------------------------------|----------------------------------------|
//! | `Off`                  | nothing (recording costs one relaxed atomic load)              | none                                   |
//! | `State`                | nothing (PyTorch's `enabled="state"`)                          | of live allocations, always: only what a snapshot's blocks show |
//! | `AllocOnly`            | `alloc`, `free_requested`, `free_completed`                    | of allocations (PyTorch's `context="alloc"`) |
//! | `All`                  | those, `segment_alloc`/`segment_free`, `segment_map`/`segment_unmap` (expandable segments), `oom`, `snapshot` | of allocations and free requests (`context="all"`) |
//!
//! Blocks in a snapshot carry the stack of their allocation while it is live (PyTorch's
//! `context="state"`): the ring keeps a table of live allocations' stacks by address. `State`
//! keeps only that table — no events, so no ring to size — and captures allocation stacks
//! whatever `stacks` says (a state without stacks would record nothing).

use std::collections::{HashMap, VecDeque};
use std::fmt;

use super::nvtx_regions::NvtxRegions;
use super::pool_id::MemPoolId;
use super::stacks::{self, Frame};
use crate::driver::StreamId;
use crate::sync::os::atomic::{AtomicU8, Ordering};
use crate::sync::os::{Arc, Mutex, OnceLock};

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
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages of an expandable segment were unmapped.
    SegmentUnmap,
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
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
            TraceAction::Snapshot => "snapshot",
        }
    }

    /// An event of a block (what `AllocOnly` records).
    fn of_block(self) -> bool {
        matches!(
            self,
            TraceAction::Alloc | TraceAction::FreeRequested | TraceAction::FreeCompleted
        )
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
#[non_exhaustive]
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
    /// For `oom`: bytes the driver reported free on the device (PyTorch's `device_free`).
    pub device_free: u64,
    /// The Rust stack of the event, innermost first (with stacks on; else empty).
    pub frames: Vec<Frame>,
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

/// What the history records: `State` — no events, only the stacks of live allocations (for a
/// snapshot's blocks); `AllocOnly` — `alloc`, `free_requested`, `free_completed` (stacks of
/// allocations); `All` — every event (stacks of allocations and free requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HistoryMode {
    /// Nothing.
    #[default]
    Off,
    /// No events; the stacks of live allocations, for a snapshot's blocks (PyTorch's
    /// `enabled="state"`).
    State,
    /// Allocations and frees.
    AllocOnly,
    /// Every event.
    All,
}

/// How [`Runtime::record_memory_history`](crate::Runtime::record_memory_history)
/// records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HistoryOptions {
    /// What is recorded.
    pub mode: HistoryMode,
    /// Entries kept (the oldest go first; PyTorch's `max_entries`).
    pub max_entries: usize,
    /// Capture the Rust stack of allocations (and, with `All`, of free requests).
    pub stacks: bool,
}

impl HistoryOptions {
    /// Records `mode`, keeping the last `max_entries` entries, without stacks.
    pub fn new(mode: HistoryMode, max_entries: usize) -> Self {
        HistoryOptions {
            mode,
            max_entries,
            stacks: false,
        }
    }

    /// With the Rust stack of each allocation (and, with `All`, of each free request).
    pub fn with_stacks(mut self, stacks: bool) -> Self {
        self.stacks = stacks;
        self
    }

    /// Whether these options capture stacks (`State` always does).
    pub(crate) fn captures_stacks(&self) -> bool {
        match self.mode {
            HistoryMode::Off => false,
            HistoryMode::State => true,
            HistoryMode::AllocOnly | HistoryMode::All => self.stacks,
        }
    }
}

impl Default for HistoryOptions {
    fn default() -> Self {
        HistoryOptions {
            mode: HistoryMode::All,
            max_entries: 100_000,
            stacks: false,
        }
    }
}

/// Microseconds since the Unix epoch.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A captured stack: return addresses, not yet symbolized.
type Stack = Arc<[usize]>;

/// (device, address) of a live allocation.
type BlockKey = (usize, u64);

/// Symbolized stacks of live allocations.
pub(crate) type LiveFrames = HashMap<BlockKey, Vec<Frame>>;

/// An entry as recorded (its stack unresolved).
#[derive(Debug)]
struct Recorded {
    entry: TraceEntry,
    stack: Option<Stack>,
}

#[derive(Debug, Default)]
struct Ring {
    capacity: usize,
    entries: VecDeque<Recorded>,
    /// Stacks of live allocations by (device, address), for snapshot blocks.
    live: HashMap<BlockKey, Stack>,
}

const OFF: u8 = 0;
const ALLOC_ONLY: u8 = 1;
const ALL: u8 = 2;
const STATE: u8 = 3;
/// Added to the mode when stacks are captured.
const STACKS: u8 = 4;
/// Added to the mode when NVTX regions follow the events (`nvtx_regions.rs`), whatever the
/// history records.
const NVTX: u8 = 8;

/// The history of one allocator.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    /// `OFF`, `STATE`, `ALLOC_ONLY` or `ALL`, plus `STACKS` (always with `STATE`), plus `NVTX`.
    mode: AtomicU8,
    ring: Mutex<Ring>,
    /// The NVTX heaps and regions (`nvtx_regions:True` with a tool attached), told of every
    /// event: the one door through which the allocator says what happened to its memory.
    regions: OnceLock<NvtxRegions>,
}

impl Trace {
    /// Applies `options` (turning history off clears what was recorded).
    pub(super) fn configure(&self, options: HistoryOptions) {
        let mut ring = self.ring.lock();
        ring.capacity = options.max_entries.max(1);
        let mode = match options.mode {
            HistoryMode::Off => OFF,
            HistoryMode::State => STATE,
            HistoryMode::AllocOnly => ALLOC_ONLY,
            HistoryMode::All => ALL,
        };
        if mode == OFF || mode == STATE {
            ring.entries.clear();
        }
        if mode == OFF {
            ring.live.clear();
        }
        while ring.entries.len() > ring.capacity {
            ring.entries.pop_front();
        }
        let stacks = if options.captures_stacks() { STACKS } else { 0 };
        let nvtx = self.mode.load(Ordering::Relaxed) & NVTX;
        self.mode.store(mode | stacks | nvtx, Ordering::Relaxed);
    }

    /// NVTX regions follow every event from now on (set once, when the allocator is built,
    /// before any memory exists).
    pub(super) fn follow_with(&self, regions: NvtxRegions) {
        if self.regions.set(regions).is_ok() {
            self.mode.fetch_or(NVTX, Ordering::Relaxed);
        }
    }

    /// Records one event (when the mode asks for it).
    #[inline]
    pub(super) fn record(
        &self,
        action: TraceAction,
        device: usize,
        addr: u64,
        size: u64,
        stream: StreamId,
    ) {
        debug_assert!(!matches!(
            action,
            TraceAction::SegmentAlloc | TraceAction::SegmentMap
        ));
        let mode = self.mode.load(Ordering::Relaxed);
        if mode == OFF {
            return;
        }
        self.record_slow(mode, action, device, addr, size, stream, 0, None);
    }

    /// Records memory mapped for `pool` (`segment_alloc`, or `segment_map` of an expandable
    /// segment): NVTX names its heap by the pool.
    pub(super) fn record_mapped(
        &self,
        action: TraceAction,
        device: usize,
        addr: u64,
        size: u64,
        stream: StreamId,
        pool: MemPoolId,
    ) {
        let mode = self.mode.load(Ordering::Relaxed);
        if mode == OFF {
            return;
        }
        self.record_slow(mode, action, device, addr, size, stream, 0, Some(pool));
    }

    /// Records an out-of-memory with the device's free bytes.
    pub(super) fn record_oom(&self, device: usize, size: u64, stream: StreamId, device_free: u64) {
        let mode = self.mode.load(Ordering::Relaxed);
        if mode == OFF {
            return;
        }
        self.record_slow(
            mode,
            TraceAction::Oom,
            device,
            0,
            size,
            stream,
            device_free,
            None,
        );
    }

    #[allow(clippy::too_many_arguments)]
    #[cold]
    fn record_slow(
        &self,
        mode: u8,
        action: TraceAction,
        device: usize,
        addr: u64,
        size: u64,
        stream: StreamId,
        device_free: u64,
        pool: Option<MemPoolId>,
    ) {
        if mode & NVTX != 0 {
            if let Some(regions) = self.regions.get() {
                match action {
                    TraceAction::SegmentAlloc | TraceAction::SegmentMap => {
                        let pool = pool.unwrap_or_default();
                        regions.mapped(device, addr, size, stream, pool);
                    }
                    TraceAction::SegmentFree | TraceAction::SegmentUnmap => {
                        regions.unmapping(device, addr, size);
                    }
                    TraceAction::Alloc => regions.handed_out(device, addr, size),
                    TraceAction::FreeCompleted => regions.freed(device, addr),
                    // Still valid memory until its uses end; no memory changes.
                    TraceAction::FreeRequested | TraceAction::Oom | TraceAction::Snapshot => {}
                }
            }
            if mode & !NVTX == OFF {
                return;
            }
        }
        let kind = mode & !(STACKS | NVTX);
        let all = kind == ALL;
        if !all && !action.of_block() {
            return;
        }
        if kind == STATE && action == TraceAction::FreeRequested {
            return;
        }
        let wants_stack = mode & STACKS != 0
            && (action == TraceAction::Alloc || (all && action == TraceAction::FreeRequested));
        let stack: Option<Stack> = wants_stack.then(|| stacks::capture().into());
        let time_us = now_us();
        let mut ring = self.ring.lock();
        match action {
            TraceAction::Alloc => {
                if let Some(s) = &stack {
                    ring.live.insert((device, addr), Arc::clone(s));
                }
            }
            TraceAction::FreeCompleted => {
                ring.live.remove(&(device, addr));
            }
            _ => {}
        }
        if kind == STATE {
            return;
        }
        while ring.entries.len() >= ring.capacity.max(1) {
            ring.entries.pop_front();
        }
        ring.entries.push_back(Recorded {
            entry: TraceEntry {
                action,
                device,
                addr,
                size,
                stream: stream.raw(),
                time_us,
                device_free,
                frames: Vec::new(),
            },
            stack,
        });
    }

    /// The entries recorded so far, oldest first, stacks symbolized; and the symbolized stacks of
    /// live allocations by (device, address).
    pub(super) fn entries_and_live_frames(&self) -> (Vec<TraceEntry>, LiveFrames) {
        type Copied = (Vec<(TraceEntry, Option<Stack>)>, Vec<(BlockKey, Stack)>);
        let (recorded, live): Copied = {
            let ring = self.ring.lock();
            (
                ring.entries
                    .iter()
                    .map(|r| (r.entry.clone(), r.stack.clone()))
                    .collect(),
                ring.live.iter().map(|(k, s)| (*k, Arc::clone(s))).collect(),
            )
        };
        // Symbolized outside the lock, each address once.
        let mut symbols = stacks::Symbolizer::default();
        let entries = recorded
            .into_iter()
            .map(|(mut entry, stack)| {
                if let Some(stack) = stack {
                    entry.frames = symbols.frames(&stack);
                }
                entry
            })
            .collect();
        let live = live
            .into_iter()
            .map(|(k, stack)| (k, symbols.frames(&stack)))
            .collect();
        (entries, live)
    }
}
