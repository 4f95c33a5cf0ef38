//! The doors a user reaches first are the ordered ones (issue 47). Before: `data_ptr()` and
//! `mutable_data_ptr()` — PyTorch's names, what a PyTorch or candle author types first — were the
//! raw address, and a raw kernel reading `data_ptr()` on another stream while the compute stream
//! wrote got every value wrong (65,536 of 65,536), silently. Now they are `data_ptr_on` and
//! `mutable_data_ptr_on` with the current stream; the unordered address is
//! `unordered_data_ptr()`, a name a reviewer notices. And the sanitizer checks an access against
//! the bytes asked for, not the allocator's rounding: a raw write 64 bytes past a 16-byte tensor
//! (inside its 512-byte block) was invisible to it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::storage::{clean, ordered_or_manual as runtime};
use common::{one_report, sanitized_host_runtime};
use cudalloc::{
    backend::HostKernelMemory, backend::HostRange, sanitizer::HazardKind, ErrorKind, Runtime,
    Storage, StreamId,
};

const ROUNDS: u64 = 50;
const LEN: u64 = 64 << 10;

/// Rounds of: `x` written on stream `a` (held back by a gate) through `mutable_data_ptr()` with
/// `a` current; then, with `b` current, `x`'s address taken by `read` and copied into `y` by a
/// raw copy on `b`. The rounds whose copy got the wrong bytes.
fn wrong_rounds(conf: &str, read: impl Fn(&Storage) -> cudalloc::DeviceAddr) -> u64 {
    let (rt, host) = runtime(conf);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let mut wrong = 0;
    for round in 0..ROUNDS {
        let x = Storage::new_on(&rt, a, LEN).unwrap();
        let y = Storage::new_on(&rt, b, LEN).unwrap();
        let gate = host.gate_stream(a).unwrap();
        {
            let _on = rt.set_current_stream(a).unwrap();
            let p = x.mutable_data_ptr().unwrap();
            // SAFETY: test memory this test owns, ordered on its stream by the door above.
            unsafe { rt.driver().kernels().fill_pattern(a, p, LEN, round) }.unwrap();
        }
        {
            let _on = rt.set_current_stream(b).unwrap();
            let (d, src) = (y.mutable_data_ptr().unwrap(), read(&x));
            // SAFETY: test memory this test owns; the doors above order it (or, for the
            // control, do not: the wrong rounds are the point).
            unsafe { rt.driver().copy_device_to_device(b, d, src, LEN) }.unwrap();
        }
        // Unordered, `b` copies at once (it does not wait for the held `a`): waited for behind
        // the storages' backs. Ordered, `b` waits for `a`, which the gate holds.
        if conf.contains("manual") {
            rt.driver().stream_synchronize(b).unwrap();
        }
        drop(gate);
        rt.driver().stream_synchronize(b).unwrap();
        wrong += u64::from(y.count_pattern_mismatches(round).unwrap() != 0);
        // Keep `x` until `b`'s copy is done in every mode (the control's free would not wait).
        drop(x);
    }
    if !conf.contains("manual") {
        clean(&rt);
    }
    wrong
}

#[test]
fn the_first_pointer_a_user_takes_is_ordered() {
    assert_eq!(
        wrong_rounds("", |x| x.data_ptr().unwrap()),
        0,
        "data_ptr() on the current stream: every round right"
    );
}

#[test]
fn the_unordered_address_is_wrong_without_a_wait() {
    // The control: the same program through the unordered address (under `manual`, where the
    // sanitizer is off) reads before the write — the test above could fail.
    assert_eq!(
        wrong_rounds("stream_order:manual", |x| x.unordered_data_ptr()),
        ROUNDS,
        "the unordered address, no wait written: every round wrong"
    );
}

/// A raw write of 4 bytes at `offset` into a storage of `asked` bytes (a 512-byte block), on a
/// fresh stream that waited for the storage's: the error and the report, if any.
fn raw_write_at(rt: &Arc<Runtime>, asked: u64, offset: u64) -> Option<String> {
    let host = rt.driver().as_host().unwrap();
    let t = rt.create_stream(0).unwrap();
    let small = Storage::new_on(rt, t, asked).unwrap();
    let s: StreamId = rt.create_stream(0).unwrap();
    let p = small.mutable_data_ptr_on(s).unwrap();
    // SAFETY: the range is this program's own memory (inside the storage's block), ordered on
    // `s` by the door above; no typed kernel sees it.
    let done = unsafe {
        host.enqueue_host(
            s,
            [HostRange::write(p.offset(offset).unwrap(), 4)],
            |m: &mut HostKernelMemory<1>| m.write(0, 0, &[7; 4]),
        )
    };
    match done {
        Ok(()) => None,
        Err(err) => {
            assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
            Some(one_report(rt, HazardKind::OutOfBounds).to_string())
        }
    }
}

#[test]
fn a_write_past_the_asked_bytes_inside_the_rounding_is_out_of_bounds() {
    let rt = sanitized_host_runtime();
    // 64 bytes past a 16-byte tensor, inside its 512-byte block: reported and refused.
    let report = raw_write_at(&rt, 16, 64).expect("the write past the tensor was not reported");
    assert!(report.contains("past the end"), "{report}");
    // The last 4 bytes of what was asked: no report.
    assert_eq!(raw_write_at(&rt, 16, 12), None);
    assert_eq!(raw_write_at(&rt, 512, 508), None);
}

/// A stream id is good only with the runtime that made it: another runtime's id — the same
/// number as one of this runtime's streams — is refused by every door that takes a stream, the
/// error naming both runtimes' drivers, and leaves nothing behind. Before, runtime `b`'s stream
/// ran as runtime `a`'s stream of the same number, silently.
#[test]
fn another_runtimes_stream_is_refused() {
    let (a, _) = runtime("");
    let (b, _) = runtime("");
    let (ours, theirs) = (a.create_stream(0).unwrap(), b.create_stream(0).unwrap());
    assert_ne!(ours, theirs, "ids of two runtimes differ");
    let x = Storage::new(&a, 0, 4096).unwrap();
    let named = |what: &str, err: cudalloc::Error| {
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{what}: {err}");
        let text = err.to_string();
        assert!(
            text.contains("another runtime's driver") && text.matches("driver #").count() == 2,
            "{what}: {text}"
        );
    };
    named("allocate_on", a.allocate_on(theirs, 512).unwrap_err());
    named(
        "Storage::new_on",
        Storage::new_on(&a, theirs, 512).unwrap_err(),
    );
    named(
        "set_current_stream",
        a.set_current_stream(theirs).err().unwrap(),
    );
    named(
        "set_default_stream",
        a.set_default_stream(theirs).unwrap_err(),
    );
    named("destroy_stream", a.destroy_stream(theirs).unwrap_err());
    named("raw_stream", a.raw_stream(theirs).unwrap_err());
    named("synchronize", a.synchronize(theirs).unwrap_err());
    named("wait_stream", a.wait_stream(ours, theirs).unwrap_err());
    named("record_event", a.record_event(theirs).unwrap_err());
    named("data_ptr_on", x.data_ptr_on(theirs).unwrap_err());
    named(
        "mutable_data_ptr_on",
        x.mutable_data_ptr_on(theirs).unwrap_err(),
    );
    named("record_stream", x.record_stream(theirs).unwrap_err());
    named(
        "copy_from_host",
        x.copy_from_host(theirs, 0, &[1; 16]).unwrap_err(),
    );
    named(
        "copy_to_host",
        x.copy_to_host(theirs, 0, &mut [0; 16]).unwrap_err(),
    );
    // Nothing was allocated or kept for it; `a`'s own stream of the same number is untouched.
    let stats = a.memory_stats(0).unwrap();
    assert_eq!(stats.allocation.all.allocated, 1, "{stats:?}");
    x.copy_from_host(ours, 0, &[7; 16]).unwrap();
    a.synchronize(ours).unwrap();
    b.synchronize(theirs).unwrap();
}
