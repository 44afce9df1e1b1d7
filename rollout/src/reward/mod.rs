//! Reward functions, selected by `--rm-type` as in slime's `rm_hub`:
//!
//! | `--rm-type` | reward |
//! |---|---|
//! | `deepscaler` | 1 if the last `\boxed{}` after `</think>` matches the label, else 0 (no `</think>`: 0) |
//! | `math` | 1 if the last `\boxed{}` anywhere matches the label, else 0 |
//! | `dapo` | `{score: ±1, acc, pred}` from the last `Answer:` line (Minerva normalisation) |
//! | `f1` | token F1 between response and label (SQuAD normalisation) |
//! | `exact_match` | 1 if the trimmed response is exactly the label, else 0 (vime's own, for synthetic tasks) |
//! | `remote_rm` | the JSON an HTTP reward model returns for `{prompt, response, label}` (`--rm-url`) |
//! | `boxed_<type>` | `<type>` applied to the last `\boxed{}` content instead of the whole response |
//!
//! A sample may carry its own `rm_type` (slime's `metadata["rm_type"]`), which wins.
//! "Matches the label" is [`deepscaler::grade_answer`]: slime's string and "sympy" graders, or
//! the math-verify equivalence of [`math`]. Dict rewards (`dapo`, most remote models) are
//! reduced to a number with `--reward-key` ([`Reward::value`]).

pub mod boxed;
pub mod dapo;
pub mod deepscaler;
pub mod exact;
pub mod f1;
pub mod math;
pub mod remote;

use std::fmt;
use std::str::FromStr;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

pub use remote::{RemoteRm, RemoteRmOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmKind {
    Deepscaler,
    Math,
    Dapo,
    F1,
    /// vime's own (slime has none): see [`exact`].
    ExactMatch,
    RemoteRm,
}

/// A parsed `--rm-type`: the reward kind, applied to the boxed answer when `boxed` is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmType {
    pub kind: RmKind,
    pub boxed: bool,
}

impl FromStr for RmType {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<RmType> {
        let s = s.trim();
        let (boxed, name) = match s.strip_prefix("boxed_") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let kind = match name {
            "deepscaler" => RmKind::Deepscaler,
            "math" => RmKind::Math,
            "dapo" => RmKind::Dapo,
            "f1" => RmKind::F1,
            "exact_match" => RmKind::ExactMatch,
            "remote_rm" => RmKind::RemoteRm,
            "" => bail!("--rm-type is not set (one of: deepscaler, math, dapo, f1, exact_match, remote_rm, boxed_<type>)"),
            other => bail!(
                "--rm-type {other:?} is not implemented (supported: deepscaler, math, dapo, f1, exact_match, remote_rm, boxed_<type>)"
            ),
        };
        Ok(RmType { kind, boxed })
    }
}

impl fmt::Display for RmType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.kind {
            RmKind::Deepscaler => "deepscaler",
            RmKind::Math => "math",
            RmKind::Dapo => "dapo",
            RmKind::F1 => "f1",
            RmKind::ExactMatch => "exact_match",
            RmKind::RemoteRm => "remote_rm",
        };
        if self.boxed {
            write!(f, "boxed_{name}")
        } else {
            f.write_str(name)
        }
    }
}

/// What a reward function sees of a sample.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardSample {
    /// The prompt as the dataset had it (a string or chat messages); only `remote_rm` uses it.
    pub prompt: serde_json::Value,
    /// The generated text (without the prompt).
    pub response: String,
    pub label: Option<String>,
    /// Per-sample `--rm-type` override (slime's `metadata["rm_type"]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rm_type: Option<String>,
}

/// A reward: a number, or named fields (`dapo`'s `{score, acc, pred}`, a remote model's dict).
#[derive(Clone, Debug, PartialEq)]
pub enum Reward {
    Scalar(f64),
    Fields(serde_json::Map<String, serde_json::Value>),
}

impl Reward {
    /// The number used for training: the scalar, or the `reward_key` field (`--reward-key`).
    pub fn value(&self, reward_key: Option<&str>) -> Result<f64> {
        match (self, reward_key) {
            (Reward::Scalar(x), _) => Ok(*x),
            (Reward::Fields(map), Some(key)) => {
                let v = map.get(key).ok_or_else(|| {
                    anyhow!(
                        "reward has no field {key:?} (fields: {})",
                        map.keys().cloned().collect::<Vec<_>>().join(", ")
                    )
                })?;
                json_number(v).ok_or_else(|| anyhow!("reward field {key:?} is not a number: {v}"))
            }
            (Reward::Fields(map), None) => Err(anyhow!(
                "the reward is a dict (fields: {}); set --reward-key to pick one",
                map.keys().cloned().collect::<Vec<_>>().join(", ")
            )),
        }
    }

    /// A remote model's reply: a number (or bool), or an object.
    pub fn from_json(v: serde_json::Value) -> Result<Reward> {
        match v {
            serde_json::Value::Object(map) => Ok(Reward::Fields(map)),
            v => json_number(&v)
                .map(Reward::Scalar)
                .ok_or_else(|| anyhow!("reward is neither a number nor an object: {v}")),
        }
    }
}

fn json_number(v: &serde_json::Value) -> Option<f64> {
    match v {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        _ => None,
    }
}

/// A rule-based reward (everything but `remote_rm`), synchronous.
pub fn rule_reward(rm: RmType, response: &str, label: Option<&str>) -> Result<Reward> {
    let boxed_answer;
    let response = if rm.boxed {
        boxed_answer = boxed::last_boxed_answer(response).unwrap_or_default();
        boxed_answer.as_str()
    } else {
        response
    };
    Ok(match rm.kind {
        RmKind::Deepscaler => Reward::Scalar(deepscaler::deepscaler_reward(response, label.unwrap_or(""))),
        RmKind::Math => Reward::Scalar(deepscaler::math_reward(response, label.unwrap_or(""))),
        RmKind::Dapo => {
            let label = label.context("dapo reward: the sample has no label")?;
            let (score, acc, pred) = dapo::dapo_score(response, label)?;
            let mut map = serde_json::Map::new();
            map.insert("score".into(), score.into());
            map.insert("acc".into(), acc.into());
            map.insert("pred".into(), pred.into());
            Reward::Fields(map)
        }
        RmKind::F1 => {
            let label = label.context("f1 reward: the sample has no label")?;
            Reward::Scalar(f1::f1_score(response, label).0)
        }
        RmKind::ExactMatch => {
            let label = label.context("exact_match reward: the sample has no label")?;
            Reward::Scalar(exact::exact_match(response, label))
        }
        RmKind::RemoteRm => bail!("remote_rm is not a rule-based reward; use RewardModel::score"),
    })
}

/// `--rm-type` (+ `--rm-url`) made ready to score samples. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RewardModel {
    rm_type: Option<RmType>,
    remote: Option<RemoteRm>,
}

impl RewardModel {
    /// `rm_type` may be empty when every sample carries its own `rm_type`.
    pub fn new(rm_type: &str, rm_url: Option<&str>) -> Result<RewardModel> {
        RewardModel::with_remote_options(rm_type, rm_url, RemoteRmOptions::default())
    }

    pub fn with_remote_options(rm_type: &str, rm_url: Option<&str>, opts: RemoteRmOptions) -> Result<RewardModel> {
        let rm = if rm_type.trim().is_empty() {
            None
        } else {
            Some(rm_type.parse::<RmType>()?)
        };
        if rm.is_some_and(|r| r.kind == RmKind::RemoteRm) && rm_url.is_none() {
            bail!("--rm-type remote_rm needs --rm-url");
        }
        let remote = rm_url.map(|u| RemoteRm::new(u, opts)).transpose()?;
        Ok(RewardModel { rm_type: rm, remote })
    }

    pub fn rm_type(&self) -> Option<RmType> {
        self.rm_type
    }

    /// Score one sample.
    pub async fn score(&self, sample: &RewardSample) -> Result<Reward> {
        let rm = match &sample.rm_type {
            Some(t) if !t.trim().is_empty() => t.parse::<RmType>()?,
            _ => self
                .rm_type
                .ok_or_else(|| anyhow!("--rm-type is not set and the sample has no rm_type"))?,
        };
        if rm.kind == RmKind::RemoteRm {
            let remote = self
                .remote
                .as_ref()
                .ok_or_else(|| anyhow!("remote_rm needs --rm-url"))?;
            let payload = remote::RemotePayload {
                prompt: &sample.prompt,
                response: &sample.response,
                label: sample.label.as_deref(),
            };
            return Reward::from_json(remote.score(&payload).await?)
                .with_context(|| format!("remote_rm at {}", remote.url()));
        }
        rule_reward(rm, &sample.response, sample.label.as_deref())
    }

    /// Score samples concurrently; results in input order. The first error fails the batch.
    pub async fn score_batch(&self, samples: &[RewardSample]) -> Result<Vec<Reward>> {
        let mut set = tokio::task::JoinSet::new();
        for (i, s) in samples.iter().enumerate() {
            let (rm, s) = (self.clone(), s.clone());
            set.spawn(async move { (i, rm.score(&s).await) });
        }
        let mut out: Vec<Option<Reward>> = vec![None; samples.len()];
        while let Some(joined) = set.join_next().await {
            let (i, r) = joined.context("reward task panicked")?;
            out[i] = Some(r.with_context(|| format!("scoring sample {i}"))?);
        }
        Ok(out.into_iter().map(|r| r.expect("every task reported")).collect())
    }
}
