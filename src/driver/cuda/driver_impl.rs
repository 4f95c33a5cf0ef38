//! `impl Driver for CudaDriver`: each method validates through the driver's tables, binds the
//! device's context and makes one or two driver calls.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUresult};

use super::{check, CudaDriver, EventEntry, EventHandle, SegmentEntry, StreamEntry, StreamHandle};
use crate::driver::{
    ranges, Backend, DeviceAddr, Driver, EventFlags, EventId, IpcEventHandle, IpcMemHandle,
    MemInfo, OpenedSegment, StreamId, IPC_HANDLE_SIZE,
};
use crate::driver::{Graphs, Interop, Ipc, Kernels, PinnedHost, VirtualMemory};
use crate::error::{Error, Result};

/// `cuMemAlloc`'s result: out-of-memory is decided by the result code (never by message text).
fn alloc_result(device: usize, requested: u64, rc: CUresult) -> Result<()> {
    if rc == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(Error::OutOfMemory {
            device,
            requested,
            message: format!("cuMemAlloc_v2 of {requested} bytes: {rc:?}"),
        });
    }
    check("cuMemAlloc_v2", rc)
}

fn query_result(call: &'static str, rc: CUresult) -> Result<bool> {
    match rc {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => check(call, other).map(|()| false),
    }
}

fn as_chars(bytes: &[u8; IPC_HANDLE_SIZE]) -> [std::ffi::c_char; IPC_HANDLE_SIZE] {
    bytes.map(|b| b as std::ffi::c_char)
}

fn as_bytes(chars: &[std::ffi::c_char; IPC_HANDLE_SIZE]) -> [u8; IPC_HANDLE_SIZE] {
    chars.map(|c| c as u8)
}

impl CudaDriver {
    /// Synchronizes every device (what `cudaFree` does before freeing). Refused, before any
    /// CUDA call, while a capture begun through this driver is under way: CUDA would refuse the
    /// synchronize and invalidate that capture.
    pub(super) fn synchronize_all(&self) -> Result<()> {
        self.refuse_during_captures(
            "freeing or unmapping device memory (it synchronizes every device)",
        )?;
        for device in 0..self.devices.len() {
            self.bind(device)?;
            // SAFETY: a context is current (bound above).
            check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        }
        Ok(())
    }

    fn launch_args(
        &self,
        stream: StreamId,
        kernel: impl FnOnce(&super::Kernels) -> super::FunctionHandle,
    ) -> Result<(StreamEntry, super::FunctionHandle)> {
        let entry = self.stream(stream)?;
        let f = kernel(&self.kernels(entry.device)?);
        self.bind(entry.device)?;
        Ok((entry, f))
    }
}

impl Driver for CudaDriver {
    crate::driver::capability::own_capabilities!(kernels, interop, vm, ipc, pinned, graphs);

    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn device_name(&self, device: usize) -> Result<String> {
        let dev = self.device(device)?;
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 chars and cuDeviceGetName writes at most `len` of them.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), 256, dev.ordinal)
        })?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.bind(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers are valid; a context is current.
        check("cuMemGetInfo_v2", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        // The driver's counter page counts as free (see `mod.rs`).
        let free = (free as u64)
            .saturating_add(self.scratch_bytes(device))
            .min(total as u64);
        Ok(MemInfo {
            free,
            total: total as u64,
        })
    }

    fn malloc(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.bind(device)?;
        if size == 0 {
            return Err(Error::invalid("malloc of 0 bytes"));
        }
        let bytes = usize::try_from(size)
            .map_err(|_| Error::invalid(format!("size {size} exceeds the address space")))?;
        let total = match self.device(device)?.total.get() {
            Some(&t) => t,
            None => {
                let t = self.mem_info(device)?.total;
                *self.device(device)?.total.get_or_init(|| t)
            }
        };
        if size > total {
            // CUDA answers absurd sizes with CUDA_ERROR_INVALID_VALUE; it is out of memory.
            return Err(Error::OutOfMemory {
                device,
                requested: size,
                message: format!("requested {size} bytes; the device has {total} bytes in total"),
            });
        }
        let mut ptr = 0;
        // SAFETY: out-pointer valid; a context is current.
        alloc_result(device, size, unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) })?;
        self.segment_table()?.write().insert(
            ptr,
            SegmentEntry {
                device,
                size,
                opened_from: None,
                exported_as: None,
            },
        );
        Ok(DeviceAddr(ptr))
    }

    fn free(&self, ptr: DeviceAddr) -> Result<()> {
        let entry = {
            let mut segments = self.segment_table()?.write();
            match segments.get(&ptr.0) {
                Some(SegmentEntry {
                    opened_from: None, ..
                }) => segments.remove(&ptr.0),
                Some(_) => return Err(ranges::opened_not_owned(ptr)),
                None => return Err(ranges::not_a_segment_base(ptr)),
            }
        };
        let device = entry.map_or(0, |e| e.device);
        // Like the host backend (and cudaFree): queued work on the segment finishes first. A
        // synchronize CUDA refuses (a stream of the device is being captured) leaves the segment
        // live and in the table: nothing was freed.
        if let Err(err) = self.synchronize_all() {
            if let Some(e) = entry {
                self.segment_table()?.write().insert(ptr.0, e);
            }
            return Err(err);
        }
        if let Some(handle) = entry.and_then(|e| e.exported_as) {
            super::process_ipc::unexported(&handle);
        }
        self.bind(device)?;
        // SAFETY: `ptr` is the base of a live cuMemAlloc segment (checked and removed above).
        check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn default_stream(&self, device: usize) -> Result<StreamId> {
        Ok(self.device(device)?.default_stream)
    }

    fn stream_create(&self, device: usize) -> Result<StreamId> {
        self.bind(device)?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: out-pointer valid; a context is current.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, flags)
        })?;
        let id = self.ids.stream(device)?;
        self.streams.insert(
            id.0,
            StreamEntry {
                device,
                raw: StreamHandle(raw),
                borrowed: false,
            },
        );
        Ok(id)
    }

    fn stream_destroy(&self, stream: StreamId) -> Result<()> {
        if self.devices.iter().any(|d| d.default_stream == stream) {
            return Err(Error::invalid("the default stream cannot be destroyed"));
        }
        let entry = self.streams.remove(stream.0)?;
        if entry.borrowed {
            return Ok(());
        }
        self.bind(entry.device)?;
        // SAFETY: the stream was created by this driver and is removed from the table, so it is
        // destroyed exactly once.
        check("cuStreamDestroy_v2", unsafe {
            sys::cuStreamDestroy_v2(entry.raw.0)
        })
    }

    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        let entry = self.stream(stream)?;
        // SAFETY: live stream of this driver; its context is bound.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(entry.raw.0)
        })
    }

    fn stream_query(&self, stream: StreamId) -> Result<bool> {
        let entry = self.stream(stream)?;
        // SAFETY: live stream of this driver; its context is bound.
        query_result("cuStreamQuery", unsafe { sys::cuStreamQuery(entry.raw.0) })
    }

    fn stream_device(&self, stream: StreamId) -> Result<usize> {
        Ok(self.stream(stream)?.device)
    }

    fn event_create(&self, device: usize, flags: EventFlags) -> Result<EventId> {
        self.bind(device)?;
        let bits = if flags.interprocess {
            sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
                | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-pointer valid; a context is current.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, bits)
        })?;
        let id = self.fresh_id();
        self.events.insert(
            id,
            EventEntry {
                device,
                raw: EventHandle(raw),
                interprocess: flags.interprocess,
                opened: false,
            },
        );
        Ok(EventId(id))
    }

    fn event_destroy(&self, event: EventId) -> Result<()> {
        let entry = self.events.remove(event.0)?;
        self.bind(entry.device)?;
        // SAFETY: created or opened by this driver, removed from the table: destroyed once.
        check("cuEventDestroy_v2", unsafe {
            sys::cuEventDestroy_v2(entry.raw.0)
        })
    }

    fn event_record(&self, event: EventId, stream: StreamId) -> Result<()> {
        let e = self.event(event)?;
        let s = self.stream(stream)?;
        if e.device != s.device {
            return Err(Error::invalid(format!(
                "event {} is on device {} but stream {} is on device {}",
                event.0, e.device, stream.0, s.device
            )));
        }
        // SAFETY: live event and stream of the same context (bound).
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(e.raw.0, s.raw.0)
        })
    }

    fn event_query(&self, event: EventId) -> Result<bool> {
        let e = self.event(event)?;
        // SAFETY: live event; context bound.
        query_result("cuEventQuery", unsafe { sys::cuEventQuery(e.raw.0) })
    }

    fn event_synchronize(&self, event: EventId) -> Result<()> {
        let e = self.event(event)?;
        // SAFETY: live event; context bound.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(e.raw.0)
        })
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        let e = self.event(event)?;
        let s = self.stream(stream)?;
        // SAFETY: live stream and event; the stream's context is bound.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(s.raw.0, e.raw.0, 0)
        })
    }

    unsafe fn copy_host_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: &[u8],
    ) -> Result<()> {
        let (_held, _) = self.hold_ranges([(dst, src.len() as u64)])?;
        let s = self.stream(stream)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the destination range lies in a live segment; `src` stays borrowed until the
        // stream synchronize below returns, so the async copy never reads freed host memory.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr().cast(), src.len(), s.raw.0)
        })?;
        // SAFETY: live stream; context bound.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s.raw.0)
        })
    }

    unsafe fn copy_device_to_host(
        &self,
        stream: StreamId,
        dst: &mut [u8],
        src: DeviceAddr,
    ) -> Result<()> {
        let (_held, _) = self.hold_ranges([(src, dst.len() as u64)])?;
        let s = self.stream(stream)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the source range lies in a live segment; `dst` stays mutably borrowed until the
        // stream synchronize below returns.
        check("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src.0, dst.len(), s.raw.0)
        })?;
        // SAFETY: live stream; context bound.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s.raw.0)
        })
    }

    unsafe fn copy_device_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()> {
        let (_held, n) = self.hold_ranges([(dst, len), (src, len)])?;
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie in live segments; the copy is stream-ordered device work.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, n, s.raw.0)
        })
    }

    unsafe fn memset(&self, stream: StreamId, dst: DeviceAddr, value: u8, len: u64) -> Result<()> {
        let (_held, n) = self.hold_ranges([(dst, len)])?;
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the range lies in a live segment.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst.0, value, n, s.raw.0)
        })
    }
}

impl Kernels for CudaDriver {
    unsafe fn fill_pattern(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<()> {
        let (_held, _) = self.hold_ranges([(dst, len)])?;
        let (s, f) = self.launch_args(stream, |k| k.fill)?;
        let (mut p, mut n, mut sd) = (dst.0, len, seed);
        let mut args = [
            (&mut p as *mut u64).cast::<c_void>(),
            (&mut n as *mut u64).cast(),
            (&mut sd as *mut u64).cast(),
        ];
        self.launch(f, s, len.div_ceil(8), &mut args)
    }

    unsafe fn count_pattern_mismatches(
        &self,
        stream: StreamId,
        src: DeviceAddr,
        len: u64,
        seed: u64,
    ) -> Result<u64> {
        let (_held, _) = self.hold_ranges([(src, len)])?;
        let (s, f) = self.launch_args(stream, |k| k.count)?;
        self.refuse_capturing(&s, "count_pattern_mismatches")?;
        // A slot of the device's counter page (see `mod.rs`): no allocation or free here — a
        // free would synchronize the device, illegal while any stream of it is being captured.
        let counter = self.take_counter(s.device)?;
        let result = (|| {
            // SAFETY: `counter` is an 8-byte allocation this call holds alone.
            check("cuMemsetD8Async", unsafe {
                sys::cuMemsetD8Async(counter, 0, 8, s.raw.0)
            })?;
            let (mut p, mut n, mut sd, mut c) = (src.0, len, seed, counter);
            let mut args = [
                (&mut p as *mut u64).cast::<c_void>(),
                (&mut n as *mut u64).cast(),
                (&mut sd as *mut u64).cast(),
                (&mut c as *mut u64).cast(),
            ];
            self.launch(f, s, len.div_ceil(8), &mut args)?;
            let mut host = 0u64;
            // SAFETY: 8 bytes from the counter into a live u64; synchronized right after.
            check("cuMemcpyDtoHAsync_v2", unsafe {
                sys::cuMemcpyDtoHAsync_v2((&mut host as *mut u64).cast(), counter, 8, s.raw.0)
            })?;
            // SAFETY: live stream.
            check("cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(s.raw.0)
            })?;
            Ok(host)
        })();
        // Back to the free slots only when no work of this call can still touch it (a failed
        // count's slot stays out: its kernel may still be queued).
        if result.is_ok() {
            self.give_counter(s.device, counter);
        }
        result
    }

    unsafe fn poison(&self, stream: StreamId, dst: DeviceAddr, len: u64) -> Result<()> {
        let (_held, _) = self.hold_ranges([(dst, len)])?;
        let (s, f) = self.launch_args(stream, |k| k.poison)?;
        let (mut p, mut n) = (dst.0, len);
        let mut args = [
            (&mut p as *mut u64).cast::<c_void>(),
            (&mut n as *mut u64).cast(),
        ];
        self.launch(f, s, len, &mut args)
    }

    fn sleep(&self, stream: StreamId, micros: u64) -> Result<()> {
        let (s, f) = self.launch_args(stream, |k| k.sleep)?;
        let mut nanos = micros.saturating_mul(1000);
        let mut args = [(&mut nanos as *mut u64).cast::<c_void>()];
        self.launch(f, s, 1, &mut args)
    }
}

impl Interop for CudaDriver {
    unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId> {
        let ctx = self.device(device)?.context;
        self.bind(device)?;
        let handle = raw as usize as sys::CUstream;
        if !handle.is_null() {
            let mut owner = std::ptr::null_mut();
            // SAFETY: the caller guarantees `raw` is a live CUstream; out-pointer valid.
            check("cuStreamGetCtx", unsafe {
                sys::cuStreamGetCtx(handle, &mut owner)
            })?;
            if owner != ctx.0 {
                return Err(Error::invalid(format!(
                    "stream {raw:#x} belongs to another context than device {device}'s primary \
                     context, which cudalloc uses"
                )));
            }
        }
        // One id per raw stream, however often it is imported (the legacy stream's is the
        // default stream's): one shard. A stream this driver made keeps its own id apart from an
        // imported one, which `stream_destroy` only forgets.
        let id = self.streams.find_or_insert(
            |entry| entry.borrowed && entry.device == device && entry.raw.0 == handle,
            || Ok(self.ids.stream(device)?.0),
            || StreamEntry {
                device,
                raw: StreamHandle(handle),
                borrowed: true,
            },
        )?;
        Ok(StreamId(id))
    }

    fn raw_stream(&self, stream: StreamId) -> Result<u64> {
        Ok(self.streams.get(stream.0)?.raw.0 as usize as u64)
    }

    unsafe fn launch_function(
        &self,
        stream: StreamId,
        function: u64,
        dims: crate::driver::capability::LaunchDims,
        params: &mut [*mut c_void],
        _touches: &[crate::driver::access::Touch],
    ) -> Result<()> {
        let entry = self.stream(stream)?;
        self.bind(entry.device)?;
        let [gx, gy, gz] = dims.grid;
        let [bx, by, bz] = dims.block;
        let shared_bytes = u32::try_from(dims.shared_bytes).map_err(|_| {
            Error::invalid(format!(
                "{} bytes of dynamic shared memory: CUDA takes at most {}",
                dims.shared_bytes,
                u32::MAX
            ))
        })?;
        // SAFETY: the caller guarantees `function` is a live kernel of this device's context
        // (bound above) and `params` points at values of the types it declares; cuLaunchKernel
        // copies them before returning.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function as usize as sys::CUfunction,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                shared_bytes,
                entry.raw.0,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl VirtualMemory for CudaDriver {
    crate::driver::forward_vm_methods!(door);
}

impl Ipc for CudaDriver {
    fn ipc_export_memory(&self, ptr: DeviceAddr) -> Result<IpcMemHandle> {
        let entry = self.segment_table()?.read().get(&ptr.0).copied().ok_or_else(|| {
            Error::invalid(format!("pointer {ptr} is not the base of a segment allocated by this driver (IPC handles name whole segments)"))
        })?;
        if entry.opened_from.is_some() {
            return Err(Error::invalid(format!(
                "segment {ptr} was opened from another process; only its owner can export it"
            )));
        }
        self.bind(entry.device)?;
        // SAFETY: CUipcMemHandle is a plain array of 64 chars; zero is a valid value.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: out-pointer valid; `ptr` is a live cuMemAlloc segment base.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, ptr.0)
        })?;
        let bytes = as_bytes(&handle.reserved);
        // Noted under the segment table's lock, so a concurrent free cannot miss it.
        let mut segments = self.segment_table()?.write();
        match segments.get_mut(&ptr.0) {
            Some(e) => e.exported_as = Some(bytes),
            None => return Err(ranges::not_a_segment_base(ptr)),
        }
        super::process_ipc::exported(bytes);
        Ok(IpcMemHandle(bytes))
    }

    fn ipc_open_memory(&self, device: usize, handle: &IpcMemHandle) -> Result<OpenedSegment> {
        self.bind(device)?;
        if !self.opened_table()?.lock().insert(handle.0) {
            return Err(Error::invalid("this IPC memory handle is already open in this process; cache the mapping and reuse it"));
        }
        let mapped = super::process_ipc::open(device, &handle.0, || {
            let raw = sys::CUipcMemHandle {
                reserved: as_chars(&handle.0),
            };
            let mut ptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: out-pointer valid; the driver validates the handle bytes itself.
            check("cuIpcOpenMemHandle_v2", unsafe {
                sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, flags)
            })
            .map_err(|err| match err {
                Error::Driver { message, .. } => {
                    Error::bad_handle(format!("cuIpcOpenMemHandle refused the handle: {message}"))
                }
                other => other,
            })?;
            let (mut base, mut size) = (0, 0usize);
            // SAFETY: out-pointers valid; `ptr` was just mapped.
            let sized = check("cuMemGetAddressRange_v2", unsafe {
                sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
            });
            if let Err(err) = sized {
                // SAFETY: mapped just above and known to no one else.
                let closed = check("cuIpcCloseMemHandle", unsafe {
                    sys::cuIpcCloseMemHandle(ptr)
                });
                if let Err(close_err) = closed {
                    tracing::error!(err = %close_err, ptr,
                        "closing an IPC mapping whose size could not be read failed; it stays mapped");
                }
                return Err(err);
            }
            Ok((ptr, size as u64))
        });
        match mapped {
            Ok((ptr, size)) => {
                self.segment_table()?.write().insert(
                    ptr,
                    SegmentEntry {
                        device,
                        size,
                        opened_from: Some(handle.0),
                        exported_as: None,
                    },
                );
                Ok(OpenedSegment {
                    ptr: DeviceAddr(ptr),
                    size,
                })
            }
            Err(err) => {
                self.opened_table()?.lock().remove(&handle.0);
                Err(err)
            }
        }
    }

    fn ipc_close_memory(&self, ptr: DeviceAddr) -> Result<()> {
        let entry = {
            let mut segments = self.segment_table()?.write();
            match segments.get(&ptr.0).copied() {
                Some(
                    e @ SegmentEntry {
                        opened_from: Some(_),
                        ..
                    },
                ) => {
                    segments.remove(&ptr.0);
                    e
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "pointer {ptr} is not the base of a segment opened from an IPC handle"
                    )))
                }
            }
        };
        let Some(handle) = entry.opened_from else {
            return Ok(());
        };
        self.opened_table()?.lock().remove(&handle);
        self.synchronize_all()?;
        super::process_ipc::close(entry.device, &handle, || {
            self.bind(entry.device)?;
            // SAFETY: `ptr` was returned by cuIpcOpenMemHandle and this is the process's last
            // user of the mapping (counted in process_ipc), so it is closed exactly once.
            check("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(ptr.0)
            })
        })
    }

    fn ipc_export_event(&self, event: EventId) -> Result<IpcEventHandle> {
        let e = self.event(event)?;
        if !e.interprocess || e.opened {
            return Err(Error::invalid(format!(
                "event {} was not created here with the interprocess flag",
                event.0
            )));
        }
        // SAFETY: CUipcEventHandle is a plain array of 64 chars; zero is a valid value.
        let mut handle: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: out-pointer valid; live interprocess event; context bound.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut handle, e.raw.0)
        })?;
        Ok(IpcEventHandle(as_bytes(&handle.reserved)))
    }

    fn ipc_open_event(&self, device: usize, handle: &IpcEventHandle) -> Result<EventId> {
        self.bind(device)?;
        let raw_handle = sys::CUipcEventHandle {
            reserved: as_chars(&handle.0),
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-pointer valid; the driver validates the handle bytes.
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut raw, raw_handle)
        })
        .map_err(|e| Error::bad_handle(format!("cuIpcOpenEventHandle refused the handle: {e}")))?;
        let id = self.fresh_id();
        self.events.insert(
            id,
            EventEntry {
                device,
                raw: EventHandle(raw),
                interprocess: true,
                opened: true,
            },
        );
        Ok(EventId(id))
    }
}

impl PinnedHost for CudaDriver {
    crate::driver::host_memory::forward_host_memory_methods!(door);
}

impl Graphs for CudaDriver {
    crate::driver::forward_capture_methods!(door);
}
