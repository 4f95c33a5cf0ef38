//! Another process of our user can truncate any named shared-memory object of ours (a segment of
//! the host backend, a ref-counter file, an event chunk). Touching a mapped page past the new end
//! raises `SIGBUS`, which kills the process unless something handles it. These tests cut objects
//! under a live runtime — in a forked child, so that a signal is a failed verdict rather than the
//! end of the test binary — and check that the producer survives, that what concerns the cut object
//! fails with an error saying so, and that everything else keeps working.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cudalloc::backend::capability::Ipc;
use std::sync::{Arc, Mutex};

use common::forked::in_forked_child;
use common::*;
use cudalloc::{backend::Driver, backend::EventFlags, ipc::IpcHandle, Runtime, Storage};

/// Forking while another test of this binary runs its threads would copy them mid-work.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const CHILD: &str = "truncated_child";

/// A runtime of whole segments (named objects) whatever this run's settings: the chunks of
/// expandable segments are sealed memfds, which no peer can cut.
fn whole_segments_runtime() -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(cudalloc::AllocatorConfig::parse("expandable_segments:False").unwrap())
            .build(Arc::new(host_driver()))
            .unwrap(),
    )
}

fn runtime() -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(test_config(""))
            .ipc_slots_per_file(16)
            .build(Arc::new(host_driver()))
            .unwrap(),
    )
}

/// What a hostile peer does: `ftruncate` the object to `len` bytes through its name.
fn truncate(name: &str, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/dev/shm/{name}"))
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

/// The names of this process's objects of kind `tag` (`seg`, `ref`, `evt`).
fn own_objects(tag: &str) -> Vec<String> {
    let prefix = format!("cudalloc-{}-", std::process::id());
    let mut names: Vec<String> = shm_names_with_prefix(&prefix)
        .into_iter()
        .filter(|n| {
            n.rsplit('-')
                .next()
                .is_some_and(|last| last.starts_with(tag))
        })
        .collect();
    names.sort();
    names
}

#[test]
fn a_truncated_segment_is_an_error_for_its_storages_not_a_signal() {
    if !common::forked::alone("a_truncated_segment_is_an_error_for_its_storages_not_a_signal") {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let verdict = in_forked_child(|| {
        let rt = whole_segments_runtime();
        let victim = Storage::new(&rt, 0, 4 << 20).map_err(|e| e.to_string())?;
        victim.fill_pattern(3).map_err(|e| e.to_string())?;
        let segments = own_objects("seg");
        ensure(segments.len() == 1, || format!("segments: {segments:?}"))?;
        truncate(&segments[0], 4096);
        // The producer writes and reads the cut pages: no signal, an error naming the cut.
        let written = victim.fill_pattern(4);
        let read = victim.count_pattern_mismatches(4);
        let err = match (written, read) {
            (Err(e), _) | (Ok(()), Err(e)) => e.to_string(),
            (Ok(()), Ok(n)) => {
                return Err(format!("the cut storage read back fine ({n} mismatches)"))
            }
        };
        ensure(err.contains("truncated"), || format!("error: {err}"))?;
        // Everything else works: storages in other segments (of the small pool now, and of the
        // large pool once the cut segment is given back), verified.
        let verified = |bytes: u64, seed: u64| -> Result<Storage, String> {
            let s = Storage::new(&rt, 0, bytes).map_err(|e| e.to_string())?;
            s.fill_pattern(seed).map_err(|e| e.to_string())?;
            let bad = s
                .count_pattern_mismatches(seed)
                .map_err(|e| e.to_string())?;
            ensure(bad == 0, || {
                format!("{bad} mismatches in a healthy storage")
            })?;
            Ok(s)
        };
        let small = verified(512 << 10, 5)?;
        drop(victim);
        rt.empty_cache();
        let large = verified(8 << 20, 6)?;
        drop((small, large));
        drop(rt);
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
}

#[test]
fn a_truncated_ref_counter_file_keeps_held_storages_and_fails_new_opens() {
    if !common::forked::alone(
        "a_truncated_ref_counter_file_keeps_held_storages_and_fails_new_opens",
    ) {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let verdict = in_forked_child(|| {
        let rt = runtime();
        let held = Storage::new(&rt, 0, 1 << 20).map_err(|e| e.to_string())?;
        held.fill_pattern(7).map_err(|e| e.to_string())?;
        let unopened = Storage::new(&rt, 0, 1 << 20).map_err(|e| e.to_string())?;
        let handle = held.share_ipc().map_err(|e| e.to_string())?;
        let unopened_handle = unopened.share_ipc().map_err(|e| e.to_string())?;
        let ref_file = handle.wire().ref_file.clone();
        let mut consumer = ChildProcess::spawn(CHILD, "hold", "host");
        consumer.send(&hex(&handle.into_bytes()));
        ensure(consumer.recv() == "holding", || {
            "consumer did not open".into()
        })?;
        // Cut the file to its header: every slot and the release ring are gone.
        truncate(&ref_file, 64);
        drop(held);
        drop(unopened);
        rt.ipc_collect();
        // The consumer that holds a lease keeps its storage (its lock decides, the counts are
        // lost); the unopened handle's storage is freed.
        let limbo = rt.ipc_limbo().0;
        ensure(limbo == 1, || format!("limbo {limbo}, expected 1"))?;
        consumer.send("check");
        let line = consumer.recv();
        ensure(line == "mismatches=0", || format!("consumer: {line}"))?;
        // Opening the unopened handle now fails with an error, in the consumer, not a signal.
        consumer.send(&hex(&unopened_handle.into_bytes()));
        let line = consumer.recv();
        ensure(
            line.starts_with("refused") && line.contains("truncated"),
            || format!("consumer: {line}"),
        )?;
        consumer.send("release");
        ensure(consumer.recv() == "released", || "no release".into())?;
        consumer.finish();
        rt.ipc_collect();
        let limbo = rt.ipc_limbo().0;
        ensure(limbo == 0, || {
            format!("limbo {limbo} after the holder left")
        })?;
        // New shares go to a fresh file and work.
        let fresh = Storage::new(&rt, 0, 1 << 20).map_err(|e| e.to_string())?;
        let h = fresh.share_ipc().map_err(|e| e.to_string())?;
        ensure(h.wire().ref_file != ref_file, || {
            "reused the cut file".into()
        })?;
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
}

#[test]
fn a_truncated_event_chunk_leaves_its_owner_working() {
    if !common::forked::alone("a_truncated_event_chunk_leaves_its_owner_working") {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let verdict = in_forked_child(|| {
        let driver = Arc::new(host_driver());
        let prefix = driver.shm_name_prefix();
        let stream = driver.default_stream(0).map_err(|e| e.to_string())?;
        let e = driver
            .event_create(0, EventFlags { interprocess: true })
            .map_err(|e| e.to_string())?;
        driver.ipc_export_event(e).map_err(|e| e.to_string())?;
        truncate(&format!("{prefix}evt0"), 0);
        // Records complete into the cut cell; the owner's own counters decide its waits.
        for _ in 0..3 {
            driver.event_record(e, stream).map_err(|e| e.to_string())?;
            driver.event_synchronize(e).map_err(|e| e.to_string())?;
        }
        ensure(driver.event_query(e).map_err(|e| e.to_string())?, || {
            "the event never completed".into()
        })?;
        driver.event_destroy(e).map_err(|e| e.to_string())?;
        let rt = Arc::new(Runtime::new(driver, Default::default()).map_err(|e| e.to_string())?);
        let s = Storage::new(&rt, 0, 1 << 20).map_err(|e| e.to_string())?;
        let c = s.lazy_clone().map_err(|e| e.to_string())?;
        c.fill_pattern(9).map_err(|e| e.to_string())?;
        let bad = c.count_pattern_mismatches(9).map_err(|e| e.to_string())?;
        ensure(bad == 0, || format!("{bad} mismatches"))?;
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
}

/// Sends this process `SIGBUS` the way another process of our user can: with `sigqueue`-style
/// info (`si_code` `SI_QUEUE`) naming `addr` as if it had faulted.
fn forged_sigbus(addr: u64) {
    // SAFETY: siginfo_t is plain C data; all-zero is a valid value to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    info.si_signo = libc::SIGBUS;
    info.si_code = -1; // SI_QUEUE
                       // `si_addr` sits after signo, errno and code (and padding) on Linux: the first word of the
                       // union, 16 bytes into the struct on 64-bit targets.
                       // SAFETY: writes one pointer-sized value inside `info`.
    unsafe {
        let at = (&mut info as *mut libc::siginfo_t as *mut u8).add(16) as *mut u64;
        at.write_unaligned(addr);
    }
    // SAFETY: rt_tgsigqueueinfo to this very thread with a valid siginfo.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_rt_tgsigqueueinfo,
            libc::getpid(),
            libc::gettid(),
            libc::SIGBUS,
            &info as *const libc::siginfo_t,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
}

#[test]
fn a_sent_sigbus_neither_cuts_a_live_mapping_nor_switches_the_guard_off() {
    if !common::forked::alone(
        "a_sent_sigbus_neither_cuts_a_live_mapping_nor_switches_the_guard_off",
    ) {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let verdict = in_forked_child(|| {
        let rt = whole_segments_runtime();
        let victim = Storage::new(&rt, 0, 4 << 20).map_err(|e| e.to_string())?;
        victim.fill_pattern(3).map_err(|e| e.to_string())?;
        // A forged fault "at" the storage: before, its pages were replaced by private zeros and
        // every access said "truncated" though nothing was.
        forged_sigbus(victim.unordered_data_ptr().0 + 8192);
        let bad = victim
            .count_pattern_mismatches(3)
            .map_err(|e| format!("after a forged SIGBUS: {e}"))?;
        ensure(bad == 0, || {
            format!("{bad} bytes changed by a forged SIGBUS")
        })?;
        // A plain `kill(getpid(), SIGBUS)`: before, it went to Rust's handler, which reset the
        // action, and the next real cut killed the process.
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(libc::getpid(), libc::SIGBUS) };
        let segments = own_objects("seg");
        ensure(segments.len() == 1, || format!("segments: {segments:?}"))?;
        truncate(&segments[0], 4096);
        let err = match victim.fill_pattern(4) {
            Err(e) => e.to_string(),
            Ok(()) => match victim.count_pattern_mismatches(4) {
                Err(e) => e.to_string(),
                Ok(n) => return Err(format!("the cut storage read back fine ({n} mismatches)")),
            },
        };
        ensure(err.contains("truncated"), || format!("error: {err}"))?;
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn truncated_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    match role.as_str() {
        "hold" => {
            let rt = runtime();
            let h = IpcHandle::from_bytes(&unhex(&parent.recv())).unwrap();
            let s = Storage::from_ipc(&rt, h).unwrap();
            parent.send("holding");
            assert_eq!(parent.recv(), "check");
            parent.send(&format!(
                "mismatches={}",
                s.count_pattern_mismatches(7).unwrap()
            ));
            let bytes = unhex(&parent.recv());
            match IpcHandle::from_bytes(&bytes).and_then(|h| Storage::from_ipc(&rt, h)) {
                Ok(_) => parent.send("opened"),
                Err(e) => parent.send(&format!("refused {e}")),
            }
            assert_eq!(parent.recv(), "release");
            drop(s);
            parent.send("released");
        }
        other => panic!("unknown role {other}"),
    }
}
