//! Storages order themselves (`stream_order:auto`, the default): every access through a storage
//! names its stream and whether it reads or writes, and the storage makes it wait for the earlier
//! accesses on other streams it conflicts with — cudarc's rule for its slices, kept per storage
//! for every reader and not only the last.
//!
//! | access on stream `s` | waits for (each on another stream than `s`) | then |
//! |---|---|---|
//! | read | the last writer, unless `s` already read since that write | `s` is a reader |
//! | write | the last writer and every reader since it | `s` is the writer, no readers |
//! | a lazy clone's first write (a copy, or the last reference's steal) | what the hand-over orders (`alloc/engine/handover.rs`) | `s` is the writer of the new memory |
//!
//! A wait is the allocator's one ordering rule ([`Runtime::order_after`](crate::Runtime::order_after)): an event
//! recorded on the earlier stream *now* — after the work the earlier access enqueued, since a
//! program enqueues its kernel before it touches the storage on another stream — and waited for
//! on `s`, across captures too. Every stream that reads or writes is recorded on the memory
//! (`record_stream` by construction): the free waits for it. The fresh memory of an allocation
//! counts as written on its allocation stream.
//!
//! Cost: one atomic load decides the common case, every access on the one stream that used the
//! storage so far; the lock and the waits come only when a second stream takes part.
//!
//! With `stream_order:manual` nothing here runs: PyTorch's rules, the program's `record_stream`
//! and waits, and the sanitizer reports what is missing.
//!
//! Outside the rule, the program's to order as in manual mode: work on raw addresses
//! (`data_ptr()`, `mutable_data_ptr()`), graph replays (a replay writes what its capture wrote,
//! which no storage sees), and streams of another device. A stream destroyed since its access is
//! not waited for (its work cannot be named any more). Addresses are taken right before the work
//! that uses them is enqueued — as every storage door does — since the wait covers the work
//! queued on the earlier stream when the later access is taken.
//!
//! [`Runtime::order_after`](crate::Runtime::order_after): crate::CachingAllocator

use super::Storage;
use crate::driver::sanitizer::AccessKind;
use crate::driver::StreamId;
use crate::error::Result;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::Mutex;
use crate::StreamOrder;

/// No single stream used the storage (two did, or none yet).
const NO_STREAM: u64 = u64::MAX;

/// The streams that used a storage since its last write.
#[derive(Debug)]
pub(super) struct StreamUses {
    /// The stream every access since the last write was on (it wrote last, nobody else read),
    /// or [`NO_STREAM`].
    sole: AtomicU64,
    uses: Mutex<Uses>,
}

#[derive(Debug, Default)]
struct Uses {
    writer: Option<StreamId>,
    /// Streams that read since the last write (each waited for that write), other than it.
    readers: Vec<StreamId>,
}

impl StreamUses {
    /// Memory written (or handed out) last on `writer`.
    pub(super) fn new(writer: Option<StreamId>) -> Self {
        StreamUses {
            sole: AtomicU64::new(writer.map_or(NO_STREAM, |s| s.0)),
            uses: Mutex::new(Uses {
                writer,
                readers: Vec::new(),
            }),
        }
    }

    /// New memory, written on `stream` (a lazy clone's copy, or its steal).
    pub(super) fn reset(&self, stream: StreamId) {
        let mut uses = self.uses.lock();
        uses.writer = Some(stream);
        uses.readers.clear();
        self.sole.store(stream.0, Ordering::Release);
    }
}

impl Storage {
    /// Whether this storage's runtime orders storages (`stream_order:auto`).
    #[inline]
    pub(super) fn orders_itself(&self) -> bool {
        self.allocator().config().stream_order == StreamOrder::Auto
    }

    /// Orders an access of `kind` on `stream` after the conflicting earlier ones on other streams
    /// (see the module docs); nothing under `stream_order:manual`.
    #[inline]
    pub(super) fn access(&self, stream: StreamId, kind: AccessKind) -> Result<()> {
        if self.inner.uses.sole.load(Ordering::Acquire) == stream.0 || !self.orders_itself() {
            return Ok(());
        }
        self.access_slow(stream, kind)
    }

    #[cold]
    fn access_slow(&self, stream: StreamId, kind: AccessKind) -> Result<()> {
        // A stream of another device is the program's to order (as in manual mode): events and
        // `record_stream` are per device.
        if self.allocator().driver().stream_device(stream)? != self.inner.device {
            return Ok(());
        }
        {
            let mut uses = self.inner.uses.uses.lock();
            let writer = uses.writer.filter(|&w| w != stream);
            match kind {
                AccessKind::Read => {
                    if uses.writer == Some(stream) || uses.readers.contains(&stream) {
                        return Ok(());
                    }
                    if let Some(w) = writer {
                        self.wait_for(stream, w)?;
                    }
                    uses.readers.push(stream);
                    self.inner.uses.sole.store(NO_STREAM, Ordering::Release);
                }
                AccessKind::Write => {
                    for &earlier in writer.iter().chain(&uses.readers) {
                        if earlier != stream {
                            self.wait_for(stream, earlier)?;
                        }
                    }
                    uses.writer = Some(stream);
                    uses.readers.clear();
                    self.inner.uses.sole.store(stream.0, Ordering::Release);
                }
            }
        }
        // Outside the lock of the uses: `record_stream` takes the storage's data lock, which a
        // lazy clone's first write holds while it resets the uses.
        self.used_on(stream)
    }

    /// Makes `stream` wait for `earlier`; a stream destroyed since is skipped (its work cannot
    /// be waited for any more, as a free of memory it used does not wait for it either).
    fn wait_for(&self, stream: StreamId, earlier: StreamId) -> Result<()> {
        let allocator = self.allocator();
        match allocator.order_after(stream, earlier) {
            Err(err) if allocator.driver().stream_device(earlier).is_err() => {
                tracing::warn!(%err, "a stream that used a storage was destroyed: not waited for");
                Ok(())
            }
            other => other,
        }
    }

    /// The memory's free waits for `stream` (`record_stream` by construction; nothing for its own
    /// allocation stream), under one take of the data lock.
    pub(super) fn used_on(&self, stream: StreamId) -> Result<()> {
        self.with_data(|data| {
            if data.allocation_stream() == Some(stream) {
                Ok(())
            } else {
                data.record_stream(stream)
            }
        })
    }
}
