//! `CudaDriver`: the [`Driver`] trait on the CUDA driver API, through `cudarc` (the only module that
//! names it).
//!
//! * Loaded at run time (`dynamic-loading`): the crate builds and runs on machines without CUDA.
//!   [`CudaDriver::new`] checks `is_culib_present()` before the first driver call and returns
//!   [`Error::NoCudaDriver`] when `libcuda` or a device is missing, so no other entry point can be
//!   reached without a driver.
//! * Every call binds the device's primary context on the calling thread first (`cuCtxSetCurrent`
//!   is thread-local and cheap), so any thread may use any device.
//! * Segments come from `cuMemAlloc` (memory from `cuMemAllocAsync` pools cannot be exported through
//!   `cuIpcGetMemHandle`). Streams cudalloc creates are `CU_STREAM_NON_BLOCKING`; the default stream
//!   is the legacy NULL stream, so work a library launches without a stream is ordered with it (the
//!   allocator's `default_stream` setting can choose per-thread or dedicated streams instead).
//! * A library's own streams are adopted with `import_stream` (checked to belong to the device's
//!   primary context with `cuStreamGetCtx`) and never destroyed by cudalloc; `raw_stream` gives
//!   any stream's `CUstream` back.
//! * Interprocess events are created with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`.
//! * Streams, events and segments live in tables, like the host backend's: ids and pointers the
//!   driver did not hand out are rejected before reaching CUDA. A driver refuses to open one
//!   handle twice (callers cache); across the drivers of a process, `process_ipc.rs` keeps CUDA's
//!   per-process rules: a handle exported here is refused, and a handle is mapped once per device
//!   and shared by every driver that opens it.
//! * Kernels are compiled from `kernels/*.cu` with NVRTC on first use (`kernels.rs`). The 8-byte
//!   counters of `count_pattern_mismatches` are slots of one page per device, made by the first
//!   count and freed when the driver drops ([`COUNTER_SLOTS`] concurrent counts per device): a
//!   free per call would synchronize the device, which a capture anywhere on it forbids.
//!   `mem_info` counts what that page took of free memory (measured when it was made) as free —
//!   it is the driver's scratch, fixed for its life — so free memory returns to where it was once
//!   everything allocated through the driver is gone.
//! * Stream capture and graphs: `capture.rs` (CUDA enforces the prohibitions; its capture codes
//!   are `StreamCapture` errors).

mod capture;
mod host_memory;
pub mod kernels;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
mod process_ipc;
mod vm;

use crate::driver::Ipc;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_void, CStr, CString};

use cudarc::driver::sys::{self, CUresult};

use crate::driver::registry::{IdCounter, Registry};
use crate::driver::vm_space::VmSpace;
use crate::driver::{ranges, ChunkId, DeviceAddr, EventId, StreamId, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::{Mutex, OnceLock, RwLock, RwLockReadGuard};

/// Declares a `Send + Sync` newtype for one kind of CUDA handle, so each kind states why it may
/// cross threads (and a handle of one kind cannot be passed where another is expected).
macro_rules! cuda_handle {
    ($(#[$doc:meta])* $name:ident($raw:ty), $why:literal) => {
        $(#[$doc])*
        #[doc = concat!("\n\nSend + Sync: ", $why, ".")]
        #[derive(Clone, Copy, Debug)]
        pub(crate) struct $name(pub(crate) $raw);
        // SAFETY: the reason given in the type's docs — the handle is an opaque token the driver
        // API accepts from any thread once the owning context is current (every call binds it
        // first); the driver synchronizes internally and the token is only copied, never
        // dereferenced by us.
        unsafe impl Send for $name {}
        // SAFETY: as for `Send`: shared references only copy the token.
        unsafe impl Sync for $name {}
    };
}

cuda_handle!(
    /// A device's primary context.
    CtxHandle(sys::CUcontext),
    "contexts are process-wide; cuCtxSetCurrent binds one on any thread"
);
cuda_handle!(
    /// A stream created with `cuStreamCreate`.
    StreamHandle(sys::CUstream),
    "streams may be used from any thread with their context current"
);
cuda_handle!(
    /// An event created or opened from an IPC handle.
    EventHandle(sys::CUevent),
    "events may be recorded, queried and waited on from any thread"
);
cuda_handle!(
    /// A kernel of a module loaded for the life of the process.
    FunctionHandle(sys::CUfunction),
    "functions of a loaded module may be launched from any thread"
);
cuda_handle!(
    /// A captured graph (`CUgraph`).
    GraphHandle(sys::CUgraph),
    "graph calls are serialized by the driver's table lock or take the handle by value"
);
cuda_handle!(
    /// An instantiated graph (`CUgraphExec`).
    GraphExecHandle(sys::CUgraphExec),
    "an instantiated graph may be launched from any thread with its context current"
);

fn check(call: &'static str, rc: CUresult) -> Result<()> {
    if rc == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null) for any code.
    let described = unsafe { sys::cuGetErrorString(rc, &mut text) } == CUresult::CUDA_SUCCESS;
    let message = if described && !text.is_null() {
        // SAFETY: non-null results of cuGetErrorString are static NUL-terminated strings.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{rc:?}")
    };
    if is_capture_code(rc) {
        // A call refused because of a stream capture: the same kind as the host backend's.
        return Err(Error::capture(format!("{call}: {message} ({rc:?})")));
    }
    Err(Error::Driver {
        source: None,
        backend: "cuda",
        call,
        message: format!("{message} ({rc:?})"),
    })
}

/// Logs a failed call of the driver's teardown (its drop): nobody is left to give the error to,
/// and at process exit the driver may be shutting down under it.
fn log_teardown(call: &'static str, rc: CUresult) {
    if let Err(err) = check(call, rc) {
        tracing::debug!(%err, "a CUDA call of the driver's teardown failed");
    }
}

/// Whether `rc` is one of CUDA's stream-capture refusals.
fn is_capture_code(rc: CUresult) -> bool {
    use CUresult::*;
    matches!(
        rc,
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | CUDA_ERROR_STREAM_CAPTURE_MERGE
            | CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
            | CUDA_ERROR_STREAM_CAPTURE_UNJOINED
            | CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            | CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | CUDA_ERROR_CAPTURED_EVENT
            | CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    )
}

#[derive(Debug)]
struct Device {
    ordinal: sys::CUdevice,
    context: CtxHandle,
    default_stream: StreamId,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
    /// Virtual-memory granularity, asked once (`vm.rs`).
    granularity: OnceLock<u64>,
    /// Total memory, asked once (`malloc` compares every request with it).
    total: OnceLock<u64>,
}

/// Concurrent `count_pattern_mismatches` calls per device (8-byte slots of one page).
pub(crate) const COUNTER_SLOTS: usize = 512;

/// The counter pages (per device, made on first use: address and the free memory it took) and
/// the free slots `(device, address)`.
#[derive(Debug, Default)]
struct CounterSlots {
    pages: Vec<Option<(u64, u64)>>,
    free: Vec<(usize, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct Kernels {
    fill: FunctionHandle,
    count: FunctionHandle,
    poison: FunctionHandle,
    sleep: FunctionHandle,
}

#[derive(Debug, Clone, Copy)]
struct StreamEntry {
    device: usize,
    raw: StreamHandle,
    /// Made by someone else (the legacy stream, a library's stream): never destroyed here.
    borrowed: bool,
}

#[derive(Debug, Clone, Copy)]
struct EventEntry {
    device: usize,
    raw: EventHandle,
    interprocess: bool,
    opened: bool,
}

#[derive(Debug, Clone, Copy)]
struct SegmentEntry {
    device: usize,
    size: u64,
    opened_from: Option<[u8; IPC_HANDLE_SIZE]>,
    /// The handle this process exported for the segment (forgotten when it is freed).
    exported_as: Option<[u8; IPC_HANDLE_SIZE]>,
}

/// The CUDA backend (see `src/driver/cuda/mod.rs`).
#[derive(Debug)]
pub struct CudaDriver {
    devices: Vec<Device>,
    ids: IdCounter,
    streams: Registry<StreamEntry>,
    events: Registry<EventEntry>,
    segments: RwLock<BTreeMap<u64, SegmentEntry>>,
    opened_handles: Mutex<HashSet<[u8; IPC_HANDLE_SIZE]>>,
    /// Reservations and mapped chunks (expandable segments); locked after `segments`.
    vm: RwLock<VmSpace<ChunkId>>,
    chunks: Registry<vm::CudaChunk>,
    /// The devices' counter pages and their free slots (`count_pattern_mismatches`).
    counters: Mutex<CounterSlots>,
    /// Captures begun through this driver and not yet ended (`capture.rs`): frees and unmaps,
    /// which synchronize every device, are refused meanwhile.
    captures_under_way: crate::sync::os::atomic::AtomicUsize,
    /// Captured graphs and their instantiations (`capture.rs`).
    graphs: Registry<capture::GraphEntry<GraphHandle>>,
    graph_execs: Registry<capture::GraphEntry<GraphExecHandle>>,
    /// Page-locked host memory this driver allocated or registered (`host_memory.rs`).
    pinned: RwLock<host_memory::PinnedTable>,
    /// The process that loaded the driver: CUDA cannot be used in a forked child, whose calls are
    /// refused before any lock, and whose drop releases nothing (`process`).
    birth: Birth,
}

/// The read locks that keep checked ranges valid until their work is enqueued.
struct HeldRanges<'a> {
    _segments: RwLockReadGuard<'a, BTreeMap<u64, SegmentEntry>>,
    _vm: RwLockReadGuard<'a, VmSpace<ChunkId>>,
}

/// Whether `libcuda` can be loaded on this machine.
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen candidate library names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

impl CudaDriver {
    /// Loads the CUDA driver, initializes it and retains every device's primary context.
    pub fn new() -> Result<Self> {
        if !driver_library_present() {
            return Err(Error::NoCudaDriver(
                "libcuda.so was not found on this machine".into(),
            ));
        }
        // SAFETY: the library is present (checked above); cuInit takes flags 0.
        check("cuInit", unsafe { sys::cuInit(0) })
            .map_err(|e| Error::NoCudaDriver(format!("cuInit failed: {e}")))?;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        if count <= 0 {
            return Err(Error::NoCudaDriver(
                "the CUDA driver reports no devices".into(),
            ));
        }
        let ids = IdCounter::default();
        let driver_tag = ids.driver();
        let mut driver = CudaDriver {
            devices: Vec::new(),
            ids,
            streams: Registry::of_streams(driver_tag),
            events: Registry::new("event"),
            segments: RwLock::new(BTreeMap::new()),
            opened_handles: Mutex::new(HashSet::new()),
            vm: RwLock::new(VmSpace::default()),
            chunks: Registry::new("chunk"),
            counters: Mutex::new(CounterSlots::default()),
            captures_under_way: Default::default(),
            graphs: Registry::new("graph"),
            graph_execs: Registry::new("instantiated graph"),
            pinned: RwLock::new(BTreeMap::new()),
            birth: Birth::now(),
        };
        for ordinal in 0..count {
            let mut dev = 0;
            // SAFETY: out-pointer valid; ordinal < count.
            check("cuDeviceGet", unsafe {
                sys::cuDeviceGet(&mut dev, ordinal)
            })?;
            let mut ctx = std::ptr::null_mut();
            // SAFETY: out-pointer valid; `dev` came from cuDeviceGet.
            check("cuDevicePrimaryCtxRetain", unsafe {
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
            })?;
            driver.devices.push(Device {
                ordinal: dev,
                context: CtxHandle(ctx),
                default_stream: StreamId(0),
                kernels: OnceLock::new(),
                granularity: OnceLock::new(),
                total: OnceLock::new(),
            });
            driver.counters.get_mut().pages.push(None);
        }
        // The default stream is the legacy NULL stream (a null CUstream), as for PyTorch and candle:
        // work a library launches without naming a stream is ordered with it.
        for device in 0..driver.devices.len() {
            let id = driver.ids.stream(device)?;
            driver.streams.insert(
                id.0,
                StreamEntry {
                    device,
                    raw: StreamHandle(std::ptr::null_mut()),
                    borrowed: true,
                },
            );
            driver.devices[device].default_stream = id;
        }
        Ok(driver)
    }

    /// `Ok` in the process that loaded the driver; in a forked child an error before any lock or
    /// CUDA call (`process.rs`). The driver's doors call it — `device` (so `bind` and every call
    /// that needs a context), the tables' accessors below, the id tables (`registry.rs`), and the
    /// forwarded capability methods — so no method checks by itself.
    fn door(&self) -> Result<()> {
        self.birth.check("this CUDA driver")
    }

    /// The segment table (a door).
    fn segment_table(&self) -> Result<&RwLock<BTreeMap<u64, SegmentEntry>>> {
        self.door()?;
        Ok(&self.segments)
    }

    /// The page-locked table (a door).
    fn pinned_table(&self) -> Result<&RwLock<host_memory::PinnedTable>> {
        self.door()?;
        Ok(&self.pinned)
    }

    /// Reservations and mappings (a door).
    fn vm_table(&self) -> Result<&RwLock<VmSpace<ChunkId>>> {
        self.door()?;
        Ok(&self.vm)
    }

    /// IPC handles opened by this driver (a door).
    fn opened_table(&self) -> Result<&Mutex<HashSet<[u8; IPC_HANDLE_SIZE]>>> {
        self.door()?;
        Ok(&self.opened_handles)
    }

    fn device(&self, device: usize) -> Result<&Device> {
        self.door()?;
        self.devices.get(device).ok_or_else(|| {
            Error::invalid(format!(
                "device {device} does not exist (CUDA reports {} device(s))",
                self.devices.len()
            ))
        })
    }

    /// Makes `device`'s primary context current on this thread.
    fn bind(&self, device: usize) -> Result<()> {
        let ctx = self.device(device)?.context;
        // SAFETY: the context was retained in `new` and is released only in Drop.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx.0) })
    }

    /// A free counter slot of `device` for `count_pattern_mismatches` (its context bound); the
    /// device's page is made on first use.
    fn take_counter(&self, device: usize) -> Result<u64> {
        let mut slots = self.counters.lock();
        if slots.pages.get(device).is_some_and(Option::is_none) {
            let free = || {
                let (mut free, mut total) = (0usize, 0usize);
                // SAFETY: valid out-pointers; the device's context is bound by the caller.
                let rc = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
                check("cuMemGetInfo_v2", rc).map(|()| free as u64)
            };
            let before = free()?;
            let mut page = 0;
            // SAFETY: out-pointer valid; the device's context is bound by the caller.
            check("cuMemAlloc_v2", unsafe {
                sys::cuMemAlloc_v2(&mut page, 8 * COUNTER_SLOTS)
            })?;
            // What the page took of free memory (a GPU rounds a small allocation up; another
            // thread's allocation in between would be counted too: best effort).
            let taken = before.saturating_sub(free().unwrap_or(before));
            slots.pages[device] = Some((page, taken));
            slots
                .free
                .extend((0..COUNTER_SLOTS as u64).map(|i| (device, page + 8 * i)));
        }
        let at = slots
            .free
            .iter()
            .position(|&(d, _)| d == device)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "more than {COUNTER_SLOTS} pattern counts at once on device {device}"
                ))
            })?;
        Ok(slots.free.swap_remove(at).1)
    }

    /// Gives a counter slot back (no work of its count can still touch it).
    pub(super) fn give_counter(&self, device: usize, counter: u64) {
        self.counters.lock().free.push((device, counter));
    }

    /// Bytes of `device` the driver holds for itself (its counter page, once made).
    pub(super) fn scratch_bytes(&self, device: usize) -> u64 {
        let made = self.counters.lock().pages.get(device).copied().flatten();
        made.map_or(0, |(_, taken)| taken)
    }

    fn fresh_id(&self) -> u64 {
        self.ids.fresh()
    }

    /// Looks up `stream` and binds its device.
    fn stream(&self, stream: StreamId) -> Result<StreamEntry> {
        let entry = self.streams.get(stream.0)?;
        self.bind(entry.device)?;
        Ok(entry)
    }

    fn event(&self, event: EventId) -> Result<EventEntry> {
        let entry = self.events.get(event.0)?;
        self.bind(entry.device)?;
        Ok(entry)
    }

    /// Checks that every range lies in a live segment and returns the segment table's read guard
    /// with the first range's length: hold the guard until the work naming the ranges is
    /// enqueued, so a concurrent `free` (which takes the write lock to remove the segment before
    /// `cuMemFree`) cannot slip in between the check and the enqueue — the host backend's rule.
    fn hold_ranges<const N: usize>(
        &self,
        ranges: [(DeviceAddr, u64); N],
    ) -> Result<(HeldRanges<'_>, usize)> {
        let table = self.segment_table()?.read();
        let vm = self.vm_table()?.read();
        for &(ptr, len) in &ranges {
            if vm.contains(ptr.0, len) {
                vm.covered(ptr, len)?;
            } else {
                ranges::containing(&table, |s| s.size, ptr, len)?;
            }
        }
        let first = ranges.first().map_or(0, |r| r.1);
        let n = usize::try_from(first)
            .map_err(|_| Error::invalid(format!("length {first} exceeds the address space")))?;
        Ok((
            HeldRanges {
                _segments: table,
                _vm: vm,
            },
            n,
        ))
    }

    fn kernels(&self, device: usize) -> Result<Kernels> {
        let dev = self.device(device)?;
        dev.kernels
            .get_or_init(|| self.load_kernels(device).map_err(|e| e.to_string()))
            .as_ref()
            .copied()
            .map_err(|message| Error::Driver {
                source: None,
                backend: "cuda",
                call: "load kernels",
                message: message.clone(),
            })
    }

    fn load_kernels(&self, device: usize) -> Result<Kernels> {
        self.bind(device)?;
        let compiled = kernels::compiled()?;
        let mut functions = HashMap::new();
        for (file, ptx) in &compiled.ptx {
            let image = CString::new(ptx.as_bytes())
                .map_err(|_| Error::invalid(format!("PTX of {file} contains a NUL byte")))?;
            let mut module = std::ptr::null_mut();
            // SAFETY: `image` is NUL-terminated PTX text that outlives the call; the module is kept
            // loaded for the life of the process (its functions are cached).
            check("cuModuleLoadData", unsafe {
                sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
            })?;
            for name in [
                "cudalloc_fill_pattern",
                "cudalloc_count_mismatches",
                "cudalloc_poison",
                "cudalloc_sleep",
            ] {
                let cname = CString::new(name).map_err(|_| Error::invalid("kernel name"))?;
                let mut f = std::ptr::null_mut();
                // SAFETY: valid module and NUL-terminated name; a missing name returns an error code.
                if unsafe { sys::cuModuleGetFunction(&mut f, module, cname.as_ptr()) }
                    == CUresult::CUDA_SUCCESS
                {
                    functions.insert(name, FunctionHandle(f));
                }
            }
        }
        let get = |name: &str| {
            functions.get(name).copied().ok_or_else(|| Error::Driver {
                source: None,
                backend: "cuda",
                call: "cuModuleGetFunction",
                message: format!("kernel {name} not found in kernels/*.cu"),
            })
        };
        Ok(Kernels {
            fill: get("cudalloc_fill_pattern")?,
            count: get("cudalloc_count_mismatches")?,
            poison: get("cudalloc_poison")?,
            sleep: get("cudalloc_sleep")?,
        })
    }

    /// Launches `f` with a grid-stride configuration for `work` items.
    fn launch(
        &self,
        f: FunctionHandle,
        stream: StreamEntry,
        work: u64,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        const BLOCK: u64 = 256;
        let blocks = work.div_ceil(BLOCK).clamp(1, 4096) as u32;
        // SAFETY: `f` is a function of a module loaded in this device's context (bound by
        // `stream()`); `args` points at live values of the types the kernel declares (u64 / pointer
        // sized), and cuLaunchKernel copies them before returning.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f.0,
                blocks,
                1,
                1,
                BLOCK as u32,
                1,
                1,
                0,
                stream.raw.0,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child's copy: the contexts, streams and memory are the parent's. The
            // tables are leaked (their locks may have been held at the fork).
            std::mem::forget(std::mem::replace(
                &mut self.streams,
                Registry::new("stream"),
            ));
            std::mem::forget(std::mem::replace(&mut self.events, Registry::new("event")));
            std::mem::forget(std::mem::replace(&mut self.chunks, Registry::new("chunk")));
            std::mem::forget(std::mem::replace(&mut self.graphs, Registry::new("graph")));
            std::mem::forget(std::mem::replace(
                &mut self.graph_execs,
                Registry::new("instantiated graph"),
            ));
            crate::process::leak_in_child(self.birth, &mut self.segments);
            crate::process::leak_in_child(self.birth, &mut self.vm);
            crate::process::leak_in_child(self.birth, &mut self.pinned);
            return;
        }
        // Mappings this driver opened give up their process-wide user (the last one unmaps).
        let opened: Vec<u64> = self
            .segments
            .read()
            .iter()
            .filter(|(_, e)| e.opened_from.is_some())
            .map(|(p, _)| *p)
            .collect();
        for ptr in opened {
            if let Err(err) = self.ipc_close_memory(DeviceAddr(ptr)) {
                tracing::debug!(%err, ptr, "closing an IPC mapping at the driver's teardown failed");
            }
        }
        self.destroy_graphs_left();
        self.drop_pinned();
        let pages = std::mem::take(&mut self.counters.get_mut().pages);
        for (device, page) in pages.into_iter().enumerate() {
            let Some((page, _)) = page else { continue };
            if self.bind(device).is_ok() {
                // SAFETY: the counter page allocated in `new`, freed once; its slots are no
                // longer in use (every count synchronized its stream, or failed).
                log_teardown("cuMemFree_v2", unsafe { sys::cuMemFree_v2(page) });
            }
        }
        let events = self.events.drain();
        for e in events {
            if self.bind(e.device).is_ok() {
                // SAFETY: the event was created or opened by this driver and is dropped once.
                log_teardown("cuEventDestroy_v2", unsafe {
                    sys::cuEventDestroy_v2(e.raw.0)
                });
            }
        }
        let streams = self.streams.drain();
        for s in streams.into_iter().filter(|s| !s.borrowed) {
            if self.bind(s.device).is_ok() {
                // SAFETY: the stream was created by this driver and is destroyed once; queued work
                // still completes (cuStreamDestroy does not cancel it).
                log_teardown("cuStreamDestroy_v2", unsafe {
                    sys::cuStreamDestroy_v2(s.raw.0)
                });
            }
        }
        for dev in &self.devices {
            // SAFETY: balances the retain in `new`.
            log_teardown("cuDevicePrimaryCtxRelease_v2", unsafe {
                sys::cuDevicePrimaryCtxRelease_v2(dev.ordinal)
            });
        }
    }
}

mod driver_impl;
