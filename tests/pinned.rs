//! The pinned host allocator (`src/pinned/`): ports of PyTorch's pinned-memory tests
//! (`test_caching_pinned_memory`, `_multi_gpu`, `test_pinned_memory_with_cudaregister` and its
//! multithreaded form, `test_pinned_memory_empty_cache`, `test_host_memory_stats`), and where
//! pinned memory meets the rest: streams, COW, IPC, threads, the sanitizer, out of memory,
//! `RLIMIT_MEMLOCK`, a forked child. Runs on the host backend, and on the CUDA backend in a CUDA
//! run (the contract double in CI).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cudalloc::backend::capability::PinnedHost;
use std::sync::Arc;

use common::{backends, checked_allocator, hold_stream, TestBackend};
use cudalloc::{
    backend::Driver, backend::HostDriver, backend::SanitizedDriver, pinned::PinnedAllocator,
    pinned::PinnedOptions, sanitizer::HazardKind, sanitizer::SanitizeOptions, DeviceAddr,
    ErrorKind, Runtime, Storage,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn runtime(b: &TestBackend, conf: &str) -> Arc<Runtime> {
    checked_allocator(b.driver.clone(), conf)
}

/// The storage's first `len` bytes, read back synchronously.
fn read_back(s: &Storage, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    s.copy_to_host(s.runtime().current_stream(s.device()).unwrap(), 0, &mut out)
        .unwrap();
    out
}

/// PyTorch's check that a pinned block is not reused while a copy on `device` still reads it:
/// `t` (holding `[1, 0, 0, 0]`) is copied on a held stream and dropped; a new buffer must get
/// other memory, and the copy must see the original bytes. Returns a buffer allocated meanwhile.
fn not_reused_while_read(
    b: &TestBackend,
    rt: &Arc<Runtime>,
    t: cudalloc::pinned::PinnedBuffer,
    device: usize,
) -> cudalloc::pinned::PinnedBuffer {
    let ptr = t.addr();
    let stream = rt.create_stream(device).unwrap();
    let gpu = Storage::new_on(rt, stream, 4).unwrap();
    let hold = hold_stream(b, stream);
    gpu.copy_from_pinned(stream, 0, &t, 0, 4).unwrap();
    drop(t);
    let t2 = rt.pinned(4).unwrap();
    if hold.still_held() {
        assert_ne!(t2.addr(), ptr, "{}: allocation re-used too soon", b.name);
    } else {
        println!(
            "{}: the hold ran out before the check; reuse not judged",
            b.name
        );
    }
    drop(hold);
    rt.driver().stream_synchronize(stream).unwrap();
    assert_eq!(read_back(&gpu, 4), [1, 0, 0, 0], "{}", b.name);
    t2
}

#[test]
fn test_caching_pinned_memory() {
    for b in backends("test_caching_pinned_memory") {
        let _device = common::device_shared();
        let rt = runtime(&b, "");
        // Allocations are reused after deletion.
        let mut t = rt.pinned(4).unwrap();
        t.as_mut_slice().unwrap().copy_from_slice(&[1, 0, 0, 0]);
        let ptr = t.addr();
        drop(t);
        let mut t = rt.pinned(4).unwrap();
        assert_eq!(t.addr(), ptr, "{}: allocation not reused", b.name);
        t.as_mut_slice().unwrap().copy_from_slice(&[1, 0, 0, 0]);
        // Not reused while a copy still reads it.
        let t2 = not_reused_while_read(&b, &rt, t, 0);
        // Once the copy completed, the first block is cached again: no third one is made.
        drop(t2);
        let (t3, t4) = (rt.pinned(4).unwrap(), rt.pinned(4).unwrap());
        assert!(t3.addr() == ptr || t4.addr() == ptr, "{}", b.name);
        assert_eq!(
            rt.pinned_allocator().stats().allocations.current,
            2,
            "{}",
            b.name
        );
        drop((t3, t4));
        rt.pinned_allocator().check_invariants().unwrap();
    }
}

#[test]
fn test_caching_pinned_memory_multi_gpu() {
    for b in backends("test_caching_pinned_memory_multi_gpu") {
        if b.driver.device_count() < 2 {
            println!(
                "test_caching_pinned_memory_multi_gpu [{}]: skipped: one device",
                b.name
            );
            continue;
        }
        let rt = runtime(&b, "");
        let mut t = rt.pinned(4).unwrap();
        t.as_mut_slice().unwrap().copy_from_slice(&[1, 0, 0, 0]);
        drop(not_reused_while_read(&b, &rt, t, 1));
    }
}

const REGISTER: &str = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8";

fn pinned_with_register(b: &TestBackend, rt: &Arc<Runtime>, sizes: &[u64]) {
    assert!(rt.pinned_allocator().options().use_host_register);
    for &len in sizes {
        let mut t = rt.pinned(len).unwrap();
        let bytes = t.as_mut_slice().unwrap();
        bytes.fill(7);
        let stream = rt.default_stream(0).unwrap();
        let gpu = Storage::new_on(rt, stream, len).unwrap();
        gpu.copy_from_pinned(stream, 0, &t, 0, len).unwrap();
        let mut back = rt.pinned(len).unwrap();
        gpu.copy_to_pinned(stream, 0, &mut back, 0, len).unwrap();
        assert!(
            back.as_slice().unwrap().iter().all(|&x| x == 7),
            "{}",
            b.name
        );
    }
}

#[test]
fn test_pinned_memory_with_cudaregister() {
    for b in backends("test_pinned_memory_with_cudaregister") {
        let _device = common::device_shared();
        pinned_with_register(&b, &runtime(&b, REGISTER), &[2 * MIB, 16 * MIB]);
    }
}

#[test]
fn test_pinned_memory_with_cudaregister_multithread() {
    for b in backends("test_pinned_memory_with_cudaregister_multithread") {
        let _device = common::device_shared();
        let rt = runtime(&b, REGISTER);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| pinned_with_register(&b, &rt, &[2 * MIB, 4 * MIB]));
            }
        });
    }
}

#[test]
fn test_pinned_memory_empty_cache() {
    for b in backends("test_pinned_memory_empty_cache") {
        let _device = common::device_shared();
        for register in [true, false] {
            let rt = runtime(&b, &format!("pinned_use_cuda_host_register:{register}"));
            let host = rt.pinned_allocator();
            let t = rt.pinned(4 * MIB).unwrap();
            drop(t);
            assert_eq!(host.stats().allocations.current, 1);
            let released = host.empty_cache().unwrap();
            assert_eq!(released, 4 * MIB, "{}", b.name);
            let stats = host.stats();
            assert_eq!(stats.allocations.current, 0);
            assert_eq!(stats.num_host_free, 1);
            if let Some(h) = &b.host {
                assert_eq!(
                    h.pinned_bytes(),
                    0,
                    "nothing stays locked after empty_cache"
                );
            }
        }
    }
}

#[test]
fn test_host_memory_stats() {
    for b in backends("test_host_memory_stats") {
        let _device = common::device_shared();
        let rt = runtime(&b, "");
        let host = rt.pinned_allocator();
        let mut expected = std::collections::BTreeMap::<String, i64>::new();
        let check = |expected: &std::collections::BTreeMap<String, i64>| {
            let stats = host.stats().to_map();
            for (k, v) in expected {
                assert_eq!(stats[k], *v, "{}: {k}", b.name);
            }
        };
        for k in [
            "allocated_bytes",
            "allocations",
            "active_bytes",
            "active_requests",
        ] {
            for s in ["allocated", "current", "freed", "peak"] {
                expected.insert(format!("{k}.{s}"), 0);
            }
        }
        for k in [
            "host_alloc_time.count",
            "host_free_time.count",
            "num_host_alloc",
            "num_host_free",
        ] {
            expected.insert(k.into(), 0);
        }
        host.empty_cache().unwrap();
        check(&expected);
        // 10 Ki floats (40 KiB) round to 64 KiB; 20 Ki floats (80 KiB) to 128 KiB.
        let mut held = Vec::new();
        for (floats, aligned) in [(10 * KIB, 16 * KIB), (20 * KIB, 32 * KIB)] {
            held.push(rt.pinned(floats * 4).unwrap());
            for prefix in ["active_requests", "allocations"] {
                for suffix in ["allocated", "current", "peak"] {
                    *expected.get_mut(&format!("{prefix}.{suffix}")).unwrap() += 1;
                }
            }
            for prefix in ["allocated_bytes", "active_bytes"] {
                for suffix in ["allocated", "current", "peak"] {
                    *expected.get_mut(&format!("{prefix}.{suffix}")).unwrap() +=
                        (aligned * 4) as i64;
                }
            }
            *expected.get_mut("num_host_alloc").unwrap() += 1;
            *expected.get_mut("host_alloc_time.count").unwrap() += 1;
            check(&expected);
        }
        // Emptying the cache while both are held changes nothing.
        host.empty_cache().unwrap();
        check(&expected);
        // The rest of PyTorch's keys are there too.
        let map = host.stats().to_map();
        for k in [
            "host_alloc_time.total",
            "host_alloc_time.max",
            "host_alloc_time.min",
            "host_alloc_time.avg",
        ] {
            assert!(map.contains_key(k), "{k}");
        }
        drop(held);
        host.reset_peak_stats();
        host.reset_accumulated_stats();
        let stats = host.stats();
        assert_eq!(stats.active_requests.current, 0);
        assert_eq!(stats.active_requests.peak, 0);
        assert_eq!(stats.allocations.allocated, 0);
        assert_eq!(stats.num_host_alloc, 0);
        assert_eq!(stats.allocations.current, 2, "both blocks stay cached");
    }
}

#[test]
fn natural_code_needs_no_synchronize() {
    // Fill a buffer, copy it to the device, fill it again at once, copy again: each copy sees
    // the bytes written before it (the host borrow waits for the first copy).
    for b in backends("natural_code_needs_no_synchronize") {
        let _device = common::device_shared();
        let rt = runtime(&b, "");
        let stream = rt.create_stream(0).unwrap();
        let len = 4 * MIB;
        let (a, c) = (
            Storage::new_on(&rt, stream, len).unwrap(),
            Storage::new_on(&rt, stream, len).unwrap(),
        );
        let mut buf = rt.pinned(len).unwrap();
        buf.as_mut_slice().unwrap().fill(1);
        a.copy_from_pinned(stream, 0, &buf, 0, len).unwrap();
        buf.as_mut_slice().unwrap().fill(2);
        c.copy_from_pinned(stream, 0, &buf, 0, len).unwrap();
        // And back: the read borrow waits for the copy into the buffer.
        let mut out = rt.pinned(len).unwrap();
        a.copy_to_pinned(stream, 0, &mut out, 0, len).unwrap();
        assert!(
            out.as_slice().unwrap().iter().all(|&x| x == 1),
            "{}",
            b.name
        );
        c.copy_to_pinned(stream, 0, &mut out, 0, len).unwrap();
        assert!(
            out.as_slice().unwrap().iter().all(|&x| x == 2),
            "{}",
            b.name
        );
    }
}

#[test]
fn copying_a_lazy_clone_to_pinned_memory_reads_it() {
    for b in backends("copying_a_lazy_clone_to_pinned_memory_reads_it") {
        let _device = common::device_shared();
        let rt = runtime(&b, "");
        let stream = rt.default_stream(0).unwrap();
        let len = MIB;
        let s = Storage::new(&rt, 0, len).unwrap();
        s.copy_from_host(
            s.runtime().current_stream(s.device()).unwrap(),
            0,
            &vec![9u8; len as usize],
        )
        .unwrap();
        let clone = s.lazy_clone().unwrap();
        let mut buf = rt.pinned(len).unwrap();
        clone.copy_to_pinned(stream, 0, &mut buf, 0, len).unwrap();
        assert!(
            clone.is_cow() && s.is_cow(),
            "{}: a read materialized",
            b.name
        );
        assert!(buf.as_slice().unwrap().iter().all(|&x| x == 9));
        // A copy into the clone writes: it is materialized, the original keeps its bytes.
        buf.as_mut_slice().unwrap().fill(3);
        clone.copy_from_pinned(stream, 0, &buf, 0, len).unwrap();
        assert!(!clone.is_cow(), "{}", b.name);
        assert!(read_back(&clone, len).iter().all(|&x| x == 3));
        assert!(read_back(&s, len).iter().all(|&x| x == 9));
    }
}

#[test]
fn pinned_memory_is_not_shared_across_processes() {
    for b in backends("pinned_memory_is_not_shared_across_processes") {
        let _device = common::device_shared();
        let rt = runtime(&b, "");
        let buf = rt.pinned(MIB).unwrap();
        let err = rt
            .driver()
            .ipc()
            .ipc_export_memory(DeviceAddr(buf.addr().0))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}", b.name);
        if b.host.is_some() {
            assert!(err.to_string().contains("page-locked host memory"), "{err}");
        }
    }
}

#[test]
fn copies_check_their_ranges() {
    for b in backends("copies_check_their_ranges") {
        let _device = common::device_shared();
        let rt = runtime(&b, "");
        let stream = rt.default_stream(0).unwrap();
        let s = Storage::new(&rt, 0, 4096).unwrap();
        let mut buf = rt.pinned(4096).unwrap();
        let kind = |r: cudalloc::Result<()>| r.unwrap_err().kind();
        assert_eq!(
            kind(s.copy_to_pinned(stream, 1, &mut buf, 0, 4096)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(s.copy_to_pinned(stream, 0, &mut buf, 1, 4096)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(s.copy_from_pinned(stream, u64::MAX, &buf, 0, 2)),
            ErrorKind::InvalidArgument
        );
        // Pageable memory is not accepted by the async copies.
        let pageable = vec![0u8; 4096];
        let host = cudalloc::backend::HostAddr(pageable.as_ptr() as u64);
        // SAFETY: refused before anything is enqueued (the range is not page-locked).
        let refused = unsafe {
            rt.driver()
                .pinned()
                .copy_pinned_to_device(stream, s.unordered_data_ptr(), host, 4096)
        };
        let err = refused.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}", b.name);
        assert!(err.to_string().contains("page-locked"), "{err}");
    }
}

#[test]
fn many_threads_and_streams() {
    for b in backends("many_threads_and_streams") {
        let _device = common::device_shared();
        let rt = runtime(&b, "");
        let streams: Vec<cudalloc::StreamId> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..4u8)
                .map(|t| {
                    let rt = &rt;
                    scope.spawn(move || {
                        let stream = rt.create_stream(0).unwrap();
                        for i in 0..40usize {
                            let len = 1 + (i as u64 * 977 + t as u64 * 131) % (256 * KIB);
                            let value = t.wrapping_mul(31).wrapping_add(i as u8);
                            let mut buf = rt.pinned(len).unwrap();
                            buf.as_mut_slice().unwrap().fill(value);
                            let s = Storage::new_on(rt, stream, len).unwrap();
                            s.copy_from_pinned(stream, 0, &buf, 0, len).unwrap();
                            drop(buf);
                            let mut back = rt.pinned(len).unwrap();
                            s.copy_to_pinned(stream, 0, &mut back, 0, len).unwrap();
                            assert!(back.as_slice().unwrap().iter().all(|&x| x == value));
                        }
                        stream
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let host = rt.pinned_allocator();
        host.process_events();
        host.check_invariants().unwrap();
        for stream in streams {
            rt.driver().stream_synchronize(stream).unwrap();
        }
        host.process_events();
        assert_eq!(host.stats().active_requests.current, 0, "{}", b.name);
        host.empty_cache().unwrap();
        assert_eq!(host.stats().allocations.current, 0);
        if let Some(h) = &b.host {
            assert_eq!(h.pinned_bytes(), 0);
        }
    }
}

/// A host driver with its own sanitizer that reports (does not panic).
fn reporting() -> (Arc<HostDriver>, Arc<dyn Driver>, Arc<Runtime>) {
    let host = Arc::new(common::host_driver());
    let driver = SanitizedDriver::wrap(host.clone(), SanitizeOptions::report());
    let rt = Arc::new(
        Runtime::builder()
            .sanitize(cudalloc::sanitizer::Sanitize::Off)
            .build(driver.clone())
            .unwrap(),
    );
    (host, driver, rt)
}

#[test]
fn sanitizer_reports_a_block_reused_while_a_copy_reads_it() {
    let (host, driver, rt) = reporting();
    let sanitizer = driver.sanitizer().unwrap();
    let stream = rt.create_stream(0).unwrap();
    let s = Storage::new_on(&rt, stream, 4096).unwrap();
    let buf = rt.pinned(4096).unwrap();
    let addr = buf.addr();
    let gate = host.gate_stream(stream).unwrap();
    // A copy the buffer does not know of (a raw driver call, as a library's own launch).
    // SAFETY: nothing borrows the buffer (or its block's next owner) while the copy may run.
    let copied = unsafe {
        driver
            .pinned()
            .copy_pinned_to_device(stream, s.unordered_data_ptr(), addr, 4096)
    };
    copied.unwrap();
    drop(buf);
    let again = rt.pinned(4096).unwrap();
    assert_eq!(again.addr(), addr, "nothing told the allocator to wait");
    let reports = sanitizer.take_reports();
    assert!(
        reports.iter().any(|r| r.kind == HazardKind::UseAfterFree),
        "the reuse was not reported: {reports:?}"
    );
    drop(gate);
    rt.driver().stream_synchronize(stream).unwrap();
}

#[test]
fn sanitizer_reports_a_host_borrow_racing_a_copy() {
    let (host, driver, rt) = reporting();
    let sanitizer = driver.sanitizer().unwrap();
    let stream = rt.create_stream(0).unwrap();
    let s = Storage::new_on(&rt, stream, 4096).unwrap();
    let buf = rt.pinned(4096).unwrap();
    let gate = host.gate_stream(stream).unwrap();
    // SAFETY: the only borrow tried while the copy may run is the one the sanitizer refuses.
    let copied = unsafe {
        driver
            .pinned()
            .copy_device_to_pinned(stream, buf.addr(), s.unordered_data_ptr(), 4096)
    };
    copied.unwrap();
    let err = buf.as_slice().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
    assert!(sanitizer
        .reports()
        .iter()
        .any(|r| r.kind == HazardKind::Race));
    drop(gate);
    rt.driver().stream_synchronize(stream).unwrap();
}

#[test]
fn sanitizer_is_quiet_on_tracked_copies() {
    let (_host, driver, rt) = reporting();
    let sanitizer = driver.sanitizer().unwrap();
    let stream = rt.create_stream(0).unwrap();
    let other = rt.create_stream(0).unwrap();
    let s = Storage::new_on(&rt, stream, 8192).unwrap();
    for round in 0..20u8 {
        let mut buf = rt.pinned(8192).unwrap();
        buf.as_mut_slice().unwrap().fill(round);
        let on = if round % 2 == 0 { stream } else { other };
        if on == other {
            rt.driver().stream_wait_stream(other, stream).unwrap();
        }
        s.copy_from_pinned(on, 0, &buf, 0, 8192).unwrap();
        buf.as_mut_slice().unwrap().fill(0);
        s.copy_to_pinned(on, 0, &mut buf, 0, 8192).unwrap();
        assert!(buf.as_slice().unwrap().iter().all(|&x| x == round));
        if on == other {
            rt.driver().stream_wait_stream(stream, other).unwrap();
        }
    }
    assert_eq!(sanitizer.take_reports(), Vec::new());
}

#[test]
fn out_of_memory_empties_the_cache_then_says_what_it_holds() {
    let host = Arc::new(HostDriver::builder().pinned_memory(MIB).build().unwrap());
    let alloc = PinnedAllocator::with_invariant_checks(host.clone(), PinnedOptions::default());
    let a = alloc.allocate(512 * KIB).unwrap();
    let b = alloc.allocate(512 * KIB).unwrap();
    let err = alloc.allocate(256 * KIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert!(err.to_string().contains("holds 1048576 bytes"), "{err}");
    drop(a);
    // The cached 512 KiB goes back to the driver, then 256 KiB fits.
    let c = alloc.allocate(256 * KIB).unwrap();
    assert_eq!(alloc.stats().num_host_free, 1);
    assert_eq!(host.pinned_bytes(), 768 * KIB);
    drop((b, c));
}

#[test]
fn host_register_contract() {
    let host = common::host_driver();
    let mut memory = vec![0u8; 4 * 4096];
    let page = (memory.as_mut_ptr() as u64 + 4095) & !4095;
    let base = cudalloc::backend::HostAddr(page);
    // SAFETY: `memory` outlives every registration (each is ended below).
    unsafe { host.host_register(base, 4096).unwrap() };
    // SAFETY: as above.
    let overlap = unsafe { host.host_register(base.offset(100).unwrap(), 10) }.unwrap_err();
    assert!(overlap.to_string().contains("overlaps"), "{overlap}");
    // SAFETY: as above; nothing references the memory.
    let wrong = unsafe { host.host_free(base) }.unwrap_err();
    assert_eq!(
        wrong.kind(),
        ErrorKind::InvalidArgument,
        "registered memory is unregistered"
    );
    // SAFETY: as above.
    unsafe { host.host_unregister(base).unwrap() };
    assert_eq!(host.pinned_bytes(), 0);
    // Two registrations in one page: the page stays locked (and counted) until both are gone.
    // SAFETY: as above.
    unsafe {
        host.host_register(base, 100).unwrap();
        host.host_register(base.offset(200).unwrap(), 100).unwrap();
    }
    assert_eq!(host.pinned_bytes(), 4096);
    // SAFETY: as above.
    unsafe { host.host_unregister(base).unwrap() };
    assert_eq!(
        host.pinned_bytes(),
        4096,
        "the page is still locked for the second"
    );
    // SAFETY: as above.
    unsafe { host.host_register(base, 100).unwrap() };
    assert_eq!(host.pinned_bytes(), 4096);
    // SAFETY: as above.
    unsafe {
        host.host_unregister(base.offset(200).unwrap()).unwrap();
        host.host_unregister(base).unwrap();
    }
    assert_eq!(host.pinned_bytes(), 0);
    // SAFETY: as above.
    let again = unsafe { host.host_unregister(base) };
    assert!(again.is_err());
    drop(memory);
}

/// `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`: an error that names the limit (in a child process,
/// which drops the capability and lowers the limit for itself).
#[test]
fn memlock_limit_is_reported() {
    let out = common::child_command("memlock_child", "memlock")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("RLIMIT_MEMLOCK"), "{text}");
}

#[test]
#[ignore = "a child role of memlock_limit_is_reported"]
fn memlock_child() {
    if std::env::var(common::ROLE_VAR).as_deref() != Ok("memlock") {
        return;
    }
    use rustix::process::{setrlimit, Resource, Rlimit};
    use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
    let mut caps = capabilities(None).unwrap();
    caps.effective.remove(CapabilitySet::IPC_LOCK);
    caps.permitted.remove(CapabilitySet::IPC_LOCK);
    set_capabilities(None, caps).unwrap();
    setrlimit(
        Resource::Memlock,
        Rlimit {
            current: Some(1 << 20),
            maximum: Some(1 << 20),
        },
    )
    .unwrap();
    let host = HostDriver::builder().build().unwrap();
    let err = host.host_alloc(4 << 20).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    println!("{err}");
}

#[test]
fn a_forked_child_cannot_allocate() {
    if !common::forked::alone("a_forked_child_cannot_allocate") {
        return; // it forks: run alone, in a re-executed test binary
    }
    let rt = checked_allocator(Arc::new(common::host_driver()), "");
    let kept = rt.pinned(4096).unwrap();
    let child_rt = rt.clone();
    let verdict = common::forked::in_forked_child(move || {
        let err = child_rt.pinned(4096).unwrap_err();
        if err.kind() != ErrorKind::ForkedChild {
            return Err(format!("allocation in a child: {err}"));
        }
        // Dropping the parent's buffer in the child touches nothing of the parent's.
        drop(kept);
        Ok(())
    });
    verdict.unwrap();
    let host = rt.pinned_allocator();
    host.check_invariants().unwrap();
    assert_eq!(
        host.stats().active_requests.current,
        0,
        "the parent's copy went back"
    );
}

#[test]
fn pinned_keys_configure_the_runtime() {
    let config = cudalloc::AllocatorConfig::parse(
        "pinned_use_host_register:True,pinned_num_register_threads:16,\
         pinned_reserve_segment_size_mb:8,pinned_use_background_threads:True",
    )
    .unwrap();
    let options = PinnedOptions::from_config(&config);
    assert!(options.use_host_register);
    assert_eq!(options.register_threads, 16);
    assert_eq!(options.reserve_segment_size, 8 << 20);
    let rt = Runtime::new(Arc::new(common::host_driver()), config).unwrap();
    assert_eq!(rt.pinned_allocator().options(), options);
    // The reserve segment is made on the first allocation and carved: one driver call.
    let (a, b) = (rt.pinned(4096).unwrap(), rt.pinned(100_000).unwrap());
    let stats = rt.pinned_allocator().stats();
    assert_eq!(stats.num_host_alloc, 1);
    assert_eq!(stats.allocations.current, 2);
    drop((a, b));
    // Carved blocks stay cached through empty_cache.
    assert_eq!(rt.pinned_allocator().empty_cache().unwrap(), 0);
    assert_eq!(rt.pinned_allocator().stats().allocations.current, 2);
}

#[test]
fn two_runtimes_share_one_driver() {
    // Each runtime has its own pinned allocator; buffers and storages of either meet on the
    // driver they share.
    for b in backends("two_runtimes_share_one_driver") {
        let _device = common::device_shared();
        let (one, two) = (runtime(&b, ""), runtime(&b, ""));
        let stream = two.default_stream(0).unwrap();
        let mut buf = one.pinned(MIB).unwrap();
        buf.as_mut_slice().unwrap().fill(5);
        let s = Storage::new_on(&two, stream, MIB).unwrap();
        s.copy_from_pinned(stream, 0, &buf, 0, MIB).unwrap();
        let mut back = two.pinned(MIB).unwrap();
        s.copy_to_pinned(stream, 0, &mut back, 0, MIB).unwrap();
        assert!(
            back.as_slice().unwrap().iter().all(|&x| x == 5),
            "{}",
            b.name
        );
        assert_eq!(one.pinned_allocator().stats().allocations.current, 1);
        assert_eq!(two.pinned_allocator().stats().allocations.current, 1);
    }
}

#[test]
fn copies_on_a_capturing_stream_are_refused() {
    let rt = checked_allocator(Arc::new(common::host_driver()), "");
    let stream = rt.create_stream(0).unwrap();
    let s = Storage::new_on(&rt, stream, 4096).unwrap();
    let buf = rt.pinned(4096).unwrap();
    rt.driver()
        .graphs()
        .stream_begin_capture(stream, cudalloc::graph::CaptureMode::ThreadLocal)
        .unwrap();
    let err = s.copy_from_pinned(stream, 0, &buf, 0, 4096).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    assert!(err.to_string().contains("pinned buffer"), "{err}");
    let graph = rt.driver().graphs().stream_end_capture(stream).unwrap();
    rt.driver().graphs().graph_destroy(graph).unwrap();
    // After the capture the same copy runs.
    s.copy_from_pinned(stream, 0, &buf, 0, 4096).unwrap();
}
