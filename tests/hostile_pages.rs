//! The page socket (expandable memory shared by page, `src/ipc/page_server.rs`) facing peers that
//! do not play by its rules: silent peers, too many peers, peers without the storage's page
//! secret or without a count on its slot, peers that never read what they asked for — and an
//! honest consumer of a producer that does not answer. Children are this test binary re-executed;
//! the "peers" are raw sockets of the test process speaking the protocol by hand
//! (`src/ipc/page_protocol.rs`).
//!
//! The limits of the page socket are process-wide (`PageSocketLimits`): the tests here set them,
//! so they run one at a time, and every child sets the ones its parent names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use common::*;
use cudalloc::{backend::Driver, ipc::IpcHandle, Runtime, Storage};
use cudalloc::{internals::WireHandle, ipc::PageSocketLimits};

const CHILD: &str = "hostile_pages_child";
const PAGE: u64 = 2 << 20;

/// The tests set process-wide limits: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn limits(deadline: Duration) -> PageSocketLimits {
    let mut l = PageSocketLimits::DEFAULT;
    l.deadline = deadline;
    l
}

/// The line that gives a child `l`.
fn limits_line(l: &PageSocketLimits) -> String {
    format!(
        "limits {} {} {} {} {}",
        l.deadline.as_millis(),
        l.max_connections,
        l.max_connections_per_peer,
        l.window_bytes,
        l.max_unread_bytes
    )
}

/// A consumer child with the limits `l`.
fn consumer(l: &PageSocketLimits) -> ChildProcess {
    let mut child = ChildProcess::spawn(CHILD, "open", test_backend());
    child.send(&limits_line(l));
    child
}

/// A host driver of `mib` MiB on one device (the CUDA driver in a CUDA run).
fn roomy_driver(mib: u64) -> Arc<dyn Driver> {
    if cuda_suite() {
        return test_driver();
    }
    Arc::new(
        cudalloc::backend::HostDriver::builder()
            .devices(1)
            .memory_per_device(mib << 20)
            .build()
            .unwrap(),
    )
}

/// A producer with expandable segments over a driver of `mib` MiB.
fn producer(mib: u64) -> Arc<Runtime> {
    let config = cudalloc::AllocatorConfig::parse("expandable_segments:True").unwrap();
    Arc::new(
        Runtime::builder()
            .config(config)
            .ipc_slots_per_file(64)
            .build(roomy_driver(mib))
            .unwrap(),
    )
}

/// A storage of `nbytes` filled with the pattern of `seed`.
fn patterned(a: &Arc<Runtime>, nbytes: u64, seed: u64) -> Storage {
    let s = Storage::new(a, 0, nbytes).unwrap();
    s.fill_pattern(seed).unwrap();
    s
}

/// `seed:handle` words for the child's `open` role.
fn offer(storages: &[(&Storage, u64)]) -> String {
    storages
        .iter()
        .map(|(s, seed)| format!("{seed}:{}", hex(&s.share_ipc().unwrap().into_bytes())))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The page socket of the storage a handle names (`…-ref<n>` → `…-pages0`).
fn page_socket(wire: &WireHandle) -> PathBuf {
    let name = &wire.ref_file;
    let stem = &name[..name.rfind("-ref").unwrap()];
    PathBuf::from("/dev/shm").join(format!("{stem}-pages0"))
}

/// A page request laid out by hand: magic, slot, generation, page size, first page, count,
/// secret, ref-counter file name.
fn raw_request(wire: &WireHandle, secret: [u8; 16]) -> Vec<u8> {
    let pages = wire.pages.unwrap();
    let mut b = b"cdalPRQ2".to_vec();
    b.extend(wire.slot.to_le_bytes());
    b.extend(wire.generation.to_le_bytes());
    b.extend(pages.page.to_le_bytes());
    b.extend(pages.first.to_le_bytes());
    b.extend(pages.count.to_le_bytes());
    b.extend(secret);
    let mut name = wire.ref_file.as_bytes().to_vec();
    name.resize(64, 0);
    b.extend(name);
    b
}

/// One message and the descriptors that came with it (`recvmsg`, room for 64).
fn recv_with_fds(stream: &UnixStream, buf: &mut [u8]) -> (usize, Vec<OwnedFd>) {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(64 * 4) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at live, writable buffers of the sizes it states.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(got >= 0, "recvmsg: {}", std::io::Error::last_os_error());
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes with well-formed headers; each SCM_RIGHTS
    // payload is an array of new descriptors, owned here from now on.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_type == libc::SCM_RIGHTS {
                let n = ((*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                let data = libc::CMSG_DATA(header).cast::<libc::c_int>();
                for i in 0..n {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    (got as usize, fds)
}

/// What the page socket answered a raw request.
struct Answer {
    /// Status of the last header (0: pages came).
    status: Option<u32>,
    fds: Vec<OwnedFd>,
    /// Each page received: (index in `fds`, offset of its chunk in that file).
    pages: Vec<(usize, u64)>,
}

impl Answer {
    fn new() -> Self {
        Answer {
            status: None,
            fds: Vec::new(),
            pages: Vec::new(),
        }
    }

    /// Reads one answer message from `stream` (false: the stream ended); returns the pages of
    /// its batch.
    fn read_message(&mut self, stream: &UnixStream) -> Option<usize> {
        let mut buf = vec![0u8; 32 + 64 * 16];
        let (len, fds) = recv_with_fds(stream, &mut buf);
        if len == 0 {
            return None;
        }
        let first_fd = self.fds.len();
        self.fds.extend(fds);
        if len < 32 {
            (&*stream).read_exact(&mut buf[len..32]).unwrap();
        }
        assert_eq!(&buf[..8], b"cdalPRP2");
        let status = u32::from_le_bytes(buf[8..12].try_into().unwrap());
        self.status = Some(status);
        if status != 0 {
            return Some(0);
        }
        let pages = u32::from_le_bytes(buf[24..28].try_into().unwrap()) as usize;
        let whole = 32 + pages * 16;
        if len.max(32) < whole {
            (&*stream).read_exact(&mut buf[len.max(32)..whole]).unwrap();
        }
        for record in buf[32..whole].chunks(16) {
            let index = u32::from_le_bytes(record[0..4].try_into().unwrap()) as usize;
            let offset = u64::from_le_bytes(record[8..16].try_into().unwrap());
            self.pages.push((first_fd + index, offset));
        }
        Some(pages)
    }

    /// Bytes of the pages received that are still backed by memory (not given back).
    fn resident(&self) -> u64 {
        self.pages
            .iter()
            .map(|&(fd, offset)| resident_range(&self.fds[fd], offset, PAGE))
            .sum()
    }
}

/// Sends `request` and reads the whole answer as an honest consumer does (every batch
/// acknowledged).
fn exchange(wire: &WireHandle, request: &[u8]) -> Answer {
    let count = wire.pages.unwrap().count;
    let stream = UnixStream::connect(page_socket(wire)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    (&stream).write_all(request).unwrap();
    let mut answer = Answer::new();
    let mut batch = 0u32;
    while (answer.pages.len() as u64) < count {
        match answer.read_message(&stream) {
            Some(n) if n > 0 => {}
            _ => break,
        }
        let mut ack = b"cdalPAK1".to_vec();
        ack.extend(batch.to_le_bytes());
        ack.extend([0u8; 4]);
        (&stream).write_all(&ack).unwrap();
        batch += 1;
    }
    answer
}

/// Reads everything left in `stream`'s receive queue up to its end.
fn drain(stream: &UnixStream) -> Answer {
    let mut answer = Answer::new();
    while answer.read_message(stream).is_some() {}
    answer
}

/// Bytes of `[offset, offset + len)` of the file `fd` that are resident in memory (`mincore` of
/// a mapping that touches nothing: a chunk given back is a hole, not resident).
fn resident_range(fd: &OwnedFd, offset: u64, len: u64) -> u64 {
    let len = len as usize;
    // SAFETY: a fresh read-only shared mapping of the range, chosen by the kernel; checked for
    // MAP_FAILED and unmapped below; never read through.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    assert_ne!(
        addr,
        libc::MAP_FAILED,
        "{}",
        std::io::Error::last_os_error()
    );
    let page = 4096;
    let mut present = vec![0u8; len.div_ceil(page)];
    // SAFETY: `addr` is the mapping of `len` bytes made above; `present` has one byte per page.
    let rc = unsafe { libc::mincore(addr, len, present.as_mut_ptr()) };
    // SAFETY: unmaps the mapping made above, once.
    unsafe { libc::munmap(addr, len) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    present.iter().filter(|&&p| p & 1 != 0).count() as u64 * page as u64
}

/// `Shmem:` of `/proc/meminfo` in bytes (the whole machine's: printed, never asserted).
fn shmem_bytes() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("Shmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// Waits (30 s at most) until the other end of `stream` stops sending — it closed, or shut its
/// writing side — without reading anything.
fn wait_for_end_of_sending(stream: &UnixStream) -> bool {
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd of an open socket.
    let rc = unsafe { libc::poll(&mut fd, 1, 30_000) };
    rc == 1 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP) != 0
}

/// The status of the first answer header on `stream` (None: closed without one).
fn first_status(stream: &UnixStream) -> Option<u32> {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut header = [0u8; 32];
    (&*stream).read_exact(&mut header).ok()?;
    assert_eq!(&header[..8], b"cdalPRP2");
    Some(u32::from_le_bytes(header[8..12].try_into().unwrap()))
}

/// Whether `stream` has nothing to read and is still open (neither answered nor dropped).
fn untouched(stream: &UnixStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let idle = matches!(
        (&*stream).read(&mut byte),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
    );
    stream.set_nonblocking(false).unwrap();
    idle
}

#[test]
fn silent_peers_neither_delay_nor_fail_honest_opens() {
    // Before: one connection at a time with a 5 s timeout — three silent peers made three honest
    // opens fail. Now each connection has its own deadline (long here: the silent peers stay
    // connected for the whole test) and the honest ones are served meanwhile.
    let _serial = serial();
    let l = limits(Duration::from_secs(60));
    l.set().unwrap();
    let a = producer(64);
    let storages: Vec<Storage> = (0..3).map(|i| patterned(&a, 2 * PAGE, 10 + i)).collect();
    let wire = storages[0].share_ipc().unwrap().wire().clone();
    let mut child = consumer(&l);
    let silent: Vec<UnixStream> = (0..3)
        .map(|_| UnixStream::connect(page_socket(&wire)).unwrap())
        .collect();
    child.send(&offer(&storages.iter().zip(10..).collect::<Vec<_>>()));
    let reply = child.recv();
    println!("3 silent peers connected: {reply}");
    assert_eq!(field(&reply, "failed"), "0", "{reply}");
    assert_eq!(field(&reply, "mismatches"), "0,0,0");
    for peer in &silent {
        assert!(
            untouched(peer),
            "a silent peer is still connected, unanswered"
        );
    }
    child.send("done");
    child.finish();
}

#[test]
fn connections_past_the_limit_are_refused_at_once_and_others_still_served() {
    // Before: a fifth connection waited in the backlog behind four silent ones (5 s each) and was
    // then closed unanswered. Now it is refused at once as busy; another process is still served.
    let _serial = serial();
    let l = {
        let mut l = limits(Duration::from_secs(60));
        l.max_connections_per_peer = 4;
        l
    };
    l.set().unwrap();
    let a = producer(64);
    let s = patterned(&a, 2 * PAGE, 3);
    let wire = s.share_ipc().unwrap().wire().clone();
    let silent: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(page_socket(&wire)).unwrap())
        .collect();
    let fifth = UnixStream::connect(page_socket(&wire)).unwrap();
    assert_eq!(first_status(&fifth), Some(5), "busy");
    let mut child = consumer(&l);
    child.send(&offer(&[(&s, 3)]));
    let reply = child.recv();
    assert_eq!(field(&reply, "failed"), "0", "{reply}");
    assert!(silent.iter().all(untouched));
    child.send("done");
    child.finish();
}

#[test]
fn an_open_from_a_producer_that_does_not_answer_fails_with_a_timeout() {
    // The producer is stopped (SIGSTOP): its socket's backlog takes the connection and the
    // request, nobody answers. Before: "Resource temporarily unavailable (os error 11)".
    let _serial = serial();
    let l = limits(Duration::from_millis(500));
    l.set().unwrap();
    let mut producer = ChildProcess::spawn(CHILD, "produce", test_backend());
    producer.send(&limits_line(&l));
    let handle = unhex(&producer.recv());
    let pid = producer.pid() as i32;
    // SAFETY: stops the child we spawned (it is resumed below).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let mut status = 0;
    // SAFETY: waits (without reaping) until our child has stopped; `status` is a valid out-pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
    assert_eq!(waited, pid);
    assert!(libc::WIFSTOPPED(status), "the producer is stopped");
    let rt = Arc::new(Runtime::new(test_driver(), Default::default()).unwrap());
    let opened = IpcHandle::from_bytes(&handle).and_then(|h| Storage::from_ipc(&rt, h));
    // SAFETY: resumes the child stopped above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let err = opened.expect_err("nobody answers");
    let message = err.to_string();
    println!("open from a stopped producer: {message}");
    assert!(message.contains("timeout"), "{message}");
    assert!(
        message.contains("batch 0"),
        "says what timed out: {message}"
    );
    assert!(err.is_retryable(), "{message}");
    producer.send("done");
    producer.finish();
}

#[test]
fn a_peer_without_the_page_secret_is_refused() {
    // Before: anyone of our user who read the handle's fields off /dev/shm (file name, slot,
    // generation, pages) got the chunks. Now the request must carry the storage's page secret.
    let _serial = serial();
    limits(Duration::from_secs(10)).set().unwrap();
    let a = producer(64);
    let s = patterned(&a, 4 * PAGE, 4);
    let handle = s.share_ipc().unwrap();
    let wire = handle.wire().clone();
    let secret = wire.pages.unwrap().secret;
    let mut wrong = secret;
    wrong[7] ^= 0x10;
    for (what, guess) in [("no secret", [0u8; 16]), ("one bit off", wrong)] {
        let answer = exchange(&wire, &raw_request(&wire, guess));
        assert_eq!(answer.status, Some(6), "{what}: refused as unauthorized");
        assert!(
            answer.fds.is_empty() && answer.pages.is_empty(),
            "{what}: no descriptor"
        );
    }
    let answer = exchange(&wire, &raw_request(&wire, secret));
    assert_eq!(answer.status, Some(0));
    assert_eq!(answer.pages.len(), 4, "with the secret, every page");
    drop(handle);
}

#[test]
fn a_peer_whose_handle_holds_no_count_is_refused() {
    // The handle's count was given back (dropped unopened): nobody counts on the storage. Before:
    // its pages were served anyway. Now refused — until a new handle carries a count again.
    let _serial = serial();
    limits(Duration::from_secs(10)).set().unwrap();
    let a = producer(64);
    let s = patterned(&a, 3 * PAGE, 5);
    let handle = s.share_ipc().unwrap();
    let wire = handle.wire().clone();
    let request = raw_request(&wire, wire.pages.unwrap().secret);
    drop(handle);
    let answer = exchange(&wire, &request);
    assert_eq!(answer.status, Some(7), "no count: refused");
    assert!(answer.fds.is_empty() && answer.pages.is_empty());
    let again = s.share_ipc().unwrap();
    assert_eq!(
        again.wire().pages.unwrap().secret,
        wire.pages.unwrap().secret
    );
    let answer = exchange(&wire, &request);
    assert_eq!(answer.status, Some(0), "a count again: served");
    assert_eq!(answer.pages.len(), 3);
    drop(again);
}

#[test]
fn peers_that_never_read_get_at_most_one_window_and_hold_nothing_after_the_free() {
    // Peers ask for a storage of 40 pages (80 MiB) and never read; then the producer frees it and
    // gives every page back. What sits in a peer's receive queue is what it can still map.
    // Before: the whole 80 MiB per peer, without any secret, kept resident after the free. Now:
    // nothing without the secret; with it, one window (2 pages here) per connection, within the
    // unread budget (3 pages) over all — and none of it resident once the producer freed it.
    let _serial = serial();
    let l = {
        // The deadline only ends the blocked connection: long enough that a page server stalled
        // by a loaded machine still serves the peers with the secret.
        let mut l = limits(Duration::from_millis(1500));
        l.window_bytes = 2 * PAGE;
        l.max_unread_bytes = 3 * PAGE;
        l
    };
    l.set().unwrap();
    let a = producer(256);
    if common::real_gpu() {
        // An H200's exported descriptors cannot be mapped by the host (mmap refuses them).
        println!(
            "skipped on a GPU: what a peer keeps resident is measured by mapping its descriptors"
        );
        return;
    }
    let s = patterned(&a, 40 * PAGE, 6);
    // Read back: the fill (stream work) has written every page before they are measured.
    assert_eq!(s.count_pattern_mismatches(6).unwrap(), 0);
    let handle = s.share_ipc().unwrap();
    let wire = handle.wire().clone();
    let secret = wire.pages.unwrap().secret;
    // The measure sees memory: an honest reader's pages are resident while the storage lives.
    let probe = exchange(&wire, &raw_request(&wire, secret));
    assert_eq!(probe.pages.len(), 40);
    assert_eq!(probe.resident(), 40 * PAGE);
    drop(probe);
    let ask = |secret: [u8; 16]| {
        let peer = UnixStream::connect(page_socket(&wire)).unwrap();
        (&peer).write_all(&raw_request(&wire, secret)).unwrap();
        peer
    };
    let stranger = ask([0; 16]);
    let first = ask(secret);
    let second = ask(secret);
    for peer in [&stranger, &first, &second] {
        assert!(
            wait_for_end_of_sending(peer),
            "the producer stops sending to a peer that does not read (refusal or deadline)"
        );
    }
    let late = UnixStream::connect(page_socket(&wire)).unwrap();
    let late_status = first_status(&late);
    drop(handle);
    drop(s);
    a.ipc_collect();
    a.empty_cache();
    assert_eq!(
        a.memory_reserved(0).unwrap(),
        0,
        "the producer gave every page back"
    );
    let shmem_before = shmem_bytes();
    let queues: Vec<Answer> = [&stranger, &first, &second]
        .into_iter()
        .map(drain)
        .collect();
    let handed: Vec<usize> = queues.iter().map(|q| q.pages.len()).collect();
    let held: Vec<u64> = queues.iter().map(Answer::resident).collect();
    drop(queues);
    let shmem_after = shmem_bytes();
    println!(
        "never-reading peers: pages in their queues {handed:?} (stranger, first, second); \
         resident after the free {:?} MiB (machine Shmem {} MiB before draining, {} MiB after)",
        held.iter().map(|b| b >> 20).collect::<Vec<_>>(),
        shmem_before >> 20,
        shmem_after >> 20
    );
    assert_eq!(handed[0], 0, "without the secret: nothing");
    assert!(
        handed[1] <= 2 && handed[2] <= 2,
        "with it, one window per connection: {handed:?}"
    );
    assert!(
        handed[1] + handed[2] <= 3,
        "within the unread budget: {handed:?}"
    );
    assert!(
        handed[1] + handed[2] > 0,
        "a peer with the secret was served"
    );
    assert_eq!(
        held,
        vec![0, 0, 0],
        "nothing of the freed storage stays resident"
    );
    assert_eq!(
        late_status,
        Some(5),
        "a process with a lingering connection is refused until it reads"
    );
}

#[test]
fn stopping_the_producer_does_not_wait_on_its_peers() {
    // Silent peers and a peer that never reads are connected when the producer's runtime goes:
    // every connection is closed (the peers see the end) and the socket is unlinked.
    let _serial = serial();
    let l = {
        let mut l = limits(Duration::from_secs(60));
        l.window_bytes = PAGE;
        l
    };
    l.set().unwrap();
    let a = producer(64);
    let s = patterned(&a, 4 * PAGE, 7);
    let handle = s.share_ipc().unwrap();
    let wire = handle.wire().clone();
    let socket = page_socket(&wire);
    let silent: Vec<UnixStream> = (0..3)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    let unread = UnixStream::connect(&socket).unwrap();
    (&unread)
        .write_all(&raw_request(&wire, wire.pages.unwrap().secret))
        .unwrap();
    drop(handle);
    let started = std::time::Instant::now();
    drop(s);
    drop(a);
    println!("runtime dropped in {:?}", started.elapsed());
    assert!(!socket.exists(), "the socket is unlinked");
    for peer in silent.iter().chain([&unread]) {
        assert!(wait_for_end_of_sending(peer), "every connection was closed");
    }
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn hostile_pages_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    let line = parent.recv();
    let v: Vec<u64> = line
        .strip_prefix("limits ")
        .unwrap()
        .split(' ')
        .map(|w| w.parse().unwrap())
        .collect();
    let mut l = PageSocketLimits::DEFAULT;
    l.deadline = Duration::from_millis(v[0]);
    l.max_connections = v[1] as u32;
    l.max_connections_per_peer = v[2] as u32;
    l.window_bytes = v[3];
    l.max_unread_bytes = v[4];
    l.set().unwrap();
    match role.as_str() {
        "open" => {
            let a = Arc::new(Runtime::new(child_test_driver(), Default::default()).unwrap());
            let line = parent.recv();
            let mut failed = Vec::new();
            let mut mismatches = Vec::new();
            let mut held = Vec::new();
            for word in line.split(' ') {
                let (seed, handle) = word.split_once(':').unwrap();
                let opened =
                    IpcHandle::from_bytes(&unhex(handle)).and_then(|h| Storage::from_ipc(&a, h));
                match opened {
                    Ok(s) => {
                        let bad = s.count_pattern_mismatches(seed.parse().unwrap()).unwrap();
                        mismatches.push(bad.to_string());
                        held.push(s);
                    }
                    Err(err) => {
                        mismatches.push("-".into());
                        failed.push(err.to_string().replace(' ', "_"));
                    }
                }
            }
            parent.send(&format!(
                "failed={} mismatches={} errors={}",
                failed.len(),
                mismatches.join(","),
                failed.join("|")
            ));
            assert_eq!(parent.recv(), "done");
        }
        "produce" => {
            let a = producer(64);
            let s = patterned(&a, 2 * PAGE, 9);
            parent.send(&hex(&s.share_ipc().unwrap().into_bytes()));
            assert_eq!(parent.recv(), "done");
        }
        other => panic!("unknown role {other}"),
    }
}
