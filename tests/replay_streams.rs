//! Replay of many-stream and multi-device traces: peaks equal an independent count and the
//! allocator's own, per device and over all devices; the exact peaks stay exact when nothing
//! reads the statistics between operations (cache releases, oversize releases, expandable
//! segments and out-of-memory included).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cudalloc::replay::{self, ReplayOptions};
use cudalloc::{backend::Driver, backend::SimDriver, AllocatorConfig, DataPtr, Runtime, StreamId};

const MIB: u64 = 1 << 20;

fn no_progress(_: u64) {}

/// An allocation `Ok((device, stream, addr, size))` or a free `Err((device, addr))`.
type Op = Result<(usize, u64, u64, u64), (usize, u64)>;

/// cudalloc JSON lines of `ops`.
fn json_lines(ops: &[Op]) -> String {
    let mut text = String::new();
    for op in ops {
        text.push_str(&match *op {
            Ok((device, stream, addr, size)) => format!(
                "{{\"action\":\"alloc\",\"device\":{device},\"stream\":{stream},\"addr\":{addr},\"size\":{size}}}\n"
            ),
            Err((device, addr)) => format!(
                "{{\"action\":\"free_requested\",\"device\":{device},\"addr\":{addr},\"size\":0}}\n"
            ),
        });
    }
    text
}

#[test]
fn ten_thousand_streams_replay_to_the_peaks_an_independent_count_gives() {
    // 10,000 streams (raw ids like pointers), one small allocation each (multiples of 512 B:
    // rounding keeps them), every third freeing the previous stream's. Each stream's first
    // small allocation maps one 2 MiB segment, kept cached after its free.
    const STREAMS: u64 = 10_000;
    let size = |s: u64| 512 * (1 + s % 7);
    let mut ops = Vec::new();
    let (mut live, mut peak) = (0u64, 0u64);
    for s in 1..=STREAMS {
        ops.push(Ok((0, 0x7f00_0000_0000 + s * 0x100, s << 20, size(s))));
        live += size(s);
        peak = peak.max(live);
        if s % 3 == 0 {
            ops.push(Err((0, (s - 1) << 20)));
            live -= size(s - 1);
        }
    }
    let trace = replay::parse(json_lines(&ops).as_bytes()).unwrap();
    assert_eq!(trace.allocations() as u64, STREAMS);
    for conf in ["", "expandable_segments:True"] {
        let r = replay::replay(
            &trace,
            &ReplayOptions::new(conf, 64 << 30),
            &mut no_progress,
        )
        .unwrap();
        assert_eq!(r.peak_allocated, peak, "{conf:?}");
        assert_eq!(r.peak_segments, STREAMS, "{conf:?}: one segment per stream");
        assert_eq!(
            r.peak_reserved,
            STREAMS * 2 * MIB,
            "{conf:?}: 2 MiB per stream"
        );
        assert_eq!(r.samples.last().unwrap().allocated, live, "{conf:?}");
        assert!(r.first_oom.is_none());
    }
    // The allocator's own device-wide peaks over the same run, read once at the end.
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 64 << 30).unwrap());
    let a = Runtime::new(driver, AllocatorConfig::default()).unwrap();
    let mut held = HashMap::new();
    for op in &ops {
        match *op {
            Ok((_, _, addr, size)) => {
                let s = a.create_stream(0).unwrap();
                held.insert(addr, a.allocate_on(s, size).unwrap());
            }
            Err((_, addr)) => drop(held.remove(&addr)),
        }
    }
    let m = a.memory_stats_map(0).unwrap();
    assert_eq!(m["allocated_bytes.all.peak"], peak as i64);
    assert_eq!(m["allocation.all.peak"], (STREAMS - STREAMS / 3) as i64);
    assert_eq!(m["reserved_bytes.all.peak"], (STREAMS * 2 * MIB) as i64);
    assert_eq!(m["segment.all.peak"], STREAMS as i64);
}

#[test]
fn a_two_device_trace_replays_with_its_figures_per_device() {
    const K: u64 = 1024;
    let ops = [
        Ok((0, 0, 0x1000, 512 * K)), // device 0: 512 KiB (one 2 MiB segment)
        Ok((1, 0, 0x1000, 256 * K)), // device 1 (the same address: another device)
        Err((0, 0x1000)),            // device 0 back to 0
        Ok((1, 0, 0x2000, 256 * K)),
        Ok((1, 9, 0x3000, 128 * K)), // device 1, a second stream: a second segment
        Err((1, 0x1000)),
        Err((1, 0x2000)),
        Err((1, 0x3000)),
    ];
    let trace = replay::parse(json_lines(&ops).as_bytes()).unwrap();
    assert_eq!(trace.devices, 2);
    let r = replay::replay(&trace, &ReplayOptions::new("", 1 << 30), &mut no_progress).unwrap();
    let d = &r.devices;
    assert_eq!(d.len(), 2);
    assert_eq!(
        (d[0].peak_allocated, d[0].peak_reserved, d[0].peak_segments),
        (512 * K, 2 * MIB, 1)
    );
    assert_eq!(
        (d[1].peak_allocated, d[1].peak_reserved, d[1].peak_segments),
        (640 * K, 4 * MIB, 2)
    );
    assert_eq!((d[0].device_mallocs, d[1].device_mallocs), (1, 2));
    // Over both devices: the peak of the sum (after the second operation), not the sum of peaks.
    assert_eq!(r.peak_allocated, 768 * K);
    assert_eq!(r.peak_reserved, 6 * MIB);
    assert_eq!(r.peak_segments, 3);
    assert_eq!(r.samples.last().unwrap().allocated, 0);

    // A two-device PyTorch snapshot written by cudalloc replays to each device's own peaks.
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(2, 4 << 30).unwrap());
    let a = Runtime::new(driver, AllocatorConfig::default()).unwrap();
    a.record_memory_history(cudalloc::stats::HistoryOptions::new(
        cudalloc::stats::HistoryMode::All,
        100_000,
    ));
    let side = a.create_stream(1).unwrap();
    let mut held = Vec::new();
    for i in 0..120u64 {
        let on = match i % 3 {
            0 => a.default_stream(0).unwrap(),
            1 => a.default_stream(1).unwrap(),
            _ => side,
        };
        held.push(a.allocate_on(on, (i % 11 + 1) * 300_000).unwrap());
        if i % 4 == 3 {
            held.swap_remove((i as usize * 5) % held.len());
        }
    }
    drop(held);
    let bytes = a.snapshot().to_pytorch_pickle(&a.config()).unwrap();
    let trace = replay::parse(&bytes).unwrap();
    assert_eq!(trace.devices, 2);
    let r = replay::replay(&trace, &ReplayOptions::new("", 4 << 30), &mut no_progress).unwrap();
    for device in 0..2 {
        let m = a.memory_stats_map(device).unwrap();
        assert_eq!(
            r.devices[device].peak_allocated as i64, m["allocated_bytes.all.peak"],
            "device {device}"
        );
        assert_eq!(
            r.devices[device].peak_reserved as i64, m["reserved_bytes.all.peak"],
            "device {device}"
        );
    }
}

/// A random trace on `streams` streams of device 0: 1 B to 30 MiB, frees of random live ones.
fn random_ops(seed: u64, streams: u64, n: usize) -> Vec<Op> {
    let mut x = seed;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut ops, mut live) = (Vec::new(), Vec::new());
    for i in 0..n as u64 {
        let r = next();
        if live.is_empty() || (r % 5 < 3 && live.len() < 24) {
            let size = 1 + (r >> 16) % if i % 7 == 0 { 30 * MIB } else { 200_000 };
            ops.push(Ok((0, (r >> 8) % streams, i + 1, size)));
            live.push(i + 1);
        } else {
            let addr = live.swap_remove((r >> 20) as usize % live.len());
            ops.push(Err((0, addr)));
        }
    }
    ops
}

/// Runs `ops` on an allocator directly, as a replay does (stream 0 is the default stream, the
/// others made as they first appear; an allocation that does not fit is skipped, with its free),
/// calling `observe` after every operation.
fn run_directly(
    conf: &str,
    capacity: u64,
    ops: &[Op],
    mut observe: impl FnMut(&Runtime),
) -> Runtime {
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, capacity).unwrap());
    let a = Runtime::new(driver, AllocatorConfig::parse(conf).unwrap()).unwrap();
    let mut streams: HashMap<u64, StreamId> = HashMap::new();
    // Ordered, so that what is still held at the end is freed in the same order every time.
    let mut held: BTreeMap<u64, DataPtr> = BTreeMap::new();
    for op in ops {
        match *op {
            Ok((_, stream, addr, size)) => {
                let s = *streams.entry(stream).or_insert_with(|| {
                    if stream == 0 {
                        a.default_stream(0).unwrap()
                    } else {
                        a.create_stream(0).unwrap()
                    }
                });
                if let Ok(data) = a.allocate_on(s, size) {
                    held.insert(addr, data);
                }
            }
            Err((_, addr)) => drop(held.remove(&addr)),
        }
        observe(&a);
    }
    a
}

#[test]
fn peaks_stay_exact_when_nothing_reads_the_statistics_between_operations() {
    // Sixteen streams on a device small enough to fill up (cache releases and retries), with
    // oversize releases and expandable segments in turn. What a lock-protected allocator would
    // see: the summed currents read after every operation. (Garbage collection visits streams in
    // no fixed order, so two of its runs differ; `alloc/engine/peaks.rs` tests it within one run.)
    let ops = random_ops(0x2545_f491_4f6c_dd1d, 16, 4000);
    let trace = replay::parse(json_lines(&ops).as_bytes()).unwrap();
    for conf in ["", "max_split_size_mb:32", "expandable_segments:True"] {
        let capacity = 320 * MIB;
        let mut max_seen = std::collections::BTreeMap::new();
        let read = run_directly(conf, capacity, &ops, |a| {
            for (key, value) in a.memory_stats_map(0).unwrap() {
                if let Some(stat) = key.strip_suffix(".current") {
                    let m = max_seen.entry(stat.to_owned()).or_insert(0i64);
                    *m = (*m).max(value);
                }
            }
        });
        // The same run, its statistics read only at the end: the same figures.
        let quiet = run_directly(conf, capacity, &ops, |_| {});
        let m = quiet.memory_stats_map(0).unwrap();
        assert_eq!(m, read.memory_stats_map(0).unwrap(), "{conf:?}");
        for (stat, max) in &max_seen {
            // Growing an expandable segment maps pages as one free block before the request
            // splits it: inactive-split statistics peak inside that operation, not after it.
            if conf.contains("expandable") && stat.starts_with("inactive_split") {
                assert!(m[&format!("{stat}.peak")] >= *max, "{conf:?}: {stat}");
                continue;
            }
            assert_eq!(m[&format!("{stat}.peak")], *max, "{conf:?}: {stat}");
        }
        assert!(m["num_alloc_retries"] > 0, "{conf:?}: the device filled up");
        // The replay reads the totals after every operation without a pass over every stream.
        let r = replay::replay(
            &trace,
            &ReplayOptions::new(conf, capacity),
            &mut no_progress,
        )
        .unwrap();
        assert_eq!(
            r.peak_allocated as i64, max_seen["allocated_bytes.all"],
            "{conf:?}"
        );
        assert_eq!(
            r.peak_reserved as i64, max_seen["reserved_bytes.all"],
            "{conf:?}"
        );
        assert_eq!(r.peak_segments as i64, max_seen["segment.all"], "{conf:?}");
        assert_eq!(r.ooms as i64, m["num_ooms"], "{conf:?}");
    }
}
