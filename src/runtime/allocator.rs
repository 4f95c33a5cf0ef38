//! The runtime's own answers for what its allocator does — streams, memory without a storage,
//! statistics, pools and tags, captures, observers and registrars — each forwarded to the
//! caching allocator (`src/alloc/`), which is the runtime's and not public: one type to call,
//! one page of documentation.

use std::collections::BTreeMap;

use super::Runtime;
use crate::alloc::{
    Capture, CaptureRoute, DataPtr, DeviceStats, FreeMemoryCallback, HistoryOptions, MemPool,
    MemPoolId, MemPoolOptions, OnRegistrationFailure, OutOfMemoryObserver, PoolScope,
    RegisteredRegion, Registrar, RegistrarId, RegistrationStats, SegmentObserver, Snapshot,
    StreamGuard,
};
use crate::driver::{CaptureMode, DeviceAddr, Driver, StreamId};
use crate::error::Result;
use crate::sync::os::Arc;

impl Runtime {
    // Streams.
    /// Creates a new stream on `device`.
    pub fn create_stream(&self, device: usize) -> Result<StreamId> {
        self.allocator.create_stream(device)
    }

    /// Waits for `stream`'s work and destroys it; the memory cached for it goes to other
    /// streams (`cross_stream_reuse:segments`/`blocks`) or back to the driver (`off`) instead of
    /// being stranded. Blocks still allocated on it stay valid. The default stream is refused.
    pub fn destroy_stream(&self, stream: StreamId) -> Result<()> {
        self.allocator.destroy_stream(stream)
    }

    /// This thread's current stream on `device` (the default stream unless set).
    pub fn current_stream(&self, device: usize) -> Result<StreamId> {
        self.allocator.current_stream(device)
    }

    /// The device's default stream for this thread: the library's
    /// ([`Runtime::set_default_stream`]) when one is set, else as the `default_stream`
    /// setting chooses — the driver's default stream (CUDA's legacy NULL stream), this thread's
    /// own stream, or the allocator's dedicated stream.
    pub fn default_stream(&self, device: usize) -> Result<StreamId> {
        self.allocator.default_stream(device)
    }

    /// Makes `stream` this thread's current stream on its device until the guard drops.
    pub fn set_current_stream(&self, stream: StreamId) -> Result<StreamGuard> {
        self.allocator.set_current_stream(stream)
    }

    /// Makes `stream` (one the library made or imported) the default stream of its device on
    /// every thread: allocation, copies and copy-on-write copies use it wherever no
    /// [`StreamGuard`] made another stream current — the way a library that keeps one stream
    /// per device works, with no guard anywhere. It overrides the `default_stream` setting until
    /// [`Runtime::clear_default_stream`]. The stream must outlive its use as default.
    pub fn set_default_stream(&self, stream: StreamId) -> Result<()> {
        self.allocator.set_default_stream(stream)
    }

    /// Gives `device` back its configured default stream (undoes
    /// [`Runtime::set_default_stream`]).
    pub fn clear_default_stream(&self, device: usize) -> Result<()> {
        self.allocator.clear_default_stream(device)
    }

    /// The raw handle of `stream` (CUDA: its `CUstream`, 0 for the legacy stream), for a
    /// library's own launches.
    pub fn raw_stream(&self, stream: StreamId) -> Result<u64> {
        self.allocator.raw_stream(stream)
    }

    /// Adopts a stream the caller made (a tensor library's own stream) by its raw handle; see
    /// [`Interop::import_stream`](crate::backend::capability::Interop::import_stream). cudalloc never destroys it.
    ///
    /// # Safety
    /// CUDA: `raw` must be a live `CUstream` of `device`'s primary context and stay alive while
    /// memory allocated or recorded on the returned stream is in use.
    pub unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId> {
        // SAFETY: the caller's contract is this method's, the allocator's own.
        unsafe { self.allocator.import_stream(device, raw) }
    }

    // Device memory without a storage (the allocator's `DataPtr`s).
    /// Allocates `size` bytes on `device`'s current stream. Size 0 gives an empty pointer.
    ///
    /// In a process forked from the one that built the allocator this is an
    /// [`ErrorKind::ForkedChild`](crate::ErrorKind::ForkedChild) error: the child would be handed
    /// the blocks its parent is handed next (build a runtime in the child).
    pub fn allocate(&self, device: usize, size: u64) -> Result<DataPtr> {
        self.allocator.allocate(device, size)
    }

    /// Allocates `size` bytes for use on `stream`.
    pub fn allocate_on(&self, stream: StreamId, size: u64) -> Result<DataPtr> {
        self.allocator.allocate_on(stream, size)
    }

    /// Marks `data` as used on `stream`: its free will wait for the work queued there so far.
    pub fn record_stream(&self, data: &DataPtr, stream: StreamId) -> Result<()> {
        self.allocator.record_stream(data, stream)
    }

    /// The allocator-level clone: allocates `nbytes` on `stream` and enqueues a device-to-device
    /// copy of `src`'s first `nbytes` there (stream-ordered, not blocking). `src` is marked as used
    /// by `stream`, so its free waits for the copy. (DESIGN calls this `clone`; renamed so it
    /// cannot be confused with `Clone::clone` on an `Arc<CachingAllocator>`.)
    pub fn clone_data(&self, src: &DataPtr, nbytes: u64, stream: StreamId) -> Result<DataPtr> {
        self.allocator.clone_data(src, nbytes, stream)
    }

    /// Waits for pending frees and returns every cached whole segment of every device to the
    /// driver (a live private pool's cache stays: [`MemPool::empty_cache`]). In a forked child it
    /// does nothing (the cached segments are the parent's).
    pub fn empty_cache(&self) {
        self.allocator.empty_cache()
    }

    /// Caps this process's reservations on `device` at `fraction` of its capacity (PyTorch's
    /// `torch.cuda.set_per_process_memory_fraction`). A reconfiguration of the
    /// `per_process_memory_fraction` key — `device`'s own value, seen in [`Runtime::config`]
    /// ([`AllocatorConfig::memory_fraction`](crate::AllocatorConfig::memory_fraction)) —, so an
    /// [`Runtime::override_config`] of the key puts it back at the override's end, and one made
    /// inside an override's scope is put back by the scope's end. An error for a fraction outside
    /// [0.0, 1.0] or a device that does not exist, and in a forked child.
    pub fn set_per_process_memory_fraction(&self, fraction: f64, device: usize) -> Result<()> {
        self.allocator
            .set_per_process_memory_fraction(fraction, device)
    }

    // Statistics, snapshots and the memory history.
    /// The statistics of `device` (PyTorch's `torch.cuda.memory_stats`, typed; with PyTorch's
    /// keys: [`Runtime::memory_stats_map`]).
    pub fn memory_stats(&self, device: usize) -> Result<DeviceStats> {
        self.allocator.memory_stats(device)
    }

    /// What live memory pools reserve on `device`, and how much of that is in pools CUDA graphs
    /// hold: cheap (no statistics copied), for a serving loop to watch.
    pub fn pools_reserved(&self, device: usize) -> Result<crate::stats::PoolsReserved> {
        self.allocator.pools_reserved(device)
    }

    /// What the allocator keeps of its shards on `device`: bounded by the streams and pools
    /// alive at once, for a long-running program to watch.
    pub fn bookkeeping(&self, device: usize) -> Result<crate::stats::Bookkeeping> {
        self.allocator.bookkeeping(device)
    }

    /// Stats of `device` with PyTorch's keys.
    pub fn memory_stats_map(&self, device: usize) -> Result<BTreeMap<String, i64>> {
        self.allocator.memory_stats_map(device)
    }

    /// Bytes allocated on `device` now (PyTorch's `memory_allocated`: rounded block sizes, all
    /// pools).
    pub fn memory_allocated(&self, device: usize) -> Result<u64> {
        self.allocator.memory_allocated(device)
    }

    /// The most bytes allocated on `device` since the last peak reset
    /// (`max_memory_allocated`).
    pub fn max_memory_allocated(&self, device: usize) -> Result<u64> {
        self.allocator.max_memory_allocated(device)
    }

    /// Bytes of segments held from the driver on `device` now (PyTorch's `memory_reserved`: the device's
    /// reserved counter, without summing the shards).
    pub fn memory_reserved(&self, device: usize) -> Result<u64> {
        self.allocator.memory_reserved(device)
    }

    /// The most bytes held from the driver on `device` since the last peak reset
    /// (`max_memory_reserved`).
    pub fn max_memory_reserved(&self, device: usize) -> Result<u64> {
        self.allocator.max_memory_reserved(device)
    }

    /// Resets every `peak` of `device` to its current value.
    pub fn reset_peak_memory_stats(&self, device: usize) -> Result<()> {
        self.allocator.reset_peak_memory_stats(device)
    }

    /// Zeroes the accumulated counts of `device`.
    pub fn reset_accumulated_memory_stats(&self, device: usize) -> Result<()> {
        self.allocator.reset_accumulated_memory_stats(device)
    }

    /// PyTorch's memory summary table of `device` (`torch.cuda.memory_summary`).
    pub fn memory_summary(&self, device: usize) -> Result<String> {
        self.allocator.memory_summary(device)
    }

    /// Every segment with its blocks, and the trace when the memory history is on (empty in a
    /// forked child: its parent's shards may be locked for good there).
    pub fn snapshot(&self) -> Snapshot {
        self.allocator.snapshot()
    }

    /// PyTorch's `torch.cuda.memory._dump_snapshot(path)`: takes a [`Snapshot`] and writes it to
    /// `path` in PyTorch's pickled layout (what `python -m torch.cuda._memory_viz` and
    /// pytorch.org/memory_viz read) — through a fresh temporary file renamed over `path`, so
    /// nothing planted there is followed or opened.
    #[cfg(feature = "pickle")]
    #[cfg_attr(docsrs, doc(cfg(feature = "pickle")))]
    pub fn dump_snapshot(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.allocator.dump_snapshot(path)
    }

    /// PyTorch's `_record_memory_history`: what the history records, how many entries it keeps,
    /// and whether allocations carry their Rust stack (see `alloc/history.rs`). Turning it off
    /// clears what was recorded.
    pub fn record_memory_history(&self, options: HistoryOptions) {
        self.allocator.record_memory_history(options)
    }

    // Memory pools and tags.
    /// A new private memory pool of this allocator (PyTorch's `torch.cuda.MemPool(...)`).
    pub fn mem_pool(&self, options: MemPoolOptions) -> Result<MemPool> {
        self.allocator.mem_pool(options)
    }

    /// Makes this thread allocate from `pool` on `device` — on every stream — until the scope
    /// drops (PyTorch's `torch.cuda.use_mem_pool(pool, device)`). Other threads are not
    /// affected; scopes nest.
    pub fn use_mem_pool(&self, pool: &MemPool, device: usize) -> Result<PoolScope> {
        self.allocator.use_mem_pool(pool, device)
    }

    /// The pool this thread allocates from on `device` (`None`: the default pool).
    pub fn current_mem_pool(&self, device: usize) -> Option<MemPoolId> {
        self.allocator.current_mem_pool(device)
    }

    /// The memory pool of tag `name`, made on first use: its memory lives on expandable segments
    /// of its own, so that [`Runtime::sleep`](crate::Runtime::sleep) can give its physical
    /// memory back and [`Runtime::wake_up`](crate::Runtime::wake_up) map it back at the same
    /// addresses. Allocate into it with [`Runtime::use_tag`] (or
    /// [`Runtime::use_mem_pool`] with this pool). Tags live as long as the allocator.
    pub fn tag(&self, name: &str) -> Result<MemPool> {
        self.allocator.tag(name)
    }

    /// Makes this thread allocate into tag `name` on `device`, on every stream, until the scope
    /// drops (vLLM's `use_memory_pool(tag=…)`); the tag is made on first use.
    pub fn use_tag(&self, name: &str, device: usize) -> Result<PoolScope> {
        self.allocator.use_tag(name, device)
    }

    /// The tags made so far, by name.
    pub fn tag_names(&self) -> Vec<String> {
        self.allocator.tag_names()
    }

    /// Whether tag `name` is asleep (or on its way to or from sleep); an error for an unknown
    /// tag.
    pub fn is_asleep(&self, name: &str) -> Result<bool> {
        self.allocator.is_asleep(name)
    }

    // Stream capture and graphs.
    /// Begins capturing `stream` into a graph in `mode` (PyTorch's `torch.cuda.graph(g,
    /// pool=…, capture_error_mode=…)`): allocations on the stream — and on streams that join the
    /// capture — come from `pool`, or from a fresh private pool when `pool` is `None`.
    pub fn begin_capture(
        &self,
        stream: StreamId,
        pool: Option<&MemPool>,
        mode: CaptureMode,
    ) -> Result<Capture> {
        self.allocator.begin_capture(stream, pool, mode)
    }

    /// Routes the capture *someone else* began on `stream` — a library's own capture, e.g.
    /// cudarc's `CudaStream::begin_capture` on a stream imported with `import_stream` — to
    /// `pool` (a fresh private pool when `None`), as [`Self::begin_capture`] routes its own:
    /// allocations on the stream come from the pool, frees with stream uses wait for the
    /// capture's end, no event is queried meanwhile. After the library ends its capture,
    /// [`CaptureRoute::finish`] gives the pool back: keep it as long as the library's graph
    /// lives, since the graph names its addresses. An error when the stream is not capturing.
    pub fn route_capture(&self, stream: StreamId, pool: Option<&MemPool>) -> Result<CaptureRoute> {
        self.allocator.route_capture(stream, pool)
    }

    // Observers and registrars.
    /// Registers a callback run on a cache miss before asking the driver for memory; it returns
    /// whether it freed anything (then best fit is retried).
    pub fn register_free_memory_callback(&self, callback: FreeMemoryCallback) {
        self.allocator.register_free_memory_callback(callback)
    }

    /// Calls `observer` with the facts of every allocation that fails for lack of memory, before
    /// its error returns.
    pub fn register_out_of_memory_observer(&self, observer: OutOfMemoryObserver) {
        self.allocator.register_out_of_memory_observer(observer)
    }

    /// Calls `observer` on every segment this allocator maps from its driver (after) and returns
    /// to it (before); see `src/alloc/observers.rs`.
    pub fn register_segment_observer(&self, observer: SegmentObserver) {
        self.allocator.register_segment_observer(observer)
    }

    /// Attaches `registrar`: every region this allocator has mapped is registered with it now,
    /// every region mapped later as it is mapped, and each is deregistered before its memory goes
    /// (`src/alloc/registration.rs`). Several registrars may be attached at once. A failure on a
    /// region already mapped fails the attach (leaving nothing registered with it) unless
    /// `on_failure` counts and skips failures. Refused in a forked child.
    pub fn attach_registrar(
        &self,
        registrar: Arc<dyn Registrar>,
        on_failure: OnRegistrationFailure,
    ) -> Result<RegistrarId> {
        self.allocator.attach_registrar(registrar, on_failure)
    }

    /// Detaches a registrar, deregistering every region it holds; false if it was not attached.
    /// In a forked child it does nothing (the registrations are the parent's).
    pub fn detach_registrar(&self, id: RegistrarId) -> bool {
        self.allocator.detach_registrar(id)
    }

    /// The mapped regions that hold bytes `[addr, addr + len)` of `device`, with the bytes in
    /// each (several only in expandable segments, whose pages are regions of their own).
    pub fn registered_regions(
        &self,
        device: usize,
        addr: DeviceAddr,
        len: u64,
    ) -> Result<Vec<RegisteredRegion>> {
        self.allocator.registered_regions(device, addr, len)
    }

    /// The regions mapped now and each attached registrar's figures.
    pub fn registration_stats(&self) -> RegistrationStats {
        self.allocator.registration_stats()
    }

    // The driver and the checks.
    /// The driver underneath (a [`SanitizedDriver`](crate::backend::SanitizedDriver) when the sanitizer is on).
    pub fn driver(&self) -> &Arc<dyn Driver> {
        self.allocator.driver()
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.allocator.device_count()
    }

    /// The stream sanitizer checking this allocator's driver, when on.
    pub fn sanitizer(&self) -> Option<Arc<crate::driver::Sanitizer>> {
        self.allocator.sanitizer()
    }

    /// Makes `waiter` wait for the work queued on `waited` so far (an event recorded on `waited`
    /// and waited for on `waiter`; nothing when they are one stream).
    pub fn wait_stream(&self, waiter: StreamId, waited: StreamId) -> Result<()> {
        self.allocator.driver().stream_wait_stream(waiter, waited)
    }

    /// Blocks until the work queued on `stream` has run; a failed stream's error (a kernel's, a
    /// sanitizer report) is returned here.
    pub fn synchronize(&self, stream: StreamId) -> Result<()> {
        self.allocator.driver().stream_synchronize(stream)
    }

    /// The allocator's configuration in force (`CUDALLOC_CONF`'s keys; `Display` prints one
    /// `key: value` line each). [`Runtime::reconfigure`] publishes another; this one stays
    /// readable as it was.
    pub fn config(&self) -> Arc<crate::config::AllocatorConfig> {
        self.allocator.config()
    }

    /// Changes the settings named in `changes` (`CUDALLOC_CONF`'s grammar, e.g.
    /// `"garbage_collection_threshold:0.8"`) on this live runtime and keeps every other one
    /// (PyTorch's `_set_allocator_settings` resets the keys it is not given). A key that cannot
    /// change on a live runtime is an [`ErrorKind::Config`](crate::ErrorKind::Config) error naming
    /// it and why (`thread_cache_mb`, `default_stream`, `stream_order`, the IPC and pinned keys),
    /// and nothing changes. Returns the keys named. Refused in a forked child (before the
    /// configuration's writer lock, which a thread of the parent may have held at the fork).
    pub fn reconfigure(&self, changes: &str) -> Result<Vec<&'static str>> {
        self.allocator.reconfigure(changes)
    }

    /// [`Runtime::reconfigure`] for a scope: when the guard drops, the keys it changed get back
    /// the values they had (the others keep any change made meanwhile; a change of one of its
    /// keys meanwhile — by `reconfigure` or `set_per_process_memory_fraction` — is put back too).
    /// Refused in a forked child, where dropping a guard inherited from the parent restores
    /// nothing.
    pub fn override_config(&self, changes: &str) -> Result<crate::ConfigOverride<'_>> {
        self.allocator.override_config(changes)
    }

    /// Checks every invariant of the allocator's books (blocks, pools, stats, segments) now; the
    /// first violation found, described. For tests; [`RuntimeBuilder::check_invariants`](super::RuntimeBuilder::check_invariants)
    /// checks after every operation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.allocator.check_invariants()
    }
}
