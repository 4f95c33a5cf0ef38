//! A full `/dev/shm` (Docker's default is 64 MiB) is out-of-memory, never a SIGBUS: the host
//! backend reserves the pages of every object when it creates it. The tests run the test binary
//! (and the `cudalloc` command) in a private mount namespace with a small tmpfs on `/dev/shm`; where
//! that cannot be set up (no privilege for `unshare -m`) they print why they are skipped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::sync::Arc;

use common::*;
use cudalloc::{backend::Driver, backend::HostDriver, ErrorKind, Runtime, Storage};

const SHM_MIB: u64 = 24;

/// `program args…` inside a private mount namespace whose /dev/shm is a `SHM_MIB` MiB tmpfs, or
/// `None` when this machine does not allow it.
fn in_small_shm(test: &str, program: &str, args: &[&str]) -> Option<std::process::Output> {
    let probe = Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg(format!("mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm"))
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            println!(
                "{test}: skipped: cannot mount a private /dev/shm ({})",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        Err(err) => {
            println!("{test}: skipped: unshare is not available ({err})");
            return None;
        }
    }
    let script = format!("mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm && exec \"$0\" \"$@\"");
    Some(
        Command::new("unshare")
            .args(["-m", "sh", "-c", &script, program])
            .args(args)
            .env(ROLE_VAR, "small_shm")
            .output()
            .unwrap(),
    )
}

/// Runs this binary's child test `child` in a small `/dev/shm` and asserts it passed and printed
/// `marker` (nothing when the machine cannot set that up: the skip line is printed).
fn child_in_small_shm(test: &str, child: &str, marker: &str) {
    let exe = std::env::current_exe().unwrap();
    let args = ["--exact", child, "--ignored", "--nocapture"];
    let Some(out) = in_small_shm(test, exe.to_str().unwrap(), &args) else {
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed ({}): {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(marker), "{stdout}");
}

#[test]
fn a_full_dev_shm_is_out_of_memory_not_sigbus() {
    child_in_small_shm(
        "a_full_dev_shm_is_out_of_memory_not_sigbus",
        "small_shm_child",
        "@@cudalloc oom after",
    );
}

#[test]
fn the_demo_in_a_small_dev_shm_fails_cleanly() {
    let Some(out) = in_small_shm(
        "the_demo_in_a_small_dev_shm_fails_cleanly",
        &cli().to_string_lossy(),
        &[],
    ) else {
        return;
    };
    use std::os::unix::process::ExitStatusExt;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), None, "killed by a signal: {stderr}");
    assert!(
        !out.status.success(),
        "the demo cannot fit in {SHM_MIB} MiB"
    );
    assert!(
        stderr.contains("out of memory") && stderr.contains("/dev/shm"),
        "a clear message: {stderr}"
    );
}

/// One device of 64 MiB, more than the small `/dev/shm` can back: the file system is the limit.
fn device_above_dev_shm() -> Arc<HostDriver> {
    Arc::new(
        HostDriver::builder()
            .devices(1)
            .memory_per_device(64 << 20)
            .build()
            .unwrap(),
    )
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn small_shm_child() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    let driver = device_above_dev_shm();
    let free = driver.mem_info(0).unwrap().free;
    assert!(
        free <= SHM_MIB << 20,
        "mem_info reports what /dev/shm can back: {free}"
    );
    let a = Arc::new(
        Runtime::builder()
            .check_invariants(true)
            .build(driver)
            .unwrap(),
    );
    let mut held = Vec::new();
    let err = loop {
        match Storage::new(&a, 0, 3 << 20) {
            Ok(s) => {
                s.fill_pattern(held.len() as u64).unwrap();
                held.push(s);
            }
            Err(err) => break err,
        }
        assert!(held.len() < 64, "never ran out");
    };
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert!(err.to_string().contains("/dev/shm"), "{err}");
    for (i, s) in held.iter().enumerate() {
        assert_eq!(s.count_pattern_mismatches(i as u64).unwrap(), 0);
    }
    // Fill what is left, byte for byte: nothing new fits in /dev/shm now.
    let filler_path = "/dev/shm/filler";
    {
        use std::io::Write;
        let mut filler = std::fs::File::create(filler_path).unwrap();
        while filler.write_all(&[0u8; 4096]).is_ok() {}
    }
    // Sharing needs a ref-counter file and an event chunk: an error, the storage untouched.
    assert!(held.len() >= 2, "two storages to work with");
    let share_err = held[0].share_ipc().unwrap_err();
    assert!(!held[0].is_received());
    assert_eq!(
        held[0].count_pattern_mismatches(0).unwrap(),
        0,
        "{share_err}"
    );
    // A lazy clone's first write needs a copy: out of memory, and it stays a valid COW storage.
    let clone = held[1].lazy_clone().unwrap();
    let cow_err = clone.fill_pattern(99).unwrap_err();
    assert_eq!(cow_err.kind(), ErrorKind::OutOfMemory, "{cow_err}");
    assert!(clone.is_cow());
    assert_eq!(clone.count_pattern_mismatches(1).unwrap(), 0);
    // Room again: both work.
    std::fs::remove_file(filler_path).unwrap();
    let handle = held[0].share_ipc().unwrap();
    assert!(Storage::from_ipc(&a, handle).unwrap().is_alias_of(&held[0]));
    drop(clone);
    let n = held.len();
    held.clear();
    a.empty_cache();
    // Memory came back: allocating again works.
    let again = Storage::new(&a, 0, 3 << 20).unwrap();
    again.fill_pattern(1).unwrap();
    ParentLink::new().send(&format!("oom after {n} storages"));
}

/// A capture while `/dev/shm` is full: the graph pool's miss is the same out-of-memory path,
/// named as during a capture, never a SIGBUS; the capture ends cleanly and, with room again,
/// the next capture's graph replays.
#[test]
fn a_capture_in_a_full_dev_shm_is_out_of_memory_and_ends_cleanly() {
    child_in_small_shm(
        "a_capture_in_a_full_dev_shm_is_out_of_memory_and_ends_cleanly",
        "small_shm_capture_child",
        "@@cudalloc capture oom",
    );
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn small_shm_capture_child() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    let driver = device_above_dev_shm();
    let a = Arc::new(
        Runtime::builder()
            .check_invariants(true)
            .build(driver)
            .unwrap(),
    );
    let s = a.create_stream(0).unwrap();
    let _on = a.set_current_stream(s).unwrap();
    // Eager storages until /dev/shm is the limit.
    let mut held = Vec::new();
    while let Ok(st) = Storage::new(&a, 0, 3 << 20) {
        held.push(st);
        assert!(held.len() < 64, "never ran out");
    }
    let capture = a
        .begin_capture(s, None, cudalloc::graph::CaptureMode::Global)
        .unwrap();
    let err = Storage::new(&a, 0, 3 << 20).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert!(err.to_string().contains("stream capture"), "{err}");
    println!("@@cudalloc capture oom: {err}");
    drop(capture);
    assert_eq!(
        a.driver().graphs().stream_capture_status(s).unwrap(),
        cudalloc::backend::CaptureStatus::None
    );
    // Room again (a capture never releases cached memory, so release it before): a capture
    // allocates, and its graph replays.
    held.clear();
    a.empty_cache();
    let capture = a
        .begin_capture(s, None, cudalloc::graph::CaptureMode::Global)
        .unwrap();
    let out = Storage::new(&a, 0, 3 << 20).unwrap();
    out.fill_pattern(5).unwrap();
    let graph = capture.end().unwrap();
    graph.replay(s).unwrap();
    assert_eq!(out.count_pattern_mismatches(5).unwrap(), 0);
    drop((out, graph));
    a.empty_cache();
    a.check_invariants().unwrap();
}
