//! What a piece of stream work touches: byte ranges read or written. The stream sanitizer checks
//! them (`sanitizer/`); a launch of a library's kernel declares them to the driver
//! (`capability::Interop::launch_function`).

/// Whether an access reads or writes its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccessKind {
    /// The bytes are read.
    Read,
    /// The bytes are written (or read and written).
    Write,
}

impl AccessKind {
    /// `"read"` or `"write"`.
    pub fn name(self) -> &'static str {
        match self {
            AccessKind::Read => "read",
            AccessKind::Write => "write",
        }
    }
}

/// One access of an enqueued operation: bytes `[start, start + len)`, read or written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Touch {
    /// First byte address.
    pub start: u64,
    /// Bytes (0: nothing).
    pub len: u64,
    /// Read or write.
    pub kind: AccessKind,
}

impl Touch {
    /// Reads `len` bytes at `start`.
    pub fn read(start: u64, len: u64) -> Self {
        Touch {
            start,
            len,
            kind: AccessKind::Read,
        }
    }

    /// Writes `len` bytes at `start`.
    pub fn write(start: u64, len: u64) -> Self {
        Touch {
            start,
            len,
            kind: AccessKind::Write,
        }
    }
}
