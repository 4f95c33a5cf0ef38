//! Random operation sequences (alloc / free / record_stream / empty_cache across streams) checked
//! against a simple model after every step: live allocations never overlap, every allocation keeps
//! its own bytes until freed, stats equal the model, and the invariant scanner (on in
//! `checked_allocator`) finds nothing wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{DataPtr, Driver, ErrorKind};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Alloc { stream: usize, size: u64 },
    Free { index: usize },
    RecordStream { index: usize, stream: usize },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => 1u64..=8192,
        3 => 8193u64..=(1 << 20),
        2 => (1u64 << 20)..=(3 << 20),
        1 => (10u64 << 20)..=(13 << 20),
    ];
    prop_oneof![
        6 => (0usize..3, size).prop_map(|(stream, size)| Op::Alloc { stream, size }),
        4 => any::<usize>().prop_map(|index| Op::Free { index }),
        2 => (any::<usize>(), 0usize..3).prop_map(|(index, stream)| Op::RecordStream { index, stream }),
        1 => Just(Op::EmptyCache),
    ]
}

struct Live {
    data: DataPtr,
    size: u64,
    seed: u64,
}

fn check_model(a: &cudalloc::Runtime, live: &[Live]) {
    let mut ranges: Vec<(u64, u64)> = live.iter().map(|l| (l.data.ptr().0, l.size)).collect();
    ranges.sort();
    for w in ranges.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "live allocations overlap: {w:?}");
    }
    let stats = a.memory_stats(0).unwrap();
    assert_eq!(stats.allocation.all.current, live.len() as i64);
    assert_eq!(
        stats.requested_bytes.all.current,
        live.iter().map(|l| l.size as i64).sum::<i64>()
    );
    a.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_match_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        let driver: Arc<dyn Driver> = test_driver();
        let a = checked_allocator(driver.clone(), "");
        let streams = [a.default_stream(0).unwrap(), a.create_stream(0).unwrap(), a.create_stream(0).unwrap()];
        let mut live: Vec<Live> = Vec::new();
        let mut next_seed = 1u64;
        for op in ops {
            match op {
                Op::Alloc { stream, size } => match a.allocate_on(streams[stream], size) {
                    Ok(data) => {
                        let seed = next_seed;
                        next_seed += 1;
                        driver.fill_pattern(streams[stream], data.ptr(), size, seed).unwrap();
                        live.push(Live { data, size, seed });
                    }
                    Err(e) => prop_assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{}", e),
                },
                Op::Free { index } if !live.is_empty() => {
                    let l = live.swap_remove(index % live.len());
                    let s = l.data.allocation_stream().unwrap();
                    let bad = driver.count_pattern_mismatches(s, l.data.ptr(), l.size, l.seed).unwrap();
                    prop_assert_eq!(bad, 0, "allocation lost its bytes before being freed");
                }
                Op::RecordStream { index, stream } if !live.is_empty() => {
                    let l = &live[index % live.len()];
                    driver.sleep(streams[stream], 50).unwrap();
                    a.record_stream(&l.data, streams[stream]).unwrap();
                }
                Op::EmptyCache => a.empty_cache(),
                _ => {}
            }
            check_model(&a, &live);
        }
        drop(live);
        a.empty_cache();
        let stats = a.memory_stats(0).unwrap();
        prop_assert_eq!(stats.allocation.all.current, 0);
        prop_assert_eq!(stats.active.all.current, 0);
        prop_assert_eq!(stats.reserved_bytes.all.current, 0);
        let m = driver.mem_info(0).unwrap();
        prop_assert_eq!(m.free, m.total);
    }
}
