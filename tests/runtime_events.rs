//! Events through the runtime (`src/runtime/events.rs`): a recorded point waited for on another
//! stream, polled and synchronized from the host, and dropped while a wait on it is pending — on
//! a `manual` runtime, where nothing else orders the streams, so each ordering shown is the
//! event's. Deterministic: the recording stream is held by a gate while the waiting work is
//! queued.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::storage::{clean, runtime, set, values};
use cudalloc::Storage;

const BYTES: u64 = 64 << 10;

#[test]
fn work_after_a_wait_on_an_event_sees_what_came_before_it() {
    let (rt, host) = runtime("stream_order:manual", true);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    for round in 0..20 {
        let v = round as f32 + 1.0;
        let x = Storage::new_on(&rt, a, BYTES).unwrap();
        let y = Storage::new_on(&rt, b, BYTES).unwrap();
        rt.synchronize(b).unwrap();
        let gate = host.gate_stream(a).unwrap();
        set(&rt, &x, a, v);
        let ready = rt.record_event(a).unwrap();
        assert_eq!(ready.stream(), a);
        assert!(!ready.is_complete().unwrap(), "held: the fill has not run");
        ready.wait_on(b).unwrap();
        // Dropped with the wait pending: the wait still holds (as CUDA's).
        drop(ready);
        rt.launch_host(b, (x.reads::<f32>(), y.writes::<f32>()), |(x, y)| {
            y.iter_mut().zip(x).for_each(|(o, i)| *o = 2.0 * i);
            Ok(())
        })
        .unwrap();
        x.record_stream(b).unwrap();
        drop(gate);
        let done = rt.record_event(b).unwrap();
        done.synchronize().unwrap();
        assert!(done.is_complete().unwrap());
        assert!(
            values(&rt, &y).iter().all(|&y| y == 2.0 * v),
            "round {round}"
        );
    }
    clean(&rt);
}
