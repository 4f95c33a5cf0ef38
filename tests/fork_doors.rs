//! Every door of a runtime and of what it hands out, asked by a forked child while a thread of the
//! parent was working behind that door: the child must get [`ErrorKind::ForkedChild`] (or, for
//! the doors that return no `Result` — `empty_cache`, a drop —, the documented harmless answer)
//! and end; none may wait for a lock the parent's thread held at the instant of the fork
//! (`src/process.rs`: the birth is checked before any lock).
//!
//! A thread of the parent allocates in a memory pool, reads and resets its statistics and
//! snapshots, reconfigures, overrides and sets the memory fraction, works on a storage, a tag and
//! the pinned allocator, in a loop; meanwhile the main thread forks [`CHILDREN`] children, which
//! run at once, side by side. The parent waits for each until one shared deadline, far past what
//! a child needs — a hang detector, not a timing —, and kills those still running.
//!
//! Its own test binary: the forks happen with no other test code running.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::forked::{fork_child, CHILD_DEADLINE_S};
use common::*;
use cudalloc::graph::{CaptureMode, Graph};
use cudalloc::pool::{MemPool, MemPoolOptions};
use cudalloc::{AllocatorConfig, ErrorKind, Runtime, Storage, StreamId, WakeOptions};

const MIB: u64 = 1 << 20;
/// Children forked while the parent's thread works.
const CHILDREN: usize = 20;

/// Whether `result` is the forked child's refusal; else `door` is noted in `answered`.
fn refused<T>(answered: &mut Vec<String>, door: &str, result: cudalloc::Result<T>) {
    match result {
        Err(err) if err.kind() == ErrorKind::ForkedChild => {}
        Err(err) => answered.push(format!("{door}: {err}")),
        Ok(_) => answered.push(format!("{door}: answered Ok")),
    }
}

/// What the parent's thread does until `stop`: every door the children ask, in a loop, so that
/// each fork happens while it holds one lock or another (a shard's, the device's shard map, the
/// pool's peak book, the configuration's writer lock, the tags', the storage's, the pinned
/// allocator's).
fn hammer(
    rt: &Arc<Runtime>,
    pool: &MemPool,
    storage: &Storage,
    rounds: &AtomicU64,
    stop: &AtomicBool,
) {
    let stream = rt.current_stream(0).unwrap();
    let captured = rt.create_stream(0).unwrap();
    let mut held = Vec::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        {
            let _in_pool = rt.use_mem_pool(pool, 0).unwrap();
            for size in [512, 3000, MIB + 512, 3 * MIB] {
                held.push(rt.allocate(0, size).unwrap());
            }
            held.drain(..held.len() / 2);
        }
        if held.len() > 16 {
            held.clear();
        }
        pool.memory_stats(0).unwrap();
        pool.snapshot().unwrap();
        pool.reset_peak_stats(0).unwrap();
        let threshold = if i.is_multiple_of(2) { "0.6" } else { "0.7" };
        rt.reconfigure(&format!("garbage_collection_threshold:{threshold}"))
            .unwrap();
        drop(rt.override_config("roundup_power2_divisions:4").unwrap());
        rt.set_per_process_memory_fraction(1.0, 0).unwrap();
        rt.memory_stats(0).unwrap();
        drop(rt.snapshot());
        storage.fill_pattern(i).unwrap();
        storage.record_stream(stream).unwrap();
        assert_eq!(storage.count_pattern_mismatches(i).unwrap(), 0);
        assert_eq!(rt.tag_names(), ["weights"]);
        assert!(!rt.is_asleep("weights").unwrap());
        drop(rt.pinned(4096).unwrap());
        rt.pinned_allocator().stats();
        rt.registration_stats();
        pool.empty_cache();
        // A capture and its graph's replay: the captures' routes and the graph's pool.
        let capture = rt
            .begin_capture(captured, None, CaptureMode::ThreadLocal)
            .unwrap();
        let output = rt.allocate_on(captured, 4096).unwrap();
        let graph = capture.end().unwrap();
        graph.replay(captured).unwrap();
        drop(output);
        drop(graph);
        i += 1;
        rounds.store(i, Ordering::Relaxed);
    }
}

/// What a child does with what it inherited: every door, each refused (or harmless); the doors
/// that answered otherwise, as the child's failure.
fn ask_every_door(
    rt: &Arc<Runtime>,
    pool: &MemPool,
    storage: &Storage,
    graph: &Graph,
    stream: StreamId,
) -> Result<(), String> {
    let mut answered = Vec::new();
    let a = &mut answered;
    // The pool's doors.
    refused(a, "MemPool::memory_stats", pool.memory_stats(0));
    refused(a, "MemPool::snapshot", pool.snapshot());
    refused(a, "MemPool::reset_peak_stats", pool.reset_peak_stats(0));
    pool.empty_cache();
    // Settings.
    refused(
        a,
        "reconfigure",
        rt.reconfigure("garbage_collection_threshold:0.8"),
    );
    refused(
        a,
        "override_config",
        rt.override_config("garbage_collection_threshold:0.8"),
    );
    refused(
        a,
        "set_per_process_memory_fraction",
        rt.set_per_process_memory_fraction(0.5, 0),
    );
    // Statistics.
    refused(a, "memory_stats", rt.memory_stats(0));
    refused(a, "pools_reserved", rt.pools_reserved(0));
    refused(a, "memory_summary", rt.memory_summary(0));
    refused(a, "reset_peak_memory_stats", rt.reset_peak_memory_stats(0));
    if !rt.snapshot().segments.is_empty() {
        a.push("snapshot: the parent's segments".into());
    }
    if rt.check_invariants().is_ok() {
        a.push("check_invariants: answered Ok".into());
    }
    // Pools, tags, sleep.
    refused(a, "mem_pool", rt.mem_pool(MemPoolOptions::default()));
    refused(a, "use_mem_pool", rt.use_mem_pool(pool, 0));
    refused(a, "allocate", rt.allocate(0, 4096));
    refused(a, "tag", rt.tag("weights"));
    refused(a, "use_tag", rt.use_tag("weights", 0));
    refused(a, "is_asleep", rt.is_asleep("weights"));
    if !rt.tag_names().is_empty() {
        a.push("tag_names: the parent's tags".into());
    }
    refused(a, "sleep", rt.sleep(&["weights"], &[]));
    refused(a, "wake_up", rt.wake_up(&[], WakeOptions::default()));
    // Captures and graphs.
    refused(
        a,
        "begin_capture",
        rt.begin_capture(stream, None, CaptureMode::ThreadLocal),
    );
    refused(a, "Graph::replay", graph.replay(stream));
    refused(
        a,
        "Graph::pool().memory_stats",
        graph.pool().memory_stats(0),
    );
    // Registration.
    refused(
        a,
        "registered_regions",
        rt.registered_regions(0, storage.unordered_data_ptr(), 4096),
    );
    if rt.registration_stats().mapped_regions != 0 {
        a.push("registration_stats: the parent's regions".into());
    }
    // The storage.
    refused(a, "Storage::fill_pattern", storage.fill_pattern(1));
    refused(a, "Storage::record_stream", storage.record_stream(stream));
    refused(a, "Storage::lazy_clone", storage.lazy_clone());
    refused(a, "Storage::share_ipc", storage.share_ipc());
    // The address word alone, no lock: any answer, as long as it comes.
    let _ = storage.data_ptr_on(stream);
    let _ = (storage.allocation_stream(), storage.is_received());
    // The pinned allocator.
    refused(a, "pinned", rt.pinned(4096));
    if rt.pinned_allocator().stats() != Default::default() {
        a.push("PinnedAllocator::stats: the parent's figures".into());
    }
    rt.pinned_allocator().reset_peak_stats();
    // Release: nothing of the parent's.
    rt.empty_cache();
    rt.ipc_collect();
    drop(pool.clone());
    if answered.is_empty() {
        Ok(())
    } else {
        Err(answered.join("; "))
    }
}

#[test]
fn forked_children_are_refused_at_every_door_while_a_parent_thread_works_behind_it() {
    let rt = Arc::new(
        Runtime::builder()
            .config(AllocatorConfig::default())
            .build(sanitized(Arc::new(host_driver())))
            .unwrap(),
    );
    let pool = rt.mem_pool(MemPoolOptions::default()).unwrap();
    drop(rt.tag("weights").unwrap());
    let storage = Storage::new(&rt, 0, MIB).unwrap();
    let stream = rt.current_stream(0).unwrap();
    let graph = {
        let side = rt.create_stream(0).unwrap();
        let capture = rt
            .begin_capture(side, None, CaptureMode::ThreadLocal)
            .unwrap();
        drop(rt.allocate_on(side, 4096).unwrap());
        capture.end().unwrap()
    };
    let rounds = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (rt, pool, storage) = (Arc::clone(&rt), pool.clone(), storage.clone());
        let (rounds, stop) = (Arc::clone(&rounds), Arc::clone(&stop));
        std::thread::spawn(move || hammer(&rt, &pool, &storage, &rounds, &stop))
    };
    // Each fork after one more round of the thread (a wait for its progress, not a sleep), so
    // that the forks fall at different points of its loop.
    let children: Vec<_> = (0..CHILDREN)
        .map(|_| {
            let seen = rounds.load(Ordering::Relaxed);
            while rounds.load(Ordering::Relaxed) == seen && !worker.is_finished() {
                std::thread::yield_now();
            }
            fork_child(|| ask_every_door(&rt, &pool, &storage, &graph, stream))
        })
        .collect();
    // Far past what a child needs (it makes a few dozen calls); a child's own alarm ends it
    // first.
    let deadline = Instant::now() + Duration::from_secs(u64::from(CHILD_DEADLINE_S) + 30);
    let mut hung = 0;
    let mut failed = Vec::new();
    for child in children {
        let pid = child.pid();
        if let Err(failure) = child.wait_until(deadline) {
            hung += usize::from(failure.hung);
            failed.push(format!("child {pid}: {}", failure.why));
        }
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    println!(
        "children hung: {hung} of {CHILDREN}; failed in all: {} of {CHILDREN}",
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{hung} of {CHILDREN} children hung, {} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
    // The parent goes on.
    rt.check_invariants().unwrap();
    storage.fill_pattern(7).unwrap();
    assert_eq!(storage.count_pattern_mismatches(7).unwrap(), 0);
    assert!(pool.memory_stats(0).is_ok() && pool.snapshot().is_ok());
}
