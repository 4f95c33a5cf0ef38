//! Runtimes and typed host kernels for the storage suites (`storage_order.rs`,
//! `storage_host_kernels.rs`, `storage_kernel_races.rs`).

use std::sync::{Arc, Mutex};

use cudalloc::{
    backend::HostDriver, sanitizer::HazardReport, sanitizer::Sanitize, AllocatorConfig, Runtime,
    Storage, StreamId,
};

/// A runtime over `host` with `conf`, invariants checked after every operation, the sanitizer on
/// when `sanitize`.
pub fn build(host: &Arc<HostDriver>, conf: &str, sanitize: bool) -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(AllocatorConfig::parse(conf).unwrap())
            .sanitize(if sanitize {
                Sanitize::On(Default::default())
            } else {
                Sanitize::Off
            })
            .check_invariants(true)
            .build(host.clone())
            .unwrap(),
    )
}

/// A runtime with `conf` over a fresh host driver, and the driver.
pub fn runtime(conf: &str, sanitize: bool) -> (Arc<Runtime>, Arc<HostDriver>) {
    let host = Arc::new(super::host_driver());
    (build(&host, conf, sanitize), host)
}

/// An ordered runtime under the sanitizer (which must stay clean: [`clean`]); a `manual` one
/// without it, to measure the wrong bytes it would refuse.
pub fn ordered_or_manual(conf: &str) -> (Arc<Runtime>, Arc<HostDriver>) {
    runtime(conf, !conf.contains("manual"))
}

/// The sanitizer's reports so far (none without it).
pub fn reports(rt: &Runtime) -> Vec<HazardReport> {
    rt.sanitizer().map(|s| s.take_reports()).unwrap_or_default()
}

/// The sanitizer found nothing.
pub fn clean(rt: &Runtime) {
    let reports = reports(rt);
    assert!(reports.is_empty(), "{reports:#?}");
}

/// Sets every `f32` of `s` to `v` with a typed kernel on `stream`.
pub fn set(rt: &Runtime, s: &Storage, stream: StreamId, v: f32) {
    rt.launch_host(stream, s.writes::<f32>(), move |x| {
        x.fill(v);
        Ok(())
    })
    .unwrap();
}

/// The `f32`s of `s`, read by a typed kernel on a fresh stream (synchronized).
pub fn values(rt: &Runtime, s: &Storage) -> Vec<f32> {
    let stream = rt.create_stream(s.device()).unwrap();
    let out = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&out);
    rt.launch_host(stream, s.reads::<f32>(), move |x| {
        *sink.lock().unwrap() = x.to_vec();
        Ok(())
    })
    .unwrap();
    rt.synchronize(stream).unwrap();
    let v = out.lock().unwrap().clone();
    v
}
