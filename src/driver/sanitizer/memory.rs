//! What the allocator and the IPC layer tell the checker of memory (the allocator's part of the
//! model in the [module docs](super)): mappings and their end, frees (graph-held ones too),
//! hand-outs and releases of freed memory, and other processes' writes before their IPC events.

use super::clock::VectorClock;
use super::report::{AccessReport, HazardKind, HazardReport};
use super::shadow::{Access, Cell, Free, Taken};
use super::state::{Actor, Allocation, State};
use super::Sanitizer;
use crate::driver::access::AccessKind;
use crate::driver::{EventId, StreamId};
use crate::sync::os::{Arc, MutexGuard};

impl Sanitizer {
    /// The driver mapped `[base, base + size)` (a segment, an opened segment): nothing is known
    /// of it yet.
    pub(crate) fn mapped(&self, base: u64, size: u64) {
        let mut st = self.state.lock();
        st.shadow.forget(base, base.saturating_add(size));
        st.segments.insert(base, size);
    }

    /// The driver's memory at `base` (a segment mapped before) is going back (told before the
    /// call that gives it back: `SanitizedDriver::unmapping`). Its size, when it was known.
    pub(crate) fn unmapped_segment(&self, base: u64) -> Option<u64> {
        let mut st = self.state.lock();
        let size = st.segments.remove(&base);
        if let Some(size) = size {
            self.check_release(&mut st, base, size);
            Self::forget_locked(&mut st, base, size);
        }
        st.managed.remove(&base);
        size
    }

    /// `[start, start + len)` is gone (unmapped pages). The allocations that start there stay
    /// known: pages are unmapped under live allocations only by a sleep, whose wake maps them
    /// back at the same addresses (their bounds and copy-on-write sharing hold again then).
    pub(crate) fn forget(&self, start: u64, len: u64) {
        let mut st = self.state.lock();
        self.check_release(&mut st, start, len);
        st.shadow.forget(start, start.saturating_add(len));
    }

    /// Memory the allocator held as free goes back to the driver: a free that an access on
    /// another stream was not ordered before is reported now, as its reuse would have been — so
    /// the verdict does not depend on whether memory pressure released the block before reuse.
    fn check_release(&self, st: &mut MutexGuard<'_, State>, start: u64, len: u64) {
        let end = start.saturating_add(len);
        let freed: Vec<(Arc<Free>, Vec<Arc<Access>>)> = st
            .shadow
            .existing(start, end)
            .filter_map(|(_, cell)| {
                let free = cell.freed.clone()?;
                Some((free, cell.accesses().cloned().collect()))
            })
            .collect();
        let hazard = freed.into_iter().find_map(|(free, accesses)| {
            let now = st.knowledge(free.owner_slot);
            accesses
                .into_iter()
                .find(|a| unordered_before_reuse(a, &free, &now))
                .map(|a| (a, free))
        });
        let Some((earlier, free)) = hazard else {
            return;
        };
        let owner = st.actors[free.owner_slot].name.clone();
        let report = HazardReport {
            kind: HazardKind::UseAfterFree,
            earlier: AccessReport::of(&earlier),
            later: AccessReport {
                kind: "release",
                what: format!("the allocator giving the memory of {owner} back to the driver"),
                start,
                len,
                allocation: None,
                stack: self.stack().as_ref().map(|s| s.render_now()),
            },
            free: Some(free.what.clone()),
        };
        let _sticky = self.fail(st, free.owner_slot, report);
    }

    fn forget_locked(st: &mut State, start: u64, len: u64) {
        let end = start.saturating_add(len);
        st.shadow.forget(start, end);
        let doomed: Vec<u64> = st.allocations.range(start..end).map(|(&s, _)| s).collect();
        for s in doomed {
            st.allocations.remove(&s);
        }
    }

    /// An IPC event of process `producer` was opened as `event`: it stands for the producer's
    /// writes before it. Each producer process is one actor whose epoch rises with every event
    /// opened (a wait on a later event of that process covers the earlier ones: the sanitizer
    /// may miss a race there, never invent one); returns the epoch `event` stands for.
    pub(crate) fn remote_event(&self, event: EventId, producer: u32) -> u64 {
        let mut st = self.state.lock();
        let slot = match st.producers.get(&producer) {
            Some(&slot) => slot,
            None => {
                let slot = st.actors.len();
                st.actors.push(Actor {
                    clock: VectorClock::default(),
                    name: format!("the writes of producer process {producer} before its IPC event"),
                    sticky: None,
                });
                st.producers.insert(producer, slot);
                slot
            }
        };
        let epoch = st.actors[slot].clock.tick(slot);
        let mut clock = VectorClock::default();
        clock.raise(slot, epoch);
        st.events.insert(event, clock);
        epoch
    }

    /// Bytes of a received storage were written by process `producer` before its event of
    /// `epoch` ([`Sanitizer::remote_event`]), which the receiving stream waited for: any other
    /// stream must wait for that one (or the event) before using them.
    pub(crate) fn remote_write(&self, start: u64, len: u64, producer: u32, epoch: u64) {
        let mut st = self.state.lock();
        let Some(&slot) = st.producers.get(&producer) else {
            return;
        };
        let access = Access {
            slot,
            epoch,
            kind: AccessKind::Write,
            what: st.actors[slot].name.clone(),
            start,
            len: len.min(u64::MAX - start),
            allocation: Some("a storage received from another process".into()),
            stack: None,
            replay: false,
        };
        st.record(Arc::new(access), false);
    }

    /// The allocator freed the block `[start, start + len)` of `stream`, whose reuse waits for
    /// the work `used_by` had queued (record_stream). `graph_held`: the block's pool is held by
    /// live graphs, whose replays may still touch it.
    pub(crate) fn free(
        &self,
        start: u64,
        len: u64,
        stream: StreamId,
        used_by: &[StreamId],
        graph_held: bool,
    ) {
        let mut st = self.state.lock();
        let owner = st.slot(stream);
        let mut clock = st.knowledge(owner);
        for &s in used_by {
            let slot = st.slot(s);
            clock.join(&st.actors[slot].clock);
        }
        Self::free_at(&mut st, start, len, owner, clock, graph_held);
    }

    /// Marks `[start, start + len)` freed by `owner`, reusable once `clock` is known.
    pub(super) fn free_at(
        st: &mut State,
        start: u64,
        len: u64,
        owner: usize,
        clock: VectorClock,
        graph_held: bool,
    ) {
        let what = format!(
            "the free of {} (bytes [{start:#x}, {:#x}))",
            st.allocation_at(start)
                .unwrap_or_else(|| "an allocation".into()),
            start.saturating_add(len)
        );
        let free = Arc::new(Free {
            clock,
            owner_slot: owner,
            what,
            graph_held,
        });
        let end = start.saturating_add(len);
        // A graph-held free marks every byte (a later hand-out must see them all: a replay may
        // touch bytes nobody touched yet); another free only the bytes something touched.
        let cells: Vec<&mut Cell> = if graph_held {
            st.shadow.covering(start, end).map(|(_, c)| c).collect()
        } else {
            st.shadow.existing(start, end).map(|(_, c)| c).collect()
        };
        for cell in cells {
            // Bytes of the block that the last hand-out did not cover (an unsplit remainder)
            // are still waiting since an earlier free: that free's clock stays theirs.
            if cell.freed.is_none() {
                cell.freed = Some(Arc::clone(&free));
            }
            cell.graph_reused = None;
        }
        st.allocations.remove(&start);
    }

    /// Lazy clones share the allocation that starts at `start` copy-on-write (`shared`), or no
    /// longer do (the last reference stole it, or is the only one left). While shared, a write
    /// into it — through a lazy clone's read pointer, or a raw pointer — is reported
    /// ([`HazardKind::CowWrite`](super::HazardKind::CowWrite)) and refused.
    pub(crate) fn cow_shared(&self, start: u64, shared: bool) {
        if let Some(a) = self.state.lock().allocations.get_mut(&start) {
            a.cow_shared = shared;
        }
    }

    /// The allocator hands `[start, start + len)` out on `stream`: every access to it on another
    /// actor must be ordered before its free, else a use after free (sticky on `stream`).
    /// `eager`: not an allocation of a capture (a capture sharing a graph's pool may take its
    /// freed bytes: it follows the graph's replays, PyTorch's rule for shared pools).
    /// `block`: the allocator's block, `len` rounded (the bytes past `len` are out of bounds).
    pub(crate) fn hand_out(&self, start: u64, len: u64, block: u64, stream: StreamId, eager: bool) {
        let mut st = self.state.lock();
        let owner = st.slot(stream);
        self.hand_out_at(&mut st, start, len, block, owner, eager);
    }

    /// [`Sanitizer::hand_out`] to actor `owner`.
    pub(super) fn hand_out_at(
        &self,
        st: &mut MutexGuard<'_, State>,
        start: u64,
        len: u64,
        block: u64,
        owner: usize,
        eager: bool,
    ) {
        // What the block's stream knows now: an access the host or the stream waited for after
        // the free is ordered before the reuse too.
        let now = st.knowledge(owner);
        let end = start.saturating_add(len);
        let mut hazard: Option<(Arc<Access>, String)> = None;
        let id = st.next_allocation;
        let stream_name = st.actors[owner].name.clone();
        let mut taker: Option<Arc<Taken>> = None;
        for (_, cell) in st.shadow.existing(start, end) {
            let Some(free) = cell.freed.take() else {
                continue;
            };
            if free.graph_held && eager {
                let taker = taker.get_or_insert_with(|| {
                    Arc::new(Taken {
                        what: format!(
                            "allocation #{id} ({start:#x}, {len} bytes, allocated on {stream_name})"
                        ),
                        id,
                    })
                });
                cell.graph_reused = Some(Arc::clone(taker));
            }
            if hazard.is_none() {
                hazard = cell
                    .accesses()
                    .find(|a| unordered_before_reuse(a, &free, &now))
                    .map(|a| (Arc::clone(a), free.what.clone()));
            }
            // The allocator waited for the other streams' work: only the block's own stream's
            // accesses still order what comes next.
            cell.write = cell.write.take().filter(|w| w.slot == free.owner_slot);
            cell.reads.retain(|r| r.slot == free.owner_slot);
        }
        st.shadow.tidy(start, end);
        st.next_allocation += 1;
        // The segment is the allocator's: its bytes outside allocations are out of bounds.
        if let Some((&base, &size)) = st.segments.range(..=start).next_back() {
            if start < base.saturating_add(size) {
                st.managed.insert(base, base.saturating_add(size));
            }
        }
        st.allocations.insert(
            start,
            Allocation {
                end,
                block_end: start.saturating_add(block.max(len)),
                id,
                stream: stream_name.clone(),
                cow_shared: false,
            },
        );
        if let Some((earlier, free)) = hazard {
            let report = HazardReport {
                kind: HazardKind::UseAfterFree,
                earlier: AccessReport::of(&earlier),
                later: AccessReport {
                    kind: "hand-out",
                    what: format!("the allocator on {stream_name}"),
                    start,
                    len,
                    allocation: st.allocation_at(start),
                    stack: self.stack().as_ref().map(|s| s.render_now()),
                },
                free: Some(free),
            };
            let _sticky = self.fail(st, owner, report);
        }
    }
}

/// Whether `access` (to bytes freed by `free`) on another actor than the block's stream is
/// ordered neither before the free nor before a reuse by the block's stream, which knows `now`.
/// A replay's access to bytes freed into a pool its graphs hold is the graph's own: the pool's
/// reuse follows the replays (a capture sharing the pool) or the driver's synchronizing free.
fn unordered_before_reuse(access: &Access, free: &Free, now: &VectorClock) -> bool {
    let graphs_own = free.graph_held && access.replay;
    let ordered = access.slot == free.owner_slot
        || free.clock.knows(access.slot, access.epoch)
        || now.knows(access.slot, access.epoch);
    !graphs_own && !ordered
}
