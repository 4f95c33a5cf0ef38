//! Fragmentation figures (not timings): peak reserved / peak allocated of the same allocation
//! trace replayed with whole segments (PyTorch's default policy) and with expandable segments.
//!
//! * `rmm 64MiB-10000` — the RMM-style random trace of `benches/alloc.rs` (sizes up to 64 MiB).
//! * `resnet50` — the real ResNet-50 training trace in `../shared/traces/` (a `torch.profiler`
//!   memory trace; frees are paired with the most recent live allocation of the same size, as the
//!   trace's README says), when the file is there.
//!
//! ```text
//! cargo bench --bench fragmentation        # the table (docs/benchmarks.md quotes it)
//! ```
//! Under `cargo test --benches` (CI's smoke run) only a short RMM trace is replayed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;

use cudalloc::{backend::Driver, backend::HostDriver, AllocatorConfig, DataPtr, Runtime};

const MIB: f64 = (1 << 20) as f64;

/// A trace step: allocate `size` bytes, or free the allocation made at step `index`.
#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc(u64),
    Free(usize),
}

fn rmm(max: u64, n: usize) -> Vec<Step> {
    // Resolve RMM's "free the live allocation at victim % live" into step indices.
    let mut live: Vec<usize> = Vec::new();
    let mut out = Vec::new();
    for (op, victim) in common::rmm_trace(max, n) {
        match op {
            Some(size) => {
                live.push(out.len());
                out.push(Step::Alloc(size));
            }
            None => {
                let idx = (victim % live.len() as u64) as usize;
                out.push(Step::Free(live.swap_remove(idx)));
            }
        }
    }
    out
}

fn resnet() -> Option<Vec<Step>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/traces/resnet50_training_v100.kineto.json.gz");
    let file = std::fs::File::open(path).ok()?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let mut events: Vec<(f64, i64)> = json["traceEvents"]
        .as_array()?
        .iter()
        .filter(|e| e["name"] == "[memory]" && e["args"]["Device Type"] == 1)
        .filter_map(|e| Some((e["ts"].as_f64()?, e["args"]["Bytes"].as_i64()?)))
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut live: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut out = Vec::new();
    for (_, bytes) in events {
        if bytes > 0 {
            live.entry(bytes as u64).or_default().push(out.len());
            out.push(Step::Alloc(bytes as u64));
        } else if let Some(at) = live.get_mut(&bytes.unsigned_abs()).and_then(Vec::pop) {
            out.push(Step::Free(at));
        }
    }
    Some(out)
}

/// Peak reserved and peak allocated (bytes) of `steps` under `conf`.
fn replay(steps: &[Step], conf: &str) -> (i64, i64) {
    let driver: Arc<dyn Driver> = Arc::new(
        HostDriver::builder()
            .memory_per_device(16 << 30)
            .poison_on_free(false)
            .build()
            .unwrap(),
    );
    let a = Runtime::new(driver, AllocatorConfig::parse(conf).unwrap()).unwrap();
    let mut live: HashMap<usize, DataPtr> = HashMap::new();
    for (i, step) in steps.iter().enumerate() {
        match *step {
            Step::Alloc(size) => {
                live.insert(i, a.allocate(0, size).unwrap());
            }
            Step::Free(at) => {
                live.remove(&at);
            }
        }
    }
    let stats = a.memory_stats(0).unwrap();
    (
        stats.reserved_bytes.all.peak,
        stats.allocated_bytes.all.peak,
    )
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let mut traces = vec![(
        if full {
            "rmm 64MiB-10000"
        } else {
            "rmm 64MiB-1000 (smoke)"
        },
        rmm(64 << 20, if full { 10_000 } else { 1_000 }),
    )];
    if full {
        match resnet() {
            Some(steps) => traces.push(("resnet50 (real)", steps)),
            None => println!("resnet50: skipped: ../shared/traces/ is not here"),
        }
    }
    println!(
        "{:<24} {:>30} {:>30}",
        "trace", "whole segments: res/alloc", "expandable: res/alloc"
    );
    for (name, steps) in traces {
        let (r, a) = replay(&steps, "");
        let (re, ae) = replay(&steps, "expandable_segments:True");
        println!(
            "{name:<24} {:>9.0}/{:<8.0} MiB = {:>5.2} {:>9.0}/{:<8.0} MiB = {:>5.2}",
            r as f64 / MIB,
            a as f64 / MIB,
            r as f64 / a as f64,
            re as f64 / MIB,
            ae as f64 / MIB,
            re as f64 / ae as f64
        );
    }
}
