//! When a block's bytes change owner, and what the next owner waits for: the one place that
//! decides it.
//!
//! A block's life, with the states the features add:
//!
//! | state | how it is left | what the next owner waits for | told to the sanitizer |
//! |---|---|---|---|
//! | handed out, used on its stream and recorded streams (`record_stream`, copies to pinned memory, a lazy clone's copiers) | the owner drops it: [`Shard::leave`] | every stream it was used on: an event per recorded stream, polled before reuse (PyTorch's rule); none when only its own stream used it | a free whose clock covers those streams |
//! | handed out, stolen by a lazy clone's last reference (`cow::context`) | [`Shard::hand_over_in_place`]: no free, the bytes keep their address; the recorded streams stay recorded (the eventual free waits for them again) | the stealing stream is ordered after the block's own stream and every recorded stream (clones dropped while another stream still read them): a stream-ordered wait, or across a capture the capture's tail event ([`Order`]); where no order can be made ([`Shard::can_hand_over_in_place`]), the stealer copies instead and the block is freed | the waits themselves (ordinary driver calls) |
//! | freed into a pool that live graphs hold | [`Shard::leave`], as any free | as any free | a free marked *graph-held*: the graphs' replays may still touch the bytes |
//! | kept by a thread's front cache (`front.rs`) | [`Shard::leave_to_front`] (only blocks no other stream used: never a lent block, [`Shard::lend`], nor one recorded on another stream) | nothing: the same thread on the same stream takes them next | a free on its own stream |
//! | freed while a capture is under way | [`Shard::leave`], then pending until the last capture ends (`capturing.rs`) | as any free | as any free |
//! | counted by other processes (shared, in the runtime's limbo: `ipc/limbo.rs`) | when no process counts on it any more, the runtime drops its `DataPtr`: [`Shard::leave`], as any free | as any free (a consumer lets go only after its own work on the bytes: `ipc/consumer.rs`) | as any free |
//! | asleep (its tag sleeps: `engine/sleep.rs`, `runtime/sleep.rs`) | not a change of owner: the owner keeps the block, its bytes wait in page-locked memory and its pages are unmapped | — (work on it is refused with `Error::Asleep`) | asleep, then awake: any work on the range meanwhile is reported |
//! | cached under another stream, taken over on a miss (`cross_stream_reuse:segments`: a whole idle segment moves to the asking stream's shard; `cross_stream.rs`) | out of its shard, then into the asking one and handed out | the old stream's work so far ([`DeviceCore::order_after`], made after the segment left its shard) | a hand-out on the asking stream, after the wait |
//! | lent to another stream (`cross_stream_reuse:blocks`: a free block of another stream's shard handed out to the asking stream; `cross_stream.rs`) | the borrower drops it: [`Shard::leave`] in the lending shard, which waits for the borrower's stream (recorded as a use by [`Shard::lend`]; never through a front cache) | at hand-out, the asking stream waits for the lender's work so far; at the free, the lender waits for the borrower's (an event, as any recorded stream) | a hand-out on the asking stream, after the wait; a free whose clock covers the borrower |
//! | pending (events recorded) | events complete (`state.rs`) | — | — |
//! | cached (free in its pool) | handed out again (`state.rs`), or given back to the driver (`device_release.rs`) | — | a hand-out checks every access on another stream was ordered before the free |
//!
//! Page-locked host blocks (`pinned/`) are another allocator's, above this layer, with the same
//! rule: a freed block waits for an event per stream that used it and is reused once they
//! completed; the sanitizer is told of the free and of the hand-out there (`pinned/state.rs`).

use super::DeviceCore;
use super::Shard;
use super::ShardState;
use crate::alloc::block::{Allocated, BlockId};
use crate::driver::capability::relaxed;
use crate::driver::{EventId, StreamId};
use crate::error::{Error, Result};

impl Shard {
    /// The owner of handed-out block `id` gave it up (a free): its statistics are settled and the
    /// streams it was used on returned — the next owner waits for them (pending events, or at
    /// once when none) — and the sanitizer is told of the free.
    pub(super) fn leave(&self, st: &mut ShardState, id: BlockId) -> Vec<StreamId> {
        let (ptr, size) = (st.blocks[id].ptr, st.blocks[id].size);
        let uses = st.release(id);
        if let Some(sanitizer) = &self.sanitizer {
            let graph_held = self.core.capturing.held_by_graphs(st.pool);
            sanitizer.free(ptr, size, self.stream(), &uses, graph_held);
        }
        uses
    }

    /// A thread's front cache takes over the `bytes` at `ptr` of a block only this shard's stream
    /// used: the same thread takes it next on the same stream, so nothing is waited for. For the
    /// sanitizer and the history the program freed the block (its next hand-out is an alloc).
    pub(in crate::alloc) fn leave_to_front(&self, ptr: u64, bytes: u64) {
        if let Some(sanitizer) = &self.sanitizer {
            sanitizer.free(ptr, bytes, self.stream(), &[], false);
        }
        self.core.record_front_free(self, ptr, bytes);
    }

    /// Free block `hit`, just handed out by this shard, is lent to `borrower` (another stream,
    /// `cross_stream_reuse:blocks`): its free waits for the borrower's work as for any recorded
    /// stream, so it never goes to a front cache, whose next taker waits for nothing.
    pub(in crate::alloc) fn lend(&self, mut hit: Allocated, borrower: StreamId) -> Allocated {
        self.state.lock().record_use(hit.block, borrower);
        hit.front = false;
        hit
    }

    /// Bytes `[ptr, ptr + len)` of this shard were handed out to a new owner (from its pools or
    /// a front cache): the sanitizer checks that every access on another stream was ordered
    /// before their free.
    #[inline]
    pub(in crate::alloc) fn handed_out(&self, ptr: u64, len: u64) {
        if let Some(sanitizer) = &self.sanitizer {
            let captured = self.core.capturing.any()
                && self
                    .core
                    .driver
                    .graphs()
                    .stream_capture_status(self.stream())
                    .is_ok_and(|s| s.is_capturing());
            sanitizer.hand_out(ptr, len, self.stream(), !captured);
        }
    }

    /// The shard's own stream, unless it is finished (synchronized and destroyed: nothing of it
    /// is left to wait for, and the driver knows it no more).
    fn own_stream_to_wait_for(&self) -> impl Iterator<Item = StreamId> {
        let finished = self
            .finished
            .load(crate::sync::os::atomic::Ordering::SeqCst);
        (!finished).then_some(self.stream()).into_iter()
    }

    /// Whether the bytes of handed-out block `id` can go to a new owner using them on `to`
    /// without a free between: every stream that used them can be waited for from `to`
    /// ([`DeviceCore::order`]). When not, the new owner copies instead and the block is freed —
    /// a free waits for what a wait cannot (`capturing.rs` defers it past the captures).
    pub(in crate::alloc) fn can_hand_over_in_place(&self, id: BlockId, to: StreamId) -> bool {
        let uses = self.state.lock().blocks[id].stream_uses.clone();
        self.own_stream_to_wait_for()
            .chain(uses)
            .filter(|&s| s != to)
            .all(|used| matches!(self.core.order(to, used), Ok(o) if o != Order::Impossible))
    }

    /// The bytes of handed-out block `id` go to a new owner without a free between (a lazy
    /// clone's last reference steals them), to be used on `to` next: `to` is ordered after the
    /// block's own stream and every stream recorded on it ([`DeviceCore::order_after`]). The
    /// recorded uses stay: the block's eventual free waits for them again, as `record_stream`
    /// promises its caller. Infallible: a wait that cannot be made is logged (the caller asked
    /// [`Shard::can_hand_over_in_place`] first). Returns whether `to` was ordered after another
    /// stream (`false`: every use was on `to`, nothing was queued).
    pub(in crate::alloc) fn hand_over_in_place(&self, id: BlockId, to: StreamId) -> bool {
        let uses = self.state.lock().blocks[id].stream_uses.clone();
        let mut ordered = false;
        for used in self
            .own_stream_to_wait_for()
            .chain(uses)
            .filter(|&s| s != to)
        {
            ordered = true;
            if let Err(err) = self.core.order_after(to, used) {
                tracing::error!(%err, "a change of owner could not be ordered after stream {}", used.raw());
            }
        }
        ordered
    }
}

/// How work next enqueued on one stream is ordered after another stream's work so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::alloc) enum Order {
    /// Neither is captured, or both are in one capture: a stream-ordered wait.
    StreamWait,
    /// The waiting stream is captured and the other is not: the host waits for it (this
    /// thread's capture mode relaxed), as a captured stream may not wait outside its capture.
    HostWaitStream,
    /// The other stream is in a capture the waiting one is not in: its eager work ended with the
    /// capture's tail event (`capturing.rs`), waited for on the stream …
    WaitTail(EventId),
    /// … or, the waiting stream being captured itself, on the host.
    HostWaitTail(EventId),
    /// The other stream is captured, and no tail of its eager work is known (a capture this
    /// allocator did not begin, or a stream that joined one): that work cannot be waited for.
    Impossible,
}

impl DeviceCore {
    /// Whether `stream` is gone: destroyed (synchronized first: `CachingAllocator::destroy_stream`),
    /// so nothing of it is left to wait for and the driver knows it no more. The one answer to
    /// "does a destroyed stream need a wait" (it does not) for every exit that waits for the
    /// streams a block was used on; blocks allocated on it stay valid, and the allocator's own
    /// work on them runs on a live stream (`tags.rs`).
    pub(in crate::alloc) fn stream_gone(&self, stream: StreamId) -> bool {
        self.driver.stream_device(stream).is_err()
    }

    /// How `to` can be ordered after `used` now.
    pub(in crate::alloc) fn order(&self, to: StreamId, used: StreamId) -> Result<Order> {
        // Asked of the driver even while this allocator runs no capture: a library may capture a
        // stream through the driver alone, and a wait on it would join that capture.
        let graphs = self.driver.graphs();
        let (to_capture, used_capture) = (
            graphs.stream_capture_status(to)?.capture_id(),
            graphs.stream_capture_status(used)?.capture_id(),
        );
        Ok(match (used_capture, to_capture) {
            (None, None) => Order::StreamWait,
            (None, Some(_)) => Order::HostWaitStream,
            (Some(u), Some(t)) if u == t => Order::StreamWait,
            (Some(_), to_capture) => match self.capturing.eager_tail(used) {
                Some(tail) if to_capture.is_some() => Order::HostWaitTail(tail),
                Some(tail) => Order::WaitTail(tail),
                None => Order::Impossible,
            },
        })
    }

    /// Makes work next enqueued on `to` wait for the work queued on `used` so far (see
    /// [`Order`]); an error when that cannot be done.
    pub(in crate::alloc) fn order_after(&self, to: StreamId, used: StreamId) -> Result<()> {
        if to == used {
            return Ok(());
        }
        let driver = &self.driver;
        match self.order(to, used)? {
            Order::StreamWait => driver.stream_wait_stream(to, used),
            Order::HostWaitStream => relaxed(driver.graphs(), || driver.stream_synchronize(used)),
            Order::WaitTail(tail) => driver.stream_wait_event(to, tail),
            Order::HostWaitTail(tail) => {
                relaxed(driver.graphs(), || driver.event_synchronize(tail))
            }
            Order::Impossible => Err(Error::capture(format!(
                "stream {} is being captured and the end of its work before the capture is not \
                 known (a capture this allocator did not begin, or a stream that joined one): it \
                 cannot be waited for from stream {} (end the capture first)",
                used.raw(),
                to.raw()
            ))),
        }
    }
}
