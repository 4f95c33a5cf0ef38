//! Shadow memory of the sanitizer: for every byte range that work touched, the last write and the
//! reads since, as disjoint cells keyed by their first address.
//!
//! | cell field | holds | cleared by |
//! |---|---|---|
//! | `write` | the last write to the cell's bytes | nothing but a newer write |
//! | `reads` | the latest read of each actor since that write | a write |
//! | `freed` | the allocator's free of the bytes (its clock), while they wait to be handed out again | the next hand-out |
//!
//! Cells split where an access begins or ends inside one and merge again when neighbours hold the
//! same records, so a program that works on whole allocations keeps about one cell per allocation.

use std::collections::BTreeMap;

use super::clock::VectorClock;
use crate::driver::access::AccessKind;
use crate::sync::os::Arc;

/// One access the sanitizer saw: who (actor slot and epoch), what, where.
#[derive(Debug)]
pub(crate) struct Access {
    pub slot: usize,
    pub epoch: u64,
    pub kind: AccessKind,
    /// What did it ("memset", "host kernel", "copy-on-write copy (read)", …) and on which stream.
    pub what: String,
    pub start: u64,
    pub len: u64,
    /// The allocation the bytes belonged to when accessed, as a phrase ("allocation #3 …").
    pub allocation: Option<String>,
    /// The Rust stack of the call that enqueued it (with stacks on), symbolized when reported.
    pub stack: Option<super::stack::Stack>,
    /// A graph replay's: a free into a pool that live graphs hold need not be ordered after it
    /// (the graph's own use of its pool's memory).
    pub replay: bool,
}

/// The allocator's free of a block: the clock every earlier access must be ordered before, for
/// the bytes to be handed out again safely.
#[derive(Debug)]
pub(crate) struct Free {
    pub clock: VectorClock,
    /// The block's own stream (its later hand-outs are on it).
    pub owner_slot: usize,
    pub what: String,
    /// Freed into a pool that live graphs hold: their replays may still touch the bytes (the
    /// graph owns its addresses), so a replay is not a use after free; anything else is.
    pub graph_held: bool,
}

/// An eager allocation that took bytes a graph-held pool had freed (`Cell::graph_reused`).
#[derive(Debug)]
pub(crate) struct Taken {
    /// The allocation, as a phrase.
    pub what: String,
    /// Its number (the sanitizer's allocation counter at the hand-out).
    pub id: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Cell {
    pub end: u64,
    pub write: Option<Arc<Access>>,
    pub reads: Vec<Arc<Access>>,
    pub freed: Option<Arc<Free>>,
    /// Bytes a pool that live graphs hold had freed, handed out since to this allocation: a
    /// replay of a graph captured before that hand-out writes into another owner's memory.
    pub graph_reused: Option<Arc<Taken>>,
}

impl Cell {
    fn is_empty(&self) -> bool {
        self.write.is_none()
            && self.reads.is_empty()
            && self.freed.is_none()
            && self.graph_reused.is_none()
    }

    fn same_records(&self, other: &Cell) -> bool {
        fn same<T: ?Sized>(a: &Option<Arc<T>>, b: &Option<Arc<T>>) -> bool {
            match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
        }
        same(&self.write, &other.write)
            && same(&self.freed, &other.freed)
            && same(&self.graph_reused, &other.graph_reused)
            && self.reads.len() == other.reads.len()
            && self
                .reads
                .iter()
                .zip(&other.reads)
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }

    /// Every access recorded in the cell.
    pub(super) fn accesses(&self) -> impl Iterator<Item = &Arc<Access>> {
        self.write.iter().chain(self.reads.iter())
    }
}

/// The cells of every range some access touched.
#[derive(Debug, Default)]
pub(crate) struct Shadow {
    cells: BTreeMap<u64, Cell>,
}

impl Shadow {
    /// Makes `at` a cell boundary (splits the cell containing it).
    fn split(&mut self, at: u64) {
        let Some((&start, cell)) = self.cells.range_mut(..at).next_back() else {
            return;
        };
        if start < at && at < cell.end {
            let rest = cell.clone();
            cell.end = at;
            self.cells.insert(at, rest);
        }
    }

    /// The existing cells overlapping `[start, end)`, split at the range's borders (gaps are
    /// left alone: nothing was recorded there).
    pub(super) fn existing(
        &mut self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (&u64, &mut Cell)> {
        self.split(start);
        self.split(end);
        self.cells.range_mut(start..end)
    }

    /// Cells covering all of `[start, end)`: split at the borders, gaps filled with empty cells.
    pub(super) fn covering(
        &mut self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (&u64, &mut Cell)> {
        self.split(start);
        self.split(end);
        let mut gaps = Vec::new();
        let mut at = start;
        for (&s, cell) in self.cells.range(start..end) {
            if s > at {
                gaps.push((at, s));
            }
            at = cell.end;
        }
        if at < end {
            gaps.push((at, end));
        }
        for (s, e) in gaps {
            self.cells.insert(
                s,
                Cell {
                    end: e,
                    ..Cell::default()
                },
            );
        }
        self.cells.range_mut(start..end)
    }

    /// Drops every record of `[start, end)` (memory returned to the driver or unmapped).
    pub(super) fn forget(&mut self, start: u64, end: u64) {
        self.split(start);
        self.split(end);
        let doomed: Vec<u64> = self.cells.range(start..end).map(|(&s, _)| s).collect();
        for s in doomed {
            self.cells.remove(&s);
        }
    }

    /// Merges neighbouring cells around and inside `[start, end)` that hold the same records, and
    /// drops empty ones.
    pub(super) fn tidy(&mut self, start: u64, end: u64) {
        let from = self
            .cells
            .range(..start)
            .next_back()
            .map_or(start, |(&s, _)| s);
        let keys: Vec<u64> = self.cells.range(from..=end).map(|(&s, _)| s).collect();
        let mut previous: Option<u64> = None;
        for key in keys {
            let Some(cell) = self.cells.get(&key) else {
                continue;
            };
            if cell.is_empty() {
                self.cells.remove(&key);
                continue;
            }
            if let Some(p) = previous {
                let merge = self
                    .cells
                    .get(&p)
                    .is_some_and(|prev| prev.end == key && prev.same_records(cell));
                if merge {
                    let end = cell.end;
                    self.cells.remove(&key);
                    if let Some(prev) = self.cells.get_mut(&p) {
                        prev.end = end;
                    }
                    continue;
                }
            }
            previous = Some(key);
        }
    }

    /// Number of cells (tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.cells.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(start: u64, len: u64) -> Arc<Access> {
        Arc::new(Access {
            replay: false,
            slot: 0,
            epoch: 1,
            kind: AccessKind::Write,
            what: "test".into(),
            start,
            len,
            allocation: None,
            stack: None,
        })
    }

    #[test]
    fn cells_split_at_borders_fill_gaps_and_merge_back() {
        let mut shadow = Shadow::default();
        let a = write(100, 100);
        for (_, cell) in shadow.covering(100, 200) {
            cell.write = Some(Arc::clone(&a));
        }
        assert_eq!(shadow.len(), 1);
        let b = write(150, 100);
        for (_, cell) in shadow.covering(150, 250) {
            cell.write = Some(Arc::clone(&b));
        }
        shadow.tidy(150, 250);
        // [100,150) a, [150,250) b.
        assert_eq!(shadow.len(), 2);
        let starts: Vec<(u64, u64)> = shadow.existing(0, 1000).map(|(&s, c)| (s, c.end)).collect();
        assert_eq!(starts, vec![(100, 150), (150, 250)]);
        let c = write(0, 1000);
        for (_, cell) in shadow.covering(0, 1000) {
            cell.write = Some(Arc::clone(&c));
        }
        shadow.tidy(0, 1000);
        assert_eq!(shadow.len(), 1);
        shadow.forget(200, 300);
        let left: Vec<(u64, u64)> = shadow.existing(0, 1000).map(|(&s, c)| (s, c.end)).collect();
        assert_eq!(left, vec![(0, 200), (300, 1000)]);
    }
}
