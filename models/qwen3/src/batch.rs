//! The packed varlen batch: sequences laid end to end with no padding.
//!
//! `input_ids [T]`, `position_ids [T]` restarting at 0 per sequence, `cu_seqlens [B+1]` (sequence
//! `s` spans `cu_seqlens[s]..cu_seqlens[s+1]`), and `targets [T]`: the next token of the same
//! sequence, or `IGNORE_TARGET` at each sequence's last token. Host-side `Arc<[u32]>` so that every
//! layer's ops share them without copies.
use anyhow::{bail, Result};
use std::sync::Arc;
use vime_kernels::IGNORE_TARGET;

#[derive(Debug, Clone)]
pub struct PackedBatch {
    pub input_ids: Arc<[u32]>,
    pub position_ids: Arc<[u32]>,
    pub cu_seqlens: Arc<[u32]>,
    pub targets: Arc<[u32]>,
}

impl PackedBatch {
    /// Packs `seqs` (each non-empty) into one varlen batch.
    pub fn from_sequences<S: AsRef<[u32]>>(seqs: &[S]) -> Result<Self> {
        if seqs.is_empty() {
            bail!("a packed batch needs at least one sequence");
        }
        let total: usize = seqs.iter().map(|s| s.as_ref().len()).sum();
        if total > u32::MAX as usize {
            bail!("packed batch of {total} tokens exceeds u32 indexing");
        }
        let mut input_ids = Vec::with_capacity(total);
        let mut position_ids = Vec::with_capacity(total);
        let mut targets = Vec::with_capacity(total);
        let mut cu_seqlens = Vec::with_capacity(seqs.len() + 1);
        cu_seqlens.push(0u32);
        for (i, s) in seqs.iter().enumerate() {
            let s = s.as_ref();
            if s.is_empty() {
                bail!("sequence {i} of the batch is empty");
            }
            input_ids.extend_from_slice(s);
            position_ids.extend(0..s.len() as u32);
            targets.extend_from_slice(&s[1..]);
            targets.push(IGNORE_TARGET);
            cu_seqlens.push(input_ids.len() as u32);
        }
        Ok(Self {
            input_ids: input_ids.into(),
            position_ids: position_ids.into(),
            cu_seqlens: cu_seqlens.into(),
            targets: targets.into(),
        })
    }

    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    pub fn num_sequences(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    /// Token range of sequence `s` in the packed layout.
    pub fn seq_range(&self, s: usize) -> std::ops::Range<usize> {
        self.cu_seqlens[s] as usize..self.cu_seqlens[s + 1] as usize
    }

    pub fn max_seqlen(&self) -> usize {
        (0..self.num_sequences())
            .map(|s| self.seq_range(s).len())
            .max()
            .unwrap_or(0)
    }
}
