//! A device's roster of shards, and the only holder of its lists: the shard serving each live
//! (stream, memory pool); the **retired** shards (a dropped pool's, a destroyed stream's) that still
//! hold memory or wait for a new pool on their stream; the **buried** shards (a destroyed stream's,
//! holding nothing) kept for the next new shard; the streams being destroyed. Moving a shard
//! between the lists and its state's `retired` flag change together here, so no caller can leave a
//! shard in neither list (where the teardown, statistics and snapshots would miss it) or flagged
//! for a list it is not in.
//!
//! | a shard is | in | its `retired` flag | leaves by |
//! |---|---|---|---|
//! | live | the map, under its (stream, pool) | `false` | its pool dropped ([`Roster::retire_pool`]), its stream destroyed ([`Roster::stream_destroyed`]; a live pool's shard once empty: [`Roster::retire_where`]) |
//! | retired | the retired list | `true` | taken by a new pool on its stream ([`RosterWrite::take_retired`]); buried once empty and its stream destroyed ([`Roster::bury`]) |
//! | buried | the buried list | `true` (its state replaced when recycled) | recycled as a new shard ([`RosterWrite::pop_buried`]) |
//!
//! Locks, always in this order: the map, then the retired list, then the buried list, then a
//! shard's lock; the list of streams being destroyed is taken alone.

use std::collections::HashMap;

use super::{Shard, ShardState};
use crate::alloc::pool_id::MemPoolId;
use crate::driver::StreamId;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, RwLock, RwLockWriteGuard};

/// What an allocator keeps of its shards on a device: bounded by the streams and pools alive at
/// once, never by how many the runtime has seen (a soak of 100,000 steps: `benches/soak.rs`). Of
/// configurations it keeps the one in force (`config/cell.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Bookkeeping {
    /// Shards serving a live (stream, pool).
    pub shards: usize,
    /// Shards of destroyed streams and dropped pools still holding memory (released or taken
    /// over by other streams and pools).
    pub retired_shards: usize,
    /// Empty shards of destroyed streams, kept for the next new stream's shard (never more than
    /// the most streams alive at once).
    pub buried_shards: usize,
}

/// A (stream, pool) a live shard serves.
type Key = (StreamId, MemPoolId);

/// Serials of shards (`Shard::serial`): unique in the process, never reused.
static NEXT_SHARD_SERIAL: AtomicU64 = AtomicU64::new(1);

/// A new shard serial.
pub(super) fn next_serial() -> u64 {
    NEXT_SHARD_SERIAL.fetch_add(1, Ordering::Relaxed)
}

/// One device's shards (see the module docs).
#[derive(Default)]
pub(super) struct Roster {
    live: RwLock<HashMap<Key, Arc<Shard>>>,
    retired: Mutex<Vec<Arc<Shard>>>,
    buried: Mutex<Vec<Arc<Shard>>>,
    /// Streams being destroyed (synchronized, not yet forgotten by the driver).
    finishing: Mutex<Vec<StreamId>>,
    /// `finishing`'s length: every wait asks [`Roster::is_finishing`], which takes that lock
    /// only while a destruction is under way.
    finishing_count: AtomicU64,
}

/// The roster with its map locked for writing: no shard is made, retired or taken from the
/// retired list meanwhile.
pub(super) struct RosterWrite<'a> {
    roster: &'a Roster,
    live: RwLockWriteGuard<'a, HashMap<Key, Arc<Shard>>>,
}

impl Roster {
    /// The live shard of `stream` in `pool`.
    #[inline]
    pub(super) fn get(&self, stream: StreamId, pool: MemPoolId) -> Option<Arc<Shard>> {
        self.live.read().get(&(stream, pool)).cloned()
    }

    /// The map locked for writing (see [`RosterWrite`]).
    pub(super) fn write(&self) -> RosterWrite<'_> {
        RosterWrite {
            roster: self,
            live: self.live.write(),
        }
    }

    /// How many live shards (for `Debug`).
    pub(super) fn live_count(&self) -> usize {
        self.live.read().len()
    }

    /// Every shard: live, retired, buried.
    pub(super) fn all(&self) -> Vec<Arc<Shard>> {
        let mut all: Vec<_> = self.live.read().values().cloned().collect();
        all.extend(self.retired.lock().iter().cloned());
        all.extend(self.buried.lock().iter().cloned());
        all
    }

    /// The shards whose cached memory the device may release (empty cache, out of memory,
    /// garbage collection): the default pool's live shards and the retired ones. A live pool
    /// keeps its cache (a graph's replays use its free blocks' addresses) until it is emptied or
    /// dropped.
    pub(super) fn releasable(&self) -> Vec<Arc<Shard>> {
        let mut out: Vec<_> = self
            .live
            .read()
            .iter()
            .filter(|((_, pool), _)| pool.is_default())
            .map(|(_, shard)| Arc::clone(shard))
            .collect();
        out.extend(self.retired.lock().iter().cloned());
        out
    }

    /// The live shards of `pool`.
    pub(super) fn of_pool(&self, pool: MemPoolId) -> Vec<Arc<Shard>> {
        self.live
            .read()
            .iter()
            .filter(|((_, p), _)| *p == pool)
            .map(|(_, shard)| Arc::clone(shard))
            .collect()
    }

    /// `f` of the live shards of `pool`, under the map's lock: no shard joins or leaves the pool
    /// meanwhile.
    pub(super) fn with_pool<T>(&self, pool: MemPoolId, f: impl FnOnce(&[&Arc<Shard>]) -> T) -> T {
        let live = self.live.read();
        let shards: Vec<&Arc<Shard>> = live
            .iter()
            .filter(|((_, p), _)| *p == pool)
            .map(|(_, shard)| shard)
            .collect();
        f(&shards)
    }

    /// The live shards of pools other than the default on `stream`.
    pub(super) fn pools_on(&self, stream: StreamId) -> Vec<Arc<Shard>> {
        self.live
            .read()
            .iter()
            .filter(|((s, p), _)| *s == stream && !p.is_default())
            .map(|(_, shard)| Arc::clone(shard))
            .collect()
    }

    /// The retired shards, as they are now.
    pub(super) fn retired(&self) -> Vec<Arc<Shard>> {
        self.retired.lock().clone()
    }

    /// What the roster keeps (see [`Bookkeeping`]).
    pub(super) fn bookkeeping(&self) -> Bookkeeping {
        Bookkeeping {
            shards: self.live.read().len(),
            retired_shards: self.retired.lock().len(),
            buried_shards: self.buried.lock().len(),
        }
    }

    /// Marks `stream` as being destroyed (`true`: synchronized, its shards' idle memory goes to
    /// other streams without a wait) or not (`false`: its destruction failed), with its live
    /// and retired shards' `finished` flags.
    pub(super) fn mark_finishing(&self, stream: StreamId, finishing: bool) {
        {
            let mut list = self.finishing.lock();
            list.retain(|&s| s != stream);
            if finishing {
                list.push(stream);
            }
            self.finishing_count
                .store(list.len() as u64, Ordering::SeqCst);
        }
        for ((s, _), shard) in self.live.read().iter() {
            if *s == stream {
                shard.finished.store(finishing, Ordering::SeqCst);
            }
        }
        // The retired shards of dropped pools on that stream too (found by review: a pool
        // dropped before its stream's destruction left a shard per step, never buried).
        for shard in self.retired.lock().iter() {
            if shard.stream() == stream {
                shard.finished.store(finishing, Ordering::SeqCst);
            }
        }
    }

    /// Whether `stream` is being destroyed (no lock unless a destruction is under way).
    #[inline]
    pub(super) fn is_finishing(&self, stream: StreamId) -> bool {
        self.finishing_count.load(Ordering::SeqCst) != 0 && self.finishing.lock().contains(&stream)
    }

    /// `stream` is destroyed (the driver knows it no more): out of the list of streams being
    /// destroyed, and its default pool's shard out of the map and into the retired list in one
    /// step under the map's lock, returned.
    pub(super) fn stream_destroyed(&self, stream: StreamId) -> Option<Arc<Shard>> {
        {
            let mut list = self.finishing.lock();
            list.retain(|&s| s != stream);
            self.finishing_count
                .store(list.len() as u64, Ordering::SeqCst);
        }
        let mut live = self.live.write();
        let gone = live.remove(&(stream, MemPoolId::DEFAULT))?;
        gone.state.lock().retired = true;
        self.retired.lock().push(Arc::clone(&gone));
        Some(gone)
    }

    /// Pool `pool` was dropped: its shards out of the map and into the retired list in one step
    /// under the map's lock.
    pub(super) fn retire_pool(&self, pool: MemPoolId) {
        let mut live = self.live.write();
        let keys: Vec<Key> = live.keys().filter(|(_, p)| *p == pool).copied().collect();
        let leaving: Vec<Arc<Shard>> = keys.iter().filter_map(|k| live.remove(k)).collect();
        for shard in &leaving {
            shard.state.lock().retired = true;
        }
        self.retired.lock().extend(leaving);
    }

    /// Moves the live shards `pick` chooses (it sees each key and its state under the map's
    /// lock and the shard's, and may change the state) to the retired list, flagged in the same
    /// hold of the shard's lock.
    pub(super) fn retire_where(&self, mut pick: impl FnMut(Key, &Shard, &mut ShardState) -> bool) {
        let mut live = self.live.write();
        let mut leaving = Vec::new();
        live.retain(|&key, shard| {
            let mut st = shard.state.lock();
            if !pick(key, shard, &mut st) {
                return true;
            }
            st.retired = true;
            leaving.push(Arc::clone(shard));
            false
        });
        self.retired.lock().extend(leaving);
    }

    /// Moves the retired shards `pick` chooses (it sees each under the retired list's lock, and
    /// may change it) to the buried list.
    pub(super) fn bury(&self, mut pick: impl FnMut(&Arc<Shard>) -> bool) {
        let mut retired = self.retired.lock();
        let (empty, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut *retired)
            .into_iter()
            .partition(|shard| pick(shard));
        *retired = kept;
        drop(retired);
        self.buried.lock().extend(empty);
    }

    /// Empties every list for the allocator's teardown: the shards. The buried ones too: each
    /// shard holds its device, so one left here would keep the device, and its driver, alive
    /// for good (found by `allocator_bookkeeping::a_dropped_runtime_keeps_nothing_alive`).
    pub(super) fn drain(&self) -> Vec<Arc<Shard>> {
        let mut shards: Vec<_> = self.live.write().drain().map(|(_, s)| s).collect();
        shards.append(&mut self.retired.lock());
        shards.append(&mut self.buried.lock());
        shards
    }
}

impl RosterWrite<'_> {
    /// The live shard of `key`.
    pub(super) fn get(&self, stream: StreamId, pool: MemPoolId) -> Option<Arc<Shard>> {
        self.live.get(&(stream, pool)).cloned()
    }

    /// `shard` serves (stream, pool) from now on.
    pub(super) fn insert(&mut self, stream: StreamId, pool: MemPoolId, shard: Arc<Shard>) {
        self.live.insert((stream, pool), shard);
    }

    /// The first retired shard `pick` accepts, out of the retired list and no longer retired,
    /// `adopt` applied to its state under the same lock (the caller inserts it before this guard
    /// drops), with what `adopt` returned.
    pub(super) fn take_retired<T>(
        &self,
        pick: impl FnMut(&Arc<Shard>) -> bool,
        adopt: impl FnOnce(&mut ShardState) -> T,
    ) -> Option<(Arc<Shard>, T)> {
        let mut retired = self.roster.retired.lock();
        let at = retired.iter().position(pick)?;
        let shard = retired.swap_remove(at);
        drop(retired);
        let adopted = {
            let mut st = shard.state.lock();
            st.retired = false;
            adopt(&mut st)
        };
        Some((shard, adopted))
    }

    /// A buried shard, to recycle.
    pub(super) fn pop_buried(&self) -> Option<Arc<Shard>> {
        self.roster.buried.lock().pop()
    }

    /// Every shard, live, retired and buried, while no shard is made or moved.
    pub(super) fn all(&self) -> Vec<Arc<Shard>> {
        let mut all: Vec<_> = self.live.values().cloned().collect();
        all.extend(self.roster.retired.lock().iter().cloned());
        all.extend(self.roster.buried.lock().iter().cloned());
        all
    }
}
