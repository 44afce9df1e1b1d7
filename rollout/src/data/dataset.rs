//! Prompt datasets: slime's `Dataset` + `RolloutDataSource` over a JSONL file, with an
//! epoch-aware cursor that a checkpoint saves and restores exactly.
//!
//! Behaviour copied from slime (`slime/utils/data.py`, `slime/rollout/data_source.py`):
//! - A row's `--input-key` is a string or a list of `{role, content}` messages. With
//!   `--apply-chat-template` a string becomes `[{"role": "user", "content": s}]` and the template
//!   is applied with `add_generation_prompt=True`, the row's tools and
//!   `--apply-chat-template-kwargs`.
//! - `--metadata-key` is any JSON (missing or falsy becomes `{}`); a row's `--tool-key` (a list, or
//!   a JSON string of one) is passed to the template and stored as `metadata["tools"]`.
//! - `--rollout-max-prompt-len` drops prompts whose token count (after the template, no special
//!   tokens added) exceeds it, and reports how many.
//! - `path@[start:end]` reads only that slice of the non-blank rows, negative bounds allowed.
//! - Epoch `e` visits the prompts in the order of `random.seed(seed + e); random.shuffle(...)`
//!   (CPython's generator, [`super::shuffle`]) with `--rollout-shuffle`, in file order without.
//!   A batch that runs past the end takes the rest of this epoch and the start of the next, and
//!   `(epoch, offset)` advance exactly as slime's `epoch_id` / `sample_offset`.
//!
//! Where vime is stricter than slime: a line that is not valid JSON (slime prints and skips it), a
//! row that is not an object, a missing input or label key, a value of the wrong type, and a list
//! of messages without `--apply-chat-template` (slime fails later, when the engine needs text) are
//! all errors naming `file:line` and the key. A `null` tools value counts as no tools.
use super::chat_template::{to_template_value, value_kind_name, ChatMessage, ChatOptions, TemplateValue};
use super::shuffle::epoch_permutation;
use super::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use minijinja::value::ValueKind;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

/// The prompt-data flags, with slime's names and defaults. Both a `clap::Args` (flatten it into a
/// binary's flags) and a serde struct (a config file sets the same names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct DataArgs {
    /// The JSONL prompt file (`path@[start:end]` reads a slice of its rows).
    #[arg(long)]
    pub prompt_data: Option<PathBuf>,
    /// The row key holding the prompt: a string, or a list of `{role, content}` messages.
    #[arg(long, default_value = "input")]
    pub input_key: String,
    /// The row key holding the label the reward function compares against.
    #[arg(long)]
    pub label_key: Option<String>,
    /// The row key holding free-form metadata (any JSON).
    #[arg(long, default_value = "metadata")]
    pub metadata_key: String,
    /// The row key holding tool schemas for the chat template (a list, or a JSON string of one).
    #[arg(long, default_value = "tools")]
    pub tool_key: String,
    /// Render each prompt with the tokenizer's chat template (`add_generation_prompt=True`).
    #[arg(long)]
    pub apply_chat_template: bool,
    /// Extra chat-template variables as a JSON object, e.g. `{"enable_thinking": false}`.
    #[arg(long, default_value = "{}", value_parser = parse_json_object)]
    pub apply_chat_template_kwargs: serde_json::Map<String, Json>,
    /// Shuffle the prompts, with a new order every epoch.
    #[arg(long)]
    pub rollout_shuffle: bool,
    /// The shuffle seed: epoch `e` uses `seed + e`.
    #[arg(long, default_value_t = 42)]
    pub rollout_seed: u64,
    /// Drop prompts longer than this many tokens when loading.
    #[arg(long)]
    pub rollout_max_prompt_len: Option<usize>,
}

impl Default for DataArgs {
    fn default() -> Self {
        DataArgs {
            prompt_data: None,
            input_key: "input".into(),
            label_key: None,
            metadata_key: "metadata".into(),
            tool_key: "tools".into(),
            apply_chat_template: false,
            apply_chat_template_kwargs: serde_json::Map::new(),
            rollout_shuffle: false,
            rollout_seed: 42,
            rollout_max_prompt_len: None,
        }
    }
}

/// `--apply-chat-template-kwargs` parser: a JSON object.
pub fn parse_json_object(s: &str) -> Result<serde_json::Map<String, Json>, String> {
    match serde_json::from_str::<Json>(s) {
        Ok(Json::Object(map)) => Ok(map),
        Ok(other) => Err(format!("expected a JSON object, got {other}")),
        Err(e) => Err(format!("invalid JSON: {e}")),
    }
}

/// Where the prompt stream stands: `offset` prompts of epoch `epoch` were handed out, in the
/// order drawn from `seed`. The same fields as the trainer's checkpoint `DataCursor`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    pub epoch: u64,
    pub offset: u64,
    pub seed: u64,
}

/// One prompt, ready for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSample {
    /// Position in the dataset's file order (after the slice and the length filter).
    pub index: usize,
    /// 1-based line of the row in the file.
    pub line: usize,
    /// The text sent to the engine (the chat template applied, when asked).
    pub prompt: String,
    /// `prompt` tokenized without added special tokens.
    pub prompt_ids: Vec<u32>,
    /// The row's `--label-key` value; `None` when no label key is set.
    pub label: Option<Json>,
    /// The row's `--metadata-key` value (`{}` when missing or falsy), plus `tools` when the row has some.
    pub metadata: Json,
}

impl PromptSample {
    /// The label as text: a string as it is, any other JSON value as compact JSON.
    pub fn label_text(&self) -> Option<String> {
        self.label.as_ref().map(|l| match l {
            Json::String(s) => s.clone(),
            other => other.to_string(),
        })
    }
}

/// A prompt file in memory, and the cursor over its epochs.
#[derive(Debug, Clone)]
pub struct PromptDataset {
    path: PathBuf,
    samples: Vec<PromptSample>,
    order: Vec<usize>,
    shuffle: bool,
    cursor: DataCursor,
    num_filtered_long: usize,
}

impl PromptDataset {
    /// Loads `--prompt-data`.
    pub fn from_args(args: &DataArgs, tokenizer: &Tokenizer) -> Result<Self> {
        let path = args.prompt_data.as_deref().context("--prompt-data is not set")?;
        Self::load(path, args, tokenizer)
    }

    /// Reads, templates, tokenizes and filters every row of a JSONL file (see the module doc).
    pub fn load(path: impl AsRef<Path>, args: &DataArgs, tokenizer: &Tokenizer) -> Result<Self> {
        let (path, slice) = split_row_slice(path.as_ref())?;
        let file = path.display().to_string();
        if path.extension().is_some_and(|e| e == "parquet") {
            bail!("{file}: parquet prompt data is not supported; convert it to JSONL");
        }
        let bytes = std::fs::read(&path).with_context(|| format!("reading prompt data {file}"))?;

        // Non-blank lines, numbered from 1, then slime's optional row slice.
        let mut lines: Vec<(usize, &[u8])> = Vec::new();
        for (i, raw) in bytes.split(|b| *b == b'\n').enumerate() {
            if !raw.iter().all(u8::is_ascii_whitespace) {
                lines.push((i + 1, raw));
            }
        }
        if let Some((start, end)) = slice {
            let (s, e) = py_slice_bounds(start, end, lines.len());
            lines = lines[s..e].to_vec();
        }

        let mut rows: Vec<(usize, Row)> = Vec::with_capacity(lines.len());
        for (line, raw) in lines {
            let at = || format!("{file}:{line}");
            let text = std::str::from_utf8(raw).map_err(|e| anyhow::anyhow!("{}: not UTF-8: {e}", at()))?;
            let row = parse_row(text, args, tokenizer).with_context(at)?;
            rows.push((line, row));
        }
        if rows.is_empty() {
            bail!("{file}: no prompts (the file or its slice has no rows)");
        }

        let texts: Vec<&str> = rows.iter().map(|(_, r)| r.prompt.as_str()).collect();
        let ids = tokenizer
            .encode_batch(&texts)
            .with_context(|| format!("tokenizing prompts of {file}"))?;
        let total = rows.len();
        let mut samples = Vec::with_capacity(total);
        for ((line, row), prompt_ids) in rows.into_iter().zip(ids) {
            if args.rollout_max_prompt_len.is_some_and(|max| prompt_ids.len() > max) {
                continue;
            }
            let index = samples.len();
            samples.push(PromptSample {
                index,
                line,
                prompt: row.prompt,
                prompt_ids,
                label: row.label,
                metadata: row.metadata,
            });
        }
        let num_filtered_long = total - samples.len();
        if let Some(max) = args.rollout_max_prompt_len {
            eprintln!(
                "vime-rollout: {file}: filtered {num_filtered_long} of {total} prompts longer than \
                 --rollout-max-prompt-len={max} tokens"
            );
        }
        if samples.is_empty() {
            bail!("{file}: every prompt is longer than --rollout-max-prompt-len");
        }

        let mut ds = PromptDataset {
            path,
            order: Vec::new(),
            samples,
            shuffle: args.rollout_shuffle,
            cursor: DataCursor {
                epoch: 0,
                offset: 0,
                seed: args.rollout_seed,
            },
            num_filtered_long,
        };
        ds.reorder();
        Ok(ds)
    }

    /// The file the prompts came from (without any `@[start:end]` slice).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The prompts in file order.
    pub fn samples(&self) -> &[PromptSample] {
        &self.samples
    }

    /// How many rows `--rollout-max-prompt-len` dropped.
    pub fn num_filtered_long(&self) -> usize {
        self.num_filtered_long
    }

    /// The current epoch's order, as indices into [`samples`](Self::samples).
    pub fn epoch_order(&self) -> &[usize] {
        &self.order
    }

    /// Where the stream stands; save it with a checkpoint.
    pub fn cursor(&self) -> DataCursor {
        self.cursor
    }

    /// Continues from a saved cursor: the next prompt handed out is the one that would have
    /// followed when the cursor was saved.
    pub fn set_cursor(&mut self, cursor: DataCursor) -> Result<()> {
        if self.shuffle && cursor.seed != self.cursor.seed {
            bail!(
                "the saved data cursor was drawn with --rollout-seed {} but this run has {}; pass \
                 --rollout-seed {} to resume the same prompt order",
                cursor.seed,
                self.cursor.seed,
                cursor.seed
            );
        }
        if cursor.offset > self.len() as u64 {
            bail!(
                "the saved data cursor is at offset {} of epoch {}, past the {} prompts of {}; the prompt data changed",
                cursor.offset,
                cursor.epoch,
                self.len(),
                self.path.display()
            );
        }
        self.cursor = DataCursor {
            seed: self.cursor.seed,
            ..cursor
        };
        self.reorder();
        Ok(())
    }

    /// The indices of the next `n` prompts, crossing into new (reshuffled) epochs as needed.
    pub fn next_indices(&mut self, n: usize) -> Vec<usize> {
        let len = self.len() as u64;
        let mut out = Vec::with_capacity(n);
        let mut need = n as u64;
        while need > 0 {
            let offset = self.cursor.offset;
            if offset + need <= len {
                out.extend_from_slice(&self.order[offset as usize..(offset + need) as usize]);
                self.cursor.offset += need;
                need = 0;
            } else {
                out.extend_from_slice(&self.order[offset as usize..]);
                need -= len - offset;
                self.cursor.epoch += 1;
                self.cursor.offset = 0;
                self.reorder();
            }
        }
        out
    }

    /// The next `n` prompts (see [`next_indices`](Self::next_indices)).
    pub fn next_batch(&mut self, n: usize) -> Vec<&PromptSample> {
        let indices = self.next_indices(n);
        indices.into_iter().map(|i| &self.samples[i]).collect()
    }

    fn reorder(&mut self) {
        self.order = if self.shuffle {
            epoch_permutation(self.samples.len(), self.cursor.seed, self.cursor.epoch)
        } else {
            (0..self.samples.len()).collect()
        };
    }
}

struct Row {
    prompt: String,
    label: Option<Json>,
    metadata: Json,
}

fn parse_row(text: &str, args: &DataArgs, tokenizer: &Tokenizer) -> Result<Row> {
    let row: TemplateValue = serde_json::from_str(text).map_err(|e| {
        let msg = e.to_string();
        let msg = msg.rsplit_once(" at line ").map_or(msg.as_str(), |(m, _)| m);
        anyhow::anyhow!("invalid JSON at column {}: {msg}", e.column())
    })?;
    if row.kind() != ValueKind::Map {
        bail!("a row must be a JSON object, got {}", value_kind_name(&row));
    }
    let field = |key: &str| -> Result<Option<TemplateValue>> {
        let v = row.get_item(&TemplateValue::from(key))?;
        Ok((!v.is_undefined()).then_some(v))
    };

    let input_key = &args.input_key;
    let input = field(input_key)?.with_context(|| format!("missing key `{input_key}` (--input-key)"))?;
    let messages = match input.kind() {
        ValueKind::String => None,
        ValueKind::Seq => {
            check_messages(&input).with_context(|| format!("key `{input_key}` (--input-key)"))?;
            Some(input.clone())
        }
        _ => bail!(
            "key `{input_key}` (--input-key) must be a string or a list of {{role, content}} messages, got {}",
            value_kind_name(&input)
        ),
    };

    let label = match &args.label_key {
        None => None,
        Some(key) => {
            let v = field(key)?.with_context(|| format!("missing key `{key}` (--label-key)"))?;
            Some(to_json(&v)?)
        }
    };

    let mut metadata = match field(&args.metadata_key)? {
        Some(v) if !py_falsy(&v) => to_json(&v)?,
        _ => Json::Object(Default::default()),
    };

    let tool_key = &args.tool_key;
    let tools = match field(tool_key)? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => {
            let tools = match v.as_str() {
                Some(s) if v.kind() == ValueKind::String => serde_json::from_str::<TemplateValue>(s)
                    .with_context(|| format!("key `{tool_key}` (--tool-key) is a string but not JSON"))?,
                _ => v,
            };
            if tools.kind() != ValueKind::Seq {
                bail!(
                    "key `{tool_key}` (--tool-key) must be a list of tool schemas, got {}",
                    value_kind_name(&tools)
                );
            }
            let Json::Object(meta) = &mut metadata else {
                bail!(
                    "key `{}` (--metadata-key) must be an object to hold the row's tools, got {}",
                    args.metadata_key,
                    metadata
                );
            };
            meta.insert("tools".into(), to_json(&tools)?);
            Some(tools)
        }
    };

    let prompt = if args.apply_chat_template {
        let messages = match messages {
            Some(m) => m,
            None => to_template_value(&[ChatMessage::new("user", input.as_str().unwrap_or_default())]),
        };
        let opts = ChatOptions {
            tools,
            ..ChatOptions::generation()
        }
        .json_kwargs(&args.apply_chat_template_kwargs);
        tokenizer.apply_chat_template(&messages, &opts)?
    } else {
        match input.as_str() {
            Some(s) if messages.is_none() => s.to_string(),
            _ => bail!(
                "key `{input_key}` (--input-key) is a list of messages; pass --apply-chat-template to turn it into text"
            ),
        }
    };
    Ok(Row {
        prompt,
        label,
        metadata,
    })
}

/// A conversation: a non-empty list of objects with a string `role` and a string, list or null `content`.
fn check_messages(messages: &TemplateValue) -> Result<()> {
    if messages.len() == Some(0) {
        bail!("the message list is empty");
    }
    for (i, m) in messages.try_iter()?.enumerate() {
        if m.kind() != ValueKind::Map {
            bail!(
                "message {i} must be an object with `role` and `content`, got {}",
                value_kind_name(&m)
            );
        }
        let role = m.get_attr("role")?;
        if role.kind() != ValueKind::String {
            bail!("message {i}: `role` must be a string, got {}", value_kind_name(&role));
        }
        let content = m.get_attr("content")?;
        if !matches!(
            content.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::None | ValueKind::Undefined
        ) {
            bail!(
                "message {i}: `content` must be a string, a list or null, got {}",
                value_kind_name(&content)
            );
        }
    }
    Ok(())
}

/// Python's truthiness of a JSON value (`data.get(metadata_key) or {}`).
fn py_falsy(v: &TemplateValue) -> bool {
    match v.kind() {
        ValueKind::None | ValueKind::Undefined => true,
        ValueKind::Bool | ValueKind::Number => !v.is_true(),
        ValueKind::String | ValueKind::Seq | ValueKind::Map => v.len() == Some(0),
        _ => false,
    }
}

fn to_json(v: &TemplateValue) -> Result<Json> {
    serde_json::to_value(v).context("converting a row value to JSON")
}

/// A `@[start:end]` row slice; either bound optional, negative counting from the end.
type RowSlice = (Option<i64>, Option<i64>);

/// Splits slime's `path@[start:end]`.
fn split_row_slice(path: &Path) -> Result<(PathBuf, Option<RowSlice>)> {
    let Some(s) = path.to_str() else {
        return Ok((path.to_path_buf(), None));
    };
    let Some(body) = s.strip_suffix(']') else {
        return Ok((path.to_path_buf(), None));
    };
    let Some(at) = body.rfind("@[") else {
        return Ok((path.to_path_buf(), None));
    };
    let Some((start, end)) = body[at + 2..].split_once(':') else {
        return Ok((path.to_path_buf(), None));
    };
    let bound = |b: &str| -> Result<Option<i64>> {
        if b.is_empty() {
            Ok(None)
        } else {
            b.parse()
                .map(Some)
                .with_context(|| format!("{s}: bad row slice bound `{b}`"))
        }
    };
    Ok((PathBuf::from(&body[..at]), Some((bound(start)?, bound(end)?))))
}

/// Python's `slice(start, end).indices(len)` for step 1, as a clamped `start..end`.
fn py_slice_bounds(start: Option<i64>, end: Option<i64>, len: usize) -> (usize, usize) {
    let len = len as i64;
    let norm = |b: i64| if b < 0 { (b + len).max(0) } else { b.min(len) };
    let s = start.map(norm).unwrap_or(0);
    let e = end.map(norm).unwrap_or(len);
    (s as usize, e.max(s) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_slices_follow_python() {
        assert_eq!(py_slice_bounds(Some(2), Some(5), 10), (2, 5));
        assert_eq!(py_slice_bounds(Some(-3), None, 10), (7, 10));
        assert_eq!(py_slice_bounds(None, Some(-8), 10), (0, 2));
        assert_eq!(py_slice_bounds(Some(8), Some(3), 10), (8, 8));
        assert_eq!(py_slice_bounds(Some(-20), Some(20), 10), (0, 10));
        let (p, s) = split_row_slice(Path::new("/d/x.jsonl@[-100:]")).unwrap();
        assert_eq!((p, s), (PathBuf::from("/d/x.jsonl"), Some((Some(-100), None))));
        assert_eq!(split_row_slice(Path::new("/d/x.jsonl")).unwrap().1, None);
    }
}
