//! Typed host kernels: a tensor library's reference kernels on the host backend, seeing the
//! memory of storages as Rust slices, ordered by the storages themselves.
//!
//! ```text
//! runtime.launch_host(stream, (x.reads::<f32>(), y.writes::<f32>()), |(x, y)| {
//!     for (o, i) in y.iter_mut().zip(x) { *o = 2.0 * i }
//!     Ok(())
//! })?;
//! ```
//!
//! A kernel declares its operands — storages, or element ranges of them
//! ([`Reads::elements`], [`Writes::elements`]) — with their mode, and receives `&[T]` for each
//! read and `&mut [T]` for each write, in the order declared. It runs on the stream's worker
//! thread after the work queued there before it, as a device kernel would (the raw layer is the
//! host backend's `enqueue_host`, `driver/host/library_kernels.rs`).
//!
//! | at the door (`launch_host`, before anything is queued) | error when |
//! |---|---|
//! | every operand is memory of the stream's driver and device | another driver's, or another device's |
//! | its memory is awake | its tag sleeps ([`ErrorKind::Asleep`](crate::ErrorKind)) |
//! | `T` has a size; the range is inside the storage; a whole storage is a whole number of `T` | `T` is zero-sized; the range runs past the end (bytes and elements named) |
//! | no bytes are seen through a `&mut` and another slice | two operands of one storage (or its clones' handles) overlap and one writes |
//! | the address is aligned for `T` | it is not (the storage's base is 512-byte aligned; an element range keeps `T`'s alignment; an empty range is no access and has no address) |
//! | then, under the operands' locks until the kernel is queued (`order::enqueue_ordered`), each is taken as an access on `stream` | a write materializes a lazy clone first (on `stream`, its new address checked for alignment again); with `stream_order:auto` the access waits for the conflicting earlier ones on other streams and is recorded for the free (`order.rs`) |
//!
//! **Slices over the memory itself, or over a private copy.** The kernel sees the memory itself
//! exactly when cudalloc orders every access to those bytes: `stream_order:auto`, a block of this
//! process's allocator in the default pool that the storage owns directly, and a stream that is
//! not capturing. Graph replays are accesses too: a replay is ordered with every storage its
//! capture touched through the storages' doors (`alloc/capturing.rs`), and the graph keeps those
//! storages alive. Any other operand set is *staged* — memory shared copy-on-write (a lazy
//! clone's, or its source's: the COW context's memory), shared with or received from another
//! process, in a private pool (whose freed blocks a graph may write after an eager owner got
//! them), under `manual`, or inside a capture: each operand is copied into a private buffer on the worker,
//! the kernel sees slices of those, and the written ones are copied back when it returns. A
//! correct program gets the same bytes either way; a racy one (under `manual`, or memory another
//! process writes) gets unspecified bytes, as on a device — never a Rust reference to memory
//! that changes under it. So `manual` keeps PyTorch's rules and pays the copies, and the stream
//! sanitizer (`CUDALLOC_SANITIZE`) reports what a program under `manual` failed to order.
//!
//! Raw address ranges (`enqueue_host`, the driver's copies) are the `unsafe` escape hatch: no
//! storage sees them, so they are not ordered against these slices.
//!
//! An error the kernel returns fails its stream; the next synchronization on it reports it. Inside
//! a stream capture the kernel is recorded (staged) and runs at each replay.

use std::marker::PhantomData;
use std::ops::Range;

pub use bytemuck::Pod;

use super::{order, Storage};
use crate::driver::host::{HostKernelMemory, HostRange};
use crate::driver::sanitizer::AccessKind;
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::runtime::Runtime;
use crate::sync::os::Arc;

/// A storage (or a range of its elements) a host kernel reads as `&[T]`; made by
/// [`Storage::reads`].
#[derive(Debug)]
#[must_use = "an operand does nothing until it is passed to `Runtime::launch_host`"]
pub struct Reads<'s, T> {
    storage: &'s Storage,
    elements: Option<Range<usize>>,
    _elements: PhantomData<fn() -> T>,
}

/// A storage (or a range of its elements) a host kernel writes as `&mut [T]`; made by
/// [`Storage::writes`].
#[derive(Debug)]
#[must_use = "an operand does nothing until it is passed to `Runtime::launch_host`"]
pub struct Writes<'s, T> {
    storage: &'s Storage,
    elements: Option<Range<usize>>,
    _elements: PhantomData<fn() -> T>,
}

impl<T> Reads<'_, T> {
    /// Only elements `range` of the storage (checked at the launch).
    pub fn elements(mut self, range: Range<usize>) -> Self {
        self.elements = Some(range);
        self
    }
}

impl<T> Writes<'_, T> {
    /// Only elements `range` of the storage (checked at the launch).
    pub fn elements(mut self, range: Range<usize>) -> Self {
        self.elements = Some(range);
        self
    }
}

impl Storage {
    /// This storage as an operand a host kernel reads as `&[T]` (see
    /// [`Runtime::launch_host`]).
    pub fn reads<T: Pod>(&self) -> Reads<'_, T> {
        Reads {
            storage: self,
            elements: None,
            _elements: PhantomData,
        }
    }

    /// This storage as an operand a host kernel writes (and may read) as `&mut [T]` (see
    /// [`Runtime::launch_host`]).
    pub fn writes<T: Pod>(&self) -> Writes<'_, T> {
        Writes {
            storage: self,
            elements: None,
            _elements: PhantomData,
        }
    }
}

/// One operand after the door: its range of memory and its number of elements.
#[derive(Clone, Copy)]
struct Placed {
    range: HostRange,
    count: usize,
}

pub(super) mod sealed {
    use std::ops::Range;

    use super::{AccessKind, Pod, Reads, Result, Runtime, Storage, StreamId, Writes};

    /// What the launch needs of one operand, whatever its type.
    #[derive(Debug)]
    pub struct Operand<'s> {
        pub(in crate::storage) storage: &'s Storage,
        pub(in crate::storage) elements: Option<Range<usize>>,
        pub(in crate::storage) size: usize,
        pub(in crate::storage) align: usize,
        pub(in crate::storage) type_name: &'static str,
        pub(in crate::storage) kind: AccessKind,
    }

    /// One operand of a host kernel: [`Reads`] or [`Writes`].
    pub trait Arg {
        /// The element type.
        type Elem: Pod;
        /// What the kernel receives for it.
        type Slice<'k>;
        /// Whether the kernel writes it.
        const WRITES: bool;
        #[doc(hidden)]
        fn operand(&self) -> Operand<'_>;
        /// # Safety
        /// `ptr` is aligned, and valid for `count` elements (and for writes if `WRITES`) and
        /// seen through no other reference while the slice lives.
        #[doc(hidden)]
        unsafe fn slice<'k>(ptr: *mut Self::Elem, count: usize) -> Self::Slice<'k>;
    }

    /// The operands of a host kernel: one [`Arg`] or a tuple of up to eight.
    pub trait Args {
        /// What the kernel receives: one slice, or a tuple of them in the declared order.
        type Slices<'k>;
        #[doc(hidden)]
        fn launch<F>(self, runtime: &Runtime, stream: StreamId, kernel: F) -> Result<()>
        where
            F: for<'k> Fn(Self::Slices<'k>) -> Result<()> + Send + Sync + 'static;
        /// The operands, in the declared order (a device launch's door: `kernel.rs`).
        #[doc(hidden)]
        fn operands(&self) -> Vec<Operand<'_>>;
    }

    impl<T: Pod> Arg for Reads<'_, T> {
        type Elem = T;
        type Slice<'k> = &'k [T];
        const WRITES: bool = false;
        fn operand(&self) -> Operand<'_> {
            Operand::new::<T>(self.storage, self.elements.clone(), false)
        }
        unsafe fn slice<'k>(ptr: *mut T, count: usize) -> &'k [T] {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts(ptr, count) }
        }
    }

    impl<T: Pod> Arg for Writes<'_, T> {
        type Elem = T;
        type Slice<'k> = &'k mut [T];
        const WRITES: bool = true;
        fn operand(&self) -> Operand<'_> {
            Operand::new::<T>(self.storage, self.elements.clone(), true)
        }
        unsafe fn slice<'k>(ptr: *mut T, count: usize) -> &'k mut [T] {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts_mut(ptr, count) }
        }
    }
}

/// The operands of a host kernel: a [`Reads`], a [`Writes`], or a tuple of up to eight of them;
/// the kernel receives the matching slice or tuple of slices.
pub trait HostArgs: sealed::Args {}
impl<A: sealed::Args> HostArgs for A {}

impl<'s> sealed::Operand<'s> {
    fn new<T>(storage: &'s Storage, elements: Option<Range<usize>>, writes: bool) -> Self {
        sealed::Operand {
            storage,
            elements,
            size: std::mem::size_of::<T>(),
            align: std::mem::align_of::<T>(),
            type_name: std::any::type_name::<T>(),
            kind: if writes {
                AccessKind::Write
            } else {
                AccessKind::Read
            },
        }
    }

    /// Bytes `[start, end)` of the storage the operand covers, and its element count.
    fn bytes(&self, i: usize) -> Result<(u64, u64, usize)> {
        let nbytes = self.storage.nbytes();
        if self.size == 0 {
            return Err(Error::invalid(format!(
                "operand {i}: {} is zero-sized; a host kernel sees elements with a size",
                self.type_name
            )));
        }
        let size = self.size as u64;
        let range = match &self.elements {
            Some(r) => r.clone(),
            None => {
                if !nbytes.is_multiple_of(size) {
                    return Err(Error::invalid(format!(
                        "operand {i}: a storage of {nbytes} bytes is not a whole number of {} \
                         ({size} bytes each): name the elements with `.elements(..)`",
                        self.type_name
                    )));
                }
                let count = usize::try_from(nbytes / size).map_err(|_| {
                    Error::invalid(format!(
                        "operand {i}: {nbytes} bytes exceed the address space"
                    ))
                })?;
                0..count
            }
        };
        let bytes_of = |n: usize| (n as u64).checked_mul(size);
        match (bytes_of(range.start), bytes_of(range.end)) {
            (Some(start), Some(end)) if range.start <= range.end && end <= nbytes => {
                Ok((start, end, range.end - range.start))
            }
            _ => Err(Error::invalid(format!(
                "operand {i}: elements {}..{} of {} ({size} bytes each) are not inside a storage \
                 of {nbytes} bytes",
                range.start, range.end, self.type_name
            ))),
        }
    }
}

/// Checks the operands at the door — before anything is taken or queued — and returns each
/// one's byte range in its storage and element count.
pub(super) fn door(
    runtime: &Runtime,
    stream: StreamId,
    operands: &[sealed::Operand<'_>],
) -> Result<smallvec::SmallVec<[(u64, u64, usize); 8]>> {
    let device = runtime.driver().stream_device(stream)?;
    let n = operands.len();
    let mut spans: smallvec::SmallVec<[(u64, u64, usize); 8]> =
        smallvec::smallvec![(0u64, 0u64, 0usize); n];
    for (i, (op, span)) in operands.iter().zip(&mut spans).enumerate() {
        // Another runtime over the same driver is fine (a storage received from one in this
        // process is the sender's own): the stream and the memory are the same driver's.
        if !Arc::ptr_eq(op.storage.runtime().driver(), runtime.driver()) {
            return Err(Error::invalid(format!(
                "operand {i} is memory of another driver than the kernel's stream"
            )));
        }
        if op.storage.device() != device {
            return Err(Error::invalid(format!(
                "operand {i} is memory of device {}, the kernel's stream runs on device {device}",
                op.storage.device()
            )));
        }
        op.storage.check_awake("a host kernel")?;
        *span = op.bytes(i)?;
        // The address now: a storage's never moves unless a lazy clone's first write gives it
        // new (512-byte aligned) memory, checked again under the locks.
        if span.1 > span.0 {
            aligned(i, op, op.storage.unordered_data_ptr().offset(span.0)?)?;
        }
    }
    for i in 0..n {
        for j in i + 1..n {
            let (a, b) = (&operands[i], &operands[j]);
            let writes = a.kind == AccessKind::Write || b.kind == AccessKind::Write;
            let overlap = spans[i].0 < spans[j].1 && spans[j].0 < spans[i].1;
            if writes && overlap && a.storage.is_alias_of(b.storage) {
                return Err(Error::invalid(format!(
                    "operands {i} and {j} overlap in one storage and one of them is written: a \
                     kernel may not see the same bytes through `&mut` and another slice"
                )));
            }
        }
    }
    Ok(spans)
}

/// What a panic's error says of one operand, kept as plain values so a launch formats nothing
/// unless its kernel panics.
#[derive(Clone, Copy, Debug)]
pub(super) struct OperandFacts {
    writes: bool,
    count: usize,
    type_name: &'static str,
    first: u64,
    nbytes: u64,
}

/// The facts of each operand (cheap: no allocation).
pub(super) fn facts<const N: usize>(
    operands: &[sealed::Operand<'_>; N],
    spans: &[(u64, u64, usize)],
) -> [OperandFacts; N] {
    std::array::from_fn(|i| {
        let op = &operands[i];
        let (start, _, count) = spans.get(i).copied().unwrap_or_default();
        OperandFacts {
            writes: op.kind == AccessKind::Write,
            count,
            type_name: op.type_name,
            first: start / op.size.max(1) as u64,
            nbytes: op.storage.nbytes(),
        }
    })
}

/// The operands as a kernel's panic names them: `operand 0: reads 1024 f32 (elements 0..1024)
/// of a 4096-byte storage; …`.
pub(super) fn describe(facts: &[OperandFacts]) -> String {
    let each: Vec<String> = facts
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let verb = if f.writes { "writes" } else { "reads" };
            format!(
                "operand {i}: {verb} {} {} (elements {}..{}) of a {}-byte storage",
                f.count,
                f.type_name,
                f.first,
                f.first + f.count as u64,
                f.nbytes
            )
        })
        .collect();
    each.join("; ")
}

/// An error unless `addr` (operand `i`'s first element; an empty operand's is not used) is
/// aligned for its element type.
pub(super) fn aligned(i: usize, op: &sealed::Operand<'_>, addr: DeviceAddr) -> Result<()> {
    if addr.0 == 0 || addr.0.is_multiple_of(op.align as u64) {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "operand {i}: address {addr} is not aligned for {} ({} bytes)",
        op.type_name, op.align
    )))
}

/// The operands' ranges at their storages' addresses under the locks (`addrs`, from
/// `order::enqueue_ordered`), and whether the kernel may see the memory itself (see the module
/// docs): decided under the locks, for the storages as they are when the kernel is queued.
fn place<const N: usize>(
    runtime: &Runtime,
    stream: StreamId,
    operands: &[sealed::Operand<'_>; N],
    spans: &[(u64, u64, usize)],
    placements: &[order::Placement],
) -> Result<([Placed; N], bool)> {
    let mut placed = [Placed {
        range: HostRange::read(DeviceAddr(0), 0),
        count: 0,
    }; N];
    // A capture records the kernel for replays outside the storages' order (a library's own
    // capture of the stream too; the allocators' captures and graphs are checked per operand).
    let mut zero_copy = !runtime
        .driver()
        .graphs()
        .stream_capture_status(stream)?
        .is_capturing();
    for (i, ((op, &(start, end, count)), out)) in
        operands.iter().zip(spans).zip(&mut placed).enumerate()
    {
        let at = placements
            .get(i)
            .copied()
            .ok_or_else(|| Error::invalid(format!("operand {i} has no address")))?;
        let base = at.addr;
        let len = end - start;
        // An empty operand touches nothing: the null range (an empty storage's address).
        let addr = if len == 0 {
            DeviceAddr(0)
        } else {
            base.offset(start)?
        };
        aligned(i, op, addr)?;
        out.range = match op.kind {
            AccessKind::Write => HostRange::write(addr, len),
            AccessKind::Read => HostRange::read(addr, len),
        };
        out.count = count;
        zero_copy &= at.ordered_bytes;
    }
    Ok((placed, zero_copy))
}

macro_rules! host_args_tuple {
    ($n:literal; $($a:ident $i:tt),+) => {
        impl<$($a: sealed::Arg),+> sealed::Args for ($($a,)+) {
            type Slices<'k> = ($($a::Slice<'k>,)+);

            fn operands(&self) -> Vec<sealed::Operand<'_>> {
                vec![$(self.$i.operand()),+]
            }

            fn launch<F>(self, runtime: &Runtime, stream: StreamId, kernel: F) -> Result<()>
            where
                F: for<'k> Fn(Self::Slices<'k>) -> Result<()> + Send + Sync + 'static,
            {
                let host = runtime.driver().as_host().ok_or_else(|| {
                    Error::invalid(format!(
                        "host kernels run on the host backend; this runtime's is {}",
                        runtime.driver().backend().name()
                    ))
                })?;
                let operands = [$(self.$i.operand()),+];
                let spans = door(runtime, stream, &operands)?;
                let accesses = operands.each_ref().map(|op| (op.storage, op.kind));
                order::enqueue_ordered(&accesses, stream, |placements| {
                let (placed, zero_copy) = place(runtime, stream, &operands, &spans, placements)?;
                let counts = placed.map(|p| p.count);
                let facts = facts(&operands, &spans);
                // A panic of the kernel is its own error, naming the operands (caught here, on
                // the stream's thread, before the driver sees it).
                let run = move |slices: <Self as sealed::Args>::Slices<'_>| -> Result<()> {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| kernel(slices)))
                        .unwrap_or_else(|panic| {
                            Err(Error::KernelPanic {
                                operands: describe(&facts),
                                message: crate::error::panic_message(&*panic),
                            })
                        })
                };
                let body = move |memory: &mut HostKernelMemory<$n>| -> Result<()> {
                    if zero_copy {
                        let bases = ($( checked_base::<$a::Elem, $n>(memory, $i)?, )+);
                        // SAFETY: each range is inside a live mapping for the whole kernel
                        // (segments are unmapped only after every stream drained), aligned
                        // (checked), and no other access to its bytes overlaps this kernel in
                        // time: the storages ordered every access to them (zero copy only
                        // then, see the module docs), and the door refused a written range
                        // overlapping another operand's.
                        return run(($( unsafe { $a::slice(bases.$i, counts[$i]) }, )+));
                    }
                    let mut staged = ($( bytemuck::zeroed_vec::<$a::Elem>(counts[$i]), )+);
                    $( memory.read($i, 0, bytemuck::cast_slice_mut(&mut staged.$i))?; )+
                    // SAFETY: the buffers are this closure's own, aligned for their element type,
                    // `counts[i]` long, and each is borrowed by one slice only.
                    run(($( unsafe { $a::slice(staged.$i.as_mut_ptr(), counts[$i]) }, )+))?;
                    $( if $a::WRITES {
                        memory.write($i, 0, bytemuck::cast_slice(&staged.$i))?;
                    } )+
                    Ok(())
                };
                // SAFETY: the ranges are the operands' memory, taken as accesses on `stream` by
                // their storages under their locks, held until this is queued; see the module
                // docs for why no slice races.
                unsafe { host.enqueue_host(stream, placed.map(|p| p.range), body) }
                })
            }
        }
    };
}

/// The host address of range `i` as a pointer to `E`, checked for alignment (an empty range's
/// is a dangling, aligned pointer: an empty slice touches nothing).
fn checked_base<E, const N: usize>(memory: &HostKernelMemory<N>, i: usize) -> Result<*mut E> {
    if memory.is_empty(i) {
        return Ok(std::ptr::NonNull::<E>::dangling().as_ptr());
    }
    let base = memory.base(i);
    if !base.is_multiple_of(std::mem::align_of::<E>()) {
        return Err(Error::invalid(format!(
            "operand {i}: host address {base:#x} is not aligned for {}",
            std::any::type_name::<E>()
        )));
    }
    Ok(base as *mut E)
}

host_args_tuple!(1; A0 0);

/// One operand alone: the kernel receives its slice (not a 1-tuple).
macro_rules! host_args_single {
    ($ty:ident) => {
        impl<T: Pod> sealed::Args for $ty<'_, T> {
            type Slices<'k> = <$ty<'static, T> as sealed::Arg>::Slice<'k>;

            fn launch<F>(self, runtime: &Runtime, stream: StreamId, kernel: F) -> Result<()>
            where
                F: for<'k> Fn(Self::Slices<'k>) -> Result<()> + Send + Sync + 'static,
            {
                sealed::Args::launch((self,), runtime, stream, move |(slice,)| kernel(slice))
            }

            fn operands(&self) -> Vec<sealed::Operand<'_>> {
                vec![sealed::Arg::operand(self)]
            }
        }
    };
}
host_args_single!(Reads);
host_args_single!(Writes);
host_args_tuple!(2; A0 0, A1 1);
host_args_tuple!(3; A0 0, A1 1, A2 2);
host_args_tuple!(4; A0 0, A1 1, A2 2, A3 3);
host_args_tuple!(5; A0 0, A1 1, A2 2, A3 3, A4 4);
host_args_tuple!(6; A0 0, A1 1, A2 2, A3 3, A4 4, A5 5);
host_args_tuple!(7; A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6);
host_args_tuple!(8; A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7);

impl Runtime {
    /// Queues a typed host kernel on `stream`: `kernel` receives the operands `args` declared
    /// (`x.reads::<f32>()`, `y.writes::<f32>().elements(0..n)`, or a tuple of up to eight) as
    /// `&[T]` / `&mut [T]`, ordered by the storages (see `src/storage/host_kernel.rs`). Errors at
    /// the door name the operand; an error the kernel returns fails the stream. The host
    /// backend's (an error on another).
    pub fn launch_host<A: HostArgs>(
        &self,
        stream: StreamId,
        args: A,
        kernel: impl for<'k> Fn(<A as sealed::Args>::Slices<'k>) -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        args.launch(self, stream, kernel)
    }
}
