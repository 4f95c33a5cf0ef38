//! Settings that change on a live allocator without forgetting the others: [`CachingAllocator::reconfigure`]
//! applies the keys it is given on top of the configuration in force (PyTorch's
//! `_set_allocator_settings` re-parses the whole string and resets every key it is not given);
//! [`ConfigOverride`] changes keys for a scope and puts back the values they had. Which keys may
//! change, and why the others may not, is `config/live.rs`'s table; a refused key is an
//! [`Error::Config`] naming it and the reason, and nothing changes.
//!
//! The configuration is published whole (`sync::Published`), to each device's cell and then the
//! allocator's, one writer at a time: an allocation reads the one in force when it starts and
//! finishes under it; the next one sees the new settings.
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
    pub fn reconfigure(&self, changes: &str) -> Result<Vec<&'static str>> {
        self.change(changes).map(|(named, _)| named)
    }

    /// [`Self::reconfigure`] until the returned guard drops (or is restored): then the keys
    /// named get back the values they had, and the settings changed meanwhile by others keep
    /// theirs.
    pub fn override_config(&self, changes: &str) -> Result<ConfigOverride<'_>> {
        let (keys, previous) = self.change(changes)?;
        Ok(ConfigOverride {
            allocator: self,
            previous,
            keys,
            restored: false,
        })
    }

    /// Applies `changes`; returns the keys named and the configuration they replaced (read under
    /// the writers' lock, so an override restores what it replaced, not what another writer
    /// published meanwhile).
    fn change(&self, changes: &str) -> Result<(Vec<&'static str>, AllocatorConfig)> {
        // The fork check, before the writers' lock.
        let devices = self.devices.all("this allocator")?;
        let mut named = Vec::new();
        let mut previous = AllocatorConfig::default();
        self.config.update(|current| {
            let mut next = current.clone();
            named = next.apply(changes)?;
            self.check_changes(current, &next, &named)?;
            publish_to(devices, &next);
            previous = current.clone();
            Ok::<_, Error>(next)
        })?;
        self.apply_fraction(&named)?;
        tracing::info!(changes, "allocator reconfigured");
        Ok((named, previous))
    }

    /// Refuses keys a live allocator cannot change (only those whose value changes: naming a
    /// key with its current value is harmless).
    fn check_changes(
        &self,
        current: &AllocatorConfig,
        next: &AllocatorConfig,
        named: &[&'static str],
    ) -> Result<()> {
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

    /// A changed memory fraction takes effect on every device at once.
    fn apply_fraction(&self, named: &[&'static str]) -> Result<()> {
        if named.contains(&"per_process_memory_fraction") {
            let fraction = self.config().per_process_memory_fraction;
            for device in self.devices.all("this allocator")? {
                device.set_memory_fraction(fraction)?;
            }
        }
        Ok(())
    }

    /// Puts back `keys`' values from `previous`, keeping the others as they are now.
    fn restore(&self, previous: &AllocatorConfig, keys: &[&'static str]) -> Result<()> {
        // The fork check, before the writers' lock.
        let devices = self.devices.all("this allocator")?;
        self.config.update(|current| {
            let mut next = current.clone();
            for key in keys {
                live::copy_key(key, previous, &mut next);
            }
            self.check_changes(current, &next, keys)?;
            publish_to(devices, &next);
            Ok::<_, Error>(next)
        })?;
        self.apply_fraction(keys)
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
