//! Stream capture and graphs (`capture.rs` holds the state machine).

use std::ffi::{c_uint, c_void};
use std::sync::Arc;

use super::{api, put};
use crate::capture::{Captures, Graph, Maker, Status};
use crate::codes::{self, CuResult};
use crate::kernels::Work;
use crate::report::{Entry, Fail};
use crate::state::{as_ptr, double, Kind, Object};

/// `cuStreamBeginCapture_v2`.
#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(stream: *mut c_void, mode: c_uint) -> CuResult {
    api(Entry::cuStreamBeginCapture_v2, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.require_current(&s, "cuStreamBeginCapture")?;
        d.captures.begin(&s, mode)
    })
}

/// `cuStreamEndCapture`: the captured graph.
///
/// # Safety
/// `ph_graph` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(
    stream: *mut c_void,
    ph_graph: *mut *mut c_void,
) -> CuResult {
    api(Entry::cuStreamEndCapture, || {
        let d = double()?;
        let s = d.stream(stream)?;
        if ph_graph.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null phGraph"));
        }
        // A failed end hands back no graph (CUDA writes a null one).
        // SAFETY: checked non-null; the caller's out-pointer.
        unsafe { ph_graph.write(std::ptr::null_mut()) };
        let nodes = d.captures.end(&s)?;
        let handle = d.insert(|handle| {
            Object::Graph(Arc::new(Graph {
                handle,
                nodes: nodes.into(),
                last_launch: Default::default(),
            }))
        });
        // SAFETY: checked non-null; the caller's out-pointer.
        unsafe { put(ph_graph, as_ptr(handle), "phGraph") }
    })
}

fn status_value(status: Status) -> c_uint {
    status as c_uint
}

/// `cuStreamIsCapturing`.
///
/// # Safety
/// `status` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: *mut c_void, status: *mut c_uint) -> CuResult {
    api(Entry::cuStreamIsCapturing, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.captures.status_of_legacy(&s)?;
        let (now, _) = d.captures.status(&s);
        // SAFETY: the caller's out-pointer.
        unsafe { put(status, status_value(now), "captureStatus") }
    })
}

/// `cuStreamGetCaptureInfo_v2`: the status and the capture's id. The double hands out no
/// in-progress graph or dependency nodes: those out-pointers must be null.
///
/// # Safety
/// `status` must be valid for a write; a non-null `id` too.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2(
    stream: *mut c_void,
    status: *mut c_uint,
    id: *mut u64,
    graph: *mut *mut c_void,
    dependencies: *mut *const c_void,
    count: *mut usize,
) -> CuResult {
    api(Entry::cuStreamGetCaptureInfo_v2, || {
        let d = double()?;
        let s = d.stream(stream)?;
        if !graph.is_null() || !dependencies.is_null() || !count.is_null() {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                "the double does not hand out the graph being captured or its dependency nodes \
                 (pass null for graph_out, dependencies_out and numDependencies_out)",
            ));
        }
        d.captures.status_of_legacy(&s)?;
        let (now, capture) = d.captures.status(&s);
        // SAFETY: the caller's out-pointers (`id` only when non-null).
        unsafe {
            put(status, status_value(now), "captureStatus_out")?;
            if !id.is_null() && now != Status::None {
                id.write(capture);
            }
        }
        Ok(())
    })
}

/// `cuThreadExchangeStreamCaptureMode`: sets this thread's mode, returns the previous one.
///
/// # Safety
/// `mode` must be valid for a read and a write.
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) -> CuResult {
    api(Entry::cuThreadExchangeStreamCaptureMode, || {
        double()?;
        if mode.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null mode"));
        }
        // SAFETY: checked non-null; the caller's in/out pointer.
        let wanted = unsafe { mode.read() };
        let previous = Captures::exchange_mode(wanted)?;
        // SAFETY: as above.
        unsafe { mode.write(previous) };
        Ok(())
    })
}

/// `cuGraphInstantiateWithFlags` (flags must be 0: the double emulates no instantiation flag).
///
/// # Safety
/// `ph_exec` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    ph_exec: *mut *mut c_void,
    graph: *mut c_void,
    flags: u64,
) -> CuResult {
    api(Entry::cuGraphInstantiateWithFlags, || {
        let d = double()?;
        d.current()?;
        let g = d.graph(graph, false)?;
        // Seen on an H200: refused during a capture that prohibits unsafe calls.
        d.captures.check_unsafe("cuGraphInstantiateWithFlags")?;
        if flags != 0 {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                format!("graph instantiation flags {flags:#x} (the double emulates none)"),
            ));
        }
        if ph_exec.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null phGraphExec"));
        }
        let nodes = g.nodes.clone();
        let handle = d.insert(|handle| {
            Object::GraphExec(Arc::new(Graph {
                handle,
                nodes,
                last_launch: Default::default(),
            }))
        });
        // SAFETY: checked non-null; the caller's out-pointer.
        unsafe { put(ph_exec, as_ptr(handle), "phGraphExec") }
    })
}

/// `cuGraphLaunch`: the graph's nodes, in order, as one piece of work on `stream` (recorded into
/// the stream's capture when it captures).
#[no_mangle]
pub extern "C" fn cuGraphLaunch(exec: *mut c_void, stream: *mut c_void) -> CuResult {
    api(Entry::cuGraphLaunch, || {
        let d = double()?;
        let g = d.graph(exec, true)?;
        let s = d.stream(stream)?;
        d.require_current(&s, "cuGraphLaunch")?;
        // Seen on an H200: a launch on a capturing stream is refused (`STREAM_CAPTURE_UNSUPPORTED`).
        d.captures.refuse_on_capturing(&s, "cuGraphLaunch")?;
        let ranges = g.nodes.iter().flat_map(|n| n.ranges.clone()).collect();
        let nodes = g.nodes.clone();
        // One launch of an instantiated graph at a time, in launch order (held across the
        // enqueue, so two threads' launches are ordered as they were made).
        let mut last = g.last_launch.lock().unwrap_or_else(|p| p.into_inner());
        let prior = last.clone();
        let make: Maker = Arc::new(move || {
            let works = nodes
                .iter()
                .map(|n| (n.make)())
                .collect::<Result<Vec<Work>, _>>()?;
            let prior = prior.clone();
            Ok(Box::new(move || {
                if let Some((stream, launch)) = prior {
                    stream.wait_completed(launch);
                }
                works.into_iter().try_for_each(|w| w())
            }) as Work)
        });
        d.enqueue_node(&s, Entry::cuGraphLaunch, ranges, make)?;
        *last = Some((s.clone(), s.submitted()));
        Ok(())
    })
}

/// `cuGraphGetNodes` with a null `nodes`: the node count (the double hands out no node handles).
///
/// # Safety
/// `count` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGraphGetNodes(
    graph: *mut c_void,
    nodes: *mut *mut c_void,
    count: *mut usize,
) -> CuResult {
    api(Entry::cuGraphGetNodes, || {
        let g = double()?.graph(graph, false)?;
        if !nodes.is_null() {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                "the double hands out no node handles (pass null nodes to count them)",
            ));
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(count, g.nodes.len(), "numNodes") }
    })
}

/// `cuGraphDestroy` (its instantiations stay usable).
#[no_mangle]
pub extern "C" fn cuGraphDestroy(graph: *mut c_void) -> CuResult {
    api(Entry::cuGraphDestroy, || {
        let d = double()?;
        let g = d.graph(graph, false)?;
        d.destroy(g.handle, Kind::Graph);
        Ok(())
    })
}

/// `cuGraphExecDestroy` (launches already queued still run).
#[no_mangle]
pub extern "C" fn cuGraphExecDestroy(exec: *mut c_void) -> CuResult {
    api(Entry::cuGraphExecDestroy, || {
        let d = double()?;
        let g = d.graph(exec, true)?;
        d.destroy(g.handle, Kind::GraphExec);
        Ok(())
    })
}
