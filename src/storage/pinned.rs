//! Copies between a [`Storage`] and a [`PinnedBuffer`], on a stream, without blocking.
//!
//! | call | storage | buffer |
//! |---|---|---|
//! | `copy_to_pinned` | read at its current address: a lazy clone is **not** materialized | written (`&mut`): host borrows wait for the copy |
//! | `copy_from_pinned` | written: a lazy clone is materialized first, on the copy's stream | read: host writes and the buffer's reuse wait for the copy |
//!
//! Both record the stream for the storage's memory when it is not the storage's own (its free
//! then waits for the copy, as with [`Storage::record_stream`]).

use std::ops::Range;

use super::Storage;
use crate::driver::StreamId;
use crate::error::{Error, Result};
use crate::pinned::PinnedBuffer;

impl Storage {
    /// Checks `[offset, offset + len)` of the storage and that `stream` is of its device;
    /// returns the buffer's range from `buffer_offset`, or `None` when there is nothing to copy.
    fn pinned_ranges(
        &self,
        offset: u64,
        len: usize,
        buffer_offset: usize,
        stream: StreamId,
    ) -> Result<Option<Range<usize>>> {
        let fits = offset
            .checked_add(len as u64)
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
        if len == 0 {
            return Ok(None);
        }
        let end = buffer_offset
            .checked_add(len)
            .ok_or_else(|| Error::invalid("pinned range overflows"))?;
        Ok(Some(buffer_offset..end))
    }

    /// Enqueues a copy of `len` bytes of the storage from `offset` into `dst` at `dst_offset`
    /// on `stream`; returns at once. Reads: a lazy clone is not materialized. `dst`'s host
    /// borrows wait for the copy.
    pub fn copy_to_pinned(
        &self,
        offset: u64,
        dst: &mut PinnedBuffer,
        dst_offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<()> {
        let Some(range) = self.pinned_ranges(offset, len, dst_offset, stream)? else {
            return Ok(());
        };
        self.check_awake("a copy to pinned memory")?;
        let src = self.data_ptr_on(stream)?.offset(offset)?;
        let driver = self.runtime().driver();
        // SAFETY: the launch enqueues one copy on `stream` that writes exactly the range given.
        unsafe {
            dst.enqueue_write(stream, range, |host, bytes| {
                driver
                    .pinned()
                    .copy_device_to_pinned(stream, host, src, bytes)
            })
        }?;
        // Ordered storages recorded `stream` at the access (`order.rs`); under manual rules a
        // pinned copy records it itself.
        if self.orders_itself() {
            return Ok(());
        }
        self.used_on(stream)
    }

    /// Enqueues a copy of `len` bytes of `src` from `src_offset` into the storage at `offset`
    /// on `stream`; returns at once. Writes: a lazy clone is materialized first, on `stream`.
    /// `src`'s host writes and its reuse wait for the copy.
    pub fn copy_from_pinned(
        &self,
        offset: u64,
        src: &PinnedBuffer,
        src_offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<()> {
        let Some(range) = self.pinned_ranges(offset, len, src_offset, stream)? else {
            return Ok(());
        };
        self.check_awake("a copy from pinned memory")?;
        let dst = self.mutable_data_ptr_on(stream)?.offset(offset)?;
        let driver = self.runtime().driver();
        // SAFETY: the launch enqueues one copy on `stream` that reads exactly the range given.
        unsafe {
            src.enqueue_read(stream, range, |host, bytes| {
                driver
                    .pinned()
                    .copy_pinned_to_device(stream, dst, host, bytes)
            })
        }?;
        // Ordered storages recorded `stream` at the access (`order.rs`); under manual rules a
        // pinned copy records it itself.
        if self.orders_itself() {
            return Ok(());
        }
        self.used_on(stream)
    }
}
