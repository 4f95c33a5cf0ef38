//! Replaying allocation traces (feature `replay`): "what would another allocator setting have done
//! with this run?" — answered without the GPU, through the real allocator on a [`SimDriver`] (a
//! device that hands out addresses and enforces a capacity but backs nothing).
//!
//! * `formats.rs` — reading cudalloc's JSON lines, PyTorch snapshot pickles (`snapshot.rs`, over
//!   the bounded pickle reader `pickle.rs`), `torch.profiler` Chrome traces (`kineto.rs`) and RMM
//!   CSV logs into [`TraceOp`]s ([`load`], [`parse`]); every reader builds with `builder.rs`
//!   (pairing frees to allocations, the event and stream bounds), which names none of them;
//! * [`limits`] — the bounds on reading a trace (below);
//! * `run.rs` — [`replay`]: one configuration, exact peaks (per device and over all devices), the
//!   first out-of-memory, time per op;
//! * `svg.rs` — [`plot_svg`]: allocated and reserved over the trace, one line per configuration.
//!
//! `cudalloc replay FILE --conf … --capacity 80GiB --svg out.svg` is the command around it.
//!
//! A trace file is untrusted input. Reading one is bounded — each limit passed is an
//! [`InvalidArgument`](crate::ErrorKind::InvalidArgument) error naming the limit and its value,
//! never a panic, an abort, a stack overflow or a hang:
//!
//! | limit | value | bounds |
//! |---|---|---|
//! | [`limits::MAX_TRACE_BYTES`] | 1 GiB | the file as read, and every decompressed layer |
//! | [`limits::MAX_GZIP_LAYERS`] | 2 | gzip layers inside one another |
//! | [`limits::MAX_GZIP_RATIO`], [`limits::GZIP_FLOOR_BYTES`] | 64×, 32 MiB | all decompressed layers together, against the compressed size |
//! | [`limits::MAX_TRACE_EVENTS`] | 2²⁵ | events kept (lines, `[memory]` events, snapshot entries) |
//! | [`limits::MAX_TRACE_STREAMS`] | 65,536 | distinct (device, stream) pairs that allocate |
//! | [`limits::MAX_SIM_DEVICES`] | 1,024 | devices |
//! | [`limits::MAX_PICKLE_DEPTH`] | 64 | nesting of containers in a pickle |
//! | [`limits::PICKLE_MEMORY_RATIO`] (floor, cap) | 16× (1 MiB, 4 GiB) | the pickle reader's structures, against the pickle's size |
//! | [`limits::MAX_JSON_DEPTH`] | 128 | nesting of JSON parsed into fields (`serde_json`'s recursion limit; skipped values pass at any depth without recursion) |
//!
//! [`SimDriver`]: crate::driver::SimDriver

mod builder;
mod formats;
mod kineto;
pub mod limits;
mod pickle;
mod run;
mod snapshot;
mod svg;

pub use builder::TraceFormat;
pub use formats::{load, parse};
pub use run::{replay, DeviceReport, OomAt, ReplayOptions, ReplayReport, Sample};
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
