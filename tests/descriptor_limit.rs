//! The descriptor limit is not the device limit: the host backend keeps the pages of expandable
//! segments in a few memfds (arenas, `shm/vm.rs`), not one open descriptor per 2 MiB page. Each
//! test lowers `RLIMIT_NOFILE` in a forked child (the limit is the process's), fills a device
//! with expandable segments, and checks how far it got and how it stopped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::forked::in_forked_child;
use cudalloc::{backend::HostDriver, ErrorKind, Runtime, Storage};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const DEVICE: u64 = 1 << 30;

fn lower_descriptor_limit(to: u64) -> Result<(), String> {
    let limit = libc::rlimit {
        rlim_cur: to,
        rlim_max: to,
    };
    // SAFETY: a valid rlimit for this (forked, single-threaded) process.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(format!("setrlimit: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn expandable_runtime() -> Result<Arc<Runtime>, String> {
    let driver = HostDriver::builder()
        .devices(1)
        .memory_per_device(DEVICE)
        .build()
        .map_err(|e| e.to_string())?;
    Runtime::builder()
        .config(common::test_config("expandable_segments:True"))
        .build(Arc::new(driver))
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// Allocates 8 MiB storages until the first error: (bytes allocated, that error).
fn fill(rt: &Arc<Runtime>) -> (u64, Vec<Storage>, cudalloc::Error) {
    let mut held = Vec::new();
    loop {
        match Storage::new(rt, 0, 8 << 20) {
            Ok(s) => held.push(s),
            Err(e) => return (held.len() as u64 * (8 << 20), held, e),
        }
    }
}

#[test]
fn a_low_descriptor_limit_still_fills_the_device() {
    if !common::forked::alone("a_low_descriptor_limit_still_fills_the_device") {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let verdict = in_forked_child(|| {
        lower_descriptor_limit(64)?;
        let rt = expandable_runtime()?;
        let (bytes, held, err) = fill(&rt);
        // Before: about 38 pages (76 MiB) then a driver error (EMFILE) — one descriptor a page.
        if err.kind() != ErrorKind::OutOfMemory {
            return Err(format!("stopped at {} MiB with {err}", bytes >> 20));
        }
        if bytes < DEVICE * 9 / 10 {
            return Err(format!(
                "only {} MiB of {} MiB: {err}",
                bytes >> 20,
                DEVICE >> 20
            ));
        }
        println!(
            "a_low_descriptor_limit_still_fills_the_device: {} MiB of {} MiB with 64 descriptors",
            bytes >> 20,
            DEVICE >> 20
        );
        drop(held);
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
}

#[test]
fn running_out_of_descriptors_is_out_of_memory_saying_why() {
    if !common::forked::alone("running_out_of_descriptors_is_out_of_memory_saying_why") {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let verdict = in_forked_child(|| {
        let rt = expandable_runtime()?;
        // Leave no descriptor free: every new arena fails.
        let mut open = Vec::new();
        lower_descriptor_limit(256)?;
        while let Ok(f) = std::fs::File::open("/dev/null") {
            open.push(f);
        }
        let (bytes, held, err) = fill(&rt);
        drop(open);
        if err.kind() != ErrorKind::OutOfMemory || !err.to_string().contains("descriptor") {
            return Err(format!("after {} MiB: {err}", bytes >> 20));
        }
        drop(held);
        // With descriptors back, the same runtime allocates again.
        let s = Storage::new(&rt, 0, 8 << 20).map_err(|e| e.to_string())?;
        s.fill_pattern(1).map_err(|e| e.to_string())?;
        match s.count_pattern_mismatches(1) {
            Ok(0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(verdict, Ok(()));
}
