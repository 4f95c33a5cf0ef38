//! Host-backend configuration: how many virtual devices, how many bytes each, whether freed
//! segments are poisoned, how long a wait on another process's event may last, and how much host
//! memory may be page-locked. From the environment (`CUDALLOC_HOST_DEVICES`,
//! `CUDALLOC_HOST_MEMORY`, `CUDALLOC_IPC_EVENT_TIMEOUT_S`, `CUDALLOC_HOST_PINNED_MEMORY`) or from
//! [`HostDriverBuilder`].

use std::time::Duration;

use super::HostDriver;
use crate::error::{Error, Result};

/// Default number of virtual devices.
pub(super) const DEFAULT_DEVICES: usize = 1;
/// Default capacity per device: 4 GiB — room for real workloads on a laptop. Memory is only
/// committed when touched (tmpfs), so the capacity costs nothing until used.
pub(super) const DEFAULT_MEMORY: u64 = 4 << 30;
/// The smallest capacity of a device.
const MIN_MEMORY: u64 = 1 << 20;
/// Most virtual devices accepted (the IPC handle stores the ordinal in 16 bits).
pub(super) const MAX_DEVICES: usize = 64;
/// Default deadline of a wait on another process's interprocess event (see
/// [`HostDriverBuilder::ipc_event_timeout`]): long past any honest producer's record, short
/// enough that a scribbled event cell cannot stall a stream for a process's whole life.
pub(super) const DEFAULT_IPC_EVENT_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest deadline accepted from `CUDALLOC_IPC_EVENT_TIMEOUT_S` (one week).
const MAX_IPC_EVENT_TIMEOUT_S: f64 = 7.0 * 24.0 * 3600.0;

/// Options of a [`HostDriver`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostDriverBuilder {
    pub(crate) devices: usize,
    pub(crate) memory_per_device: u64,
    pub(crate) poison_on_free: bool,
    pub(crate) ipc_event_timeout: Option<Duration>,
    /// Most bytes of page-locked host memory the driver allocates and registers together
    /// (`u64::MAX`: as much as the operating system locks).
    pub(crate) pinned_memory: u64,
}

impl Default for HostDriverBuilder {
    fn default() -> Self {
        HostDriverBuilder {
            devices: DEFAULT_DEVICES,
            memory_per_device: DEFAULT_MEMORY,
            poison_on_free: true,
            ipc_event_timeout: Some(DEFAULT_IPC_EVENT_TIMEOUT),
            pinned_memory: u64::MAX,
        }
    }
}

impl HostDriverBuilder {
    /// Starts from `CUDALLOC_HOST_DEVICES`, `CUDALLOC_HOST_MEMORY`,
    /// `CUDALLOC_IPC_EVENT_TIMEOUT_S` and `CUDALLOC_HOST_PINNED_MEMORY` where set.
    pub fn from_env() -> Result<Self> {
        let mut b = Self::default();
        if let Some(v) = env_var("CUDALLOC_HOST_DEVICES")? {
            b.devices = v
                .trim()
                .parse()
                .ok()
                .filter(|n| (1..=MAX_DEVICES).contains(n))
                .ok_or_else(|| {
                    Error::Config(format!(
                        "CUDALLOC_HOST_DEVICES={v:?} is not a device count; expected \
                         1..={MAX_DEVICES}"
                    ))
                })?;
        }
        if let Some(v) = env_var("CUDALLOC_HOST_MEMORY")? {
            b.memory_per_device = parse_byte_size(&v)
                .map_err(|why| Error::Config(format!("CUDALLOC_HOST_MEMORY={v:?}: {why}")))?;
            if b.memory_per_device < MIN_MEMORY {
                return Err(Error::Config(format!(
                    "CUDALLOC_HOST_MEMORY={v:?} is below the minimum capacity of 1MiB"
                )));
            }
        }
        if let Some(v) = env_var("CUDALLOC_IPC_EVENT_TIMEOUT_S")? {
            b.ipc_event_timeout = parse_timeout_s(&v).map_err(|why| {
                Error::Config(format!("CUDALLOC_IPC_EVENT_TIMEOUT_S={v:?}: {why}"))
            })?;
        }
        if let Some(v) = env_var("CUDALLOC_HOST_PINNED_MEMORY")? {
            b.pinned_memory = parse_byte_size(&v).map_err(|why| {
                Error::Config(format!("CUDALLOC_HOST_PINNED_MEMORY={v:?}: {why}"))
            })?;
        }
        b.validate()?;
        Ok(b)
    }

    /// Number of virtual devices (1..=64).
    pub fn devices(mut self, n: usize) -> Self {
        self.devices = n;
        self
    }

    /// Capacity of each device in bytes.
    pub fn memory_per_device(mut self, bytes: u64) -> Self {
        self.memory_per_device = bytes;
        self
    }

    /// Most bytes of page-locked host memory ([`PinnedHost::host_alloc`](crate::backend::capability::PinnedHost::host_alloc)
    /// and [`PinnedHost::host_register`](crate::backend::capability::PinnedHost::host_register) together, charged in whole
    /// pages) before either is out of memory; default: as much as the operating system locks
    /// (`RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`). Also `CUDALLOC_HOST_PINNED_MEMORY`.
    pub fn pinned_memory(mut self, bytes: u64) -> Self {
        self.pinned_memory = bytes;
        self
    }

    /// Whether freed segments are overwritten with the poison pattern before unmapping (default on).
    pub fn poison_on_free(mut self, on: bool) -> Self {
        self.poison_on_free = on;
        self
    }

    /// How long a stream (or `event_synchronize`) waits for a record of another process's
    /// interprocess event before the wait fails with
    /// [`ForeignEventFailure::Timeout`](crate::ForeignEventFailure::Timeout); `None`: no deadline
    /// (a scribbled event cell then stalls the stream until its producer exits). Default
    /// 60 s.
    pub fn ipc_event_timeout(mut self, deadline: Option<Duration>) -> Self {
        self.ipc_event_timeout = deadline;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.devices == 0 || self.devices > MAX_DEVICES {
            return Err(Error::Config(format!(
                "host device count {} out of range; expected 1..={MAX_DEVICES}",
                self.devices
            )));
        }
        if self.memory_per_device < MIN_MEMORY {
            return Err(Error::Config(format!(
                "host device memory {} bytes is below the minimum of 1 MiB",
                self.memory_per_device
            )));
        }
        Ok(())
    }

    /// Builds the driver (starts each device's default stream).
    pub fn build(self) -> Result<HostDriver> {
        self.validate()?;
        HostDriver::with_config(self)
    }
}

fn env_var(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(Error::Config(format!("{name} is not valid UTF-8")))
        }
    }
}

/// Parses a deadline in seconds (`60`, `0.25`); `0` or `off` is no deadline.
fn parse_timeout_s(text: &str) -> std::result::Result<Option<Duration>, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let seconds: f64 = t
        .parse()
        .map_err(|_| "expected seconds such as 60 or 0.5, or 0 / off for no deadline".to_owned())?;
    if !seconds.is_finite() || !(0.0..=MAX_IPC_EVENT_TIMEOUT_S).contains(&seconds) {
        return Err(format!(
            "{t} seconds is out of range; expected 0 to {MAX_IPC_EVENT_TIMEOUT_S}"
        ));
    }
    Ok((seconds > 0.0).then(|| Duration::from_secs_f64(seconds)))
}

/// Parses `4096`, `512KiB`, `64MiB`, `8GiB`, `1TiB` (also `K`/`M`/`G`/`T`, `KB`/`MB`/`GB`/`TB`,
/// all binary multiples), case-insensitive, optional space before the unit.
pub fn parse_byte_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| "expected a byte count such as 4096, 512MiB or 8GiB".to_owned())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?}; use B, KiB, MiB, GiB or TiB"
            ))
        }
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{t} overflows 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse() {
        assert_eq!(parse_byte_size("4096"), Ok(4096));
        assert_eq!(parse_byte_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_byte_size(" 64 MiB "), Ok(64 << 20));
        assert_eq!(parse_byte_size("8g"), Ok(8 << 30));
        assert!(parse_byte_size("").is_err());
        assert!(parse_byte_size("12 parsecs").is_err());
        assert!(parse_byte_size("-1").is_err());
        assert!(parse_byte_size("99999999999999TiB").is_err());
    }

    #[test]
    fn event_timeouts_parse() {
        assert_eq!(parse_timeout_s("60"), Ok(Some(Duration::from_secs(60))));
        assert_eq!(
            parse_timeout_s(" 0.25 "),
            Ok(Some(Duration::from_millis(250)))
        );
        assert_eq!(parse_timeout_s("0"), Ok(None));
        assert_eq!(parse_timeout_s("OFF"), Ok(None));
        for bad in ["", "-1", "NaN", "inf", "1e9", "soon"] {
            assert!(parse_timeout_s(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn builder_rejects_nonsense() {
        assert!(HostDriverBuilder::default().devices(0).validate().is_err());
        assert!(HostDriverBuilder::default().devices(65).validate().is_err());
        assert!(HostDriverBuilder::default()
            .memory_per_device(100)
            .validate()
            .is_err());
        assert!(HostDriverBuilder::default().validate().is_ok());
    }
}
