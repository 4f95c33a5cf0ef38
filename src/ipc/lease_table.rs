//! How many leases this process holds on each slot, generic so `loom_tests/ipc_slot.rs`
//! model-checks the very code consumers run.
//!
//! A consumer *process* is one holder of a slot: one OFD lock on the slot's bytes and one `held`
//! count, whatever number of leases (runtimes, threads, receipts) it has on it. The first lease
//! takes the hold, the last one gives it up; both steps run under this table's lock, so a lease
//! being dropped can never unlock a slot another lease of the process is taking or still uses.
//! (Unlocking on every drop — what one open file description per process did before — lets the
//! producer see "no lock, held > 0" while a lease is alive and reclaim memory in use: the model
//! `negative_control_unlocking_on_every_drop_frees_memory_in_use` shows loom finding it.)

use std::collections::HashMap;
use std::hash::Hash;

use crate::error::Result;
use crate::sync::model::Mutex;

/// Lease counts by slot.
#[derive(Debug)]
pub struct LeaseTable<K> {
    counts: Mutex<HashMap<K, u64>>,
}

impl<K: Eq + Hash + Clone> Default for LeaseTable<K> {
    fn default() -> Self {
        LeaseTable {
            counts: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash + Clone> LeaseTable<K> {
    /// Takes one lease on `key`: the first of the process runs `first` (lock, then
    /// `pending` → `held`); later ones run `again` (give the handle's `pending` count back — the
    /// process's hold covers it). Nothing is recorded if the step fails.
    pub fn take(
        &self,
        key: K,
        first: impl FnOnce() -> Result<()>,
        again: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut counts = self.counts.lock();
        match counts.get_mut(&key) {
            Some(n) => {
                again()?;
                *n += 1;
            }
            None => {
                first()?;
                counts.insert(key, 1);
            }
        }
        Ok(())
    }

    /// Drops one lease on `key`; the last one runs `last` (`held` − 1, release hint, unlock).
    /// Returns false if the process held no lease on `key` (a bookkeeping bug; nothing is done).
    pub fn release(&self, key: &K, last: impl FnOnce()) -> bool {
        let mut counts = self.counts.lock();
        match counts.get_mut(key) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                counts.remove(key);
                last();
            }
            None => return false,
        }
        true
    }

    /// Leases held on `key`.
    pub fn count(&self, key: &K) -> u64 {
        let counts = self.counts.lock();
        counts.get(key).copied().unwrap_or(0)
    }
}
