//! The device layer: everything the allocator needs from a device, and nothing more.
//!
//! [`Driver`] is implemented twice with the same observable semantics:
//!
//! * [`HostDriver`] — always available, the backend of every test and of CI. Segments are POSIX
//!   shared-memory objects that another process really opens, streams are worker threads that run
//!   their queues in order, events live in shared memory so another process can wait on them. It is
//!   strict where CUDA is strict and louder where CUDA is silent (see [`host`]).
//! * [`CudaDriver`] — the CUDA driver API through `cudarc`, loaded at run time. Built everywhere;
//!   construction fails with [`Error::NoCudaDriver`](crate::Error::NoCudaDriver) where `libcuda` is
//!   absent, so no entry point can ever reach a missing library.
//!
//! [`SanitizedDriver`] wraps any of them (and [`SimDriver`]) for the stream sanitizer
//! ([`sanitizer`]): every stream operation is checked against the happens-before order of the
//! program's streams before it is enqueued.
//!
//! # Handles
//!
//! Streams and events are opaque ids ([`StreamId`], [`EventId`]) that index the driver's own tables;
//! they are never raw CUDA pointers, so an id the driver did not hand out (or already destroyed) is an
//! [`Error::InvalidArgument`](crate::Error::InvalidArgument), not undefined behaviour. Device memory is
//! a [`DeviceAddr`]: an address in the device's space that the caller never dereferences; all access goes
//! through the driver, which checks that the whole range lies in a segment it knows.
//!
//! # Ordering model
//!
//! | operation                         | returns                         |
//! |-----------------------------------|---------------------------------|
//! | `copy_device_to_device`, `memset`, kernels, `event_record`, `stream_wait_event` | at once (enqueued) |
//! | `copy_host_to_device`, `copy_device_to_host` (pageable memory), `count_pattern_mismatches` | when that work is done (stream-ordered, like an async copy followed by a stream synchronize) |
//! | `copy_pinned_to_device`, `copy_device_to_pinned` (page-locked memory, `host_memory.rs`) | at once (enqueued) |
//! | `free`, `ipc_close_memory`        | after every stream of the driver drained (CUDA's `cuMemFree` synchronizes too) |
//!
//! Every stream — the per-device default stream included — is independent: there is no legacy
//! default stream that implicitly serializes with others. The CUDA backend uses non-blocking streams
//! for the same reason.

pub mod capture;
pub mod cuda;
pub mod host;
pub mod host_memory;
pub mod pattern;
mod ranges;
pub(crate) mod registry;
pub mod sanitizer;
pub mod sim;
pub(crate) mod vm_space;

use std::fmt;

pub use capture::{CaptureMode, CaptureStatus, GraphExecId, GraphId};
pub use cuda::CudaDriver;
pub use host::{HostDriver, HostDriverBuilder};
pub use host_memory::HostAddr;
pub use sanitizer::{SanitizeOptions, SanitizedDriver, Sanitizer};
pub use sim::SimDriver;

use crate::error::Result;

/// Size in bytes of a CUDA IPC memory or event handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_SIZE: usize = 64;

/// An address in a device's memory. Never dereferenced by the host; only passed to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceAddr(pub u64);

impl DeviceAddr {
    /// The address `bytes` past this one, or an error if that overflows.
    pub fn offset(self, bytes: u64) -> Result<DeviceAddr> {
        self.0.checked_add(bytes).map(DeviceAddr).ok_or_else(|| {
            crate::Error::invalid(format!("device pointer {:#x} + {bytes} overflows", self.0))
        })
    }
}

impl fmt::Display for DeviceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A chunk of physical device memory made or imported through a driver's virtual-memory API
/// (expandable segments).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkId(pub(crate) u64);

/// A chunk as handed to another process: a descriptor (sent with `SCM_RIGHTS`) and where the chunk
/// starts in the memory it names — 0 on CUDA (one descriptor per chunk); the host backend keeps
/// many chunks in one memfd, so the descriptor limit is not the device's (`shm/vm.rs`).
#[derive(Debug)]
pub struct ExportedChunk {
    /// The descriptor.
    pub fd: std::os::fd::OwnedFd,
    /// Offset of the chunk's first byte in the descriptor's memory.
    pub offset: u64,
}

/// An opaque stream id handed out by a [`Driver`]. It carries its device (bits 48..64) so the
/// allocator finds a stream's device without asking the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub(crate) u64);

/// Bits of a [`StreamId`] below its device.
const STREAM_DEVICE_SHIFT: u32 = 48;

impl StreamId {
    /// The id of a driver's stream number `serial` on `device` (drivers only).
    pub(crate) fn new(device: usize, serial: u64) -> Result<StreamId> {
        let device = u64::try_from(device)
            .ok()
            .filter(|&d| d < 1 << (64 - STREAM_DEVICE_SHIFT))
            .ok_or_else(|| crate::Error::invalid(format!("device ordinal {device} too large")))?;
        if serial >= 1 << STREAM_DEVICE_SHIFT {
            return Err(crate::Error::invalid("stream numbers exhausted"));
        }
        Ok(StreamId((device << STREAM_DEVICE_SHIFT) | serial))
    }

    /// The device the stream belongs to (no driver call; the driver still validates the stream
    /// whenever it is used).
    pub fn device(self) -> usize {
        (self.0 >> STREAM_DEVICE_SHIFT) as usize
    }

    /// The raw id, for logs and snapshots.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// An opaque event id handed out by a [`Driver`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub(crate) u64);

impl EventId {
    /// The raw id, for logs.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// Which implementation a driver is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum Backend {
    /// [`HostDriver`].
    Host,
    /// [`CudaDriver`].
    Cuda,
    /// [`SimDriver`]: a simulated device that backs nothing (replays).
    Simulated,
}

impl Backend {
    /// `"host"`, `"cuda"` or `"simulated"`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "cuda",
            Backend::Simulated => "simulated",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Free and total bytes of a device, as `cuMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemInfo {
    /// Bytes the driver could still hand out.
    pub free: u64,
    /// The device's capacity.
    pub total: u64,
}

impl MemInfo {
    /// `free` of `total` bytes (what a driver of one's own reports).
    pub fn new(free: u64, total: u64) -> Self {
        MemInfo { free, total }
    }
}

/// How an event is created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventFlags {
    /// The event can be exported with [`Driver::ipc_export_event`] and waited on by another process
    /// (CUDA: `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`).
    pub interprocess: bool,
}

/// A segment's 64-byte IPC memory handle: names the whole segment, never an interior pointer.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; IPC_HANDLE_SIZE]);

/// An interprocess event's 64-byte IPC handle.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle(pub [u8; IPC_HANDLE_SIZE]);

macro_rules! debug_as_hex {
    ($ty:ident) => {
        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($ty), "("))?;
                for byte in &self.0 {
                    write!(f, "{byte:02x}")?;
                }
                write!(f, ")")
            }
        }
    };
}
debug_as_hex!(IpcMemHandle);
debug_as_hex!(IpcEventHandle);

/// A segment opened from another process's [`IpcMemHandle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenedSegment {
    /// Base address of the whole segment in this process.
    pub ptr: DeviceAddr,
    /// Size of the whole segment in bytes.
    pub size: u64,
}

/// Everything the allocator needs from a device (the ordering model: `src/driver/mod.rs`).
///
/// All methods validate their arguments: an unknown device, stream, event or pointer, a range that
/// leaves its segment, a size of 0 or one that overflows is an
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument).
pub trait Driver: Send + Sync + fmt::Debug {
    /// Which implementation this is.
    fn backend(&self) -> Backend;
    /// This driver as the host backend, for host-only facilities (`enqueue_host`, stream gates).
    fn as_host(&self) -> Option<&HostDriver> {
        None
    }
    /// The stream sanitizer checking this driver, when it is a [`SanitizedDriver`].
    fn sanitizer(&self) -> Option<crate::sync::os::Arc<Sanitizer>> {
        None
    }
    /// The driver under a [`SanitizedDriver`]: for the allocator's own bookkeeping (the events
    /// of pending frees), whose waits must not count as the program's synchronization.
    fn unsanitized(&self) -> Option<crate::sync::os::Arc<dyn Driver>> {
        None
    }
    /// Number of devices.
    fn device_count(&self) -> usize;
    /// A human-readable device name.
    fn device_name(&self, device: usize) -> Result<String>;
    /// Free and total memory of `device`.
    fn mem_info(&self, device: usize) -> Result<MemInfo>;

    /// Allocates a whole segment of `size` bytes on `device` (aligned to at least 512 bytes).
    fn malloc(&self, device: usize, size: u64) -> Result<DeviceAddr>;
    /// Frees a segment returned by [`Driver::malloc`]; waits for all queued work first.
    fn free(&self, ptr: DeviceAddr) -> Result<()>;

    /// The device's default stream, never destroyed: CUDA's legacy NULL stream (what a library
    /// launching without a stream uses); the host backend's own stream of the device.
    fn default_stream(&self, device: usize) -> Result<StreamId>;
    /// Adopts a stream the caller made, named by its raw handle: CUDA, its `CUstream`; host, the
    /// [`Driver::raw_stream`] of a stream this driver created. The caller keeps it alive;
    /// [`Driver::stream_destroy`] only forgets it, never destroys it. A stream of another device
    /// or context is an error.
    ///
    /// # Safety
    /// CUDA: `raw` must be a live `CUstream` and stay alive while this driver may use the id.
    unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId>;
    /// The raw handle of `stream` (CUDA: its `CUstream`, 0 for the legacy stream; host: its
    /// number), to hand to a library's own launches.
    fn raw_stream(&self, stream: StreamId) -> Result<u64>;
    /// Creates a stream on `device`.
    fn stream_create(&self, device: usize) -> Result<StreamId>;
    /// Destroys a stream after its queued work completes (an imported stream is only forgotten).
    /// The default stream cannot be destroyed.
    fn stream_destroy(&self, stream: StreamId) -> Result<()>;
    /// Blocks until all work queued on `stream` is done.
    fn stream_synchronize(&self, stream: StreamId) -> Result<()>;
    /// Whether all work queued on `stream` is done.
    fn stream_query(&self, stream: StreamId) -> Result<bool>;
    /// The device a stream belongs to.
    fn stream_device(&self, stream: StreamId) -> Result<usize>;

    /// Creates an event on `device`.
    fn event_create(&self, device: usize, flags: EventFlags) -> Result<EventId>;
    /// Destroys an event (created or opened from a handle).
    fn event_destroy(&self, event: EventId) -> Result<()>;
    /// Captures the work queued on `stream` so far; the event completes when that work has.
    fn event_record(&self, event: EventId, stream: StreamId) -> Result<()>;
    /// Whether the event's latest record has completed (true if never recorded).
    fn event_query(&self, event: EventId) -> Result<bool>;
    /// Blocks until the event's latest record has completed.
    fn event_synchronize(&self, event: EventId) -> Result<()>;
    /// Makes future work on `stream` wait for the event's latest record (as of this call).
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()>;
    /// Makes future work on `waiter` wait for the work queued on `waited` so far (an event made,
    /// recorded on `waited`, waited on by `waiter` and destroyed). Nothing when they are one stream.
    fn stream_wait_stream(&self, waiter: StreamId, waited: StreamId) -> Result<()> {
        if waiter == waited {
            return Ok(());
        }
        let event = self.event_create(waited.device(), EventFlags::default())?;
        let ordered = self
            .event_record(event, waited)
            .and_then(|()| self.stream_wait_event(waiter, event));
        let destroyed = self.event_destroy(event);
        ordered.and(destroyed)
    }

    /// Copies `src` into device memory at `dst`, in `stream` order; returns when done.
    fn copy_host_to_device(&self, stream: StreamId, dst: DeviceAddr, src: &[u8]) -> Result<()>;
    /// Copies device memory at `src` into `dst`, in `stream` order; returns when done.
    fn copy_device_to_host(&self, stream: StreamId, dst: &mut [u8], src: DeviceAddr) -> Result<()>;
    /// Enqueues a copy of `len` bytes from `src` to `dst` on `stream`.
    fn copy_device_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()>;
    /// Enqueues setting `len` bytes at `dst` to `value` on `stream`.
    fn memset(&self, stream: StreamId, dst: DeviceAddr, value: u8, len: u64) -> Result<()>;

    /// Enqueues the fill kernel: byte `i` of the range becomes [`pattern::byte`]`(seed, i)`.
    fn fill_pattern(&self, stream: StreamId, dst: DeviceAddr, len: u64, seed: u64) -> Result<()>;
    /// Runs the verify kernel on `stream` and returns how many bytes differ from the pattern.
    fn count_pattern_mismatches(
        &self,
        stream: StreamId,
        src: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<u64>;
    /// Enqueues the poison kernel: byte `i` of the range becomes [`pattern::poison_byte`]`(i)`.
    fn poison(&self, stream: StreamId, dst: DeviceAddr, len: u64) -> Result<()>;
    /// Enqueues a kernel that keeps `stream` busy for `micros` microseconds (`torch.cuda._sleep`).
    fn sleep(&self, stream: StreamId, micros: u64) -> Result<()>;

    /// Exports the IPC handle of the segment whose base address is `ptr`.
    fn ipc_export_memory(&self, ptr: DeviceAddr) -> Result<IpcMemHandle>;
    /// Opens another process's segment on `device`. Opening in the exporting process, or opening the
    /// same handle twice without closing it, is an error (callers must cache).
    fn ipc_open_memory(&self, device: usize, handle: &IpcMemHandle) -> Result<OpenedSegment>;
    /// Closes a segment opened with [`Driver::ipc_open_memory`]; waits for queued work first.
    fn ipc_close_memory(&self, ptr: DeviceAddr) -> Result<()>;
    /// Exports an interprocess event.
    fn ipc_export_event(&self, event: EventId) -> Result<IpcEventHandle>;
    /// Opens another process's interprocess event; destroy it with [`Driver::event_destroy`].
    fn ipc_open_event(&self, device: usize, handle: &IpcEventHandle) -> Result<EventId>;

    // Page-locked host memory (`host_memory.rs`). A backend without it says so on every call.

    /// Allocates `size` bytes of page-locked host memory that every device's copies can use
    /// (CUDA: `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE`); contents unspecified.
    fn host_alloc(&self, size: u64) -> Result<HostAddr> {
        let _ = size;
        Err(host_memory::unsupported(self.backend()))
    }
    /// Frees memory from [`Driver::host_alloc`]; waits for queued work first.
    ///
    /// # Safety
    /// No reference into the memory may outlive the call (it is unmapped).
    unsafe fn host_free(&self, ptr: HostAddr) -> Result<()> {
        let _ = ptr;
        Err(host_memory::unsupported(self.backend()))
    }
    /// Page-locks `[ptr, ptr + size)` of the caller's memory for the async copies (CUDA:
    /// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`). A range overlapping another
    /// registration or a [`Driver::host_alloc`] is an error.
    ///
    /// # Safety
    /// The range must be memory of this process, readable and writable, that stays allocated
    /// until [`Driver::host_unregister`] returns: the driver's streams read and write it.
    unsafe fn host_register(&self, ptr: HostAddr, size: u64) -> Result<()> {
        let _ = (ptr, size);
        Err(host_memory::unsupported(self.backend()))
    }
    /// Ends the registration that starts at `ptr`; waits for queued work first.
    ///
    /// # Safety
    /// As [`Driver::host_free`] for what the registration covered, when the caller frees it next.
    unsafe fn host_unregister(&self, ptr: HostAddr) -> Result<()> {
        let _ = ptr;
        Err(host_memory::unsupported(self.backend()))
    }
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
    ) -> Result<()> {
        let _ = (stream, dst, src, len);
        Err(host_memory::unsupported(self.backend()))
    }
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
    ) -> Result<()> {
        let _ = (stream, dst, src, len);
        Err(host_memory::unsupported(self.backend()))
    }

    // Virtual memory (expandable segments). Sizes and offsets are multiples of the granularity.
    // Memory operations accept any range mapped throughout, across adjacent chunks.

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

    // Stream capture and graphs (`capture.rs`). A backend without them says so: beginning a
    // capture is an error, and no stream is ever capturing.

    /// Begins capturing `stream` into a graph in `mode` (see `capture.rs`).
    fn stream_begin_capture(&self, stream: StreamId, mode: CaptureMode) -> Result<()> {
        let _ = (stream, mode);
        Err(capture::unsupported(self.backend()))
    }
    /// Ends the capture begun on `stream` and returns its graph.
    fn stream_end_capture(&self, stream: StreamId) -> Result<GraphId> {
        let _ = stream;
        Err(capture::unsupported(self.backend()))
    }
    /// Whether `stream` is being captured, and into which capture.
    fn stream_capture_status(&self, stream: StreamId) -> Result<CaptureStatus> {
        let _ = stream;
        Ok(CaptureStatus::None)
    }
    /// Sets the calling thread's capture interaction mode; returns the previous one.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> CaptureMode {
        let _ = mode;
        CaptureMode::Global
    }
    /// Instantiates `graph` for launching.
    fn graph_instantiate(&self, graph: GraphId) -> Result<GraphExecId> {
        let _ = graph;
        Err(capture::unsupported(self.backend()))
    }
    /// Enqueues a replay of `exec` on `stream`.
    fn graph_launch(&self, exec: GraphExecId, stream: StreamId) -> Result<()> {
        let _ = (exec, stream);
        Err(capture::unsupported(self.backend()))
    }
    /// Destroys `graph` (its instantiations stay usable).
    fn graph_destroy(&self, graph: GraphId) -> Result<()> {
        let _ = graph;
        Err(capture::unsupported(self.backend()))
    }
    /// Destroys an instantiated graph (replays already enqueued still run).
    fn graph_exec_destroy(&self, exec: GraphExecId) -> Result<()> {
        let _ = exec;
        Err(capture::unsupported(self.backend()))
    }
    /// How many nodes `graph` holds.
    fn graph_node_count(&self, graph: GraphId) -> Result<usize> {
        let _ = graph;
        Err(capture::unsupported(self.backend()))
    }
}

/// The virtual-memory methods of [`Driver`], forwarded to a backend's inherent methods of the
/// same meaning (`granularity`, `reserve`, `free_reservation`, `create_chunk`, `release_chunk`,
/// `map`, `unmap`, `export_chunk`, `import_chunk`) — both backends implement them that way.
macro_rules! forward_vm_methods {
    () => {
        fn vm_granularity(&self, device: usize) -> $crate::error::Result<u64> {
            self.granularity(device)
        }

        fn vm_reserve(
            &self,
            device: usize,
            size: u64,
        ) -> $crate::error::Result<$crate::driver::DeviceAddr> {
            self.reserve(device, size)
        }

        fn vm_free_reservation(
            &self,
            base: $crate::driver::DeviceAddr,
        ) -> $crate::error::Result<()> {
            self.free_reservation(base)
        }

        fn vm_create_chunk(
            &self,
            device: usize,
            size: u64,
        ) -> $crate::error::Result<$crate::driver::ChunkId> {
            self.create_chunk(device, size)
        }

        fn vm_release_chunk(&self, chunk: $crate::driver::ChunkId) -> $crate::error::Result<()> {
            self.release_chunk(chunk)
        }

        fn vm_map(
            &self,
            addr: $crate::driver::DeviceAddr,
            chunk: $crate::driver::ChunkId,
        ) -> $crate::error::Result<()> {
            self.map(addr, chunk)
        }

        fn vm_unmap(
            &self,
            addr: $crate::driver::DeviceAddr,
            size: u64,
        ) -> $crate::error::Result<()> {
            self.unmap(addr, size)
        }

        fn vm_export_chunk(
            &self,
            chunk: $crate::driver::ChunkId,
        ) -> $crate::error::Result<$crate::driver::ExportedChunk> {
            self.export_chunk(chunk)
        }

        fn vm_import_chunk(
            &self,
            device: usize,
            chunk: $crate::driver::ExportedChunk,
            size: u64,
        ) -> $crate::error::Result<$crate::driver::ChunkId> {
            self.import_chunk(device, chunk, size)
        }
    };
}
pub(crate) use forward_vm_methods;

/// The capture and graph methods of [`Driver`], forwarded to a backend's inherent methods of the
/// same meaning (`begin_capture`, `end_capture`, `capture_status`, `exchange_mode`,
/// `instantiate_graph`, `launch_graph`, `destroy_graph`, `destroy_graph_exec`,
/// `graph_nodes`).
macro_rules! forward_capture_methods {
    () => {
        fn stream_begin_capture(
            &self,
            stream: $crate::driver::StreamId,
            mode: $crate::driver::CaptureMode,
        ) -> $crate::error::Result<()> {
            self.begin_capture(stream, mode)
        }
        fn stream_end_capture(
            &self,
            stream: $crate::driver::StreamId,
        ) -> $crate::error::Result<$crate::driver::GraphId> {
            self.end_capture(stream)
        }
        fn stream_capture_status(
            &self,
            stream: $crate::driver::StreamId,
        ) -> $crate::error::Result<$crate::driver::CaptureStatus> {
            self.capture_status(stream)
        }
        fn exchange_capture_mode(
            &self,
            mode: $crate::driver::CaptureMode,
        ) -> $crate::driver::CaptureMode {
            self.exchange_mode(mode)
        }
        fn graph_instantiate(
            &self,
            graph: $crate::driver::GraphId,
        ) -> $crate::error::Result<$crate::driver::GraphExecId> {
            self.instantiate_graph(graph)
        }
        fn graph_launch(
            &self,
            exec: $crate::driver::GraphExecId,
            stream: $crate::driver::StreamId,
        ) -> $crate::error::Result<()> {
            self.launch_graph(exec, stream)
        }
        fn graph_destroy(&self, graph: $crate::driver::GraphId) -> $crate::error::Result<()> {
            self.destroy_graph(graph)
        }
        fn graph_exec_destroy(
            &self,
            exec: $crate::driver::GraphExecId,
        ) -> $crate::error::Result<()> {
            self.destroy_graph_exec(exec)
        }
        fn graph_node_count(&self, graph: $crate::driver::GraphId) -> $crate::error::Result<usize> {
            self.graph_nodes(graph)
        }
    };
}
pub(crate) use forward_capture_methods;

/// Which backend to use, from `CUDALLOC_BACKEND` (`auto`, `cuda`, `host`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendChoice {
    /// CUDA when a driver and a device are present, else host.
    #[default]
    Auto,
    /// CUDA or an error.
    Cuda,
    /// The host backend.
    Host,
}

impl std::str::FromStr for BackendChoice {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "auto" | "" => Ok(BackendChoice::Auto),
            "cuda" => Ok(BackendChoice::Cuda),
            "host" => Ok(BackendChoice::Host),
            other => Err(crate::Error::Config(format!(
                "{other:?} is not a backend; valid values: auto, cuda, host"
            ))),
        }
    }
}

impl BackendChoice {
    /// `"auto"`, `"cuda"` or `"host"` (what `CUDALLOC_BACKEND` takes).
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cuda => "cuda",
            BackendChoice::Host => "host",
        }
    }

    /// Reads `CUDALLOC_BACKEND` (unset means `auto`).
    pub fn from_env() -> Result<Self> {
        match std::env::var("CUDALLOC_BACKEND") {
            Ok(value) => value.parse().map_err(|err| match err {
                crate::Error::Config(message) => {
                    crate::Error::Config(format!("CUDALLOC_BACKEND: {message}"))
                }
                other => other,
            }),
            Err(std::env::VarError::NotPresent) => Ok(BackendChoice::Auto),
            Err(std::env::VarError::NotUnicode(_)) => Err(crate::Error::Config(
                "CUDALLOC_BACKEND is not valid UTF-8".into(),
            )),
        }
    }

    /// Opens the chosen backend. With `Auto`, the result says why CUDA was not used (also logged).
    pub fn open(self) -> Result<SelectedBackend> {
        let host = |reason: Option<String>| -> Result<SelectedBackend> {
            Ok(SelectedBackend {
                driver: crate::sync::os::Arc::new(HostDriver::from_env()?),
                fallback_reason: reason,
            })
        };
        match self {
            BackendChoice::Host => host(None),
            BackendChoice::Cuda => Ok(SelectedBackend {
                driver: crate::sync::os::Arc::new(CudaDriver::new()?),
                fallback_reason: None,
            }),
            BackendChoice::Auto => match CudaDriver::new() {
                Ok(cuda) => {
                    tracing::info!(devices = cuda.device_count(), "cudalloc backend: cuda");
                    Ok(SelectedBackend {
                        driver: crate::sync::os::Arc::new(cuda),
                        fallback_reason: None,
                    })
                }
                Err(err) => {
                    tracing::warn!(reason = %err, "cudalloc backend: host, because the CUDA backend is unavailable");
                    host(Some(err.to_string()))
                }
            },
        }
    }
}

/// The driver a [`BackendChoice`] opened.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SelectedBackend {
    /// The driver.
    pub driver: crate::sync::os::Arc<dyn Driver>,
    /// With `auto`, why the CUDA backend was not used.
    pub fallback_reason: Option<String>,
}
