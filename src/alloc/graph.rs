//! CUDA graphs through the allocator: PyTorch's `torch.cuda.graph` / `CUDAGraph` semantics.
//!
//! [`Runtime::begin_capture`](crate::Runtime::begin_capture) begins capturing a stream (the driver's capture,
//! `driver/capture.rs`) with a private memory pool — a fresh one, `(n, 0)`, or one the caller
//! shares between graphs — and routes every allocation on that stream (and on streams that join
//! the capture) to it (`capturing.rs`). [`Capture::end`] gives a [`Graph`], instantiated, that
//! [`Graph::replay`]s the captured work on any stream with the same addresses every time.
//!
//! | moment | the pool's memory | why |
//! |---|---|---|
//! | during the capture | allocations come from the pool; a block freed in the capture may serve a later allocation of the same capture | PyTorch's private pools |
//! | while the graph lives | the pool keeps every block, freed or not: nothing outside the pool is ever handed its memory — neither `empty_cache`, the pool's own `empty_cache`, out of memory nor `use_on_oom` lending releases it — and the stream sanitizer is not told of frees in it (`capturing.rs`, [`GraphPool`]) | replays write the addresses the capture saw |
//! | the graph (and every other holder of the pool) dropped | the pool is dropped: its cache goes back, blocks live storages still hold return as they are freed (`mem_pool.rs`) | PyTorch's `releasePool` |
//!
//! A capture that fails — out of memory inside it, a forbidden call — is an error of the call
//! that failed; dropping the [`Capture`] (or calling [`Capture::end`], which then returns the
//! error) ends the driver's capture, so the stream runs work again and nothing of it leaks.
//!
//! A library that captures with its own API (cudarc's `CudaStream::begin_capture` /
//! `end_capture` and `CudaGraph`) tells the allocator with [`Runtime::route_capture`](crate::Runtime::route_capture):
//! the same routing, with the capture begun and ended by the library; the [`CaptureRoute`] gives
//! the pool back when it finishes, for the library to keep beside its graph.

use super::capturing::{CaptureRoutes, CapturedUse, GraphHold};
use super::engine::Cores;
use super::mem_pool::MemPool;
use super::pool_id::MemPoolOptions;
use super::CachingAllocator;
use crate::driver::capability::relaxed;
use crate::driver::{CaptureMode, Driver, GraphExecId, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::Arc;

/// A stream capture under way (see [`Runtime::begin_capture`](crate::Runtime::begin_capture)). Dropping it without
/// [`Capture::end`] ends the driver's capture and discards what it recorded. It stays on the
/// thread that began it:
///
/// ```compile_fail
/// fn f(capture: cudalloc::graph::Capture) {
///     std::thread::spawn(move || drop(capture));
/// }
/// ```
#[derive(Debug)]
#[must_use = "the capture runs while this lives: end it with `.end()`"]
pub struct Capture {
    route: Route,
    /// `!Send`: a capture ends on the thread that began it (the driver refuses another's, and
    /// the allocator would stop routing while the driver's capture went on).
    _this_thread: std::marker::PhantomData<*const ()>,
}

/// A captured and instantiated graph: [`Graph::replay`] runs the captured work again on any
/// stream. It keeps its memory pool — and with it every address the capture handed out — alive.
#[derive(Debug)]
pub struct Graph {
    driver: Arc<dyn Driver>,
    exec: GraphExecId,
    pool: MemPool,
    _hold: GraphHold,
    nodes: usize,
    /// The accesses its capture took through storages: each replay is ordered with them, and
    /// they (the storages) live as long as the graph (`capturing.rs`).
    uses: Vec<Arc<dyn CapturedUse>>,
    birth: Birth,
}

/// The pool of a graph someone else captured ([`CaptureRoute::finish`]): keep it as long as
/// that graph lives — while it does, the pool's memory stays the graph's (no eager allocation,
/// `MemPool::empty_cache` or `use_on_oom` lending takes it; `capturing.rs`).
#[derive(Debug)]
pub struct GraphPool {
    pool: MemPool,
    _hold: GraphHold,
}

impl GraphPool {
    /// The pool (share it with a later capture).
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }
}

impl CachingAllocator {
    /// The body of [`Runtime::begin_capture`](crate::Runtime::begin_capture), documented there.
    pub(crate) fn begin_capture(
        &self,
        stream: StreamId,
        pool: Option<&MemPool>,
        mode: CaptureMode,
    ) -> Result<Capture> {
        let route = self.start_route(stream, pool, true, || {
            self.driver.graphs().stream_begin_capture(stream, mode)
        })?;
        Ok(Capture {
            route,
            _this_thread: std::marker::PhantomData,
        })
    }

    /// The body of [`Runtime::route_capture`](crate::Runtime::route_capture), documented there.
    pub(crate) fn route_capture(
        &self,
        stream: StreamId,
        pool: Option<&MemPool>,
    ) -> Result<CaptureRoute> {
        let route = self.start_route(stream, pool, false, || Ok(()))?;
        Ok(CaptureRoute {
            route,
            _this_thread: std::marker::PhantomData,
        })
    }

    /// Counts a capture starting, runs `begin`, and routes the capture then under way on
    /// `stream` to `pool` (or a fresh private pool). `tail`: the capture begins here, so an event
    /// is recorded on the stream first, after its eager work (`capturing.rs`).
    fn start_route(
        &self,
        stream: StreamId,
        pool: Option<&MemPool>,
        tail: bool,
        begin: impl FnOnce() -> Result<()>,
    ) -> Result<Route> {
        self.birth.check("this allocator")?;
        let pool = match pool {
            Some(pool) => {
                if !self.owns_pool(pool) {
                    return Err(Error::invalid(format!(
                        "memory pool {} belongs to another allocator",
                        pool.id()
                    )));
                }
                pool.clone()
            }
            None => self.graph_pool(MemPoolOptions::default()),
        };
        let tail = if tail {
            let event = self
                .driver
                .event_create(stream.device(), crate::driver::EventFlags::default())?;
            if let Err(err) = self.driver.event_record(event, stream) {
                self.destroy_tail(Some(event));
                return Err(err);
            }
            Some(event)
        } else {
            None
        };
        self.capturing.starting();
        // No wait between streams is decided while the capture begins and its tail is entered.
        let beginning = self.capturing.beginning();
        let began = begin().and_then(|()| self.driver.graphs().stream_capture_status(stream));
        let id = match began.map(|s| s.capture_id()) {
            Ok(Some(id)) => id,
            Ok(None) => {
                // Before the flush of deferred frees, which takes shard locks: a free holding
                // its shard's lock may wait for this gate.
                drop(beginning);
                self.capture_never_began();
                self.destroy_tail(tail);
                return Err(Error::capture(format!(
                    "stream {} is not being captured (begin its capture first)",
                    stream.raw()
                )));
            }
            Err(err) => {
                drop(beginning);
                self.capture_never_began();
                self.destroy_tail(tail);
                return Err(err);
            }
        };
        if let Some(event) = tail {
            self.capturing.tail(id, stream, event);
        }
        let hold = CaptureRoutes::hold(&self.capturing, pool.id(), self.birth);
        CaptureRoutes::route(&self.capturing, id, pool.id(), pool.options());
        drop(beginning);
        Ok(Route {
            driver: Arc::clone(&self.driver),
            capturing: Arc::clone(&self.capturing),
            devices: self.devices.clone(),
            stream,
            capture: Some(id),
            pool,
            hold,
            birth: self.birth,
        })
    }

    /// Whether `stream` is being captured by a capture of this allocator's (one load while none
    /// runs). Work the allocator does on its own on such a stream — a lazy clone's copy — is
    /// recorded into the graph, so it must not be waited for or followed by an event.
    pub(crate) fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        if !self.capturing.any() {
            return Ok(false);
        }
        Ok(self
            .driver
            .graphs()
            .stream_capture_status(stream)?
            .is_capturing())
    }

    /// Whether any capture of this allocator is under way (one load).
    pub(crate) fn captures_under_way(&self) -> bool {
        self.capturing.any()
    }

    /// Destroys a capture's tail event (logged on failure).
    fn destroy_tail(&self, tail: Option<crate::driver::EventId>) {
        destroy_tail(&self.driver, tail);
    }

    /// A capture counted by `begin_capture` did not begin: frees deferred meanwhile get their
    /// events when it was the only one.
    fn capture_never_began(&self) {
        if self.capturing.ended(None).0 {
            for device in self.devices.in_its_process().unwrap_or_default() {
                device.flush_deferred();
            }
        }
    }
}

/// Destroys a capture's tail event, if any (logged on failure).
fn destroy_tail(driver: &Arc<dyn Driver>, tail: Option<crate::driver::EventId>) {
    if let Some(event) = tail {
        if let Err(err) = driver.event_destroy(event) {
            tracing::warn!(%err, "destroying a capture's tail event failed");
        }
    }
}

/// What a capture's routing holds (a [`Capture`]'s or a [`CaptureRoute`]'s).
#[derive(Debug)]
struct Route {
    driver: Arc<dyn Driver>,
    capturing: Arc<CaptureRoutes>,
    devices: Cores,
    stream: StreamId,
    /// The driver's id of the capture (`None` once the routing stopped).
    capture: Option<u64>,
    pool: MemPool,
    /// The capture's hold on its pool (`capturing.rs`).
    hold: GraphHold,
    birth: Birth,
}

impl Route {
    /// Stops routing the capture, once; the frees deferred during captures get their events
    /// when the last one stopped.
    fn stop(&mut self) {
        if let Some(capture) = self.capture.take() {
            let (last, tail) = self.capturing.ended(Some(capture));
            destroy_tail(&self.driver, tail);
            if last {
                for device in self.devices.in_its_process().unwrap_or_default() {
                    device.flush_deferred();
                }
            }
        }
    }
}

impl Capture {
    /// The pool the capture allocates from (share it with a later capture: PyTorch's
    /// `graph.pool()`).
    pub fn pool(&self) -> &MemPool {
        &self.route.pool
    }

    /// The stream being captured.
    pub fn stream(&self) -> StreamId {
        self.route.stream
    }

    /// Ends the capture: the graph, instantiated — or the error that ended it (an invalidated
    /// capture, a forked stream never joined back). Refused in a forked child.
    pub fn end(mut self) -> Result<Graph> {
        self.route.birth.check("this capture")?;
        let uses = match self.route.capture {
            Some(capture) => self.route.capturing.take_uses(capture),
            None => Vec::new(),
        };
        let graph = self.finish()?;
        let r = &self.route;
        // Relaxed: another capture of this thread, or another thread's global one, would
        // prohibit instantiating (CUDA refuses it, seen on an H200); the graph is ours to make.
        let graphs = r.driver.graphs();
        let made = relaxed(graphs, || graphs.graph_instantiate(graph));
        let nodes = r.driver.graphs().graph_node_count(graph).unwrap_or(0);
        if let Err(err) = r.driver.graphs().graph_destroy(graph) {
            tracing::debug!(%err, "destroying a captured graph after instantiating it failed");
        }
        Ok(Graph {
            driver: Arc::clone(&r.driver),
            exec: made?,
            pool: r.pool.clone(),
            _hold: r.hold.another(),
            nodes,
            uses,
            birth: r.birth,
        })
    }

    /// Ends the driver's capture once and stops its routing.
    fn finish(&mut self) -> Result<crate::driver::GraphId> {
        if self.route.capture.is_none() {
            return Err(Error::capture("the capture already ended"));
        }
        let graph = self
            .route
            .driver
            .graphs()
            .stream_end_capture(self.route.stream);
        self.route.stop();
        graph
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.route.capture.is_none() || !self.route.birth.is_current() {
            return;
        }
        match self.finish() {
            Ok(graph) => {
                if let Err(err) = self.route.driver.graphs().graph_destroy(graph) {
                    tracing::warn!(%err, "destroying the graph of a capture dropped without its end failed");
                }
            }
            Err(err) => {
                tracing::debug!(%err, "a capture dropped without its end ended with an error")
            }
        }
    }
}

/// A capture begun by someone else, routed to a pool ([`Runtime::route_capture`](crate::Runtime::route_capture)).
/// Dropping it stops the routing, as [`CaptureRoute::finish`] does; like a [`Capture`] it stays on
/// the thread that began it.
#[derive(Debug)]
#[must_use = "allocations on the stream come from the pool while this lives: finish it after the capture ends"]
pub struct CaptureRoute {
    route: Route,
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl CaptureRoute {
    /// The pool the capture allocates from.
    pub fn pool(&self) -> &MemPool {
        &self.route.pool
    }

    /// Stops routing once the capture has ended, and gives the graph's pool back — keep it as
    /// long as the captured graph lives. An error (the route stays) while the capture is still
    /// under way: end it first.
    pub fn finish(&mut self) -> Result<GraphPool> {
        let r = &mut self.route;
        r.birth.check("this capture route")?;
        let Some(capture) = r.capture else {
            return Err(Error::capture("the capture route already finished"));
        };
        if r.driver
            .graphs()
            .stream_capture_status(r.stream)?
            .capture_id()
            == Some(capture)
        {
            return Err(Error::capture(format!(
                "stream {} is still being captured (capture {capture}): end the capture, then \
                 finish its route",
                r.stream.raw()
            )));
        }
        r.stop();
        Ok(GraphPool {
            pool: r.pool.clone(),
            _hold: r.hold.another(),
        })
    }
}

impl Drop for CaptureRoute {
    fn drop(&mut self) {
        if self.route.birth.is_current() {
            self.route.stop();
        }
    }
}

impl Graph {
    /// Replays the captured work on `stream` (PyTorch's `graph.replay()`), stream-ordered — and
    /// ordered, as one more access, with every storage its capture read or wrote through the
    /// storage's doors (typed kernels, copies): `stream` waits for their conflicting earlier
    /// accesses on other streams, and theirs after it wait for the replay. An error, nothing
    /// launched, when such a storage no longer holds the memory the capture saw (it was
    /// materialized from a lazy clone since) or is now shared copy-on-write and written here.
    pub fn replay(&self, stream: StreamId) -> Result<()> {
        self.birth.check("this graph")?;
        let mut launch = || {
            // SAFETY: the replay touches what its capture touched: the storages it took as
            // accesses are held and ordered now (their locks held while this is queued); the
            // graph's pool memory is its own (typed kernels see private copies of private-pool
            // memory); raw captured work was the capturing caller's `unsafe` contract.
            unsafe { self.driver.graphs().graph_launch(self.exec, stream) }
        };
        match self.uses.first() {
            Some(first) => first.order_replay(&self.uses, stream, &mut launch),
            None => launch(),
        }
    }

    /// The memory pool the graph's allocations came from (PyTorch's `graph.pool()`): pass it to
    /// another capture to share it.
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }

    /// How many nodes the captured graph has.
    pub fn node_count(&self) -> usize {
        self.nodes
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            return;
        }
        if let Err(err) = self.driver.graphs().graph_exec_destroy(self.exec) {
            tracing::debug!(%err, "destroying a graph's instantiation failed");
        }
    }
}
