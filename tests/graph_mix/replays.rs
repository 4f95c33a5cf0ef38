//! Replays, outputs, dropping graphs and pools, `empty_cache`.

use super::*;

impl World<'_> {
    pub(super) fn replay(&mut self) {
        let candidates: Vec<usize> = (0..self.graphs.len())
            .filter(|&i| !self.pool_busy(self.graphs[i].pool))
            .collect();
        if candidates.is_empty() {
            return;
        }
        let i = candidates[self.rng.index(candidates.len())];
        let Some(r) = self.idle_stream(None) else {
            return;
        };
        let pool = self.graphs[i].pool;
        // After every earlier use of the pool's memory (replays of its graphs, reads of their
        // outputs), and after the input's last write.
        let users = self.pool_users.remove(&pool).unwrap_or_default();
        for &u in &users {
            order(&self.d, &self.marks, r, u);
        }
        let expected = {
            let g = &self.graphs[i];
            before_write(&self.d, &self.marks, r, &g.output.uses);
            // The replay reads the input (whatever the output ends up holding).
            if let Some(k) = g.input {
                before_read(&self.d, &self.marks, r, &self.eager[&k].uses);
            }
            match (g.content, g.input) {
                (Content::Input, Some(k)) => self.eager[&k].seed,
                (Content::Seed(seed), _) => seed,
                (Content::Input, None) => unreachable!("an input content without an input"),
            }
        };
        self.graphs[i].graph.replay(r).unwrap();
        self.counts.replays += 1;
        self.pool_users.insert(pool, vec![r]);
        let g = &mut self.graphs[i];
        if r != g.output.home {
            self.a.record_stream(&g.output.ptr, r).unwrap();
        }
        g.output.uses.wrote(r);
        g.output.valid = Some(expected);
        if let Some(k) = g.input {
            let e = self.eager.get_mut(&k).unwrap();
            if r != e.home {
                self.a.record_stream(&e.ptr, r).unwrap();
            }
            e.uses.read(r);
        }
        let name = g.name;
        // A graph sharing the pool may have reused bytes this replay wrote.
        for (j, other) in self.graphs.iter_mut().enumerate() {
            if j != i && other.pool == pool {
                other.output.valid = None;
            }
        }
        for o in self.orphans.iter_mut().filter(|o| o.pool == pool) {
            o.valid = None;
        }
        self.note(format!(
            "replay g{name} on s{} (expects seed {expected})",
            self.sid(r)
        ));
        if self.unprohibited() && self.rng.chance(40) {
            self.verify_output(Target::Graph(i));
        }
    }

    /// Verifies an output whose content is known, on an idle stream.
    pub(super) fn verify_output(&mut self, t: Target) {
        let (valid, writer) = {
            let o = match t {
                Target::Graph(i) => &self.graphs[i].output,
                Target::Orphan(i) => &self.orphans[i],
            };
            (o.valid, o.uses.writer)
        };
        let Some(seed) = valid else {
            return;
        };
        let Some(v) = self.idle_stream(writer) else {
            return;
        };
        let o = match t {
            Target::Graph(i) => &mut self.graphs[i].output,
            Target::Orphan(i) => &mut self.orphans[i],
        };
        before_read(&self.d, &self.marks, v, &o.uses);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let bad = unsafe {
            self.d
                .kernels()
                .count_pattern_mismatches(v, o.ptr.ptr(), o.len, seed)
        }
        .unwrap();
        assert_eq!(
            bad,
            0,
            "{t:?}: output ({} bytes at {:#x}) does not hold seed {seed}: {bad} bytes differ",
            o.len,
            o.ptr.ptr().0
        );
        if v != o.home {
            self.a.record_stream(&o.ptr, v).unwrap();
        }
        o.uses.read(v);
        let pool = o.pool;
        self.pool_users.entry(pool).or_default().push(v);
        self.counts.output_checks += 1;
    }

    pub(super) fn check_output(&mut self) {
        if !self.unprohibited() {
            return;
        }
        let n = self.graphs.len() + self.orphans.len();
        if n == 0 {
            return;
        }
        let i = self.rng.index(n);
        let t = if i < self.graphs.len() {
            Target::Graph(i)
        } else {
            Target::Orphan(i - self.graphs.len())
        };
        self.verify_output(t);
        self.note(format!("verify {t:?}"));
    }

    /// An eager copy of a graph's output (eager work reading a graph's memory).
    pub(super) fn consume_output(&mut self) {
        if self.graphs.is_empty() || self.eager.len() >= MAX_EAGER || !self.unprohibited() {
            return;
        }
        let i = self.rng.index(self.graphs.len());
        let Some(seed) = self.graphs[i].output.valid else {
            return;
        };
        let Some(h) = self.idle_stream(self.graphs[i].output.uses.writer) else {
            return;
        };
        let n = self.graphs[i].output.len;
        let ptr = match self.alloc(h, n) {
            Ok(p) => p,
            Err(err) if is_oom(&err) => {
                self.counts.ooms += 1;
                return;
            }
            Err(err) => panic!("eager allocation of {n} bytes: {err}"),
        };
        let g = &mut self.graphs[i];
        before_read(&self.d, &self.marks, h, &g.output.uses);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            self.d
                .copy_device_to_device(h, ptr.ptr(), g.output.ptr.ptr(), n)
        }
        .unwrap();
        if h != g.output.home {
            self.a.record_stream(&g.output.ptr, h).unwrap();
        }
        g.output.uses.read(h);
        let (name, pool) = (g.name, g.pool);
        self.pool_users.entry(pool).or_default().push(h);
        self.adopt_eager(
            ptr,
            n,
            seed,
            h,
            format!("copy of g{name}'s output ({n} bytes)"),
        );
    }

    pub(super) fn drop_graph(&mut self) {
        if self.graphs.is_empty() {
            return;
        }
        let i = self.rng.index(self.graphs.len());
        let g = self.graphs.swap_remove(i);
        if let Some(k) = g.input {
            self.eager.get_mut(&k).unwrap().pins -= 1;
        }
        let keep = self.rng.chance(30);
        let output_first = self.rng.chance(50);
        let Live {
            graph,
            name,
            output,
            ..
        } = g;
        if keep {
            drop(graph);
            self.orphans.push(output);
        } else if output_first {
            drop(output);
            drop(graph);
        } else {
            drop(graph);
            drop(output);
        }
        self.note(format!(
            "drop g{name}{}",
            if keep { " (output kept)" } else { "" }
        ));
    }

    pub(super) fn drop_orphan(&mut self) {
        if !self.orphans.is_empty() {
            let i = self.rng.index(self.orphans.len());
            self.orphans.swap_remove(i);
            self.note(format!("drop orphan output {i}"));
        }
    }

    pub(super) fn pool_handle(&mut self) {
        if !self.graphs.is_empty() && self.handles.len() < 2 && self.rng.chance(50) {
            let i = self.rng.index(self.graphs.len());
            let p = self.graphs[i].graph.pool().clone();
            self.note(format!("hold pool {}", p.id()));
            self.handles.push(p);
        } else if !self.handles.is_empty() {
            let i = self.rng.index(self.handles.len());
            let p = self.handles.swap_remove(i);
            self.note(format!("drop pool handle {}", p.id()));
        }
    }

    pub(super) fn empty_cache(&mut self) {
        self.a.empty_cache();
        self.note("empty_cache".into());
        if !self.open.is_empty() {
            return; // nothing is released during a capture
        }
        // What no live pool holds is given back, but for segments with a block still held.
        let live = self.live_pools();
        for seg in &self.a.snapshot().segments {
            if live.contains(&seg.segment_pool_id) {
                continue;
            }
            assert!(
                seg.blocks
                    .iter()
                    .any(|b| b.state == SnapshotBlockState::ActiveAllocated),
                "after empty_cache, a segment at {:#x} of pool {} holds nothing: {:?}",
                seg.address,
                seg.segment_pool_id,
                seg.blocks
            );
        }
    }

    // ---- the checks ----
}
