//! IPC: memory and event handles.
//!
//! A handle is 64 bytes: magic (`CUDBLMEM` / `CUDBLEVT`), version 1, exporter pid, the
//! exporter's descriptor of the region, device, id, size, zeros. Handle bytes come from another
//! process and are untrusted: anything that does not decode, or names a region that is gone or
//! is not the one the handle describes, is *rejected* (`CUDA_ERROR_INVALID_VALUE`, logged as
//! rejected input, not as a violation). The rules the caller must keep are violations:
//!
//! | rule                                                              | code                |
//! |-------------------------------------------------------------------|---------------------|
//! | a memory handle is not opened in the process that exported it     | `INVALID_CONTEXT`   |
//! | a process opens a memory handle once per device until it closes it (newer drivers count repeated opens; older ones fail — portable code opens once) | `ALREADY_MAPPED` |
//! | `cuIpcOpenMemHandle` takes `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`   | `INVALID_VALUE`     |
//! | only memory allocated by this process is exported                 | `INVALID_VALUE`     |
//! | only `INTERPROCESS \| DISABLE_TIMING` events created here are exported | `INVALID_VALUE` |
//! | an event handle is not opened in the process that exported it     | `INVALID_CONTEXT`   |
//! | `cuIpcCloseMemHandle` only closes what `cuIpcOpenMemHandle` opened | `INVALID_VALUE`     |

use std::ffi::{c_char, c_uint, c_void};
use std::sync::Arc;

use super::memory::SEGMENT_MAGIC;
use super::stream::{put_handle, EVENT_DISABLE_TIMING, EVENT_INTERPROCESS, EVENT_MAGIC};
use super::{api, put};
use crate::codes::{self, CuResult};
use crate::event::CellStore;
use crate::memory::{Allocation, Backing, Origin};
use crate::region::{Header, Region};
use crate::report::{Checked, Entry, Fail};
use crate::state::double;

/// `CUipcMemHandle` / `CUipcEventHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IpcHandle {
    /// The bytes.
    pub reserved: [c_char; 64],
}

const VERSION: u32 = 1;

fn encode(magic: [u8; 8], region: &Region) -> IpcHandle {
    let h = region.header();
    let mut bytes = [0u8; 64];
    bytes[..8].copy_from_slice(&magic);
    bytes[8..12].copy_from_slice(&VERSION.to_le_bytes());
    bytes[12..16].copy_from_slice(&h.pid.to_le_bytes());
    bytes[16..20].copy_from_slice(&region.fd().to_le_bytes());
    bytes[20..24].copy_from_slice(&h.device.to_le_bytes());
    bytes[24..32].copy_from_slice(&h.id.to_le_bytes());
    bytes[32..40].copy_from_slice(&h.size.to_le_bytes());
    IpcHandle {
        reserved: bytes.map(|b| b as c_char),
    }
}

/// `(header the region must have, descriptor)` of a handle, or the refusal.
fn decode(magic: [u8; 8], handle: &IpcHandle) -> Checked<(Header, i32)> {
    let bytes = handle.reserved.map(|c| c as u8);
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let long = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(w)
    };
    if bytes[..8] != magic || word(8) != VERSION || bytes[40..].iter().any(|&b| b != 0) {
        return Err(Fail::rejected(
            codes::INVALID_VALUE,
            "the handle bytes were not made by cuIpcGet*Handle of this driver",
        ));
    }
    let header = Header {
        magic,
        pid: word(12),
        device: word(20),
        id: long(24),
        size: long(32),
    };
    Ok((header, word(16) as i32))
}

/// `cuIpcGetMemHandle`.
///
/// # Safety
/// `p_handle` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(p_handle: *mut IpcHandle, dptr: u64) -> CuResult {
    api(Entry::cuIpcGetMemHandle, || {
        let (a, _) = double()?.memory.resolve(dptr, 0)?;
        let region = match (&a.origin, &a.backing) {
            (Origin::Owned { .. }, Backing::Region(region)) => region,
            (Origin::Reserved, _) => {
                return Err(Fail::violation(
                    codes::INVALID_VALUE,
                    format!("{dptr:#x} is virtual memory (cuMemMap): share its chunks with cuMemExportToShareableHandle, not cuIpcGetMemHandle"),
                ))
            }
            _ => {
                return Err(Fail::violation(
                    codes::INVALID_VALUE,
                    format!("{dptr:#x} was opened from another process; only its owner exports it"),
                ))
            }
        };
        // SAFETY: caller's out-pointer.
        unsafe { put(p_handle, encode(SEGMENT_MAGIC, region), "pHandle") }
    })
}

/// `cuIpcOpenMemHandle_v2`: maps another process's allocation into the current context.
///
/// # Safety
/// `pdptr` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut u64,
    handle: IpcHandle,
    flags: c_uint,
) -> CuResult {
    api(Entry::cuIpcOpenMemHandle_v2, || {
        let d = double()?;
        d.captures.check_unsafe("cuIpcOpenMemHandle_v2")?;
        let ctx = d.current()?;
        if flags != 1 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("flags must be CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1), got {flags:#x}"),
            ));
        }
        if pdptr.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null pdptr"));
        }
        let (header, fd) = decode(SEGMENT_MAGIC, &handle)?;
        if header.pid == d.pid {
            return Err(Fail::violation(
                codes::INVALID_CONTEXT,
                "a memory handle was opened in the process that exported it",
            ));
        }
        let key = (header.pid, header.id, ctx.device);
        let mut opened = d.memory.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(base) = opened.get(&key) {
            return Err(Fail::violation(
                codes::ALREADY_MAPPED,
                format!(
                    "this handle is already open in this process at {base:#x}; open once and cache"
                ),
            ));
        }
        let region = Region::open(header.pid, fd, header)?;
        let base = d.memory.place(ctx.device, header.size)?;
        d.memory.insert(Arc::new(Allocation {
            base,
            size: header.size,
            device: ctx.device,
            ctx: ctx.handle,
            origin: Origin::Opened {
                pid: header.pid,
                id: header.id,
            },
            backing: Backing::Region(region),
            released: false.into(),
        }));
        opened.insert(key, base);
        // SAFETY: checked non-null; caller's out-pointer.
        unsafe { pdptr.write(base) };
        Ok(())
    })
}

/// `cuIpcCloseMemHandle`: queued work that reaches the memory afterwards faults its stream.
#[no_mangle]
pub extern "C" fn cuIpcCloseMemHandle(dptr: u64) -> CuResult {
    api(Entry::cuIpcCloseMemHandle, || {
        let d = double()?;
        d.captures.check_unsafe("cuIpcCloseMemHandle")?;
        let removed = d.memory.remove(dptr, |a| match a.origin {
            Origin::Opened { .. } => Ok(()),
            Origin::Owned { .. } | Origin::Reserved => Err(Fail::violation(
                codes::INVALID_VALUE,
                format!(
                    "cuIpcCloseMemHandle of {dptr:#x}, which this process allocated (cuMemFree it)"
                ),
            )),
        })?;
        if let Origin::Opened { pid, id } = removed.origin {
            d.memory
                .opened
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(pid, id, removed.device));
        }
        Ok(())
    })
}

/// `cuIpcGetEventHandle`.
///
/// # Safety
/// `p_handle` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetEventHandle(
    p_handle: *mut IpcHandle,
    event: *mut c_void,
) -> CuResult {
    api(Entry::cuIpcGetEventHandle, || {
        let e = double()?.event(event)?;
        let wanted = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING;
        match &e.store {
            CellStore::Shared(region) if !e.imported && e.flags & wanted == wanted => {
                // SAFETY: caller's out-pointer.
                unsafe { put(p_handle, encode(EVENT_MAGIC, region), "pHandle") }
            }
            _ => {
                Err(Fail::violation(
                    codes::INVALID_VALUE,
                    format!(
                    "event flags {:#x}{}: only INTERPROCESS | DISABLE_TIMING events created in \
                     this process can be exported",
                    e.flags,
                    if e.imported { " (opened from another process)" } else { "" }
                ),
                ))
            }
        }
    })
}

/// `cuIpcOpenEventHandle`.
///
/// # Safety
/// `ph_event` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenEventHandle(
    ph_event: *mut *mut c_void,
    handle: IpcHandle,
) -> CuResult {
    api(Entry::cuIpcOpenEventHandle, || {
        let d = double()?;
        let ctx = d.current()?;
        if ph_event.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null phEvent"));
        }
        let (header, fd) = decode(EVENT_MAGIC, &handle)?;
        if header.size != 0 {
            return Err(Fail::rejected(
                codes::INVALID_VALUE,
                "event handle with a size",
            ));
        }
        if header.pid == d.pid {
            return Err(Fail::violation(
                codes::INVALID_CONTEXT,
                "an event handle was opened in the process that exported it",
            ));
        }
        let region = Region::open(header.pid, fd, header)?;
        let handle = d.insert_event(
            &ctx,
            EVENT_INTERPROCESS | EVENT_DISABLE_TIMING,
            true,
            CellStore::Shared(region),
        );
        // SAFETY: caller's out-pointer.
        unsafe { put_handle(ph_event, handle, "phEvent") }
    })
}
