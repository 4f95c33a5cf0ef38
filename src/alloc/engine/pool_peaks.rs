//! Each live memory pool's peaks, and what pools and graphs reserve — cheaply.
//!
//! A pool's currents are the sums of its shards' (one per stream it is used on). Its *peak* is
//! the highest those sums reached, which no shard sees alone (the device's peaks have the same
//! problem, solved with budgets in `peaks.rs`; a pool is not the hot path, so a simpler book
//! does): every settle of a pool's shard tells the pool's [`PoolBook`] how its currents moved
//! since it last told it, under the shard's lock, and the book adds the difference to its sums
//! and raises its peaks. The book's lock is a leaf (taken under a shard's lock, nothing taken
//! under it).
//!
//! | event | the pool's book |
//! |---|---|
//! | a pool's first shard on the device (`shard_in`), or a retired shard taken by the pool | opened (sums and peaks 0; a taken shard tells its currents whole at its next settle) |
//! | a settle of one of its shards | sums += what changed; peaks := max(peaks, sums) |
//! | a read ([`DeviceCore::pool_peaks`], [`DeviceCore::pools_reserved`]) | each of the pool's shards tells first, so sums are exact (a path that changed a shard without settling — a release — only lowered currents, which raise no peak) |
//! | `MemPool::reset_peak_stats` | peaks := sums |
//! | the pool dropped (`retire_pool`) | closed; its retired shards tell no one |

use super::{Books, DeviceCore, Figures, ShardState};
use crate::alloc::pool_id::MemPoolId;
use crate::alloc::stats::{DeviceStats, PEAK_STATS, RESERVED_BYTES_ALL};

impl ShardState {
    /// The currents of the statistics that have peaks.
    fn currents(&self) -> Figures {
        let mut out = [0; PEAK_STATS];
        self.stats.for_each_peak_stat(|k, s| out[k] = s.current);
        out
    }
}

/// What private memory pools reserve on a device, and how much of it is in pools that live CUDA
/// graphs hold (their replays use it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolsReserved {
    /// Bytes reserved by live memory pools (`MemPool`s, tags, graphs' pools).
    pub pools: u64,
    /// Of those, the bytes of pools that live graphs hold.
    pub graphs: u64,
}

impl Books {
    /// Pool shard `st` tells its pool's book how its currents moved since it last told it.
    pub(super) fn tell_pool(&self, st: &mut ShardState) {
        let now = st.currents();
        if now == st.pool_told {
            return;
        }
        if let Some(book) = self.pools.lock().get_mut(&st.pool) {
            let moved = now.iter().zip(&st.pool_told).map(|(n, t)| n - t);
            for ((sum, peak), d) in book.sums.iter_mut().zip(&mut book.peaks).zip(moved) {
                *sum += d;
                *peak = (*peak).max(*sum);
            }
        }
        st.pool_told = now;
    }

    /// `pool` has a shard on this device from now on: its book opens (empty when new).
    pub(super) fn open_pool(&self, pool: MemPoolId) {
        self.pools.lock().entry(pool).or_default();
    }

    /// A shard of `pool` leaves it while the pool lives, with `st`: the pool's book keeps its
    /// accumulated counts (its currents are zero: it leaves empty).
    pub(super) fn depart(&self, st: &ShardState) {
        if let Some(book) = self.pools.lock().get_mut(&st.pool) {
            let mut own = st.stats.clone();
            own.subtract_accumulated(&st.pool_base);
            book.departed.accumulate(&own);
        }
    }

    /// The accumulated counts of `pool`'s departed shards (none for an unknown pool).
    pub(super) fn departed(&self, pool: MemPoolId) -> Option<DeviceStats> {
        self.pools
            .lock()
            .get(&pool)
            .map(|book| book.departed.clone())
    }

    /// Every pool's departed counts back to zero (`reset_accumulated_memory_stats`).
    pub(super) fn reset_departed(&self) {
        for book in self.pools.lock().values_mut() {
            book.departed.reset_accumulated();
        }
    }

    /// `pool` was dropped: its book closes (its retired shards tell no one).
    pub(super) fn close_pool(&self, pool: MemPoolId) {
        self.pools.lock().remove(&pool);
    }
}

impl DeviceCore {
    /// Every shard of `pool` tells its book (what it changed without settling).
    fn sync_pool(&self, pool: MemPoolId) {
        for shard in self.pool_shards(pool) {
            let mut st = shard.state.lock();
            if st.pool == pool {
                self.books.tell_pool(&mut st);
            }
        }
    }

    /// `pool`'s statistics on this device: its live shards' own figures and the accumulated
    /// counts of those that left it, read while no shard joins or leaves it; its peaks from its
    /// book.
    pub(in crate::alloc) fn pool_memory_stats(&self, pool: MemPoolId) -> DeviceStats {
        let mut total = self.roster.with_pool(pool, |shards| {
            let mut total = self.books.departed(pool).unwrap_or_default();
            for shard in shards {
                total.accumulate(&shard.pool_stats());
            }
            total
        });
        let peaks = self.pool_peaks(pool);
        total.for_each_peak_stat_mut(|k, s| {
            s.peak = peaks.map_or(s.current, |p| p[k].max(s.current));
        });
        total
    }

    /// `pool`'s peaks on this device (indices of `DeviceStats::for_each_peak_stat_mut`); `None`
    /// when the pool has no shard here.
    pub(in crate::alloc) fn pool_peaks(&self, pool: MemPoolId) -> Option<Figures> {
        self.sync_pool(pool);
        self.books.pools.lock().get(&pool).map(|book| book.peaks)
    }

    /// Resets `pool`'s peaks to its currents.
    pub(in crate::alloc) fn reset_pool_peaks(&self, pool: MemPoolId) {
        self.sync_pool(pool);
        if let Some(book) = self.books.pools.lock().get_mut(&pool) {
            book.peaks = book.sums;
        }
    }

    /// What live memory pools reserve on this device: one lock per pool shard and the book's,
    /// no statistics copied.
    pub(in crate::alloc) fn pools_reserved(&self) -> PoolsReserved {
        let pools: Vec<MemPoolId> = self.books.pools.lock().keys().copied().collect();
        for &pool in &pools {
            self.sync_pool(pool);
        }
        // Read, then asked of the captures outside the book's lock (a leaf lock).
        let reserved: Vec<(MemPoolId, u64)> = self
            .books
            .pools
            .lock()
            .iter()
            .map(|(pool, book)| (*pool, book.sums[RESERVED_BYTES_ALL].max(0) as u64))
            .collect();
        let mut out = PoolsReserved::default();
        for (pool, bytes) in reserved {
            out.pools += bytes;
            if self.wide.capturing.held_by_graphs(pool) {
                out.graphs += bytes;
            }
        }
        out
    }
}
