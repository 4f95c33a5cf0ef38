//! A randomized mix of CUDA-graph captures, replays and eager work through one allocator on the
//! host backend (on the CUDA backend in a CUDA run), always checked by the stream sanitizer — in
//! report mode unless `CUDALLOC_SANITIZE` asks for more (`panic` panics at the first hazard) —
//! for the property: zero bytes of a live graph's memory are handed to allocations outside its
//! pool.
//!
//! Each seed drives one allocator (invariant scanner on) over three streams through a random
//! sequence of steps: eager allocations of 512 B .. 8 MiB on random streams (by stream, or as the
//! thread's current stream), written with a pattern, rewritten, copied, verified and freed, used
//! across streams with `record_stream`; now and then a large unwritten block (memory pressure:
//! the out-of-memory path runs while graphs live); captures (Global, ThreadLocal or Relaxed; two
//! at once at most) into a fresh pool or one shared with a live graph or a held pool handle,
//! reading an eager input or not, allocating, writing and freeing temporaries, forking a side
//! stream into the capture and joining it back, leaving one output alive — ended, or aborted
//! (also on out of memory inside the capture); replays of live graphs on any stream, also while
//! other captures run, after which the output must hold the pattern the capture left there;
//! eager copies of outputs; graphs dropped in random order, their outputs with them or kept past
//! them; `empty_cache` at random. Eager work runs during Relaxed captures too, on the streams no
//! capture holds. Configurations: the default, `thread_cache_mb`, and `max_split_size_mb` with
//! `roundup_power2_divisions` (and expandable segments in CI's second pass).
//!
//! Checked at every step:
//! 1. zero bytes of a live graph's memory go to an allocation outside its pool: no eager block
//!    overlaps a range any live graph's capture allocated, every such range is still covered by
//!    its pool's segments (the snapshot's `segment_pool_id`), every eager block is an allocated
//!    block of a default-pool segment, every output one of its pool's, and no two blocks of the
//!    snapshot overlap;
//! 2. eager data is never corrupted by replays (every live eager block is verified after
//!    replays, outputs after theirs);
//! 3. `check_invariants` holds; the device and every live pool count exactly the allocations
//!    (and requested bytes) the program holds; after `empty_cache` outside captures no segment
//!    outside a live pool is left without an allocated block;
//! 4. at the end, with everything dropped and `empty_cache`, nothing is allocated or reserved,
//!    and the sanitizer reported nothing.
//!
//! Ordering is the program's duty, as with CUDA: a stream that touches a buffer last written (or
//! read) elsewhere waits for those streams first (for a stream a capture holds, for its work
//! before the capture); replays of graphs that share a pool run in one chain, and a capture into
//! a shared pool follows that chain (a later capture may reuse an earlier graph's freed
//! temporaries: PyTorch's rule for shared pools); cross-stream uses of a block are recorded with
//! `record_stream`.
//!
//! `GRAPH_MIX_SEED=n` runs one seed, `GRAPH_MIX_SEEDS=n` that many, `GRAPH_MIX_STEPS=n` steps per
//! seed; a failure prints its seed, configuration and the steps that led to it.
//! The tests after the mix reduce the four bugs it found (each failed before its fix: a false
//! use after free reported for a replay over a shared pool's reused temporary, a capture
//! invalidated by a retired shard's reservation freed inside it, a `use_on_oom` pool lending a
//! live graph's memory, a live graph's pool emptied by its own `empty_cache`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;

use cudalloc::{
    backend::Driver, backend::EventFlags, backend::EventId, backend::SanitizedDriver,
    graph::Capture, graph::CaptureMode, graph::Graph, pool::MemPool, pool::MemPoolId,
    sanitizer::SanitizeOptions, stats::SnapshotBlockState, DataPtr, ErrorKind, Runtime, StreamId,
};

const MIB: u64 = 1 << 20;
const STREAMS: usize = 3;
/// Live eager blocks at most.
const MAX_EAGER: usize = 10;
/// Live graphs and open captures at most.
const MAX_GRAPHS: usize = 4;
/// Captures open at once at most.
const MAX_OPEN: usize = 2;
/// Temporaries alive in one capture at most.
const MAX_TEMPS: usize = 3;

#[path = "graph_mix/world.rs"]
mod world;

use world::{in_pool, World};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
    })
}

/// Runs `seeds` (or the one of `GRAPH_MIX_SEED`) over `conf`, printing the failing seed's steps.
fn run(conf: &str, seeds: std::ops::Range<u64>) {
    let steps = env_u64("GRAPH_MIX_STEPS").unwrap_or(300);
    let seeds: Vec<u64> = match (env_u64("GRAPH_MIX_SEED"), env_u64("GRAPH_MIX_SEEDS")) {
        (Some(one), _) => vec![one],
        (None, Some(n)) => (seeds.start..seeds.start + n).collect(),
        (None, None) => seeds.collect(),
    };
    let _device = common::device_shared();
    for seed in seeds {
        let log = RefCell::new(Vec::new());
        let started = std::time::Instant::now();
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            let mut w = World::new(seed, conf, &log);
            for _ in 0..steps {
                w.step();
            }
            w.finish()
        }));
        match result {
            Ok(counts) => println!(
                "seed {seed} [{conf:?}] in {:.2?}: {counts:?}",
                started.elapsed()
            ),
            Err(panic) => {
                let log = log.borrow();
                let from = log.len().saturating_sub(120);
                eprintln!(
                    "graph mix failed: seed {seed}, configuration {conf:?}, {steps} steps \
                     (rerun: GRAPH_MIX_SEED={seed}); its last {} of {} steps:",
                    log.len() - from,
                    log.len()
                );
                for (i, line) in log.iter().enumerate().skip(from) {
                    eprintln!("  {i:4}: {line}");
                }
                panic::resume_unwind(panic);
            }
        }
    }
}

/// An allocator over a 64 MiB device (the run's backend, sanitized as the run asks), its driver
/// and a stream of its own: the reductions' set-up.
fn small_device() -> (Runtime, Arc<dyn Driver>, StreamId) {
    let (driver, cap) = common::sized_driver(64 * MIB);
    let a = Runtime::builder()
        .config(common::test_config(&cap))
        .build(common::sanitized(driver))
        .unwrap();
    let d = Arc::clone(a.driver());
    let s = a.create_stream(0).unwrap();
    (a, d, s)
}

#[test]
fn randomized_capture_replay_eager_mix() {
    run("", 0..12);
}

#[test]
fn randomized_mix_with_front_caches_and_split_limits() {
    run("thread_cache_mb:8", 100..103);
    run("max_split_size_mb:24,roundup_power2_divisions:4", 200..203);
}

/// Found by the mix (seeds 10, 14 and 15 of `randomized_capture_replay_eager_mix`): graphs
/// sharing a pool, replayed in capture order, are a correct program, yet the sanitizer calls a
/// replay of the first graph a use after free (and fails the stream: the replay returns the
/// error). A later capture into the pool takes the first graph's freed temporary and frees it
/// again — inside that capture, or as the second graph's output when that graph is dropped. The
/// allocator reports such a free to the sanitizer like an eager one (`src/alloc/engine/shard.rs`,
/// `Shard::free`); the first graph's replays touched those bytes, so the free marks them
/// (`Sanitizer::free` marks only bytes with a shadow) and any later touch of marked bytes is a
/// use after free (`src/driver/sanitizer/mod.rs`, `Sanitizer::check`). Temporaries freed inside
/// the first capture pass only because no real work had touched their bytes yet. The same marks
/// also give a "use after free" at the release of the pool's memory when the replays ran on a
/// stream other than the shard's.
#[test]
fn a_replay_after_a_sharing_capture_reused_its_temporary_is_no_use_after_free() {
    let _device = common::device_shared();
    let (driver, cap) = common::sized_driver(256 * MIB);
    let d = SanitizedDriver::wrap(driver, SanitizeOptions::report());
    let a = Runtime::builder()
        .config(common::test_config(&cap))
        .build(Arc::clone(&d))
        .unwrap();
    let s = a.create_stream(0).unwrap();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let tmp = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, tmp.ptr(), MIB, 1) }.unwrap();
    let out = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, out.ptr(), tmp.ptr(), MIB) }.unwrap();
    drop(tmp);
    let first = capture.end().unwrap();
    first.replay(s).unwrap();
    // A second graph sharing the pool takes the freed temporary, and frees it again.
    let capture = a
        .begin_capture(s, Some(first.pool()), CaptureMode::Global)
        .unwrap();
    let tmp = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, tmp.ptr(), MIB, 2) }.unwrap();
    drop(tmp);
    let second = capture.end().unwrap();
    // Replays in capture order, on one stream.
    let replayed = first.replay(s).and_then(|()| second.replay(s));
    let reports: Vec<String> = a
        .sanitizer()
        .unwrap()
        .take_reports()
        .iter()
        .map(|r| r.to_string())
        .collect();
    assert!(
        replayed.is_ok() && reports.is_empty(),
        "{replayed:?}: {reports:#?}"
    );
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().count_pattern_mismatches(s, out.ptr(), MIB, 1) }.unwrap(),
        0
    );
}

/// Found by the mix (`CUDALLOC_TEST_EXPANDABLE=1`: most seeds, 0 and 2 to 9 among them): with
/// expandable segments, the first allocation of a capture's pool on a stream takes the empty
/// shard a dropped pool left there and frees its address reservations right away
/// (`src/alloc/engine/device_shards.rs`, `DeviceCore::shard_in`, the `take_retired` branch) —
/// `vm_free_reservation`, an unsafe call, inside a Global capture: the driver refuses it and
/// invalidates the capture (the allocation itself succeeds; the next captured work and the end
/// fail), and the refused reservation is forgotten by the allocator.
#[test]
fn a_capture_after_a_dropped_graph_pool_stays_valid_with_expandable_segments() {
    let _device = common::device_shared();
    let (driver, cap) = common::sized_driver(256 * MIB);
    let a = Runtime::builder()
        .config(
            cudalloc::AllocatorConfig::parse(&common::join_conf("expandable_segments:True", &cap))
                .unwrap(),
        )
        .build(common::sanitized(driver))
        .unwrap();
    let d = Arc::clone(a.driver());
    let s = a.create_stream(0).unwrap();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let out = a.allocate_on(s, MIB).unwrap();
    let graph = capture.end().unwrap();
    drop(out);
    drop(graph); // the pool goes: its shard on `s` is emptied and retired
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let out = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let written = unsafe { d.memset(s, out.ptr(), 1, MIB) };
    let ended = capture.end();
    assert!(
        written.is_ok() && ended.is_ok(),
        "{written:?} / {:?}",
        ended.err()
    );
}

/// Zero bytes of a live graph's memory outside its pool — also through a pool made with
/// `use_on_oom` that a capture allocated from: an eager allocation that finds no memory must not
/// be lent the graph's freed temporary (its replays write it). Found probing the pool options the
/// mix does not draw.
#[test]
fn a_use_on_oom_pool_never_lends_a_live_graphs_memory() {
    let _device = common::device_alone();
    let (a, d, s) = small_device();
    let pool = a
        .mem_pool(cudalloc::pool::MemPoolOptions::default().with_use_on_oom(true))
        .unwrap();
    let capture = a
        .begin_capture(s, Some(&pool), CaptureMode::Global)
        .unwrap();
    let tmp = a.allocate_on(s, 4 * MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, tmp.ptr(), 4 * MIB, 7) }.unwrap();
    let out = a.allocate_on(s, 4 * MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, out.ptr(), tmp.ptr(), 4 * MIB) }.unwrap();
    let graph_mem = (tmp.ptr().0, tmp.ptr().0 + 4 * MIB);
    drop(tmp);
    let graph = capture.end().unwrap();
    // Eager blocks until the device is full: none may be the graph's temporary.
    let mut held = Vec::new();
    while let Ok(p) = a.allocate_on(s, 4 * MIB) {
        let at = p.ptr().0;
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, p.ptr(), 4 * MIB, 9) }.unwrap();
        if at < graph_mem.1 && graph_mem.0 < at + 4 * MIB {
            graph.replay(s).unwrap();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            let bad =
                unsafe { d.kernels().count_pattern_mismatches(s, p.ptr(), 4 * MIB, 9) }.unwrap();
            panic!(
                "an eager block at {at:#x} got the live graph's temporary {graph_mem:#x?}: after \
                 a replay {bad} of its bytes differ"
            );
        }
        held.push(p);
    }
    drop((held, out, graph, pool));
}

/// Zero bytes of a live graph's memory outside its pool — also after `MemPool::empty_cache` on
/// the graph's pool (`graph.pool()`): `src/alloc/graph.rs` says the pool keeps every block while
/// the graph lives, yet that call gives the cached segment of a freed temporary back to the
/// driver; an eager block then gets the same addresses and the next replay overwrites it. Found
/// probing the pool calls the mix does not draw.
#[test]
fn a_live_graphs_pool_keeps_its_memory_through_its_own_empty_cache() {
    let _device = common::device_shared();
    let (a, d, s) = small_device();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let tmp = a.allocate_on(s, 12 * MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, tmp.ptr(), 12 * MIB, 7) }.unwrap();
    let out = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, out.ptr(), tmp.ptr(), MIB) }.unwrap();
    let graph_mem = (tmp.ptr().0, tmp.ptr().0 + 12 * MIB);
    drop(tmp);
    let graph = capture.end().unwrap();
    graph.pool().empty_cache();
    assert!(
        in_pool(&a, graph.pool().id(), graph_mem.0, 12 * MIB),
        "the pool's own empty_cache gave back the live graph's memory {graph_mem:#x?}"
    );
    let eager = a.allocate_on(s, 12 * MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, eager.ptr(), 12 * MIB, 9) }.unwrap();
    graph.replay(s).unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            d.kernels()
                .count_pattern_mismatches(s, eager.ptr(), 12 * MIB, 9)
        }
        .unwrap(),
        0,
        "a replay overwrote an eager block"
    );
    drop((eager, out, graph));
}
