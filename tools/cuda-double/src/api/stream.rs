//! Streams and events (`stream.rs` and `event.rs` hold their state machines).

use std::ffi::{c_uint, c_void};

use super::{api, put};
use crate::codes::{self, CuResult};
use crate::event::CellStore;
use crate::region::{Header, Region};
use crate::report::{Entry, Fail};
use crate::state::{as_ptr, double, Kind, Object};
use crate::stream::Stream;

/// `CU_EVENT_BLOCKING_SYNC`.
const EVENT_BLOCKING_SYNC: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`.
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_EVENT_INTERPROCESS`.
pub(crate) const EVENT_INTERPROCESS: c_uint = 4;
/// Magic of an interprocess event's region.
pub(crate) const EVENT_MAGIC: [u8; 8] = *b"CUDBLEVT";

/// `cuStreamCreate` (flags: `CU_STREAM_DEFAULT` or `CU_STREAM_NON_BLOCKING`).
///
/// # Safety
/// `ph_stream` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(ph_stream: *mut *mut c_void, flags: c_uint) -> CuResult {
    api(Entry::cuStreamCreate, || {
        let d = double()?;
        let ctx = d.current()?;
        if flags > 1 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("stream flags {flags:#x}"),
            ));
        }
        if ph_stream.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null phStream"));
        }
        let mut made = None;
        let handle = d.insert(|h| {
            let s = Stream::start(h, ctx.handle, ctx.device, flags == 0);
            made = Some(s.clone());
            Object::Stream(s)
        });
        if let Some(s) = made {
            ctx.streams
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(s);
        }
        // SAFETY: checked non-null; caller's out-pointer.
        unsafe { ph_stream.write(as_ptr(handle)) };
        Ok(())
    })
}

/// `cuStreamDestroy_v2`: returns at once; queued work still runs (and a context synchronize or a
/// `cuMemFree` still waits for it).
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CuResult {
    api(Entry::cuStreamDestroy_v2, || {
        let d = double()?;
        if stream.is_null() {
            return Err(Fail::violation(
                codes::INVALID_HANDLE,
                "the legacy default stream cannot be destroyed",
            ));
        }
        let s = d.stream(stream)?;
        let captured = d.captures.forget_stream(&s);
        // The context keeps listing it until its queued work has run (`Context::streams`).
        s.close();
        d.destroy(s.handle, Kind::Stream);
        captured
    })
}

/// `cuStreamGetCtx` (the null stream: the current context's legacy stream).
///
/// # Safety
/// `pctx` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(stream: *mut c_void, pctx: *mut *mut c_void) -> CuResult {
    api(Entry::cuStreamGetCtx, || {
        let s = double()?.stream(stream)?;
        // SAFETY: caller's out-pointer.
        unsafe { put_handle(pctx, s.ctx, "pctx") }
    })
}

/// `cuStreamSynchronize`.
#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CuResult {
    api(Entry::cuStreamSynchronize, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.captures.check_blocking(&s, "cuStreamSynchronize")?;
        s.synchronize()
    })
}

/// `cuStreamQuery`: `CUDA_ERROR_NOT_READY` while work is pending.
#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: *mut c_void) -> CuResult {
    api(Entry::cuStreamQuery, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.captures.check_blocking(&s, "cuStreamQuery")?;
        if s.idle()? {
            Ok(())
        } else {
            Err(Fail::outcome(codes::NOT_READY, "work pending"))
        }
    })
}

/// `cuStreamWaitEvent`: the stream waits for the event's most recent record (flags must be 0).
#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    flags: c_uint,
) -> CuResult {
    api(Entry::cuStreamWaitEvent, || {
        let d = double()?;
        if flags != 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!(
                    "cuStreamWaitEvent flags must be CU_EVENT_WAIT_DEFAULT (0), got {flags:#x}"
                ),
            ));
        }
        let s = d.stream(stream)?;
        let e = d.event(event)?;
        if let Some(outcome) = d.captures.wait(&s, e.handle) {
            return outcome;
        }
        d.enqueue(&s, Entry::cuStreamWaitEvent, Vec::new(), || {
            let target = e.cell().target();
            Box::new(move || {
                e.cell().wait(target);
                Ok(())
            })
        })
    })
}

/// `cuEventCreate`. `CU_EVENT_INTERPROCESS` requires `CU_EVENT_DISABLE_TIMING`.
///
/// # Safety
/// `ph_event` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(ph_event: *mut *mut c_void, flags: c_uint) -> CuResult {
    api(Entry::cuEventCreate, || {
        let d = double()?;
        let ctx = d.current()?;
        let known = EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS;
        if flags & !known != 0
            || (flags & EVENT_INTERPROCESS != 0 && flags & EVENT_DISABLE_TIMING == 0)
        {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("event flags {flags:#x} (INTERPROCESS requires DISABLE_TIMING)"),
            ));
        }
        if ph_event.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null phEvent"));
        }
        let store = if flags & EVENT_INTERPROCESS != 0 {
            CellStore::Shared(Region::create(Header {
                magic: EVENT_MAGIC,
                pid: d.pid,
                device: ctx.device as u32,
                id: d.memory.fresh_id(),
                size: 0,
            })?)
        } else {
            CellStore::Local(Box::default())
        };
        let handle = d.insert_event(&ctx, flags, false, store);
        // SAFETY: checked non-null; caller's out-pointer.
        unsafe { ph_event.write(as_ptr(handle)) };
        Ok(())
    })
}

/// `cuEventDestroy_v2`.
#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CuResult {
    api(Entry::cuEventDestroy_v2, || {
        let d = double()?;
        let e = d.event(event)?;
        d.captures.forget_point(e.handle);
        d.destroy(e.handle, Kind::Event);
        Ok(())
    })
}

/// `cuEventRecord`: event and stream must belong to the same context.
#[no_mangle]
pub extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CuResult {
    api(Entry::cuEventRecord, || {
        let d = double()?;
        let e = d.event(event)?;
        let s = d.stream(stream)?;
        if e.ctx != s.ctx {
            return Err(Fail::violation(
                codes::INVALID_HANDLE,
                format!(
                    "event of device {} recorded on a stream of device {}",
                    e.device, s.device
                ),
            ));
        }
        if let Some(outcome) = d.captures.record_point(e.handle, &s) {
            return outcome;
        }
        d.enqueue(&s, Entry::cuEventRecord, Vec::new(), || {
            let n = e.cell().record();
            Box::new(move || {
                e.cell().complete(n);
                Ok(())
            })
        })
    })
}

/// `cuEventQuery`: `CUDA_ERROR_NOT_READY` until the most recent record is reached.
#[no_mangle]
pub extern "C" fn cuEventQuery(event: *mut c_void) -> CuResult {
    api(Entry::cuEventQuery, || {
        let d = double()?;
        let e = d.event(event)?;
        d.captures.check_event(e.handle, "cuEventQuery")?;
        let cell = e.cell();
        if cell.reached(cell.target()) {
            Ok(())
        } else {
            Err(Fail::outcome(codes::NOT_READY, "record pending"))
        }
    })
}

/// `cuEventSynchronize`.
#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: *mut c_void) -> CuResult {
    api(Entry::cuEventSynchronize, || {
        let d = double()?;
        let e = d.event(event)?;
        d.captures.check_event(e.handle, "cuEventSynchronize")?;
        let cell = e.cell();
        cell.wait(cell.target());
        Ok(())
    })
}

/// Writes a handle (kept for symmetry with the other modules' out-pointer writes).
///
/// # Safety
/// `out` must be valid for a write.
pub(crate) unsafe fn put_handle(
    out: *mut *mut c_void,
    handle: usize,
    what: &str,
) -> crate::report::Checked<()> {
    // SAFETY: forwarded caller contract.
    unsafe { put(out, as_ptr(handle), what) }
}
