//! The `cudalloc` command.
//!
//! * `cudalloc` / `cudalloc demo` — the producer/consumer demonstration (see `cli/demo.rs`).
//! * `cudalloc info` — backend, devices and capacities, configuration, version.
//! * `cudalloc clean` — removes shared-memory objects that dead cudalloc processes left in
//!   `/dev/shm` (never those of a live process, nor those a consumer still holds) and prints them.
//! * `cudalloc replay FILE` — replays an allocation trace on the simulated device under one or
//!   more configurations: a table and an SVG plot (see `cli/replay.rs`).
//!
//! Bad flags or environment values print one clear line and exit with code 2.

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use cudalloc::{backend::BackendChoice, backend::Driver};

#[derive(Parser, Debug)]
#[command(
    name = "cudalloc",
    version,
    about = "CUDA caching allocator with IPC sharing and copy-on-write"
)]
struct Cli {
    /// Backend: auto (CUDA when present, else host), cuda, or host. Overrides CUDALLOC_BACKEND.
    #[arg(long, global = true)]
    backend: Option<String>,
    /// The demo's options (when no command is given, `demo` runs).
    #[command(flatten)]
    demo: DemoArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

/// Options of the demo.
#[derive(Args, Debug, Clone)]
struct DemoArgs {
    /// Consumer processes (at least 1).
    #[arg(long, default_value_t = 2)]
    consumers: usize,
    /// Storages the producer allocates (a lazy clone of every third is added).
    #[arg(long, default_value_t = 48)]
    storages: usize,
    /// Largest storage: bytes or a size such as 64MiB.
    #[arg(long, default_value = "64MiB")]
    max_size: String,
    /// Seed of sizes and patterns.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds a consumer process may take to start and connect.
    #[arg(long, default_value_t = 30.0)]
    connect_timeout_s: f64,
    /// The consumer program (default: this executable).
    #[arg(long, hide = true)]
    consumer_exe: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Producer/consumer demonstration over IPC with lazy clones (the default job).
    Demo(DemoArgs),
    /// Print the backend, its devices and capacities, and the configuration.
    Info,
    /// Remove shared-memory objects left in /dev/shm by dead cudalloc processes (never those of a
    /// live process, nor those a consumer still holds) and print what was removed.
    Clean,
    /// Replay an allocation trace (cudalloc JSON lines, PyTorch snapshot pickle, torch.profiler
    /// Chrome trace or RMM CSV log, possibly gzip'd) through the allocator on a simulated device:
    /// peaks, their ratio, segments, the first out-of-memory, time per op, and an SVG plot.
    Replay {
        /// The trace file.
        file: PathBuf,
        /// A configuration in PYTORCH_CUDA_ALLOC_CONF's grammar; repeat to compare several
        /// (default: PyTorch's default and "expandable_segments:True").
        #[arg(long = "conf")]
        confs: Vec<String>,
        /// Capacity of each simulated device (e.g. 80GiB).
        #[arg(long, default_value = "80GiB")]
        capacity: String,
        /// Where to write the plot (none unless given).
        #[arg(long)]
        svg: Option<PathBuf>,
    },
    /// A demo consumer (started by `demo`).
    #[command(hide = true)]
    DemoConsumer {
        /// The producer's socket.
        #[arg(long)]
        socket: PathBuf,
    },
}

/// Appends a line to a `String` (writing to a `String` cannot fail).
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Writes `text` to stdout. A reader that went away (`cudalloc info | head`) is not an error:
/// what it wanted it has.
fn write_stdout(text: &str) -> Result<(), (u8, String)> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err((1, format!("writing to stdout: {e}")))
        }
        _ => Ok(()),
    }
}

/// The report of `cudalloc info`.
fn info(
    driver: &dyn Driver,
    fallback_reason: Option<&str>,
    config: &cudalloc::AllocatorConfig,
) -> cudalloc::Result<String> {
    let mut out = String::new();
    outln!(out, "cudalloc {}", env!("CARGO_PKG_VERSION"));
    match fallback_reason {
        Some(why) => outln!(out, "backend: {} (CUDA not used: {why})", driver.backend()),
        None => outln!(out, "backend: {}", driver.backend()),
    }
    outln!(out, "devices: {}", driver.device_count());
    for device in 0..driver.device_count() {
        let mem = driver.mem_info(device)?;
        outln!(
            out,
            "  [{device}] {}: {} total, {} free",
            driver.device_name(device)?,
            human_bytes(mem.total),
            human_bytes(mem.free)
        );
    }
    if driver.backend() == cudalloc::backend::Backend::Host {
        match cudalloc::backend::HostDriver::shm_available_bytes() {
            Ok(free) => outln!(
                out,
                "  /dev/shm can back {} now (host segments live there; a full /dev/shm is out of memory)",
                human_bytes(free)
            ),
            Err(err) => outln!(out, "  /dev/shm free space unknown ({err})"),
        }
    }
    outln!(out, "allocator configuration (CUDALLOC_CONF):");
    for line in config.to_string().lines() {
        outln!(out, "  {line}");
    }
    outln!(out, "environment:");
    for var in [
        "CUDALLOC_BACKEND",
        "CUDALLOC_HOST_DEVICES",
        "CUDALLOC_HOST_MEMORY",
        "CUDALLOC_IPC_EVENT_TIMEOUT_S",
        "CUDALLOC_CONF",
    ] {
        match std::env::var(var) {
            Ok(value) => outln!(out, "  {var}={value}"),
            Err(_) => outln!(out, "  {var} (unset)"),
        }
    }
    Ok(out)
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

fn run(cli: Cli) -> Result<(), (u8, String)> {
    let usage = |e: cudalloc::Error| (2u8, e.to_string());
    let choice: BackendChoice = match &cli.backend {
        Some(name) => name.parse().map_err(usage)?,
        None => BackendChoice::from_env().map_err(usage)?,
    };
    // A bad CUDALLOC_CONF is a usage error for every command that allocates or reports it.
    let config = cudalloc::AllocatorConfig::from_env().map_err(usage)?;
    let command = cli.command.unwrap_or(Command::Demo(cli.demo));
    match command {
        Command::Info => {
            let selected = choice.open().map_err(|e| exit_code(&e))?;
            let report = info(
                selected.driver.as_ref(),
                selected.fallback_reason.as_deref(),
                &config,
            )
            .map_err(|e| exit_code(&e))?;
            write_stdout(&report)
        }
        Command::Clean => {
            let removed = cudalloc::ipc::sweep_orphans().map_err(|e| exit_code(&e))?;
            for name in &removed {
                println!("removed /dev/shm/{name}");
            }
            println!("{} orphaned object(s) removed", removed.len());
            Ok(())
        }
        Command::Demo(DemoArgs {
            consumers,
            storages,
            max_size,
            seed,
            connect_timeout_s,
            consumer_exe,
        }) => {
            if consumers == 0 {
                return Err((
                    2,
                    "--consumers 0: the demo needs at least 1 consumer".into(),
                ));
            }
            if storages == 0 {
                // A verdict over nothing would say "ok" having checked nothing.
                return Err((
                    2,
                    "--storages 0: the demo needs at least 1 storage to verify".into(),
                ));
            }
            let max_size = cudalloc::parse_byte_size(&max_size)
                .map_err(|why| (2, format!("--max-size {max_size:?}: {why}")))?;
            let connect_timeout = std::time::Duration::try_from_secs_f64(connect_timeout_s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    (
                        2,
                        format!(
                            "--connect-timeout-s {connect_timeout_s}: a positive number of seconds"
                        ),
                    )
                })?;
            let opts = cli::demo::DemoOptions {
                consumers,
                storages,
                max_size,
                seed,
                backend: choice,
                connect_timeout,
                consumer_exe,
            };
            let verdict = cli::demo::run(&opts).map_err(|failure| match failure {
                // A bad backend or setting is the caller's mistake: exit code 2, as for flags.
                cli::demo::DemoFailure::Setup(err) => exit_code(&err),
                cli::demo::DemoFailure::Failed(why) => (1, format!("demo failed: {why}")),
            })?;
            println!("{verdict}");
            Ok(())
        }
        Command::Replay {
            file,
            confs,
            capacity,
            svg,
        } => {
            let capacity = cudalloc::parse_byte_size(&capacity)
                .map_err(|why| (2, format!("--capacity {capacity:?}: {why}")))?;
            if capacity == 0 {
                return Err((2, "--capacity 0: the device needs room".into()));
            }
            let args = cli::replay::ReplayArgs {
                file,
                confs,
                capacity,
                svg,
            };
            let text = cli::replay::run(&args).map_err(|e| exit_code(&e))?;
            println!("{text}");
            Ok(())
        }
        Command::DemoConsumer { socket } => {
            cli::demo::consumer(&socket, choice).map_err(|why| (1, why))
        }
    }
}

fn exit_code(err: &cudalloc::Error) -> (u8, String) {
    match err.kind() {
        cudalloc::ErrorKind::Config | cudalloc::ErrorKind::InvalidArgument => (2, err.to_string()),
        _ => (1, err.to_string()),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CUDALLOC_LOG"))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let matches = Cli::command().get_matches();
    // The demo's options also work without `demo`; given with another command they are a mistake.
    let demo_flags = [
        "consumers",
        "storages",
        "max_size",
        "seed",
        "connect_timeout_s",
    ];
    if let Some((name, _)) = matches.subcommand().filter(|(name, _)| *name != "demo") {
        if let Some(flag) = demo_flags
            .iter()
            .find(|id| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
        {
            eprintln!(
                "cudalloc: --{} is a demo option, not one of `{name}`",
                flag.replace('_', "-")
            );
            return ExitCode::from(2);
        }
    }
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => err.exit(),
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, message)) => {
            eprintln!("cudalloc: {message}");
            ExitCode::from(code)
        }
    }
}
