//! The crate's one error type.
//!
//! Every fallible entry point returns [`Error`]. Callers that want to react (retry after freeing
//! memory, fall back to the host backend, report a bug) look at [`Error::kind`] instead of matching
//! message text:
//!
//! | kind                        | retrying can help?                                   |
//! |-----------------------------|------------------------------------------------------|
//! | [`ErrorKind::OutOfMemory`]  | yes, after freeing memory or emptying caches         |
//! | [`ErrorKind::InvalidArgument`] | no: the call is wrong (bad pointer, size, handle) |
//! | [`ErrorKind::InvalidIpcHandle`] | no: the bytes from another process are not a valid handle |
//! | [`ErrorKind::Config`]       | no: fix the environment variable or option           |
//! | [`ErrorKind::NoCudaDriver`] | no: use the host backend instead                     |
//! | [`ErrorKind::Driver`]       | maybe: the device or the operating system failed     |
//! | [`ErrorKind::StreamRace`]   | no: the program's stream order is wrong (the sanitizer found two unordered accesses); sticky on the stream |
//! | [`ErrorKind::ForkedChild`]  | no: the object belongs to the parent of this forked process; build a runtime in the child |
//! | [`ErrorKind::StreamCapture`] | no: the call is not allowed while a stream is being captured into a graph (or the capture was already invalidated by one); end the capture first |
//! | [`ErrorKind::Asleep`]      | memory of a sleeping tag (its pages given back): yes, after `wake_up` of the tag; a tag in the wrong phase for the call (sleeping an asleep tag, waking an awake one, one on its way) or memory other processes hold: when that changes — the message says which; the call did nothing |
//! | [`ErrorKind::KernelPanic`] | no: a typed host kernel panicked (a bug in it; the message names its operands); sticky on the stream |
//! | [`ErrorKind::ForeignEvent`] | no: another process's event failed the work that waited for it (its producer exited, its cell was written by a third party, or the wait passed its deadline); the storage it guards is not ready — drop it, the stream stays usable |

use std::fmt;

use crate::sync::os::Arc;

/// What went wrong, coarsely: what a caller can do about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The device (or a configured limit) has no room for the request.
    OutOfMemory,
    /// The caller passed something invalid: unknown pointer, device, stream, size 0, overflow.
    InvalidArgument,
    /// An IPC handle that does not decode or does not name a live object of ours.
    InvalidIpcHandle,
    /// A configuration string or environment variable is malformed.
    Config,
    /// CUDA was requested but `libcuda` (or a device) is not present.
    NoCudaDriver,
    /// The driver or the operating system reported a failure.
    Driver,
    /// The stream sanitizer found a race or a use after free (see `driver::sanitizer`).
    StreamRace,
    /// The object was made by the parent of this forked process (see `process`): a child never
    /// allocates, frees or runs stream work for its parent.
    ForkedChild,
    /// A wait on another process's interprocess event failed (see [`ForeignEventFailure`]): the
    /// memory it guards is not ready; the waiting stream stays usable for other work.
    ForeignEvent,
    /// A host kernel of the caller's failed with its own error ([`Error::Kernel`]).
    Kernel,
    /// A typed host kernel of the caller's panicked ([`Error::KernelPanic`]): a bug in the
    /// kernel; the message names its operands. Sticky on the stream.
    KernelPanic,
    /// A call that a stream capture forbids, or a capture that cannot go on (see
    /// `driver/capture.rs`): the capture it concerns is invalidated.
    StreamCapture,
    /// A registrar (a transfer engine's registration of the allocator's memory) failed
    /// ([`Error::Registration`]).
    Registration,
    /// A transfer engine refused or failed a transfer, or its peer is gone ([`Error::Transfer`]).
    Transfer,
    /// The memory concerned belongs to a tag that is asleep, or the tag is not in the state the
    /// call needs ([`Error::Asleep`]).
    Asleep,
}

/// Why a wait on another process's interprocess event failed ([`Error::ForeignEvent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ForeignEventFailure {
    /// The producer process exited (or dropped the driver that owned the event) before completing
    /// the record waited for: the creator lock of its event chunk is free.
    ProducerExited,
    /// The event's shared cell holds values its producer cannot have written (a completion that
    /// went back, or past every record; a record count below the one waited for): another
    /// process wrote it.
    Implausible,
    /// The record was not completed within the deadline for foreign events
    /// (`CUDALLOC_IPC_EVENT_TIMEOUT_S` on the host backend).
    Timeout,
}

impl fmt::Display for ForeignEventFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ForeignEventFailure::ProducerExited => "the producer exited",
            ForeignEventFailure::Implausible => "implausible event cell",
            ForeignEventFailure::Timeout => "timeout",
        })
    }
}

/// The error of every fallible cudalloc operation.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not enough device memory (or a configured cap was reached). Retrying after freeing memory may
    /// succeed.
    #[error("out of memory on device {device}: {message}")]
    OutOfMemory {
        /// Device ordinal.
        device: usize,
        /// Bytes that were requested.
        requested: u64,
        /// The full explanation (capacity, free, allocated, ...).
        message: String,
    },
    /// Not enough page-locked host memory (the host allocator's driver refused, a configured cap
    /// was reached, or the operating system's limit on locked memory, `RLIMIT_MEMLOCK`, was; the
    /// message says which). Retrying after freeing pinned buffers may succeed.
    #[error("out of page-locked host memory: {message}")]
    HostOutOfMemory {
        /// Bytes that were requested.
        requested: u64,
        /// The full explanation.
        message: String,
    },
    /// The call itself is wrong; retrying the same call cannot help.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Bytes from another process do not form a valid handle, or name nothing of ours.
    #[error("invalid IPC handle: {0}")]
    InvalidIpcHandle(String),
    /// A configuration value is malformed; the message names the key and what is valid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The CUDA backend was asked for but the CUDA driver library or a device is missing.
    #[error("no CUDA driver: {0}")]
    NoCudaDriver(String),
    /// A driver call failed.
    #[error("{backend} driver call {call} failed: {message}")]
    Driver {
        /// `"host"` or `"cuda"`.
        backend: &'static str,
        /// The failing call (e.g. `cuMemAlloc_v2`, `shm_open`).
        call: &'static str,
        /// What the driver or operating system said.
        message: String,
        /// The operating system's error, when one caused this ([`std::error::Error::source`]).
        #[source]
        source: Option<Cause>,
    },
    /// A host kernel of the caller's ([`HostDriver::enqueue_host`](crate::backend::HostDriver::enqueue_host))
    /// failed with an error of its own, kept as the [`source`](std::error::Error::source).
    /// Sticky on the stream, like a CUDA error.
    #[error("host kernel failed: {source}")]
    Kernel {
        /// The kernel's own error.
        source: Cause,
    },
    /// A typed host kernel of the caller's ([`Runtime::launch_host`](crate::Runtime::launch_host))
    /// panicked: the panic is caught on the stream's thread and fails the stream, like a CUDA
    /// kernel's fault; the error names the kernel's operands.
    #[error("a host kernel panicked: {message} (its operands: {operands})")]
    KernelPanic {
        /// The operands as the kernel saw them: kind, element type, elements, storage size.
        operands: String,
        /// The panic's message.
        message: String,
    },
    /// The stream sanitizer found two accesses that stream order does not order (a race, or a use
    /// after free); the message names both. Sticky on the stream, like a CUDA error.
    #[error("{0}")]
    StreamRace(String),

    /// A call that stream capture forbids, or a capture that cannot be ended (`driver/capture.rs`).
    #[error("stream capture: {0}")]
    StreamCapture(String),
    /// The object belongs to the process this one was forked from; the message names both pids.
    #[error("forked child: {0}")]
    ForkedChild(String),
    /// A wait on another process's interprocess event failed; names the producer's pid, its
    /// event chunk and why. The work queued behind the wait on that stream did not run.
    #[error("wait on the interprocess event of pid {pid} (event chunk {chunk}) failed ({failure}): {message}")]
    ForeignEvent {
        /// The producer's process id.
        pid: u32,
        /// The shared-memory object holding the event's cell.
        chunk: String,
        /// Why the wait failed.
        failure: ForeignEventFailure,
        /// Details: the slot, the record waited for, what the cell said.
        message: String,
    },
    /// A registrar failed to register a region of the allocator's memory (see
    /// `alloc/registration.rs`): the allocation that mapped it fails, unless the registrar was
    /// attached to count and skip its failures.
    #[error("registration with {registrar} failed: {source}")]
    Registration {
        /// The registrar's name.
        registrar: String,
        /// What it said.
        source: Cause,
    },
    /// A transfer engine refused or failed a transfer (or could not be set up); the message says
    /// which transfer and why.
    #[error("transfer: {0}")]
    Transfer(String),
    /// Memory of a sleeping tag was asked for, used or shared, or a tag was put to sleep or woken
    /// in the wrong state (`Runtime::sleep`, `alloc/engine/sleep.rs`); the message says which and what
    /// to do. Nothing was done.
    #[error("tag {tag:?}: {message}")]
    Asleep {
        /// The tag.
        tag: String,
        /// What was refused and why.
        message: String,
    },
}

impl Error {
    /// The coarse category of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::OutOfMemory { .. } | Error::HostOutOfMemory { .. } => ErrorKind::OutOfMemory,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::InvalidIpcHandle(_) => ErrorKind::InvalidIpcHandle,
            Error::Config(_) => ErrorKind::Config,
            Error::NoCudaDriver(_) => ErrorKind::NoCudaDriver,
            Error::Driver { .. } => ErrorKind::Driver,
            Error::StreamRace(_) => ErrorKind::StreamRace,
            Error::StreamCapture(_) => ErrorKind::StreamCapture,
            Error::ForkedChild(_) => ErrorKind::ForkedChild,
            Error::ForeignEvent { .. } => ErrorKind::ForeignEvent,
            Error::Kernel { .. } => ErrorKind::Kernel,
            Error::KernelPanic { .. } => ErrorKind::KernelPanic,
            Error::Registration { .. } => ErrorKind::Registration,
            Error::Transfer(_) => ErrorKind::Transfer,
            Error::Asleep { .. } => ErrorKind::Asleep,
        }
    }

    /// Whether retrying the same operation later can succeed (after memory is freed, or after a
    /// transient driver failure). Programming errors and bad input are never retryable.
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind(), ErrorKind::OutOfMemory | ErrorKind::Driver)
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn invalid(message: impl fmt::Display) -> Self {
        Error::InvalidArgument(message.to_string())
    }

    /// Shorthand for [`Error::StreamCapture`].
    pub(crate) fn capture(message: impl fmt::Display) -> Self {
        Error::StreamCapture(message.to_string())
    }

    /// Shorthand for [`Error::InvalidIpcHandle`].
    pub(crate) fn bad_handle(message: impl fmt::Display) -> Self {
        Error::InvalidIpcHandle(message.to_string())
    }

    /// A host-backend failure of an operating-system call: an `io::Error` (or errno) is kept as
    /// the error's source, a message is only text.
    pub(crate) fn host_os(call: &'static str, err: impl Into<OsCause>) -> Self {
        let (message, source) = match err.into() {
            OsCause::Io(io) => (io.to_string(), Some(Cause::new(io))),
            OsCause::Text(text) => (text, None),
        };
        Error::Driver {
            backend: "host",
            call,
            message,
            source,
        }
    }

    /// The error of a host kernel of the caller's: `kernel(my_error)` keeps `my_error` as the
    /// [`source`](std::error::Error::source) of an [`ErrorKind::Kernel`] error (its message shows
    /// in this error's).
    pub fn kernel(err: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Kernel {
            source: Cause::new(err),
        }
    }
}

/// The error that caused an [`Error`]: the operating system's, a host kernel's own, or an
/// earlier error of a failed stream. It shows as the error it holds, and its
/// [`source`](std::error::Error::source) *is* that error — so a caller walking the chain can
/// `downcast_ref` to its own type.
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync>);

impl Cause {
    /// Wraps `err`.
    pub fn new(err: impl std::error::Error + Send + Sync + 'static) -> Self {
        Cause(Arc::new(err))
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// What an operating-system call's failure carries: the `io::Error` itself, or a message.
#[derive(Debug)]
pub(crate) enum OsCause {
    Io(std::io::Error),
    Text(String),
}

impl From<std::io::Error> for OsCause {
    fn from(err: std::io::Error) -> Self {
        OsCause::Io(err)
    }
}

impl From<String> for OsCause {
    fn from(text: String) -> Self {
        OsCause::Text(text)
    }
}

impl From<&str> for OsCause {
    fn from(text: &str) -> Self {
        OsCause::Text(text.to_owned())
    }
}

impl Error {
    /// The error of a registrar named `registrar` that failed with `err` (kept as the
    /// [`source`](std::error::Error::source)).
    pub fn registration(
        registrar: impl fmt::Display,
        err: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Registration {
            registrar: registrar.to_string(),
            source: Cause::new(err),
        }
    }

    /// Shorthand for [`Error::Transfer`].
    pub fn transfer(message: impl fmt::Display) -> Self {
        Error::Transfer(message.to_string())
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The message of a caught panic (its `&str` or `String` payload).
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// Runs code the allocator calls back into — a registrar, an observer, a free-memory callback —
/// with its panic caught and turned into its message: the path that called it goes on with its
/// state whole (a lock it holds is not left mid-change, a sleeping tag not left mid-transition).
pub(crate) fn caught<T>(callback: impl FnOnce() -> T) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(callback))
        .map_err(|panic| panic_message(&*panic))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_only_for_memory_and_driver_failures() {
        let oom = Error::OutOfMemory {
            device: 0,
            requested: 1,
            message: "full".into(),
        };
        assert!(oom.is_retryable());
        assert!(!Error::invalid("size 0").is_retryable());
        assert!(!Error::bad_handle("magic").is_retryable());
        assert!(!Error::NoCudaDriver("absent".into()).is_retryable());
        assert!(Error::host_os("open", "EIO").is_retryable());
        assert_eq!(Error::Config("x".into()).kind(), ErrorKind::Config);
    }

    #[test]
    fn an_os_error_is_kept_as_the_source_and_text_is_not_one() {
        use std::error::Error as _;
        let io = std::io::Error::from_raw_os_error(28);
        let err = Error::host_os("fallocate", io);
        let cause = err.source().expect("the io::Error is the source");
        let io = cause
            .source()
            .and_then(|e| e.downcast_ref::<std::io::Error>());
        assert_eq!(io.and_then(std::io::Error::raw_os_error), Some(28));
        assert!(Error::host_os("stream", "text only").source().is_none());
    }
}
