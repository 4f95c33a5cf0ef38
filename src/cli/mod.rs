//! The `cudalloc` command's jobs (binary-only code).

pub mod demo;
