//! Ports of PyTorch's `test_cuda.py` caching-allocator tests, named after the originals, run on
//! every backend present (the host backend here; CUDA too when a GPU is there).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use cudalloc::{backend::Driver, ErrorKind, Runtime};

const MIB: u64 = 1 << 20;

fn stat(a: &Runtime, key: &str) -> i64 {
    a.memory_stats_map(0).unwrap()[key]
}

#[test]
fn test_memory_allocation() {
    for b in backends("test_memory_allocation") {
        let a = checked_allocator(b.driver.clone(), "");
        let before = stat(&a, "allocated_bytes.all.current");
        let mut live = Vec::new();
        let mut expected = 0;
        for (i, size) in [1u64, 511, 512, 513, 4096, MIB, MIB + 1, 3 * MIB, 12 * MIB]
            .into_iter()
            .enumerate()
        {
            let p = a.allocate(0, size).unwrap();
            assert_eq!(
                p.ptr().0 % 512,
                0,
                "{}: allocation {i} not 512-aligned",
                b.name
            );
            expected += size.max(512).next_multiple_of(512);
            live.push(p);
            assert_eq!(
                stat(&a, "allocated_bytes.all.current") - before,
                expected as i64,
                "{}",
                b.name
            );
        }
        assert_eq!(stat(&a, "allocation.all.current"), live.len() as i64);
        let reserved = stat(&a, "reserved_bytes.all.current");
        assert!(reserved >= expected as i64);
        drop(live);
        assert_eq!(stat(&a, "allocated_bytes.all.current"), before);
        assert_eq!(stat(&a, "allocation.all.current"), 0);
        assert_eq!(
            stat(&a, "reserved_bytes.all.current"),
            reserved,
            "freed blocks stay cached"
        );
        a.empty_cache();
        assert_eq!(stat(&a, "reserved_bytes.all.current"), 0, "{}", b.name);
        a.check_invariants().unwrap();
    }
}

#[test]
fn test_memory_stats() {
    for b in backends("test_memory_stats") {
        let a = checked_allocator(b.driver.clone(), "");
        let x = a.allocate(0, 3 * MIB).unwrap();
        let y = a.allocate(0, 1000).unwrap();
        assert_eq!(
            stat(&a, "allocated_bytes.all.current"),
            (3 * MIB + 1024) as i64
        );
        assert_eq!(
            stat(&a, "allocated_bytes.large_pool.current"),
            (3 * MIB) as i64
        );
        assert_eq!(stat(&a, "allocated_bytes.small_pool.current"), 1024);
        assert_eq!(stat(&a, "requested_bytes.small_pool.current"), 1000);
        assert_eq!(stat(&a, "segment.all.current"), 2);
        assert_eq!(stat(&a, "num_device_alloc"), 2);
        drop(x);
        let peak = stat(&a, "allocated_bytes.all.peak");
        assert_eq!(peak, (3 * MIB + 1024) as i64);
        assert_eq!(stat(&a, "allocated_bytes.all.current"), 1024);
        assert_eq!(stat(&a, "allocated_bytes.all.freed"), (3 * MIB) as i64);
        a.reset_peak_memory_stats(0).unwrap();
        assert_eq!(stat(&a, "allocated_bytes.all.peak"), 1024);
        a.reset_accumulated_memory_stats(0).unwrap();
        assert_eq!(stat(&a, "allocated_bytes.all.allocated"), 0);
        assert_eq!(stat(&a, "num_device_alloc"), 0);
        drop(y);
        // The freed large block merged back into one block. In an expandable segment it lies
        // beside unmapped address space, which makes it a split block (as PyTorch counts it).
        assert_eq!(
            stat(&a, "inactive_split.large_pool.current"),
            i64::from(expandable_run()),
            "merged back into one block"
        );
        let summary = a.memory_summary(0).unwrap();
        assert!(
            summary.contains("Allocated memory") && summary.contains("Reserved segments"),
            "{summary}"
        );
    }
}

#[test]
fn test_out_of_memory() {
    for b in backends("test_out_of_memory") {
        let a = checked_allocator(b.driver.clone(), "");
        let total = b.driver.mem_info(0).unwrap().total;
        let err = a.allocate(0, total + 5 * MIB).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory);
        let text = err.to_string();
        assert!(text.contains("tried to allocate"), "{text}");
        assert!(
            text.contains(&cudalloc::format_size(total + 5 * MIB)),
            "names the requested size: {text}"
        );
        assert!(!text.contains("expandable"), "{text}");
        assert_eq!(stat(&a, "num_ooms"), 1);
        // The 1 EB case has its own message and changes no state.
        let err = a.allocate(0, 1 << 61).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory);
        assert!(err.to_string().contains("1 EB"), "{err}");
        assert!(a.allocate(0, u64::MAX).is_err());
        // Still usable afterwards.
        let ok = a.allocate(0, MIB).unwrap();
        assert_eq!(stat(&a, "allocation.all.current"), 1);
        drop(ok);
    }
}

#[test]
fn test_out_of_memory_retry() {
    // Host backend: a 64 MiB device. Cached segments must be released to satisfy a request that
    // only fits once they are gone.
    let driver: std::sync::Arc<dyn Driver> = std::sync::Arc::new(host_driver());
    let a = checked_allocator(driver.clone(), "");
    let x = a.allocate(0, 30 * MIB).unwrap();
    let y = a.allocate(0, 20 * MIB).unwrap();
    drop(x);
    drop(y);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), (50 * MIB) as i64);
    let z = a.allocate(0, 40 * MIB).unwrap();
    if expandable_run() {
        // One expandable segment: the two freed blocks merged into 50 MiB that hold 40 MiB
        // without asking the driver — no retry, nothing released.
        assert_eq!(stat(&a, "num_alloc_retries"), 0);
        assert_eq!(stat(&a, "reserved_bytes.all.current"), (50 * MIB) as i64);
        a.empty_cache();
        assert_eq!(
            stat(&a, "reserved_bytes.all.current"),
            (40 * MIB) as i64,
            "free pages unmapped"
        );
    } else {
        assert_eq!(stat(&a, "num_alloc_retries"), 1);
        assert_eq!(stat(&a, "num_sync_all_streams"), 1);
        assert_eq!(stat(&a, "reserved_bytes.all.current"), (40 * MIB) as i64);
    }
    drop(z);
}

#[test]
fn test_set_per_process_memory_fraction() {
    for b in backends("test_set_per_process_memory_fraction") {
        let a = checked_allocator(b.driver.clone(), "");
        let total = b.driver.mem_info(0).unwrap().total;
        a.set_per_process_memory_fraction(0.5, 0).unwrap();
        assert!(a.set_per_process_memory_fraction(1.5, 0).is_err());
        let under = (total as f64 * 0.499) as u64 / MIB * MIB;
        let x = a.allocate(0, under).unwrap();
        let err = a.allocate(0, total / 10).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{}", b.name);
        assert!(
            err.to_string().contains("may use 0.5 of the device"),
            "{err}"
        );
        drop(x);
        a.empty_cache();
        a.set_per_process_memory_fraction(1.0, 0).unwrap();
    }
}

#[test]
fn test_caching_allocator_record_stream_oom() {
    // A free delayed by record_stream must still be reclaimed by the out-of-memory path: it waits
    // for the stream's events and releases the cache before giving up. Host: 64 MiB device.
    // The side stream is held by a gate until the miss path runs the free-memory callbacks, so x's
    // event is pending when the allocation first looks (no timing involved) and the path must
    // wait for it.
    let host = std::sync::Arc::new(host_driver());
    let driver: std::sync::Arc<dyn Driver> = host.clone();
    let a = checked_allocator(driver.clone(), "");
    let side = a.create_stream(0).unwrap();
    let x = a.allocate(0, 40 * MIB).unwrap();
    let gate = std::sync::Arc::new(std::sync::Mutex::new(Some(host.gate_stream(side).unwrap())));
    let opener = std::sync::Arc::clone(&gate);
    a.register_free_memory_callback(std::sync::Arc::new(move || {
        drop(opener.lock().unwrap().take());
        false
    }));
    a.record_stream(&x, side).unwrap();
    drop(x);
    assert_eq!(
        stat(&a, "active.all.current"),
        1,
        "x waits for the side stream"
    );
    let y = a.allocate(0, 40 * MIB).unwrap();
    assert!(gate.lock().unwrap().is_none(), "the callbacks ran");
    assert!(stat(&a, "num_sync_all_streams") >= 1);
    assert_eq!(stat(&a, "active.all.current"), 1);
    drop(y);
}

#[test]
fn test_record_stream() {
    // A block freed while a slow stream still reads it is not handed out again until that work is
    // done: the reader's copy sees the original bytes although a new allocation is written at once.
    for b in backends("test_record_stream") {
        let a = checked_allocator(b.driver.clone(), "");
        let d = b.driver.as_ref();
        let main = a.default_stream(0).unwrap();
        let side = a.create_stream(0).unwrap();
        let len = 4 * MIB;
        let x = a.allocate(0, len).unwrap();
        let x_addr = x.ptr();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(main, x.ptr(), len, 1) }.unwrap();
        d.stream_synchronize(main).unwrap();
        let copy = a.allocate_on(side, len).unwrap();
        let hold = hold_stream(&b, side);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.copy_device_to_device(side, copy.ptr(), x.ptr(), len) }.unwrap();
        a.record_stream(&x, side).unwrap();
        drop(x);
        // Same size on the same stream: without record_stream this would be x's block.
        let y = a.allocate(0, len).unwrap();
        if hold.still_held() {
            assert_ne!(
                y.ptr(),
                x_addr,
                "{}: a block still read by another stream was reused",
                b.name
            );
        } else {
            println!(
                "{}: the hold ran out before the check; reuse not judged",
                b.name
            );
        }
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(main, y.ptr(), len, 2) }.unwrap();
        drop(hold);
        d.stream_synchronize(side).unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                d.kernels()
                    .count_pattern_mismatches(side, copy.ptr(), len, 1)
            }
            .unwrap(),
            0,
            "{}",
            b.name
        );
        // Once the side stream is done, the block is free again and best fit returns it.
        let z = a.allocate(0, len).unwrap();
        assert_eq!(z.ptr(), x_addr, "{}", b.name);
        drop((y, z, copy));
        a.check_invariants().unwrap();
    }
}
