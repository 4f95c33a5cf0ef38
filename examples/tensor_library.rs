//! A tensor library adopting cudalloc, written the way a small cudarc-based library would be:
//!
//! 1. configures `GLOBAL` from code (`GLOBAL.init`), before anything allocates;
//! 2. hands cudalloc the stream it already has (`import_stream`), makes it the default stream of
//!    its device (`set_default_stream`: allocation, copies, copy-on-write copies and IPC receipts
//!    use it on every thread, with no guard anywhere), and runs its kernels on it — on CUDA
//!    through cudarc on typed views (feature `cudarc`), on the host backend as typed host kernels
//!    (`Runtime::launch_host`, the storage seen as `&mut [f32]`), so the same library code is tested on a laptop — and under the stream
//!    sanitizer (`CUDALLOC_SANITIZE=1`, what CI runs a second time);
//! 3. shares a tensor with a child process (which adds to it and sends it back) and reads stats.
//!
//! ```text
//! cargo run --example tensor_library                      # host backend (what CI runs)
//! CUDALLOC_BACKEND=cuda cargo run --example tensor_library --features cudarc   # a GPU
//! ```

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use cudalloc::{
    backend::BackendChoice, ipc::IpcHandle, AllocatorConfig, Error, Result, Runtime, Storage,
    StreamId, GLOBAL,
};

/// The library's tensor: `len` f32 values on a stream.
struct Tensor {
    storage: Storage,
    len: usize,
    stream: StreamId,
}

impl Tensor {
    fn zeros(len: usize, stream: StreamId) -> Result<Tensor> {
        let storage = GLOBAL.storage_on(stream, (len * 4) as u64)?;
        let t = Tensor {
            storage,
            len,
            stream,
        };
        t.add_scalar(0.0)?; // writes every element (zeros + 0)
        Ok(t)
    }

    /// `self[i] += value` for every element, as a kernel on the tensor's stream.
    fn add_scalar(&self, value: f32) -> Result<()> {
        let runtime = GLOBAL.get()?;
        if runtime.driver().as_host().is_none() {
            return self.add_scalar_cuda(value);
        }
        // A typed host kernel: the storage, seen as `&mut [f32]`, ordered by the storage.
        runtime.launch_host(self.stream, self.storage.writes::<f32>(), move |x| {
            x.iter_mut().for_each(|v| *v += value);
            Ok(())
        })
    }

    #[cfg(feature = "cudarc")]
    fn add_scalar_cuda(&self, value: f32) -> Result<()> {
        use cudalloc::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
        const SOURCE: &str = r#"extern "C" __global__ void add_scalar(float *x, unsigned long long n, float v) {
            for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += v;
        }"#;
        // cudarc's driver errors convert into cudalloc's (their code kept): `?` works.
        let ctx = CudaContext::new(0)?;
        let stream = ctx.new_stream()?;
        let ptx = cudalloc::cudarc::nvrtc::compile_ptx(SOURCE)
            .map_err(|e| Error::InvalidArgument(format!("NVRTC: {e}")))?;
        let module = ctx.load_module(ptx)?;
        let f = module.load_function("add_scalar")?;
        let mut view = self.storage.view_mut::<f32>(0..self.len, &stream)?;
        let n = self.len as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut view).arg(&n).arg(&value);
        // SAFETY: add_scalar takes (float*, u64, float) and touches `n` floats of the view.
        unsafe { launch.launch(LaunchConfig::for_num_elems(self.len as u32)) }?;
        // Waited through cudalloc's driver, which the stream sanitizer sees (cudarc's own
        // `stream.synchronize()` is invisible to it); the stream adopted without `unsafe`.
        let runtime = GLOBAL.get()?;
        let id = runtime.adopt_cudarc_stream(0, &stream)?;
        runtime.driver().stream_synchronize(id)
    }

    #[cfg(not(feature = "cudarc"))]
    fn add_scalar_cuda(&self, _value: f32) -> Result<()> {
        Err(Error::InvalidArgument(
            "this example launches CUDA kernels through cudarc: build it with --features cudarc"
                .into(),
        ))
    }

    fn to_vec(&self) -> Result<Vec<f32>> {
        // On the default stream (the library's): in stream order, returns when it is done.
        let mut bytes = vec![0u8; self.len * 4];
        self.storage.copy_to_host(self.stream, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// The library's own stream, as it would have made it before adopting cudalloc, imported and
/// made the device's default: every allocation, copy and receipt is ordered on it.
fn library_stream() -> Result<StreamId> {
    let runtime = GLOBAL.get()?;
    let driver = runtime.driver();
    let raw = driver.interop().raw_stream(driver.stream_create(0)?)?;
    // SAFETY: `raw` names a live stream of device 0 that this program never destroys.
    let stream = unsafe { GLOBAL.get()?.import_stream(0, raw) }?;
    GLOBAL.get()?.set_default_stream(stream)?;
    Ok(stream)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Result<Vec<u8>> {
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| Error::InvalidArgument("bad hex".into()))
        })
        .collect()
}

/// The child: opens the tensor, adds 1, says done.
fn child() -> Result<()> {
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let handle = IpcHandle::from_bytes(&unhex(line.trim())?)?;
    // The library's stream first: the receipt waits for the producer's event on it.
    let stream = library_stream()?;
    let storage = Storage::from_ipc(GLOBAL.get()?, handle)?;
    let tensor = Tensor {
        len: (storage.nbytes() / 4) as usize,
        storage,
        stream,
    };
    tensor.add_scalar(1.0)?;
    let sum: f32 = tensor.to_vec()?.iter().sum();
    println!("child sum {sum}");
    Ok(())
}

fn main() -> Result<()> {
    let config = AllocatorConfig::parse("max_split_size_mb:64,default_stream:legacy")?;
    GLOBAL.init(
        Runtime::builder().config(config),
        BackendChoice::from_env()?,
    )?;
    if std::env::args().nth(1).as_deref() == Some("child") {
        return child();
    }
    println!("backend: {}", GLOBAL.backend()?);
    if let Some(why) = GLOBAL.fallback_reason()? {
        println!("  (CUDA not used: {why})");
    }
    let stream = library_stream()?;
    let t = Tensor::zeros(1024, stream)?;
    t.add_scalar(2.5)?;
    assert!(t.to_vec()?.iter().all(|&x| x == 2.5));

    // Share with a child process, which adds 1.
    let handle = t.storage.share_ipc()?;
    let io = |e: std::io::Error| Error::InvalidArgument(format!("child process: {e}"));
    let exe = std::env::current_exe().map_err(io)?;
    let mut child = Command::new(exe)
        .arg("child")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(io)?;
    let mut to_child = child
        .stdin
        .take()
        .ok_or_else(|| io(std::io::ErrorKind::BrokenPipe.into()))?;
    writeln!(to_child, "{}", hex(&handle.into_bytes())).map_err(io)?;
    let mut reply = String::new();
    let out = child
        .stdout
        .take()
        .ok_or_else(|| io(std::io::ErrorKind::BrokenPipe.into()))?;
    BufReader::new(out).read_line(&mut reply).map_err(io)?;
    let status = child.wait().map_err(io)?;
    println!("{}", reply.trim());
    if !status.success() || reply.trim() != "child sum 3584" {
        return Err(Error::InvalidArgument(format!(
            "the child failed: {status}, {reply:?}"
        )));
    }
    assert!(
        t.to_vec()?.iter().all(|&x| x == 3.5),
        "the child's write is visible here"
    );

    let stats = GLOBAL.get()?.memory_stats_map(0)?;
    println!(
        "allocated {} bytes in {} allocations; reserved {} bytes",
        stats["allocated_bytes.all.current"],
        stats["allocation.all.allocated"],
        stats["reserved_bytes.all.current"]
    );
    Ok(())
}
