//! Event cells of other processes are untrusted (issue 21, item 7): a third process that scribbles
//! a live producer's event cell, or a producer that dies before completing its event, fails the
//! waits (and the work queued behind them) that depended on that event — with a typed
//! `ErrorKind::ForeignEvent` naming the producer, its event chunk and why — and nothing else: the
//! consumer's stream neither hangs nor stays failed, and unrelated storages on it keep working.
//!
//! Three processes: this test (orchestrator and scribbler: it writes the producer's event chunk in
//! `/dev/shm` directly, as any process of the same user can), a producer child and a consumer child
//! (this test binary re-executed). Children talk over stdin/stdout lines; the consumer arms
//! `alarm(2)` so that a hang ends in `SIGALRM` (the test then fails: "child exited before
//! answering") instead of hanging the suite. Nothing is synchronized by sleeping: stream gates hold
//! streams, protocol lines order the processes, and the consumer's per-wait deadline for foreign
//! events is set small through its driver's configuration — the tests assert on the errors, never
//! on elapsed time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use cudalloc::{backend::HostDriver, ipc::IpcHandle, Runtime, Storage};

const CHILD: &str = "hostile_child";
/// Bytes of a shared storage.
const LEN: u64 = 1 << 20;
/// The producer's pattern.
const SEED: u64 = 7;
/// Layout of an event chunk (`src/driver/host/event.rs`): a 64-byte header, then 64-byte cells of
/// `recorded: u64, completed: u64, wake: u32, waiters: u32`.
const CELL: u64 = 64;
const CELLS: u64 = 1024;
const RECORDED: u64 = 0;
const COMPLETED: u64 = 8;
/// Seconds after which a consumer child that hangs is ended by `SIGALRM`.
const HANG_ALARM_S: u32 = 20;
/// The consumer's deadline for a wait on another process's event.
const FOREIGN_DEADLINE: Duration = Duration::from_millis(200);
/// Healthy operations run on the consumer's stream after a failed wait.
const HEALTHY: u64 = 300;

/// Writes `value` into field `field` of every cell of the event chunk `chunk` (a file in /dev/shm).
fn scribble_every_cell(chunk: &str, field: u64, value: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/dev/shm/{chunk}"))
        .unwrap();
    for cell in 0..CELLS {
        f.write_all_at(&value.to_le_bytes(), CELL * (cell + 1) + field)
            .unwrap();
    }
}

/// A producer child and what it shared: the handle's hex and its first event chunk's name.
struct Producer {
    child: ChildProcess,
    handle: String,
    chunk: String,
}

impl Producer {
    /// Starts a producer that shares one storage of the pattern [`SEED`]: with its writes and its
    /// event record complete (`held` false), or held behind a gate on its stream (`held` true).
    fn start(held: bool) -> Self {
        let mut child = ChildProcess::spawn(CHILD, "producer", "host");
        child.send(if held { "share_held" } else { "share_done" });
        let line = child.recv();
        Producer {
            chunk: format!("{}evt0", field(&line, "prefix")),
            handle: field(&line, "handle").to_owned(),
            child,
        }
    }

    fn pid(&self) -> u32 {
        self.child.pid()
    }

    fn finish(mut self) {
        self.child.send("open");
        assert_eq!(self.child.recv(), "opened");
        self.child.send("stop");
        self.child.finish();
    }
}

/// What a consumer child reported: `key=value` fields, then the message of the dependent
/// operation's error (if any) after ` message=`.
struct Report {
    fields: String,
    message: String,
}

impl Report {
    fn parse(line: &str) -> Self {
        println!("consumer: {line}");
        let (fields, message) = line.split_once(" message=").unwrap_or((line, ""));
        Report {
            fields: fields.to_owned(),
            message: message.to_owned(),
        }
    }

    fn get(&self, key: &str) -> &str {
        field(&self.fields, key)
    }

    /// Asserts that the dependent operation failed with a foreign-event error naming `pid`,
    /// `chunk` and `why`.
    fn assert_foreign_failure(&self, pid: u32, chunk: &str, why: &str) {
        assert_eq!(
            self.get("dependent"),
            "ForeignEvent",
            "{} {}",
            self.fields,
            self.message
        );
        for needle in [format!("pid {pid}"), chunk.to_owned(), why.to_owned()] {
            assert!(
                self.message.contains(&needle),
                "{needle:?} missing from {:?}",
                self.message
            );
        }
    }
}

fn consumer() -> ChildProcess {
    ChildProcess::spawn(CHILD, "consumer", "host")
}

#[test]
fn a_completion_scribbled_back_to_zero_fails_only_the_dependent_work_after_the_deadline() {
    // The producer's record is complete; then a third party writes `completed = 0`: the cell now
    // says "in flight" for ever. Before: the consumer's stream hung until the producer exited.
    let producer = Producer::start(false);
    scribble_every_cell(&producer.chunk, COMPLETED, 0);
    let mut consumer = consumer();
    consumer.send(&format!("receive_gated handle={}", producer.handle));
    assert_eq!(consumer.recv(), "queued");
    consumer.send("go");
    let report = Report::parse(&consumer.recv());
    report.assert_foreign_failure(producer.pid(), &producer.chunk, "timeout");
    assert_eq!(report.get("unrelated"), "0", "{}", report.fields);
    consumer.finish();
    producer.finish();
}

#[test]
fn a_huge_recorded_does_not_move_what_a_consumer_waits_for() {
    // The consumer's wait target comes from the handle, not from the shared `recorded` field.
    // Before: the target was `recorded`, unreachable, and the stream hung.
    let producer = Producer::start(false);
    scribble_every_cell(&producer.chunk, RECORDED, u64::MAX / 2);
    let mut consumer = consumer();
    consumer.send(&format!("receive handle={}", producer.handle));
    let report = Report::parse(&consumer.recv());
    assert_eq!(report.get("received"), "ok", "{}", report.message);
    assert_eq!(report.get("mismatches"), "0", "{}", report.fields);
    consumer.finish();
    producer.finish();
}

#[test]
fn a_completion_scribbled_past_the_record_is_refused_not_believed() {
    // The producer's writes (and record) are held behind a gate; a third party writes a completed
    // count no record reached. Before: the consumer believed it and read the bytes early.
    let producer = Producer::start(true);
    scribble_every_cell(&producer.chunk, COMPLETED, 1 << 40);
    let mut consumer = consumer();
    consumer.send(&format!("receive handle={}", producer.handle));
    let report = Report::parse(&consumer.recv());
    assert_eq!(
        report.get("received"),
        "ForeignEvent",
        "{} {}",
        report.fields,
        report.message
    );
    for needle in [format!("pid {}", producer.pid()), producer.chunk.clone()] {
        assert!(report.message.contains(&needle), "{:?}", report.message);
    }
    assert_eq!(report.get("unrelated"), "0", "{}", report.fields);
    consumer.finish();
    producer.finish();
}

#[test]
fn a_producer_killed_before_its_event_fails_only_the_dependent_wait() {
    // The consumer queues a wait on the producer's event (in flight: the producer's stream is
    // gated) and work that depends on it; the producer is killed. Before: the consumer's stream
    // failed for good — every later operation on it failed.
    let producer = Producer::start(true);
    let (pid, chunk) = (producer.pid(), producer.chunk.clone());
    let mut consumer = consumer();
    consumer.send(&format!("receive_gated handle={}", producer.handle));
    assert_eq!(consumer.recv(), "queued");
    producer.child.kill();
    consumer.send("go");
    let report = Report::parse(&consumer.recv());
    report.assert_foreign_failure(pid, &chunk, "exited");
    assert_eq!(report.get("unrelated"), "0", "{}", report.fields);
    assert_eq!(
        report.get("healthy_failed"),
        "0",
        "of {HEALTHY}: {}",
        report.fields
    );
    consumer.finish();
    // The killed producer's objects: nobody holds them any more.
    cudalloc::ipc::sweep_orphans().unwrap();
}

/// `kind` of a result as a protocol word: `ok`, or the error kind (`ForeignEvent`, …).
fn kind_of<T>(result: &cudalloc::Result<T>) -> String {
    match result {
        Ok(_) => "ok".to_owned(),
        Err(err) => format!("{:?}", err.kind()),
    }
}

fn message_of<T>(result: &cudalloc::Result<T>) -> String {
    result
        .as_ref()
        .err()
        .map(|e| e.to_string().replace('\n', " "))
        .unwrap_or_default()
}

/// Mismatches of a fresh storage filled and verified on `stream` (the stream still works), or the
/// error kind.
fn unrelated_storage(rt: &Arc<Runtime>, stream: cudalloc::StreamId, seed: u64) -> String {
    let checked = Storage::new_on(rt, stream, 64 << 10).and_then(|s| {
        s.fill_pattern(seed)?;
        s.count_pattern_mismatches(seed)
    });
    match checked {
        Ok(n) => n.to_string(),
        Err(err) => format!("{:?}", err.kind()),
    }
}

fn consumer_runtime() -> (Arc<Runtime>, Arc<HostDriver>) {
    let driver = Arc::new(
        HostDriver::builder()
            .devices(1)
            .memory_per_device(64 << 20)
            .ipc_event_timeout(Some(FOREIGN_DEADLINE))
            .build()
            .unwrap(),
    );
    let rt = Runtime::builder()
        .config(test_config(""))
        .build(driver.clone())
        .unwrap();
    (Arc::new(rt), driver)
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn hostile_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    match role.as_str() {
        "producer" => {
            let driver = Arc::new(host_driver());
            let prefix = driver.shm_name_prefix();
            let rt = Arc::new(
                Runtime::builder()
                    .config(test_config(""))
                    .build(driver.clone())
                    .unwrap(),
            );
            let stream = rt.current_stream(0).unwrap();
            let mut storages = Vec::new();
            let mut gates = Vec::new();
            while let Some(line) = parent.recv_or_eof() {
                match line.as_str() {
                    "share_done" | "share_held" => {
                        if line == "share_held" {
                            gates.push(driver.gate_stream(stream).unwrap());
                        }
                        let s = Storage::new(&rt, 0, LEN).unwrap();
                        s.fill_pattern(SEED).unwrap();
                        let handle = hex(&s.share_ipc().unwrap().into_bytes());
                        if gates.is_empty() {
                            rt.driver().stream_synchronize(stream).unwrap();
                        }
                        storages.push(s);
                        parent.send(&format!("prefix={prefix} handle={handle}"));
                    }
                    "open" => {
                        gates.clear();
                        rt.driver().stream_synchronize(stream).unwrap();
                        parent.send("opened");
                    }
                    "stop" => break,
                    other => panic!("unknown producer command {other}"),
                }
            }
        }
        "consumer" => {
            // SAFETY: `alarm` has no preconditions; its SIGALRM ends this child if it hangs.
            unsafe { libc::alarm(HANG_ALARM_S) };
            let (rt, host) = consumer_runtime();
            let stream = rt.current_stream(0).unwrap();
            let line = parent.recv();
            let (command, handle) = line.split_once(" handle=").unwrap();
            let handle = IpcHandle::from_bytes(&unhex(handle)).unwrap();
            match command {
                "receive" => {
                    let received = Storage::from_ipc(&rt, handle);
                    let mismatches = received
                        .as_ref()
                        .map_err(Clone::clone)
                        .and_then(|s| s.count_pattern_mismatches(SEED));
                    parent.send(&format!(
                        "received={} mismatches={} unrelated={} message={}",
                        kind_of(&received),
                        mismatches.as_ref().map_or("-".into(), u64::to_string),
                        unrelated_storage(&rt, stream, 3),
                        message_of(&received),
                    ));
                }
                "receive_gated" => {
                    // The wait and a copy that depends on it are queued behind a gate, so both are
                    // in the queue whatever happens to the producer meanwhile.
                    let gate = host.gate_stream(stream).unwrap();
                    let received = Storage::from_ipc(&rt, handle).unwrap();
                    let scratch = Storage::new_on(&rt, stream, LEN).unwrap();
                    let dst = scratch.mutable_data_ptr_on(stream).unwrap();
                    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                    unsafe {
                        rt.driver().copy_device_to_device(
                            stream,
                            dst,
                            received.unordered_data_ptr(),
                            LEN,
                        )
                    }
                    .unwrap();
                    parent.send("queued");
                    assert_eq!(parent.recv(), "go");
                    gate.open();
                    let dependent = rt.driver().stream_synchronize(stream);
                    let unrelated = unrelated_storage(&rt, stream, 3);
                    drop(received);
                    let healthy_failed = (0..HEALTHY)
                        .filter(|&i| unrelated_storage(&rt, stream, 100 + i) != "0")
                        .count();
                    parent.send(&format!(
                        "dependent={} unrelated={unrelated} healthy_failed={healthy_failed} message={}",
                        kind_of(&dependent),
                        message_of(&dependent),
                    ));
                }
                other => panic!("unknown consumer command {other}"),
            }
        }
        other => panic!("unknown role {other}"),
    }
}
