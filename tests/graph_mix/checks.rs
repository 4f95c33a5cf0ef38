//! The checks after every step, one step, and the end of a seed.

use super::*;

impl World<'_> {
    pub(super) fn check(&mut self) {
        let step = self.counts.steps;
        self.a
            .check_invariants()
            .unwrap_or_else(|e| panic!("step {step}: invariants: {e}"));
        let snap = self.a.snapshot();
        // Every block of the snapshot, by address: none overlaps another.
        let mut blocks: Vec<(u64, u64, MemPoolId, SnapshotBlockState)> = snap
            .segments
            .iter()
            .flat_map(|s| {
                s.blocks
                    .iter()
                    .map(move |b| (b.addr, b.size, s.segment_pool_id, b.state))
            })
            .collect();
        blocks.sort_by_key(|b| b.0);
        for w in blocks.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "step {step}: blocks overlap: {:#x}+{} ({}) and {:#x} ({})",
                w[0].0,
                w[0].1,
                w[0].2,
                w[1].0,
                w[1].2
            );
        }
        let by_addr: BTreeMap<u64, (u64, MemPoolId, SnapshotBlockState)> = blocks
            .iter()
            .map(|&(a, n, p, s)| (a, (a + n, p, s)))
            .collect();
        // The memory of every live graph: its capture's ranges, still its pool's.
        let mut graph_mem: Vec<(u64, u64, usize)> = Vec::new();
        for g in &self.graphs {
            for &(at, n) in &g.ranges {
                assert!(
                    covered(&by_addr, g.pool, at, n),
                    "step {step}: g{}'s memory [{at:#x}, +{n}) is no longer in its pool {}",
                    g.name,
                    g.pool
                );
                graph_mem.push((at, at + n, g.name));
            }
        }
        graph_mem.sort_unstable();
        let pressure = self.pressure.as_ref().map(|(p, n)| (u64::MAX, p, *n));
        let eager = self.eager.iter().map(|(&k, e)| (k, &e.ptr, e.len));
        for (key, ptr, len) in eager.chain(pressure) {
            let at = ptr.ptr().0;
            match by_addr.get(&at) {
                Some(&(end, pool, state)) => assert!(
                    pool.is_default()
                        && state == SnapshotBlockState::ActiveAllocated
                        && end >= at + len,
                    "step {step}: eager e{key} at {at:#x} is a {state:?} block of pool {pool}"
                ),
                None => panic!("step {step}: eager e{key} at {at:#x} is no block of the snapshot"),
            }
            // Zero bytes of a live graph's memory.
            let hit = graph_mem
                .iter()
                .find(|&&(lo, hi, _)| lo < at + len && at < hi);
            if let Some(&(lo, hi, name)) = hit {
                panic!(
                    "step {step}: eager e{key} [{at:#x}, +{}) overlaps live graph g{name}'s \
                     memory [{lo:#x}, {hi:#x})",
                    len
                );
            }
        }
        let pools = self.live_pools();
        for g in &self.graphs {
            let at = g.output.ptr.ptr().0;
            let block = by_addr.get(&at);
            assert!(
                block.is_some_and(|&(end, p, state)| p == g.pool
                    && state == SnapshotBlockState::ActiveAllocated
                    && end >= at + g.output.len),
                "step {step}: g{}'s output at {at:#x} is not an allocated block of its pool",
                g.name
            );
        }
        // Each live pool counts exactly what the program holds of it: outputs (orphans too) and
        // the temporaries and outputs of open captures into it.
        for &pool in &pools {
            let holder = self
                .graphs
                .iter()
                .map(|g| g.graph.pool())
                .chain(self.handles.iter())
                .chain(self.open.iter().map(|o| o.capture.pool()))
                .find(|p| p.id() == pool)
                .unwrap();
            let st = holder.memory_stats(0).unwrap();
            let outputs = self
                .graphs
                .iter()
                .map(|g| &g.output)
                .chain(self.orphans.iter())
                .filter(|o| o.pool == pool)
                .map(|o| o.len);
            let open = self
                .open
                .iter()
                .filter(|o| o.pool == pool)
                .flat_map(|o| o.temps.iter().chain(o.output.as_ref().map(|(t, _)| t)))
                .map(|t| t.len);
            let held: Vec<u64> = outputs.chain(open).collect();
            assert_eq!(
                (st.allocation.all.current, st.requested_bytes.all.current),
                (held.len() as i64, held.iter().sum::<u64>() as i64),
                "step {step}: pool {pool}'s allocations and requested bytes"
            );
        }
        // The device counts exactly what the program holds: eager blocks, outputs (orphans too)
        // and the open captures' temporaries and outputs.
        let st = self.a.memory_stats(0).unwrap();
        let open = self
            .open
            .iter()
            .flat_map(|o| o.temps.iter().chain(o.output.as_ref().map(|(t, _)| t)))
            .map(|t| t.len);
        let held: Vec<u64> = self
            .eager
            .values()
            .map(|e| e.len)
            .chain(self.pressure.as_ref().map(|p| p.1))
            .chain(self.graphs.iter().map(|g| g.output.len))
            .chain(self.orphans.iter().map(|o| o.len))
            .chain(open)
            .collect();
        assert_eq!(
            st.allocation.all.current,
            held.len() as i64,
            "step {step}: device allocations"
        );
        if self.exact_requested {
            assert_eq!(
                st.requested_bytes.all.current,
                held.iter().sum::<u64>() as i64,
                "step {step}: device requested bytes"
            );
        }
    }

    pub(crate) fn step(&mut self) {
        match self.rng.below(100) {
            0..=11 => self.eager_alloc(),
            12..=16 => self.eager_write(),
            17..=19 => self.eager_verify(),
            20..=22 => self.eager_copy(),
            23..=30 => self.eager_free(),
            31 => self.pressure(),
            32..=39 => self.begin(),
            40..=59 => self.capture_op(),
            60..=79 => self.replay(),
            80..=83 => self.check_output(),
            84..=85 => self.consume_output(),
            86..=89 => self.drop_graph(),
            90..=91 => self.pool_handle(),
            92..=93 => self.empty_cache(),
            94..=95 => self.drop_orphan(),
            _ => self.verify_all(),
        }
        self.counts.steps += 1;
        self.check();
    }

    /// Ends what is open, verifies everything, drops everything in random order: nothing is
    /// left allocated or reserved.
    pub(crate) fn finish(mut self) -> Counts {
        while !self.open.is_empty() {
            let c = self.open.len() - 1;
            self.end(c, false);
            self.check();
        }
        self.verify_all();
        self.check();
        while !(self.graphs.is_empty() && self.orphans.is_empty() && self.handles.is_empty()) {
            match self.rng.below(3) {
                0 => self.drop_graph(),
                1 => self.drop_orphan(),
                _ => {
                    if let Some(p) = self.handles.pop() {
                        drop(p);
                    }
                }
            }
            self.check();
        }
        self.verify_all();
        while let Some(key) = self.random_eager() {
            self.eager.remove(&key);
        }
        self.pressure = None;
        self.check();
        self.a.empty_cache();
        let st = self.a.memory_stats(0).unwrap();
        assert_eq!(st.allocated_bytes.all.current, 0, "allocated at the end");
        assert_eq!(st.reserved_bytes.all.current, 0, "reserved at the end");
        assert!(
            self.a.snapshot().segments.is_empty(),
            "segments left at the end"
        );
        self.a.check_invariants().unwrap();
        let reports: Vec<String> = self
            .a
            .sanitizer()
            .map(|s| s.take_reports().iter().map(|r| r.to_string()).collect())
            .unwrap_or_default();
        assert!(reports.is_empty(), "sanitizer reports: {reports:#?}");
        std::mem::take(&mut self.counts)
    }
}
