//! Private memory pools (PyTorch's `MemPool` / `use_mem_pool`): the ports of `test_cuda.py`'s
//! pool tests (same names) and where pools meet the rest — out of memory, expandable segments,
//! statistics, snapshots, storages, dropping a pool with live blocks. On the host backend, and on
//! the CUDA backend in a CUDA run (the contract double in CI, a GPU in `scripts/gpu-check.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use cudalloc::{
    backend::Driver, backend::SimDriver, pool::MemPool, pool::MemPoolId, pool::MemPoolOptions,
    sanitizer::Sanitize, stats::SegmentChange, stats::Snapshot, AllocatorConfig, DataPtr, Runtime,
};

/// An allocator on the host backend with one device of `device_bytes`, or in a CUDA run (the
/// double, a GPU) on the CUDA backend capped at `device_bytes`.
fn allocator_with(conf: &str, device_bytes: u64) -> Runtime {
    let (driver, cap) = common::sized_driver(device_bytes);
    let driver = common::sanitized(driver);
    Runtime::builder()
        .config(AllocatorConfig::parse(&common::join_conf(conf, &cap)).unwrap())
        .check_invariants(true)
        .build(driver)
        .unwrap()
}

fn allocator() -> Runtime {
    allocator_with("", 256 << 20)
}

/// The pool whose segment holds `p` in `snap` (None: no segment holds it).
fn pool_of(snap: &Snapshot, p: &DataPtr) -> Option<MemPoolId> {
    let addr = p.ptr().0;
    // By the segments' blocks: an expandable segment's mapped pages need not be contiguous.
    snap.segments
        .iter()
        .find(|s| {
            s.blocks
                .iter()
                .any(|b| b.addr <= addr && addr < b.addr + b.size)
        })
        .map(|s| s.segment_pool_id)
}

fn holds(snap: &Snapshot, p: &DataPtr) -> bool {
    pool_of(snap, p).is_some()
}

fn reserved(a: &Runtime) -> i64 {
    a.memory_stats(0).unwrap().reserved_bytes.all.current
}

#[test]
fn test_mempool_id() {
    let a = allocator();
    let p1 = a.mem_pool(MemPoolOptions::default()).unwrap();
    let p2 = a.mem_pool(MemPoolOptions::default()).unwrap();
    let (f1, s1) = p1.id().as_pair();
    let (f2, s2) = p2.id().as_pair();
    // Pools a program makes are (0, n), n unique; (0, 0) is the default pool.
    assert_eq!((f1, f2), (0, 0));
    assert!(s1 > 0 && s2 > 0 && s1 != s2, "{s1} {s2}");
    assert!(p1.id().is_user_created() && !p1.id().is_default());
    assert!(MemPoolId::DEFAULT.is_default());
    assert_eq!(MemPoolId::DEFAULT.as_pair(), (0, 0));
    assert_eq!(p1.clone().id(), p1.id());
    assert_eq!(format!("{}", p1.id()), format!("(0, {s1})"));
}

#[test]
fn test_mempool_context() {
    let a = allocator();
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    assert_eq!(pool.use_count(), 1);
    assert_eq!(a.current_mem_pool(0), None);
    let inside = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        assert_eq!(pool.use_count(), 2, "the scope holds the pool");
        assert_eq!(a.current_mem_pool(0), Some(pool.id()));
        a.allocate(0, 1 << 20).unwrap()
    };
    assert_eq!(pool.use_count(), 1);
    assert_eq!(a.current_mem_pool(0), None);
    let outside = a.allocate(0, 1 << 20).unwrap();
    let snap = a.snapshot();
    assert_eq!(pool_of(&snap, &inside), Some(pool.id()));
    assert_eq!(pool_of(&snap, &outside), Some(MemPoolId::DEFAULT));
    let mine = pool.snapshot().unwrap();
    assert!(holds(&mine, &inside));
    assert!(!holds(&mine, &outside));
    assert!(mine.segments.iter().all(|s| s.segment_pool_id == pool.id()));
    // Nesting: the innermost scope wins, and the outer one is back after it.
    let other = a.mem_pool(MemPoolOptions::default()).unwrap();
    let outer = a.use_mem_pool(&pool, 0).unwrap();
    let inner = a.use_mem_pool(&other, 0).unwrap();
    let in_other = a.allocate(0, 4096).unwrap();
    drop(inner);
    let in_pool = a.allocate(0, 4096).unwrap();
    drop(outer);
    let snap = a.snapshot();
    assert_eq!(pool_of(&snap, &in_other), Some(other.id()));
    assert_eq!(pool_of(&snap, &in_pool), Some(pool.id()));
    a.check_invariants().unwrap();
}

#[test]
fn test_mempool_multithread() {
    let a = Arc::new(allocator());
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
                let ptrs: Vec<DataPtr> = {
                    let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
                    (0..16)
                        .map(|i| a.allocate(0, 4096 << (i % 5)).unwrap())
                        .collect()
                };
                (pool, ptrs)
            })
        })
        .collect();
    let results: Vec<(MemPool, Vec<DataPtr>)> =
        threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut ids: Vec<_> = results.iter().map(|(p, _)| p.id()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 8, "every thread's pool has its own id");
    let snap = a.snapshot();
    for (pool, ptrs) in &results {
        let mine = pool.snapshot().unwrap();
        for p in ptrs {
            assert_eq!(pool_of(&snap, p), Some(pool.id()));
            assert!(holds(&mine, p));
        }
        // No other thread's allocation is in this pool.
        for (other, theirs) in &results {
            if other.id() != pool.id() {
                assert!(theirs.iter().all(|p| !holds(&mine, p)));
            }
        }
    }
    a.check_invariants().unwrap();
}

#[test]
fn test_mempool_snapshot() {
    let a = allocator();
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let outside = a.allocate(0, 8192).unwrap();
    let inside = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        vec![
            a.allocate(0, 8192).unwrap(),
            a.allocate(0, 4 << 20).unwrap(),
        ]
    };
    let all = a.snapshot();
    let pools: Vec<_> = all.segments.iter().map(|s| s.segment_pool_id).collect();
    assert!(pools.contains(&pool.id()) && pools.contains(&MemPoolId::DEFAULT));
    let mine = pool.snapshot().unwrap();
    assert_eq!(
        mine.segments.len(),
        all.segments
            .iter()
            .filter(|s| s.segment_pool_id == pool.id())
            .count()
    );
    assert!(inside.iter().all(|p| holds(&mine, p)));
    assert!(!holds(&mine, &outside));
    #[cfg(feature = "pickle")]
    {
        // PyTorch's layout carries the pool as a pair.
        let bytes = all.to_pytorch_pickle(&a.config()).unwrap();
        let value: serde_pickle::Value =
            serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
        let text = format!("{value:?}");
        let (first, second) = pool.id().as_pair();
        assert!(
            text.contains(&format!("Tuple([I64({first}), I64({second})])")),
            "segment_pool_id of the pool in the pickle"
        );
    }
}

#[test]
fn test_use_mem_pool_current_thread() {
    let a = Arc::new(allocator());
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
    let here = a.allocate(0, 4096).unwrap();
    let a2 = Arc::clone(&a);
    let there = std::thread::spawn(move || {
        assert_eq!(a2.current_mem_pool(0), None, "the scope is this thread's");
        a2.allocate(0, 4096).unwrap()
    })
    .join()
    .unwrap();
    let snap = a.snapshot();
    assert_eq!(pool_of(&snap, &here), Some(pool.id()));
    assert_eq!(pool_of(&snap, &there), Some(MemPoolId::DEFAULT));
}

#[test]
fn test_use_mem_pool_current_thread_all_streams() {
    let a = allocator();
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let side = a.create_stream(0).unwrap();
    let other = a.create_stream(0).unwrap();
    let (on_current, on_side, on_guarded) = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        let on_current = a.allocate(0, 4096).unwrap();
        let on_side = a.allocate_on(side, 4096).unwrap();
        let _on = a.set_current_stream(other).unwrap();
        (on_current, on_side, a.allocate(0, 4096).unwrap())
    };
    let after = a.allocate_on(side, 4096).unwrap();
    let snap = a.snapshot();
    for p in [&on_current, &on_side, &on_guarded] {
        assert_eq!(pool_of(&snap, p), Some(pool.id()));
    }
    assert_eq!(pool_of(&snap, &after), Some(MemPoolId::DEFAULT));
    // One segment per stream in the pool: each stream has its own shard of it.
    let streams: std::collections::BTreeSet<u64> = pool
        .snapshot()
        .unwrap()
        .segments
        .iter()
        .map(|s| s.stream)
        .collect();
    assert_eq!(streams.len(), 3);
}

#[test]
fn test_mempool_expandable() {
    let a = allocator_with("expandable_segments:True", 256 << 20);
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let outside = a.allocate(0, 3 << 20).unwrap();
    let inside: Vec<DataPtr> = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        (0..4).map(|_| a.allocate(0, 3 << 20).unwrap()).collect()
    };
    let mine = pool.snapshot().unwrap();
    assert!(!mine.segments.is_empty());
    assert!(mine.segments.iter().all(|s| s.is_expandable));
    assert!(inside.iter().all(|p| holds(&mine, p)));
    assert!(!holds(&mine, &outside));
    // The pool's segment grew by pages of its own, not into the default pool's.
    assert!(!holds(&a.snapshot_default(), &inside[0]));
    drop(inside);
    drop(outside);
    a.empty_cache();
    assert!(
        reserved(&a) > 0,
        "a live pool keeps its cache through empty_cache"
    );
    pool.empty_cache();
    assert_eq!(
        reserved(&a),
        0,
        "the pool's pages go back with its own empty_cache"
    );
    a.check_invariants().unwrap();
}

trait DefaultSnapshot {
    fn snapshot_default(&self) -> Snapshot;
}

impl DefaultSnapshot for Runtime {
    /// The snapshot with only the default pool's segments.
    fn snapshot_default(&self) -> Snapshot {
        let mut snap = self.snapshot();
        snap.segments.retain(|s| s.segment_pool_id.is_default());
        snap
    }
}

/// Memory of a pool never serves an allocation outside it, nor the other way round: a freed
/// block of each side stays on its side, however well it would fit the other.
#[test]
fn memory_of_a_pool_serves_only_the_pool() {
    let a = allocator();
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let freed_in_pool = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        a.allocate(0, 1 << 20).unwrap().ptr()
    };
    let freed_outside = a.allocate(0, 1 << 20).unwrap().ptr();
    let outside = a.allocate(0, 1 << 20).unwrap();
    assert_eq!(
        outside.ptr(),
        freed_outside,
        "the default pool reuses its own block"
    );
    let inside = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        a.allocate(0, 1 << 20).unwrap()
    };
    assert_eq!(inside.ptr(), freed_in_pool, "the pool reuses its own block");
    let snap = a.snapshot();
    assert_eq!(pool_of(&snap, &inside), Some(pool.id()));
    assert_eq!(pool_of(&snap, &outside), Some(MemPoolId::DEFAULT));
    let stats = pool.memory_stats(0).unwrap();
    assert_eq!(stats.allocated_bytes.all.current, 1 << 20);
    assert_eq!(
        a.memory_stats(0).unwrap().allocated_bytes.all.current,
        2 << 20,
        "the device counts both"
    );
}

/// A dropped pool gives back its cache at once and its live blocks' memory once they are freed
/// (at the next release, as the default pool's).
#[test]
fn a_dropped_pool_gives_its_memory_back_as_its_blocks_are_freed() {
    let a = allocator();
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let kept = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        let kept = a.allocate(0, 4 << 20).unwrap();
        drop(a.allocate(0, 32 << 20).unwrap());
        kept
    };
    // The live block's 20 MiB segment and a cached 32 MiB one.
    assert_eq!(reserved(&a), 52 << 20);
    drop(pool);
    assert_eq!(
        reserved(&a),
        20 << 20,
        "the cached segment went back at once"
    );
    // The block still works and is still the (retired) pool's.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        a.driver()
            .memset(a.current_stream(0).unwrap(), kept.ptr(), 1, 4 << 20)
    }
    .unwrap();
    drop(kept);
    a.empty_cache();
    assert_eq!(reserved(&a), 0);
    a.check_invariants().unwrap();
}

/// Dropping pools does not grow the allocator: a retired pool's empty shard serves the next
/// pool on its stream (the statistics stay exact across the reuse).
#[test]
fn pools_made_and_dropped_in_a_loop_stay_exact() {
    let a = allocator();
    for round in 0..200u64 {
        let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
        let p = {
            let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
            a.allocate(0, 4096 + round).unwrap()
        };
        let stats = pool.memory_stats(0).unwrap();
        assert_eq!(stats.allocation.all.current, 1, "round {round}");
        assert_eq!(
            pool.snapshot().unwrap().segments.len(),
            1,
            "round {round}: only this pool's segment"
        );
        drop(p);
    }
    a.empty_cache();
    assert_eq!(reserved(&a), 0);
    assert_eq!(a.memory_stats(0).unwrap().allocation.all.current, 0);
    a.check_invariants().unwrap();
}

/// PyTorch's `no_split`: a pool's blocks are handed out whole.
#[test]
fn a_no_split_pool_hands_every_block_out_whole() {
    let a = allocator();
    let pool = a
        .mem_pool(MemPoolOptions::default().with_no_split(true))
        .unwrap();
    let ptrs: Vec<DataPtr> = {
        let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
        (0..3).map(|_| a.allocate(0, 512).unwrap()).collect()
    };
    let mine = pool.snapshot().unwrap();
    assert_eq!(
        mine.segments.len(),
        3,
        "one segment each: {:#?}",
        mine.segments
    );
    assert!(mine.segments.iter().all(|s| s.blocks.len() == 1));
    drop(ptrs);
    // The default pool splits as ever.
    let ptrs: Vec<DataPtr> = (0..3).map(|_| a.allocate(0, 512).unwrap()).collect();
    assert_eq!(a.snapshot_default().segments.len(), 1);
    drop(ptrs);
}

/// PyTorch's `use_on_oom`: an allocation outside pools that finds no memory takes a free block of
/// such a pool (on its stream); without the option it fails.
#[test]
fn a_use_on_oom_pool_lends_its_free_blocks_to_a_failing_allocation() {
    for lend in [false, true] {
        let a = allocator_with("", 64 << 20);
        let pool = a
            .mem_pool(MemPoolOptions::default().with_use_on_oom(lend))
            .unwrap();
        {
            let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
            drop(a.allocate(0, 40 << 20).unwrap());
        }
        // 24 MiB left on the device, a free 40 MiB block in the pool.
        let got = a.allocate(0, 30 << 20);
        if !lend {
            let err = got.unwrap_err();
            assert!(matches!(err, cudalloc::Error::OutOfMemory { .. }), "{err}");
            continue;
        }
        let p = got.unwrap();
        assert_eq!(
            pool_of(&a.snapshot(), &p),
            Some(pool.id()),
            "the pool's block"
        );
        assert_eq!(a.memory_stats(0).unwrap().num_ooms, 0);
        drop(p);
        assert_eq!(pool.memory_stats(0).unwrap().allocation.all.current, 0);
        a.check_invariants().unwrap();
    }
}

#[test]
fn a_pool_of_another_allocator_is_refused() {
    let a = allocator();
    let b = allocator();
    let pool = b.mem_pool(MemPoolOptions::default()).unwrap();
    let err = a.use_mem_pool(&pool, 0).unwrap_err();
    assert!(err.to_string().contains("another allocator"), "{err}");
    assert!(a
        .use_mem_pool(&a.mem_pool(MemPoolOptions::default()).unwrap(), 7)
        .is_err());
}

/// A storage made inside a scope lives in the pool: the runtime's door goes through the same
/// path.
#[test]
fn storages_made_in_a_scope_live_in_the_pool() {
    let driver: Arc<dyn Driver> = common::test_driver();
    let rt = Arc::new(cudalloc::Runtime::new(driver, AllocatorConfig::default()).unwrap());
    let pool = rt.mem_pool(MemPoolOptions::default()).unwrap();
    let s = {
        let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
        let s = cudalloc::Storage::new(&rt, 0, 1 << 20).unwrap();
        s.fill_pattern(7).unwrap();
        s
    };
    let addr = s.unordered_data_ptr().0;
    assert!(pool.snapshot().unwrap().segments.iter().any(|seg| seg
        .blocks
        .iter()
        .any(|b| b.addr <= addr && addr < b.addr + b.size)));
    assert_eq!(s.count_pattern_mismatches(7).unwrap(), 0);
    // A lazy clone's first write inside a scope materializes its copy in the pool too.
    let clone = s.lazy_clone().unwrap();
    let copied = {
        let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
        clone.unordered_mutable_data_ptr().unwrap().0
    };
    assert_ne!(copied, addr);
    assert!(pool.snapshot().unwrap().segments.iter().any(|seg| seg
        .blocks
        .iter()
        .any(|b| b.addr <= copied && copied < b.addr + b.size)));
    assert_eq!(clone.count_pattern_mismatches(7).unwrap(), 0);
}

// Found by a hostile review of the pools (each failed before its fix).

/// A new pool's statistics are its own: a retired shard taken again must not bring the dropped
/// pool's accumulated counts along (and the device's accumulated counts must not go backwards).
#[test]
fn a_reused_retired_shard_does_not_carry_the_old_pools_counts() {
    let a = allocator_with("", 256 << 20);
    let old = a.mem_pool(MemPoolOptions::default()).unwrap();
    {
        let _s = a.use_mem_pool(&old, 0).unwrap();
        for _ in 0..5 {
            drop(a.allocate(0, 4096).unwrap());
        }
    }
    assert_eq!(old.memory_stats(0).unwrap().allocation.all.allocated, 5);
    drop(old);
    let device_before = a.memory_stats(0).unwrap().allocation.all.allocated;
    let new = a.mem_pool(MemPoolOptions::default()).unwrap();
    let p = {
        let _s = a.use_mem_pool(&new, 0).unwrap();
        a.allocate(0, 4096).unwrap()
    };
    let stats = new.memory_stats(0).unwrap();
    assert_eq!(stats.allocation.all.current, 1);
    assert_eq!(
        stats.allocation.all.allocated, 1,
        "the new pool made one allocation"
    );
    assert_eq!(stats.num_device_alloc, 1, "the new pool mapped one segment");
    assert_eq!(
        a.memory_stats(0).unwrap().allocation.all.allocated,
        device_before + 1,
        "device counts are monotonic"
    );
    drop(p);
    a.check_invariants().unwrap();
}

/// With expandable segments, dropped pools must not accumulate: their retired shard keeps an
/// (empty) expandable segment, so it is never "empty" and never reused.
#[test]
fn expandable_pools_made_and_dropped_in_a_loop_do_not_pile_up() {
    let a = allocator_with("expandable_segments:True", 256 << 20);
    for _ in 0..20 {
        let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
        {
            let _s = a.use_mem_pool(&pool, 0).unwrap();
            drop(a.allocate(0, 3 << 20).unwrap());
        }
    }
    a.empty_cache();
    let stats = a.memory_stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.current, 0);
    let segments = a.snapshot().segments.len();
    assert!(
        segments <= 1 && stats.segment.all.current <= 1,
        "dropped pools left {segments} segments behind (segment.all.current = {})",
        stats.segment.all.current
    );
    a.check_invariants().unwrap();
}

/// A pool dropped on one thread while the allocator drops on another: before, the pool's shards
/// were in neither the map nor the retired list while its cache was released, so the allocator's
/// teardown missed them; they landed in the retired list afterwards and nobody ever orphaned them
/// (a cycle shard <-> device core): the live block's segment never went back to the driver.
#[test]
fn a_pool_dropped_while_the_allocator_drops_is_not_leaked() {
    let sim = Arc::new(SimDriver::new(1, 256 << 20).unwrap());
    let driver: Arc<dyn Driver> = sim.clone();
    let total = driver.mem_info(0).unwrap().total;
    let a = Runtime::builder()
        .sanitize(Sanitize::Off)
        .build(Arc::clone(&driver))
        .unwrap();
    // The dropping thread's unmap (inside the pool's retire) says so and waits until the
    // allocator has been dropped: the window held open without timing.
    let (in_retire, wait_in_retire) = std::sync::mpsc::channel::<()>();
    let (go_on, may_go_on) = std::sync::mpsc::channel::<()>();
    let (in_retire, may_go_on) = (Mutex::new(in_retire), Mutex::new(may_go_on));
    a.register_segment_observer(Arc::new(move |e| {
        if e.change == SegmentChange::Unmap && std::thread::current().name() == Some("pool-dropper")
        {
            let _ = in_retire.lock().unwrap().send(());
            let _ = may_go_on.lock().unwrap().recv();
        }
    }));
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let kept: DataPtr = {
        let _s = a.use_mem_pool(&pool, 0).unwrap();
        let kept = a.allocate(0, 4 << 20).unwrap();
        drop(a.allocate(0, 32 << 20).unwrap()); // a cached segment: retire releases it
        kept
    };
    let dropper = std::thread::Builder::new()
        .name("pool-dropper".into())
        .spawn(move || drop(pool))
        .unwrap();
    wait_in_retire.recv().unwrap();
    drop(a); // while the pool's shard is being released
    go_on.send(()).unwrap();
    dropper.join().unwrap();
    drop(kept);
    assert_eq!(
        driver.mem_info(0).unwrap().free,
        total,
        "every segment back to the driver once allocator, pool and blocks are gone"
    );
    assert_eq!(
        Arc::strong_count(&driver),
        2,
        "nothing of the allocator is left holding the driver"
    );
}
