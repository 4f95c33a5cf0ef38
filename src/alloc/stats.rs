//! PyTorch's allocator statistics, key for key.
//!
//! Every [`Stat`] has `current`, `peak`, `allocated` (sum of increases) and `freed` (sum of
//! decreases). Each is kept per pool: index 0 = `all`, 1 = `small_pool`, 2 = `large_pool`.
//! [`DeviceStats::to_map`] flattens them into exactly PyTorch's keys (`allocated_bytes.all.current`,
//! `allocation.small_pool.peak`, `num_alloc_retries`, …).
//!
//! Stats live in each shard (one per stream), updated under the shard's lock — no shared cache line
//! on the hot path. A device's stats are the sum of its shards': `current`, `allocated` and `freed`
//! add exactly; device-wide peaks are exact too, kept by per-shard budgets (`peaks.rs`) — within a
//! shard, `peak` is its high-water mark since the device's peak book last read it.

use std::collections::BTreeMap;

use super::size::PoolKind;

/// One statistic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Sum of increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of decreases since the last accumulated reset.
    pub freed: i64,
    /// How far `current` may grow before the device's peaks are reconciled (per shard,
    /// `peaks.rs`; 0 in device totals).
    #[cfg_attr(feature = "serde", serde(skip))]
    pub(crate) limit: i64,
}

impl Stat {
    /// Adds `n` (updates `peak` and `allocated`); returns whether `current` went past its limit.
    #[inline]
    pub(crate) fn increase(&mut self, n: i64) -> bool {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
        self.current > self.limit
    }

    /// Subtracts `n` (updates `freed`).
    #[inline]
    pub(crate) fn decrease(&mut self, n: i64) {
        self.current -= n;
        self.freed += n;
    }

    fn add(&mut self, other: &Stat) {
        self.current += other.current;
        self.peak += other.peak;
        self.allocated += other.allocated;
        self.freed += other.freed;
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// Statistics with a peak: 9 arrays of 3 pools, and the two oversize counts.
pub(crate) const PEAK_STATS: usize = 29;

/// Index of `segment.all` among the statistics with a peak (`DeviceStats::for_each_peak_stat_mut`).
#[cfg(any(test, feature = "replay"))]
pub(crate) const SEGMENT_ALL: usize = 3;
/// Index of `allocated_bytes.all` among the statistics with a peak.
#[cfg(any(test, feature = "replay"))]
pub(crate) const ALLOCATED_BYTES_ALL: usize = 4 * 3;
/// Index of `reserved_bytes.all` among the statistics with a peak.
pub(crate) const RESERVED_BYTES_ALL: usize = 5 * 3;

/// Whether a shard's statistics may have changed since its device's peak book last read them
/// (`peaks.rs`): set by the shard when it tells the book, cleared by the book when it reads.
/// Bookkeeping, not a statistic: any two are equal, and it is never serialized.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Unread(pub(crate) bool);

impl PartialEq for Unread {
    fn eq(&self, _: &Unread) -> bool {
        true
    }
}

impl Eq for Unread {}

/// A [`Stat`] per pool, by PyTorch's pool names: `all`, `small_pool` (`small`) and `large_pool`
/// (`large`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct PoolStats {
    /// Both pools together (PyTorch's `all`).
    pub all: Stat,
    /// The small pool (blocks of at most 1 MiB; PyTorch's `small_pool`).
    pub small: Stat,
    /// The large pool (PyTorch's `large_pool`).
    pub large: Stat,
}

impl PoolStats {
    /// `all`, `small`, `large`, in PyTorch's key order (`POOL_NAMES`).
    pub fn iter(&self) -> impl Iterator<Item = &Stat> {
        [&self.all, &self.small, &self.large].into_iter()
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Stat> {
        [&mut self.all, &mut self.small, &mut self.large].into_iter()
    }

    fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }
}

/// PyTorch's pool names, in [`PoolStats::iter`] order.
pub(super) const POOL_NAMES: [&str; 3] = ["all", "small_pool", "large_pool"];

/// Increases the `all` entry and the pool's entry; returns whether either went past its limit.
#[inline]
pub(super) fn increase(array: &mut PoolStats, pool: PoolKind, n: u64) -> bool {
    let n = n as i64;
    array.all.increase(n) | array.pool_mut(pool).increase(n)
}

/// Decreases the `all` entry and the pool's entry.
#[inline]
pub(super) fn decrease(array: &mut PoolStats, pool: PoolKind, n: u64) {
    let n = n as i64;
    array.all.decrease(n);
    array.pool_mut(pool).decrease(n);
}

/// Takes `n` off the `all` entry's and the pool's `current` only (a front cache's blocks, hidden
/// from a device's totals; `alloc/front.rs`).
pub(crate) fn hide(array: &mut PoolStats, pool: PoolKind, n: u64) {
    let n = n as i64;
    array.all.current -= n;
    array.pool_mut(pool).current -= n;
}

/// All statistics of one device (or one shard).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct DeviceStats {
    /// Live allocations handed out.
    pub allocation: PoolStats,
    /// Segments obtained from the driver.
    pub segment: PoolStats,
    /// Blocks in use or waiting for their stream events (active).
    pub active: PoolStats,
    /// Free blocks that are part of a split segment.
    pub inactive_split: PoolStats,
    /// Bytes of allocated blocks (rounded sizes).
    pub allocated_bytes: PoolStats,
    /// Bytes of segments.
    pub reserved_bytes: PoolStats,
    /// Bytes of active blocks.
    pub active_bytes: PoolStats,
    /// Bytes of inactive split blocks.
    pub inactive_split_bytes: PoolStats,
    /// Bytes requested by callers (before rounding).
    pub requested_bytes: PoolStats,
    /// Allocations of at least `max_split_size` bytes.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size` bytes.
    pub oversize_segments: Stat,
    /// Allocations that had to free cached memory and retry.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: u64,
    /// Times every stream's pending frees were synchronized.
    pub num_sync_all_streams: u64,
    /// Driver `malloc` calls.
    pub num_device_alloc: u64,
    /// Driver `free` calls.
    pub num_device_free: u64,
    /// cudalloc's own (not in PyTorch's map): misses served by memory another stream had cached
    /// (`cross_stream_reuse`: an idle segment taken over or a free block lent).
    pub num_cross_stream_reuses: u64,
    /// The configured `max_split_size` in bytes (-1 when unlimited: PyTorch's `SIZE_MAX` as int64).
    pub max_split_size: i64,
    /// A shard's: whether its device's peak book has yet to read its latest figures (`peaks.rs`).
    #[cfg_attr(feature = "serde", serde(skip))]
    pub(crate) unread: Unread,
}

impl DeviceStats {
    fn arrays_mut(&mut self) -> [&mut PoolStats; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    fn arrays(&self) -> [(&'static str, &PoolStats); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// [`Self::for_each_peak_stat_mut`], read-only.
    pub(crate) fn for_each_peak_stat(&self, mut f: impl FnMut(usize, &Stat)) {
        let arrays = self.arrays();
        let stats = arrays
            .iter()
            .flat_map(|(_, a)| a.iter())
            .chain([&self.oversize_allocations, &self.oversize_segments]);
        for (k, s) in stats.enumerate() {
            f(k, s);
        }
    }

    /// Calls `f` with each statistic that has a peak and its index (`0..PEAK_STATS`, a fixed
    /// order), mutably.
    pub(crate) fn for_each_peak_stat_mut(&mut self, mut f: impl FnMut(usize, &mut Stat)) {
        let mut k = 0;
        for array in self.arrays_mut() {
            for s in array.iter_mut() {
                f(k, s);
                k += 1;
            }
        }
        f(k, &mut self.oversize_allocations);
        f(k + 1, &mut self.oversize_segments);
    }

    /// Adds another shard's stats into these (counters too).
    pub(crate) fn accumulate(&mut self, other: &DeviceStats) {
        for (mine, (_, theirs)) in self.arrays_mut().into_iter().zip(other.arrays()) {
            for (m, t) in mine.iter_mut().zip(theirs.iter()) {
                m.add(t);
            }
        }
        self.oversize_allocations.add(&other.oversize_allocations);
        self.oversize_segments.add(&other.oversize_segments);
        self.num_alloc_retries += other.num_alloc_retries;
        self.num_ooms += other.num_ooms;
        self.num_sync_all_streams += other.num_sync_all_streams;
        self.num_cross_stream_reuses += other.num_cross_stream_reuses;
        self.num_device_alloc += other.num_device_alloc;
        self.num_device_free += other.num_device_free;
    }

    /// Takes `base`'s accumulated counts off these (currents and peaks untouched).
    pub(crate) fn subtract_accumulated(&mut self, base: &DeviceStats) {
        for (mine, (_, theirs)) in self.arrays_mut().into_iter().zip(base.arrays()) {
            for (m, t) in mine.iter_mut().zip(theirs.iter()) {
                m.allocated -= t.allocated;
                m.freed -= t.freed;
            }
        }
        for (m, t) in [
            (&mut self.oversize_allocations, &base.oversize_allocations),
            (&mut self.oversize_segments, &base.oversize_segments),
        ] {
            m.allocated -= t.allocated;
            m.freed -= t.freed;
        }
        self.num_alloc_retries = self
            .num_alloc_retries
            .saturating_sub(base.num_alloc_retries);
        self.num_ooms = self.num_ooms.saturating_sub(base.num_ooms);
        self.num_sync_all_streams = self
            .num_sync_all_streams
            .saturating_sub(base.num_sync_all_streams);
        self.num_cross_stream_reuses = self
            .num_cross_stream_reuses
            .saturating_sub(base.num_cross_stream_reuses);
        self.num_device_alloc = self.num_device_alloc.saturating_sub(base.num_device_alloc);
        self.num_device_free = self.num_device_free.saturating_sub(base.num_device_free);
    }

    /// Zeroes every `allocated`/`freed` sum and the event counters.
    pub(crate) fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            array.iter_mut().for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_cross_stream_reuses = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// The flat map with PyTorch's exact keys.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        let mut put_stat = |prefix: String, stat: &Stat| {
            map.insert(format!("{prefix}.current"), stat.current);
            map.insert(format!("{prefix}.peak"), stat.peak);
            map.insert(format!("{prefix}.allocated"), stat.allocated);
            map.insert(format!("{prefix}.freed"), stat.freed);
        };
        for (name, array) in self.arrays() {
            for (pool, stat) in POOL_NAMES.iter().zip(array.iter()) {
                put_stat(format!("{name}.{pool}"), stat);
            }
        }
        put_stat("oversize_allocations".into(), &self.oversize_allocations);
        put_stat("oversize_segments".into(), &self.oversize_segments);
        for (key, value) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
        ] {
            map.insert(key.to_owned(), value as i64);
        }
        map.insert("max_split_size".into(), self.max_split_size);
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_sums() {
        let mut s = Stat::default();
        s.increase(10);
        s.decrease(4);
        s.increase(2);
        assert_eq!(
            s,
            Stat {
                current: 8,
                peak: 10,
                allocated: 12,
                freed: 4,
                limit: 0,
            }
        );
    }

    #[test]
    fn peak_stat_indices_name_their_statistics() {
        let mut d = DeviceStats::default();
        d.segment.all.current = 1;
        d.allocated_bytes.all.current = 2;
        d.reserved_bytes.all.current = 3;
        let mut seen = [0i64; PEAK_STATS];
        d.for_each_peak_stat(|k, s| seen[k] = s.current);
        assert_eq!(seen[SEGMENT_ALL], 1);
        assert_eq!(seen[ALLOCATED_BYTES_ALL], 2);
        assert_eq!(seen[RESERVED_BYTES_ALL], 3);
        assert_eq!(seen.iter().sum::<i64>(), 6);
    }

    #[test]
    fn map_has_pytorch_keys() {
        let mut d = DeviceStats::default();
        increase(&mut d.allocated_bytes, PoolKind::Small, 512);
        let m = d.to_map();
        assert_eq!(m["allocated_bytes.all.current"], 512);
        assert_eq!(m["allocated_bytes.small_pool.peak"], 512);
        assert_eq!(m["allocated_bytes.large_pool.current"], 0);
        for key in [
            "allocation.all.allocated",
            "segment.large_pool.freed",
            "inactive_split_bytes.all.peak",
            "requested_bytes.small_pool.current",
            "oversize_allocations.current",
            "oversize_segments.peak",
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
            "max_split_size",
        ] {
            assert!(m.contains_key(key), "{key}");
        }
        assert_eq!(m.len(), 9 * 3 * 4 + 2 * 4 + 6);
    }
}
