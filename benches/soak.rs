//! The soak: a long run of the steps a serving or training loop repeats, on the host backend —
//! a fresh stream per step (allocations on it, a lazy clone written on it, then the stream
//! destroyed), a live reconfiguration with a value never used before, a tag put to sleep and
//! woken, a memory pool used and dropped, a graph captured and replayed. What the allocator keeps
//! must be bounded by what is live: the process's resident memory and the time per step are
//! printed for the first and the last tenth of the run, side by side.
//!
//! `cargo bench --bench soak -- [--steps N] [--parts streams,settings,clones,tags,pools,graphs]`
//! (every part by default; 100,000 steps, 300 in `cargo test --benches`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Instant;

use cudalloc::{backend::HostDriver, graph::CaptureMode, pool::MemPoolOptions, Runtime, Storage};

const KIB: u64 = 1 << 10;

/// Resident memory of this process in bytes (`/proc/self/statm`'s second field, in pages).
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    // `cargo bench` passes `--bench`; `cargo test --benches` (CI's smoke run) does not: then a
    // short run shows the steps work, not their figures.
    let measuring = args.iter().any(|a| a == "--bench");
    let default_steps = if measuring { 100_000 } else { 300 };
    let steps: u64 = value("--steps")
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_steps);
    let parts =
        value("--parts").unwrap_or_else(|| "streams,settings,clones,tags,pools,graphs".into());
    let on = |part: &str| parts.split(',').any(|p| p == part);
    let driver = Arc::new(
        HostDriver::builder()
            .memory_per_device(1 << 30)
            .build()
            .unwrap(),
    );
    let rt = Arc::new(Runtime::builder().build(driver).unwrap());
    let tagged = if on("tags") {
        let _in = rt.use_tag("weights", 0).unwrap();
        Some(Storage::new(&rt, 0, 256 * KIB).unwrap())
    } else {
        None
    };
    let graph_stream = rt.create_stream(0).unwrap();
    let tenth = (steps / 10).max(1);
    let mut marks = Vec::new();
    let mut started = Instant::now();
    let mut first_rss = resident();
    for step in 0..steps {
        if step % tenth == 0 {
            started = Instant::now();
            first_rss = resident();
        }
        if on("bare-streams") {
            // The driver's own part: a stream made and destroyed, nothing allocated on it.
            let s = rt.create_stream(0).unwrap();
            rt.destroy_stream(s).unwrap();
        }
        if on("streams") {
            let s = rt.create_stream(0).unwrap();
            {
                let _on = rt.set_current_stream(s).unwrap();
                let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
                x.fill_pattern(step).unwrap();
                if on("clones") {
                    let c = x.lazy_clone().unwrap();
                    c.fill_pattern(step + 1).unwrap();
                }
            }
            rt.destroy_stream(s).unwrap();
        } else if on("clones") {
            let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
            let c = x.lazy_clone().unwrap();
            c.fill_pattern(step).unwrap();
        }
        if on("settings") {
            // A value never used before, every step.
            let threshold = 0.5 + (step % 400_000) as f64 / 1_000_000.0;
            rt.reconfigure(&format!("garbage_collection_threshold:{threshold}"))
                .unwrap();
        }
        if step % 100 == 0 {
            if let Some(t) = &tagged {
                rt.sleep(&["weights"], &[]).unwrap();
                rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
                assert_eq!(t.nbytes(), 256 * KIB);
            }
            if on("pools") {
                let pool = rt.mem_pool(MemPoolOptions::default()).unwrap();
                let _in = rt.use_mem_pool(&pool, 0).unwrap();
                let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
                x.fill_pattern(step).unwrap();
            }
            if on("graphs") {
                let capture = rt
                    .begin_capture(graph_stream, None, CaptureMode::Global)
                    .unwrap();
                let x = {
                    let _on = rt.set_current_stream(graph_stream).unwrap();
                    let x = Storage::new(&rt, 0, 64 * KIB).unwrap();
                    x.fill_pattern(step).unwrap();
                    x
                };
                let graph = capture.end().unwrap();
                graph.replay(graph_stream).unwrap();
                rt.driver().stream_synchronize(graph_stream).unwrap();
                drop((x, graph));
            }
        }
        if step % tenth == tenth - 1 {
            let per_step = started.elapsed().as_secs_f64() * 1e6 / tenth as f64;
            marks.push((per_step, resident().saturating_sub(first_rss), resident()));
        }
    }
    let (first, last) = (marks.first().copied(), marks.last().copied());
    println!("soak: {steps} steps of {parts}");
    for (i, (per_step, grew, rss)) in marks.iter().enumerate() {
        println!(
            "  tenth {:>2}: {per_step:>8.2} µs/step, resident {:>8.1} MiB (+{:.1} MiB in the tenth)",
            i + 1,
            *rss as f64 / (1 << 20) as f64,
            *grew as f64 / (1 << 20) as f64
        );
    }
    if let (Some(f), Some(l)) = (first, last) {
        println!(
            "  last tenth / first tenth: time per step {:.2}x; resident {:.1} → {:.1} MiB",
            l.0 / f.0,
            f.2 as f64 / (1 << 20) as f64,
            l.2 as f64 / (1 << 20) as f64
        );
    }
    println!("  kept after the run: {:?}", rt.bookkeeping(0).unwrap());
    let stats_started = Instant::now();
    rt.memory_stats(0).unwrap();
    println!(
        "  memory_stats after the run: {:.3} ms",
        stats_started.elapsed().as_secs_f64() * 1e3
    );
}
