//! The pinned allocator's bookkeeping under its one lock: blocks, free lists per size class,
//! the queue of events freed blocks wait for, the event pool, statistics — and the invariants
//! that tie them together (`check`).

use std::collections::VecDeque;

use slab::Slab;

use super::memory::{Reserve, Source};
use super::stats::PinnedStats;
use crate::driver::{EventId, HostAddr};

/// Size classes: block sizes are powers of two, `1 << class`.
pub(super) const CLASSES: usize = 64;

/// Where a block is in its life (the table in `pinned/mod.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BlockState {
    /// Held by a `PinnedBuffer`.
    InUse,
    /// Freed; waiting for this many events.
    Waiting(u32),
    /// In its class's free list.
    Cached,
}

#[derive(Debug)]
pub(super) struct Block {
    pub(super) addr: HostAddr,
    pub(super) size: u64,
    pub(super) source: Source,
    pub(super) state: BlockState,
}

/// An event a freed block waits for.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pending {
    pub(super) event: EventId,
    pub(super) device: usize,
    pub(super) block: usize,
    /// The entry's number in the queue (never reused): an event id comes back from the pool for
    /// other blocks, so a poller that queried an entry recognizes it by this, not by the event.
    pub(super) ticket: u64,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) blocks: Slab<Block>,
    /// Cached blocks of each class (last freed is reused first).
    pub(super) free: Vec<Vec<usize>>,
    /// Events of freed blocks, oldest first.
    pub(super) events: VecDeque<Pending>,
    /// Idle events per device.
    pub(super) event_pool: Vec<Vec<EventId>>,
    /// The next queue entry's ticket.
    pub(super) next_ticket: u64,
    pub(super) reserve: Option<Reserve>,
    /// Making the reserve segment failed once: not tried again.
    pub(super) reserve_failed: bool,
    pub(super) stats: PinnedStats,
}

/// The class of a power-of-two size.
pub(super) fn class_of(size: u64) -> usize {
    size.trailing_zeros() as usize
}

impl State {
    pub(super) fn new() -> Self {
        State {
            free: vec![Vec::new(); CLASSES],
            ..State::default()
        }
    }

    /// A new block, handed out.
    pub(super) fn insert(&mut self, addr: HostAddr, size: u64, source: Source) -> usize {
        let bytes = i64::try_from(size).unwrap_or(i64::MAX);
        self.stats.allocations.increase(1);
        self.stats.allocated_bytes.increase(bytes);
        self.stats.active_requests.increase(1);
        self.stats.active_bytes.increase(bytes);
        self.blocks.insert(Block {
            addr,
            size,
            source,
            state: BlockState::InUse,
        })
    }

    /// A cached block of `size` (a power of two), handed out.
    pub(super) fn take_cached(&mut self, size: u64) -> Option<(usize, HostAddr)> {
        let index = self.free.get_mut(class_of(size))?.pop()?;
        let block = self.blocks.get_mut(index)?;
        block.state = BlockState::InUse;
        let (addr, bytes) = (block.addr, i64::try_from(block.size).unwrap_or(i64::MAX));
        self.stats.active_requests.increase(1);
        self.stats.active_bytes.increase(bytes);
        Some((index, addr))
    }

    /// Block `index` is reusable: into its class's free list.
    pub(super) fn cache(&mut self, index: usize) {
        let Some(block) = self.blocks.get_mut(index) else {
            return;
        };
        block.state = BlockState::Cached;
        let (class, bytes) = (
            class_of(block.size),
            i64::try_from(block.size).unwrap_or(i64::MAX),
        );
        self.stats.active_requests.decrease(1);
        self.stats.active_bytes.decrease(bytes);
        if let Some(list) = self.free.get_mut(class) {
            list.push(index);
        }
    }

    /// One of block `index`'s events completed: cached at its last.
    pub(super) fn event_done(&mut self, index: usize) {
        let Some(block) = self.blocks.get_mut(index) else {
            return;
        };
        match block.state {
            BlockState::Waiting(n) if n > 1 => block.state = BlockState::Waiting(n - 1),
            BlockState::Waiting(_) => self.cache(index),
            BlockState::InUse | BlockState::Cached => {}
        }
    }

    /// Takes every cached block that can go back to the driver out of the books.
    pub(super) fn take_releasable(&mut self) -> Vec<Block> {
        let mut out = Vec::new();
        for list in &mut self.free {
            let (keep, go): (Vec<usize>, Vec<usize>) = list
                .iter()
                .partition(|&&i| self.blocks[i].source == Source::Reserve);
            *list = keep;
            for i in go {
                let block = self.blocks.remove(i);
                let bytes = i64::try_from(block.size).unwrap_or(i64::MAX);
                self.stats.allocations.decrease(1);
                self.stats.allocated_bytes.decrease(bytes);
                out.push(block);
            }
        }
        out
    }

    /// A block `take_releasable` took that could not be released: cached again.
    pub(super) fn restore(&mut self, block: Block) {
        // Undoes `take_releasable`'s count: the block never left.
        let bytes = i64::try_from(block.size).unwrap_or(i64::MAX);
        self.stats.allocations.current += 1;
        self.stats.allocations.freed -= 1;
        self.stats.allocated_bytes.current += bytes;
        self.stats.allocated_bytes.freed -= bytes;
        let class = class_of(block.size);
        let index = self.blocks.insert(Block {
            state: BlockState::Cached,
            ..block
        });
        if let Some(list) = self.free.get_mut(class) {
            list.push(index);
        }
    }

    /// The invariants: every block is in exactly one place its state names; the free lists hold
    /// cached blocks of their class; events name waiting blocks, as many as they wait for;
    /// blocks do not overlap; carved blocks lie in the reserve; the statistics count what is
    /// here. Returns the first violation.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut cached = 0usize;
        for (class, list) in self.free.iter().enumerate() {
            for &i in list {
                let b = self
                    .blocks
                    .get(i)
                    .ok_or_else(|| format!("free list {class} names missing block {i}"))?;
                if b.state != BlockState::Cached || class_of(b.size) != class {
                    return Err(format!("free list {class} holds block {i} ({b:?})"));
                }
                cached += 1;
            }
        }
        let mut waits = vec![0u32; self.blocks.capacity()];
        for p in &self.events {
            match self.blocks.get(p.block).map(|b| b.state) {
                Some(BlockState::Waiting(_)) => waits[p.block] += 1,
                other => return Err(format!("event for block {} in state {other:?}", p.block)),
            }
        }
        let (mut bytes, mut active, mut active_bytes) = (0i64, 0i64, 0i64);
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (i, b) in &self.blocks {
            if !b.size.is_power_of_two() {
                return Err(format!(
                    "block {i} has size {} (not a power of two)",
                    b.size
                ));
            }
            match b.state {
                BlockState::Cached => {}
                BlockState::Waiting(n) if n == waits[i] && n > 0 => {}
                BlockState::Waiting(n) => {
                    return Err(format!(
                        "block {i} waits for {n} events, {} queued",
                        waits[i]
                    ))
                }
                BlockState::InUse => {}
            }
            if b.state != BlockState::Cached {
                active += 1;
                active_bytes += b.size as i64;
            }
            if b.source == Source::Reserve && !self.reserve.as_ref().is_some_and(|r| r.owns(b.addr))
            {
                return Err(format!("block {i} is carved but outside the reserve"));
            }
            bytes += b.size as i64;
            spans.push((b.addr.0, b.addr.0 + b.size));
        }
        let cached_blocks = self
            .blocks
            .iter()
            .filter(|(_, b)| b.state == BlockState::Cached)
            .count();
        if cached != cached_blocks {
            return Err(format!(
                "{cached_blocks} cached blocks, {cached} in the free lists"
            ));
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[0].1 > w[1].0) {
            return Err(format!("blocks overlap: {:#x?} and {:#x?}", w[0], w[1]));
        }
        let s = &self.stats;
        let expect = [
            (
                "allocations",
                s.allocations.current,
                self.blocks.len() as i64,
            ),
            ("allocated_bytes", s.allocated_bytes.current, bytes),
            ("active_requests", s.active_requests.current, active),
            ("active_bytes", s.active_bytes.current, active_bytes),
        ];
        for (name, have, want) in expect {
            if have != want {
                return Err(format!("{name}.current is {have}, the books say {want}"));
            }
        }
        Ok(())
    }
}
