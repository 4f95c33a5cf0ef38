//! NIXL benchmarks (feature `nixl`; NIXL's library through `CUDALLOC_NIXL_LIB_DIR`), 1,000
//! storages of mixed sizes (512 B to 4 MiB) on the host backend:
//! * `registration` — registering what the storages live in with a NIXL agent: one registration
//!   per region the allocator mapped (what cudalloc's registrar does) against one per storage (what
//!   a tensor library without a registration model does), each deregistered after.
//! * `transfer` — the 1,000 storages written and read process to process (this bench re-executed as the
//!   receiver) in one NIXL transfer over UCX on loopback, against a plain `memcpy` of the same
//!   bytes in this process; `transfer_large` — the same for the storages of at least 1 MiB.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
#[path = "../tests/nixl_foreign/peer_driver.rs"]
#[allow(dead_code)] // the suite's listening peer is not benchmarked
mod peer_driver;

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use cudalloc::nixl::{NixlAgent, NixlOptions, RemoteStorage};
use cudalloc::{Runtime, Storage};
use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor};

const CHILD_ENV: &str = "CUDALLOC_BENCH_NIXL_RECEIVER";
const STORAGES: u64 = 1000;
const WAIT: Duration = Duration::from_secs(60);

fn size(i: u64) -> u64 {
    let steps = [512, 4096, 65_536, 300_007, 1 << 20, 2 << 20, 4 << 20];
    steps[(i * 7 + i / 3) as usize % steps.len()]
}

fn setup() {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    cudalloc::nixl::load_library(None).expect("NIXL's library (CUDALLOC_NIXL_LIB_DIR)");
}

fn storages(rt: &Arc<Runtime>, seed: u64, filter: impl Fn(u64) -> bool) -> Vec<Storage> {
    (0..STORAGES)
        .map(size)
        .filter(|&n| filter(n))
        .enumerate()
        .map(|(i, n)| {
            let s = Storage::new(rt, 0, n).unwrap();
            s.fill_pattern(seed + i as u64).unwrap();
            s
        })
        .collect()
}

#[derive(Debug)]
struct Range(u64, u64);

impl MemoryRegion for Range {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0 as *const u8
    }
    fn size(&self) -> usize {
        self.1 as usize
    }
}

impl NixlDescriptor for Range {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// Registers every range with `agent` and deregisters them; the time of the registrations.
fn register_all(agent: &Agent, ranges: &[(u64, u64)]) -> Duration {
    let started = Instant::now();
    let handles: Vec<_> = ranges
        .iter()
        .map(|&(a, n)| agent.register_memory(&Range(a, n), None).unwrap())
        .collect();
    let took = started.elapsed();
    drop(handles);
    took
}

fn registration(c: &mut Criterion) {
    setup();
    let rt = common::pinned_allocator(4 << 30);
    let all = storages(&rt, 0, |_| true);
    let mut regions: Vec<(u64, u64)> = all
        .iter()
        .flat_map(|s| s.registered_regions().unwrap())
        .map(|p| (p.region.base.0, p.region.size))
        .collect();
    regions.sort_unstable();
    regions.dedup();
    let per_storage: Vec<(u64, u64)> = all
        .iter()
        .map(|s| (s.unordered_data_ptr().0, s.nbytes()))
        .collect();
    // The allocator's own registrar, attached over the same storages: its count and time.
    let agent =
        NixlAgent::new(&rt, NixlOptions::new(format!("reg-{}", std::process::id()))).unwrap();
    let stats = rt.registration_stats();
    println!(
        "registration: {} storages in {} regions; the allocator's NIXL registrar made {} registrations in {:.2} ms",
        all.len(),
        regions.len(),
        stats.registrars[0].registrations,
        stats.registrars[0].registration_ns as f64 / 1e6
    );
    drop(agent);
    let raw = Agent::new_configured(
        &format!("raw-{}", std::process::id()),
        &nixl_sys::AgentConfig {
            thread_sync: nixl_sys::ThreadSync::Rw,
            pthr_delay_us: 1000,
            ..Default::default()
        },
    )
    .unwrap();
    let (_m, params) = raw.get_plugin_params("UCX").unwrap();
    raw.create_backend("UCX", &params).unwrap();
    let mut g = c.benchmark_group("registration");
    g.bench_function(BenchmarkId::new("per region", regions.len()), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| register_all(&raw, &regions)).sum())
    });
    g.bench_function(BenchmarkId::new("per storage", per_storage.len()), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| register_all(&raw, &per_storage)).sum())
    });
    g.finish();
}

/// The receiver: allocates the storages, sends its metadata and their descriptions, waits.
fn receiver() {
    setup();
    let large = std::env::var(CHILD_ENV).unwrap() == "large";
    let rt = common::pinned_allocator(4 << 30);
    let agent = NixlAgent::new(
        &rt,
        NixlOptions::new(format!("bench-rx-{}", std::process::id())),
    )
    .unwrap();
    let all = storages(&rt, 0, |n| !large || n >= 1 << 20);
    let stream = rt.default_stream(0).unwrap();
    let mut out = std::io::stdout().lock();
    for s in &all {
        writeln!(
            out,
            "{}",
            common::hex(&agent.describe(s, stream).unwrap().to_bytes())
        )
        .unwrap();
    }
    writeln!(out, "md {}", common::hex(&agent.metadata().unwrap())).unwrap();
    out.flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

fn transfer_group(c: &mut Criterion, group: &str, large: bool) {
    setup();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, if large { "large" } else { "all" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap());
    let rt = common::pinned_allocator(4 << 30);
    let agent = NixlAgent::new(
        &rt,
        NixlOptions::new(format!("bench-tx-{}", std::process::id())),
    )
    .unwrap();
    let local = storages(&rt, 7, |n| !large || n >= 1 << 20);
    let mut remote = Vec::new();
    loop {
        let mut line = String::new();
        from_child.read_line(&mut line).unwrap();
        let line = line.trim();
        if let Some(md) = line.strip_prefix("md ") {
            agent.load_peer(&common::unhex(md)).unwrap();
            break;
        }
        remote.push(RemoteStorage::from_bytes(&common::unhex(line)).unwrap());
    }
    assert_eq!(remote.len(), local.len());
    let bytes: u64 = local.iter().map(Storage::nbytes).sum();
    let stream = rt.default_stream(0).unwrap();
    let pairs: Vec<(&Storage, &RemoteStorage)> = local.iter().zip(&remote).collect();
    // The memcpy baseline: the same sizes between two sets of host buffers.
    let sources: Vec<Vec<u8>> = local
        .iter()
        .map(|s| vec![7u8; s.nbytes() as usize])
        .collect();
    let mut targets: Vec<Vec<u8>> = local
        .iter()
        .map(|s| vec![0u8; s.nbytes() as usize])
        .collect();
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function(
        BenchmarkId::new("nixl write, two processes", local.len()),
        |b| {
            b.iter_custom(|iters| {
                let started = Instant::now();
                for _ in 0..iters {
                    agent
                        .write(stream, &pairs, None)
                        .unwrap()
                        .wait(WAIT)
                        .unwrap();
                }
                started.elapsed()
            })
        },
    );
    g.bench_function(
        BenchmarkId::new("nixl read, two processes", local.len()),
        |b| {
            b.iter_custom(|iters| {
                let started = Instant::now();
                for _ in 0..iters {
                    agent
                        .read(stream, &pairs, None)
                        .unwrap()
                        .wait(WAIT)
                        .unwrap();
                }
                started.elapsed()
            })
        },
    );
    // A foreign peer (tests/nixl_foreign/peer.py, the nixl wheel's Python API only) reading this
    // process's storages in one transfer of NIXL's own descriptor list: the transfers' time as it
    // measures it.
    if std::env::var_os(peer_driver::PYTHON_VAR).is_none() {
        println!(
            "foreign peer read: left out ({} is not set)",
            peer_driver::PYTHON_VAR
        );
    } else {
        let mut peer = peer_driver::Peer::spawn(&format!("bench-py-{}", std::process::id()));
        peer.expect("META");
        peer.send(&format!(
            "META {}",
            common::hex(&agent.nixl_metadata().unwrap())
        ));
        peer.expect("OK");
        let pieces: Vec<(u64, u64)> = local
            .iter()
            .flat_map(|s| agent.describe(s, stream).unwrap().pieces().to_vec())
            .collect();
        let all = RemoteStorage::new(
            agent.name().to_owned(),
            cudalloc::nixl::MemoryKind::Dram,
            0,
            pieces,
        )
        .unwrap()
        .to_nixl_descs();
        let all = common::hex(&all);
        g.bench_function(
            BenchmarkId::new("foreign peer read (Python, nixl wheel)", local.len()),
            |b| {
                b.iter_custom(|iters| {
                    peer.send(&format!("BENCH {iters} {all}"));
                    Duration::from_secs_f64(peer.expect("BENCH").parse().unwrap())
                })
            },
        );
    }
    g.bench_function(
        BenchmarkId::new("memcpy of the same bytes", local.len()),
        |b| {
            b.iter(|| {
                for (t, s) in targets.iter_mut().zip(&sources) {
                    t.copy_from_slice(s);
                }
                std::hint::black_box(&targets);
            })
        },
    );
    g.finish();
    drop(child.stdin.take());
    child.wait().unwrap();
}

fn transfer(c: &mut Criterion) {
    transfer_group(c, "transfer", false);
}

fn transfer_large(c: &mut Criterion) {
    transfer_group(c, "transfer_large", true);
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3)).sample_size(10);
    targets = registration, transfer, transfer_large
}

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        receiver();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
