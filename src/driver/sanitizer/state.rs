//! The checker's state: actors and their clocks, events, the shadow memory, live allocations and
//! the reports (see the model in the [module docs](super)).

use std::collections::{BTreeMap, HashMap};

use super::clock::VectorClock;
use super::report::HazardReport;
use super::shadow::{Access, Free, Shadow, Taken};
use crate::driver::access::AccessKind;
use crate::driver::{EventId, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::Arc;

/// An actor: a stream, the host (touching page-locked memory), or another process's writes
/// before one of its events.
#[derive(Debug)]
pub(super) struct Actor {
    pub(super) clock: VectorClock,
    pub(super) name: String,
    /// The hazard that failed this stream (sticky).
    pub(super) sticky: Option<Error>,
}

/// A live hand-out of the allocator, for naming the allocation of an access and checking that
/// an access stays inside it.
#[derive(Debug)]
pub(super) struct Allocation {
    /// The end of the bytes asked for.
    pub(super) end: u64,
    /// The end of the allocator's block (its rounding): bytes in `[end, block_end)` are out of
    /// bounds, reported as past this allocation's end.
    pub(super) block_end: u64,
    pub(super) id: u64,
    pub(super) stream: String,
    /// Lazy clones share it copy-on-write: a write into it is a hazard (`Sanitizer::cow_shared`).
    pub(super) cow_shared: bool,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) streams: HashMap<StreamId, usize>,
    pub(super) actors: Vec<Actor>,
    pub(super) host: VectorClock,
    pub(super) events: HashMap<EventId, VectorClock>,
    /// The clock after the latest launch of each instantiated graph: its next launch, on any
    /// stream, is ordered after it (`Sanitizer::launch`).
    pub(super) launches: HashMap<u64, VectorClock>,
    /// The actor of each producer process whose IPC events were opened.
    pub(super) producers: HashMap<u32, usize>,
    pub(super) shadow: Shadow,
    pub(super) allocations: BTreeMap<u64, Allocation>,
    pub(super) next_allocation: u64,
    /// Memory the driver mapped (segments, opened segments): base → size, forgotten on free.
    pub(super) segments: BTreeMap<u64, u64>,
    /// Segments the allocator hands out blocks of (seen at a hand-out): base → end. An access to
    /// their bytes outside every live allocation touches memory the allocator holds but never
    /// handed out (or handed out and took back): out of bounds.
    pub(super) managed: BTreeMap<u64, u64>,
    pub(super) reports: Vec<HazardReport>,
    pub(super) hazards: u64,
    /// The host's actor, once it touched page-locked memory (`host.rs`).
    pub(super) host_actor: Option<usize>,
    /// Ranges of sleeping tags: start → (end, tag) (`asleep.rs`).
    pub(super) asleep: BTreeMap<u64, (u64, Arc<str>)>,
}

impl State {
    pub(super) fn slot(&mut self, stream: StreamId) -> usize {
        if let Some(&slot) = self.streams.get(&stream) {
            return slot;
        }
        let slot = self.actors.len();
        let serial = stream.serial();
        self.actors.push(Actor {
            clock: VectorClock::default(),
            name: format!("stream {serial} of device {}", stream.device()),
            sticky: None,
        });
        self.streams.insert(stream, slot);
        slot
    }

    /// The host's actor (made on first use); its clock is [`State::host`].
    pub(super) fn host_slot(&mut self) -> usize {
        if let Some(slot) = self.host_actor {
            return slot;
        }
        let slot = self.actors.len();
        self.actors.push(Actor {
            clock: VectorClock::default(),
            name: "the host".to_owned(),
            sticky: None,
        });
        self.host_actor = Some(slot);
        slot
    }

    pub(super) fn sticky(&mut self, stream: StreamId) -> Result<usize> {
        let slot = self.slot(stream);
        match &self.actors[slot].sticky {
            Some(err) => Err(err.clone()),
            None => Ok(slot),
        }
    }

    /// The clock work enqueued on `slot` now carries (the stream's, joined with the host's).
    pub(super) fn knowledge(&self, slot: usize) -> VectorClock {
        let mut k = self.actors[slot].clock.clone();
        k.join(&self.host);
        k
    }

    pub(super) fn allocation_at(&self, addr: u64) -> Option<String> {
        let (&start, a) = self.allocations.range(..=addr).next_back()?;
        (addr < a.end).then(|| Self::name(start, a))
    }

    fn name(start: u64, a: &Allocation) -> String {
        format!(
            "allocation #{} ({:#x}, {} bytes, allocated on {})",
            a.id,
            start,
            a.end - start,
            a.stream
        )
    }

    /// The allocation `[start, end)` leaves, and how many of its bytes lie outside it: an access
    /// that begins in a live allocation and runs past its end, or begins outside every allocation
    /// and runs into one. `None` for an access inside one allocation, or touching none (memory the
    /// allocator did not hand out: a driver allocation of a library's own, another process's).
    pub(super) fn out_of_bounds(&self, start: u64, end: u64) -> Option<(String, u64)> {
        if let Some((&at, a)) = self.allocations.range(..=start).next_back() {
            if start < a.end {
                return (end > a.end).then(|| (Self::name(at, a), end - a.end));
            }
        }
        let (&at, a) = self.allocations.range(start..end).next()?;
        Some((Self::name(at, a), at - start))
    }

    /// The live allocation whose block's rounding holds `addr` (past the bytes asked for, before
    /// the block's end), named.
    pub(super) fn in_rounding_of(&self, addr: u64) -> Option<String> {
        let (&start, a) = self.allocations.range(..=addr).next_back()?;
        (a.end <= addr && addr < a.block_end).then(|| Self::name(start, a))
    }

    /// The allocator's segment under `[start, end)` when no live allocation holds `start` and the
    /// range touches that segment's bytes outside every allocation: its base and the bytes from
    /// `start` to the first allocation (or the range's end).
    pub(super) fn unallocated(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        if self.allocation_at(start).is_some() {
            return None;
        }
        let (&base, &seg_end) = self.managed.range(..=start).next_back()?;
        if start >= seg_end {
            return None;
        }
        let next = self
            .allocations
            .range(start..end)
            .next()
            .map_or(end, |(&at, _)| at);
        Some((base, next.min(seg_end) - start))
    }

    /// The allocation lazy clones share that `[start, end)` touches, named.
    pub(super) fn cow_shared_in(&self, start: u64, end: u64) -> Option<String> {
        let first = self
            .allocations
            .range(..=start)
            .next_back()
            .filter(|(_, a)| start < a.end)
            .map_or(start, |(&at, _)| at);
        self.allocations
            .range(first..end)
            .find(|(_, a)| a.cow_shared)
            .map(|(&at, a)| Self::name(at, a))
    }

    /// The first earlier access to `[start, end)` that an access of `kind` by `slot` carrying
    /// `k` is not ordered after.
    pub(super) fn conflict(
        &mut self,
        start: u64,
        end: u64,
        slot: usize,
        k: &VectorClock,
        kind: AccessKind,
    ) -> Option<Arc<Access>> {
        for (_, cell) in self.shadow.existing(start, end) {
            let unordered = |a: &&Arc<Access>| a.slot != slot && !k.knows(a.slot, a.epoch);
            if let Some(w) = cell.write.as_ref().filter(unordered) {
                return Some(Arc::clone(w));
            }
            if kind == AccessKind::Write {
                if let Some(r) = cell.reads.iter().find(unordered) {
                    return Some(Arc::clone(r));
                }
            }
        }
        None
    }

    /// The first byte of `[start, end)` that a graph-held pool freed and handed out since to an
    /// allocation numbered `born` or later (after a graph's capture ended), with that allocation.
    pub(super) fn graph_reused_in(
        &mut self,
        start: u64,
        end: u64,
        born: u64,
    ) -> Option<(u64, Arc<Taken>)> {
        self.shadow.existing(start, end).find_map(|(&at, cell)| {
            cell.graph_reused
                .as_ref()
                .filter(|t| t.id >= born)
                .map(|t| (at.max(start), Arc::clone(t)))
        })
    }

    /// The first byte of `[start, end)` the allocator holds as free, with that free.
    pub(super) fn freed_in(&mut self, start: u64, end: u64) -> Option<(u64, Arc<Free>)> {
        self.shadow
            .existing(start, end)
            .find_map(|(&at, cell)| cell.freed.as_ref().map(|f| (at.max(start), Arc::clone(f))))
    }

    /// Records `access` on its bytes; `replay`: not on bytes freed into a pool live graphs hold
    /// (the graph's own, see `Sanitizer::commit`).
    pub(super) fn record(&mut self, access: Arc<Access>, replay: bool) {
        let (start, end) = (access.start, access.start + access.len);
        for (_, cell) in self.shadow.covering(start, end) {
            if replay && cell.freed.as_ref().is_some_and(|f| f.graph_held) {
                continue;
            }
            match access.kind {
                AccessKind::Write => {
                    cell.write = Some(Arc::clone(&access));
                    cell.reads.clear();
                }
                AccessKind::Read => {
                    cell.reads.retain(|r| r.slot != access.slot);
                    cell.reads.push(Arc::clone(&access));
                }
            }
        }
        self.shadow.tidy(start, end);
    }
}
