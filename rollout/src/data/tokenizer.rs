//! A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` crate, plus what
//! `tokenizer_config.json` adds (chat template, named special tokens).
//!
//! Decisions:
//! - `encode` never adds special tokens: HF's `tokenizer(text, add_special_tokens=False)`, which
//!   is how slime tokenizes a prompt whose chat template already wrote every special token. (Qwen3
//!   has `add_bos_token: false` and no post-processor tokens either way.)
//! - Where the chat template comes from follows transformers 5: `chat_template.jinja` (and
//!   `additional_chat_templates/*.jinja`) beside the tokenizer win over the `chat_template` entry
//!   of `tokenizer_config.json`, which may be a string or a list of `{name, template}`. With tools,
//!   a template named `tool_use` is used when there is one, else `default`.
use super::chat_template::{ChatOptions, ChatTemplate, TemplateValue};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::Path;

/// HF's named special-token attributes, the ones passed to chat templates.
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Tokenizer and chat templates of one checkpoint.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    templates: BTreeMap<String, ChatTemplate>,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("templates", &self.templates.keys().collect::<Vec<_>>())
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`, and `dir/tokenizer_config.json` / `dir/chat_template.jinja` /
    /// `dir/additional_chat_templates/*.jinja` when present (an HF checkpoint folder).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = dir.join("tokenizer_config.json");
        let mut tok = Self::from_files(dir.join("tokenizer.json"), config.exists().then_some(config.as_path()))?;
        let mut files: BTreeMap<String, String> = BTreeMap::new();
        let main = dir.join("chat_template.jinja");
        if main.exists() {
            files.insert("default".into(), read(&main)?);
        }
        let extra = dir.join("additional_chat_templates");
        if extra.is_dir() {
            for entry in std::fs::read_dir(&extra).with_context(|| format!("reading {}", extra.display()))? {
                let path = entry?.path();
                if path.extension().is_some_and(|e| e == "jinja") {
                    let name = path.file_stem().unwrap_or_default().to_string_lossy().into_owned();
                    files.insert(name, read(&path)?);
                }
            }
        }
        if !files.is_empty() {
            tok.templates.clear();
            for (name, source) in files {
                tok.set_chat_template(&name, &source)
                    .with_context(|| format!("chat template `{name}` in {}", dir.display()))?;
            }
        }
        Ok(tok)
    }

    /// Loads a `tokenizer.json`, and optionally the `tokenizer_config.json` with the chat template.
    pub fn from_files(tokenizer_json: impl AsRef<Path>, tokenizer_config: Option<&Path>) -> Result<Self> {
        let path = tokenizer_json.as_ref();
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| anyhow!("loading tokenizer {}: {e}", path.display()))?;
        let mut tok = Tokenizer {
            inner,
            templates: BTreeMap::new(),
            special_tokens: Vec::new(),
        };
        if let Some(config_path) = tokenizer_config {
            let config: Json = serde_json::from_str(&read(config_path)?)
                .with_context(|| format!("parsing {}", config_path.display()))?;
            tok.apply_config(&config)
                .with_context(|| format!("in {}", config_path.display()))?;
        }
        Ok(tok)
    }

    fn apply_config(&mut self, config: &Json) -> Result<()> {
        for name in SPECIAL_TOKEN_NAMES {
            let token = match config.get(name) {
                Some(Json::String(s)) => Some(s.clone()),
                Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(str::to_string),
                _ => None,
            };
            if let Some(token) = token {
                self.special_tokens.push((name.to_string(), token));
            }
        }
        match config.get("chat_template") {
            None | Some(Json::Null) => {}
            Some(Json::String(source)) => self.set_chat_template("default", source)?,
            Some(Json::Array(named)) => {
                for entry in named {
                    let (Some(name), Some(source)) = (
                        entry.get("name").and_then(Json::as_str),
                        entry.get("template").and_then(Json::as_str),
                    ) else {
                        bail!("chat_template list entries must be {{\"name\": str, \"template\": str}}");
                    };
                    self.set_chat_template(name, source)?;
                }
            }
            Some(other) => bail!("chat_template must be a string or a list, got {other}"),
        }
        Ok(())
    }

    /// Sets (or replaces) the chat template called `name` (`default`, `tool_use`, ...).
    pub fn set_chat_template(&mut self, name: &str, source: &str) -> Result<()> {
        let template = ChatTemplate::new(source)?.with_special_tokens(self.special_tokens.clone());
        self.templates.insert(name.to_string(), template);
        Ok(())
    }

    /// The template HF would pick: `tool_use` when tools are given and it exists, else `default`.
    pub fn chat_template(&self, with_tools: bool) -> Result<&ChatTemplate> {
        if with_tools {
            if let Some(t) = self.templates.get("tool_use") {
                return Ok(t);
            }
        }
        match self.templates.get("default") {
            Some(t) => Ok(t),
            None if self.templates.is_empty() => {
                bail!("the tokenizer has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja)")
            }
            None => bail!(
                "the tokenizer has several chat templates and none named `default`: {:?}",
                self.templates.keys().collect::<Vec<_>>()
            ),
        }
    }

    /// HF's `apply_chat_template(messages, tokenize=False, ...)`.
    pub fn apply_chat_template(&self, messages: &TemplateValue, opts: &ChatOptions) -> Result<String> {
        self.chat_template(opts.tools.is_some())?.render(messages, opts)
    }

    /// Token ids of `text`, no special tokens added: HF's `tokenizer(text, add_special_tokens=False)`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// [`encode`](Self::encode) over many texts, in parallel.
    pub fn encode_batch(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        let encs = self
            .inner
            .encode_batch_fast(texts.to_vec(), false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(encs.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// Text of `ids`; `skip_special_tokens` drops the added tokens marked special (`<|im_end|>`, ...).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("decoding: {e}"))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Ids the tokenizer knows, added tokens included (151,669 for Qwen3; the model pads its
    /// embedding further).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A named special token from `tokenizer_config.json` (`"eos_token"` -> `<|im_end|>`).
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// The id of `eos_token` (`<|im_end|>` = 151645 for post-trained Qwen3).
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special_token("eos_token").and_then(|t| self.token_to_id(t))
    }

    /// The id of `pad_token` (`<|endoftext|>` = 151643 for Qwen3).
    pub fn pad_token_id(&self) -> Option<u32> {
        self.special_token("pad_token").and_then(|t| self.token_to_id(t))
    }

    /// The `tokenizers` tokenizer underneath.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}
