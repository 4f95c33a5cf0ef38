//! [`SanitizeOptions`]: report or panic, with or without stacks; `CUDALLOC_SANITIZE`.

use crate::error::{Error, Result};

/// How the sanitizer reports hazards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SanitizeOptions {
    /// Panic at the first hazard (test suites) instead of returning the error.
    pub panic: bool,
    /// Capture the Rust stack of every access (named in reports; costs a stack walk each).
    pub stacks: bool,
}

impl SanitizeOptions {
    /// Report mode: a hazard is an error (sticky on its stream) and a `tracing` error.
    pub fn report() -> Self {
        SanitizeOptions::default()
    }

    /// Panic mode: the call that finds a hazard panics (test suites).
    pub fn panic() -> Self {
        SanitizeOptions {
            panic: true,
            stacks: false,
        }
    }

    /// The same, capturing the Rust stack of every access.
    pub fn with_stacks(mut self) -> Self {
        self.stacks = true;
        self
    }

    /// Parses a `CUDALLOC_SANITIZE` value: `0`/`off`/empty (off, `None`), `1`/`on`/`report`, or
    /// `panic`, optionally followed by `,stacks`.
    pub fn parse(value: &str) -> Result<Option<SanitizeOptions>> {
        let mut parts = value.split(',').map(str::trim);
        let mut options = match parts.next().unwrap_or("") {
            "" | "0" | "off" | "false" => return Ok(None),
            "1" | "on" | "true" | "report" => SanitizeOptions::default(),
            "panic" => SanitizeOptions {
                panic: true,
                stacks: false,
            },
            other => {
                return Err(Error::Config(format!(
                    "CUDALLOC_SANITIZE: {other:?} is not a mode; valid: 0, 1 (report), panic, each optionally with ,stacks"
                )))
            }
        };
        for part in parts {
            match part {
                "stacks" => options.stacks = true,
                other => {
                    return Err(Error::Config(format!(
                        "CUDALLOC_SANITIZE: {other:?} is not an option; valid: stacks"
                    )))
                }
            }
        }
        Ok(Some(options))
    }

    /// Reads `CUDALLOC_SANITIZE` (unset: off).
    pub fn from_env() -> Result<Option<SanitizeOptions>> {
        match std::env::var("CUDALLOC_SANITIZE") {
            Ok(value) => Self::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::Config("CUDALLOC_SANITIZE is not valid UTF-8".into()))
            }
        }
    }
}
