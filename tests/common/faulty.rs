//! A driver that delegates to a host driver and fails chosen operations on demand: the test double
//! for error paths the host backend cannot be made to take (a device copy that fails, an event that
//! cannot be created). It implements the core and the capabilities it checks (virtual memory,
//! page-locked host memory); the others are the host driver's, forwarded by their accessors.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudalloc::backend::capability::{Graphs, Interop, Ipc, Kernels, PinnedHost, VirtualMemory};
use cudalloc::backend::HostDriver;
use cudalloc::{
    backend::Backend, backend::Driver, backend::EventFlags, backend::EventId, backend::HostAddr,
    backend::MemInfo, DeviceAddr, Error, Result, StreamId,
};

/// Operations a [`FaultyDriver`] can be told to fail.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// `copy_device_to_device` fails without enqueueing anything.
    pub device_copies: AtomicBool,
    /// `event_create` fails.
    pub event_creation: AtomicBool,
    /// Events created so far.
    pub events_created: std::sync::atomic::AtomicU64,
    /// The copies to and from pinned host memory panic before enqueueing anything (as a driver
    /// in the stream sanitizer's panic mode does on a hazard).
    pub pinned_copies_panic: AtomicBool,
    /// Every memory call (`malloc`, `free`, `vm_map`, `vm_unmap`) as `(call, address, size)`, in
    /// call order, with whatever else a test appends (to check what comes before what).
    pub memory_calls: std::sync::Mutex<Vec<(&'static str, u64, u64)>>,
    /// Called (once, then cleared) just before the next `event_record` on the given stream: a
    /// test's way into the moment between a decision and the call that carries it out.
    pub before_record: std::sync::Mutex<Option<(StreamId, RecordHook)>>,
}

/// A hook of [`Faults::before_record`].
pub(crate) struct RecordHook(pub Box<dyn FnOnce() + Send>);

impl std::fmt::Debug for RecordHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordHook")
    }
}

impl Faults {
    /// Appends `(call, addr, size)` to [`Faults::memory_calls`].
    pub(crate) fn log(&self, call: &'static str, addr: u64, size: u64) {
        self.memory_calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((call, addr, size));
    }

    /// A copy of [`Faults::memory_calls`].
    pub(crate) fn calls(&self) -> Vec<(&'static str, u64, u64)> {
        self.memory_calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct FaultyDriver {
    /// The driver doing the work.
    pub inner: Arc<HostDriver>,
    /// What fails now.
    pub faults: Arc<Faults>,
}

impl FaultyDriver {
    /// Wraps `inner`.
    pub(crate) fn new(inner: Arc<HostDriver>) -> Self {
        FaultyDriver {
            inner,
            faults: Arc::default(),
        }
    }
}

fn injected(call: &'static str) -> Error {
    Error::Driver {
        source: None,
        backend: "host",
        call,
        message: "failure injected by the test".into(),
    }
}

fn check(flag: &AtomicBool, call: &'static str) -> Result<()> {
    if flag.load(Ordering::SeqCst) {
        Err(injected(call))
    } else {
        Ok(())
    }
}

impl Driver for FaultyDriver {
    fn kernels(&self) -> &dyn Kernels {
        self.inner.kernels()
    }

    fn interop(&self) -> &dyn Interop {
        self.inner.interop()
    }

    fn vm(&self) -> &dyn VirtualMemory {
        self
    }

    fn ipc(&self) -> &dyn Ipc {
        self.inner.ipc()
    }

    fn pinned(&self) -> &dyn PinnedHost {
        self
    }

    fn graphs(&self) -> &dyn Graphs {
        self.inner.graphs()
    }

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
        self.faults.log("malloc", ptr.0, size);
        Ok(ptr)
    }
    fn free(&self, ptr: DeviceAddr) -> Result<()> {
        self.faults.log("free", ptr.0, 0);
        self.inner.free(ptr)
    }
    fn default_stream(&self, device: usize) -> Result<StreamId> {
        self.inner.default_stream(device)
    }
    fn stream_create(&self, device: usize) -> Result<StreamId> {
        self.inner.stream_create(device)
    }
    fn stream_destroy(&self, stream: StreamId) -> Result<()> {
        self.inner.stream_destroy(stream)
    }
    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        self.inner.stream_synchronize(stream)
    }
    fn stream_query(&self, stream: StreamId) -> Result<bool> {
        self.inner.stream_query(stream)
    }
    fn stream_device(&self, stream: StreamId) -> Result<usize> {
        self.inner.stream_device(stream)
    }
    fn event_create(&self, device: usize, flags: EventFlags) -> Result<EventId> {
        check(&self.faults.event_creation, "event_create")?;
        self.faults.events_created.fetch_add(1, Ordering::SeqCst);
        self.inner.event_create(device, flags)
    }
    fn event_destroy(&self, event: EventId) -> Result<()> {
        self.inner.event_destroy(event)
    }
    fn event_record(&self, event: EventId, stream: StreamId) -> Result<()> {
        let hook = {
            let mut armed = self
                .faults
                .before_record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match armed.take() {
                Some((on, hook)) if on == stream => Some(hook),
                other => {
                    *armed = other;
                    None
                }
            }
        };
        if let Some(RecordHook(hook)) = hook {
            hook();
        }
        self.inner.event_record(event, stream)
    }
    fn event_query(&self, event: EventId) -> Result<bool> {
        self.inner.event_query(event)
    }
    fn event_synchronize(&self, event: EventId) -> Result<()> {
        self.inner.event_synchronize(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        self.inner.stream_wait_event(stream, event)
    }
    unsafe fn copy_host_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: &[u8],
    ) -> Result<()> {
        // SAFETY: the caller's contract is the trait's, forwarded unchanged.
        unsafe { self.inner.copy_host_to_device(stream, dst, src) }
    }
    unsafe fn copy_device_to_host(
        &self,
        stream: StreamId,
        dst: &mut [u8],
        src: DeviceAddr,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the trait's, forwarded unchanged.
        unsafe { self.inner.copy_device_to_host(stream, dst, src) }
    }
    unsafe fn copy_device_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()> {
        check(&self.faults.device_copies, "copy_device_to_device")?;
        // SAFETY: the caller's contract is the trait's, forwarded unchanged.
        unsafe { self.inner.copy_device_to_device(stream, dst, src, len) }
    }
    unsafe fn memset(&self, stream: StreamId, dst: DeviceAddr, value: u8, len: u64) -> Result<()> {
        // SAFETY: the caller's contract is the trait's, forwarded unchanged.
        unsafe { self.inner.memset(stream, dst, value, len) }
    }
}

impl VirtualMemory for FaultyDriver {
    fn vm_granularity(&self, device: usize) -> Result<u64> {
        self.inner.vm_granularity(device)
    }
    fn vm_reserve(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.inner.vm_reserve(device, size)
    }
    fn vm_free_reservation(&self, base: DeviceAddr) -> Result<()> {
        self.inner.vm_free_reservation(base)
    }
    fn vm_create_chunk(&self, device: usize, size: u64) -> Result<cudalloc::backend::ChunkId> {
        self.inner.vm_create_chunk(device, size)
    }
    fn vm_release_chunk(&self, chunk: cudalloc::backend::ChunkId) -> Result<()> {
        self.inner.vm_release_chunk(chunk)
    }
    fn vm_map(&self, addr: DeviceAddr, chunk: cudalloc::backend::ChunkId) -> Result<()> {
        self.inner.vm_map(addr, chunk)?;
        self.faults.log("vm_map", addr.0, 0);
        Ok(())
    }
    fn vm_unmap(&self, addr: DeviceAddr, size: u64) -> Result<()> {
        self.faults.log("vm_unmap", addr.0, size);
        self.inner.vm_unmap(addr, size)
    }
    fn vm_export_chunk(
        &self,
        chunk: cudalloc::backend::ChunkId,
    ) -> Result<cudalloc::backend::ExportedChunk> {
        self.inner.vm_export_chunk(chunk)
    }
    fn vm_import_chunk(
        &self,
        device: usize,
        chunk: cudalloc::backend::ExportedChunk,
        size: u64,
    ) -> Result<cudalloc::backend::ChunkId> {
        self.inner.vm_import_chunk(device, chunk, size)
    }
}

impl PinnedHost for FaultyDriver {
    fn host_alloc(&self, size: u64) -> Result<HostAddr> {
        self.inner.host_alloc(size)
    }
    unsafe fn host_free(&self, ptr: HostAddr) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.host_free(ptr) }
    }
    unsafe fn host_register(&self, ptr: HostAddr, size: u64) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.host_register(ptr, size) }
    }
    unsafe fn host_unregister(&self, ptr: HostAddr) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.host_unregister(ptr) }
    }
    unsafe fn copy_pinned_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: HostAddr,
        len: u64,
    ) -> Result<()> {
        assert!(
            !self.faults.pinned_copies_panic.load(Ordering::SeqCst),
            "panic injected by the test (copy_pinned_to_device)"
        );
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.copy_pinned_to_device(stream, dst, src, len) }
    }
    unsafe fn copy_device_to_pinned(
        &self,
        stream: StreamId,
        dst: HostAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()> {
        assert!(
            !self.faults.pinned_copies_panic.load(Ordering::SeqCst),
            "panic injected by the test (copy_device_to_pinned)"
        );
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.copy_device_to_pinned(stream, dst, src, len) }
    }
}
