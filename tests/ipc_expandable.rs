//! Sharing memory of expandable segments across processes: the consumer fetches the chunks under a
//! storage from the producer's page socket (`SCM_RIGHTS`, no `pidfd_getfd`) and maps only those
//! pages. The producer here always uses expandable segments (the other IPC suites run a second time
//! with them too: `CUDALLOC_TEST_EXPANDABLE=1`). Children are this test binary re-executed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{Driver, IpcHandle, Runtime, Storage};

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
    assert_eq!(child.recv(), "mismatches=0,0");
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
            parent.send(&format!("mismatches={}", mismatches.join(",")));
            assert_eq!(parent.recv(), "done");
        }
        other => panic!("unknown role {other}"),
    }
}
