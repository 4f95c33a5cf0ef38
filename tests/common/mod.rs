//! Helpers shared by the integration tests: the backends present on this machine, child processes
//! (the test binary re-executed as a child), and shared-memory leak checks.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(crate) mod faulty;
pub(crate) mod forked;
pub(crate) mod rng;
pub(crate) mod storage;

use cudalloc::{backend::CudaDriver, backend::Driver, backend::HostDriver};

/// Environment variable naming a child process's role.
pub(crate) const ROLE_VAR: &str = "CUDALLOC_TEST_CHILD_ROLE";
/// Environment variable naming the backend a child uses.
pub(crate) const BACKEND_VAR: &str = "CUDALLOC_TEST_CHILD_BACKEND";
/// Prefix of protocol lines on a child's stdout (libtest prints its own lines too).
const PREFIX: &str = "@@cudalloc ";

/// A host driver sized for tests: 2 devices of 64 MiB.
pub(crate) fn host_driver() -> HostDriver {
    HostDriver::builder()
        .devices(2)
        .memory_per_device(64 << 20)
        .build()
        .unwrap()
}

/// `driver` checked by the stream sanitizer when `CUDALLOC_SANITIZE` asks for it (the suites'
/// own driver calls are then checked as well as the allocator's).
pub(crate) fn sanitized(driver: Arc<dyn Driver>) -> Arc<dyn Driver> {
    match cudalloc::sanitizer::SanitizeOptions::from_env().unwrap() {
        Some(options) => cudalloc::backend::SanitizedDriver::wrap(driver, options),
        None => driver,
    }
}

/// The CUDA backend's device belongs to the whole test process (one double or one GPU under every
/// test thread, where each host-backend test builds its own devices): a test that reads its free
/// memory or fills it holds it alone, one that only uses it shares it, so no concurrent test moves
/// the figures a test checks.
static DEVICE: RwLock<()> = RwLock::new(());

/// The process's device, shared with the other tests that only use it.
pub(crate) fn device_shared() -> RwLockReadGuard<'static, ()> {
    DEVICE.read().unwrap_or_else(PoisonError::into_inner)
}

/// The process's device, alone (for a test that measures or fills it).
pub(crate) fn device_alone() -> RwLockWriteGuard<'static, ()> {
    DEVICE.write().unwrap_or_else(PoisonError::into_inner)
}

/// A backend under test.
pub(crate) struct TestBackend {
    /// `"host"` or `"cuda"`.
    pub name: &'static str,
    /// The driver.
    pub driver: Arc<dyn Driver>,
    /// The same driver, typed, when it is the host backend (for host-only facilities).
    pub host: Option<Arc<HostDriver>>,
}

/// Whether the suites run on the CUDA backend: `CUDALLOC_BACKEND=cuda` (on a GPU, or on the
/// contract double of `tools/cuda-double` in CI — `scripts/cuda-double.sh`).
pub(crate) fn cuda_suite() -> bool {
    std::env::var("CUDALLOC_BACKEND").is_ok_and(|b| b.trim() == "cuda")
}

/// The driver a backend-independent test runs on: CUDA in a CUDA run ([`cuda_suite`]), else the
/// host backend ([`host_driver`]). A CUDA run without a usable driver is a failure, not a skip:
/// it was asked for explicitly.
pub(crate) fn test_driver() -> Arc<dyn Driver> {
    sanitized(test_driver_unchecked())
}

/// A driver for a suite that sizes its device, unchecked by the sanitizer (callers wrap it with
/// [`sanitized`] or their own options), and the setting that makes `bytes` the allocator's limit:
/// the host backend with one device of `bytes` (no setting needed), or in a CUDA run the CUDA
/// backend with `per_process_memory_fraction` capping the allocator at `bytes`, so out-of-memory
/// cases mean the same on both. Run such suites one test at a time on the double (its device is
/// shared by the tests of a process).
pub(crate) fn sized_driver(bytes: u64) -> (Arc<dyn Driver>, String) {
    if !cuda_suite() {
        let host = HostDriver::builder()
            .devices(1)
            .memory_per_device(bytes)
            .build()
            .unwrap();
        return (Arc::new(host), String::new());
    }
    let cuda: Arc<dyn Driver> = Arc::new(CudaDriver::new().unwrap_or_else(|e| {
        panic!("CUDALLOC_BACKEND=cuda but the CUDA backend cannot start: {e}")
    }));
    let total = cuda.mem_info(0).unwrap().total;
    assert!(
        bytes <= total,
        "{bytes} bytes asked of a {total}-byte device"
    );
    let fraction = bytes as f64 / total as f64;
    (cuda, format!("per_process_memory_fraction:{fraction}"))
}

/// `a` and `b` joined as one allocator setting.
pub(crate) fn join_conf(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_owned(),
        (_, true) => a.to_owned(),
        _ => format!("{a},{b}"),
    }
}

/// [`test_driver`] without the sanitizer (for tests that wrap it with options of their own).
pub(crate) fn test_driver_unchecked() -> Arc<dyn Driver> {
    if cuda_suite() {
        Arc::new(CudaDriver::new().unwrap_or_else(|e| {
            panic!("CUDALLOC_BACKEND=cuda but the CUDA backend cannot start: {e}")
        }))
    } else {
        Arc::new(host_driver())
    }
}

/// The backend name [`test_driver`] uses (`"cuda"` or `"host"`).
pub(crate) fn test_backend() -> &'static str {
    if cuda_suite() {
        "cuda"
    } else {
        "host"
    }
}

/// The contract double's extra symbol `name` (not a CUDA entry point), when the loaded `libcuda`
/// is the double.
fn double_symbol(name: &std::ffi::CStr) -> Option<*mut libc::c_void> {
    // SAFETY: RTLD_NOLOAD only looks up an already loaded library; dlclose balances the dlopen
    // (the library stays loaded: the process holds it).
    unsafe {
        let lib = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        if lib.is_null() {
            return None;
        }
        let sym = libc::dlsym(lib, name.as_ptr());
        libc::dlclose(lib);
        (!sym.is_null()).then_some(sym)
    }
}

/// Violations the CUDA contract double has recorded in this process, or `None` when the loaded
/// `libcuda` is not the double (a real driver, or none).
pub(crate) fn double_violations() -> Option<u64> {
    let sym = double_symbol(c"cuda_double_violations")?;
    // SAFETY: the double's `extern "C" fn() -> u64`.
    let f: extern "C" fn() -> u64 = unsafe { std::mem::transmute(sym) };
    Some(f())
}

/// The `cudalloc` command: `CUDALLOC_CLI` when set (a machine that runs carried test binaries
/// has it elsewhere than where cargo built it), else cargo's build of it.
pub(crate) fn cli() -> std::path::PathBuf {
    std::env::var_os("CUDALLOC_CLI")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_cudalloc").into())
}

/// Whether the suites run on a real GPU: the CUDA backend over a `libcuda` that is not the
/// contract double (asked after the driver loaded it).
pub(crate) fn real_gpu() -> bool {
    cuda_suite() && !on_the_double()
}

/// Whether the loaded `libcuda` is the contract double.
pub(crate) fn on_the_double() -> bool {
    double_symbol(c"cuda_double_violations").is_some()
}

/// The free device memory a test expects back once it freed everything: the whole device on the
/// host backend and on the double; on a GPU, what is free after a warm-up — CUDA keeps memory for
/// its context, the loaded kernels and graph launches, which no free of cudalloc's gives back.
pub(crate) fn free_baseline(driver: &Arc<dyn Driver>) -> u64 {
    let total = driver.mem_info(0).unwrap().total;
    if !real_gpu() {
        return total;
    }
    let stream = driver.stream_create(0).unwrap();
    let ptr = driver.malloc(0, 1 << 21).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { driver.kernels().fill_pattern(stream, ptr, 1 << 21, 1) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        driver
            .kernels()
            .count_pattern_mismatches(stream, ptr, 1 << 21, 1)
    }
    .unwrap();
    let graphs = driver.graphs();
    graphs
        .stream_begin_capture(stream, cudalloc::graph::CaptureMode::ThreadLocal)
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { driver.memset(stream, ptr, 0, 4096) }.unwrap();
    let graph = graphs.stream_end_capture(stream).unwrap();
    let exec = graphs.graph_instantiate(graph).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { graphs.graph_launch(exec, stream) }.unwrap();
    driver.stream_synchronize(stream).unwrap();
    graphs.graph_exec_destroy(exec).unwrap();
    graphs.graph_destroy(graph).unwrap();
    driver.free(ptr).unwrap();
    driver.stream_destroy(stream).unwrap();
    driver.mem_info(0).unwrap().free
}

/// Announces to the contract double that this thread is about to commit `n` prohibited driver
/// calls on purpose (a test of a prohibition): they are logged as expected, not as violations.
/// Returns whether the double is loaded (elsewhere nothing is announced).
pub(crate) fn expect_double_violations(n: u64) -> bool {
    let Some(sym) = double_symbol(c"cuda_double_expect_violations") else {
        return false;
    };
    // SAFETY: the double's `extern "C" fn(u64)`.
    let f: extern "C" fn(u64) = unsafe { std::mem::transmute(sym) };
    f(n);
    true
}

/// Announced violations this thread has not committed yet (0: the double flagged every one), or
/// `None` without the double.
pub(crate) fn double_expected_left() -> Option<u64> {
    let sym = double_symbol(c"cuda_double_expected_left")?;
    // SAFETY: the double's `extern "C" fn() -> u64`.
    let f: extern "C" fn() -> u64 = unsafe { std::mem::transmute(sym) };
    Some(f())
}

/// Every backend present: the host backend always, CUDA when a driver and a device exist. Prints
/// "skipped: no CUDA driver" for the CUDA case otherwise. In a CUDA run ([`cuda_suite`]) only
/// CUDA: the host backend had its run.
pub(crate) fn backends(test: &str) -> Vec<TestBackend> {
    if cuda_suite() {
        return vec![TestBackend {
            name: "cuda",
            driver: test_driver(),
            host: None,
        }];
    }
    let host = Arc::new(host_driver());
    let mut out = vec![TestBackend {
        name: "host",
        driver: sanitized(host.clone()),
        host: Some(host),
    }];
    match CudaDriver::new() {
        Ok(cuda) => out.push(TestBackend {
            name: "cuda",
            driver: sanitized(Arc::new(cuda)),
            host: None,
        }),
        Err(err) => println!("{test} [cuda]: skipped: no CUDA driver ({err})"),
    }
    out
}

/// Whether the CUDA backend can run here; prints the skip line when it cannot.
pub(crate) fn cuda_present(test: &str) -> bool {
    match CudaDriver::new() {
        Ok(_) => true,
        Err(err) => {
            println!("{test} [cuda]: skipped: no CUDA driver ({err})");
            false
        }
    }
}

/// The driver a child process uses for `backend`.
pub(crate) fn child_driver(backend: &str) -> Arc<dyn Driver> {
    sanitized(match backend {
        "cuda" => Arc::new(CudaDriver::new().unwrap()),
        _ => Arc::new(host_driver()),
    })
}

/// The driver of a child process, on the backend its parent named ([`ChildProcess::spawn`]).
pub(crate) fn child_test_driver() -> Arc<dyn Driver> {
    child_driver(&std::env::var(BACKEND_VAR).unwrap_or_else(|_| "host".into()))
}

/// Hex encoding of a handle for the line protocol.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Inverse of [`hex`].
pub(crate) fn unhex(text: &str) -> Vec<u8> {
    assert_eq!(text.len() % 2, 0, "odd hex length {}", text.len());
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// Inverse of [`hex`] for 64-byte handles.
pub(crate) fn unhex64(text: &str) -> [u8; 64] {
    unhex(text)
        .try_into()
        .unwrap_or_else(|v: Vec<u8>| panic!("handle hex has {} bytes", v.len()))
}

/// Starts `command` with piped stdin and stdout.
pub(crate) fn spawn_piped(command: &mut Command) -> (Child, ChildStdin, BufReader<ChildStdout>) {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (child, stdin, stdout)
}

/// A child process running one ignored test of the current test binary, talking over lines.
pub(crate) struct ChildProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// A command that re-executes this test binary running only `entry` (an `#[ignore]`d test) as
/// `role`.
pub(crate) fn child_command(entry: &str, role: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        entry,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_VAR, role);
    c
}

impl ChildProcess {
    /// Re-executes this test binary running only `entry` (an `#[ignore]`d test) as `role`.
    pub(crate) fn spawn(entry: &str, role: &str, backend: &str) -> Self {
        let mut command = child_command(entry, role);
        command.env(BACKEND_VAR, backend);
        let (child, stdin, stdout) = spawn_piped(&mut command);
        ChildProcess {
            child,
            stdin,
            stdout,
        }
    }

    /// [`Self::spawn`] in a pid namespace of its own (`unshare --pid --fork`, whose child is
    /// pid 1 there); `Err` says why the machine refuses it.
    pub(crate) fn spawn_in_pid_namespace(
        entry: &str,
        role: &str,
        backend: &str,
    ) -> Result<Self, String> {
        let probe = Command::new("unshare")
            .args(["--pid", "--fork", "true"])
            .stderr(std::process::Stdio::piped())
            .output()
            .map_err(|e| format!("`unshare` cannot run: {e}"))?;
        if !probe.status.success() {
            return Err(format!(
                "`unshare --pid --fork` failed: {}",
                String::from_utf8_lossy(&probe.stderr).trim()
            ));
        }
        let inner = child_command(entry, role);
        let mut command = Command::new("unshare");
        command
            .args(["--pid", "--fork"])
            .arg(inner.get_program())
            .args(inner.get_args())
            .env(ROLE_VAR, role)
            .env(BACKEND_VAR, backend);
        let (child, stdin, stdout) = spawn_piped(&mut command);
        Ok(ChildProcess {
            child,
            stdin,
            stdout,
        })
    }

    /// The child's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one line.
    pub(crate) fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// Receives the next protocol line (panics if the child exits first).
    pub(crate) fn recv(&mut self) -> String {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "child exited before answering");
            // libtest may have printed "test name ... " without a newline just before.
            if let Some(at) = line.find(PREFIX) {
                return line[at + PREFIX.len()..].trim_end().to_owned();
            }
        }
    }

    /// Waits for the child to exit (however it ends) and reaps it.
    pub(crate) fn wait(mut self) -> std::process::ExitStatus {
        drop(self.stdin);
        self.child.wait().unwrap()
    }

    /// Kills the child with SIGKILL and reaps it.
    pub(crate) fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits for the child and asserts it succeeded.
    pub(crate) fn finish(mut self) {
        drop(self.stdin);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "child failed: {status}");
    }
}

/// The parent's end of the line protocol, as seen from inside a child.
pub(crate) struct ParentLink {
    stdin: std::io::StdinLock<'static>,
}

impl ParentLink {
    /// The link of the current (child) process.
    pub(crate) fn new() -> Self {
        ParentLink {
            stdin: std::io::stdin().lock(),
        }
    }

    /// Sends one line to the parent.
    pub(crate) fn send(&self, line: &str) {
        // Written to the stdout handle directly: `println!` inside a test goes through libtest's
        // output capture.
        let mut out = std::io::stdout().lock();
        writeln!(out, "{PREFIX}{line}").unwrap();
        out.flush().unwrap();
    }

    /// Receives one line from the parent, or `None` once the parent closed the link.
    pub(crate) fn recv_or_eof(&mut self) -> Option<String> {
        let mut line = String::new();
        let n = self.stdin.read_line(&mut line).unwrap();
        (n > 0).then(|| line.trim_end().to_owned())
    }

    /// Receives one line from the parent.
    pub(crate) fn recv(&mut self) -> String {
        let mut line = String::new();
        let n = self.stdin.read_line(&mut line).unwrap();
        assert!(n > 0, "parent closed the link");
        line.trim_end().to_owned()
    }
}

/// `key=value` lookup in a space-separated protocol line.
pub(crate) fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(' ')
        .find_map(|kv| kv.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// Names in /dev/shm that start with `prefix`.
pub(crate) fn shm_names_with_prefix(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// A caching allocator with the invariant scanner on, over `driver`.
pub(crate) fn checked_allocator(driver: Arc<dyn Driver>, conf: &str) -> Arc<cudalloc::Runtime> {
    let config = test_config(conf);
    Arc::new(
        cudalloc::Runtime::builder()
            .config(config)
            .check_invariants(true)
            .build(driver)
            .unwrap(),
    )
}

/// Whether this run of the suites uses expandable segments (`CUDALLOC_TEST_EXPANDABLE=1`): the
/// allocator suites run a second time with them, as PyTorch's own suite does.
pub(crate) fn expandable_run() -> bool {
    std::env::var("CUDALLOC_TEST_EXPANDABLE").is_ok_and(|v| v == "1")
}

/// The allocator configuration `conf` with the settings of this run added (see
/// [`with_test_settings`]).
pub(crate) fn test_config(conf: &str) -> cudalloc::AllocatorConfig {
    cudalloc::AllocatorConfig::parse(&with_test_settings(conf)).unwrap()
}

/// `conf` with the settings of this run added: `expandable_segments:True` in an expandable run
/// (`CUDALLOC_TEST_EXPANDABLE=1`), `pass_through:True` in a pass-through run
/// (`CUDALLOC_TEST_PASS_THROUGH=1`: the suites that do not test caching run with nothing
/// cached, as a memcheck run of a library's suite would), `nvtx_regions:True` in an NVTX run
/// (`CUDALLOC_TEST_NVTX=1`: under an NVTX tool — compute-sanitizer, or CI's recorder in strict
/// mode — every block is a region of its heap). A key is given once: a suite that
/// sets it keeps its own value, and a suite that asks for a cache (`thread_cache_mb`,
/// `expandable_segments`) keeps it — pass-through refuses both.
pub(crate) fn with_test_settings(conf: &str) -> String {
    let mut out = conf.to_owned();
    let mut add = |setting: &str| {
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(setting);
    };
    if expandable_run() && !conf.contains("expandable_segments") {
        add("expandable_segments:True");
    }
    let caches = conf.contains("thread_cache_mb") || conf.contains("expandable_segments:True");
    if pass_through_run() && !expandable_run() && !caches && !conf.contains("pass_through") {
        add("pass_through:True");
    }
    if std::env::var("CUDALLOC_TEST_NVTX").is_ok_and(|v| v == "1") && !conf.contains("nvtx_regions")
    {
        add("nvtx_regions:True");
    }
    out
}

/// Whether this run passes every allocation through to the driver (`CUDALLOC_TEST_PASS_THROUGH=1`).
pub(crate) fn pass_through_run() -> bool {
    std::env::var("CUDALLOC_TEST_PASS_THROUGH").is_ok_and(|v| v == "1")
}

/// Holds `stream` busy: a gate on the host backend (deterministic), a 300 ms sleep kernel on CUDA.
/// Opening (or dropping) the returned value releases a gate; a sleep releases itself.
pub(crate) fn hold_stream(b: &TestBackend, stream: cudalloc::StreamId) -> Hold {
    match &b.host {
        Some(h) => Hold {
            gate: Some(h.gate_stream(stream).unwrap()),
            marker: None,
        },
        None => {
            b.driver.kernels().sleep(stream, 300_000).unwrap();
            let event = b
                .driver
                .event_create(
                    b.driver.stream_device(stream).unwrap(),
                    cudalloc::backend::EventFlags::default(),
                )
                .unwrap();
            b.driver.event_record(event, stream).unwrap();
            Hold {
                gate: None,
                marker: Some((Arc::clone(&b.driver), event)),
            }
        }
    }
}

/// A stream held by [`hold_stream`]: a gate on the host backend (held until dropped), and
/// elsewhere a sleep kernel followed by a marker event, which says whether the sleep still runs.
pub(crate) struct Hold {
    gate: Option<cudalloc::internals::StreamGate>,
    marker: Option<(Arc<dyn Driver>, cudalloc::backend::EventId)>,
}

impl Hold {
    /// Whether the stream is still held now. Work queued on it after the hold has not run, so
    /// asked after an allocation, `true` proves it was held throughout that allocation. A hold
    /// that ran out (a loaded machine slept longer than the kernel) proves nothing: the test
    /// skips the claim instead of failing on timing.
    pub(crate) fn still_held(&self) -> bool {
        match &self.marker {
            Some((driver, event)) => !driver.event_query(*event).unwrap(),
            None => self.gate.is_some(),
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        drop(self.gate.take());
        if let Some((driver, event)) = self.marker.take() {
            let _ = driver.event_destroy(event);
        }
    }
}

/// Makes `waiter` wait for the work queued so far on `waited`, through the runtime's driver (so
/// the stream sanitizer sees it).
pub(crate) fn wait_for(
    rt: &cudalloc::Runtime,
    waiter: cudalloc::StreamId,
    waited: cudalloc::StreamId,
) {
    rt.driver().stream_wait_stream(waiter, waited).unwrap();
}

/// A storage of `len` bytes allocated for `stream` and filled there with the pattern of `seed`.
// Never inlined: the sanitizer's tests look for this frame in Rust stacks, which an optimized
// build without debug information (the binaries carried to a GPU) only shows for real calls.
#[inline(never)]
pub(crate) fn filled_on(
    rt: &Arc<cudalloc::Runtime>,
    stream: cudalloc::StreamId,
    len: u64,
    seed: u64,
) -> cudalloc::Storage {
    let s = cudalloc::Storage::new_on(rt, stream, len).unwrap();
    let ptr = s.mutable_data_ptr_on(stream).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(stream, ptr, len, seed) }.unwrap();
    s
}

/// Storages of `sizes` allocated in tag `tag` on device 0, each filled with the pattern of
/// `seed` plus its index (sleep and wake suites).
pub(crate) fn tagged(
    rt: &Arc<cudalloc::Runtime>,
    tag: &str,
    sizes: &[u64],
    seed: u64,
) -> Vec<cudalloc::Storage> {
    let _in = rt.use_tag(tag, 0).unwrap();
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = cudalloc::Storage::new(rt, 0, n).unwrap();
            s.fill_pattern(seed + i as u64).unwrap();
            s
        })
        .collect()
}

/// `seed:handle` (hex) for a consumer: `s` shared, the pattern seed it holds.
pub(crate) fn offer_word(s: &cudalloc::Storage, seed: u64) -> String {
    format!("{seed}:{}", hex(&s.share_ipc().unwrap().into_bytes()))
}

/// The storage a `seed:handle` word ([`offer_word`]) names, opened on `rt`, and its seed.
pub(crate) fn open_offered(
    rt: &Arc<cudalloc::Runtime>,
    word: &str,
) -> cudalloc::Result<(cudalloc::Storage, u64)> {
    let (seed, handle) = word
        .split_once(':')
        .ok_or_else(|| cudalloc::Error::InvalidArgument(format!("not seed:handle: {word}")))?;
    let seed = seed
        .parse()
        .map_err(|_| cudalloc::Error::InvalidArgument(format!("bad seed in {word}")))?;
    let handle = cudalloc::ipc::IpcHandle::from_bytes(&unhex(handle))?;
    Ok((cudalloc::Storage::from_ipc(rt, handle)?, seed))
}

/// The hazards the sanitizer of `rt` found since the last look: exactly one, of `kind`.
pub(crate) fn one_report(
    rt: &cudalloc::Runtime,
    kind: cudalloc::sanitizer::HazardKind,
) -> cudalloc::sanitizer::HazardReport {
    let mut reports = rt.sanitizer().unwrap().take_reports();
    assert_eq!(reports.len(), 1, "{reports:#?}");
    let report = reports.remove(0);
    assert_eq!(report.kind, kind, "{report}");
    report
}

/// The sanitizer of `rt` found nothing since the last look (its reports are taken).
pub(crate) fn no_reports(rt: &cudalloc::Runtime) {
    let reports = rt.sanitizer().unwrap().take_reports();
    assert!(
        reports.is_empty(),
        "correct code was reported: {reports:#?}"
    );
}

/// A runtime over a fresh host driver with the sanitizer on in report mode and the invariant
/// scanner: for tests that plant a hazard and read its report.
pub(crate) fn sanitized_host_runtime() -> Arc<cudalloc::Runtime> {
    Arc::new(
        cudalloc::Runtime::builder()
            .sanitize(cudalloc::sanitizer::Sanitize::On(Default::default()))
            .check_invariants(true)
            .build(Arc::new(host_driver()))
            .unwrap(),
    )
}
