//! Transfers through the real NIXL engine over UCX on loopback, no GPU (feature `nixl`): two
//! processes (and two runtimes in one process), each with its own NIXL agent, write and read
//! storages of mixed sizes in whole and expandable segments; every byte is checked; registrations
//! count segments, not storages; a freed segment is deregistered and a transfer into it refused; a
//! lazy clone's first write after a transfer; a peer killed mid-transfer; the stream sanitizer
//! sees transfers; hostile metadata and descriptions are errors.
//!
//! The engine is the point: without NIXL's library (`CUDALLOC_NIXL_LIB_DIR` or the library
//! path) every test here **fails**, it never skips.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use common::*;
use cudalloc::nixl::{NixlAgent, NixlOptions, RemoteStorage};
use cudalloc::{
    backend::HostDriver, sanitizer::Sanitize, sanitizer::SanitizeOptions, AllocatorConfig,
    ErrorKind, Runtime, Storage, StreamId,
};

const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(60);
/// Storage sizes, each twice in a row (so neighbours can be paired with each other).
const SIZES: [u64; 12] = [
    512,
    4096,
    100_003,
    512,
    65_536,
    MIB,
    3 * MIB + 17,
    4096,
    7 * MIB,
    12 * MIB,
    25 * MIB,
    2048,
];

/// NIXL's agents and UCX's threads are process-wide: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Takes the test lock, keeps UCX on the loopback device, and loads NIXL — a failure, not a skip.
fn setup() -> MutexGuard<'static, ()> {
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        // Under the lock, before any agent exists: UCX reads it when an agent starts.
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let library = cudalloc::nixl::load_library(None).unwrap_or_else(|e| {
        panic!("the NIXL engine is required by this suite and could not be loaded: {e}")
    });
    eprintln!("NIXL loaded from {}", library.path.display());
    guard
}

fn unique(role: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{role}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn runtime(conf: &str, sanitize: Sanitize) -> (Arc<Runtime>, String) {
    let host = HostDriver::builder()
        .devices(1)
        .memory_per_device(1 << 30)
        .build()
        .unwrap();
    let prefix = host.shm_name_prefix();
    let rt = Runtime::builder()
        .config(AllocatorConfig::parse(conf).unwrap())
        .check_invariants(true)
        .sanitize(sanitize)
        .build(Arc::new(host))
        .unwrap();
    (Arc::new(rt), prefix)
}

fn sizes(n: usize) -> Vec<u64> {
    (0..n).map(|i| SIZES[(i / 2) % SIZES.len()]).collect()
}

fn filled(rt: &Arc<Runtime>, stream: StreamId, sizes: &[u64], seed: u64) -> Vec<Storage> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = Storage::new_on(rt, stream, n).unwrap();
            s.fill_pattern(seed + i as u64).unwrap();
            s
        })
        .collect()
}

fn wrong(s: &Storage, seed: u64) -> u64 {
    s.count_pattern_mismatches(seed).unwrap()
}

/// Registrations are the mapped regions: whole segments (fewer than the storages), or in an
/// expandable runtime its mapped pages.
fn assert_registrations_are_segments(rt: &Runtime, agent: &NixlAgent, storages: usize) {
    let stats = rt.registration_stats();
    let nixl = &stats.registrars[0];
    assert_eq!(nixl.name, "nixl");
    assert_eq!(agent.registered_regions() as u64, stats.mapped_regions);
    assert_eq!(nixl.registered_regions, stats.mapped_regions);
    if !rt.config().expandable_segments {
        assert!(
            nixl.registrations < storages as u64,
            "{} registrations for {storages} storages",
            nixl.registrations
        );
    }
    assert_eq!(nixl.failures, 0);
}

#[test]
fn two_processes_write_and_read_every_byte_whole_into_expandable() {
    two_processes("", "expandable_segments:True");
}

#[test]
fn two_processes_write_and_read_every_byte_expandable_into_whole() {
    two_processes("expandable_segments:True", "");
}

fn two_processes(mine: &str, theirs: &str) {
    let _one = setup();
    let n = 24;
    let (rt, prefix) = runtime(mine, Sanitize::FromEnv);
    let agent = NixlAgent::new(&rt, NixlOptions::new(unique("parent"))).unwrap();
    let mut child = ChildProcess::spawn("child_entry", "peer", "host");
    child.send(&format!("conf={theirs} name={}", unique("child")));
    let hello = child.recv();
    let peer = agent.load_peer(&unhex(field(&hello, "md"))).unwrap();
    let child_prefix = field(&hello, "prefix").to_owned();

    child.send(&format!("alloc n={n} seed=1000"));
    let remote: Vec<RemoteStorage> = (0..n)
        .map(|_| RemoteStorage::from_bytes(&unhex(field(&child.recv(), "desc"))).unwrap())
        .collect();
    let counts = child.recv();
    assert_eq!(field(&counts, "registered"), field(&counts, "mapped"));
    if theirs.is_empty() {
        assert!(field(&counts, "registered").parse::<usize>().unwrap() < n);
    }
    assert!(remote.iter().all(|r| r.agent() == peer));
    assert_eq!(agent.load_peer(&unhex(field(&counts, "md"))).unwrap(), peer);

    let stream = rt.default_stream(0).unwrap();
    let local = filled(&rt, stream, &sizes(n), 2000);
    assert_registrations_are_segments(&rt, &agent, n);

    // Even storages written into the peer's, odd ones read from it: one transfer each way.
    let evens: Vec<(&Storage, &RemoteStorage)> =
        (0..n).step_by(2).map(|i| (&local[i], &remote[i])).collect();
    let odds: Vec<(&Storage, &RemoteStorage)> =
        (1..n).step_by(2).map(|i| (&local[i], &remote[i])).collect();
    let mut write = agent.write(stream, &evens, Some(b"wrote")).unwrap();
    let mut read = agent.read(stream, &odds, Some(b"read")).unwrap();
    write.wait(WAIT).unwrap();
    read.wait(WAIT).unwrap();
    assert_eq!(
        write.bytes() + read.bytes(),
        sizes(n).iter().sum::<u64>(),
        "every byte of both sides moved once"
    );
    drop((write, read));
    for (i, s) in local.iter().enumerate() {
        let seed = if i % 2 == 0 { 2000 } else { 1000 } + i as u64;
        assert_eq!(wrong(s, seed), 0, "local storage {i}");
    }
    child.send(&format!("check written=2000 from={}", agent.name()));
    assert_eq!(field(&child.recv(), "wrong"), "0", "the peer's storages");

    // A lazy clone read into: materialized first, its source untouched.
    let into_clone = local[0].lazy_clone().unwrap();
    let mut t = agent
        .read(stream, &[(&into_clone, &remote[1])], None)
        .unwrap();
    t.wait(WAIT).unwrap();
    drop(t);
    assert_ne!(
        into_clone.unordered_data_ptr(),
        local[0].unordered_data_ptr(),
        "materialized"
    );
    assert_eq!(wrong(&into_clone, 1001), 0);
    assert_eq!(wrong(&local[0], 2000), 0);
    // A lazy clone written from: read in place, never materialized.
    let from_clone = local[2].lazy_clone().unwrap();
    let mut t = agent
        .write(stream, &[(&from_clone, &remote[3])], None)
        .unwrap();
    t.wait(WAIT).unwrap();
    drop(t);
    assert!(
        from_clone.is_cow(),
        "a transfer that reads does not materialize"
    );
    // The first write of a clone of memory a transfer filled: the source keeps those bytes.
    let clone = local[1].lazy_clone().unwrap();
    clone.fill_pattern(77).unwrap();
    assert_eq!(wrong(&clone, 77), 0);
    assert_eq!(wrong(&local[1], 1001), 0);

    // The peer frees its storages and releases their segments (deregistered first), then sends
    // fresh metadata: a transfer into the freed memory is refused by NIXL.
    child.send("free");
    let freed = child.recv();
    assert_eq!(field(&freed, "registered"), "0");
    assert_eq!(agent.load_peer(&unhex(field(&freed, "md"))).unwrap(), peer);
    let err = agent
        .write(stream, &[(&local[4], &remote[4])], None)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transfer, "{err}");
    child.send("exit");
    child.finish();
    assert!(shm_names_with_prefix(&child_prefix).is_empty());

    drop((into_clone, from_clone, clone, local));
    drop(agent);
    rt.empty_cache();
    assert_eq!(rt.registration_stats().mapped_regions, 0);
    drop(rt);
    assert!(shm_names_with_prefix(&prefix).is_empty());
}

#[test]
fn a_peer_killed_mid_transfer_fails_the_transfer_and_the_survivor_goes_on() {
    let _one = setup();
    let (rt, prefix) = runtime("", Sanitize::FromEnv);
    let agent = NixlAgent::new(&rt, NixlOptions::new(unique("survivor"))).unwrap();
    let mut child = ChildProcess::spawn("child_entry", "peer", "host");
    child.send(&format!("conf= name={}", unique("victim")));
    let hello = child.recv();
    let peer = agent.load_peer(&unhex(field(&hello, "md"))).unwrap();
    let child_prefix = field(&hello, "prefix").to_owned();
    child.send("alloc n=1 seed=5");
    let target = RemoteStorage::from_bytes(&unhex(field(&child.recv(), "desc"))).unwrap();
    agent.load_peer(&unhex(field(&child.recv(), "md"))).unwrap();
    let stream = rt.default_stream(0).unwrap();
    let source = Storage::new_on(&rt, stream, 512).unwrap();
    let big_source = Storage::new_on(&rt, stream, 64 * MIB).unwrap();
    big_source.fill_pattern(9).unwrap();
    // The peer's storage is 512 bytes: write the small one until the peer is killed (right
    // after the third post), then every transfer fails — promptly, without a hang or a signal.
    let mut child = Some(child);
    let mut failures = 0;
    for i in 0..200 {
        let outcome = agent
            .write(stream, &[(&source, &target)], Some(b"x"))
            .and_then(|mut t| {
                if i == 3 {
                    child.take().unwrap().kill();
                }
                t.wait(WAIT)
            });
        match outcome {
            Ok(()) => assert!(failures == 0, "a transfer to a dead peer succeeded"),
            Err(err) => {
                assert_eq!(err.kind(), ErrorKind::Transfer, "{err}");
                failures += 1;
                if failures == 3 {
                    break;
                }
            }
        }
    }
    assert_eq!(failures, 3, "transfers to a killed peer fail");
    assert!(child.is_none());
    agent.forget_peer(&peer).unwrap();
    let err = agent
        .write(stream, &[(&source, &target)], None)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transfer);
    // The survivor keeps working, and nothing of the dead peer stays in /dev/shm.
    let s = Storage::new_on(&rt, stream, 5 * MIB).unwrap();
    s.fill_pattern(4).unwrap();
    assert_eq!(wrong(&s, 4), 0);
    assert_eq!(wrong(&big_source, 9), 0);
    cudalloc::ipc::sweep_orphans().unwrap();
    assert!(shm_names_with_prefix(&child_prefix).is_empty());
    drop((s, source, big_source, agent));
    drop(rt);
    assert!(shm_names_with_prefix(&prefix).is_empty());
}

/// Two runtimes and two agents in one process (the sanitizer on both, in report mode).
struct Pair {
    a: Arc<Runtime>,
    b: Arc<Runtime>,
    agent_a: NixlAgent,
    agent_b: NixlAgent,
}

fn pair(conf_a: &str, conf_b: &str) -> Pair {
    pair_sanitized(conf_a, conf_b, Sanitize::On(SanitizeOptions::report()))
}

fn pair_sanitized(conf_a: &str, conf_b: &str, sanitize: Sanitize) -> Pair {
    let (a, _) = runtime(conf_a, sanitize);
    let (b, _) = runtime(conf_b, sanitize);
    let agent_a = NixlAgent::new(&a, NixlOptions::new(unique("a"))).unwrap();
    let agent_b = NixlAgent::new(&b, NixlOptions::new(unique("b"))).unwrap();
    agent_a.load_peer(&agent_b.metadata().unwrap()).unwrap();
    agent_b.load_peer(&agent_a.metadata().unwrap()).unwrap();
    Pair {
        a,
        b,
        agent_a,
        agent_b,
    }
}

#[test]
fn two_runtimes_in_one_process_and_the_sanitizer_sees_transfers() {
    let _one = setup();
    let p = pair("expandable_segments:True", "");
    let (sa, sb) = (
        p.a.default_stream(0).unwrap(),
        p.b.default_stream(0).unwrap(),
    );
    let n = 8;
    let src = filled(&p.a, sa, &sizes(n), 300);
    let dst = filled(&p.b, sb, &sizes(n), 0);
    let targets: Vec<RemoteStorage> = dst
        .iter()
        .map(|s| p.agent_b.describe(s, sb).unwrap())
        .collect();
    let pairs: Vec<(&Storage, &RemoteStorage)> = src.iter().zip(&targets).collect();
    // b's storages live in segments mapped after the metadata a loaded: a clear refusal.
    let err = p.agent_a.write(sa, &pairs, None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transfer);
    assert!(err.to_string().contains("fresh metadata"), "{err}");
    p.agent_a.load_peer(&p.agent_b.metadata().unwrap()).unwrap();
    let mut t = p.agent_a.write(sa, &pairs, Some(b"done")).unwrap();
    // While it is in flight (until a poll or wait saw its end), b's metadata cannot be replaced.
    let err = p
        .agent_a
        .load_peer(&p.agent_b.metadata().unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("in flight"), "{err}");

    // Writing src[0] while the transfer reads it is no race: the transfer holds the memory as
    // it was at the post, and the write materializes the storage elsewhere (the peer still gets
    // the bytes of the post, checked below).
    src[0].fill_pattern(1).unwrap();
    t.wait(WAIT).unwrap();
    drop(t);
    assert_eq!(wrong(&src[0], 1), 0);

    p.agent_b
        .wait_notification(p.agent_a.name(), b"done", WAIT)
        .unwrap();
    // Local work on a storage a peer may write, between its description and `received`, races
    // with the peer's write: here a copy out of dst[1] queued on another stream first.
    let other = p.b.create_stream(0).unwrap();
    let scratch = Storage::new_on(&p.b, other, dst[1].nbytes()).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        p.b.driver().copy_device_to_device(
            other,
            scratch.unordered_data_ptr(),
            dst[1].unordered_data_ptr(),
            dst[1].nbytes(),
        )
    }
    .unwrap();
    let err = p.agent_b.received(&dst[1], sb).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
    assert!(
        err.to_string().contains("a NIXL transfer from a peer"),
        "{err}"
    );
    for (i, d) in dst.iter().enumerate() {
        if i != 1 {
            p.agent_b.received(d, sb).unwrap();
        }
        assert_eq!(wrong(d, 300 + i as u64), 0, "storage {i}");
    }

    // A transfer on a stream that does not know another stream's pending write to its source:
    // refused as a race before NIXL touches anything.
    let side = p.a.create_stream(0).unwrap();
    let fresh = Storage::new_on(&p.a, side, sizes(n)[2]).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        p.a.driver()
            .kernels()
            .fill_pattern(side, fresh.unordered_data_ptr(), fresh.nbytes(), 3)
    }
    .unwrap();
    let err = p
        .agent_a
        .write(sa, &[(&fresh, &targets[2])], None)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
    // Ordered (its own stream), it goes through.
    let mut ok = p
        .agent_a
        .write(side, &[(&fresh, &targets[2])], None)
        .unwrap();
    ok.wait(WAIT).unwrap();
    drop(ok);

    // A read writes local memory: reading that memory before the read's end was seen (here a
    // write of the storage, whose copy-on-write step reads the pinned memory) is a race.
    let into = Storage::new_on(&p.a, sa, sizes(n)[3]).unwrap();
    let mut reading = p.agent_a.read(sa, &[(&into, &targets[3])], None).unwrap();
    let err = into.fill_pattern(5).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
    assert!(err.to_string().contains("a NIXL read"), "{err}");
    reading.wait(WAIT).unwrap();
}

#[test]
fn a_transfer_keeps_its_memory_and_registrations_whatever_happens_to_its_storage_and_agent() {
    let _one = setup();
    // Without the sanitizer: it would refuse the racing write below before it moved anything.
    let p = pair_sanitized("", "", Sanitize::Off);
    let (sa, sb) = (
        p.a.default_stream(0).unwrap(),
        p.b.default_stream(0).unwrap(),
    );
    let src = Storage::new_on(&p.b, sb, 4 * MIB).unwrap();
    src.fill_pattern(41).unwrap();
    let described = p.agent_b.describe(&src, sb).unwrap();
    p.agent_a.load_peer(&p.agent_b.metadata().unwrap()).unwrap();
    let dst = Storage::new_on(&p.a, sa, 4 * MIB).unwrap();
    let posted_at = dst.unordered_data_ptr();
    let mut t = p.agent_a.read(sa, &[(&dst, &described)], None).unwrap();
    // Meanwhile (a user's race) the storage is lazily cloned and written, so it moves to new
    // memory, and the clone — now the only other holder of the old memory — is dropped: the
    // memory NIXL writes stays allocated until the transfer ends, a new allocation of the same
    // size does not get it.
    let clone = dst.lazy_clone().unwrap();
    dst.fill_pattern(1).unwrap();
    assert_ne!(
        dst.unordered_data_ptr(),
        posted_at,
        "the written storage moved"
    );
    drop(clone);
    let other = Storage::new_on(&p.a, sa, 4 * MIB).unwrap();
    assert_ne!(
        other.unordered_data_ptr(),
        posted_at,
        "memory under a transfer was handed out again"
    );
    // The agent goes too: its registrations stay while the transfer lives.
    let Pair {
        a,
        b,
        agent_a,
        agent_b,
    } = p;
    drop(agent_a);
    assert_eq!(a.registration_stats().registrars.len(), 1);
    t.wait(WAIT).unwrap();
    drop(t);
    assert!(
        a.registration_stats().registrars.is_empty(),
        "detached with the last transfer"
    );
    drop((other, dst, agent_b, src));
    a.empty_cache();
    b.empty_cache();
    assert_eq!(a.registration_stats().mapped_regions, 0);
}

#[test]
fn descriptors_outside_registered_memory_and_hostile_input_are_errors() {
    let _one = setup();
    let p = pair("", "expandable_segments:True");
    let (sa, sb) = (
        p.a.default_stream(0).unwrap(),
        p.b.default_stream(0).unwrap(),
    );
    let src = Storage::new_on(&p.a, sa, MIB).unwrap();
    src.fill_pattern(6).unwrap();
    let dst = Storage::new_on(&p.b, sb, MIB).unwrap();
    let good = p.agent_b.describe(&dst, sb).unwrap();
    p.agent_a.load_peer(&p.agent_b.metadata().unwrap()).unwrap();

    // The same storage description moved past the peer's registered memory.
    let moved: Vec<(u64, u64)> = good
        .pieces()
        .iter()
        .map(|&(a, l)| (a + (64 << 30), l))
        .collect();
    assert_ne!(moved, good.pieces());
    let outside = forge(&good, moved);
    let err = p.agent_a.write(sa, &[(&src, &outside)], None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transfer, "{err}");
    // Sizes that differ, and a peer never loaded.
    let small = Storage::new_on(&p.a, sa, 4096).unwrap();
    assert!(p.agent_a.write(sa, &[(&small, &good)], None).is_err());
    p.agent_a.forget_peer(p.agent_b.name()).unwrap();
    let err = p.agent_a.write(sa, &[(&src, &good)], None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transfer);

    // Metadata from nowhere: empty, oversized, truncated, damaged — errors, never a crash.
    let md = p.agent_b.metadata().unwrap();
    assert!(p.agent_a.load_peer(&[]).is_err());
    assert!(p
        .agent_a
        .load_peer(&vec![0u8; cudalloc::nixl::MAX_METADATA_BYTES + 1])
        .is_err());
    for cut in [1, 7, md.len() / 3, md.len() / 2] {
        assert!(p.agent_a.load_peer(&md[..cut]).is_err(), "cut at {cut}");
    }
    assert!(p.agent_a.load_peer(&[0xA5; 512]).is_err());
    // A name nixl-sys would panic on (not UTF-8), of the same length: refused before NIXL.
    let name = p.agent_b.name().as_bytes().to_vec();
    let at = md
        .windows(name.len())
        .position(|w| w == name.as_slice())
        .unwrap();
    let mut renamed = md.clone();
    renamed[at..at + name.len()].fill(0xFF);
    let err = p.agent_a.load_peer(&renamed).unwrap_err();
    assert!(err.to_string().contains("UTF-8"), "{err}");
    // NIXL's own bytes without cudalloc's envelope: a foreign peer's form (issue 39), loaded
    // with generation 0 — a description newer than that is then refused until the envelope's
    // metadata is loaded again (below).
    assert_eq!(p.agent_a.load_peer(&md[16..]).unwrap(), p.agent_b.name());
    // Every damaged byte of the envelope and NIXL's header: an error or a load, never a crash.
    for i in 0..64.min(md.len()) {
        let mut b = md.clone();
        b[i] ^= 0x41;
        let _ = p.agent_a.load_peer(&b);
    }
    // The real metadata still loads, and the transfer then works.
    p.agent_a.load_peer(&md).unwrap();
    let mut t = p.agent_a.write(sa, &[(&src, &good)], None).unwrap();
    t.wait(WAIT).unwrap();
    drop(t);
    assert_eq!(wrong(&dst, 6), 0);
    // A received storage names no region of ours; an empty one none at all.
    assert!(p
        .agent_a
        .describe(&Storage::new(&p.a, 0, 0).unwrap(), sa)
        .is_err());
}

/// A description of `like`'s storage at other addresses (what a confused or hostile peer sends).
fn forge(like: &RemoteStorage, pieces: Vec<(u64, u64)>) -> RemoteStorage {
    RemoteStorage::new(like.agent().to_owned(), like.kind(), like.device(), pieces).unwrap()
}

/// The child: a runtime and an agent answering the parent's lines.
#[test]
#[ignore = "run by the tests above as a child process"]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    assert_eq!(role, "peer");
    let _one = setup();
    let mut link = ParentLink::new();
    let hello = link.recv();
    let conf = field(&hello, "conf").to_owned();
    let (rt, prefix) = runtime(&conf, Sanitize::FromEnv);
    let agent = NixlAgent::new(&rt, NixlOptions::new(field(&hello, "name"))).unwrap();
    link.send(&format!(
        "md={} prefix={prefix}",
        hex(&agent.metadata().unwrap())
    ));
    let stream = rt.default_stream(0).unwrap();
    let mut storages: Vec<Storage> = Vec::new();
    while let Some(line) = link.recv_or_eof() {
        let command = line.split(' ').next().unwrap_or_default();
        match command {
            "alloc" => {
                let n: usize = field(&line, "n").parse().unwrap();
                let seed: u64 = field(&line, "seed").parse().unwrap();
                storages = filled(&rt, stream, &sizes(n), seed);
                for s in &storages {
                    let desc = agent.describe(s, stream).unwrap();
                    link.send(&format!("desc={}", hex(&desc.to_bytes())));
                }
                let stats = rt.registration_stats();
                // Fresh metadata after the new segments: the peer learns their registrations.
                link.send(&format!(
                    "registered={} mapped={} md={}",
                    agent.registered_regions(),
                    stats.mapped_regions,
                    hex(&agent.metadata().unwrap())
                ));
            }
            "check" => {
                let written: u64 = field(&line, "written").parse().unwrap();
                agent
                    .wait_notification(field(&line, "from"), b"wrote", WAIT)
                    .unwrap();
                let mut bad = 0;
                for (i, s) in storages.iter().enumerate() {
                    if i % 2 == 0 {
                        agent.received(s, stream).unwrap();
                        bad += wrong(s, written + i as u64);
                    } else {
                        bad += wrong(s, 1000 + i as u64);
                    }
                }
                link.send(&format!("wrong={bad}"));
            }
            "free" => {
                storages.clear();
                rt.empty_cache();
                link.send(&format!(
                    "registered={} md={}",
                    agent.registered_regions(),
                    hex(&agent.metadata().unwrap())
                ));
            }
            "exit" => break,
            other => panic!("unknown command {other:?}"),
        }
    }
    drop(storages);
    drop(agent);
    drop(rt);
}

#[test]
fn a_forked_child_never_calls_into_the_agent_it_inherited() {
    if !common::forked::alone("a_forked_child_never_calls_into_the_agent_it_inherited") {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = setup();
    let p = pair_sanitized("", "", Sanitize::Off);
    let (sa, sb) = (
        p.a.default_stream(0).unwrap(),
        p.b.default_stream(0).unwrap(),
    );
    let src = Storage::new_on(&p.b, sb, MIB).unwrap();
    src.fill_pattern(12).unwrap();
    let described = p.agent_b.describe(&src, sb).unwrap();
    let md = p.agent_b.metadata().unwrap();
    p.agent_a.load_peer(&md).unwrap();
    let dst = Storage::new_on(&p.a, sa, MIB).unwrap();
    let t = p.agent_a.read(sa, &[(&dst, &described)], None).unwrap();
    let verdict = common::forked::in_forked_child(|| {
        let mut t = t;
        let forked = |what: &str, r: cudalloc::Result<()>| match r {
            Err(e) if e.kind() == ErrorKind::ForkedChild => Ok(()),
            other => Err(format!("{what} in a forked child: {other:?}")),
        };
        forked("poll", t.poll().map(drop))?;
        forked("metadata", p.agent_a.metadata().map(drop))?;
        forked("load_peer", p.agent_a.load_peer(&md).map(drop))?;
        forked(
            "write",
            p.agent_a.write(sa, &[(&dst, &described)], None).map(drop),
        )?;
        forked("notifications", p.agent_a.notifications().map(drop))?;
        // Dropping the in-flight transfer touches neither its request nor NIXL.
        drop(t);
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
    // The parent's transfer (dropped with the closure, so waited for) and agent go on.
    assert_eq!(wrong(&dst, 12), 0);
    let mut again = p.agent_a.write(sa, &[(&dst, &described)], None).unwrap();
    again.wait(WAIT).unwrap();
}

/// Children forked while a parent thread registers and deregisters segments with the agent (each
/// new segment of runtime `a` is registered, each released one deregistered: the registrar's
/// lock), and an agent of the sanitized runtime has transfer actors: every door of the agent in
/// the child is refused or answers without the parent's state, and the child's drop of the
/// agent touches neither its streams nor NIXL.
#[test]
fn forked_children_meet_every_agent_door_while_a_parent_thread_registers() {
    use common::forked::{fork_child, CHILD_DEADLINE_S};
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;
    if !common::forked::alone(
        "forked_children_meet_every_agent_door_while_a_parent_thread_registers",
    ) {
        return; // it forks: run alone, in a re-executed test binary
    }
    const CHILDREN: usize = 8;
    let _one = setup();
    let p = pair("", "");
    let (sa, sb) = (
        p.a.default_stream(0).unwrap(),
        p.b.default_stream(0).unwrap(),
    );
    let src = Storage::new_on(&p.b, sb, MIB).unwrap();
    src.fill_pattern(3).unwrap();
    let described = p.agent_b.describe(&src, sb).unwrap();
    let md = p.agent_b.metadata().unwrap();
    let dst = Storage::new_on(&p.a, sa, MIB).unwrap();
    // The actors exist: a transfer ran through them (an agent of its own, dropped by each child).
    let spare = NixlAgent::new(&p.a, NixlOptions::new(unique("spare"))).unwrap();
    spare.load_peer(&md).unwrap();
    let mut t = spare.read(sa, &[(&dst, &described)], None).unwrap();
    t.wait(WAIT).unwrap();
    drop(t);
    assert!(spare.registered_regions() > 0);
    let spare = Mutex::new(Some(spare));
    let rounds = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (rt, rounds, stop) = (Arc::clone(&p.a), Arc::clone(&rounds), Arc::clone(&stop));
        std::thread::spawn(move || {
            let stream = rt.default_stream(0).unwrap();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                // A new segment each round (registered), given back (deregistered).
                drop(Storage::new_on(&rt, stream, 3 * MIB).unwrap());
                rt.empty_cache();
                i += 1;
                rounds.store(i, Ordering::Relaxed);
            }
        })
    };
    let children: Vec<_> = (0..CHILDREN)
        .map(|_| {
            let seen = rounds.load(Ordering::Relaxed);
            while rounds.load(Ordering::Relaxed) == seen && !worker.is_finished() {
                std::thread::yield_now();
            }
            fork_child(|| {
                let mut answered = Vec::new();
                let mut refused = |what: &str, r: cudalloc::Result<()>| match r {
                    Err(e) if e.kind() == ErrorKind::ForkedChild => {}
                    other => answered.push(format!("{what}: {other:?}")),
                };
                let a = &p.agent_a;
                refused("metadata", a.metadata().map(drop));
                refused("nixl_metadata", a.nixl_metadata().map(drop));
                refused("load_peer", a.load_peer(&md).map(drop));
                refused("send_metadata", a.send_metadata("127.0.0.1", 1));
                refused(
                    "fetch_peer",
                    a.fetch_peer("x", "127.0.0.1", 1, Duration::ZERO).map(drop),
                );
                refused("await_peer", a.await_peer("x", Duration::ZERO).map(drop));
                refused(
                    "await_description",
                    a.await_description(&described, Duration::ZERO),
                );
                refused("forget_peer", a.forget_peer("x"));
                refused("describe", a.describe(&dst, sa).map(drop));
                refused("notify", a.notify("x", b"m"));
                refused("notifications", a.notifications().map(drop));
                refused(
                    "wait_notification",
                    a.wait_notification("x", b"m", Duration::ZERO),
                );
                refused("received", a.received(&dst, sa));
                refused("read", a.read(sa, &[(&dst, &described)], None).map(drop));
                refused("write", a.write(sa, &[(&dst, &described)], None).map(drop));
                if a.registered_regions() != 0 {
                    answered.push("registered_regions: the parent's registrations".into());
                }
                let _ = (a.name(), a.generation());
                // Dropped in the child: nothing of the parent's is destroyed or deregistered.
                drop(spare.lock().unwrap().take());
                if answered.is_empty() {
                    Ok(())
                } else {
                    Err(answered.join("; "))
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(u64::from(CHILD_DEADLINE_S) + 30);
    let failed: Vec<String> = children
        .into_iter()
        .filter_map(|child| {
            let pid = child.pid();
            child
                .wait_until(deadline)
                .err()
                .map(|f| format!("child {pid}: {} (hung: {})", f.why, f.hung))
        })
        .collect();
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    // The parent's agents go on, the spare's registrations and actors with them.
    let spare = spare.lock().unwrap().take().unwrap();
    assert!(spare.registered_regions() > 0);
    dst.fill_pattern(0).unwrap();
    let mut again = spare.read(sa, &[(&dst, &described)], None).unwrap();
    again.wait(WAIT).unwrap();
    assert_eq!(wrong(&dst, 3), 0);
}
