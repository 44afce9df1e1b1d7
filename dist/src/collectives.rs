//! The collectives trait: one process group as a value.
//!
//! Conventions (NCCL's, and what the trainer relies on):
//! - Every rank of the group calls the same collective in the same order with tensors of the same
//!   shape and dtype; a mismatch is an error naming both shapes where the backend can see it.
//! - `all_gather` concatenates the ranks' tensors along dim 0 in group-rank order;
//!   `reduce_scatter` takes a tensor whose dim 0 is `size() * n` and returns this rank's
//!   `[n, ..]` slice of the sum (chunk `rank()`).
//! - Sums are reduced in group-rank order (rank 0 + rank 1 + ...) by the CPU backend, so its results
//!   are bit-identical on every rank and from run to run. NCCL's order is its own.
//! - Results come back as new tensors on the input's device, in the input's dtype.
use anyhow::Result;
use candle_core::{DType, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

pub trait Collectives {
    /// This process's rank within the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The global ranks of the group's members, in group-rank order (for error messages).
    fn members(&self) -> &[usize];

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// `t` on `root` (group rank) to every rank; other ranks pass a tensor of the same shape and
    /// dtype whose values are ignored.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    fn barrier(&self) -> Result<()>;
    fn send(&self, t: &Tensor, peer: usize) -> Result<()>;
    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor>;

    /// The sum (or max) over the group of `t`, as [`Self::all_reduce`] (or, with `scatter`, as
    /// [`Self::reduce_scatter`]), while `work` runs on this thread: communication overlapped with
    /// computation, as Megatron overlaps a layer's dgrad collective with its wgrad GEMMs. `work`
    /// must not use this group. The default runs the collective, then `work`; a backend that can
    /// run both at once overrides it. The result is the same either way.
    fn reduce_while(
        &self,
        t: &Tensor,
        op: ReduceOp,
        scatter: bool,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Tensor> {
        let r = if scatter {
            self.reduce_scatter(t, op)?
        } else {
            self.all_reduce(t, op)?
        };
        work()?;
        Ok(r)
    }

    /// Host bytes from `root` to every rank (any length; other ranks' `data` is ignored).
    fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>>;
    /// Every rank's bytes (any lengths), in group-rank order, on every rank.
    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
}

/// The group of one process: every collective is the identity. What a single-rank run uses, so
/// that it is the same code at world size 1.
#[derive(Debug, Clone)]
pub struct SingleRank {
    members: [usize; 1],
}

impl SingleRank {
    pub fn new(global_rank: usize) -> Self {
        Self { members: [global_rank] }
    }
}

impl Default for SingleRank {
    fn default() -> Self {
        Self::new(0)
    }
}

impl Collectives for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn members(&self) -> &[usize] {
        &self.members
    }
    fn all_reduce(&self, t: &Tensor, _op: ReduceOp) -> Result<Tensor> {
        Ok(t.copy()?)
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.copy()?)
    }
    fn reduce_scatter(&self, t: &Tensor, _op: ReduceOp) -> Result<Tensor> {
        Ok(t.copy()?)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        anyhow::ensure!(root == 0, "broadcast from group rank {root} in a group of one");
        Ok(t.copy()?)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn send(&self, _t: &Tensor, peer: usize) -> Result<()> {
        anyhow::bail!("send to group rank {peer} in a group of one")
    }
    fn recv(&self, _shape: &[usize], _dtype: DType, peer: usize) -> Result<Tensor> {
        anyhow::bail!("recv from group rank {peer} in a group of one")
    }
    fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        anyhow::ensure!(root == 0, "broadcast from group rank {root} in a group of one");
        Ok(data.to_vec())
    }
    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![data.to_vec()])
    }
}
