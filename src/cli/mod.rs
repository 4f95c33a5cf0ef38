//! The `cudalloc` command's jobs (binary-only code).

pub(crate) mod demo;
pub(crate) mod replay;

/// A progress bar that says what it counts, drawn only on a terminal (indicatif hides itself when
/// standard error is not one, so pipes get no escape codes).
pub(crate) fn labelled_progress(len: u64, what: &'static str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len}") {
        bar.set_style(style);
    }
    bar.set_message(what);
    bar
}
