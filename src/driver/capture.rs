//! Stream capture and graphs: the names every backend shares (CUDA's `cuStreamBeginCapture`,
//! `cuStreamEndCapture`, `cuGraphInstantiate`, `cuGraphLaunch` and their contracts).
//!
//! Work enqueued on a *capturing* stream is not run: it is recorded into a graph, which
//! [`Driver::stream_end_capture`](super::Driver::stream_end_capture) returns. An instantiated
//! graph is launched on any stream, replaying the recorded work in its order. Another stream
//! joins a capture by waiting on an event recorded inside it (a fork); the capture can only end
//! once every joined stream's work was waited for by the origin stream again (a join).
//!
//! | call during a capture | what happens |
//! |---|---|
//! | device work on a capturing stream (copies between device ranges, fills, kernels, sleeps) | recorded, not run |
//! | `event_record` on a capturing stream | marks a point of the capture (not a real record) |
//! | `stream_wait_event` of a point of a capture | a stream outside joins the capture; the origin joins a forked stream back |
//! | `stream_wait_event` of an event recorded outside, on a capturing stream | error: a capture cannot wait on work outside it (the capture is invalidated) |
//! | blocking calls that involve a capturing stream or a point of a capture (`stream_synchronize`, `stream_query`, `event_query`, `event_synchronize`, host copies, counting kernels) | error, whatever the mode (the capture is invalidated) |
//! | *unsafe* calls (`malloc`, `free`, VM map/unmap, synchronizing or querying any stream or event) while the calling thread is prohibited (below) | error (the capture that prohibits it is invalidated) |
//! | `free` while a capture of the same driver is under way (any mode, any stream) | error, nothing freed, the capture untouched: a free synchronizes every device on CUDA (`cudaFree`), which a capture forbids — the CUDA backend also refuses unmapping and closing IPC memory then, for the same synchronize |
//! | `stream_end_capture` | the graph; an error if the capture was invalidated, a forked stream never joined back, or (modes other than relaxed) another thread ends it |
//!
//! When is a thread prohibited from unsafe calls? That depends on its *interaction mode*
//! ([`Driver::exchange_capture_mode`](super::Driver::exchange_capture_mode), `Global` unless
//! exchanged) and on the captures under way, as in CUDA:
//!
//! | thread's mode | prohibited while |
//! |---|---|
//! | `Global` | this thread began a capture that is not `Relaxed`, or another thread began a `Global` one |
//! | `ThreadLocal` | this thread began a capture that is not `Relaxed` |
//! | `Relaxed` | never |
//!
//! A caching allocator that must get memory from the driver during a capture (a graph's private
//! pool missing its cache) relaxes its thread's mode around that call, as PyTorch's
//! `cudaMallocMaybeCapturing` does; the memory is the graph's for as long as the graph lives.

use std::fmt;

use super::Backend;
use crate::error::Error;

/// The error of a capture or graph call on a backend without them.
pub(crate) fn unsupported(backend: Backend) -> Error {
    Error::capture(format!(
        "the {} backend does not capture streams or run graphs",
        backend.name()
    ))
}

/// How a capture interacts with potentially unsafe calls (CUDA's `CUstreamCaptureMode`); also a
/// thread's interaction mode. See the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CaptureMode {
    /// Unsafe calls are errors on the capturing thread and on every thread whose mode is
    /// `Global` (the default).
    #[default]
    Global,
    /// Unsafe calls are errors on the capturing thread only.
    ThreadLocal,
    /// Unsafe calls are allowed (calls that conflict with the capture itself are still errors).
    Relaxed,
}

/// Whether a stream is being captured (CUDA's `cuStreamGetCaptureInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CaptureStatus {
    /// Work on the stream runs.
    None,
    /// Work on the stream is recorded into capture `id` (unique in the process, never 0).
    Active {
        /// The capture's id.
        id: u64,
    },
    /// The stream's capture `id` was invalidated by a forbidden call: its end is an error.
    Invalidated {
        /// The capture's id.
        id: u64,
    },
}

impl CaptureStatus {
    /// The id of the capture the stream takes part in, active or invalidated.
    pub fn capture_id(self) -> Option<u64> {
        match self {
            CaptureStatus::None => None,
            CaptureStatus::Active { id } | CaptureStatus::Invalidated { id } => Some(id),
        }
    }

    /// Whether work on the stream is recorded instead of run.
    pub fn is_capturing(self) -> bool {
        !matches!(self, CaptureStatus::None)
    }
}

/// A captured graph (CUDA's `CUgraph`): what a capture recorded, not yet runnable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphId(pub u64);

/// An instantiated graph (CUDA's `CUgraphExec`): launched on a stream, it replays the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphExecId(pub u64);

impl fmt::Display for GraphId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "graph {}", self.0)
    }
}

impl fmt::Display for GraphExecId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "graph exec {}", self.0)
    }
}

/// The refusal of launching `exec` on capturing `stream`: CUDA cannot capture a graph launch (an
/// H200 answered `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidated the capture); refused
/// here before CUDA sees it, the capture goes on.
pub(crate) fn launch_in_capture(
    exec: GraphExecId,
    stream: crate::driver::StreamId,
) -> crate::error::Error {
    crate::error::Error::capture(format!(
        "{exec} cannot be launched on stream {}, which is being captured: CUDA does not capture \
         graph launches (launch it before the capture begins or after it ends; nothing was done)",
        stream.0
    ))
}
