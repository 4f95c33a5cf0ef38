//! How much address space a consumer reserves for storages shared from an expandable segment.
//!
//! The producer (this process) allocates N storages from one expandable segment on the host
//! backend and shares them; a consumer (this program re-executed) opens them all and reports the
//! page spans it mapped and the address space they reserve. PyTorch's consumer of expandable memory
//! reserves the producer's whole segment range on every import; cudalloc's maps only the pages
//! under each storage, and storages on the same pages share one mapping.
//!
//! ```text
//! cargo run --release --example expandable_sharing -- [--storages N] [--size BYTES] [--device-mib MIB]
//! ```
//! (defaults: 1,000 storages of 1 MiB on a 2 GiB device, whose expandable segment reserves 4 GiB).
//! The consumer checks every storage's bytes; the program fails if any differs or if the consumer
//! reserved more than the storages' chunk-rounded sizes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use cudalloc::{backend::HostDriver, ipc::IpcHandle, AllocatorConfig, Runtime, Storage};

const CONSUMER: &str = "--consumer";

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number"))
        })
        .unwrap_or(default)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The consumer: opens every handle on stdin's first line, checks each storage's bytes, reports.
fn consumer() {
    let driver = Arc::new(HostDriver::builder().devices(1).build().unwrap());
    let a = Arc::new(Runtime::new(driver, AllocatorConfig::default()).unwrap());
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let started = Instant::now();
    let storages: Vec<Storage> = line
        .split_whitespace()
        .map(|h| Storage::from_ipc(&a, IpcHandle::from_bytes(&unhex(h)).unwrap()).unwrap())
        .collect();
    let opened_in = started.elapsed();
    let bad: u64 = storages
        .iter()
        .enumerate()
        .map(|(i, s)| s.count_pattern_mismatches(i as u64).unwrap())
        .sum();
    println!(
        "{} {} {} {} {}",
        storages.len(),
        a.ipc_open_segments(),
        a.ipc_imported_address_space(),
        bad,
        opened_in.as_micros()
    );
    std::io::stdout().flush().unwrap();
    let mut done = String::new();
    std::io::stdin().lock().read_line(&mut done).unwrap();
}

fn main() {
    if std::env::args().any(|a| a == CONSUMER) {
        consumer();
        return;
    }
    let n = arg("--storages", 1000);
    let size = arg("--size", 1 << 20);
    let device = arg("--device-mib", 2048) << 20;
    let driver = Arc::new(
        HostDriver::builder()
            .devices(1)
            .memory_per_device(device)
            .build()
            .unwrap(),
    );
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let a = Arc::new(Runtime::builder().config(config).build(driver).unwrap());
    let storages: Vec<Storage> = (0..n)
        .map(|i| {
            let s = Storage::new(&a, 0, size).unwrap();
            s.fill_pattern(i).unwrap();
            s
        })
        .collect();
    let segments = a.snapshot().segments;
    let mapped: u64 = segments.iter().map(|s| s.total_size).sum();
    // An expandable segment reserves twice the device's capacity (src/alloc/engine/expandable.rs).
    let reservation = 2 * device;
    let page = 2u64 << 20;
    let chunk_rounded: u64 = storages
        .iter()
        .map(|s| {
            let first = s.unordered_data_ptr().0 / page;
            let last = (s.unordered_data_ptr().0 + s.nbytes() - 1) / page;
            (last - first + 1) * page
        })
        .sum();
    let line: Vec<String> = storages
        .iter()
        .map(|s| hex(&s.share_ipc().unwrap().into_bytes()))
        .collect();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg(CONSUMER)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{}", line.join(" ")).unwrap();
    let mut report = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut report)
        .unwrap();
    let fields: Vec<u64> = report
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    let [opened, spans, reserved, bad, micros] = fields[..] else {
        panic!("consumer report {report:?}")
    };
    writeln!(stdin).unwrap();
    drop(stdin);
    assert!(child.wait().unwrap().success());
    println!(
        "producer: {n} storages of {size} bytes in {} expandable segment(s): {} mapped of a {} reservation",
        segments.len(),
        mib(mapped),
        mib(reservation)
    );
    println!("  sum of storage sizes          {}", mib(n * size));
    println!("  sum of chunk-rounded sizes    {}", mib(chunk_rounded));
    println!(
        "consumer: opened {opened} storages in {:.1} ms, {bad} bytes mismatched",
        micros as f64 / 1000.0
    );
    println!("  page spans mapped             {spans}");
    println!("  address space reserved        {}", mib(reserved));
    println!(
        "  importing the whole segment   {} reserved, {} mapped (PyTorch's way: the segment's whole range)",
        mib(reservation),
        mib(mapped)
    );
    assert_eq!(bad, 0, "every storage reads its pattern");
    assert!(
        reserved <= chunk_rounded,
        "the consumer reserves at most the chunk-rounded sizes"
    );
}
