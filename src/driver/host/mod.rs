//! `HostDriver`: a real device made of host resources — the backend of every test and of CI.
//!
//! | CUDA concept        | host backend                                                        |
//! |---------------------|---------------------------------------------------------------------|
//! | device memory       | POSIX shared-memory objects (`/dev/shm`), `0600`, exclusive, mapped |
//! | device capacity     | a byte budget per virtual device; exceeding it is out-of-memory     |
//! | stream              | a worker thread running its queue in order (`stream.rs`)           |
//! | event               | atomics in a shared-memory chunk, waited on with futexes (`event.rs`) |
//! | IPC event handle    | names the chunk cell *and the record exported*; the opener's waits are checked and bounded (`foreign_event.rs`) |
//! | IPC memory handle   | names the segment's object; another process maps it (`handle.rs`) |
//! | kernels             | native fill / verify / poison / sleep (`kernels.rs`)                |
//! | page-locked host memory | anonymous mappings locked with `mlock`, and the caller's memory locked in place; copies from and to it enqueued (`pinned.rs`) |
//! | stream capture, graphs | work on a capturing stream recorded as re-runnable nodes; a launch re-checks their memory and runs them in order (`capture.rs`) |
//!
//! Stricter and louder than CUDA: freed segments are poisoned before they are unmapped (another
//! process that still maps them sees `0xDEADBEEF`); opening a handle in the exporting process or
//! opening the same handle twice is an error; pointers, streams, events and devices the driver did
//! not hand out are errors; sizes of 0 or that overflow are errors. Segment bases are page aligned
//! (4096 bytes), stronger than CUDA's 256-byte guarantee; capacity is charged in whole pages.
//!
//! Shared-memory objects are unlinked when their segment is freed or the driver is dropped. A
//! process killed outright leaves its objects behind, as a crashed PyTorch producer does.
//!
//! Another process's event is untrusted: a wait on it waits for the record named in its handle,
//! checks the shared cell at every look and has a deadline (`CUDALLOC_IPC_EVENT_TIMEOUT_S`,
//! [`HostDriverBuilder::ipc_event_timeout`]). When it fails — the producer exited, the cell was
//! scribbled, the deadline passed — the wait and the work queued behind it on that stream fail with
//! [`Error::ForeignEvent`], reported to the first blocking call after it too; the stream stays
//! usable for everything else (`stream.rs`, *faults*).

mod capture;
mod capture_calls;
mod config;
mod event;
mod event_calls;
mod foreign_event;
mod handle;
mod kernels;
pub(crate) mod library_kernels;
mod pinned;
mod segments;
mod stream;
mod vm;

use std::collections::HashMap;

pub use config::{parse_byte_size, HostDriverBuilder};
pub use library_kernels::{HostKernelMemory, HostRange};
pub use stream::StreamGate;

use self::event::EventPool;
use self::event_calls::HostEvent;
use self::handle::{HandleKind, HostHandle};
use self::segments::{Origin, Segment, SegmentTable};
use self::stream::HostStream;
use crate::driver::registry::{IdCounter, Registry};
use crate::driver::{
    Backend, DeviceAddr, Driver, EventFlags, EventId, IpcEventHandle, IpcMemHandle, MemInfo,
    OpenedSegment, StreamId,
};
use crate::driver::{Graphs, Interop, Ipc, Kernels, Layer, PinnedHost, VirtualMemory};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::shm::{self, SharedMemory};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, OnceLock, Weak};

const PAGE: u64 = 4096;

/// The host backend (see `src/driver/host/mod.rs`).
pub struct HostDriver {
    config: HostDriverBuilder,
    pid: u32,
    /// The process that built the driver (see `process`): only it runs the stream threads.
    birth: Birth,
    nonce: u64,
    used: Vec<AtomicU64>,
    ids: IdCounter,
    segments: SegmentTable,
    streams: Registry<Arc<HostStream>>,
    chunks: Registry<Arc<segments::HostChunk>>,
    default_streams: Vec<StreamId>,
    events: Registry<Arc<HostEvent>>,
    event_pool: Mutex<EventPool>,
    foreign_chunks: Mutex<HashMap<String, Weak<SharedMemory>>>,
    /// The stream sanitizer of the [`SanitizedDriver`](crate::driver::SanitizedDriver)s over
    /// this driver (one for all of them): library kernels report their accesses to it.
    sanitizer: OnceLock<Arc<crate::driver::Sanitizer>>,
    /// Stream captures under way and the graphs they made (`capture.rs`).
    captures: capture::Captures,
    /// Page-locked host memory (`pinned.rs`).
    pinned: pinned::PinnedTable,
}

impl std::fmt::Debug for HostDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDriver")
            .field("pid", &self.pid)
            .field("devices", &self.config.devices)
            .field("memory_per_device", &self.config.memory_per_device)
            .field("streams", &self.streams.len())
            .field("events", &self.events.len())
            .finish()
    }
}

impl HostDriver {
    /// A builder with the defaults.
    pub fn builder() -> HostDriverBuilder {
        HostDriverBuilder::default()
    }

    fn with_config(config: HostDriverBuilder) -> Result<Self> {
        let ids = IdCounter::default();
        let driver_tag = ids.driver();
        let mut driver = HostDriver {
            pid: std::process::id(),
            birth: Birth::now(),
            nonce: shm::random_u64(),
            used: (0..config.devices).map(|_| AtomicU64::new(0)).collect(),
            ids,
            segments: SegmentTable::default(),
            streams: Registry::of_streams(driver_tag),
            chunks: Registry::new("chunk"),
            default_streams: Vec::new(),
            events: Registry::new("event"),
            event_pool: Mutex::new(EventPool::default()),
            foreign_chunks: Mutex::new(HashMap::new()),
            sanitizer: OnceLock::new(),
            captures: capture::Captures::default(),
            pinned: pinned::PinnedTable::default(),
            config,
        };
        for device in 0..driver.config.devices {
            let id = driver.stream_create(device)?;
            driver.default_streams.push(id);
        }
        Ok(driver)
    }

    /// The sanitizer of this driver's sanitized wrappers, made with `options` by the first.
    pub(crate) fn attach_sanitizer(
        &self,
        options: crate::driver::SanitizeOptions,
    ) -> Arc<crate::driver::Sanitizer> {
        Arc::clone(
            self.sanitizer
                .get_or_init(|| Arc::new(crate::driver::Sanitizer::new(options))),
        )
    }

    /// The sanitizer attached by a sanitized wrapper, if any.
    pub(crate) fn attached_sanitizer(&self) -> Option<&Arc<crate::driver::Sanitizer>> {
        self.sanitizer.get()
    }

    /// Capacity of each virtual device in bytes.
    pub fn memory_per_device(&self) -> u64 {
        self.config.memory_per_device
    }

    /// The prefix of every `/dev/shm` name this driver creates (`cudalloc-<pid>-<nonce>-`), for leak
    /// checks: after the driver is dropped no name with it remains.
    pub fn shm_name_prefix(&self) -> String {
        format!("cudalloc-{}-{:016x}-", self.pid, self.nonce)
    }

    /// Bytes `/dev/shm` can still back: every segment, event chunk and ref-counter file of the host
    /// backend lives there, so this bounds the real capacity whatever `memory_per_device` says.
    pub fn shm_available_bytes() -> Result<u64> {
        crate::shm::available_bytes()
    }

    /// Holds `stream` at this point of its queue until the returned gate is opened or dropped
    /// (host-only; see [`StreamGate`]).
    #[doc(hidden)]
    pub fn gate_stream(&self, stream: StreamId) -> Result<StreamGate> {
        self.this_process()?;
        StreamGate::install(&*self.stream(stream)?)
    }

    /// `Ok` in the process that built the driver; in a forked child an error, before any lock:
    /// the child has none of the stream threads, and the segments are its parent's. Every
    /// `Driver` method and every public host-only call begins with it.
    #[inline]
    fn this_process(&self) -> Result<()> {
        self.birth.check("this host driver")
    }

    fn check_device(&self, device: usize) -> Result<()> {
        if device >= self.config.devices {
            return Err(Error::invalid(format!(
                "device {device} does not exist (this host driver has {} device(s))",
                self.config.devices
            )));
        }
        Ok(())
    }

    fn stream(&self, id: StreamId) -> Result<Arc<HostStream>> {
        self.streams.get(id.0)
    }

    fn event(&self, id: EventId) -> Result<Arc<HostEvent>> {
        self.events.get(id.0)
    }

    fn fresh_id(&self) -> u64 {
        self.ids.fresh()
    }

    /// Drains every stream (for a free or close about to unmap memory): a failed stream is an
    /// error, a fault (a failed foreign wait, `stream.rs`) is not — it concerns other memory.
    fn synchronize_all(&self) -> Result<()> {
        // Every stream, even after one failed: a caller about to unmap must know the work
        // queued on all of them is done (the first error is returned).
        let mut first = Ok(());
        for stream in self.streams.values() {
            let drained = stream.drain();
            if first.is_ok() {
                first = drained;
            }
        }
        first
    }

    /// Checks `ranges` and enqueues `op` on `stream` while the ranges are guaranteed mapped.
    /// `op` receives the checked host addresses in the order of `ranges`.
    fn enqueue_on_ranges<const N: usize>(
        &self,
        stream: StreamId,
        ranges: [(DeviceAddr, u64); N],
        op: impl Fn([usize; N]) + Send + Sync + 'static,
    ) -> Result<u64> {
        self.enqueue_fallible_on_ranges(stream, ranges, move |addrs| {
            op(addrs);
            Ok(())
        })
    }

    /// As `enqueue_on_ranges`, for work a blocking call waits for (its ticket): never recorded —
    /// a stream that became capturing since the caller's check refuses it.
    fn enqueue_blocking_on_ranges<const N: usize>(
        &self,
        stream: StreamId,
        ranges: [(DeviceAddr, u64); N],
        op: impl Fn([usize; N]) + Send + Sync + 'static,
    ) -> Result<u64> {
        self.enqueue_ranges(stream, ranges, false, move |addrs| {
            op(addrs);
            Ok(())
        })
    }

    /// As `enqueue_on_ranges`, for work that can fail its stream. On a capturing stream the work
    /// is recorded as a node of the capture instead (`capture.rs`; ticket 0: nothing to wait for).
    fn enqueue_fallible_on_ranges<const N: usize>(
        &self,
        stream: StreamId,
        ranges: [(DeviceAddr, u64); N],
        op: impl Fn([usize; N]) -> Result<()> + Send + Sync + 'static,
    ) -> Result<u64> {
        self.enqueue_ranges(stream, ranges, true, op)
    }

    /// The enqueue of both: recorded on a capturing stream when `record`, refused there otherwise.
    fn enqueue_ranges<const N: usize>(
        &self,
        stream: StreamId,
        ranges: [(DeviceAddr, u64); N],
        record: bool,
        op: impl Fn([usize; N]) -> Result<()> + Send + Sync + 'static,
    ) -> Result<u64> {
        let s = self.stream(stream)?;
        if self.captures.any() {
            return self.enqueue_or_record(&s, stream, ranges, record, op);
        }
        let view = self.segments.view();
        let mut addrs = [0usize; N];
        // A range inside a mapped segment fits the address space: no separate length check.
        for (addr, &(ptr, len)) in addrs.iter_mut().zip(&ranges) {
            *addr = view.check(ptr, len)?;
        }
        let ticket = s.enqueue_fallible(Box::new(move || op(addrs)))?;
        drop(view);
        Ok(ticket)
    }

    fn wait_ticket(&self, stream: StreamId, ticket: u64) -> Result<()> {
        self.stream(stream)?.wait_for(ticket)
    }

    fn owned_name(&self, kind: HandleKind, object: u64) -> String {
        handle::object_name(kind, self.pid, self.nonce, object)
    }

    fn release_segment(&self, segment: Segment, poison: bool) -> Result<()> {
        // The segment is out of the table: nothing new can be enqueued on it. Drain what was.
        let drained = self.synchronize_all();
        if poison {
            // SAFETY: the mapping is alive (we own `segment`) and every stream has drained, so no
            // worker touches it; other processes may still read it, which is the point.
            unsafe { kernels::poison(segment.shm.as_ptr() as usize, segment.shm.len() as usize) };
        }
        drop(segment);
        drained
    }
}

impl Drop for HostDriver {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child's copy: no stream thread exists here to join, and the segments,
            // chunks and event cells are the parent's (unmapping the child's copies is harmless,
            // poisoning them is not). Everything is leaked in the child.
            let birth = self.birth;
            std::mem::forget(std::mem::replace(
                &mut self.streams,
                Registry::new("stream"),
            ));
            std::mem::forget(std::mem::replace(&mut self.chunks, Registry::new("chunk")));
            std::mem::forget(std::mem::replace(&mut self.events, Registry::new("event")));
            crate::process::leak_in_child(birth, &mut self.segments);
            crate::process::leak_in_child(birth, &mut self.event_pool);
            crate::process::leak_in_child(birth, &mut self.foreign_chunks);
            // The parent's locked pages: the child's copies are not locked (locks are not
            // inherited) and unmapping them is harmless, but leave them as the rest.
            crate::process::leak_in_child(birth, &mut self.pinned);
            return;
        }
        let streams = self.streams.drain();
        for s in &streams {
            s.shutdown();
        }
        self.drop_pinned();
        let leftover = self.segments.drain();
        if leftover
            .iter()
            .any(|s| matches!(s.origin, Origin::Owned { .. }))
        {
            tracing::debug!(
                segments = leftover.len(),
                "host driver dropped with live segments"
            );
        }
    }
}

fn checked_len(len: u64) -> Result<usize> {
    usize::try_from(len)
        .map_err(|_| Error::invalid(format!("length {len} exceeds the address space")))
}

impl Driver for HostDriver {
    fn layer(&self) -> Layer<'_> {
        Layer::Host(self)
    }

    crate::driver::capability::own_capabilities!(kernels, interop, vm, ipc, pinned, graphs);

    fn backend(&self) -> Backend {
        Backend::Host
    }

    fn device_count(&self) -> usize {
        self.config.devices
    }

    fn device_name(&self, device: usize) -> Result<String> {
        self.this_process()?;
        self.check_device(device)?;
        Ok(format!("cudalloc host device {device}"))
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.this_process()?;
        self.check_device(device)?;
        let total = self.config.memory_per_device;
        let used = self.used[device].load(Ordering::SeqCst);
        // What /dev/shm can still back bounds what malloc can really hand out (shared by every
        // device and process); unknown counts as unbounded.
        let shm_free = crate::shm::available_bytes().unwrap_or(u64::MAX);
        Ok(MemInfo {
            free: total.saturating_sub(used).min(shm_free),
            total,
        })
    }

    fn malloc(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.this_process()?;
        self.check_device(device)?;
        self.captures.check_unsafe("malloc")?;
        if size == 0 {
            return Err(Error::invalid("malloc of 0 bytes"));
        }
        let total = self.config.memory_per_device;
        let charged = size
            .checked_next_multiple_of(PAGE)
            .filter(|&c| c <= total)
            .ok_or_else(|| Error::OutOfMemory {
                device,
                requested: size,
                message: format!("requested {size} bytes; device capacity is {total} bytes"),
            })?;
        let used = &self.used[device];
        used.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
            u.checked_add(charged).filter(|&n| n <= total)
        })
        .map_err(|u| Error::OutOfMemory {
            device,
            requested: size,
            message: format!(
                "requested {size} bytes; capacity {total}, in use {u}, free {}",
                total.saturating_sub(u)
            ),
        })?;
        let object = self.fresh_id();
        match SharedMemory::create(&self.owned_name(HandleKind::Memory, object), size) {
            Ok(shm) => Ok(self.segments.insert(Segment {
                device,
                shm,
                origin: Origin::Owned { object },
            })),
            Err(err) => {
                used.fetch_sub(charged, Ordering::SeqCst);
                if crate::shm::is_no_space(&err) {
                    // Through the allocator's miss path like any out-of-memory (free cached
                    // segments, retry, then a clear error) instead of a SIGBUS on first write.
                    return Err(Error::OutOfMemory {
                        device,
                        requested: size,
                        message: err.to_string(),
                    });
                }
                Err(err)
            }
        }
    }

    fn free(&self, ptr: DeviceAddr) -> Result<()> {
        self.this_process()?;
        self.captures.check_unsafe("free")?;
        if self.captures.any() {
            // As on CUDA, where a free synchronizes every device, which a capture forbids.
            return Err(Error::capture(
                "free is not allowed while a stream capture of this driver is under way: end it \
                 first (nothing was freed)",
            ));
        }
        let segment = self.segments.remove_owned(ptr)?;
        let (device, size) = (segment.device, segment.shm.len());
        let result = self.release_segment(segment, self.config.poison_on_free);
        let charged = size.next_multiple_of(PAGE);
        self.used[device].fetch_sub(charged, Ordering::SeqCst);
        result
    }

    fn default_stream(&self, device: usize) -> Result<StreamId> {
        self.this_process()?;
        self.check_device(device)?;
        Ok(self.default_streams[device])
    }

    fn stream_create(&self, device: usize) -> Result<StreamId> {
        self.this_process()?;
        self.check_device(device)?;
        let id = self.ids.stream(device)?;
        let stream = HostStream::spawn(device, id.0)?;
        self.streams.insert(id.0, stream);
        Ok(id)
    }

    fn stream_destroy(&self, stream: StreamId) -> Result<()> {
        self.this_process()?;
        if self.default_streams.contains(&stream) {
            return Err(Error::invalid("the default stream cannot be destroyed"));
        }
        if self.captures.status(stream).is_capturing() {
            return Err(Error::capture(format!(
                "stream {} is being captured: end the capture before destroying it",
                stream.0
            )));
        }
        // Drain and stop it while it is still in the registry: a concurrent free or unmap
        // (`synchronize_all`) must wait for its queued work before unmapping memory.
        self.stream(stream)?.shutdown();
        self.streams.remove(stream.0)?;
        Ok(())
    }

    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        self.this_process()?;
        let s = self.stream(stream)?;
        self.captures.check_blocking(stream, "stream_synchronize")?;
        s.synchronize()
    }

    fn stream_query(&self, stream: StreamId) -> Result<bool> {
        self.this_process()?;
        let s = self.stream(stream)?;
        self.captures.check_blocking(stream, "stream_query")?;
        s.is_idle()
    }

    fn stream_device(&self, stream: StreamId) -> Result<usize> {
        self.this_process()?;
        Ok(self.stream(stream)?.device())
    }

    fn event_create(&self, device: usize, flags: EventFlags) -> Result<EventId> {
        self.host_event_create(device, flags)
    }

    fn event_destroy(&self, event: EventId) -> Result<()> {
        self.host_event_destroy(event)
    }

    fn event_record(&self, event: EventId, stream: StreamId) -> Result<()> {
        self.host_event_record(event, stream)
    }

    fn event_query(&self, event: EventId) -> Result<bool> {
        self.host_event_query(event)
    }

    fn event_synchronize(&self, event: EventId) -> Result<()> {
        self.host_event_synchronize(event)
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        self.host_stream_wait_event(stream, event)
    }

    unsafe fn copy_host_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: &[u8],
    ) -> Result<()> {
        self.this_process()?;
        self.captures
            .check_blocking(stream, "a copy from host memory")?;
        let data = src.to_vec();
        let len = data.len();
        let ticket = self.enqueue_blocking_on_ranges(stream, [(dst, len as u64)], move |[d]| {
            // SAFETY: `d..d+len` was checked to lie in a live segment, which stays mapped until
            // every stream drains; `data` is owned by this closure.
            unsafe { kernels::copy(d, data.as_ptr() as usize, len) }
        })?;
        self.wait_ticket(stream, ticket)
    }

    unsafe fn copy_device_to_host(
        &self,
        stream: StreamId,
        dst: &mut [u8],
        src: DeviceAddr,
    ) -> Result<()> {
        self.this_process()?;
        self.captures
            .check_blocking(stream, "a copy to host memory")?;
        let len = dst.len();
        let out = Arc::new(Mutex::new(vec![0u8; len]));
        let for_op = Arc::clone(&out);
        let ticket = self.enqueue_blocking_on_ranges(stream, [(src, len as u64)], move |[s]| {
            let mut buf = for_op.lock();
            // SAFETY: `s..s+len` is checked and stays mapped (see above); `buf` has `len` bytes.
            unsafe { kernels::copy(buf.as_mut_ptr() as usize, s, len) }
        })?;
        self.wait_ticket(stream, ticket)?;
        dst.copy_from_slice(&out.lock());
        Ok(())
    }

    unsafe fn copy_device_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()> {
        self.this_process()?;
        let n = checked_len(len)?;
        self.enqueue_on_ranges(stream, [(dst, len), (src, len)], move |[d, s]| {
            // SAFETY: both ranges were checked and stay mapped until every stream drains.
            unsafe { kernels::copy(d, s, n) }
        })
        .map(|_| ())
    }

    unsafe fn memset(&self, stream: StreamId, dst: DeviceAddr, value: u8, len: u64) -> Result<()> {
        self.this_process()?;
        let n = checked_len(len)?;
        self.enqueue_on_ranges(stream, [(dst, len)], move |[d]| {
            // SAFETY: the range was checked and stays mapped until every stream drains.
            unsafe { kernels::memset(d, value, n) }
        })
        .map(|_| ())
    }
}

impl Kernels for HostDriver {
    unsafe fn fill_pattern(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<()> {
        self.this_process()?;
        let n = checked_len(len)?;
        self.enqueue_on_ranges(stream, [(dst, len)], move |[d]| {
            // SAFETY: the range was checked and stays mapped until every stream drains.
            unsafe { kernels::fill_pattern(d, n, seed) }
        })
        .map(|_| ())
    }

    unsafe fn count_pattern_mismatches(
        &self,
        stream: StreamId,
        src: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<u64> {
        self.this_process()?;
        self.captures
            .check_blocking(stream, "count_pattern_mismatches")?;
        let n = checked_len(len)?;
        let result = Arc::new(AtomicU64::new(0));
        let for_op = Arc::clone(&result);
        let ticket = self.enqueue_blocking_on_ranges(stream, [(src, len)], move |[s]| {
            // SAFETY: the range was checked and stays mapped until every stream drains.
            let count = unsafe { kernels::count_mismatches(s, n, seed) };
            for_op.store(count, Ordering::SeqCst);
        })?;
        self.wait_ticket(stream, ticket)?;
        Ok(result.load(Ordering::SeqCst))
    }

    unsafe fn poison(&self, stream: StreamId, dst: DeviceAddr, len: u64) -> Result<()> {
        self.this_process()?;
        let n = checked_len(len)?;
        self.enqueue_on_ranges(stream, [(dst, len)], move |[d]| {
            // SAFETY: the range was checked and stays mapped until every stream drains.
            unsafe { kernels::poison(d, n) }
        })
        .map(|_| ())
    }

    fn sleep(&self, stream: StreamId, micros: u64) -> Result<()> {
        self.this_process()?;
        if let Some(recorded) = self
            .captures
            .record(stream, || capture::Node::Sleep(micros))
        {
            return recorded;
        }
        self.stream(stream)?
            .enqueue(Box::new(move || {
                std::thread::sleep(std::time::Duration::from_micros(micros))
            }))
            .map(|_| ())
    }
}

impl Interop for HostDriver {
    unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId> {
        self.check_device(device)?;
        let stream = StreamId(raw);
        let owner = self.stream(stream)?.device();
        if owner != device {
            return Err(Error::invalid(format!(
                "stream {raw} belongs to device {owner}, not device {device}"
            )));
        }
        // The host backend's raw handle is the id itself: importing names the same stream.
        Ok(stream)
    }

    fn raw_stream(&self, stream: StreamId) -> Result<u64> {
        self.this_process()?;
        self.stream(stream)?;
        Ok(stream.0)
    }

    unsafe fn launch_function(
        &self,
        _: StreamId,
        _: u64,
        _: crate::driver::capability::LaunchDims,
        _: &mut [*mut std::ffi::c_void],
        _: &[crate::driver::access::Touch],
    ) -> Result<()> {
        Err(Error::invalid(
            "the host backend has no device code: a kernel's host body runs here (Runtime::launch)",
        ))
    }
}

impl VirtualMemory for HostDriver {
    crate::driver::forward_vm_methods!(this_process);
}

impl Ipc for HostDriver {
    fn ipc_export_memory(&self, ptr: DeviceAddr) -> Result<IpcMemHandle> {
        self.this_process()?;
        self.pinned.refuse_export(ptr)?;
        let (device, object, size) = self.segments.view().owned_at(ptr)?;
        let device =
            u16::try_from(device).map_err(|_| Error::invalid("device ordinal too large"))?;
        let h = HostHandle {
            kind: HandleKind::Memory,
            device,
            pid: self.pid,
            nonce: self.nonce,
            object,
            extra: size,
            record: 0,
        };
        Ok(IpcMemHandle(h.encode()))
    }

    fn ipc_open_memory(&self, device: usize, handle: &IpcMemHandle) -> Result<OpenedSegment> {
        self.this_process()?;
        self.check_device(device)?;
        self.captures.check_unsafe("ipc_open_memory")?;
        let h = HostHandle::decode(HandleKind::Memory, &handle.0)?;
        if h.pid == self.pid {
            return Err(Error::invalid(
                "an IPC memory handle cannot be opened in the process that exported it; use the original pointer",
            ));
        }
        let key = (h.pid, h.nonce, h.object);
        if self.segments.is_open(&key) {
            return Err(Error::invalid(
                "this IPC memory handle is already open in this process; cache the mapping and reuse it",
            ));
        }
        let shm = SharedMemory::open(&h.object_name(), Some(h.extra))?;
        let size = shm.len();
        let ptr = self.segments.insert(Segment {
            device,
            shm,
            origin: Origin::Opened { key },
        });
        Ok(OpenedSegment { ptr, size })
    }

    fn ipc_close_memory(&self, ptr: DeviceAddr) -> Result<()> {
        self.this_process()?;
        self.captures.check_unsafe("ipc_close_memory")?;
        let segment = self.segments.remove_opened(ptr)?;
        self.release_segment(segment, false)
    }

    fn ipc_export_event(&self, event: EventId) -> Result<IpcEventHandle> {
        self.host_ipc_export_event(event)
    }

    fn ipc_open_event(&self, device: usize, handle: &IpcEventHandle) -> Result<EventId> {
        self.host_ipc_open_event(device, handle)
    }
}

impl PinnedHost for HostDriver {
    crate::driver::host_memory::forward_host_memory_methods!(this_process);
}

impl Graphs for HostDriver {
    crate::driver::forward_capture_methods!(this_process);
}
