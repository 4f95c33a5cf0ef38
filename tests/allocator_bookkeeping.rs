//! What the allocator keeps besides memory is bounded by what is live, never by how many streams
//! or settings a runtime has seen (`Runtime::bookkeeping`; the soak of `benches/soak.rs` shows
//! the same for resident memory and time per step). Found by a hostile round: 10,000 steps of a
//! fresh stream each grew the allocator by 89.2 MiB and `memory_stats` from 0.006 ms to 23.7 ms
//! (every destroyed stream's empty shard kept and walked).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use cudalloc::Storage;

const KIB: u64 = 1 << 10;

fn kept_shards(rt: &cudalloc::Runtime) -> usize {
    let kept = rt.bookkeeping(0).unwrap();
    kept.shards + kept.retired_shards + kept.buried_shards
}

#[test]
fn destroyed_streams_leave_no_bookkeeping_behind() {
    let _device = device_alone();
    for policy in ["off", "segments", "blocks"] {
        for thread_cache in ["", ",thread_cache_mb:8"] {
            let conf = format!("cross_stream_reuse:{policy}{thread_cache}");
            let rt = checked_allocator(test_driver(), &conf);
            let mut after_warmup = 0;
            for step in 0..400u64 {
                let s = rt.create_stream(0).unwrap();
                {
                    let _on = rt.set_current_stream(s).unwrap();
                    let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
                    x.fill_pattern(step).unwrap();
                    let c = x.lazy_clone().unwrap();
                    c.fill_pattern(step + 1).unwrap();
                    assert_eq!(x.count_pattern_mismatches(step).unwrap(), 0);
                }
                rt.destroy_stream(s).unwrap();
                if step == 20 {
                    after_warmup = kept_shards(&rt);
                }
            }
            let kept = rt.bookkeeping(0).unwrap();
            assert!(
                kept_shards(&rt) <= after_warmup.max(4),
                "{conf}: {kept:?} after 400 streams ({after_warmup} shards after 20)"
            );
            rt.check_invariants().unwrap();
            // The accumulated counts of the recycled shards stay in the device's totals.
            let stats = rt.memory_stats(0).unwrap();
            assert!(stats.allocation.all.allocated >= 800, "{conf}: {stats:?}");
        }
    }
}

/// Found by a hostile round: 20,000 `reconfigure` calls with distinct values grew the allocator
/// by 9.5 MiB and each call from 19.5 to 220.9 µs (every published value kept and compared). A
/// configuration is now the readers' once superseded: the runtime holds none but the one in force.
#[test]
fn superseded_settings_are_not_kept() {
    let rt = checked_allocator(test_driver(), "");
    let first = rt.config();
    let mut earlier = Vec::new();
    for step in 0..2_000u32 {
        let threshold = 0.5 + f64::from(step) / 10_000.0;
        rt.reconfigure(&format!(
            "garbage_collection_threshold:{threshold},max_split_size_mb:{}",
            21 + step % 7
        ))
        .unwrap();
        if step % 500 == 0 {
            earlier.push(rt.config());
        }
        // Allocations under every setting, each rounded and fitted by the one in force.
        let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
        x.fill_pattern(u64::from(step)).unwrap();
    }
    assert_eq!(
        first.garbage_collection_threshold, 0.0,
        "a reader's value stays as it was"
    );
    assert_eq!(
        std::sync::Arc::strong_count(&first),
        1,
        "the runtime keeps no superseded value"
    );
    for held in &earlier {
        assert_eq!(std::sync::Arc::strong_count(held), 1);
    }
    let now = rt.config();
    assert!(
        (now.garbage_collection_threshold - 0.6999).abs() < 1e-9,
        "{now:?}"
    );
    assert_eq!(now.max_split_size, (21 + 1999 % 7) << 20);
    rt.check_invariants().unwrap();
}

/// A dropped runtime leaves nothing of itself behind, whatever its streams went through: the
/// driver it was built on is held by no one else afterwards. Found by review: an empty shard
/// kept for the next stream (a destroyed stream's) held its device, which held it, so a runtime
/// that had destroyed a stream never freed its device's bookkeeping, its driver with it.
#[test]
fn a_dropped_runtime_keeps_nothing_alive() {
    let _device = device_alone();
    for conf in ["", "cross_stream_reuse:off", "expandable_segments:True"] {
        let driver = test_driver();
        let rt = checked_allocator(std::sync::Arc::clone(&driver), conf);
        let pool = rt.mem_pool(Default::default()).unwrap();
        for step in 0..4u64 {
            let s = rt.create_stream(0).unwrap();
            {
                let _on = rt.set_current_stream(s).unwrap();
                let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
                x.fill_pattern(step).unwrap();
                let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
                drop(rt.allocate(0, 4 * KIB).unwrap());
            }
            rt.destroy_stream(s).unwrap();
        }
        drop(pool);
        assert!(rt.bookkeeping(0).unwrap().buried_shards > 0, "{conf}");
        drop(rt);
        assert_eq!(
            std::sync::Arc::strong_count(&driver),
            1,
            "{conf}: the runtime's driver is still held after the runtime dropped"
        );
    }
}
