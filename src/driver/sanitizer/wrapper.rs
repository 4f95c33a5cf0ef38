//! [`SanitizedDriver`]: any [`Driver`] with every stream operation checked by a [`Sanitizer`].

use super::{SanitizeOptions, Sanitizer, Touch};
use crate::driver::{
    Backend, CaptureMode, CaptureStatus, ChunkId, DeviceAddr, Driver, EventFlags, EventId,
    ExportedChunk, GraphExecId, GraphId, HostAddr, IpcEventHandle, IpcMemHandle, MemInfo,
    OpenedSegment, StreamId,
};
use crate::driver::{Graphs, Interop, Ipc, Kernels, Layer, PinnedHost, VirtualMemory};
use crate::error::Result;
use crate::process::Birth;
use crate::process::PerProcess;
use crate::sync::os::{Arc, Mutex, Weak};

use std::collections::HashMap;

/// A driver whose streams, events and memory operations feed a [`Sanitizer`] (see the
/// `src/driver/sanitizer/mod.rs`); everything else is forwarded unchanged.
///
/// `as_host()` (on `dyn Driver`) gives the host backend underneath, for its host-only facilities: its
/// library kernels (`enqueue_host`) report to the same sanitizer, but stream operations called on
/// it directly (`event_record`, `stream_synchronize`, copies) bypass the checker — call them on
/// this driver (the runtime's `driver()`), or the sanitizer reports races they ordered.
#[derive(Debug)]
pub struct SanitizedDriver {
    inner: Arc<dyn Driver>,
    sanitizer: Arc<Sanitizer>,
    /// The first id seen for each (device, raw stream): another id of the same queue (a stream
    /// imported by the raw handle of one the driver made) is the same actor.
    raws: Mutex<HashMap<(usize, u64), StreamId>>,
    /// The process that made the wrapper: a forked child is refused before any lock (`process`).
    birth: Birth,
}

impl SanitizedDriver {
    /// `inner` checked by a sanitizer with `options`; a driver that is sanitized already is
    /// returned as it is. A host backend keeps one sanitizer for all its wrappers (its library
    /// kernels report to it).
    ///
    /// Every wrapper of one driver shares one sanitizer (the first wrap's options hold): an event
    /// recorded through one runtime and waited on through another is known to both.
    pub fn wrap(inner: Arc<dyn Driver>, options: SanitizeOptions) -> Arc<dyn Driver> {
        if inner.sanitizer().is_some() {
            return inner;
        }
        let sanitizer = match inner.as_host() {
            Some(host) => host.attach_sanitizer(options),
            None => shared_sanitizer(&inner, options),
        };
        Arc::new(SanitizedDriver {
            inner,
            sanitizer,
            raws: Mutex::new(HashMap::new()),
            birth: Birth::now(),
        })
    }

    /// The sanitizer, through the one door of the wrapper's own state: in a forked child an error
    /// before any lock of it (`process`). Every other path of a method reaches the inner driver
    /// first, whose own doors refuse a child the same way — so no method checks by itself.
    fn sanitizer(&self) -> Result<&Sanitizer> {
        self.birth.check("this sanitized driver")?;
        Ok(&self.sanitizer)
    }

    /// The capture `stream` takes part in: its work is recorded into a graph, not run, so it is
    /// forwarded unchecked and its touches are kept for the graph's replays (`graphs.rs`).
    fn capture_of(&self, stream: StreamId) -> Result<Option<u64>> {
        self.sanitizer()?;
        Ok(self
            .inner
            .graphs()
            .stream_capture_status(stream)
            .ok()
            .and_then(|status| status.capture_id()))
    }

    fn captured(&self, stream: StreamId) -> Result<bool> {
        Ok(self.capture_of(stream)?.is_some())
    }

    /// Notes `stream` under its raw handle; a second id of the same raw stream becomes an alias
    /// of the first in the sanitizer.
    fn note_raw(&self, device: usize, stream: StreamId) {
        let Ok(raw) = self.inner.interop().raw_stream(stream) else {
            return;
        };
        let mut raws = self.raws.lock();
        match raws.get(&(device, raw)) {
            Some(&first) if first != stream => self.sanitizer.alias_stream(stream, first),
            Some(_) => {}
            None => {
                raws.insert((device, raw), stream);
            }
        }
    }
}

/// The sanitizers of drivers that cannot hold one themselves (all but the host backend), by the
/// driver they check.
type Registry = Vec<(Weak<dyn Driver>, Weak<Sanitizer>)>;
static SANITIZERS: PerProcess<Mutex<Registry>> = PerProcess::new(|| Mutex::new(Vec::new()));

/// The sanitizer of `driver`: the one a wrapper of it already made, or a new one.
fn shared_sanitizer(driver: &Arc<dyn Driver>, options: SanitizeOptions) -> Arc<Sanitizer> {
    let mut registry = SANITIZERS.lock();
    registry.retain(|(d, s)| d.strong_count() > 0 && s.strong_count() > 0);
    let found = registry.iter().find_map(|(d, s)| {
        d.upgrade()
            .filter(|d| std::ptr::addr_eq(Arc::as_ptr(d), Arc::as_ptr(driver)))
            .and_then(|_| s.upgrade())
    });
    found.unwrap_or_else(|| {
        let made = Arc::new(Sanitizer::new(options));
        registry.push((Arc::downgrade(driver), Arc::downgrade(&made)));
        made
    })
}

impl SanitizedDriver {
    /// Gives the memory mapped at `base` back with `release`, the sanitizer told first: once
    /// the release returns, another thread may get the same addresses from the driver and hand
    /// them out, which a later "unmapped" would wipe (found by the model of every exit: a block
    /// handed out in a segment mapped where another had just been freed was then "never handed
    /// out"). Should the release fail, the segment is known again, its allocations forgotten:
    /// the failure is the allocator's to report (a driver that cannot free memory).
    fn unmapping(&self, base: DeviceAddr, release: impl FnOnce() -> Result<()>) -> Result<()> {
        let size = self.sanitizer.unmapped_segment(base.0);
        let released = release();
        if released.is_err() {
            if let Some(size) = size {
                self.sanitizer.mapped(base.0, size);
            }
        }
        released
    }

    /// Stream work checked by the sanitizer (or, on a capturing stream, forwarded unchecked).
    fn checked<T>(
        &self,
        stream: StreamId,
        what: &'static str,
        touches: &[Touch],
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if let Some(capture) = self.capture_of(stream)? {
            let out = f()?;
            self.sanitizer.captured(capture, touches);
            return Ok(out);
        }
        self.sanitizer
            .enqueue(stream, super::label_or(what), touches, f)
    }

    /// A blocking stream call checked by the sanitizer (a capturing stream refuses it anyway).
    fn checked_blocking<T>(
        &self,
        stream: StreamId,
        what: &'static str,
        touches: &[Touch],
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if self.captured(stream)? {
            return f();
        }
        self.sanitizer
            .blocking(stream, super::label_or(what), touches, f)
    }
}

impl Driver for SanitizedDriver {
    fn layer(&self) -> Layer<'_> {
        Layer::Sanitized {
            sanitizer: &self.sanitizer,
            inner: &self.inner,
        }
    }

    crate::driver::capability::own_capabilities!(kernels, interop, vm, ipc, pinned, graphs);

    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn device_count(&self) -> usize {
        self.inner.device_count()
    }
    fn device_name(&self, device: usize) -> Result<String> {
        self.inner.device_name(device)
    }
    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.inner.mem_info(device)
    }

    fn malloc(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        let ptr = self.inner.malloc(device, size)?;
        self.sanitizer.mapped(ptr.0, size);
        Ok(ptr)
    }
    fn free(&self, ptr: DeviceAddr) -> Result<()> {
        // It drains every stream, but only the allocator frees segments (empty_cache, the
        // out-of-memory path, garbage collection): when it happens depends on memory pressure,
        // so it does not order the program's accesses (a race straddling it is still one).
        self.unmapping(ptr, || self.inner.free(ptr))
    }

    fn default_stream(&self, device: usize) -> Result<StreamId> {
        let stream = self.inner.default_stream(device)?;
        self.note_raw(device, stream);
        Ok(stream)
    }
    fn stream_create(&self, device: usize) -> Result<StreamId> {
        let stream = self.inner.stream_create(device)?;
        self.note_raw(device, stream);
        Ok(stream)
    }
    fn stream_destroy(&self, stream: StreamId) -> Result<()> {
        self.inner.stream_destroy(stream)?;
        // A later stream may get the same raw handle: it is a new actor.
        self.raws.lock().retain(|_, s| *s != stream);
        Ok(())
    }
    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        self.sanitizer()?
            .host_waits_stream(stream, || self.inner.stream_synchronize(stream))
    }
    fn stream_query(&self, stream: StreamId) -> Result<bool> {
        self.inner.stream_query(stream)
    }
    fn stream_device(&self, stream: StreamId) -> Result<usize> {
        self.inner.stream_device(stream)
    }

    fn event_create(&self, device: usize, flags: EventFlags) -> Result<EventId> {
        self.inner.event_create(device, flags)
    }
    fn event_destroy(&self, event: EventId) -> Result<()> {
        self.inner.event_destroy(event)?;
        self.sanitizer.event_destroyed(event);
        Ok(())
    }
    fn event_record(&self, event: EventId, stream: StreamId) -> Result<()> {
        if self.captured(stream)? {
            self.inner.event_record(event, stream)?;
            // A point of the capture: the event no longer stands for its last real record, so a
            // fork on it (a real stream's wait) orders nothing.
            self.sanitizer.event_destroyed(event);
            return Ok(());
        }
        self.sanitizer
            .event_record(event, stream, || self.inner.event_record(event, stream))
    }
    fn event_query(&self, event: EventId) -> Result<bool> {
        self.inner.event_query(event)
    }
    fn event_synchronize(&self, event: EventId) -> Result<()> {
        self.sanitizer()?
            .host_waits_event(event, || self.inner.event_synchronize(event))
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        if self.captured(stream)? {
            return self.inner.stream_wait_event(stream, event);
        }
        self.sanitizer.stream_wait_event(stream, event, || {
            self.inner.stream_wait_event(stream, event)
        })
    }

    unsafe fn copy_host_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: &[u8],
    ) -> Result<()> {
        let touch = [Touch::write(dst.0, src.len() as u64)];
        self.checked_blocking(stream, "copy_host_to_device", &touch, || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe { self.inner.copy_host_to_device(stream, dst, src) }
        })
    }
    unsafe fn copy_device_to_host(
        &self,
        stream: StreamId,
        dst: &mut [u8],
        src: DeviceAddr,
    ) -> Result<()> {
        let touch = [Touch::read(src.0, dst.len() as u64)];
        self.checked_blocking(stream, "copy_device_to_host", &touch, || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe { self.inner.copy_device_to_host(stream, dst, src) }
        })
    }
    unsafe fn copy_device_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()> {
        let touches = [Touch::read(src.0, len), Touch::write(dst.0, len)];
        self.checked(stream, "copy_device_to_device", &touches, || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe { self.inner.copy_device_to_device(stream, dst, src, len) }
        })
    }
    unsafe fn memset(&self, stream: StreamId, dst: DeviceAddr, value: u8, len: u64) -> Result<()> {
        self.checked(stream, "memset", &[Touch::write(dst.0, len)], || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe { self.inner.memset(stream, dst, value, len) }
        })
    }
}

impl Kernels for SanitizedDriver {
    unsafe fn fill_pattern(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<()> {
        self.checked(stream, "fill_pattern", &[Touch::write(dst.0, len)], || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe { self.inner.kernels().fill_pattern(stream, dst, len, seed) }
        })
    }
    unsafe fn count_pattern_mismatches(
        &self,
        stream: StreamId,
        src: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<u64> {
        let touch = [Touch::read(src.0, len)];
        self.checked_blocking(stream, "count_pattern_mismatches", &touch, || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe {
                self.inner
                    .kernels()
                    .count_pattern_mismatches(stream, src, len, seed)
            }
        })
    }
    unsafe fn poison(&self, stream: StreamId, dst: DeviceAddr, len: u64) -> Result<()> {
        self.checked(stream, "poison", &[Touch::write(dst.0, len)], || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe { self.inner.kernels().poison(stream, dst, len) }
        })
    }
    fn sleep(&self, stream: StreamId, micros: u64) -> Result<()> {
        self.checked(stream, "sleep", &[], || {
            self.inner.kernels().sleep(stream, micros)
        })
    }
}

impl Interop for SanitizedDriver {
    unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId> {
        // SAFETY: forwarded; the caller upholds the contract.
        let stream = unsafe { self.inner.interop().import_stream(device, raw) }?;
        self.note_raw(device, stream);
        Ok(stream)
    }
    fn raw_stream(&self, stream: StreamId) -> Result<u64> {
        self.inner.interop().raw_stream(stream)
    }
    unsafe fn launch_function(
        &self,
        stream: StreamId,
        function: u64,
        dims: crate::driver::capability::LaunchDims,
        params: &mut [*mut std::ffi::c_void],
        touches: &[Touch],
    ) -> Result<()> {
        // What the kernel touches, as its caller declares it (`Runtime::launch`: the operands).
        self.checked(stream, "a kernel launch", touches, || {
            // SAFETY: forwarded; the caller upholds the contract.
            unsafe {
                self.inner
                    .interop()
                    .launch_function(stream, function, dims, params, touches)
            }
        })
    }
}

impl VirtualMemory for SanitizedDriver {
    fn vm_granularity(&self, device: usize) -> Result<u64> {
        self.inner.vm().vm_granularity(device)
    }
    fn vm_reserve(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.inner.vm().vm_reserve(device, size)
    }
    fn vm_free_reservation(&self, base: DeviceAddr) -> Result<()> {
        self.inner.vm().vm_free_reservation(base)
    }
    fn vm_create_chunk(&self, device: usize, size: u64) -> Result<ChunkId> {
        self.inner.vm().vm_create_chunk(device, size)
    }
    fn vm_release_chunk(&self, chunk: ChunkId) -> Result<()> {
        self.inner.vm().vm_release_chunk(chunk)
    }
    fn vm_map(&self, addr: DeviceAddr, chunk: ChunkId) -> Result<()> {
        self.inner.vm().vm_map(addr, chunk)
    }
    fn vm_unmap(&self, addr: DeviceAddr, size: u64) -> Result<()> {
        // As `free`: page release is the allocator's, not the program's synchronization. Told
        // first, as `unmapping` says why.
        self.sanitizer.forget(addr.0, size);
        self.inner.vm().vm_unmap(addr, size)
    }
    fn vm_export_chunk(&self, chunk: ChunkId) -> Result<ExportedChunk> {
        self.inner.vm().vm_export_chunk(chunk)
    }
    fn vm_import_chunk(&self, device: usize, chunk: ExportedChunk, size: u64) -> Result<ChunkId> {
        self.inner.vm().vm_import_chunk(device, chunk, size)
    }
}

impl Ipc for SanitizedDriver {
    fn ipc_export_memory(&self, ptr: DeviceAddr) -> Result<IpcMemHandle> {
        self.inner.ipc().ipc_export_memory(ptr)
    }
    fn ipc_open_memory(&self, device: usize, handle: &IpcMemHandle) -> Result<OpenedSegment> {
        let opened = self.inner.ipc().ipc_open_memory(device, handle)?;
        self.sanitizer.mapped(opened.ptr.0, opened.size);
        Ok(opened)
    }
    fn ipc_close_memory(&self, ptr: DeviceAddr) -> Result<()> {
        // As `free`: the IPC layer's own step, not the program's synchronization.
        self.unmapping(ptr, || self.inner.ipc().ipc_close_memory(ptr))
    }
    fn ipc_export_event(&self, event: EventId) -> Result<IpcEventHandle> {
        self.inner.ipc().ipc_export_event(event)
    }
    fn ipc_open_event(&self, device: usize, handle: &IpcEventHandle) -> Result<EventId> {
        // What the event stands for is told by the IPC layer, which knows its producer
        // (`Sanitizer::remote_event`).
        self.inner.ipc().ipc_open_event(device, handle)
    }
}

impl PinnedHost for SanitizedDriver {
    fn host_alloc(&self, size: u64) -> Result<HostAddr> {
        let ptr = self.inner.pinned().host_alloc(size)?;
        self.sanitizer.mapped(ptr.0, size);
        Ok(ptr)
    }
    unsafe fn host_free(&self, ptr: HostAddr) -> Result<()> {
        // SAFETY: the caller's contract is the trait's.
        self.unmapping(DeviceAddr(ptr.0), || unsafe {
            self.inner.pinned().host_free(ptr)
        })
    }
    unsafe fn host_register(&self, ptr: HostAddr, size: u64) -> Result<()> {
        // SAFETY: the caller's contract is the trait's.
        unsafe { self.inner.pinned().host_register(ptr, size) }?;
        self.sanitizer.mapped(ptr.0, size);
        Ok(())
    }
    unsafe fn host_unregister(&self, ptr: HostAddr) -> Result<()> {
        // SAFETY: the caller's contract is the trait's.
        self.unmapping(DeviceAddr(ptr.0), || unsafe {
            self.inner.pinned().host_unregister(ptr)
        })
    }
    unsafe fn copy_pinned_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: HostAddr,
        len: u64,
    ) -> Result<()> {
        let touches = [Touch::read(src.0, len), Touch::write(dst.0, len)];
        self.checked(stream, "copy_pinned_to_device", &touches, || {
            // SAFETY: the caller's contract is the trait's.
            unsafe {
                self.inner
                    .pinned()
                    .copy_pinned_to_device(stream, dst, src, len)
            }
        })
    }
    unsafe fn copy_device_to_pinned(
        &self,
        stream: StreamId,
        dst: HostAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()> {
        let touches = [Touch::read(src.0, len), Touch::write(dst.0, len)];
        self.checked(stream, "copy_device_to_pinned", &touches, || {
            // SAFETY: the caller's contract is the trait's.
            unsafe {
                self.inner
                    .pinned()
                    .copy_device_to_pinned(stream, dst, src, len)
            }
        })
    }
}

impl Graphs for SanitizedDriver {
    fn stream_begin_capture(&self, stream: StreamId, mode: CaptureMode) -> Result<()> {
        self.inner.graphs().stream_begin_capture(stream, mode)
    }
    fn stream_end_capture(&self, stream: StreamId) -> Result<GraphId> {
        let capture = self.capture_of(stream)?;
        let ended = self.inner.graphs().stream_end_capture(stream);
        if let Some(capture) = capture {
            // Not the origin, or not this thread's: the capture goes on.
            if self.capture_of(stream)? != Some(capture) {
                self.sanitizer
                    .capture_ended(capture, ended.as_ref().ok().copied());
            }
        }
        ended
    }
    fn stream_capture_status(&self, stream: StreamId) -> Result<CaptureStatus> {
        self.inner.graphs().stream_capture_status(stream)
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> CaptureMode {
        self.inner.graphs().exchange_capture_mode(mode)
    }
    fn graph_instantiate(&self, graph: GraphId) -> Result<GraphExecId> {
        let exec = self.inner.graphs().graph_instantiate(graph)?;
        self.sanitizer.graph_instantiated(graph, exec);
        Ok(exec)
    }
    unsafe fn graph_launch(&self, exec: GraphExecId, stream: StreamId) -> Result<()> {
        // A replay is checked and recorded like eager work: one operation touching everything
        // the graph's nodes touch. A launch on a capturing stream is refused by every backend.
        if self.captured(stream)? {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            return unsafe { self.inner.graphs().graph_launch(exec, stream) };
        }
        let (touches, born) = self.sanitizer()?.exec_touches(exec);
        self.sanitizer.launch(exec, born, stream, &touches, || {
            // SAFETY: the caller's contract is the trait's, forwarded unchanged.
            unsafe { self.inner.graphs().graph_launch(exec, stream) }
        })
    }
    fn graph_destroy(&self, graph: GraphId) -> Result<()> {
        self.inner.graphs().graph_destroy(graph)?;
        self.sanitizer.graph_destroyed(graph);
        Ok(())
    }
    fn graph_exec_destroy(&self, exec: GraphExecId) -> Result<()> {
        self.inner.graphs().graph_exec_destroy(exec)?;
        self.sanitizer.exec_destroyed(exec);
        Ok(())
    }
    fn graph_node_count(&self, graph: GraphId) -> Result<usize> {
        self.inner.graphs().graph_node_count(graph)
    }
}
