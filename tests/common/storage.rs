//! Runtimes and typed host kernels for the storage suites (`storage_order.rs`,
//! `storage_host_kernels.rs`, `storage_kernel_races.rs`).

use std::sync::{Arc, Mutex};

use cudalloc::{
    backend::HostDriver, sanitizer::HazardReport, sanitizer::Sanitize, AllocatorConfig, Runtime,
    Storage, StreamId,
};

/// A runtime over `host` with `conf`, invariants checked after every operation, the sanitizer on
/// when `sanitize`.
pub(crate) fn build(host: &Arc<HostDriver>, conf: &str, sanitize: bool) -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(AllocatorConfig::parse(&super::with_test_settings(conf)).unwrap())
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
pub(crate) fn runtime(conf: &str, sanitize: bool) -> (Arc<Runtime>, Arc<HostDriver>) {
    let host = Arc::new(super::host_driver());
    (build(&host, conf, sanitize), host)
}

/// An ordered runtime under the sanitizer (which must stay clean: [`clean`]); a `manual` one
/// without it, to measure the wrong bytes it would refuse.
pub(crate) fn ordered_or_manual(conf: &str) -> (Arc<Runtime>, Arc<HostDriver>) {
    runtime(conf, !conf.contains("manual"))
}

/// The sanitizer's reports so far (none without it).
pub(crate) fn reports(rt: &Runtime) -> Vec<HazardReport> {
    rt.sanitizer().map(|s| s.take_reports()).unwrap_or_default()
}

/// The sanitizer found nothing.
pub(crate) fn clean(rt: &Runtime) {
    let reports = reports(rt);
    assert!(reports.is_empty(), "{reports:#?}");
}

/// Sets every `f32` of `s` to `v` with a typed kernel on `stream`.
pub(crate) fn set(rt: &Runtime, s: &Storage, stream: StreamId, v: f32) {
    rt.launch_host(stream, s.writes::<f32>(), move |x| {
        x.fill(v);
        Ok(())
    })
    .unwrap();
}

/// The `f32`s of `s`, read by a typed kernel on a fresh stream (synchronized).
pub(crate) fn values(rt: &Runtime, s: &Storage) -> Vec<f32> {
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

/// A bounded wait for what a correct program never sends while a probe holds its slice (an upper
/// bound only: a correct outcome waits it out, no outcome depends on it).
pub(crate) const PROBE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// What a probe kernel saw while it held its slice.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Seen {
    /// The slice's address (compare with the storage's address: zero copy when equal).
    pub ptr: u64,
    /// The signal came while the kernel held its slice.
    pub signalled: bool,
    /// The slice's bytes changed while the kernel held it.
    pub changed: bool,
    /// The first element after the wait (shown in failure messages).
    pub first_after: f32,
}

/// A probe kernel holding a storage as a slice until signalled (or [`PROBE_WAIT`]).
pub(crate) struct Blocker {
    pub seen: Arc<Mutex<Option<Seen>>>,
    pub tx: std::sync::mpsc::Sender<()>,
}

impl Blocker {
    /// What it saw (after its stream ran).
    pub(crate) fn seen(&self) -> Seen {
        self.seen.lock().unwrap().expect("the blocker ran")
    }
}

fn probe(rt: &Runtime, stream: StreamId, x: &Storage, marker: Option<f32>) -> Blocker {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = Mutex::new(rx);
    let seen = Arc::new(Mutex::new(None));
    let out = Arc::clone(&seen);
    let look = move |x: &[f32], before: &[f32]| {
        let ptr = x.as_ptr() as u64;
        let signalled = rx.lock().unwrap().recv_timeout(PROBE_WAIT).is_ok();
        let x = std::hint::black_box(x);
        *out.lock().unwrap() = Some(Seen {
            ptr,
            signalled,
            changed: x != before,
            first_after: x[0],
        });
    };
    match marker {
        Some(m) => rt.launch_host(stream, x.writes::<f32>(), move |x| {
            x.fill(m);
            let before = x.to_vec();
            look(x, &before);
            Ok(())
        }),
        None => rt.launch_host(stream, x.reads::<f32>(), move |x| {
            let before = x.to_vec();
            look(x, &before);
            Ok(())
        }),
    }
    .unwrap();
    Blocker { seen, tx }
}

/// A probe writing `marker` into `x` on `stream`, then holding it.
pub(crate) fn block_writing(rt: &Runtime, stream: StreamId, x: &Storage, marker: f32) -> Blocker {
    probe(rt, stream, x, Some(marker))
}

/// A probe reading `x` on `stream`, holding it.
pub(crate) fn block_reading(rt: &Runtime, stream: StreamId, x: &Storage) -> Blocker {
    probe(rt, stream, x, None)
}

/// Synchronizes `streams`.
pub(crate) fn sync(rt: &Runtime, streams: &[StreamId]) {
    for &s in streams {
        rt.synchronize(s).unwrap();
    }
}

/// A storage of 2048 bytes whose address is off a 1024-byte boundary (blocks are 512-byte aligned
/// and packed in their segment: one of a few, with 512-byte pads between, is).
pub(crate) fn misaligned_for_1024(rt: &Arc<Runtime>, s: StreamId) -> Storage {
    let mut keep = Vec::new();
    for _ in 0..4 {
        let w = Storage::new_on(rt, s, 2048).unwrap();
        if !w.unordered_data_ptr().0.is_multiple_of(1024) {
            return w;
        }
        keep.push(w);
        keep.push(Storage::new_on(rt, s, 512).unwrap());
    }
    panic!("no 2048-byte storage off a 1024-byte boundary among four with pads");
}
