//! The COW protocol, generic over the data so `loom_tests/cow.rs` model-checks this very code.
//!
//! A [`CowCell`] holds the original data, a reference count (one per COW storage) and a
//! reader-writer lock. Materialization (the first write of a COW storage) is **lock, then
//! decrement**:
//!
//! 1. take the shared lock;
//! 2. if others still hold references, do the whole fallible copy step (allocate, enqueue the copy,
//!    order it) *before* giving up the count — on failure nothing changed and the storage stays COW;
//! 3. decrement; if that released the last reference and nothing was copied, drop the shared lock,
//!    take the exclusive lock (it waits for every in-flight copy) and steal the data — no copy; if
//!    a copy was made meanwhile (the others let go after step 2), free the original the same way;
//! 4. release the shared lock.
//!
//! PyTorch decrements first and locks after: in between, the last holder can steal — and start
//! writing — the data another thread is about to copy. The model
//! `negative_control_decrement_then_lock` shows loom catching exactly that.
//!
//! Precondition of [`CowCell::materialize`]: the caller holds one reference and its own storage
//! cannot be lazily cloned concurrently (the storage's lock is held). So when the count reads 1 it
//! stays 1 until the decrement, and the steal path needs no allocation.

use crate::error::Result;
use crate::sync::model::atomic::{AtomicUsize, Ordering};
use crate::sync::model::{Mutex, RwLock};

/// What materialization produced.
#[derive(Debug)]
pub enum Materialized<D, C> {
    /// This was the last reference: the original data, unchanged and in place.
    Stole(D),
    /// Others still share the data: a private copy.
    Copied(C),
}

/// Shared data of a set of COW storages.
#[derive(Debug)]
pub struct CowCell<D> {
    lock: RwLock<()>,
    refcount: AtomicUsize,
    data: Mutex<Option<D>>,
}

impl<D> CowCell<D> {
    /// A cell shared by `refs` storages.
    pub fn new(data: D, refs: usize) -> Self {
        CowCell {
            lock: RwLock::new(()),
            refcount: AtomicUsize::new(refs),
            data: Mutex::new(Some(data)),
        }
    }

    /// A lazy clone: one more storage shares the data. One atomic increment.
    #[inline]
    pub fn add_ref(&self) {
        self.refcount.fetch_add(1, Ordering::AcqRel);
    }

    /// Current number of references (for diagnostics and tests).
    pub fn refs(&self) -> usize {
        self.refcount.load(Ordering::Acquire)
    }

    /// Runs `f` on the shared data (it is present until the last reference steals or releases it).
    pub fn with_data<R>(&self, f: impl FnOnce(Option<&D>) -> R) -> R {
        let guard = self.data.lock();
        f(guard.as_ref())
    }

    /// Materializes one reference: steal if last, else `copy` — the whole fallible copy step
    /// (allocate, enqueue the copy, order it) — under the shared lock *before* the count is given
    /// up. On `copy`'s error nothing changed: the caller still holds its reference.
    ///
    /// If the others released their references between the copy and the decrement, this was the
    /// last reference after all: the copy is kept and the original data is freed here, after every
    /// in-flight copy (exclusive lock).
    pub fn materialize<C>(&self, copy: impl FnOnce(&D) -> Result<C>) -> Result<Materialized<D, C>> {
        self.materialize_or_copy(true, copy)
    }

    /// [`CowCell::materialize`], copying even as the last reference when `steal` is false (the
    /// data cannot change owner in place: the copy is kept and the original freed here, after
    /// every in-flight copy, as when the others let go between copy and decrement).
    pub fn materialize_or_copy<C>(
        &self,
        steal: bool,
        copy: impl FnOnce(&D) -> Result<C>,
    ) -> Result<Materialized<D, C>> {
        let shared = self.lock.read();
        let copied = if !steal || self.refcount.load(Ordering::Acquire) > 1 {
            let data = self.data.lock();
            let original = data.as_ref().ok_or_else(|| {
                crate::Error::invalid("COW data already taken: reference count corrupted")
            })?;
            Some(copy(original)?)
        } else {
            None
        };
        if self.refcount.fetch_sub(1, Ordering::AcqRel) == 1 {
            drop(shared);
            let _exclusive = self.lock.write();
            let data = self.data.lock().take();
            return match (copied, data) {
                (Some(copy), original) => {
                    drop(original);
                    Ok(Materialized::Copied(copy))
                }
                (None, Some(original)) => Ok(Materialized::Stole(original)),
                (None, None) => Err(crate::Error::invalid(
                    "COW data already taken: reference count corrupted",
                )),
            };
        }
        drop(shared);
        copied.map(Materialized::Copied).ok_or_else(|| {
            // Count was 1 when read but someone else held a reference at the decrement: the
            // precondition (the caller's storage is locked) was broken.
            crate::Error::invalid("COW materialization raced a lazy clone of the same storage")
        })
    }

    /// A COW storage went away without writing: gives up its reference; the last one takes the
    /// data out (after every in-flight copy, through the exclusive lock) for the caller to free.
    pub fn release(&self) -> Option<D> {
        if self.refcount.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _exclusive = self.lock.write();
            return self.data.lock().take();
        }
        None
    }
}
