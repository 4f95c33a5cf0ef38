//! What storages ordering themselves costs (`stream_order:auto` against `manual`, side by side in
//! one run): an access through the storage's door on one stream, and a short kernel sequence
//! (4 KiB memsets through `mutable_data_ptr_on`) on one stream and alternating between two — in
//! manual mode with the waits a correct program writes by hand (`stream_wait_stream`), in auto
//! mode with none written.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

mod common;

use criterion::{criterion_group, criterion_main, Criterion};
use cudalloc::{AllocatorConfig, Runtime, Storage};

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
                    d.memset(s, p, 1, 4096).unwrap();
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
                        d.memset(on, p, 1, 4096).unwrap();
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

criterion_group!(benches, order);
criterion_main!(benches);
