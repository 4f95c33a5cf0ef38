//! Caching-allocator benchmarks with their baselines in the same groups:
//! * `pair/<impl>/<size>` — one cached allocate + free, ours vs glibc `malloc`/`free` vs a no-cache
//!   allocator that calls the driver every time;
//! * `random_trace/<impl>/<max>-<n>` — RMM's `random_allocations`: fixed seed, allocate with
//!   probability 0.73 (if the live total stays under 1 GiB) else free a random live allocation, sizes
//!   uniform in [1 B, max];
//! * `threads/<n>`, `threads_same_stream/<n>` — n threads on their own streams / on one stream,
//!   doing the same number of pairs each (started together on a spinning line; 2 threads finishing in
//!   the time of 1 means 2× throughput), each sample on a fresh allocator; `exact` is PyTorch's
//!   policy, `thread-cache` adds `thread_cache_mb:64`. `pair/cudalloc-thread-cache` is the pair with thread front caches.
//! * `pair/cudalloc-sanitized` — the pair with the stream sanitizer on (`Sanitize::On`); the plain
//!   `pair/cudalloc` has it off (its cost there: one branch on the allocation and the free).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

mod common;
#[cfg(feature = "bench-peers")]
#[path = "common/cubecl_peer.rs"]
mod cubecl_peer;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use cudalloc::{backend::Driver, DataPtr, DeviceAddr, Runtime};

const MIB: u64 = 1 << 20;

fn driver() -> Arc<dyn Driver> {
    // Memory is only committed when touched; the benchmarks never touch it.
    common::bench_driver(8 << 30)
}

fn allocator(d: &Arc<dyn Driver>) -> Arc<Runtime> {
    Arc::new(Runtime::new(d.clone(), Default::default()).unwrap())
}

fn glibc_malloc(size: u64) -> *mut libc::c_void {
    // SAFETY: plain malloc of a positive size; the result is freed by `glibc_free`.
    unsafe { libc::malloc(size as usize) }
}

fn glibc_free(p: *mut libc::c_void) {
    // SAFETY: `p` came from `glibc_malloc` and is freed once.
    unsafe { libc::free(p) }
}

fn pair(c: &mut Criterion) {
    let d = driver();
    let a = allocator(&d);
    let expandable = Arc::new(
        Runtime::new(
            d.clone(),
            cudalloc::AllocatorConfig::parse("expandable_segments:True").unwrap(),
        )
        .unwrap(),
    );
    let thread_cached = Arc::new(
        Runtime::new(
            d.clone(),
            cudalloc::AllocatorConfig::parse("thread_cache_mb:128").unwrap(),
        )
        .unwrap(),
    );
    let sanitized = Arc::new(
        Runtime::builder()
            .sanitize(cudalloc::sanitizer::Sanitize::On(Default::default()))
            .build(d.clone())
            .unwrap(),
    );
    let mut g = c.benchmark_group("pair");
    for size in [512u64, 64 << 10, MIB, 16 * MIB, 64 * MIB] {
        drop(sanitized.allocate(0, size).unwrap());
        g.bench_with_input(
            BenchmarkId::new("cudalloc-sanitized", size),
            &size,
            |b, &s| b.iter(|| black_box(sanitized.allocate(0, s).unwrap())),
        );
        drop(a.allocate(0, size).unwrap()); // warm the cache
        drop(expandable.allocate(0, size).unwrap());
        drop(thread_cached.allocate(0, size).unwrap());
        g.bench_with_input(BenchmarkId::new("cudalloc", size), &size, |b, &s| {
            b.iter(|| black_box(a.allocate(0, s).unwrap()))
        });
        g.bench_with_input(
            BenchmarkId::new("cudalloc-thread-cache", size),
            &size,
            |b, &s| b.iter(|| black_box(thread_cached.allocate(0, s).unwrap())),
        );
        g.bench_with_input(
            BenchmarkId::new("cudalloc-expandable", size),
            &size,
            |b, &s| b.iter(|| black_box(expandable.allocate(0, s).unwrap())),
        );
        g.bench_with_input(BenchmarkId::new("glibc", size), &size, |b, &s| {
            b.iter(|| glibc_free(black_box(glibc_malloc(s))))
        });
        g.bench_with_input(BenchmarkId::new("no-cache", size), &size, |b, &s| {
            b.iter(|| d.free(black_box(d.malloc(0, s).unwrap())).unwrap())
        });
        #[cfg(feature = "bench-peers")]
        {
            let mut m = cubecl_peer::manager();
            drop(cubecl_peer::reserve(&mut m, size));
            g.bench_with_input(BenchmarkId::new("cubecl", size), &size, |b, &s| {
                b.iter(|| black_box(cubecl_peer::reserve(&mut m, s)))
            });
        }
    }
    g.finish();
}

fn replay<T>(
    steps: &[(Option<u64>, u64)],
    mut alloc: impl FnMut(u64) -> T,
    mut free: impl FnMut(T),
) {
    let mut live: Vec<T> = Vec::new();
    for &(op, victim) in steps {
        match op {
            Some(size) => live.push(alloc(size)),
            None => {
                let idx = (victim % live.len() as u64) as usize;
                free(live.swap_remove(idx));
            }
        }
    }
    live.into_iter().for_each(free);
}

fn random_trace(c: &mut Criterion) {
    let d = driver();
    let a = allocator(&d);
    let mut g = c.benchmark_group("random_trace");
    g.sample_size(10);
    for (max, n) in [
        (MIB, 10_000),
        (4 * MIB, 10_000),
        (64 * MIB, 10_000),
        (MIB, 100_000),
        (4 * MIB, 100_000),
        (64 * MIB, 100_000),
    ] {
        let steps = common::rmm_trace(max, n);
        let id = format!("{}MiB-{n}", max / MIB);
        let mut peak_reserved = 0;
        g.bench_function(BenchmarkId::new("cudalloc", &id), |b| {
            b.iter(|| replay(&steps, |s| a.allocate(0, s).unwrap(), drop::<DataPtr>));
            let stats = a.memory_stats(0).unwrap();
            peak_reserved = stats.reserved_bytes.all.peak;
        });
        let stats = a.memory_stats(0).unwrap();
        println!(
            "random_trace {id}: peak reserved {} MiB / peak allocated {} MiB",
            peak_reserved / MIB as i64,
            stats.allocated_bytes.all.peak / MIB as i64
        );
        g.bench_function(BenchmarkId::new("glibc", &id), |b| {
            b.iter(|| replay(&steps, glibc_malloc, glibc_free))
        });
        #[cfg(feature = "bench-peers")]
        {
            let mut m = cubecl_peer::manager();
            g.bench_function(BenchmarkId::new("cubecl", &id), |b| {
                b.iter(|| {
                    let mut live = Vec::new();
                    for &(op, victim) in &steps {
                        match op {
                            Some(size) => live.push(cubecl_peer::reserve(&mut m, size)),
                            None => drop(live.swap_remove((victim % live.len() as u64) as usize)),
                        }
                    }
                })
            });
        }
        if n <= 10_000 {
            g.bench_function(BenchmarkId::new("no-cache", &id), |b| {
                b.iter(|| {
                    replay(
                        &steps,
                        |s| d.malloc(0, s).unwrap(),
                        |p: DeviceAddr| d.free(p).unwrap(),
                    )
                })
            });
        }
        a.empty_cache();
        a.reset_peak_memory_stats(0).unwrap();
    }
    g.finish();
}

/// `threads/<n>` (each thread on its own stream) and `threads_same_stream/<n>` (all on one
/// stream), for PyTorch's exact policy and with thread front caches (`thread_cache_mb:64`). Every
/// sample runs on a **fresh allocator** (built outside the timing), so the medians are over
/// allocators, not over one lucky heap layout; the threads time themselves
/// ([`common::time_threads`]).
/// `benches/scaling.rs` prints the per-allocator ratios with their minimum and median.
fn threads(c: &mut Criterion) {
    const PAIRS: u64 = 20_000;
    for (kind, same_stream) in [("threads", false), ("threads_same_stream", true)] {
        let mut g = c.benchmark_group(kind);
        for (config_name, conf) in [("exact", ""), ("thread-cache", "thread_cache_mb:64")] {
            for n in [1usize, 2] {
                let id = BenchmarkId::new(config_name, n);
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        let config = cudalloc::AllocatorConfig::parse(conf).unwrap();
                        let a = Arc::new(Runtime::new(driver(), config).unwrap());
                        let first = a.create_stream(0).unwrap();
                        let streams: Vec<_> = (0..n)
                            .map(|i| {
                                if same_stream || i == 0 {
                                    first
                                } else {
                                    a.create_stream(0).unwrap()
                                }
                            })
                            .collect();
                        common::time_threads(&a, &streams, iters * PAIRS)
                    })
                });
            }
        }
        g.finish();
    }
}

/// The cached pair's cost with the memory history off, alloc-only, all, and all with stacks (the
/// ring full, so every record also drops the oldest entry).
fn history(c: &mut Criterion) {
    use cudalloc::{stats::HistoryMode, stats::HistoryOptions};
    let d = driver();
    let mut g = c.benchmark_group("history");
    for (name, mode, stacks) in [
        ("off", HistoryMode::Off, false),
        ("alloc_only", HistoryMode::AllocOnly, false),
        ("all", HistoryMode::All, false),
        ("all_stacks", HistoryMode::All, true),
    ] {
        let a = allocator(&d);
        a.record_memory_history(HistoryOptions::new(mode, 10_000).with_stacks(stacks));
        drop(a.allocate(0, 4096).unwrap());
        g.bench_function(BenchmarkId::new("pair-4096", name), |b| {
            b.iter(|| black_box(a.allocate(0, 4096).unwrap()))
        });
    }
    g.finish();
}

/// The cached pair three ways side by side: plain, with a memory pool's scope active, and inside
/// a stream capture (the allocation routed to the graph's pool, uncached, while it runs).
fn pools_and_capture(c: &mut Criterion) {
    use cudalloc::{graph::CaptureMode, pool::MemPoolOptions};
    let d = driver();
    let a = allocator(&d);
    let s = a.create_stream(0).unwrap();
    let pool = a.mem_pool(MemPoolOptions::default()).unwrap();
    let mut g = c.benchmark_group("pair_pools");
    for size in [512u64, MIB] {
        drop(a.allocate_on(s, size).unwrap());
        g.bench_with_input(BenchmarkId::new("plain", size), &size, |b, &n| {
            b.iter(|| black_box(a.allocate_on(s, n).unwrap()))
        });
        {
            let _in_pool = a.use_mem_pool(&pool, 0).unwrap();
            drop(a.allocate_on(s, size).unwrap());
            g.bench_with_input(BenchmarkId::new("in-pool", size), &size, |b, &n| {
                b.iter(|| black_box(a.allocate_on(s, n).unwrap()))
            });
        }
        // Replays are not measured: a capture of nothing, its pool warmed by the first pair.
        if d.as_host().is_some() {
            let capture = a.begin_capture(s, None, CaptureMode::ThreadLocal).unwrap();
            drop(a.allocate_on(s, size).unwrap());
            g.bench_with_input(BenchmarkId::new("in-capture", size), &size, |b, &n| {
                b.iter(|| black_box(a.allocate_on(s, n).unwrap()))
            });
            drop(capture.end().unwrap());
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    targets = pair, random_trace, threads, history, pools_and_capture
}
criterion_main!(benches);
