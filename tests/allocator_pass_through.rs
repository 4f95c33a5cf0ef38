//! Pass-through mode (`pass_through:True`, issue 48): the default pool caches nothing — each
//! allocation is a driver allocation of its own rounded size, each free a driver free once its
//! stream-ordered wait is over — so a tool that checks a driver allocation's bounds sees every
//! tensor's. Same API and statistics; memory pools keep their memory; the combinations with a
//! cache are refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{AllocatorConfig, ErrorKind, Runtime, Storage};

fn runtime(conf: &str) -> (Arc<Runtime>, TestBackend) {
    let b = backends("allocator_pass_through").remove(0);
    let rt = Arc::new(
        Runtime::builder()
            .config(AllocatorConfig::parse(conf).unwrap())
            .check_invariants(true)
            .build(b.driver.clone())
            .unwrap(),
    );
    (rt, b)
}

/// Every live allocation is one segment of its own rounded size, and a free with no other
/// stream gives its segment back at once: nothing is ever reserved beyond what is allocated.
#[test]
fn each_allocation_is_its_own_driver_allocation() {
    let _device = device_shared();
    let (rt, _b) = runtime("pass_through:True");
    let s = rt.create_stream(0).unwrap();
    let mut live = Vec::new();
    for (i, size) in [
        1u64,
        512,
        513,
        4096,
        1 << 20,
        (1 << 20) + 1,
        3 << 20,
        11 << 20,
    ]
    .into_iter()
    .cycle()
    .take(24)
    .enumerate()
    {
        live.push(Storage::new_on(&rt, s, size).unwrap());
        let stats = rt.memory_stats(0).unwrap();
        assert_eq!(stats.segment.all.current, live.len() as i64, "step {i}");
        assert_eq!(
            stats.reserved_bytes.all.current, stats.allocated_bytes.all.current,
            "step {i}: reserved only what is allocated"
        );
        let snapshot = rt.snapshot();
        assert!(
            snapshot.segments.iter().all(|seg| seg.blocks.len() == 1),
            "step {i}: one block per segment"
        );
        if i % 3 == 2 {
            live.remove(i % live.len());
            let stats = rt.memory_stats(0).unwrap();
            assert_eq!(
                stats.segment.all.current,
                live.len() as i64,
                "step {i}: freed"
            );
            assert_eq!(
                stats.reserved_bytes.all.current,
                stats.allocated_bytes.all.current
            );
        }
    }
    drop(live);
    let stats = rt.memory_stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.current, 0, "{stats:?}");
    assert_eq!(stats.segment.all.freed, stats.segment.all.allocated);
    // Caching, the same program keeps what it freed.
    let (cached, _b) = runtime("");
    let s = cached.create_stream(0).unwrap();
    drop(Storage::new_on(&cached, s, 4096).unwrap());
    assert!(cached.memory_stats(0).unwrap().reserved_bytes.all.current > 0);
}

/// A free whose memory another stream still uses waits for that stream's work (stream-ordered,
/// as the caching allocator's), and only then goes back to the driver; meanwhile its memory is
/// never handed out again.
#[test]
fn a_free_goes_back_to_the_driver_after_the_streams_that_used_it() {
    let _device = device_shared();
    let (rt, b) = runtime("pass_through:True,stream_order:manual");
    let (s, t) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let x = Storage::new_on(&rt, s, 1 << 20).unwrap();
    let addr = x.unordered_data_ptr();
    let hold = hold_stream(&b, t);
    x.record_stream(t).unwrap();
    drop(x);
    let stats = rt.memory_stats(0).unwrap();
    assert_eq!(stats.segment.all.current, 1, "kept while `t` may use it");
    assert_eq!(stats.allocated_bytes.all.current, 0);
    let y = Storage::new_on(&rt, s, 1 << 20).unwrap();
    assert_ne!(
        y.unordered_data_ptr(),
        addr,
        "memory `t` may use is not handed out"
    );
    // A driver free synchronizes the device (CUDA's `cuMemFree` does, as the host backend's
    // free): `y` is dropped once `t` runs again.
    drop(hold);
    drop(y);
    rt.synchronize(t).unwrap();
    // The next allocation polls the free's event and gives its segment back first.
    let z = Storage::new_on(&rt, s, 4096).unwrap();
    let stats = rt.memory_stats(0).unwrap();
    assert_eq!(stats.segment.all.current, 1, "{stats:?}");
    assert_eq!(stats.reserved_bytes.all.current, 4096);
    drop(z);
    assert_eq!(rt.memory_stats(0).unwrap().reserved_bytes.all.current, 0);
}

/// Passing through, nothing is reused across streams either: a segment another stream freed
/// (its wait over, not yet given back) is not adopted by a miss on a third stream under
/// `cross_stream_reuse` — it goes back to the driver. Found by review: the cross-stream step ran
/// before pass-through's own allocation and handed the old segment out.
#[test]
fn nothing_is_reused_across_streams() {
    let _device = device_shared();
    for reuse in ["segments", "blocks"] {
        let conf = format!("pass_through:True,cross_stream_reuse:{reuse},stream_order:manual");
        let (rt, b) = runtime(&conf);
        let [s, t, u] = [0; 3].map(|_| rt.create_stream(0).unwrap());
        let x = Storage::new_on(&rt, s, 1 << 20).unwrap();
        let addr = x.unordered_data_ptr();
        let hold = hold_stream(&b, t);
        x.record_stream(t).unwrap();
        drop(x);
        drop(hold);
        rt.synchronize(t).unwrap();
        // `x`'s wait is over but unseen by `s`'s cache; a miss on `u` must not take it.
        let y = Storage::new_on(&rt, u, 1 << 20).unwrap();
        assert_ne!(
            y.unordered_data_ptr(),
            addr,
            "{reuse}: `x`'s memory was reused"
        );
        drop(y);
        drop(Storage::new_on(&rt, s, 512).unwrap());
        let stats = rt.memory_stats(0).unwrap();
        assert_eq!(stats.reserved_bytes.all.current, 0, "{reuse}: {stats:?}");
    }
}

/// A memory pool keeps its memory (a graph's replays reuse what its capture allocated), so its
/// segments are the caching allocator's.
#[test]
fn memory_pools_keep_their_memory() {
    let _device = device_shared();
    let (rt, _b) = runtime("pass_through:True");
    let s = rt.create_stream(0).unwrap();
    let pool = rt.mem_pool(Default::default()).unwrap();
    {
        let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
        drop(Storage::new_on(&rt, s, 4096).unwrap());
    }
    let stats = pool.memory_stats(0).unwrap();
    assert_eq!(stats.segment.all.current, 1, "the pool keeps its segment");
    assert_eq!(
        stats.reserved_bytes.all.current,
        2 << 20,
        "a small segment, as cached"
    );
}

/// What contradicts pass-through is refused by name, from text and from code; the key is printed
/// with the others and read back; a live runtime keeps its rule.
#[test]
fn pass_through_is_a_key_like_the_others() {
    for (conf, named) in [
        ("pass_through:True,thread_cache_mb:8", "thread_cache_mb"),
        (
            "pass_through:True,expandable_segments:True",
            "expandable_segments",
        ),
        ("pass_through:maybe", "pass_through"),
    ] {
        let err = AllocatorConfig::parse(conf).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{conf}: {err}");
        assert!(err.to_string().contains(named), "{conf}: {err}");
    }
    let mut config = AllocatorConfig::default();
    config.pass_through = true;
    config.thread_cache = 1 << 20;
    let err = Runtime::builder()
        .config(config)
        .build(test_driver())
        .unwrap_err();
    assert!(err.to_string().contains("thread_cache_mb"), "{err}");
    let config = AllocatorConfig::parse("pass_through:True").unwrap();
    let printed = config.to_string();
    assert!(printed.contains("pass_through: true"), "{printed}");
    let (rt, _b) = runtime("pass_through:True");
    let err = rt.reconfigure("pass_through:False").unwrap_err();
    assert!(err.to_string().contains("pass_through"), "{err}");
    let err = rt.reconfigure("expandable_segments:True").unwrap_err();
    assert!(err.to_string().contains("expandable_segments"), "{err}");
}
