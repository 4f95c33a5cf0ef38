//! The double's process state: initialization, devices, primary contexts, the thread's current
//! context, and the table of every handle it gave out.
//!
//! Handles are numbers from one counter (never addresses, never reused), kept in one table with
//! their kind, so a handle the double did not give out, a handle of the wrong kind, and a handle
//! already destroyed are each recognized and reported as what they are.
//!
//! Primary context states:
//!
//! | retains | `cuCtxSetCurrent` | context-bound calls while current            |
//! |---------|-------------------|----------------------------------------------|
//! | 0 (never retained) | violation (not a handle given out) | —                 |
//! | ≥ 1     | ok                | ok                                           |
//! | 0 after release | ok (CUDA accepts it) | violation: the context is inactive; its memory was freed, its streams and events are gone |

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::capture::{Captures, Graph, Maker, Node};
use crate::codes;
use crate::event::Event;
use crate::memory::Memory;
use crate::module::{Function, Module};
use crate::report::{Checked, Fail};
use crate::stream::Stream;

/// Kinds of handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `CUcontext`.
    Context,
    /// `CUstream`.
    Stream,
    /// `CUevent`.
    Event,
    /// `CUmodule`.
    Module,
    /// `CUfunction`.
    Function,
    /// `CUgraph`.
    Graph,
    /// `CUgraphExec`.
    GraphExec,
}

/// An entry of the handle table.
#[derive(Clone, Debug)]
pub enum Object {
    /// A primary context.
    Context(Arc<Context>),
    /// A stream.
    Stream(Arc<Stream>),
    /// An event.
    Event(Arc<Event>),
    /// A loaded module.
    Module(Arc<Module>),
    /// A kernel of a module.
    Function(Arc<Function>),
    /// A captured graph.
    Graph(Arc<Graph>),
    /// An instantiated graph.
    GraphExec(Arc<Graph>),
    /// A handle destroyed by the caller.
    Destroyed(Kind),
}

impl Object {
    fn kind(&self) -> Kind {
        match self {
            Object::Context(_) => Kind::Context,
            Object::Stream(_) => Kind::Stream,
            Object::Event(_) => Kind::Event,
            Object::Module(_) => Kind::Module,
            Object::Function(_) => Kind::Function,
            Object::Graph(_) => Kind::Graph,
            Object::GraphExec(_) => Kind::GraphExec,
            Object::Destroyed(k) => *k,
        }
    }
}

/// A device's primary context.
#[derive(Debug)]
pub struct Context {
    /// Its handle.
    pub handle: usize,
    /// Its device.
    pub device: usize,
    /// `cuDevicePrimaryCtxRetain` minus `cuDevicePrimaryCtxRelease` calls.
    pub retains: Mutex<u32>,
    /// Streams not yet destroyed, and destroyed ones whose queued work has not all run yet
    /// (a context synchronize still waits for it, as CUDA's does); pruned when listed.
    pub streams: Mutex<Vec<Arc<Stream>>>,
    /// The legacy default stream (the null `CUstream`), made on first use.
    pub legacy: OnceLock<Arc<Stream>>,
    /// Incremented when the last release tears the context down: events and functions made
    /// before then are stale.
    pub epoch: AtomicU64,
}

impl Context {
    /// Whether the context has been retained and not fully released.
    pub fn active(&self) -> bool {
        *self.retains.lock().unwrap_or_else(|p| p.into_inner()) > 0
    }

    /// Every stream of the context (the legacy stream included, when made).
    pub fn all_streams(&self) -> Vec<Arc<Stream>> {
        let mut all = {
            let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            streams.retain(|s| !s.finished());
            streams.clone()
        };
        all.extend(self.legacy.get().cloned());
        all
    }
}

/// A device.
#[derive(Debug)]
pub struct Device {
    /// Its name (`cuDeviceGetName`).
    pub name: String,
    /// Capacity in bytes.
    pub total: u64,
    /// Bytes allocated by this process.
    pub used: AtomicU64,
    /// Its primary context.
    pub context: Arc<Context>,
}

/// The state after `cuInit`.
#[derive(Debug)]
pub struct Double {
    /// The process that called `cuInit` (a forked child may not use the driver).
    pub pid: u32,
    /// Devices.
    pub devices: Vec<Device>,
    objects: Mutex<HashMap<usize, Object>>,
    next_handle: AtomicUsize,
    /// Device memory.
    pub memory: Memory,
    /// Stream captures (`capture.rs`).
    pub captures: Captures,
    /// Page-locked host memory (`host.rs`).
    pub host: crate::host::PinnedHost,
}

static DOUBLE: OnceLock<Double> = OnceLock::new();

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn env_number(name: &str, default: u64) -> Checked<u64> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(default),
        Ok(text) => text.trim().parse().map_err(|_| {
            Fail::violation(
                codes::INVALID_VALUE,
                format!("{name}={text:?} is not a number"),
            )
        }),
        Err(_) => Err(Fail::violation(
            codes::INVALID_VALUE,
            format!("{name} is not UTF-8"),
        )),
    }
}

/// `cuInit`: builds the state from `CUDA_DOUBLE_DEVICES` (default 2) and `CUDA_DOUBLE_MEMORY`
/// (bytes per device, default 1 GiB). Calling it again is allowed and does nothing.
pub fn init() -> Checked<()> {
    if let Some(d) = DOUBLE.get() {
        return check_pid(d).map(|_| ());
    }
    let count = env_number("CUDA_DOUBLE_DEVICES", 2)?;
    let total = env_number("CUDA_DOUBLE_MEMORY", 1 << 30)?;
    if !(1..=16).contains(&count) || total == 0 {
        return Err(Fail::violation(
            codes::INVALID_VALUE,
            format!("CUDA_DOUBLE_DEVICES={count} (1..=16) / CUDA_DOUBLE_MEMORY={total} (> 0)"),
        ));
    }
    let next_handle = AtomicUsize::new(0x1000);
    let mut objects = HashMap::new();
    let devices = (0..count as usize)
        .map(|device| {
            let handle = next_handle.fetch_add(0x10, Ordering::Relaxed);
            let context = Arc::new(Context {
                handle,
                device,
                retains: Mutex::new(0),
                streams: Mutex::new(Vec::new()),
                legacy: OnceLock::new(),
                epoch: AtomicU64::new(0),
            });
            objects.insert(handle, Object::Context(context.clone()));
            Device {
                name: format!("cudalloc CUDA contract double (device {device}, not a GPU)"),
                total,
                used: AtomicU64::new(0),
                context,
            }
        })
        .collect::<Vec<_>>();
    let memory = Memory::new(devices.len());
    let _ = DOUBLE.set(Double {
        pid: std::process::id(),
        devices,
        objects: Mutex::new(objects),
        next_handle,
        memory,
        captures: Captures::default(),
        host: crate::host::PinnedHost::default(),
    });
    Ok(())
}

fn check_pid(d: &'static Double) -> Checked<&'static Double> {
    if d.pid != std::process::id() {
        return Err(Fail::violation(
            codes::NOT_INITIALIZED,
            format!(
                "the driver was initialized in process {} and is used in its forked child {}; \
                 CUDA cannot be used after fork",
                d.pid,
                std::process::id()
            ),
        ));
    }
    Ok(d)
}

/// The state, or the violation of calling before `cuInit`.
pub fn double() -> Checked<&'static Double> {
    match DOUBLE.get() {
        Some(d) => check_pid(d),
        None => Err(Fail::violation(
            codes::NOT_INITIALIZED,
            "called before cuInit",
        )),
    }
}

/// `CU_STREAM_LEGACY`: the legacy stream, named explicitly.
const CU_STREAM_LEGACY: usize = 1;
/// `CU_STREAM_PER_THREAD`.
const CU_STREAM_PER_THREAD: usize = 2;

/// The handle value as the C API sees it.
pub fn as_ptr(handle: usize) -> *mut c_void {
    handle as *mut c_void
}

impl Double {
    /// The device `ordinal`, or the violation.
    pub fn device(&self, ordinal: libc::c_int) -> Checked<&Device> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or_else(|| {
                Fail::violation(
                    codes::INVALID_DEVICE,
                    format!(
                        "device ordinal {ordinal} (there are {} devices)",
                        self.devices.len()
                    ),
                )
            })
    }

    /// A fresh handle for `make(handle)`.
    pub fn insert(&self, make: impl FnOnce(usize) -> Object) -> usize {
        let handle = self.next_handle.fetch_add(0x10, Ordering::Relaxed);
        let object = make(handle);
        self.objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle, object);
        handle
    }

    /// Registers a new event of context `ctx` (made or opened now) and returns its handle.
    pub fn insert_event(
        &self,
        ctx: &Context,
        flags: u32,
        imported: bool,
        store: crate::event::CellStore,
    ) -> usize {
        let epoch = ctx.epoch.load(Ordering::Acquire);
        self.insert(|handle| {
            Object::Event(Arc::new(Event {
                handle,
                ctx: ctx.handle,
                device: ctx.device,
                epoch,
                flags,
                imported,
                store,
            }))
        })
    }

    /// Looks up `handle`, which must be of `kind`.
    pub fn lookup(&self, handle: *mut c_void, kind: Kind) -> Checked<Object> {
        let key = handle as usize;
        let objects = self.objects.lock().unwrap_or_else(|p| p.into_inner());
        match objects.get(&key) {
            None => Err(Fail::violation(
                codes::INVALID_HANDLE,
                format!("{key:#x} is not a {kind:?} handle the driver returned"),
            )),
            Some(Object::Destroyed(k)) if *k == kind => Err(Fail::violation(
                codes::INVALID_HANDLE,
                format!("{kind:?} {key:#x} was already destroyed"),
            )),
            Some(other) if other.kind() != kind => Err(Fail::violation(
                codes::INVALID_HANDLE,
                format!(
                    "{key:#x} is a {:?} handle, passed where a {kind:?} is expected",
                    other.kind()
                ),
            )),
            Some(object) => Ok(object.clone()),
        }
    }

    /// Marks `handle` destroyed (later uses are reported as use after destroy).
    pub fn destroy(&self, handle: usize, kind: Kind) {
        self.objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle, Object::Destroyed(kind));
    }

    /// The context current on this thread, which must be active.
    pub fn current(&self) -> Checked<Arc<Context>> {
        let handle = CURRENT.with(Cell::get);
        if handle == 0 {
            return Err(Fail::violation(
                codes::INVALID_CONTEXT,
                "no context is current on this thread (cuCtxSetCurrent first)",
            ));
        }
        let Object::Context(ctx) = self.lookup(as_ptr(handle), Kind::Context)? else {
            return Err(Fail::violation(codes::INVALID_CONTEXT, "current context"));
        };
        Self::require_active(&ctx)?;
        Ok(ctx)
    }

    /// The violation of using a released context.
    pub fn require_active(ctx: &Context) -> Checked<()> {
        if ctx.active() {
            Ok(())
        } else {
            Err(Fail::violation(
                codes::INVALID_CONTEXT,
                format!(
                    "the primary context of device {} was released (retain count 0): its \
                     memory, streams and events are gone",
                    ctx.device
                ),
            ))
        }
    }

    /// The context of `handle`.
    pub fn context(&self, handle: *mut c_void) -> Checked<Arc<Context>> {
        match self.lookup(handle, Kind::Context)? {
            Object::Context(c) => Ok(c),
            _ => Err(Fail::violation(codes::INVALID_CONTEXT, "not a context")),
        }
    }

    /// This thread's current context handle (0: none).
    pub fn current_handle(&self) -> usize {
        CURRENT.with(Cell::get)
    }

    /// Sets this thread's current context (0 unbinds).
    pub fn set_current(&self, handle: usize) {
        CURRENT.with(|c| c.set(handle));
    }

    /// The stream `handle` (null: the current context's legacy default stream); its context
    /// must be active.
    pub fn stream(&self, handle: *mut c_void) -> Checked<Arc<Stream>> {
        if handle as usize == CU_STREAM_PER_THREAD {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                "CU_STREAM_PER_THREAD: the double does not emulate per-thread default streams",
            ));
        }
        let stream = if handle.is_null() || handle as usize == CU_STREAM_LEGACY {
            let ctx = self.current()?;
            ctx.legacy
                .get_or_init(|| Stream::start(0, ctx.handle, ctx.device, true))
                .clone()
        } else {
            match self.lookup(handle, Kind::Stream)? {
                Object::Stream(s) => s,
                _ => return Err(Fail::violation(codes::INVALID_HANDLE, "not a stream")),
            }
        };
        let ctx = self.context(as_ptr(stream.ctx))?;
        Self::require_active(&ctx)?;
        Ok(stream)
    }

    /// The event `handle`; its context must be active.
    pub fn event(&self, handle: *mut c_void) -> Checked<Arc<Event>> {
        match self.lookup(handle, Kind::Event)? {
            Object::Event(e) => {
                self.require_epoch(e.ctx, e.epoch, "event")?;
                Ok(e)
            }
            _ => Err(Fail::violation(codes::INVALID_HANDLE, "not an event")),
        }
    }

    /// The violation of using an object of context `ctx` made before the context was torn down.
    fn require_epoch(&self, ctx: usize, epoch: u64, what: &str) -> Checked<()> {
        let ctx = self.context(as_ptr(ctx))?;
        Self::require_active(&ctx)?;
        if ctx.epoch.load(Ordering::Acquire) != epoch {
            return Err(Fail::violation(
                codes::INVALID_HANDLE,
                format!(
                    "this {what} belongs to the primary context of device {} as it was before \
                     its last release tore it down",
                    ctx.device
                ),
            ));
        }
        Ok(())
    }

    /// The module `handle`.
    pub fn module(&self, handle: *mut c_void) -> Checked<Arc<Module>> {
        match self.lookup(handle, Kind::Module)? {
            Object::Module(m) => Ok(m),
            _ => Err(Fail::violation(codes::INVALID_HANDLE, "not a module")),
        }
    }

    /// The function `handle`.
    pub fn function(&self, handle: *mut c_void) -> Checked<Arc<Function>> {
        match self.lookup(handle, Kind::Function)? {
            Object::Function(f) => {
                self.require_epoch(f.ctx, f.epoch, "function")?;
                self.lookup(as_ptr(f.module), Kind::Module).map_err(|_| {
                    Fail::violation(
                        codes::INVALID_HANDLE,
                        format!(
                            "kernel {} belongs to a module that was unloaded",
                            f.sig.name
                        ),
                    )
                })?;
                Ok(f)
            }
            _ => Err(Fail::violation(codes::INVALID_HANDLE, "not a function")),
        }
    }

    /// Queues device work that a capture records: on a capturing stream, a node of the capture
    /// (`capture.rs`); otherwise the work `make` builds now, queued as [`Self::enqueue`] does.
    pub fn enqueue_node(
        &self,
        stream: &Arc<Stream>,
        entry: crate::report::Entry,
        ranges: Vec<(u64, u64)>,
        make: Maker,
    ) -> Checked<()> {
        let node = || Node {
            entry,
            ranges: ranges.clone(),
            make: make.clone(),
        };
        if let Some(outcome) = self.captures.record(stream, node) {
            return outcome;
        }
        let work = make()?;
        self.enqueue_now(stream, entry, ranges, || work)
    }

    /// The graph `handle` (captured, or instantiated when `exec`).
    pub fn graph(&self, handle: *mut c_void, exec: bool) -> Checked<Arc<Graph>> {
        let kind = if exec { Kind::GraphExec } else { Kind::Graph };
        match self.lookup(handle, kind)? {
            Object::Graph(g) | Object::GraphExec(g) => Ok(g),
            _ => Err(Fail::violation(codes::INVALID_HANDLE, "not a graph")),
        }
    }

    /// Queues the work `make` builds on `stream`, behind the legacy stream's implicit
    /// synchronization (see `stream.rs`). Work a capture cannot record: on a capturing stream it
    /// is a violation (`capture.rs`).
    pub fn enqueue(
        &self,
        stream: &Arc<Stream>,
        entry: crate::report::Entry,
        ranges: Vec<(u64, u64)>,
        make: impl FnOnce() -> Box<dyn FnOnce() -> Checked<()> + Send>,
    ) -> Checked<()> {
        self.captures.check_uncapturable(stream, entry.name())?;
        self.enqueue_now(stream, entry, ranges, make)
    }

    fn enqueue_now(
        &self,
        stream: &Arc<Stream>,
        entry: crate::report::Entry,
        ranges: Vec<(u64, u64)>,
        make: impl FnOnce() -> Box<dyn FnOnce() -> Checked<()> + Send>,
    ) -> Checked<()> {
        let ctx = self.context(as_ptr(stream.ctx))?;
        let barriers: Vec<(Arc<Stream>, u64)> = if stream.handle == 0 {
            ctx.streams
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|s| s.blocking)
                .map(|s| (s.clone(), s.submitted()))
                .collect()
        } else if stream.blocking {
            ctx.legacy
                .get()
                .map(|l| (l.clone(), l.submitted()))
                .into_iter()
                .collect()
        } else {
            Vec::new()
        };
        stream.submit_with(entry, ranges, || {
            let run = make();
            if barriers.is_empty() {
                return run;
            }
            Box::new(move || {
                for (other, target) in barriers {
                    other.wait_completed(target);
                }
                run()
            })
        })
    }

    /// The violation of work submitted to a stream of a context that is not current.
    pub fn require_current(&self, stream: &Stream, call: &str) -> Checked<()> {
        let ctx = self.current()?;
        if ctx.handle != stream.ctx {
            return Err(Fail::violation(
                codes::INVALID_CONTEXT,
                format!(
                    "{call} on a stream of device {} while the context of device {} is current",
                    stream.device, ctx.device
                ),
            ));
        }
        Ok(())
    }
}
