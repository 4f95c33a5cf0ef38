//! Says, in the test summary itself, which evidence could not run on this machine: the CUDA
//! backend's cases print `skipped: ...` inside tests that then report `ok`, which libtest only
//! shows with `--nocapture`. This harness-less test prints one line per kind of evidence, always.

use cudalloc::backend::CudaDriver;
use cudalloc::internals::kernels::nvrtc_present;

fn main() {
    match CudaDriver::new() {
        Ok(d) => {
            let name = cudalloc::backend::Driver::device_name(&d, 0).unwrap_or_default();
            println!("evidence: CUDA backend cases RAN on {name}");
        }
        Err(err) => println!(
            "evidence: CUDA backend cases SKIPPED here ({err}); they run in CI on the contract \
             double (scripts/cuda-double.sh) and on a GPU (scripts/gpu-check.sh)"
        ),
    }
    if nvrtc_present() {
        println!("evidence: kernels/*.cu NVRTC compile check RAN");
    } else {
        println!(
            "evidence: kernels/*.cu NVRTC compile check SKIPPED (no libnvrtc on LD_LIBRARY_PATH; \
             CI installs the nvidia-cuda-nvrtc-cu12 wheel)"
        );
    }
}
