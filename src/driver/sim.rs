//! [`SimDriver`]: a simulated device that hands out addresses and enforces a capacity but backs
//! nothing — no memory is touched, no work runs — so an allocation trace of any size (an 80 GiB
//! training run) replays through the real allocator on a laptop in seconds (`cudalloc replay`).
//!
//! | what                        | here                                                          |
//! |-----------------------------|---------------------------------------------------------------|
//! | `malloc` / `free`           | a fresh address range (never reused), counted against the capacity |
//! | virtual memory              | reservations, chunks and mappings checked as on CUDA (`vm_space.rs`); chunks count against the capacity |
//! | streams, events             | ids (a stream's carries its device, as on the other backends); all work is complete the moment it is enqueued |
//! | copies, fills, kernels      | the ranges are checked, nothing is read or written            |
//! | reading memory back         | an error (`copy_device_to_host`, the verify kernel): nothing is stored |
//! | IPC                         | an error: nothing exists outside this process                 |
//!
//! Addresses start at 1 TiB and grow; segments are 512-byte aligned and reservations aligned to the
//! granularity (2 MiB, CUDA's), so the allocator sees the layout a GPU gives it.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::vm_space::VmSpace;
use super::{
    ranges, Backend, ChunkId, DeviceAddr, Driver, DriverTag, EventFlags, EventId, IpcEventHandle,
    IpcMemHandle, MemInfo, OpenedSegment, StreamId,
};
use crate::driver::{Interop, Ipc, Kernels, VirtualMemory};
use crate::error::{Error, Result};
use crate::sync::os::Mutex;

/// Granularity of the simulated virtual memory (CUDA's on current GPUs).
const GRANULARITY: u64 = 2 << 20;
/// Where addresses start.
const FIRST_ADDRESS: u64 = 1 << 40;
/// The most simulated devices (a trace naming device 10⁹ is corrupt, not a machine).
pub const MAX_SIM_DEVICES: usize = 1024;

#[derive(Debug, Default)]
struct State {
    next_address: u64,
    next_id: u64,
    used: Vec<u64>,
    /// Segments by base: (device, size).
    segments: BTreeMap<u64, (usize, u64)>,
    /// Streams: id → device.
    streams: HashMap<u64, usize>,
    events: HashSet<u64>,
    /// Chunks: id → (device, size).
    chunks: HashMap<u64, (usize, u64)>,
    vm: VmSpace<u64>,
    /// How many mappings each mapped chunk has.
    mappings: HashMap<u64, u32>,
    /// Chunks released while still mapped: their bytes go at their last unmap.
    released_mapped: HashMap<u64, (usize, u64)>,
}

/// A device that backs nothing: see `src/driver/sim.rs`.
#[derive(Debug)]
pub struct SimDriver {
    capacity: u64,
    devices: usize,
    /// The driver's number its stream ids carry.
    driver: DriverTag,
    state: Mutex<State>,
}

fn nothing_stored(what: &str) -> Error {
    Error::invalid(format!(
        "{what}: the simulated device stores nothing (it replays allocations only)"
    ))
}

fn no_ipc() -> Error {
    Error::invalid("the simulated device cannot share memory between processes")
}

impl SimDriver {
    /// `devices` simulated devices of `capacity` bytes each.
    pub fn new(devices: usize, capacity: u64) -> Result<Self> {
        if devices == 0 || capacity == 0 || devices > MAX_SIM_DEVICES {
            return Err(Error::invalid(format!(
                "a simulated driver needs 1 to {MAX_SIM_DEVICES} devices and a capacity \
                 ({devices} devices of {capacity} bytes asked)"
            )));
        }
        // Device `d`'s default stream is number `d + 1` of that device; fresh numbers come after
        // them. Every stream id carries its device's bits (`StreamId::new`), as on the other
        // backends, so the allocator finds a stream's device without asking.
        let driver = DriverTag::fresh();
        let streams = (0..devices)
            .map(|d| Ok((Self::default_id(driver, d)?.0, d)))
            .collect::<Result<_>>()?;
        Ok(SimDriver {
            capacity,
            devices,
            driver,
            state: Mutex::new(State {
                next_address: FIRST_ADDRESS,
                next_id: devices as u64,
                used: vec![0; devices],
                streams,
                ..State::default()
            }),
        })
    }

    /// The id of `device`'s default stream.
    fn default_id(driver: DriverTag, device: usize) -> Result<StreamId> {
        StreamId::new(driver, device, device as u64 + 1)
    }

    fn check_device(&self, device: usize) -> Result<()> {
        if device >= self.devices {
            return Err(Error::invalid(format!(
                "device {device} does not exist (the simulated driver has {})",
                self.devices
            )));
        }
        Ok(())
    }

    fn check_granular(what: &str, size: u64) -> Result<()> {
        if size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(Error::invalid(format!(
                "{what} of {size} bytes: a positive multiple of the granularity ({GRANULARITY} bytes)"
            )));
        }
        Ok(())
    }

    /// Charges `size` bytes to `device` or fails with out-of-memory.
    fn charge(&self, st: &mut State, device: usize, size: u64) -> Result<()> {
        let used = st.used[device];
        match used.checked_add(size) {
            Some(total) if total <= self.capacity => {
                st.used[device] = total;
                Ok(())
            }
            _ => Err(Error::OutOfMemory {
                device,
                requested: size,
                message: format!(
                    "simulated device of {} bytes has {} in use",
                    self.capacity, used
                ),
            }),
        }
    }

    /// A fresh address range of `size` bytes aligned to `align`.
    fn take_addresses(st: &mut State, size: u64, align: u64) -> Result<u64> {
        let base = st.next_address.div_ceil(align) * align;
        st.next_address = base
            .checked_add(size)
            .ok_or_else(|| Error::invalid("the simulated address space is exhausted"))?;
        Ok(base)
    }

    fn fresh_id(st: &mut State) -> u64 {
        st.next_id += 1;
        st.next_id
    }

    fn stream_of(&self, st: &State, stream: StreamId) -> Result<usize> {
        st.streams.get(&stream.0).copied().ok_or_else(|| {
            stream.unknown_to(self.driver, || {
                Error::invalid(format!(
                    "stream {} was not created by this driver or was destroyed",
                    stream.0
                ))
            })
        })
    }

    fn event_known(st: &State, event: EventId) -> Result<()> {
        if st.events.contains(&event.0) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "event {} was not created by this driver or was destroyed",
                event.0
            )))
        }
    }

    /// Checks that work on `stream` may name `[ptr, ptr + len)`.
    fn check_range(&self, stream: StreamId, ptr: DeviceAddr, len: u64) -> Result<()> {
        let st = self.state.lock();
        self.stream_of(&st, stream)?;
        if st.vm.contains(ptr.0, len) {
            return st.vm.covered(ptr, len);
        }
        ranges::containing(&st.segments, |s| s.1, ptr, len).map(|_| ())
    }

    fn granularity(&self, device: usize) -> Result<u64> {
        self.check_device(device)?;
        Ok(GRANULARITY)
    }

    fn reserve(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.check_device(device)?;
        Self::check_granular("a reservation", size)?;
        let mut st = self.state.lock();
        let base = Self::take_addresses(&mut st, size, GRANULARITY)?;
        st.vm.insert(base, device, size);
        Ok(DeviceAddr(base))
    }

    fn free_reservation(&self, base: DeviceAddr) -> Result<()> {
        self.state.lock().vm.remove(base.0).map(|_| ())
    }

    fn create_chunk(&self, device: usize, size: u64) -> Result<ChunkId> {
        self.check_device(device)?;
        Self::check_granular("a chunk", size)?;
        let mut st = self.state.lock();
        self.charge(&mut st, device, size)?;
        let id = Self::fresh_id(&mut st);
        st.chunks.insert(id, (device, size));
        Ok(ChunkId(id))
    }

    fn release_chunk(&self, chunk: ChunkId) -> Result<()> {
        let mut st = self.state.lock();
        let (device, size) = st
            .chunks
            .remove(&chunk.0)
            .ok_or_else(|| Error::invalid(format!("chunk {} is not a live chunk", chunk.0)))?;
        if st.mappings.contains_key(&chunk.0) {
            st.released_mapped.insert(chunk.0, (device, size));
        } else {
            st.used[device] = st.used[device].saturating_sub(size);
        }
        Ok(())
    }

    fn map(&self, addr: DeviceAddr, chunk: ChunkId) -> Result<()> {
        let mut st = self.state.lock();
        let (device, size) = *st
            .chunks
            .get(&chunk.0)
            .ok_or_else(|| Error::invalid(format!("chunk {} is not a live chunk", chunk.0)))?;
        let into = st.vm.check_map(addr.0, size, GRANULARITY)?;
        if into != device {
            return Err(Error::invalid(format!(
                "a chunk of device {device} cannot be mapped into a reservation of device {into}"
            )));
        }
        st.vm.insert_mapping(addr.0, size, chunk.0)?;
        *st.mappings.entry(chunk.0).or_default() += 1;
        Ok(())
    }

    fn export_chunk(&self, _chunk: ChunkId) -> Result<super::ExportedChunk> {
        Err(no_ipc())
    }

    fn import_chunk(
        &self,
        _device: usize,
        _chunk: super::ExportedChunk,
        _size: u64,
    ) -> Result<ChunkId> {
        Err(no_ipc())
    }

    fn unmap(&self, addr: DeviceAddr, size: u64) -> Result<()> {
        let mut st = self.state.lock();
        let taken = st.vm.take_mappings(addr.0, size)?;
        st.vm.finish_unmap(addr.0, size);
        for (_, _, chunk) in taken {
            let last = match st.mappings.get_mut(&chunk) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                _ => {
                    st.mappings.remove(&chunk);
                    true
                }
            };
            if last {
                if let Some((device, bytes)) = st.released_mapped.remove(&chunk) {
                    st.used[device] = st.used[device].saturating_sub(bytes);
                }
            }
        }
        Ok(())
    }
}

impl Driver for SimDriver {
    crate::driver::capability::own_capabilities!(kernels, interop, vm, ipc);

    fn backend(&self) -> Backend {
        Backend::Simulated
    }

    fn device_count(&self) -> usize {
        self.devices
    }

    fn device_name(&self, device: usize) -> Result<String> {
        self.check_device(device)?;
        Ok(format!(
            "simulated device {device} ({} bytes)",
            self.capacity
        ))
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.check_device(device)?;
        let used = self.state.lock().used[device];
        Ok(MemInfo {
            free: self.capacity.saturating_sub(used),
            total: self.capacity,
        })
    }

    fn malloc(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.check_device(device)?;
        if size == 0 {
            return Err(Error::invalid("malloc of 0 bytes"));
        }
        let mut st = self.state.lock();
        self.charge(&mut st, device, size)?;
        let base = Self::take_addresses(&mut st, size, 512)?;
        st.segments.insert(base, (device, size));
        Ok(DeviceAddr(base))
    }

    fn free(&self, ptr: DeviceAddr) -> Result<()> {
        let mut st = self.state.lock();
        let (device, size) = st
            .segments
            .remove(&ptr.0)
            .ok_or_else(|| Error::invalid(format!("{ptr} is not a segment of this driver")))?;
        st.used[device] = st.used[device].saturating_sub(size);
        Ok(())
    }

    fn default_stream(&self, device: usize) -> Result<StreamId> {
        self.check_device(device)?;
        Self::default_id(self.driver, device)
    }

    fn stream_create(&self, device: usize) -> Result<StreamId> {
        self.check_device(device)?;
        let mut st = self.state.lock();
        let id = StreamId::new(self.driver, device, Self::fresh_id(&mut st))?;
        st.streams.insert(id.0, device);
        Ok(id)
    }

    fn stream_destroy(&self, stream: StreamId) -> Result<()> {
        if Self::default_id(self.driver, stream.device()).is_ok_and(|d| d == stream) {
            return Err(Error::invalid("the default stream cannot be destroyed"));
        }
        let mut st = self.state.lock();
        st.streams.remove(&stream.0).map(|_| ()).ok_or_else(|| {
            Error::invalid(format!(
                "stream {} is not a stream of this driver",
                stream.0
            ))
        })
    }

    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        self.stream_of(&self.state.lock(), stream).map(|_| ())
    }

    fn stream_query(&self, stream: StreamId) -> Result<bool> {
        self.stream_of(&self.state.lock(), stream).map(|_| true)
    }

    fn stream_device(&self, stream: StreamId) -> Result<usize> {
        self.stream_of(&self.state.lock(), stream)
    }

    fn event_create(&self, device: usize, _flags: EventFlags) -> Result<EventId> {
        self.check_device(device)?;
        let mut st = self.state.lock();
        let id = Self::fresh_id(&mut st);
        st.events.insert(id);
        Ok(EventId(id))
    }

    fn event_destroy(&self, event: EventId) -> Result<()> {
        let mut st = self.state.lock();
        Self::event_known(&st, event)?;
        st.events.remove(&event.0);
        Ok(())
    }

    fn event_record(&self, event: EventId, stream: StreamId) -> Result<()> {
        let st = self.state.lock();
        Self::event_known(&st, event)?;
        self.stream_of(&st, stream).map(|_| ())
    }

    fn event_query(&self, event: EventId) -> Result<bool> {
        Self::event_known(&self.state.lock(), event).map(|()| true)
    }

    fn event_synchronize(&self, event: EventId) -> Result<()> {
        Self::event_known(&self.state.lock(), event)
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        let st = self.state.lock();
        Self::event_known(&st, event)?;
        self.stream_of(&st, stream).map(|_| ())
    }

    unsafe fn copy_host_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: &[u8],
    ) -> Result<()> {
        self.check_range(stream, dst, src.len() as u64)
    }

    unsafe fn copy_device_to_host(
        &self,
        stream: StreamId,
        dst: &mut [u8],
        src: DeviceAddr,
    ) -> Result<()> {
        self.check_range(stream, src, dst.len() as u64)?;
        Err(nothing_stored("copy_device_to_host"))
    }

    unsafe fn copy_device_to_device(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        src: DeviceAddr,
        len: u64,
    ) -> Result<()> {
        self.check_range(stream, src, len)?;
        self.check_range(stream, dst, len)
    }

    unsafe fn memset(&self, stream: StreamId, dst: DeviceAddr, _value: u8, len: u64) -> Result<()> {
        self.check_range(stream, dst, len)
    }
}

impl Kernels for SimDriver {
    unsafe fn fill_pattern(
        &self,
        stream: StreamId,
        dst: DeviceAddr,
        len: u64,
        _seed: u64,
    ) -> Result<()> {
        self.check_range(stream, dst, len)
    }

    unsafe fn count_pattern_mismatches(
        &self,
        stream: StreamId,
        src: DeviceAddr,
        len: u64,
        _seed: u64,
    ) -> Result<u64> {
        self.check_range(stream, src, len)?;
        Err(nothing_stored("count_pattern_mismatches"))
    }

    unsafe fn poison(&self, stream: StreamId, dst: DeviceAddr, len: u64) -> Result<()> {
        self.check_range(stream, dst, len)
    }

    fn sleep(&self, stream: StreamId, _micros: u64) -> Result<()> {
        self.stream_of(&self.state.lock(), stream).map(|_| ())
    }
}

impl Interop for SimDriver {
    unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId> {
        self.check_device(device)?;
        let st = self.state.lock();
        match st.streams.get(&raw) {
            Some(&d) if d == device => Ok(StreamId(raw)),
            _ => Err(Error::invalid(format!(
                "{raw} is not a stream of device {device} of this driver"
            ))),
        }
    }

    fn raw_stream(&self, stream: StreamId) -> Result<u64> {
        self.stream_of(&self.state.lock(), stream).map(|_| stream.0)
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
            "the simulated device runs no kernels (it replays allocation traces)",
        ))
    }
}

impl VirtualMemory for SimDriver {
    super::forward_vm_methods!();
}

impl Ipc for SimDriver {
    fn ipc_export_memory(&self, _ptr: DeviceAddr) -> Result<IpcMemHandle> {
        Err(no_ipc())
    }

    fn ipc_open_memory(&self, _device: usize, _handle: &IpcMemHandle) -> Result<OpenedSegment> {
        Err(no_ipc())
    }

    fn ipc_close_memory(&self, _ptr: DeviceAddr) -> Result<()> {
        Err(no_ipc())
    }

    fn ipc_export_event(&self, _event: EventId) -> Result<IpcEventHandle> {
        Err(no_ipc())
    }

    fn ipc_open_event(&self, _device: usize, _handle: &IpcEventHandle) -> Result<EventId> {
        Err(no_ipc())
    }
}
