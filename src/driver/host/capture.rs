//! The host backend's stream capture (the contract is `driver/capture.rs`): work on a capturing
//! stream becomes a node of a graph — its device ranges and a re-runnable operation on their host
//! addresses — instead of running; a launch checks every node's ranges against the live segments
//! (memory freed since the capture is an error of the launch, never a fault) and enqueues the
//! nodes on the launch stream in their recorded order.
//!
//! The recorded order is the order of the calls that enqueued the work, over every stream of the
//! capture. A capture's streams are joined through events recorded inside it, so that order is a
//! linearization of the graph's dependencies: a replay runs the nodes one after the other on the
//! launch stream (correct, without the concurrency of the captured streams).
//!
//! | table entry | made by | removed by |
//! |---|---|---|
//! | a capture (origin, mode, thread, nodes, member streams, coverage) | `stream_begin_capture` | `stream_end_capture` (a graph, or an error) |
//! | a point (event → capture, stream, nodes so far, what that stream covers) | `event_record` on a capturing stream | the capture's end, or a real record of the event |
//! | a graph / an instantiated graph (shared nodes; its latest launch) | the end / `graph_instantiate` | `graph_destroy` / `graph_exec_destroy` |
//!
//! Join bookkeeping: every member stream but the origin has an *activity* (the node count when it
//! joined or last recorded work); a wait on a point of stream `s` covers `s` up to the point's node
//! count, and inherits what the point's stream covered. The capture ends only when the origin
//! covers every member's activity.

use std::cell::Cell;
use std::collections::HashMap;
use std::thread::ThreadId;

use crate::driver::capture::{CaptureMode, CaptureStatus, GraphExecId, GraphId};
use crate::driver::{DeviceAddr, EventId, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicUsize, Ordering};
use crate::sync::os::{Arc, Mutex};

/// A re-runnable operation on the host addresses of a node's ranges.
pub(super) type NodeOp = Arc<dyn Fn(&[usize]) -> Result<()> + Send + Sync>;

/// One recorded unit of work.
#[derive(Clone)]
pub(super) enum Node {
    /// Device work on `ranges` (checked again at every launch).
    Device {
        ranges: Vec<(DeviceAddr, u64)>,
        op: NodeOp,
    },
    /// A sleep kernel of so many microseconds.
    Sleep(u64),
}

/// What a stream of a capture covers: member stream → node count up to which its work is
/// ordered before this stream's next work.
type Coverage = HashMap<StreamId, usize>;

struct Capture {
    origin: StreamId,
    mode: CaptureMode,
    thread: ThreadId,
    nodes: Vec<Node>,
    /// Member streams (the origin too) and the node count of their latest activity.
    members: HashMap<StreamId, usize>,
    /// What each member covers (see the module docs).
    covers: HashMap<StreamId, Coverage>,
    /// Why the capture was invalidated.
    invalid: Option<String>,
}

/// Waits until a launch's last node has run (on the host, from another stream's worker).
pub(super) type LaunchDone = Arc<dyn Fn() + Send + Sync>;

/// An instantiated graph: its nodes, and its latest launch (the stream and a wait for its end).
/// CUDA runs the launches of one executable graph one after the other, whatever their streams:
/// a launch on another stream first waits for the latest one (`capture_calls.rs`).
pub(super) struct Exec {
    pub(super) nodes: Arc<[Node]>,
    pub(super) latest: Mutex<Option<(StreamId, LaunchDone)>>,
}

/// An event recorded inside a capture.
struct Point {
    capture: u64,
    stream: StreamId,
    nodes: usize,
    covers: Coverage,
}

#[derive(Default)]
struct Table {
    captures: HashMap<u64, Capture>,
    streams: HashMap<StreamId, u64>,
    points: HashMap<EventId, Point>,
    graphs: HashMap<u64, Arc<[Node]>>,
    execs: HashMap<u64, Arc<Exec>>,
    next_id: u64,
}

impl Table {
    fn fresh(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn invalidate(&mut self, capture: u64, why: &str) {
        if let Some(c) = self.captures.get_mut(&capture) {
            c.invalid.get_or_insert_with(|| why.to_owned());
        }
    }

    /// The capture that prohibits an unsafe call on this thread (see `driver/capture.rs`).
    fn prohibiting(&self, me: ThreadId, mode: CaptureMode) -> Option<u64> {
        if mode == CaptureMode::Relaxed {
            return None;
        }
        let own = self
            .captures
            .iter()
            .find(|(_, c)| c.thread == me && c.mode != CaptureMode::Relaxed);
        let other = || {
            self.captures.iter().find(|(_, c)| {
                mode == CaptureMode::Global && c.thread != me && c.mode == CaptureMode::Global
            })
        };
        own.or_else(other).map(|(&id, _)| id)
    }
}

thread_local! {
    /// This thread's capture interaction mode.
    static MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// The host driver's captures and graphs.
#[derive(Default)]
pub(super) struct Captures {
    /// Captures under way (0: every check is one load).
    active: AtomicUsize,
    table: Mutex<Table>,
}

fn refused(what: &str, capture: u64, why: &str) -> Error {
    Error::capture(format!(
        "{what} is not allowed {why} (capture {capture}); the capture is invalidated"
    ))
}

impl Captures {
    /// Whether any capture is under way.
    #[inline]
    pub(super) fn any(&self) -> bool {
        self.active.load(Ordering::Acquire) != 0
    }

    /// Sets this thread's interaction mode; returns the previous one.
    pub(super) fn exchange_mode(mode: CaptureMode) -> CaptureMode {
        MODE.with(|m| m.replace(mode))
    }

    /// An error (invalidating the capture) when this thread may not make unsafe call `what` now.
    pub(super) fn check_unsafe(&self, what: &str) -> Result<()> {
        if !self.any() {
            return Ok(());
        }
        let mut table = self.table.lock();
        let mode = MODE.with(Cell::get);
        match table.prohibiting(std::thread::current().id(), mode) {
            Some(id) => {
                let why = format!("while a capture in {mode:?} interaction mode is under way");
                table.invalidate(id, &format!("{what} was called"));
                Err(refused(what, id, &why))
            }
            None => Ok(()),
        }
    }

    /// [`Self::check_unsafe`], and an error in any mode when `stream` is capturing (blocking on a
    /// stream whose work is not running).
    pub(super) fn check_blocking(&self, stream: StreamId, what: &str) -> Result<()> {
        if !self.any() {
            return Ok(());
        }
        {
            let mut table = self.table.lock();
            if let Some(&id) = table.streams.get(&stream) {
                table.invalidate(id, &format!("{what} was called on a capturing stream"));
                return Err(refused(what, id, "on a stream that is being captured"));
            }
        }
        self.check_unsafe(what)
    }

    /// [`Self::check_unsafe`], and an error in any mode when `event` marks a point of a capture.
    pub(super) fn check_event(&self, event: EventId, what: &str) -> Result<()> {
        if !self.any() {
            return Ok(());
        }
        {
            let mut table = self.table.lock();
            if let Some(id) = table.points.get(&event).map(|p| p.capture) {
                table.invalidate(id, &format!("{what} was called on an event of the capture"));
                return Err(refused(what, id, "on an event recorded inside a capture"));
            }
        }
        self.check_unsafe(what)
    }

    /// A destroyed event is no point of any capture any more.
    pub(super) fn forget_point(&self, event: EventId) {
        if self.any() {
            self.table.lock().points.remove(&event);
        }
    }

    /// Invalidates the capture `stream` takes part in, if any (a call on it failed, as in CUDA).
    pub(super) fn invalidate_stream(&self, stream: StreamId, why: &str) {
        if !self.any() {
            return;
        }
        let mut table = self.table.lock();
        if let Some(&id) = table.streams.get(&stream) {
            table.invalidate(id, why);
        }
    }

    /// Records `node` when `stream` is capturing: `None` when it is not (run the work), else the
    /// outcome (an invalidated capture refuses more work).
    pub(super) fn record(
        &self,
        stream: StreamId,
        node: impl FnOnce() -> Node,
    ) -> Option<Result<()>> {
        if !self.any() {
            return None;
        }
        let mut table = self.table.lock();
        let id = *table.streams.get(&stream)?;
        let capture = table.captures.get_mut(&id)?;
        if let Some(why) = &capture.invalid {
            return Some(Err(Error::capture(format!(
                "capture {id} was invalidated ({why}): no more work can be recorded"
            ))));
        }
        capture.nodes.push(node());
        let count = capture.nodes.len();
        capture.members.insert(stream, count);
        Some(Ok(()))
    }

    /// `event_record` on `stream`: a point of the capture when the stream is capturing (`Some`);
    /// otherwise a real record follows (`None`), which forgets any old point of the event.
    pub(super) fn record_point(&self, event: EventId, stream: StreamId) -> Option<Result<()>> {
        if !self.any() {
            return None;
        }
        let mut table = self.table.lock();
        let Some(&id) = table.streams.get(&stream) else {
            table.points.remove(&event);
            return None;
        };
        let capture = table.captures.get(&id)?;
        if let Some(why) = &capture.invalid {
            return Some(Err(Error::capture(format!(
                "capture {id} was invalidated ({why}): no event can be recorded into it"
            ))));
        }
        let point = Point {
            capture: id,
            stream,
            nodes: capture.nodes.len(),
            covers: capture.covers.get(&stream).cloned().unwrap_or_default(),
        };
        table.points.insert(event, point);
        Some(Ok(()))
    }

    /// `stream_wait_event`: `None` when neither the stream nor the event is in a capture (a real
    /// wait follows); else a join, a fork or an error (see the module docs).
    pub(super) fn wait(&self, stream: StreamId, event: EventId) -> Option<Result<()>> {
        if !self.any() {
            return None;
        }
        let mut table = self.table.lock();
        let waiting_in = table.streams.get(&stream).copied();
        let Some(point) = table.points.get(&event) else {
            let id = waiting_in?;
            table.invalidate(id, "a wait on an event recorded outside the capture");
            return Some(Err(refused(
                "waiting on an event recorded outside the capture",
                id,
                "on a capturing stream",
            )));
        };
        let (capture, from, nodes) = (point.capture, point.stream, point.nodes);
        let mut covered = point.covers.clone();
        covered.insert(from, nodes);
        match waiting_in {
            Some(id) if id != capture => {
                table.invalidate(id, "a wait on another capture's event");
                table.invalidate(capture, "a wait on its event from another capture");
                return Some(Err(refused(
                    "waiting on another capture's event",
                    id,
                    "on a capturing stream",
                )));
            }
            Some(_) => {}
            None => {
                // A fork: the stream joins the capture.
                table.streams.insert(stream, capture);
            }
        }
        let c = table.captures.get_mut(&capture)?;
        let count = c.nodes.len();
        c.members.entry(stream).or_insert(count);
        let mine = c.covers.entry(stream).or_default();
        for (s, n) in covered {
            let at = mine.entry(s).or_insert(0);
            *at = (*at).max(n);
        }
        Some(Ok(()))
    }

    /// Begins capturing `stream` in `mode` on this thread.
    pub(super) fn begin(&self, stream: StreamId, mode: CaptureMode) -> Result<()> {
        let mut table = self.table.lock();
        if let Some(id) = table.streams.get(&stream) {
            return Err(Error::capture(format!(
                "stream {} is already being captured (capture {id})",
                stream.0
            )));
        }
        let id = table.fresh();
        table.captures.insert(
            id,
            Capture {
                origin: stream,
                mode,
                thread: std::thread::current().id(),
                nodes: Vec::new(),
                members: HashMap::from([(stream, 0)]),
                covers: HashMap::new(),
                invalid: None,
            },
        );
        table.streams.insert(stream, id);
        self.active.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Ends the capture begun on `stream`: its graph, or why there is none. The capture ends
    /// either way (its streams run work again).
    pub(super) fn end(&self, stream: StreamId) -> Result<GraphId> {
        let mut table = self.table.lock();
        let Some(&id) = table.streams.get(&stream) else {
            return Err(Error::capture(format!(
                "stream {} is not being captured",
                stream.0
            )));
        };
        let Some(capture) = table.captures.get(&id) else {
            return Err(Error::capture(format!("capture {id} vanished")));
        };
        // As CUDA does (seen on an H200): an end on a joined stream invalidates the capture, which
        // goes on until its origin ends it; an end on the wrong thread ends it, without a graph.
        if capture.origin != stream {
            let why = format!(
                "capture {id} began on stream {}: end it there, not on stream {}",
                capture.origin.0, stream.0
            );
            table.invalidate(id, &why);
            return Err(Error::capture(format!("{why}; the capture is invalidated")));
        }
        let wrong_thread =
            capture.mode != CaptureMode::Relaxed && capture.thread != std::thread::current().id();
        let Some(capture) = table.captures.remove(&id) else {
            return Err(Error::capture(format!("capture {id} vanished")));
        };
        self.active.fetch_sub(1, Ordering::AcqRel);
        table.streams.retain(|_, c| *c != id);
        table.points.retain(|_, p| p.capture != id);
        if wrong_thread {
            return Err(Error::capture(format!(
                "capture {id} ({:?} mode) must be ended by the thread that began it; it ended \
                 without a graph",
                capture.mode
            )));
        }
        if let Some(why) = capture.invalid {
            return Err(Error::capture(format!(
                "capture {id} was invalidated: {why}"
            )));
        }
        let origin_covers = capture.covers.get(&stream).cloned().unwrap_or_default();
        let unjoined: Vec<u64> = capture
            .members
            .iter()
            .filter(|&(s, &activity)| {
                *s != stream && origin_covers.get(s).is_none_or(|&n| n < activity)
            })
            .map(|(s, _)| s.0)
            .collect();
        if !unjoined.is_empty() {
            return Err(Error::capture(format!(
                "capture {id}: stream(s) {unjoined:?} joined the capture but the origin never \
                 waited for their last work (record an event there and wait on it from stream {})",
                stream.0
            )));
        }
        let graph = table.fresh();
        table.graphs.insert(graph, capture.nodes.into());
        Ok(GraphId(graph))
    }

    /// Whether `stream` is being captured.
    pub(super) fn status(&self, stream: StreamId) -> CaptureStatus {
        if !self.any() {
            return CaptureStatus::None;
        }
        let table = self.table.lock();
        match table.streams.get(&stream) {
            None => CaptureStatus::None,
            Some(&id) => match table.captures.get(&id) {
                Some(c) if c.invalid.is_some() => CaptureStatus::Invalidated { id },
                _ => CaptureStatus::Active { id },
            },
        }
    }

    /// An instantiation of `graph`.
    pub(super) fn instantiate(&self, graph: GraphId) -> Result<GraphExecId> {
        let mut table = self.table.lock();
        let nodes = table
            .graphs
            .get(&graph.0)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("{graph} does not exist")))?;
        let exec = table.fresh();
        let latest = Mutex::new(None);
        table.execs.insert(exec, Arc::new(Exec { nodes, latest }));
        Ok(GraphExecId(exec))
    }

    /// An instantiated graph, to launch.
    pub(super) fn exec(&self, exec: GraphExecId) -> Result<Arc<Exec>> {
        self.table
            .lock()
            .execs
            .get(&exec.0)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("{exec} does not exist")))
    }

    /// How many nodes `graph` has.
    pub(super) fn node_count(&self, graph: GraphId) -> Result<usize> {
        self.table
            .lock()
            .graphs
            .get(&graph.0)
            .map(|n| n.len())
            .ok_or_else(|| Error::invalid(format!("{graph} does not exist")))
    }

    pub(super) fn destroy_graph(&self, graph: GraphId) -> Result<()> {
        self.table
            .lock()
            .graphs
            .remove(&graph.0)
            .map(|_| ())
            .ok_or_else(|| Error::invalid(format!("{graph} does not exist")))
    }

    pub(super) fn destroy_exec(&self, exec: GraphExecId) -> Result<()> {
        self.table
            .lock()
            .execs
            .remove(&exec.0)
            .map(|_| ())
            .ok_or_else(|| Error::invalid(format!("{exec} does not exist")))
    }
}
