//! Typed views of a [`Storage`] for cudarc launches (feature `cudarc`).
//!
//! A tensor library built on cudarc passes a view where it would pass a `CudaSlice`: as a kernel
//! argument (`launch_builder(..).arg(&view)`), or to any cudarc API taking
//! [`DevicePtr`]/[`DevicePtrMut`]. Views are made for a cudarc stream:
//!
//! | step | what happens |
//! |------|--------------|
//! | `storage.view::<T>(range, &stream)` | bounds and alignment checked; the stream is adopted by cudalloc (`import_stream`, once per stream) and *recorded* for the storage — its free waits for work queued on that stream, as `record_stream` does — with no event per view |
//! | `storage.view_mut::<T>(..)` | the same, after the copy-on-write step (`mutable_data_ptr_on` the view's stream: a private copy is queued there, before the kernel), which can fail (out of memory) and then leaves the storage unchanged |
//! | `device_ptr(&other_stream)` | `other_stream` waits for the view's stream (an event, as cudarc's own slices order their streams) and is recorded too; if that fails (the trait cannot return it) the host waits for the view's stream instead and the view's `ordered()` returns the error |
//!
//! With the stream sanitizer on, a view is an access on its stream (read for `view`, write for
//! `view_mut`) taken when the view is made: make views right before the launch, after any waits.
//!
//! Ordering of the view's stream after the storage's allocation stream is the library's business,
//! as with PyTorch's `record_stream` (a tensor used on a side stream waits for its producer).
//!
//! Stream lifetime: a recorded stream must outlive the storage's free. The stream a view was made
//! for is kept alive for the life of the process (an `Arc` in a process-wide table, one per
//! stream); a different stream passed to `device_ptr` must be kept alive by the library.
//!
//! Views need the CUDA backend: on the host backend there is no `CUdeviceptr` to launch with, and
//! `view` returns an [`ErrorKind::InvalidArgument`](crate::ErrorKind) error saying so.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::Range;

use cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use super::Storage;
use crate::driver::{Backend, StreamId};
use crate::error::{Error, Result};
use crate::process::PerProcess;
use crate::sync::os::{Arc, Mutex};

/// Streams views were made for, by (runtime id, raw handle), with their cudalloc ids: kept alive
/// (see the module docs).
type Adopted = HashMap<(u64, u64), (Arc<CudaStream>, StreamId)>;
static ADOPTED: PerProcess<Mutex<Option<Adopted>>> = PerProcess::new(|| Mutex::new(None));

/// The cudalloc id of `stream` for `storage`'s runtime, adopting it on first use.
fn adopt(storage: &Storage, stream: &Arc<CudaStream>) -> Result<StreamId> {
    storage
        .runtime()
        .adopt_cudarc_stream(storage.device(), stream)
}

impl crate::runtime::Runtime {
    /// The cudalloc id of a cudarc stream of `device`, adopted on first use — safely: cudalloc
    /// keeps the stream alive (an `Arc` in a process-wide table) as long as the process may use
    /// the id, so the library can pass the id to any door (`Storage::new_on`, `data_ptr_on`,
    /// `launch`) and drop its own handle when it likes. The same stream gives the same id.
    pub fn adopt_cudarc_stream(&self, device: usize, stream: &Arc<CudaStream>) -> Result<StreamId> {
        let raw = stream.cu_stream() as usize as u64;
        let mut guard = ADOPTED.lock();
        let table = guard.get_or_insert_with(HashMap::new);
        if let Some((_, id)) = table.get(&(self.id(), raw)) {
            return Ok(*id);
        }
        // SAFETY: `raw` is the live stream of `stream`, which the table keeps alive for the life
        // of the process, so it outlives every use cudalloc makes of the id.
        let id = unsafe { self.import_stream(device, raw) }?;
        table.insert((self.id(), raw), (Arc::clone(stream), id));
        Ok(id)
    }
}

impl super::kernel::CudaBody {
    /// The body of a cudarc function (its module stays loaded while the body lives).
    pub fn new(function: cudarc::driver::CudaFunction) -> Self {
        let raw = function.cu_function() as usize as u64;
        Self::with_function(raw, Some(Box::new(function)))
    }
}

/// cudarc's driver errors keep their code: the error's text names it (`CUDA_ERROR_…`), and the
/// error itself is the [`source`](std::error::Error::source) (downcast it to read the code).
impl From<cudarc::driver::DriverError> for Error {
    fn from(err: cudarc::driver::DriverError) -> Self {
        Error::Driver {
            message: format!("{err} (code {})", err.0 as i64),
            source: Some(crate::error::Cause::new(err)),
            backend: "cuda",
            call: "cudarc",
        }
    }
}

/// A `device_ptr(&other)` call on a view of `storage` made for stream `own`, with `bytes` at
/// `ptr`: as cudarc's own slices do, `other` is ordered after the view's stream (an event), and
/// recorded for the storage (its free waits for `other` too). The trait cannot return a failure:
/// it is kept in the view (`failed`, returned by the view's `ordered()`), and `other` is ordered
/// after the view's stream the one way left — the host waits for the view's stream — so the
/// launch on `other` still follows the view's work.
fn order_other_stream(
    storage: &Storage,
    own: StreamId,
    other: &CudaStream,
    touch: crate::driver::sanitizer::Touch,
    failed: &Mutex<Option<Error>>,
) {
    let raw = other.cu_stream() as usize as u64;
    let runtime = storage.runtime();
    let known = ADOPTED
        .lock()
        .as_ref()
        .and_then(|t| t.get(&(runtime.id(), raw)).map(|(_, id)| *id));
    // SAFETY: the caller of `device_ptr` keeps the stream alive while memory it used may be
    // freed (module docs); `raw` is its live handle now.
    let id = known.map_or_else(
        || unsafe { runtime.import_stream(storage.device(), raw) },
        Ok,
    );
    let ordered = id.and_then(|id| {
        // The allocator's one door for a wait between streams (captures, destroyed streams).
        storage.allocator().order_after(id, own)?;
        storage.record_stream(id)?;
        note_access(storage, id, touch)
    });
    let Err(err) = ordered else { return };
    tracing::warn!(%err, "ordering a view's other stream failed: the host waits for the view's stream");
    let driver = storage.runtime().driver();
    // A host wait would invalidate a capture of the view's stream: then the error alone.
    let capturing = driver
        .graphs()
        .stream_capture_status(own)
        .is_ok_and(|s| s.is_capturing());
    if capturing {
        tracing::error!(
            "the view's stream is being captured: no host wait stands in for the ordering"
        );
    } else if let Err(sync) = driver.stream_synchronize(own) {
        tracing::error!(%sync, "waiting for a view's stream on the host failed too");
    }
    let mut slot = failed.lock();
    if slot.is_none() {
        *slot = Some(Error::invalid(format!(
            "a view could not order another stream (CUstream {raw:#x}) after its own: {err}; \
             the host waited for the view's stream instead, and the storage's free may not \
             wait for that stream: synchronize it before the storage is dropped"
        )));
    }
}

/// Tells the stream sanitizer (when on) that a launch on `stream` will touch the view's bytes.
fn note_access(
    storage: &Storage,
    stream: StreamId,
    touch: crate::driver::sanitizer::Touch,
) -> Result<()> {
    match storage.runtime().driver().sanitizer() {
        Some(sanitizer) => sanitizer.enqueue(stream, "a cudarc view", &[touch], || Ok(())),
        None => Ok(()),
    }
}

/// Checks `range` (in elements of `T`) against the storage and returns (byte address, length).
fn locate<T>(storage: &Storage, base: u64, range: &Range<usize>) -> Result<(u64, usize)> {
    if storage.runtime().driver().backend() != Backend::Cuda {
        return Err(Error::invalid(
            "views are for cudarc launches and need the CUDA backend (this storage is on the host backend)",
        ));
    }
    let size = std::mem::size_of::<T>() as u64;
    let (start, end) = (range.start as u64, range.end as u64);
    let in_bounds = start <= end && end.checked_mul(size).is_some_and(|b| b <= storage.nbytes());
    if !in_bounds {
        return Err(Error::invalid(format!(
            "view {range:?} of {} elements of {size} bytes is outside the storage's {} bytes",
            end.saturating_sub(start),
            storage.nbytes()
        )));
    }
    let addr = base + start * size;
    if !addr.is_multiple_of(std::mem::align_of::<T>() as u64) {
        return Err(Error::invalid(format!(
            "view at {addr:#x} is not aligned for {}",
            std::any::type_name::<T>()
        )));
    }
    Ok((addr, (end - start) as usize))
}

/// A read view of `len` elements of `T` in a storage, for launches on its stream.
#[derive(Debug)]
pub struct StorageView<'a, T> {
    storage: &'a Storage,
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    id: StreamId,
    /// The first failure to order another stream (see `order_other_stream`), until taken.
    failed: Mutex<Option<Error>>,
    _elements: PhantomData<*const T>,
}

/// A write view: as [`StorageView`], made after the copy-on-write step.
#[derive(Debug)]
pub struct StorageViewMut<'a, T> {
    storage: &'a Storage,
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    id: StreamId,
    /// The first failure to order another stream (see `order_other_stream`), until taken.
    failed: Mutex<Option<Error>>,
    _elements: PhantomData<*mut T>,
}

#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
impl Storage {
    /// A read view of elements `range` of `T`, for launches on `stream` (see the
    /// [module docs](self)); `stream` is recorded for this storage.
    pub fn view<T>(
        &self,
        range: Range<usize>,
        stream: &Arc<CudaStream>,
    ) -> Result<StorageView<'_, T>> {
        self.check_awake("a read view")?;
        let (ptr, len) = locate::<T>(self, self.unordered_data_ptr().0, &range)?;
        let id = adopt(self, stream)?;
        self.record_stream(id)?;
        // Ordered after the last write on another stream (`stream_order:auto`).
        self.data_ptr_on(id)?;
        note_access(self, id, touch_of::<T>(ptr, len, false))?;
        Ok(StorageView {
            storage: self,
            ptr,
            len,
            stream: Arc::clone(stream),
            id,
            failed: Mutex::new(None),
            _elements: PhantomData,
        })
    }

    /// A write view: materializes a copy-on-write storage first, on `stream` (which can fail,
    /// leaving it unchanged), then as [`Storage::view`].
    pub fn view_mut<T>(
        &self,
        range: Range<usize>,
        stream: &Arc<CudaStream>,
    ) -> Result<StorageViewMut<'_, T>> {
        self.check_awake("a write view")?;
        locate::<T>(self, self.unordered_data_ptr().0, &range)?;
        let id = adopt(self, stream)?;
        // The private copy is queued on the view's own stream, so the kernel is ordered after
        // it (found on the contract double when it was queued on the current stream: the copy
        // landed after the kernel and overwrote its result).
        let base = self.mutable_data_ptr_on(id)?;
        let (ptr, len) = locate::<T>(self, base.0, &range)?;
        self.record_stream(id)?;
        note_access(self, id, touch_of::<T>(ptr, len, true))?;
        Ok(StorageViewMut {
            storage: self,
            ptr,
            len,
            stream: Arc::clone(stream),
            id,
            failed: Mutex::new(None),
            _elements: PhantomData,
        })
    }
}

/// The sanitizer's access of a view of `len` elements of `T` at `ptr`.
fn touch_of<T>(ptr: u64, len: usize, write: bool) -> crate::driver::sanitizer::Touch {
    let bytes = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
    if write {
        crate::driver::sanitizer::Touch::write(ptr, bytes)
    } else {
        crate::driver::sanitizer::Touch::read(ptr, bytes)
    }
}

macro_rules! view_traits {
    ($view:ident, $write:expr) => {
        impl<T> DeviceSlice<T> for $view<'_, T> {
            fn len(&self) -> usize {
                self.len
            }
            fn stream(&self) -> &Arc<CudaStream> {
                &self.stream
            }
        }

        impl<T> DevicePtr<T> for $view<'_, T> {
            fn device_ptr<'s>(
                &'s self,
                stream: &'s CudaStream,
            ) -> (sys::CUdeviceptr, SyncOnDrop<'s>) {
                if stream.cu_stream() != self.stream.cu_stream() {
                    let touch = touch_of::<T>(self.ptr, self.len, $write);
                    order_other_stream(self.storage, self.id, stream, touch, &self.failed);
                }
                (self.ptr, SyncOnDrop::Sync(None))
            }
        }

        impl<T> Drop for $view<'_, T> {
            fn drop(&mut self) {
                if let Some(err) = self.failed.get_mut().take() {
                    tracing::error!(%err, "a view's ordering failure was never asked for (`ordered()`)");
                }
            }
        }

        // SAFETY: the pushed pointer is to `self.ptr`, a `CUdeviceptr` that lives as long as the
        // borrow of the view, which outlives the launch arguments ('b: 'a).
        unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b $view<'c, T>> for LaunchArgs<'a> {
            #[inline(always)]
            fn arg(&mut self, arg: &'b $view<'c, T>) -> &mut Self {
                <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
            }
        }
    };
}

/// The view's ordering failure, taken (see [`StorageView::ordered`]).
fn take_failure(failed: &Mutex<Option<Error>>) -> Result<()> {
    match failed.lock().take() {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

impl<T> StorageView<'_, T> {
    /// `Err` with the first failure to order another stream this view was launched on
    /// (`device_ptr(&other)`, which cannot return it), taken: the host waited for the view's
    /// stream instead, so the launch still followed the view's work, but the storage's free may
    /// not wait for that stream. `Ok` when every ordering held.
    pub fn ordered(&self) -> Result<()> {
        take_failure(&self.failed)
    }
}

impl<T> StorageViewMut<'_, T> {
    /// As [`StorageView::ordered`].
    pub fn ordered(&self) -> Result<()> {
        take_failure(&self.failed)
    }
}

view_traits!(StorageView, false);
view_traits!(StorageViewMut, true);

impl<T> DevicePtrMut<T> for StorageViewMut<'_, T> {
    fn device_ptr_mut<'s>(
        &'s mut self,
        stream: &'s CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'s>) {
        if stream.cu_stream() != self.stream.cu_stream() {
            let touch = touch_of::<T>(self.ptr, self.len, true);
            order_other_stream(self.storage, self.id, stream, touch, &self.failed);
        }
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

// SAFETY: as for the shared form: a pointer to the view's `CUdeviceptr`, borrowed for the launch.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut StorageViewMut<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut StorageViewMut<'c, T>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}
