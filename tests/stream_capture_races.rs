//! A wait between streams, and a free's event, against a capture beginning on another thread. Found by the model of
//! every exit on the CUDA double: a storage written on stream `a` and then used on stream `b`
//! makes `b` wait for `a`; the allocator asked whether `a` was being captured, another thread
//! began a capture on `a`, and the wait — an event recorded on `a`, now inside the capture —
//! joined `b` to that capture. The capture's end then failed with unjoined work, and the next
//! wait for `b` was refused (a capturing stream with no known tail).
//!
//! The test stops the waiting thread between its decision and its event record (the driver's
//! hook) and lets the other thread begin its capture there. With the fix the capture's start
//! waits for the wait to be enqueued (the hook's bounded wait for the capture times out, and the
//! test passes whatever the timing); before it, the capture began in the gap.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use common::faulty::{Faults, FaultyDriver, RecordHook};
use common::*;
use cudalloc::graph::CaptureMode;
use cudalloc::{Runtime, Storage, StreamId};

/// A capture begun on `stream` by another thread just before the driver's next event record
/// there (the gap between a decision and its record); the hook gives it a bounded time to begin.
struct Gap {
    capturer: JoinHandle<cudalloc::Result<()>>,
    end: mpsc::Sender<()>,
    began_in_gap: Arc<AtomicBool>,
    faults: Arc<Faults>,
}

/// What happened in the gap: whether the hook ran, how the capture ended, whether it began in
/// the gap.
struct GapSeen {
    fired: bool,
    ended: cudalloc::Result<()>,
    began_in_gap: bool,
}

impl Gap {
    fn arm(rt: &Arc<Runtime>, faults: &Arc<Faults>, stream: StreamId) -> Gap {
        let (go, go_rx) = mpsc::channel::<()>();
        let (began, began_rx) = mpsc::channel::<()>();
        let (end, end_rx) = mpsc::channel::<()>();
        let capturer = {
            let rt = Arc::clone(rt);
            std::thread::spawn(move || {
                if go_rx.recv().is_err() {
                    return Ok(()); // the hook never ran: `GapSeen::fired` says so
                }
                let capture = rt.begin_capture(stream, None, CaptureMode::ThreadLocal)?;
                // The hook may have stopped waiting (it does, with the fix).
                began.send(()).ok();
                end_rx.recv().ok();
                capture.end().map(drop)
            })
        };
        let began_in_gap = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&began_in_gap);
        *faults.before_record.lock().unwrap() = Some((
            stream,
            RecordHook(Box::new(move || {
                go.send(()).unwrap();
                let in_gap = began_rx.recv_timeout(Duration::from_millis(500)).is_ok();
                seen.store(in_gap, Ordering::SeqCst);
            })),
        ));
        Gap {
            capturer,
            end,
            began_in_gap,
            faults: Arc::clone(faults),
        }
    }

    fn finish(self) -> GapSeen {
        let unfired = self.faults.before_record.lock().unwrap().take();
        let fired = unfired.is_none();
        drop(unfired);
        self.end.send(()).ok();
        let ended = self.capturer.join().unwrap();
        GapSeen {
            fired,
            ended,
            began_in_gap: self.began_in_gap.load(Ordering::SeqCst),
        }
    }
}

/// A runtime over a driver whose event records can be hooked, and two of its streams.
fn runtime_with_hooks() -> (Arc<Runtime>, Arc<Faults>, StreamId, StreamId) {
    let faulty = Arc::new(FaultyDriver::new(Arc::new(host_driver())));
    let faults = faulty.faults.clone();
    let rt = Arc::new(Runtime::builder().build(faulty).unwrap());
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    (rt, faults, a, b)
}

#[test]
fn a_capture_does_not_begin_between_a_waits_decision_and_its_record() {
    let _device = device_shared();
    let (rt, faults, a, b) = runtime_with_hooks();
    let storage = Storage::new_on(&rt, a, 4096).unwrap();
    // Written on `a` (the storage's door records the write there).
    storage.mutable_data_ptr_on(a).unwrap();
    let gap = Gap::arm(&rt, &faults, a);
    // Reading on `b` what `a` wrote: `b` waits for `a`.
    let read = storage.data_ptr_on(b);
    let seen = gap.finish();
    assert!(
        seen.fired,
        "the wait recorded no event on the written stream"
    );
    read.unwrap();
    seen.ended.expect("the capture ends: no stream joined it");
    assert!(
        !seen.began_in_gap,
        "a capture began between the wait's decision and its event record"
    );
    // The reading stream is no capture's.
    let status = rt.driver().graphs().stream_capture_status(b).unwrap();
    assert!(!status.is_capturing(), "stream b joined the capture");
    storage.data_ptr_on(a).unwrap();
}

/// A free of a block another stream used records an event on that stream; a capture begun there
/// between the free's decision (no capture under way: events now) and the record took the event
/// into the capture, where it never completes for the allocator (found by review). The free now
/// holds the same gate as every wait: the capture begins after the record.
#[test]
fn a_free_event_is_not_recorded_into_a_capture_begun_meanwhile() {
    let _device = device_shared();
    let (rt, faults, a, b) = runtime_with_hooks();
    let storage = Storage::new_on(&rt, a, 4096).unwrap();
    storage.data_ptr_on(b).unwrap();
    rt.synchronize(b).unwrap();
    let gap = Gap::arm(&rt, &faults, b);
    drop(storage);
    let seen = gap.finish();
    assert!(seen.fired, "the free recorded no event on the other stream");
    seen.ended.expect("the capture ends");
    rt.synchronize(a).unwrap();
    rt.synchronize(b).unwrap();
    rt.empty_cache();
    let pending: Vec<_> = rt
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|blk| blk.state != cudalloc::stats::SnapshotBlockState::Inactive)
        .map(|blk| blk.addr)
        .collect();
    assert!(
        pending.is_empty(),
        "the freed block is still waiting for its event: {pending:x?}"
    );
    assert!(
        !seen.began_in_gap,
        "a capture began between the free's decision and its event record"
    );
}
