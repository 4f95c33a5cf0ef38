//! Random sequences over the pinned host allocator (allocate / fill / copy to and from storages on
//! several streams, with a stream held / drop / record_stream / empty_cache / poll), with the
//! invariant scanner on after every change (`src/pinned/state.rs`), checked against a model
//! after every step: live buffers never overlap and keep their own bytes, and a block still read
//! by a held stream is never handed out again. At the end, once the streams drained, nothing is
//! active and `empty_cache` gives every byte back. Runs with each way of making memory (the
//! driver's page-locked allocation, registration, the reserve segment).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{pinned::PinnedBuffer, Runtime, Storage, StreamId};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: usize, value: u8 },
    Drop { index: usize },
    CopyOut { index: usize, stream: usize },
    RoundTrip { index: usize, stream: usize },
    RecordStream { index: usize, stream: usize },
    Hold { stream: usize },
    Release,
    EmptyCache,
    Poll,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![4 => 1usize..=4096, 3 => 4097usize..=(256 << 10), 1 => (256usize << 10)..=(2 << 20)];
    prop_oneof![
        6 => (size, any::<u8>()).prop_map(|(size, value)| Op::Alloc { size, value }),
        4 => any::<usize>().prop_map(|index| Op::Drop { index }),
        3 => (any::<usize>(), 0usize..3).prop_map(|(index, stream)| Op::CopyOut { index, stream }),
        2 => (any::<usize>(), 0usize..3).prop_map(|(index, stream)| Op::RoundTrip { index, stream }),
        1 => (any::<usize>(), 0usize..3).prop_map(|(index, stream)| Op::RecordStream { index, stream }),
        1 => (0usize..3).prop_map(|stream| Op::Hold { stream }),
        1 => Just(Op::Release),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::Poll),
    ]
}

struct Live {
    buf: PinnedBuffer,
    value: u8,
    /// A copy on the held stream still reads it (a host write would wait for the gate).
    read_by_held: bool,
}

fn run(conf: &str, ops: Vec<Op>) {
    let b = backends("pinned_properties").remove(0);
    let _device = device_shared();
    let rt: Arc<Runtime> = checked_allocator(b.driver.clone(), conf);
    let host = rt.pinned_allocator();
    let streams: Vec<StreamId> = (0..3).map(|_| rt.create_stream(0).unwrap()).collect();
    let mut live: Vec<Live> = Vec::new();
    let mut held: Option<(usize, Hold)> = None;
    // Addresses of blocks freed while a held stream still read them: not handed out until release.
    let mut guarded: Vec<u64> = Vec::new();
    // One storage per stream, as large as the largest buffer: device memory stays constant.
    let targets: Vec<Storage> = streams
        .iter()
        .map(|&s| Storage::new_on(&rt, s, 2 << 20).unwrap())
        .collect();
    for op in ops {
        match op {
            Op::Alloc { size, value } => {
                let mut buf = rt.pinned(size as u64).unwrap();
                // Judged only while the hold provably lasted past the allocation.
                let still_held = held.as_ref().is_some_and(|(_, hold)| hold.still_held());
                assert!(
                    !still_held || !guarded.contains(&buf.addr().0),
                    "a block still read by a held stream was handed out"
                );
                buf.as_mut_slice().unwrap().fill(value);
                live.push(Live {
                    buf,
                    value,
                    read_by_held: false,
                });
            }
            Op::Drop { index } if !live.is_empty() => {
                let l = live.swap_remove(index % live.len());
                drop(l);
            }
            Op::CopyOut { index, stream } if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[index % n];
                let len = l.buf.len();
                targets[stream]
                    .copy_from_pinned(streams[stream], 0, &l.buf, 0, len)
                    .unwrap();
                if held.as_ref().is_some_and(|(h, _)| *h == stream) {
                    guarded.push(l.buf.addr().0);
                    l.read_by_held = true;
                }
            }
            Op::RoundTrip { index, stream } if !live.is_empty() => {
                let i = index % live.len();
                if live[i].read_by_held || held.as_ref().is_some_and(|(h, _)| *h == stream) {
                    continue; // the host write would wait for the held stream
                }
                let len = live[i].buf.len();
                let s = &targets[stream];
                s.copy_from_pinned(streams[stream], 0, &live[i].buf, 0, len)
                    .unwrap();
                live[i].buf.as_mut_slice().unwrap().fill(0);
                s.copy_to_pinned(streams[stream], 0, &mut live[i].buf, 0, len)
                    .unwrap();
                let value = live[i].value;
                assert!(live[i].buf.as_slice().unwrap().iter().all(|&x| x == value));
            }
            Op::RecordStream { index, stream } if !live.is_empty() => {
                live[index % live.len()].buf.record_stream(streams[stream]);
            }
            Op::Hold { stream } if held.is_none() => {
                held = Some((stream, hold_stream(&b, streams[stream])));
            }
            Op::Release => {
                if let Some((stream, gate)) = held.take() {
                    drop(gate);
                    rt.driver().stream_synchronize(streams[stream]).unwrap();
                    guarded.clear();
                    for l in &mut live {
                        l.read_by_held = false;
                    }
                }
            }
            // Giving memory back synchronizes every stream (cuMemFreeHost does): not while one
            // is held.
            Op::EmptyCache if held.is_none() => {
                host.empty_cache().unwrap();
            }
            Op::Poll => host.process_events(),
            _ => {}
        }
        // The model: live buffers keep their bytes and do not overlap.
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .map(|l| (l.buf.addr().0, l.buf.capacity()))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "live pinned buffers overlap: {w:?}"
            );
        }
        host.check_invariants().unwrap();
    }
    for l in &live {
        if held.is_none() {
            assert!(l.buf.as_slice().unwrap().iter().all(|&x| x == l.value));
        }
    }
    drop(held);
    drop(live);
    for s in &streams {
        rt.driver().stream_synchronize(*s).unwrap();
    }
    host.process_events();
    let stats = host.stats();
    assert_eq!(stats.active_requests.current, 0);
    host.empty_cache().unwrap();
    host.check_invariants().unwrap();
    if !conf.contains("reserve") {
        assert_eq!(host.stats().allocations.current, 0);
        if let Some(h) = &b.host {
            assert_eq!(h.pinned_bytes(), 0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn driver_allocations(ops in proptest::collection::vec(op(), 1..60)) {
        run("", ops);
    }

    #[test]
    fn registrations(ops in proptest::collection::vec(op(), 1..60)) {
        run("pinned_use_cuda_host_register:True,pinned_num_register_threads:4", ops);
    }

    #[test]
    fn reserve_segment(ops in proptest::collection::vec(op(), 1..60)) {
        run("pinned_reserve_segment_size_mb:4", ops);
    }
}
