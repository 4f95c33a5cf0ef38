//! Loom models of the COW protocol (`cudalloc::internals::cell::CowCell`, the production code, over
//! loom's atomics and locks). The data is a `loom::cell::UnsafeCell`: a stealer's write that is not
//! ordered after every copier's read is reported by loom as a data race, so "the stealer's writes
//! never overlap a copy" is checked by loom itself, not by a timing assumption.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --test loom_cow`.
//! Run time on the 2-core CI machine (all five models, release build): about 2 s.
#![cfg(loom)]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use cudalloc::internals::cell::{CowCell, Materialized};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex, RwLock};
use loom::thread;

const ORIGINAL: u64 = 7;
const WRITTEN: u64 = 99;

/// Device memory stand-in: counts how often it is freed.
struct Data {
    value: UnsafeCell<u64>,
    frees: Arc<AtomicUsize>,
}

impl Drop for Data {
    fn drop(&mut self) {
        self.frees.fetch_add(1, Ordering::SeqCst);
    }
}

fn read(d: &Data) -> u64 {
    // SAFETY (model): loom checks that this read is ordered with every write.
    d.value.with(|p| unsafe { *p })
}

fn write(d: &Data, v: u64) {
    // SAFETY (model): loom checks that this write is ordered with every other access.
    d.value.with_mut(|p| unsafe { *p = v })
}

/// One holder writes: materialize, then write to what it got. Returns true if it stole.
fn materialize_and_write(cell: &CowCell<Data>) -> bool {
    let out = cell.materialize(|src| Ok(read(src))).unwrap();
    match out {
        Materialized::Stole(data) => {
            write(&data, WRITTEN);
            true
        }
        Materialized::Copied(copy) => {
            assert_eq!(
                copy, ORIGINAL,
                "a copy read data that a stealer had already changed"
            );
            false
        }
    }
}

fn cell(refs: usize) -> (Arc<CowCell<Data>>, Arc<AtomicUsize>) {
    let frees = Arc::new(AtomicUsize::new(0));
    let data = Data {
        value: UnsafeCell::new(ORIGINAL),
        frees: frees.clone(),
    };
    (Arc::new(CowCell::new(data, refs)), frees)
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    // Honours LOOM_MAX_PREEMPTIONS (read by `Builder::new`); 3 when unset.
    let mut b = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

#[test]
fn two_holders_materialize_concurrently() {
    model(|| {
        let (c, frees) = cell(2);
        let c2 = c.clone();
        let t = thread::spawn(move || materialize_and_write(&c2));
        let mine = materialize_and_write(&c);
        let theirs = t.join().unwrap();
        // At most one steal: a copier that finds itself last after its copy (the other let go
        // meanwhile) frees the original instead.
        assert!(!(mine && theirs), "at most one steal");
        assert_eq!(
            frees.load(Ordering::SeqCst),
            1,
            "the data freed exactly once (by the stealer or the last copier)"
        );
    });
}

#[test]
fn three_holders_materialize_concurrently() {
    model(|| {
        let (c, frees) = cell(3);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let c = c.clone();
                thread::spawn(move || materialize_and_write(&c))
            })
            .collect();
        let mut steals = usize::from(materialize_and_write(&c));
        for h in handles {
            steals += usize::from(h.join().unwrap());
        }
        assert!(steals <= 1, "at most one steal");
        assert_eq!(frees.load(Ordering::SeqCst), 1, "freed exactly once");
    });
}

#[test]
fn lazy_clone_races_materialization() {
    model(|| {
        let (c, frees) = cell(2);
        let c2 = c.clone();
        // Holder 2 lazily clones (a third holder appears) and then both its references write.
        let t = thread::spawn(move || {
            c2.add_ref();
            usize::from(materialize_and_write(&c2)) + usize::from(materialize_and_write(&c2))
        });
        let mine = usize::from(materialize_and_write(&c));
        assert!(
            mine + t.join().unwrap() <= 1,
            "at most one of the three steals"
        );
        assert_eq!(frees.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn drop_races_materialization() {
    model(|| {
        let (c, frees) = cell(2);
        let c2 = c.clone();
        let t = thread::spawn(move || drop(c2.release()));
        let stole = materialize_and_write(&c);
        t.join().unwrap();
        // Either the dropper released first (we stole) or we copied and the dropper freed.
        assert_eq!(
            frees.load(Ordering::SeqCst),
            1,
            "freed exactly once (stole: {stole})"
        );
    });
}

/// PyTorch's order, for the negative control: decrement first, lock after.
struct NaiveCell {
    lock: RwLock<()>,
    refs: AtomicUsize,
    data: Mutex<Option<Data>>,
}

impl NaiveCell {
    fn materialize_and_write(&self) -> bool {
        let last = self.refs.fetch_sub(1, Ordering::AcqRel) == 1;
        if last {
            let _x = self.lock.write().unwrap();
            let data = self.data.lock().unwrap().take().unwrap();
            drop(_x);
            write(&data, WRITTEN);
            return true;
        }
        let _s = self.lock.read().unwrap();
        let copy = {
            let d = self.data.lock().unwrap();
            d.as_ref().map(read)
        };
        // The last holder may have taken (and be writing) the data already.
        assert_eq!(copy, Some(ORIGINAL), "copy saw stolen data");
        false
    }
}

#[test]
fn negative_control_decrement_then_lock() {
    let caught = std::panic::catch_unwind(|| {
        model(|| {
            let frees = Arc::new(AtomicUsize::new(0));
            let c = Arc::new(NaiveCell {
                lock: RwLock::new(()),
                refs: AtomicUsize::new(2),
                data: Mutex::new(Some(Data {
                    value: UnsafeCell::new(ORIGINAL),
                    frees,
                })),
            });
            let c2 = c.clone();
            let t = thread::spawn(move || c2.materialize_and_write());
            c.materialize_and_write();
            t.join().unwrap();
        })
    });
    assert!(
        caught.is_err(),
        "loom must catch the decrement-then-lock ordering"
    );
}
