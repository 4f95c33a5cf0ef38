//! [`PinnedStats`]: PyTorch's `torch.cuda.host_memory_stats()` for the pinned allocator.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::alloc::Stat;

/// Durations of driver calls in microseconds, as PyTorch's `DurationStat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct DurationStat {
    /// Sum.
    pub total: u64,
    /// Longest.
    pub max: u64,
    /// Shortest (0 when none).
    pub min: u64,
    /// How many.
    pub count: u64,
}

impl DurationStat {
    /// Mean (0 when none).
    pub fn avg(&self) -> u64 {
        self.total.checked_div(self.count).unwrap_or(0)
    }

    pub(super) fn add(&mut self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.total = self.total.saturating_add(us);
        self.max = self.max.max(us);
        self.min = if self.count == 0 {
            us
        } else {
            self.min.min(us)
        };
        self.count += 1;
    }
}

/// The pinned host allocator's statistics, with PyTorch's keys (`to_map`).
///
/// | field | counts |
/// |---|---|
/// | `allocations`, `allocated_bytes` | blocks (and their bytes) the allocator holds: in use, waiting for their streams, or cached |
/// | `active_requests`, `active_bytes` | blocks handed out and not yet back in the cache (a freed block stays active until its streams' work completed, as in PyTorch) |
/// | `num_host_alloc`, `num_host_free` | driver calls that made or released memory (`cuMemHostAlloc` / registration; their frees) |
/// | `host_alloc_time`, `host_free_time` | their durations in µs |
///
/// Block sizes are rounded up to powers of two, so byte counts are of rounded sizes. Blocks
/// carved from the reserve segment count as blocks; the segment is one driver call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct PinnedStats {
    /// Blocks held.
    pub allocations: Stat,
    /// Bytes of the blocks held.
    pub allocated_bytes: Stat,
    /// Blocks handed out.
    pub active_requests: Stat,
    /// Bytes of the blocks handed out.
    pub active_bytes: Stat,
    /// Driver allocations and registrations.
    pub num_host_alloc: u64,
    /// Driver frees and unregistrations.
    pub num_host_free: u64,
    /// Time in driver allocations and registrations.
    pub host_alloc_time: DurationStat,
    /// Time in driver frees and unregistrations.
    pub host_free_time: DurationStat,
}

impl PinnedStats {
    /// The statistics under PyTorch's flattened keys (`allocations.current`,
    /// `active_bytes.peak`, `num_host_alloc`, `host_alloc_time.avg`, …).
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        for (name, stat) in [
            ("allocations", &self.allocations),
            ("allocated_bytes", &self.allocated_bytes),
            ("active_requests", &self.active_requests),
            ("active_bytes", &self.active_bytes),
        ] {
            out.insert(format!("{name}.current"), stat.current);
            out.insert(format!("{name}.peak"), stat.peak);
            out.insert(format!("{name}.allocated"), stat.allocated);
            out.insert(format!("{name}.freed"), stat.freed);
        }
        let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        out.insert("num_host_alloc".into(), int(self.num_host_alloc));
        out.insert("num_host_free".into(), int(self.num_host_free));
        for (name, d) in [
            ("host_alloc_time", &self.host_alloc_time),
            ("host_free_time", &self.host_free_time),
        ] {
            out.insert(format!("{name}.total"), int(d.total));
            out.insert(format!("{name}.max"), int(d.max));
            out.insert(format!("{name}.min"), int(d.min));
            out.insert(format!("{name}.count"), int(d.count));
            out.insert(format!("{name}.avg"), int(d.avg()));
        }
        out
    }

    pub(super) fn reset_peak(&mut self) {
        for stat in self.stats_mut() {
            stat.peak = stat.current;
        }
        self.host_alloc_time.max = 0;
        self.host_free_time.max = 0;
    }

    pub(super) fn reset_accumulated(&mut self) {
        for stat in self.stats_mut() {
            stat.allocated = 0;
            stat.freed = 0;
        }
        self.num_host_alloc = 0;
        self.num_host_free = 0;
        self.host_alloc_time = DurationStat::default();
        self.host_free_time = DurationStat::default();
    }

    fn stats_mut(&mut self) -> [&mut Stat; 4] {
        [
            &mut self.allocations,
            &mut self.allocated_bytes,
            &mut self.active_requests,
            &mut self.active_bytes,
        ]
    }
}
