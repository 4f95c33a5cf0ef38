//! The host driver's capture and graph calls (`Driver::stream_begin_capture` … `graph_launch`):
//! the table is `capture.rs`; here is what a launch does with a graph's nodes.

use super::capture::{Captures, Node, NodeOp};
use super::stream::HostStream;
use super::HostDriver;
use crate::driver::capture::{CaptureMode, CaptureStatus, GraphExecId, GraphId};
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::Arc;

impl HostDriver {
    pub(super) fn begin_capture(&self, stream: StreamId, mode: CaptureMode) -> Result<()> {
        self.stream(stream)?;
        self.captures.begin(stream, mode)
    }

    pub(super) fn end_capture(&self, stream: StreamId) -> Result<GraphId> {
        self.stream(stream)?;
        self.captures.end(stream)
    }

    pub(super) fn capture_status(&self, stream: StreamId) -> Result<CaptureStatus> {
        self.stream(stream)?;
        Ok(self.captures.status(stream))
    }

    pub(super) fn exchange_mode(&self, mode: CaptureMode) -> CaptureMode {
        Captures::exchange_mode(mode)
    }

    pub(super) fn instantiate_graph(&self, graph: GraphId) -> Result<GraphExecId> {
        // Unsafe during a capture that prohibits it, as on CUDA (it may allocate).
        self.captures.check_unsafe("graph_instantiate")?;
        self.captures.instantiate(graph)
    }

    /// Enqueues the nodes of `exec` on `stream` in their order, after checking every node's
    /// ranges against the live segments (all of them before any is enqueued: a graph whose memory
    /// was freed is an error of the launch, and nothing of it runs). On a capturing stream it is
    /// refused, as on CUDA (`driver::capture::launch_in_capture`).
    ///
    /// Launches of one instantiated graph run one after the other, as CUDA runs them: a launch on
    /// another stream than the latest one's first waits for it (held across the enqueue, so two
    /// threads' launches are ordered as they were made).
    pub(super) fn launch_graph(&self, exec: GraphExecId, stream: StreamId) -> Result<()> {
        let graph = self.captures.exec(exec)?;
        let nodes = &graph.nodes;
        let s = self.stream(stream)?;
        if self.captures.status(stream).is_capturing() {
            return Err(crate::driver::capture::launch_in_capture(exec, stream));
        }
        let view = self.segments.view();
        let mut ready = Vec::with_capacity(nodes.len());
        for (i, node) in nodes.iter().enumerate() {
            let addrs = match node {
                Node::Device { ranges, .. } => ranges
                    .iter()
                    .map(|&(ptr, len)| view.check(ptr, len))
                    .collect::<Result<Vec<usize>>>()
                    .map_err(|err| {
                        Error::invalid(format!(
                            "{exec}, node {i}: its memory is no longer there ({err}); a graph's \
                             memory must outlive its launches"
                        ))
                    })?,
                Node::Sleep(_) => Vec::new(),
            };
            ready.push(addrs);
        }
        let mut latest = graph.latest.lock();
        if let Some((previous, done)) = latest.as_ref().filter(|(on, _)| *on != stream) {
            let done = Arc::clone(done);
            tracing::trace!(%exec, "launch waits for the latest launch on stream {}", previous.0);
            s.enqueue_control(Box::new(move || done()))?;
        }
        let mut last = None;
        for (node, addrs) in nodes.iter().zip(ready) {
            last = Some(match node {
                Node::Device { op, .. } => {
                    let op = Arc::clone(op);
                    s.enqueue_fallible(Box::new(move || op(&addrs)))?
                }
                &Node::Sleep(micros) => s.enqueue(Box::new(move || {
                    std::thread::sleep(std::time::Duration::from_micros(micros))
                }))?,
            });
        }
        drop(view);
        // A graph without nodes is ordered all the same (the next launch waits for this one,
        // and this one for the previous): a marker stands for its end.
        let ticket = match last {
            Some(ticket) => ticket,
            None => s.enqueue_control(Box::new(|| {}))?,
        };
        let on = Arc::clone(&s);
        *latest = Some((stream, Arc::new(move || on.wait_done(ticket))));
        Ok(())
    }

    pub(super) fn destroy_graph(&self, graph: GraphId) -> Result<()> {
        self.captures.destroy_graph(graph)
    }

    pub(super) fn destroy_graph_exec(&self, exec: GraphExecId) -> Result<()> {
        self.captures.destroy_exec(exec)
    }

    pub(super) fn graph_nodes(&self, graph: GraphId) -> Result<usize> {
        self.captures.node_count(graph)
    }

    /// [`Self::enqueue_fallible_on_ranges`] while some capture is under way: the work as a node,
    /// recorded when `stream` is capturing, enqueued otherwise.
    #[cold]
    pub(super) fn enqueue_or_record<const N: usize>(
        &self,
        s: &HostStream,
        stream: StreamId,
        ranges: [(DeviceAddr, u64); N],
        record: bool,
        op: impl Fn([usize; N]) -> Result<()> + Send + Sync + 'static,
    ) -> Result<u64> {
        let view = self.segments.view();
        let mut addrs = [0usize; N];
        for (addr, &(ptr, len)) in addrs.iter_mut().zip(&ranges) {
            *addr = view.check(ptr, len).inspect_err(|_| {
                self.captures
                    .invalidate_stream(stream, "a captured call on invalid memory failed")
            })?;
        }
        let node_op: NodeOp = Arc::new(move |at: &[usize]| {
            let at: [usize; N] = at
                .try_into()
                .map_err(|_| Error::invalid("a graph node's ranges do not match its operation"))?;
            op(at)
        });
        let node = || Node::Device {
            ranges: ranges.to_vec(),
            op: Arc::clone(&node_op),
        };
        if !record {
            if self.captures.status(stream).is_capturing() {
                return Err(Error::capture(format!(
                    "stream {} began a capture while a blocking call enqueued on it",
                    stream.0
                )));
            }
        } else if let Some(recorded) = self.captures.record(stream, node) {
            return recorded.map(|()| 0);
        }
        let ticket = s.enqueue_fallible(Box::new(move || node_op(&addrs)))?;
        drop(view);
        Ok(ticket)
    }
}
