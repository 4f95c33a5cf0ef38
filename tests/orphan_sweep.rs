//! The orphan sweep across pid namespaces (containers sharing one `/dev/shm`: Docker's
//! `--ipc=host`, pods sharing a memory volume). A sweep run where the producers' pids mean nothing
//! must keep every live producer's objects — from its very first one — because every process locks
//! its liveness file before it creates any object, and only that lock decides. Objects whose
//! process died, and liveness files abandoned half-made, go.
//!
//! The second namespace needs `unshare(CLONE_NEWPID)` (root or a user namespace); where the machine
//! refuses it, the test says it skipped and why.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use common::*;
use cudalloc::{ipc::IpcHandle, Runtime, Storage};

const CHILD: &str = "orphan_sweep_child";
const PRODUCERS: usize = 10;

/// A sweeper in a pid namespace of its own: sweeps until its stdin closes, then writes every
/// name it removed to its stdout. `None` (with the reason) where namespaces are not permitted.
struct NamespacedSweeper {
    pid: libc::pid_t,
    stop: Option<OwnedFd>,
    removed: OwnedFd,
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid out-array of two descriptors.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0);
    // SAFETY: both descriptors were just created and are owned here alone.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

impl NamespacedSweeper {
    fn start() -> Result<NamespacedSweeper, String> {
        let (stop_read, stop_write) = pipe();
        let (removed_read, removed_write) = pipe();
        let (ready_read, ready_write) = pipe();
        // SAFETY: the child only calls async-signal-safe functions until it forks again; the
        // grandchild runs the sweep (file-system calls only) and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            drop((stop_write, removed_read, ready_read));
            // SAFETY: unshare with one flag; the new namespace applies to this process's children.
            if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
                let err = std::io::Error::last_os_error();
                let mut ready = std::fs::File::from(ready_write);
                let _ = write!(ready, "unshare(CLONE_NEWPID) refused: {err}");
                // SAFETY: ends the child without the parent's exit hooks.
                unsafe { libc::_exit(0) };
            }
            // SAFETY: the grandchild (pid 1 of the new namespace) sweeps and `_exit`s.
            let inner = unsafe { libc::fork() };
            if inner == 0 {
                sweep_until_stopped(stop_read, removed_write, ready_write);
            }
            // Only the sweeper keeps the pipes' ends: the parent sees end-of-file when it is done.
            drop((stop_read, removed_write, ready_write));
            let mut status = 0;
            // SAFETY: waits for the grandchild forked above.
            unsafe { libc::waitpid(inner, &mut status, 0) };
            // SAFETY: ends the child without the parent's exit hooks.
            unsafe { libc::_exit(0) };
        }
        drop((stop_read, removed_write, ready_write));
        let mut ready = String::new();
        std::fs::File::from(ready_read)
            .read_to_string(&mut ready)
            .unwrap();
        if ready != "sweeping" {
            let mut status = 0;
            // SAFETY: reaps the child forked above.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            return Err(ready);
        }
        Ok(NamespacedSweeper {
            pid,
            stop: Some(stop_write),
            removed: removed_read,
        })
    }

    /// Stops the sweeper; the names it removed.
    fn stop(mut self) -> Vec<String> {
        drop(self.stop.take());
        let mut removed = Vec::new();
        let reader = BufReader::new(std::fs::File::from(self.removed.try_clone().unwrap()));
        for line in reader.lines() {
            removed.push(line.unwrap());
        }
        let mut status = 0;
        // SAFETY: reaps the child forked in `start`.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
        removed
    }
}

/// In the new namespace: tells it is sweeping, sweeps until `stop` reads end-of-file (its writer
/// closed), then reports the removed names and ends.
fn sweep_until_stopped(stop: OwnedFd, removed: OwnedFd, ready: OwnedFd) -> ! {
    // SAFETY: the descriptor is valid; making it non-blocking only changes how reads return.
    unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&stop),
            libc::F_SETFL,
            libc::O_NONBLOCK,
        )
    };
    let mut ready = std::fs::File::from(ready);
    let _ = ready.write_all(b"sweeping");
    drop(ready);
    let mut stop = std::fs::File::from(stop);
    let mut gone = Vec::new();
    loop {
        if let Ok(names) = cudalloc::ipc::sweep_orphans() {
            gone.extend(names);
        }
        let mut byte = [0u8; 1];
        match stop.read(&mut byte) {
            Ok(0) => break,
            _ => continue,
        }
    }
    let mut out = std::fs::File::from(removed);
    for name in gone {
        let _ = writeln!(out, "{name}");
    }
    drop(out);
    // SAFETY: ends the sweeper without the test process's exit hooks.
    unsafe { libc::_exit(0) }
}

/// The tests of this file fork; a child forked by one would inherit the other's descriptors —
/// and with them its open file descriptions and their locks (a lock "dropped" by the test would
/// live on in the child).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn a_sweep_in_another_pid_namespace_keeps_every_starting_producers_objects() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let sweeper = match NamespacedSweeper::start() {
        Ok(s) => s,
        Err(why) => {
            println!("a_sweep_in_another_pid_namespace [host]: skipped: {why}");
            return;
        }
    };
    // Producers start while the sweep runs; each shares its first storage at once.
    let mut producers = Vec::new();
    for i in 0..PRODUCERS {
        let mut p = ChildProcess::spawn(CHILD, "producer", "host");
        p.send(&i.to_string());
        let handle = p.recv();
        producers.push((p, i, handle));
    }
    let removed = sweeper.stop();
    let theirs: Vec<_> = removed
        .iter()
        .filter(|n| {
            producers
                .iter()
                .any(|(p, _, _)| n.starts_with(&format!("cudalloc-{}-", p.pid())))
        })
        .collect();
    assert!(
        theirs.is_empty(),
        "the sweep in another pid namespace removed live producers' objects: {theirs:?}"
    );
    // Every first storage still opens, with its bytes.
    let consumer = Arc::new(Runtime::new(Arc::new(host_driver()), Default::default()).unwrap());
    for (p, i, handle) in producers {
        let s = Storage::from_ipc(&consumer, IpcHandle::from_bytes(&unhex(&handle)).unwrap())
            .unwrap_or_else(|e| panic!("producer {i}'s storage: {e}"));
        assert_eq!(
            s.count_pattern_mismatches(i as u64).unwrap(),
            0,
            "producer {i}"
        );
        drop(s);
        p.finish();
    }
}

#[test]
fn only_the_lock_decides_and_half_made_liveness_files_go() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // A pid no process has here, as a process of another namespace would look.
    let pid = (1..=u32::from(u16::MAX))
        .map(|k| 4_000_000 + k)
        .find(|&p| {
            // SAFETY: signal 0 only probes for existence.
            let rc = unsafe { libc::kill(p as libc::pid_t, 0) };
            rc != 0
        })
        .unwrap();
    let dir = std::path::Path::new("/dev/shm");
    let nonce = std::process::id();
    let live = dir.join(format!("cudalloc-{pid}-{nonce:016x}-live0"));
    let kept = dir.join(format!("cudalloc-{pid}-{nonce:016x}-seg0"));
    let making = dir.join(format!("cudalloc-making-{nonce:016x}"));
    for path in [&live, &kept, &making] {
        std::fs::write(path, b"").unwrap();
    }
    // Its liveness file locked (as that process would hold it): everything stays.
    let holder = std::fs::File::open(&live).unwrap();
    let mut fl: libc::flock = unsafe_zeroed_flock();
    fl.l_type = libc::F_RDLCK as libc::c_short;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&holder);
    // SAFETY: valid descriptor and flock; F_OFD_SETLK only reads and writes `fl`.
    let rc = unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &mut fl) };
    assert_eq!(rc, 0);
    let removed = cudalloc::ipc::sweep_orphans().unwrap();
    assert!(
        live.exists() && kept.exists(),
        "removed while locked: {removed:?}"
    );
    assert!(
        !making.exists(),
        "an unlocked half-made liveness file stays"
    );
    // Its lock gone (the process died): its objects go.
    drop(holder);
    let removed = cudalloc::ipc::sweep_orphans().unwrap();
    assert!(
        !live.exists() && !kept.exists(),
        "kept after the process died: {removed:?}"
    );
}

#[test]
fn a_dead_process_named_with_a_live_pid_of_this_namespace_is_swept_by_its_lock() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // What a container's first process leaves when it is killed: objects named with pid 1 —
    // alive here (init) — and its liveness file, unlocked. Before, `kill(1, 0)` kept them for ever.
    let dir = std::path::Path::new("/dev/shm");
    let nonce = u64::from(std::process::id()) << 16 | 0xdead;
    let live = dir.join(format!("cudalloc-1-{nonce:016x}-live0"));
    let seg = dir.join(format!("cudalloc-1-{nonce:016x}-seg0"));
    for path in [&live, &seg] {
        std::fs::write(path, b"").unwrap();
    }
    let removed = cudalloc::ipc::sweep_orphans().unwrap();
    let gone = !live.exists() && !seg.exists();
    for path in [&live, &seg] {
        let _ = std::fs::remove_file(path);
    }
    assert!(
        gone,
        "kept objects of a dead pid-1 process: removed {removed:?}"
    );
}

fn unsafe_zeroed_flock() -> libc::flock {
    // SAFETY: flock is a plain C struct; all-zero is a valid value (whole file from offset 0).
    unsafe { std::mem::zeroed() }
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn orphan_sweep_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    match role.as_str() {
        "producer" => {
            let seed: u64 = parent.recv().parse().unwrap();
            let a = Arc::new(Runtime::new(Arc::new(host_driver()), Default::default()).unwrap());
            let s = Storage::new(&a, 0, 1 << 20).unwrap();
            s.fill_pattern(seed).unwrap();
            parent.send(&hex(&s.share_ipc().unwrap().into_bytes()));
            // Until the parent is done with the storage (its stdin closes).
            let _ = parent.recv_or_eof();
        }
        other => panic!("unknown role {other}"),
    }
}
