//! The capabilities of a [`Driver`] beyond its core: each a trait of its own, reached through the
//! driver's accessor of the same name (`driver.vm().vm_map(..)`). A backend implements the traits
//! it has and returns itself from their accessors; a wrapper (the stream sanitizer, a test's fault
//! injector) implements what it checks and forwards the rest with one line each
//! (`fn ipc(&self) -> &dyn Ipc { self.inner.ipc() }`). A capability a backend lacks is answered by
//! an absent capability: every call an error naming the backend and what it lacks, and no stream is ever
//! being captured.
//!
//! | capability | accessor | host | CUDA | simulated |
//! |---|---|---|---|---|
//! | [`Kernels`] (`kernels/*.cu`) | `kernels()` | yes | yes | yes (addresses only: no bytes) |
//! | [`Interop`] (import and raw stream handles) | `interop()` | yes | yes | yes |
//! | [`VirtualMemory`] (expandable segments) | `vm()` | yes | yes | yes |
//! | [`Ipc`] (handles for other processes) | `ipc()` | yes | yes | refused per call |
//! | [`PinnedHost`] (page-locked host memory) | `pinned()` | yes | yes | absent |
//! | [`Graphs`] (stream capture, graphs) | `graphs()` | yes | yes | absent |

use std::fmt;

use super::access::Touch;
use super::capture::{self, CaptureMode, CaptureStatus, GraphExecId, GraphId};
use super::host_memory::{self, HostAddr};
use super::{
    Backend, ChunkId, DeviceAddr, Driver, EventId, ExportedChunk, HostDriver, IpcEventHandle,
    IpcMemHandle, OpenedSegment, Sanitizer, StreamId,
};
use crate::error::{Error, Result};
use crate::sync::os::Arc;

/// What a driver is made of ([`Driver::layer`]).
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum Layer<'a> {
    /// A backend of its own (CUDA, simulated, or another implementation).
    Backend,
    /// The host backend.
    Host(&'a HostDriver),
    /// The stream sanitizer over another driver.
    Sanitized {
        /// The checker.
        sanitizer: &'a Arc<Sanitizer>,
        /// The driver it checks.
        inner: &'a Arc<dyn Driver>,
    },
}

impl fmt::Debug for Layer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layer::Backend => f.write_str("Backend"),
            Layer::Host(_) => f.write_str("Host"),
            Layer::Sanitized { inner, .. } => write!(f, "Sanitized({})", inner.backend()),
        }
    }
}

impl dyn Driver {
    /// This driver as the host backend (under a sanitizer too), for host-only facilities
    /// (`enqueue_host`, stream gates).
    pub fn as_host(&self) -> Option<&HostDriver> {
        match self.layer() {
            Layer::Host(host) => Some(host),
            Layer::Sanitized { inner, .. } => inner.as_host(),
            Layer::Backend => None,
        }
    }

    /// The stream sanitizer checking this driver, when it is a
    /// [`SanitizedDriver`](super::SanitizedDriver).
    pub fn sanitizer(&self) -> Option<Arc<Sanitizer>> {
        match self.layer() {
            Layer::Sanitized { sanitizer, .. } => Some(Arc::clone(sanitizer)),
            _ => None,
        }
    }

    /// The driver under a [`SanitizedDriver`](super::SanitizedDriver): for the allocator's own
    /// bookkeeping (the events of pending frees), whose waits must not count as the program's
    /// synchronization.
    pub fn unsanitized(&self) -> Option<Arc<dyn Driver>> {
        match self.layer() {
            Layer::Sanitized { inner, .. } => Some(Arc::clone(inner)),
            _ => None,
        }
    }
}

/// The small kernels of `kernels/`: a fill and a verify of byte patterns, poison, a sleep.
pub trait Kernels {
    /// Enqueues the fill kernel: byte `i` of the range becomes [`pattern::byte`](super::pattern::byte)`(seed, i)`.
    ///
    /// # Safety
    /// As the raw memory operations of [`Driver`](super::Driver) (`copy_device_to_device`): not
    /// at the same time as a typed host kernel that sees the same bytes.
    unsafe fn fill_pattern(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<()>;
    /// Runs the verify kernel on `stream` and returns how many bytes differ from the pattern.
    ///
    /// # Safety
    /// As the raw memory operations of [`Driver`](super::Driver) (`copy_device_to_device`): not
    /// at the same time as a typed host kernel that sees the same bytes.
    unsafe fn count_pattern_mismatches(
        &self,
        stream: StreamId,
        src: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<u64>;
    /// Enqueues the poison kernel: byte `i` of the range becomes [`pattern::poison_byte`](super::pattern::poison_byte)`(i)`.
    ///
    /// # Safety
    /// As the raw memory operations of [`Driver`](super::Driver) (`copy_device_to_device`): not
    /// at the same time as a typed host kernel that sees the same bytes.
    unsafe fn poison(&self, stream: StreamId, dst: DeviceAddr, len: u64) -> Result<()>;
    /// Enqueues a kernel that keeps `stream` busy for `micros` microseconds (`torch.cuda._sleep`).
    fn sleep(&self, stream: StreamId, micros: u64) -> Result<()>;
}

/// Streams shared with a library's own launches.
pub trait Interop {
    /// Adopts a stream the caller made, named by its raw handle: CUDA, its `CUstream`; host, the
    /// [`Interop::raw_stream`] of a stream this driver created. The caller keeps it alive;
    /// [`Driver::stream_destroy`] only forgets it, never destroys it. A stream of another device
    /// or context is an error.
    ///
    /// # Safety
    /// CUDA: `raw` must be a live `CUstream` and stay alive while this driver may use the id.
    unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId>;
    /// The raw handle of `stream` (CUDA: its `CUstream`, 0 for the legacy stream; host: its
    /// number), to hand to a library's own launches.
    fn raw_stream(&self, stream: StreamId) -> Result<u64>;
    /// Launches `function` — a kernel of a module the caller loaded in the context of `stream`'s
    /// device (CUDA: its `CUfunction`) — on `stream` with `dims`, `params` as `cuLaunchKernel`
    /// takes them; `touches` are the byte ranges it reads and writes, which a sanitized driver
    /// checks (`Runtime::launch` passes its operands). Backends without device code refuse it
    /// (the host backend runs host bodies: `Runtime::launch`).
    ///
    /// # Safety
    /// `function` must be a live kernel of that context; `params` must point at live values of
    /// the types and number the kernel declares; what the kernel touches must be memory the
    /// caller owns and orders on `stream`, all of it in `touches`.
    unsafe fn launch_function(
        &self,
        stream: StreamId,
        function: u64,
        dims: LaunchDims,
        params: &mut [*mut std::ffi::c_void],
        touches: &[Touch],
    ) -> Result<()>;
}

/// A launch's grid and block (CUDA's `gridDim`, `blockDim`) and its dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory per block (CUDA takes at most `u32::MAX`; more is an
    /// error at the launch).
    pub shared_bytes: u64,
}

impl LaunchDims {
    /// A one-dimensional grid of `block` threads per block covering `work` items, at most
    /// 65,535 blocks (for grid-stride loops): cudarc's `LaunchConfig::for_num_elems` in spirit.
    pub fn grid_stride(work: u64, block: u32) -> Self {
        let block = block.max(1);
        let blocks = work.div_ceil(u64::from(block)).clamp(1, 65_535) as u32;
        LaunchDims {
            grid: [blocks, 1, 1],
            block: [block, 1, 1],
            shared_bytes: 0,
        }
    }
}

/// Virtual memory (expandable segments). Sizes and offsets are multiples of the granularity.
/// Memory operations accept any range mapped throughout, across adjacent chunks.
pub trait VirtualMemory {
    /// The granularity of reservations, chunks and mappings on `device` (CUDA: the minimum of
    /// `cuMemGetAllocationGranularity`, 2 MiB on current GPUs; host: 2 MiB as well).
    fn vm_granularity(&self, device: usize) -> Result<u64>;
    /// Reserves `size` bytes of address space on `device` (no memory).
    fn vm_reserve(&self, device: usize, size: u64) -> Result<DeviceAddr>;
    /// Frees a reservation; nothing may be mapped in it.
    fn vm_free_reservation(&self, base: DeviceAddr) -> Result<()>;
    /// Creates a chunk of `size` bytes of physical memory on `device`, exportable as a file
    /// descriptor. Counts against the device's capacity: none left is out of memory.
    fn vm_create_chunk(&self, device: usize, size: u64) -> Result<ChunkId>;
    /// Releases a chunk; its memory goes when its last mapping is unmapped.
    fn vm_release_chunk(&self, chunk: ChunkId) -> Result<()>;
    /// Maps `chunk` read-write at `addr` inside a reservation of the chunk's device.
    fn vm_map(&self, addr: DeviceAddr, chunk: ChunkId) -> Result<()>;
    /// Unmaps whole chunks covering `[addr, addr + size)`, after queued work finishes.
    fn vm_unmap(&self, addr: DeviceAddr, size: u64) -> Result<()>;
    /// A file descriptor of `chunk` and the chunk's offset in it, for another process (to send
    /// with `SCM_RIGHTS`).
    fn vm_export_chunk(&self, chunk: ChunkId) -> Result<ExportedChunk>;
    /// A chunk from another process's descriptor, which must hold `size` bytes at the offset.
    fn vm_import_chunk(&self, device: usize, chunk: ExportedChunk, size: u64) -> Result<ChunkId>;
}

/// Memory and events shared with other processes.
pub trait Ipc {
    /// Exports the IPC handle of the segment whose base address is `ptr`.
    fn ipc_export_memory(&self, ptr: DeviceAddr) -> Result<IpcMemHandle>;
    /// Opens another process's segment on `device`. Opening in the exporting process, or opening the
    /// same handle twice without closing it, is an error (callers must cache).
    fn ipc_open_memory(&self, device: usize, handle: &IpcMemHandle) -> Result<OpenedSegment>;
    /// Closes a segment opened with [`Ipc::ipc_open_memory`]; waits for queued work first.
    fn ipc_close_memory(&self, ptr: DeviceAddr) -> Result<()>;
    /// Exports an interprocess event.
    fn ipc_export_event(&self, event: EventId) -> Result<IpcEventHandle>;
    /// Opens another process's interprocess event; destroy it with [`Driver::event_destroy`].
    fn ipc_open_event(&self, device: usize, handle: &IpcEventHandle) -> Result<EventId>;
}

/// Page-locked host memory (`host_memory.rs`).
pub trait PinnedHost {
    /// Allocates `size` bytes of page-locked host memory that every device's copies can use
    /// (CUDA: `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE`); contents unspecified.
    fn host_alloc(&self, size: u64) -> Result<HostAddr>;
    /// Frees memory from [`PinnedHost::host_alloc`]; waits for queued work first.
    ///
    /// # Safety
    /// No reference into the memory may outlive the call (it is unmapped).
    unsafe fn host_free(&self, ptr: HostAddr) -> Result<()>;
    /// Page-locks `[ptr, ptr + size)` of the caller's memory for the async copies (CUDA:
    /// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`). A range overlapping another
    /// registration or a [`PinnedHost::host_alloc`] is an error.
    ///
    /// # Safety
    /// The range must be memory of this process, readable and writable, that stays allocated
    /// until [`PinnedHost::host_unregister`] returns: the driver's streams read and write it.
    unsafe fn host_register(&self, ptr: HostAddr, size: u64) -> Result<()>;
    /// Ends the registration that starts at `ptr`; waits for queued work first.
    ///
    /// # Safety
    /// As [`PinnedHost::host_free`] for what the registration covered, when the caller frees it next.
    unsafe fn host_unregister(&self, ptr: HostAddr) -> Result<()>;
    /// Enqueues a copy of `len` bytes of page-locked host memory at `src` to `dst` on `stream`
    /// (the whole source inside one allocation or registration of this driver).
    ///
    /// # Safety
    /// The source bytes are read when the stream reaches the copy: until then no `&mut`
    /// reference to them may exist, and nothing may write them.
    unsafe fn copy_pinned_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: HostAddr,
        len: u64,
    ) -> Result<()>;
    /// Enqueues a copy of `len` bytes at `src` into page-locked host memory at `dst` on `stream`.
    ///
    /// # Safety
    /// The destination bytes are written when the stream reaches the copy: until then no
    /// reference to them may exist, and nothing may read or write them.
    unsafe fn copy_device_to_pinned(
        &self,
        stream: StreamId,
        dst: HostAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()>;
}

/// Stream capture and graphs (`capture.rs`).
pub trait Graphs {
    /// Begins capturing `stream` into a graph in `mode` (see `capture.rs`).
    fn stream_begin_capture(&self, stream: StreamId, mode: CaptureMode) -> Result<()>;
    /// Ends the capture begun on `stream` and returns its graph.
    fn stream_end_capture(&self, stream: StreamId) -> Result<GraphId>;
    /// Whether `stream` is being captured, and into which capture.
    fn stream_capture_status(&self, stream: StreamId) -> Result<CaptureStatus>;
    /// Sets the calling thread's capture interaction mode; returns the previous one.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> CaptureMode;
    /// Instantiates `graph` for launching.
    fn graph_instantiate(&self, graph: GraphId) -> Result<GraphExecId>;
    /// Enqueues a replay of `exec` on `stream`.
    ///
    /// # Safety
    /// The replay writes what its capture wrote, outside the storages' order: as the raw memory
    /// operations of [`Driver`](super::Driver), not at the same time as a typed host kernel
    /// that sees the same bytes. (The allocator's [`Graph::replay`](crate::graph::Graph::replay) is
    /// safe: while its graphs live, typed kernels see private copies.)
    unsafe fn graph_launch(&self, exec: GraphExecId, stream: StreamId) -> Result<()>;
    /// Destroys `graph` (its instantiations stay usable).
    fn graph_destroy(&self, graph: GraphId) -> Result<()>;
    /// Destroys an instantiated graph (replays already enqueued still run).
    fn graph_exec_destroy(&self, exec: GraphExecId) -> Result<()>;
    /// How many nodes `graph` holds.
    fn graph_node_count(&self, graph: GraphId) -> Result<usize>;
}

/// The answer of a backend to a capability it lacks: every call an error that names the backend
/// and what it lacks; no stream is ever being captured.
#[derive(Debug)]
pub(crate) struct Absent {
    backend: Backend,
}

static ABSENT: [Absent; 3] = [
    Absent {
        backend: Backend::Host,
    },
    Absent {
        backend: Backend::Cuda,
    },
    Absent {
        backend: Backend::Simulated,
    },
];

/// The [`Absent`] capability of `backend`.
pub(crate) fn absent(backend: Backend) -> &'static Absent {
    match backend {
        Backend::Host => &ABSENT[0],
        Backend::Cuda => &ABSENT[1],
        Backend::Simulated => &ABSENT[2],
    }
}

impl Absent {
    fn lacks(&self, what: &str) -> Error {
        Error::invalid(format!("the {} backend has no {what}", self.backend.name()))
    }
}

impl Kernels for Absent {
    unsafe fn fill_pattern(&self, _: StreamId, _: DeviceAddr, _: u64, _: u64) -> Result<()> {
        Err(self.lacks("kernels"))
    }
    unsafe fn count_pattern_mismatches(
        &self,
        _: StreamId,
        _: DeviceAddr,
        _: u64,
        _: u64,
    ) -> Result<u64> {
        Err(self.lacks("kernels"))
    }
    unsafe fn poison(&self, _: StreamId, _: DeviceAddr, _: u64) -> Result<()> {
        Err(self.lacks("kernels"))
    }
    fn sleep(&self, _: StreamId, _: u64) -> Result<()> {
        Err(self.lacks("kernels"))
    }
}

impl Interop for Absent {
    unsafe fn import_stream(&self, _: usize, _: u64) -> Result<StreamId> {
        Err(self.lacks("stream interop"))
    }
    fn raw_stream(&self, _: StreamId) -> Result<u64> {
        Err(self.lacks("stream interop"))
    }
    unsafe fn launch_function(
        &self,
        _: StreamId,
        _: u64,
        _: LaunchDims,
        _: &mut [*mut std::ffi::c_void],
        _: &[Touch],
    ) -> Result<()> {
        Err(self.lacks("stream interop"))
    }
}

impl VirtualMemory for Absent {
    fn vm_granularity(&self, _: usize) -> Result<u64> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_reserve(&self, _: usize, _: u64) -> Result<DeviceAddr> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_free_reservation(&self, _: DeviceAddr) -> Result<()> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_create_chunk(&self, _: usize, _: u64) -> Result<ChunkId> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_release_chunk(&self, _: ChunkId) -> Result<()> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_map(&self, _: DeviceAddr, _: ChunkId) -> Result<()> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_unmap(&self, _: DeviceAddr, _: u64) -> Result<()> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_export_chunk(&self, _: ChunkId) -> Result<ExportedChunk> {
        Err(self.lacks("virtual memory"))
    }
    fn vm_import_chunk(&self, _: usize, _: ExportedChunk, _: u64) -> Result<ChunkId> {
        Err(self.lacks("virtual memory"))
    }
}

impl Ipc for Absent {
    fn ipc_export_memory(&self, _: DeviceAddr) -> Result<IpcMemHandle> {
        Err(self.lacks("IPC"))
    }
    fn ipc_open_memory(&self, _: usize, _: &IpcMemHandle) -> Result<OpenedSegment> {
        Err(self.lacks("IPC"))
    }
    fn ipc_close_memory(&self, _: DeviceAddr) -> Result<()> {
        Err(self.lacks("IPC"))
    }
    fn ipc_export_event(&self, _: EventId) -> Result<IpcEventHandle> {
        Err(self.lacks("IPC"))
    }
    fn ipc_open_event(&self, _: usize, _: &IpcEventHandle) -> Result<EventId> {
        Err(self.lacks("IPC"))
    }
}

impl PinnedHost for Absent {
    fn host_alloc(&self, _: u64) -> Result<HostAddr> {
        Err(host_memory::unsupported(self.backend))
    }
    unsafe fn host_free(&self, _: HostAddr) -> Result<()> {
        Err(host_memory::unsupported(self.backend))
    }
    unsafe fn host_register(&self, _: HostAddr, _: u64) -> Result<()> {
        Err(host_memory::unsupported(self.backend))
    }
    unsafe fn host_unregister(&self, _: HostAddr) -> Result<()> {
        Err(host_memory::unsupported(self.backend))
    }
    unsafe fn copy_pinned_to_device(
        &self,
        _: StreamId,
        _: DeviceAddr,
        _: HostAddr,
        _: u64,
    ) -> Result<()> {
        Err(host_memory::unsupported(self.backend))
    }
    unsafe fn copy_device_to_pinned(
        &self,
        _: StreamId,
        _: HostAddr,
        _: DeviceAddr,
        _: u64,
    ) -> Result<()> {
        Err(host_memory::unsupported(self.backend))
    }
}

impl Graphs for Absent {
    fn stream_begin_capture(&self, _: StreamId, _: CaptureMode) -> Result<()> {
        Err(capture::unsupported(self.backend))
    }
    fn stream_end_capture(&self, _: StreamId) -> Result<GraphId> {
        Err(capture::unsupported(self.backend))
    }
    fn stream_capture_status(&self, _: StreamId) -> Result<CaptureStatus> {
        Ok(CaptureStatus::None)
    }
    fn exchange_capture_mode(&self, _: CaptureMode) -> CaptureMode {
        CaptureMode::Global
    }
    fn graph_instantiate(&self, _: GraphId) -> Result<GraphExecId> {
        Err(capture::unsupported(self.backend))
    }
    unsafe fn graph_launch(&self, _: GraphExecId, _: StreamId) -> Result<()> {
        Err(capture::unsupported(self.backend))
    }
    fn graph_destroy(&self, _: GraphId) -> Result<()> {
        Err(capture::unsupported(self.backend))
    }
    fn graph_exec_destroy(&self, _: GraphExecId) -> Result<()> {
        Err(capture::unsupported(self.backend))
    }
    fn graph_node_count(&self, _: GraphId) -> Result<usize> {
        Err(capture::unsupported(self.backend))
    }
}

/// The accessors of the capabilities a driver implements itself, inside its `impl Driver`:
/// `own_capabilities!(kernels, interop, vm)` returns the driver from each one named.
macro_rules! own_capabilities {
    ($($accessor:ident),* $(,)?) => {
        $( $crate::driver::capability::own_capabilities!(@one $accessor); )*
    };
    (@one kernels) => {
        fn kernels(&self) -> &dyn $crate::driver::Kernels {
            self
        }
    };
    (@one interop) => {
        fn interop(&self) -> &dyn $crate::driver::Interop {
            self
        }
    };
    (@one vm) => {
        fn vm(&self) -> &dyn $crate::driver::VirtualMemory {
            self
        }
    };
    (@one ipc) => {
        fn ipc(&self) -> &dyn $crate::driver::Ipc {
            self
        }
    };
    (@one pinned) => {
        fn pinned(&self) -> &dyn $crate::driver::PinnedHost {
            self
        }
    };
    (@one graphs) => {
        fn graphs(&self) -> &dyn $crate::driver::Graphs {
            self
        }
    };
}
pub(crate) use own_capabilities;

/// Runs `f` with this thread's capture interaction mode relaxed, restored after (also when `f`
/// panics): calls a capture of this thread (or another thread's global one) would prohibit —
/// allocating a segment, a host wait for work outside the capture, instantiating a graph — are
/// the allocator's own and safe to make from here. PyTorch makes its allocations during captures
/// the same way.
pub(crate) fn relaxed<R>(graphs: &dyn Graphs, f: impl FnOnce() -> R) -> R {
    struct Restore<'a> {
        graphs: &'a dyn Graphs,
        mode: CaptureMode,
    }
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            self.graphs.exchange_capture_mode(self.mode);
        }
    }
    let _restore = Restore {
        graphs,
        mode: graphs.exchange_capture_mode(CaptureMode::Relaxed),
    };
    f()
}
