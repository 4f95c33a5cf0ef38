//! The configuration as `cudalloc info` prints it: one `key: value` line per key of the grammar,
//! in a form the grammar reads back (`tests.rs` checks both).

use super::{AllocatorConfig, CrossStreamReuse, DefaultStream, StreamOrder, MIB};

impl std::fmt::Display for AllocatorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let or_off = |on: bool, value: String| if on { value } else { "off".to_owned() };
        let split = if self.max_split_size == u64::MAX {
            "unlimited".to_owned()
        } else {
            format!("{}", self.max_split_size / MIB)
        };
        let divisions: Vec<String> = self
            .roundup_power2_divisions
            .iter()
            .map(u64::to_string)
            .collect();
        let rounding = self.roundup_power2_divisions.iter().any(|&d| d > 1);
        let default_stream = match self.default_stream {
            DefaultStream::Legacy => "legacy",
            DefaultStream::PerThread => "per_thread",
            DefaultStream::Dedicated => "dedicated",
        };
        writeln!(f, "max_split_size_mb: {split}")?;
        writeln!(
            f,
            "garbage_collection_threshold: {}",
            or_off(
                self.garbage_collection_threshold > 0.0,
                self.garbage_collection_threshold.to_string()
            )
        )?;
        writeln!(
            f,
            "roundup_power2_divisions: {}",
            or_off(rounding, format!("[{}]", divisions.join(",")))
        )?;
        writeln!(
            f,
            "release_lock_on_cudamalloc: {}",
            self.release_lock_on_cudamalloc
        )?;
        writeln!(f, "expandable_segments: {}", self.expandable_segments)?;
        if self.device_memory_fractions.is_empty() {
            writeln!(
                f,
                "per_process_memory_fraction: {}",
                self.per_process_memory_fraction
            )?;
        } else {
            // The list form, which the grammar reads back.
            let devices: Vec<String> = self
                .device_memory_fractions
                .iter()
                .map(|(device, fraction)| format!("{device}:{fraction}"))
                .collect();
            writeln!(
                f,
                "per_process_memory_fraction: [*:{},{}]",
                self.per_process_memory_fraction,
                devices.join(",")
            )?;
        }
        writeln!(
            f,
            "ipc_handle_ttl_s: {}",
            or_off(
                self.ipc_handle_ttl_ms > 0,
                format!("{}", self.ipc_handle_ttl_ms as f64 / 1000.0)
            )
        )?;
        writeln!(f, "default_stream: {default_stream}")?;
        writeln!(
            f,
            "thread_cache_mb: {}",
            or_off(self.thread_cache > 0, (self.thread_cache / MIB).to_string())
        )?;
        writeln!(
            f,
            "oom_snapshot_path: {}",
            self.oom_snapshot_path.as_deref().unwrap_or("off")
        )?;
        writeln!(
            f,
            "max_non_split_rounding_mb: {}",
            self.max_non_split_rounding / MIB
        )?;
        writeln!(f, "backend: native")?;
        writeln!(
            f,
            "pinned_use_cuda_host_register: {}",
            self.pinned_use_host_register
        )?;
        writeln!(
            f,
            "pinned_num_register_threads: {}",
            self.pinned_num_register_threads
        )?;
        writeln!(
            f,
            "pinned_reserve_segment_size_mb: {}",
            self.pinned_reserve_segment_size / MIB
        )?;
        writeln!(
            f,
            "pinned_use_background_threads: {}",
            self.pinned_use_background_threads
        )?;
        let stream_order = match self.stream_order {
            StreamOrder::Auto => "auto",
            StreamOrder::Manual => "manual",
        };
        writeln!(f, "stream_order: {stream_order}")?;
        let cross_stream_reuse = match self.cross_stream_reuse {
            CrossStreamReuse::Off => "off",
            CrossStreamReuse::Segments => "segments",
            CrossStreamReuse::Blocks => "blocks",
        };
        writeln!(f, "cross_stream_reuse: {cross_stream_reuse}")?;
        writeln!(f, "pass_through: {}", self.pass_through)?;
        write!(f, "nvtx_regions: {}", self.nvtx_regions)
    }
}
