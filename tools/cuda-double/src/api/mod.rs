//! The exported C entry points, grouped by concern. Each one counts its call, runs its body
//! under `catch_unwind` (a panic must never cross the C boundary) and records any failure in the
//! report before returning its code.

pub mod device;
pub mod graph;
pub mod host;
pub mod ipc;
pub mod memory;
pub mod module;
pub mod stream;
pub mod vm;

use crate::codes::{self, CuResult};
use crate::report::{report, Checked, Entry, Fail};

/// Runs the body of entry point `entry`.
pub(crate) fn api(entry: Entry, body: impl FnOnce() -> Checked<()>) -> CuResult {
    report().count(entry);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
        .unwrap_or_else(|_| Err(Fail::violation(codes::UNKNOWN, "the double panicked")));
    match outcome {
        Ok(()) => codes::SUCCESS,
        Err(fail) => {
            report().record(entry, &fail);
            fail.code
        }
    }
}

/// Writes `value` through the caller's out-pointer `out` (null is a violation).
///
/// # Safety
/// A non-null `out` must be valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T, what: &str) -> Checked<()> {
    if out.is_null() {
        return Err(Fail::violation(
            codes::INVALID_VALUE,
            format!("{what} is a null out-pointer"),
        ));
    }
    // SAFETY: non-null, and valid for writes by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Violations this process has recorded: not a CUDA entry point — tests look it up with `dlsym`
/// to assert that a scenario broke no rule.
#[no_mangle]
pub extern "C" fn cuda_double_violations() -> u64 {
    report().violations()
}

/// Announces that the next `n` violations on this thread are committed on purpose (a test of a
/// prohibition, e.g. a call prohibited during a stream capture): they are logged to
/// `expected.log`, not counted. Not a CUDA entry point; tests look it up with `dlsym`.
#[no_mangle]
pub extern "C" fn cuda_double_expect_violations(n: u64) {
    crate::report::expect_violations(n);
}

/// Announced violations this thread has not committed yet: a test asserts 0 after the prohibited
/// calls (the double did flag each one).
#[no_mangle]
pub extern "C" fn cuda_double_expected_left() -> u64 {
    crate::report::expected_left()
}
