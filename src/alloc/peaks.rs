//! Exact device-wide peaks without a device-wide lock on the hot path.
//!
//! Statistics live in each shard (one per stream) so threads on different streams share no cache
//! line. Currents add up exactly; a device's *peak* is the maximum of the sum over time, which no
//! shard sees alone. PyTorch gets it from its device-wide lock. Here every shard gets a **budget**
//! per statistic: it may grow up to its limit without telling anyone, and the limits never add up
//! to more than the device's recorded peak — so while every shard is within its limit the device's
//! total cannot pass the recorded peak, and nothing needs to be exchanged. A shard that goes past a
//! limit (`Stat::increase` reports it; found under the shard's lock, acted on after releasing it)
//! **reconciles** under the device's
//! peak lock:
//!
//! | step   | each shard, under its own lock, one at a time | after the pass |
//! |--------|------------------------------------------------|----------------|
//! | revoke | read its currents and its high-water mark since the last pass; limit := current | total := Σ currents; peak := max(peak, total) |
//! | grant  | limit := current + what its high-water mark says it needs, then an even share of the rest | Σ limits ≤ peak again |
//!
//! After a shard's limit is revoked it can only shrink without reconciling, so the total of the
//! pass is the device's total at the pass's end with the shrinking linearized after it — an
//! attained value, as PyTorch's serialized peak is. An allocation that went past its limit returns
//! only after its reconcile. Reading the statistics reconciles first, so they include any
//! allocation still on its way. A steady loop (allocate, free, repeat) settles after a pass or two:
//! each shard's limit is its own high-water mark and the hot path never reconciles again.

use super::device::DeviceCore;
use super::shard::ShardState;
use super::stats::{DeviceStats, Stat, PEAK_STATS};

/// The recorded device-wide peaks (one per statistic, in [`DeviceStats::peak_stats`] order).
#[derive(Debug, Default)]
pub(crate) struct PeakBook {
    peaks: [i64; PEAK_STATS],
}

impl ShardState {
    /// Takes the flag that a statistic went past its limit (set by the increases themselves:
    /// `Stat::increase` says so, so the hot path pays one compare per increase).
    #[inline]
    pub fn take_over_budget(&mut self) -> bool {
        std::mem::take(&mut self.over_budget)
    }
}

impl DeviceCore {
    /// Reconciles after a shard went past its budget (see the module docs).
    pub fn reconcile_peaks(&self) {
        let mut book = self.peaks.lock();
        self.reconcile(&mut book, false);
    }

    /// Every shard's statistics added up, with exact device-wide peaks (`reset`: the peaks start
    /// again from the currents).
    pub fn exact_stats(&self, reset: bool) -> DeviceStats {
        let mut book = self.peaks.lock();
        self.reconcile(&mut book, reset)
    }

    fn reconcile(&self, book: &mut PeakBook, reset: bool) -> DeviceStats {
        let shards = self.all_shards();
        let mut total = DeviceStats::default();
        // (current, high-water) of every shard and statistic, as read in the revoke pass.
        let mut reads: Vec<[(i64, i64); PEAK_STATS]> = Vec::with_capacity(shards.len());
        for shard in &shards {
            let mut st = shard.state.lock();
            let mut read = [(0, 0); PEAK_STATS];
            st.stats.for_each_peak_stat_mut(|k, s: &mut Stat| {
                read[k] = (s.current, s.peak);
                s.limit = s.current;
                s.peak = s.current; // the high-water mark starts again
            });
            st.over_budget = false;
            total.accumulate(&st.stats);
            reads.push(read);
        }
        let mut sums = [0i64; PEAK_STATS];
        total.for_each_peak_stat(|k, s| sums[k] = s.current);
        for (k, sum) in sums.iter().enumerate() {
            book.peaks[k] = if reset { *sum } else { book.peaks[k].max(*sum) };
        }
        // Grant: what each shard's high-water mark asks for, then the rest evenly.
        let n = shards.len().max(1) as i64;
        let mut grants = vec![[0i64; PEAK_STATS]; shards.len()];
        for k in 0..PEAK_STATS {
            let mut slack = book.peaks[k] - sums[k];
            for (x, read) in reads.iter().enumerate() {
                let need = (read[k].1 - read[k].0).clamp(0, slack.max(0));
                grants[x][k] = need;
                slack -= need;
            }
            let share = slack.max(0) / n;
            for grant in grants.iter_mut() {
                grant[k] += share;
            }
        }
        for ((shard, read), grant) in shards.iter().zip(&reads).zip(&grants) {
            let mut st = shard.state.lock();
            st.stats
                .for_each_peak_stat_mut(|k, s| s.limit = read[k].0 + grant[k]);
            // A shard that grew past its revoked limit meanwhile was told so by its own increase
            // and reconciles next; the grant does not hide that.
        }
        let peaks = book.peaks;
        total.for_each_peak_stat_mut(|k, s| s.peak = peaks[k].max(s.current));
        total
    }
}
