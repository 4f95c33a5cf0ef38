//! What the double's own test scenarios share: asserting a call's code and the violations it
//! recorded.
#![allow(dead_code, clippy::unwrap_used)]

use cuda_double::codes::{self, CuResult};
use cuda_double::report::report;

/// Asserts the result code and that exactly one violation mentioning `rule` was recorded.
pub fn violates(code: CuResult, expected: CuResult, rule: &str) {
    let recent = report().take_recent();
    assert_eq!(code, expected, "{}: {recent:?}", codes::name(code));
    assert_eq!(
        recent.len(),
        1,
        "one violation expected for {rule:?}: {recent:?}"
    );
    assert!(recent[0].contains(rule), "{rule:?} not in {:?}", recent[0]);
}

/// Asserts the result code and that no violation was recorded.
pub fn clean(code: CuResult, expected: CuResult) {
    let recent = report().take_recent();
    assert_eq!(code, expected, "{}: {recent:?}", codes::name(code));
    assert!(recent.is_empty(), "unexpected violation: {recent:?}");
}
