//! Host-backend streams: one worker thread per stream, executing its queue strictly in order.
//!
//! Every operation enqueued on a stream is a closure. Enqueueing returns a *ticket* (the operation's
//! position in the queue); waiting for a ticket blocks until the worker has finished that operation,
//! which is how stream-ordered blocking calls (host copies, the verify kernel, `synchronize`) are
//! built. Work on different streams really runs concurrently.
//!
//! | queue counter | meaning                                             |
//! |---------------|-----------------------------------------------------|
//! | `submitted`   | tickets handed out so far                           |
//! | `completed`   | operations finished (always `<= submitted`)         |
//! | idle          | `completed == submitted`                            |
//!
//! Three kinds of work, and what a failure does:
//!
//! | work                                      | runs                        | when it fails                                   |
//! |-------------------------------------------|-----------------------------|-------------------------------------------------|
//! | device work: copies, kernels, host kernels | unless inside a fault's window (below) | the stream is *failed* (sticky, like a CUDA kernel fault) |
//! | control: event completions, waits on this process's events, gates | always | (cannot fail; a panic fails the stream) |
//! | a wait on another process's event          | always                      | a *fault* of the stream (below)                 |
//!
//! A **fault** is how one bad producer stays one bad producer. It has a *window*, the tickets from
//! the failed wait to the last one handed out when it failed (the work queued behind the wait then,
//! which may depend on the memory it guarded), and is *reported* once:
//!
//! | a blocking call for ticket `t` (host copy, verify kernel, `synchronize`, `query`) | returns |
//! |------------------------------------------------------|------------------------------------------|
//! | `t` inside a fault's window (its work did not run)   | the fault's error, every time            |
//! | `t` after a fault not reported yet                   | the fault's error, once: it is reported now |
//! | otherwise                                            | success                                  |
//!
//! The error is the typed [`ForeignEvent`](crate::Error::ForeignEvent) naming the producer. Device
//! work in a window is skipped — never run on memory that is not ready; control work still runs
//! (event completions, so nobody waiting on them hangs; waits, so later work stays ordered). After
//! the window work runs normally and, once the fault is reported, every call succeeds: the stream
//! is not failed. So the first blocking call after a failed wait learns of it even when the work
//! that needed the memory was enqueued after the failure; an unrelated call that happens to come
//! first gets the error instead (once) — the cost of a stream-level report, bounded by one. The
//! stream remembers its latest [`MAX_FAULTS`] faults. Draining (a free unmapping memory, teardown)
//! waits for the work but reports nothing: the memory freed is not the memory a failed wait guarded.
//!
//! A panicking operation (a bug, never expected) or a failing host kernel does not kill the stream
//! silently: the stream becomes *failed* — like CUDA's sticky errors — so every later enqueue and
//! wait returns an error instead of hanging or pretending success.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;

use crate::error::{panic_message, Error, Result};
use crate::sync::os::{Arc, Condvar, Mutex, MutexGuard};

/// One unit of stream work that cannot fail.
pub(crate) type Op = Box<dyn FnOnce() + Send + 'static>;

/// Device work that can fail (a library host kernel returning an error): its error fails the
/// stream, like CUDA's sticky errors.
pub(crate) type FallibleOp = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// A wait on another process's event: its error is a fault (see the [module docs](self)).
pub(crate) type ForeignWaitOp = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

/// Faults a stream remembers; an older one is forgotten (its tickets then report success).
pub(crate) const MAX_FAULTS: usize = 64;

enum Work {
    Device(FallibleOp),
    Control(Op),
    ForeignWait(ForeignWaitOp),
}

/// A failed foreign wait: tickets `first..=last` (its window) did not run their device work;
/// `reported` once a blocking call after `first` has returned `error`.
struct Fault {
    first: u64,
    last: u64,
    error: Error,
    reported: bool,
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Work>,
    submitted: u64,
    completed: u64,
    waiters: u32,
    /// Whether the worker waits for work (`has_work`): a push wakes it only then, so a busy
    /// stream takes work without a system call.
    worker_idle: bool,
    shutdown: bool,
    /// What failed the stream: its text, and the error itself when work returned one (the
    /// source of every later error of the stream).
    failure: Option<(String, Option<Error>)>,
    faults: VecDeque<Fault>,
}

impl Queue {
    /// The fault whose window holds `ticket`.
    fn fault_at(&self, ticket: u64) -> Option<&Fault> {
        self.faults
            .iter()
            .rev()
            .find(|f| (f.first..=f.last).contains(&ticket))
    }

    /// What a blocking call for `ticket` reports (see the [module docs](self)): the error of the
    /// fault whose window holds it, else of the earliest fault before it not reported yet. Every
    /// fault before `ticket` counts as reported afterwards.
    fn report(&mut self, ticket: u64) -> Option<Error> {
        let inside = self.fault_at(ticket).map(|f| f.error.clone());
        let mut earliest = None;
        for fault in self.faults.iter_mut() {
            if fault.first <= ticket && !fault.reported {
                fault.reported = true;
                earliest.get_or_insert_with(|| fault.error.clone());
            }
        }
        inside.or(earliest)
    }
}

/// A stream of the host backend.
pub(crate) struct HostStream {
    device: usize,
    id: u64,
    queue: Mutex<Queue>,
    has_work: Condvar,
    progressed: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for HostStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = self.queue.lock();
        f.debug_struct("HostStream")
            .field("id", &self.id)
            .field("device", &self.device)
            .field("submitted", &q.submitted)
            .field("completed", &q.completed)
            .field("faults", &q.faults.len())
            .finish()
    }
}

/// What running one unit of work came to.
enum Outcome {
    Done,
    /// Device work inside a fault: not run.
    Skipped,
    /// Device work that returned an error (sticky).
    Failed(Error),
    /// A panic (a bug; sticky).
    Panicked(String),
    /// A failed foreign wait: a fault.
    Fault(Error),
}

/// Runs `work` (device work only when it is not `in_fault`), catching panics.
fn execute(work: Work, in_fault: bool) -> Outcome {
    let caught = |panic: Box<dyn std::any::Any + Send>| Outcome::Panicked(panic_message(&*panic));
    match work {
        Work::Device(_) if in_fault => Outcome::Skipped,
        Work::Device(op) => match catch_unwind(AssertUnwindSafe(op)) {
            Ok(Ok(())) => Outcome::Done,
            Ok(Err(what)) => Outcome::Failed(what),
            Err(panic) => caught(panic),
        },
        Work::Control(op) => {
            catch_unwind(AssertUnwindSafe(op)).map_or_else(caught, |()| Outcome::Done)
        }
        Work::ForeignWait(op) => match catch_unwind(AssertUnwindSafe(op)) {
            Ok(Ok(())) => Outcome::Done,
            Ok(Err(err)) => Outcome::Fault(err),
            Err(panic) => caught(panic),
        },
    }
}

impl HostStream {
    /// Starts a stream and its worker thread.
    pub(crate) fn spawn(device: usize, id: u64) -> Result<Arc<Self>> {
        let stream = Arc::new(HostStream {
            device,
            id,
            queue: Mutex::new(Queue::default()),
            has_work: Condvar::new(),
            progressed: Condvar::new(),
            worker: Mutex::new(None),
        });
        let for_worker = Arc::clone(&stream);
        let handle = std::thread::Builder::new()
            .name(format!("cudalloc-stream-{id}"))
            .spawn(move || for_worker.run())
            .map_err(|e| Error::host_os("pthread_create", e))?;
        *stream.worker.lock() = Some(handle);
        Ok(stream)
    }

    /// The device this stream belongs to.
    pub(crate) fn device(&self) -> usize {
        self.device
    }

    /// This stream's id (for messages).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    fn run(&self) {
        loop {
            let (work, ticket, in_fault) = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(work) = q.ops.pop_front() {
                        let ticket = q.completed + 1;
                        let in_fault = q.fault_at(ticket).is_some();
                        break (work, ticket, in_fault);
                    }
                    if q.shutdown {
                        return;
                    }
                    q.worker_idle = true;
                    q = self.has_work.wait(q);
                    q.worker_idle = false;
                }
            };
            let outcome = execute(work, in_fault);
            self.complete(&mut self.queue.lock(), ticket, outcome);
        }
    }

    /// Counts the operation with `ticket` done with `outcome` (a failure or fault recorded) and
    /// wakes whoever waits for progress.
    fn complete(&self, q: &mut Queue, ticket: u64, outcome: Outcome) {
        q.completed += 1;
        match outcome {
            Outcome::Done | Outcome::Skipped => {}
            Outcome::Failed(error) => {
                tracing::warn!(stream = self.id, %error, "host stream operation failed; stream failed");
                q.failure.get_or_insert((error.to_string(), Some(error)));
            }
            Outcome::Panicked(what) => {
                tracing::error!(stream = self.id, %what, "host stream operation panicked; stream failed");
                q.failure.get_or_insert((what, None));
            }
            Outcome::Fault(error) => {
                let last = q.submitted;
                tracing::warn!(
                    stream = self.id,
                    %error,
                    tickets = last - ticket + 1,
                    "a wait on another process's event failed: it and the work queued behind it fail; the stream stays usable"
                );
                if q.faults.len() == MAX_FAULTS {
                    q.faults.pop_front();
                }
                q.faults.push_back(Fault {
                    first: ticket,
                    last,
                    error,
                    reported: false,
                });
            }
        }
        if q.waiters > 0 {
            self.progressed.notify_all();
        }
    }

    fn check_usable(&self, q: &Queue) -> Result<()> {
        if let Some((failure, error)) = &q.failure {
            // A typed kernel's panic keeps its kind: the program's bug, not the driver's.
            if let Some(Error::KernelPanic { operands, message }) = error {
                return Err(Error::KernelPanic {
                    operands: operands.clone(),
                    message: format!("{message} (stream {} failed by it)", self.id),
                });
            }
            return Err(Error::Driver {
                source: error.clone().map(crate::error::Cause::new),
                backend: "host",
                call: "stream",
                message: format!("stream {} failed earlier: {failure}", self.id),
            });
        }
        if q.shutdown {
            return Err(Error::invalid(format!("stream {} was destroyed", self.id)));
        }
        Ok(())
    }

    fn push(&self, work: Work) -> Result<u64> {
        let mut q = self.queue.lock();
        self.check_usable(&q)?;
        q.ops.push_back(work);
        q.submitted += 1;
        let ticket = q.submitted;
        let idle = q.worker_idle;
        drop(q);
        if idle {
            self.has_work.notify_one();
        }
        Ok(ticket)
    }

    /// Appends device work to the queue; returns its ticket.
    pub(crate) fn enqueue(&self, op: Op) -> Result<u64> {
        self.enqueue_fallible(Box::new(move || {
            op();
            Ok(())
        }))
    }

    /// Appends device work that can fail the stream; returns its ticket.
    pub(crate) fn enqueue_fallible(&self, op: FallibleOp) -> Result<u64> {
        self.push(Work::Device(op))
    }

    /// Appends control work (runs even inside a fault); returns its ticket.
    pub(crate) fn enqueue_control(&self, op: Op) -> Result<u64> {
        self.push(Work::Control(op))
    }

    /// Control work that an idle stream runs at once, on the calling thread (everything queued
    /// before it is done, so running it now is running it in order); a busy stream queues it
    /// (`enqueue_control`). For quick work that never touches this stream's queue (an event's
    /// completion): it runs under the queue's lock. Saves the worker's wake-up and, for whoever
    /// waits on the event, a wait that finds it already complete.
    pub(crate) fn control_now_or_enqueue(&self, op: Op) -> Result<u64> {
        let mut q = self.queue.lock();
        self.check_usable(&q)?;
        if !q.ops.is_empty() || q.completed != q.submitted {
            drop(q);
            return self.enqueue_control(op);
        }
        q.submitted += 1;
        let ticket = q.submitted;
        let outcome = execute(Work::Control(op), false);
        self.complete(&mut q, ticket, outcome);
        Ok(ticket)
    }

    /// Appends a wait on another process's event; its error becomes a fault.
    pub(crate) fn enqueue_foreign_wait(&self, op: ForeignWaitOp) -> Result<u64> {
        self.push(Work::ForeignWait(op))
    }

    /// Waits, under the queue's lock, until `ticket` has finished.
    fn finished(&self, ticket: u64) -> MutexGuard<'_, Queue> {
        let mut q = self.queue.lock();
        q.waiters += 1;
        // Wait for completion even on a failed stream: the worker keeps draining its queue, and
        // callers (free, close) rely on queued work being finished before they unmap memory.
        while q.completed < ticket {
            q = self.progressed.wait(q);
        }
        q.waiters -= 1;
        q
    }

    /// Blocks until the operation with `ticket` (and so everything before it) has finished; a
    /// fault's error as the [module docs](self) say.
    pub(crate) fn wait_for(&self, ticket: u64) -> Result<()> {
        let mut q = self.finished(ticket);
        if q.failure.is_some() {
            return self.check_usable(&q);
        }
        match q.report(ticket) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Blocks until the operation with `ticket` has finished, whatever its outcome (for another
    /// stream's ordering: a failure is reported on this stream).
    pub(crate) fn wait_done(&self, ticket: u64) {
        drop(self.finished(ticket));
    }

    /// Blocks until everything enqueued so far has finished.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let ticket = self.queue.lock().submitted;
        self.wait_for(ticket)
    }

    /// Blocks until everything enqueued so far has finished; reports a failed stream but no fault
    /// (for frees and teardown, which need the work done, not its outcome).
    pub(crate) fn drain(&self) -> Result<()> {
        let ticket = self.queue.lock().submitted;
        let q = self.finished(ticket);
        match &q.failure {
            Some(_) => self.check_usable(&q),
            None => Ok(()),
        }
    }

    /// Whether everything enqueued so far has finished; a fault's error as for a blocking call
    /// for the latest ticket.
    pub(crate) fn is_idle(&self) -> Result<bool> {
        let mut q = self.queue.lock();
        if q.failure.is_some() {
            return self.check_usable(&q).map(|()| false);
        }
        let latest = q.submitted;
        match q.report(latest) {
            Some(error) => Err(error),
            None => Ok(q.completed == q.submitted),
        }
    }

    /// Lets the queue drain, then stops and joins the worker. Later enqueues fail.
    pub(crate) fn shutdown(&self) {
        self.queue.lock().shutdown = true;
        self.has_work.notify_all();
        if let Some(handle) = self.worker.lock().take() {
            if handle.join().is_err() {
                tracing::error!(
                    stream = self.id,
                    "host stream worker panicked outside an operation"
                );
            }
        }
    }
}

/// A host-only test facility: holds a stream at a point in its queue until opened, like a kernel
/// spinning on a flag the host sets (`cuStreamWaitValue32`). Proves asynchrony without timing.
/// Dropping the gate opens it, so a forgotten gate never deadlocks a stream.
#[derive(Debug)]
pub struct StreamGate {
    state: Arc<(Mutex<bool>, Condvar)>,
}

impl StreamGate {
    pub(crate) fn install(stream: &HostStream) -> Result<Self> {
        let state = Arc::new((Mutex::new(false), Condvar::new()));
        let for_op = Arc::clone(&state);
        stream.enqueue_control(Box::new(move || {
            let (open, cv) = &*for_op;
            let mut open = open.lock();
            while !*open {
                open = cv.wait(open);
            }
        }))?;
        Ok(StreamGate { state })
    }

    /// Lets the stream continue past the gate.
    pub fn open(&self) {
        let (open, cv) = &*self.state;
        *open.lock() = true;
        cv.notify_all();
    }
}

impl Drop for StreamGate {
    fn drop(&mut self) {
        self.open();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::os::atomic::{AtomicU64, Ordering};

    #[test]
    fn operations_run_in_order_and_tickets_wait() {
        let s = HostStream::spawn(0, 1).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut last = 0;
        for i in 0..100 {
            let log = Arc::clone(&log);
            last = s.enqueue(Box::new(move || log.lock().push(i))).unwrap();
        }
        s.wait_for(last).unwrap();
        assert_eq!(*log.lock(), (0..100).collect::<Vec<_>>());
        assert!(s.is_idle().unwrap());
        s.shutdown();
        assert!(s.enqueue(Box::new(|| {})).is_err());
    }

    #[test]
    fn gate_holds_later_work_until_opened() {
        let s = HostStream::spawn(0, 2).unwrap();
        let done = Arc::new(AtomicU64::new(0));
        let gate = StreamGate::install(&s).unwrap();
        let d = Arc::clone(&done);
        let ticket = s
            .enqueue(Box::new(move || d.store(1, Ordering::SeqCst)))
            .unwrap();
        assert!(!s.is_idle().unwrap());
        assert_eq!(done.load(Ordering::SeqCst), 0);
        gate.open();
        s.wait_for(ticket).unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 1);
        s.shutdown();
    }

    #[test]
    fn a_panicking_operation_fails_the_stream_instead_of_hanging() {
        let s = HostStream::spawn(0, 3).unwrap();
        let ticket = s.enqueue(Box::new(|| panic!("boom"))).unwrap();
        let err = s.wait_for(ticket).unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
        assert!(s.enqueue(Box::new(|| {})).is_err());
        assert!(s.synchronize().is_err());
        s.shutdown();
    }

    fn foreign_failure() -> Error {
        Error::ForeignEvent {
            pid: 42,
            chunk: "cudalloc-42-0-evt0".into(),
            failure: crate::ForeignEventFailure::Timeout,
            message: "test".into(),
        }
    }

    #[test]
    fn a_failed_foreign_wait_fails_the_work_behind_it_and_nothing_after() {
        let s = HostStream::spawn(0, 4).unwrap();
        let ran = Arc::new(AtomicU64::new(0));
        let gate = StreamGate::install(&s).unwrap();
        let wait = s
            .enqueue_foreign_wait(Box::new(|| Err(foreign_failure())))
            .unwrap();
        let (r1, r2, r3) = (Arc::clone(&ran), Arc::clone(&ran), Arc::clone(&ran));
        let device = s
            .enqueue(Box::new(move || {
                r1.fetch_add(1, Ordering::SeqCst);
            }))
            .unwrap();
        let control = s
            .enqueue_control(Box::new(move || {
                r2.fetch_add(10, Ordering::SeqCst);
            }))
            .unwrap();
        gate.open();
        for ticket in [wait, device, control] {
            let err = s.wait_for(ticket).unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::ForeignEvent, "{err}");
        }
        assert!(
            s.synchronize().is_err(),
            "the latest ticket is in the fault"
        );
        assert!(s.is_idle().is_err());
        s.drain().unwrap();
        assert_eq!(
            ran.load(Ordering::SeqCst),
            10,
            "device work in the window is skipped, control work runs"
        );
        // Work enqueued after the window runs, and (the fault reported) every later wait succeeds.
        let later = s
            .enqueue(Box::new(move || {
                r3.fetch_add(100, Ordering::SeqCst);
            }))
            .unwrap();
        s.wait_for(later).unwrap();
        s.synchronize().unwrap();
        assert!(s.is_idle().unwrap());
        assert_eq!(ran.load(Ordering::SeqCst), 110);
        s.shutdown();
    }

    #[test]
    fn the_first_blocking_call_after_a_failed_wait_reports_it_once() {
        let s = HostStream::spawn(0, 6).unwrap();
        s.enqueue_foreign_wait(Box::new(|| Err(foreign_failure())))
            .unwrap();
        s.drain().unwrap();
        // Enqueued after the failure (nothing was behind the wait): it runs, and its wait reports.
        let ran = Arc::new(AtomicU64::new(0));
        let r = Arc::clone(&ran);
        let after = s
            .enqueue(Box::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }))
            .unwrap();
        let err = s.wait_for(after).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::ForeignEvent, "{err}");
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        s.wait_for(after).unwrap();
        s.synchronize().unwrap();
        assert!(s.is_idle().unwrap());
        s.shutdown();
    }

    #[test]
    fn a_stream_remembers_a_bounded_number_of_faults() {
        let s = HostStream::spawn(0, 5).unwrap();
        let first = s
            .enqueue_foreign_wait(Box::new(|| Err(foreign_failure())))
            .unwrap();
        s.drain().unwrap();
        let mut last = first;
        for _ in 0..MAX_FAULTS {
            last = s
                .enqueue_foreign_wait(Box::new(|| Err(foreign_failure())))
                .unwrap();
            s.drain().unwrap();
        }
        assert!(
            s.wait_for(last).is_err(),
            "inside the latest fault's window"
        );
        s.wait_for(first).unwrap();
        assert_eq!(s.queue.lock().faults.len(), MAX_FAULTS);
        s.shutdown();
    }
}
