//! Streams: one worker thread per stream runs its operations in order, like a GPU queue.
//!
//! | queue state              | `cuStreamQuery` | `cuStreamSynchronize`       |
//! |--------------------------|-----------------|-----------------------------|
//! | nothing submitted/pending| `SUCCESS`       | returns                     |
//! | operations pending       | `NOT_READY`     | blocks until they are done  |
//! | an operation faulted     | the fault code  | the fault code (sticky, like a device error) |
//!
//! The legacy stream (the null `CUstream` of a context) synchronizes implicitly with the context's
//! *blocking* streams (created without `CU_STREAM_NON_BLOCKING`): work queued on it waits for what
//! those streams had queued, and work queued on them waits for what it had queued
//! (`Double::enqueue`). Non-blocking streams are independent of it.
//!
//! An operation that faults (device work touching freed memory, say) is a violation, recorded
//! once when it runs; afterwards the stream returns the fault code from every query, as a real
//! context does after an illegal address. `cuStreamDestroy` returns at once; queued work still
//! runs, then the worker exits (the documented behaviour).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::report::{report, Checked, Entry, Fail};

/// Device work: what it is (the entry point that queued it), the device memory it touches, and
/// what it does when it runs.
pub struct Op {
    /// The entry point that queued the work (for the report).
    pub entry: Entry,
    /// Device ranges `(address, length)` the work reads or writes.
    pub ranges: Vec<(u64, u64)>,
    /// The work.
    pub run: Box<dyn FnOnce() -> Checked<()> + Send>,
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Op({})", self.entry.name())
    }
}

#[derive(Debug, Default)]
struct Queue {
    ops: VecDeque<Op>,
    submitted: u64,
    completed: u64,
    fault: Option<Fail>,
    closing: bool,
    /// The ranges of the operation running now.
    running: Vec<(u64, u64)>,
}

/// A stream.
#[derive(Debug)]
pub struct Stream {
    /// Its handle (0 for a context's legacy stream).
    pub handle: usize,
    /// Its context's handle.
    pub ctx: usize,
    /// Its device.
    pub device: usize,
    /// Created without `CU_STREAM_NON_BLOCKING` (orders with the legacy stream).
    pub blocking: bool,
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl Stream {
    /// Creates the stream and starts its worker.
    pub fn start(handle: usize, ctx: usize, device: usize, blocking: bool) -> Arc<Stream> {
        let stream = Arc::new(Stream {
            handle,
            ctx,
            device,
            blocking,
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
        });
        let worker = stream.clone();
        std::thread::Builder::new()
            .name(format!("cuda-double-stream-{handle:#x}"))
            .spawn(move || worker.run())
            .map(drop)
            .unwrap_or_else(|err| {
                // Without a worker nothing would ever complete: fault the stream instead.
                stream.lock().fault = Some(Fail::violation(
                    crate::codes::OPERATING_SYSTEM,
                    format!("cannot start the stream's worker thread: {err}"),
                ));
            });
        stream
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self) {
        loop {
            let op = {
                let mut q = self.lock();
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        q.running = op.ranges.clone();
                        break op;
                    }
                    if q.closing {
                        return;
                    }
                    q = self.changed.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let entry = op.entry;
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(op.run))
                .unwrap_or_else(|_| {
                    Err(Fail::violation(
                        crate::codes::LAUNCH_FAILED,
                        "device work panicked inside the double",
                    ))
                });
            let mut q = self.lock();
            q.running.clear();
            q.completed += 1;
            if let Err(fail) = result {
                report().record(entry, &fail);
                if q.fault.is_none() {
                    q.fault = Some(fail);
                }
            }
            self.changed.notify_all();
        }
    }

    fn sticky(q: &Queue) -> Checked<()> {
        match &q.fault {
            Some(f) => Err(Fail::outcome(
                f.code,
                format!("the stream faulted earlier: {}", f.message),
            )),
            None => Ok(()),
        }
    }

    /// Queues the work `make` builds, building it only once the stream accepts work (so an
    /// event record is not started for a stream that refuses it).
    pub fn submit_with(
        &self,
        entry: Entry,
        ranges: Vec<(u64, u64)>,
        make: impl FnOnce() -> Box<dyn FnOnce() -> Checked<()> + Send>,
    ) -> Checked<()> {
        let mut q = self.lock();
        Self::sticky(&q)?;
        if q.closing {
            return Err(Fail::violation(
                crate::codes::INVALID_HANDLE,
                "work submitted to a destroyed stream",
            ));
        }
        q.submitted += 1;
        q.ops.push_back(Op {
            entry,
            ranges,
            run: make(),
        });
        self.changed.notify_all();
        Ok(())
    }

    /// Blocks until everything submitted so far has run.
    pub fn synchronize(&self) -> Checked<()> {
        let mut q = self.lock();
        let target = q.submitted;
        while q.completed < target && q.fault.is_none() {
            q = self.changed.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        Self::sticky(&q)
    }

    /// Whether work queued or running on this stream touches `[ptr, ptr + len)`.
    pub fn touches(&self, ptr: u64, len: u64) -> bool {
        let q = self.lock();
        let hit =
            |&(at, n): &(u64, u64)| at < ptr.saturating_add(len) && ptr < at.saturating_add(n);
        q.running.iter().any(hit) || q.ops.iter().any(|op| op.ranges.iter().any(hit))
    }

    /// Operations submitted so far.
    pub fn submitted(&self) -> u64 {
        self.lock().submitted
    }

    /// Blocks until `target` operations have run (or the stream faulted).
    pub fn wait_completed(&self, target: u64) {
        let mut q = self.lock();
        while q.completed < target && q.fault.is_none() {
            q = self.changed.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether everything submitted has run.
    pub fn idle(&self) -> Checked<bool> {
        let q = self.lock();
        Self::sticky(&q)?;
        Ok(q.completed == q.submitted)
    }

    /// Whether the stream was destroyed and its queued work has all run (nothing of it is left to
    /// wait for).
    pub fn finished(&self) -> bool {
        let q = self.lock();
        q.closing && (q.completed == q.submitted || q.fault.is_some())
    }

    /// Lets the worker exit once its queue is empty.
    pub fn close(&self) {
        self.lock().closing = true;
        self.changed.notify_all();
    }
}
