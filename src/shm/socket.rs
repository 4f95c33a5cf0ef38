//! Unix-domain sockets in `/dev/shm` and file descriptors passed over them (`SCM_RIGHTS`): how a
//! consumer gets the chunks of a producer's expandable segment without `pidfd_getfd` (which
//! unprivileged containers deny) — any two processes that share `/dev/shm` can do it.
//!
//! A listening socket is an object like the others: named `cudalloc-<pid>-<nonce>-<tag><n>`, its
//! file made `0600` right after `bind` (the umask already denies others the write permission that
//! `connect` needs), unlinked at drop or process exit, swept when its creator died. The server
//! also checks that every peer runs as our effective user (`SO_PEERCRED`: [`peer_credentials`],
//! which also names the peer process, for per-peer limits).
//!
//! One message carries a payload of bytes and up to [`MAX_FDS`] descriptors. Received descriptors
//! are opened close-on-exec. What arrives is untrusted: a truncated control message, more
//! descriptors than asked for, or a malformed header closes every descriptor that did arrive and is
//! an error — never a leak, never a panic.
//!
//! | side   | how it waits                                                                 |
//! |--------|------------------------------------------------------------------------------|
//! | server | never: nonblocking sockets ([`send_fds_nonblocking`]) under one `poll`; [`unread_bytes`] (`SIOCOUTQ`) tells whether a peer has read what was sent — descriptors in its receive queue keep their files alive until it reads or closes |
//! | client | [`TimedStream`]: the connect (against a full backlog) and every read and write bounded by one timeout; one that runs out is an error saying "timeout: `<step>` took longer than …" |

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{
    self, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use super::names::{ensure_liveness, forget_name, remember_name};
use super::{path_of, validate_name};
use crate::error::{Error, Result};

/// A listening socket in `/dev/shm`, unlinked when dropped by the process that made it.
#[derive(Debug)]
pub(crate) struct ShmListener {
    name: String,
    creator: u32,
    /// The socket.
    pub listener: UnixListener,
}

impl ShmListener {
    /// Binds the socket `name` (failing if the name exists) and makes it `0600`.
    pub(crate) fn bind(name: &str) -> Result<Self> {
        validate_name(name)?;
        let path = path_of(name);
        ensure_liveness()?;
        let listener = UnixListener::bind(&path).map_err(|e| Error::host_os("bind", e))?;
        remember_name(name);
        let made = ShmListener {
            name: name.to_owned(),
            creator: std::process::id(),
            listener,
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::host_os("chmod", e))?;
        Ok(made)
    }

    /// The socket's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        if self.creator == std::process::id() {
            // Already gone (a sweep took it) is fine; nothing else can be done from a drop.
            let _ = std::fs::remove_file(path_of(&self.name));
            forget_name(&self.name);
        }
    }
}

/// Connects to the socket at `path`; the connect itself (a listener whose backlog is full), and
/// every later read and write, time out after `timeout`.
fn connect_with_timeout(path: &std::path::Path, timeout: Duration) -> std::io::Result<UnixStream> {
    let addr = SocketAddrUnix::new(path)?;
    let fd = net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let stream = UnixStream::from(fd);
    // Linux bounds a blocking connect to a Unix socket by the send timeout.
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    loop {
        match net::connect(&stream, &addr) {
            Ok(()) => return Ok(stream),
            Err(Errno::INTR) => continue,
            Err(err) => return Err(err.into()),
        }
    }
}

/// Whether an I/O error of a socket with timeouts is its timeout running out.
pub(crate) fn is_timeout(kind: std::io::ErrorKind) -> bool {
    matches!(
        kind,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// A blocking stream whose every step is bounded by its timeout, and whose errors say which step
/// timed out ("timeout: <what> took longer than …") and with whom.
#[derive(Debug)]
pub(crate) struct TimedStream {
    stream: UnixStream,
    timeout: Duration,
    peer: String,
}

impl TimedStream {
    /// Connects to the socket `name` in `/dev/shm`; `peer` names the other side in errors. A
    /// connect that times out is a (retryable) driver error that says "timeout"; one that fails
    /// otherwise (no such socket, refused) is an error of the handle that named it.
    pub(crate) fn connect(name: &str, timeout: Duration, peer: String) -> Result<Self> {
        validate_name(name)?;
        match connect_with_timeout(&path_of(name), timeout) {
            Ok(stream) => Ok(TimedStream {
                stream,
                timeout,
                peer,
            }),
            Err(err) if is_timeout(err.kind()) => Err(Error::host_os(
                "connect",
                format!(
                    "timeout: connecting to {peer} took longer than {timeout:?} (its backlog is \
                     full and nothing accepts)"
                ),
            )),
            Err(err) => Err(Error::bad_handle(format!("cannot reach {peer} ({err})"))),
        }
    }

    fn failed(&self, call: &'static str, what: &str, err: &std::io::Error) -> Error {
        if is_timeout(err.kind()) {
            Error::host_os(
                call,
                format!(
                    "timeout: {what} took longer than {:?} ({})",
                    self.timeout, self.peer
                ),
            )
        } else {
            Error::host_os(call, format!("{what} ({}): {err}", self.peer))
        }
    }

    /// Writes all of `bytes` (never raising `SIGPIPE`: a peer that closed is an error); `what`
    /// names the step in errors.
    pub(crate) fn write_all(&self, bytes: &[u8], what: &str) -> Result<()> {
        let mut sent = 0;
        while sent < bytes.len() {
            match net::send(&self.stream, &bytes[sent..], SendFlags::NOSIGNAL) {
                Ok(n) => sent += n,
                Err(Errno::INTR) => continue,
                Err(Errno::PIPE | Errno::CONNRESET) => {
                    return Err(Error::host_os(
                        "send",
                        format!("{what}: {} closed the connection", self.peer),
                    ))
                }
                Err(err) => return Err(self.failed("send", what, &err.into())),
            }
        }
        Ok(())
    }

    /// Fills `buf`; `what` names the step in errors.
    pub(crate) fn read_exact(&self, buf: &mut [u8], what: &str) -> Result<()> {
        std::io::Read::read_exact(&mut &self.stream, buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Error::host_os(
                    "read",
                    format!("{what}: {} closed the connection midway", self.peer),
                )
            } else {
                self.failed("read", what, &e)
            }
        })
    }

    /// [`recv_fds`] with this stream's timeout; `what` names the step in errors.
    pub(crate) fn recv_fds(
        &self,
        payload: &mut [u8],
        max_fds: usize,
        what: &str,
    ) -> Result<(usize, Vec<OwnedFd>)> {
        recv_message(&self.stream, payload, max_fds).map_err(|failure| match failure {
            RecvFailure::Os(err) => self.failed("recvmsg", what, &err),
            RecvFailure::Malformed(err) => err,
        })
    }
}

/// Who is at the other end of a connection (`SO_PEERCRED`: as of `connect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerCredentials {
    pub pid: u32,
    pub uid: u32,
}

impl PeerCredentials {
    /// Whether the peer runs as our effective user.
    pub(crate) fn is_our_user(self) -> bool {
        self.uid == rustix::process::geteuid().as_raw()
    }
}

/// The credentials of the process at the other end of `stream`. Its pid is 0 when the peer runs
/// in a pid namespace this process cannot see into (read through nix, whose pid is a plain
/// `pid_t`: rustix's `UCred` cannot hold 0 and turned such a peer into an error, so every consumer
/// in another pid namespace was refused its pages; `CUDALLOC_TEST_EXPANDABLE=1 cargo test --test
/// pid_namespaces`).
pub(crate) fn peer_credentials(stream: &UnixStream) -> Result<PeerCredentials> {
    let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| Error::host_os("getsockopt(SO_PEERCRED)", std::io::Error::from(e)))?;
    Ok(PeerCredentials {
        pid: u32::try_from(cred.pid()).unwrap_or(0),
        uid: cred.uid(),
    })
}

/// The (device, inode) of the file `fd` names when it is a regular file (a memfd, a file in
/// `/dev/shm`): two descriptors of one regular file name the same memory, at their offsets.
/// `None` for anything else: descriptors a driver exports for its memory (CUDA's POSIX handles)
/// may all show one inode of a device or an anonymous file while each stands for other memory —
/// seen on an H200, where merging them mapped a storage's first page in place of its second.
pub(crate) fn file_identity(fd: &OwnedFd) -> Result<Option<(u64, u64)>> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::host_os("fstat", std::io::Error::from(e)))?;
    let regular =
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile;
    Ok(regular.then_some((st.st_dev, st.st_ino)))
}

/// Bytes we sent on `stream` that the peer has not read yet (`SIOCOUTQ`): descriptors in them are
/// still in the peer's receive queue, keeping their files alive, until it reads them or closes.
pub(crate) fn unread_bytes(stream: &UnixStream) -> Result<usize> {
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer, which is valid.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
    if rc != 0 {
        return Err(os("ioctl(SIOCOUTQ)"));
    }
    Ok(usize::try_from(queued).unwrap_or(0))
}

/// A pipe (read end, write end), closed on exec: closing the write end wakes a `poll` on the read
/// end (how a serving thread is told to stop).
pub(crate) fn wake_pipe() -> Result<(OwnedFd, OwnedFd)> {
    rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| Error::host_os("pipe2", std::io::Error::from(e)))
}

/// The most descriptors one message carries (the kernel's `SCM_MAX_FD` is 253).
pub(crate) const MAX_FDS: usize = 64;

fn os(call: &'static str) -> Error {
    Error::host_os(call, std::io::Error::last_os_error())
}

/// Bytes of control buffer for `n` descriptors.
fn control_len(n: usize) -> usize {
    rustix::cmsg_space!(ScmRights(n))
}

/// Sends `payload` (at least one byte) and `fds` in one message, blocking (bounded by the
/// socket's send timeout) until all of it is sent. (The page server sends without blocking,
/// [`send_fds_nonblocking`]; this is for tests.)
#[cfg(test)]
pub(crate) fn send_fds(socket: &UnixStream, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    let sent = sendmsg(socket, payload, fds, SendFlags::empty())
        .map_err(|e| Error::host_os("sendmsg", e))?;
    if sent != payload.len() {
        return Err(Error::host_os(
            "sendmsg",
            format!("sent {sent} of {} payload bytes", payload.len()),
        ));
    }
    Ok(())
}

/// Sends what fits of `payload` now, with `fds` attached to its first byte, without blocking:
/// the bytes sent (the descriptors went with them if any was), or `WouldBlock`.
pub(crate) fn send_fds_nonblocking(
    socket: &UnixStream,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<usize> {
    sendmsg(socket, payload, fds, SendFlags::DONTWAIT)
}

fn sendmsg(
    socket: &UnixStream,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
    flags: SendFlags,
) -> std::io::Result<usize> {
    if payload.is_empty() || fds.len() > MAX_FDS {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a descriptor message needs a payload and at most {MAX_FDS} descriptors ({} given)",
                fds.len()
            ),
        ));
    }
    let mut space = vec![MaybeUninit::<u8>::uninit(); control_len(fds.len().max(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the descriptors do not fit the control buffer",
        ));
    }
    let iov = [IoSlice::new(payload)];
    loop {
        match net::sendmsg(socket, &iov, &mut control, SendFlags::NOSIGNAL | flags) {
            Ok(sent) => return Ok(sent),
            Err(Errno::INTR) => continue,
            Err(err) => return Err(err.into()),
        }
    }
}

/// Why receiving a descriptor message failed.
enum RecvFailure {
    /// The call failed (a timeout, the peer gone, …).
    Os(std::io::Error),
    /// What arrived is not a well-formed message (its descriptors are closed).
    Malformed(Error),
}

/// Receives one message into `payload` with at most `max_fds` descriptors; returns the payload
/// length and the descriptors (owned, close-on-exec). (Consumers receive through
/// [`TimedStream::recv_fds`]; this is for tests.)
#[cfg(test)]
pub(crate) fn recv_fds(
    socket: &UnixStream,
    payload: &mut [u8],
    max_fds: usize,
) -> Result<(usize, Vec<OwnedFd>)> {
    recv_message(socket, payload, max_fds).map_err(|failure| match failure {
        RecvFailure::Os(err) => Error::host_os("recvmsg", err),
        RecvFailure::Malformed(err) => err,
    })
}

fn recv_message(
    socket: &UnixStream,
    payload: &mut [u8],
    max_fds: usize,
) -> std::result::Result<(usize, Vec<OwnedFd>), RecvFailure> {
    let max_fds = max_fds.min(MAX_FDS);
    let mut space = vec![MaybeUninit::<u8>::uninit(); control_len(max_fds.max(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(payload)];
    let got = loop {
        match net::recvmsg(socket, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(got) => break got,
            Err(Errno::INTR) => continue,
            Err(err) => return Err(RecvFailure::Os(err.into())),
        }
    };
    // Take ownership of whatever arrived first, so every error path below closes it (the
    // buffer's own drop closes anything left in it too).
    let mut fds = Vec::new();
    let mut malformed = false;
    for message in control.drain() {
        match message {
            RecvAncillaryMessage::ScmRights(arrived) => fds.extend(arrived),
            // Nothing else was asked for (no SO_PASSCRED, SO_PASSSEC or SO_PASSPIDFD, so the
            // kernel sends no other kind): whatever else arrives makes the message malformed.
            _ => malformed = true,
        }
    }
    if got.flags.contains(ReturnFlags::CTRUNC) || malformed || fds.len() > max_fds {
        return Err(RecvFailure::Malformed(Error::bad_handle(format!(
            "a descriptor message was truncated or malformed ({} descriptor(s) arrived, at most \
             {max_fds} expected); all closed",
            fds.len()
        ))));
    }
    Ok((got.bytes, fds))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::shm::vm::Chunk;
    use std::os::fd::AsFd;

    #[test]
    fn chunks_sent_over_a_socket_are_the_same_memory() {
        let (a, b) = UnixStream::pair().unwrap();
        let chunks: Vec<Chunk> = (0..3).map(|_| Chunk::create(4096).unwrap()).collect();
        for (i, c) in chunks.iter().enumerate() {
            c.with_mapping(|addr, _| {
                // SAFETY: a fresh mapping of the chunk's 4096 bytes.
                unsafe { (addr as *mut u8).write(i as u8 + 7) }
            })
            .unwrap();
        }
        let exported: Vec<(OwnedFd, u64)> = chunks.iter().map(|c| c.export().unwrap()).collect();
        let borrowed: Vec<BorrowedFd<'_>> = exported.iter().map(|(f, _)| f.as_fd()).collect();
        send_fds(&a, b"chunks", &borrowed).unwrap();
        let mut payload = [0u8; 16];
        let (n, fds) = recv_fds(&b, &mut payload, 8).unwrap();
        assert_eq!(&payload[..n], b"chunks");
        assert_eq!(fds.len(), 3);
        for (i, fd) in fds.into_iter().enumerate() {
            let chunk = Chunk::import(fd, exported[i].1, 4096).unwrap();
            chunk
                .with_mapping(|addr, _| {
                    // SAFETY: a fresh mapping of the chunk's 4096 bytes.
                    assert_eq!(unsafe { (addr as *const u8).read() }, i as u8 + 7);
                })
                .unwrap();
        }
    }

    #[test]
    fn more_descriptors_than_expected_are_closed_and_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let chunks: Vec<Chunk> = (0..4).map(|_| Chunk::create(4096).unwrap()).collect();
        let exported: Vec<(OwnedFd, u64)> = chunks.iter().map(|c| c.export().unwrap()).collect();
        let borrowed: Vec<BorrowedFd<'_>> = exported.iter().map(|(f, _)| f.as_fd()).collect();
        send_fds(&a, b"x", &borrowed).unwrap();
        let mut payload = [0u8; 4];
        let err = recv_fds(&b, &mut payload, 2).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidIpcHandle, "{err}");
        assert!(send_fds(&a, b"", &[]).is_err(), "a message needs a payload");
    }

    #[test]
    fn unread_bytes_are_what_the_peer_has_not_read_yet() {
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(unread_bytes(&a).unwrap(), 0);
        assert_eq!(send_fds_nonblocking(&a, b"0123456789", &[]).unwrap(), 10);
        assert!(unread_bytes(&a).unwrap() > 0, "queued in the peer");
        let mut got = [0u8; 10];
        std::io::Read::read_exact(&mut &b, &mut got).unwrap();
        assert_eq!(
            unread_bytes(&a).unwrap(),
            0,
            "read: nothing pinned any more"
        );
        let (fd, _) = Chunk::create(4096).unwrap().export().unwrap();
        let again = fd.try_clone().unwrap();
        let identity = file_identity(&fd).unwrap();
        assert!(identity.is_some(), "a memfd is a regular file");
        assert_eq!(identity, file_identity(&again).unwrap());
        // Not a regular file: never taken for the same memory as another descriptor.
        let (r, w) = rustix::pipe::pipe().unwrap();
        assert_eq!(file_identity(&r).unwrap(), None);
        drop(w);
    }

    #[test]
    fn a_timed_stream_says_timeout_and_names_the_step() {
        let (a, _b) = UnixStream::pair().unwrap();
        let timeout = Duration::from_millis(20);
        a.set_read_timeout(Some(timeout)).unwrap();
        let stream = TimedStream {
            stream: a,
            timeout,
            peer: "the test's peer".into(),
        };
        let mut buf = [0u8; 8];
        let err = stream
            .recv_fds(&mut buf, 1, "waiting for batch 3")
            .unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("timeout: waiting for batch 3 took longer than"),
            "{message}"
        );
        assert!(message.contains("the test's peer"), "{message}");
        assert!(err.is_retryable(), "{message}");
        let err = stream
            .read_exact(&mut buf, "reading the header")
            .unwrap_err();
        assert!(
            err.to_string().contains("timeout: reading the header"),
            "{err}"
        );
    }
}
