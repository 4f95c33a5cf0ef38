//! Thread scaling that cannot be lucky: where the heap puts two shards decides whether their state
//! shares a cache line, so one allocator's ratio says little. Every round builds a fresh
//! allocator and measures, side by side, the cached 4 KiB pair:
//!
//! * `1` — one thread on its own stream;
//! * `threads/2` — two threads, each on its own stream (two shards);
//! * `threads_same_stream/2` — two threads on one stream (one shard, the common case of a library
//!   that launches everything on the default stream).
//!
//! It prints each round's throughput ratio against one thread, then the minimum and the median over
//! the rounds — the figures `docs/benchmarks.md` quotes. Not criterion: a ratio per fresh allocator
//! is the measurement.
//!
//! ```text
//! cargo bench --bench scaling              # 9 rounds of 200,000 pairs per thread
//! ```
//! Under `cargo test --benches` (CI's smoke run) one short round runs.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::sync::{Arc, Barrier};
use std::time::Instant;

use cudalloc::{Runtime, StreamId};

/// Time for `threads` threads (streams given per thread) to do `pairs` cached pairs each.
fn run(a: &Arc<Runtime>, streams: &[StreamId], pairs: u64) -> f64 {
    let barrier = Arc::new(Barrier::new(streams.len() + 1));
    let handles: Vec<_> = streams
        .iter()
        .map(|&s| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                drop(a.allocate_on(s, 4096).unwrap()); // warm this thread's path
                barrier.wait();
                for _ in 0..pairs {
                    std::hint::black_box(a.allocate_on(s, 4096).unwrap());
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    start.elapsed().as_secs_f64()
}

fn summary(name: &str, ratios: &mut [f64]) {
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    println!(
        "{name:<24} min {:.2}x  median {median:.2}x  max {:.2}x  (rounds: {})",
        ratios[0],
        ratios[ratios.len() - 1],
        ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, pairs) = if full { (9, 200_000) } else { (1, 2_000) };
    let mut own = Vec::new();
    let mut same = Vec::new();
    for _ in 0..rounds {
        // A fresh driver and allocator each round: fresh shards wherever the heap puts them.
        let a = Arc::new(Runtime::new(common::bench_driver(1 << 30), Default::default()).unwrap());
        let s1 = a.create_stream(0).unwrap();
        let s2 = a.create_stream(0).unwrap();
        let one = run(&a, &[s1], pairs);
        let two_own = run(&a, &[s1, s2], pairs);
        let two_same = run(&a, &[s1, s1], pairs);
        // Throughput ratio: twice the pairs in `two` seconds against the pairs in `one`.
        own.push(2.0 * one / two_own);
        same.push(2.0 * one / two_same);
    }
    println!(
        "cached 4 KiB pair, {pairs} per thread, {rounds} fresh allocators; throughput vs 1 thread:"
    );
    summary("threads/2", &mut own);
    summary("threads_same_stream/2", &mut same);
}
