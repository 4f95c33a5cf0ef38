//! The host as an actor that touches memory: page-locked host memory (the pinned host
//! allocator's buffers) is read and written by the CPU as well as by streams' copies.
//!
//! | call | effect |
//! |---|---|
//! | [`Sanitizer::host_access`] (a `PinnedBuffer` borrowed as a slice) | `H[h] += 1`; the bytes are accessed by the host actor `h` at that epoch — a race when an earlier stream access to them is not ordered before `H` (a copy still reading or writing them) |
//! | work enqueued on stream `s` | `C[s] ⊔= H` (as for every enqueue): a copy issued after the host wrote the bytes is ordered after that write |
//! | the host waits for an event or a stream | `H ⊔= …` (as before): a borrow after the wait is ordered after the copies the event covers |
//! | the pinned allocator frees a block used by copies (events `e…`) and by streams named with `record_stream` (`r…`) | the bytes are freed by `h` with `F = H ⊔ E[e…] ⊔ C[r…]`: what the allocator's events guarantee before reuse |
//! | the pinned allocator hands a block out | as a device hand-out, to the host: an access on a stream not ordered before `F` (or before `H` now) is a **use after free** |
//!
//! A hazard found at a host access is returned (and panics in panic mode); no stream is failed.
//! A hazard found at a pinned hand-out is reported — kept, logged, a panic in panic mode — but
//! not returned: the allocation itself succeeded, and no stream did the reuse.

use super::clock::VectorClock;
use super::{Sanitizer, Touch};
use crate::driver::{EventId, StreamId};
use crate::error::Result;

impl Sanitizer {
    /// The host (CPU) touches `touches` of page-locked memory now (`what` names the access in
    /// reports): checked against the streams' accesses to the same bytes, then recorded. A
    /// library reading or writing pinned memory outside cudalloc's buffers calls it before the
    /// access.
    pub fn host_access(&self, what: &str, touches: &[Touch]) -> Result<()> {
        let mut st = self.state.lock();
        let h = st.host_slot();
        let mut k = st.host.clone();
        k.tick(h);
        self.check_touches(&mut st, h, &k, what, touches, None)?;
        let epoch = k.get(h);
        st.host = k;
        self.record_touches(&mut st, h, epoch, what, touches, false);
        Ok(())
    }

    /// The pinned allocator freed the block `[start, start + len)`; its reuse waits for `events`
    /// (recorded after the copies that used it) and for the work `streams` had queued.
    pub(crate) fn free_host_block(
        &self,
        start: u64,
        len: u64,
        events: &[EventId],
        streams: &[StreamId],
    ) {
        let mut st = self.state.lock();
        let h = st.host_slot();
        let mut clock: VectorClock = st.host.clone();
        for event in events {
            if let Some(e) = st.events.get(event) {
                clock.join(e);
            }
        }
        for &s in streams {
            let slot = st.slot(s);
            clock.join(&st.actors[slot].clock);
        }
        Self::free_at(&mut st, start, len, h, clock, false);
    }

    /// The pinned allocator hands `[start, start + len)` to the host.
    pub(crate) fn hand_out_host(&self, start: u64, len: u64) {
        let mut st = self.state.lock();
        let h = st.host_slot();
        self.hand_out_at(&mut st, start, len, len, h, true);
    }
}
