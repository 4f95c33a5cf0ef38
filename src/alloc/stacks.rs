//! Rust stacks for the memory history: captured as return addresses (an unwind, no symbol lookup),
//! symbolized later — when a snapshot is taken — with a cache so each address is looked up once.
//! Frames of the capture itself, of cudalloc and of the standard library are left out until the
//! first of the caller's: a stack starts at the call into cudalloc, through any door.

use std::collections::HashMap;

/// One frame of a recorded stack (PyTorch's `{filename, line, name}`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Frame {
    /// Source file ("??" when the binary has no debug information for it).
    pub filename: String,
    /// Line (0 when unknown).
    pub line: u32,
    /// Function, demangled.
    pub name: String,
}

/// The most frames kept per stack.
#[cfg(feature = "stacks")]
const MAX_FRAMES: usize = 48;

/// The return addresses of the current thread's stack, innermost first (none without the
/// `stacks` feature).
pub(crate) fn capture() -> Vec<usize> {
    #[cfg(feature = "stacks")]
    {
        let mut ips = Vec::with_capacity(MAX_FRAMES);
        backtrace::trace(|frame| {
            ips.push(frame.ip() as usize);
            ips.len() < MAX_FRAMES
        });
        ips
    }
    #[cfg(not(feature = "stacks"))]
    Vec::new()
}

/// Whether stacks can be recorded: false without the `stacks` feature, said once in the log.
pub(crate) fn available() -> bool {
    if cfg!(feature = "stacks") {
        return true;
    }
    static SAID: crate::sync::os::OnceLock<()> = crate::sync::os::OnceLock::new();
    SAID.get_or_init(|| {
        tracing::warn!("Rust stacks were asked for, but cudalloc was built without its `stacks` feature: none are recorded");
    });
    false
}

/// Symbolizes stacks, each address once.
#[derive(Default)]
pub(crate) struct Symbolizer {
    cache: HashMap<usize, Vec<Frame>>,
}

/// Whether a frame is the capture's, cudalloc's or the standard library's: the frames a stack
/// leaves out until the first one of the caller's (whichever door — `Storage`, `Runtime`,
/// `CachingAllocator` — the call came through, and std's closures between them).
fn internal(name: &str) -> bool {
    let name = name.trim_start_matches('<');
    ["backtrace::", "cudalloc::", "core::", "std::", "alloc::"]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

impl Symbolizer {
    /// The frames of `stack` (inlined functions expanded), without the leading internal ones.
    pub(crate) fn frames(&mut self, stack: &[usize]) -> Vec<Frame> {
        let mut out = Vec::new();
        for (i, &ip) in stack.iter().enumerate() {
            // A return address points after the call; the call's line is at the byte before.
            let at = if i == 0 { ip } else { ip.saturating_sub(1) };
            let frames = self.cache.entry(at).or_insert_with(|| resolve(at));
            out.extend(frames.iter().cloned());
        }
        let skip = out.iter().take_while(|f| internal(&f.name)).count();
        out.drain(..skip);
        out
    }
}

fn resolve(addr: usize) -> Vec<Frame> {
    let mut frames = Vec::new();
    #[cfg(feature = "stacks")]
    backtrace::resolve(addr as *mut std::ffi::c_void, |symbol| {
        frames.push(Frame {
            filename: symbol
                .filename()
                .map_or_else(|| "??".to_owned(), |p| p.display().to_string()),
            line: symbol.lineno().unwrap_or(0),
            name: symbol
                .name()
                .map_or_else(|| format!("{addr:#x}"), |n| format!("{n:#}")),
        });
    });
    if frames.is_empty() {
        frames.push(Frame {
            filename: "??".to_owned(),
            line: 0,
            name: format!("{addr:#x}"),
        });
    }
    frames
}
