//! Out-of-memory errors that explain themselves (`alloc/engine/explain.rs`, `alloc/oom.rs`): the
//! error and its `OutOfMemoryEvent` name the rounded request, the largest free block of the
//! asking stream's pool, what other streams cache and whether one of their blocks would have
//! served it, what memory pools hold; advice only where it applies. A property test recomputes
//! every figure from a snapshot taken right after the error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use cudalloc::backend::Driver;
use cudalloc::stats::{OutOfMemoryEvent, SnapshotBlockState};
use cudalloc::{ErrorKind, Runtime, StreamId};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

/// A runtime over a 64 MiB device under `conf`, and the out-of-memory events it reports.
fn runtime(conf: &str) -> (Arc<dyn Driver>, Runtime, Arc<Mutex<Vec<OutOfMemoryEvent>>>) {
    let (driver, cap) = sized_driver(64 * MIB);
    let driver = sanitized(driver);
    let a = Runtime::builder()
        .config(cudalloc::AllocatorConfig::parse(&join_conf(conf, &cap)).unwrap())
        .check_invariants(true)
        .build(Arc::clone(&driver))
        .unwrap();
    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&events);
    a.register_out_of_memory_observer(Arc::new(move |e: &OutOfMemoryEvent| {
        seen.lock().unwrap().push(e.clone())
    }));
    (driver, a, events)
}

/// On a 64 MiB device: s2 with one 20 MiB segment split into 6 MiB (freed), 6 MiB (held) and
/// 8 MiB (free); s1 filling the rest with two whole 20 MiB segments. The held blocks come back.
fn split_on_one_full_on_another(a: &Runtime) -> (StreamId, StreamId, Vec<cudalloc::DataPtr>) {
    let (s1, s2) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let x = a.allocate_on(s2, 6 * MIB).unwrap();
    let mut held = vec![a.allocate_on(s2, 6 * MIB).unwrap()];
    drop(x);
    held.extend((0..2).map(|_| a.allocate_on(s1, 20 * MIB).unwrap()));
    (s1, s2, held)
}

#[test]
fn oom_message_names_largest_free_block_and_other_streams() {
    let _device = device_alone();
    for policy in ["off", "blocks"] {
        let (_d, a, events) = runtime(&format!("cross_stream_reuse:{policy}"));
        let (s1, s2, held) = split_on_one_full_on_another(&a);
        let asked = 8 * MIB;
        match (policy, a.allocate_on(s1, asked)) {
            ("off", Err(err)) => {
                assert_eq!(err.kind(), ErrorKind::OutOfMemory);
                let text = err.to_string();
                let e = events.lock().unwrap().last().cloned().unwrap();
                assert_eq!(e.rounded, asked);
                assert_eq!(e.stream, Some(s1));
                assert_eq!((e.largest_free_block, e.free_in_pool), (0, 0), "{e:?}");
                assert_eq!(e.cached_on_other_streams, 14 * MIB, "{e:?}");
                assert_eq!(e.largest_fit_on_other_streams, 8 * MIB, "{e:?}");
                assert_eq!((e.held_by_pools, e.held_by_graphs), (0, 0), "{e:?}");
                assert!(
                    text.contains("The largest free block this stream's pool has is 0 bytes"),
                    "{text}"
                );
                assert!(
                    text.contains("Other streams cache 14.00 MiB free"),
                    "{text}"
                );
                assert!(
                    text.contains("one of their blocks (8.00 MiB) would have served this request"),
                    "{text}"
                );
                assert!(text.contains("cross_stream_reuse:blocks"), "{text}");
                // Nothing on s1 is fragmented: no splitting advice.
                assert!(!text.contains("max_split_size_mb"), "{text}");
                assert!(!text.contains("expandable_segments"), "{text}");
            }
            ("blocks", Ok(lent)) => {
                // The block the explanation pointed at serves the request under `blocks`.
                assert_eq!(lent.allocation_stream(), Some(s2));
                assert!(events.lock().unwrap().is_empty());
            }
            (policy, got) => panic!("{policy}: {:?}", got.map(|p| p.ptr())),
        }
        drop(held);
        a.check_invariants().unwrap();
    }
}

#[test]
fn no_cross_stream_advice_where_nothing_could_be_lent() {
    let _device = device_alone();
    let (_d, a, events) = runtime("");
    let (s1, _s2, held) = split_on_one_full_on_another(&a);
    // A memory pool's allocation is never lent another stream's block.
    let pool = a.mem_pool(Default::default()).unwrap();
    let err = {
        let _scope = a.use_mem_pool(&pool, 0).unwrap();
        a.allocate_on(s1, 8 * MIB).unwrap_err()
    };
    let e = events.lock().unwrap().last().cloned().unwrap();
    assert_eq!(e.cached_on_other_streams, 14 * MIB, "{e:?}");
    assert_eq!(e.largest_fit_on_other_streams, 0, "{e:?}");
    assert!(!err.to_string().contains("cross_stream_reuse"), "{err}");
    drop((held, pool));
}

#[test]
fn oom_message_counts_memory_pools_and_fragmentation() {
    let _device = device_alone();
    if expandable_run() {
        println!(
            "oom_message_counts_memory_pools_and_fragmentation: skipped: describes whole segments"
        );
        return;
    }
    let (_d, a, events) = runtime("");
    let s = a.create_stream(0).unwrap();
    let pool = a.mem_pool(Default::default()).unwrap();
    let in_pool = {
        let _scope = a.use_mem_pool(&pool, 0).unwrap();
        a.allocate_on(s, 20 * MIB).unwrap()
    };
    // The default pool on s: a 20 MiB segment cut into 5 blocks of 4 MiB, every other one freed
    // (12 MiB free, no block over 4 MiB), then a 20 MiB segment held whole.
    let mut parts: Vec<_> = (0..5)
        .map(|_| Some(a.allocate_on(s, 4 * MIB).unwrap()))
        .collect();
    for i in [0, 2, 4] {
        parts[i] = None;
    }
    let whole = a.allocate_on(s, 20 * MIB).unwrap();
    let err = a.allocate_on(s, 10 * MIB).unwrap_err();
    let text = err.to_string();
    let e = events.lock().unwrap().last().cloned().unwrap();
    assert_eq!(e.held_by_pools, 20 * MIB, "{e:?}");
    assert_eq!(e.free_in_pool, 12 * MIB, "{e:?}");
    assert_eq!(e.largest_free_block, 4 * MIB, "{e:?}");
    assert!((e.fragmentation - (1.0 - 4.0 / 12.0)).abs() < 1e-9, "{e:?}");
    assert!(text.contains("Memory pools reserve 20.00 MiB"), "{text}");
    assert!(text.contains("in no single block"), "{text}");
    assert!(text.contains("expandable_segments:True"), "{text}");
    assert!(text.contains("max_split_size_mb"), "{text}");
    drop((parts, whole, in_pool, pool));
}

/// The figures of `e` recomputed from a snapshot taken right after the error.
fn recompute(a: &Runtime, e: &OutOfMemoryEvent, asker: StreamId) -> OutOfMemoryEvent {
    let raw = asker.raw();
    let kind = if e.rounded <= MIB { "small" } else { "large" };
    let mut out = OutOfMemoryEvent::default();
    for seg in a.snapshot().segments {
        let free = || {
            seg.blocks
                .iter()
                .filter(|b| b.state == SnapshotBlockState::Inactive)
                .map(|b| b.size)
        };
        if !seg.segment_pool_id.is_default() {
            out.held_by_pools += seg.total_size;
        } else if seg.stream == raw {
            if seg.segment_type == kind {
                out.free_in_pool += free().sum::<u64>();
                out.largest_free_block = out.largest_free_block.max(free().max().unwrap_or(0));
            }
        } else {
            out.cached_on_other_streams += free().sum::<u64>();
            if seg.segment_type == kind {
                let fit = free().filter(|&s| s >= e.rounded).max().unwrap_or(0);
                out.largest_fit_on_other_streams = out.largest_fit_on_other_streams.max(fit);
            }
        }
    }
    out
}

#[derive(Clone, Debug)]
enum Op {
    Allocate { stream: usize, size: u64 },
    Free { index: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, prop::sample::select(vec![512, 4096, 256 << 10, MIB, 3 * MIB, 6 * MIB, 12 * MIB, 25 * MIB]))
            .prop_map(|(stream, size)| Op::Allocate { stream, size }),
        2 => any::<usize>().prop_map(|index| Op::Free { index }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn oom_figures_equal_a_snapshot_at_that_moment(ops in prop::collection::vec(op(), 10..80)) {
        let _device = device_alone();
        let (_d, a, events) = runtime("");
        let streams: Vec<StreamId> = (0..3).map(|_| a.create_stream(0).unwrap()).collect();
        let mut live = Vec::new();
        let mut ooms = 0;
        for op in ops {
            match op {
                Op::Allocate { stream, size } => match a.allocate_on(streams[stream], size) {
                    Ok(p) => live.push(p),
                    Err(err) => {
                        prop_assert_eq!(err.kind(), ErrorKind::OutOfMemory);
                        ooms += 1;
                        let e = events.lock().unwrap().last().cloned().unwrap();
                        prop_assert_eq!(e.rounded, size.max(512));
                        prop_assert_eq!(e.stream, Some(streams[stream]));
                        let want = recompute(&a, &e, streams[stream]);
                        prop_assert_eq!(
                            (e.largest_free_block, e.free_in_pool, e.cached_on_other_streams,
                             e.largest_fit_on_other_streams, e.held_by_pools),
                            (want.largest_free_block, want.free_in_pool, want.cached_on_other_streams,
                             want.largest_fit_on_other_streams, want.held_by_pools),
                            "{}", err
                        );
                    }
                },
                Op::Free { index } => {
                    if !live.is_empty() {
                        let i = index % live.len();
                        live.swap_remove(i);
                    }
                }
            }
        }
        let _ = ooms;
        drop(live);
        a.check_invariants().unwrap();
    }
}
