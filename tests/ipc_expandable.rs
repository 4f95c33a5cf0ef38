//! Sharing memory of expandable segments across processes: the consumer fetches the chunks under a
//! storage from the producer's page socket (`SCM_RIGHTS`, no `pidfd_getfd`) and maps only those
//! pages. The producer here always uses expandable segments (the other IPC suites run a second time
//! with them too: `CUDALLOC_TEST_EXPANDABLE=1`). Children are this test binary re-executed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{backend::Driver, ipc::IpcHandle, Runtime, Storage};

const CHILD: &str = "expandable_child";
const PAGE: u64 = 2 << 20;

/// A producer with expandable segments over `driver`.
fn producer_with(driver: Arc<dyn Driver>) -> Arc<Runtime> {
    let config = cudalloc::AllocatorConfig::parse("expandable_segments:True").unwrap();
    Arc::new(
        Runtime::builder()
            .config(config)
            .ipc_slots_per_file(64)
            .check_invariants(true)
            .build(driver)
            .unwrap(),
    )
}

fn producer() -> Arc<Runtime> {
    producer_with(test_driver())
}

/// A storage of `nbytes` filled with the pattern of `seed`.
fn patterned(a: &Arc<Runtime>, nbytes: u64, seed: u64) -> Storage {
    let s = Storage::new(a, 0, nbytes).unwrap();
    s.fill_pattern(seed).unwrap();
    s
}

fn send(h: IpcHandle) -> String {
    hex(&h.into_bytes())
}

/// `seed:handle` words for the child's `open` role.
fn offer(storages: &[(&Storage, u64)]) -> String {
    storages
        .iter()
        .map(|(s, seed)| format!("{seed}:{}", send(s.share_ipc().unwrap())))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn storages_at_the_same_place_of_their_pages_are_different_storages() {
    // Both storages start at offset 0 of their first page. The consumer's table of received
    // storages was keyed by (memory handle, offset) — all zero for pages — so the second receipt
    // returned the first storage (found by the interplay test).
    let a = producer();
    let first = patterned(&a, 3 * PAGE, 1);
    let second = patterned(&a, 3 * PAGE, 2);
    let mut child = ChildProcess::spawn(CHILD, "open", test_backend());
    child.send(&offer(&[(&first, 1), (&second, 2)]));
    assert_eq!(field(&child.recv(), "mismatches"), "0,0");
    child.send("done");
    child.finish();
}

/// A host driver of `mib` MiB on one device (the CUDA driver in a CUDA run).
fn roomy_driver(mib: u64) -> Arc<dyn Driver> {
    if cuda_suite() {
        return test_driver();
    }
    Arc::new(
        cudalloc::backend::HostDriver::builder()
            .devices(1)
            .memory_per_device(mib << 20)
            .build()
            .unwrap(),
    )
}

#[test]
fn storages_on_the_same_pages_share_one_mapping_and_the_consumer_reserves_only_their_pages() {
    // 40 storages of 1 MiB: two to a page. The consumer maps each page once and reserves exactly
    // the pages under the storages — not the producer's reservation (twice the device's capacity).
    let a = producer_with(roomy_driver(128));
    let storages: Vec<Storage> = (0..40).map(|i| patterned(&a, 1 << 20, 100 + i)).collect();
    let line = offer(&storages.iter().zip(100..).collect::<Vec<_>>());
    let mut child = ChildProcess::spawn(CHILD, "open", test_backend());
    child.send(&line);
    let reply = child.recv();
    assert_eq!(field(&reply, "mismatches"), vec!["0"; 40].join(","));
    let spans: u64 = field(&reply, "spans").parse().unwrap();
    let reserved: u64 = field(&reply, "reserved").parse().unwrap();
    assert_eq!(spans, 20, "pairs of storages on one page share its mapping");
    assert_eq!(reserved, 20 * PAGE, "only the pages under the storages");
    child.send("done");
    child.finish();
}

#[test]
fn a_storage_of_more_pages_than_one_message_carries_arrives_whole() {
    // 70 pages: the descriptors come in two batches (64 + 6), in page order.
    let a = producer_with(roomy_driver(192));
    let big = patterned(&a, 70 * PAGE - 4096, 7);
    let small = patterned(&a, 3000, 8);
    let mut child = ChildProcess::spawn(CHILD, "open", test_backend());
    child.send(&offer(&[(&big, 7), (&small, 8)]));
    let reply = child.recv();
    assert_eq!(field(&reply, "mismatches"), "0,0");
    assert_eq!(field(&reply, "spans"), "2");
    child.send("done");
    child.finish();
}

#[test]
fn pages_a_producer_reuses_after_a_consumer_let_go_are_fetched_afresh() {
    // A and B share a page; the consumer holds both, lets A go, and the producer puts C where A
    // was: C joins the mapping B keeps (same page, same chunk). Then everything goes, the producer
    // gives its pages back and maps new ones: D, at an address the consumer mapped before, must
    // be fetched afresh (its old mapping went with its last user).
    let a = producer();
    let half = PAGE / 2;
    let sa = patterned(&a, half, 1);
    let sb = patterned(&a, half, 2);
    let mut child = ChildProcess::spawn(CHILD, "hold", test_backend());
    child.send(&format!("open a {}", offer(&[(&sa, 1)])));
    assert_eq!(child.recv(), "a mismatches=0 spans=1");
    child.send(&format!("open b {}", offer(&[(&sb, 2)])));
    assert_eq!(child.recv(), "b mismatches=0 spans=1");
    child.send("drop a");
    assert_eq!(child.recv(), "dropped a spans=1");
    let a_ptr = sa.unordered_data_ptr();
    drop(sa);
    a.ipc_collect();
    let sc = patterned(&a, half, 3);
    assert_eq!(sc.unordered_data_ptr(), a_ptr, "C takes A's place");
    child.send(&format!("open c {}", offer(&[(&sc, 3)])));
    assert_eq!(child.recv(), "c mismatches=0 spans=1");
    child.send("verify b 2");
    assert_eq!(child.recv(), "b mismatches=0");
    child.send("drop b");
    assert_eq!(child.recv(), "dropped b spans=1");
    child.send("drop c");
    assert_eq!(child.recv(), "dropped c spans=0");
    drop((sb, sc));
    a.ipc_collect();
    a.empty_cache();
    assert_eq!(a.memory_reserved(0).unwrap(), 0, "every page given back");
    let sd = patterned(&a, half, 4);
    child.send(&format!("open d {}", offer(&[(&sd, 4)])));
    assert_eq!(child.recv(), "d mismatches=0 spans=1");
    child.send("stop");
    child.finish();
}

#[test]
fn a_killed_consumer_is_reclaimed_and_its_pages_go_back_to_the_device() {
    let a = producer();
    let storages: Vec<Storage> = (0..3).map(|i| patterned(&a, 3 * PAGE, i)).collect();
    let mut child = ChildProcess::spawn(CHILD, "open", test_backend());
    child.send(&offer(&storages.iter().zip(0..).collect::<Vec<_>>()));
    assert_eq!(field(&child.recv(), "mismatches"), "0,0,0");
    child.kill();
    drop(storages);
    assert_eq!(a.ipc_limbo().0, 3, "the dead consumer's leases keep them");
    let drained = a.ipc_collect();
    assert_eq!(drained.from_dead_consumers, 3);
    a.empty_cache();
    assert_eq!(a.memory_reserved(0).unwrap(), 0);
}

#[test]
fn a_producer_runtime_dropped_with_storages_in_limbo_still_serves_their_pages() {
    // The handle is in flight (counted, not yet opened) when the producer's storage and runtime
    // go: the memory stays allocated until the process exits, and so does the page socket.
    let a = producer();
    let s = patterned(&a, 2 * PAGE, 5);
    let line = offer(&[(&s, 5)]);
    drop(s);
    drop(a);
    let mut child = ChildProcess::spawn(CHILD, "open", test_backend());
    child.send(&line);
    assert_eq!(field(&child.recv(), "mismatches"), "0");
    child.send("done");
    child.finish();
}

/// The page socket of the storage a handle names (`…-ref<n>` → `…-pages0`).
fn page_socket(handle: &IpcHandle) -> std::path::PathBuf {
    let name = &handle.wire().ref_file;
    let stem = &name[..name.rfind("-ref").unwrap()];
    std::path::PathBuf::from("/dev/shm").join(format!("{stem}-pages0"))
}

/// A page request laid out by hand (magic, slot, generation, page, first, count, secret, name).
fn raw_request(handle: &IpcHandle, generation: u32, count: u64) -> Vec<u8> {
    let w = handle.wire();
    let pages = w.pages.unwrap();
    let mut b = b"cdalPRQ2".to_vec();
    b.extend(w.slot.to_le_bytes());
    b.extend(generation.to_le_bytes());
    b.extend(pages.page.to_le_bytes());
    b.extend(pages.first.to_le_bytes());
    b.extend(count.to_le_bytes());
    b.extend(pages.secret);
    let mut name = w.ref_file.as_bytes().to_vec();
    name.resize(64, 0);
    b.extend(name);
    b
}

/// Sends `request` to the page socket and returns the status of the first answer header (None:
/// the server closed without answering).
fn ask(socket: &std::path::Path, request: &[u8]) -> Option<u32> {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream.write_all(request).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut header = [0u8; 32];
    stream.read_exact(&mut header).ok()?;
    assert_eq!(&header[..8], b"cdalPRP2");
    Some(u32::from_le_bytes(header[8..12].try_into().unwrap()))
}

#[test]
fn the_page_socket_refuses_what_it_must_and_keeps_serving() {
    let a = producer();
    let s = patterned(&a, 2 * PAGE, 6);
    let handle = s.share_ipc().unwrap();
    let socket = page_socket(&handle);
    let generation = handle.wire().generation;
    let count = handle.wire().pages.unwrap().count;
    assert_eq!(
        ask(&socket, b"short"),
        None,
        "a truncated request is dropped"
    );
    assert_eq!(ask(&socket, &[0xAB; 120]), Some(1), "garbage: malformed");
    assert_eq!(
        ask(&socket, &raw_request(&handle, generation + 1, count)),
        Some(2),
        "a stale generation: not shared"
    );
    assert_eq!(
        ask(&socket, &raw_request(&handle, generation, count + 1)),
        Some(3),
        "other pages than shared"
    );
    let mut evil_name = raw_request(&handle, generation, count);
    evil_name[56..66].copy_from_slice(b"../../etc/");
    assert_eq!(ask(&socket, &evil_name), Some(1), "a name outside /dev/shm");
    // After all that, a real consumer is served.
    let mut child = ChildProcess::spawn(CHILD, "open", test_backend());
    child.send(&format!("6:{}", send(handle)));
    assert_eq!(field(&child.recv(), "mismatches"), "0");
    child.send("done");
    child.finish();
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn expandable_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let a = Arc::new(Runtime::new(child_test_driver(), Default::default()).unwrap());
    let mut parent = ParentLink::new();
    match role.as_str() {
        "open" => {
            let line = parent.recv();
            let received: Vec<(Storage, u64)> = line
                .split(' ')
                .map(|word| {
                    let (seed, handle) = word.split_once(':').unwrap();
                    let h = IpcHandle::from_bytes(&unhex(handle)).unwrap();
                    (Storage::from_ipc(&a, h).unwrap(), seed.parse().unwrap())
                })
                .collect();
            let mismatches: Vec<String> = received
                .iter()
                .map(|(s, seed)| s.count_pattern_mismatches(*seed).unwrap().to_string())
                .collect();
            parent.send(&format!(
                "mismatches={} spans={} reserved={}",
                mismatches.join(","),
                a.ipc_open_segments(),
                a.ipc_imported_address_space()
            ));
            assert_eq!(parent.recv(), "done");
        }
        "hold" => {
            // open NAME SEED:HANDLE | verify NAME SEED | drop NAME | stop
            let mut held: std::collections::HashMap<String, Storage> = Default::default();
            loop {
                let line = parent.recv();
                let words: Vec<&str> = line.split(' ').collect();
                match words[0] {
                    "open" => {
                        let (seed, handle) = words[2].split_once(':').unwrap();
                        let h = IpcHandle::from_bytes(&unhex(handle)).unwrap();
                        let s = Storage::from_ipc(&a, h).unwrap();
                        let bad = s.count_pattern_mismatches(seed.parse().unwrap()).unwrap();
                        held.insert(words[1].into(), s);
                        parent.send(&format!(
                            "{} mismatches={bad} spans={}",
                            words[1],
                            a.ipc_open_segments()
                        ));
                    }
                    "verify" => {
                        let bad = held[words[1]]
                            .count_pattern_mismatches(words[2].parse().unwrap())
                            .unwrap();
                        parent.send(&format!("{} mismatches={bad}", words[1]));
                    }
                    "drop" => {
                        held.remove(words[1]);
                        parent.send(&format!(
                            "dropped {} spans={}",
                            words[1],
                            a.ipc_open_segments()
                        ));
                    }
                    _ => break,
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
}
