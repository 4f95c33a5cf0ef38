//! Memory history (PyTorch's `_record_memory_history`): modes, the entry limit, timestamps, the
//! out-of-memory entry, and Rust stacks symbolized at snapshot time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use cudalloc::{backend::Driver, backend::SimDriver, AllocatorConfig, DataPtr, Runtime};
use cudalloc::{
    stats::HistoryMode, stats::HistoryOptions, stats::SnapshotBlockState, stats::TraceAction,
};

fn allocator(conf: &str) -> Runtime {
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 64 << 20).unwrap());
    Runtime::new(driver, AllocatorConfig::parse(conf).unwrap()).unwrap()
}

fn options(mode: HistoryMode, max_entries: usize, stacks: bool) -> HistoryOptions {
    HistoryOptions::new(mode, max_entries).with_stacks(stacks)
}

fn actions(a: &Runtime) -> Vec<TraceAction> {
    a.snapshot().trace.iter().map(|e| e.action).collect()
}

#[test]
fn modes_record_what_they_say() {
    let a = allocator("");
    a.record_memory_history(options(HistoryMode::AllocOnly, 100, false));
    drop(a.allocate(0, 4096).unwrap());
    a.empty_cache();
    assert_eq!(
        actions(&a),
        [
            TraceAction::Alloc,
            TraceAction::FreeRequested,
            TraceAction::FreeCompleted
        ],
        "alloc-only: no segment events, no snapshot entry"
    );
    a.record_memory_history(options(HistoryMode::Off, 100, false));
    assert!(a.snapshot().trace.is_empty(), "off clears");
    drop(a.allocate(0, 4096).unwrap());
    assert!(a.snapshot().trace.is_empty(), "off records nothing");
    a.record_memory_history(options(HistoryMode::All, 3, false));
    for _ in 0..10 {
        drop(a.allocate(0, 4096).unwrap());
    }
    let trace = a.snapshot().trace;
    assert_eq!(trace.len(), 3, "the limit keeps the newest");
    assert_eq!(trace[2].action, TraceAction::Snapshot);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    assert!(trace.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    assert!(trace[0].time_us <= now && trace[0].time_us + 60_000_000 > now);
}

#[test]
fn expandable_segments_record_maps_and_unmaps() {
    let a = allocator("expandable_segments:True");
    a.record_memory_history(options(HistoryMode::All, 100, false));
    drop(a.allocate(0, 4 << 20).unwrap());
    a.empty_cache();
    let got = actions(&a);
    assert!(got.contains(&TraceAction::SegmentMap) && got.contains(&TraceAction::SegmentUnmap));
    assert!(!got.contains(&TraceAction::SegmentAlloc));
}

#[test]
fn an_out_of_memory_entry_says_what_was_free() {
    let a = allocator("");
    a.record_memory_history(options(HistoryMode::All, 100, false));
    let _held = a.allocate(0, 40 << 20).unwrap();
    assert!(a.allocate(0, 40 << 20).is_err());
    let trace = a.snapshot().trace;
    let oom = trace.iter().find(|e| e.action == TraceAction::Oom).unwrap();
    assert_eq!(oom.size, 40 << 20);
    assert_eq!(oom.device_free, 24 << 20);
}

/// Allocates through a function of this file, so its name is in the stack.
#[inline(never)]
fn allocate_here(a: &Runtime, size: u64) -> DataPtr {
    let p = a.allocate(0, size).unwrap();
    std::hint::black_box(&p);
    p
}

#[test]
fn stacks_name_the_caller_in_entries_and_live_blocks() {
    let a = allocator("");
    a.record_memory_history(options(HistoryMode::All, 100, true));
    let live = allocate_here(&a, 4096);
    drop(allocate_here(&a, 8192));
    let snap = a.snapshot();
    let alloc = snap
        .trace
        .iter()
        .find(|e| e.action == TraceAction::Alloc)
        .unwrap();
    assert!(
        alloc
            .frames
            .iter()
            .any(|f| f.name.contains("allocate_here")),
        "{:#?}",
        alloc.frames
    );
    assert!(
        !alloc.frames[0].name.starts_with("cudalloc::"),
        "internal frames are left out: {:?}",
        alloc.frames[0]
    );
    let request = snap
        .trace
        .iter()
        .find(|e| e.action == TraceAction::FreeRequested)
        .unwrap();
    assert!(
        !request.frames.is_empty(),
        "all: free requests carry stacks"
    );
    let block = snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.addr == live.ptr().0)
        .unwrap();
    assert_eq!(block.state, SnapshotBlockState::ActiveAllocated);
    assert!(block
        .frames
        .iter()
        .any(|f| f.name.contains("allocate_here")));
    assert!(snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == SnapshotBlockState::Inactive)
        .all(|b| b.frames.is_empty()));
    // Alloc-only (after clearing): no stacks on frees.
    a.record_memory_history(options(HistoryMode::Off, 100, false));
    a.record_memory_history(options(HistoryMode::AllocOnly, 100, true));
    drop(allocate_here(&a, 4096));
    let trace = a.snapshot().trace;
    assert!(trace
        .iter()
        .filter(|e| e.action != TraceAction::Alloc)
        .all(|e| e.frames.is_empty()));
    drop(live);
}

/// PyTorch's `enabled="state"`: no events at all, yet live blocks carry the stack of their
/// allocation (stacks are captured whatever `stacks` says), and a freed block's stack is gone.
#[test]
fn state_mode_records_no_events_but_live_blocks_carry_their_stacks() {
    let a = allocator("");
    a.record_memory_history(options(HistoryMode::All, 100, false));
    drop(a.allocate(0, 4096).unwrap());
    assert!(!actions(&a).is_empty());
    // Switching to `State` drops the events recorded so far.
    a.record_memory_history(options(HistoryMode::State, 100, false));
    let live = allocate_here(&a, 4096);
    drop(allocate_here(&a, 8192));
    let oom = a.allocate(0, 1 << 40);
    assert!(oom.is_err());
    let snap = a.snapshot();
    assert!(
        snap.trace.is_empty(),
        "state records no events: {:?}",
        snap.trace
    );
    let blocks: Vec<_> = snap.segments.iter().flat_map(|s| &s.blocks).collect();
    let block = blocks.iter().find(|b| b.addr == live.ptr().0).unwrap();
    assert_eq!(block.state, SnapshotBlockState::ActiveAllocated);
    if cfg!(feature = "stacks") {
        assert!(
            block
                .frames
                .iter()
                .any(|f| f.name.contains("allocate_here")),
            "{:#?}",
            block.frames
        );
    }
    assert!(blocks
        .iter()
        .filter(|b| b.state == SnapshotBlockState::Inactive)
        .all(|b| b.frames.is_empty()));
    // Off forgets the live stacks too.
    a.record_memory_history(options(HistoryMode::Off, 100, false));
    let snap = a.snapshot();
    assert!(snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .all(|b| b.frames.is_empty()));
    drop(live);
}

#[inline(never)]
fn storage_here(rt: &Arc<cudalloc::Runtime>) -> cudalloc::Storage {
    let s = cudalloc::Storage::new(rt, 0, 4096).unwrap();
    std::hint::black_box(&s);
    s
}

/// A recorded stack starts at the caller's frame, whichever door the allocation came through:
/// a `Storage` made through the `Runtime` carried the storage's, the runtime's and the
/// allocator's frames (and std's closures between them) on top before.
#[test]
fn stacks_start_at_the_caller_through_every_door() {
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 64 << 20).unwrap());
    let rt = Arc::new(cudalloc::Runtime::new(driver, AllocatorConfig::default()).unwrap());
    rt.record_memory_history(options(HistoryMode::All, 100, true));
    let s = storage_here(&rt);
    let snap = rt.snapshot();
    let alloc = snap
        .trace
        .iter()
        .find(|e| e.action == TraceAction::Alloc)
        .unwrap();
    let first = &alloc.frames[0].name;
    assert!(
        first.contains("storage_here"),
        "the stack starts at {first}, not at the caller: {:#?}",
        &alloc.frames[..alloc.frames.len().min(16)]
    );
    drop(s);
}
