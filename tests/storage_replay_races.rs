//! Storages queueing their own work under their locks (`src/storage/order.rs`), graph replays as
//! accesses, and runtime events, attacked in safe code: from a hostile review whose findings each
//! failed here before their fix — an observer and a free-memory callback touching another operand
//! deadlocked a launch (the lazy clone's materialization ran under the operands' locks), and a
//! capture of one runtime writing another runtime's storage kept no use, so its replays wrote
//! under that runtime's zero-copy slice. A capture that reads a lazy clone and then writes it is
//! refused at replay (documented): the read's memory is the clone's shared memory no more.
//! Deadlock probes run the suspect code in a thread and fail after `DEADLOCK_WAIT` (an upper
//! bound only).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::host_driver;
use common::storage::{block_writing, build, runtime, set, sync, values, PROBE_WAIT};
use cudalloc::{graph::CaptureMode, Runtime, Storage};

const N: usize = 4096;
const BYTES: u64 = (N * 4) as u64;
const DEADLOCK_WAIT: Duration = Duration::from_secs(10);

/// Runs `f` on a thread; `None` if it did not return within `DEADLOCK_WAIT` (deadlock).
fn bounded<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    bounded_for(DEADLOCK_WAIT, f)
}

fn bounded_for<R: Send + 'static>(
    wait: Duration,
    f: impl FnOnce() -> R + Send + 'static,
) -> Option<R> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(wait).ok()
}

// ---------------------------------------------------------------------------------------------
// (2) Replays: a capture of *another* runtime over the same driver writes a storage of this one.
// ---------------------------------------------------------------------------------------------

/// rt2 captures a typed kernel writing x (a storage of rt1) on rt2's stream. x's allocator has
/// no capture under way, so `note_if_captured` keeps nothing: rt2's replays are not accesses of
/// x. A kernel through rt1 on x then gets zero copy (x is rt1's default pool, rt1 orders it), and
/// rt2's replay (the staged kernel's write-back) writes under its `&mut [f32]`.
#[test]
fn other_runtime_capture_replay_writes_under_zero_copy_slice() {
    let host = Arc::new(host_driver());
    let rt1 = build(&host, "", false);
    let rt2 = build(&host, "", false);
    let a = rt1.create_stream(0).unwrap();
    let b = rt2.create_stream(0).unwrap();
    let c = rt2.create_stream(0).unwrap();
    let x = Storage::new_on(&rt1, a, BYTES).unwrap();
    set(&rt1, &x, a, 0.0);
    sync(&rt1, &[a]);
    let slot: Arc<Mutex<Option<mpsc::Sender<()>>>> = Arc::new(Mutex::new(None));
    let z = Storage::new_on(&rt2, b, 4).unwrap();
    let capture = rt2
        .begin_capture(b, None, CaptureMode::ThreadLocal)
        .unwrap();
    set(&rt2, &x, b, 99.0);
    let s2 = Arc::clone(&slot);
    rt2.launch_host(b, z.reads::<u8>(), move |_| {
        if let Some(tx) = s2.lock().unwrap().as_ref() {
            let _ = tx.send(());
        }
        Ok(())
    })
    .unwrap();
    let graph = capture.end().unwrap();
    sync(&rt2, &[b]);

    // The blocker, started (deterministic: the replay is queued while it holds its slice).
    let started = Storage::new_on(&rt1, a, 4).unwrap();
    let _ = started;
    let (st_tx, st_rx) = mpsc::channel::<()>();
    let st_tx = Mutex::new(st_tx);
    let z1 = Storage::new_on(&rt1, a, 4).unwrap();
    rt1.launch_host(a, z1.reads::<u8>(), move |_| {
        let _ = st_tx.lock().unwrap().send(());
        Ok(())
    })
    .unwrap();
    let blocker = block_writing(&rt1, a, &x, 1.0);
    *slot.lock().unwrap() = Some(blocker.tx.clone());
    st_rx.recv_timeout(PROBE_WAIT).unwrap();
    graph.replay(c).unwrap();
    sync(&rt1, &[a, c]);
    let seen = blocker.seen();
    let zero_copy = seen.ptr == x.unordered_data_ptr().0;
    // The replay is an access of `x` (kept by rt2's capture): it waits for the kernel.
    assert!(
        !seen.signalled && !seen.changed,
        "rt2's replay ran under rt1's &mut [f32] (zero copy {zero_copy}): {seen:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// (1) Callbacks run under the operands' locks.
// ---------------------------------------------------------------------------------------------

/// A launch that reads x and writes c (a lazy clone: its first write allocates the copy on a
/// fresh stream, mapping a new segment), while a callback `hook` registers on the runtime touches
/// x: the launch returns (before the fix it held x's data lock across the allocation, and the
/// callback, run on the same thread, deadlocked). The whole body runs in a bounded thread: a
/// deadlocked body also hangs in its drops.
fn launch_while_a_callback_touches_the_other_operand(
    what: &'static str,
    hook: fn(&Runtime, Storage, Arc<AtomicUsize>),
) {
    let body = move || {
        let (rt, _) = runtime("", false);
        let s0 = rt.create_stream(0).unwrap();
        let x = Storage::new_on(&rt, s0, BYTES).unwrap();
        let src = Storage::new_on(&rt, s0, BYTES).unwrap();
        sync(&rt, &[s0]);
        let c = src.lazy_clone().unwrap();
        let fresh = rt.create_stream(0).unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        hook(&rt, x.clone(), Arc::clone(&calls));
        let rt2 = Arc::clone(&rt);
        let done = bounded(move || {
            rt2.launch_host(fresh, (x.reads::<f32>(), c.writes::<f32>()), |_| Ok(()))
        });
        assert!(
            done.is_some(),
            "launch deadlocked: the {what} ({} calls) touched x under its lock",
            calls.load(Ordering::SeqCst)
        );
        done.unwrap().unwrap();
        assert!(calls.load(Ordering::SeqCst) > 0, "the {what} ran");
    };
    let r = bounded_for(2 * DEADLOCK_WAIT, body);
    assert!(
        r.is_some(),
        "{what}: the body did not finish within {DEADLOCK_WAIT:?}"
    );
}

/// A segment observer reading x's state (`allocation_stream`: observers may read, not allocate).
#[test]
fn segment_observer_reading_other_operand_deadlocks() {
    launch_while_a_callback_touches_the_other_operand("segment observer", |rt, x, calls| {
        let watched = Mutex::new(Some(x));
        rt.register_segment_observer(Arc::new(move |_event| {
            calls.fetch_add(1, Ordering::SeqCst);
            if let Some(x) = watched.lock().unwrap().take() {
                let _ = black_box(x.allocation_stream());
            }
        }));
    });
}

/// A free-memory callback (run on the cache miss of the copy's allocation) touching x.
#[test]
fn free_memory_callback_touching_other_operand_deadlocks() {
    launch_while_a_callback_touches_the_other_operand("free-memory callback", |rt, x, calls| {
        let watched = Mutex::new(Some(x));
        rt.register_free_memory_callback(Arc::new(move || {
            calls.fetch_add(1, Ordering::SeqCst);
            if let Some(x) = watched.lock().unwrap().take() {
                let _ = black_box(x.is_received());
            }
            false
        }));
    });
}

/// Two threads: T1's kernel (x reads, c writes: a lazy clone, so it allocates under x's lock)
/// runs a free-memory callback that takes y's lock (`is_received`); T2's kernel writes x and y
/// (locks in address order). Whether the orders cross depends on the addresses: several y's so
/// that one of them sorts below x.
#[test]
fn callback_under_locks_crosses_another_threads_launch() {
    let (rt, _) = runtime("", false);
    let s0 = rt.create_stream(0).unwrap();
    let x = Storage::new_on(&rt, s0, BYTES).unwrap();
    let ys: Vec<Storage> = (0..6)
        .map(|_| Storage::new_on(&rt, s0, 4096).unwrap())
        .collect();
    let src = Storage::new_on(&rt, s0, BYTES).unwrap();
    sync(&rt, &[s0]);
    let c = src.lazy_clone().unwrap();
    let fresh = rt.create_stream(0).unwrap();
    let (in_tx, in_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let armed = Arc::new(AtomicBool::new(true));
    let (in_tx, go_rx) = (Mutex::new(in_tx), Mutex::new(go_rx));
    let ys2 = ys.clone();
    let arm = Arc::clone(&armed);
    rt.register_free_memory_callback(Arc::new(move || {
        if arm.swap(false, Ordering::SeqCst) {
            let _ = in_tx.lock().unwrap().send(());
            let _ = go_rx.lock().unwrap().recv_timeout(PROBE_WAIT);
            for y in &ys2 {
                let _ = black_box(y.is_received());
            }
        }
        false
    }));
    let (rt1, x1, c1) = (Arc::clone(&rt), x.clone(), c.clone());
    let (t1_tx, t1_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = rt1
            .launch_host(fresh, (x1.reads::<f32>(), c1.writes::<f32>()), |(_, _)| {
                Ok(())
            })
            .map(|_| ());
        let _ = t1_tx.send(r);
    });
    assert!(
        in_rx.recv_timeout(PROBE_WAIT).is_ok(),
        "inconclusive: no free-memory callback ran inside the launch"
    );
    // T2..: each writes x and one y, on its own stream.
    let mut others = Vec::new();
    for y in &ys {
        let (rt3, x3, y3) = (Arc::clone(&rt), x.clone(), y.clone());
        let st = rt.create_stream(0).unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let r = rt3
                .launch_host(st, (x3.writes::<f32>(), y3.writes::<u8>()), |(_, _)| Ok(()))
                .map(|_| ());
            let _ = tx.send(r);
        });
        others.push(rx);
    }
    // Give the others a chance to take their first lock (not a correctness condition: without
    // it the probe is only less likely to find the inversion).
    std::thread::sleep(Duration::from_millis(200));
    go_tx.send(()).unwrap();
    let t1 = t1_rx.recv_timeout(DEADLOCK_WAIT);
    assert!(
        t1.is_ok(),
        "deadlock: T1's free-memory callback waits for a y whose lock another launch holds \
         while it waits for x (held by T1)"
    );
    for rx in others {
        rx.recv_timeout(DEADLOCK_WAIT).unwrap().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// (2) Replays of captures that materialized a lazy clone.
// ---------------------------------------------------------------------------------------------

/// A capture that reads a lazy clone c and then writes it (its first write materializes it inside
/// the capture): the replay would read the clone's shared memory, which c no longer holds — it
/// is refused with an error that says how to write the program (the review found it refused; the
/// limitation is kept, and documented). Made the other way — the first write before the
/// capture — the same work replays.
#[test]
fn capture_reading_then_writing_lazy_clone_replays() {
    let (rt, _) = runtime("", false);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let src = Storage::new_on(&rt, a, BYTES).unwrap();
    let out = Storage::new_on(&rt, a, BYTES).unwrap();
    set(&rt, &src, a, 5.0);
    sync(&rt, &[a]);
    let capture_work = |c: &Storage| {
        let capture = rt.begin_capture(b, None, CaptureMode::ThreadLocal).unwrap();
        rt.launch_host(b, (c.reads::<f32>(), out.writes::<f32>()), |(c, o)| {
            o.copy_from_slice(c);
            Ok(())
        })
        .unwrap();
        rt.launch_host(b, c.writes::<f32>(), |c| {
            c.iter_mut().for_each(|v| *v += 1.0);
            Ok(())
        })
        .unwrap();
        capture.end().unwrap()
    };
    let c = src.lazy_clone().unwrap();
    let graph = capture_work(&c);
    let err = graph.replay(b).unwrap_err();
    assert!(
        err.to_string()
            .contains("before capturing work that reads it"),
        "{err}"
    );
    drop(graph);
    // The first write before the capture: replays run, each adding 1.
    let c = src.lazy_clone().unwrap();
    rt.launch_host(b, c.writes::<f32>(), |_| Ok(())).unwrap();
    let graph = capture_work(&c);
    graph.replay(b).unwrap();
    graph.replay(b).unwrap();
    sync(&rt, &[b]);
    assert_eq!(values(&rt, &c)[0], 7.0);
    assert_eq!(values(&rt, &out)[0], 6.0);
    assert_eq!(values(&rt, &src)[0], 5.0, "the source changed");
}

// ---------------------------------------------------------------------------------------------
// (4) Events on capturing streams.
// ---------------------------------------------------------------------------------------------

/// An event recorded on a stream under a runtime capture, then polled and synchronized on the
/// host: an error or at once — not a hang, and the capture still ends.
#[test]
fn event_recorded_inside_capture() {
    let (rt, _) = runtime("", false);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let x = Storage::new_on(&rt, a, BYTES).unwrap();
    sync(&rt, &[a]);
    let capture = rt.begin_capture(b, None, CaptureMode::ThreadLocal).unwrap();
    set(&rt, &x, b, 3.0);
    let ev = rt.record_event(b).unwrap();
    let rt2 = Arc::clone(&rt);
    // is_complete / synchronize of a captured event, from this thread (it owns the capture).
    let q = ev.is_complete();
    eprintln!("is_complete inside capture: {q:?}");
    drop(ev);
    let ended = capture.end();
    eprintln!("capture end after event: {:?}", ended.as_ref().map(|_| ()));
    // CUDA's rule: a query of a captured event invalidates the capture. Then the runtime goes on:
    // the failed capture's uses are gone, x is written eagerly and read back.
    assert!(q.is_err() && ended.is_err());
    set(&rt, &x, a, 4.0);
    sync(&rt, &[a]);
    assert_eq!(values(&rt2, &x)[0], 4.0);
    drop(x);
    rt.empty_cache();
}

/// An event recorded inside a capture, kept past its end, synchronized: must not hang.
#[test]
fn captured_event_synchronize_after_capture() {
    let (rt, _) = runtime("", false);
    let b = rt.create_stream(0).unwrap();
    let x = Storage::new_on(&rt, b, BYTES).unwrap();
    sync(&rt, &[b]);
    let capture = rt.begin_capture(b, None, CaptureMode::ThreadLocal).unwrap();
    set(&rt, &x, b, 3.0);
    let ev = rt.record_event(b).unwrap();
    let graph = capture.end().unwrap();
    let done = bounded(move || {
        let s = ev.synchronize();
        let q = ev.is_complete();
        (format!("{s:?}"), format!("{q:?}"))
    });
    eprintln!("captured event after the capture: {done:?}");
    assert!(
        done.is_some(),
        "Event::synchronize of a captured event hung"
    );
    drop(graph);
}

/// An event's wait pending on a gated stream, the event dropped: the waiter still waits (CUDA's
/// `cudaEventDestroy`), and nothing hangs once the gate opens.
#[test]
fn event_dropped_while_wait_pending() {
    let (rt, host) = runtime("", false);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let x = Storage::new_on(&rt, a, BYTES).unwrap();
    sync(&rt, &[a]);
    let gate = host.gate_stream(a).unwrap();
    set(&rt, &x, a, 7.0); // behind the gate
    let ev = rt.record_event(a).unwrap();
    ev.wait_on(b).unwrap();
    drop(ev);
    // Raw read on b through a manual-style path: a second event on b, polled.
    let ev_b = rt.record_event(b).unwrap();
    let early = ev_b.is_complete().unwrap();
    drop(gate);
    let done = bounded({
        let rt = Arc::clone(&rt);
        move || rt.driver().stream_synchronize(b).map_err(|e| e.to_string())
    });
    assert!(done.is_some(), "b hung after its event was dropped");
    assert!(
        !early,
        "b ran past its wait on a dropped event while a was gated"
    );
    drop(rt);
    drop(ev_b); // after its runtime
}

/// A capture dropped without its end, and one that fails: the storages it touched are not kept
/// (their memory goes back when the program drops them); a graph keeps its storages until it is
/// dropped, then they go too.
#[test]
fn dropped_and_failed_captures_keep_no_storage_graph_releases() {
    let (rt, _) = runtime("", false);
    let (a, b, d) = (
        rt.create_stream(0).unwrap(),
        rt.create_stream(0).unwrap(),
        rt.create_stream(0).unwrap(),
    );
    let base = rt.memory_allocated(0).unwrap();
    // Dropped capture.
    let x = Storage::new_on(&rt, a, BYTES).unwrap();
    sync(&rt, &[a]);
    let capture = rt.begin_capture(b, None, CaptureMode::ThreadLocal).unwrap();
    set(&rt, &x, b, 1.0);
    drop(capture);
    drop(x);
    sync(&rt, &[a, b]);
    let after_dropped = rt.memory_allocated(0).unwrap();
    // Failed capture: a forked stream never joined back.
    let y = Storage::new_on(&rt, a, BYTES).unwrap();
    sync(&rt, &[a]);
    let capture = rt.begin_capture(b, None, CaptureMode::ThreadLocal).unwrap();
    set(&rt, &y, b, 1.0);
    let ev = rt.record_event(b).unwrap();
    ev.wait_on(d).unwrap();
    set(&rt, &y, d, 2.0);
    let failed = capture.end();
    drop(ev);
    drop(y);
    let after_failed = rt.memory_allocated(0).unwrap();
    // A graph keeps its storage; dropping it lets go.
    let w = Storage::new_on(&rt, a, BYTES).unwrap();
    sync(&rt, &[a]);
    let capture = rt.begin_capture(b, None, CaptureMode::ThreadLocal).unwrap();
    set(&rt, &w, b, 1.0);
    let graph = capture.end().unwrap();
    drop(w);
    let with_graph = rt.memory_allocated(0).unwrap();
    drop(graph);
    let after_graph = rt.memory_allocated(0).unwrap();
    eprintln!(
        "base {base} dropped {after_dropped} failed {after_failed} ({:?}) graph {with_graph} after {after_graph}",
        failed.as_ref().map(|_| ())
    );
    assert_eq!(after_dropped, base, "a dropped capture kept its storage");
    assert_eq!(after_failed, base, "a failed capture kept its storage");
    assert!(
        with_graph >= base + BYTES,
        "the graph did not keep its storage"
    );
    assert_eq!(
        after_graph, base,
        "the graph's storage stayed after the graph"
    );
}
