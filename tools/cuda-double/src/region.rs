//! Memory another process can open: a `memfd` mapped shared, with a one-page header saying what
//! it is. Device allocations and interprocess event cells both live in regions.
//!
//! A region is named across processes by `(pid, fd)` and opened through `/proc/<pid>/fd/<fd>`,
//! so nothing is left behind in `/dev/shm` when a process dies: the kernel frees the memory when
//! the last descriptor and mapping are gone (like device memory when a process exits). Because a
//! descriptor number can be reused after `close`, an opener checks the header (magic, pid, id,
//! size) before trusting the mapping; a mismatch is a refused handle, never a wrong mapping.

use std::ffi::CString;

use crate::codes;
use crate::report::{Checked, Fail};

/// Bytes before the payload.
pub const HEADER: usize = 4096;

/// The identity written at the start of a region.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the region holds (`b"CUDBLSEG"`, `b"CUDBLEVT"`).
    pub magic: [u8; 8],
    /// The creating process.
    pub pid: u32,
    /// The device the region belongs to.
    pub device: u32,
    /// A number unique within the creating process.
    pub id: u64,
    /// Payload bytes.
    pub size: u64,
}

/// A mapped region (created here or opened from another process).
#[derive(Debug)]
pub struct Region {
    fd: libc::c_int,
    map: *mut u8,
    map_len: usize,
}

// SAFETY: the region is a shared mapping; all access goes through raw pointers whose users
// uphold the device memory model (the double's stream workers), and the mapping is released
// only in Drop, when no reference remains.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

fn os_error(what: &str) -> Fail {
    Fail::outcome(
        codes::OPERATING_SYSTEM,
        format!("{what}: {}", std::io::Error::last_os_error()),
    )
}

impl Region {
    /// Creates a region of `header.size` payload bytes.
    pub fn create(header: Header) -> Checked<Region> {
        let payload = usize::try_from(header.size)
            .map_err(|_| Fail::outcome(codes::OUT_OF_MEMORY, "size exceeds the address space"))?;
        let map_len = payload
            .checked_add(HEADER)
            .ok_or_else(|| Fail::outcome(codes::OUT_OF_MEMORY, "size overflows"))?;
        let name = CString::new("cuda-double").map_err(|_| os_error("name"))?;
        // SAFETY: valid NUL-terminated name; flags are valid.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `fd` is a fresh memfd.
        if unsafe { libc::ftruncate(fd, map_len as libc::off_t) } != 0 {
            let err = os_error("ftruncate");
            // SAFETY: `fd` is open and owned here.
            unsafe { libc::close(fd) };
            return Err(Fail::outcome(codes::OUT_OF_MEMORY, err.message));
        }
        let region = Self::map(fd, map_len)?;
        // SAFETY: the mapping starts with HEADER >= size_of::<Header>() writable bytes and is
        // page-aligned.
        unsafe { region.map.cast::<Header>().write(header) };
        Ok(region)
    }

    /// Opens the region `(pid, fd)` of another process and checks that its header is `expected`.
    pub fn open(pid: u32, fd: i32, expected: Header) -> Checked<Region> {
        let refuse = |why: String| Fail::rejected(codes::INVALID_VALUE, why);
        let payload = usize::try_from(expected.size)
            .map_err(|_| refuse("size exceeds the address space".into()))?;
        let map_len = payload
            .checked_add(HEADER)
            .ok_or_else(|| refuse("size overflows".into()))?;
        let path = CString::new(format!("/proc/{pid}/fd/{fd}"))
            .map_err(|_| refuse("path contains NUL".into()))?;
        // SAFETY: valid NUL-terminated path.
        let opened = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if opened < 0 {
            return Err(refuse(format!(
                "cannot open the exporter's memory (process {pid} gone or the object freed): {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `stat` is plain data; fstat fills it for an open descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `opened` is open; `st` is a valid out-pointer.
        let stat_ok = unsafe { libc::fstat(opened, &mut st) } == 0;
        if !stat_ok || st.st_size as u64 != map_len as u64 {
            // SAFETY: `opened` is open and owned here.
            unsafe { libc::close(opened) };
            return Err(refuse(format!(
                "the exporter's object has {} bytes, the handle says {map_len}",
                st.st_size
            )));
        }
        let region = Self::map(opened, map_len)?;
        if region.header() != expected {
            return Err(refuse(format!(
                "the object at /proc/{pid}/fd/{fd} is not the one the handle names (found {:?})",
                region.header()
            )));
        }
        Ok(region)
    }

    /// A region from a descriptor received from another process (`cuMemImportFromShareableHandle`):
    /// its size and header (magic, size) must agree; anything else is refused input.
    pub fn adopt(fd: std::os::fd::OwnedFd, magic: [u8; 8]) -> Checked<Region> {
        use std::os::fd::IntoRawFd;
        let raw = fd.into_raw_fd();
        let refuse = |why: String| {
            // SAFETY: `raw` is ours (taken from the OwnedFd above) and not yet handed on.
            unsafe { libc::close(raw) };
            Fail::rejected(codes::INVALID_VALUE, why)
        };
        // SAFETY: `stat` is plain data; fstat fills it for an open descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is open; `st` a valid out-pointer.
        if unsafe { libc::fstat(raw, &mut st) } != 0 || (st.st_size as u64) < HEADER as u64 {
            return Err(refuse(
                "the descriptor is not a chunk of this driver".into(),
            ));
        }
        let map_len = st.st_size as usize;
        let region = Self::map(raw, map_len)?;
        let h = region.header();
        if h.magic != magic || h.size.checked_add(HEADER as u64) != Some(map_len as u64) {
            return Err(Fail::rejected(
                codes::INVALID_VALUE,
                format!("the descriptor does not hold a chunk of this driver ({h:?})"),
            ));
        }
        Ok(region)
    }

    fn map(fd: libc::c_int, map_len: usize) -> Checked<Region> {
        // SAFETY: maps `map_len` bytes of a file that has that size; checked for MAP_FAILED.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            let err = os_error("mmap");
            // SAFETY: `fd` is open and owned by the caller, who hands it to us.
            unsafe { libc::close(fd) };
            return Err(Fail::outcome(codes::OUT_OF_MEMORY, err.message));
        }
        Ok(Region {
            fd,
            map: map.cast(),
            map_len,
        })
    }

    /// The header.
    pub fn header(&self) -> Header {
        // SAFETY: the mapping starts with a Header (written at creation, checked at open).
        unsafe { self.map.cast::<Header>().read() }
    }

    /// The descriptor other processes open through `/proc`.
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// The start of the payload.
    pub fn payload(&self) -> *mut u8 {
        // SAFETY: HEADER < map_len, inside the mapping.
        unsafe { self.map.add(HEADER) }
    }

    /// The start of the header page (cells of events live there, after the header).
    pub fn header_page(&self) -> *mut u8 {
        self.map
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping and descriptor were created by `map` and are released once.
        unsafe {
            libc::munmap(self.map.cast(), self.map_len);
            libc::close(self.fd);
        }
    }
}

/// Whether process `pid` is running (a zombie, killed but not yet reaped, is not: it will never
/// run device work again).
pub fn process_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state is the field after the command name, which is in parentheses and may hold spaces.
    let state = stat
        .rfind(')')
        .and_then(|close| stat[close + 1..].split_whitespace().next());
    !matches!(state, None | Some("Z") | Some("X") | Some("x"))
}
