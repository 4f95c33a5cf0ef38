//! Memory of a sleeping tag (`alloc/engine/sleep.rs`): its pages are unmapped while the addresses stay
//! handed out, so any work on them is a bug of the program — one that on a GPU faults (or, with
//! new memory mapped there by someone else, corrupts), and that the host backend refuses.
//!
//! | call | effect |
//! |---|---|
//! | the allocator puts pages of tag `t` to sleep ([`Sanitizer::asleep`]) | the range is *asleep*: its accesses were forgotten with the unmap |
//! | any work that touches an asleep range, on any stream or the host | an **access to sleeping memory** report (kept, logged) and [`Error::Asleep`] from the call; nothing is enqueued, no stream is failed, no panic even in panic mode: the call was refused before anything ran, as a driver refuses an unmapped address |
//! | the allocator maps the pages back ([`Sanitizer::awake`]) | the range is ordinary fresh memory again: the wake's copies write it (on the block's stream, waited for by the host before the wake returns) |

use super::report::{AccessReport, HazardKind, HazardReport};
use super::state::State;
use super::{Sanitizer, Touch, MAX_KEPT_REPORTS};
use crate::error::Error;
use crate::sync::os::MutexGuard;

impl Sanitizer {
    /// `[start, start + len)` of tag `tag` is asleep: unmapped, its addresses still handed out.
    pub(crate) fn asleep(&self, start: u64, len: u64, tag: &str) {
        let mut st = self.state.lock();
        let end = start.saturating_add(len);
        st.shadow.forget(start, end);
        st.asleep.insert(start, (end, tag.into()));
    }

    /// `[start, start + len)` is mapped again (the wake of its tag).
    pub(crate) fn awake(&self, start: u64, len: u64) {
        let mut st = self.state.lock();
        let end = start.saturating_add(len);
        let inside: Vec<u64> = st.asleep.range(start..end).map(|(&s, _)| s).collect();
        for s in inside {
            st.asleep.remove(&s);
        }
    }

    /// Refuses `touches` of `what` on actor `slot` when one lies in sleeping memory: reported
    /// and returned as [`Error::Asleep`] (see the module docs).
    pub(super) fn check_awake(
        &self,
        st: &mut MutexGuard<'_, State>,
        slot: usize,
        what: &str,
        touches: &[Touch],
    ) -> Result<(), Error> {
        for t in touches.iter().filter(|t| t.len > 0) {
            let end = t.start.saturating_add(t.len);
            let Some((at, until, tag)) = st
                .asleep
                .range(..end)
                .next_back()
                .filter(|(_, (until, _))| *until > t.start)
                .map(|(&at, (until, tag))| (at, *until, tag.clone()))
            else {
                continue;
            };
            let report = HazardReport {
                kind: HazardKind::AccessWhileAsleep,
                earlier: AccessReport {
                    kind: "sleep",
                    what: format!("the sleep of tag {tag:?}"),
                    start: at,
                    len: until - at,
                    allocation: None,
                    stack: None,
                },
                later: self.later_access(st, slot, what, t, None),
                free: None,
            };
            let text = report.to_string();
            tracing::error!(target: "cudalloc::sanitizer", "{text}");
            st.hazards += 1;
            if st.reports.len() < MAX_KEPT_REPORTS {
                st.reports.push(report);
            }
            return Err(Error::Asleep {
                tag: tag.to_string(),
                message: text,
            });
        }
        Ok(())
    }
}
