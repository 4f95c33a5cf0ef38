//! Host kernels a tensor library brings: its own reference implementations, run in stream order.
//!
//! [`HostDriver::enqueue_host`] queues a closure on a stream's worker thread with the device
//! memory it names, exactly where a CUDA kernel launch would run: after everything queued on that
//! stream before it, concurrently with other streams. So the ordering bugs of GPU code — a free
//! without `record_stream`, a read on a side stream that did not wait for its producer — show up in
//! tests on a laptop: the reused memory holds another tensor's bytes (or the poison pattern of a
//! freed segment) when the late kernel runs.
//!
//! The kernel sees the memory through [`HostKernelMemory`], by copies, never as `&mut [u8]`: the bytes are
//! shared with other streams and processes that may write them concurrently (as on a device, such
//! bytes are then unspecified), which a Rust slice may not be. A kernel that returns an error fails
//! its stream: the next synchronization on it reports the message.
//!
//! This is the raw layer under the typed kernels of storages (`storage/host_kernel.rs`,
//! [`Runtime::launch_host`](crate::Runtime::launch_host)), which order themselves and see memory
//! as slices; so it is `unsafe`: nothing here is ordered against those slices.
//!
//! Each range says whether the kernel reads it or writes it ([`HostRange::read`],
//! [`HostRange::write`]); writing a range named for reading is an error of the kernel. With the
//! stream sanitizer on (`CUDALLOC_SANITIZE`, `driver::sanitizer`), the kernel's ranges are checked
//! against every other stream's work when it is enqueued: a kernel that reads what another stream
//! writes without a wait is reported, deterministically, before it runs.

use super::HostDriver;
use crate::driver::sanitizer::{AccessKind, Touch};
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};

/// A range of device memory a host kernel reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRange {
    addr: DeviceAddr,
    len: u64,
    kind: AccessKind,
}

impl HostRange {
    /// `len` bytes at `addr` that the kernel only reads.
    pub fn read(addr: DeviceAddr, len: u64) -> Self {
        HostRange {
            addr,
            len,
            kind: AccessKind::Read,
        }
    }

    /// `len` bytes at `addr` that the kernel writes (and may read).
    pub fn write(addr: DeviceAddr, len: u64) -> Self {
        HostRange {
            addr,
            len,
            kind: AccessKind::Write,
        }
    }
}

/// The memory of a host kernel: `N` ranges of device memory, in the order they were named.
#[derive(Debug)]
pub struct HostKernelMemory<const N: usize> {
    addrs: [usize; N],
    lens: [usize; N],
    writable: [bool; N],
}

impl<const N: usize> HostKernelMemory<N> {
    /// Bytes of range `i`.
    pub fn len(&self, i: usize) -> u64 {
        self.host_len(i) as u64
    }

    /// Bytes of range `i`, as the host's slices count them.
    fn host_len(&self, i: usize) -> usize {
        self.lens.get(i).copied().unwrap_or(0)
    }

    /// Whether range `i` is empty (or does not exist).
    pub fn is_empty(&self, i: usize) -> bool {
        self.len(i) == 0
    }

    /// The host address of `[offset, offset + n)` of range `i`, checked.
    fn at(&self, i: usize, offset: u64, n: usize) -> Result<usize> {
        let (addr, len) = self
            .addrs
            .get(i)
            .zip(self.lens.get(i))
            .ok_or_else(|| Error::invalid(format!("range {i} of {N} does not exist")))?;
        let start = usize::try_from(offset).ok();
        match start.and_then(|start| Some((start, start.checked_add(n)?))) {
            Some((start, end)) if end <= *len => Ok(addr + start),
            _ => Err(Error::invalid(format!(
                "{n} bytes at offset {offset} run past range {i} ({len} bytes)"
            ))),
        }
    }

    /// The host address of range `i` (0 when it does not exist), for the typed kernels of
    /// `storage/host_kernel.rs`, which form slices over it.
    pub(crate) fn base(&self, i: usize) -> usize {
        self.addrs.get(i).copied().unwrap_or(0)
    }

    /// Copies bytes `[offset, offset + out.len())` of range `i` into `out`.
    pub fn read(&self, i: usize, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.at(i, offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: checked inside range `i`, which the driver keeps mapped while the kernel runs
        // (segments are unmapped only after every stream has drained); `out` is the caller's
        // distinct buffer.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Range `i` as a vector.
    pub fn to_vec(&self, i: usize) -> Result<Vec<u8>> {
        let mut out = vec![0; self.host_len(i)];
        self.read(i, 0, &mut out)?;
        Ok(out)
    }

    /// Copies `data` into range `i` at `offset` (a range named with [`HostRange::write`]).
    pub fn write(&mut self, i: usize, offset: u64, data: &[u8]) -> Result<()> {
        if !self.writable.get(i).copied().unwrap_or(false) {
            return Err(Error::invalid(format!(
                "range {i} was named for reading (HostRange::read): the kernel may not write it"
            )));
        }
        let dst = self.at(i, offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `read`, with `dst` writable device memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
        Ok(())
    }
}

impl HostDriver {
    /// Queues `kernel` on `stream` with the memory of `ranges` (each inside a live segment, checked
    /// now), to run on the stream's worker after the work queued before it (see the
    /// `src/driver/host/library_kernels.rs`). An error the kernel returns fails the stream.
    ///
    /// The raw escape hatch: storages do not see these ranges, so nothing orders them
    /// (`stream_order:auto` does not apply). Programs use typed kernels over storages
    /// ([`Runtime::launch_host`](crate::Runtime::launch_host)).
    ///
    /// # Safety
    /// Typed kernels hand out Rust slices over the memory of storages, ordered by the storages
    /// alone: the caller orders this kernel after, or before, every typed kernel that sees the
    /// same bytes (a write here must not overlap one's slices in time), as on a device.
    pub unsafe fn enqueue_host<const N: usize>(
        &self,
        stream: StreamId,
        ranges: [HostRange; N],
        kernel: impl Fn(&mut HostKernelMemory<N>) -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        self.this_process()?;
        let mut lens = [0usize; N];
        let mut writable = [false; N];
        for ((len, w), r) in lens.iter_mut().zip(&mut writable).zip(&ranges) {
            *len = usize::try_from(r.len)
                .map_err(|_| Error::invalid(format!("{} bytes exceed the address space", r.len)))?;
            *w = r.kind == AccessKind::Write;
        }
        let spans = ranges.map(|r| (r.addr, r.len));
        let enqueue = || {
            self.enqueue_fallible_on_ranges(stream, spans, move |addrs| {
                let mut memory = HostKernelMemory {
                    addrs,
                    lens,
                    writable,
                };
                kernel(&mut memory)
            })
            .map(|_| ())
        };
        match self.attached_sanitizer() {
            Some(sanitizer) if self.captures.status(stream).is_capturing() => {
                // Captured work does not run now: its touches are kept for the replays.
                enqueue()?;
                if let Some(capture) = self.captures.status(stream).capture_id() {
                    let touches = ranges.map(|r| Touch {
                        start: r.addr.0,
                        len: r.len,
                        kind: r.kind,
                    });
                    sanitizer.captured(capture, &touches);
                }
                Ok(())
            }
            Some(sanitizer) => {
                let touches = ranges.map(|r| Touch {
                    start: r.addr.0,
                    len: r.len,
                    kind: r.kind,
                });
                sanitizer.enqueue(stream, "a host kernel", &touches, enqueue)
            }
            None => enqueue(),
        }
    }
}
