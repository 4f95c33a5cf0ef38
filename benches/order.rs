//! What storages ordering themselves costs (`stream_order:auto` against `manual`, side by side in
//! one run): an access through the storage's door on one stream, and a short kernel sequence
//! (4 KiB memsets through `mutable_data_ptr_on`) on one stream and alternating between two — in
//! manual mode with the waits a correct program writes by hand (`stream_wait_stream`), in auto
//! mode with none written; and a typed host kernel seeing the memory itself, staged, and the raw
//! escape hatch by copies.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

mod common;

use criterion::{criterion_group, criterion_main, Criterion};
use cudalloc::{backend::HostKernelMemory, backend::HostRange, AllocatorConfig, Runtime, Storage};

const LAUNCHES: usize = 64;

fn runtime(conf: &str) -> Arc<Runtime> {
    Arc::new(
        Runtime::new(
            common::bench_driver(1 << 30),
            AllocatorConfig::parse(conf).unwrap(),
        )
        .unwrap(),
    )
}

fn order(c: &mut Criterion) {
    let mut g = c.benchmark_group("stream_order");
    g.measurement_time(Duration::from_secs(3));
    for (mode, conf) in [("auto", ""), ("manual", "stream_order:manual")] {
        let rt = runtime(conf);
        let (s, t) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
        let x = Storage::new_on(&rt, s, 4096).unwrap();
        g.bench_function(format!("access on one stream/{mode}"), |b| {
            b.iter(|| x.mutable_data_ptr_on(s).unwrap())
        });
        let d = rt.driver().clone();
        g.bench_function(format!("{LAUNCHES} launches on one stream/{mode}"), |b| {
            b.iter(|| {
                for _ in 0..LAUNCHES {
                    let p = x.mutable_data_ptr_on(s).unwrap();
                    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                    unsafe { d.memset(s, p, 1, 4096) }.unwrap();
                }
                d.stream_synchronize(s).unwrap();
            })
        });
        g.bench_function(
            format!("{LAUNCHES} launches alternating two streams/{mode}"),
            |b| {
                b.iter(|| {
                    let mut last = s;
                    for i in 0..LAUNCHES {
                        let on = if i % 2 == 0 { s } else { t };
                        if conf.contains("manual") {
                            // The wait a correct manual program writes itself.
                            d.stream_wait_stream(on, last).unwrap();
                        }
                        let p = x.mutable_data_ptr_on(on).unwrap();
                        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                        unsafe { d.memset(on, p, 1, 4096) }.unwrap();
                        last = on;
                    }
                    if conf.contains("manual") {
                        // The free must wait for `t` too: record it, as auto mode does.
                        x.record_stream(t).unwrap();
                    }
                    d.stream_synchronize(s).unwrap();
                    d.stream_synchronize(t).unwrap();
                })
            },
        );
    }
    g.finish();
}

/// A typed host kernel over 4 MiB (x → y = 2x, f32): slices over the memory itself (`auto`),
/// over private copies (`manual`: staged), and the raw escape hatch reading and writing by copies
/// (`HostKernelMemory::read`/`write`), side by side.
fn host_kernels(c: &mut Criterion) {
    const BYTES: u64 = 4 << 20;
    let mut g = c.benchmark_group("host_kernel_4MiB");
    g.measurement_time(Duration::from_secs(3));
    for (mode, conf) in [
        ("typed, memory itself", ""),
        ("typed, staged", "stream_order:manual"),
    ] {
        let rt = runtime(conf);
        let s = rt.create_stream(0).unwrap();
        let (x, y) = (
            Storage::new_on(&rt, s, BYTES).unwrap(),
            Storage::new_on(&rt, s, BYTES).unwrap(),
        );
        g.bench_function(mode, |b| {
            b.iter(|| {
                rt.launch_host(s, (x.reads::<f32>(), y.writes::<f32>()), |(x, y)| {
                    y.iter_mut().zip(x).for_each(|(o, i)| *o = 2.0 * i);
                    Ok(())
                })
                .unwrap();
                rt.driver().stream_synchronize(s).unwrap();
            })
        });
    }
    let rt = runtime("");
    let s = rt.create_stream(0).unwrap();
    let (x, y) = (
        Storage::new_on(&rt, s, BYTES).unwrap(),
        Storage::new_on(&rt, s, BYTES).unwrap(),
    );
    let host = rt.driver().as_host().unwrap();
    g.bench_function("raw, by copies", |b| {
        b.iter(|| {
            let ranges = [
                HostRange::read(x.data_ptr_on(s).unwrap(), BYTES),
                HostRange::write(y.mutable_data_ptr_on(s).unwrap(), BYTES),
            ];
            // SAFETY: no typed kernel sees these storages.
            unsafe {
                host.enqueue_host(s, ranges, |m: &mut HostKernelMemory<2>| {
                    let bytes = m.to_vec(0)?;
                    let out: Vec<u8> = bytes
                        .chunks_exact(4)
                        .flat_map(|c| {
                            (2.0 * f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
                        })
                        .collect();
                    m.write(1, 0, &out)
                })
            }
            .unwrap();
            rt.driver().stream_synchronize(s).unwrap();
        })
    });
    g.finish();
}

/// Issue 36's target: a typed host kernel adding two 64 MiB `f32` tensors (`z = x + y`, slices over
/// the memory itself) against the same loop over plain `Vec<f32>` in this process, side by side.
fn add_64mib(c: &mut Criterion) {
    const ELEMS: usize = (64 << 20) / 4;
    const BYTES: u64 = (ELEMS * 4) as u64;
    let mut g = c.benchmark_group("add_two_64MiB_f32");
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(8));
    let (xs, ys) = (vec![1.5f32; ELEMS], vec![2.25f32; ELEMS]);
    let mut zs = vec![0f32; ELEMS];
    g.bench_function("plain Vec<f32> loop", |b| {
        b.iter(|| {
            zs.iter_mut()
                .zip(std::hint::black_box(&xs).iter().zip(&ys))
                .for_each(|(z, (x, y))| *z = x + y);
            std::hint::black_box(&zs);
        })
    });
    let rt = runtime("");
    let s = rt.create_stream(0).unwrap();
    let [x, y, z] = [0; 3].map(|_| Storage::new_on(&rt, s, BYTES).unwrap());
    x.copy_from_host(s, 0, bytemuck::cast_slice(&xs)).unwrap();
    y.copy_from_host(s, 0, bytemuck::cast_slice(&ys)).unwrap();
    let add = || {
        rt.launch_host(
            s,
            (x.reads::<f32>(), y.reads::<f32>(), z.writes::<f32>()),
            |(x, y, z)| {
                z.iter_mut()
                    .zip(x.iter().zip(y))
                    .for_each(|(z, (x, y))| *z = x + y);
                Ok(())
            },
        )
        .unwrap();
        rt.synchronize(s).unwrap();
    };
    // Once outside the measurement, so the check below holds when a filter skips the group.
    add();
    g.bench_function("typed host kernel", |b| b.iter(add));
    g.finish();
    let mut back = vec![0u8; BYTES as usize];
    z.copy_to_host(s, 0, &mut back).unwrap();
    assert!(bytemuck::pod_collect_to_vec::<u8, f32>(&back)
        .iter()
        .all(|&v| v == 3.75));
}

/// Issue 47's target: a typed launch (`Runtime::launch` of a `Kernel` declared once: the door's
/// checks, the operands' ordering under their storages' locks, the host body over slices) against
/// the raw escape hatch (`enqueue_host`: unchecked, unordered), the same tiny body (one `f32` read,
/// one written) — 64 launches on one stream and one synchronize per iteration, so the launch
/// path is what is measured. The stream is held by a gate while the 64 are queued, so the
/// worker's sleeps and wake-ups between launches (the scheduler's, on this 2-core machine) do not
/// decide the figure; they run as one batch when the gate opens.
fn launch_small(c: &mut Criterion) {
    let mut g = c.benchmark_group("launch_4KiB");
    g.measurement_time(Duration::from_secs(3));
    let rt = runtime("");
    let s = rt.create_stream(0).unwrap();
    let (x, y) = (
        Storage::new_on(&rt, s, 4096).unwrap(),
        Storage::new_on(&rt, s, 4096).unwrap(),
    );
    let kernel = cudalloc::kernel::Kernel::new("bump", |(x, y): (&[f32], &mut [f32])| {
        y[0] = x[0] + 1.0;
        Ok(())
    });
    let host = rt.driver().as_host().unwrap();
    g.bench_function("typed (Runtime::launch)", |b| {
        b.iter(|| {
            let gate = host.gate_stream(s).unwrap();
            for _ in 0..LAUNCHES {
                rt.launch(s, (x.reads::<f32>(), y.writes::<f32>()), &kernel)
                    .unwrap();
            }
            drop(gate);
            rt.driver().stream_synchronize(s).unwrap();
        })
    });
    g.bench_function("raw (enqueue_host)", |b| {
        b.iter(|| {
            let gate = host.gate_stream(s).unwrap();
            for _ in 0..LAUNCHES {
                let ranges = [
                    HostRange::read(x.unordered_data_ptr(), 4096),
                    HostRange::write(y.unordered_mutable_data_ptr().unwrap(), 4096),
                ];
                // SAFETY: no typed kernel runs on these storages while this group runs raw.
                unsafe {
                    host.enqueue_host(s, ranges, |m: &mut HostKernelMemory<2>| {
                        let mut v = [0u8; 4];
                        m.read(0, 0, &mut v)?;
                        m.write(1, 0, &(f32::from_le_bytes(v) + 1.0).to_le_bytes())
                    })
                }
                .unwrap();
            }
            drop(gate);
            rt.driver().stream_synchronize(s).unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, order, host_kernels, add_64mib, launch_small);
criterion_main!(benches);
