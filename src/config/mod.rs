//! Allocator configuration: `CUDALLOC_CONF`, in the grammar and with the keys of PyTorch's
//! `PYTORCH_CUDA_ALLOC_CONF`, so a tuned PyTorch setting carries over unchanged.
//!
//! Grammar: `key:value[,key:value]*`, whitespace ignored; `roundup_power2_divisions` also takes a
//! list `[size_mb:divisions,...,>:divisions]`. Every key is checked: an unknown key or a bad value is
//! an [`Error::Config`] naming the key and what is valid.
//!
//! | key | value | default |
//! |---|---|---|
//! | `max_split_size_mb` | integer > 20 (MiB); blocks at least this large are never split | unlimited |
//! | `garbage_collection_threshold` | 0.0 < t < 1.0: reclaim cached blocks above t × allowed memory | off |
//! | `roundup_power2_divisions` | power of two ≤ 64, or `[256:1,512:2,>:4]` per size interval | off |
//! | `expandable_segments` | `True`/`False`: one segment per stream and pool that grows and shrinks in pages on the driver's virtual memory (shared between processes by page) | `False` |
//! | `release_lock_on_cudamalloc` | `True`/`False`: call the driver's malloc without holding the shard lock | `False` |
//! | `per_process_memory_fraction` | 0.0 ≤ f ≤ 1.0 of each device's total memory; or a list `[*:f,d:f,...]`: `*` every device not named (1.0 when absent), `d` device `d` alone (what `set_per_process_memory_fraction(f, d)` sets: the setter is a reconfiguration of this key, and `Display` prints the list form once a device has a value of its own). Either form is the key's whole value: the plain form clears the devices' own values. A device is capped when it has a value of its own, or the value for every device is below 1.0 | 1.0 |
//! | `default_stream` | `legacy`: the device's default stream (CUDA's legacy NULL stream, what PyTorch and candle launch on); `per_thread`: one stream per thread and device, made by cudalloc on first use and kept for the allocator's life; `dedicated`: one non-blocking stream per device made by cudalloc (cudalloc's own key) | `legacy` |
//! | `ipc_handle_ttl_s` | seconds > 0 (cudalloc's own key): an IPC handle not opened within this time is refused by consumers and its count reclaimed by `ipc_collect()` | off |
//! | `oom_snapshot_path` | a file (cudalloc's own key; feature `pickle`): when an allocation runs out of memory, a snapshot in PyTorch's pickled layout is written there before the error returns (with history on, it holds the trace), through a fresh temporary file beside it renamed over the path: a symlink or FIFO planted there is replaced, never followed or opened. No commas or whitespace in the path | off |
//! | `thread_cache_mb` | integer ≥ 0 (MiB; cudalloc's own key): each thread keeps up to this many bytes (and 32 blocks) of the blocks it freed, per stream, and hands them back to its own allocations of the same size without the stream's lock — two threads on one stream then scale; **changes PyTorch's reuse order** (see `alloc/front.rs`) | 0 (off: PyTorch's exact order) |
//! | `max_non_split_rounding_mb` | integer ≥ 0 (MiB): an oversize request takes a cached oversize block only if the block is less than this much larger | 20 |
//! | `backend` | `native` (PyTorch's `cudaMallocAsync` is refused: cudalloc is the native caching allocator) | `native` |
//! | `pinned_use_cuda_host_register` (also `pinned_use_host_register`) | `True`/`False`: the pinned host allocator (`crate::pinned`) takes ordinary pages, faults them in and registers them with the driver (`cuMemHostRegister`) instead of allocating page-locked memory (`cuMemHostAlloc`) | `False` |
//! | `pinned_num_register_threads` | power of two ≤ 128: threads that fault in the pages of one registration | 1 |
//! | `pinned_reserve_segment_size_mb` | integer ≥ 0 (MiB): one page-locked segment made on the first pinned allocation, from which later ones are carved before the driver is asked (never given back; `pinned/memory.rs`) | 0 (off) |
//! | `stream_order` | `auto`: a storage orders itself — an access through it on a stream (`data_ptr_on`, `mutable_data_ptr_on`, its copies and kernels) waits for the earlier accesses on other streams it conflicts with (a write for every earlier reader and writer, a read for the last writer), and its free waits for every stream that used it (`storage/order.rs`); `manual`: PyTorch's rules (`record_stream` and waits are the program's; the sanitizer reports what is missing) (cudalloc's own key) | `auto` |
//! | `cross_stream_reuse` | `off`: memory cached for one stream serves that stream only (PyTorch's order; other streams' idle segments are freed to the driver at the out-of-memory sequence's last step); `segments`: before asking the driver for a segment, a miss takes over the smallest whole idle segment cached under another stream that fits, ordered after that stream's work (no driver call); `blocks`: first the best-fitting free block cached under another stream, used on the asking stream after a wait on its owner's work and freed back to its owner after the asking stream's work, then as `segments` (`alloc/engine/cross_stream.rs`; cudalloc's own key) | `off` |
//! | `pass_through` | `True`/`False` (cudalloc's own key; PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING`): the default pool caches nothing — each allocation is its own driver allocation of the rounded size, each free its own driver free once the free's stream-ordered wait is over (found over at the next allocation or free on that stream, or at `empty_cache`) — so tools that check a driver allocation's bounds (compute-sanitizer's memcheck) see every tensor's. Same API and statistics; no cross-stream reuse, lending or free-memory callbacks before an out-of-memory; a driver free synchronizes the device (`cuMemFree`; on the host backend too, so a storage dropped while the dropping thread holds a stream back waits for it). Memory pools and graphs keep their memory (a graph's replays need it). Not with `thread_cache_mb` or `expandable_segments` (both caches) | `False` |
//! | `nvtx_regions` | `True`/`False` (cudalloc's own key): when an NVTX tool is attached to the process (`NVTX_INJECTION64_PATH`, as compute-sanitizer and Nsight Systems attach one), every mapped range of memory the allocator holds is an NVTX heap and every live block a region of it (registered when handed out, unregistered when its free completes; heaps unregistered before memory goes back to the driver), so `compute-sanitizer --tool memcheck --nvtx yes` reports an access from one block into a neighbour of the same segment. Without a tool, or `False`: one predictable branch per allocation and free (`alloc/nvtx_regions.rs`) | `False` |
//! | `pinned_use_background_threads` | `True`/`False`: validated; cudalloc polls the pinned allocator's events on every allocation that finds some queued (one atomic load when none) and in `empty_cache`, so no background thread is started | `False` |

use std::collections::BTreeMap;

use crate::error::{Error, Result};

pub(crate) mod cell;
mod display;
pub(crate) mod live;

/// Bytes in a MiB.
const MIB: u64 = 1 << 20;
/// Number of size intervals of `roundup_power2_divisions` (1 MiB, 2 MiB, … 32 GiB and above).
pub(crate) const ROUNDUP_INTERVALS: usize = 16;
/// Largest `thread_cache_mb` (1 TiB): more is a typo, not a cache.
const MAX_THREAD_CACHE_MB: u64 = 1 << 20;
/// `max_split_size_mb` must exceed this (PyTorch's large-buffer size, 20 MiB).
const MIN_MAX_SPLIT_MB: u64 = 20;

/// Whether storages order their accesses across streams themselves (`stream_order` in the table
/// above).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamOrder {
    /// A storage's access on a stream waits for the conflicting earlier accesses on other
    /// streams, and its free for every stream that used it.
    #[default]
    Auto,
    /// PyTorch's rules: the program records streams and waits.
    Manual,
}

/// Whether memory cached for one stream serves another (`cross_stream_reuse` in the table
/// above).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CrossStreamReuse {
    /// PyTorch's order: a stream's cache serves that stream only.
    #[default]
    Off,
    /// A miss takes over another stream's whole idle segment before asking the driver.
    Segments,
    /// A miss borrows another stream's best-fitting free block, else as `Segments`.
    Blocks,
}

/// What a thread's current stream is until it sets one (`default_stream` in the table above).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DefaultStream {
    /// The driver's default stream: CUDA's legacy NULL stream; the host backend's device stream.
    #[default]
    Legacy,
    /// A stream per (thread, device), made on first use and kept for the allocator's life.
    PerThread,
    /// One stream per device made by the allocator.
    Dedicated,
}

/// Parsed allocator settings.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct AllocatorConfig {
    /// Blocks of at least this many bytes are never split (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// Fraction of allowed memory above which cached blocks are reclaimed (0: off).
    pub garbage_collection_threshold: f64,
    /// Divisions per size interval for power-of-two rounding (0 or 1: plain 512-byte rounding).
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// Call the driver's malloc without holding the shard lock.
    pub release_lock_on_cudamalloc: bool,
    /// Expandable segments: one growing segment per stream and pool on the driver's virtual
    /// memory, mapped and unmapped in pages (`alloc/engine/expandable.rs`).
    pub expandable_segments: bool,
    /// Fraction of each device's memory this process may reserve (the devices without a value of
    /// their own in `device_memory_fractions`).
    pub per_process_memory_fraction: f64,
    /// Devices' own fractions (`set_per_process_memory_fraction(f, device)`, or the list form of
    /// `per_process_memory_fraction`), by device: they override `per_process_memory_fraction`.
    pub device_memory_fractions: BTreeMap<usize, f64>,
    /// Time-to-live of IPC handles in milliseconds (0: handles never expire).
    pub ipc_handle_ttl_ms: u64,
    /// What a thread's current stream is until it sets one.
    pub default_stream: DefaultStream,
    /// Where a snapshot is written when an allocation runs out of memory (feature `pickle`).
    pub oom_snapshot_path: Option<String>,
    /// Bytes of its own freed blocks a thread may keep per stream for reuse without the stream's
    /// lock (0: off, PyTorch's exact reuse order; `alloc/front.rs`).
    pub thread_cache: u64,
    /// An oversize request (at least `max_split_size`) may take a cached oversize block only if
    /// the block is less than this many bytes larger (PyTorch's `max_non_split_rounding_mb`;
    /// 20 MiB).
    pub max_non_split_rounding: u64,
    /// Pinned host memory from ordinary pages registered with the driver, not from the driver's
    /// page-locked allocation (`pinned_use_cuda_host_register`).
    pub pinned_use_host_register: bool,
    /// Threads that fault in the pages of one registration (`pinned_num_register_threads`).
    pub pinned_num_register_threads: u64,
    /// Bytes of the pinned reserve segment (`pinned_reserve_segment_size_mb`; 0: none).
    pub pinned_reserve_segment_size: u64,
    /// `pinned_use_background_threads` as given (validated; events are polled inline).
    pub pinned_use_background_threads: bool,
    /// Whether storages order their accesses across streams themselves (`stream_order`).
    pub stream_order: StreamOrder,
    /// Whether memory cached for one stream serves another (`cross_stream_reuse`).
    pub cross_stream_reuse: CrossStreamReuse,
    /// The default pool caches nothing: one driver allocation per allocation (`pass_through`).
    pub pass_through: bool,
    /// Live blocks are NVTX regions of NVTX heaps, for a tool attached (`nvtx_regions`).
    pub nvtx_regions: bool,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            release_lock_on_cudamalloc: false,
            expandable_segments: false,
            per_process_memory_fraction: 1.0,
            device_memory_fractions: BTreeMap::new(),
            ipc_handle_ttl_ms: 0,
            default_stream: DefaultStream::Legacy,
            oom_snapshot_path: None,
            thread_cache: 0,
            max_non_split_rounding: 20 * MIB,
            pinned_use_host_register: false,
            pinned_num_register_threads: 1,
            pinned_reserve_segment_size: 0,
            pinned_use_background_threads: false,
            stream_order: StreamOrder::Auto,
            cross_stream_reuse: CrossStreamReuse::Off,
            pass_through: false,
            nvtx_regions: false,
        }
    }
}

fn bad(key: &str, value: &str, valid: &str) -> Error {
    Error::Config(format!("{key}:{value} is invalid; expected {valid}"))
}

/// A whole number of MiB up to [`MAX_THREAD_CACHE_MB`] (1 TiB: more is a typo), in bytes.
fn parse_mib(key: &str, value: &str) -> Result<u64> {
    value
        .parse::<u64>()
        .ok()
        .filter(|&mb| mb <= MAX_THREAD_CACHE_MB)
        .map(|mb| mb * MIB)
        .ok_or_else(|| {
            bad(
                key,
                value,
                &format!("an integer number of MiB ≤ {MAX_THREAD_CACHE_MB}"),
            )
        })
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "True" | "true" => Ok(true),
        "False" | "false" => Ok(false),
        _ => Err(bad(key, value, "True or False")),
    }
}

fn parse_power_of_two(key: &str, what: &str, value: &str, max: u64) -> Result<u64> {
    match value.parse::<u64>() {
        Ok(n) if n.is_power_of_two() && n <= max => Ok(n),
        _ => Err(bad(
            key,
            value,
            &format!("{what}: a power of two between 1 and {max}"),
        )),
    }
}

/// Interval index of a size given in MiB (1 MiB → 0, 2 MiB → 1, …), clamped to the table.
fn interval_of_mb(mb: u64) -> usize {
    (mb.ilog2() as usize).min(ROUNDUP_INTERVALS - 1)
}

fn parse_divisions(value: &str) -> Result<[u64; ROUNDUP_INTERVALS]> {
    const KEY: &str = "roundup_power2_divisions";
    let mut table = [0u64; ROUNDUP_INTERVALS];
    let Some(list) = value.strip_prefix('[') else {
        let n = parse_power_of_two(KEY, "divisions", value, 64)?;
        return Ok([n; ROUNDUP_INTERVALS]);
    };
    let list = list
        .strip_suffix(']')
        .ok_or_else(|| bad(KEY, value, "a list closed by ']', e.g. [256:1,512:2,>:4]"))?;
    // Each entry `size_mb:d` sets the divisions of the intervals from the end of the previous entry
    // up to (not including) size_mb's interval; `>:d` sets every interval after the last entry.
    let mut start = 0usize;
    for entry in list.split(',').filter(|e| !e.is_empty()) {
        let (size, divisions) = entry.split_once(':').ok_or_else(|| {
            bad(
                KEY,
                value,
                "entries of the form size_mb:divisions or >:divisions",
            )
        })?;
        let d = parse_power_of_two(KEY, "divisions", divisions, 64)?;
        if size == ">" {
            table[start..].fill(d);
            start = ROUNDUP_INTERVALS;
        } else {
            let mb = parse_power_of_two(KEY, "interval size in MiB", size, 1 << 40)?;
            let end = interval_of_mb(mb);
            if end < start {
                return Err(bad(KEY, value, "interval sizes in increasing order"));
            }
            table[start..end].fill(d);
            start = end;
        }
    }
    Ok(table)
}

fn parse_fraction(key: &str, value: &str, open_low: bool, open_high: bool) -> Result<f64> {
    let v: f64 = value.parse().map_err(|_| bad(key, value, "a number"))?;
    let low_ok = if open_low { v > 0.0 } else { v >= 0.0 };
    let high_ok = if open_high { v < 1.0 } else { v <= 1.0 };
    if !(low_ok && high_ok) {
        let range = format!(
            "a number in {}0.0, 1.0{}",
            if open_low { "(" } else { "[" },
            if open_high { ")" } else { "]" }
        );
        return Err(bad(key, value, &range));
    }
    Ok(v)
}

/// Largest device ordinal the list form of `per_process_memory_fraction` accepts (more is a typo,
/// not a device).
const MAX_DEVICE: usize = 1 << 16;

/// `per_process_memory_fraction`'s value: a fraction for every device, or a list
/// `[*:f,d:f,...]` (`*`: every device not named, 1.0 when absent; `d`: device `d`).
fn parse_memory_fractions(key: &str, value: &str) -> Result<(f64, BTreeMap<usize, f64>)> {
    let Some(list) = value.strip_prefix('[') else {
        return Ok((parse_fraction(key, value, false, false)?, BTreeMap::new()));
    };
    let form = "a fraction, or a list [*:f,device:f,...] of fractions in [0.0, 1.0]";
    let list = list
        .strip_suffix(']')
        .ok_or_else(|| bad(key, value, form))?;
    let (mut every, mut devices) = (None, BTreeMap::new());
    for entry in list.split(',').filter(|e| !e.is_empty()) {
        let (which, fraction) = entry.split_once(':').ok_or_else(|| bad(key, value, form))?;
        let fraction = parse_fraction(key, fraction, false, false)?;
        let again = if which == "*" {
            every.replace(fraction).is_some()
        } else {
            let device = which
                .parse::<usize>()
                .ok()
                .filter(|&d| d <= MAX_DEVICE)
                .ok_or_else(|| bad(key, value, "device ordinals (or *) before each fraction"))?;
            devices.insert(device, fraction).is_some()
        };
        if again {
            return Err(bad(key, value, "each device (and *) named once"));
        }
    }
    Ok((every.unwrap_or(1.0), devices))
}

/// Splits at commas that are not inside `[...]`.
fn split_top_level(text: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// One `key: value` line per setting, in `CUDALLOC_CONF`'s terms (what `cudalloc info` prints).
/// `err`, with a hint when `item` holds a `;`: pairs are separated by `,` (a `;` in the text is
/// read as part of a value).
fn with_separator_hint(err: Error, item: &str) -> Error {
    match err {
        Error::Config(message) if item.contains(';') => Error::Config(format!(
            "{message} (pairs are separated by ',', not ';': \"expandable_segments:True,max_split_size_mb:128\")"
        )),
        other => other,
    }
}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF`-style string.
    pub fn parse(text: &str) -> Result<Self> {
        let mut config = AllocatorConfig::default();
        config.apply(text)?;
        Ok(config)
    }

    /// Applies the `key:value` pairs of `text` on top of this configuration: the keys it names
    /// take their new values (a key's whole value: `roundup_power2_divisions` given as a list
    /// resets the intervals it does not name), the others keep theirs. Returns the keys named, by
    /// their canonical names, in order. On an error nothing changes.
    pub fn apply(&mut self, text: &str) -> Result<Vec<&'static str>> {
        let mut next = self.clone();
        let keys = next.apply_pairs(text)?;
        next.check_combination()?;
        *self = next;
        Ok(keys)
    }

    /// An error when two keys in force contradict each other (`pass_through` with a cache).
    /// Checked when text is applied and when a runtime is built from a configuration (whose
    /// fields are public).
    pub(crate) fn check_combination(&self) -> Result<()> {
        if self.pass_through && self.thread_cache > 0 {
            return Err(Error::Config(
                "pass_through caches nothing, and thread_cache_mb is a cache: set thread_cache_mb:0"
                    .into(),
            ));
        }
        if self.pass_through && self.expandable_segments {
            return Err(Error::Config(
                "pass_through gives each allocation its own driver allocation, and \
                 expandable_segments caches pages of one segment: set expandable_segments:False"
                    .into(),
            ));
        }
        Ok(())
    }

    fn apply_pairs(&mut self, text: &str) -> Result<Vec<&'static str>> {
        let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        let mut keys = Vec::new();
        for item in split_top_level(&compact)
            .into_iter()
            .filter(|s| !s.is_empty())
        {
            let (key, value) = item.split_once(':').ok_or_else(|| {
                with_separator_hint(
                    Error::Config(format!("{item:?} is not of the form key:value")),
                    item,
                )
            })?;
            let canonical = live::canonical(key).unwrap_or("?");
            if canonical != "?" && keys.contains(&canonical) {
                return Err(Error::Config(format!(
                    "{canonical} is given twice; give each key once (the last would silently win)"
                )));
            }
            keys.push(canonical);
            self.apply_one(key, value)
                .map_err(|err| with_separator_hint(err, item))?;
        }
        Ok(keys)
    }

    /// Sets `key` to `value` (one pair of [`Self::apply`]).
    fn apply_one(&mut self, key: &str, value: &str) -> Result<()> {
        {
            match key {
                "max_split_size_mb" => {
                    let mb: u64 = value.parse().map_err(|_| {
                        bad(key, value, &format!("an integer number of MiB > {MIN_MAX_SPLIT_MB}"))
                    })?;
                    if mb <= MIN_MAX_SPLIT_MB {
                        return Err(bad(key, value, &format!("an integer number of MiB > {MIN_MAX_SPLIT_MB}")));
                    }
                    self.max_split_size = mb.saturating_mul(MIB);
                }
                "garbage_collection_threshold" => {
                    self.garbage_collection_threshold = parse_fraction(key, value, true, true)?;
                }
                "roundup_power2_divisions" => self.roundup_power2_divisions = parse_divisions(value)?,
                "expandable_segments" => self.expandable_segments = parse_bool(key, value)?,
                "release_lock_on_cudamalloc" => self.release_lock_on_cudamalloc = parse_bool(key, value)?,
                "per_process_memory_fraction" => {
                    (self.per_process_memory_fraction, self.device_memory_fractions) =
                        parse_memory_fractions(key, value)?;
                }
                "default_stream" => {
                    self.default_stream = match value {
                        "legacy" => DefaultStream::Legacy,
                        "per_thread" => DefaultStream::PerThread,
                        "dedicated" => DefaultStream::Dedicated,
                        _ => return Err(bad(key, value, "legacy, per_thread or dedicated")),
                    }
                }
                "ipc_handle_ttl_s" => {
                    let seconds: f64 = value
                        .parse()
                        .ok()
                        .filter(|s: &f64| s.is_finite() && *s > 0.0 && *s <= 1e9)
                        .ok_or_else(|| bad(key, value, "a number of seconds > 0"))?;
                    self.ipc_handle_ttl_ms = ((seconds * 1000.0).ceil() as u64).max(1);
                }
                "oom_snapshot_path" => {
                    if value.is_empty() {
                        return Err(bad(key, value, "a file path"));
                    }
                    if !cfg!(feature = "pickle") {
                        return Err(Error::Config(format!(
                            "{key} needs cudalloc built with the `pickle` feature (PyTorch's snapshot layout)"
                        )));
                    }
                    self.oom_snapshot_path = Some(value.to_owned());
                }
                "thread_cache_mb" => self.thread_cache = parse_mib(key, value)?,
                "max_non_split_rounding_mb" => self.max_non_split_rounding = parse_mib(key, value)?,
                "backend" => match value {
                    "native" => {}
                    "cudaMallocAsync" => {
                        return Err(Error::Config(
                            "backend:cudaMallocAsync is not available: cudalloc is the native caching \
                             allocator (backend:native)"
                                .into(),
                        ))
                    }
                    _ => return Err(bad(key, value, "native (cudaMallocAsync is not available)")),
                },
                "pinned_use_cuda_host_register" | "pinned_use_host_register" => {
                    self.pinned_use_host_register = parse_bool(key, value)?;
                }
                "pinned_use_background_threads" => {
                    self.pinned_use_background_threads = parse_bool(key, value)?;
                }
                "pinned_num_register_threads" => {
                    self.pinned_num_register_threads =
                        parse_power_of_two(key, "threads", value, 128)?;
                }
                "pinned_reserve_segment_size_mb" => {
                    self.pinned_reserve_segment_size = parse_mib(key, value)?;
                }
                "stream_order" => {
                    self.stream_order = match value {
                        "auto" => StreamOrder::Auto,
                        "manual" => StreamOrder::Manual,
                        _ => return Err(bad(key, value, "auto or manual")),
                    }
                }
                "pass_through" => self.pass_through = parse_bool(key, value)?,
                "nvtx_regions" => self.nvtx_regions = parse_bool(key, value)?,
                "cross_stream_reuse" => {
                    self.cross_stream_reuse = match value {
                        "off" => CrossStreamReuse::Off,
                        "segments" => CrossStreamReuse::Segments,
                        "blocks" => CrossStreamReuse::Blocks,
                        _ => return Err(bad(key, value, "off, segments or blocks")),
                    }
                }
                _ => {
                    return Err(Error::Config(format!(
                        "unknown key {key:?}; valid keys: max_split_size_mb, garbage_collection_threshold, \
                         roundup_power2_divisions, expandable_segments, release_lock_on_cudamalloc, \
                         per_process_memory_fraction, ipc_handle_ttl_s, default_stream, oom_snapshot_path, thread_cache_mb, \
                         max_non_split_rounding_mb, backend, pinned_use_cuda_host_register, \
                         pinned_num_register_threads, pinned_reserve_segment_size_mb, \
                         pinned_use_background_threads, stream_order, cross_stream_reuse, pass_through, \
                         nvtx_regions"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Reads `CUDALLOC_CONF` (unset or empty: defaults).
    pub fn from_env() -> Result<Self> {
        match std::env::var("CUDALLOC_CONF") {
            Ok(text) => Self::parse(&text).map_err(|e| match e {
                Error::Config(m) => Error::Config(format!("CUDALLOC_CONF: {m}")),
                other => other,
            }),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::Config("CUDALLOC_CONF is not valid UTF-8".into()))
            }
        }
    }

    /// The cap on what this process may reserve on `device`, a fraction of its total memory, when
    /// one is in force: the device's own value (`set_per_process_memory_fraction`), else
    /// `per_process_memory_fraction` when below 1.0.
    pub fn memory_fraction(&self, device: usize) -> Option<f64> {
        match self.device_memory_fractions.get(&device) {
            Some(&own) => Some(own),
            None => {
                (self.per_process_memory_fraction < 1.0).then_some(self.per_process_memory_fraction)
            }
        }
    }

    /// Gives `device` a memory fraction of its own (`set_per_process_memory_fraction`): an
    /// error, nothing changed, when it is not in [0.0, 1.0].
    pub(crate) fn set_device_memory_fraction(
        &mut self,
        device: usize,
        fraction: f64,
    ) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::invalid(format!(
                "memory fraction {fraction} is not in [0.0, 1.0]"
            )));
        }
        self.device_memory_fractions.insert(device, fraction);
        Ok(())
    }

    /// Divisions for power-of-two rounding of a request of `size` bytes.
    #[cfg(test)]
    pub(crate) fn divisions_for(&self, size: u64) -> u64 {
        self.roundup_power2_divisions[Self::division_interval(size)]
    }

    /// The index of `size`'s interval in `roundup_power2_divisions`.
    #[inline]
    pub(crate) fn division_interval(size: u64) -> usize {
        let index = if size > MIB {
            (size.ilog2() - 20) as usize
        } else {
            0
        };
        index.min(ROUNDUP_INTERVALS - 1)
    }
}

#[cfg(test)]
mod tests;
