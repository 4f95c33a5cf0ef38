//! Regressions the CUDA contract double (`tools/cuda-double`) found in `CudaDriver`: each scenario
//! must end without a contract violation recorded by the double. Outside a run on the double
//! (`scripts/cuda-double.sh`) these print that they were skipped and why.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use cudalloc::backend::capability::Ipc;
use cudalloc::{backend::CudaDriver, backend::Driver, ErrorKind};

/// A CUDA driver on the double, or `None` (with the skip line).
fn on_double(test: &str) -> Option<CudaDriver> {
    let driver = match CudaDriver::new() {
        Ok(d) => d,
        Err(err) => {
            println!("{test}: skipped: no CUDA driver ({err})");
            return None;
        }
    };
    if double_violations().is_none() {
        println!("{test}: skipped: the loaded libcuda is not the contract double");
        return None;
    }
    Some(driver)
}

#[test]
fn opening_a_memory_handle_in_the_exporting_process_is_refused_before_cuda() {
    let Some(d) = on_double("opening_a_memory_handle_in_the_exporting_process") else {
        return;
    };
    let before = double_violations().unwrap();
    let p = d.malloc(0, 1 << 20).unwrap();
    let handle = d.ipc_export_memory(p).unwrap();
    let err = d.ipc_open_memory(0, &handle).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    // A second driver of the same process is the same process to CUDA.
    let other = CudaDriver::new().unwrap();
    let err = other.ipc_open_memory(0, &handle).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    d.free(p).unwrap();
    assert_eq!(
        double_violations().unwrap(),
        before,
        "the double saw a violation"
    );
}
