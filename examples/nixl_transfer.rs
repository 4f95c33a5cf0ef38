//! Storages sent process to process through NIXL (over UCX), with one registration per segment.
//!
//! This process (the sender) starts a receiver (this program re-executed) and talks to it over a
//! Unix socket: the receiver allocates N storages of mixed sizes from the process's allocator
//! (`GLOBAL`, whose NIXL agent registered each segment once as it was mapped), fills the odd ones,
//! describes them all and sends its NIXL metadata and the descriptions. The sender writes its even
//! storages into the receiver's and reads the odd ones back, in two transfers with notifications;
//! each side checks every byte it received. Both print their registrations against their storages.
//!
//! ```text
//! CUDALLOC_NIXL_LIB_DIR=<the nixl wheel's .nixl_cu12.mesonpy.libs> UCX_NET_DEVICES=lo \
//!   cargo run --release --features nixl --example nixl_transfer -- [--storages N] [--max-mib M]
//! ```
//! (defaults: 200 storages of 512 B to 8 MiB). It exits non-zero on any wrong byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

use cudalloc::nixl::{NixlAgent, NixlOptions, RemoteStorage};
use cudalloc::{Storage, GLOBAL};

const RECEIVER: &str = "--receiver";
/// Largest frame either side accepts from the other.
const MAX_FRAME: usize = 64 << 20;
const TIMEOUT: Duration = Duration::from_secs(60);

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

fn send(socket: &mut UnixStream, frame: &[u8]) {
    socket
        .write_all(&(frame.len() as u32).to_le_bytes())
        .and_then(|()| socket.write_all(frame))
        .expect("the peer went away");
}

fn recv(socket: &mut UnixStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    socket.read_exact(&mut len).expect("the peer went away");
    let len = u32::from_le_bytes(len) as usize;
    assert!(len <= MAX_FRAME, "a frame of {len} bytes from the peer");
    let mut frame = vec![0u8; len];
    socket.read_exact(&mut frame).expect("the peer went away");
    frame
}

/// Storage `i`'s size: 512 B up to `max` bytes, mostly small (as a model's tensors are).
fn size(i: u64, max: u64) -> u64 {
    let steps = [512, 4096, 65_536, 300_007, 1 << 20, 3 << 20, 8 << 20];
    steps[(i * 7 + i / 3) as usize % steps.len()].min(max)
}

fn agent(role: &str) -> NixlAgent {
    let runtime = GLOBAL.get().expect("the runtime");
    let name = format!("{role}-{}", std::process::id());
    NixlAgent::new(runtime, NixlOptions::new(name)).unwrap_or_else(|e| {
        eprintln!("{role}: {e}");
        std::process::exit(2)
    })
}

fn report(role: &str, agent: &NixlAgent, storages: usize) {
    let stats = GLOBAL.get().unwrap().registration_stats();
    let nixl = &stats.registrars[0];
    println!(
        "{role}: {storages} storages in {} segments: {} NIXL registrations ({} MiB registered)",
        stats.mapped_regions,
        nixl.registrations,
        nixl.registered_bytes >> 20
    );
    assert_eq!(agent.registered_regions() as u64, stats.mapped_regions);
}

fn receiver(path: &str, n: u64, max: u64) {
    let mut socket = UnixStream::connect(path).expect("the sender's socket");
    socket.set_read_timeout(Some(TIMEOUT)).unwrap();
    let agent = agent("receiver");
    let runtime = GLOBAL.get().unwrap();
    let stream = runtime.default_stream(0).unwrap();
    let storages: Vec<Storage> = (0..n)
        .map(|i| {
            let s = Storage::new_on(runtime, stream, size(i, max)).unwrap();
            s.fill_pattern(if i % 2 == 1 { 1000 + i } else { 0 })
                .unwrap();
            s
        })
        .collect();
    let descriptions: Vec<Vec<u8>> = storages
        .iter()
        .map(|s| agent.describe(s, stream).unwrap().to_bytes())
        .collect();
    // Metadata after the storages: it names every segment they live in.
    send(&mut socket, &agent.metadata().unwrap());
    for d in &descriptions {
        send(&mut socket, d);
    }
    let sender = String::from_utf8(recv(&mut socket)).unwrap();
    agent
        .wait_notification(&sender, b"written", TIMEOUT)
        .unwrap();
    let mut wrong = 0;
    for (i, s) in storages.iter().enumerate().step_by(2) {
        agent.received(s, stream).unwrap();
        wrong += s.count_pattern_mismatches(2000 + i as u64).unwrap();
    }
    report("receiver", &agent, storages.len());
    send(&mut socket, &wrong.to_le_bytes());
    // Keep the storages until the sender read the odd ones.
    recv(&mut socket);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n = arg("--storages", 200).max(2);
    let max = arg("--max-mib", 8) << 20;
    if let Some(at) = args.iter().position(|a| a == RECEIVER) {
        receiver(&args[at + 1], n, max);
        return;
    }
    let dir = std::env::temp_dir().join(format!("cudalloc-nixl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("socket");
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([RECEIVER, path.to_str().unwrap()])
        .args([
            "--storages",
            &n.to_string(),
            "--max-mib",
            &(max >> 20).to_string(),
        ])
        .spawn()
        .unwrap();
    let (mut socket, _) = listener.accept().unwrap();
    socket.set_read_timeout(Some(TIMEOUT)).unwrap();
    let agent = agent("sender");
    let runtime = GLOBAL.get().unwrap();
    let stream = runtime.default_stream(0).unwrap();

    let peer = agent.load_peer(&recv(&mut socket)).unwrap();
    let remote: Vec<RemoteStorage> = (0..n)
        .map(|_| RemoteStorage::from_bytes(&recv(&mut socket)).unwrap())
        .collect();
    let local: Vec<Storage> = (0..n)
        .map(|i| {
            let s = Storage::new_on(runtime, stream, size(i, max)).unwrap();
            s.fill_pattern(2000 + i).unwrap();
            s
        })
        .collect();
    let pairs = |parity: usize| -> Vec<(&Storage, &RemoteStorage)> {
        local.iter().zip(&remote).skip(parity).step_by(2).collect()
    };
    let started = Instant::now();
    let mut write = agent.write(stream, &pairs(0), Some(b"written")).unwrap();
    let mut read = agent.read(stream, &pairs(1), None).unwrap();
    write.wait(TIMEOUT).unwrap();
    read.wait(TIMEOUT).unwrap();
    let elapsed = started.elapsed();
    let bytes = write.bytes() + read.bytes();
    drop((write, read));
    send(&mut socket, agent.name().as_bytes());
    let their_wrong = u64::from_le_bytes(recv(&mut socket).try_into().unwrap());
    let mut wrong = 0;
    for (i, s) in local.iter().enumerate().skip(1).step_by(2) {
        wrong += s.count_pattern_mismatches(1000 + i as u64).unwrap();
    }
    send(&mut socket, b"done");
    let status = child.wait().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    report("sender", &agent, local.len());
    println!(
        "{n} storages with {peer}: {:.1} MiB in {:.1} ms ({:.2} GB/s), wrong bytes: {wrong} here, {their_wrong} there",
        bytes as f64 / (1 << 20) as f64,
        elapsed.as_secs_f64() * 1e3,
        bytes as f64 / elapsed.as_secs_f64() / 1e9
    );
    if wrong != 0 || their_wrong != 0 || !status.success() {
        eprintln!("verdict: FAILED (receiver {status})");
        std::process::exit(1);
    }
    println!("verdict: ok — every byte checked on both sides");
}
