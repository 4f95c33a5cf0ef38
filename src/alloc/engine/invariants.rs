//! The invariant scanner: after any mutation a test can ask a shard to prove that its blocks tile
//! their segments, that free blocks are exactly the members of the free pools, that no two free
//! neighbours were left unmerged, that pending frees match their events, and that every stat's
//! `current` equals a recount.

use super::ShardState;
use crate::alloc::block::BlockState;
use crate::alloc::size::PoolKind;
use crate::alloc::stats::{DeviceStats, PoolStats};

fn pool_slot(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Small => 1,
        PoolKind::Large => 2,
    }
}

fn bump(counts: &mut [i64; 3], pool: PoolKind, n: u64) {
    counts[0] += n as i64;
    counts[pool_slot(pool)] += n as i64;
}

fn compare(name: &str, stat: &PoolStats, want: &[i64; 3]) -> Result<(), String> {
    for (i, s) in stat.iter().enumerate() {
        if s.current != want[i] {
            return Err(format!(
                "stat {name}[{i}].current = {} but a recount gives {}",
                s.current, want[i]
            ));
        }
        if s.current < 0 || s.peak < s.current {
            return Err(format!("stat {name}[{i}] inconsistent: {s:?}"));
        }
    }
    Ok(())
}

impl ShardState {
    /// Checks every structural invariant and recounts the stats; `Err` says what is broken.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut visited = 0usize;
        let mut recount = Recount::default();
        for (&base, seg) in &self.segments {
            let mut at = Some(seg.head);
            let mut expect_ptr = base;
            let mut prev = None;
            let mut prev_free = false;
            let mut prev_unmapped = false;
            let mut mapped = 0u64;
            while let Some(id) = at {
                let b = self
                    .blocks
                    .get(id)
                    .ok_or_else(|| format!("segment {base:#x}: dangling block {id}"))?;
                if b.ptr != expect_ptr || b.segment != base || b.prev != prev || b.pool != seg.pool
                {
                    return Err(format!(
                        "segment {base:#x}: block {id} does not tile ({b:?})"
                    ));
                }
                let free = b.state == BlockState::Free;
                let unmapped = b.state == BlockState::Unmapped;
                let releasing = b.state == BlockState::Releasing;
                if (free && prev_free) || (unmapped && prev_unmapped) {
                    return Err(format!(
                        "segment {base:#x}: neighbouring free (or unmapped) blocks were not merged at {id}"
                    ));
                }
                if (unmapped || releasing) && !self.expandable.contains_key(&base) {
                    return Err(format!(
                        "segment {base:#x}: unmapped block {id} in a whole segment"
                    ));
                }
                if !unmapped && !releasing {
                    mapped += b.size;
                }
                prev_unmapped = unmapped;
                recount.block(b.state, b.pool, b.size, b.requested, b.is_split());
                let deferred = self.deferred.iter().any(|(d, _)| *d == id);
                if b.state == BlockState::PendingFree && b.pending_events == 0 && !deferred {
                    return Err(format!("block {id} pending with no events"));
                }
                if deferred && b.state != BlockState::PendingFree {
                    return Err(format!("deferred block {id} is not pending"));
                }
                recount.pending_events += u64::from(b.pending_events);
                prev_free = free;
                prev = Some(id);
                expect_ptr += b.size;
                visited += 1;
                at = b.next;
            }
            if expect_ptr != base + seg.size {
                return Err(format!(
                    "segment {base:#x}: blocks cover {} of {} bytes",
                    expect_ptr - base,
                    seg.size
                ));
            }
            self.check_pages(base)?;
            if let Some(pages) = self.expandable.get(&base).filter(|p| p.asleep.is_some()) {
                // A sleeping segment maps nothing (`sleep.rs`).
                if !pages.chunks.is_empty() {
                    return Err(format!("segment {base:#x} sleeps with pages mapped"));
                }
                mapped = 0;
            }
            bump(&mut recount.segment, seg.pool, 1);
            bump(&mut recount.reserved_bytes, seg.pool, mapped);
        }
        if visited != self.blocks.len() {
            return Err(format!(
                "{} blocks exist but {visited} are reachable from segments",
                self.blocks.len()
            ));
        }
        for (pool, set) in [
            (PoolKind::Small, &self.free_small),
            (PoolKind::Large, &self.free_large),
        ] {
            for (size, ptr, id) in set.iter() {
                let b = self
                    .blocks
                    .get(id)
                    .ok_or_else(|| format!("free set names missing block {id}"))?;
                if b.state != BlockState::Free || b.size != size || b.ptr != ptr || b.pool != pool {
                    return Err(format!(
                        "free set entry ({size}, {ptr:#x}, {id}) disagrees with {b:?}"
                    ));
                }
            }
        }
        if recount.free_blocks != (self.free_small.len() + self.free_large.len()) as u64 {
            return Err(format!(
                "{} free blocks but {} free-set entries",
                recount.free_blocks,
                self.free_small.len() + self.free_large.len()
            ));
        }
        let queued: u64 = self.pending.values().map(|q| q.len() as u64).sum();
        if queued != recount.pending_events {
            return Err(format!(
                "{queued} queued events but blocks wait for {}",
                recount.pending_events
            ));
        }
        recount.compare(&self.stats)
    }
}

impl ShardState {
    /// An expandable segment's page records against its blocks: the pages under blocks that
    /// hold memory (neither unmapped nor releasing) are exactly the mapped ones — or, while the
    /// segment sleeps, exactly the ones its wake maps back (`sleep.rs`).
    fn check_pages(&self, base: u64) -> Result<(), String> {
        let (Some(pages), Some(seg)) = (self.expandable.get(&base), self.segments.get(&base))
        else {
            return Ok(());
        };
        let page = pages.page.max(1);
        let mut expected = Vec::new();
        let mut at = Some(seg.head);
        while let Some(id) = at {
            let b = &self.blocks[id];
            if !matches!(b.state, BlockState::Unmapped | BlockState::Releasing) {
                let first = base + (b.ptr - base) / page * page;
                let end = base + (b.ptr + b.size - base).div_ceil(page) * page;
                let mut p = first;
                while p < end {
                    if expected.last() != Some(&p) {
                        expected.push(p);
                    }
                    p += page;
                }
            }
            at = b.next;
        }
        let recorded: Vec<u64> = match &pages.asleep {
            Some(asleep) => asleep.clone(),
            None => pages.chunks.keys().copied().collect(),
        };
        if recorded != expected {
            return Err(format!(
                "segment {base:#x}: {} page(s) recorded ({}) but its blocks hold {}",
                recorded.len(),
                if pages.asleep.is_some() {
                    "asleep"
                } else {
                    "mapped"
                },
                expected.len()
            ));
        }
        Ok(())
    }
}

#[derive(Default)]
struct Recount {
    allocation: [i64; 3],
    active: [i64; 3],
    allocated_bytes: [i64; 3],
    active_bytes: [i64; 3],
    requested_bytes: [i64; 3],
    inactive_split: [i64; 3],
    inactive_split_bytes: [i64; 3],
    segment: [i64; 3],
    reserved_bytes: [i64; 3],
    free_blocks: u64,
    pending_events: u64,
}

impl Recount {
    fn block(&mut self, state: BlockState, pool: PoolKind, size: u64, requested: u64, split: bool) {
        match state {
            BlockState::Allocated => {
                bump(&mut self.allocation, pool, 1);
                bump(&mut self.allocated_bytes, pool, size);
                bump(&mut self.requested_bytes, pool, requested);
                bump(&mut self.active, pool, 1);
                bump(&mut self.active_bytes, pool, size);
            }
            BlockState::PendingFree => {
                bump(&mut self.active, pool, 1);
                bump(&mut self.active_bytes, pool, size);
            }
            BlockState::Free => {
                self.free_blocks += 1;
                if split {
                    bump(&mut self.inactive_split, pool, 1);
                    bump(&mut self.inactive_split_bytes, pool, size);
                }
            }
            BlockState::Unmapped | BlockState::Releasing => {}
        }
    }

    fn compare(&self, s: &DeviceStats) -> Result<(), String> {
        compare("allocation", &s.allocation, &self.allocation)?;
        compare("active", &s.active, &self.active)?;
        compare("allocated_bytes", &s.allocated_bytes, &self.allocated_bytes)?;
        compare("active_bytes", &s.active_bytes, &self.active_bytes)?;
        compare("requested_bytes", &s.requested_bytes, &self.requested_bytes)?;
        compare("inactive_split", &s.inactive_split, &self.inactive_split)?;
        compare(
            "inactive_split_bytes",
            &s.inactive_split_bytes,
            &self.inactive_split_bytes,
        )?;
        compare("segment", &s.segment, &self.segment)?;
        compare("reserved_bytes", &s.reserved_bytes, &self.reserved_bytes)
    }
}
