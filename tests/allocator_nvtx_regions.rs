//! NVTX memory regions (`nvtx_regions:True`, issue 48): through NVTX's own injection interface
//! (`NVTX_INJECTION64_PATH`), the allocator's mapped memory is a set of heaps and its live blocks
//! the regions of them — what compute-sanitizer's memcheck needs (`--nvtx yes`) to report an
//! access from one block into its neighbour of the same segment.
//!
//! The tool is `tools/nvtx-recorder` (built here with cargo): it keeps what it was told and
//! records every breach of the extension's rules (a region outside its heap or over another, a
//! heap over another, an unknown handle; on the host backend a heap not mapped when it is
//! registered or unregistered — memory given back before its heap). The randomized run asserts
//! after every step that the registered regions are exactly the live blocks (allocated, or freed
//! and waiting for other streams) of the allocator's snapshot and the heaps exactly its mapped
//! memory, under several configurations; the tool is loaded once per process, so the run is a
//! child process of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use common::faulty::FaultyDriver;
use common::rng::Rng;
use common::*;
use cudalloc::graph::CaptureMode;
use cudalloc::pool::MemPoolId;
use cudalloc::stats::{Snapshot, SnapshotBlockState};
use cudalloc::{Runtime, Storage, StreamId, WakeOptions};

const ROLE: &str = "nvtx-run";

/// Builds the recorder with this test's cargo into a target folder of its own (the outer build's
/// folder is locked while its tests run) and returns the library's path; or the one
/// `CUDALLOC_NVTX_RECORDER` names (a machine without cargo: `scripts/gpu-check.sh --prepare`).
fn recorder_library() -> PathBuf {
    if let Some(path) = std::env::var_os("CUDALLOC_NVTX_RECORDER") {
        return PathBuf::from(path);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = root.join("target").join("nvtx-recorder");
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", "nvtx-recorder", "--target-dir"])
        .arg(&target)
        .current_dir(&root)
        .status()
        .expect("cargo runs");
    assert!(status.success(), "building tools/nvtx-recorder failed");
    let library = target.join("debug").join("libnvtx_recorder.so");
    assert!(library.exists(), "{} was not built", library.display());
    library
}

#[test]
fn nvtx_regions_are_the_live_blocks_at_every_step() {
    let library = recorder_library();
    let mut command = child_command("nvtx_regions_child", ROLE);
    command
        .env("NVTX_INJECTION64_PATH", &library)
        .env(BACKEND_VAR, test_backend());
    if !cuda_suite() {
        // Host memory: the recorder checks that a heap is mapped while it is registered.
        command.env("NVTX_RECORDER_CHECK_MAPPED", "1");
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "the NVTX run failed");
    assert!(
        stdout.contains("nvtx regions: every step matched"),
        "the child did not run its steps"
    );
}

/// Without a tool attached, `nvtx_regions:True` is accepted and reports nothing (nothing to
/// load, nothing to fail); the key is printed and read back.
#[test]
fn nvtx_regions_without_a_tool_changes_nothing() {
    let _device = device_shared();
    if std::env::var_os("NVTX_INJECTION64_PATH").is_some() {
        println!("nvtx_regions_without_a_tool_changes_nothing: skipped: a tool is attached to this process");
        return;
    }
    let rt = checked_allocator(test_driver(), "nvtx_regions:True");
    assert!(rt.config().nvtx_regions);
    assert!(rt.config().to_string().contains("nvtx_regions: true"));
    let s = rt.create_stream(0).unwrap();
    let a = Storage::new_on(&rt, s, 4096).unwrap();
    drop(a);
    rt.empty_cache();
    assert_eq!(rt.memory_reserved(0).unwrap(), 0);
    let err = rt.reconfigure("nvtx_regions:False").unwrap_err();
    assert!(err.to_string().contains("nvtx_regions"), "{err}");
}

/// The recorder's state, as its report says.
#[derive(Debug, Default)]
struct Recorded {
    /// Heaps by base: (size, name).
    heaps: BTreeMap<u64, (u64, String)>,
    /// Regions by start: (size, heap base).
    regions: BTreeMap<u64, (u64, u64)>,
    errors: Vec<String>,
    calls: Vec<u64>,
}

struct Recorder {
    _library: libloading::Library,
    report: unsafe extern "C" fn(*mut u8, usize) -> usize,
}

impl Recorder {
    fn open() -> Recorder {
        let path = std::env::var_os("NVTX_INJECTION64_PATH").expect("the parent names the tool");
        // SAFETY: the recorder, already loaded by the allocator's NVTX client (same handle).
        let library = unsafe { libloading::Library::new(path) }.unwrap();
        // SAFETY: the recorder's `nvtx_recorder_report` has this type.
        let report = unsafe {
            *library
                .get::<unsafe extern "C" fn(*mut u8, usize) -> usize>(b"nvtx_recorder_report\0")
                .unwrap()
        };
        Recorder {
            _library: library,
            report,
        }
    }

    fn read(&self) -> Recorded {
        // SAFETY: a null buffer of no room asks for the length only.
        let mut len = unsafe { (self.report)(std::ptr::null_mut(), 0) };
        let text = loop {
            let mut buf = vec![0u8; len + 4096];
            // SAFETY: `buf` has `buf.len()` bytes of room.
            let n = unsafe { (self.report)(buf.as_mut_ptr(), buf.len()) };
            if n <= buf.len() {
                buf.truncate(n);
                break String::from_utf8(buf).unwrap();
            }
            len = n;
        };
        let mut out = Recorded::default();
        for line in text.lines() {
            let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
            let nums = |n: usize| -> Vec<u64> {
                rest.split(' ')
                    .take(n)
                    .map(|w| w.parse().unwrap())
                    .collect()
            };
            match kind {
                "heap" => {
                    let v = nums(2);
                    let name = rest.splitn(3, ' ').nth(2).unwrap_or("").to_owned();
                    out.heaps.insert(v[0], (v[1], name));
                }
                "region" => {
                    let v = nums(3);
                    out.regions.insert(v[0], (v[1], v[2]));
                }
                "error" => out.errors.push(rest.to_owned()),
                "calls" => out.calls = nums(4),
                other => panic!("unknown report line {other:?}"),
            }
        }
        out
    }
}

/// Ranges `(start, end)` merged where they touch.
fn coalesce(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if last.1 >= start => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// The recorder's heaps and regions against the allocator's snapshot: heaps cover exactly the
/// mapped memory; a region starts at each live block (allocated, or freed and waiting), covers
/// its requested bytes and stays inside it; nothing else is a region; no breach was recorded.
fn check(step: &str, snapshot: &Snapshot, recorded: &Recorded, tag: MemPoolId) {
    assert!(
        recorded.errors.is_empty(),
        "{step}: the tool recorded breaches: {:#?}",
        recorded.errors
    );
    let mut mapped = Vec::new();
    let mut live = BTreeMap::new();
    // Free blocks of graphs' pools: a freed block a graph may still write keeps its region.
    let mut graph_free = Vec::new();
    for seg in &snapshot.segments {
        for b in &seg.blocks {
            mapped.push((b.addr, b.addr + b.size));
            if b.state != SnapshotBlockState::Inactive {
                live.insert(b.addr, (b.requested_size, b.size));
            } else if seg.segment_pool_id.as_pair().0 != 0 {
                graph_free.push((b.addr, b.addr + b.size));
            }
        }
    }
    let heaps = coalesce(
        recorded
            .heaps
            .iter()
            .map(|(&b, (s, _))| (b, b + s))
            .collect(),
    );
    assert_eq!(
        heaps,
        coalesce(mapped),
        "{step}: the heaps are not the mapped memory"
    );
    let starts: BTreeSet<u64> = recorded.regions.keys().copied().collect();
    let expected: BTreeSet<u64> = live.keys().copied().collect();
    let missing: Vec<_> = expected.difference(&starts).collect();
    let extra: Vec<_> = starts
        .difference(&expected)
        .filter(|&&start| {
            let size = recorded.regions[&start].0;
            !graph_free
                .iter()
                .any(|&(lo, hi)| lo <= start && start + size <= hi)
        })
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{step}: the regions are not the live blocks: not registered {missing:x?}, registered but not live {extra:x?}; heaps {:x?}; segments {:x?}",
        recorded.heaps,
        snapshot
            .segments
            .iter()
            .map(|s| (s.segment_pool_id.as_pair(), s.blocks.iter().map(|b| (b.addr, b.size, b.state.name())).collect::<Vec<_>>()))
            .collect::<Vec<_>>()
    );
    // Each segment's heap is named by whose cache it is.
    for seg in &snapshot.segments {
        let first = &seg.blocks[0];
        let (_, (_, name)) = recorded
            .heaps
            .range(..=first.addr)
            .next_back()
            .expect("a heap holds every segment");
        let (a, b) = seg.segment_pool_id.as_pair();
        let expected = if seg.segment_pool_id.is_default() {
            String::new()
        } else if seg.segment_pool_id == tag {
            ", tag \"weights\"".to_owned()
        } else if a == 0 {
            format!(", memory pool ({a}, {b})")
        } else {
            format!(", graph pool ({a}, {b})")
        };
        // A stream's number is the low 36 bits of its raw id (`StreamId`'s layout).
        let stream = seg.stream & ((1 << 36) - 1);
        assert!(
            name.ends_with(&format!("stream {stream}{expected}")),
            "{step}: the heap of a segment of pool ({a}, {b}) on stream {stream} is named {name:?}"
        );
    }
    for (start, &(size, heap)) in &recorded.regions {
        let (heap_size, _) = &recorded.heaps[&heap];
        assert!(
            heap <= *start && start + size <= heap + heap_size,
            "{step}: the region at {start:#x} is outside its heap at {heap:#x}"
        );
        let Some(&(requested, block)) = live.get(start) else {
            continue; // a graph's freed block, checked above
        };
        assert!(
            requested <= size && size <= block,
            "{step}: the region at {start:#x} has {size} bytes; its block {block}, asked {requested}"
        );
    }
}

struct Walk<'a> {
    rt: &'a Arc<Runtime>,
    recorder: &'a Recorder,
    streams: Vec<StreamId>,
    live: Vec<Storage>,
    clones: Vec<Storage>,
    graphs: Vec<cudalloc::graph::Graph>,
    steps: usize,
}

impl Walk<'_> {
    fn check(&mut self, what: &str) {
        self.steps += 1;
        let tag = self.rt.tag("weights").unwrap().id();
        let snapshot = self.rt.snapshot();
        let recorded = self.recorder.read();
        check(
            &format!("step {} ({what})", self.steps),
            &snapshot,
            &recorded,
            tag,
        );
    }

    fn size(rng: &mut Rng) -> u64 {
        match rng.below(4) {
            0 => 1 + rng.below(4096),
            1 => 512 * (1 + rng.below(2048)),
            2 => (1 << 20) + rng.below(1 << 20),
            _ => (2 << 20) + rng.below(4 << 20),
        }
    }

    /// A storage of `size` bytes on `s`; on an out-of-memory (the device is small), half of what
    /// lives is dropped and the cache emptied, and `None` returned.
    fn allocate(&mut self, s: StreamId, size: u64) -> Option<Storage> {
        let made = Storage::new_on(self.rt, s, size);
        self.unless_oom(made)
    }

    /// The value, or `None` after an out-of-memory (the device is small): half of what lives is
    /// dropped and the cache emptied, and the state checked.
    fn unless_oom<T>(&mut self, result: cudalloc::Result<T>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(err) if err.kind() == cudalloc::ErrorKind::OutOfMemory => {
                self.check("out of memory");
                let keep = self.live.len() / 2;
                self.live.truncate(keep);
                self.clones.clear();
                self.graphs.clear();
                self.rt.empty_cache();
                self.check("after an out-of-memory");
                None
            }
            Err(err) => panic!("{err}"),
        }
    }

    fn step(&mut self, rng: &mut Rng, tags: bool) {
        if self.live.len() > 12 {
            self.live.remove(0);
            self.check("oldest freed");
        }
        let s = rng.pick(&self.streams);
        match rng.below(12) {
            0..=2 => {
                let Some(storage) = self.allocate(s, Self::size(rng)) else {
                    return;
                };
                storage.fill_pattern(rng.next()).unwrap();
                self.live.push(storage);
                self.check("allocate");
            }
            3 | 4 if !self.live.is_empty() => {
                let i = rng.below(self.live.len() as u64) as usize;
                let storage = self.live.swap_remove(i);
                // Used on another stream first: its free waits for that stream.
                if rng.below(2) == 0 {
                    let other = rng.pick(&self.streams);
                    storage.data_ptr_on(other).unwrap();
                }
                drop(storage);
                self.check("free");
            }
            5 if !self.live.is_empty() => {
                let i = rng.below(self.live.len() as u64) as usize;
                let clone = self.live[i].lazy_clone().unwrap();
                // A write materializes the clone (copy, or steal when it is the last).
                if rng.below(2) == 0 {
                    let written = clone.mutable_data_ptr_on(s);
                    if self.unless_oom(written).is_none() {
                        return;
                    }
                }
                self.clones.push(clone);
                if self.clones.len() > 6 {
                    self.clones.remove(0);
                }
                self.check("lazy clone");
            }
            6 if !self.clones.is_empty() => {
                let clone = self.clones.swap_remove(0);
                let written = clone.mutable_data_ptr_on(s);
                if self.unless_oom(written).is_none() {
                    return;
                }
                self.live.push(clone);
                self.check("write to a clone");
            }
            7 => {
                let pool = self.rt.mem_pool(Default::default()).unwrap();
                let scope = self.rt.use_mem_pool(&pool, 0).unwrap();
                let storage = self.allocate(s, Self::size(rng));
                drop(scope);
                self.live.extend(storage);
                self.check("allocate in a memory pool");
            }
            8 if tags => {
                let scope = self.rt.use_tag("weights", 0).unwrap();
                let storage = self.allocate(s, Self::size(rng));
                drop(scope);
                self.live.extend(storage);
                self.check("allocate in a tag");
                for &stream in &self.streams {
                    self.rt.synchronize(stream).unwrap();
                }
                self.rt.sleep(&["weights"], &[]).unwrap();
                self.check("tag asleep");
                self.rt.wake_up(&[], WakeOptions::default()).unwrap();
                self.check("tag awake");
            }
            9 if self.graphs.len() < 2 => {
                let capture = self.rt.begin_capture(s, None, CaptureMode::Global).unwrap();
                let a = Storage::new_on(self.rt, s, 1 + rng.below(1 << 20)).unwrap();
                let b = Storage::new_on(self.rt, s, 4096).unwrap();
                // A storage the capture touched lives as long as the graph; raw memory freed in
                // the capture is the graph's to write at every replay (a kernel of the library
                // using it as scratch): its block is free, and keeps its region.
                let _on = self.rt.set_current_stream(s).unwrap();
                a.fill_pattern(rng.next()).unwrap();
                drop(a);
                let scratch = self.rt.allocate_on(s, 4096 + rng.below(1 << 16)).unwrap();
                let a_at = scratch.ptr().0;
                drop(scratch);
                let graph = capture.end().unwrap();
                graph.replay(s).unwrap();
                self.live.push(b);
                self.graphs.push(graph);
                self.check("graph captured and replayed");
                assert!(
                    self.recorder.read().regions.contains_key(&a_at),
                    "a block the graph writes lost its region when it was freed in the capture"
                );
            }
            10 if !self.graphs.is_empty() => {
                drop(self.graphs.swap_remove(0));
                self.check("graph dropped");
            }
            _ => {
                for &stream in &self.streams {
                    self.rt.synchronize(stream).unwrap();
                }
                self.rt.empty_cache();
                self.check("synchronized, cache emptied");
            }
        }
    }
}

/// A free whose events cannot be recorded (the driver refuses to make one) synchronizes the
/// streams that used it and is free at once: traced, so its region goes (found by review: it
/// kept its region over free memory). Returns the steps checked.
fn free_without_events(recorder: &Recorder) -> usize {
    let faulty = Arc::new(FaultyDriver::new(Arc::new(host_driver())));
    let faults = faulty.faults.clone();
    let rt = checked_allocator(faulty, "nvtx_regions:True");
    let tag = rt.tag("weights").unwrap().id();
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let storage = Storage::new_on(&rt, a, 4096).unwrap();
    storage.data_ptr_on(b).unwrap();
    check(
        "a storage used on two streams",
        &rt.snapshot(),
        &recorder.read(),
        tag,
    );
    faults
        .event_creation
        .store(true, std::sync::atomic::Ordering::SeqCst);
    drop(storage);
    faults
        .event_creation
        .store(false, std::sync::atomic::Ordering::SeqCst);
    check(
        "freed with no event recorded",
        &rt.snapshot(),
        &recorder.read(),
        tag,
    );
    drop(rt);
    let recorded = recorder.read();
    assert!(recorded.heaps.is_empty() && recorded.regions.is_empty());
    2
}

/// The child: runs the walk under each configuration, checking after every step, and that a
/// runtime leaves no heap or region behind.
#[test]
#[ignore = "the child of nvtx_regions_are_the_live_blocks_at_every_step"]
fn nvtx_regions_child() {
    if std::env::var(ROLE_VAR).as_deref() != Ok(ROLE) {
        return;
    }
    let recorder = Recorder::open();
    let configurations = [
        ("nvtx_regions:True", true),
        ("nvtx_regions:True,expandable_segments:True", true),
        ("nvtx_regions:True,cross_stream_reuse:blocks", false),
        ("nvtx_regions:True,thread_cache_mb:8", false),
        ("nvtx_regions:True,pass_through:True", false),
    ];
    let mut total = 0;
    for (seed, (conf, tags)) in configurations.into_iter().enumerate() {
        let rt = checked_allocator(child_test_driver(), conf);
        let streams = (0..3).map(|_| rt.create_stream(0).unwrap()).collect();
        let mut walk = Walk {
            rt: &rt,
            recorder: &recorder,
            streams,
            live: Vec::new(),
            clones: Vec::new(),
            graphs: Vec::new(),
            steps: 0,
        };
        let mut rng = Rng(0x4e56_5458 + seed as u64, 0);
        for _ in 0..150 {
            walk.step(&mut rng, tags);
        }
        let steps = walk.steps;
        drop(walk);
        drop(rt);
        let recorded = recorder.read();
        assert!(recorded.errors.is_empty(), "{conf}: {:#?}", recorded.errors);
        assert!(
            recorded.heaps.is_empty() && recorded.regions.is_empty(),
            "{conf}: the runtime left {} heaps and {} regions registered",
            recorded.heaps.len(),
            recorded.regions.len()
        );
        println!("{conf}: {steps} steps matched; calls {:?}", recorded.calls);
        total += steps;
    }
    total += free_without_events(&recorder);
    println!("nvtx regions: every step matched ({total} steps)");
}
