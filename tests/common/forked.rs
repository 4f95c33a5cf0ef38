//! Running a closure in a forked child: its verdict comes back over a pipe, a panic is a failure
//! (never an unwinding into libtest's own machinery in the child), and a hang ends in `SIGALRM`.
//! One child at a time ([`in_forked_child`]), or several side by side ([`fork_child`], each
//! waited for until a deadline that detects a hang: [`ForkedChild::wait_until`]).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::Instant;

/// Environment variable naming the one test a re-executed test binary runs.
const ALONE_VAR: &str = "CUDALLOC_TEST_ALONE";

/// Runs test `name` alone, for a test that forks in a binary whose other tests run meanwhile:
/// `true` in the test binary re-executed to run that test with one test thread (the caller goes
/// on), `false` in the caller's own run, after the re-executed one passed (the caller returns).
pub(crate) fn alone(name: &str) -> bool {
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
pub(crate) const CHILD_DEADLINE_S: u32 = 60;

/// Forks; the child runs `f` and `_exit`s (0 if `f` returned `Ok`). Returns the child's verdict:
/// `Ok`, or what failed (its message, its panic, or the signal that ended it).
///
/// Fork only while no other thread of the test binary runs test code — a lock every test of the
/// binary holds, or the test run [`alone`] — so the child inherits no lock another test's thread
/// held at the fork; the allocator's own threads are the point.
pub(crate) fn in_forked_child(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    fork_child(f).wait().map_err(|failure| failure.why)
}

/// Why a forked child failed: `hung` when it never ended by itself (its `SIGALRM`, or the
/// parent's kill at the deadline of [`ForkedChild::wait_until`]).
#[derive(Debug)]
pub(crate) struct ChildFailure {
    pub hung: bool,
    pub why: String,
}

/// A child forked by [`fork_child`], not yet waited for.
#[must_use = "wait for the child"]
pub(crate) struct ForkedChild {
    pid: libc::pid_t,
    verdict: OwnedFd,
}

/// Forks; the child runs `f` (ended by `SIGALRM` after [`CHILD_DEADLINE_S`]) and `_exit`s, 0 if
/// `f` returned `Ok`; the parent goes on at once. Several children may run at a time: each
/// has its own pipe for its verdict (the other children inherit only read ends of it, which
/// never hold its end of file back). Fork as [`in_forked_child`] says.
pub(crate) fn fork_child(f: impl FnOnce() -> Result<(), String>) -> ForkedChild {
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
    ForkedChild {
        pid,
        verdict: read_end,
    }
}

impl ForkedChild {
    /// The child's pid.
    pub(crate) fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// Waits for the child to end by itself (a hang ends in its `SIGALRM`); its verdict.
    pub(crate) fn wait(self) -> Result<(), ChildFailure> {
        let mut verdict = String::new();
        std::fs::File::from(self.verdict)
            .read_to_string(&mut verdict)
            .unwrap();
        reap(self.pid, verdict)
    }

    /// Waits for the child's verdict until `deadline` at the latest — `poll` on its pipe, which
    /// ends when the child does — then kills it, a hang: a detector of children that never end,
    /// not a measure of how long they take. Its verdict.
    pub(crate) fn wait_until(self, deadline: Instant) -> Result<(), ChildFailure> {
        let mut file = std::fs::File::from(self.verdict);
        let mut verdict = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut fd = libc::pollfd {
                fd: file.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let timeout = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
            // SAFETY: `fd` is one valid pollfd for the pipe this function owns.
            let ready = unsafe { libc::poll(&mut fd, 1, timeout) };
            if ready < 0
                && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
            {
                continue;
            }
            assert!(
                ready >= 0,
                "poll failed: {}",
                std::io::Error::last_os_error()
            );
            if ready == 0 {
                // SAFETY: kills the child this value owns and has not reaped yet.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
                let mut status = 0;
                // SAFETY: reaps that child; `status` is a valid out-pointer.
                assert_eq!(unsafe { libc::waitpid(self.pid, &mut status, 0) }, self.pid);
                return Err(ChildFailure {
                    hung: true,
                    why: format!(
                        "child {} still ran at the deadline: killed (a hang)",
                        self.pid
                    ),
                });
            }
            let mut chunk = [0u8; 4096];
            match file.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => verdict.extend_from_slice(&chunk[..n]),
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
                Err(err) => panic!("reading child {}'s verdict: {err}", self.pid),
            }
        }
        reap(self.pid, String::from_utf8_lossy(&verdict).into_owned())
    }
}

/// Waits for child `pid`, whose pipe gave `verdict`; how it ended.
fn reap(pid: libc::pid_t, verdict: String) -> Result<(), ChildFailure> {
    let mut status = 0;
    // SAFETY: waits for a child forked by `fork_child`; `status` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    if libc::WIFSIGNALED(status) {
        let signal = libc::WTERMSIG(status);
        let hung = signal == libc::SIGALRM;
        let why = if hung {
            format!(" (it ran past {CHILD_DEADLINE_S} s: a hang)")
        } else {
            String::new()
        };
        return Err(ChildFailure {
            hung,
            why: format!("the child died of signal {signal}{why}"),
        });
    }
    match (libc::WEXITSTATUS(status), verdict.is_empty()) {
        (0, true) => Ok(()),
        (code, _) => Err(ChildFailure {
            hung: false,
            why: format!("the child exited with {code}: {verdict}"),
        }),
    }
}
