//! What the allocator reports, PyTorch's names for it: the statistics of a device (and the
//! `memory_allocated` family of one-number helpers), their resets, the summary table, the
//! memory history and snapshots — taken, or written in PyTorch's pickled layout (`dump_snapshot`,
//! and on out-of-memory with `oom_snapshot_path`).

use std::collections::BTreeMap;

use super::engine::snapshot::SnapshotBlockState;
use super::history::TraceAction;
use super::{
    summary, Bookkeeping, CachingAllocator, DeviceStats, HistoryOptions, PoolsReserved, Snapshot,
};
use crate::driver::StreamId;
use crate::error::Result;

impl CachingAllocator {
    /// The body of [`Runtime::memory_allocated`](crate::Runtime::memory_allocated), documented there.
    pub(crate) fn memory_allocated(&self, device: usize) -> Result<u64> {
        self.all_pools(device, |s| s.allocated_bytes.all.current)
    }

    /// The body of [`Runtime::max_memory_allocated`](crate::Runtime::max_memory_allocated), documented there.
    pub(crate) fn max_memory_allocated(&self, device: usize) -> Result<u64> {
        self.all_pools(device, |s| s.allocated_bytes.all.peak)
    }

    /// The body of [`Runtime::memory_reserved`](crate::Runtime::memory_reserved), documented there.
    pub(crate) fn memory_reserved(&self, device: usize) -> Result<u64> {
        self.reserved_bytes(device)
    }

    /// The body of [`Runtime::max_memory_reserved`](crate::Runtime::max_memory_reserved), documented there.
    pub(crate) fn max_memory_reserved(&self, device: usize) -> Result<u64> {
        self.all_pools(device, |s| s.reserved_bytes.all.peak)
    }

    /// One figure of `device`'s statistics, as bytes (a negative figure, impossible, reads 0).
    fn all_pools(&self, device: usize, figure: impl FnOnce(&DeviceStats) -> i64) -> Result<u64> {
        Ok(u64::try_from(figure(&self.memory_stats(device)?)).unwrap_or(0))
    }

    /// Stats of `device`.
    pub(crate) fn memory_stats(&self, device: usize) -> Result<DeviceStats> {
        Ok(self.device(device)?.stats())
    }

    /// What live memory pools (and, of that, pools graphs hold) reserve on `device`: one lock
    /// per pool shard, no statistics copied (PyTorch has no such figure; `memory_stats` of every
    /// pool would copy every shard's statistics).
    pub(crate) fn pools_reserved(&self, device: usize) -> Result<PoolsReserved> {
        Ok(self.device(device)?.pools_reserved())
    }

    /// What the allocator keeps on `device` besides memory: shards live, retired and kept for
    /// reuse ([`Bookkeeping`]; of configurations it keeps the one in force: `config/cell.rs`).
    pub(crate) fn bookkeeping(&self, device: usize) -> Result<Bookkeeping> {
        self.birth.check("this allocator")?;
        Ok(self.device(device)?.bookkeeping())
    }

    /// The body of [`Runtime::memory_stats_map`](crate::Runtime::memory_stats_map), documented there.
    pub(crate) fn memory_stats_map(&self, device: usize) -> Result<BTreeMap<String, i64>> {
        Ok(self.memory_stats(device)?.to_map())
    }

    /// The body of [`Runtime::reset_peak_memory_stats`](crate::Runtime::reset_peak_memory_stats), documented there.
    pub(crate) fn reset_peak_memory_stats(&self, device: usize) -> Result<()> {
        self.device(device)?.reset_stats(true);
        Ok(())
    }

    /// The body of [`Runtime::reset_accumulated_memory_stats`](crate::Runtime::reset_accumulated_memory_stats), documented there.
    pub(crate) fn reset_accumulated_memory_stats(&self, device: usize) -> Result<()> {
        self.device(device)?.reset_stats(false);
        Ok(())
    }

    /// The summary table of `device`.
    pub(crate) fn memory_summary(&self, device: usize) -> Result<String> {
        let stats = self.memory_stats(device)?;
        Ok(summary::render(
            device,
            self.driver.backend().name(),
            &stats,
        ))
    }

    /// The body of [`Runtime::record_memory_history`](crate::Runtime::record_memory_history), documented there.
    pub(crate) fn record_memory_history(&self, options: HistoryOptions) {
        if self.birth.ignored_in_child("recording the memory history") {
            return;
        }
        if let Some(sanitizer) = self.driver.sanitizer() {
            // Reports name the stacks of both accesses while the history records stacks.
            sanitizer.set_stacks(sanitizer.options().stacks || options.captures_stacks());
        }
        if options.captures_stacks() {
            super::stacks::available();
        }
        self.trace.configure(options);
    }

    /// The body of [`Runtime::snapshot`](crate::Runtime::snapshot), documented there.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::new();
        let Some(devices) = self.devices.unless_child("taking a snapshot") else {
            return Snapshot {
                segments,
                trace: Vec::new(),
                device_count: self.devices.len(),
            };
        };
        for d in devices {
            d.snapshot_into(&mut segments);
        }
        segments.sort_by_key(|s| (s.device, s.address));
        if let Some(first) = devices.first() {
            let stream = self
                .driver
                .default_stream(first.device())
                .unwrap_or(StreamId(0));
            self.trace
                .record(TraceAction::Snapshot, first.device(), 0, 0, stream);
        }
        let (trace, live) = self.trace.entries_and_live_frames();
        if !live.is_empty() {
            for seg in &mut segments {
                for block in &mut seg.blocks {
                    if block.state != SnapshotBlockState::Inactive {
                        if let Some(frames) = live.get(&(seg.device, block.addr)) {
                            block.frames.clone_from(frames);
                        }
                    }
                }
            }
        }
        Snapshot {
            segments,
            trace,
            device_count: devices.len(),
        }
    }

    /// Bytes of segments held from the driver on `device`.
    pub(crate) fn reserved_bytes(&self, device: usize) -> Result<u64> {
        Ok(self.device(device)?.reserved_bytes())
    }

    /// PyTorch's `torch.cuda.memory._dump_snapshot(path)`: takes a [`Snapshot`] and writes it to
    /// `path` in PyTorch's pickled layout (what `python -m torch.cuda._memory_viz` and
    /// pytorch.org/memory_viz read) — through a fresh temporary file renamed over `path`, so
    /// nothing planted there is followed or opened. Refused in a forked child (its snapshot
    /// would be empty).
    #[cfg(feature = "pickle")]
    #[cfg_attr(docsrs, doc(cfg(feature = "pickle")))]
    pub(crate) fn dump_snapshot(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.birth.check("this allocator")?;
        let bytes = self.snapshot().to_pytorch_pickle(&self.config())?;
        super::pytorch_pickle::write_snapshot_file(path.as_ref(), &bytes)
    }

    /// With `oom_snapshot_path` set: writes a snapshot in PyTorch's layout there (no shard lock is
    /// held here; concurrent out-of-memory errors write one after the other) — into a fresh
    /// temporary file renamed over the path, so nothing planted there is followed or opened
    /// (`pytorch_pickle::write_snapshot_file`). A failure to write is logged, never hides the
    /// out-of-memory error.
    pub(super) fn dump_snapshot_on_oom(&self) {
        #[cfg(feature = "pickle")]
        let config = self.config();
        #[cfg(feature = "pickle")]
        if let Some(path) = &config.oom_snapshot_path {
            let _one_at_a_time = self.oom_dump.lock();
            let written = self
                .snapshot()
                .to_pytorch_pickle(&config)
                .and_then(|bytes| {
                    super::pytorch_pickle::write_snapshot_file(path.as_ref(), &bytes)
                });
            match written {
                Ok(()) => tracing::warn!(path = %path, "out of memory: snapshot written"),
                Err(err) => {
                    tracing::warn!(%err, "out of memory: the snapshot could not be written")
                }
            }
        }
    }
}
