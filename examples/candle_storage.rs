//! A candle-style CUDA storage on cudalloc (feature `cudarc`): where candle keeps a `CudaSlice<f32>`
//! and a `CudaStream`, this library keeps a cudalloc [`Storage`] and the same cudarc stream, and
//! hands cudarc a typed view wherever it would hand it the slice — to its own kernels
//! (`launch_builder(..).arg(&view)`) and to cuBLAS (`Gemm::gemm(cfg, &a, &b, &mut c)`).
//!
//! 1. the library's cudarc stream is adopted without `unsafe` (`adopt_cudarc_stream`);
//! 2. tensors are allocated on it, filled from the host and read back (`copy_from_host`);
//! 3. a lazy clone costs a count, and its first write through a `view_mut` copies it first;
//! 4. `matmul` is cuBLAS's `sgemm` on three views (row-major, as candle calls it), checked against
//!    the host's product — where `libcublas` loads; elsewhere (the contract double of
//!    `scripts/cuda-double.sh` has no cuBLAS) the step says it was skipped and why;
//! 5. every failure is a `cudalloc::Error` or cuBLAS's own, returned with `?`.
//!
//! ```text
//! cargo run --example candle_storage --features cudarc      # a GPU, or the double via scripts/cuda-double.sh
//! ```

use std::error::Error as StdError;
use std::sync::Arc;

use cudalloc::backend::CudaDriver;
use cudalloc::cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudalloc::cudarc::driver::{CudaContext, CudaStream};
use cudalloc::{Runtime, Storage, StreamId};

type Result<T> = std::result::Result<T, Box<dyn StdError>>;

/// The library's storage of `len` f32 values, as candle's `CudaStorage` would hold a slice.
struct CudaTensor {
    storage: Storage,
    stream: Arc<CudaStream>,
    id: StreamId,
    len: usize,
}

impl CudaTensor {
    /// A tensor holding `values`, allocated and written on the library's stream.
    fn from_host(runtime: &Arc<Runtime>, stream: &Arc<CudaStream>, values: &[f32]) -> Result<Self> {
        let id = runtime.adopt_cudarc_stream(0, stream)?;
        let storage = Storage::new_on(runtime, id, std::mem::size_of_val(values) as u64)?;
        storage.copy_from_host(id, 0, bytes_of(values))?;
        Ok(CudaTensor {
            storage,
            stream: Arc::clone(stream),
            id,
            len: values.len(),
        })
    }

    /// The values, read on the tensor's stream.
    fn to_host(&self) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; self.len * 4];
        self.storage.copy_to_host(self.id, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// candle's `try_clone`: a lazy clone, copied only when one side is written.
    fn try_clone(&self) -> Result<Self> {
        Ok(CudaTensor {
            storage: self.storage.lazy_clone()?,
            stream: Arc::clone(&self.stream),
            id: self.id,
            len: self.len,
        })
    }

    /// `self (m × k) · rhs (k × n)`, row-major, through cuBLAS on the tensor's stream.
    fn matmul(
        &self,
        rhs: &CudaTensor,
        blas: &CudaBlas,
        (m, k, n): (usize, usize, usize),
    ) -> Result<Self> {
        let runtime = self.storage.runtime();
        let out = CudaTensor {
            storage: Storage::new_on(runtime, self.id, (m * n * 4) as u64)?,
            stream: Arc::clone(&self.stream),
            id: self.id,
            len: m * n,
        };
        // cuBLAS is column-major: a row-major product C = A·B is the column-major Cᵀ = Bᵀ·Aᵀ.
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: n as i32,
            ldb: k as i32,
            beta: 0.0,
            ldc: n as i32,
        };
        {
            let a = rhs.storage.view::<f32>(0..k * n, &self.stream)?;
            let b = self.storage.view::<f32>(0..m * k, &self.stream)?;
            let mut c = out.storage.view_mut::<f32>(0..m * n, &self.stream)?;
            // SAFETY: the views hold k·n, m·k and m·n f32 values, the sizes the configuration
            // names.
            unsafe { blas.gemm(cfg, &a, &b, &mut c) }?;
            for ordered in [a.ordered(), b.ordered(), c.ordered()] {
                ordered?;
            }
        }
        Ok(out)
    }
}

fn bytes_of(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

fn main() -> Result<()> {
    let driver = match CudaDriver::new() {
        Ok(driver) => driver,
        Err(err) => {
            println!("candle_storage: skipped: no CUDA driver ({err})");
            return Ok(());
        }
    };
    let runtime = Arc::new(Runtime::builder().build(Arc::new(driver))?);
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;

    let (m, k, n) = (64, 48, 32);
    let lhs_values: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
    let rhs_values: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.5).collect();
    let lhs = CudaTensor::from_host(&runtime, &stream, &lhs_values)?;
    let rhs = CudaTensor::from_host(&runtime, &stream, &rhs_values)?;
    assert_eq!(lhs.to_host()?, lhs_values, "a round trip keeps the values");

    // A lazy clone shares the bytes until its first write, which copies them first.
    let clone = lhs.try_clone()?;
    assert!(
        clone.storage.is_cow() && lhs.storage.is_cow(),
        "the clone shares the bytes"
    );
    drop(clone.storage.view_mut::<f32>(0..clone.len, &clone.stream)?);
    assert!(
        !clone.storage.is_cow(),
        "the write view made a private copy"
    );
    assert_eq!(
        clone.to_host()?,
        lhs_values,
        "the private copy holds the source's bytes"
    );
    println!("storages, views and a lazy clone: right");

    // SAFETY: only asks whether the library file loads.
    if !unsafe { cudalloc::cudarc::cublas::sys::is_culib_present() } {
        println!("matmul: skipped: libcublas was not found (the contract double has no cuBLAS)");
        return Ok(());
    }
    let blas = CudaBlas::new(Arc::clone(&stream))?;
    let product = lhs.matmul(&rhs, &blas, (m, k, n))?.to_host()?;
    let mut worst = 0f32;
    for i in 0..m {
        for j in 0..n {
            let expected: f32 = (0..k)
                .map(|p| lhs_values[i * k + p] * rhs_values[p * n + j])
                .sum();
            worst = worst.max((product[i * n + j] - expected).abs());
        }
    }
    assert!(
        worst < 1e-3,
        "cuBLAS's product differs from the host's by {worst}"
    );
    println!("matmul through cuBLAS on three views: right (largest difference {worst})");
    stats(&runtime)
}

fn stats(runtime: &Runtime) -> Result<()> {
    let stats = runtime.memory_stats(0)?;
    println!(
        "allocated now: {} bytes in {} allocations",
        stats.allocated_bytes.all.current, stats.allocation.all.current
    );
    Ok(())
}
