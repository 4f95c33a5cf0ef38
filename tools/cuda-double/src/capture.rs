//! Stream capture and graphs: what `cuStreamBeginCapture_v2` … `cuGraphLaunch` do to the double.
//!
//! Work queued on a capturing stream becomes a *node* — the entry point that queued it, its device
//! ranges and a maker that builds the work again for every launch — instead of running. Kernel
//! arguments are captured by value (as CUDA does); device pointers are resolved again when a
//! launch builds the work, so a replay over memory freed since the capture is a violation of that
//! launch, as the eager call would be.
//!
//! | call during a capture | the double |
//! |---|---|
//! | memset, device-to-device copy, kernel launch on a capturing stream | recorded as a node |
//! | host-to-device / device-to-host copy on a capturing stream | violation (`STREAM_CAPTURE_UNSUPPORTED`): pageable host memory cannot be captured |
//! | `cuEventRecord` on a capturing stream | marks a point of the capture (no real record) |
//! | `cuStreamWaitEvent(s, point)` | `s` joins the capture (a fork), or the origin joins a fork back |
//! | `cuStreamWaitEvent(capturing, event recorded outside)` | violation (`STREAM_CAPTURE_ISOLATION`), capture invalidated |
//! | sync/query of a capturing stream, of an event marking a point | violation (`STREAM_CAPTURE_UNSUPPORTED`), capture invalidated |
//! | `cuMemFree`, `cuCtxSynchronize` while a stream of the context captures | violation: they synchronize the context |
//! | any work on the legacy stream while a blocking stream of its context captures | violation (`STREAM_CAPTURE_IMPLICIT`) |
//! | *unsafe* calls (allocation, free, VM map/unmap, IPC open/close, graph instantiation, syncs and queries) while this thread is prohibited | violation (`STREAM_CAPTURE_UNSUPPORTED`), the prohibiting capture invalidated |
//! | `cuStreamEndCapture` | the graph; violation when not the origin (the capture is invalidated and goes on), on the wrong thread (modes other than relaxed: the capture ends without a graph) or with a forked stream never joined back; `STREAM_CAPTURE_INVALIDATED` (an outcome: its cause was reported) when invalidated |
//! | `cuGraphLaunch` on a capturing stream | violation (`STREAM_CAPTURE_UNSUPPORTED`), capture invalidated |
//! | `cuGraphInstantiateWithFlags` | an *unsafe* call (below) |
//!
//! A thread is prohibited, by its mode (`cuThreadExchangeStreamCaptureMode`, global unless
//! exchanged): global — while it began a capture that is not relaxed, or another thread began a
//! global one; thread-local — while it began one that is not relaxed; relaxed — never.
//!
//! Joins: every member stream but the origin has an *activity* (the node count when it joined or
//! last recorded work); a wait on a point covers the point's stream up to the point's node count
//! and inherits what that stream covered. The capture ends only when the origin covers every
//! member's activity. A replay runs the nodes in their recorded order as one piece of work on
//! the launch stream (the order of the calls linearizes the graph's dependencies).

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::codes;
use crate::kernels::Work;
use crate::report::{Checked, Entry, Fail};
use crate::stream::Stream;

/// Builds a node's work again for each launch.
pub type Maker = Arc<dyn Fn() -> Checked<Work> + Send + Sync>;

/// One recorded piece of device work.
#[derive(Clone)]
pub struct Node {
    /// The entry point that queued it.
    pub entry: Entry,
    /// The device ranges it touches.
    pub ranges: Vec<(u64, u64)>,
    /// Its work, built per launch.
    pub make: Maker,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node({})", self.entry.name())
    }
}

/// A captured graph (`CUgraph`), or its instantiation (`CUgraphExec`, which shares the nodes).
#[derive(Debug)]
pub struct Graph {
    /// Its handle.
    pub handle: usize,
    /// The recorded work, in order.
    pub nodes: Arc<[Node]>,
    /// An instantiation's latest launch (its stream and operation count): CUDA runs one launch
    /// of an instantiated graph at a time, each after the previous ones.
    pub last_launch: Mutex<Option<(Arc<Stream>, u64)>>,
}

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`.
pub const MODE_GLOBAL: u32 = 0;
/// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
pub const MODE_THREAD_LOCAL: u32 = 1;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
pub const MODE_RELAXED: u32 = 2;

/// `CU_STREAM_CAPTURE_STATUS_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Not capturing.
    None = 0,
    /// Capturing.
    Active = 1,
    /// Capturing, invalidated.
    Invalidated = 2,
}

/// A stream's key in the tables: its address (every legacy stream has handle 0).
pub fn key(stream: &Arc<Stream>) -> usize {
    Arc::as_ptr(stream) as usize
}

type Coverage = HashMap<usize, usize>;

struct Capture {
    origin: usize,
    mode: u32,
    thread: ThreadId,
    nodes: Vec<Node>,
    members: HashMap<usize, usize>,
    covers: HashMap<usize, Coverage>,
    invalid: Option<String>,
}

struct Member {
    capture: u64,
    ctx: usize,
    blocking: bool,
}

struct Point {
    capture: u64,
    stream: usize,
    nodes: usize,
    covers: Coverage,
}

#[derive(Default)]
struct Table {
    captures: HashMap<u64, Capture>,
    streams: HashMap<usize, Member>,
    points: HashMap<usize, Point>,
    next_id: u64,
}

impl Table {
    fn invalidate(&mut self, capture: u64, why: &str) {
        if let Some(c) = self.captures.get_mut(&capture) {
            c.invalid.get_or_insert_with(|| why.to_owned());
        }
    }

    fn prohibiting(&self, me: ThreadId, mode: u32) -> Option<u64> {
        if mode == MODE_RELAXED {
            return None;
        }
        let own = self
            .captures
            .iter()
            .find(|(_, c)| c.thread == me && c.mode != MODE_RELAXED);
        let other = || {
            self.captures
                .iter()
                .find(|(_, c)| mode == MODE_GLOBAL && c.thread != me && c.mode == MODE_GLOBAL)
        };
        own.or_else(other).map(|(&id, _)| id)
    }
}

thread_local! {
    static MODE: Cell<u32> = const { Cell::new(MODE_GLOBAL) };
}

fn violation(code: codes::CuResult, what: &str, capture: u64, why: &str) -> Fail {
    Fail::violation(
        code,
        format!("{what} {why} (capture {capture}); the capture is invalidated"),
    )
}

/// The process's captures.
#[derive(Default)]
pub struct Captures {
    active: AtomicUsize,
    table: Mutex<Table>,
}

impl std::fmt::Debug for Captures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Captures({} active)",
            self.active.load(Ordering::Relaxed)
        )
    }
}

impl Captures {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a capture is under way (every other check is skipped when not: one load).
    pub fn any(&self) -> bool {
        self.active.load(Ordering::Acquire) != 0
    }

    /// `cuThreadExchangeStreamCaptureMode`.
    pub fn exchange_mode(mode: u32) -> Checked<u32> {
        if mode > MODE_RELAXED {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("capture mode {mode}"),
            ));
        }
        Ok(MODE.with(|m| m.replace(mode)))
    }

    /// The violation of unsafe call `what` on a prohibited thread.
    pub fn check_unsafe(&self, what: &str) -> Checked<()> {
        if !self.any() {
            return Ok(());
        }
        let mut table = self.lock();
        let mode = MODE.with(Cell::get);
        match table.prohibiting(std::thread::current().id(), mode) {
            Some(id) => {
                table.invalidate(id, &format!("{what} was called"));
                Err(violation(
                    codes::STREAM_CAPTURE_UNSUPPORTED,
                    what,
                    id,
                    &format!("is prohibited on this thread (mode {mode}) during a capture"),
                ))
            }
            None => Ok(()),
        }
    }

    /// [`Self::check_unsafe`], and the violation of blocking on a capturing stream.
    pub fn check_blocking(&self, stream: &Arc<Stream>, what: &str) -> Checked<()> {
        if !self.any() {
            return Ok(());
        }
        {
            let mut table = self.lock();
            if let Some(id) = table.streams.get(&key(stream)).map(|m| m.capture) {
                table.invalidate(id, &format!("{what} on a capturing stream"));
                return Err(violation(
                    codes::STREAM_CAPTURE_UNSUPPORTED,
                    what,
                    id,
                    "on a stream that is being captured",
                ));
            }
        }
        self.check_unsafe(what)
    }

    /// The violation of `what`, which CUDA cannot capture, on a capturing stream (the capture is
    /// invalidated).
    pub fn refuse_on_capturing(&self, stream: &Arc<Stream>, what: &str) -> Checked<()> {
        if !self.any() {
            return Ok(());
        }
        let mut table = self.lock();
        match table.streams.get(&key(stream)).map(|m| m.capture) {
            Some(id) => {
                table.invalidate(id, &format!("{what} on a capturing stream"));
                Err(violation(
                    codes::STREAM_CAPTURE_UNSUPPORTED,
                    what,
                    id,
                    "cannot be captured",
                ))
            }
            None => Ok(()),
        }
    }

    /// [`Self::check_unsafe`], and the violation of querying or waiting on a point's event.
    pub fn check_event(&self, event: usize, what: &str) -> Checked<()> {
        if !self.any() {
            return Ok(());
        }
        {
            let mut table = self.lock();
            if let Some(id) = table.points.get(&event).map(|p| p.capture) {
                table.invalidate(id, &format!("{what} on an event of the capture"));
                return Err(violation(
                    codes::STREAM_CAPTURE_UNSUPPORTED,
                    what,
                    id,
                    "on an event recorded inside a capture",
                ));
            }
        }
        self.check_unsafe(what)
    }

    /// [`Self::check_unsafe`], and the violation of synchronizing context `ctx` while one of its
    /// streams captures (`cuMemFree`, `cuCtxSynchronize`).
    pub fn check_context(&self, ctx: usize, what: &str) -> Checked<()> {
        if !self.any() {
            return Ok(());
        }
        {
            let mut table = self.lock();
            if let Some(id) = table
                .streams
                .values()
                .find(|m| m.ctx == ctx)
                .map(|m| m.capture)
            {
                table.invalidate(id, &format!("{what} synchronized the context"));
                return Err(violation(
                    codes::STREAM_CAPTURE_UNSUPPORTED,
                    what,
                    id,
                    "synchronizes a context with a stream being captured",
                ));
            }
        }
        self.check_unsafe(what)
    }

    /// The violation of queuing work that cannot be captured on a capturing stream, or of
    /// using the legacy stream while a blocking stream of its context captures.
    pub fn check_uncapturable(&self, stream: &Arc<Stream>, what: &str) -> Checked<()> {
        if !self.any() {
            return Ok(());
        }
        let mut table = self.lock();
        if let Some(id) = table.streams.get(&key(stream)).map(|m| m.capture) {
            table.invalidate(id, &format!("{what} cannot be captured"));
            return Err(violation(
                codes::STREAM_CAPTURE_UNSUPPORTED,
                what,
                id,
                "cannot be captured (pageable host memory)",
            ));
        }
        Self::check_legacy(&mut table, stream, what)
    }

    fn check_legacy(table: &mut Table, stream: &Arc<Stream>, what: &str) -> Checked<()> {
        if stream.handle != 0 {
            return Ok(());
        }
        let implicit = table
            .streams
            .values()
            .find(|m| m.ctx == stream.ctx && m.blocking)
            .map(|m| m.capture);
        match implicit {
            Some(id) => {
                table.invalidate(id, "the legacy stream was used");
                Err(violation(
                    codes::STREAM_CAPTURE_IMPLICIT,
                    what,
                    id,
                    "on the legacy stream, which synchronizes with a blocking stream being \
                     captured",
                ))
            }
            None => Ok(()),
        }
    }

    /// Records `node` when `stream` captures: `None` when it does not (run the work).
    pub fn record(&self, stream: &Arc<Stream>, node: impl FnOnce() -> Node) -> Option<Checked<()>> {
        if !self.any() {
            return None;
        }
        let mut table = self.lock();
        let Some(id) = table.streams.get(&key(stream)).map(|m| m.capture) else {
            return Self::check_legacy(&mut table, stream, node().entry.name())
                .err()
                .map(Err);
        };
        let capture = table.captures.get_mut(&id)?;
        if let Some(why) = &capture.invalid {
            return Some(Err(Fail::outcome(
                codes::STREAM_CAPTURE_INVALIDATED,
                format!("capture {id} was invalidated ({why})"),
            )));
        }
        capture.nodes.push(node());
        let count = capture.nodes.len();
        capture.members.insert(key(stream), count);
        Some(Ok(()))
    }

    /// `cuEventRecord(event, stream)`: a point when the stream captures (`Some`); otherwise a
    /// real record follows (`None`), forgetting any point the event marked.
    pub fn record_point(&self, event: usize, stream: &Arc<Stream>) -> Option<Checked<()>> {
        if !self.any() {
            return None;
        }
        let mut table = self.lock();
        let Some(id) = table.streams.get(&key(stream)).map(|m| m.capture) else {
            table.points.remove(&event);
            return Self::check_legacy(&mut table, stream, "cuEventRecord")
                .err()
                .map(Err);
        };
        let capture = table.captures.get(&id)?;
        if let Some(why) = &capture.invalid {
            return Some(Err(Fail::outcome(
                codes::STREAM_CAPTURE_INVALIDATED,
                format!("capture {id} was invalidated ({why})"),
            )));
        }
        let point = Point {
            capture: id,
            stream: key(stream),
            nodes: capture.nodes.len(),
            covers: capture
                .covers
                .get(&key(stream))
                .cloned()
                .unwrap_or_default(),
        };
        table.points.insert(event, point);
        Some(Ok(()))
    }

    /// `cuStreamWaitEvent(stream, event)`: `None` when neither takes part in a capture (a real
    /// wait follows); else a fork, a join or a violation.
    pub fn wait(&self, stream: &Arc<Stream>, event: usize) -> Option<Checked<()>> {
        if !self.any() {
            return None;
        }
        let mut table = self.lock();
        let me = key(stream);
        let waiting_in = table.streams.get(&me).map(|m| m.capture);
        let Some(point) = table.points.get(&event) else {
            let Some(id) = waiting_in else {
                return Self::check_legacy(&mut table, stream, "cuStreamWaitEvent")
                    .err()
                    .map(Err);
            };
            table.invalidate(id, "a wait on an event recorded outside the capture");
            return Some(Err(violation(
                codes::STREAM_CAPTURE_ISOLATION,
                "cuStreamWaitEvent",
                id,
                "waits on an event recorded outside the capture",
            )));
        };
        let (capture, from, nodes) = (point.capture, point.stream, point.nodes);
        let mut covered = point.covers.clone();
        covered.insert(from, nodes);
        match waiting_in {
            Some(id) if id != capture => {
                table.invalidate(id, "a wait on another capture's event");
                table.invalidate(capture, "a wait on its event from another capture");
                return Some(Err(violation(
                    codes::STREAM_CAPTURE_MERGE,
                    "cuStreamWaitEvent",
                    id,
                    "waits on an event of another capture",
                )));
            }
            Some(_) => {}
            None if stream.handle == 0 => {
                table.invalidate(capture, "the legacy stream waited on its event");
                return Some(Err(violation(
                    codes::STREAM_CAPTURE_UNSUPPORTED,
                    "cuStreamWaitEvent",
                    capture,
                    "on the legacy stream, which cannot join a capture",
                )));
            }
            None => {
                table.streams.insert(
                    me,
                    Member {
                        capture,
                        ctx: stream.ctx,
                        blocking: stream.blocking,
                    },
                );
            }
        }
        let c = table.captures.get_mut(&capture)?;
        let count = c.nodes.len();
        c.members.entry(me).or_insert(count);
        let mine = c.covers.entry(me).or_default();
        for (s, n) in covered {
            let at = mine.entry(s).or_insert(0);
            *at = (*at).max(n);
        }
        Some(Ok(()))
    }

    /// `cuStreamBeginCapture_v2`.
    pub fn begin(&self, stream: &Arc<Stream>, mode: u32) -> Checked<()> {
        if mode > MODE_RELAXED {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("capture mode {mode}"),
            ));
        }
        if stream.handle == 0 {
            return Err(Fail::violation(
                codes::STREAM_CAPTURE_UNSUPPORTED,
                "the legacy stream cannot be captured",
            ));
        }
        let mut table = self.lock();
        if let Some(m) = table.streams.get(&key(stream)) {
            return Err(Fail::violation(
                codes::ILLEGAL_STATE,
                format!(
                    "stream {:#x} already takes part in capture {}",
                    stream.handle, m.capture
                ),
            ));
        }
        table.next_id += 1;
        let id = table.next_id;
        table.captures.insert(
            id,
            Capture {
                origin: key(stream),
                mode,
                thread: std::thread::current().id(),
                nodes: Vec::new(),
                members: HashMap::from([(key(stream), 0)]),
                covers: HashMap::new(),
                invalid: None,
            },
        );
        table.streams.insert(
            key(stream),
            Member {
                capture: id,
                ctx: stream.ctx,
                blocking: stream.blocking,
            },
        );
        self.active.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// `cuStreamEndCapture`: the recorded nodes, or why there is no graph. Once past the
    /// checks of who ends it, the capture ends either way.
    pub fn end(&self, stream: &Arc<Stream>) -> Checked<Vec<Node>> {
        let mut table = self.lock();
        let me = key(stream);
        let Some(id) = table.streams.get(&me).map(|m| m.capture) else {
            return Err(Fail::violation(
                codes::ILLEGAL_STATE,
                format!("stream {:#x} is not being captured", stream.handle),
            ));
        };
        let Some(capture) = table.captures.get(&id) else {
            return Err(Fail::violation(codes::UNKNOWN, "a capture vanished"));
        };
        // Seen on an H200: an end on a joined stream invalidates the capture (it goes on until
        // its origin ends it); an end on the wrong thread ends it, without a graph.
        if capture.origin != me {
            table.invalidate(id, "it was ended on a stream that joined it");
            return Err(Fail::violation(
                codes::STREAM_CAPTURE_UNMATCHED,
                format!(
                    "capture {id} is ended on a stream that joined it, not its origin; the \
                     capture is invalidated"
                ),
            ));
        }
        let wrong_thread =
            capture.mode != MODE_RELAXED && capture.thread != std::thread::current().id();
        let Some(capture) = table.captures.remove(&id) else {
            return Err(Fail::violation(codes::UNKNOWN, "a capture vanished"));
        };
        self.active.fetch_sub(1, Ordering::AcqRel);
        table.streams.retain(|_, m| m.capture != id);
        table.points.retain(|_, p| p.capture != id);
        if wrong_thread {
            return Err(Fail::violation(
                codes::STREAM_CAPTURE_WRONG_THREAD,
                format!(
                    "capture {id} (mode {}) is ended by another thread than began it; it ended \
                     without a graph",
                    capture.mode
                ),
            ));
        }
        if let Some(why) = capture.invalid {
            return Err(Fail::outcome(
                codes::STREAM_CAPTURE_INVALIDATED,
                format!("capture {id} was invalidated: {why}"),
            ));
        }
        let covered = capture.covers.get(&me).cloned().unwrap_or_default();
        let unjoined = capture
            .members
            .iter()
            .filter(|&(s, &activity)| *s != me && covered.get(s).is_none_or(|&n| n < activity))
            .count();
        if unjoined > 0 {
            return Err(Fail::violation(
                codes::STREAM_CAPTURE_UNJOINED,
                format!(
                    "capture {id}: {unjoined} stream(s) joined the capture but the origin never \
                     waited for their last work"
                ),
            ));
        }
        Ok(capture.nodes)
    }

    /// The error CUDA gives a capture-status query of the legacy stream while a blocking stream
    /// of its context captures (`STREAM_CAPTURE_IMPLICIT`, an outcome: the query is legal).
    pub fn status_of_legacy(&self, stream: &Arc<Stream>) -> Checked<()> {
        if !self.any() || stream.handle != 0 {
            return Ok(());
        }
        let table = self.lock();
        match table
            .streams
            .values()
            .find(|m| m.ctx == stream.ctx && m.blocking)
        {
            Some(m) => Err(Fail::outcome(
                codes::STREAM_CAPTURE_IMPLICIT,
                format!(
                    "the legacy stream synchronizes with a blocking stream being captured                      (capture {})",
                    m.capture
                ),
            )),
            None => Ok(()),
        }
    }

    /// `cuStreamGetCaptureInfo_v2` / `cuStreamIsCapturing`: the status and the capture's id.
    pub fn status(&self, stream: &Arc<Stream>) -> (Status, u64) {
        if !self.any() {
            return (Status::None, 0);
        }
        let table = self.lock();
        match table.streams.get(&key(stream)).map(|m| m.capture) {
            None => (Status::None, 0),
            Some(id) => match table.captures.get(&id) {
                Some(c) if c.invalid.is_some() => (Status::Invalidated, id),
                _ => (Status::Active, id),
            },
        }
    }

    /// `cuStreamDestroy_v2` of a stream taking part in a capture: the violation, after the
    /// stream is taken out of it — a capture it began is gone (nobody could end it), one it
    /// joined is invalidated — so that no prohibition outlives it.
    pub fn forget_stream(&self, stream: &Arc<Stream>) -> Checked<()> {
        if !self.any() {
            return Ok(());
        }
        let mut table = self.lock();
        let me = key(stream);
        let Some(id) = table.streams.remove(&me).map(|m| m.capture) else {
            return Ok(());
        };
        let origin = table.captures.get(&id).is_some_and(|c| c.origin == me);
        if origin {
            table.captures.remove(&id);
            table.streams.retain(|_, m| m.capture != id);
            table.points.retain(|_, p| p.capture != id);
            self.active.fetch_sub(1, Ordering::AcqRel);
        } else {
            table.invalidate(id, "a stream that joined it was destroyed");
        }
        Err(Fail::violation(
            codes::STREAM_CAPTURE_UNSUPPORTED,
            format!(
                "cuStreamDestroy of a stream taking part in capture {id} ({}): end the capture first",
                if origin { "its origin; the capture is gone" } else { "joined; the capture is invalidated" }
            ),
        ))
    }

    /// A destroyed event marks no point any more.
    pub fn forget_point(&self, event: usize) {
        if self.any() {
            self.lock().points.remove(&event);
        }
    }

    /// Invalidates the capture `stream` takes part in (a call on it failed, as in CUDA).
    pub fn invalidate_stream(&self, stream: &Arc<Stream>, why: &str) {
        if !self.any() {
            return;
        }
        let mut table = self.lock();
        if let Some(id) = table.streams.get(&key(stream)).map(|m| m.capture) {
            table.invalidate(id, why);
        }
    }
}
