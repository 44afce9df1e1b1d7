//! Data parallelism in the RL loop: who does what, and the few exchanges it needs.
//!
//! Roles (every rank runs the same loop):
//! - rank 0 owns the rollout engine, the rewards, metrics, plots and checkpoint files; it
//!   generates each rollout and broadcasts its samples to every rank ([`broadcast_samples`]).
//! - the scoring passes (old / reference log-probs, critic values) are split over the
//!   data-parallel ranks and gathered back, so every rank holds every sample's values and
//!   computes the same advantages ([`score_split`]).
//! - each optimizer step's samples are split over the data-parallel ranks ([`dp_split`]); each
//!   rank accumulates the gradients of its micro-batches, normalised by the whole step's
//!   normaliser, and the ZeRO-1 optimizer reduce-scatters them: the sum over ranks is the
//!   gradient of the step's loss, as at DP = 1.
//! - loss metrics are sums over micro-batches already divided by the step normaliser, so the
//!   step's value is their sum over ranks ([`sum_metrics`]).
//!
//! Decisions:
//! - Samples travel once per rollout as JSON (a few MB at most, small next to a training step), in
//!   a private wire form (`WireSample`) whose engine log-probs and reward are their raw f32 /
//!   f64 bits: JSON has no NaN or Inf, and a NaN log-prob must reach the step's NaN/Inf guard, as
//!   at DP = 1, with its bits. `Sample`'s own serde form is not used across ranks.
//! - Scores and summed metrics travel as raw little-endian float bits, not JSON: JSON has no NaN, and a NaN old
//!   log-prob or value must reach the step's NaN/Inf guard (skip and count, or stop with
//!   `--check-for-nan-in-loss-and-grad`) as it does at DP = 1.
//! - Without `--balance-data` a step's samples go round-robin (`i % dp`), slime's split; with it,
//!   Karmarkar-Karp on token counts with equal sample counts per rank (slime's
//!   `get_seqlen_balanced_partitions(.., equal_size=True)`).
use super::args::ParallelArgs;
use super::step::Sample;
use crate::batching::balance_across_ranks;
use anyhow::{bail, Context, Result};
use candle_core::Device;
use std::collections::BTreeMap;
use std::time::Duration;
use vime_dist::launch::DistEnv;
use vime_dist::world::{Backend, WorldOptions};
use vime_dist::{Collectives, ParallelDims, World};
use vime_rollout::engine::FinishReason;

/// This process's world, from torchrun's environment contract (a single process without it),
/// and its device: with several ranks, `--device cuda` means `cuda:LOCAL_RANK`. Also the name of
/// the collectives backend, for the log.
pub fn join_world(args: &ParallelArgs, device: &str) -> Result<(World, Device, &'static str)> {
    let (tp, cp, dp) = (
        args.tensor_model_parallel_size,
        args.context_parallel_size,
        args.data_parallel_size,
    );
    let Some(env) = DistEnv::from_env()? else {
        ParallelDims::new(1, tp, cp, dp).context(
            "this is one process (no RANK, WORLD_SIZE, ... in the environment): start several ranks with \
             --nproc-per-node N or torchrun",
        )?;
        return Ok((World::single(), crate::device::parse_device(device)?, "none"));
    };
    let dims = ParallelDims::new(env.world_size, tp, cp, dp).with_context(|| format!("rank {}", env.rank))?;
    let cuda = device == "cuda" || device.starts_with("cuda:");
    let device = if cuda && env.local_world_size > 1 {
        if device != "cuda" {
            eprintln!(
                "vime: rank {}: --device {device} with {} local ranks: using cuda:{} (LOCAL_RANK)",
                env.rank, env.local_world_size, env.local_rank
            );
        }
        crate::device::parse_device(&format!("cuda:{}", env.local_rank))?
    } else {
        crate::device::parse_device(device)?
    };
    let (backend, name) = match (args.distributed_backend.as_str(), device.is_cuda()) {
        ("cpu" | "gloo", _) | ("auto", false) => (Backend::Cpu, "cpu"),
        #[cfg(feature = "cuda")]
        ("nccl" | "auto", true) => (Backend::Nccl(device.clone()), "nccl"),
        ("nccl", false) => bail!("--distributed-backend nccl needs --device cuda"),
        #[cfg(not(feature = "cuda"))]
        ("nccl" | "auto", true) => bail!("the nccl backend needs a build with the cuda feature"),
        (other, _) => bail!("--distributed-backend {other:?}: expected auto, nccl or cpu"),
    };
    let mut opts = WorldOptions::from_env()?;
    let limit = Duration::from_secs_f64(args.distributed_timeout_minutes * 60.0);
    if std::env::var_os("VIME_DIST_OP_TIMEOUT").is_none() {
        opts.timeouts.op = limit;
    }
    if std::env::var_os("VIME_DIST_TIMEOUT").is_none() {
        opts.timeouts.rendezvous = limit.min(opts.timeouts.rendezvous);
    }
    let world = World::new(&env, dims, backend, opts)
        .with_context(|| format!("rank {}: joining the {}-rank world", env.rank, env.world_size))?;
    Ok((world, device, name))
}

/// The local positions (into `lengths`) that each of `dp` ranks trains on.
pub fn dp_split(lengths: &[usize], dp: usize, balance: bool) -> Vec<Vec<usize>> {
    if dp <= 1 {
        return vec![(0..lengths.len()).collect()];
    }
    if balance {
        balance_across_ranks(lengths, dp, true)
    } else {
        (0..dp).map(|r| (r..lengths.len()).step_by(dp).collect()).collect()
    }
}

/// What rank 0 sends after a rollout: the samples, or why there are none (so that the other
/// ranks stop with rank 0's error instead of waiting for samples that never come).
#[derive(serde::Serialize, serde::Deserialize)]
enum RolloutMessage {
    Samples(Vec<WireSample>),
    Failed(String),
}

/// A [`Sample`] as it crosses the data-parallel ranks (as JSON): its floats as their raw bits, so
/// that a NaN (with its payload) or Inf comes back as it left. Both conversions name every field,
/// so a field added to `Sample` must be added here too.
#[derive(serde::Serialize, serde::Deserialize)]
struct WireSample {
    prompt_index: usize,
    tokens: Vec<u32>,
    response_length: usize,
    /// `f32::to_bits` of each engine log-prob.
    rollout_log_probs: Option<Vec<u32>>,
    response: String,
    label: Option<String>,
    /// `f64::to_bits` of the reward.
    raw_reward: u64,
    finish: FinishReason,
}

impl From<Sample> for WireSample {
    fn from(s: Sample) -> Self {
        let Sample {
            prompt_index,
            tokens,
            response_length,
            rollout_log_probs,
            response,
            label,
            raw_reward,
            finish,
        } = s;
        WireSample {
            prompt_index,
            tokens,
            response_length,
            rollout_log_probs: rollout_log_probs.map(|v| v.into_iter().map(f32::to_bits).collect()),
            response,
            label,
            raw_reward: raw_reward.to_bits(),
            finish,
        }
    }
}

impl From<WireSample> for Sample {
    fn from(s: WireSample) -> Self {
        let WireSample {
            prompt_index,
            tokens,
            response_length,
            rollout_log_probs,
            response,
            label,
            raw_reward,
            finish,
        } = s;
        Sample {
            prompt_index,
            tokens,
            response_length,
            rollout_log_probs: rollout_log_probs.map(|v| v.into_iter().map(f32::from_bits).collect()),
            response,
            label,
            raw_reward: f64::from_bits(raw_reward),
            finish,
        }
    }
}

/// Rank 0's samples (or its error) on every rank of `group`. Rank 0 passes `Some(result)`, the
/// others `None`.
pub fn broadcast_samples(group: &dyn Collectives, mine: Option<Result<Vec<Sample>>>) -> Result<Vec<Sample>> {
    if group.size() == 1 {
        return mine.context("internal: the only rank has no samples")?;
    }
    let (bytes, own_err) = match mine {
        Some(Ok(s)) => {
            let msg = RolloutMessage::Samples(s.into_iter().map(WireSample::from).collect());
            (
                serde_json::to_vec(&msg).context("encoding the rollout for the other ranks")?,
                None,
            )
        }
        Some(Err(e)) => (
            serde_json::to_vec(&RolloutMessage::Failed(format!("{e:#}"))).context("encoding rank 0's error")?,
            Some(e),
        ),
        None => (Vec::new(), None),
    };
    let got = group
        .broadcast_bytes(&bytes, 0)
        .context("receiving the rollout from rank 0")?;
    if let Some(e) = own_err {
        return Err(e);
    }
    match serde_json::from_slice(&got).context("decoding the rollout from rank 0")? {
        RolloutMessage::Samples(s) => Ok(s.into_iter().map(Sample::from).collect()),
        RolloutMessage::Failed(why) => bail!("rank 0 failed to produce the rollout: {why}"),
    }
}

/// Per-sample values of `score` over all `n` samples, each rank scoring the samples
/// `dp_split` gives it and every rank receiving all of them.
pub fn score_split(
    group: &dyn Collectives,
    lengths: &[usize],
    balance: bool,
    score: impl FnOnce(&[usize]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>> {
    let n = lengths.len();
    let parts = dp_split(lengths, group.size(), balance);
    let mine = &parts[group.rank()];
    let values = score(mine)?;
    if group.size() == 1 {
        return Ok(values);
    }
    let all = group
        .all_gather_bytes(&encode_scores(&values))
        .context("gathering per-sample scores")?;
    let mut out: Vec<Option<Vec<f32>>> = vec![None; n];
    for (r, (b, idx)) in all.iter().zip(&parts).enumerate() {
        let v = decode_scores(b).with_context(|| format!("decoding the scores of data-parallel rank {r}"))?;
        if v.len() != idx.len() {
            bail!(
                "data-parallel rank {r} scored {} samples, {} expected",
                v.len(),
                idx.len()
            );
        }
        for (&i, vals) in idx.iter().zip(v) {
            out[i] = Some(vals);
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, v)| v.with_context(|| format!("internal: no rank scored sample {i}")))
        .collect()
}

/// Per sample (or any list of f32 vectors): its value count (u64) then its values' f32 bits,
/// little-endian.
pub(crate) fn encode_scores(values: &[Vec<f32>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.iter().map(|v| 8 + 4 * v.len()).sum());
    for v in values {
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

pub(crate) fn decode_scores(mut b: &[u8]) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let Some((len, rest)) = b.split_first_chunk::<8>() else {
            bail!("{} trailing bytes after sample {}", b.len(), out.len());
        };
        let len = u64::from_le_bytes(*len) as usize;
        let Some(body) = rest.get(..len.saturating_mul(4)) else {
            bail!(
                "sample {} has {len} values but only {} bytes follow",
                out.len(),
                rest.len()
            );
        };
        out.push(
            body.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("chunks of 4")))
                .collect(),
        );
        b = &rest[body.len()..];
    }
    Ok(out)
}

/// Per metric: the name's length (u64), its UTF-8 bytes, the value's f64 bits, little-endian
/// (a NaN or Inf metric crosses with its bits, as JSON could not carry it).
fn encode_metrics(m: &BTreeMap<String, f64>) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in m {
        out.extend_from_slice(&(k.len() as u64).to_le_bytes());
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn decode_metrics(mut b: &[u8]) -> Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    while !b.is_empty() {
        let Some((len, rest)) = b.split_first_chunk::<8>() else {
            bail!("{} trailing bytes after metric {}", b.len(), out.len());
        };
        let len = u64::from_le_bytes(*len) as usize;
        let Some((name, rest)) = rest.split_at_checked(len) else {
            bail!("metric {} names {len} bytes but only {} follow", out.len(), rest.len());
        };
        let Some((value, rest)) = rest.split_first_chunk::<8>() else {
            bail!("metric {} has no value", out.len());
        };
        let name = std::str::from_utf8(name).with_context(|| format!("metric {}'s name", out.len()))?;
        out.insert(name.to_string(), f64::from_le_bytes(*value));
        b = rest;
    }
    Ok(out)
}

/// Replaces each metric by its sum over the ranks of `group` (in rank order, so every rank gets
/// the same bits). A metric missing on some rank counts as 0 there.
pub fn sum_metrics(group: &dyn Collectives, m: &mut BTreeMap<String, f64>) -> Result<()> {
    if group.size() == 1 {
        return Ok(());
    }
    let all = group
        .all_gather_bytes(&encode_metrics(m))
        .context("summing metrics over ranks")?;
    let mut total: BTreeMap<String, f64> = BTreeMap::new();
    for (r, b) in all.iter().enumerate() {
        let part = decode_metrics(b).with_context(|| format!("decoding the metrics of rank {r}"))?;
        for (k, v) in part {
            *total.entry(k).or_insert(0.0) += v;
        }
    }
    *m = total;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_and_balanced_splits_cover_every_sample_once() {
        let lengths = [5, 9, 2, 7, 7, 3, 8, 1];
        for dp in 1..=4 {
            for balance in [false, true] {
                let parts = dp_split(&lengths, dp, balance);
                assert_eq!(parts.len(), dp);
                let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
                all.sort();
                assert_eq!(all, (0..lengths.len()).collect::<Vec<_>>(), "dp {dp} balance {balance}");
            }
        }
        assert_eq!(dp_split(&lengths, 3, false)[1], vec![1, 4, 7]);
    }

    /// Metrics cross with their bits, NaN and Inf included, and a cut buffer is an error.
    #[test]
    fn metrics_encoding_keeps_every_value_bit_for_bit() {
        let m: BTreeMap<String, f64> = [
            ("train/loss".to_string(), f64::NAN),
            ("train/grad_norm".to_string(), f64::INFINITY),
            ("perf/tokens".to_string(), 1234.5),
            ("x/ünïcode".to_string(), -0.0),
        ]
        .into();
        let b = encode_metrics(&m);
        let back = decode_metrics(&b).unwrap();
        assert_eq!(back.len(), m.len());
        for (k, v) in &m {
            assert_eq!(back[k].to_bits(), v.to_bits(), "{k}");
        }
        let e = decode_metrics(&b[..b.len() - 3]).unwrap_err();
        assert!(format!("{e:#}").contains("metric 3 has no value"), "{e:#}");
    }

    /// A NaN (or Inf) score crosses the exchange with its bits, as at DP = 1, so that the step's
    /// NaN/Inf guard sees it; JSON would turn it into `null` and fail to decode.
    #[test]
    fn scores_keep_nan_and_inf_bits_across_data_parallel_ranks() {
        use vime_dist::launch::free_port;
        use vime_dist::{Backend, DistEnv, ParallelDims, Timeouts, World, WorldOptions};
        let lengths = [3, 1, 2, 4, 0];
        let score = |i: usize| -> Vec<f32> {
            (0..lengths[i])
                .map(|t| match (i, t) {
                    (1, 0) => f32::NAN,
                    (3, 2) => f32::INFINITY,
                    (3, 3) => -0.0,
                    _ => 0.1 * (i * 10 + t) as f32,
                })
                .collect()
        };
        let expected: Vec<Vec<u32>> = (0..lengths.len())
            .map(|i| score(i).iter().map(|x| x.to_bits()).collect())
            .collect();
        let port = free_port().unwrap();
        let opts = || WorldOptions {
            timeouts: Timeouts {
                rendezvous: Duration::from_secs(20),
                op: Duration::from_secs(20),
                heartbeat: Duration::from_secs(10),
                heartbeat_interval: Duration::from_millis(200),
            },
            on_failure: Some(std::sync::Arc::new(|f| eprintln!("test world: {f} died"))),
        };
        let dims = ParallelDims::new(2, 1, 1, None).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    s.spawn(move || -> Result<Vec<Vec<f32>>> {
                        let w = World::new(&DistEnv::local(r, 2, port), dims, Backend::Cpu, opts())?;
                        let got = score_split(&**w.dp(), &lengths, false, |idx| {
                            Ok(idx.iter().map(|&i| score(i)).collect())
                        })?;
                        w.finish()?;
                        Ok(got)
                    })
                })
                .collect();
            for (r, h) in handles.into_iter().enumerate() {
                let got = h.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e:#}"));
                let bits: Vec<Vec<u32>> = got.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect();
                assert_eq!(bits, expected, "rank {r}");
            }
        });
    }

    /// Rank 0's samples reach every data-parallel rank with every float's bits: a NaN (whatever
    /// its payload), +-Inf or -0.0 engine log-prob or reward, which JSON cannot carry (a NaN
    /// log-prob must reach the step's NaN/Inf guard as at DP = 1). And when rank 0 has no
    /// rollout, the other ranks stop with its error.
    #[test]
    fn samples_keep_nan_and_inf_bits_across_data_parallel_ranks() {
        use vime_dist::launch::free_port;
        use vime_dist::{Backend, DistEnv, ParallelDims, Timeouts, World, WorldOptions};
        let samples = || -> Vec<Sample> {
            let sample = |prompt_index: usize, lp: Option<Vec<f32>>, raw_reward: f64, finish| Sample {
                prompt_index,
                tokens: vec![7, 8, 9, u32::MAX],
                response_length: 2,
                rollout_log_probs: lp,
                response: format!("answer \"{prompt_index}\"\n"),
                label: prompt_index.is_multiple_of(2).then(|| "42".to_string()),
                raw_reward,
                finish,
            };
            vec![
                sample(
                    0,
                    Some(vec![f32::NAN, f32::from_bits(0x7fc0_1234), -0.25, -1e-30]),
                    f64::NAN,
                    FinishReason::Stop,
                ),
                sample(
                    1,
                    Some(vec![
                        f32::INFINITY,
                        f32::NEG_INFINITY,
                        -0.0,
                        f32::from_bits(0xffc0_0001),
                    ]),
                    f64::from_bits(0x7ff8_0000_0000_1234),
                    FinishReason::Length,
                ),
                sample(
                    2,
                    Some(vec![-0.1, f32::MIN_POSITIVE / 2.0]),
                    f64::NEG_INFINITY,
                    FinishReason::Abort,
                ),
                sample(3, None, -0.0, FinishReason::Stop),
                sample(4, Some(vec![]), 0.1, FinishReason::Stop),
            ]
        };
        type Bits = (
            usize,
            Vec<u32>,
            usize,
            Option<Vec<u32>>,
            String,
            Option<String>,
            u64,
            FinishReason,
        );
        let bits = |s: &[Sample]| -> Vec<Bits> {
            s.iter()
                .map(|s| {
                    (
                        s.prompt_index,
                        s.tokens.clone(),
                        s.response_length,
                        s.rollout_log_probs
                            .as_ref()
                            .map(|v| v.iter().map(|x| x.to_bits()).collect()),
                        s.response.clone(),
                        s.label.clone(),
                        s.raw_reward.to_bits(),
                        s.finish,
                    )
                })
                .collect()
        };
        let expected = bits(&samples());
        let port = free_port().unwrap();
        let opts = || WorldOptions {
            timeouts: Timeouts {
                rendezvous: Duration::from_secs(20),
                op: Duration::from_secs(20),
                heartbeat: Duration::from_secs(10),
                heartbeat_interval: Duration::from_millis(200),
            },
            on_failure: Some(std::sync::Arc::new(|f| eprintln!("test world: {f} died"))),
        };
        let dims = ParallelDims::new(2, 1, 1, None).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    s.spawn(move || -> Result<[Result<Vec<Sample>>; 2]> {
                        let w = World::new(&DistEnv::local(r, 2, port), dims, Backend::Cpu, opts())?;
                        let got = broadcast_samples(&**w.dp(), (r == 0).then(|| Ok(samples())));
                        let failed = broadcast_samples(
                            &**w.dp(),
                            (r == 0).then(|| Err(anyhow::anyhow!("the engine went away").context("rollout 3"))),
                        );
                        w.finish()?;
                        Ok([got, failed])
                    })
                })
                .collect();
            for (r, h) in handles.into_iter().enumerate() {
                let [got, failed] = h.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e:#}"));
                let got = got.unwrap_or_else(|e| panic!("rank {r}: {e:#}"));
                assert_eq!(bits(&got), expected, "rank {r}");
                let e = format!("{:#}", failed.err().unwrap_or_else(|| panic!("rank {r}: no error")));
                assert!(e.contains("rollout 3: the engine went away"), "rank {r}: {e}");
                if r > 0 {
                    assert!(e.contains("rank 0 failed to produce the rollout"), "rank {r}: {e}");
                }
            }
        });
    }

    #[test]
    fn truncated_scores_name_the_sample() {
        let mut b = encode_scores(&[vec![1.0, 2.0], vec![3.0; 4]]);
        b.truncate(b.len() - 2);
        let e = format!("{:#}", decode_scores(&b).unwrap_err());
        assert!(e.contains("sample 1 has 4 values"), "{e}");
    }
}
