//! The kernels of `kernels/*.cu`, compiled at run time with NVRTC and loaded per device.
//!
//! The sources are embedded in the binary (`include_str!`), so a deployed binary needs only the
//! NVRTC library, not the source tree. [`compile_all`] is also what the kernel compile check in CI
//! calls (with the NVRTC wheel from PyPI and no GPU).

use cudarc::nvrtc::{self, CompileOptions};

use crate::error::{Error, Result};
use crate::sync::os::OnceLock;

/// `(file name, source)` of every kernel file.
pub const SOURCES: [(&str, &str); 3] = [
    ("pattern.cu", include_str!("../../../kernels/pattern.cu")),
    ("poison.cu", include_str!("../../../kernels/poison.cu")),
    ("sleep.cu", include_str!("../../../kernels/sleep.cu")),
];

/// `(file name, PTX)` of every kernel file.
#[derive(Clone, Debug)]
pub struct CompiledKernels {
    /// PTX text per source file, in [`SOURCES`] order.
    pub ptx: Vec<(&'static str, String)>,
}

/// Whether the NVRTC library can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen candidate library names; no symbols are called.
    unsafe { nvrtc::sys::is_culib_present() }
}

/// Compiles every kernel file to PTX with NVRTC.
pub fn compile_all() -> Result<CompiledKernels> {
    if !nvrtc_present() {
        return Err(Error::NoCudaDriver(
            "the NVRTC library (libnvrtc.so) was not found; install the CUDA toolkit or the \
             nvidia-cuda-nvrtc-cu12 wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let mut ptx = Vec::with_capacity(SOURCES.len());
    for (name, source) in SOURCES {
        let opts = CompileOptions {
            name: Some(name.to_owned()),
            ..Default::default()
        };
        let compiled = nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| Error::Driver {
            source: None,
            backend: "cuda",
            call: "nvrtcCompileProgram",
            message: format!("{name}: {e}"),
        })?;
        ptx.push((name, compiled.to_src()));
    }
    Ok(CompiledKernels { ptx })
}

/// The PTX of all kernels, compiled once per process.
pub(crate) fn compiled() -> Result<&'static CompiledKernels> {
    static COMPILED: OnceLock<std::result::Result<CompiledKernels, String>> = OnceLock::new();
    COMPILED
        .get_or_init(|| compile_all().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|message| Error::Driver {
            source: None,
            backend: "cuda",
            call: "nvrtc",
            message: message.clone(),
        })
}
