//! Which `Storage` a receipt returns.
//!
//! * **Shared storages** of this process, by the key their handles carry (ref-counter file,
//!   slot, generation), whichever runtime shared them: a receipt in the producer's own process
//!   returns the original storage — through any runtime of the process. The generation makes a
//!   handle of an earlier storage in a reused slot miss.
//! * **Received storages**, per runtime, by the same key as shared ones (ref-counter file, slot,
//!   generation): a second receipt of a live storage returns the same `Storage`. (Keyed once by
//!   (memory handle, offset): memory of expandable segments has no memory handle — it is named by
//!   its pages — so two storages at the same offset of their pages were taken for one.) The lock of this table is held across a whole receipt, so
//!   two threads opening one storage get one `Storage` (check and insert are one step).
//!
//! Entries are weak; dead ones are pruned whenever an entry is added.

use std::collections::HashMap;

use super::{Storage, WeakStorage};
use crate::ipc::SharedKey;
use crate::process::PerProcess;
use crate::sync::os::{Mutex, MutexGuard};

static SHARED: PerProcess<Mutex<Option<HashMap<SharedKey, WeakStorage>>>> =
    PerProcess::new(|| Mutex::new(None));

/// (runtime id, the shared storage's key).
pub(super) type ReceivedKey = (u64, SharedKey);

/// Received storages of every runtime of the process.
pub(super) type Received = HashMap<ReceivedKey, WeakStorage>;

static RECEIVED: PerProcess<Mutex<Option<Received>>> = PerProcess::new(|| Mutex::new(None));

/// Registers a storage shared for the first time.
pub(super) fn remember_shared(key: SharedKey, storage: &Storage) {
    let mut guard = SHARED.lock();
    let map = guard.get_or_insert_with(HashMap::new);
    map.retain(|_, w| w.is_alive());
    map.insert(key, storage.downgrade());
}

/// The live storage this process shared under `key`.
pub(super) fn shared(key: &SharedKey) -> Option<Storage> {
    SHARED
        .lock()
        .as_ref()
        .and_then(|map| map.get(key))
        .and_then(WeakStorage::upgrade)
}

/// The received-storage table, locked for a whole receipt.
pub(super) fn received() -> MutexGuard<'static, Option<Received>> {
    RECEIVED.lock()
}
