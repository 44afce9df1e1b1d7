//! slime's placement flags as a layout: which GPUs train, which serve rollouts, and how many
//! engines serve (`--actor-num-nodes`, `--actor-num-gpus-per-node`, `--rollout-num-gpus`,
//! `--rollout-num-gpus-per-engine`, `--colocate`). slime hands this to Ray; vime computes it,
//! prints it, starts its training ranks on the training GPUs, and gives each engine it launches
//! its own GPUs (`CUDA_VISIBLE_DEVICES`).
use anyhow::{bail, ensure, Result};

/// The resolved layout of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// GPUs (ordinals) the training ranks use, rank i on `train[i]`.
    pub train: Vec<usize>,
    /// GPUs the rollout engines use (the training GPUs when colocated).
    pub rollout: Vec<usize>,
    pub gpus_per_engine: usize,
    pub colocate: bool,
}

impl Layout {
    /// The layout of `actor_gpus` training GPUs and `rollout_gpus` serving GPUs (default: as many
    /// as train when colocated, none otherwise), engines of `per_engine` GPUs each. `visible`:
    /// GPUs this machine has (checked when known).
    pub fn new(
        actor_nodes: usize,
        actor_gpus: usize,
        rollout_gpus: Option<usize>,
        per_engine: usize,
        colocate: bool,
        visible: Option<usize>,
    ) -> Result<Self> {
        ensure!(
            actor_nodes == 1,
            "--actor-num-nodes {actor_nodes}: vime trains on one node (start it with torchrun or srun per node \
             for more; multi-node runs are not tested yet)"
        );
        ensure!(actor_gpus >= 1, "--actor-num-gpus-per-node must be at least 1");
        ensure!(per_engine >= 1, "--rollout-num-gpus-per-engine must be at least 1");
        let rollout_n = rollout_gpus.unwrap_or(if colocate { actor_gpus } else { 0 });
        if !rollout_n.is_multiple_of(per_engine) {
            bail!("--rollout-num-gpus {rollout_n} is not a multiple of --rollout-num-gpus-per-engine {per_engine}");
        }
        let train: Vec<usize> = (0..actor_gpus).collect();
        let rollout: Vec<usize> = if colocate {
            ensure!(
                rollout_n <= actor_gpus,
                "--colocate with --rollout-num-gpus {rollout_n} > --actor-num-gpus-per-node {actor_gpus}: colocated \
                 engines share the training GPUs"
            );
            (0..rollout_n).collect()
        } else {
            (actor_gpus..actor_gpus + rollout_n).collect()
        };
        if let Some(v) = visible {
            let need = if colocate { actor_gpus } else { actor_gpus + rollout_n };
            ensure!(
                need <= v,
                "the placement needs {need} GPUs ({actor_gpus} to train{}) but this machine has {v}",
                if colocate {
                    String::new()
                } else {
                    format!(" + {rollout_n} to serve rollouts")
                }
            );
        }
        Ok(Self {
            train,
            rollout,
            gpus_per_engine: per_engine,
            colocate,
        })
    }

    pub fn engines(&self) -> usize {
        self.rollout.len() / self.gpus_per_engine
    }

    /// One line for the start of a run.
    pub fn describe(&self) -> String {
        let span = |g: &[usize]| match (g.first(), g.last()) {
            (Some(a), Some(b)) if a == b => format!("GPU {a}"),
            (Some(a), Some(b)) => format!("GPUs {a}-{b}"),
            _ => "no GPU".to_string(),
        };
        let serve = if self.rollout.is_empty() {
            "rollouts from the engines given (--vllm-url) or the built-in engine".to_string()
        } else {
            format!(
                "{} engine(s) x {} GPU(s) on {}{}",
                self.engines(),
                self.gpus_per_engine,
                span(&self.rollout),
                if self.colocate {
                    " (colocated: they sleep while vime trains)"
                } else {
                    ""
                }
            )
        };
        format!(
            "placement: train on {} ({} rank(s)); serve: {serve}",
            span(&self.train),
            self.train.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slimes_two_layouts() {
        // The seed's decoupled run: 2 train + 6 rollout, engines of 2 GPUs.
        let l = Layout::new(1, 2, Some(6), 2, false, Some(8)).unwrap();
        assert_eq!(l.train, vec![0, 1]);
        assert_eq!(l.rollout, vec![2, 3, 4, 5, 6, 7]);
        assert_eq!(l.engines(), 3);
        assert!(
            l.describe().contains("3 engine(s) x 2 GPU(s) on GPUs 2-7"),
            "{}",
            l.describe()
        );
        // Colocated on 8: 4 engines of TP 2 on the training GPUs.
        let l = Layout::new(1, 8, None, 2, true, Some(8)).unwrap();
        assert_eq!(l.rollout, (0..8).collect::<Vec<_>>());
        assert_eq!(l.engines(), 4);
        assert!(l.describe().contains("colocated"));
    }

    #[test]
    fn layouts_that_do_not_fit_are_named() {
        let e = |r: Result<Layout>| format!("{:#}", r.unwrap_err());
        assert!(e(Layout::new(1, 2, Some(6), 2, false, Some(4)))
            .contains("needs 8 GPUs (2 to train + 6 to serve rollouts) but this machine has 4"));
        assert!(e(Layout::new(1, 2, Some(5), 2, false, None)).contains("not a multiple"));
        assert!(e(Layout::new(2, 8, None, 1, true, None)).contains("--actor-num-nodes 2"));
        assert!(e(Layout::new(1, 2, Some(4), 1, true, None)).contains("share the training GPUs"));
    }
}
