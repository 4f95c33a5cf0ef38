//! A foreign NIXL peer (feature `nixl`, issue 39): `tests/nixl_foreign/peer.py`, a program on the
//! `nixl` wheel's public Python API only — `nixl_agent`, `get_agent_metadata` / `add_remote_agent`,
//! descriptor lists serialized by NIXL (`get_serialized_descs` / `deserialize_descs`),
//! `initialize_xfer`, notifications — reads storages cudalloc offered and checks every byte, writes
//! into storages cudalloc offered (cudalloc learns it by the notification and orders its stream
//! after the bytes), and offers a buffer of its own that cudalloc reads and writes. UCX on
//! loopback. Registrations stay one per mapped region.
//!
//! The engine and the peer are the point: without NIXL's library, or without a Python that has the
//! wheel and numpy (`CUDALLOC_NIXL_PYTHON`, which `.ci/run` sets), every test here **fails**.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::BufRead;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cudalloc::backend::HostDriver;
use cudalloc::nixl::{NixlAgent, NixlOptions, RemoteStorage};
use cudalloc::{Runtime, Storage};

const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(60);
mod common;
use common::{hex, unhex};

#[path = "nixl_foreign/peer_driver.rs"]
mod peer_driver;
use peer_driver::Peer;

/// NIXL's agents and UCX's threads are process-wide: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn setup() -> MutexGuard<'static, ()> {
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    cudalloc::nixl::load_library(None).unwrap_or_else(|e| {
        panic!("the NIXL engine is required by this suite and could not be loaded: {e}")
    });
    guard
}

fn runtime() -> Arc<Runtime> {
    let host = HostDriver::builder()
        .devices(1)
        .memory_per_device(1 << 30)
        .build()
        .unwrap();
    Arc::new(
        Runtime::builder()
            .sanitize(cudalloc::sanitizer::Sanitize::FromEnv)
            .check_invariants(true)
            .build(Arc::new(host))
            .unwrap(),
    )
}

const SIZES: [u64; 8] = [
    512,
    4096,
    100_003,
    MIB,
    3 * MIB + 17,
    7 * MIB,
    12 * MIB,
    25 * MIB,
];

#[test]
fn a_foreign_peer_reads_and_writes_cudalloc_storages_and_offers_its_own() {
    let _one = setup();
    let rt = runtime();
    let name = format!("cudalloc-{}", std::process::id());
    let agent = NixlAgent::new(&rt, NixlOptions::new(name)).unwrap();
    let stream = rt.default_stream(0).unwrap();
    let mut peer = Peer::spawn(&format!("python-{}", std::process::id()));
    // Meet: each side loads the other's metadata in NIXL's own form.
    let theirs = agent.load_peer(&unhex(&peer.expect("META"))).unwrap();

    let storages: Vec<Storage> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = Storage::new_on(&rt, stream, n).unwrap();
            s.fill_pattern(100 + i as u64).unwrap();
            s
        })
        .collect();
    let targets: Vec<Storage> = SIZES
        .iter()
        .map(|&n| Storage::new_on(&rt, stream, n).unwrap())
        .collect();
    rt.synchronize(stream).unwrap();
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    assert_eq!(peer.expect("OK"), agent.name());

    // (a) The peer reads what cudalloc offers, every byte checked there.
    for (i, s) in storages.iter().enumerate() {
        let offer = agent.describe(s, stream).unwrap().to_nixl_descs();
        peer.send(&format!("READ {} {}", 100 + i, hex(&offer)));
        assert_eq!(peer.expect("READ"), "0", "storage {i} read by the peer");
    }
    // (b) The peer writes into storages cudalloc offers; cudalloc learns it by the notification
    // and orders its stream after the bytes before reading them.
    for (i, t) in targets.iter().enumerate() {
        let offer = agent.describe(t, stream).unwrap().to_nixl_descs();
        peer.send(&format!("WRITE {} {}", 200 + i, hex(&offer)));
        peer.expect("WROTE");
        agent
            .wait_notification(&theirs, b"write-done", WAIT)
            .unwrap();
        agent.received(t, stream).unwrap();
        assert_eq!(
            t.count_pattern_mismatches(200 + i as u64).unwrap(),
            0,
            "storage {i} written by the peer"
        );
    }
    // (c) The peer offers a buffer of its own: cudalloc reads it, then writes it.
    let n = 5 * MIB + 3;
    peer.send(&format!("OFFER {n} 300"));
    let offered = unhex(&peer.expect("OFFER"));
    assert_eq!(
        agent.load_peer(&unhex(&peer.expect("META"))).unwrap(),
        theirs
    );
    let remote = RemoteStorage::from_nixl_descs(&theirs, &offered).unwrap();
    assert_eq!(remote.nbytes(), n);
    let into = Storage::new_on(&rt, stream, n).unwrap();
    let mut read = agent.read(stream, &[(&into, &remote)], None).unwrap();
    read.wait(WAIT).unwrap();
    drop(read);
    assert_eq!(
        into.count_pattern_mismatches(300).unwrap(),
        0,
        "read from the peer"
    );
    let from = Storage::new_on(&rt, stream, n).unwrap();
    from.fill_pattern(301).unwrap();
    let mut write = agent.write(stream, &[(&from, &remote)], None).unwrap();
    write.wait(WAIT).unwrap();
    drop(write);
    peer.send("CHECK 301");
    assert_eq!(peer.expect("CHECK"), "0", "written into the peer's buffer");

    // Registrations are the mapped regions, never one per storage or per transfer.
    let stats = rt.registration_stats();
    assert_eq!(agent.registered_regions() as u64, stats.mapped_regions);
    assert_eq!(stats.registrars[0].failures, 0);
}

#[test]
fn a_foreign_peer_with_fresh_metadata_cannot_reach_a_freed_storage_and_its_death_harms_nothing() {
    let _one = setup();
    let rt = runtime();
    let agent = NixlAgent::new(
        &rt,
        NixlOptions::new(format!("owner-{}", std::process::id())),
    )
    .unwrap();
    let stream = rt.default_stream(0).unwrap();
    let mut peer = Peer::spawn(&format!("reader-{}", std::process::id()));
    agent.load_peer(&unhex(&peer.expect("META"))).unwrap();

    // A storage alone in its segment, offered and read once.
    let doomed = Storage::new_on(&rt, stream, 24 * MIB).unwrap();
    doomed.fill_pattern(7).unwrap();
    rt.synchronize(stream).unwrap();
    let offer = agent.describe(&doomed, stream).unwrap().to_nixl_descs();
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    peer.expect("OK");
    peer.send(&format!("READ 7 {}", hex(&offer)));
    assert_eq!(peer.expect("READ"), "0");
    // Freed and its segment given back (deregistered first); the peer loads fresh metadata.
    let regions = agent.registered_regions();
    drop(doomed);
    rt.empty_cache();
    assert_eq!(agent.registered_regions(), regions - 1);
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    peer.expect("OK");
    peer.send(&format!("READ 7 {}", hex(&offer)));
    let mut line = String::new();
    peer.output.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("ERR"),
        "a read of a freed storage must fail at the peer, got {line:?}"
    );

    // A peer killed while it reads: cudalloc's storages and registrations are untouched, and a
    // new peer reads them.
    let kept: Vec<Storage> = (0..4)
        .map(|i| {
            let s = Storage::new_on(&rt, stream, 25 * MIB).unwrap();
            s.fill_pattern(40 + i).unwrap();
            s
        })
        .collect();
    rt.synchronize(stream).unwrap();
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    peer.expect("OK");
    let offers: Vec<Vec<u8>> = kept
        .iter()
        .map(|s| agent.describe(s, stream).unwrap().to_nixl_descs())
        .collect();
    peer.send(&format!("READ 40 {}", hex(&offers[0])));
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    drop(peer);
    let regions = agent.registered_regions();
    assert_eq!(regions as u64, rt.registration_stats().mapped_regions);
    for (i, s) in kept.iter().enumerate() {
        assert_eq!(s.count_pattern_mismatches(40 + i as u64).unwrap(), 0);
    }
    let mut next = Peer::spawn(&format!("reader2-{}", std::process::id()));
    agent.load_peer(&unhex(&next.expect("META"))).unwrap();
    next.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    next.expect("OK");
    for (i, offer) in offers.iter().enumerate() {
        next.send(&format!("READ {} {}", 40 + i, hex(offer)));
        assert_eq!(
            next.expect("READ"),
            "0",
            "storage {i} after the first peer died"
        );
    }
    assert_eq!(agent.registered_regions(), regions);
}

/// A TCP port nothing listens on now (the kernel's choice; released before NIXL binds it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn metadata_travels_by_nixls_own_listeners_both_ways() {
    let _one = setup();
    let rt = runtime();
    let (ours, theirs) = (free_port(), free_port());
    let name = format!("listening-{}", std::process::id());
    let agent = NixlAgent::new(&rt, NixlOptions::new(name.clone()).listen(ours)).unwrap();
    let stream = rt.default_stream(0).unwrap();
    let python = format!("py-listening-{}", std::process::id());
    let mut peer = Peer::spawn_listening(&python, theirs);
    peer.expect("META"); // not used: the metadata goes by the listeners
                         // The peer sends its metadata to our listener; ours goes to its listener.
    peer.send(&format!("SENDMD 127.0.0.1 {ours}"));
    peer.expect("SENT");
    assert_eq!(agent.await_peer(&python, WAIT).unwrap(), python);
    // What the peer will read exists (and is registered) before our metadata leaves.
    let s = Storage::new_on(&rt, stream, 3 * MIB + 5).unwrap();
    s.fill_pattern(77).unwrap();
    rt.synchronize(stream).unwrap();
    agent.send_metadata("127.0.0.1", theirs).unwrap();
    peer.send(&format!("WAITMD {name}"));
    assert_eq!(peer.expect("OK"), name);
    // And then a read each way.
    peer.send(&format!(
        "READ 77 {}",
        hex(&agent.describe(&s, stream).unwrap().to_nixl_descs())
    ));
    assert_eq!(peer.expect("READ"), "0");
    peer.send(&format!("OFFER {} 78", 2 * MIB));
    let offered = unhex(&peer.expect("OFFER"));
    peer.expect("META");
    // The peer's new registration reaches us by its listener message again.
    peer.send(&format!("SENDMD 127.0.0.1 {ours}"));
    peer.expect("SENT");
    let remote = RemoteStorage::from_nixl_descs(&python, &offered).unwrap();
    let into = Storage::new_on(&rt, stream, 2 * MIB).unwrap();
    // The re-sent metadata arrives asynchronously: wait until it covers the offered buffer.
    agent.await_description(&remote, WAIT).unwrap();
    let mut read = agent.read(stream, &[(&into, &remote)], None).unwrap();
    read.wait(WAIT).unwrap();
    drop(read);
    assert_eq!(into.count_pattern_mismatches(78).unwrap(), 0);
}

#[test]
fn an_offered_storage_stays_allocated_until_the_peer_releases_it() {
    let _one = setup();
    let rt = runtime();
    let agent = NixlAgent::new(
        &rt,
        NixlOptions::new(format!("offering-{}", std::process::id())),
    )
    .unwrap();
    let stream = rt.default_stream(0).unwrap();
    let mut peer = Peer::spawn(&format!("leasing-{}", std::process::id()));
    let theirs = agent.load_peer(&unhex(&peer.expect("META"))).unwrap();

    let len = 4 * MIB;
    let offered = Storage::new_on(&rt, stream, len).unwrap();
    offered.fill_pattern(9).unwrap();
    let addr = offered.unordered_data_ptr();
    let (id, description) = agent.offer(&offered, stream, &theirs, WAIT * 10).unwrap();
    let descs = hex(&description.to_nixl_descs());
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    peer.expect("OK");
    // The program lets go of its handle: the offer keeps the bytes where the peer reads them.
    drop(offered);
    let other = Storage::new_on(&rt, stream, len).unwrap();
    assert_ne!(
        other.unordered_data_ptr(),
        addr,
        "an offered storage's memory went to another owner"
    );
    other.fill_pattern(10).unwrap();
    rt.synchronize(stream).unwrap();
    peer.send(&format!("READ 9 {descs}"));
    assert_eq!(
        peer.expect("READ"),
        "0",
        "the peer still reads the offered bytes"
    );

    // A release for an id that was never offered is refused; the offer stays.
    peer.send(&format!("RELEASE {}", id.wrapping_add(1)));
    peer.expect("RELEASED");
    // The peer releases it by a notification; the memory is then the allocator's again.
    peer.send(&format!("RELEASE {id}"));
    peer.expect("RELEASED");
    let deadline = std::time::Instant::now() + WAIT;
    let counts = loop {
        let counts = agent.collect_offers().unwrap();
        if counts.released == 1 {
            break counts;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no release arrived: {counts:?}"
        );
        std::thread::yield_now();
    };
    assert_eq!((counts.held, counts.expired, counts.refused), (0, 0, 1));
    assert!(
        !agent
            .notifications()
            .unwrap()
            .iter()
            .any(|n| n.message.starts_with(cudalloc::nixl::RELEASE_PREFIX)),
        "releases are never among the program's notifications"
    );
    let again = Storage::new_on(&rt, stream, len).unwrap();
    assert_eq!(
        again.unordered_data_ptr(),
        addr,
        "released: best fit hands the block out again"
    );

    // An offer nobody releases expires.
    let (_, _) = agent
        .offer(&again, stream, &theirs, Duration::ZERO)
        .unwrap();
    let counts = agent.collect_offers().unwrap();
    assert_eq!((counts.held, counts.released, counts.expired), (0, 1, 1));
}

#[test]
fn a_foreign_peer_cannot_reach_a_sleeping_storage_and_reaches_it_again_after_the_wake() {
    let _one = setup();
    let rt = runtime();
    let agent = NixlAgent::new(
        &rt,
        NixlOptions::new(format!("sleeper-{}", std::process::id())),
    )
    .unwrap();
    let stream = rt.default_stream(0).unwrap();
    let mut peer = Peer::spawn(&format!("waker-{}", std::process::id()));
    agent.load_peer(&unhex(&peer.expect("META"))).unwrap();
    let weights = {
        let _in = rt.use_tag("weights", 0).unwrap();
        Storage::new_on(&rt, stream, 6 * MIB).unwrap()
    };
    weights.fill_pattern(11).unwrap();
    let descs = hex(&agent.describe(&weights, stream).unwrap().to_nixl_descs());
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    peer.expect("OK");
    peer.send(&format!("READ 11 {descs}"));
    assert_eq!(peer.expect("READ"), "0");

    // Asleep: its pages deregistered and given back; a peer with fresh metadata is refused.
    let regions = agent.registered_regions();
    rt.sleep(&["weights"], &[]).unwrap();
    assert!(agent.registered_regions() < regions);
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    peer.expect("OK");
    peer.send(&format!("READ 11 {descs}"));
    let mut line = String::new();
    peer.output.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("ERR"),
        "a read of sleeping memory: {line:?}"
    );

    // Awake: the same addresses registered again, the same bytes (offloaded and restored).
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    assert_eq!(agent.registered_regions(), regions);
    peer.send(&format!("META {}", hex(&agent.nixl_metadata().unwrap())));
    peer.expect("OK");
    peer.send(&format!("READ 11 {descs}"));
    assert_eq!(
        peer.expect("READ"),
        "0",
        "the same descriptors after the wake"
    );
}
