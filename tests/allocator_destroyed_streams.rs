//! Where destroyed streams meet recycled shards, pools, expandable segments, lazy clones, forks and
//! the configuration cell: the findings of a hostile review of issue 46 (each failed before its fix)
//! and its checks that held.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;

const KIB: u64 = 1 << 10;

/// A thread's shard cache still names a destroyed stream's shard: `allocate_on` of the destroyed
/// stream must be refused, as it is on a thread with no cached slot (the driver no longer knows
/// the stream), and must never put a block into a buried shard.
#[test]
fn a_cached_slot_of_a_destroyed_stream_is_refused() {
    let rt = checked_allocator(test_driver(), "");
    let s = rt.create_stream(0).unwrap();
    drop(rt.allocate_on(s, 64 * KIB).unwrap()); // caches (alloc, Stream(s)) on this thread
    rt.destroy_stream(s).unwrap();
    rt.empty_cache(); // the shard holds nothing now: buried
    assert_eq!(rt.bookkeeping(0).unwrap().buried_shards, 1);
    let other = std::thread::scope(|sc| {
        sc.spawn(|| rt.allocate_on(s, 64 * KIB).map(drop))
            .join()
            .unwrap()
    });
    assert!(other.is_err(), "a thread with no cached slot is refused");
    let stale = rt.allocate_on(s, 64 * KIB);
    assert!(
        stale.is_err(),
        "allocate_on(destroyed stream) succeeded through this thread's cached slot: {:?}",
        rt.bookkeeping(0).unwrap()
    );
}

/// What the stale slot's block does to the next new stream: the buried shard it went into is
/// recycled (`Shard::recycle` replaces the state) while the block is out. With debug assertions
/// the recycle's `debug_assert!` fires; without them the stale block's free indexes the recycled
/// state and frees the new stream's block, which is handed out a second time.
#[test]
fn a_block_in_a_buried_shard_survives_its_recycling() {
    // Unchecked, as a program runs it: the invariant scanner would stop at the first symptom.
    let rt = cudalloc::Runtime::builder()
        .config(test_config(""))
        .build(test_driver())
        .unwrap();
    let s = rt.create_stream(0).unwrap();
    drop(rt.allocate_on(s, 64 * KIB).unwrap());
    rt.destroy_stream(s).unwrap();
    rt.empty_cache();
    let Ok(stale) = rt.allocate_on(s, 64 * KIB) else {
        return; // refused: nothing can reach a buried shard
    };
    let mut stale = std::mem::ManuallyDrop::new(stale);
    let t = rt.create_stream(0).unwrap();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let y = rt.allocate_on(t, 64 * KIB).unwrap();
        // SAFETY: dropped once, here (never on the unwinding path).
        unsafe { std::mem::ManuallyDrop::drop(&mut stale) };
        let w = rt.allocate_on(t, 64 * KIB).unwrap();
        (y, w)
    }));
    let (y, w) = outcome.expect("the recycle or the stale block's free panicked");
    assert_ne!(y.ptr(), w.ptr(), "two live blocks at one address");
    drop((y, w));
}

/// A forked child reads the configuration it inherited (to build a runtime of its own with the
/// parent's settings, as `process.rs` tells a child to) while a thread of the parent reads or
/// changes it: `Runtime::config` locks the cell's `current` mutex without asking the birth first,
/// so a child forked while a parent thread held that lock waits forever.
#[test]
fn a_forked_child_reads_the_inherited_configuration() {
    use common::forked::{alone, fork_child, CHILD_DEADLINE_S};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    if !alone("a_forked_child_reads_the_inherited_configuration") {
        return;
    }
    let rt = Arc::new(
        cudalloc::Runtime::builder()
            .config(cudalloc::AllocatorConfig::default())
            .build(Arc::new(host_driver()))
            .unwrap(),
    );
    let rounds = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (rt, rounds, stop) = (Arc::clone(&rt), Arc::clone(&rounds), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..64 {
                    drop(rt.config());
                }
                let threshold = if i.is_multiple_of(2) { "0.6" } else { "0.7" };
                rt.reconfigure(&format!("garbage_collection_threshold:{threshold}"))
                    .unwrap();
                i += 1;
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let children: Vec<_> = (0..40)
        .map(|_| {
            let seen = rounds.load(Ordering::Relaxed);
            while rounds.load(Ordering::Relaxed) == seen && !worker.is_finished() {
                std::thread::yield_now();
            }
            // The child reads the configuration only (what it would build its own runtime
            // with): a hang is that read's.
            fork_child(|| {
                let inherited = (*rt.config()).clone();
                assert!(inherited.garbage_collection_threshold >= 0.6);
                Ok(())
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(u64::from(CHILD_DEADLINE_S) + 30);
    let mut failed = Vec::new();
    for child in children {
        let pid = child.pid();
        if let Err(failure) = child.wait_until(deadline) {
            failed.push(format!(
                "child {pid} (hung: {}): {}",
                failure.hung, failure.why
            ));
        }
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    assert!(
        failed.is_empty(),
        "{} of 40 children failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

fn kept(rt: &cudalloc::Runtime) -> cudalloc::stats::Bookkeeping {
    rt.bookkeeping(0).unwrap()
}

fn kept_total(rt: &cudalloc::Runtime) -> usize {
    let k = kept(rt);
    k.shards + k.retired_shards + k.buried_shards
}

/// A memory pool per request and a stream per request, the pool dropped before the stream is
/// destroyed: the pool's retired shard of the stream is never marked finished (`mark_finished`
/// walks the map only), so it is never buried, and no later pool can take it (its stream is
/// gone). The shards kept grow by one per step.
#[test]
fn a_pool_dropped_before_its_stream_leaves_a_shard_per_step() {
    use cudalloc::pool::MemPoolOptions;
    let rt = checked_allocator(test_driver(), "");
    let mut after_warmup = 0;
    for step in 0..100 {
        let s = rt.create_stream(0).unwrap();
        let pool = rt.mem_pool(MemPoolOptions::default()).unwrap();
        {
            let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
            let _on = rt.set_current_stream(s).unwrap();
            drop(rt.allocate(0, 64 * KIB).unwrap());
        }
        drop(pool);
        rt.destroy_stream(s).unwrap();
        rt.empty_cache();
        if step == 10 {
            after_warmup = kept_total(&rt);
        }
    }
    assert!(
        kept_total(&rt) <= after_warmup.max(4),
        "{:?} after 100 steps ({after_warmup} shards after 10)",
        kept(&rt)
    );
    rt.check_invariants().unwrap();
}

/// A long-lived memory pool (a graph pool, say) used on a stream per step: each destroyed
/// stream's pool shard stayed in the device's map for the pool's life, even emptied by
/// `MemPool::empty_cache` (100 shards after 100 steps). Once empty it leaves the pool, whose
/// statistics keep its counts.
#[test]
fn a_long_lived_pool_keeps_no_shard_of_destroyed_streams() {
    use cudalloc::pool::MemPoolOptions;
    let rt = checked_allocator(test_driver(), "");
    let pool = rt.mem_pool(MemPoolOptions::default()).unwrap();
    let mut after_warmup = 0;
    for step in 0..100 {
        let s = rt.create_stream(0).unwrap();
        {
            let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
            let _on = rt.set_current_stream(s).unwrap();
            drop(rt.allocate(0, 64 * KIB).unwrap());
        }
        rt.destroy_stream(s).unwrap();
        pool.empty_cache();
        rt.empty_cache();
        if step == 10 {
            after_warmup = kept_total(&rt);
        }
    }
    assert!(
        kept_total(&rt) <= after_warmup.max(4),
        "{:?} after 100 steps ({after_warmup} shards after 10)",
        kept(&rt)
    );
    rt.check_invariants().unwrap();
    let stats = pool.memory_stats(0).unwrap();
    assert_eq!(stats.allocation.all.allocated, 100, "{stats:?}");
    assert_eq!(stats.allocation.all.freed, 100, "{stats:?}");
    assert_eq!(stats.allocation.all.current, 0, "{stats:?}");
    assert!(
        stats.allocated_bytes.all.peak >= 64 * KIB as i64,
        "{stats:?}"
    );
    rt.reset_accumulated_memory_stats(0).unwrap();
    assert_eq!(pool.memory_stats(0).unwrap().allocation.all.allocated, 0);
}

/// A buried shard recycled as a memory pool's shard: the pool's accumulated counts are its own,
/// the device's keep the recycled shard's history, peaks stay exact.
#[test]
fn a_recycled_shard_as_a_pools_shard_counts_for_the_pool_alone() {
    use cudalloc::pool::MemPoolOptions;
    let rt = checked_allocator(test_driver(), "");
    for _ in 0..3 {
        let s = rt.create_stream(0).unwrap();
        let held: Vec<_> = (0..4)
            .map(|_| rt.allocate_on(s, 64 * KIB).unwrap())
            .collect();
        drop(held);
        rt.destroy_stream(s).unwrap();
        rt.empty_cache();
    }
    assert!(kept(&rt).buried_shards >= 1, "{:?}", kept(&rt));
    rt.reset_peak_memory_stats(0).unwrap();
    let pool = rt.mem_pool(MemPoolOptions::default()).unwrap();
    let t = rt.create_stream(0).unwrap();
    let x = {
        let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
        let _on = rt.set_current_stream(t).unwrap();
        rt.allocate(0, 64 * KIB).unwrap()
    };
    assert_eq!(
        kept(&rt).buried_shards,
        0,
        "the pool's shard is the recycled one"
    );
    let ps = pool.memory_stats(0).unwrap();
    assert_eq!(ps.allocation.all.allocated, 1, "{ps:?}");
    assert_eq!(ps.allocation.all.current, 1);
    assert_eq!(ps.allocation.all.peak, 1);
    assert_eq!(ps.allocated_bytes.all.peak, 64 * KIB as i64);
    let ds = rt.memory_stats(0).unwrap();
    assert_eq!(ds.allocation.all.allocated, 13, "{ds:?}");
    assert_eq!(ds.allocation.all.peak, 1);
    assert_eq!(rt.max_memory_allocated(0).unwrap(), 64 * KIB);
    drop(x);
    drop(pool);
    rt.check_invariants().unwrap();
}

/// Settings change (rounding, fit rules, segment kind, cap) while two threads allocate with
/// front caches and lend blocks across streams, and destroy and make streams (recycled shards):
/// every shard's invariants hold after every change (`check_invariants(true)`), the statistics
/// come back to zero.
#[test]
fn reconfigure_races_allocations_on_recycled_shards() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const MIB: u64 = 1 << 20;
    let driver = cudalloc::backend::HostDriver::builder()
        .devices(1)
        .memory_per_device(512 * MIB)
        .build()
        .unwrap();
    let rt = Arc::new(
        cudalloc::Runtime::builder()
            .config(test_config("thread_cache_mb:8,cross_stream_reuse:blocks"))
            .check_invariants(true)
            .build(sanitized(Arc::new(driver)))
            .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2usize)
        .map(|t| {
            let (rt, stop) = (Arc::clone(&rt), Arc::clone(&stop));
            std::thread::spawn(move || {
                let sizes = [512, 3000, MIB + 512, 3 * MIB, 12 * MIB, 22 * MIB, 30 * MIB];
                let mut s = rt.create_stream(0).unwrap();
                let mut live = Vec::new();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) || i < 400 {
                    if i % 25 == 24 {
                        // Blocks of the old stream stay out across its destruction.
                        rt.destroy_stream(s).unwrap();
                        s = rt.create_stream(0).unwrap();
                    }
                    let size = sizes[(i * 3 + t) % sizes.len()];
                    live.push(rt.allocate_on(s, size).unwrap());
                    if live.len() > 4 {
                        live.remove(i % live.len());
                    }
                    i += 1;
                }
                drop(live);
                rt.destroy_stream(s).unwrap();
            })
        })
        .collect();
    let changes = [
        "max_split_size_mb:21,max_non_split_rounding_mb:0",
        "roundup_power2_divisions:4,expandable_segments:True",
        "max_split_size_mb:64,max_non_split_rounding_mb:40",
        "roundup_power2_divisions:[256:2,>:8],expandable_segments:False",
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9",
    ];
    for i in 0..200usize {
        rt.reconfigure(changes[i % changes.len()]).unwrap();
        {
            let _scope = rt.override_config("max_split_size_mb:30").unwrap();
            rt.set_per_process_memory_fraction(if i.is_multiple_of(2) { 1.0 } else { 0.95 }, 0)
                .unwrap();
            rt.memory_stats(0).unwrap();
        }
        if i % 20 == 0 {
            rt.empty_cache();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    rt.empty_cache();
    rt.check_invariants().unwrap();
    let stats = rt.memory_stats(0).unwrap();
    assert_eq!(stats.allocated_bytes.all.current, 0, "{stats:?}");
    assert_eq!(stats.active.all.current, 0);
    assert_eq!(stats.reserved_bytes.all.current, 0, "{:?}", kept(&rt));
}

/// With `expandable_segments:True` a destroyed stream's shard keeps its expandable segment once
/// every page is released (the reservation, a wholly unmapped block): `bury_empty` asks for
/// no segment at all, so the shard is never buried — nor its reservation freed — and the shards
/// kept grow by one per stream (`allocator_bookkeeping.rs`'s own test fails the same way under
/// `CUDALLOC_TEST_EXPANDABLE=1`, as `scripts/gpu-check.sh` runs it).
#[test]
fn destroyed_streams_with_expandable_segments_are_buried() {
    for policy in ["off", "segments", "blocks"] {
        let conf = format!("expandable_segments:True,cross_stream_reuse:{policy}");
        let rt = checked_allocator(test_driver(), &conf);
        let mut after_warmup = 0;
        for step in 0..100 {
            let s = rt.create_stream(0).unwrap();
            drop(rt.allocate_on(s, 64 * KIB).unwrap());
            rt.destroy_stream(s).unwrap();
            rt.empty_cache();
            if step == 10 {
                after_warmup = kept_total(&rt);
            }
        }
        assert!(
            kept_total(&rt) <= after_warmup.max(4),
            "{conf}: {:?} after 100 streams ({after_warmup} after 10)",
            kept(&rt)
        );
        rt.check_invariants().unwrap();
    }
}

/// What the unburied shards keep: each destroyed stream's expandable segment keeps its address
/// reservation (twice the device's capacity) for the allocator's life. On a large device the
/// process's address space runs out after a handful of streams, though every byte was freed.
#[test]
fn destroyed_streams_give_their_expandable_reservations_back() {
    use std::sync::Arc;
    if !common::forked::alone("destroyed_streams_give_their_expandable_reservations_back") {
        return;
    }
    // 16 TiB: a reservation is 32 TiB, a quarter of x86-64's 128 TiB of user address space.
    let driver = cudalloc::backend::HostDriver::builder()
        .devices(1)
        .memory_per_device(16 << 40)
        .build()
        .unwrap();
    let rt = cudalloc::Runtime::builder()
        .config(cudalloc::AllocatorConfig::parse("expandable_segments:True").unwrap())
        .build(Arc::new(driver))
        .unwrap();
    for step in 0..16 {
        let s = rt.create_stream(0).unwrap();
        let x = rt.allocate_on(s, 64 * KIB);
        assert!(
            x.is_ok(),
            "step {step}: {:?} ({:?}; reserved now {} bytes)",
            x.err(),
            kept(&rt),
            rt.memory_reserved(0).unwrap()
        );
        drop(x);
        rt.destroy_stream(s).unwrap();
        rt.empty_cache();
    }
}

/// A lazy clone made on a stream destroyed since: its first write (a materialization on another
/// stream) orders itself after the clone's stream — a stream that is gone, whose work is all done
/// (`DeviceCore::stream_gone`: not waited for). It must not fail for good.
#[test]
fn a_lazy_clone_outlives_the_stream_it_was_made_on() {
    use cudalloc::Storage;
    for thread_cache in ["", "thread_cache_mb:8"] {
        let rt = checked_allocator(test_driver(), thread_cache);
        let (s, t) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
        let (x, c) = {
            let _on = rt.set_current_stream(s).unwrap();
            let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
            x.fill_pattern(3).unwrap();
            let c = x.lazy_clone().unwrap();
            (x, c)
        };
        rt.destroy_stream(s).unwrap();
        let _on = rt.set_current_stream(t).unwrap();
        assert_eq!(c.count_pattern_mismatches(3).unwrap(), 0);
        c.fill_pattern(4)
            .unwrap_or_else(|e| panic!("{thread_cache:?}: the clone's first write: {e}"));
        assert_eq!(x.count_pattern_mismatches(3).unwrap(), 0);
        assert_eq!(c.count_pattern_mismatches(4).unwrap(), 0);
        drop((x, c));
        rt.check_invariants().unwrap();
    }
}

/// A block lent to another stream (`cross_stream_reuse:blocks`) under a storage that is lazily
/// cloned, the clone written on the lender's stream (the last reference steals the block), freed
/// there with a front cache on: every access ordered (run under `CUDALLOC_SANITIZE=panic`), every
/// byte right.
#[test]
fn a_borrowed_block_under_a_lazy_clone_stolen_on_the_lenders_stream() {
    use cudalloc::Storage;
    let rt = checked_allocator(test_driver(), "cross_stream_reuse:blocks,thread_cache_mb:8");
    let (s1, s2) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let len = 512 * KIB;
    let kept = rt.allocate_on(s1, len).unwrap();
    let x = {
        let _on = rt.set_current_stream(s2).unwrap();
        let x = Storage::new(&rt, 0, len).unwrap();
        x.fill_pattern(1).unwrap();
        x
    };
    let lent = x.allocation_stream() == Some(s1);
    let c = {
        let _on = rt.set_current_stream(s2).unwrap();
        x.lazy_clone().unwrap()
    };
    drop(x);
    {
        let _on = rt.set_current_stream(s1).unwrap();
        assert_eq!(c.count_pattern_mismatches(1).unwrap(), 0);
        c.fill_pattern(2).unwrap();
        assert_eq!(c.count_pattern_mismatches(2).unwrap(), 0);
        drop(c);
        for i in 0..4 {
            let z = Storage::new(&rt, 0, len).unwrap();
            z.fill_pattern(10 + i).unwrap();
            assert_eq!(z.count_pattern_mismatches(10 + i).unwrap(), 0);
        }
    }
    rt.synchronize(s1).unwrap();
    rt.synchronize(s2).unwrap();
    drop(kept);
    println!("lent: {lent}");
    rt.check_invariants().unwrap();
}

/// Peaks across recycled shards: streams made and destroyed one after another, each holding a
/// different number of blocks while the previous stream's are still out; the device's peaks are
/// the most held at once, exactly (recycled shards carry their budgets and high-water marks into
/// the book under a new key).
#[test]
fn peaks_stay_exact_across_recycled_shards() {
    for conf in ["", "thread_cache_mb:8", "cross_stream_reuse:blocks"] {
        let rt = checked_allocator(test_driver(), conf);
        let mut previous: Vec<cudalloc::DataPtr> = Vec::new();
        let mut most = 0u64;
        for step in 0..60u64 {
            let s = rt.create_stream(0).unwrap();
            let n = [3, 1, 5, 2, 7, 1, 4][step as usize % 7];
            let held: Vec<_> = (0..n)
                .map(|_| rt.allocate_on(s, 64 * KIB).unwrap())
                .collect();
            most = most.max((held.len() + previous.len()) as u64 * 64 * KIB);
            drop(std::mem::replace(&mut previous, held));
            rt.destroy_stream(s).unwrap();
            if step % 3 == 0 {
                rt.empty_cache();
            }
            if step == 30 {
                rt.reset_peak_memory_stats(0).unwrap();
                most = previous.len() as u64 * 64 * KIB;
            }
        }
        let peak = rt.max_memory_allocated(0).unwrap();
        if conf.starts_with("thread_cache") {
            // Front caches make peaks upper bounds (`front.rs`).
            assert!(peak >= most, "{conf}: {peak} < {most}");
        } else {
            assert_eq!(peak, most, "{conf}: {:?}", kept(&rt));
        }
        drop(previous);
        rt.empty_cache();
        let stats = rt.memory_stats(0).unwrap();
        assert_eq!(stats.allocated_bytes.all.current, 0, "{conf}");
        if !conf.starts_with("thread_cache") {
            let want = 60 / 7 * 23 + [3, 1, 5, 2].iter().sum::<i64>();
            assert_eq!(stats.allocation.all.allocated, want, "{conf}");
        }
        rt.check_invariants().unwrap();
    }
}
