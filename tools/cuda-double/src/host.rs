//! Page-locked host memory: what `cuMemHostAlloc` made and `cuMemHostRegister` locked, so that
//! the async copies can tell pinned memory (read when the stream reaches the copy, as a GPU's DMA
//! does) from pageable memory (staged when the call is made), and frees can be checked.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::codes;
use crate::report::{Checked, Fail};

/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
pub const HOST_MEMORY_ALREADY_REGISTERED: codes::CuResult = 712;
/// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
pub const HOST_MEMORY_NOT_REGISTERED: codes::CuResult = 713;

/// One page-locked range.
#[derive(Debug)]
pub struct Locked {
    /// Bytes.
    pub len: usize,
    /// `cuMemHostRegister` (else `cuMemHostAlloc`).
    pub registered: bool,
    /// Cleared when the range is freed or unregistered: a queued copy that still names it is a
    /// violation when it runs.
    pub live: std::sync::atomic::AtomicBool,
}

/// The table of page-locked ranges (base → range).
#[derive(Debug, Default)]
pub struct PinnedHost {
    ranges: Mutex<BTreeMap<usize, Arc<Locked>>>,
}

const PAGE: usize = 4096;

impl PinnedHost {
    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Arc<Locked>>> {
        self.ranges.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The range holding `[ptr, ptr + len)` whole, if it is page-locked.
    pub fn containing(&self, ptr: usize, len: usize) -> Option<Arc<Locked>> {
        let table = self.table();
        let (&base, locked) = table.range(..=ptr).next_back()?;
        let end = ptr.checked_add(len)?;
        (end <= base + locked.len).then(|| Arc::clone(locked))
    }

    /// `cuMemHostAlloc`: page-aligned, zeroed memory.
    pub fn alloc(&self, len: usize) -> Checked<usize> {
        let layout = Layout::from_size_align(len, PAGE)
            .map_err(|_| Fail::violation(codes::INVALID_VALUE, format!("{len} bytes")))?;
        // SAFETY: `len` is non-zero (checked by the caller) and the layout valid.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Fail::outcome(codes::OUT_OF_MEMORY, "host memory exhausted"));
        }
        self.insert(ptr as usize, len, false);
        Ok(ptr as usize)
    }

    fn insert(&self, base: usize, len: usize, registered: bool) {
        self.table().insert(
            base,
            Arc::new(Locked {
                len,
                registered,
                live: std::sync::atomic::AtomicBool::new(true),
            }),
        );
    }

    /// `cuMemFreeHost`.
    pub fn free(&self, ptr: usize) -> Checked<()> {
        let locked = self.take(ptr, false, "cuMemFreeHost")?;
        let layout = Layout::from_size_align(locked.len, PAGE)
            .map_err(|_| Fail::violation(codes::INVALID_VALUE, "layout"))?;
        // SAFETY: allocated by `alloc` with this layout, taken out of the table once.
        unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        Ok(())
    }

    /// `cuMemHostRegister`: refused when it overlaps a locked range.
    pub fn register(&self, ptr: usize, len: usize) -> Checked<()> {
        let end = ptr
            .checked_add(len)
            .ok_or_else(|| Fail::violation(codes::INVALID_VALUE, "range overflows"))?;
        let mut table = self.table();
        if let Some((&base, other)) = table.range(..end).next_back() {
            if base + other.len > ptr {
                return Err(Fail::violation(
                    HOST_MEMORY_ALREADY_REGISTERED,
                    format!("[{ptr:#x}, {end:#x}) overlaps page-locked memory at {base:#x}"),
                ));
            }
        }
        table.insert(
            ptr,
            Arc::new(Locked {
                len,
                registered: true,
                live: std::sync::atomic::AtomicBool::new(true),
            }),
        );
        Ok(())
    }

    /// `cuMemHostUnregister`.
    pub fn unregister(&self, ptr: usize) -> Checked<()> {
        self.take(ptr, true, "cuMemHostUnregister").map(drop)
    }

    fn take(&self, ptr: usize, registered: bool, call: &str) -> Checked<Arc<Locked>> {
        let mut table = self.table();
        match table.get(&ptr) {
            Some(l) if l.registered == registered => {}
            Some(_) => {
                return Err(Fail::violation(
                    codes::INVALID_VALUE,
                    format!("{call} of {ptr:#x}, which was locked the other way"),
                ))
            }
            None => {
                let code = if registered {
                    HOST_MEMORY_NOT_REGISTERED
                } else {
                    codes::INVALID_VALUE
                };
                return Err(Fail::violation(
                    code,
                    format!("{call} of {ptr:#x}, which is not the base of page-locked memory"),
                ));
            }
        }
        let locked = table
            .remove(&ptr)
            .ok_or_else(|| Fail::violation(codes::UNKNOWN, "range vanished"))?;
        locked
            .live
            .store(false, std::sync::atomic::Ordering::Release);
        Ok(locked)
    }
}
