//! Unix-domain sockets in `/dev/shm` and file descriptors passed over them (`SCM_RIGHTS`): how a
//! consumer gets the chunks of a producer's expandable segment without `pidfd_getfd` (which
//! unprivileged containers deny) — any two processes that share `/dev/shm` can do it.
//!
//! A listening socket is an object like the others: named `cudalloc-<pid>-<nonce>-<tag><n>`, its
//! file made `0600` right after `bind` (the umask already denies others the write permission that
//! `connect` needs), unlinked at drop or process exit, swept when its creator died. The server
//! also checks that every peer runs as our effective user (`SO_PEERCRED`).
//!
//! One message carries a payload of bytes and up to [`MAX_FDS`] descriptors. Received descriptors
//! are opened close-on-exec. What arrives is untrusted: a truncated control message, more
//! descriptors than asked for, or a malformed header closes every descriptor that did arrive and is
//! an error — never a leak, never a panic.

use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

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
            let _ = std::fs::remove_file(path_of(&self.name));
            forget_name(&self.name);
        }
    }
}

/// Connects to the socket `name` in `/dev/shm`; reads and writes time out after `timeout`.
pub(crate) fn connect(name: &str, timeout: Duration) -> Result<UnixStream> {
    validate_name(name)?;
    let stream = UnixStream::connect(path_of(name)).map_err(|e| Error::host_os("connect", e))?;
    set_timeouts(&stream, timeout)?;
    Ok(stream)
}

/// Reads and writes on `stream` time out after `timeout` (a silent peer is an error, not a hang).
pub(crate) fn set_timeouts(stream: &UnixStream, timeout: Duration) -> Result<()> {
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| Error::host_os("setsockopt(SO_RCVTIMEO)", e))
}

/// A pipe (read end, write end), closed on exec: closing the write end wakes a `poll` on the read
/// end (how a serving thread is told to stop).
pub(crate) fn wake_pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut ends = [-1 as RawFd; 2];
    // SAFETY: `ends` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(os("pipe2"));
    }
    // SAFETY: pipe2 succeeded: both descriptors are new and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) })
}

/// Whether the process at the other end of `stream` runs as our effective user.
pub(crate) fn peer_is_our_user(stream: &UnixStream) -> Result<bool> {
    // SAFETY: ucred is plain data; all-zero is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the socket is open; `cred` and `len` are valid for writes of the sizes given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(os("getsockopt(SO_PEERCRED)"));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    Ok(cred.uid == unsafe { libc::geteuid() })
}

/// The most descriptors one message carries (the kernel's `SCM_MAX_FD` is 253).
pub(crate) const MAX_FDS: usize = 64;

fn os(call: &'static str) -> Error {
    Error::host_os(call, std::io::Error::last_os_error())
}

/// Bytes of control buffer for `n` descriptors.
fn control_len(n: usize) -> usize {
    // SAFETY: CMSG_SPACE only computes a size.
    unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends `payload` (at least one byte) and `fds` in one message.
pub(crate) fn send_fds(socket: &UnixStream, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if payload.is_empty() || fds.len() > MAX_FDS {
        return Err(Error::invalid(format!(
            "a descriptor message needs a payload and at most {MAX_FDS} descriptors ({} given)",
            fds.len()
        )));
    }
    let mut control = vec![0u8; control_len(fds.len().max(1))];
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control_len(fds.len()) as _;
        // SAFETY: the control buffer holds CMSG_SPACE(n fds) bytes, so the first header and its
        // data (CMSG_LEN(n fds)) fit; the descriptors are copied in as plain ints.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len =
                libc::CMSG_LEN((fds.len() * std::mem::size_of::<RawFd>()) as u32) as _;
            let data = libc::CMSG_DATA(header).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(os("sendmsg"));
    }
    if sent as usize != payload.len() {
        return Err(Error::host_os(
            "sendmsg",
            format!("sent {sent} of {} payload bytes", payload.len()),
        ));
    }
    Ok(())
}

/// Receives one message into `payload` with at most `max_fds` descriptors; returns the payload
/// length and the descriptors (owned, close-on-exec).
pub(crate) fn recv_fds(
    socket: &UnixStream,
    payload: &mut [u8],
    max_fds: usize,
) -> Result<(usize, Vec<OwnedFd>)> {
    let max_fds = max_fds.min(MAX_FDS);
    let space = control_len(max_fds.max(1));
    let mut control = vec![MaybeUninit::<u8>::zeroed(); space];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at live, writable buffers of the sizes it states.
    let got = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(os("recvmsg"));
    }
    // Take ownership of whatever arrived first, so every error path below closes it.
    let mut fds = Vec::new();
    let mut malformed = false;
    // SAFETY: the kernel filled `msg_controllen` bytes of our buffer with well-formed headers;
    // CMSG_FIRSTHDR/NXTHDR stay inside it and return null at its end.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let data_len =
                    ((*header).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                let n = data_len / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(header).cast::<RawFd>();
                for i in 0..n {
                    let raw = data.add(i).read_unaligned();
                    if raw >= 0 {
                        fds.push(OwnedFd::from_raw_fd(raw));
                    } else {
                        malformed = true;
                    }
                }
            } else {
                malformed = true;
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || malformed || fds.len() > max_fds {
        return Err(Error::bad_handle(format!(
            "a descriptor message was truncated or malformed ({} descriptor(s) arrived, at most \
             {max_fds} expected); all closed",
            fds.len()
        )));
    }
    Ok((got as usize, fds))
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
        let exported: Vec<OwnedFd> = chunks.iter().map(|c| c.export().unwrap()).collect();
        let borrowed: Vec<BorrowedFd<'_>> = exported.iter().map(|f| f.as_fd()).collect();
        send_fds(&a, b"chunks", &borrowed).unwrap();
        let mut payload = [0u8; 16];
        let (n, fds) = recv_fds(&b, &mut payload, 8).unwrap();
        assert_eq!(&payload[..n], b"chunks");
        assert_eq!(fds.len(), 3);
        for (i, fd) in fds.into_iter().enumerate() {
            let chunk = Chunk::import(fd, 4096).unwrap();
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
        let exported: Vec<OwnedFd> = chunks.iter().map(|c| c.export().unwrap()).collect();
        let borrowed: Vec<BorrowedFd<'_>> = exported.iter().map(|f| f.as_fd()).collect();
        send_fds(&a, b"x", &borrowed).unwrap();
        let mut payload = [0u8; 4];
        let err = recv_fds(&b, &mut payload, 2).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidIpcHandle, "{err}");
        assert!(send_fds(&a, b"", &[]).is_err(), "a message needs a payload");
    }
}
