//! `vime-train logprobs`: score token sequences with an HF Qwen3 checkpoint.
//!
//! Input: JSONL, one object per line with `"tokens": [ids]` (at least 2) and optionally
//! `"prompt_len": P` (1 <= P < len). Output: the same objects (every input key kept) plus
//! `"logprobs"` (len - 1 values: log p(token[i+1] | tokens[..=i]), f32) and `"entropy"` (the
//! entropy of the same len - 1 next-token distributions); with `prompt_len`, also
//! `"response_logprobs"` (the last len - P of them: the response tokens' log-probs, as an RL
//! trainer uses them).
//!
//! Lines are packed into varlen batches of at most `max_tokens_per_batch` tokens. The whole input is
//! validated before the model runs, and the output is written to a temporary file renamed into place
//! at the end, so a failure never leaves a truncated output under the final name.
use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::Qwen3;

pub struct ScoreRequest {
    pub obj: Map<String, Value>,
    pub tokens: Vec<u32>,
    pub prompt_len: Option<usize>,
}

/// Parses and validates the input JSONL; errors name `file:line`.
pub fn read_requests(path: &Path, vocab_size: usize) -> Result<Vec<ScoreRequest>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let at = format!("{}:{}", path.display(), i + 1);
        let line = line.with_context(|| format!("reading {at}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line).with_context(|| format!("{at}: not valid JSON"))?;
        let Value::Object(obj) = v else {
            bail!("{at}: expected a JSON object")
        };
        let tokens = match obj.get("tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(j, t)| match t.as_u64() {
                    Some(id) if (id as usize) < vocab_size => Ok(id as u32),
                    Some(id) => bail!("{at}: tokens[{j}] = {id} is outside the vocabulary ({vocab_size} ids)"),
                    None => bail!("{at}: tokens[{j}] = {t} is not a non-negative integer"),
                })
                .collect::<Result<Vec<u32>>>()?,
            Some(other) => bail!("{at}: \"tokens\" must be an array of ids, got {other}"),
            None => bail!("{at}: missing key \"tokens\""),
        };
        if tokens.len() < 2 {
            bail!("{at}: \"tokens\" needs at least 2 ids to score, got {}", tokens.len());
        }
        let prompt_len = match obj.get("prompt_len") {
            None | Some(Value::Null) => None,
            Some(p) => match p.as_u64() {
                Some(p) if p >= 1 && (p as usize) < tokens.len() => Some(p as usize),
                _ => bail!(
                    "{at}: \"prompt_len\" must be an integer in 1..{} (got {p})",
                    tokens.len()
                ),
            },
        };
        out.push(ScoreRequest {
            obj,
            tokens,
            prompt_len,
        });
    }
    Ok(out)
}

/// Scores every request and writes the output JSONL atomically.
pub fn score_file(model: &Qwen3, input: &Path, output: &Path, max_tokens_per_batch: usize) -> Result<usize> {
    let reqs = read_requests(input, model.config().vocab_size)?;
    let max_pos = model.config().max_position_embeddings;
    if let Some((i, r)) = reqs.iter().enumerate().find(|(_, r)| r.tokens.len() > max_pos) {
        bail!(
            "request {} has {} tokens, over max_position_embeddings {max_pos}",
            i + 1,
            r.tokens.len()
        );
    }
    let tmp = output.with_extension("jsonl.tmp");
    let written = write_scores(model, &reqs, &tmp, max_tokens_per_batch).and_then(|()| {
        std::fs::rename(&tmp, output).with_context(|| format!("renaming {} to {}", tmp.display(), output.display()))
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(reqs.len())
}

fn write_scores(model: &Qwen3, reqs: &[ScoreRequest], tmp: &Path, max_tokens_per_batch: usize) -> Result<()> {
    let mut w = BufWriter::new(std::fs::File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let mut start = 0;
    while start < reqs.len() {
        let mut end = start + 1;
        let mut n = reqs[start].tokens.len();
        while end < reqs.len() && n + reqs[end].tokens.len() <= max_tokens_per_batch {
            n += reqs[end].tokens.len();
            end += 1;
        }
        let seqs: Vec<&[u32]> = reqs[start..end].iter().map(|r| r.tokens.as_slice()).collect();
        let batch = PackedBatch::from_sequences(&seqs)?;
        let out = model.logprobs_entropy(&batch)?;
        let lp: Vec<f32> = out.logprobs.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        let ent: Vec<f32> = out.entropy.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        for (s, r) in reqs[start..end].iter().enumerate() {
            let range = batch.seq_range(s);
            // positions 0..len-1 of the sequence predict tokens 1..len
            let body = range.start..range.end - 1;
            let mut obj = r.obj.clone();
            obj.insert("logprobs".into(), serde_json::to_value(&lp[body.clone()])?);
            obj.insert("entropy".into(), serde_json::to_value(&ent[body.clone()])?);
            if let Some(p) = r.prompt_len {
                obj.insert(
                    "response_logprobs".into(),
                    serde_json::to_value(&lp[body.start + p - 1..body.end])?,
                );
            }
            serde_json::to_writer(&mut w, &Value::Object(obj))?;
            w.write_all(b"\n")?;
        }
        start = end;
    }
    let f = w.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    Ok(())
}
