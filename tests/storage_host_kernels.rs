//! Typed host kernels (`src/storage/host_kernel.rs`, `Runtime::launch_host`): operands declared
//! as storages with their mode, seen as `&[T]` / `&mut [T]`, ordered by the storages; the door's
//! checks (bounds, whole elements, aliasing, runtime, alignment) as errors naming the operand; the
//! newcomer's two bugs of issue 36 right with no wait or `record_stream` written; the staged path
//! (`stream_order:manual`, memory another runtime maps, graphs) right for correct programs.
//! Deterministic: an earlier stream is held by a gate while the later kernel is enqueued.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::storage::{clean, misaligned_for_1024, ordered_or_manual as runtime, set, values};
use cudalloc::{graph::CaptureMode, host_kernel, ErrorKind, Runtime, Storage, StreamId};

const N: usize = 16 << 10;
const BYTES: u64 = (N * 4) as u64;

#[test]
fn a_kernel_sees_its_operands_as_typed_slices() {
    let (rt, _) = runtime("");
    let s = rt.current_stream(0).unwrap();
    let (x, y) = (
        Storage::new_on(&rt, s, BYTES).unwrap(),
        Storage::new_on(&rt, s, BYTES).unwrap(),
    );
    rt.launch_host(s, x.writes::<f32>(), |x| {
        for (i, v) in x.iter_mut().enumerate() {
            *v = i as f32;
        }
        Ok(())
    })
    .unwrap();
    rt.launch_host(s, (x.reads::<f32>(), y.writes::<f32>()), |(x, y)| {
        for (o, i) in y.iter_mut().zip(x) {
            *o = 2.0 * i;
        }
        Ok(())
    })
    .unwrap();
    let y = values(&rt, &y);
    assert_eq!(y.len(), N);
    assert!(y.iter().enumerate().all(|(i, &v)| v == 2.0 * i as f32));
    // A range of elements, and the bytes a copy to the host sees.
    rt.launch_host(s, x.writes::<f32>().elements(10..12), |x| {
        x.copy_from_slice(&[-1.0, -2.0]);
        Ok(())
    })
    .unwrap();
    let mut bytes = vec![0u8; 16];
    rt.driver().stream_synchronize(s).unwrap();
    x.copy_to_host(
        x.runtime().current_stream(x.device()).unwrap(),
        0,
        &mut bytes,
    )
    .unwrap();
    let head: Vec<f32> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(head, [0.0, 1.0, 2.0, 3.0]);
    assert_eq!(values(&rt, &x)[9..13], [9.0, -1.0, -2.0, 12.0]);
    clean(&rt);
}

/// The newcomer's read on another stream without a wait (`y[0] = 0`, 2.0 expected, in issue 36),
/// with typed kernels: `a` is held while `b`'s kernel is enqueued.
fn read_on_another_stream(conf: &str) -> usize {
    let (rt, host) = runtime(conf);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let mut wrong = 0;
    for round in 0..20 {
        let v = round as f32 + 1.0;
        let x = Storage::new_on(&rt, a, BYTES).unwrap();
        let y = Storage::new_on(&rt, b, BYTES).unwrap();
        let gate = host.gate_stream(a).unwrap();
        set(&rt, &x, a, v);
        rt.launch_host(b, (x.reads::<f32>(), y.writes::<f32>()), |(x, y)| {
            y.iter_mut().zip(x).for_each(|(o, i)| *o = 2.0 * i);
            Ok(())
        })
        .unwrap();
        if conf.contains("manual") {
            // Unordered, `b` ran already: wait for it behind the storages' backs.
            rt.driver().stream_synchronize(b).unwrap();
        }
        drop(gate);
        rt.driver().stream_synchronize(b).unwrap();
        wrong += usize::from(values(&rt, &y).iter().any(|&y| y != 2.0 * v));
    }
    clean(&rt);
    wrong
}

#[test]
fn a_typed_read_on_another_stream_waits_for_the_write() {
    assert_eq!(read_on_another_stream(""), 0, "auto: every round right");
    assert_eq!(
        read_on_another_stream("stream_order:manual"),
        20,
        "manual, no wait written: every round wrong (staged: wrong bytes, no data race)"
    );
}

/// The newcomer's forgotten `record_stream` (`y[0] = 14`, 2.0 expected): a kernel on `b` (held)
/// reads `x`, `x` is dropped, the next storage on `a` is written with 14.
fn free_while_another_stream_reads(conf: &str) -> usize {
    let (rt, host) = runtime(conf);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let mut wrong = 0;
    for _ in 0..20 {
        let x = Storage::new_on(&rt, a, BYTES).unwrap();
        set(&rt, &x, a, 1.0);
        rt.driver().stream_synchronize(a).unwrap();
        let y = Storage::new_on(&rt, b, BYTES).unwrap();
        let gate = host.gate_stream(b).unwrap();
        rt.launch_host(b, (x.reads::<f32>(), y.writes::<f32>()), |(x, y)| {
            y.iter_mut().zip(x).for_each(|(o, i)| *o = 2.0 * i);
            Ok(())
        })
        .unwrap();
        drop(x);
        let next = Storage::new_on(&rt, a, BYTES).unwrap();
        set(&rt, &next, a, 7.0);
        rt.driver().stream_synchronize(a).unwrap();
        drop(gate);
        rt.driver().stream_synchronize(b).unwrap();
        wrong += usize::from(values(&rt, &y).iter().any(|&v| v != 2.0));
        drop(next);
    }
    clean(&rt);
    wrong
}

#[test]
fn a_typed_kernels_operand_is_not_reused_under_it_without_record_stream() {
    assert_eq!(
        free_while_another_stream_reads(""),
        0,
        "auto: every round right"
    );
    assert_eq!(
        free_while_another_stream_reads("stream_order:manual"),
        20,
        "manual, no record_stream: every round read the next tensor's 7.0"
    );
}

#[test]
fn writing_a_lazy_clone_through_a_kernel_leaves_the_source() {
    let (rt, _) = runtime("");
    let s = rt.current_stream(0).unwrap();
    let a = Storage::new_on(&rt, s, BYTES).unwrap();
    set(&rt, &a, s, 3.0);
    let c = a.lazy_clone().unwrap();
    assert!(c.is_cow());
    // Reading the clone shares; writing it materializes first, on the kernel's stream.
    let other = rt.create_stream(0).unwrap();
    rt.launch_host(other, (a.reads::<f32>(), c.writes::<f32>()), |(a, c)| {
        c.iter_mut().zip(a).for_each(|(o, i)| *o = i + 1.0);
        Ok(())
    })
    .unwrap();
    assert!(!c.is_cow());
    assert!(values(&rt, &a).iter().all(|&v| v == 3.0));
    assert!(values(&rt, &c).iter().all(|&v| v == 4.0));
    clean(&rt);
}

fn invalid(result: cudalloc::Result<()>, words: &[&str]) {
    let err = result.expect_err("the door refuses it");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let text = err.to_string();
    for w in words {
        assert!(text.contains(w), "{text:?} lacks {w:?}");
    }
}

/// An element type aligned beyond the allocator's 512 bytes.
#[derive(Clone, Copy)]
#[repr(C, align(1024))]
struct Wide([u8; 1024]);
// SAFETY: an array of bytes with no padding (size 1024 = alignment); any bit pattern is a value.
unsafe impl bytemuck::Zeroable for Wide {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for Wide {}

#[test]
fn the_door_refuses_what_a_kernel_may_not_see() {
    let (rt, _) = runtime("");
    let s = rt.current_stream(0).unwrap();
    let x = Storage::new_on(&rt, s, 4096).unwrap();
    let odd = Storage::new_on(&rt, s, 10).unwrap();
    invalid(
        rt.launch_host(s, x.reads::<f32>().elements(1000..1025), |_| Ok(())),
        &["operand 0", "1000..1025", "4096 bytes"],
    );
    invalid(
        rt.launch_host(s, odd.reads::<u32>(), |_| Ok(())),
        &["operand 0", "10 bytes", "whole number", "u32"],
    );
    invalid(
        rt.launch_host(s, x.reads::<()>(), |_| Ok(())),
        &["zero-sized"],
    );
    #[allow(clippy::reversed_empty_ranges)]
    invalid(
        rt.launch_host(s, x.reads::<u8>().elements(5..4), ok_u8),
        &["5..4"],
    );
    // One storage seen through `&mut` and another slice, or through a clone of its handle.
    let alias = x.clone();
    invalid(
        rt.launch_host(s, (x.reads::<u32>(), alias.writes::<u32>()), |_| Ok(())),
        &["operands 0 and 1 overlap"],
    );
    invalid(
        rt.launch_host(
            s,
            (
                x.writes::<u32>().elements(0..10),
                x.writes::<u32>().elements(9..20),
            ),
            |_| Ok(()),
        ),
        &["operands 0 and 1 overlap"],
    );
    // Disjoint ranges of one storage, and two reads of the same bytes, are fine; and the slices
    // are the memory itself (40 bytes apart, as the ranges; staged buffers are not).
    rt.launch_host(s, disjoint_halves(&x), |(a, b)| {
        a.fill(1);
        b.fill(2);
        assert_eq!(b.as_ptr() as usize - a.as_ptr() as usize, 40, "zero copy");
        Ok(())
    })
    .unwrap();
    rt.launch_host(s, (x.reads::<u32>(), x.reads::<u32>()), |(a, b)| {
        assert_eq!(a, b);
        Ok(())
    })
    .unwrap();
    // Another driver's storage.
    let (other, _) = runtime("");
    let foreign = Storage::new(&other, 0, 64).unwrap();
    invalid(
        rt.launch_host(s, foreign.reads::<u8>(), ok_u8),
        &["operand 0 is memory of another driver"],
    );
    // Alignment: a 2048-byte storage off a 1024-byte boundary, for an element aligned to 1024;
    // an empty range of it is no access and is fine.
    let misaligned = misaligned_for_1024(&rt, s);
    invalid(
        rt.launch_host(s, misaligned.reads::<Wide>().elements(0..1), |_| Ok(())),
        &["not aligned", "Wide"],
    );
    rt.launch_host(s, misaligned.reads::<Wide>().elements(0..0), |w| {
        assert!(w.is_empty());
        Ok(())
    })
    .unwrap();
    // An empty storage is an operand like any other (an empty slice).
    let empty = Storage::new_on(&rt, s, 0).unwrap();
    rt.launch_host(s, (empty.writes::<f32>(), x.reads::<u8>()), |(e, x)| {
        assert!(e.is_empty() && x.len() == 4096);
        Ok(())
    })
    .unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    clean(&rt);
}

fn disjoint_halves(x: &Storage) -> (host_kernel::Writes<'_, u32>, host_kernel::Writes<'_, u32>) {
    (
        x.writes::<u32>().elements(0..10),
        x.writes::<u32>().elements(10..20),
    )
}

fn ok_u8(_: &[u8]) -> cudalloc::Result<()> {
    Ok(())
}

#[test]
fn a_kernels_error_fails_its_stream_with_its_message() {
    let (rt, _) = runtime("");
    let s = rt.create_stream(0).unwrap();
    let x = Storage::new_on(&rt, s, 64).unwrap();
    rt.launch_host(s, x.reads::<u8>(), |_| {
        Err(cudalloc::Error::kernel(std::io::Error::other(
            "the reference kernel found a NaN",
        )))
    })
    .unwrap();
    let err = rt.driver().stream_synchronize(s).unwrap_err();
    assert!(err.to_string().contains("found a NaN"), "{err}");
}

/// A typed kernel's panic was reported as a driver error with the panic's text alone (issue 47):
/// it is its own kind, naming the kernel's operands, in both the zero-copy and the staged paths.
#[test]
fn a_kernel_panic_is_a_kernel_error() {
    for conf in ["", "stream_order:manual"] {
        let (rt, _) = runtime(conf);
        let s = rt.create_stream(0).unwrap();
        let x = Storage::new_on(&rt, s, 4096).unwrap();
        let y = Storage::new_on(&rt, s, 64).unwrap();
        rt.launch_host(
            s,
            (x.reads::<f32>(), y.writes::<u32>().elements(2..6)),
            |(x, _y)| {
                assert!(x.len() > 4096, "the kernel's own bug");
                Ok(())
            },
        )
        .unwrap();
        let err = rt.driver().stream_synchronize(s).unwrap_err();
        // The stream's sticky error is the kernel's own.
        let text = format!("{err}");
        for words in [
            "a host kernel panicked",
            "the kernel's own bug",
            "operand 0: reads 1024 f32 (elements 0..1024) of a 4096-byte storage",
            "operand 1: writes 4 u32 (elements 2..6) of a 64-byte storage",
        ] {
            assert!(text.contains(words), "{conf}: {words:?} not in {text}");
        }
        assert_eq!(err.kind(), ErrorKind::KernelPanic, "{conf}: {err:?}");
    }
}

#[test]
fn manual_order_and_shared_memory_are_staged_and_right() {
    // `manual`: the staged path, for a correct program (one stream).
    let (rt, _) = runtime("stream_order:manual");
    let s = rt.current_stream(0).unwrap();
    let x = Storage::new_on(&rt, s, BYTES).unwrap();
    set(&rt, &x, s, 5.0);
    rt.launch_host(s, x.writes::<f32>().elements(0..4), |x| {
        x.iter_mut().for_each(|v| *v += 1.0);
        Ok(())
    })
    .unwrap();
    // Manual: the program orders the read on another stream (here, by synchronizing).
    rt.driver().stream_synchronize(s).unwrap();
    let v = values(&rt, &x);
    assert_eq!(v[..5], [6.0, 6.0, 6.0, 6.0, 5.0]);
    rt.launch_host(s, disjoint_halves(&x), |(a, b)| {
        let apart = (b.as_ptr() as usize).wrapping_sub(a.as_ptr() as usize);
        assert_ne!(apart, 40, "staged: private buffers, not the memory");
        Ok(())
    })
    .unwrap();
    rt.driver().stream_synchronize(s).unwrap();

    // Memory shared by IPC (another process may map it): staged, right.
    let (producer, _) = runtime("");
    let ps = producer.current_stream(0).unwrap();
    let shared = Storage::new_on(&producer, ps, BYTES).unwrap();
    set(&producer, &shared, ps, 1.5);
    let _handle = shared.share_ipc().unwrap();
    rt_write_double(&producer, &shared, ps);
    assert!(values(&producer, &shared).iter().all(|&v| v == 3.0));
    clean(&producer);
}

fn rt_write_double(rt: &Runtime, s: &Storage, stream: StreamId) {
    rt.launch_host(stream, s.writes::<f32>(), |x| {
        x.iter_mut().for_each(|v| *v *= 2.0);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_captured_kernel_runs_at_each_replay() {
    let (rt, _) = runtime("");
    let s = rt.create_stream(0).unwrap();
    let x = Storage::new_on(&rt, s, 64).unwrap();
    rt.launch_host(s, x.writes::<u32>(), |x| {
        x.fill(0);
        Ok(())
    })
    .unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    let capture = rt.begin_capture(s, None, CaptureMode::ThreadLocal).unwrap();
    rt.launch_host(s, x.writes::<u32>(), |x| {
        x.iter_mut().for_each(|v| *v += 1);
        Ok(())
    })
    .unwrap();
    let graph = capture.end().unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    let read = |rt: &Runtime| {
        let mut b = [0u8; 4];
        x.copy_to_host(x.runtime().current_stream(x.device()).unwrap(), 0, &mut b)
            .unwrap();
        let _ = rt;
        u32::from_le_bytes(b)
    };
    assert_eq!(read(&rt), 0, "captured, not run");
    for _ in 0..3 {
        graph.replay(s).unwrap();
    }
    rt.driver().stream_synchronize(s).unwrap();
    assert_eq!(read(&rt), 3);
    drop(graph);
    clean(&rt);
}

#[test]
fn host_kernels_are_the_host_backends() {
    let rt = Arc::new(
        Runtime::builder()
            .build(Arc::new(
                cudalloc::backend::SimDriver::new(1, 1 << 30).unwrap(),
            ))
            .unwrap(),
    );
    let s = rt.current_stream(0).unwrap();
    let x = Storage::new_on(&rt, s, 64).unwrap();
    invalid(rt.launch_host(s, x.reads::<u8>(), ok_u8), &["host backend"]);
}
