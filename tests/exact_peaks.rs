//! Device-wide peaks are exact with any number of streams (PyTorch's `max_memory_allocated`), kept
//! by per-shard budgets instead of a device-wide lock (`alloc/engine/peaks.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{backend::Driver, backend::SimDriver, AllocatorConfig, DataPtr, Runtime};

fn allocator(conf: &str) -> Runtime {
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 8 << 30).unwrap());
    Runtime::new(
        driver,
        AllocatorConfig::parse(&with_test_settings(conf)).unwrap(),
    )
    .unwrap()
}

#[test]
fn two_streams_one_after_the_other_peak_at_one_allocation() {
    // PyTorch: alloc 512 on stream 0, free, alloc 512 on stream 1 -> allocated_bytes.all.peak 512.
    let a = allocator("");
    let s0 = a.default_stream(0).unwrap();
    let s1 = a.create_stream(0).unwrap();
    drop(a.allocate_on(s0, 512).unwrap());
    let held = a.allocate_on(s1, 512).unwrap();
    let m = a.memory_stats_map(0).unwrap();
    assert_eq!(m["allocated_bytes.all.peak"], 512);
    assert_eq!(m["allocation.all.peak"], 1);
    assert_eq!(m["active_bytes.all.peak"], 512);
    assert_eq!(m["requested_bytes.all.peak"], 512);
    assert_eq!(m["allocated_bytes.all.current"], 512);
    drop(held);
}

#[test]
fn peaks_equal_the_maximum_of_the_summed_currents_over_a_random_run() {
    // One thread, four streams, random sizes: after every operation the device's exact total is
    // read; its maximum must be the reported peak, for every statistic with a peak.
    for conf in ["", "max_split_size_mb:32"] {
        let a = allocator(conf);
        let streams: Vec<_> = (0..4)
            .map(|i| {
                if i == 0 {
                    a.default_stream(0).unwrap()
                } else {
                    a.create_stream(0).unwrap()
                }
            })
            .collect();
        let mut live: Vec<DataPtr> = Vec::new();
        let mut max_seen = std::collections::BTreeMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..3000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if live.is_empty() || (x % 5 < 3 && live.len() < 64) {
                let s = streams[(x >> 8) as usize % streams.len()];
                let size = 1 + (x >> 16) % (if step % 7 == 0 { 30 << 20 } else { 200_000 });
                live.push(a.allocate_on(s, size).unwrap());
            } else {
                live.swap_remove((x >> 20) as usize % live.len());
            }
            // What a lock-protected allocator would see now: the summed currents.
            for (key, value) in a.memory_stats_map(0).unwrap() {
                if let Some(stat) = key.strip_suffix(".current") {
                    let m = max_seen.entry(stat.to_owned()).or_insert(0i64);
                    *m = (*m).max(value);
                }
            }
            if step % 500 == 0 {
                a.empty_cache();
            }
        }
        let m = a.memory_stats_map(0).unwrap();
        for (stat, max) in &max_seen {
            assert_eq!(m[&format!("{stat}.peak")], *max, "{conf:?}: {stat}");
        }
        drop(live);
    }
}

#[test]
fn threads_on_their_own_streams_get_a_peak_no_lower_than_any_total_and_no_higher_than_all_at_once()
{
    let a = Arc::new(allocator(""));
    let threads = 4;
    let per_thread = 8u64;
    let size = 1 << 20;
    let barrier = Arc::new(std::sync::Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                let s = a.create_stream(0).unwrap();
                barrier.wait();
                for _ in 0..200 {
                    let held: Vec<_> = (0..per_thread)
                        .map(|_| a.allocate_on(s, size).unwrap())
                        .collect();
                    drop(held);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let m = a.memory_stats_map(0).unwrap();
    let peak = m["allocated_bytes.all.peak"];
    // At least one thread's batch; at most every batch at once.
    assert!(peak >= (per_thread * size) as i64, "{peak}");
    assert!(
        peak <= (threads as u64 * per_thread * size) as i64,
        "{peak}"
    );
    assert_eq!(m["allocated_bytes.all.current"], 0);
    a.reset_peak_memory_stats(0).unwrap();
    assert_eq!(
        a.memory_stats_map(0).unwrap()["allocated_bytes.all.peak"],
        0
    );
}
