//! The CUDA backend's capture and graph calls (the contract is `driver/capture.rs`):
//! `cuStreamBeginCapture_v2`, `cuStreamEndCapture`, `cuStreamGetCaptureInfo_v2`,
//! `cuThreadExchangeStreamCaptureMode`, `cuGraphInstantiateWithFlags`, `cuGraphLaunch`,
//! `cuGraphGetNodes`, `cuGraphDestroy`, `cuGraphExecDestroy`.
//!
//! CUDA itself enforces the prohibitions; its capture codes (`CUDA_ERROR_STREAM_CAPTURE_*`,
//! `CUDA_ERROR_CAPTURED_EVENT`) become [`Error::StreamCapture`] in `check` (`mod.rs`), as the
//! host backend's refusals are. Graphs and instantiated graphs live in tables like streams and
//! events: an id this driver did not hand out is refused before it reaches CUDA, and what is
//! left when the driver drops is destroyed then.

use cudarc::driver::sys;

use super::{check, CudaDriver, GraphExecHandle, GraphHandle, StreamEntry};
use crate::driver::capture::{CaptureMode, CaptureStatus, GraphExecId, GraphId};
use crate::driver::StreamId;
use crate::error::{Error, Result};

/// A graph or an instantiated graph, with the device whose context made it.
#[derive(Debug, Clone, Copy)]
pub(super) struct GraphEntry<H> {
    pub(super) device: usize,
    pub(super) raw: H,
}

fn mode_of(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

fn mode_from(mode: sys::CUstreamCaptureMode) -> CaptureMode {
    match mode {
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        _ => CaptureMode::Global,
    }
}

impl CudaDriver {
    pub(super) fn begin_capture(&self, stream: StreamId, mode: CaptureMode) -> Result<()> {
        let s = self.stream(stream)?;
        if let Some(id) = self.raw_capture(&s)?.capture_id() {
            return Err(Error::capture(format!(
                "stream {} is already being captured (capture {id})",
                stream.0
            )));
        }
        if s.raw.0.is_null() {
            return Err(Error::capture(
                "the default stream is CUDA's legacy stream, which cannot be captured: capture a \
                 stream made with create_stream",
            ));
        }
        // SAFETY: live stream of this driver; its context is bound.
        check("cuStreamBeginCapture_v2", unsafe {
            sys::cuStreamBeginCapture_v2(s.raw.0, mode_of(mode))
        })?;
        self.captures_under_way
            .fetch_add(1, crate::sync::os::atomic::Ordering::AcqRel);
        Ok(())
    }

    /// An error while captures begun through this driver are under way (`what` would
    /// synchronize a capturing stream; see `synchronize_all`).
    pub(super) fn refuse_during_captures(&self, what: &str) -> Result<()> {
        let n = self
            .captures_under_way
            .load(crate::sync::os::atomic::Ordering::Acquire);
        if n == 0 {
            return Ok(());
        }
        Err(Error::capture(format!(
            "{what} is not allowed while {n} stream capture(s) begun through this driver are \
             under way: end them first (nothing was done)"
        )))
    }

    pub(super) fn end_capture(&self, stream: StreamId) -> Result<GraphId> {
        let s = self.stream(stream)?;
        if !self.raw_capture(&s)?.is_capturing() {
            return Err(Error::capture(format!(
                "stream {} is not being captured",
                stream.0
            )));
        }
        let mut graph = std::ptr::null_mut();
        // SAFETY: live stream; context bound; the out-pointer is valid.
        let ended = check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(s.raw.0, &mut graph)
        });
        // The capture is over unless CUDA refused to end it here (another thread's, say).
        if !matches!(self.raw_capture(&s), Ok(status) if status.is_capturing()) {
            self.captures_under_way
                .fetch_sub(1, crate::sync::os::atomic::Ordering::AcqRel);
        }
        ended?;
        if graph.is_null() {
            return Err(Error::capture(
                "cuStreamEndCapture returned no graph (the capture was invalidated)",
            ));
        }
        let id = self.fresh_id();
        self.graphs.insert(
            id,
            GraphEntry {
                device: s.device,
                raw: GraphHandle(graph),
            },
        );
        Ok(GraphId(id))
    }

    pub(super) fn capture_status(&self, stream: StreamId) -> Result<CaptureStatus> {
        let s = self.stream(stream)?;
        self.raw_capture(&s)
    }

    /// An error when `s` is being captured: for calls that must block on the stream's work
    /// (refused here, with a clear error, before any of their work is recorded).
    pub(super) fn refuse_capturing(&self, s: &StreamEntry, what: &str) -> Result<()> {
        match self.raw_capture(s)?.capture_id() {
            None => Ok(()),
            Some(id) => Err(Error::capture(format!(
                "{what} blocks on a stream that is being captured (capture {id})"
            ))),
        }
    }

    /// The capture status of `s` (its context is bound).
    fn raw_capture(&self, s: &StreamEntry) -> Result<CaptureStatus> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        // SAFETY: live stream; context bound; the graph and dependency out-pointers are optional
        // (null), the others valid.
        check("cuStreamGetCaptureInfo_v2", unsafe {
            sys::cuStreamGetCaptureInfo_v2(
                s.raw.0,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                CaptureStatus::Active { id }
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated { id }
            }
            _ => CaptureStatus::None,
        })
    }

    pub(super) fn exchange_mode(&self, mode: CaptureMode) -> CaptureMode {
        let mut raw = mode_of(mode);
        // SAFETY: `raw` is a valid in/out pointer; the call is not bound to a context.
        let rc = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut raw) };
        match check("cuThreadExchangeStreamCaptureMode", rc) {
            Ok(()) => mode_from(raw),
            Err(err) => {
                // Nothing to hand back: the mode stays what it was, and the call it guards
                // reports any prohibition itself.
                tracing::warn!(%err, "the capture mode could not be exchanged");
                mode
            }
        }
    }

    pub(super) fn instantiate_graph(&self, graph: GraphId) -> Result<GraphExecId> {
        let g = self.graphs.get(graph.0)?;
        self.bind(g.device)?;
        let mut exec = std::ptr::null_mut();
        // SAFETY: a live graph of this driver; flags 0; the out-pointer is valid.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, g.raw.0, 0)
        })?;
        let id = self.fresh_id();
        self.graph_execs.insert(
            id,
            GraphEntry {
                device: g.device,
                raw: GraphExecHandle(exec),
            },
        );
        Ok(GraphExecId(id))
    }

    pub(super) fn launch_graph(&self, exec: GraphExecId, stream: StreamId) -> Result<()> {
        let e = self.graph_execs.get(exec.0)?;
        let s = self.stream(stream)?;
        if e.device != s.device {
            return Err(Error::invalid(format!(
                "{exec} was instantiated on device {} but stream {} is on device {}",
                e.device, stream.0, s.device
            )));
        }
        if self.raw_capture(&s)?.is_capturing() {
            return Err(crate::driver::capture::launch_in_capture(exec, stream));
        }
        // SAFETY: a live instantiated graph and a live stream of the same (bound) context.
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(e.raw.0, s.raw.0)
        })
    }

    pub(super) fn destroy_graph(&self, graph: GraphId) -> Result<()> {
        let g = self.graphs.remove(graph.0)?;
        self.bind(g.device)?;
        // SAFETY: removed from the table, so destroyed exactly once.
        check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(g.raw.0) })
    }

    pub(super) fn destroy_graph_exec(&self, exec: GraphExecId) -> Result<()> {
        let e = self.graph_execs.remove(exec.0)?;
        self.bind(e.device)?;
        // SAFETY: removed from the table, so destroyed exactly once; launches already enqueued
        // still run (CUDA's contract).
        check("cuGraphExecDestroy", unsafe {
            sys::cuGraphExecDestroy(e.raw.0)
        })
    }

    pub(super) fn graph_nodes(&self, graph: GraphId) -> Result<usize> {
        let g = self.graphs.get(graph.0)?;
        self.bind(g.device)?;
        let mut count = 0usize;
        // SAFETY: a live graph; a null node array asks for the count only.
        check("cuGraphGetNodes", unsafe {
            sys::cuGraphGetNodes(g.raw.0, std::ptr::null_mut(), &mut count)
        })?;
        Ok(count)
    }

    /// Destroys the graphs and instantiations left when the driver drops.
    pub(super) fn destroy_graphs_left(&self) {
        for e in self.graph_execs.drain() {
            if self.bind(e.device).is_ok() {
                // SAFETY: drained from the table: destroyed once.
                super::log_teardown("cuGraphExecDestroy", unsafe {
                    sys::cuGraphExecDestroy(e.raw.0)
                });
            }
        }
        for g in self.graphs.drain() {
            if self.bind(g.device).is_ok() {
                // SAFETY: drained from the table: destroyed once.
                super::log_teardown("cuGraphDestroy", unsafe { sys::cuGraphDestroy(g.raw.0) });
            }
        }
    }
}
