//! Eager steps: allocations, writes, copies, verification and frees outside every capture.

use super::*;

impl World<'_> {
    pub(super) fn eager_alloc(&mut self) {
        if self.eager.len() >= MAX_EAGER || !self.unprohibited() {
            return;
        }
        let Some(h) = self.idle_stream(None) else {
            return;
        };
        let n = self.rng.size();
        let ptr = match self.alloc(h, n) {
            Ok(p) => p,
            Err(err) if is_oom(&err) => {
                self.counts.ooms += 1;
                self.note(format!(
                    "eager alloc {n} on s{}: out of memory",
                    self.sid(h)
                ));
                return;
            }
            Err(err) => panic!("eager allocation of {n} bytes: {err}"),
        };
        let seed = self.seed();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { self.d.kernels().fill_pattern(h, ptr.ptr(), n, seed) }.unwrap();
        self.adopt_eager(ptr, n, seed, h, format!("{n} bytes, seed {seed}"));
    }

    /// A large eager block (32 .. 224 MiB), held unwritten for a while: memory pressure, so that
    /// the out-of-memory path (releasing cached memory, retrying) runs while graphs live. Dropped
    /// instead when one is held.
    pub(super) fn pressure(&mut self) {
        if let Some(p) = self.pressure.take() {
            self.note(format!("drop pressure at {:#x}", p.0.ptr().0));
            return;
        }
        if !self.unprohibited() {
            return;
        }
        let Some(h) = self.idle_stream(None) else {
            return;
        };
        let n = (32 + self.rng.below(193)) * MIB;
        match self.a.allocate_on(h, n) {
            Ok(p) => {
                self.note(format!(
                    "pressure: {n} bytes at {:#x} on s{}",
                    p.ptr().0,
                    self.sid(h)
                ));
                self.pressure = Some((p, n));
            }
            Err(err) if is_oom(&err) => {
                self.counts.ooms += 1;
                self.note(format!("pressure {n} on s{}: out of memory", self.sid(h)));
            }
            Err(err) => panic!("eager allocation of {n} bytes: {err}"),
        }
    }

    /// Allocates `n` bytes for `on`: by stream, or as the thread's current stream.
    pub(super) fn alloc(&mut self, on: StreamId, n: u64) -> cudalloc::Result<DataPtr> {
        if self.rng.chance(25) {
            let _current = self.a.set_current_stream(on).unwrap();
            self.a.allocate(0, n)
        } else {
            self.a.allocate_on(on, n)
        }
    }

    pub(super) fn random_eager(&mut self) -> Option<u64> {
        if self.eager.is_empty() {
            return None;
        }
        let i = self.rng.index(self.eager.len());
        self.eager.keys().nth(i).copied()
    }

    pub(super) fn eager_write(&mut self) {
        let Some(key) = self.random_eager() else {
            return;
        };
        let home = self.eager[&key].home;
        let Some(w) = self.idle_stream(Some(home)) else {
            return;
        };
        let seed = self.seed();
        let e = self.eager.get_mut(&key).unwrap();
        before_write(&self.d, &self.marks, w, &e.uses);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { self.d.kernels().fill_pattern(w, e.ptr.ptr(), e.len, seed) }.unwrap();
        if w != e.home {
            self.a.record_stream(&e.ptr, w).unwrap();
        }
        e.uses.wrote(w);
        e.seed = seed;
        let line = format!("eager write e{key} on s{} seed {seed}", self.sid(w));
        self.note(line);
    }

    /// Verifies eager block `key` on an idle stream (its writer's when it can); false when no
    /// stream could.
    pub(super) fn verify_eager(&mut self, key: u64) -> bool {
        let (home, writer) = {
            let e = &self.eager[&key];
            (e.home, e.uses.writer)
        };
        let Some(v) = self.idle_stream(writer.or(Some(home))) else {
            return false;
        };
        let e = self.eager.get_mut(&key).unwrap();
        before_read(&self.d, &self.marks, v, &e.uses);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let bad = unsafe {
            self.d
                .kernels()
                .count_pattern_mismatches(v, e.ptr.ptr(), e.len, e.seed)
        }
        .unwrap();
        assert_eq!(
            bad,
            0,
            "eager e{key} ({} bytes at {:#x}, seed {}) corrupted: {bad} bytes differ",
            e.len,
            e.ptr.ptr().0,
            e.seed
        );
        if v != e.home {
            self.a.record_stream(&e.ptr, v).unwrap();
        }
        e.uses.read(v);
        self.counts.eager_checks += 1;
        true
    }

    pub(super) fn eager_verify(&mut self) {
        if !self.unprohibited() {
            return;
        }
        if let Some(key) = self.random_eager() {
            if self.verify_eager(key) {
                self.note(format!("eager verify e{key}"));
            }
        }
    }

    pub(super) fn eager_copy(&mut self) {
        if self.eager.len() >= MAX_EAGER || !self.unprohibited() {
            return;
        }
        let Some(src) = self.random_eager() else {
            return;
        };
        let Some(h) = self.idle_stream(Some(self.eager[&src].home)) else {
            return;
        };
        let n = self.eager[&src].len;
        let ptr = match self.alloc(h, n) {
            Ok(p) => p,
            Err(err) if is_oom(&err) => {
                self.counts.ooms += 1;
                return;
            }
            Err(err) => panic!("eager allocation of {n} bytes: {err}"),
        };
        let s = self.eager.get_mut(&src).unwrap();
        before_read(&self.d, &self.marks, h, &s.uses);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { self.d.copy_device_to_device(h, ptr.ptr(), s.ptr.ptr(), n) }.unwrap();
        if h != s.home {
            self.a.record_stream(&s.ptr, h).unwrap();
        }
        s.uses.read(h);
        let seed = s.seed;
        self.adopt_eager(ptr, n, seed, h, format!("copy of e{src} ({n} bytes)"));
    }

    pub(super) fn eager_free(&mut self) {
        let Some(key) = self.random_eager() else {
            return;
        };
        if self.eager[&key].pins > 0 {
            return;
        }
        self.eager.remove(&key);
        self.note(format!("eager free e{key}"));
    }

    pub(super) fn verify_all(&mut self) {
        if !self.unprohibited() {
            return;
        }
        let keys: Vec<u64> = self.eager.keys().copied().collect();
        for key in keys {
            self.verify_eager(key);
        }
        for i in 0..self.graphs.len() {
            self.verify_output(Target::Graph(i));
        }
        for i in 0..self.orphans.len() {
            self.verify_output(Target::Orphan(i));
        }
        self.note("verify all".into());
    }

    // ---- captures ----
}
