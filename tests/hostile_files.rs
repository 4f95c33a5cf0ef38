//! Hostile files: every input format of `cudalloc replay` is a bounded parser (gzip bombs, nested
//! layers, pickles with lying length prefixes, memo bombs and deep nesting, deep JSON) — each is an
//! error naming the limit, never an abort, a stack overflow or a hang — and `oom_snapshot_path`
//! neither follows a planted symlink nor opens a planted FIFO.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudalloc::replay::{self, limits};
use cudalloc::{backend::Driver, backend::SimDriver, AllocatorConfig, ErrorKind, Runtime};

const MIB: u64 = 1 << 20;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

/// `n` zero bytes, gzip'd without holding them.
fn gzip_zeros(n: u64) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let chunk = vec![0u8; 1 << 20];
    let mut left = n;
    while left > 0 {
        let step = left.min(chunk.len() as u64) as usize;
        gz.write_all(&chunk[..step]).unwrap();
        left -= step as u64;
    }
    gz.finish().unwrap()
}

/// Asserts that reading `bytes` is an invalid-argument error naming `limit`.
fn refused(bytes: &[u8], limit: &str) -> String {
    let err = replay::parse(bytes).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let text = err.to_string();
    assert!(text.contains(limit), "names {limit}: {text}");
    text
}

const TRACE: &str = "{\"action\":\"alloc\",\"addr\":1,\"size\":512}\n";

#[test]
fn a_small_nested_gzip_bomb_is_refused_naming_the_limit() {
    // 64 MiB of zeros gzip'd twice: a few KiB that would expand 10,000-fold and more.
    let bomb = gzip(&gzip_zeros(64 * MIB));
    assert!(bomb.len() < 16 << 10, "a small file: {} bytes", bomb.len());
    let text = refused(&bomb, "MAX_GZIP_RATIO");
    assert!(text.contains(&limits::MAX_GZIP_RATIO.to_string()), "{text}");
    // One layer, the same.
    refused(&gzip_zeros(64 * MIB), "MAX_GZIP_RATIO");
    // What fits the allowance (at least GZIP_FLOOR_BYTES, 32 MiB) still reads.
    let mut text = String::new();
    while (text.len() as u64) < 8 * MIB {
        text.push_str(TRACE);
    }
    let trace = replay::parse(&gzip(text.as_bytes())).unwrap();
    assert_eq!(trace.allocations() as u64, 8 * MIB / TRACE.len() as u64 + 1);
}

#[test]
fn nested_gzip_layers_past_the_limit_are_refused_before_they_are_opened() {
    let mut bytes = TRACE.as_bytes().to_vec();
    for _ in 0..limits::MAX_GZIP_LAYERS {
        bytes = gzip(&bytes);
    }
    assert_eq!(replay::parse(&bytes).unwrap().allocations(), 1);
    bytes = gzip(&bytes);
    refused(&bytes, "MAX_GZIP_LAYERS");
    for _ in 0..500 {
        bytes = gzip(&bytes);
    }
    refused(&bytes, "MAX_GZIP_LAYERS");
}

#[test]
fn a_short_pickle_with_a_huge_length_prefix_is_an_error() {
    for (op, len) in [
        (b'X', &u32::MAX.to_le_bytes()[..]), // BINUNICODE
        (0x8d, &u64::MAX.to_le_bytes()[..]), // BINUNICODE8
        (0x8e, &u64::MAX.to_le_bytes()[..]), // BINBYTES8
        (b'B', &u32::MAX.to_le_bytes()[..]), // BINBYTES
        (0x8b, &u32::MAX.to_le_bytes()[..]), // LONG4
        (b'T', &(-1i32).to_le_bytes()[..]),  // BINSTRING
    ] {
        let mut p = vec![0x80, 4, b'}', 0x94, b'('];
        p.push(op);
        p.extend_from_slice(len);
        p.extend_from_slice(b"abc");
        p.push(b'.');
        let err = replay::parse(&p).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        assert!(
            err.to_string().contains("runs past the end"),
            "{op:#x}: {err}"
        );
    }
}

#[test]
fn a_memo_bomb_pickle_is_an_error_not_an_abort() {
    // {"device_traces": L8} with L0 = [] and L(n+1) = [Ln] * 250: 250^8 lists as a tree, 4 KiB
    // as a pickle (a reader that copies memo references runs out of memory).
    let mut p = vec![0x80, 4, b'}', 0x94, b'('];
    p.extend_from_slice(&[0x8c, 13]);
    p.extend_from_slice(b"device_traces");
    p.extend_from_slice(&[b']', 0x94, b'0']); // memo 1: L0
    for level in 1..=8u8 {
        p.push(b'(');
        for _ in 0..250 {
            p.extend_from_slice(&[b'h', level]);
        }
        p.extend_from_slice(&[b'l', 0x94, b'0']); // memo level + 1: L(level)
    }
    p.extend_from_slice(&[b'h', 9, b'u', b'.']);
    assert!(p.len() < 5000);
    let err = replay::parse(&p).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(err.to_string().contains("is not a dict"), "{err}");
    // DUP, TUPLE2, forty times: 84 bytes, 2^40 leaves for a reader that copies on DUP.
    let mut p = vec![0x80, 4, b']'];
    for _ in 0..40 {
        p.extend_from_slice(&[b'2', 0x86]);
    }
    p.push(b'.');
    let err = replay::parse(&p).unwrap_err();
    assert!(
        err.to_string().contains("a PyTorch snapshot is a dict"),
        "{err}"
    );
}

#[test]
fn a_deeply_nested_pickle_is_an_error_not_a_stack_overflow() {
    const DEPTH: usize = 2_000_000;
    // MARK ... LIST, nested two million deep.
    let mut p = vec![0x80, 4];
    p.extend(std::iter::repeat_n(b'(', DEPTH));
    p.extend(std::iter::repeat_n(b'l', DEPTH));
    p.push(b'.');
    refused(&p, "MAX_PICKLE_DEPTH");
    // EMPTY_LIST two million times, then APPEND into one another: the lists alone pass the
    // memory budget first (they cost more than 16 bytes per byte).
    let mut p = vec![0x80, 4];
    p.extend(std::iter::repeat_n(b']', DEPTH));
    p.extend(std::iter::repeat_n(b'a', DEPTH - 1));
    p.push(b'.');
    refused(&p, "PICKLE_MEMORY_RATIO");
    // With little enough lists to fit, the nesting is refused.
    let mut p = vec![0x80, 4];
    p.extend(std::iter::repeat_n(b']', 10_000));
    p.extend(std::iter::repeat_n(b'a', 10_000 - 1));
    p.push(b'.');
    refused(&p, "MAX_PICKLE_DEPTH");
    // Nested through the memo after the fact (a list appended to after it was nested): nothing
    // walks the values recursively, so reading and dropping it is flat.
    let mut p = vec![0x80, 4, b']', 0x94]; // memo 0: the outer list
    for i in 0..200_000u32 {
        p.push(b'j');
        p.extend_from_slice(&i.to_le_bytes());
        p.extend_from_slice(&[b']', 0x94, b'a', b'0']); // memo i + 1, appended into memo i
    }
    p.extend_from_slice(&[b'h', 0, b'.']);
    let err = replay::parse(&p).unwrap_err();
    assert!(
        err.to_string().contains("a PyTorch snapshot is a dict"),
        "{err}"
    );
}

#[test]
fn pickles_that_outgrow_their_memory_budget_are_refused() {
    // One byte per empty list (EMPTY_LIST): far more than 16 bytes of values per byte.
    let mut p = vec![0x80, 4];
    p.extend(std::iter::repeat_n(b']', 4 << 20));
    p.push(b'.');
    refused(&p, "PICKLE_MEMORY_RATIO");
}

#[test]
fn deep_json_is_an_error_or_a_trace_never_a_stack_overflow() {
    const DEPTH: usize = 1_000_000;
    let deep = format!("{}{}", "[".repeat(DEPTH), "]".repeat(DEPTH));
    // A Chrome trace: deep in a skipped member, in an event's args, in an unknown event field.
    let skipped = format!("{{\"x\": {deep}, \"traceEvents\": []}}");
    assert!(replay::parse(skipped.as_bytes()).is_err(), "no allocations");
    let args =
        format!("{{\"traceEvents\": [{{\"name\": \"[memory]\", \"ts\": 1, \"args\": {deep}}}]}}");
    assert!(replay::parse(args.as_bytes()).is_err());
    let field = format!(
        "{{\"traceEvents\": [{{\"name\": \"[memory]\", \"ts\": 1, \"deep\": {deep}, \"args\": \
         {{\"Device Type\": 1, \"Device Id\": 0, \"Bytes\": 512, \"Addr\": 7}}}}]}}"
    );
    assert_eq!(replay::parse(field.as_bytes()).unwrap().allocations(), 1);
    // JSON lines: deep in an unknown field, and as a field the replay reads.
    let line = format!("{{\"action\":\"alloc\",\"addr\":1,\"size\":512,\"frames\":{deep}}}\n");
    assert_eq!(replay::parse(line.as_bytes()).unwrap().allocations(), 1);
    let line = format!("{{\"action\":\"alloc\",\"addr\":{deep},\"size\":512}}\n");
    assert!(replay::parse(line.as_bytes()).is_err());
    // A very long CSV line is split into its first fields only.
    let csv = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,512,0x0{}\n",
        ",".repeat(DEPTH)
    );
    assert_eq!(replay::parse(csv.as_bytes()).unwrap().allocations(), 1);
}

#[test]
fn too_many_streams_or_devices_are_refused_naming_the_limit() {
    let mut text = String::new();
    for s in 0..=limits::MAX_TRACE_STREAMS as u64 {
        text.push_str(&format!(
            "{{\"action\":\"alloc\",\"addr\":{},\"size\":512,\"stream\":{s}}}\n",
            s * 512
        ));
    }
    refused(text.as_bytes(), "MAX_TRACE_STREAMS");
    let device = limits::MAX_SIM_DEVICES;
    let line = format!("{{\"action\":\"alloc\",\"device\":{device},\"addr\":1,\"size\":512}}\n");
    refused(line.as_bytes(), "MAX_SIM_DEVICES");
}

#[test]
fn the_command_refuses_a_bomb_in_one_line() {
    let dir = scratch_dir("cli");
    let file = dir.join("bomb.json.gz");
    std::fs::write(&file, gzip(&gzip_zeros(64 * MIB))).unwrap();
    let out = std::process::Command::new(common::cli())
        .arg("replay")
        .arg(&file)
        .arg("--svg")
        .arg(dir.join("plot.svg"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("MAX_GZIP_RATIO"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fresh directory for one test.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cudalloc-hostile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Runs an allocation that does not fit, with `oom_snapshot_path` set to `path`.
fn out_of_memory_with_snapshot_at(path: &Path) {
    let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 64 * MIB).unwrap());
    let conf = format!("oom_snapshot_path:{}", path.display());
    let a = Runtime::new(driver, AllocatorConfig::parse(&conf).unwrap()).unwrap();
    let held = a.allocate(0, 40 * MIB).unwrap();
    let err = a.allocate(0, 40 * MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    drop(held);
}

fn assert_fresh_snapshot(path: &Path) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert!(meta.file_type().is_file(), "a regular file: {meta:?}");
    let bytes = std::fs::read(path).unwrap();
    let value: serde_pickle::Value =
        serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap();
    assert!(matches!(value, serde_pickle::Value::Dict(_)));
}

#[test]
fn the_out_of_memory_snapshot_follows_no_symlink_and_opens_no_fifo() {
    use std::os::unix::fs::{symlink, FileTypeExt, OpenOptionsExt};
    let dir = scratch_dir("oom");
    // The name the snapshot used to be written through first.
    let old_temporary =
        |path: &Path| PathBuf::from(format!("{}.tmp{}", path.display(), std::process::id()));

    // Symlinks at the path and at the old temporary name: their targets stay as they were.
    let path = dir.join("oom.pickle");
    let (victim, other_victim) = (dir.join("victim"), dir.join("other-victim"));
    std::fs::write(&victim, b"precious").unwrap();
    std::fs::write(&other_victim, b"precious too").unwrap();
    symlink(&victim, &path).unwrap();
    symlink(&other_victim, old_temporary(&path)).unwrap();
    out_of_memory_with_snapshot_at(&path);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert_eq!(std::fs::read(&other_victim).unwrap(), b"precious too");
    assert_fresh_snapshot(&path);

    // FIFOs at the path and at the old temporary name (with a reader, so that a writer that
    // opened one would not block this test but write into it): neither is opened or kept.
    let path = dir.join("fifo.pickle");
    mkfifo(&path);
    mkfifo(&old_temporary(&path));
    let _reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(old_temporary(&path))
        .unwrap();
    out_of_memory_with_snapshot_at(&path);
    assert_fresh_snapshot(&path);
    assert!(std::fs::symlink_metadata(old_temporary(&path))
        .unwrap()
        .file_type()
        .is_fifo());

    // A snapshot already there is replaced whole; no temporary file is left behind.
    out_of_memory_with_snapshot_at(&path);
    assert_fresh_snapshot(&path);
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp") && !n.ends_with(&format!(".tmp{}", std::process::id())))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
