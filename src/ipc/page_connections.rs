//! The page server's loop: every connection of the page socket served at once by one thread,
//! nonblocking, each with its own deadline, under the limits of [`PageSocketLimits`].
//!
//! **Why one `poll` thread.** The work of a connection is tiny (read 120 bytes, export a batch of
//! descriptors under the registry lock, one `sendmsg`, read 16 bytes); what takes time is waiting
//! for the peer. A thread per connection (or a pool) lets peers that wait hold threads — a pool
//! of *n* is stalled by *n* silent peers, as the old one-at-a-time server was by one — and a stop
//! must then wait for threads blocked in reads. With nonblocking sockets and one `poll` over all of
//! them, a silent or slow peer costs a table entry until its deadline, an honest request is served
//! as soon as its bytes arrive, and stopping (the wake pipe closes) ends the loop within one pass:
//! it never blocks anywhere else.
//!
//! Per connection (its deadline is [`PageSocketLimits::deadline`] after it was accepted, then
//! after each step of its peer: the whole request, each acknowledgement — a slow peer is cut, a
//! large answer to a peer that keeps up is not):
//!
//! | phase   | waits for (poll) | on progress                                           | at its deadline |
//! |---------|------------------|-------------------------------------------------------|-----------------|
//! | request | readable         | 8 bytes not the magic → refuse; all [`REQUEST_SIZE`] → parse, authorize (`Registry::authorize`) → send batch 0, or refuse | closed ("timeout: … no complete request") |
//! | send    | writable, or budget | export the batch's chunks, `sendmsg` (header + records + descriptors) → ack | closed, or lingers if part of the batch left |
//! | ack     | readable         | the acknowledgement of this batch → next batch, or done (closed) | lingers if unread ("timeout: … no acknowledgement") |
//! | refuse  | writable         | the refusal header written → closed                   | closed          |
//! | linger  | nothing (checked every [`LINGER_CHECK`]) | the peer read everything we sent (`SIOCOUTQ` = 0) or closed → closed | — (until then) |
//!
//! A new connection is admitted if its peer runs as our user, the socket has fewer than
//! `max_connections` connections, its peer process fewer than `max_connections_per_peer` and no
//! lingering one; otherwise it gets a [`Refusal::Busy`] header and is closed at once (never left in
//! the backlog). A peer that stops reading can pin only what is in its receive queue: one batch
//! per connection (the next is sent after the acknowledgement), within `max_unread_bytes` of all
//! connections together, and its connection lingers — counted — until it reads or closes, so the
//! bound holds however often it reconnects.

use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;

use super::page_protocol::{
    self, PageRecord, PageRequest, PageSocketLimits, Refusal, ReplyHeader, ACK_SIZE, REQUEST_MAGIC,
    REQUEST_SIZE,
};
use super::page_server::Registry;
use crate::driver::{Driver, ExportedChunk};
use crate::shm::socket::{self, ShmListener};

/// How often lingering connections are checked for their peer having read or closed.
const LINGER_CHECK: Duration = Duration::from_millis(100);
/// Connections accepted per pass of the loop at most (more wait for the next pass).
const ACCEPTS_PER_PASS: usize = 64;
/// How long the listener rests after `accept` failed for want of descriptors.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// A message being sent: its bytes, and the descriptors that go with its first byte.
struct Outgoing {
    bytes: Vec<u8>,
    sent: usize,
    fds: Vec<OwnedFd>,
}

impl Outgoing {
    fn refusal(refusal: Refusal, count: u64) -> Self {
        Outgoing {
            bytes: ReplyHeader::refusal(refusal, count).encode().to_vec(),
            sent: 0,
            fds: Vec::new(),
        }
    }
}

/// Pages `start .. start + pages` of the answer, batch number `batch`.
#[derive(Clone, Copy)]
struct Batch {
    number: u32,
    start: u64,
    pages: u64,
}

enum Phase {
    Request {
        buf: [u8; REQUEST_SIZE],
        got: usize,
    },
    /// `out` is `None` while the batch waits for the unread budget.
    Send {
        batch: Batch,
        out: Option<Outgoing>,
    },
    Ack {
        batch: Batch,
        buf: [u8; ACK_SIZE],
        got: usize,
    },
    Refuse {
        out: Outgoing,
    },
    Linger,
    Closed,
}

struct Conn {
    stream: UnixStream,
    pid: u32,
    /// When the peer's next step is due.
    deadline: Instant,
    request: Option<PageRequest>,
    phase: Phase,
    /// Bytes of pages sent on this connection and not acknowledged (or, lingering, not read).
    unread: u64,
}

impl Conn {
    fn page(&self) -> u64 {
        self.request.as_ref().map_or(0, |r| r.pages.page)
    }

    fn count(&self) -> u64 {
        self.request.as_ref().map_or(0, |r| r.pages.count)
    }

    fn batch_bytes(&self, batch: Batch) -> u64 {
        batch.pages.saturating_mul(self.page())
    }

    /// The batch after `done` pages, sized by `limits`.
    fn batch_from(&self, number: u32, done: u64, limits: &PageSocketLimits) -> Batch {
        Batch {
            number,
            start: done,
            pages: limits
                .pages_per_batch(self.page())
                .min(self.count().saturating_sub(done)),
        }
    }

    fn refuse(&mut self, refusal: Refusal) {
        tracing::debug!(peer = self.pid, ?refusal, "page request refused");
        self.phase = Phase::Refuse {
            out: Outgoing::refusal(refusal, self.count()),
        };
    }
}

/// What a step asks of the loop.
enum Step {
    /// Waiting on the peer (or the budget).
    Keep,
    /// Nothing of ours is in the peer's queue: close.
    Close,
    /// Stop serving; close, or linger while the peer has not read what we sent.
    Retire,
}

/// Everything the loop serves.
struct Server<'a> {
    registry: &'a Registry,
    driver: &'a dyn Driver,
    socket: &'a str,
    conns: Vec<Conn>,
    /// Bytes of pages sent and not acknowledged or read, over all connections.
    unread: u64,
    /// Until when the listener is left alone (after running out of descriptors).
    listener_rests_until: Option<Instant>,
}

/// Serves the page socket until the stop pipe `wake` closes (or the socket fails).
pub(super) fn serve(
    listener: &ShmListener,
    wake: &OwnedFd,
    registry: &Registry,
    driver: &dyn Driver,
) {
    let mut server = Server {
        registry,
        driver,
        socket: listener.name(),
        conns: Vec::new(),
        unread: 0,
        listener_rests_until: None,
    };
    let mut revents: Vec<PollFlags> = Vec::new();
    loop {
        let limits = PageSocketLimits::current();
        let now = Instant::now();
        server.advance(&revents, &limits, now);
        let listening = server.listener_rests_until.is_none_or(|t| now >= t);
        if listening {
            server.listener_rests_until = None;
        }
        let timeout = server.poll_timeout(now);
        // The stop pipe first, the listener next (while it is not resting), then every connection
        // that waits for something (`slots`: where in `fds` each connection is, if polled).
        let mut fds = Vec::with_capacity(2 + server.conns.len());
        fds.push(PollFd::new(wake, PollFlags::IN));
        if listening {
            fds.push(PollFd::new(&listener.listener, PollFlags::IN));
        }
        let slots: Vec<Option<usize>> = server
            .conns
            .iter()
            .map(|c| {
                interest(&c.phase).map(|events| {
                    fds.push(PollFd::new(&c.stream, events));
                    fds.len() - 1
                })
            })
            .collect();
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(_) => {}
            Err(Errno::INTR) => {
                revents.clear();
                continue;
            }
            Err(err) => {
                let err = std::io::Error::from(err);
                tracing::error!(%err, socket = server.socket, "page server: poll failed; stopping");
                return;
            }
        }
        let woken = !fds[0].revents().is_empty();
        let listener_events = if listening {
            fds[1].revents()
        } else {
            PollFlags::empty()
        };
        revents = slots
            .iter()
            .map(|slot| slot.map_or(PollFlags::empty(), |at| fds[at].revents()))
            .collect();
        drop(fds);
        if woken {
            return; // the stop pipe closed
        }
        if listener_events.intersects(PollFlags::ERR | PollFlags::HUP | PollFlags::NVAL) {
            // A broken listener never becomes readable again: stop rather than spin.
            tracing::error!(
                socket = server.socket,
                "page server: the socket failed; stopping"
            );
            return;
        }
        if listener_events.contains(PollFlags::IN) {
            server.accept(listener, &limits);
        }
    }
}

/// What a connection in `phase` waits for (`None`: not polled).
fn interest(phase: &Phase) -> Option<PollFlags> {
    match phase {
        Phase::Request { .. } | Phase::Ack { .. } => Some(PollFlags::IN),
        Phase::Send { out: Some(_), .. } | Phase::Refuse { .. } => Some(PollFlags::OUT),
        // Waiting for budget: only a hang-up (always reported) matters.
        Phase::Send { out: None, .. } => Some(PollFlags::empty()),
        Phase::Linger | Phase::Closed => None,
    }
}

impl Server<'_> {
    /// How long the next poll may sleep: until the nearest deadline, or the next linger check.
    fn poll_timeout(&self, now: Instant) -> Option<Timespec> {
        let mut next: Option<Instant> = self.listener_rests_until;
        for c in &self.conns {
            let at = match c.phase {
                Phase::Linger => now + LINGER_CHECK,
                _ => c.deadline,
            };
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        next.map(|at| {
            let wait = at.saturating_duration_since(now);
            // Rounded up to the millisecond, so the loop does not wake just before a deadline and
            // spin.
            let ms = i64::try_from(wait.as_nanos().div_ceil(1_000_000)).unwrap_or(i64::MAX / 2);
            Timespec {
                tv_sec: ms / 1000,
                tv_nsec: (ms % 1000) * 1_000_000,
            }
        })
    }

    /// Accepts what waits in the backlog: admits it, or refuses it at once.
    fn accept(&mut self, listener: &ShmListener, limits: &PageSocketLimits) {
        for _ in 0..ACCEPTS_PER_PASS {
            match listener.listener.accept() {
                Ok((stream, _)) => self.admit(stream, limits),
                Err(err) => match err.kind() {
                    std::io::ErrorKind::WouldBlock => return,
                    std::io::ErrorKind::Interrupted => continue,
                    _ => {
                        // EMFILE and the like: the backlog stays readable, so rest instead of
                        // spinning on it.
                        tracing::warn!(%err, socket = self.socket, "page server: accept failed");
                        self.listener_rests_until = Some(Instant::now() + ACCEPT_PAUSE);
                        return;
                    }
                },
            }
        }
    }

    fn admit(&mut self, stream: UnixStream, limits: &PageSocketLimits) {
        if let Err(err) = stream.set_nonblocking(true) {
            tracing::debug!(%err, "page server: a connection could not be made nonblocking");
            return;
        }
        let peer = match socket::peer_credentials(&stream) {
            Ok(peer) => peer,
            Err(err) => {
                tracing::debug!(%err, "page server: a connection without credentials");
                return;
            }
        };
        if !peer.is_our_user() {
            tracing::warn!(
                uid = peer.uid,
                pid = peer.pid,
                socket = self.socket,
                "page server: a process of another user connected; closed"
            );
            return;
        }
        let of_peer = self.conns.iter().filter(|c| c.pid == peer.pid);
        let (mine, lingering) = of_peer.fold((0u32, false), |(n, l), c| {
            (n + 1, l || matches!(c.phase, Phase::Linger))
        });
        let total = u32::try_from(self.conns.len()).unwrap_or(u32::MAX);
        if total >= limits.max_connections || mine >= limits.max_connections_per_peer || lingering {
            tracing::debug!(
                peer = peer.pid,
                connections = total,
                of_peer = mine,
                lingering,
                socket = self.socket,
                "page server: at a connection limit; refused"
            );
            // One try, no waiting: a fresh connection's buffer always takes a header.
            let header = ReplyHeader::refusal(Refusal::Busy, 0).encode();
            // A peer that already left needs no answer.
            let _ = socket::send_fds_nonblocking(&stream, &header, &[]);
            return;
        }
        self.conns.push(Conn {
            stream,
            pid: peer.pid,
            deadline: Instant::now() + limits.deadline,
            request: None,
            phase: Phase::Request {
                buf: [0; REQUEST_SIZE],
                got: 0,
            },
            unread: 0,
        });
    }

    /// One pass over the connections: lingering ones checked, expired ones retired, the others
    /// moved as far as their sockets allow; closed ones removed.
    fn advance(&mut self, revents: &[PollFlags], limits: &PageSocketLimits, now: Instant) {
        let mut conns = std::mem::take(&mut self.conns);
        for (at, conn) in conns.iter_mut().enumerate() {
            let hung_up = revents
                .get(at)
                .is_some_and(|r| r.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL));
            let step = match conn.phase {
                Phase::Linger => match socket::unread_bytes(&conn.stream) {
                    Ok(0) | Err(_) => Step::Close,
                    Ok(_) => Step::Keep,
                },
                Phase::Closed => Step::Close,
                _ if now >= conn.deadline => self.expire(conn, limits),
                _ => self.progress(conn, hung_up, limits),
            };
            self.apply(conn, step);
        }
        // Budget freed late in the pass (an acknowledgement, a close) may let a batch that waited
        // earlier in it go now, rather than at its deadline.
        for conn in &mut conns {
            if matches!(conn.phase, Phase::Send { out: None, .. }) {
                let step = self.progress(conn, false, limits);
                self.apply(conn, step);
            }
        }
        conns.retain(|c| !matches!(c.phase, Phase::Closed));
        self.conns = conns;
    }

    fn apply(&mut self, conn: &mut Conn, step: Step) {
        match step {
            Step::Keep => {}
            Step::Close => self.close(conn),
            Step::Retire => self.retire(conn),
        }
    }

    fn close(&mut self, conn: &mut Conn) {
        self.unread = self.unread.saturating_sub(conn.unread);
        conn.unread = 0;
        conn.phase = Phase::Closed;
    }

    /// Stops serving `conn`: closes it, unless the peer still has some of what we sent unread —
    /// then it lingers (its write side shut, so the peer sees the end) until the peer reads or
    /// closes, its bytes still counted.
    fn retire(&mut self, conn: &mut Conn) {
        if conn.unread > 0 {
            if let Ok(queued) = socket::unread_bytes(&conn.stream) {
                if queued > 0 {
                    tracing::info!(
                        peer = conn.pid,
                        bytes = conn.unread,
                        socket = self.socket,
                        "page server: a peer left descriptors unread; the connection lingers \
                         until it reads or closes"
                    );
                    // A peer already gone fails this harmlessly: the lingering ends when it closes.
                    let _ = conn.stream.shutdown(std::net::Shutdown::Write);
                    conn.phase = Phase::Linger;
                    return;
                }
            }
        }
        self.close(conn);
    }

    /// The deadline of `conn` passed.
    fn expire(&mut self, conn: &mut Conn, limits: &PageSocketLimits) -> Step {
        let waited = limits.deadline;
        let (what, step) = match &conn.phase {
            Phase::Request { got, .. } => (
                format!("no complete page request ({got} of {REQUEST_SIZE} bytes)"),
                Step::Close,
            ),
            Phase::Send { batch, out: None } => {
                let what = format!("batch {} waited for the unread budget", batch.number);
                (what, Step::Retire)
            }
            Phase::Send {
                batch,
                out: Some(out),
            } => {
                if out.sent == 0 {
                    // Nothing of it left: its bytes are not in the peer's queue.
                    let bytes = conn.batch_bytes(*batch);
                    conn.unread = conn.unread.saturating_sub(bytes);
                    self.unread = self.unread.saturating_sub(bytes);
                }
                let what = format!("the peer's socket did not take batch {}", batch.number);
                (what, Step::Retire)
            }
            Phase::Ack { batch, .. } => (
                format!("no acknowledgement of batch {}", batch.number),
                Step::Retire,
            ),
            Phase::Refuse { .. } => ("the refusal was not taken".to_owned(), Step::Close),
            Phase::Linger | Phase::Closed => return Step::Keep,
        };
        tracing::debug!(
            peer = conn.pid,
            socket = self.socket,
            "page server: timeout: {what} within {waited:?}; connection closed"
        );
        step
    }

    /// Moves `conn` as far as its socket allows without blocking.
    fn progress(&mut self, conn: &mut Conn, hung_up: bool, limits: &PageSocketLimits) -> Step {
        loop {
            let step = match &mut conn.phase {
                Phase::Request { buf, got } => match read_some(&conn.stream, buf, got) {
                    Got::Pending => Step::Keep,
                    Got::Eof | Got::Failed => Step::Close,
                    Got::Done => {
                        let parsed = PageRequest::parse(&buf[..]);
                        self.requested(conn, parsed, limits);
                        continue;
                    }
                    Got::Partial if *got >= 8 && buf[..8] != REQUEST_MAGIC => {
                        conn.refuse(Refusal::Malformed);
                        continue;
                    }
                    Got::Partial => Step::Keep,
                },
                Phase::Send { batch, out: None } => {
                    let batch = *batch;
                    if hung_up {
                        return Step::Retire;
                    }
                    match self.export(conn, batch, limits) {
                        Some(()) => continue,
                        None => Step::Keep,
                    }
                }
                Phase::Send {
                    batch,
                    out: Some(out),
                } => {
                    let batch = *batch;
                    match send_some(&conn.stream, out) {
                        Sent::All => {
                            conn.phase = Phase::Ack {
                                batch,
                                buf: [0; ACK_SIZE],
                                got: 0,
                            };
                            continue;
                        }
                        Sent::Pending => Step::Keep,
                        Sent::Failed { anything_sent } => {
                            if !anything_sent {
                                let bytes = conn.batch_bytes(batch);
                                conn.unread = conn.unread.saturating_sub(bytes);
                                self.unread = self.unread.saturating_sub(bytes);
                            }
                            Step::Retire
                        }
                    }
                }
                Phase::Ack { batch, buf, got } => match read_some(&conn.stream, buf, got) {
                    Got::Pending | Got::Partial => Step::Keep,
                    Got::Eof | Got::Failed => Step::Retire,
                    Got::Done => {
                        let batch = *batch;
                        if page_protocol::parse_ack(&buf[..]) != Some(batch.number) {
                            tracing::debug!(
                                peer = conn.pid,
                                "page server: the peer sent something else than the \
                                 acknowledgement of batch {}",
                                batch.number
                            );
                            return Step::Retire;
                        }
                        let bytes = conn.batch_bytes(batch);
                        conn.unread = conn.unread.saturating_sub(bytes);
                        self.unread = self.unread.saturating_sub(bytes);
                        // The peer took its step: it has a deadline's time for the next one.
                        conn.deadline = Instant::now() + limits.deadline;
                        let done = batch.start + batch.pages;
                        if done >= conn.count() {
                            return Step::Close;
                        }
                        let next = conn.batch_from(batch.number.saturating_add(1), done, limits);
                        conn.phase = Phase::Send {
                            batch: next,
                            out: None,
                        };
                        continue;
                    }
                },
                Phase::Refuse { out } => match send_some(&conn.stream, out) {
                    Sent::Pending => Step::Keep,
                    Sent::All | Sent::Failed { .. } => Step::Close,
                },
                Phase::Linger | Phase::Closed => Step::Keep,
            };
            return step;
        }
    }

    /// A whole request arrived: authorize it and start its answer (or refuse).
    fn requested(
        &mut self,
        conn: &mut Conn,
        parsed: crate::error::Result<PageRequest>,
        limits: &PageSocketLimits,
    ) {
        let request = match parsed {
            Ok(r) => r,
            Err(err) => {
                tracing::debug!(%err, peer = conn.pid, "page server: a malformed request");
                conn.refuse(Refusal::Malformed);
                return;
            }
        };
        let authorized = self.registry.authorize(&request);
        conn.request = Some(request);
        conn.deadline = Instant::now() + limits.deadline;
        match authorized {
            Err(refusal) => conn.refuse(refusal),
            Ok(()) => {
                conn.phase = Phase::Send {
                    batch: conn.batch_from(0, 0, limits),
                    out: None,
                };
            }
        }
    }

    /// Exports `batch` of `conn` and readies its message, if the unread budget has room for it
    /// (`None`: it waits). A refusal (the storage was freed meanwhile, …) replaces the answer.
    fn export(&mut self, conn: &mut Conn, batch: Batch, limits: &PageSocketLimits) -> Option<()> {
        let bytes = conn.batch_bytes(batch);
        if self.unread > 0 && self.unread.saturating_add(bytes) > limits.max_unread_bytes {
            return None;
        }
        let request = conn.request.as_ref()?;
        let exported = self
            .registry
            .export(self.driver, request, batch.start, batch.pages);
        let chunks = match exported {
            Ok(chunks) => chunks,
            Err(refusal) => {
                conn.refuse(refusal);
                return Some(());
            }
        };
        let (fds, records) = match distinct_files(chunks) {
            Ok(found) => found,
            Err(err) => {
                tracing::warn!(%err, "page server: a chunk descriptor could not be examined");
                conn.refuse(Refusal::ExportFailed);
                return Some(());
            }
        };
        let header = ReplyHeader {
            refusal: None,
            batch: batch.number,
            count: conn.count(),
            pages: u32::try_from(records.len()).unwrap_or(u32::MAX),
            fds: u32::try_from(fds.len()).unwrap_or(u32::MAX),
        };
        conn.unread = conn.unread.saturating_add(bytes);
        self.unread = self.unread.saturating_add(bytes);
        conn.phase = Phase::Send {
            batch,
            out: Some(Outgoing {
                bytes: page_protocol::encode_batch(&header, &records),
                sent: 0,
                fds,
            }),
        };
        Some(())
    }
}

/// The descriptors of a batch, one per distinct regular file (chunks carved from one arena share
/// it; descriptors that are no regular file, as CUDA's, each stay their own), and the record of
/// each page: which of them, at which offset.
fn distinct_files(
    chunks: Vec<ExportedChunk>,
) -> crate::error::Result<(Vec<OwnedFd>, Vec<PageRecord>)> {
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut files: Vec<Option<(u64, u64)>> = Vec::new();
    let mut records = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        let identity = socket::file_identity(&chunk.fd)?;
        let known = identity.and_then(|id| files.iter().position(|f| *f == Some(id)));
        let at = match known {
            Some(at) => at, // the same file: this duplicate descriptor is closed here
            None => {
                files.push(identity);
                fds.push(chunk.fd);
                files.len() - 1
            }
        };
        records.push(PageRecord {
            fd_index: u32::try_from(at).unwrap_or(u32::MAX),
            offset: chunk.offset,
        });
    }
    Ok((fds, records))
}

/// What a nonblocking read did to a fixed-size message.
enum Got {
    /// Nothing to read now.
    Pending,
    /// Some bytes; not complete yet.
    Partial,
    /// The message is complete.
    Done,
    /// The peer closed (or shut its writing side) before the message was complete.
    Eof,
    Failed,
}

fn read_some(stream: &UnixStream, buf: &mut [u8], got: &mut usize) -> Got {
    loop {
        if *got >= buf.len() {
            return Got::Done;
        }
        match (&*stream).read(&mut buf[*got..]) {
            Ok(0) => return Got::Eof,
            Ok(n) => {
                *got += n;
                if *got < buf.len() {
                    return Got::Partial;
                }
            }
            Err(err) => match err.kind() {
                std::io::ErrorKind::WouldBlock => return Got::Pending,
                std::io::ErrorKind::Interrupted => {}
                _ => return Got::Failed,
            },
        }
    }
}

/// What a nonblocking send did.
enum Sent {
    All,
    Pending,
    Failed { anything_sent: bool },
}

fn send_some(stream: &UnixStream, out: &mut Outgoing) -> Sent {
    while out.sent < out.bytes.len() {
        let fds: Vec<BorrowedFd<'_>> = if out.sent == 0 {
            out.fds.iter().map(AsFd::as_fd).collect()
        } else {
            Vec::new()
        };
        match socket::send_fds_nonblocking(stream, &out.bytes[out.sent..], &fds) {
            Ok(0) => return Sent::Pending,
            Ok(n) => {
                // The descriptors went with the first byte: ours are not needed any more.
                drop(fds);
                out.fds.clear();
                out.sent += n;
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return Sent::Pending,
            Err(_) => {
                return Sent::Failed {
                    anything_sent: out.sent > 0,
                }
            }
        }
    }
    Sent::All
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exported(fd: OwnedFd, offset: u64) -> ExportedChunk {
        ExportedChunk { fd, offset }
    }

    /// On an H200, CUDA's exported descriptors of different chunks showed one inode: merged as one
    /// file, the consumer mapped a storage's first page in place of its second (about 1 MiB of a
    /// 3 MiB storage read wrong). Two descriptors of one device file stand for two chunks here.
    #[test]
    fn descriptors_that_are_no_regular_file_are_never_merged() {
        let open = || {
            rustix::fs::open(
                "/dev/null",
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .unwrap()
        };
        let (fds, records) =
            distinct_files(vec![exported(open(), 0), exported(open(), 0)]).unwrap();
        assert_eq!(fds.len(), 2);
        let at: Vec<u32> = records.iter().map(|r| r.fd_index).collect();
        assert_eq!(at, [0, 1]);
    }

    /// Chunks carved from one arena (a regular file) still travel as one descriptor.
    #[test]
    fn chunks_of_one_regular_file_share_a_descriptor() {
        let (fd, _) = crate::shm::vm::Chunk::create(8192)
            .unwrap()
            .export()
            .unwrap();
        let again = fd.try_clone().unwrap();
        let (fds, records) = distinct_files(vec![exported(fd, 0), exported(again, 4096)]).unwrap();
        assert_eq!(fds.len(), 1);
        let at: Vec<(u32, u64)> = records.iter().map(|r| (r.fd_index, r.offset)).collect();
        assert_eq!(at, [(0, 0), (0, 4096)]);
    }
}
