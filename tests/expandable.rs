//! Expandable segments (`expandable_segments:True`): growth in pages, whole free pages given back,
//! the snapshot and the observers, on every backend present (the CUDA backend uses the driver's
//! virtual memory: on a GPU, or on the contract double in CI).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use cudalloc::{stats::SegmentChange, stats::SegmentEvent};

const MIB: u64 = 1 << 20;

/// A checked runtime with exactly `conf` (whatever the run's test settings are).
fn runtime(driver: Arc<dyn cudalloc::backend::Driver>, conf: &str) -> Arc<cudalloc::Runtime> {
    Arc::new(
        cudalloc::Runtime::builder()
            .config(cudalloc::AllocatorConfig::parse(conf).unwrap())
            .check_invariants(true)
            .build(driver)
            .unwrap(),
    )
}

fn reserved(a: &cudalloc::Runtime) -> u64 {
    a.memory_reserved(0).unwrap()
}

#[test]
fn grows_in_pages_and_gives_whole_free_pages_back() {
    let _device = device_alone();
    for b in backends("grows_in_pages_and_gives_whole_free_pages_back") {
        let a = runtime(b.driver.clone(), "expandable_segments:True");
        let page = b.driver.vm().vm_granularity(0).unwrap();
        assert_eq!(page, 2 * MIB, "{}", b.name);
        let maps: Arc<Mutex<Vec<SegmentEvent>>> = Arc::default();
        let log = maps.clone();
        a.register_segment_observer(Arc::new(move |e: &SegmentEvent| {
            log.lock().unwrap().push(*e)
        }));

        let x = a.allocate(0, 3 * MIB).unwrap();
        assert_eq!(reserved(&a), 4 * MIB, "{}: two pages", b.name);
        // The 1 MiB left free is grown into: 4 more MiB make room for 5 MiB after it.
        let y = a.allocate(0, 5 * MIB).unwrap();
        assert_eq!(reserved(&a), 8 * MIB, "{}", b.name);
        assert_eq!(
            y.ptr().0,
            x.ptr().0 + 3 * MIB,
            "{}: contiguous in one segment",
            b.name
        );
        // Data across page boundaries works like any memory.
        let s = a.default_stream(0).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { b.driver.kernels().fill_pattern(s, y.ptr(), 5 * MIB, 9) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                b.driver
                    .kernels()
                    .count_pattern_mismatches(s, y.ptr(), 5 * MIB, 9)
            }
            .unwrap(),
            0
        );
        let snap = a.snapshot();
        assert_eq!(snap.segments.len(), 1, "{}", b.name);
        assert!(snap.segments[0].is_expandable);
        assert_eq!(snap.segments[0].total_size, 8 * MIB);

        drop(x);
        a.empty_cache();
        // [0, 3 MiB) is free: its one whole page goes back; the rest of it stays mapped.
        assert_eq!(reserved(&a), 6 * MIB, "{}", b.name);
        drop(y);
        a.empty_cache();
        assert_eq!(reserved(&a), 0, "{}: every page back", b.name);
        assert!(a.snapshot().segments.is_empty(), "{}", b.name);
        let events = maps.lock().unwrap().clone();
        let mapped: u64 = events
            .iter()
            .filter(|e| e.change == SegmentChange::Map)
            .map(|e| e.size)
            .sum();
        let unmapped: u64 = events
            .iter()
            .filter(|e| e.change == SegmentChange::Unmap)
            .map(|e| e.size)
            .sum();
        assert_eq!(
            (mapped, unmapped),
            (8 * MIB, 8 * MIB),
            "{}: {events:?}",
            b.name
        );
        a.check_invariants().unwrap();
    }
}

#[test]
fn fragmentation_that_strands_whole_segments_costs_expandable_segments_less_than_a_page_per_hole() {
    let _device = device_alone();
    // Free every other 3 MiB block, then ask for 5 MiB blocks: whole segments keep the holes
    // (each 3 MiB hole is too small) and allocate more; an expandable segment maps only what
    // the new blocks need beyond the holes it can merge.
    for b in backends("fragmentation_that_strands_whole_segments") {
        let run = |conf: &str| {
            let a = runtime(b.driver.clone(), conf);
            let mut keep = Vec::new();
            let mut drop_later = Vec::new();
            for i in 0..8 {
                let block = a.allocate(0, 3 * MIB).unwrap();
                if i % 2 == 0 {
                    keep.push(block)
                } else {
                    drop_later.push(block)
                }
            }
            drop(drop_later);
            let big: Vec<_> = (0..4).map(|_| a.allocate(0, 5 * MIB).unwrap()).collect();
            a.empty_cache();
            let allocated = a.memory_stats(0).unwrap().allocated_bytes.all.current as u64;
            let held = reserved(&a);
            drop((keep, big));
            (allocated, held)
        };
        let (allocated, whole) = run("");
        let (allocated_e, expandable) = run("expandable_segments:True");
        assert_eq!(allocated, allocated_e);
        println!("{}: allocated {allocated}, reserved with whole segments {whole}, expandable {expandable}", b.name);
        // Four 3 MiB holes stay (too small for 5 MiB); each keeps at most one partial page mapped.
        assert!(
            expandable < allocated + 4 * 2 * MIB,
            "{}: {expandable} reserved for {allocated}",
            b.name
        );
        assert!(
            expandable < whole,
            "{}: expandable {expandable} vs whole {whole}",
            b.name
        );
    }
}

#[test]
fn threads_growing_freeing_and_emptying_the_cache_at_once_keep_every_byte() {
    let _device = device_alone();
    // Four threads allocate, write, verify and free on one stream (one shard, one expandable
    // segment) while a fifth empties the cache: pages are given back and grown into concurrently.
    for b in backends("threads_growing_freeing_and_emptying_the_cache_at_once") {
        let a = runtime(b.driver.clone(), "expandable_segments:True");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let emptier = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    a.empty_cache();
                    std::thread::yield_now();
                }
            })
        };
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let s = a.default_stream(0).unwrap();
                    let d = a.driver().clone();
                    let mut held = Vec::new();
                    for i in 0..60u64 {
                        // At most 5 held blocks of at most 2 MiB per thread: within the 64 MiB.
                        let size = 1 + cudalloc::internals::pattern::word(t, i) % (2 * MIB);
                        let block = a.allocate(0, size).unwrap();
                        let seed = t * 1000 + i;
                        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                        unsafe { d.kernels().fill_pattern(s, block.ptr(), size, seed) }.unwrap();
                        held.push((block, size, seed));
                        if held.len() > 4 {
                            let (block, size, seed) = held.remove((i % 4) as usize);
                            assert_eq!(
                                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                                unsafe {
                                    d.kernels()
                                        .count_pattern_mismatches(s, block.ptr(), size, seed)
                                }
                                .unwrap(),
                                0
                            );
                            drop(block);
                        }
                    }
                    for (block, size, seed) in held {
                        assert_eq!(
                            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                            unsafe {
                                d.kernels()
                                    .count_pattern_mismatches(s, block.ptr(), size, seed)
                            }
                            .unwrap(),
                            0
                        );
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        emptier.join().unwrap();
        a.empty_cache();
        assert_eq!(reserved(&a), 0, "{}", b.name);
        a.check_invariants().unwrap();
    }
}

#[test]
fn a_growth_that_runs_out_of_memory_half_way_gives_its_pages_back() {
    let _device = device_alone();
    // The device has room for 3 more pages; a request needs 5. The 3 mapped for it must be
    // unmapped and released again (capacity and reserved bytes as before), the error is
    // out-of-memory, and what fits afterwards is still served.
    for b in backends("a_growth_that_runs_out_of_memory_half_way") {
        let d = b.driver.clone();
        let a = runtime(d.clone(), "expandable_segments:True");
        let page = d.vm().vm_granularity(0).unwrap();
        let room = d.mem_info(0).unwrap().free / page * page;
        let big = a.allocate(0, room - 3 * page).unwrap();
        // A GPU's free memory also moves with the page tables its driver makes for mappings:
        // there the free bytes are compared as bounds, elsewhere exactly.
        let exact = b.name == "host" || on_the_double();
        let free_before = d.mem_info(0).unwrap().free;
        if exact {
            assert_eq!(free_before, 3 * page, "{}", b.name);
        } else {
            assert!(
                free_before >= 3 * page && free_before < 5 * page,
                "{free_before}"
            );
        }
        let err = a.allocate(0, 5 * page).unwrap_err();
        assert_eq!(
            err.kind(),
            cudalloc::ErrorKind::OutOfMemory,
            "{}: {err}",
            b.name
        );
        let free_after = d.mem_info(0).unwrap().free;
        if exact {
            assert_eq!(free_after, free_before, "{}: chunks released", b.name);
        } else {
            assert!(free_after >= free_before, "{}: chunks released", b.name);
        }
        assert_eq!(reserved(&a), room - 3 * page, "{}", b.name);
        a.check_invariants().unwrap();
        // On a GPU the page tables of new mappings also take free bytes: two pages are asked.
        let fits = a.allocate(0, if exact { 3 } else { 2 } * page).unwrap();
        if exact {
            assert_eq!(d.mem_info(0).unwrap().free, 0, "{}", b.name);
        }
        drop((big, fits));
        a.empty_cache();
        assert_eq!(reserved(&a), 0, "{}", b.name);
        let free_end = d.mem_info(0).unwrap().free;
        if exact {
            assert_eq!(free_end, room, "{}", b.name);
        } else {
            assert!(free_end >= room, "{}: every page back", b.name);
        }
    }
}
