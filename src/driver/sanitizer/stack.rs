//! The Rust stack of an access (sanitizer stacks on): captured when the access is enqueued, named
//! in a report. Below both the shadow memory that keeps it and the report that prints it.

use std::fmt;

/// A Rust stack captured when an access was enqueued (sanitizer stacks on), symbolized only when
/// a report names it.
#[derive(Clone)]
pub(crate) struct Stack(#[cfg(feature = "stacks")] backtrace::Backtrace);

impl fmt::Debug for Stack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Stack(..)")
    }
}

impl Stack {
    /// The current thread's stack, unresolved.
    pub(crate) fn capture() -> Self {
        Stack(
            #[cfg(feature = "stacks")]
            backtrace::Backtrace::new_unresolved(),
        )
    }

    /// Without the `stacks` feature: a line saying why there is no stack.
    #[cfg(not(feature = "stacks"))]
    pub(crate) fn render_now(&self) -> String {
        "      (no stack: cudalloc was built without its `stacks` feature)".to_owned()
    }

    /// The frames from the caller's entry into cudalloc outwards, one `name (file:line)` a line.
    #[cfg(feature = "stacks")]
    pub(crate) fn render_now(&self) -> String {
        let mut trace = self.0.clone();
        trace.resolve();
        let mut lines = Vec::new();
        for frame in trace.frames() {
            for symbol in frame.symbols() {
                let name = symbol
                    .name()
                    .map_or_else(|| "??".to_owned(), |n| format!("{n:#}"));
                let at = match (symbol.filename(), symbol.lineno()) {
                    (Some(file), Some(line)) => format!(" ({}:{line})", file.display()),
                    _ => String::new(),
                };
                lines.push(format!("{name}{at}"));
            }
        }
        // Leave out the capture and cudalloc's own frames above the caller.
        let skip = lines
            .iter()
            .take_while(|l| {
                l.starts_with("backtrace::")
                    || l.starts_with("cudalloc::")
                    || l.starts_with("<cudalloc::")
            })
            .count();
        lines
            .into_iter()
            .skip(skip)
            .take(24)
            .map(|l| format!("      {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
