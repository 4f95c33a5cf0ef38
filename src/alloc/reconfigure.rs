//! Settings that change on a live allocator without forgetting the others: [`CachingAllocator::reconfigure`]
//! applies the keys it is given on top of the configuration in force (PyTorch's
//! `_set_allocator_settings` re-parses the whole string and resets every key it is not given);
//! [`ConfigOverride`] changes keys for a scope and puts back the values they had. Which keys may
//! change, and why the others may not, is `config/live.rs`'s table; a refused key is an
//! [`Error::Config`] naming it and the reason, and nothing changes.
//!
//! The configuration is published whole (`config/cell.rs`), to each device's cell (and from there
//! each shard's fit rules) and then the allocator's, one writer at a time: an allocation rounds
//! its request by one setting and fits it under one setting's rules; the next one sees the new
//! settings. Nothing of a superseded configuration is kept but what its readers hold.
//!
//! A setting has one home, the configuration: [`CachingAllocator::set_per_process_memory_fraction`]
//! is a reconfiguration of `per_process_memory_fraction` (a device's own value in the key's list
//! form), and the devices read their caps from the configuration published to them. So an override
//! of the key puts back the setter's values too, and a setter inside an override's scope changes
//! the key the override puts back at its end, as `reconfigure` would.
//!
//! In a forked child every change is refused ([`Error::ForkedChild`]) before the writers' lock —
//! which a thread of the parent may have held at the fork — and dropping an override inherited
//! from the parent restores nothing.

use super::engine::DeviceCore;
use super::CachingAllocator;
use crate::config::live::{self, Change};
use crate::config::AllocatorConfig;
use crate::error::{Error, Result};
use crate::sync::os::Arc;

impl CachingAllocator {
    /// Changes the settings named in `changes` (`CUDALLOC_CONF`'s grammar, e.g.
    /// `"garbage_collection_threshold:0.8,expandable_segments:True"`) and keeps every other one.
    /// Returns the keys named, by their canonical names.
    pub(crate) fn reconfigure(&self, changes: &str) -> Result<Vec<&'static str>> {
        self.change(changes).map(|(named, _)| named)
    }

    /// [`Self::reconfigure`] until the returned guard drops (or is restored): then the keys
    /// named get back the values they had, and the settings changed meanwhile by others keep
    /// theirs.
    pub(crate) fn override_config(&self, changes: &str) -> Result<ConfigOverride<'_>> {
        let (keys, previous) = self.change(changes)?;
        Ok(ConfigOverride {
            allocator: self,
            previous,
            keys,
            restored: false,
        })
    }

    /// Caps this process's reservations on `device` at `fraction` of its capacity (PyTorch's
    /// `set_per_process_memory_fraction`): a reconfiguration of `per_process_memory_fraction`
    /// that gives `device` a value of its own (see the module docs).
    pub(crate) fn set_per_process_memory_fraction(
        &self,
        fraction: f64,
        device: usize,
    ) -> Result<()> {
        self.devices.get(device, "this allocator")?;
        self.update(|next| {
            next.set_device_memory_fraction(device, fraction)?;
            Ok(vec!["per_process_memory_fraction"])
        })?;
        tracing::info!(fraction, device, "per-process memory fraction set");
        Ok(())
    }

    /// Applies `changes`; returns the keys named and the configuration they replaced (read under
    /// the writers' lock, so an override restores what it replaced, not what another writer
    /// published meanwhile).
    fn change(&self, changes: &str) -> Result<(Vec<&'static str>, AllocatorConfig)> {
        let done = self.update(|next| next.apply(changes))?;
        tracing::info!(changes, "allocator reconfigured");
        Ok(done)
    }

    /// The one path of every change: the fork check (before the writers' lock), then `edit` on
    /// a copy of the configuration in force, which returns the keys it changed; the change is
    /// checked and published to the devices and then to the allocator, or nothing changes.
    /// Returns the keys and the configuration replaced.
    fn update(
        &self,
        edit: impl FnOnce(&mut AllocatorConfig) -> Result<Vec<&'static str>>,
    ) -> Result<(Vec<&'static str>, AllocatorConfig)> {
        let devices = self.devices.all("this allocator")?;
        let mut named = Vec::new();
        let mut previous = AllocatorConfig::default();
        self.config.update(|current| {
            let mut next = current.clone();
            named = edit(&mut next)?;
            self.check_changes(current, &next, &named)?;
            publish_to(devices, &next);
            previous = current.clone();
            Ok::<_, Error>(next)
        })?;
        Ok((named, previous))
    }

    /// Refuses keys a live allocator cannot change (only those whose value changes: naming a
    /// key with its current value is harmless), and memory fractions of devices that do not
    /// exist.
    fn check_changes(
        &self,
        current: &AllocatorConfig,
        next: &AllocatorConfig,
        named: &[&'static str],
    ) -> Result<()> {
        if let Some(device) = next
            .device_memory_fractions
            .keys()
            .find(|&&d| d >= self.devices.len())
        {
            return Err(Error::Config(format!(
                "per_process_memory_fraction names device {device}, which does not exist ({} \
                 device(s))",
                self.devices.len()
            )));
        }
        for &key in named {
            let mut probe = current.clone();
            live::copy_key(key, next, &mut probe);
            if probe == *current {
                continue;
            }
            match live::change_of(key) {
                Change::Live => {}
                Change::Refused(reason) => {
                    return Err(Error::Config(format!(
                        "{key} cannot change on a live runtime: {reason}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Puts back `keys`' values from `previous`, keeping the others as they are now.
    fn restore(&self, previous: &AllocatorConfig, keys: &[&'static str]) -> Result<()> {
        self.update(|next| {
            for key in keys {
                live::copy_key(key, previous, next);
            }
            Ok(keys.to_vec())
        })
        .map(drop)
    }
}

/// Each device reads the configuration from a cell of its own (one load on the hot path, no
/// shared line); they get the new one before the allocator's own, under its writer lock.
fn publish_to(devices: &[Arc<DeviceCore>], config: &AllocatorConfig) {
    for device in devices {
        device.publish_config(config.clone());
    }
}

/// Settings changed for a scope ([`crate::Runtime::override_config`]): dropping it (or
/// [`ConfigOverride::restore`]) gives the keys it changed back the values they had, and leaves
/// the others as they are then. Overrides nest: drop them in the reverse order of their making (an
/// inner one dropped after its outer one puts back the value it saw, the outer one's).
#[must_use = "the settings are restored when the guard drops"]
pub struct ConfigOverride<'a> {
    allocator: &'a CachingAllocator,
    previous: AllocatorConfig,
    keys: Vec<&'static str>,
    restored: bool,
}

impl ConfigOverride<'_> {
    /// The keys this override changed (canonical names).
    pub fn keys(&self) -> &[&'static str] {
        &self.keys
    }

    /// Restores the previous values now; an error says why they could not be.
    pub fn restore(mut self) -> Result<()> {
        self.restored = true;
        self.allocator.restore(&self.previous, &self.keys)
    }
}

impl std::fmt::Debug for ConfigOverride<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigOverride")
            .field("keys", &self.keys)
            .finish()
    }
}

impl Drop for ConfigOverride<'_> {
    fn drop(&mut self) {
        // In a forked child the configuration is the parent's: nothing to restore.
        if self.restored || !self.allocator.birth.is_current() {
            return;
        }
        if let Err(err) = self.allocator.restore(&self.previous, &self.keys) {
            tracing::error!(%err, keys = ?self.keys, "a configuration override could not be restored");
        }
    }
}
