//! # cuda-double: a strict contract double of the CUDA driver API
//!
//! Built as `libcuda.so`, this crate stands in for NVIDIA's driver library so that cudalloc's
//! CUDA backend (`CudaDriver`, through cudarc's dynamic loading) executes in CI on machines
//! without a GPU. Put the folder holding `libcuda.so` / `libcuda.so.1` on `LD_LIBRARY_PATH`
//! (`scripts/cuda-double.sh` does it) and every process loads the double instead of a driver.
//!
//! ## What it proves, and what it cannot
//!
//! It proves that the CUDA backend *executes* — every entry point it uses is called — and that
//! each call honours the documented contract of the driver API: `cuInit` first, a current
//! context for context-bound calls, handles valid, of the right kind and not destroyed, stream
//! order and event semantics (`CUDA_ERROR_NOT_READY`, most-recent-record waits), the IPC rules,
//! launch limits, and finite device memory (`CUDA_ERROR_OUT_OF_MEMORY`). Every breach is recorded
//! as a *violation* (`report.rs`) and the run fails on any.
//!
//! It cannot prove real device semantics (memory model, caching, peer access, timing), the
//! behaviour of NVIDIA's driver where its documentation is silent, or the absence of driver
//! bugs. Kernels run as native code with the effect of the CUDA source, not as PTX.
//! `scripts/gpu-check.sh` on a real GPU remains the proof.
//!
//! ## How it emulates a device
//!
//! | CUDA                | the double                                                          |
//! |---------------------|---------------------------------------------------------------------|
//! | device memory       | a `memfd` region per allocation (`region.rs`), at device addresses never reused (`memory.rs`) |
//! | stream              | a worker thread running queued work in order (`stream.rs`)          |
//! | event               | two counters in a cell, in shared memory when interprocess (`event.rs`) |
//! | IPC handle          | `(pid, fd, id)` of the region, opened through `/proc/<pid>/fd`       |
//! | module / kernel     | PTX parsed for its entries; launches run native code (`module.rs`, `kernels.rs`) |
//! | stream capture, graph | nodes recorded per capture, replayed in order on the launch stream (`capture.rs`) |
//! | devices             | `CUDA_DOUBLE_DEVICES` (default 2) of `CUDA_DOUBLE_MEMORY` bytes (default 1 GiB), counted per process |
//!
//! Where the double is stricter than some drivers it says so at the rule: work is submitted with
//! the stream's context current; a memory handle is opened once per process.
//!
//! This is test tooling, separate from the cudalloc library: it uses `std::sync` and `libc`
//! directly (cudalloc's one-module rules for `memmap2`/`std::sync` apply to cudalloc).

pub mod capture;
pub mod codes;
pub mod event;
pub mod host;
pub mod kernels;
pub mod memory;
pub mod module;
pub mod region;
pub mod report;
pub mod state;
pub mod stream;
pub mod vm;

pub mod api;
