//! Settings that change on a live runtime without forgetting the others (`Runtime::reconfigure`,
//! `Runtime::override_config`; `alloc/reconfigure.rs`, `config/live.rs`): one key changes and
//! the rest keep their values, a scoped override puts back exactly what it changed, keys that
//! cannot change are refused by name with the reason and change nothing, allocations running
//! on other threads while settings change keep the allocator consistent, and the memory
//! fraction's setter is a reconfiguration of its key (one home for the setting: overrides put
//! back what the setter set).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use cudalloc::{AllocatorConfig, CrossStreamReuse, ErrorKind, Runtime};

const MIB: u64 = 1 << 20;

fn runtime(conf: &str) -> Runtime {
    Runtime::builder()
        .config(AllocatorConfig::parse(conf).unwrap())
        .check_invariants(true)
        .build(test_driver())
        .unwrap()
}

#[test]
fn reconfigure_one_key_keeps_the_others() {
    let _device = device_shared();
    let a =
        runtime("max_split_size_mb:64,garbage_collection_threshold:0.6,roundup_power2_divisions:4");
    let before = (*a.config()).clone();
    let named = a.reconfigure("garbage_collection_threshold:0.8").unwrap();
    assert_eq!(named, ["garbage_collection_threshold"]);
    let after = a.config();
    assert_eq!(after.garbage_collection_threshold, 0.8);
    assert_eq!(
        after.max_split_size,
        64 * MIB,
        "PyTorch's re-parse would reset it"
    );
    assert_eq!(
        after.roundup_power2_divisions,
        before.roundup_power2_divisions
    );
    let mut expected = before.clone();
    expected.garbage_collection_threshold = 0.8;
    assert_eq!(*after, expected);
    // The reference read before the change still reads the old value.
    assert_eq!(before.garbage_collection_threshold, 0.6);
}

#[test]
fn expandable_segments_and_cross_stream_reuse_change_live() {
    let _device = device_shared();
    if expandable_run() {
        println!("expandable_segments_and_cross_stream_reuse_change_live: skipped: starts without expandable segments");
        return;
    }
    let a = runtime("");
    let s1 = a.create_stream(0).unwrap();
    let whole = a.allocate_on(s1, 6 * MIB).unwrap();
    a.reconfigure("expandable_segments:True").unwrap();
    let s2 = a.create_stream(0).unwrap();
    let grown = a.allocate_on(s2, 6 * MIB).unwrap();
    // An allocation on s1 after the change: its segment's rest is still split as a whole
    // segment's block (its kind, not the setting, decides).
    let more = a.allocate_on(s1, 6 * MIB).unwrap();
    let kinds: Vec<(u64, bool)> = a
        .snapshot()
        .segments
        .iter()
        .map(|s| (s.stream, s.is_expandable))
        .collect();
    assert!(kinds.contains(&(s1.raw(), false)), "{kinds:?}");
    assert!(kinds.contains(&(s2.raw(), true)), "{kinds:?}");
    assert!(
        !kinds.contains(&(s1.raw(), true)),
        "s1 had room in its whole segment: {kinds:?}"
    );
    drop((whole, grown, more));
    a.check_invariants().unwrap();

    // Cross-stream reuse turned on live: a fresh stream takes over s1's idle whole segment.
    a.reconfigure("expandable_segments:False,cross_stream_reuse:segments")
        .unwrap();
    assert_eq!(a.config().cross_stream_reuse, CrossStreamReuse::Segments);
    let reserved = a.memory_stats(0).unwrap().reserved_bytes.all.current;
    let s3 = a.create_stream(0).unwrap();
    let taken = a.allocate_on(s3, 6 * MIB).unwrap();
    assert_eq!(
        a.memory_stats(0).unwrap().reserved_bytes.all.current,
        reserved,
        "no new memory: s1's idle segment moved to s3"
    );
    drop(taken);
    a.check_invariants().unwrap();
}

#[test]
fn scoped_config_restores_the_previous() {
    let _device = device_shared();
    let a = runtime("garbage_collection_threshold:0.5,release_lock_on_cudamalloc:True");
    let before = (*a.config()).clone();
    {
        let scope = a
            .override_config("garbage_collection_threshold:0.9,expandable_segments:True")
            .unwrap();
        assert_eq!(
            scope.keys(),
            ["garbage_collection_threshold", "expandable_segments"]
        );
        assert_eq!(a.config().garbage_collection_threshold, 0.9);
        assert!(a.config().expandable_segments);
        drop(a.allocate(0, MIB).unwrap());
    }
    assert_eq!(
        *a.config(),
        before,
        "the override put back exactly what it changed"
    );

    // A key changed by someone else inside the scope keeps its new value.
    let scope = a
        .override_config("garbage_collection_threshold:0.7")
        .unwrap();
    a.reconfigure("cross_stream_reuse:blocks").unwrap();
    scope.restore().unwrap();
    let mut expected = before.clone();
    expected.cross_stream_reuse = CrossStreamReuse::Blocks;
    assert_eq!(*a.config(), expected);

    // Nested scopes unwind in order.
    let outer = a.override_config("roundup_power2_divisions:4").unwrap();
    let inner = a.override_config("roundup_power2_divisions:8").unwrap();
    assert_eq!(a.config().roundup_power2_divisions[0], 8);
    drop(inner);
    assert_eq!(a.config().roundup_power2_divisions[0], 4);
    drop(outer);
    assert_eq!(*a.config(), expected);
}

#[test]
fn keys_that_cannot_change_are_refused_by_name_and_change_nothing() {
    let _device = device_shared();
    let a = runtime("thread_cache_mb:4");
    let before = (*a.config()).clone();
    for (changes, key) in [
        (
            "garbage_collection_threshold:0.5,thread_cache_mb:8",
            "thread_cache_mb",
        ),
        ("default_stream:dedicated", "default_stream"),
        ("stream_order:manual", "stream_order"),
        ("ipc_handle_ttl_s:5", "ipc_handle_ttl_s"),
        (
            "pinned_use_host_register:True",
            "pinned_use_cuda_host_register",
        ),
    ] {
        let err = a.reconfigure(changes).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{changes}");
        let text = err.to_string();
        assert!(
            text.contains(key) && text.contains("cannot change"),
            "{text}"
        );
        assert_eq!(*a.config(), before, "{changes}: nothing changed");
    }
    // Naming a fixed key with the value it has is no change.
    a.reconfigure("thread_cache_mb:4,stream_order:auto")
        .unwrap();
    // An unknown key or a bad value is the parser's error.
    assert_eq!(
        a.reconfigure("no_such_key:1").unwrap_err().kind(),
        ErrorKind::Config
    );
    assert_eq!(
        a.reconfigure("garbage_collection_threshold:2")
            .unwrap_err()
            .kind(),
        ErrorKind::Config
    );

    // max_split_size_mb changes live: a block counted as oversize when handed out is taken back
    // as such when freed under another limit (the counters never go negative).
    let held = a.allocate(0, 30 * MIB).unwrap();
    let big = {
        let _scope = a.override_config("max_split_size_mb:24").unwrap();
        assert_eq!(a.config().max_split_size, 24 * MIB);
        drop(held); // handed out under no limit: not counted, not taken back
        assert_eq!(a.memory_stats(0).unwrap().oversize_allocations.current, 0);
        a.allocate(0, 30 * MIB).unwrap()
    };
    assert_eq!(a.memory_stats(0).unwrap().oversize_allocations.current, 1);
    assert_eq!(
        a.config().max_split_size,
        u64::MAX,
        "the scope put the limit back"
    );
    // Freed under no limit: counted when handed out, so taken back.
    drop(big);
    let stats = a.memory_stats(0).unwrap();
    assert_eq!(stats.oversize_allocations.current, 0);
    assert_eq!(stats.oversize_segments.current, 0);
    a.check_invariants().unwrap();
}

#[test]
fn the_memory_fraction_changes_on_every_device_and_comes_back() {
    let _device = device_alone();
    let (driver, cap) = sized_driver(64 * MIB);
    let a = Runtime::builder()
        .config(AllocatorConfig::parse(&cap).unwrap())
        .build(sanitized(driver))
        .unwrap();
    let fraction = a.config().per_process_memory_fraction;
    {
        let _scope = a
            .override_config(&format!("per_process_memory_fraction:{}", fraction / 4.0))
            .unwrap();
        let err = a.allocate(0, 24 * MIB).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    }
    drop(a.allocate(0, 24 * MIB).unwrap());
}

#[test]
fn allocations_on_other_threads_while_settings_change_stay_consistent() {
    let _device = device_shared();
    let a = Arc::new(runtime(""));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
            std::thread::spawn(move || {
                let s = a.create_stream(0).unwrap();
                let mut live = Vec::new();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || i < 200 {
                    let size = [512, 3000, MIB + 512, 3 * MIB][(i as usize + t) % 4];
                    live.push(a.allocate_on(s, size).unwrap());
                    if live.len() > 6 {
                        live.remove(i as usize % live.len());
                    }
                    i += 1;
                }
            })
        })
        .collect();
    for i in 0..100 {
        let changes = if i % 2 == 0 {
            "roundup_power2_divisions:4,expandable_segments:True,cross_stream_reuse:segments"
        } else {
            "roundup_power2_divisions:1,expandable_segments:False,cross_stream_reuse:off"
        };
        a.reconfigure(changes).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    a.check_invariants().unwrap();
    let stats = a.memory_stats(0).unwrap();
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert_eq!(stats.active.all.current, 0);
}

/// Whether `mib` MiB fit on device 0 under the cap in force (the cache emptied first: a cap
/// limits what is reserved, and a cached segment would serve without a reservation).
fn fits(a: &Runtime, mib: u64) -> bool {
    a.empty_cache();
    match a.allocate(0, mib * MIB) {
        Ok(_) => true,
        Err(err) if err.kind() == ErrorKind::OutOfMemory => false,
        Err(err) => panic!("allocating {mib} MiB: {err}"),
    }
}

/// The memory fraction has one home, the configuration: `set_per_process_memory_fraction` is a
/// reconfiguration of `per_process_memory_fraction`, so an override of the key puts back what the
/// setter set, and a setter inside an override's scope is a change of the key that the scope's
/// end puts back, as a `reconfigure` would be.
#[test]
fn the_memory_fraction_setter_and_overrides_share_one_home() {
    let _device = device_alone();
    let (driver, cap) = sized_driver(64 * MIB);
    let a = Runtime::builder()
        .config(AllocatorConfig::parse(&cap).unwrap())
        .build(sanitized(driver))
        .unwrap();
    // The fraction that is the whole 64 MiB (1.0 on the host backend).
    let whole = a.config().per_process_memory_fraction;
    assert!(fits(&a, 40));

    // The setter's cap, overridden for a scope: after it, the setter's cap again (32 MiB).
    a.set_per_process_memory_fraction(whole * 0.5, 0).unwrap();
    assert!(!fits(&a, 40) && fits(&a, 30));
    {
        let _scope = a
            .override_config(&format!("per_process_memory_fraction:{}", whole * 0.25))
            .unwrap();
        assert!(!fits(&a, 30) && fits(&a, 12));
    }
    assert!(
        !fits(&a, 40),
        "40 MiB fit after the override: the setter's cap was lost"
    );
    assert!(fits(&a, 30));
    assert_eq!(a.config().memory_fraction(0), Some(whole * 0.5));

    // An override lifting the setter's cap puts it back too.
    {
        let _scope = a
            .override_config(&format!("per_process_memory_fraction:{whole}"))
            .unwrap();
        assert!(fits(&a, 40));
    }
    assert!(!fits(&a, 40) && fits(&a, 30), "the setter's cap is back");

    // A setter inside a scope changes the key the scope puts back at its end.
    a.reconfigure(&format!("per_process_memory_fraction:{whole}"))
        .unwrap();
    assert!(fits(&a, 40));
    {
        let _scope = a
            .override_config(&format!("per_process_memory_fraction:{}", whole * 0.25))
            .unwrap();
        a.set_per_process_memory_fraction(whole * 0.5, 0).unwrap();
        assert!(
            !fits(&a, 40) && fits(&a, 30),
            "the setter is in force in the scope"
        );
    }
    assert!(
        fits(&a, 40),
        "the scope's end put back what was in force before it"
    );
    a.check_invariants().unwrap();
}

/// The setter's value is the configuration's: `config()` (and `cudalloc info`, which prints it)
/// shows it in a form the grammar reads back, a bad value or device is refused with nothing
/// changed, and the key's plain form — every device — clears the devices' own values.
#[test]
fn the_memory_fraction_setter_is_seen_in_the_configuration() {
    let _device = device_shared();
    let a = runtime("");
    let every = a.config().per_process_memory_fraction;
    a.set_per_process_memory_fraction(0.5, 0).unwrap();
    assert_eq!(a.config().memory_fraction(0), Some(0.5));
    assert_eq!(
        a.config().device_memory_fractions,
        BTreeMap::from([(0, 0.5)])
    );
    let printed = a.config().to_string();
    let line = printed
        .lines()
        .find(|l| l.starts_with("per_process_memory_fraction:"))
        .unwrap();
    assert_eq!(
        line,
        format!("per_process_memory_fraction: [*:{every},0:0.5]")
    );
    assert_eq!(
        AllocatorConfig::parse(line).unwrap().memory_fraction(0),
        Some(0.5)
    );

    let before = (*a.config()).clone();
    assert_eq!(
        a.set_per_process_memory_fraction(1.5, 0)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let missing = a.device_count();
    assert_eq!(
        a.set_per_process_memory_fraction(0.5, missing)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let err = a
        .reconfigure(&format!("per_process_memory_fraction:[{missing}:0.5]"))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert_eq!(*a.config(), before, "nothing changed");

    a.reconfigure("per_process_memory_fraction:0.75").unwrap();
    assert!(a.config().device_memory_fractions.is_empty());
    assert_eq!(a.config().memory_fraction(0), Some(0.75));
}
