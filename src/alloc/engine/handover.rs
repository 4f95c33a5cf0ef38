//! When a block's bytes change owner, and what the next owner waits for: the one place that
//! decides it.
//!
//! A block's life, with the states the features add. Each exit that changes the block's owner
//! is decided here once, as a plan its caller carries out ([`FreePlan`] for a free, made by
//! [`Shard::leave`]; [`StealPlan`] for a lazy clone's steal, made by [`Shard::plan_steal`]); the
//! `plan` column names them (a test checks the column against the plans). A stream that is gone
//! (destroyed: synchronized first) is never waited for ([`DeviceCore::stream_gone`]); the block's
//! own stream is not when its shard is finished ([`Shard::own_stream_done`]).
//!
//! | state | how it is left | plan | what the next owner waits for | told to the sanitizer |
//! |---|---|---|---|---|
//! | handed out, used on its stream and recorded streams (`record_stream`, copies to pinned memory, a lazy clone's copiers) | the owner drops it: [`Shard::leave`] | `FreePlan::Now`, `FreePlan::AfterEvents` | nothing when only its own stream used it (or every other one is gone); else an event per recorded stream, polled before reuse (PyTorch's rule) | a free whose clock covers those streams |
//! | the same, freed while a capture is under way | [`Shard::leave`] | `FreePlan::Now`, `FreePlan::AfterCaptures` | as above; the events are recorded when the last capture ends (`capturing.rs`: no event may be recorded on a capturing stream) | as any free |
//! | handed out, stolen by a lazy clone's last reference (`cow::context`) | [`Shard::hand_over_in_place`]: no free, the bytes keep their address; the recorded streams stay recorded (the eventual free waits for them again) | `StealPlan::HandOver`, `StealPlan::CopyInstead` | the stealing stream is ordered after the block's own stream and every recorded stream: a stream-ordered wait, or across a capture the capture's tail event ([`Order`]); where no order can be made, the stealer copies instead and the block is freed | the waits themselves (ordinary driver calls) |
//! | freed into a pool that live graphs hold | [`Shard::leave`], as any free | as any free | as any free | a free marked *graph-held*: the graphs' replays may still touch the bytes |
//! | kept by a thread's front cache (`front.rs`) | [`Shard::leave_to_front`] (only blocks no other stream used: never a lent block, [`Shard::lend`], nor one recorded on another stream — its owner's size class is cleared then) | `FreePlan::Now` (known without the lock) | nothing: the same thread on the same stream takes them next | a free on its own stream |
//! | counted by other processes (shared, in the runtime's limbo: `ipc/limbo.rs`) | when no process counts on it any more, the runtime drops its `DataPtr`: [`Shard::leave`], as any free | as any free | as any free (a consumer lets go only after its own work on the bytes: `ipc/consumer.rs`) | as any free |
//! | asleep (its tag sleeps: `engine/sleep.rs`, `runtime/sleep.rs`) | not a change of owner: the owner keeps the block, its bytes wait in page-locked memory (copied on a live stream: `Shard::copy_stream`) and its pages are unmapped | — | — (work on it is refused with `Error::Asleep`) | asleep, then awake: any work on the range meanwhile is reported |
//! | cached under another stream, taken over on a miss (`cross_stream_reuse:segments`: a whole idle segment moves to the asking stream's shard; `cross_stream.rs`) | out of its shard, then into the asking one and handed out | — (free memory, no owner) | the old stream's work so far ([`DeviceCore::order_after`], made after the segment left its shard), nothing when that stream is done | a hand-out on the asking stream, after the wait |
//! | lent to another stream (`cross_stream_reuse:blocks`: a free block of another stream's shard handed out to the asking stream; `cross_stream.rs`) | the borrower drops it: [`Shard::leave`] in the lending shard, which waits for the borrower's stream (recorded as a use by [`Shard::lend`]; never through a front cache) | as any free | at hand-out, the asking stream waits for the lender's work so far; at the free, the lender waits for the borrower's (an event, as any recorded stream) | a hand-out on the asking stream, after the wait; a free whose clock covers the borrower |
//! | pending (events recorded) | events complete (`state.rs`) | — | — | — |
//! | cached (free in its pool) | handed out again (`state.rs`), or given back to the driver (`device_release.rs`, after the pending frees' events) | — | — | a hand-out checks every access on another stream was ordered before the free |
//!
//! Page-locked host blocks (`pinned/`) are another allocator's, above this layer, with the same
//! rule: a freed block waits for an event per stream that used it and is reused once they
//! completed; the sanitizer is told of the free and of the hand-out there (`pinned/state.rs`).

use super::DeviceCore;
use super::Shard;
use super::ShardState;
use crate::alloc::block::{Allocated, BlockId};
use crate::driver::capability::relaxed;
use crate::driver::{EventFlags, EventId, StreamId};
use crate::error::{Error, Result};

/// What a free leaves its block's next owner to wait for ([`Shard::leave`]); the free path
/// carries it out and decides nothing (`shard.rs`).
#[must_use = "a free's plan is carried out by its caller"]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::alloc) enum FreePlan {
    /// Nothing: only the block's own stream used it, or every other stream that did is gone
    /// (destroyed: synchronized first, nothing of it left). The block is free in its pool.
    Now,
    /// An event recorded now on each of these streams, polled before the block is handed out
    /// again (PyTorch's `record_stream` rule; `state.rs`).
    AfterEvents(Vec<StreamId>),
    /// As `AfterEvents`, but only once the last capture under way ends: no event may be recorded
    /// (nor queried) on a capturing stream (`capturing.rs`).
    AfterCaptures(Vec<StreamId>),
}

/// What a lazy clone's last reference may do with the block it would steal ([`Shard::plan_steal`]).
#[must_use = "a steal's plan is carried out by its caller"]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::alloc) enum StealPlan {
    /// Take the bytes in place: the stealing stream first waits for each of these streams'
    /// work (the block's own stream and every recorded one that is not the stealer's or gone).
    HandOver(Vec<StreamId>),
    /// One of those streams cannot be waited for from the stealer's (a capture this allocator
    /// did not begin): the stealer copies, and the block is freed (a free waits for what a wait
    /// cannot).
    CopyInstead,
}

/// Every plan's name, as the state table of the module docs names them (checked by a test).
#[cfg(test)]
const PLANS: [&str; 5] = [
    "FreePlan::Now",
    "FreePlan::AfterEvents",
    "FreePlan::AfterCaptures",
    "StealPlan::HandOver",
    "StealPlan::CopyInstead",
];

impl FreePlan {
    /// The plan's name in the module docs' state table.
    #[cfg(test)]
    fn name(&self) -> &'static str {
        match self {
            FreePlan::Now => PLANS[0],
            FreePlan::AfterEvents(_) => PLANS[1],
            FreePlan::AfterCaptures(_) => PLANS[2],
        }
    }
}

impl StealPlan {
    /// The plan's name in the module docs' state table.
    #[cfg(test)]
    fn name(&self) -> &'static str {
        match self {
            StealPlan::HandOver(_) => PLANS[3],
            StealPlan::CopyInstead => PLANS[4],
        }
    }
}

impl Shard {
    /// The owner of handed-out block `id` gave it up (a free): its statistics are settled, the
    /// sanitizer is told of the free, and the plan for its next owner is made — the one decision
    /// of what a free waits for. A block no other stream used is free at once; otherwise the
    /// streams it was used on, but those gone, are waited for, by events or, while a capture is
    /// under way, once the captures end.
    pub(super) fn leave(&self, st: &mut ShardState, id: BlockId) -> FreePlan {
        let (ptr, size) = (st.blocks[id].ptr, st.blocks[id].size);
        let uses = st.release(id);
        if let Some(sanitizer) = &self.sanitizer {
            let graph_held = self.core.wide.capturing.held_by_graphs(st.pool);
            sanitizer.free(ptr, size, self.stream(), &uses, graph_held);
        }
        if uses.is_empty() {
            // `release` freed it already: the hot path's one branch.
            return FreePlan::Now;
        }
        let waits = self.core.streams_to_wait_for(uses, None);
        if waits.is_empty() {
            st.finish_pending_without_events(id);
            FreePlan::Now
        } else if self.core.wide.capturing.any() {
            FreePlan::AfterCaptures(waits)
        } else {
            FreePlan::AfterEvents(waits)
        }
    }

    /// A thread's front cache takes over the `bytes` at `ptr` of a block only this shard's stream
    /// used: the same thread takes it next on the same stream, so nothing is waited for (the
    /// front cache's precondition of [`FreePlan::Now`], known without the lock: the block's
    /// owner lost its size class when another stream was recorded on it, or was lent one —
    /// [`Shard::lend`]). For the sanitizer and the history the program freed the block (its
    /// next hand-out is an alloc).
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

    /// Bytes `[ptr, ptr + len)` of this shard's block of `block` bytes at `ptr` were handed out
    /// to a new owner (from its pools or a front cache): the sanitizer checks that every access
    /// on another stream was ordered before their free, and none past `len`.
    #[inline]
    pub(in crate::alloc) fn handed_out(&self, ptr: u64, len: u64, block: u64) {
        if let Some(sanitizer) = &self.sanitizer {
            let captured = self.core.wide.capturing.any()
                && self
                    .core
                    .driver
                    .graphs()
                    .stream_capture_status(self.stream())
                    .is_ok_and(|s| s.is_capturing());
            sanitizer.hand_out(ptr, len, block, self.stream(), !captured);
        }
    }

    /// Whether this shard's own stream is done: finished (synchronized, about to be or already
    /// destroyed: `CachingAllocator::destroy_stream`) or gone. Nothing of it is left to wait for.
    pub(in crate::alloc) fn own_stream_done(&self) -> bool {
        self.finished
            .load(crate::sync::os::atomic::Ordering::SeqCst)
            || self.core.stream_gone(self.stream())
    }

    /// What a lazy clone's last reference may do with handed-out block `id` to use its bytes on
    /// `to` without a free between: the waits of a hand-over, or a copy when one of them cannot
    /// be made from `to` ([`DeviceCore::order`]).
    pub(in crate::alloc) fn plan_steal(&self, id: BlockId, to: StreamId) -> StealPlan {
        let waits = self.steal_waits(id, to);
        let orderable = waits
            .iter()
            .all(|&used| matches!(self.core.order(to, used), Ok(o) if o != Order::Impossible));
        if orderable {
            StealPlan::HandOver(waits)
        } else {
            StealPlan::CopyInstead
        }
    }

    /// The streams a steal of block `id` for `to` waits for: the shard's own (unless done) and
    /// every recorded use, but `to` and the streams that are gone.
    fn steal_waits(&self, id: BlockId, to: StreamId) -> Vec<StreamId> {
        let uses = self.state.lock().blocks[id].stream_uses.clone();
        let own = (!self.own_stream_done()).then_some(self.stream());
        self.core
            .streams_to_wait_for(own.into_iter().chain(uses), Some(to))
    }

    /// The bytes of handed-out block `id` go to a new owner without a free between (a lazy
    /// clone's last reference steals them), to be used on `to` next: the plan is made again —
    /// another reference may have recorded a stream since the caller's [`Shard::plan_steal`] —
    /// and carried out: `to` is ordered after each stream it names ([`DeviceCore::order_after`]).
    /// The recorded uses stay: the block's eventual free waits for them again, as
    /// `record_stream` promises its caller. Infallible: a wait that cannot be made is logged.
    /// Returns whether `to` was ordered after another stream (`false`: nothing was queued).
    pub(in crate::alloc) fn hand_over_in_place(&self, id: BlockId, to: StreamId) -> bool {
        let waits = match self.plan_steal(id, to) {
            StealPlan::HandOver(waits) => waits,
            StealPlan::CopyInstead => {
                tracing::error!(
                    "a stream recorded since the steal was planned cannot be waited for from \
                     stream {}: the hand-over goes on without that wait",
                    to.raw()
                );
                self.steal_waits(id, to)
            }
        };
        for &used in &waits {
            if let Err(err) = self.core.order_after(to, used) {
                tracing::error!(%err, "a change of owner could not be ordered after stream {}", used.raw());
            }
        }
        !waits.is_empty()
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
    /// streams a block was used on ([`crate::driver::stream_gone`]); blocks allocated on it stay
    /// valid, and the allocator's own work on them runs on a live stream (`tags.rs`).
    pub(in crate::alloc) fn stream_gone(&self, stream: StreamId) -> bool {
        crate::driver::stream_gone(self.driver.as_ref(), stream) || self.roster.is_finishing(stream)
    }

    /// The streams an exit waits for, of `used` (each once): not `to` (the new owner's own
    /// stream, whose order is its own), not a stream that is gone.
    fn streams_to_wait_for(
        &self,
        used: impl IntoIterator<Item = StreamId>,
        to: Option<StreamId>,
    ) -> Vec<StreamId> {
        let mut waits: Vec<StreamId> = Vec::new();
        for stream in used {
            if Some(stream) != to && !waits.contains(&stream) && !self.stream_gone(stream) {
                waits.push(stream);
            }
        }
        waits
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
            (Some(_), to_capture) => match self.wide.capturing.eager_tail(used) {
                Some(tail) if to_capture.is_some() => Order::HostWaitTail(tail),
                Some(tail) => Order::WaitTail(tail),
                None => Order::Impossible,
            },
        })
    }

    /// Makes work next enqueued on `to` wait for the work queued on `used` so far (see
    /// [`Order`]); an error when that cannot be done. Nothing when `used` is gone (destroyed:
    /// nothing of it is left to wait for — found by the model of every exit: a lazy clone made
    /// on a stream destroyed before the clone's first write failed that write).
    pub(in crate::alloc) fn order_after(&self, to: StreamId, used: StreamId) -> Result<()> {
        if to == used || self.stream_gone(used) {
            return Ok(());
        }
        match self.order_after_live(to, used) {
            // Destroyed meanwhile (by another thread): its work was done before it went.
            Err(err) if self.stream_gone(used) => {
                tracing::debug!(%err, "a stream destroyed during a wait for it: nothing to wait for");
                Ok(())
            }
            other => other,
        }
    }

    fn order_after_live(&self, to: StreamId, used: StreamId) -> Result<()> {
        let driver = &self.driver;
        // From the capture status asked to the wait enqueued, no capture of this allocator
        // begins: a wait enqueued on a stream whose capture began in between would join it.
        let no_capture_begins = self.wide.capturing.ordering();
        match self.order(to, used)? {
            Order::StreamWait => driver.stream_wait_stream(to, used),
            Order::WaitTail(tail) => driver.stream_wait_event(to, tail),
            Order::HostWaitStream => {
                // The end of `used`'s work so far, marked while no capture can begin there; the
                // host waits for the mark once the gate is open (found by review: a capture
                // begun on `used` between the gate and a stream synchronize was invalidated).
                let mark = driver.event_create(used.device(), EventFlags::default())?;
                let marked = driver.event_record(mark, used);
                drop(no_capture_begins);
                let waited = marked
                    .and_then(|()| relaxed(driver.graphs(), || driver.event_synchronize(mark)));
                if let Err(err) = driver.event_destroy(mark) {
                    tracing::warn!(%err, "destroying the mark of a host wait failed");
                }
                waited
            }
            Order::HostWaitTail(tail) => {
                drop(no_capture_begins);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The plans the module docs' state table names are exactly the plans there are.
    #[test]
    fn the_state_table_names_every_plan() {
        let docs: String = include_str!("handover.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .filter(|l| l.starts_with("//! | "))
            .collect();
        let samples = [
            FreePlan::Now.name(),
            FreePlan::AfterEvents(Vec::new()).name(),
            FreePlan::AfterCaptures(Vec::new()).name(),
            StealPlan::HandOver(Vec::new()).name(),
            StealPlan::CopyInstead.name(),
        ];
        assert_eq!(samples, PLANS);
        for plan in PLANS {
            assert!(
                docs.contains(&format!("`{plan}`")),
                "the state table does not name {plan}"
            );
        }
        let named = docs.matches("`FreePlan::").count() + docs.matches("`StealPlan::").count();
        let expected: usize = PLANS
            .iter()
            .map(|p| docs.matches(&format!("`{p}`")).count())
            .sum();
        assert_eq!(
            named, expected,
            "the state table names a plan that does not exist"
        );
    }
}
