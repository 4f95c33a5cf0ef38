//! One kernel, two backends: a library declares a kernel once — its operands (storages read and
//! written, their element types and ranges: [`Storage::reads`](crate::Storage::reads), [`Storage::writes`](crate::Storage::writes)), a host body
//! and a CUDA body — and [`Runtime::launch`] is the one door that orders, checks, tells the
//! sanitizer and launches on whichever backend the runtime runs. The same test of a library op
//! runs on the host backend (the host body) and on CUDA (the CUDA body; on the contract double
//! without a GPU).
//!
//! ```text
//! let add = Kernel::new("add", |(a, b, o): (&[f32], &[f32], &mut [f32])| { …; Ok(()) });
//! // SAFETY: `add_f32(const float *a, const float *b, float *o, unsigned long long n)`.
//! let add = unsafe { add.with_cuda(CudaBody::new(function).params([Operand(0), Operand(1), Operand(2), Len(2)])) };
//! runtime.launch(stream, (a.reads::<f32>(), b.reads::<f32>(), o.writes::<f32>()), &add)?;
//! ```
//!
//! | step of [`Runtime::launch`] | host backend | CUDA |
//! |---|---|---|
//! | the door: every operand of the stream's driver and device, awake, in bounds, whole elements, aligned, no bytes seen through a write and another operand | `host_kernel.rs` | the same checks |
//! | each operand taken as an access on the stream under its storage's lock (a write materializes a lazy clone; with `stream_order:auto` the stream waits for conflicting earlier accesses) | `order::enqueue_ordered` | the same |
//! | the sanitizer told | of the host kernel's ranges | of each operand's bytes, read or written (a sanitized driver checks the launch's touches) |
//! | the body | the host body, seeing the storages as slices (`launch_host`) | the CUDA body: its function with its parameters — operands' addresses, sizes, scalars — in the declared order, the launch dimensions from the operands' element counts |
//! | a kernel without a body for the backend | — | an error naming the kernel |
//!
//! A CUDA body is a function of a module loaded in the device's context (with feature `cudarc`,
//! a cudarc `CudaFunction`, whose module it keeps alive: `CudaBody::new`, in `views.rs` with
//! the crate's other cudarc glue). Declaring it is `unsafe`
//! ([`Kernel::with_cuda`]): its parameters must be the kernel's, in order and types, and it must
//! touch nothing but its operands' ranges — what the door checks and the sanitizer sees.

use std::any::Any;
use std::ffi::c_void;

use super::host_kernel::{self, HostArgs};
use super::order;
use crate::driver::capability::LaunchDims;
use crate::driver::sanitizer::Touch;
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::runtime::Runtime;
use crate::sync::os::Arc;

// Parameters are passed as 8-byte slots whose first bytes hold the value: right on
// little-endian targets, the ones CUDA runs on.
const _: () = assert!(cfg!(target_endian = "little"));

/// A kernel declared once for both backends (see the module docs): a name, a host body, and
/// optionally a CUDA body.
pub struct Kernel<F> {
    name: &'static str,
    host: Arc<F>,
    cuda: Option<CudaBody>,
}

impl<F> std::fmt::Debug for Kernel<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel")
            .field("name", &self.name)
            .field("cuda", &self.cuda.is_some())
            .finish()
    }
}

impl<F> Kernel<F> {
    /// The kernel `name` with its host body: it receives the operands as slices, as a
    /// [`Runtime::launch_host`] kernel does.
    pub fn new(name: &'static str, host: F) -> Self {
        Kernel {
            name,
            host: Arc::new(host),
            cuda: None,
        }
    }

    /// The kernel with `body` as its CUDA body.
    ///
    /// # Safety
    /// `body`'s function must declare exactly `body`'s parameters, in order and types, and
    /// touch no memory but its operands' ranges (as [`Runtime::launch`] checks them).
    pub unsafe fn with_cuda(mut self, body: CudaBody) -> Self {
        self.cuda = Some(body);
        self
    }

    /// Its name (in errors).
    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// One parameter of a CUDA body, in the order the kernel declares them.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Param {
    /// Operand `i`'s device address (a pointer to its first element).
    Operand(usize),
    /// Operand `i`'s element count, as an unsigned 64-bit integer.
    Len(usize),
    /// Operand `i`'s byte count, as an unsigned 64-bit integer.
    Bytes(usize),
    /// An unsigned 64-bit scalar.
    U64(u64),
    /// A signed 64-bit scalar.
    I64(i64),
    /// An unsigned 32-bit scalar.
    U32(u32),
    /// A signed 32-bit scalar.
    I32(i32),
    /// A 32-bit float.
    F32(f32),
    /// A 64-bit float.
    F64(f64),
}

/// The dimensions of a launch from its operands' element counts.
type Dims = Box<dyn Fn(&[usize]) -> LaunchDims + Send + Sync>;

/// A kernel's CUDA body: a function of a module loaded in the device's context, its parameters
/// in order, and its launch dimensions (by default a grid-stride grid of 256-thread blocks over
/// the first operand's elements).
pub struct CudaBody {
    function: u64,
    /// What keeps the function's module loaded (a cudarc `CudaFunction`), if anything.
    _keep: Option<Box<dyn Any + Send + Sync>>,
    params: Vec<Param>,
    dims: Dims,
}

impl std::fmt::Debug for CudaBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBody")
            .field("function", &format_args!("{:#x}", self.function))
            .field("params", &self.params)
            .finish()
    }
}

impl CudaBody {
    /// The body of a raw `CUfunction`, with what keeps its module loaded.
    ///
    /// # Safety
    /// `function` must stay a live kernel of the device's context as long as `keep` lives.
    pub unsafe fn from_raw(function: u64, keep: impl Any + Send + Sync) -> Self {
        Self::with_function(function, Some(Box::new(keep)))
    }

    pub(super) fn with_function(function: u64, keep: Option<Box<dyn Any + Send + Sync>>) -> Self {
        CudaBody {
            function,
            _keep: keep,
            params: Vec::new(),
            dims: Box::new(|counts: &[usize]| {
                LaunchDims::grid_stride(counts.first().copied().unwrap_or(1) as u64, 256)
            }),
        }
    }

    /// Its parameters, in the order the kernel declares them.
    pub fn params(mut self, params: impl IntoIterator<Item = Param>) -> Self {
        self.params = params.into_iter().collect();
        self
    }

    /// Its launch dimensions, from the operands' element counts.
    pub fn dims(mut self, dims: impl Fn(&[usize]) -> LaunchDims + Send + Sync + 'static) -> Self {
        self.dims = Box::new(dims);
        self
    }
}

/// One operand at the launch: its address, bytes and elements.
struct Placed {
    addr: u64,
    bytes: u64,
    count: usize,
}

impl Param {
    /// This parameter's 8-byte slot.
    fn slot(self, placed: &[Placed]) -> Result<u64> {
        let operand = |i: usize| {
            placed.get(i).ok_or_else(|| {
                Error::invalid(format!(
                    "a parameter names operand {i}; the launch has {} operand(s)",
                    placed.len()
                ))
            })
        };
        Ok(match self {
            Param::Operand(i) => operand(i)?.addr,
            Param::Len(i) => operand(i)?.count as u64,
            Param::Bytes(i) => operand(i)?.bytes,
            Param::U64(v) => v,
            Param::I64(v) => v as u64,
            Param::U32(v) => u64::from(v),
            Param::I32(v) => u64::from(v as u32),
            Param::F32(v) => u64::from(v.to_bits()),
            Param::F64(v) => v.to_bits(),
        })
    }
}

impl Runtime {
    /// Launches `kernel` on `stream` over `args` (as [`Runtime::launch_host`]: a [`Reads`](host_kernel::Reads), a
    /// [`Writes`](host_kernel::Writes) or a tuple of them): its host body on the host backend,
    /// its CUDA body on CUDA, through one door (see the [module docs](self)).
    pub fn launch<A, F>(&self, stream: StreamId, args: A, kernel: &Kernel<F>) -> Result<()>
    where
        A: HostArgs,
        F: for<'k> Fn(<A as host_kernel::sealed::Args>::Slices<'k>) -> Result<()>
            + Send
            + Sync
            + 'static,
    {
        if self.driver().as_host().is_some() {
            let host = Arc::clone(&kernel.host);
            return self.launch_host(stream, args, move |slices| host(slices));
        }
        let body = kernel.cuda.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "kernel {} has no CUDA body, and this runtime's backend is {}",
                kernel.name,
                self.driver().backend().name()
            ))
        })?;
        let operands = args.operands();
        let spans = host_kernel::door(self, stream, &operands)?;
        let accesses: Vec<_> = operands.iter().map(|op| (op.storage, op.kind)).collect();
        order::enqueue_ordered(&accesses, stream, |placements| {
            let mut placed = Vec::with_capacity(operands.len());
            let mut touches = Vec::with_capacity(operands.len());
            for (i, (op, &(start, end, count))) in operands.iter().zip(&spans).enumerate() {
                let at = placements
                    .get(i)
                    .ok_or_else(|| Error::invalid(format!("operand {i} has no address")))?;
                let bytes = end - start;
                // An empty operand touches nothing: the null address.
                let addr = if bytes == 0 {
                    DeviceAddr(0)
                } else {
                    at.addr.offset(start)?
                };
                host_kernel::aligned(i, op, addr)?;
                touches.push(Touch {
                    start: addr.0,
                    len: bytes,
                    kind: op.kind,
                });
                placed.push(Placed {
                    addr: addr.0,
                    bytes,
                    count,
                });
            }
            let mut slots = body
                .params
                .iter()
                .map(|p| p.slot(&placed))
                .collect::<Result<Vec<u64>>>()?;
            let mut params: Vec<*mut c_void> = slots
                .iter_mut()
                .map(|slot| (slot as *mut u64).cast::<c_void>())
                .collect();
            let counts: Vec<usize> = placed.iter().map(|p| p.count).collect();
            let dims = (body.dims)(&counts);
            // SAFETY: `with_cuda`'s caller declared the function's parameters (the slots live
            // until the launch returns, which copies them) and that it touches only the
            // operands' ranges: taken as accesses on `stream` under their storages' locks
            // (held until this returns), checked at the door, and the sanitizer's `touches`.
            unsafe {
                self.driver().interop().launch_function(
                    stream,
                    body.function,
                    dims,
                    &mut params,
                    &touches,
                )
            }
        })
    }
}
