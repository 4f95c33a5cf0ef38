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
//! A panicking operation (a bug, never expected) does not kill the stream silently: the stream
//! becomes *failed* — like CUDA's sticky errors — so every later enqueue and wait returns an error
//! instead of hanging or pretending success.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::sync::os::{Arc, Condvar, Mutex};

/// One unit of stream work.
pub(crate) type Op = Box<dyn FnOnce() + Send + 'static>;

/// A unit of stream work that can fail (a wait on another process's event whose owner died): its
/// error fails the stream, like CUDA's sticky errors.
pub(crate) type FallibleOp = Box<dyn FnOnce() -> std::result::Result<(), String> + Send + 'static>;

#[derive(Default)]
struct Queue {
    ops: VecDeque<FallibleOp>,
    submitted: u64,
    completed: u64,
    waiters: u32,
    shutdown: bool,
    failure: Option<String>,
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
            .finish()
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

    fn run(&self) {
        loop {
            let op = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        break op;
                    }
                    if q.shutdown {
                        return;
                    }
                    q = self.has_work.wait(q);
                }
            };
            let outcome = catch_unwind(AssertUnwindSafe(op));
            let mut q = self.queue.lock();
            q.completed += 1;
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(what)) => {
                    tracing::warn!(stream = self.id, %what, "host stream operation failed; stream failed");
                    q.failure.get_or_insert(what);
                }
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".to_owned());
                    tracing::error!(stream = self.id, %what, "host stream operation panicked; stream failed");
                    q.failure.get_or_insert(what);
                }
            }
            if q.waiters > 0 {
                self.progressed.notify_all();
            }
        }
    }

    fn check_usable(&self, q: &Queue) -> Result<()> {
        if let Some(failure) = &q.failure {
            return Err(Error::Driver {
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

    /// Appends `op` to the queue; returns its ticket.
    pub(crate) fn enqueue(&self, op: Op) -> Result<u64> {
        self.enqueue_fallible(Box::new(move || {
            op();
            Ok(())
        }))
    }

    /// Appends an operation that can fail the stream; returns its ticket.
    pub(crate) fn enqueue_fallible(&self, op: FallibleOp) -> Result<u64> {
        let mut q = self.queue.lock();
        self.check_usable(&q)?;
        q.ops.push_back(op);
        q.submitted += 1;
        let ticket = q.submitted;
        drop(q);
        self.has_work.notify_one();
        Ok(ticket)
    }

    /// Blocks until the operation with `ticket` (and so everything before it) has finished.
    pub(crate) fn wait_for(&self, ticket: u64) -> Result<()> {
        let mut q = self.queue.lock();
        q.waiters += 1;
        // Wait for completion even on a failed stream: the worker keeps draining its queue, and
        // callers (free, close) rely on queued work being finished before they unmap memory.
        while q.completed < ticket {
            q = self.progressed.wait(q);
        }
        q.waiters -= 1;
        match &q.failure {
            Some(_) => self.check_usable(&q),
            None => Ok(()),
        }
    }

    /// Blocks until everything enqueued so far has finished.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let ticket = self.queue.lock().submitted;
        self.wait_for(ticket)
    }

    /// Whether everything enqueued so far has finished.
    pub(crate) fn is_idle(&self) -> Result<bool> {
        let q = self.queue.lock();
        match &q.failure {
            Some(_) => self.check_usable(&q).map(|()| false),
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
        stream.enqueue(Box::new(move || {
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
}
