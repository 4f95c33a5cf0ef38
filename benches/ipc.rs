//! IPC benchmarks.
//! * `limbo_drain/<in limbo>` — the cost of one consumer release plus the drain that frees it,
//!   with 100 vs 100,000 other storages waiting in limbo. PyTorch scans its whole limbo on every
//!   collect; ours reads only the release ring, so the two should cost the same (target: within 2×).
//!   The consumer's release is the in-process path of a handle dropped unopened (give back the count,
//!   push the slot into the ring) — exactly the file operations a remote consumer performs.
//! * `share_encode_decode` — share a storage, encode the handle, decode it (file cached), drop it.
//! * `round_trip` — the full cross-process path: share + encode in the producer, send the bytes
//!   over a pipe to a consumer process (this bench binary re-executed), which decodes, opens (the
//!   segment mapping is cached after the first time), reads one byte stream-ordered, releases and
//!   answers; the producer then drains. Baseline in the same group: the same bytes sent and
//!   answered over the same pipe without any sharing.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use criterion::{criterion_group, BatchSize, BenchmarkId, Criterion};
use cudalloc::{ipc::IpcHandle, Runtime, Storage};

fn allocator() -> Arc<Runtime> {
    common::pinned_allocator(2 << 30)
}

/// A storage in limbo whose only count is held by the returned (decoded, unopened) handle.
fn in_limbo(a: &Arc<Runtime>) -> IpcHandle {
    let s = Storage::new(a, 0, 512).unwrap();
    let bytes = s.share_ipc().unwrap().into_bytes();
    let handle = IpcHandle::from_bytes(&bytes).unwrap();
    drop(s);
    handle
}

fn limbo_drain(c: &mut Criterion) {
    let mut g = c.benchmark_group("limbo_drain");
    for n in [100usize, 100_000] {
        let a = allocator();
        let background: Vec<IpcHandle> = (0..n).map(|_| in_limbo(&a)).collect();
        assert_eq!(a.ipc_limbo().0, n);
        g.bench_function(BenchmarkId::new("release+drain", n), |b| {
            b.iter_batched(
                || in_limbo(&a),
                |handle| {
                    drop(handle);
                    let freed = a.ipc_drain();
                    assert_eq!(freed.storages, 1);
                },
                BatchSize::SmallInput,
            )
        });
        g.bench_function(BenchmarkId::new("collect (full scan)", n), |b| {
            b.iter_batched(
                || in_limbo(&a),
                |handle| {
                    drop(handle);
                    assert_eq!(a.ipc_collect().storages, 1);
                },
                BatchSize::SmallInput,
            )
        });
        drop(background);
        a.ipc_collect();
    }
    g.finish();
}

fn share_round_trip(c: &mut Criterion) {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    c.bench_function("share_encode_decode", |b| {
        b.iter(|| {
            let bytes = s.share_ipc().unwrap().into_bytes();
            drop(IpcHandle::from_bytes(&bytes).unwrap());
        })
    });
}

const CHILD_ENV: &str = "CUDALLOC_BENCH_IPC_CHILD";

/// The consumer process: one hex line in (a handle, or `raw:` bytes for the baseline), one line out.
fn consumer() {
    let a = allocator();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { return };
        let reply = if let Some(raw) = line.strip_prefix("raw:") {
            raw.len().to_string()
        } else {
            let bytes: Vec<u8> = (0..line.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&line[i..i + 2], 16).unwrap())
                .collect();
            let t0 = Instant::now();
            let handle = IpcHandle::from_bytes(&bytes).unwrap();
            let t1 = Instant::now();
            let s = Storage::from_ipc(&a, handle).unwrap();
            let t2 = Instant::now();
            let mut b = [0u8; 1];
            s.copy_to_host(s.runtime().current_stream(s.device()).unwrap(), 0, &mut b)
                .unwrap();
            let t3 = Instant::now();
            drop(s);
            let t4 = Instant::now();
            // The byte read, then the consumer's steps in ns: decode, open, read, release.
            format!(
                "{} {} {} {} {}",
                b[0],
                (t1 - t0).as_nanos(),
                (t2 - t1).as_nanos(),
                (t3 - t2).as_nanos(),
                (t4 - t3).as_nanos()
            )
        };
        writeln!(out, "{reply}").unwrap();
        out.flush().unwrap();
    }
}

fn round_trip(c: &mut Criterion) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap());
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    s.copy_from_host(s.runtime().current_stream(s.device()).unwrap(), 0, &[42])
        .unwrap();
    let mut g = c.benchmark_group("round_trip");
    let mut ask = |line: String| {
        writeln!(to_child, "{line}").unwrap();
        to_child.flush().unwrap();
        let mut reply = String::new();
        from_child.read_line(&mut reply).unwrap();
        reply
    };
    g.bench_function("share+send+open+read+release", |b| {
        b.iter(|| {
            let reply = ask(common::hex(&s.share_ipc().unwrap().into_bytes()));
            assert_eq!(reply.split(' ').next(), Some("42"));
            a.ipc_drain();
        })
    });
    // The steps one by one (medians of 2,000 round trips, in µs): the producer's share and
    // encode, the pipe with the consumer's work, the consumer's decode, open, read and release
    // (timed there and sent back), and the producer's drain.
    let mut steps: [Vec<f64>; 7] = Default::default();
    for _ in 0..2_000 {
        let t0 = Instant::now();
        let line = common::hex(&s.share_ipc().unwrap().into_bytes());
        let t1 = Instant::now();
        let reply = ask(line);
        let t2 = Instant::now();
        a.ipc_drain();
        let t3 = Instant::now();
        let parts: Vec<f64> = reply
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse::<f64>().unwrap() / 1e3)
            .collect();
        let consumer: f64 = parts.iter().sum();
        for (i, v) in [
            (t1 - t0).as_secs_f64() * 1e6,
            (t2 - t1).as_secs_f64() * 1e6 - consumer,
            parts[0],
            parts[1],
            parts[2],
            parts[3],
            (t3 - t2).as_secs_f64() * 1e6,
        ]
        .into_iter()
        .enumerate()
        {
            steps[i].push(v);
        }
    }
    let names = [
        "share+encode",
        "pipe both ways",
        "decode",
        "open",
        "read 1 byte",
        "release",
        "drain",
    ];
    let medians: Vec<String> = steps
        .iter_mut()
        .zip(names)
        .map(|(v, name)| {
            v.sort_by(f64::total_cmp);
            format!("{name} {:.1}", v[v.len() / 2])
        })
        .collect();
    println!("round_trip steps (median µs): {}", medians.join(", "));
    g.bench_function("same bytes over the pipe, no sharing (baseline)", |b| {
        let bytes = s.share_ipc().unwrap().wire().encode();
        let line = format!("raw:{}", common::hex(&bytes));
        b.iter(|| {
            let reply = ask(line.clone());
            assert_eq!(reply.trim(), (bytes.len() * 2).to_string());
        })
    });
    g.finish();
    drop(to_child);
    child.wait().unwrap();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(20);
    targets = limbo_drain, share_round_trip, round_trip
}

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        consumer();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
