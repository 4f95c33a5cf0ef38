//! What a data-loader worker does after `fork`, on every object it inherited: drop storages (plain,
//! lazy clones, received from another process), empty the cache, allocate, run stream work, drop
//! the runtime — then build a runtime of its own. The parent is multi-threaded (stream workers, a
//! page server, a thread churning its own runtime). In the child, inherited objects release
//! nothing of the parent's and poison nothing, allocation and stream work are `ForkedChild`
//! errors (never a hang: a child past its deadline dies of `SIGALRM`, a failure), and the child's
//! own runtime works. The parent's bytes, counts and cache are checked afterwards.
//!
//! Its own test binary: the forks happen one at a time (`FORKS`), with no other test code running.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::forked::in_forked_child;
use common::*;
use cudalloc::{ipc::IpcHandle, AllocatorConfig, ErrorKind, Runtime, Storage};

const MIB: u64 = 1 << 20;
const CHILD: &str = "fork_safety_child";

/// One fork at a time: a fork while another test thread holds a lock would copy it held.
static FORKS: Mutex<()> = Mutex::new(());

fn runtime(conf: &str) -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(AllocatorConfig::parse(conf).unwrap())
            .build(sanitized(Arc::new(host_driver())))
            .unwrap(),
    )
}

/// `Ok` if `result` is the forked child's refusal, else what it was instead.
fn refused<T: std::fmt::Debug>(what: &str, result: cudalloc::Result<T>) -> Result<(), String> {
    match result {
        Err(err) if err.kind() == ErrorKind::ForkedChild => Ok(()),
        other => Err(format!(
            "{what} in the child: {other:?}, not a ForkedChild error"
        )),
    }
}

/// A thread allocating, filling, checking and freeing on a runtime of its own until dropped, so
/// the fork happens while another thread works in cudalloc (its locks may be held at that instant).
struct Churn {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Churn {
    fn start() -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let own = runtime("");
            let mut round = 0u64;
            while !flag.load(Ordering::Relaxed) {
                let s = Storage::new(&own, 0, 64 << 10).unwrap();
                s.fill_pattern(round).unwrap();
                // Waits for the stream: its queue stays short.
                assert_eq!(s.count_pattern_mismatches(round).unwrap(), 0);
                round += 1;
            }
        });
        Churn {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Churn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

/// Everything the child inherits and drops; the parent's copy stays in its own memory.
struct Inherited {
    runtime: Arc<Runtime>,
    live: Storage,
    other: Storage,
    lazy: Storage,
    shared: Storage,
}

#[test]
fn a_forked_worker_releases_nothing_of_its_parent_and_its_own_runtime_works() {
    for conf in ["", "expandable_segments:True"] {
        let _one = FORKS.lock().unwrap_or_else(|p| p.into_inner());
        let a = runtime(conf);
        let live = Storage::new(&a, 0, 4 * MIB).unwrap();
        live.fill_pattern(9).unwrap();
        let other = Storage::new(&a, 0, 4 * MIB).unwrap();
        other.fill_pattern(10).unwrap();
        let stream = a.current_stream(0).unwrap();
        let lazy = live.lazy_clone().unwrap();
        let shared = Storage::new(&a, 0, MIB).unwrap();
        shared.fill_pattern(13).unwrap();
        let handle = shared.share_ipc().unwrap(); // ref-counter file, event, page server
                                                  // A whole cached segment with known bytes: an empty_cache in the child must not poison it.
        let cached = Storage::new(&a, 0, 12 * MIB).unwrap();
        cached.fill_pattern(11).unwrap();
        let cached_at = cached.unordered_data_ptr();
        drop(cached);
        let held = Mutex::new(Some(Inherited {
            runtime: Arc::clone(&a),
            live,
            other,
            lazy,
            shared,
        }));
        drop(a);
        let churn = Churn::start();

        let verdict = in_forked_child(|| {
            let Inherited {
                runtime: inherited,
                live,
                other,
                lazy,
                shared,
            } = held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .unwrap();
            drop(lazy);
            drop(other);
            drop(shared);
            drop(handle);
            inherited.empty_cache();
            refused("allocating", Storage::new(&inherited, 0, 4 * MIB))?;
            refused(
                "allocating on a stream",
                inherited.allocate_on(stream, 4096),
            )?;
            refused("a fill on an inherited storage", live.fill_pattern(1))?;
            refused(
                "counting an inherited storage",
                live.count_pattern_mismatches(9),
            )?;
            refused("sharing", live.share_ipc())?;
            refused("the stats", inherited.memory_stats(0))?;
            drop(live);
            // The child's last reference: the runtime, its allocator and driver drop here.
            drop(inherited);
            // A runtime of the child's own works.
            let own = runtime(conf);
            let s = Storage::new(&own, 0, 4 * MIB).map_err(|e| e.to_string())?;
            s.fill_pattern(3).map_err(|e| e.to_string())?;
            match s.count_pattern_mismatches(3) {
                Ok(0) => Ok(()),
                other => Err(format!("the child's own storage: {other:?}")),
            }
        });
        drop(churn);
        verdict.unwrap_or_else(|why| panic!("{conf:?}: {why}"));

        let Inherited {
            runtime: a,
            live,
            other,
            lazy,
            shared,
        } = held.into_inner().unwrap().unwrap();
        assert_eq!(
            live.count_pattern_mismatches(9).unwrap(),
            0,
            "{conf:?}: live"
        );
        assert_eq!(
            other.count_pattern_mismatches(10).unwrap(),
            0,
            "{conf:?}: dropped in the child"
        );
        assert_eq!(
            lazy.count_pattern_mismatches(9).unwrap(),
            0,
            "{conf:?}: lazy clone"
        );
        assert_eq!(
            shared.count_pattern_mismatches(13).unwrap(),
            0,
            "{conf:?}: shared"
        );
        let again = Storage::new(&a, 0, 12 * MIB).unwrap();
        assert_eq!(
            again.unordered_data_ptr(),
            cached_at,
            "{conf:?}: the cached segment again"
        );
        assert_eq!(
            again.count_pattern_mismatches(11).unwrap(),
            0,
            "{conf:?}: the cached segment's bytes"
        );
        // The parent goes on: stream work, sharing, lazy clones stay apart.
        live.fill_pattern(12).unwrap();
        assert_eq!(lazy.count_pattern_mismatches(9).unwrap(), 0, "{conf:?}");
        drop(live.share_ipc().unwrap());
        a.check_invariants().unwrap();
        drop((again, live, other, lazy, shared));
        a.ipc_collect();
        a.empty_cache();
        assert_eq!(a.memory_reserved(0).unwrap(), 0, "{conf:?}");
    }
}

/// Every door of a driver, unsanitized, refuses a forked child: the core calls, and the
/// capabilities' (virtual memory, capture and graphs, page-locked memory), whose forwarded
/// methods the host backend let through before the checks moved to the doors.
#[test]
fn every_door_of_a_bare_driver_refuses_a_forked_child() {
    let _one = FORKS.lock().unwrap_or_else(|p| p.into_inner());
    let d: Arc<dyn cudalloc::backend::Driver> = Arc::new(host_driver());
    let s = d.stream_create(0).unwrap();
    let ptr = d.malloc(0, 4096).unwrap();
    let churn = Churn::start();
    let verdict = in_forked_child(|| {
        refused("malloc", d.malloc(0, 4096))?;
        refused("mem_info", d.mem_info(0))?;
        refused("stream_create", d.stream_create(0))?;
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        refused("memset", unsafe { d.memset(s, ptr, 0, 16) })?;
        refused("event_create", d.event_create(0, Default::default()))?;
        refused("vm_granularity", d.vm().vm_granularity(0))?;
        refused("vm_reserve", d.vm().vm_reserve(0, 2 * MIB))?;
        refused("vm_create_chunk", d.vm().vm_create_chunk(0, 2 * MIB))?;
        refused(
            "stream_begin_capture",
            d.graphs()
                .stream_begin_capture(s, cudalloc::graph::CaptureMode::Global),
        )?;
        refused("stream_capture_status", d.graphs().stream_capture_status(s))?;
        refused("host_alloc", d.pinned().host_alloc(4096))?;
        Ok(())
    });
    drop(churn);
    verdict.unwrap_or_else(|why| panic!("{why}"));
    // The parent's driver goes on.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, ptr, 1, 16) }.unwrap();
    d.stream_synchronize(s).unwrap();
    d.free(ptr).unwrap();
}

#[test]
fn a_forked_worker_dropping_a_received_storage_leaves_it_to_its_parent() {
    // The producer (this process) shares; the consumer (a child process) opens the storage and
    // forks a worker that drops its copy. The consumer still holds the storage: the producer must
    // keep it in limbo, and memory the producer allocates next must not be that storage's.
    for conf in ["", "expandable_segments:True"] {
        let _one = FORKS.lock().unwrap_or_else(|p| p.into_inner());
        let a = runtime(conf);
        let s = Storage::new(&a, 0, 4 * MIB).unwrap();
        s.fill_pattern(7).unwrap();
        let mut consumer = ChildProcess::spawn(CHILD, "worker_drops", "host");
        consumer.send(conf);
        consumer.send(&hex(&s.share_ipc().unwrap().into_bytes()));
        assert_eq!(consumer.recv(), "forked ok", "{conf:?}");
        drop(s);
        a.ipc_collect();
        assert_eq!(
            a.ipc_limbo().0,
            1,
            "{conf:?}: the consumer still holds the storage its worker dropped"
        );
        // What the producer allocates next is not the consumer's storage.
        let next: Vec<_> = (0..4)
            .map(|i| {
                let n = Storage::new(&a, 0, 4 * MIB).unwrap();
                n.fill_pattern(100 + i).unwrap();
                n
            })
            .collect();
        consumer.send("check");
        assert_eq!(consumer.recv(), "mismatches=0", "{conf:?}");
        consumer.send("release");
        assert_eq!(consumer.recv(), "released", "{conf:?}");
        consumer.finish();
        a.ipc_collect();
        assert_eq!(a.ipc_limbo().0, 0, "{conf:?}: released by the consumer");
        drop(next);
    }
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn fork_safety_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    match role.as_str() {
        "worker_drops" => {
            let conf = parent.recv();
            let a = runtime(&conf);
            let bytes = unhex(&parent.recv());
            let received = Storage::from_ipc(&a, IpcHandle::from_bytes(&bytes).unwrap()).unwrap();
            assert_eq!(received.count_pattern_mismatches(7).unwrap(), 0);
            let held = Mutex::new(Some(received));
            let verdict = in_forked_child(|| {
                // The worker drops its copy of the received storage.
                drop(held.lock().unwrap_or_else(|p| p.into_inner()).take());
                Ok(())
            });
            match verdict {
                Ok(()) => parent.send("forked ok"),
                Err(why) => parent.send(&format!("forked failed: {why}")),
            }
            let received = held.into_inner().unwrap().unwrap();
            assert_eq!(parent.recv(), "check");
            parent.send(&format!(
                "mismatches={}",
                received.count_pattern_mismatches(7).unwrap()
            ));
            assert_eq!(parent.recv(), "release");
            drop(received);
            parent.send("released");
        }
        other => panic!("unknown role {other}"),
    }
}
