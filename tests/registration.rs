//! The registration model (`src/alloc/registration.rs`): registrars attached to an allocator see
//! every region it maps once — at attach for what was mapped before, as it is mapped after — and
//! deregister each before its memory goes (`empty_cache`, the out-of-memory path, page release,
//! the allocator's drop), several at once; a failure fails the allocation that needed it or is
//! counted and skipped; ids are never reused; a storage names its region, offset and length.
//!
//! The order against the driver is checked on a timeline: the test driver logs every `malloc`,
//! `free`, `vm_map` and `vm_unmap`, and the recording registrar logs into the same list.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::faulty::{Faults, FaultyDriver};
use common::*;
use cudalloc::{
    backend::Driver, registration::OnRegistrationFailure, registration::Region,
    registration::RegionKind, registration::Registrar, registration::SegmentId, AllocatorConfig,
    Error, ErrorKind, Result, Runtime, Storage,
};

const MIB: u64 = 1 << 20;

/// Every test holds this shared; the forking test alone (no other test's thread runs meanwhile).
static FORK: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    FORK.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A registrar that keeps what it holds, checks it is never told twice or of what it does not
/// hold, and can be told to fail.
struct Recorder {
    name: &'static str,
    faults: Option<Arc<Faults>>,
    held: Mutex<HashMap<SegmentId, Region>>,
    errors: Mutex<Vec<String>>,
    fail: AtomicBool,
    /// Fail only regions of at least this size (0: any).
    fail_from: AtomicU64,
}

impl Recorder {
    fn new(name: &'static str, faults: Option<Arc<Faults>>) -> Arc<Self> {
        Arc::new(Recorder {
            name,
            faults,
            held: Mutex::default(),
            errors: Mutex::default(),
            fail: AtomicBool::new(false),
            fail_from: AtomicU64::new(0),
        })
    }

    fn held(&self) -> Vec<Region> {
        let mut v: Vec<Region> = self.held.lock().unwrap().values().copied().collect();
        v.sort_by_key(|r| (r.device, r.base.0));
        v
    }

    fn assert_clean(&self) {
        let errors = self.errors.lock().unwrap();
        assert!(errors.is_empty(), "{}: {errors:?}", self.name);
    }
}

#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the engine refused the region (test)")
    }
}

impl std::error::Error for Refused {}

impl Registrar for Recorder {
    fn name(&self) -> &str {
        self.name
    }

    fn register(&self, region: &Region) -> Result<()> {
        if self.fail.load(Ordering::SeqCst) && region.size >= self.fail_from.load(Ordering::SeqCst)
        {
            return Err(Error::registration(self.name, Refused));
        }
        if let Some(f) = &self.faults {
            f.log("register", region.base.0, region.size);
        }
        if let Some(old) = self.held.lock().unwrap().insert(region.id, *region) {
            self.errors
                .lock()
                .unwrap()
                .push(format!("{} registered twice ({old:?})", region.id));
        }
        Ok(())
    }

    fn deregister(&self, region: &Region) {
        if let Some(f) = &self.faults {
            f.log("deregister", region.base.0, region.size);
        }
        if self.held.lock().unwrap().remove(&region.id) != Some(*region) {
            self.errors
                .lock()
                .unwrap()
                .push(format!("{} deregistered but not held", region.id));
        }
    }
}

fn faulty() -> (Arc<dyn Driver>, Arc<Faults>) {
    let driver = FaultyDriver::new(Arc::new(host_driver()));
    let faults = driver.faults.clone();
    (sanitized(Arc::new(driver)), faults)
}

fn runtime(driver: Arc<dyn Driver>, conf: &str) -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(AllocatorConfig::parse(conf).unwrap())
            .check_invariants(true)
            .build(driver)
            .unwrap(),
    )
}

/// On the timeline: every region registered lies in memory mapped before it, and every byte
/// freed or unmapped was deregistered by every registrar that held it before the call.
fn assert_timeline(calls: &[(&'static str, u64, u64)], registrars: usize) {
    // live registrations: base -> (size, count of registrars holding it)
    let mut live: HashMap<u64, (u64, usize)> = HashMap::new();
    let mut mapped_segments: HashMap<u64, u64> = HashMap::new();
    for (i, &(call, addr, size)) in calls.iter().enumerate() {
        match call {
            "malloc" => {
                mapped_segments.insert(addr, size);
            }
            "register" => {
                let e = live.entry(addr).or_insert((size, 0));
                e.1 += 1;
                assert!(e.1 <= registrars, "#{i}: {addr:#x} registered too often");
            }
            "deregister" => {
                let e = live
                    .get_mut(&addr)
                    .expect("deregistered but never registered");
                e.1 -= 1;
                if e.1 == 0 {
                    live.remove(&addr);
                }
            }
            "free" => {
                let size = mapped_segments.remove(&addr).unwrap_or(0);
                for (&base, &(len, _)) in &live {
                    assert!(
                        base + len <= addr || base >= addr + size.max(1),
                        "#{i}: segment {addr:#x} freed while {base:#x} (+{len}) is registered"
                    );
                }
            }
            "vm_unmap" => {
                for (&base, &(len, _)) in &live {
                    assert!(
                        base + len <= addr || base >= addr + size,
                        "#{i}: page {addr:#x} (+{size}) unmapped while {base:#x} (+{len}) is registered"
                    );
                }
            }
            _ => {}
        }
    }
}

#[test]
fn attach_registers_what_is_mapped_then_each_new_segment_once() {
    let _shared = shared();
    let (driver, faults) = faulty();
    let rt = runtime(driver, "");
    let before: Vec<Storage> = [512, 3 * MIB, 30 * MIB]
        .iter()
        .map(|&n| Storage::new(&rt, 0, n).unwrap())
        .collect();
    let mapped = rt.registration_stats();
    assert_eq!(
        mapped.mapped_regions, 3,
        "a small, a large and an oversize segment"
    );
    let rec = Recorder::new("recorder", Some(faults.clone()));
    rt.attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    assert_eq!(rec.held().len(), 3, "everything mapped so far, at attach");

    // Many storages, few segments: registrations count segments, not storages.
    let many: Vec<Storage> = (0..200)
        .map(|i| Storage::new(&rt, 0, 4096 * (1 + i % 7)).unwrap())
        .collect();
    let stats = rt.registration_stats();
    let r = &stats.registrars[0];
    assert_eq!(r.registrations, stats.mapped_regions);
    assert!(
        stats.mapped_regions < 10,
        "{} regions for 203 storages",
        stats.mapped_regions
    );
    assert_eq!(r.registered_regions, stats.mapped_regions);
    assert_eq!(r.registered_bytes, stats.mapped_bytes);
    assert_eq!(stats.mapped_bytes, rt.memory_reserved(0).unwrap());

    // A storage names its region: the registrar's record, plus its offset.
    for s in before.iter().chain(&many) {
        let pieces = s.registered_regions().unwrap();
        assert_eq!(pieces.len(), 1, "a whole segment is one region");
        let p = pieces[0];
        assert_eq!(p.addr(), s.unordered_data_ptr());
        assert_eq!(p.len, s.nbytes());
        assert!(p.offset + p.len <= p.region.size);
        assert_eq!(rec.held.lock().unwrap().get(&p.region.id), Some(&p.region));
        assert_eq!(p.region.kind, RegionKind::Segment);
    }

    drop(before);
    drop(many);
    rt.empty_cache();
    assert!(rec.held().is_empty(), "empty_cache deregistered everything");
    let r = &rt.registration_stats().registrars[0];
    assert_eq!(r.deregistrations, r.registrations);
    assert_eq!((r.registered_regions, r.registered_bytes), (0, 0));
    rec.assert_clean();
    assert_timeline(&faults.calls(), 1);
}

#[test]
fn ids_are_never_reused_when_addresses_are() {
    let _shared = shared();
    let (driver, _faults) = faulty();
    let rt = runtime(driver, "");
    let mut seen = HashMap::new();
    let mut addresses = HashMap::new();
    for _ in 0..20 {
        let s = Storage::new(&rt, 0, 8 * MIB).unwrap();
        let region = s.registered_regions().unwrap()[0].region;
        assert!(
            seen.insert(region.id, region.base).is_none(),
            "{} used twice",
            region.id
        );
        *addresses.entry(region.base).or_insert(0) += 1;
        drop(s);
        rt.empty_cache();
    }
    assert!(
        addresses.values().any(|&n| n > 1) || addresses.len() == 20,
        "the ids differ whether or not the driver reused an address"
    );
}

#[test]
fn several_registrars_and_detach() {
    let _shared = shared();
    let (driver, faults) = faulty();
    let rt = runtime(driver, "");
    let a = Recorder::new("a", Some(faults.clone()));
    let b = Recorder::new("b", Some(faults.clone()));
    let ida = rt
        .attach_registrar(a.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    let x = Storage::new(&rt, 0, 5 * MIB).unwrap();
    rt.attach_registrar(b.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    let y = Storage::new(&rt, 0, 40 * MIB).unwrap();
    assert_eq!(a.held(), b.held(), "both hold every region");
    assert_eq!(a.held().len(), 2);

    assert!(rt.detach_registrar(ida));
    assert!(!rt.detach_registrar(ida), "detached once");
    assert!(a.held().is_empty(), "detaching deregisters");
    assert_eq!(b.held().len(), 2);
    let stats = rt.registration_stats();
    assert_eq!(stats.registrars.len(), 1);
    assert_eq!(stats.registrars[0].name, "b");

    drop((x, y));
    rt.empty_cache();
    assert!(b.held().is_empty());
    a.assert_clean();
    b.assert_clean();
    assert_timeline(&faults.calls(), 2);
}

#[test]
fn a_failed_registration_fails_the_allocation_and_gives_the_memory_back() {
    let _shared = shared();
    let (driver, faults) = faulty();
    let rt = runtime(driver.clone(), "");
    let ok = Recorder::new("ok", Some(faults.clone()));
    let bad = Recorder::new("bad", Some(faults.clone()));
    rt.attach_registrar(ok.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    rt.attach_registrar(bad.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    let free_before = driver.mem_info(0).unwrap().free;
    bad.fail.store(true, Ordering::SeqCst);
    let err = Storage::new(&rt, 0, 6 * MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Registration, "{err}");
    assert!(err.to_string().contains("bad"), "{err}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "the registrar's error is kept"
    );
    assert!(
        ok.held().is_empty(),
        "the registrar that took it gave it back"
    );
    assert_eq!(rt.memory_reserved(0).unwrap(), 0);
    assert_eq!(driver.mem_info(0).unwrap().free, free_before);
    assert_eq!(rt.registration_stats().mapped_regions, 0);
    assert_eq!(rt.registration_stats().registrars[1].failures, 1);

    // Expandable pages likewise: a growth whose page is refused maps nothing.
    let ex = runtime(driver.clone(), "expandable_segments:True");
    ex.attach_registrar(bad.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    let err = Storage::new(&ex, 0, 9 * MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Registration, "{err}");
    assert_eq!(ex.memory_reserved(0).unwrap(), 0);
    assert_eq!(driver.mem_info(0).unwrap().free, free_before);

    // The engine recovers: the allocator works again.
    bad.fail.store(false, Ordering::SeqCst);
    let s = Storage::new(&rt, 0, 6 * MIB).unwrap();
    s.fill_pattern(3).unwrap();
    assert_eq!(s.count_pattern_mismatches(3).unwrap(), 0);
    assert_eq!(ok.held(), bad.held());
    drop(s);
    rt.empty_cache();
    ok.assert_clean();
    bad.assert_clean();
    assert_timeline(&faults.calls(), 2);
}

#[test]
fn count_and_skip_counts_and_the_allocation_succeeds() {
    let _shared = shared();
    let (driver, _faults) = faulty();
    let rt = runtime(driver, "");
    let picky = Recorder::new("picky", None);
    picky.fail.store(true, Ordering::SeqCst);
    picky.fail_from.store(20 * MIB, Ordering::SeqCst);
    rt.attach_registrar(picky.clone(), OnRegistrationFailure::CountAndSkip)
        .unwrap();
    let small = Storage::new(&rt, 0, MIB).unwrap();
    let big = Storage::new(&rt, 0, 40 * MIB).unwrap();
    let stats = rt.registration_stats();
    assert_eq!(stats.mapped_regions, 2);
    let r = &stats.registrars[0];
    assert_eq!((r.registrations, r.failures), (1, 1));
    let held = picky.held();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].id, small.registered_regions().unwrap()[0].region.id);
    // The big one is mapped (it has a region) but this registrar does not hold it.
    let big_region = big.registered_regions().unwrap()[0].region;
    assert!(!held.iter().any(|r| r.id == big_region.id));
    drop((small, big));
    rt.empty_cache();
    assert!(picky.held().is_empty());
    picky.assert_clean();
}

#[test]
fn an_attach_that_fails_leaves_nothing_registered() {
    let _shared = shared();
    let (driver, _faults) = faulty();
    let rt = runtime(driver, "");
    let _a = Storage::new(&rt, 0, MIB).unwrap();
    let _b = Storage::new(&rt, 0, 30 * MIB).unwrap();
    let rec = Recorder::new("late", None);
    rec.fail.store(true, Ordering::SeqCst);
    rec.fail_from.store(20 * MIB, Ordering::SeqCst);
    let err = rt
        .attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Registration);
    assert!(rec.held().is_empty(), "the small region was given back");
    assert!(rt.registration_stats().registrars.is_empty());
    // Counting and skipping, the same attach succeeds.
    rt.attach_registrar(rec.clone(), OnRegistrationFailure::CountAndSkip)
        .unwrap();
    assert_eq!(rec.held().len(), 1);
    rec.assert_clean();
}

#[test]
fn expandable_pages_are_regions_and_page_release_deregisters_exactly_them() {
    let _shared = shared();
    let (driver, faults) = faulty();
    let rt = runtime(driver, "expandable_segments:True");
    let rec = Recorder::new("pages", Some(faults.clone()));
    rt.attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    let a = Storage::new(&rt, 0, 3 * MIB).unwrap();
    let b = Storage::new(&rt, 0, 7 * MIB).unwrap();
    let page = 2 * MIB;
    let held = rec.held();
    assert!(held
        .iter()
        .all(|r| r.size == page && r.kind == RegionKind::ExpandablePage));
    assert_eq!(
        held.len() as u64 * page,
        rt.memory_reserved(0).unwrap(),
        "one region per mapped page"
    );
    // b spans pages: one piece per page, contiguous, covering it exactly.
    let pieces = b.registered_regions().unwrap();
    assert!(pieces.len() >= 4, "{pieces:?}");
    let mut at = b.unordered_data_ptr().0;
    for p in &pieces {
        assert_eq!(p.addr().0, at);
        at += p.len;
    }
    assert_eq!(at, b.unordered_data_ptr().0 + b.nbytes());

    // Freeing a and releasing: only the pages under a (not shared with b) go.
    let b_pages: Vec<SegmentId> = pieces.iter().map(|p| p.region.id).collect();
    drop(a);
    rt.empty_cache();
    let left = rec.held();
    for id in &b_pages {
        assert!(left.iter().any(|r| r.id == *id), "b's page {id} kept");
    }
    assert_eq!(left.len() as u64 * page, rt.memory_reserved(0).unwrap());
    drop(b);
    rt.empty_cache();
    assert!(rec.held().is_empty());
    rec.assert_clean();
    assert_timeline(&faults.calls(), 1);
}

#[test]
fn the_out_of_memory_path_deregisters_what_it_frees() {
    let _shared = shared();
    let driver = FaultyDriver::new(Arc::new(
        cudalloc::backend::HostDriver::builder()
            .devices(1)
            .memory_per_device(64 * MIB)
            .build()
            .unwrap(),
    ));
    let faults = driver.faults.clone();
    let rt = runtime(sanitized(Arc::new(driver)), "");
    let rec = Recorder::new("oom", Some(faults.clone()));
    rt.attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    // Fill the device with cached 20 MiB segments, then ask for one 40 MiB block: the miss path
    // frees the cached segments (deregistering them first) and maps a new one.
    let cached: Vec<Storage> = (0..3)
        .map(|_| Storage::new(&rt, 0, 18 * MIB).unwrap())
        .collect();
    drop(cached);
    let big = Storage::new(&rt, 0, 40 * MIB).unwrap();
    assert_eq!(rec.held().len(), 1);
    assert_eq!(
        rec.held()[0].id,
        big.registered_regions().unwrap()[0].region.id
    );
    drop(big);
    drop(rt);
    assert!(
        rec.held().is_empty(),
        "the allocator's drop deregistered the rest"
    );
    rec.assert_clean();
    assert_timeline(&faults.calls(), 1);
}

#[test]
fn a_storage_outliving_its_allocator_keeps_its_registration_until_it_goes() {
    let _shared = shared();
    let (driver, faults) = faulty();
    let rt = runtime(driver, "");
    let rec = Recorder::new("late-free", Some(faults.clone()));
    rt.attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    let survivor = Storage::new(&rt, 0, 4 * MIB).unwrap();
    let cached = Storage::new(&rt, 0, 30 * MIB).unwrap();
    drop(cached);
    drop(rt);
    // The storage holds its runtime; the cached segment is still the allocator's too, until the
    // last storage goes.
    survivor.fill_pattern(5).unwrap();
    assert!(!rec.held().is_empty(), "live memory stays registered");
    drop(survivor);
    assert!(rec.held().is_empty());
    rec.assert_clean();
    assert_timeline(&faults.calls(), 1);
}

#[test]
fn attach_while_other_threads_map_and_free_misses_nothing() {
    let _shared = shared();
    let (driver, faults) = faulty();
    let rt = runtime(driver.clone(), "");
    let rec = Recorder::new("racing", Some(faults.clone()));
    let streams: Vec<_> = (0..3).map(|_| rt.create_stream(0).unwrap()).collect();
    std::thread::scope(|scope| {
        for (t, &stream) in streams.iter().enumerate() {
            let rt = &rt;
            scope.spawn(move || {
                for i in 0..60u64 {
                    let n = [512, 3 * MIB, 12 * MIB][((i + t as u64) % 3) as usize];
                    let s = Storage::new_on(rt, stream, n).unwrap();
                    drop(s);
                    if i % 7 == 0 {
                        rt.empty_cache();
                    }
                }
            });
        }
        rt.attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
            .unwrap();
    });
    let stats = rt.registration_stats();
    let held = rec.held();
    assert_eq!(
        held.len() as u64,
        stats.mapped_regions,
        "every mapped region, once"
    );
    assert_eq!(
        held.iter().map(|r| r.size).sum::<u64>(),
        rt.memory_reserved(0).unwrap()
    );
    rt.empty_cache();
    assert!(rec.held().is_empty());
    rec.assert_clean();
    assert_timeline(&faults.calls(), 1);
}

#[test]
fn what_a_storage_cannot_name() {
    let _shared = shared();
    let rt = runtime(test_driver(), "");
    let empty = Storage::new(&rt, 0, 0).unwrap();
    assert_eq!(
        empty.registered_regions().unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // A lazy clone reads the source's region; a write through registered_regions_mut
    // materializes it into a region of its own first.
    let src = Storage::new(&rt, 0, MIB).unwrap();
    src.fill_pattern(8).unwrap();
    let clone = src.lazy_clone().unwrap();
    assert_eq!(
        clone.registered_regions().unwrap()[0].addr(),
        src.unordered_data_ptr()
    );
    let written = clone.registered_regions_mut().unwrap();
    assert_ne!(written[0].addr(), src.unordered_data_ptr());
    assert!(!clone.is_cow());
    assert_eq!(clone.count_pattern_mismatches(8).unwrap(), 0);
}

#[test]
fn a_forked_child_cannot_attach_and_frees_nothing() {
    let _alone = FORK
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (driver, faults) = faulty();
    let rt = runtime(driver, "");
    let rec = Recorder::new("parent", Some(faults.clone()));
    rt.attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    let s = Storage::new(&rt, 0, 4 * MIB).unwrap();
    let held_before = rec.held();
    let verdict = common::forked::in_forked_child(|| {
        let other = Recorder::new("child", None);
        match rt.attach_registrar(other, OnRegistrationFailure::FailAllocation) {
            Err(e) if e.kind() == ErrorKind::ForkedChild => {}
            other => return Err(format!("attach in a child: {other:?}")),
        }
        drop(s);
        rt.empty_cache();
        if rec.held() != held_before {
            return Err("the child deregistered the parent's memory".into());
        }
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
    assert_eq!(rec.held(), held_before);
}

#[test]
fn memory_a_capture_maps_is_registered_and_a_refusal_inside_a_capture_is_freed_after_it() {
    let _shared = shared();
    let (driver, faults) = faulty();
    let rt = runtime(driver, "");
    let rec = Recorder::new("graphs", Some(faults.clone()));
    rt.attach_registrar(rec.clone(), OnRegistrationFailure::FailAllocation)
        .unwrap();
    // Observers must see every unmap after its map (a refused segment is never announced).
    let events: Arc<Mutex<Vec<cudalloc::stats::SegmentEvent>>> = Arc::default();
    let log = events.clone();
    rt.register_segment_observer(Arc::new(move |e: &cudalloc::stats::SegmentEvent| {
        log.lock().unwrap().push(*e)
    }));
    let s = rt.create_stream(0).unwrap();
    let capture = rt
        .begin_capture(s, None, cudalloc::graph::CaptureMode::Global)
        .unwrap();
    let out = rt.allocate_on(s, MIB).unwrap();
    let region = rt.registered_regions(0, out.ptr(), MIB).unwrap()[0].region;
    assert!(
        rec.held().iter().any(|r| r.id == region.id),
        "registered inside the capture"
    );
    // A refusal inside the capture: the allocation fails, its segment waits for the capture's end.
    rec.fail.store(true, Ordering::SeqCst);
    let err = rt.allocate_on(s, 30 * MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Registration, "{err}");
    rec.fail.store(false, Ordering::SeqCst);
    let graph = capture.end().unwrap();
    // The graph holds its pool: its freed output stays mapped and registered.
    drop(out);
    rt.empty_cache();
    assert!(rec.held().iter().any(|r| r.id == region.id));
    drop(graph);
    rt.empty_cache();
    assert!(rec.held().is_empty());
    assert_eq!(
        rt.memory_reserved(0).unwrap(),
        0,
        "the refused segment went back too"
    );
    let mut mapped = std::collections::HashSet::new();
    for e in events.lock().unwrap().iter() {
        match e.change {
            cudalloc::stats::SegmentChange::Map => assert!(mapped.insert(e.base)),
            _ => assert!(
                mapped.remove(&e.base),
                "unmap of {:#x} never mapped",
                e.base.0
            ),
        }
    }
    rec.assert_clean();
    assert_timeline(&faults.calls(), 1);
}
