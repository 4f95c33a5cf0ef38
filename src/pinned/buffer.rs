//! [`PinnedBuffer`]: a block of page-locked host memory, borrowed by the host only after the
//! stream work that touches it, and reused by the allocator only after that work completed.
//!
//! | step | what the buffer does |
//! |---|---|
//! | `enqueue_read(stream, ..)` (a copy to the device: `Storage::copy_from_pinned`) | runs the enqueue, then records an event on `stream` (one per stream and direction, re-recorded) |
//! | `enqueue_write(stream, ..)` (`&mut self`; a copy from the device: `Storage::copy_to_pinned`) | the same, as a write |
//! | `as_slice()` | waits for the events of writes, then the host reads (checked by the sanitizer) |
//! | `as_mut_slice()` (`&mut self`) | waits for every event, then the host writes |
//! | `record_stream(stream)` (PyTorch's `record_event`) | the reuse will wait for the work queued on `stream` by the time of the free (for work cudalloc did not enqueue) |
//! | drop | the block goes back with the events of its uses (and one fresh event per recorded stream): cached once all completed |
//!
//! Borrowing rules do the rest: a device write can only be enqueued through `&mut self`, so no
//! slice of the buffer is alive while one is in flight. (`enqueue_*` are `unsafe`: their launch
//! must touch only the range it is given, on the stream it names.)

use std::ops::Range;

use super::pinned_allocator::PinnedAllocator;
use super::state::Pending;
use crate::driver::sanitizer::Touch;
use crate::driver::{HostAddr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::{Arc, Mutex};

/// Stream work on the buffer that borrows and reuse wait for.
#[derive(Debug)]
struct Use {
    stream: StreamId,
    event: crate::driver::EventId,
    writes: bool,
}

#[derive(Debug, Default)]
struct Uses {
    pending: Vec<Use>,
    recorded: Vec<StreamId>,
}

/// Page-locked host memory from a [`PinnedAllocator`] (see `src/pinned/buffer.rs`): at least
/// [`len`](PinnedBuffer::len) bytes, returned to the allocator's cache on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    alloc: Arc<PinnedAllocator>,
    /// The allocator's block (`None`: an empty buffer).
    block: Option<usize>,
    addr: HostAddr,
    len: usize,
    capacity: u64,
    uses: Mutex<Uses>,
}

impl PinnedBuffer {
    pub(super) fn new(
        alloc: Arc<PinnedAllocator>,
        block: usize,
        addr: HostAddr,
        len: usize,
        capacity: u64,
    ) -> Self {
        PinnedBuffer {
            alloc,
            block: Some(block),
            addr,
            len,
            capacity,
            uses: Mutex::new(Uses::default()),
        }
    }

    pub(super) fn empty(alloc: Arc<PinnedAllocator>) -> Self {
        PinnedBuffer {
            alloc,
            block: None,
            addr: HostAddr(0),
            len: 0,
            capacity: 0,
            uses: Mutex::new(Uses::default()),
        }
    }

    /// Bytes requested.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of its block (the request rounded up to a power of two).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The address of its first byte (for a library's own launches: wrap them in
    /// [`enqueue_read`](Self::enqueue_read) / [`enqueue_write`](Self::enqueue_write)).
    pub fn addr(&self) -> HostAddr {
        self.addr
    }

    /// The allocator it came from.
    pub fn allocator(&self) -> &Arc<PinnedAllocator> {
        &self.alloc
    }

    /// The bytes, for reading on the host: waits for the stream work that writes them.
    pub fn as_slice(&self) -> Result<&[u8]> {
        if self.len == 0 {
            return Ok(&[]);
        }
        self.alloc.birth.check("this pinned buffer")?;
        self.wait(|u| u.writes)?;
        self.host_access(Touch::read(self.addr.0, self.len as u64))?;
        // SAFETY: the block is this buffer's (in use until drop) and holds `len` bytes of
        // mapped memory; every stream write into it completed (waited above) and no new one can
        // be enqueued while this shared borrow lives (that takes `&mut self`).
        Ok(unsafe { std::slice::from_raw_parts(self.addr.as_ptr(), self.len) })
    }

    /// The bytes, for writing on the host: waits for all stream work on them.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        if self.len == 0 {
            return Ok(&mut []);
        }
        self.alloc.birth.check("this pinned buffer")?;
        self.wait(|_| true)?;
        self.host_access(Touch::write(self.addr.0, self.len as u64))?;
        // SAFETY: as in `as_slice`; every stream access completed, and the exclusive borrow
        // keeps any new one from being enqueued while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr.as_ptr(), self.len) })
    }

    fn host_access(&self, touch: Touch) -> Result<()> {
        match self.alloc.driver().sanitizer() {
            Some(sanitizer) => sanitizer.host_access("a borrow of a pinned buffer", &[touch]),
            None => Ok(()),
        }
    }

    /// Waits for the pending uses `which` selects; they are done with afterwards.
    fn wait(&self, which: impl Fn(&Use) -> bool) -> Result<()> {
        let mut uses = self.uses.lock();
        let (done, keep): (Vec<Use>, Vec<Use>) = std::mem::take(&mut uses.pending)
            .into_iter()
            .partition(|u| which(u));
        uses.pending = keep;
        let mut result = Ok(());
        for u in done {
            match self.alloc.driver().event_synchronize(u.event) {
                Ok(()) => self.alloc.return_event(u.stream.device(), u.event),
                Err(err) => {
                    // Keep it: the free waits for it too.
                    uses.pending.push(u);
                    if result.is_ok() {
                        result = Err(err);
                    }
                }
            }
        }
        result
    }

    /// The reuse of this buffer's memory waits for the work queued on `stream` when the buffer
    /// is dropped (PyTorch's `record_event`): for work on it that cudalloc did not enqueue.
    /// Nothing in a forked child (the buffer is the parent's).
    pub fn record_stream(&self, stream: StreamId) {
        if self
            .alloc
            .birth
            .ignored_in_child("recording a stream on a pinned buffer")
        {
            return;
        }
        let mut uses = self.uses.lock();
        if !uses.recorded.contains(&stream) {
            uses.recorded.push(stream);
        }
    }

    fn range(&self, range: &Range<u64>) -> Result<(HostAddr, u64)> {
        if range.start > range.end || range.end > self.len as u64 {
            return Err(Error::invalid(format!(
                "range {range:?} is outside a pinned buffer of {} bytes",
                self.len
            )));
        }
        Ok((self.addr.offset(range.start)?, range.end - range.start))
    }

    /// Enqueues stream work that reads bytes `range` of the buffer: `launch(address, len)`
    /// enqueues it on `stream`; later host writes and the buffer's reuse wait for it.
    ///
    /// # Safety
    /// `launch` enqueues, on `stream` only, work that only reads `len` bytes at `address` (host
    /// borrows that read may be alive meanwhile; none that writes is).
    pub unsafe fn enqueue_read(
        &self,
        stream: StreamId,
        range: Range<u64>,
        launch: impl FnOnce(HostAddr, u64) -> Result<()>,
    ) -> Result<()> {
        self.enqueue(stream, range, false, launch)
    }

    /// Enqueues stream work that writes bytes `range` of the buffer: later host borrows and the
    /// buffer's reuse wait for it.
    ///
    /// # Safety
    /// `launch` enqueues, on `stream` only, work that touches no bytes but the `len` at
    /// `address`.
    pub unsafe fn enqueue_write(
        &mut self,
        stream: StreamId,
        range: Range<u64>,
        launch: impl FnOnce(HostAddr, u64) -> Result<()>,
    ) -> Result<()> {
        self.enqueue(stream, range, true, launch)
    }

    fn enqueue(
        &self,
        stream: StreamId,
        range: Range<u64>,
        writes: bool,
        launch: impl FnOnce(HostAddr, u64) -> Result<()>,
    ) -> Result<()> {
        // Before the uses' lock, which a thread of the parent may have held at the fork.
        self.alloc.birth.check("this pinned buffer")?;
        let (addr, len) = self.range(&range)?;
        if len == 0 {
            return Ok(());
        }
        let driver = self.alloc.driver();
        if driver
            .graphs()
            .stream_capture_status(stream)?
            .is_capturing()
        {
            return Err(Error::capture(
                "a pinned buffer is not used on a capturing stream: its reuse waits for events \
                 recorded after each copy, which a capture would only record into its graph",
            ));
        }
        // The event first: once the work is enqueued, it must be tracked.
        let mut uses = self.uses.lock();
        let existing = uses
            .pending
            .iter()
            .position(|u| u.stream == stream && u.writes == writes);
        let event = match existing {
            Some(i) => uses.pending[i].event,
            None => self.alloc.take_event(stream.device())?,
        };
        // A launch that fails or panics (a driver in the sanitizer's panic mode) enqueued nothing:
        // a fresh event goes back to the pool either way.
        let launched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| launch(addr, len)));
        if !matches!(launched, Ok(Ok(()))) && existing.is_none() {
            self.alloc.return_event(stream.device(), event);
        }
        match launched {
            Ok(Ok(())) => {}
            Ok(Err(err)) => return Err(err),
            Err(panic) => std::panic::resume_unwind(panic),
        }
        if let Err(err) = driver.event_record(event, stream) {
            // The work is enqueued but cannot be tracked: wait for it here instead.
            if existing.is_none() {
                self.alloc.return_event(stream.device(), event);
            }
            if let Err(sync_err) = driver.stream_synchronize(stream) {
                tracing::error!(err = %sync_err, ?stream,
                    "waiting for a pinned buffer's untracked work failed; the buffer may be reused under it");
            }
            return Err(err);
        }
        if existing.is_none() {
            uses.pending.push(Use {
                stream,
                event,
                writes,
            });
        }
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let Some(block) = self.block else {
            return;
        };
        if !self.alloc.in_its_process() {
            // A forked child: the block is the parent's; nothing is touched here.
            return;
        }
        let uses = std::mem::take(&mut *self.uses.lock());
        let mut events: Vec<Pending> = uses
            .pending
            .into_iter()
            .map(|u| Pending {
                event: u.event,
                device: u.stream.device(),
                block,
                ticket: 0,
            })
            .collect();
        let driver = self.alloc.driver();
        for stream in uses.recorded {
            let recorded = self
                .alloc
                .take_event(stream.device())
                .and_then(|event| driver.event_record(event, stream).map(|()| event));
            match recorded {
                Ok(event) => events.push(Pending {
                    event,
                    device: stream.device(),
                    block,
                    ticket: 0,
                }),
                Err(err) => {
                    // Reuse must still wait: for the whole stream, now.
                    tracing::warn!(%err, "recording a pinned buffer's stream failed; waiting for the stream");
                    if let Err(sync_err) = driver.stream_synchronize(stream) {
                        tracing::error!(err = %sync_err, ?stream,
                            "waiting for a dropped pinned buffer's stream failed; the block may be reused under its work");
                    }
                }
            }
        }
        self.alloc.free(block, self.addr, self.capacity, events);
    }
}
