//! Sleep and wake by tag (`src/alloc/tags.rs`, `src/alloc/engine/sleep.rs`, `src/runtime/sleep.rs`):
//! offload and discard, addresses kept, bytes restored, physical memory given back, many cycles,
//! and where sleep meets the rest — graphs, COW, registrars, sharing with a killed consumer, the
//! sanitizer, several devices, allocations racing a sleep on another thread. Runs on the host
//! backend, and on the CUDA backend in a CUDA run (the contract double in CI, a GPU in
//! `gpu-check.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use cudalloc::{
    backend::Driver, backend::HostDriver, graph::CaptureMode, registration::Region,
    registration::Registrar, registration::SegmentId, sanitizer::HazardKind, sanitizer::Sanitize,
    sanitizer::SanitizeOptions, DeviceAddr, ErrorKind, Runtime, Storage, WakeOptions,
};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 << 20;

/// One test at a time: the CUDA backend's one device (its free memory is measured), and a
/// fork happens only while no other test of this binary runs.
fn device() -> std::sync::RwLockWriteGuard<'static, ()> {
    device_alone()
}

fn runtime(b: &TestBackend, conf: &str) -> Arc<Runtime> {
    checked_allocator(b.driver.clone(), conf)
}

fn mismatches(storages: &[Storage], seed: u64) -> Vec<u64> {
    storages
        .iter()
        .enumerate()
        .map(|(i, s)| s.count_pattern_mismatches(seed + i as u64).unwrap())
        .collect()
}

fn free_memory(rt: &Runtime) -> u64 {
    rt.driver().mem_info(0).unwrap().free
}

fn tag_reserved(rt: &Runtime, tag: &str) -> i64 {
    rt.tag(tag)
        .unwrap()
        .memory_stats(0)
        .unwrap()
        .reserved_bytes
        .all
        .current
}

#[test]
fn offloaded_bytes_come_back_at_the_same_addresses() {
    for b in backends("offloaded_bytes_come_back_at_the_same_addresses") {
        let _device = device();
        let rt = runtime(&b, "");
        let sizes = [512, 4096, MIB, 5 * MIB + 100, 3 * PAGE];
        let weights = tagged(&rt, "weights", &sizes, 10);
        let before: Vec<DeviceAddr> = weights.iter().map(Storage::unordered_data_ptr).collect();
        let reserved = tag_reserved(&rt, "weights");
        assert!(reserved > 0);
        let free_awake = free_memory(&rt);

        let report = rt.sleep(&["weights"], &[]).unwrap();
        assert!(rt.is_asleep("weights").unwrap(), "{}", b.name);
        assert!(
            report.offloaded_bytes >= sizes.iter().sum::<u64>(),
            "{}: {report:?}",
            b.name
        );
        assert_eq!(report.discarded_bytes, 0);
        assert_eq!(report.released_bytes, reserved as u64, "{}", b.name);
        assert_eq!(tag_reserved(&rt, "weights"), 0, "{}", b.name);
        assert!(
            rt.tag("weights")
                .unwrap()
                .snapshot()
                .unwrap()
                .segments
                .is_empty(),
            "{}: a sleeping tag's snapshot shows no memory",
            b.name
        );
        let given_back = free_memory(&rt) - free_awake;
        assert!(
            given_back * 100 >= reserved as u64 * 99,
            "{}: {given_back} of {reserved} bytes given back",
            b.name
        );

        let woke = rt
            .wake_up(&["weights"], cudalloc::WakeOptions::default())
            .unwrap();
        assert_eq!(woke.mapped_bytes, reserved as u64, "{}", b.name);
        assert!(woke.restored_bytes >= sizes.iter().sum::<u64>());
        assert!(!rt.is_asleep("weights").unwrap());
        let after: Vec<DeviceAddr> = weights.iter().map(Storage::unordered_data_ptr).collect();
        assert_eq!(before, after, "{}: addresses kept", b.name);
        assert_eq!(mismatches(&weights, 10), vec![0; sizes.len()], "{}", b.name);
        assert_eq!(tag_reserved(&rt, "weights"), reserved, "{}", b.name);
        // Allocations of the tag are served again.
        let more = tagged(&rt, "weights", &[MIB], 99);
        assert_eq!(mismatches(&more, 99), vec![0]);
        drop((weights, more));
        rt.tag("weights").unwrap().empty_cache();
        assert_eq!(rt.memory_reserved(0).unwrap(), 0, "{}", b.name);
    }
}

#[test]
fn discarded_tags_give_memory_back_and_wake_zeroed_on_request() {
    for b in backends("discarded_tags_give_memory_back_and_wake_zeroed_on_request") {
        let _device = device();
        let rt = runtime(&b, "");
        let weights = tagged(&rt, "weights", &[3 * MIB], 1);
        let kv = tagged(&rt, "kv_cache", &[4 * MIB, MIB], 7);
        let kv_addr: Vec<DeviceAddr> = kv.iter().map(Storage::unordered_data_ptr).collect();
        let host_before = rt.pinned_allocator().stats().active_bytes.current;

        let report = rt.sleep(&["weights"], &["kv_cache"]).unwrap();
        assert_eq!(report.discarded_bytes, 5 * MIB, "{}: {report:?}", b.name);
        assert_eq!(report.offloaded_bytes, 3 * MIB);
        assert_eq!(
            rt.memory_reserved(0).unwrap(),
            0,
            "{}: everything given back",
            b.name
        );
        // Only the offloaded tag took pinned memory.
        let host_during = rt.pinned_allocator().stats().active_bytes.current;
        assert!(host_during - host_before >= 3 * MIB as i64);
        assert!(host_during - host_before < 8 * MIB as i64, "{}", b.name);

        let woke = rt
            .wake_up(&[], WakeOptions::default().zero_discarded(true))
            .unwrap();
        assert_eq!(woke.zeroed_bytes, 5 * MIB, "{}: {woke:?}", b.name);
        assert_eq!(mismatches(&weights, 1), vec![0]);
        for s in &kv {
            let mut bytes = vec![1u8; s.nbytes() as usize];
            s.copy_to_host(
                s.runtime().current_stream(s.device()).unwrap(),
                0,
                &mut bytes,
            )
            .unwrap();
            assert!(bytes.iter().all(|&x| x == 0), "{}: zeroed", b.name);
        }
        assert_eq!(
            kv.iter()
                .map(Storage::unordered_data_ptr)
                .collect::<Vec<_>>(),
            kv_addr
        );
        // The offloaded bytes' pinned buffers went back to the host allocator's cache.
        rt.pinned_allocator().process_events();
        assert_eq!(
            rt.pinned_allocator().stats().active_bytes.current,
            host_before,
            "{}",
            b.name
        );
    }
}

#[test]
fn refusals_say_what_is_wrong() {
    for b in backends("refusals_say_what_is_wrong") {
        let _device = device();
        let rt = runtime(&b, "");
        let weights = tagged(&rt, "weights", &[MIB], 3);
        let other = Storage::new(&rt, 0, MIB).unwrap();
        assert_eq!(
            rt.sleep(&["nope"], &[]).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            rt.sleep(&["weights"], &["weights"]).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            rt.wake_up(&["weights"], cudalloc::WakeOptions::default())
                .unwrap_err()
                .kind(),
            ErrorKind::Asleep,
            "{}: waking an awake tag",
            b.name
        );
        rt.sleep(&["weights"], &[]).unwrap();
        assert_eq!(
            rt.sleep(&["weights"], &[]).unwrap_err().kind(),
            ErrorKind::Asleep
        );
        // New allocations of the tag, library calls on its memory and sharing it are refused.
        {
            let _in = rt.use_tag("weights", 0).unwrap();
            let err = Storage::new(&rt, 0, 4096).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Asleep, "{}: {err}", b.name);
            assert!(err.to_string().contains("weights"), "{err}");
        }
        let s = &weights[0];
        assert_eq!(s.fill_pattern(5).unwrap_err().kind(), ErrorKind::Asleep);
        assert_eq!(
            s.count_pattern_mismatches(3).unwrap_err().kind(),
            ErrorKind::Asleep
        );
        let mut host = vec![0u8; 16];
        assert_eq!(
            s.copy_to_host(
                s.runtime().current_stream(s.device()).unwrap(),
                0,
                &mut host
            )
            .unwrap_err()
            .kind(),
            ErrorKind::Asleep
        );
        assert_eq!(s.share_ipc().unwrap_err().kind(), ErrorKind::Asleep);
        let mut pinned = rt.pinned(16).unwrap();
        let stream = rt.current_stream(0).unwrap();
        assert_eq!(
            s.copy_to_pinned(stream, 0, &mut pinned, 0, 16)
                .unwrap_err()
                .kind(),
            ErrorKind::Asleep
        );
        // Memory outside the tag is untouched.
        other.fill_pattern(4).unwrap();
        assert_eq!(other.count_pattern_mismatches(4).unwrap(), 0);
        // A capture under way refuses a wake (mapping is forbidden then); after it, it works.
        let s2 = rt.create_stream(0).unwrap();
        let capture = rt.begin_capture(s2, None, CaptureMode::Global).unwrap();
        assert_eq!(
            rt.wake_up(&["weights"], cudalloc::WakeOptions::default())
                .unwrap_err()
                .kind(),
            ErrorKind::StreamCapture
        );
        drop(capture.end().unwrap());
        rt.wake_up(&["weights"], cudalloc::WakeOptions::default())
            .unwrap();
        assert_eq!(mismatches(&weights, 3), vec![0], "{}", b.name);
        // And a capture refuses a sleep, leaving the tag awake.
        let capture = rt.begin_capture(s2, None, CaptureMode::Global).unwrap();
        assert_eq!(
            rt.sleep(&["weights"], &[]).unwrap_err().kind(),
            ErrorKind::StreamCapture
        );
        drop(capture.end().unwrap());
        assert!(!rt.is_asleep("weights").unwrap());
        assert_eq!(mismatches(&weights, 3), vec![0]);
    }
}

#[test]
fn a_hundred_cycles_leak_nothing() {
    for b in backends("a_hundred_cycles_leak_nothing") {
        let _device = device();
        let rt = runtime(&b, "");
        let weights = tagged(&rt, "weights", &[MIB, 3 * MIB], 20);
        let kv = tagged(&rt, "kv", &[2 * MIB], 30);
        let free_awake = free_memory(&rt);
        let reserved = rt.memory_reserved(0).unwrap();
        let mut host_after_first = None;
        for cycle in 0..100u64 {
            rt.sleep(&["weights"], &["kv"]).unwrap();
            assert_eq!(
                rt.memory_reserved(0).unwrap(),
                0,
                "{} cycle {cycle}",
                b.name
            );
            rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
            assert_eq!(free_memory(&rt), free_awake, "{} cycle {cycle}", b.name);
            assert_eq!(rt.memory_reserved(0).unwrap(), reserved);
            // The weights change between cycles: each sleep keeps the latest bytes.
            weights[0].fill_pattern(100 + cycle).unwrap();
            kv[0].fill_pattern(cycle).unwrap();
            let host = rt.pinned_allocator().stats();
            let held = (host.allocations.current, host.allocated_bytes.current);
            match host_after_first {
                None => host_after_first = Some(held),
                Some(first) => assert_eq!(held, first, "{} cycle {cycle}: pinned cache", b.name),
            }
        }
        assert_eq!(weights[0].count_pattern_mismatches(199).unwrap(), 0);
        assert_eq!(weights[1].count_pattern_mismatches(21).unwrap(), 0);
        drop((weights, kv));
        for tag in ["weights", "kv"] {
            rt.tag(tag).unwrap().empty_cache();
        }
        assert_eq!(rt.memory_reserved(0).unwrap(), 0, "{}", b.name);
    }
}

#[test]
fn a_captured_graph_replays_after_wake() {
    for b in backends("a_captured_graph_replays_after_wake") {
        let _device = device();
        let rt = runtime(&b, "");
        let s = rt.create_stream(0).unwrap();
        let _on = rt.set_current_stream(s).unwrap();
        let weights = tagged(&rt, "weights", &[2 * MIB], 40);
        let scratch = tagged(&rt, "scratch", &[2 * MIB], 50);
        let out = Storage::new(&rt, 0, 2 * MIB).unwrap();
        // The graph reads the weights and the scratch (discarded, then zeroed) into `out`.
        let capture = rt.begin_capture(s, None, CaptureMode::Global).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            rt.driver().copy_device_to_device(
                s,
                out.unordered_mutable_data_ptr().unwrap(),
                weights[0].unordered_data_ptr(),
                MIB,
            )
        }
        .unwrap();
        let tail = out.unordered_data_ptr().offset(MIB).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            rt.driver()
                .copy_device_to_device(s, tail, scratch[0].unordered_data_ptr(), MIB)
        }
        .unwrap();
        let graph = capture.end().unwrap();

        rt.sleep(&["weights"], &["scratch"]).unwrap();
        rt.wake_up(&[], WakeOptions::default().zero_discarded(true))
            .unwrap();
        out.fill_pattern(1).unwrap();
        graph.replay(s).unwrap();
        rt.driver().stream_synchronize(s).unwrap();
        let mut got = vec![0u8; 2 * MIB as usize];
        out.copy_to_host(
            out.runtime().current_stream(out.device()).unwrap(),
            0,
            &mut got,
        )
        .unwrap();
        let mut want = vec![0u8; MIB as usize];
        weights[0]
            .copy_to_host(
                weights[0]
                    .runtime()
                    .current_stream(weights[0].device())
                    .unwrap(),
                0,
                &mut want,
            )
            .unwrap();
        assert_eq!(
            got[..MIB as usize],
            want[..],
            "{}: the weights' bytes",
            b.name
        );
        assert!(
            got[MIB as usize..].iter().all(|&x| x == 0),
            "{}: the zeroed scratch",
            b.name
        );
    }
}

#[test]
fn lazy_clones_of_sleeping_memory() {
    for b in backends("lazy_clones_of_sleeping_memory") {
        let _device = device();
        let rt = runtime(&b, "");
        let weights = tagged(&rt, "weights", &[MIB], 60);
        let clone = weights[0].lazy_clone().unwrap();
        rt.sleep(&["weights"], &[]).unwrap();
        // The first write of the clone would copy from sleeping memory: refused, still a clone.
        let err = clone.unordered_mutable_data_ptr().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Asleep, "{}: {err}", b.name);
        assert!(clone.is_cow());
        rt.wake_up(&["weights"], cudalloc::WakeOptions::default())
            .unwrap();
        clone.fill_pattern(61).unwrap();
        assert!(!clone.is_cow());
        assert_eq!(clone.count_pattern_mismatches(61).unwrap(), 0);
        assert_eq!(
            weights[0].count_pattern_mismatches(60).unwrap(),
            0,
            "{}: the source is untouched",
            b.name
        );
        // A clone made outside the tag and materialized before the sleep is not the tag's.
        let copy = weights[0].lazy_clone().unwrap();
        copy.unordered_mutable_data_ptr().unwrap();
        rt.sleep(&[], &["weights"]).unwrap();
        assert_eq!(copy.count_pattern_mismatches(60).unwrap(), 0, "{}", b.name);
        rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    }
}

/// Counts what is registered now.
#[derive(Default)]
struct Held(Mutex<HashMap<SegmentId, Region>>);

impl Registrar for Held {
    fn name(&self) -> &str {
        "held"
    }
    fn register(&self, region: &Region) -> cudalloc::Result<()> {
        self.0.lock().unwrap().insert(region.id, *region);
        Ok(())
    }
    fn deregister(&self, region: &Region) {
        self.0.lock().unwrap().remove(&region.id);
    }
}

#[test]
fn registrars_see_the_pages_go_and_come_back() {
    for b in backends("registrars_see_the_pages_go_and_come_back") {
        let _device = device();
        let rt = runtime(&b, "");
        let held = Arc::new(Held::default());
        rt.attach_registrar(held.clone(), Default::default())
            .unwrap();
        let weights = tagged(&rt, "weights", &[3 * PAGE], 70);
        let regions = weights[0].registered_regions().unwrap();
        assert_eq!(regions.len(), 3, "{}: one region per page", b.name);
        let pages = held.0.lock().unwrap().len();
        rt.sleep(&["weights"], &[]).unwrap();
        assert_eq!(held.0.lock().unwrap().len(), 0, "{}: deregistered", b.name);
        assert_eq!(
            weights[0].registered_regions().unwrap_err().kind(),
            ErrorKind::Asleep
        );
        rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
        assert_eq!(
            held.0.lock().unwrap().len(),
            pages,
            "{}: registered again",
            b.name
        );
        let again = weights[0].registered_regions().unwrap();
        assert_eq!(again.len(), 3);
        assert_ne!(
            again[0].region.id, regions[0].region.id,
            "{}: new regions",
            b.name
        );
    }
}

#[test]
fn a_tag_spans_devices() {
    let _device = device();
    if cuda_suite() {
        println!("skipped: the CUDA run has one device");
        return;
    }
    let rt = checked_allocator(Arc::new(host_driver()), "");
    let on = |device: usize, seed: u64| {
        let _in = rt.use_tag("weights", device).unwrap();
        let s = Storage::new(&rt, device, 3 * MIB).unwrap();
        s.fill_pattern(seed).unwrap();
        s
    };
    let (a, b) = (on(0, 1), on(1, 2));
    let report = rt.sleep(&["weights"], &[]).unwrap();
    assert_eq!(
        rt.memory_reserved(0).unwrap() + rt.memory_reserved(1).unwrap(),
        0
    );
    assert_eq!(report.released_bytes, 2 * 2 * PAGE);
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    assert_eq!(a.count_pattern_mismatches(1).unwrap(), 0);
    assert_eq!(b.count_pattern_mismatches(2).unwrap(), 0);
}

/// A host runtime checked (or not) by the sanitizer, with a tag "weights" of one storage filled
/// with `seed`, asleep; and the error of a raw memset on that storage's address meanwhile.
fn raw_work_while_asleep(
    sanitize: Sanitize,
    seed: u64,
) -> (Arc<Runtime>, Storage, cudalloc::Error) {
    let host: Arc<dyn Driver> = Arc::new(host_driver());
    let rt = Arc::new(
        Runtime::builder()
            .sanitize(sanitize)
            .check_invariants(true)
            .build(host)
            .unwrap(),
    );
    let weights = tagged(&rt, "weights", &[MIB], seed).remove(0);
    let stream = rt.current_stream(0).unwrap();
    rt.sleep(&["weights"], &[]).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let err = unsafe {
        rt.driver()
            .memset(stream, weights.unordered_data_ptr(), 0, 64)
    }
    .unwrap_err();
    (rt, weights, err)
}

#[test]
fn the_sanitizer_reports_work_on_sleeping_memory() {
    let _device = device();
    if cuda_suite() {
        // The same path as on the host backend: the check is the sanitizer's, before the driver.
        println!("skipped on the CUDA run: backend-independent (run on the host backend)");
        return;
    }
    // Not in panic mode, whatever the environment says: an access while asleep is refused, and
    // never panics anyway.
    let (rt, weights, err) = raw_work_while_asleep(Sanitize::On(SanitizeOptions::default()), 80);
    assert_eq!(err.kind(), ErrorKind::Asleep, "{err}");
    let sanitizer = rt.driver().sanitizer().unwrap();
    let reports = sanitizer.reports();
    assert!(
        reports
            .iter()
            .any(|r| r.kind == HazardKind::AccessWhileAsleep),
        "{reports:?}"
    );
    // The stream is not failed: work elsewhere goes on.
    let other = Storage::new(&rt, 0, MIB).unwrap();
    other.fill_pattern(1).unwrap();
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    assert_eq!(weights.count_pattern_mismatches(80).unwrap(), 0);
    // After the wake the same call is fine.
    let stream = rt.current_stream(0).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        rt.driver()
            .memset(stream, weights.unordered_data_ptr(), 0, 64)
    }
    .unwrap();
}

#[test]
fn without_the_sanitizer_the_host_backend_refuses_sleeping_addresses() {
    let _device = device();
    if cuda_suite() {
        println!("skipped on the CUDA run: a GPU faults on an unmapped address (as vLLM's does)");
        return;
    }
    // A raw driver call on the address: a typed error, not a SIGBUS.
    let (rt, weights, err) = raw_work_while_asleep(Sanitize::Off, 90);
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    assert_eq!(weights.count_pattern_mismatches(90).unwrap(), 0);
}

/// Two threads allocate into a tag (served, or refused while it sleeps), free at random and
/// empty the tag's cache, on streams of their own, while this thread puts the tag to sleep and
/// wakes it 30 times; the invariant scanner runs after every change. Under the sanitizer this
/// found the offload copy of a block freed between the listing and the copy (the copies are now
/// enqueued under the shard's lock).
#[test]
fn allocations_frees_and_empty_cache_racing_sleeps() {
    for b in backends("allocations_frees_and_empty_cache_racing_sleeps") {
        let _device = device();
        let rt = runtime(&b, "");
        let warm = tagged(&rt, "weights", &[MIB], 0);
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let (rt, stop) = (rt.clone(), stop.clone());
                std::thread::spawn(move || {
                    let s = rt.create_stream(0).unwrap();
                    let _on = rt.set_current_stream(s).unwrap();
                    let _in = rt.use_tag("weights", 0).unwrap();
                    let mut held: Vec<Storage> = Vec::new();
                    let (mut served, mut refused) = (0u64, 0u64);
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) || n < 50 {
                        n += 1;
                        if n.is_multiple_of(7) {
                            rt.tag("weights").unwrap().empty_cache();
                        }
                        match Storage::new(&rt, 0, 4096 * (1 + (n * 37 + t) % 700)) {
                            Ok(st) => {
                                served += 1;
                                held.push(st);
                            }
                            Err(err) => {
                                assert_eq!(err.kind(), ErrorKind::Asleep, "{err}");
                                refused += 1;
                                std::thread::yield_now();
                            }
                        }
                        if held.len() > 12 {
                            held.remove((n as usize) % held.len());
                        }
                    }
                    (held, served, refused)
                })
            })
            .collect();
        for _ in 0..30 {
            rt.sleep(&["weights"], &[]).unwrap();
            rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        for w in workers {
            let (held, served, refused) = w.join().unwrap();
            println!("{}: {served} served, {refused} refused", b.name);
            // Every block still held is mapped: written and read back whole.
            for (i, s) in held.iter().enumerate() {
                s.fill_pattern(i as u64).unwrap();
                assert_eq!(
                    s.count_pattern_mismatches(i as u64).unwrap(),
                    0,
                    "{}",
                    b.name
                );
            }
        }
        drop(warm);
        rt.tag("weights").unwrap().empty_cache();
        assert_eq!(rt.memory_reserved(0).unwrap(), 0, "{}", b.name);
    }
}

const CHILD: &str = "sleep_child";

#[test]
fn memory_a_consumer_holds_keeps_its_tag_awake_until_the_consumer_is_gone() {
    let _device = device();
    let rt = checked_allocator(test_driver(), "");
    let shared = tagged(&rt, "weights", &[3 * MIB], 100);
    let plain = Storage::new(&rt, 0, MIB).unwrap();
    plain.fill_pattern(101).unwrap();
    let mut child = ChildProcess::spawn(CHILD, "hold", test_backend());
    child.send(&format!(
        "{} {}",
        offer_word(&shared[0], 100),
        offer_word(&plain, 101)
    ));
    assert_eq!(child.recv(), "mismatches=0,0");
    let err = rt.sleep(&["weights"], &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Asleep, "{err}");
    assert!(
        err.to_string().contains("shared with other processes"),
        "{err}"
    );
    assert!(
        !rt.is_asleep("weights").unwrap(),
        "refused whole: still awake"
    );
    assert_eq!(shared[0].count_pattern_mismatches(100).unwrap(), 0);
    // The consumer dies holding both; the default pool's storage can go to limbo meanwhile.
    child.kill();
    drop(plain);
    assert_eq!(rt.ipc_collect().from_dead_consumers, 1);
    // Nobody counts on the tag's storage any more: it sleeps, and wakes with its bytes.
    rt.sleep(&["weights"], &[]).unwrap();
    assert_eq!(tag_reserved(&rt, "weights"), 0);
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    assert_eq!(shared[0].count_pattern_mismatches(100).unwrap(), 0);
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn sleep_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    assert_eq!(role, "hold");
    let rt = Arc::new(Runtime::new(child_test_driver(), Default::default()).unwrap());
    let mut parent = ParentLink::new();
    let line = parent.recv();
    let held: Vec<(Storage, u64)> = line
        .split(' ')
        .map(|word| open_offered(&rt, word).unwrap())
        .collect();
    let bad: Vec<String> = held
        .iter()
        .map(|(s, seed)| s.count_pattern_mismatches(*seed).unwrap().to_string())
        .collect();
    parent.send(&format!("mismatches={}", bad.join(",")));
    // Held until killed.
    let _ = parent.recv_or_eof();
}

#[test]
fn a_host_driver_without_pinned_budget_fails_offload_and_stays_awake() {
    let _device = device();
    if cuda_suite() {
        println!("skipped on the CUDA run: the pinned budget is the host backend's");
        return;
    }
    let host: Arc<dyn Driver> = Arc::new(
        HostDriver::builder()
            .devices(1)
            .memory_per_device(64 << 20)
            .pinned_memory(MIB)
            .build()
            .unwrap(),
    );
    let rt = checked_allocator(host, "");
    let weights = tagged(&rt, "weights", &[4 * MIB], 110);
    let err = rt.sleep(&["weights"], &[]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert!(!rt.is_asleep("weights").unwrap());
    assert_eq!(weights[0].count_pattern_mismatches(110).unwrap(), 0);
    // Discarding needs no host memory.
    rt.sleep(&[], &["weights"]).unwrap();
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    let fresh = tagged(&rt, "weights", &[MIB], 111);
    assert_eq!(mismatches(&fresh, 111), vec![0]);
}

#[test]
fn a_forked_child_neither_sleeps_nor_wakes_its_parents_tags() {
    let _device = device();
    let rt = checked_allocator(test_driver(), "");
    let weights = tagged(&rt, "weights", &[MIB], 120);
    let child_rt = rt.clone();
    let verdict = common::forked::in_forked_child(move || {
        let slept = child_rt.sleep(&["weights"], &[]).unwrap_err();
        let woken = child_rt
            .wake_up(&["weights"], cudalloc::WakeOptions::default())
            .unwrap_err();
        for err in [slept, woken] {
            if err.kind() != ErrorKind::ForkedChild {
                return Err(format!("in a forked child: {err}"));
            }
        }
        Ok(())
    });
    verdict.unwrap();
    assert!(!rt.is_asleep("weights").unwrap());
    rt.sleep(&["weights"], &[]).unwrap();
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    assert_eq!(mismatches(&weights, 120), vec![0]);
}

/// A graph captured into a tag's pool (its temporaries are the tag's): the free blocks the graph
/// keeps for its replays are not given back by the sleep — only unmapped and mapped back with
/// the rest — so a replay after the wake finds its temporaries' pages mapped.
#[test]
fn a_graph_captured_into_a_tag_replays_after_wake() {
    for b in backends("a_graph_captured_into_a_tag_replays_after_wake") {
        let _device = device();
        let rt = runtime(&b, "");
        let s = rt.create_stream(0).unwrap();
        let _on = rt.set_current_stream(s).unwrap();
        let pool = rt.tag("graph").unwrap();
        let src = Storage::new(&rt, 0, 2 * MIB).unwrap();
        src.fill_pattern(5).unwrap();
        let out = Storage::new(&rt, 0, 2 * MIB).unwrap();
        let capture = rt
            .begin_capture(s, Some(&pool), CaptureMode::Global)
            .unwrap();
        {
            // A temporary of the graph, freed inside the capture: its block stays the graph's.
            let tmp = Storage::new(&rt, 0, 4 * MIB).unwrap();
            let d = rt.driver();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                d.copy_device_to_device(
                    s,
                    tmp.unordered_mutable_data_ptr().unwrap(),
                    src.unordered_data_ptr(),
                    2 * MIB,
                )
            }
            .unwrap();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                d.copy_device_to_device(
                    s,
                    out.unordered_mutable_data_ptr().unwrap(),
                    tmp.unordered_data_ptr(),
                    2 * MIB,
                )
            }
            .unwrap();
        }
        let graph = capture.end().unwrap();
        rt.sleep(&[], &["graph"]).unwrap();
        assert_eq!(tag_reserved(&rt, "graph"), 0, "{}", b.name);
        rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
        out.fill_pattern(1).unwrap();
        graph.replay(s).unwrap();
        rt.driver().stream_synchronize(s).unwrap();
        assert_eq!(out.count_pattern_mismatches(5).unwrap(), 0, "{}", b.name);
    }
}
