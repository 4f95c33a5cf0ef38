//! The `cudalloc` command.
//!
//! * `cudalloc info` — backend, devices and capacities, configuration, version (the default job for
//!   now; the producer/consumer demonstration replaces it as the default once IPC and COW land).
//!
//! Bad flags or environment values print one clear line and exit with code 2.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cudalloc::{BackendChoice, Driver};

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
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the backend, its devices and capacities, and the configuration.
    Info,
}

fn info(driver: &dyn Driver, fallback_reason: Option<&str>) -> cudalloc::Result<()> {
    println!("cudalloc {}", env!("CARGO_PKG_VERSION"));
    match fallback_reason {
        Some(why) => println!("backend: {} (CUDA not used: {why})", driver.backend()),
        None => println!("backend: {}", driver.backend()),
    }
    println!("devices: {}", driver.device_count());
    for device in 0..driver.device_count() {
        let mem = driver.mem_info(device)?;
        println!(
            "  [{device}] {}: {} total, {} free",
            driver.device_name(device)?,
            human_bytes(mem.total),
            human_bytes(mem.free)
        );
    }
    match cudalloc::AllocatorConfig::from_env() {
        Ok(config) => println!("allocator configuration: {config:?}"),
        Err(err) => println!("allocator configuration: invalid ({err})"),
    }
    println!("environment:");
    for var in [
        "CUDALLOC_BACKEND",
        "CUDALLOC_HOST_DEVICES",
        "CUDALLOC_HOST_MEMORY",
        "CUDALLOC_CONF",
    ] {
        match std::env::var(var) {
            Ok(value) => println!("  {var}={value}"),
            Err(_) => println!("  {var} (unset)"),
        }
    }
    Ok(())
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

fn run(cli: Cli) -> cudalloc::Result<()> {
    let choice = match &cli.backend {
        Some(name) => name.parse()?,
        None => BackendChoice::from_env()?,
    };
    let selected = choice.open()?;
    match cli.command.unwrap_or(Command::Info) {
        Command::Info => info(
            selected.driver.as_ref(),
            selected.fallback_reason.as_deref(),
        ),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CUDALLOC_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("cudalloc: {err}");
            match err.kind() {
                cudalloc::ErrorKind::Config | cudalloc::ErrorKind::InvalidArgument => {
                    ExitCode::from(2)
                }
                _ => ExitCode::FAILURE,
            }
        }
    }
}
