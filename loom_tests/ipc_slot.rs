//! Loom model of the IPC slot protocol: producer drop vs consumer release vs the drain, with the
//! production code (`cudalloc::internals::limbo`: the slot counter protocol and the limbo) over loom's
//! atomics and mutex. Processes are modeled as threads; the shared-memory slot as a struct of two
//! loom atomics; the release ring as one hint flag.
//!
//! Properties: the storage is freed exactly once; never while a consumer uses it; and never left
//! stranded in limbo once every count is gone (a final drain of the remaining hints frees it).
//! A negative control re-runs the model with the check taken *outside* the limbo lock and asserts
//! that loom finds the stranded-entry schedule.
//!
//! The lease models (`cudalloc::internals::lease_table`): two leases of one consumer process on one slot
//! against the producer's dead-holder check — the memory is never reclaimed while a lease uses
//! it; the negative control (unlock on every drop, the old behaviour) is caught.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --test loom_ipc_slot`.
//! Measured on the 2-core CI machine: the five models (three on the slot and limbo, two on the
//! per-process lease table) finish in about 4.5 s together.
#![cfg(loom)]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use cudalloc::internals::lease_table::LeaseTable;
use cudalloc::internals::limbo::{Counter, Limbo, SlotCounters};
use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

struct LoomCounter(AtomicU64);

impl Counter for LoomCounter {
    fn increment(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst)
    }

    fn decrement(&self) -> bool {
        let mut current = self.0.load(Ordering::SeqCst);
        loop {
            if current == 0 {
                return false;
            }
            match self
                .0
                .compare_exchange(current, current - 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(now) => current = now,
            }
        }
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

struct Slot {
    pending: LoomCounter,
    held: LoomCounter,
}

impl SlotCounters for Slot {
    type C = LoomCounter;
    type P = LoomCounter;
    fn pending(&self) -> &LoomCounter {
        &self.pending
    }
    fn held(&self) -> &LoomCounter {
        &self.held
    }
}

struct World {
    slot: Slot,
    limbo: Limbo<u32, &'static str>,
    hint: AtomicBool,
    in_use: AtomicBool,
    freed: AtomicUsize,
}

impl World {
    fn new(sent: u64) -> Arc<World> {
        Arc::new(World {
            slot: Slot {
                pending: LoomCounter(AtomicU64::new(sent)),
                held: LoomCounter(AtomicU64::new(0)),
            },
            limbo: Limbo::default(),
            hint: AtomicBool::new(false),
            in_use: AtomicBool::new(false),
            freed: AtomicUsize::new(0),
        })
    }

    fn free(&self, what: Option<&'static str>) {
        if what.is_some() {
            assert!(
                !self.in_use.load(Ordering::SeqCst),
                "freed while a consumer uses the memory"
            );
            assert!(self.slot.is_free(), "freed while counted");
            self.freed.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The producer's drain: consume the hint, free if in limbo and free.
    fn drain(&self) {
        if self.hint.swap(false, Ordering::SeqCst) {
            self.free(self.limbo.take_if_free(0, &self.slot));
        }
    }
}

/// Consumer process: open (lease), use, release (held −1, push hint).
fn consumer(w: &World) {
    assert!(w.slot.pending_to_held());
    w.in_use.store(true, Ordering::SeqCst);
    w.in_use.store(false, Ordering::SeqCst);
    assert!(w.slot.release_held());
    // The ring write is a read-modify-write, as in `refcount.rs` (`push_release` swaps its entry).
    w.hint.fetch_or(true, Ordering::SeqCst);
}

/// The message of a caught panic.
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

/// A model builder honouring `LOOM_MAX_PREEMPTIONS` (3 when unset).
fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        b.preemption_bound = Some(3);
    }
    b
}

fn run(retire: fn(&World)) {
    let builder = builder();
    builder.check(move || {
        let w = World::new(1);
        let (c, p, d) = (w.clone(), w.clone(), w.clone());
        let tc = thread::spawn(move || consumer(&c));
        let tp = thread::spawn(move || retire(&p));
        let td = thread::spawn(move || d.drain());
        tc.join().unwrap();
        tp.join().unwrap();
        td.join().unwrap();
        w.drain(); // the next drain after everything settled
        assert_eq!(
            w.freed.load(Ordering::SeqCst),
            1,
            "freed exactly once, never stranded"
        );
    });
}

#[test]
fn retire_races_release_and_drain() {
    run(|w| w.free(w.limbo.retire(0, "storage", &w.slot)));
}

#[test]
fn a_handle_given_back_unopened_races_retire() {
    let builder = builder();
    builder.check(|| {
        let w = World::new(2);
        let (c, g, p) = (w.clone(), w.clone(), w.clone());
        let tc = thread::spawn(move || consumer(&c));
        let tg = thread::spawn(move || {
            assert!(g.slot.give_back_pending());
            g.hint.fetch_or(true, Ordering::SeqCst);
        });
        let tp = thread::spawn(move || p.free(p.limbo.retire(0, "storage", &p.slot)));
        tc.join().unwrap();
        tg.join().unwrap();
        tp.join().unwrap();
        w.drain();
        assert_eq!(w.freed.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn negative_control_checking_outside_the_limbo_lock_strands_the_storage() {
    // The naive order: decide "not free" first, insert later without re-checking under the lock.
    fn naive_retire(w: &World) {
        if w.slot.is_free() {
            w.free(Some("storage"));
            return;
        }
        // Window: the consumer releases and the drain consumes the hint here.
        let _ = w.limbo.retire(
            0,
            "storage",
            &Slot {
                pending: LoomCounter(AtomicU64::new(1)),
                held: LoomCounter(AtomicU64::new(0)),
            },
        );
    }
    let caught = std::panic::catch_unwind(|| run(naive_retire));
    let text = panic_text(
        caught.expect_err("loom must find the schedule that strands the storage in limbo"),
    );
    assert!(
        text.contains("never stranded"),
        "failed for another reason: {text}"
    );
}

// ---- Leases of one consumer process (`cudalloc::internals::lease_table`) ----
//
// Two threads of one consumer process each hold a lease on the same slot (two runtimes, or two
// receipts of one handle); the producer, whose storage is in limbo, runs the dead-holder check of
// `ipc_collect` concurrently: "pending == 0, held > 0 and nobody holds the slot's lock" means every
// holder died, so the memory is reclaimed. It must never be reclaimed while a lease uses it.

struct Process {
    slot: Slot,
    /// The process's OFD lock on the slot (one open file description per process).
    locked: AtomicBool,
    leases: LeaseTable<u32>,
    in_use: AtomicUsize,
    reclaimed: AtomicBool,
}

impl Process {
    fn new() -> Arc<Process> {
        Arc::new(Process {
            slot: Slot {
                pending: LoomCounter(AtomicU64::new(2)),
                held: LoomCounter(AtomicU64::new(0)),
            },
            locked: AtomicBool::new(false),
            leases: LeaseTable::default(),
            in_use: AtomicUsize::new(0),
            reclaimed: AtomicBool::new(false),
        })
    }

    /// The producer's dead-holder check, in `collect`'s order: counts, then the lock.
    fn collect(&self) {
        let (pending, held) = self.slot.counts();
        if pending == 0 && held > 0 && !self.locked.load(Ordering::SeqCst) {
            assert_eq!(
                self.in_use.load(Ordering::SeqCst),
                0,
                "reclaimed memory a live lease uses"
            );
            self.reclaimed.store(true, Ordering::SeqCst);
        }
    }

    fn use_memory(&self) {
        self.in_use.fetch_add(1, Ordering::SeqCst);
        self.in_use.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One lease, the production way: counted per process.
fn counted_lease(p: &Process) {
    p.leases
        .take(
            0,
            || {
                p.locked.store(true, Ordering::SeqCst);
                assert!(p.slot.pending_to_held());
                Ok(())
            },
            || {
                assert!(p.slot.give_back_pending());
                Ok(())
            },
        )
        .unwrap();
    p.use_memory();
    assert!(p.leases.release(&0, || {
        assert!(p.slot.release_held());
        p.locked.store(false, Ordering::SeqCst);
    }));
}

/// One lease the old way: every lease is a holder, and every drop unlocks the process's lock.
fn unlock_on_every_drop(p: &Process) {
    p.locked.store(true, Ordering::SeqCst);
    assert!(p.slot.pending_to_held());
    p.use_memory();
    assert!(p.slot.release_held());
    p.locked.store(false, Ordering::SeqCst);
}

fn run_leases(lease: fn(&Process)) {
    builder().check(move || {
        let p = Process::new();
        let (a, b, c) = (p.clone(), p.clone(), p.clone());
        let ta = thread::spawn(move || lease(&a));
        let tb = thread::spawn(move || lease(&b));
        let tc = thread::spawn(move || c.collect());
        ta.join().unwrap();
        tb.join().unwrap();
        tc.join().unwrap();
        assert_eq!(p.slot.counts(), (0, 0), "every count returned");
        assert!(!p.locked.load(Ordering::SeqCst));
    });
}

#[test]
fn two_leases_of_one_process_keep_the_slot_held_until_the_last() {
    run_leases(counted_lease);
}

#[test]
fn negative_control_unlocking_on_every_drop_frees_memory_in_use() {
    let caught = std::panic::catch_unwind(|| run_leases(unlock_on_every_drop));
    let text = panic_text(caught.expect_err("loom must find the reclaim of memory in use"));
    assert!(
        text.contains("reclaimed memory a live lease uses"),
        "failed for another reason: {text}"
    );
}
