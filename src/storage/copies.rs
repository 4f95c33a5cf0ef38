//! Copies between a [`Storage`] and host memory, each on a stream the caller names, at an offset
//! of the storage, in bytes as `u64` (one size type for every copy).
//!
//! | call | storage | host side | returns |
//! |---|---|---|---|
//! | `copy_to_host(stream, offset, dst)` | read at its current address: a lazy clone is **not** materialized | pageable `&mut [u8]` | when done (a pageable copy is synchronous, as CUDA's) |
//! | `copy_from_host(stream, offset, src)` | written: a lazy clone is materialized first, on `stream` | pageable `&[u8]` | when done |
//! | `copy_to_pinned(stream, offset, dst, dst_offset, len)` | read, as `copy_to_host` | a [`PinnedBuffer`], written: its host borrows wait for the copy | at once (stream-ordered) |
//! | `copy_from_pinned(stream, offset, src, src_offset, len)` | written, as `copy_from_host` | a [`PinnedBuffer`], read: its host writes and reuse wait for the copy | at once |
//!
//! Each is an access of the storage on `stream` (`order.rs`: under `stream_order:auto` it waits
//! for the conflicting earlier accesses on other streams, and the storage's free waits for it).
//! Under `manual` a pinned copy records its stream for the storage's memory itself (as
//! [`Storage::record_stream`]); a pageable copy has finished when it returns.

use std::ops::Range;

use super::order::{enqueue_ordered, Placement};
use super::Storage;
use crate::driver::sanitizer::AccessKind;
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::pinned::PinnedBuffer;

impl Storage {
    /// Checks `[offset, offset + len)` of the storage and that `stream` is of its device;
    /// returns the buffer's range from `buffer_offset`, or `None` when there is nothing to copy.
    fn pinned_ranges(
        &self,
        offset: u64,
        len: u64,
        buffer_offset: u64,
        stream: StreamId,
    ) -> Result<Option<Range<u64>>> {
        self.check_range(offset, len, stream)?;
        if len == 0 {
            return Ok(None);
        }
        let end = buffer_offset
            .checked_add(len)
            .ok_or_else(|| Error::invalid("pinned range overflows"))?;
        Ok(Some(buffer_offset..end))
    }

    /// Checks `[offset, offset + len)` of the storage and that `stream` is of its device.
    fn check_range(&self, offset: u64, len: u64, stream: StreamId) -> Result<()> {
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| end <= self.inner.nbytes);
        if !fits {
            return Err(Error::invalid(format!(
                "bytes [{offset}, {offset} + {len}) are outside a storage of {} bytes",
                self.inner.nbytes
            )));
        }
        if stream.device() != self.inner.device {
            return Err(Error::invalid(format!(
                "stream {} is on device {}, the storage on device {}",
                stream.raw(),
                stream.device(),
                self.inner.device
            )));
        }
        Ok(())
    }

    /// Enqueues a copy of `len` bytes of the storage from `offset` into `dst` at `dst_offset`
    /// on `stream`; returns at once. Reads: a lazy clone is not materialized. `dst`'s host
    /// borrows wait for the copy.
    pub fn copy_to_pinned(
        &self,
        stream: StreamId,
        offset: u64,
        dst: &mut PinnedBuffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        let Some(range) = self.pinned_ranges(offset, len, dst_offset, stream)? else {
            return Ok(());
        };
        self.check_awake("a copy to pinned memory")?;
        let driver = self.runtime().driver();
        enqueue_ordered(&[(self, AccessKind::Read)], stream, |addrs| {
            let src = at(addrs, offset)?;
            // SAFETY: the launch enqueues one copy on `stream` that writes exactly the range
            // given; the storage's bytes are taken under its locks (`order.rs`).
            unsafe {
                dst.enqueue_write(stream, range, |host, bytes| {
                    driver
                        .pinned()
                        .copy_device_to_pinned(stream, host, src, bytes)
                })
            }
        })?;
        self.record_if_manual(stream)
    }

    /// Enqueues a copy of `len` bytes of `src` from `src_offset` into the storage at `offset`
    /// on `stream`; returns at once. Writes: a lazy clone is materialized first, on `stream`.
    /// `src`'s host writes and its reuse wait for the copy.
    pub fn copy_from_pinned(
        &self,
        stream: StreamId,
        offset: u64,
        src: &PinnedBuffer,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        let Some(range) = self.pinned_ranges(offset, len, src_offset, stream)? else {
            return Ok(());
        };
        self.check_awake("a copy from pinned memory")?;
        let driver = self.runtime().driver();
        enqueue_ordered(&[(self, AccessKind::Write)], stream, |addrs| {
            let dst = at(addrs, offset)?;
            // SAFETY: the launch enqueues one copy on `stream` that reads exactly the range
            // given; the storage's bytes are taken under its locks (`order.rs`).
            unsafe {
                src.enqueue_read(stream, range, |host, bytes| {
                    driver
                        .pinned()
                        .copy_pinned_to_device(stream, dst, host, bytes)
                })
            }
        })?;
        self.record_if_manual(stream)
    }

    /// Copies `src` into the storage at `offset` on `stream`; returns when done (pageable
    /// memory). Writes: a lazy clone is materialized first, on `stream`.
    pub fn copy_from_host(&self, stream: StreamId, offset: u64, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len() as u64, stream)?;
        if src.is_empty() {
            return Ok(());
        }
        self.check_awake("a copy from the host")?;
        let driver = self.runtime().driver();
        enqueue_ordered(&[(self, AccessKind::Write)], stream, |addrs| {
            let dst = at(addrs, offset)?;
            // SAFETY: the storage's own bytes, taken under its locks for `stream` (`order.rs`):
            // ordered as a typed kernel's under `auto`; under `manual` typed kernels see private
            // copies, so a missing wait gives wrong bytes, never a racing reference.
            unsafe { driver.copy_host_to_device(stream, dst, src) }
        })
    }

    /// Copies bytes of the storage from `offset` into `dst` on `stream`; returns when done
    /// (pageable memory). Reads: a lazy clone is not materialized.
    pub fn copy_to_host(&self, stream: StreamId, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len() as u64, stream)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.check_awake("a copy to the host")?;
        let driver = self.runtime().driver();
        enqueue_ordered(&[(self, AccessKind::Read)], stream, |addrs| {
            let src = at(addrs, offset)?;
            // SAFETY: as in `copy_from_host`.
            unsafe { driver.copy_device_to_host(stream, dst, src) }
        })
    }

    /// Under manual rules a pinned copy, which outlives the call, records its stream for the
    /// storage's free itself (ordered storages recorded it at the access).
    fn record_if_manual(&self, stream: StreamId) -> Result<()> {
        if self.orders_itself() {
            return Ok(());
        }
        self.used_on(stream)
    }
}

/// The address `offset` bytes into the one operand of a copy.
fn at(placements: &[Placement], offset: u64) -> Result<DeviceAddr> {
    placements
        .first()
        .ok_or_else(|| Error::invalid("a copy without its storage"))?
        .addr
        .offset(offset)
}
