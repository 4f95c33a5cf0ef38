//! Replaying allocation traces (feature `replay`): "what would another allocator setting have done
//! with this run?" — answered without the GPU, through the real allocator on a [`SimDriver`] (a
//! device that hands out addresses and enforces a capacity but backs nothing).
//!
//! * `formats.rs` — reading cudalloc's JSON lines, PyTorch snapshot pickles, `torch.profiler`
//!   Chrome traces and RMM CSV logs into [`TraceOp`]s ([`load`], [`parse`]);
//! * `run.rs` — [`replay`]: one configuration, exact peaks, the first out-of-memory, time per op;
//! * `svg.rs` — [`plot_svg`]: allocated and reserved over the trace, one line per configuration.
//!
//! `cudalloc replay FILE --conf … --capacity 80GiB --svg out.svg` is the command around it.
//!
//! [`SimDriver`]: crate::driver::SimDriver

mod formats;
mod run;
mod svg;

pub use formats::{load, parse, TraceFormat};
pub use run::{replay, OomAt, ReplayOptions, ReplayReport, Sample};
pub use svg::plot_svg;

/// One operation of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceOp {
    /// Allocate `size` bytes on `device` for `stream` (the trace's raw stream id; 0 is the
    /// default stream); `id` names the allocation for its free.
    Alloc {
        /// Names the allocation.
        id: u64,
        /// Device ordinal.
        device: usize,
        /// Bytes asked for.
        size: u64,
        /// The trace's stream id.
        stream: u64,
    },
    /// Free the allocation `id`.
    Free {
        /// The allocation.
        id: u64,
    },
}

/// A trace read from a file.
#[derive(Clone, Debug)]
pub struct Trace {
    /// The format it was read from.
    pub format: TraceFormat,
    /// The operations, in order.
    pub ops: Vec<TraceOp>,
    /// Frees that matched no live allocation (skipped).
    pub unmatched_frees: u64,
    /// Devices the trace uses (at least 1).
    pub devices: usize,
}

impl Trace {
    /// Allocations in the trace.
    pub fn allocations(&self) -> usize {
        self.ops
            .iter()
            .filter(|op| matches!(op, TraceOp::Alloc { .. }))
            .count()
    }
}
