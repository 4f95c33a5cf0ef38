//! Running a closure in a forked child: its verdict comes back over a pipe, a panic is a failure
//! (never an unwinding into libtest's own machinery in the child), and a hang ends in `SIGALRM`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Command;

/// Environment variable naming the one test a re-executed test binary runs.
const ALONE_VAR: &str = "CUDALLOC_TEST_ALONE";

/// Runs test `name` alone, for a test that forks in a binary whose other tests run meanwhile:
/// `true` in the test binary re-executed to run that test with one test thread (the caller goes
/// on), `false` in the caller's own run, after the re-executed one passed (the caller returns).
pub fn alone(name: &str) -> bool {
    if std::env::var(ALONE_VAR).as_deref() == Ok(name) {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env(ALONE_VAR, name)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{name}, run alone, failed");
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{name}, run alone, ran no test (is the name right?)"
    );
    false
}

/// Seconds a forked child may run before `SIGALRM` ends it (a hang is a failure, not a wait).
pub const CHILD_DEADLINE_S: u32 = 60;

/// Forks; the child runs `f` and `_exit`s (0 if `f` returned `Ok`). Returns the child's verdict:
/// `Ok`, or what failed (its message, its panic, or the signal that ended it).
///
/// Fork only while no other thread of the test binary runs test code — a lock every test of the
/// binary holds, or the test run [`alone`] — so the child inherits no lock another test's thread
/// held at the fork; the allocator's own threads are the point.
pub fn in_forked_child(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid out-array of two descriptors.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe failed");
    // SAFETY: both descriptors were just created and are owned here alone.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the child only runs `f` (cudalloc's and the test's code) and `_exit`s; it never
    // returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        drop(read_end);
        // SAFETY: `alarm` has no preconditions; its SIGALRM ends the child if `f` hangs.
        unsafe { libc::alarm(CHILD_DEADLINE_S) };
        let verdict = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(())) => String::new(),
            Ok(Err(message)) => message,
            Err(panic) => format!(
                "panicked: {}",
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default()
            ),
        };
        let mut pipe = std::fs::File::from(write_end);
        let _ = pipe.write_all(verdict.as_bytes());
        drop(pipe);
        // SAFETY: ends the child at once, without the parent's exit hooks or libtest.
        unsafe { libc::_exit(i32::from(!verdict.is_empty())) };
    }
    drop(write_end);
    let mut verdict = String::new();
    std::fs::File::from(read_end)
        .read_to_string(&mut verdict)
        .unwrap();
    let mut status = 0;
    // SAFETY: waits for the child forked above; `status` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    if libc::WIFSIGNALED(status) {
        let signal = libc::WTERMSIG(status);
        let why = if signal == libc::SIGALRM {
            format!(" (it ran past {CHILD_DEADLINE_S} s: a hang)")
        } else {
            String::new()
        };
        return Err(format!("the child died of signal {signal}{why}"));
    }
    match (libc::WEXITSTATUS(status), verdict.is_empty()) {
        (0, true) => Ok(()),
        (code, _) => Err(format!("the child exited with {code}: {verdict}")),
    }
}
