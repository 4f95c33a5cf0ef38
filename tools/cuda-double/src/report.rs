//! What the double observed: calls per entry point and every contract violation.
//!
//! With `CUDA_DOUBLE_REPORT=<dir>` set, every process that loads the double adds to one report:
//!
//! | file             | content                                                               |
//! |------------------|-----------------------------------------------------------------------|
//! | `calls.bin`      | `"CUDBLCNT"`, a fingerprint of the entry table, then per entry point a `u64` of calls and, after them, a `u64` of calls that did not return `CUDA_SUCCESS` (so error paths are seen to run); mapped shared and incremented atomically (a killed process has counted its calls already) |
//! | `violations.log` | one line per contract violation: pid, call, result code, rule broken  |
//! | `rejected.log`   | one line per input refused as corrupt (IPC handle bytes not made by the double): an expected outcome for untrusted input, not a violation |
//!
//! Lines are appended with one `write` on an `O_APPEND` descriptor, so lines of concurrent
//! processes never interleave. Without the variable nothing is counted and violations go
//! to standard error. `cuda-double-report` reads the folder and fails on any violation or on any
//! entry point the CUDA backend uses that was never called.

use std::ffi::CString;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::codes::{self, CuResult};

macro_rules! entries {
    ($($name:ident),* $(,)?) => {
        /// Every driver API entry point the double exports.
        #[allow(non_camel_case_types, missing_docs)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(usize)]
        pub enum Entry { $($name),* }

        /// All entry points, in counter order.
        pub const ENTRIES: &[Entry] = &[$(Entry::$name),*];

        impl Entry {
            /// The C symbol name.
            pub fn name(self) -> &'static str {
                match self { $(Entry::$name => stringify!($name)),* }
            }
        }
    };
}

entries!(
    cuInit,
    cuGetExportTable,
    cuGetErrorString,
    cuDeviceGetCount,
    cuDeviceGet,
    cuDeviceGetName,
    cuDeviceGetAttribute,
    cuDevicePrimaryCtxRetain,
    cuDevicePrimaryCtxRelease_v2,
    cuCtxSetCurrent,
    cuCtxGetCurrent,
    cuCtxSynchronize,
    cuMemGetInfo_v2,
    cuMemAlloc_v2,
    cuMemFree_v2,
    cuMemGetAddressRange_v2,
    cuMemHostAlloc,
    cuMemFreeHost,
    cuMemHostRegister_v2,
    cuMemHostUnregister,
    cuMemcpyHtoDAsync_v2,
    cuMemcpyDtoHAsync_v2,
    cuMemcpyDtoDAsync_v2,
    cuMemsetD8Async,
    cuStreamCreate,
    cuStreamDestroy_v2,
    cuStreamSynchronize,
    cuStreamQuery,
    cuStreamGetCtx,
    cuStreamWaitEvent,
    cuEventCreate,
    cuEventDestroy_v2,
    cuEventRecord,
    cuEventQuery,
    cuEventSynchronize,
    cuModuleLoadData,
    cuModuleGetFunction,
    cuModuleUnload,
    cuLaunchKernel,
    cuIpcGetMemHandle,
    cuIpcOpenMemHandle_v2,
    cuIpcCloseMemHandle,
    cuIpcGetEventHandle,
    cuIpcOpenEventHandle,
    cuMemGetAllocationGranularity,
    cuMemAddressReserve,
    cuMemAddressFree,
    cuMemCreate,
    cuMemRelease,
    cuMemMap,
    cuMemSetAccess,
    cuMemUnmap,
    cuMemExportToShareableHandle,
    cuMemImportFromShareableHandle,
    cuStreamBeginCapture_v2,
    cuStreamEndCapture,
    cuStreamIsCapturing,
    cuStreamGetCaptureInfo_v2,
    cuThreadExchangeStreamCaptureMode,
    cuGraphInstantiateWithFlags,
    cuGraphLaunch,
    cuGraphGetNodes,
    cuGraphDestroy,
    cuGraphExecDestroy,
);

/// How a failed call is classified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// The caller broke the documented contract (or hit something the double cannot emulate).
    Violation,
    /// Input another process could have corrupted was refused: expected for untrusted input.
    Rejected,
    /// A legitimate outcome the caller must handle (out of memory, not ready, not found).
    Outcome,
}

/// A failed call: the code returned and why.
#[derive(Clone, Debug)]
pub struct Fail {
    /// The result code returned to the caller.
    pub code: CuResult,
    /// Whether this is a violation.
    pub class: Class,
    /// The rule broken or the reason.
    pub message: String,
}

impl Fail {
    /// A contract violation.
    pub fn violation(code: CuResult, message: impl Into<String>) -> Self {
        Fail {
            code,
            class: Class::Violation,
            message: message.into(),
        }
    }

    /// Refused untrusted input.
    pub fn rejected(code: CuResult, message: impl Into<String>) -> Self {
        Fail {
            code,
            class: Class::Rejected,
            message: message.into(),
        }
    }

    /// A legitimate non-success outcome.
    pub fn outcome(code: CuResult, message: impl Into<String>) -> Self {
        Fail {
            code,
            class: Class::Outcome,
            message: message.into(),
        }
    }
}

/// `Result` of the double's internals.
pub type Checked<T> = std::result::Result<T, Fail>;

const COUNTS_MAGIC: &[u8; 8] = b"CUDBLCNT";
const COUNTS_HEADER: usize = 16;

/// A hash of the entry table (names, in order): what `calls.bin`'s header carries.
fn fingerprint() -> [u8; 8] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for e in ENTRIES {
        for b in e.name().bytes().chain([0]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h.to_le_bytes()
}

/// The report of this process (see the module docs).
#[derive(Debug)]
pub struct Report {
    shared: Option<SharedCounts>,
    dir: Option<std::path::PathBuf>,
    violations: AtomicU64,
    recent: Mutex<Vec<String>>,
}

/// The mapped `calls.bin`.
#[derive(Debug)]
struct SharedCounts {
    base: *mut u8,
}

// SAFETY: the mapping is shared memory accessed only through atomics; the pointer is never freed
// (the mapping lives for the life of the process).
unsafe impl Send for SharedCounts {}
// SAFETY: as for Send.
unsafe impl Sync for SharedCounts {}

impl SharedCounts {
    fn open(path: &std::path::Path) -> Option<Self> {
        let len = COUNTS_HEADER + 16 * ENTRIES.len();
        let cpath = CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
        // SAFETY: valid NUL-terminated path; the descriptor is closed below.
        let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o644) };
        if fd < 0 {
            return None;
        }
        // A file left by another layout of the entry table would scramble the counts: refuse it.
        let mut header = [0u8; COUNTS_HEADER];
        // SAFETY: reads at most COUNTS_HEADER bytes into `header`.
        let read = unsafe { libc::pread(fd, header.as_mut_ptr().cast(), COUNTS_HEADER, 0) };
        let expected = fingerprint();
        // Zeros are a header another process is still writing (it creates, then writes).
        let part_ok = |part: &[u8], want: &[u8]| part == want || part.iter().all(|&b| b == 0);
        let foreign = read as usize == COUNTS_HEADER
            && !(part_ok(&header[..8], COUNTS_MAGIC) && part_ok(&header[8..], &expected));
        if foreign {
            // SAFETY: `fd` was opened above.
            unsafe { libc::close(fd) };
            let _ = std::io::stderr().write_all(
                format!("cuda-double: {} was written by another build of the double; use a fresh report folder\n", path.display()).as_bytes(),
            );
            return None;
        }
        // SAFETY: `fd` is open; every creator truncates to the same length, so the race is benign.
        let sized = unsafe { libc::ftruncate(fd, len as libc::off_t) } == 0;
        // SAFETY: mapping `len` bytes of a file that has `len` bytes; checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: `fd` was opened above; the mapping keeps the file.
        unsafe { libc::close(fd) };
        if !sized || base == libc::MAP_FAILED {
            return None;
        }
        let base = base.cast::<u8>();
        // SAFETY: the mapping has COUNTS_HEADER bytes at its start; concurrent writers write the
        // same bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(COUNTS_MAGIC.as_ptr(), base, 8);
            std::ptr::copy_nonoverlapping(expected.as_ptr(), base.add(8), 8);
        }
        Some(SharedCounts { base })
    }

    /// Counter `index` (calls: the entry's number; failures: after all the entries' calls).
    fn counter(&self, index: usize) -> &AtomicU64 {
        // SAFETY: the mapping holds 2 * ENTRIES 8-byte-aligned u64s after the 16-byte header
        // (mmap returns page-aligned memory; index < 2 * ENTRIES) and lives for the life of the
        // process.
        unsafe { AtomicU64::from_ptr(self.base.add(COUNTS_HEADER + 8 * index).cast()) }
    }
}

/// This process's report, set up from `CUDA_DOUBLE_REPORT` on first use.
pub fn report() -> &'static Report {
    static REPORT: OnceLock<Report> = OnceLock::new();
    REPORT.get_or_init(|| {
        let dir = std::env::var_os("CUDA_DOUBLE_REPORT").map(std::path::PathBuf::from);
        let shared = dir.as_ref().and_then(|d| {
            let _ = std::fs::create_dir_all(d);
            SharedCounts::open(&d.join("calls.bin"))
        });
        Report {
            shared,
            dir,
            violations: AtomicU64::new(0),
            recent: Mutex::new(Vec::new()),
        }
    })
}

impl Report {
    /// Counts one call of `entry`.
    pub fn count(&self, entry: Entry) {
        if let Some(shared) = &self.shared {
            shared
                .counter(entry as usize)
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a call of `entry` that did not return `CUDA_SUCCESS`.
    pub fn count_failure(&self, entry: Entry) {
        if let Some(shared) = &self.shared {
            shared
                .counter(ENTRIES.len() + entry as usize)
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Violations recorded by this process.
    pub fn violations(&self) -> u64 {
        self.violations.load(Ordering::Relaxed)
    }

    /// The violation lines of this process recorded since the last call (for the double's tests).
    pub fn take_recent(&self) -> Vec<String> {
        std::mem::take(&mut *self.recent.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Records a failed call of `entry` (violations and rejected input; outcomes are not logged).
    pub fn record(&self, entry: Entry, fail: &Fail) {
        self.count_failure(entry);
        let expected = fail.class == Class::Violation
            && EXPECTED.with(|left| {
                let n = left.get();
                left.set(n.saturating_sub(1));
                n > 0
            });
        let file = match fail.class {
            Class::Outcome => return,
            Class::Violation if expected => "expected.log",
            Class::Violation => "violations.log",
            Class::Rejected => "rejected.log",
        };
        let line = format!(
            "pid={} call={} code={} rule: {}\n",
            std::process::id(),
            entry.name(),
            codes::name(fail.code),
            fail.message.replace('\n', " ")
        );
        if fail.class == Class::Violation && !expected {
            self.violations.fetch_add(1, Ordering::Relaxed);
            self.recent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(line.clone());
        }
        match &self.dir {
            Some(dir) => append(&dir.join(file), &line),
            None if fail.class == Class::Violation => {
                let _ = std::io::stderr().write_all(format!("cuda-double: {line}").as_bytes());
            }
            None => {}
        }
    }
}

thread_local! {
    /// Violations this thread announced it is about to commit on purpose
    /// ([`expect_violations`]).
    static EXPECTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Announces that the next `n` violations recorded on this thread are committed on purpose (a
/// test of a prohibition): they go to `expected.log` and are not counted. Replaces what was left.
pub fn expect_violations(n: u64) {
    EXPECTED.with(|left| left.set(n));
}

/// How many announced violations this thread has not committed (0 once all were reported).
pub fn expected_left() -> u64 {
    EXPECTED.with(std::cell::Cell::get)
}

/// Appends `line` with one write on an `O_APPEND` descriptor.
fn append(path: &std::path::Path, line: &str) {
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = file.write_all(line.as_bytes());
    }
}

/// Reads the counters of a report folder's `calls.bin` as `(entry name, calls, failed calls)`.
pub fn read_counts(dir: &std::path::Path) -> std::io::Result<Vec<(&'static str, u64, u64)>> {
    let bytes = std::fs::read(dir.join("calls.bin"))?;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    if bytes.len() != COUNTS_HEADER + 16 * ENTRIES.len()
        || &bytes[..8] != COUNTS_MAGIC
        || bytes[8..16] != fingerprint()
    {
        return Err(bad(
            "calls.bin was not written by this version of the double",
        ));
    }
    Ok(ENTRIES
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let word = |index: usize| {
                let at = COUNTS_HEADER + 8 * index;
                let mut word = [0u8; 8];
                word.copy_from_slice(&bytes[at..at + 8]);
                u64::from_ne_bytes(word)
            };
            (e.name(), word(i), word(ENTRIES.len() + i))
        })
        .collect())
}
