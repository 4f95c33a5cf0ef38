//! Thread front caches (`thread_cache_mb`, issue 14): what a demanding user needs from a cache that
//! skips the stream's lock — reuse by the freeing thread only, statistics that count what the
//! program holds, memory that is never stranded (out of memory, `empty_cache`, thread exit,
//! allocator drop), frees that wait for other streams, and exactly PyTorch's order when it is off.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{mpsc, Arc, Barrier};

use cudalloc::stats::SnapshotBlockState;
use cudalloc::{backend::Driver, backend::HostDriver, AllocatorConfig, Runtime};

const MIB: u64 = 1 << 20;

fn driver() -> Arc<HostDriver> {
    Arc::new(common::host_driver())
}

fn cached(d: &Arc<HostDriver>, mb: u64) -> Arc<Runtime> {
    // With the run's settings (expandable segments in CI's second pass).
    let config = common::test_config(&format!("thread_cache_mb:{mb}"));
    Arc::new(
        Runtime::builder()
            .config(config)
            .check_invariants(true)
            .build(d.clone())
            .unwrap(),
    )
}

fn used(d: &HostDriver) -> u64 {
    let m = d.mem_info(0).unwrap();
    m.total - m.free
}

/// Whether this thread's front cache holds the block at `addr` (of a `size`-byte allocation):
/// another thread asking the same size then gets other memory (the shard does not have it).
fn held_by_this_thread(a: &Runtime, size: u64, addr: u64) -> bool {
    std::thread::scope(|s| {
        s.spawn(|| a.allocate(0, size).unwrap().ptr().0 != addr)
            .join()
            .unwrap()
    })
}

fn block_state(a: &Runtime, addr: u64) -> Option<SnapshotBlockState> {
    a.snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .find(|b| b.addr == addr)
        .map(|b| b.state)
}

#[test]
fn the_setting_parses_and_bad_values_are_errors_naming_the_key() {
    assert_eq!(AllocatorConfig::default().thread_cache, 0);
    let c = AllocatorConfig::parse("thread_cache_mb:64").unwrap();
    assert_eq!(c.thread_cache, 64 * MIB);
    assert!(c.to_string().contains("thread_cache_mb: 64"));
    for bad in [
        "thread_cache_mb:-1",
        "thread_cache_mb:x",
        "thread_cache_mb:",
        "thread_cache_mb:99999999999",
    ] {
        let err = AllocatorConfig::parse(bad).unwrap_err().to_string();
        assert!(err.contains("thread_cache_mb"), "{bad}: {err}");
    }
}

#[test]
fn a_freed_block_is_reused_by_its_thread_and_counted_as_freed() {
    let d = driver();
    let a = cached(&d, 8);
    let first = a.allocate(0, 4096).unwrap();
    let addr = first.ptr();
    drop(first);
    // This thread's front cache holds it; the statistics and the snapshot count it as freed.
    assert!(held_by_this_thread(&a, 4096, addr.0));
    assert_eq!(block_state(&a, addr.0), Some(SnapshotBlockState::Inactive));
    let s = a.memory_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.allocation.all.current, 0);
    assert_eq!(s.active_bytes.all.current, 0);
    assert_eq!(s.requested_bytes.all.current, 0);
    assert!(s.reserved_bytes.all.current > 0);
    let again = a.allocate(0, 4000).unwrap(); // same rounded size
    assert_eq!(
        again.ptr(),
        addr,
        "the thread's own freed block was not reused"
    );
    let s = a.memory_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, 4096);
    assert_eq!(s.allocation.all.current, 1);
    // Another size goes to the shard.
    let other = a.allocate(0, 8192).unwrap();
    assert_ne!(other.ptr(), addr);
    drop((again, other));
    a.check_invariants().unwrap();
}

#[test]
fn another_thread_does_not_get_a_cached_block() {
    let d = driver();
    let a = cached(&d, 8);
    let p = a.allocate(0, 4096).unwrap();
    let addr = p.ptr();
    drop(p);
    let a2 = a.clone();
    let theirs = std::thread::spawn(move || a2.allocate(0, 4096).unwrap().ptr())
        .join()
        .unwrap();
    assert_ne!(
        theirs, addr,
        "a block in this thread's cache went to another thread"
    );
    // The other thread exited: its cache went back to the shard, so its block is free there.
    assert_eq!(
        block_state(&a, theirs.0),
        Some(SnapshotBlockState::Inactive)
    );
}

#[test]
fn empty_cache_gives_back_what_threads_keep() {
    let d = driver();
    let a = cached(&d, 32);
    let blocks: Vec<_> = (0..4).map(|_| a.allocate(0, 3 * MIB).unwrap()).collect();
    drop(blocks);
    assert!(used(&d) > 0);
    a.empty_cache();
    assert_eq!(used(&d), 0, "empty_cache left blocks in a thread's cache");
    assert_eq!(a.memory_stats(0).unwrap().reserved_bytes.all.current, 0);
}

#[test]
fn another_threads_cached_memory_is_flushed_before_out_of_memory() {
    // 64 MiB device: thread A keeps 40 MiB in its cache; thread B needs 40 MiB.
    let d = driver();
    let a = cached(&d, 64);
    let (ready_tx, ready_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let a1 = a.clone();
    let holder = std::thread::spawn(move || {
        drop(a1.allocate(0, 40 * MIB).unwrap()); // kept in this thread's cache
        ready_tx.send(()).unwrap();
        done_rx.recv().unwrap(); // stay alive (its cache with it) until B is done
    });
    ready_rx.recv().unwrap();
    assert!(used(&d) >= 40 * MIB);
    let b = a.allocate(0, 40 * MIB);
    assert!(
        b.is_ok(),
        "out of memory while another thread's cache held 40 MiB: {b:?}"
    );
    drop(b);
    done_tx.send(()).unwrap();
    holder.join().unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn dropping_the_allocator_retires_live_threads_caches() {
    let d = driver();
    let a = cached(&d, 32);
    let (ready_tx, ready_rx) = mpsc::channel();
    let gate = Arc::new(Barrier::new(2));
    let a1 = a.clone();
    let g = gate.clone();
    let worker = std::thread::spawn(move || {
        for size in [4096, 3 * MIB, 12 * MIB] {
            drop(a1.allocate(0, size).unwrap());
        }
        drop(a1);
        ready_tx.send(()).unwrap();
        g.wait(); // alive while the allocator is dropped
    });
    ready_rx.recv().unwrap();
    drop(a);
    assert_eq!(
        used(&d),
        0,
        "memory stayed in a live thread's cache after its allocator was dropped"
    );
    gate.wait();
    worker.join().unwrap();
}

#[test]
fn a_pointer_freed_after_its_allocator_goes_to_the_driver_not_a_cache() {
    let d = driver();
    let a = cached(&d, 32);
    drop(a.allocate(0, 4096).unwrap()); // this thread has a cache for the shard
    let kept = a.allocate(0, 8192).unwrap();
    drop(a);
    assert!(used(&d) > 0);
    drop(kept);
    assert_eq!(
        used(&d),
        0,
        "a block freed after its allocator was kept by a cache"
    );
}

#[test]
fn a_block_used_on_another_stream_waits_for_it_instead_of_being_cached() {
    let d = driver();
    let a = cached(&d, 32);
    let other = a.create_stream(0).unwrap();
    let p = a.allocate(0, 4096).unwrap();
    let addr = p.ptr();
    let gate = d.gate_stream(other).unwrap();
    a.record_stream(&p, other).unwrap();
    drop(p);
    assert_eq!(
        block_state(&a, addr.0),
        Some(SnapshotBlockState::ActivePendingFree)
    );
    let next = a.allocate(0, 4096).unwrap();
    assert_ne!(
        next.ptr(),
        addr,
        "a block was reused while another stream still used it"
    );
    drop(gate);
    d.stream_synchronize(other).unwrap();
    drop(next);
    a.check_invariants().unwrap();
}

#[test]
fn many_threads_on_one_stream_keep_the_shard_consistent() {
    let d = driver();
    let a = cached(&d, 4);
    let threads = 4;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut live = Vec::new();
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                for _ in 0..3000 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x.is_multiple_of(3) && !live.is_empty() {
                        live.swap_remove((x as usize / 3) % live.len());
                    } else {
                        live.push(a.allocate(0, 512 << (x % 6)).unwrap());
                    }
                }
                live.len() as i64
            })
        })
        .collect();
    // The threads exited with some blocks still live in `live` (dropped at their end), and their
    // caches were given back: nothing is allocated, every block is free in the shard.
    for h in handles {
        h.join().unwrap();
    }
    a.check_invariants().unwrap();
    let s = a.memory_stats(0).unwrap();
    assert_eq!(s.allocation.all.current, 0);
    assert_eq!(s.allocated_bytes.all.current, 0);
    let snapshot = a.snapshot();
    let busy = snapshot
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state != SnapshotBlockState::Inactive)
        .count();
    assert_eq!(
        busy, 0,
        "blocks stayed handed out after every thread exited"
    );
}

#[test]
fn off_by_default_the_freed_block_goes_back_to_the_shard_at_once() {
    let d = driver();
    let a = Runtime::new(d.clone(), AllocatorConfig::default()).unwrap();
    let p = a.allocate(0, 4096).unwrap();
    let addr = p.ptr();
    drop(p);
    assert_eq!(block_state(&a, addr.0), Some(SnapshotBlockState::Inactive));
}

#[test]
fn the_history_sees_front_cache_frees_and_reuses_as_frees_and_allocations() {
    use cudalloc::stats::TraceAction;
    let d = driver();
    let a = cached(&d, 8);
    a.record_memory_history(cudalloc::stats::HistoryOptions::new(
        cudalloc::stats::HistoryMode::All,
        1000,
    ));
    let p = a.allocate(0, 4096).unwrap();
    let addr = p.ptr().0;
    drop(p); // kept by this thread's front cache
    let again = a.allocate(0, 4096).unwrap(); // from the front cache
    assert_eq!(again.ptr().0, addr);
    drop(again);
    let actions: Vec<TraceAction> = a
        .snapshot()
        .trace
        .iter()
        .filter(|e| e.addr == addr)
        .map(|e| e.action)
        .filter(|a| !matches!(a, TraceAction::SegmentAlloc | TraceAction::SegmentMap))
        .collect();
    let (alloc, req, done) = (
        TraceAction::Alloc,
        TraceAction::FreeRequested,
        TraceAction::FreeCompleted,
    );
    assert_eq!(
        actions,
        [alloc, req, done, alloc, req, done],
        "every hand-out and free, through the front cache or not, is in the history"
    );
}

#[test]
fn allocators_built_one_after_another_on_a_thread_each_get_a_working_cache() {
    // A dropped allocator's shard memory is often reused by the next one's shard: the thread's
    // retired cache of the old shard must not be taken for the new shard's.
    let d = driver();
    for round in 0..50 {
        let a = cached(&d, 8);
        let p = a.allocate(0, 4096).unwrap();
        let addr = p.ptr();
        drop(p);
        assert!(
            held_by_this_thread(&a, 4096, addr.0),
            "round {round}: the freed block was not kept by this thread's cache"
        );
        assert_eq!(a.allocate(0, 4096).unwrap().ptr(), addr);
    }
}
