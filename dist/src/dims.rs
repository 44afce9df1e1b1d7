//! `ParallelDims { dp, tp, cp }`: the parallel sizes, validated against the world size, and the
//! rank layout. Megatron's order: tensor-parallel ranks are adjacent (fastest varying, so a TP
//! group sits on one node's NVLink), then context-parallel, then data-parallel:
//! `global = tp_rank + tp * (cp_rank + cp * dp_rank)`.
use anyhow::{bail, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub dp: usize,
    pub tp: usize,
    pub cp: usize,
}

/// One rank's coordinates in the (dp, cp, tp) grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankCoords {
    pub global: usize,
    pub dp: usize,
    pub cp: usize,
    pub tp: usize,
}

impl ParallelDims {
    /// The single-process layout.
    pub const SINGLE: ParallelDims = ParallelDims { dp: 1, tp: 1, cp: 1 };

    /// `dp` derived as `world / (tp * cp)` (Megatron's rule); `dp` given explicitly must agree.
    pub fn new(world: usize, tp: usize, cp: usize, dp: Option<usize>) -> Result<Self> {
        if world == 0 {
            bail!("the world size must be at least 1");
        }
        if tp == 0 || cp == 0 {
            bail!("--tensor-model-parallel-size ({tp}) and --context-parallel-size ({cp}) must be at least 1");
        }
        let mp = tp * cp;
        if !world.is_multiple_of(mp) {
            bail!(
                "the world size {world} is not divisible by tensor-parallel size {tp} x context-parallel size {cp} = {mp}"
            );
        }
        let derived = world / mp;
        if let Some(d) = dp {
            if d != derived {
                bail!("--data-parallel-size {d} does not match world size {world} / (tp {tp} x cp {cp}) = {derived}");
            }
        }
        Ok(ParallelDims { dp: derived, tp, cp })
    }

    pub fn world(&self) -> usize {
        self.dp * self.tp * self.cp
    }

    pub fn coords(&self, global: usize) -> RankCoords {
        RankCoords {
            global,
            tp: global % self.tp,
            cp: (global / self.tp) % self.cp,
            dp: global / (self.tp * self.cp),
        }
    }

    pub fn global_rank(&self, dp: usize, cp: usize, tp: usize) -> usize {
        tp + self.tp * (cp + self.cp * dp)
    }

    /// Global ranks of the data-parallel group that `global` belongs to (same cp, tp).
    pub fn dp_group(&self, global: usize) -> Vec<usize> {
        let c = self.coords(global);
        (0..self.dp).map(|d| self.global_rank(d, c.cp, c.tp)).collect()
    }

    /// Global ranks of the tensor-parallel group of `global` (same dp, cp).
    pub fn tp_group(&self, global: usize) -> Vec<usize> {
        let c = self.coords(global);
        (0..self.tp).map(|t| self.global_rank(c.dp, c.cp, t)).collect()
    }

    /// Global ranks of the context-parallel group of `global` (same dp, tp).
    pub fn cp_group(&self, global: usize) -> Vec<usize> {
        let c = self.coords(global);
        (0..self.cp).map(|k| self.global_rank(c.dp, k, c.tp)).collect()
    }

    /// Every distinct group of one kind, e.g. all DP groups: each global rank in exactly one.
    pub fn all_groups(&self, of: impl Fn(&Self, usize) -> Vec<usize>) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for r in 0..self.world() {
            let g = of(self, r);
            if !out.contains(&g) {
                out.push(g);
            }
        }
        out
    }
}
