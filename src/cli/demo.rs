//! `cudalloc demo`: the producer/consumer demonstration that exercises everything.
//!
//! The producer allocates a realistic mix of storages (512 B to `--max-size`, log-uniform, on two
//! streams), fills them with the pattern kernel, lazily clones some and writes to half of the
//! clones (materializing them), and shares storages and clones with `--consumers` consumer
//! processes (this binary, hidden subcommand `demo-consumer`) over Unix sockets. Each consumer
//! verifies every byte with the verify kernel, writes an answer pattern into some, and releases.
//! The producer checks the answers, drops its storages, calls `ipc_collect()`, prints the memory
//! summary and a verdict. Any mismatch or leak is a non-zero exit with the reason.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudalloc::internals::pattern;
use cudalloc::{backend::BackendChoice, ipc::IpcHandle, AllocatorConfig, Runtime, Storage};

/// Options of the demo.
#[derive(Debug, Clone)]
pub(crate) struct DemoOptions {
    pub consumers: usize,
    pub storages: usize,
    pub max_size: u64,
    pub seed: u64,
    pub backend: BackendChoice,
    /// How long a consumer may take to start and connect.
    pub connect_timeout: Duration,
    /// The consumer program (default: this executable); tests and packagers may point elsewhere.
    pub consumer_exe: Option<PathBuf>,
}

/// The folder of the producer's socket: removed on every exit path.
struct SocketDir(PathBuf);

impl Drop for SocketDir {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_dir_all(&self.0) {
            if err.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(%err, dir = %self.0.display(), "removing the demo's socket folder failed");
            }
        }
    }
}

/// Waits for `child` to connect to `listener`, at most `timeout`; fails at once if the child exits.
fn accept_consumer(
    listener: &UnixListener,
    child: &mut Child,
    timeout: Duration,
) -> Result<UnixStream, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listener: {e}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| format!("consumer socket: {e}"))?;
                return Ok(stream);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("accepting a consumer: {e}")),
        }
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return Err(format!(
                "a consumer process exited ({status}) before connecting"
            ));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "a consumer process did not connect within {:.1} s",
                timeout.as_secs_f64()
            ));
        }
        let mut fds = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().min(100) as libc::c_int;
        // SAFETY: `fds` is one valid pollfd for the duration of the call; poll only writes revents.
        unsafe { libc::poll(&mut fds, 1, ms) };
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) {
        return Err("odd-length hex".into());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(text.get(i..i + 2).unwrap_or("zz"), 16).map_err(|e| e.to_string())
        })
        .collect()
}

fn allocator(backend: BackendChoice) -> cudalloc::Result<Arc<Runtime>> {
    let selected = backend.open()?;
    let config = AllocatorConfig::from_env()?;
    Runtime::new(selected.driver, config).map(Arc::new)
}

/// One storage the producer tracks: what it holds and what the consumer must answer.
struct Item {
    storage: Storage,
    seed: u64,
    answer: Option<u64>,
    label: &'static str,
}

struct Consumer {
    child: Child,
    stream: BufReader<UnixStream>,
}

impl Drop for Consumer {
    fn drop(&mut self) {
        // On an early return the consumer may still run: stop it rather than leave it behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            // Already exited in between is fine; the wait below reaps it either way.
            let _ = self.child.kill();
        }
        // A drop has nowhere to report; the wait only reaps the child.
        let _ = self.child.wait();
    }
}

impl Consumer {
    fn ask(&mut self, line: &str) -> Result<String, String> {
        let s = self.stream.get_mut();
        s.write_all(line.as_bytes())
            .and_then(|()| s.write_all(b"\n"))
            .map_err(|e| e.to_string())?;
        let mut reply = String::new();
        self.stream
            .read_line(&mut reply)
            .map_err(|e| e.to_string())?;
        if reply.is_empty() {
            return Err("consumer closed the socket".into());
        }
        Ok(reply.trim_end().to_owned())
    }
}

/// Why the demo did not pass: it could not be set up (a bad backend or setting: the user's
/// mistake), or it ran and failed.
#[derive(Debug)]
pub(crate) enum DemoFailure {
    /// The backend or the allocator could not be made.
    Setup(cudalloc::Error),
    /// The run failed; what went wrong.
    Failed(String),
}

/// Runs the producer side; returns the verdict line or why it did not pass.
pub(crate) fn run(opts: &DemoOptions) -> Result<String, DemoFailure> {
    let start = Instant::now();
    let a = allocator(opts.backend).map_err(DemoFailure::Setup)?;
    run_on(opts, &a, start).map_err(DemoFailure::Failed)
}

fn run_on(opts: &DemoOptions, a: &Arc<Runtime>, start: Instant) -> Result<String, String> {
    let streams = [
        a.default_stream(0).map_err(|e| e.to_string())?,
        a.create_stream(0).map_err(|e| e.to_string())?,
    ];
    println!(
        "cudalloc demo: backend {}, {} consumer(s), {} storages plus a lazy clone of every third ({} to share)",
        a.driver().backend(),
        opts.consumers,
        opts.storages,
        opts.storages + opts.storages.div_ceil(3)
    );

    // Phase 1: allocate and fill a realistic mix on two streams.
    let progress = super::labelled_progress(opts.storages as u64, "allocating and filling");
    let mut items = Vec::new();
    let (lo, hi) = (9f64, (opts.max_size.max(512) as f64).log2());
    for i in 0..opts.storages as u64 {
        let r = pattern::word(opts.seed, i);
        let size = 2f64.powf(lo + (hi - lo) * (r % 10_000) as f64 / 10_000.0) as u64;
        let _guard = a
            .set_current_stream(streams[(i % 2) as usize])
            .map_err(|e| e.to_string())?;
        let storage =
            Storage::new(a, 0, size).map_err(|e| format!("allocating {size} bytes: {e}"))?;
        let seed = opts.seed ^ (i << 20);
        storage.fill_pattern(seed).map_err(|e| e.to_string())?;
        let answer = (i % 2 == 0).then_some(seed ^ 0xA5A5);
        items.push(Item {
            storage,
            seed,
            answer,
            label: "storage",
        });
        progress.inc(1);
    }
    progress.finish_and_clear();
    // Everything from here runs on the default stream, which must wait for the fills queued on
    // the second stream first (by CUDA's rules; a lazy clone materializes, and sharing copies,
    // on the current stream — without this wait those copies raced the fills, about one run in
    // six with large storages, and the stream sanitizer reports it every time).
    a.driver()
        .stream_wait_stream(streams[0], streams[1])
        .map_err(|e| e.to_string())?;

    // Phase 2: lazy clones of every third storage; write to half of them (materialize).
    let mut clones = Vec::new();
    for (k, item) in items.iter().enumerate().filter(|(k, _)| k % 3 == 0) {
        let clone = item.storage.lazy_clone().map_err(|e| e.to_string())?;
        let seed = if k % 2 == 0 {
            let s = item.seed ^ 0xC10E;
            clone.fill_pattern(s).map_err(|e| e.to_string())?; // first write: copy
            s
        } else {
            item.seed // unwritten: shares the data until shared (sharing materializes)
        };
        clones.push(Item {
            storage: clone,
            seed,
            answer: None,
            label: "lazy clone",
        });
    }
    items.extend(clones);

    // Phase 3: consumers over Unix sockets.
    let dir = SocketDir(std::env::temp_dir().join(format!("cudalloc-demo-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| e.to_string())?;
    let socket: PathBuf = dir.0.join("producer.sock");
    let listener =
        UnixListener::bind(&socket).map_err(|e| format!("bind {}: {e}", socket.display()))?;
    let exe = match &opts.consumer_exe {
        Some(exe) => exe.clone(),
        None => std::env::current_exe().map_err(|e| e.to_string())?,
    };
    let mut consumers = Vec::new();
    for _ in 0..opts.consumers {
        let mut child = Command::new(&exe)
            .args(["demo-consumer", "--socket"])
            .arg(&socket)
            .args(["--backend", backend_name(opts.backend)])
            .spawn()
            .map_err(|e| format!("starting a consumer ({}): {e}", exe.display()))?;
        let stream = match accept_consumer(&listener, &mut child, opts.connect_timeout) {
            Ok(stream) => stream,
            Err(why) => {
                // The error reported is `why`; this only stops and reaps the child.
                let _ = child.kill();
                let _ = child.wait();
                return Err(why);
            }
        };
        consumers.push(Consumer {
            child,
            stream: BufReader::new(stream),
        });
    }
    let progress = super::labelled_progress(items.len() as u64, "sharing and verifying");
    let mut verified_bytes = 0u64;
    for (k, item) in items.iter().enumerate() {
        let handle = item
            .storage
            .share_ipc()
            .map_err(|e| format!("sharing a {}: {e}", item.label))?;
        let answer = item.answer.map_or("-".to_owned(), |s| s.to_string());
        let line = format!(
            "VERIFY {} {answer} {}",
            item.seed,
            hex(&handle.into_bytes())
        );
        let n = consumers.len();
        let reply = consumers[k % n].ask(&line)?;
        if reply != "OK 0" {
            return Err(format!(
                "consumer reported {reply:?} for {} {k} ({} bytes)",
                item.label,
                item.storage.nbytes()
            ));
        }
        verified_bytes += item.storage.nbytes();
        progress.inc(1);
    }
    progress.finish_and_clear();
    for mut c in consumers {
        // A consumer that already left answers nothing; its exit status is checked next.
        let _ = c.ask("BYE");
        let status = c.child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("a consumer exited with {status}"));
        }
    }
    drop(dir);

    // Phase 4: answers, release, collect.
    for item in &items {
        if let Some(seed) = item.answer {
            let bad = item
                .storage
                .count_pattern_mismatches(seed)
                .map_err(|e| e.to_string())?;
            if bad != 0 {
                return Err(format!("{bad} bytes of a consumer's answer are wrong"));
            }
        }
    }
    let shared = items.len();
    let clones = shared - opts.storages;
    drop(items);
    a.ipc_collect();
    let (limbo, limbo_bytes) = a.ipc_limbo();
    if limbo != 0 {
        return Err(format!(
            "{limbo} storages ({limbo_bytes} bytes) left in limbo"
        ));
    }
    let stats = a.memory_stats(0).map_err(|e| e.to_string())?;
    if stats.allocation.all.current != 0 {
        return Err(format!(
            "{} allocations leaked",
            stats.allocation.all.current
        ));
    }
    println!("{}", a.memory_summary(0).map_err(|e| e.to_string())?);
    let active = stats.active_bytes.all.current;
    if active > stats.allocated_bytes.all.current {
        println!(
            "(Active {} > Allocated: blocks already freed whose reuse still waits for work other \
             streams had queued on them — record_stream's events — count as active until then.)",
            cudalloc::format_size(active as u64)
        );
    }
    Ok(format!(
        "verdict: ok — {shared} storages ({} + {clones} lazy clones) shared with {} consumer(s), {} verified byte for byte, answers checked, limbo drained, {:.2} s",
        opts.storages,
        opts.consumers,
        cudalloc::format_size(verified_bytes),
        start.elapsed().as_secs_f64()
    ))
}

fn backend_name(b: BackendChoice) -> &'static str {
    b.name()
}

/// The consumer process: verify, maybe answer, release, reply — until `BYE`.
pub(crate) fn consumer(socket: &std::path::Path, backend: BackendChoice) -> Result<(), String> {
    let a = allocator(backend).map_err(|e| e.to_string())?;
    let stream =
        UnixStream::connect(socket).map_err(|e| format!("connect {}: {e}", socket.display()))?;
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let mut parts = line.split(' ');
        let reply = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some("BYE"), ..) => {
                // The producer may have closed its end already: the goodbye is a courtesy.
                let _ = writeln!(writer, "BYE");
                return Ok(());
            }
            (Some("VERIFY"), Some(seed), Some(answer), Some(handle)) => {
                let seed: u64 = seed.parse().map_err(|_| "bad seed")?;
                let bytes = unhex(handle)?;
                let storage = IpcHandle::from_bytes(&bytes)
                    .and_then(|h| Storage::from_ipc(&a, h))
                    .map_err(|e| e.to_string())?;
                let bad = storage
                    .count_pattern_mismatches(seed)
                    .map_err(|e| e.to_string())?;
                if let Ok(answer) = answer.parse::<u64>() {
                    storage.fill_pattern(answer).map_err(|e| e.to_string())?;
                }
                drop(storage); // waits for our work, then releases the slot
                format!("OK {bad}")
            }
            _ => format!("ERR unknown request {line:?}"),
        };
        writeln!(writer, "{reply}").map_err(|e| e.to_string())?;
    }
    Ok(())
}
