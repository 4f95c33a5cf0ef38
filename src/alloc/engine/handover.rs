//! When a block's bytes change owner, and what the next owner waits for: the one place that
//! decides it.
//!
//! A block's life, with the states the features add:
//!
//! | state | how it is left | what the next owner waits for | told to the sanitizer |
//! |---|---|---|---|
//! | handed out, used on its stream and recorded streams (`record_stream`, copies to pinned memory, a lazy clone's copiers) | the owner drops it: [`Shard::leave`] | every stream it was used on: an event per recorded stream, polled before reuse (PyTorch's rule); none when only its own stream used it | a free whose clock covers those streams |
//! | handed out, stolen by a lazy clone's last reference (`cow::context`) | [`Shard::hand_over_in_place`]: no free, the bytes keep their address | the stealing stream waits, stream-ordered, for the block's own stream and every recorded stream (clones dropped while another stream still read them) | the waits themselves (ordinary driver calls) |
//! | freed into a pool that live graphs hold | [`Shard::leave`], as any free | as any free | a free marked *graph-held*: the graphs' replays may still touch the bytes |
//! | kept by a thread's front cache (`front.rs`) | [`Shard::leave_to_front`] (only blocks no other stream used) | nothing: the same thread on the same stream takes them next | a free on its own stream |
//! | freed while a capture is under way | [`Shard::leave`], then pending until the last capture ends (`capturing.rs`) | as any free | as any free |
//! | counted by other processes (shared, in the runtime's limbo: `ipc/limbo.rs`) | when no process counts on it any more, the runtime drops its `DataPtr`: [`Shard::leave`], as any free | as any free (a consumer lets go only after its own work on the bytes: `ipc/consumer.rs`) | as any free |
//! | asleep (its tag sleeps: `engine/sleep.rs`, `runtime/sleep.rs`) | not a change of owner: the owner keeps the block, its bytes wait in page-locked memory and its pages are unmapped | — (work on it is refused with `Error::Asleep`) | asleep, then awake: any work on the range meanwhile is reported |
//! | pending (events recorded) | events complete (`state.rs`) | — | — |
//! | cached (free in its pool) | handed out again (`state.rs`), or given back to the driver (`device_release.rs`) | — | a hand-out checks every access on another stream was ordered before the free |
//!
//! Page-locked host blocks (`pinned/`) are another allocator's, above this layer, with the same
//! rule: a freed block waits for an event per stream that used it and is reused once they
//! completed; the sanitizer is told of the free and of the hand-out there (`pinned/state.rs`).

use super::Shard;
use super::ShardState;
use crate::alloc::block::BlockId;
use crate::driver::{CaptureMode, Driver, StreamId};
use crate::error::Result;
use crate::sync::os::Arc;

impl Shard {
    /// The owner of handed-out block `id` gave it up (a free): its statistics are settled and the
    /// streams it was used on returned — the next owner waits for them (pending events, or at
    /// once when none) — and the sanitizer is told of the free.
    pub(super) fn leave(&self, st: &mut ShardState, id: BlockId) -> Vec<StreamId> {
        let (ptr, size) = (st.blocks[id].ptr, st.blocks[id].size);
        let uses = st.release(id, &self.core.config);
        if let Some(sanitizer) = &self.sanitizer {
            let graph_held = self.core.capturing.held_by_graphs(st.pool);
            sanitizer.free(ptr, size, self.stream, &uses, graph_held);
        }
        uses
    }

    /// A thread's front cache takes over the `bytes` at `ptr` of a block only this shard's stream
    /// used: the same thread takes it next on the same stream, so nothing is waited for. For the
    /// sanitizer and the history the program freed the block (its next hand-out is an alloc).
    pub(crate) fn leave_to_front(&self, ptr: u64, bytes: u64) {
        if let Some(sanitizer) = &self.sanitizer {
            sanitizer.free(ptr, bytes, self.stream, &[], false);
        }
        self.core.record_front_free(self, ptr, bytes);
    }

    /// Bytes `[ptr, ptr + len)` of this shard were handed out to a new owner (from its pools or
    /// a front cache): the sanitizer checks that every access on another stream was ordered
    /// before their free.
    #[inline]
    pub(crate) fn handed_out(&self, ptr: u64, len: u64) {
        if let Some(sanitizer) = &self.sanitizer {
            sanitizer.hand_out(ptr, len, self.stream);
        }
    }

    /// The bytes of handed-out block `id` go to a new owner without a free between (a lazy
    /// clone's last reference steals them), to be used on `to` next: `to` waits, stream-ordered,
    /// for the block's own stream and every stream recorded on it, and the recorded uses are
    /// consumed (the wait covers them). `to_capturing`: `to` is being captured; then work outside
    /// the capture is waited for on the host, and streams being captured have no eager work to
    /// wait for. Infallible: a wait that cannot be enqueued is made on the host instead (logged).
    pub(crate) fn hand_over_in_place(&self, id: BlockId, to: StreamId, to_capturing: bool) {
        let mut waited = std::mem::take(&mut self.state.lock().blocks[id].stream_uses);
        waited.push(self.stream);
        waited.retain(|&s| s != to);
        waited.dedup();
        let driver = &self.core.driver;
        for used in waited {
            if let Err(err) = order_after(driver, to, to_capturing, used) {
                tracing::warn!(%err, "a change of owner: waiting for stream {} on the host instead", used.raw());
                if let Err(err) = relaxed(driver, || driver.stream_synchronize(used)) {
                    tracing::error!(%err, "a change of owner: waiting on the host failed");
                }
            }
        }
    }
}

/// Makes work enqueued on `to` next wait for the work queued on `used` so far.
fn order_after(
    driver: &Arc<dyn Driver>,
    to: StreamId,
    to_capturing: bool,
    used: StreamId,
) -> Result<()> {
    if driver.graphs().stream_capture_status(used)?.is_capturing() {
        // Recorded into a graph, not run: nothing eager to wait for, unless `to` joins the
        // same capture (a wait inside it).
        return if to_capturing {
            driver.stream_wait_stream(to, used)
        } else {
            Ok(())
        };
    }
    if to_capturing {
        // CUDA's capture isolation: a capturing stream cannot wait on work outside its capture.
        return relaxed(driver, || driver.stream_synchronize(used));
    }
    driver.stream_wait_stream(to, used)
}

/// Runs `f` with this thread's capture interaction mode relaxed (a host wait for work outside a
/// capture, which a global capture would otherwise forbid), restoring it after.
pub(crate) fn relaxed<R>(driver: &Arc<dyn Driver>, f: impl FnOnce() -> R) -> R {
    let before = driver.graphs().exchange_capture_mode(CaptureMode::Relaxed);
    let out = f();
    driver.graphs().exchange_capture_mode(before);
    out
}
