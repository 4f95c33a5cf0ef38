//! Which settings a live runtime may change, and how one key's value is carried from one
//! configuration to another (`Runtime::reconfigure` changes the keys it is given and keeps the
//! rest — PyTorch's `_set_allocator_settings` resets every key it is not given; a scoped override
//! puts back the values it replaced).
//!
//! | key | on a live runtime | why |
//! |---|---|---|
//! | `garbage_collection_threshold`, `release_lock_on_cudamalloc`, `cross_stream_reuse`, `oom_snapshot_path` | changes | read at each miss (or out-of-memory) |
//! | `roundup_power2_divisions`, `max_non_split_rounding_mb` | changes | read when a request is rounded and fitted; blocks already handed out keep their sizes |
//! | `expandable_segments` | changes | new segments are of the new kind; a block is split by the kind of the segment it lies in |
//! | `per_process_memory_fraction` | changes | each device reads its cap from the configuration it was published (the one home of the setting): the value for every device and the devices' own values, which `set_per_process_memory_fraction` sets — a reconfiguration of this key, so an override of the key puts back both, exactly what was in force |
//! | `pinned_use_background_threads` | changes | validated only |
//! | `max_split_size_mb` | changes | read when a block is fitted, split or counted; a block (a segment) counted as oversize when handed out (made) is taken back as such, whatever the limit is by then (`Block::counted_oversize`) |
//! | `thread_cache_mb` | refused | each stream's front-cache limit is fixed when its shard is made |
//! | `default_stream` | refused | threads have already chosen their default streams by it |
//! | `stream_order` | refused | storages already made order themselves by it; a change would mix two rules on one storage |
//! | `pass_through` | refused | the cache a runtime kept by one rule would be kept (or dropped) under the other; build a new runtime |
//! | `nvtx_regions` | refused | a tool told of no heap before would be told of blocks in them; build a new runtime |
//! | `ipc_handle_ttl_s`, `pinned_use_cuda_host_register`, `pinned_num_register_threads`, `pinned_reserve_segment_size_mb`, `backend` | refused | the IPC state and the pinned allocator are built with the runtime |

use super::AllocatorConfig;

/// Every key, by its canonical name.
pub(crate) const KEYS: [&str; 20] = [
    "max_split_size_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "per_process_memory_fraction",
    "default_stream",
    "ipc_handle_ttl_s",
    "oom_snapshot_path",
    "thread_cache_mb",
    "max_non_split_rounding_mb",
    "backend",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_use_background_threads",
    "stream_order",
    "cross_stream_reuse",
    "pass_through",
    "nvtx_regions",
];

/// The canonical name of `key` (`pinned_use_host_register` is an alias).
pub(crate) fn canonical(key: &str) -> Option<&'static str> {
    if key == "pinned_use_host_register" {
        return Some("pinned_use_cuda_host_register");
    }
    KEYS.iter().copied().find(|k| *k == key)
}

/// Whether a live runtime may change a key (the table in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// At any time.
    Live,
    /// Never; the reason.
    Refused(&'static str),
}

/// Whether a live runtime may change canonical key `key`.
pub(crate) fn change_of(key: &str) -> Change {
    match key {
        "garbage_collection_threshold"
        | "release_lock_on_cudamalloc"
        | "cross_stream_reuse"
        | "oom_snapshot_path"
        | "roundup_power2_divisions"
        | "max_non_split_rounding_mb"
        | "expandable_segments"
        | "per_process_memory_fraction"
        | "pinned_use_background_threads"
        | "max_split_size_mb" => Change::Live,
        "thread_cache_mb" => Change::Refused(
            "each stream's front-cache limit is fixed when the stream is first used",
        ),
        "default_stream" => {
            Change::Refused("threads have already chosen their default streams by it")
        }
        "stream_order" => Change::Refused(
            "storages already made order themselves by it; a change would mix two rules on one storage",
        ),
        "pass_through" => Change::Refused(
            "the cache a runtime kept by one rule would be kept, or dropped, under the other; build a new runtime",
        ),
        "nvtx_regions" => Change::Refused(
            "a tool told of no heap of the memory held so far would be told of blocks in it; build a new runtime",
        ),
        _ => Change::Refused(
            "the IPC state and the pinned allocator are built with the runtime; build a new one",
        ),
    }
}

/// Copies canonical key `key`'s value from `from` into `to`.
pub(crate) fn copy_key(key: &str, from: &AllocatorConfig, to: &mut AllocatorConfig) {
    match key {
        "max_split_size_mb" => to.max_split_size = from.max_split_size,
        "garbage_collection_threshold" => {
            to.garbage_collection_threshold = from.garbage_collection_threshold
        }
        "roundup_power2_divisions" => to.roundup_power2_divisions = from.roundup_power2_divisions,
        "expandable_segments" => to.expandable_segments = from.expandable_segments,
        "release_lock_on_cudamalloc" => {
            to.release_lock_on_cudamalloc = from.release_lock_on_cudamalloc
        }
        "per_process_memory_fraction" => {
            to.per_process_memory_fraction = from.per_process_memory_fraction;
            to.device_memory_fractions
                .clone_from(&from.device_memory_fractions);
        }
        "default_stream" => to.default_stream = from.default_stream,
        "ipc_handle_ttl_s" => to.ipc_handle_ttl_ms = from.ipc_handle_ttl_ms,
        "oom_snapshot_path" => to.oom_snapshot_path = from.oom_snapshot_path.clone(),
        "thread_cache_mb" => to.thread_cache = from.thread_cache,
        "max_non_split_rounding_mb" => to.max_non_split_rounding = from.max_non_split_rounding,
        "pinned_use_cuda_host_register" => {
            to.pinned_use_host_register = from.pinned_use_host_register
        }
        "pinned_num_register_threads" => {
            to.pinned_num_register_threads = from.pinned_num_register_threads
        }
        "pinned_reserve_segment_size_mb" => {
            to.pinned_reserve_segment_size = from.pinned_reserve_segment_size
        }
        "pinned_use_background_threads" => {
            to.pinned_use_background_threads = from.pinned_use_background_threads
        }
        "stream_order" => to.stream_order = from.stream_order,
        "cross_stream_reuse" => to.cross_stream_reuse = from.cross_stream_reuse,
        "pass_through" => to.pass_through = from.pass_through,
        "nvtx_regions" => to.nvtx_regions = from.nvtx_regions,
        // `backend` has one value and no field.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_known_and_copies_alone() {
        // Every key has a verdict, and copying one key changes that key only.
        let tuned = AllocatorConfig::parse(
            "max_split_size_mb:64,garbage_collection_threshold:0.5,roundup_power2_divisions:4,\
             expandable_segments:True,release_lock_on_cudamalloc:True,\
             per_process_memory_fraction:[*:0.5,1:0.25],default_stream:dedicated,ipc_handle_ttl_s:5,\
             thread_cache_mb:8,max_non_split_rounding_mb:40,pinned_use_cuda_host_register:True,\
             pinned_num_register_threads:4,pinned_reserve_segment_size_mb:16,\
             pinned_use_background_threads:True,stream_order:manual,cross_stream_reuse:blocks",
        )
        .unwrap();
        let base = AllocatorConfig::default();
        let mut all = base.clone();
        for key in KEYS {
            assert_eq!(canonical(key), Some(key));
            // Every key has a verdict (the value itself is checked elsewhere).
            let _ = change_of(key);
            let mut one = base.clone();
            copy_key(key, &tuned, &mut one);
            let mut back = one.clone();
            copy_key(key, &base, &mut back);
            assert_eq!(back, base, "{key}: copying it back restores the rest");
            copy_key(key, &tuned, &mut all);
        }
        assert_eq!(all, tuned, "the keys cover every field set above");
        assert_eq!(
            canonical("pinned_use_host_register"),
            Some("pinned_use_cuda_host_register")
        );
    }
}
