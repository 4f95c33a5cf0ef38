//! Random operation sequences (alloc / free / record_stream / empty_cache across streams) checked
//! against a simple model after every step: live allocations never overlap, every allocation keeps
//! its own bytes until freed, stats equal the model, and the invariant scanner (on in
//! `checked_allocator`) finds nothing wrong. The second property mixes memory pools in (scopes
//! entered and left, pools dropped with live blocks, a pool's own `empty_cache`): every block
//! lives in its pool's segments, and each pool's statistics equal the model's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{
    backend::Driver, pool::MemPool, pool::MemPoolId, pool::MemPoolOptions, pool::PoolScope,
    DataPtr, ErrorKind,
};
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

fn check_model<'a>(a: &cudalloc::Runtime, live: impl IntoIterator<Item = &'a Live>) {
    let live: Vec<&Live> = live.into_iter().collect();
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
        // The device alone: the case checks its free memory at the end (on the CUDA backend the
        // device is the whole test process's).
        let _alone = device_alone();
        let driver: Arc<dyn Driver> = test_driver();
        let baseline = free_baseline(&driver);
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
                        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                        unsafe { driver.kernels().fill_pattern(streams[stream], data.ptr(), size, seed) }.unwrap();
                        live.push(Live { data, size, seed });
                    }
                    Err(e) => prop_assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{}", e),
                },
                Op::Free { index } if !live.is_empty() => {
                    let l = live.swap_remove(index % live.len());
                    let s = l.data.allocation_stream().unwrap();
                    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                    let bad = unsafe { driver.kernels().count_pattern_mismatches(s, l.data.ptr(), l.size, l.seed) }.unwrap();
                    prop_assert_eq!(bad, 0, "allocation lost its bytes before being freed");
                }
                Op::RecordStream { index, stream } if !live.is_empty() => {
                    let l = &live[index % live.len()];
                    driver.kernels().sleep(streams[stream], 50).unwrap();
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
        prop_assert_eq!(m.free, baseline);
    }
}

#[derive(Clone, Debug)]
enum PoolOp {
    Plain(Op),
    /// Allocations of this thread go to pool `which` (made if it is gone) until `Leave`.
    Enter {
        which: usize,
    },
    Leave,
    /// The program lets go of pool `which` (scopes on it keep it alive until they end).
    Drop {
        which: usize,
    },
    /// Pool `which`'s own `empty_cache`.
    EmptyPool {
        which: usize,
    },
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        8 => op().prop_map(PoolOp::Plain),
        2 => (0usize..2).prop_map(|which| PoolOp::Enter { which }),
        2 => Just(PoolOp::Leave),
        1 => (0usize..2).prop_map(|which| PoolOp::Drop { which }),
        1 => (0usize..2).prop_map(|which| PoolOp::EmptyPool { which }),
    ]
}

/// Every live block lies in a segment of its own pool; each live pool's statistics are the
/// model's.
fn check_pools(a: &cudalloc::Runtime, live: &[(Live, MemPoolId)], pools: &[Option<MemPool>]) {
    let snap = a.snapshot();
    for (l, pool) in live {
        let addr = l.data.ptr().0;
        // By the segment's blocks: an expandable segment's mapped pages need not be contiguous,
        // so its `total_size` does not bound its addresses.
        let seg = snap
            .segments
            .iter()
            .find(|s| {
                s.blocks
                    .iter()
                    .any(|b| b.addr <= addr && addr < b.addr + b.size)
            })
            .expect("a live block lies in a segment");
        assert_eq!(
            seg.segment_pool_id, *pool,
            "block {addr:#x} outside its pool"
        );
    }
    for pool in pools.iter().flatten() {
        let stats = pool.memory_stats(0).unwrap();
        let mine: Vec<_> = live.iter().filter(|(_, p)| *p == pool.id()).collect();
        assert_eq!(stats.allocation.all.current, mine.len() as i64);
        assert_eq!(
            stats.requested_bytes.all.current,
            mine.iter().map(|(l, _)| l.size as i64).sum::<i64>()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_with_memory_pools_match_the_model(ops in proptest::collection::vec(pool_op(), 1..60)) {
        let _alone = device_alone();
        let driver: Arc<dyn Driver> = test_driver();
        let baseline = free_baseline(&driver);
        let a = checked_allocator(driver.clone(), "");
        let streams = [a.default_stream(0).unwrap(), a.create_stream(0).unwrap(), a.create_stream(0).unwrap()];
        let mut pools: Vec<Option<MemPool>> = vec![None, None];
        let mut scopes: Vec<PoolScope> = Vec::new();
        let mut live: Vec<(Live, MemPoolId)> = Vec::new();
        let mut next_seed = 1u64;
        for op in ops {
            match op {
                PoolOp::Plain(Op::Alloc { stream, size }) => match a.allocate_on(streams[stream], size) {
                    Ok(data) => {
                        let seed = next_seed;
                        next_seed += 1;
                        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                        unsafe { driver.kernels().fill_pattern(streams[stream], data.ptr(), size, seed) }.unwrap();
                        let pool = scopes.last().map_or(MemPoolId::DEFAULT, |s| s.pool().id());
                        live.push((Live { data, size, seed }, pool));
                    }
                    Err(e) => prop_assert_eq!(e.kind(), ErrorKind::OutOfMemory, "{}", e),
                },
                PoolOp::Plain(Op::Free { index }) if !live.is_empty() => {
                    let (l, _) = live.swap_remove(index % live.len());
                    let s = l.data.allocation_stream().unwrap();
                    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                    let bad = unsafe { driver.kernels().count_pattern_mismatches(s, l.data.ptr(), l.size, l.seed) }.unwrap();
                    prop_assert_eq!(bad, 0, "allocation lost its bytes before being freed");
                }
                PoolOp::Plain(Op::RecordStream { index, stream }) if !live.is_empty() => {
                    let (l, _) = &live[index % live.len()];
                    driver.kernels().sleep(streams[stream], 50).unwrap();
                    a.record_stream(&l.data, streams[stream]).unwrap();
                }
                PoolOp::Plain(Op::EmptyCache) => a.empty_cache(),
                PoolOp::Enter { which } => {
                    let pool = match &pools[which] {
                        Some(pool) => pool.clone(),
                        None => {
                            let made = a.mem_pool(MemPoolOptions::default()).unwrap();
                            pools[which] = Some(made.clone());
                            made
                        }
                    };
                    scopes.push(a.use_mem_pool(&pool, 0).unwrap());
                }
                PoolOp::Leave => drop(scopes.pop()),
                PoolOp::Drop { which } => drop(pools[which].take()),
                PoolOp::EmptyPool { which } => {
                    if let Some(pool) = &pools[which] {
                        pool.empty_cache();
                    }
                }
                _ => {}
            }
            check_model(&a, live.iter().map(|(l, _)| l));
            check_pools(&a, &live, &pools);
        }
        drop(scopes);
        drop(pools);
        drop(live);
        a.empty_cache();
        let stats = a.memory_stats(0).unwrap();
        prop_assert_eq!(stats.allocation.all.current, 0);
        prop_assert_eq!(stats.reserved_bytes.all.current, 0);
        let m = driver.mem_info(0).unwrap();
        prop_assert_eq!(m.free, baseline, "every pool's segments went back");
    }
}
