//! Page-locked ("pinned") host memory in the device layer: what the pinned host allocator
//! (`crate::pinned`) needs from a driver.
//!
//! | call | CUDA | host backend | returns |
//! |---|---|---|---|
//! | [`Driver::host_alloc`](super::Driver::host_alloc) | `cuMemHostAlloc(PORTABLE)` | an anonymous mapping, locked with `mlock` | at once |
//! | [`Driver::host_register`](super::Driver::host_register) | `cuMemHostRegister(PORTABLE)` | `mlock` of the pages under the range (counted per page) | at once |
//! | [`Driver::host_free`](super::Driver::host_free), [`Driver::host_unregister`](super::Driver::host_unregister) | `cuMemFreeHost`, `cuMemHostUnregister` | out of the table, every stream drained, unlocked (and unmapped) | after queued work |
//! | [`Driver::copy_pinned_to_device`](super::Driver::copy_pinned_to_device), [`Driver::copy_device_to_pinned`](super::Driver::copy_device_to_pinned) | `cuMemcpyHtoDAsync`, `cuMemcpyDtoHAsync` | a copy enqueued on the stream's worker | at once (stream-ordered) |
//! | `copy_host_to_device`, `copy_device_to_host` (pageable memory) | the same copies, then a stream synchronize | a staging copy, enqueued and waited for | when done |
//!
//! So, as on CUDA, a copy from page-locked memory is asynchronous and a copy from pageable memory
//! is synchronous. The async copies accept only memory the driver page-locked (allocated or
//! registered, the whole range inside one allocation or registration): anything else is an
//! [`Error::InvalidArgument`] — stricter than CUDA, which silently makes such a copy synchronous.
//!
//! The driver never forms a Rust reference to pinned memory: it reads and writes it through raw
//! pointers on its streams. Whoever hands out references to it (the allocator's `PinnedBuffer`)
//! orders them after the copies that touch the bytes — which is why the copies, the free and
//! the unregistration are `unsafe`: safe code holding a slice of a buffer must not be able to
//! start a copy into it, or unmap it.

use std::fmt;

use super::Backend;
use crate::error::Error;

/// The address, in this process, of page-locked host memory a driver allocated or registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostAddr(pub u64);

impl HostAddr {
    /// The address `bytes` past this one, or an error if that overflows.
    pub fn offset(self, bytes: u64) -> crate::error::Result<HostAddr> {
        self.0.checked_add(bytes).map(HostAddr).ok_or_else(|| {
            Error::invalid(format!("host pointer {:#x} + {bytes} overflows", self.0))
        })
    }

    /// The address as a pointer.
    pub fn as_ptr(self) -> *mut u8 {
        self.0 as usize as *mut u8
    }
}

impl fmt::Display for HostAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// The error of a backend without page-locked host memory (the simulated device).
pub(crate) fn unsupported(backend: Backend) -> Error {
    Error::invalid(format!(
        "the {} backend has no page-locked host memory",
        backend.name()
    ))
}

/// The page-locked memory methods of [`Driver`](super::Driver), forwarded to a backend's inherent
/// methods of the same meaning (`pinned_alloc`, `pinned_free`, `pinned_register`,
/// `pinned_unregister`, and `pinned_copy(stream, device, host, len, to_device)`) — both
/// backends implement them that way — each after the backend's `door()` when one is named.
macro_rules! forward_host_memory_methods {
    ($($door:ident)?) => {
        fn host_alloc(&self, size: u64) -> $crate::error::Result<$crate::driver::HostAddr> {
            $( self.$door()?; )?
            self.pinned_alloc(size)
        }

        unsafe fn host_free(&self, ptr: $crate::driver::HostAddr) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.pinned_free(ptr)
        }

        unsafe fn host_register(
            &self,
            ptr: $crate::driver::HostAddr,
            size: u64,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            // SAFETY: the caller's contract is the trait's.
            unsafe { self.pinned_register(ptr, size) }
        }

        unsafe fn host_unregister(
            &self,
            ptr: $crate::driver::HostAddr,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.pinned_unregister(ptr)
        }

        unsafe fn copy_pinned_to_device(
            &self,
            stream: $crate::driver::StreamId,
            dst: $crate::driver::DeviceAddr,
            src: $crate::driver::HostAddr,
            len: u64,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.pinned_copy(stream, dst, src, len, true)
        }

        unsafe fn copy_device_to_pinned(
            &self,
            stream: $crate::driver::StreamId,
            dst: $crate::driver::HostAddr,
            src: $crate::driver::DeviceAddr,
            len: u64,
        ) -> $crate::error::Result<()> {
            $( self.$door()?; )?
            self.pinned_copy(stream, src, dst, len, false)
        }
    };
}
pub(crate) use forward_host_memory_methods;
