//! The slot protocol's shared logic, generic so that `loom_tests/` model-checks the very code the
//! producer runs: the counter operations of a slot ([`SlotCounters`], over any [`Counter`]) and the
//! limbo ([`Limbo`]) that decides when a shared storage is freed.
//!
//! Freed exactly once, never while counted: a storage leaves the limbo only under the limbo's lock,
//! and only when its slot reads `pending == 0 && held == 0`. [`Limbo::retire`] checks the slot and
//! inserts *under the same lock* that [`Limbo::take_if_free`] holds while checking and removing: a
//! consumer's release that a drain already consumed (hint read, entry not yet in limbo) is caught by
//! the producer's own check, so no entry is stranded until a full scan. (Checking before taking the
//! lock loses that release: the model `retire_races_release_and_drain` fails with that ordering.)

use std::collections::HashMap;
use std::hash::Hash;

use crate::sync::model::Mutex;

/// An atomic counter (real in shared memory, loom's in the models).
pub trait Counter {
    /// Adds one; returns the previous value.
    fn increment(&self) -> u64;
    /// Subtracts one unless zero; `false` if it was zero.
    fn decrement(&self) -> bool;
    /// Current value.
    fn get(&self) -> u64;
}

/// The two counters of a slot and the protocol on them (see `refcount.rs` for the table).
pub trait SlotCounters {
    /// Counter type of `held`.
    type C: Counter;
    /// Counter type of `pending` (in ref-counter files it also carries the slot's generation).
    type P: Counter;
    /// Handles sent, not yet opened or given back.
    fn pending(&self) -> &Self::P;
    /// Consumer processes holding the slot.
    fn held(&self) -> &Self::C;

    /// Producer: one more handle sent.
    fn add_pending(&self) {
        self.pending().increment();
    }

    /// Consumer (lock held): becomes a holder — raises `held` *before* lowering `pending`, so
    /// nobody reading `pending` then `held` sees both at 0 midway. False if nothing was pending.
    fn pending_to_held(&self) -> bool {
        self.held().increment();
        if self.pending().decrement() {
            true
        } else {
            self.held().decrement();
            false
        }
    }

    /// Consumer: a handle given back unopened (or a duplicate receipt). False if nothing pending.
    fn give_back_pending(&self) -> bool {
        self.pending().decrement()
    }

    /// Consumer: stops holding. False if nobody held.
    fn release_held(&self) -> bool {
        self.held().decrement()
    }

    /// `(pending, held)`, read in that order.
    fn counts(&self) -> (u64, u64) {
        let pending = self.pending().get();
        (pending, self.held().get())
    }

    /// Nobody counts on the slot.
    fn is_free(&self) -> bool {
        self.counts() == (0, 0)
    }
}

/// Shared storages whose producer dropped them while consumers still counted.
#[derive(Debug)]
pub struct Limbo<K, T> {
    entries: Mutex<HashMap<K, T>>,
}

impl<K: Eq + Hash + Copy, T> Default for Limbo<K, T> {
    fn default() -> Self {
        Limbo {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash + Copy, T> Limbo<K, T> {
    fn lock(&self) -> crate::sync::model::MutexGuard<'_, HashMap<K, T>> {
        self.entries.lock()
    }

    /// The producer's storage died. Returns it back when it must be freed now (nobody counts),
    /// else keeps it. The check and the insertion happen under the limbo lock.
    pub fn retire(&self, key: K, data: T, slot: &impl SlotCounters) -> Option<T> {
        let mut entries = self.lock();
        if slot.is_free() {
            return Some(data);
        }
        entries.insert(key, data);
        None
    }

    /// Keeps `data` without looking at its slot (whose counters cannot be trusted).
    pub fn keep(&self, key: K, data: T) {
        self.lock().insert(key, data);
    }

    /// A consumer released `key`'s slot: takes the entry out if it is in limbo and free.
    pub fn take_if_free(&self, key: K, slot: &impl SlotCounters) -> Option<T> {
        let mut entries = self.lock();
        if entries.contains_key(&key) && slot.is_free() {
            return entries.remove(&key);
        }
        None
    }

    /// Takes out every entry for which `free` holds (full scans).
    pub fn take_where(&self, mut free: impl FnMut(&K, &T) -> bool) -> Vec<T> {
        let mut entries = self.lock();
        let keys: Vec<K> = entries
            .iter()
            .filter(|(k, v)| free(k, v))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| entries.remove(&k))
            .collect()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the limbo is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Folds over the entries (sizes for reports).
    pub fn fold<A>(&self, init: A, f: impl FnMut(A, &T) -> A) -> A {
        self.lock().values().fold(init, f)
    }

    /// Removes everything (teardown).
    pub fn drain_all(&self) -> Vec<T> {
        self.lock().drain().map(|(_, v)| v).collect()
    }
}
