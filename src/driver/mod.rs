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
//! # The core and the capabilities
//!
//! [`Driver`] is the core every backend has (30 methods): devices, whole segments, streams,
//! events, copies and memset, what a driver is made of ([`Driver::layer`]) and one accessor per
//! capability. The capabilities are traits of their own ([`capability`]): the small kernels,
//! stream interop, virtual memory, IPC, page-locked host memory, capture and graphs. A backend
//! implements the ones it has and returns itself from their accessors; one it lacks answers every
//! call with an error that names it. A wrapper (the sanitizer, a test's fault injector) implements
//! what it checks and forwards each other capability with one line (`fn ipc(&self) -> &dyn Ipc {
//! self.inner.ipc() }`). Calls read `driver.vm().vm_map(..)`, `driver.graphs().graph_launch(..)`,
//! `driver.kernels().fill_pattern(..)`.
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

pub(crate) mod access;
pub mod capability;
pub(crate) mod capture;
pub(crate) mod cuda;
pub(crate) mod host;
pub(crate) mod host_memory;
pub mod pattern;
mod ranges;
pub(crate) mod registry;
pub(crate) mod sanitizer;
pub(crate) mod sim;
pub(crate) mod vm_space;

use std::fmt;

pub(crate) use capability::{Graphs, Interop, Ipc, Kernels, Layer, PinnedHost, VirtualMemory};
pub use capture::{CaptureMode, CaptureStatus, GraphExecId, GraphId};
pub use cuda::CudaDriver;
pub use host::{HostDriver, HostDriverBuilder};
pub use host_memory::HostAddr;
pub use sanitizer::SanitizedDriver;
pub(crate) use sanitizer::{SanitizeOptions, Sanitizer};
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

/// An opaque stream id handed out by a [`Driver`]. It carries the driver that made it (bits
/// 48..64, a number per driver in this process) and its device (bits 36..48), so the allocator
/// finds a stream's device without asking the driver, and a stream of another runtime's driver is
/// refused by name instead of running on this runtime's stream of the same number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub(crate) u64);

/// Bits of a [`StreamId`] below its device (the driver's stream number).
const STREAM_DEVICE_SHIFT: u32 = 36;
/// Bits of a [`StreamId`] below its driver.
const STREAM_DRIVER_SHIFT: u32 = 48;

impl StreamId {
    /// The id of stream number `serial` on `device` made by the driver `driver` (drivers only).
    pub(crate) fn new(driver: DriverTag, device: usize, serial: u64) -> Result<StreamId> {
        let device = u64::try_from(device)
            .ok()
            .filter(|&d| d < 1 << (STREAM_DRIVER_SHIFT - STREAM_DEVICE_SHIFT))
            .ok_or_else(|| crate::Error::invalid(format!("device ordinal {device} too large")))?;
        if serial >= 1 << STREAM_DEVICE_SHIFT {
            return Err(crate::Error::invalid("stream numbers exhausted"));
        }
        Ok(StreamId(
            (u64::from(driver.0) << STREAM_DRIVER_SHIFT) | (device << STREAM_DEVICE_SHIFT) | serial,
        ))
    }

    /// The device the stream belongs to (no driver call; the driver still validates the stream
    /// whenever it is used).
    pub fn device(self) -> usize {
        ((self.0 >> STREAM_DEVICE_SHIFT) & ((1 << (STREAM_DRIVER_SHIFT - STREAM_DEVICE_SHIFT)) - 1))
            as usize
    }

    /// The stream's number among its driver's streams (for names in reports).
    pub(crate) fn serial(self) -> u64 {
        self.0 & ((1 << STREAM_DEVICE_SHIFT) - 1)
    }

    /// The driver that made the stream.
    pub(crate) fn driver(self) -> DriverTag {
        DriverTag((self.0 >> STREAM_DRIVER_SHIFT) as u16)
    }

    /// The error for a stream `mine` does not know: one naming both drivers when another driver
    /// made it, else `unknown` (destroyed, or never made).
    pub(crate) fn unknown_to(
        self,
        mine: DriverTag,
        unknown: impl FnOnce() -> crate::Error,
    ) -> crate::Error {
        let theirs = self.driver();
        if theirs == mine {
            return unknown();
        }
        crate::Error::invalid(format!(
            "stream {} of device {} belongs to another runtime's driver (driver #{}), not to this \
             runtime's (driver #{}): streams are used with the runtime that made or imported them",
            self.serial(),
            self.device(),
            theirs.0,
            mine.0
        ))
    }

    /// The raw id, for logs and snapshots.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A driver's number in this process, carried by each of its [`StreamId`]s: numbers 1 to 65,534
/// in order of creation, then again from 1 (two drivers 65,534 creations apart share one, and
/// only they are not told apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DriverTag(u16);

impl DriverTag {
    /// The next driver's number.
    pub(crate) fn fresh() -> DriverTag {
        use crate::sync::os::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // 1..=0xFFFE: never 0 (no driver) nor 0xFFFF (so no id is `u64::MAX`, the allocator's
        // "no stream").
        DriverTag((n % 0xFFFE) as u16 + 1)
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
    /// The event can be exported with [`Ipc::ipc_export_event`](capability::Ipc::ipc_export_event) and waited on by another process
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

/// Whether `stream` is gone: destroyed (or never made by `driver`), so nothing of it is left to
/// wait for. Stream ids are never reused by a driver, so a stream the driver does not know has no
/// work queued that anything could still wait for: the allocator's exits (`alloc/engine/handover.rs`)
/// and the storages' ordering (`storage/order.rs`) skip it.
pub(crate) fn stream_gone(driver: &dyn Driver, stream: StreamId) -> bool {
    driver.stream_device(stream).is_err()
}

/// Everything the allocator needs from a device (the ordering model: `src/driver/mod.rs`).
///
/// All methods validate their arguments: an unknown device, stream, event or pointer, a range that
/// leaves its segment, a size of 0 or one that overflows is an
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument).
pub trait Driver: Send + Sync + fmt::Debug {
    /// Which implementation this is.
    fn backend(&self) -> Backend;
    /// What this driver is made of: a backend, the host backend, or the stream sanitizer over
    /// another driver (`as_host`, `sanitizer` and `unsanitized` on `dyn Driver` read it).
    fn layer(&self) -> Layer<'_> {
        Layer::Backend
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

    // The raw memory operations below are `unsafe`: storages see memory as Rust slices in typed
    // host kernels (`storage/host_kernel.rs`) and order every access they know of; an address
    // reaches memory behind their backs. Each has one contract:
    //
    // # Safety (every raw memory operation)
    // The bytes the operation reads are not written, and the bytes it writes are not seen, by a
    // typed host kernel at the same time: the caller orders it with every such kernel on the same
    // bytes (a storage's own door — `data_ptr_on`, `mutable_data_ptr_on` — taken for the stream
    // right before does, under `stream_order:auto`). Out-of-range or freed addresses are errors,
    // never undefined behaviour: the contract is about ordering only.

    /// Copies `src` into device memory at `dst`, in `stream` order; returns when done.
    ///
    /// # Safety
    /// See the raw memory operations above.
    unsafe fn copy_host_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: &[u8],
    ) -> Result<()>;
    /// Copies device memory at `src` into `dst`, in `stream` order; returns when done.
    ///
    /// # Safety
    /// See the raw memory operations above.
    unsafe fn copy_device_to_host(
        &self,
        stream: StreamId,
        dst: &mut [u8],
        src: DeviceAddr,
    ) -> Result<()>;
    /// Enqueues a copy of `len` bytes from `src` to `dst` on `stream`.
    ///
    /// # Safety
    /// See the raw memory operations above.
    unsafe fn copy_device_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()>;
    /// Enqueues setting `len` bytes at `dst` to `value` on `stream`.
    ///
    /// # Safety
    /// See the raw memory operations above.
    unsafe fn memset(&self, stream: StreamId, dst: DeviceAddr, value: u8, len: u64) -> Result<()>;

    // The capabilities beyond the core (`capability.rs`): a backend implements the traits it has
    // and returns itself here; a wrapper forwards a capability it does not check with one line.
    // A capability a backend lacks answers every call with an error that says so.

    /// The small kernels of `kernels/` (fill, verify, poison, sleep).
    fn kernels(&self) -> &dyn Kernels {
        capability::absent(self.backend())
    }
    /// Streams shared with a library's own launches (import, raw handles).
    fn interop(&self) -> &dyn Interop {
        capability::absent(self.backend())
    }
    /// Virtual memory: reservations, chunks of physical memory, mappings (expandable segments).
    fn vm(&self) -> &dyn VirtualMemory {
        capability::absent(self.backend())
    }
    /// Memory and events shared with other processes (CUDA IPC handles).
    fn ipc(&self) -> &dyn Ipc {
        capability::absent(self.backend())
    }
    /// Page-locked host memory and the async copies from and to it.
    fn pinned(&self) -> &dyn PinnedHost {
        capability::absent(self.backend())
    }
    /// Stream capture and graphs.
    fn graphs(&self) -> &dyn Graphs {
        capability::absent(self.backend())
    }
}

/// The virtual-memory methods of [`Driver`], forwarded to a backend's inherent methods of the
/// same meaning (`granularity`, `reserve`, `free_reservation`, `create_chunk`, `release_chunk`,
/// `map`, `unmap`, `export_chunk`, `import_chunk`) — both backends implement them that way.
/// `forward_vm_methods!(door)` calls the backend's `door()` first in each (its fork check: a
/// forked child is refused before any lock, `process.rs`).
macro_rules! forward_vm_methods {
    ($($door:ident)?) => {
        fn vm_granularity(&self, device: usize) -> $crate::error::Result<u64> {
            $( self.$door()?; )?
            self.granularity(device)
        }

        fn vm_reserve(
            &self,
            device: usize,
            size: u64,
        ) -> $crate::error::Result<$crate::driver::DeviceAddr> {
            $( self.$door()?; )?
            self.reserve(device, size)
        }

        fn vm_free_reservation(
            &self,
            base: $crate::driver::DeviceAddr,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.free_reservation(base)
        }

        fn vm_create_chunk(
            &self,
            device: usize,
            size: u64,
        ) -> $crate::error::Result<$crate::driver::ChunkId> {
            $( self.$door()?; )?
            self.create_chunk(device, size)
        }

        fn vm_release_chunk(&self, chunk: $crate::driver::ChunkId) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.release_chunk(chunk)
        }

        fn vm_map(
            &self,
            addr: $crate::driver::DeviceAddr,
            chunk: $crate::driver::ChunkId,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.map(addr, chunk)
        }

        fn vm_unmap(
            &self,
            addr: $crate::driver::DeviceAddr,
            size: u64,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.unmap(addr, size)
        }

        fn vm_export_chunk(
            &self,
            chunk: $crate::driver::ChunkId,
        ) -> $crate::error::Result<$crate::driver::ExportedChunk> {
            $( self.$door()?; )?
            self.export_chunk(chunk)
        }

        fn vm_import_chunk(
            &self,
            device: usize,
            chunk: $crate::driver::ExportedChunk,
            size: u64,
        ) -> $crate::error::Result<$crate::driver::ChunkId> {
            $( self.$door()?; )?
            self.import_chunk(device, chunk, size)
        }
    };
}
pub(crate) use forward_vm_methods;

/// The capture and graph methods of [`Driver`], forwarded to a backend's inherent methods of the
/// same meaning (`begin_capture`, `end_capture`, `capture_status`, `exchange_mode`,
/// `instantiate_graph`, `launch_graph`, `destroy_graph`, `destroy_graph_exec`,
/// `graph_nodes`), each after the backend's `door()` when one is named, as for
/// `forward_vm_methods`.
macro_rules! forward_capture_methods {
    ($($door:ident)?) => {
        fn stream_begin_capture(
            &self,
            stream: $crate::driver::StreamId,
            mode: $crate::driver::CaptureMode,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.begin_capture(stream, mode)
        }
        fn stream_end_capture(
            &self,
            stream: $crate::driver::StreamId,
        ) -> $crate::error::Result<$crate::driver::GraphId> {
            $( self.$door()?; )?
            self.end_capture(stream)
        }
        fn stream_capture_status(
            &self,
            stream: $crate::driver::StreamId,
        ) -> $crate::error::Result<$crate::driver::CaptureStatus> {
            $( self.$door()?; )?
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
            $( self.$door()?; )?
            self.instantiate_graph(graph)
        }
        unsafe fn graph_launch(
            &self,
            exec: $crate::driver::GraphExecId,
            stream: $crate::driver::StreamId,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.launch_graph(exec, stream)
        }
        fn graph_destroy(&self, graph: $crate::driver::GraphId) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.destroy_graph(graph)
        }
        fn graph_exec_destroy(
            &self,
            exec: $crate::driver::GraphExecId,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.destroy_graph_exec(exec)
        }
        fn graph_node_count(&self, graph: $crate::driver::GraphId) -> $crate::error::Result<usize> {
            $( self.$door()?; )?
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
                driver: crate::sync::os::Arc::new(host::HostDriverBuilder::from_env()?.build()?),
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
