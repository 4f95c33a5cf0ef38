//! The simulated device and `cudalloc replay`: traces in four formats, replayed through the real
//! allocator with exact peaks; bad input is an error, never a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cudalloc::backend::capability::{Ipc, Kernels, VirtualMemory};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cudalloc::replay::{self, ReplayOptions, TraceFormat, TraceOp};
use cudalloc::{
    backend::Driver, backend::EventFlags, backend::HostDriver, backend::SimDriver, AllocatorConfig,
    DataPtr, ErrorKind, Runtime,
};

const MIB: u64 = 1 << 20;

fn no_progress(_: u64) {}

#[test]
fn the_simulated_device_enforces_its_capacity_and_backs_nothing() {
    let d = SimDriver::new(1, 64 * MIB).unwrap();
    let a = d.malloc(0, 40 * MIB).unwrap();
    let err = d.malloc(0, 40 * MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert_eq!(d.mem_info(0).unwrap().free, 24 * MIB);
    let s = d.default_stream(0).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.fill_pattern(s, a, MIB, 1) }.unwrap();
    assert!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.fill_pattern(s, a.offset(40 * MIB).unwrap(), 1, 1) }.is_err(),
        "past the end"
    );
    let mut back = [0u8; 16];
    assert!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.copy_device_to_host(s, &mut back, a) }.is_err(),
        "nothing is stored"
    );
    assert!(d.ipc_export_memory(a).is_err());
    d.free(a).unwrap();
    assert!(d.free(a).is_err(), "double free");
    assert_eq!(d.mem_info(0).unwrap().free, 64 * MIB);
    assert!(d.stream_destroy(s).is_err(), "the default stream stays");
    let e = d.event_create(0, EventFlags::default()).unwrap();
    d.event_record(e, s).unwrap();
    assert!(d.event_query(e).unwrap());
    d.event_destroy(e).unwrap();
    assert!(d.event_query(e).is_err());
    // Virtual memory: chunks count against the capacity until released and unmapped.
    let g = d.vm_granularity(0).unwrap();
    let base = d.vm_reserve(0, 4 * g).unwrap();
    let c = d.vm_create_chunk(0, g).unwrap();
    d.vm_map(base, c).unwrap();
    d.vm_release_chunk(c).unwrap();
    assert_eq!(
        d.mem_info(0).unwrap().free,
        64 * MIB - g,
        "released but mapped"
    );
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, base, 0, g) }.unwrap();
    assert!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(s, base, 0, g + 1) }.is_err(),
        "into unmapped pages"
    );
    d.vm_unmap(base, g).unwrap();
    assert_eq!(d.mem_info(0).unwrap().free, 64 * MIB);
    d.vm_free_reservation(base).unwrap();
    assert!(SimDriver::new(0, 1).is_err() && SimDriver::new(1, 0).is_err());
    assert!(SimDriver::new(1 << 30, 1).is_err(), "no billion devices");
}

#[test]
fn sharing_memory_of_the_simulated_device_is_refused_and_leaves_the_storage_alone() {
    for conf in ["", "expandable_segments:True"] {
        let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 1 << 30).unwrap());
        let rt = Arc::new(
            cudalloc::Runtime::new(driver, AllocatorConfig::parse(conf).unwrap()).unwrap(),
        );
        let s = cudalloc::Storage::new(&rt, 0, 3 << 20).unwrap();
        let err = s.share_ipc().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{conf:?}: {err}");
        assert!(err.to_string().contains("simulated"), "{err}");
        s.fill_pattern(1).unwrap();
        assert_eq!(rt.ipc_limbo(), (0, 0));
        let c = s.lazy_clone().unwrap();
        drop(s);
        drop(c);
        assert_eq!(rt.memory_stats(0).unwrap().allocated_bytes.all.current, 0);
    }
}

/// Replays an RMM-style random trace directly on `driver`: the memory stats at the end.
fn random_run(driver: Arc<dyn Driver>, conf: &str) -> BTreeMap<String, i64> {
    let a = Runtime::new(driver, AllocatorConfig::parse(conf).unwrap()).unwrap();
    let mut live: Vec<DataPtr> = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..3000 {
        if live.len() < 20 && next() % 3 != 0 || live.is_empty() {
            live.push(a.allocate(0, 1 + next() % (24 * MIB)).unwrap());
        } else {
            let at = (next() % live.len() as u64) as usize;
            live.swap_remove(at);
        }
    }
    a.memory_stats_map(0).unwrap()
}

#[test]
fn the_allocator_behaves_on_the_simulated_device_exactly_as_on_the_host_backend() {
    for conf in ["", "expandable_segments:True", "max_split_size_mb:32"] {
        let host = HostDriver::builder()
            .devices(1)
            .memory_per_device(1 << 30)
            .poison_on_free(false)
            .build()
            .unwrap();
        let sim = SimDriver::new(1, 1 << 30).unwrap();
        assert_eq!(
            random_run(Arc::new(host), conf),
            random_run(Arc::new(sim), conf),
            "{conf:?}: every stat equal"
        );
    }
}

#[test]
fn a_cudalloc_trace_replays_to_the_peaks_the_allocator_recorded() {
    // Record a run's history, write it as JSON lines, replay it: same peaks as the run itself.
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 4 << 30).unwrap());
    let a = Runtime::new(driver, AllocatorConfig::default()).unwrap();
    a.record_memory_history(cudalloc::stats::HistoryOptions::new(
        cudalloc::stats::HistoryMode::All,
        100_000,
    ));
    let mut live = HashMap::new();
    for i in 0..400u64 {
        live.insert(i, a.allocate(0, (i % 37 + 1) * 300_000).unwrap());
        if i % 3 == 0 {
            live.remove(&(i / 2));
        }
    }
    drop(live);
    let stats = a.memory_stats(0).unwrap();
    let text = cudalloc::stats::trace_json_lines(&a.snapshot().trace);
    let trace = replay::parse(text.as_bytes()).unwrap();
    assert_eq!(trace.format, TraceFormat::CudallocJsonLines);
    assert_eq!(trace.allocations(), 400);
    assert_eq!(trace.unmatched_frees, 0);
    let r = replay::replay(&trace, &ReplayOptions::new("", 4 << 30), &mut no_progress).unwrap();
    // Rounded sizes in the trace round to themselves: the same blocks, the same peaks.
    assert_eq!(r.peak_allocated as i64, stats.allocated_bytes.all.peak);
    assert_eq!(r.peak_reserved as i64, stats.reserved_bytes.all.peak);
    assert!(r.first_oom.is_none());
}

#[test]
fn a_pytorch_snapshot_written_by_cudalloc_replays_to_the_same_peaks() {
    // Both features at once: the history written as PyTorch's pickle, read back by the replay.
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 4 << 30).unwrap());
    let a = Runtime::new(driver, AllocatorConfig::default()).unwrap();
    a.record_memory_history(cudalloc::stats::HistoryOptions::new(
        cudalloc::stats::HistoryMode::All,
        100_000,
    ));
    let side = a.create_stream(0).unwrap();
    let mut live = Vec::new();
    // The exact device-wide peak, read as the run goes (currents add up exactly across streams).
    let mut exact_peak = 0;
    let mut observe = |a: &Runtime| {
        exact_peak = exact_peak.max(a.memory_stats(0).unwrap().allocated_bytes.all.current);
    };
    for i in 0..300u64 {
        let on = if i % 2 == 0 {
            a.default_stream(0).unwrap()
        } else {
            side
        };
        live.push(a.allocate_on(on, (i % 13 + 1) * 700_000).unwrap());
        observe(&a);
        if i % 4 == 3 {
            live.swap_remove((i as usize * 7) % live.len());
        }
    }
    drop(live);
    let bytes = a.snapshot().to_pytorch_pickle(&a.config()).unwrap();
    let trace = replay::parse(&bytes).unwrap();
    assert_eq!(trace.format, TraceFormat::PytorchSnapshot);
    assert_eq!(trace.allocations(), 300);
    assert_eq!(trace.unmatched_frees, 0);
    let r = replay::replay(&trace, &ReplayOptions::new("", 4 << 30), &mut no_progress).unwrap();
    assert_eq!(r.peak_allocated as i64, exact_peak);
    assert_eq!(r.samples.last().unwrap().allocated, 0);
}

#[test]
fn peaks_are_exact_across_streams() {
    // 512 bytes on stream 0, freed, then 512 on stream 1: PyTorch's peak is 512 (a sum of
    // per-stream peaks would say 1024).
    let text = "\
{\"action\":\"alloc\",\"addr\":4096,\"size\":512,\"stream\":0}
{\"action\":\"free_requested\",\"addr\":4096,\"size\":512,\"stream\":0}
{\"action\":\"alloc\",\"addr\":8192,\"size\":512,\"stream\":7}
{\"action\":\"free_requested\",\"addr\":8192,\"size\":512,\"stream\":7}
";
    let trace = replay::parse(text.as_bytes()).unwrap();
    let r = replay::replay(&trace, &ReplayOptions::new("", 1 << 30), &mut no_progress).unwrap();
    assert_eq!(r.peak_allocated, 512);
    assert_eq!(r.peak_reserved, 4 * MIB, "one small segment per stream");
}

#[test]
fn the_first_allocation_that_does_not_fit_is_reported_and_the_replay_goes_on() {
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for i in 0..6u64 {
        text.push_str(&format!(
            "1,0.{i},allocate,0x{:x},{},0x0\n",
            0x1000 + i * 0x1000_0000,
            30 * MIB
        ));
    }
    text.push_str("1,1.0,free,0x1000,31457280,0x0\n");
    text.push_str("1,1.1,allocate failure,0x0,5,0x0\n");
    let trace = replay::parse(text.as_bytes()).unwrap();
    assert_eq!(trace.format, TraceFormat::RmmCsv);
    let r = replay::replay(&trace, &ReplayOptions::new("", 100 * MIB), &mut no_progress).unwrap();
    let oom = r.first_oom.expect("an out-of-memory");
    assert_eq!(oom.op, 3, "three of 30 MiB fit in 100 MiB");
    assert_eq!(oom.size, 30 * MIB);
    assert_eq!(r.ooms, 3);
    assert_eq!(r.peak_allocated, 90 * MIB);
}

#[test]
fn chrome_traces_pair_by_address_when_they_have_one_and_by_size_otherwise() {
    let event = |ts: u64, bytes: i64, addr: Option<u64>, device_type: i64| {
        let addr = addr.map(|a| format!(", \"Addr\": {a}")).unwrap_or_default();
        format!(
            "{{\"ph\": \"i\", \"name\": \"[memory]\", \"ts\": {ts}, \"args\": {{\"Device Type\": {device_type}, \"Device Id\": 0, \"Bytes\": {bytes}{addr}}}}}"
        )
    };
    // Without addresses: two of 1 MiB, the most recent is freed first.
    let events = [
        event(1, MIB as i64, None, 1),
        event(2, 2 * MIB as i64, None, 1),
        event(3, MIB as i64, None, 1),
        event(4, 64, None, 0), // CPU: ignored
        event(5, -(MIB as i64), None, 1),
        event(6, -(7 * MIB as i64), None, 1), // matches nothing
        "{\"name\": \"aten::add\", \"ts\": \"not a number\", \"args\": {\"Device Id\": \"x\"}}"
            .into(),
    ];
    let text = format!("{{\"traceEvents\": [{}]}}", events.join(","));
    let trace = replay::parse(text.as_bytes()).unwrap();
    assert_eq!(trace.format, TraceFormat::KinetoChrome);
    assert_eq!(trace.unmatched_frees, 1);
    assert_eq!(
        trace.ops.last(),
        Some(&TraceOp::Free { id: 3 }),
        "the most recent 1 MiB allocation"
    );
    // With addresses.
    let events = [
        event(1, MIB as i64, Some(100), 1),
        event(2, MIB as i64, Some(200), 1),
        event(3, -(MIB as i64), Some(100), 1),
    ];
    let text = format!("{{\"traceEvents\": [{}]}}", events.join(","));
    let trace = replay::parse(text.as_bytes()).unwrap();
    assert_eq!(trace.ops.last(), Some(&TraceOp::Free { id: 1 }));
}

#[test]
fn pytorch_snapshot_pickles_replay_their_device_traces() {
    use serde_pickle::{HashableValue as H, Value as V};
    let entry = |action: &str, addr: i64, size: i64, time: i64| {
        let mut m = BTreeMap::new();
        m.insert(H::String("action".into()), V::String(action.into()));
        m.insert(H::String("addr".into()), V::I64(addr));
        m.insert(H::String("size".into()), V::I64(size));
        m.insert(H::String("stream".into()), V::I64(0));
        m.insert(H::String("time_us".into()), V::I64(time));
        m.insert(H::String("frames".into()), V::List(vec![]));
        V::Dict(m)
    };
    let device0 = V::List(vec![
        entry("segment_alloc", 0, 2 << 20, 1),
        entry("alloc", 0, 512, 2),
        entry("alloc", 512, 1024, 3),
        entry("free_requested", 0, 512, 4),
        entry("free_completed", 0, 512, 5),
        entry("free_completed", 512, 1024, 6), // no request recorded: this frees it
    ]);
    let mut top = BTreeMap::new();
    top.insert(H::String("segments".into()), V::List(vec![]));
    top.insert(H::String("device_traces".into()), V::List(vec![device0]));
    let bytes = serde_pickle::value_to_vec(&V::Dict(top), serde_pickle::SerOptions::new()).unwrap();
    let trace = replay::parse(&bytes).unwrap();
    assert_eq!(trace.format, TraceFormat::PytorchSnapshot);
    assert_eq!(
        trace.ops,
        vec![
            TraceOp::Alloc {
                id: 1,
                device: 0,
                size: 512,
                stream: 0
            },
            TraceOp::Alloc {
                id: 2,
                device: 0,
                size: 1024,
                stream: 0
            },
            TraceOp::Free { id: 1 },
            TraceOp::Free { id: 2 },
        ]
    );
    let r = replay::replay(&trace, &ReplayOptions::new("", 1 << 30), &mut no_progress).unwrap();
    assert_eq!(r.peak_allocated, 1536);
}

#[test]
fn gzip_and_bad_input() {
    use std::io::Write;
    let text = "{\"action\":\"alloc\",\"addr\":1,\"size\":512}\n";
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(text.as_bytes()).unwrap();
    let trace = replay::parse(&gz.finish().unwrap()).unwrap();
    assert_eq!(trace.allocations(), 1);
    for bad in [
        &b""[..],
        b"\x80\x04garbage",
        b"\x1f\x8b\x08truncated",
        b"{\"action\":\"alloc\",\"addr\":1}\n",
        b"{\"traceEvents\": 5}",
        b"Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,zz,5,0\n",
        b"{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 1, \"args\": {\"Device Type\": 1, \"Bytes\": \"big\"}}]}",
        b"hello",
        b"{\"action\":\"alloc\",\"device\":1000000000,\"addr\":1,\"size\":512}\n",
    ] {
        let err = replay::parse(bad).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    }
    // Noise and mutations of valid inputs: errors or traces, never a panic.
    let valid = [
        text.as_bytes().to_vec(),
        b"Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,5,0x0\n1,0,free,0x10,5,0x0\n"
            .to_vec(),
    ];
    let mut x = 7u64;
    for round in 0..20_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut input = valid[(round % 2) as usize].clone();
        let at = (x % input.len() as u64) as usize;
        input[at] = (x >> 32) as u8;
        if round % 3 == 0 {
            input.truncate(at);
        }
        let _ = replay::parse(&input);
    }
}

#[test]
fn the_plot_is_an_svg_with_one_line_per_configuration() {
    let text = "{\"action\":\"alloc\",\"addr\":1,\"size\":3000000}\n{\"action\":\"alloc\",\"addr\":2,\"size\":5000000}\n";
    let trace = replay::parse(text.as_bytes()).unwrap();
    let reports: Vec<_> = ["", "expandable_segments:True"]
        .iter()
        .map(|c| {
            replay::replay(&trace, &ReplayOptions::new(*c, 1 << 30), &mut no_progress).unwrap()
        })
        .collect();
    let svg = replay::plot_svg(&reports, "test").unwrap();
    assert!(svg.starts_with("<svg"));
    assert!(svg.contains("reserved: default"));
    assert!(svg.contains("reserved: expandable_segments:True"));
    assert_eq!(
        svg.matches(">\nallocated\n<").count(),
        1,
        "one allocated line while every configuration allocated the same"
    );
}
