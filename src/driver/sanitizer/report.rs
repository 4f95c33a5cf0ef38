//! What the sanitizer reports: two accesses that are not ordered, named so a reader can find both.

use std::fmt;

use super::shadow::Access;
use super::stack::Stack;

/// What kind of hazard a report is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HazardKind {
    /// Two accesses to overlapping bytes on different streams, at least one a write, with no
    /// event, synchronization or wait ordering the first before the second.
    Race,
    /// Memory handed out again while an access to it (on a stream other than the block's own)
    /// was not ordered before its free — a forgotten `record_stream`, or a free while another
    /// stream still reads or writes.
    UseAfterFree,
    /// Work on memory of a tag that is asleep (its pages given back, its addresses kept): the
    /// call was refused (`asleep.rs`).
    AccessWhileAsleep,
    /// An access that runs past the end of its allocation (the allocator's block), or begins
    /// outside every allocation and runs into one: refused before it runs.
    OutOfBounds,
    /// A write into memory lazy clones still share copy-on-write (through a read pointer, or a
    /// raw one): refused; write through `mutable_data_ptr`, which copies first.
    CowWrite,
}

impl HazardKind {
    /// `"race"`, `"use after free"`, … (a few words).
    pub fn name(self) -> &'static str {
        match self {
            HazardKind::Race => "race",
            HazardKind::UseAfterFree => "use after free",
            HazardKind::AccessWhileAsleep => "access while asleep",
            HazardKind::OutOfBounds => "out of bounds",
            HazardKind::CowWrite => "write into copy-on-write memory",
        }
    }
}

/// One side of a report, as text (the access, its bytes, its allocation, its stack).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AccessReport {
    /// `"read"` or `"write"` (`"hand-out"` and `"release"` for the allocator's steps, `"free"`
    /// for a free that later work touched, `"graph-reuse"` for bytes a graph's pool handed out
    /// that a replay of the graph then touched, `"allocation end"` / `"allocation start"` for the
    /// bound an out-of-bounds access crossed — then `len` is how many of its bytes lie outside —
    /// and `"lazy clones"` for the allocation a copy-on-write write hit).
    pub kind: &'static str,
    /// What did it and on which stream, e.g. `"memset on stream 2 of device 0"`.
    pub what: String,
    /// First byte address.
    pub start: u64,
    /// Bytes.
    pub len: u64,
    /// The allocation the bytes belonged to, when known.
    pub allocation: Option<String>,
    /// The Rust stack that enqueued it, when sanitizer stacks are on.
    pub stack: Option<String>,
}

impl AccessReport {
    pub(crate) fn of(access: &Access) -> Self {
        AccessReport {
            kind: access.kind.name(),
            what: access.what.clone(),
            start: access.start,
            len: access.len,
            allocation: access.allocation.clone(),
            stack: access.stack.as_ref().map(Stack::render_now),
        }
    }
}

impl fmt::Display for AccessReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} by {}, bytes [{:#x}, {:#x}) ({} bytes)",
            self.kind,
            self.what,
            self.start,
            self.start.saturating_add(self.len),
            self.len
        )?;
        if let Some(a) = &self.allocation {
            write!(f, " of {a}")?;
        }
        if let Some(stack) = &self.stack {
            write!(f, "\n    enqueued at:\n{stack}")?;
        }
        Ok(())
    }
}

/// A hazard the sanitizer found: the earlier access, and the later one that is not ordered after
/// it (for a use after free, the free and the hand-out follow).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HazardReport {
    /// Race or use after free.
    pub kind: HazardKind,
    /// The access that came first.
    pub earlier: AccessReport,
    /// The access (or hand-out) not ordered after it.
    pub later: AccessReport,
    /// For a use after free: the free that did not wait for `earlier`.
    pub free: Option<String>,
}

impl fmt::Display for HazardReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            HazardKind::Race => write!(
                f,
                "stream race: {}\n  is not ordered after the earlier {}\n  (no event, wait or synchronization orders them: \
                 take addresses through the ordered doors — `data_ptr_on(stream)` / \
                 `mutable_data_ptr_on(stream)`, or `data_ptr()` / `mutable_data_ptr()` on the \
                 current stream — or order the streams with an event)",
                self.later, self.earlier
            ),
            HazardKind::UseAfterFree if self.earlier.kind == "free" => write!(
                f,
                "use after free: {}\n  touches memory the allocator holds as free since {}",
                self.later,
                self.earlier.what
            ),
            HazardKind::UseAfterFree if self.earlier.kind == "graph-reuse" => write!(
                f,
                "use after free: {}\n  writes bytes its graph's pool freed and handed out since to {} (a \
                 graph still writes what it captured: keep its pool's memory out of eager \
                 allocations while it lives)",
                self.later, self.earlier.what
            ),
            HazardKind::UseAfterFree => write!(
                f,
                "use after free: {}\n  while the earlier {}\n  was not ordered before {} (take addresses through the ordered doors — \
                 `data_ptr_on(stream)` / `mutable_data_ptr_on(stream)`, or `data_ptr()` / \
                 `mutable_data_ptr()` on the current stream —; with an unordered address, \
                 `record_stream` or a wait was missing)",
                self.later,
                self.earlier,
                self.free.as_deref().unwrap_or("its free")
            ),
            HazardKind::AccessWhileAsleep => write!(
                f,
                "access while asleep: {}\n  touches memory put to sleep by {} (refused; wake_up the tag first)",
                self.later, self.earlier.what
            ),
            HazardKind::OutOfBounds if self.earlier.kind == "allocation start" => write!(
                f,
                "out of bounds: {}\n  begins {} bytes before {} and runs into it (refused before it ran)",
                self.later, self.earlier.len, self.earlier.what
            ),
            HazardKind::OutOfBounds if self.earlier.kind == "never handed out" => write!(
                f,
                "out of bounds: {}\n  touches {} bytes of {}, which the allocator never handed \
                 out to anyone (refused before it ran)",
                self.later, self.earlier.len, self.earlier.what
            ),
            HazardKind::OutOfBounds => write!(
                f,
                "out of bounds: {}\n  runs {} bytes past the end of {} (refused before it ran)",
                self.later, self.earlier.len, self.earlier.what
            ),
            HazardKind::CowWrite => write!(
                f,
                "write into copy-on-write memory: {}\n  writes {}, which lazy clones share (refused; \
                 write through the storage's mutable_data_ptr, which copies first)",
                self.later, self.earlier.what
            ),
        }
    }
}
