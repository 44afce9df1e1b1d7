//! Integer arithmetic as a verifiable RL task: the prompt `"12+35="`, the label `"47"`, scored by
//! `--rm-type exact_match`. Small enough that a random-init model of a few hundred thousand
//! parameters learns it on a CPU.
//!
//! Decisions:
//! - An operand of `d` digits: `d` is uniform in `min_digits..=max_digits`, then the value is
//!   uniform over the `d`-digit numbers (`0..=9` for one digit, `10..=99` for two, ...). Drawing
//!   the digit count first keeps short operands as frequent as long ones.
//! - Subtraction keeps the operand order, so answers may be negative (`"3-7="` -> `"-4"`).
//!   Multiplication's answer has up to `2 * max_digits` digits. `max_digits` is at most 9, so
//!   every answer fits an `i64`.
//! - Rows are `{"input": prompt, "label": answer}` (`--input-key input --label-key label`), with
//!   unique prompts. [`write_task`] draws the eval prompts first (from `seed`), then the train
//!   prompts (from `seed + 1`) excluding every eval prompt: the two files are disjoint, and the
//!   eval set does not change when only `n_train` does.
//! - Randomness is `vime_kernels::testing::Rng` (SplitMix64): the same files on every machine.
//! - The tokenizer ([`super::char_tokenizer`]) has `<eos>` (id 0) and `<pad>` (id 1), then the
//!   characters of [`ArithTask::vocab_chars`]. A separate pad keeps "mask the padding" from ever
//!   masking the EOS the model must learn to emit.
use anyhow::{bail, Context, Result};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use vime_kernels::testing::Rng;

use super::char_tokenizer::write_char_tokenizer;
use super::{write_atomic, SyntheticTask};
use crate::data::Tokenizer;

/// The end-of-sequence token of the task tokenizer (id 0): the model ends its answer with it.
pub const EOS_TOKEN: &str = "<eos>";
/// The padding token of the task tokenizer (id 1).
pub const PAD_TOKEN: &str = "<pad>";
/// The operators [`ArithTask`] knows, in the order their characters enter the vocabulary.
pub const OPS: [char; 3] = ['+', '-', '*'];
/// The largest `max_digits`: a 9-digit product has 18 digits and still fits an `i64`.
pub const MAX_DIGITS: u32 = 9;

/// `a <op> b =` with operands of `min_digits..=max_digits` digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArithTask {
    pub min_digits: u32,
    pub max_digits: u32,
    /// A subset of [`OPS`]; each prompt picks one uniformly.
    pub ops: Vec<char>,
}

impl Default for ArithTask {
    /// Addition of 1- and 2-digit numbers: 10,000 distinct prompts, answers of at most 3 digits,
    /// a 14-token vocabulary.
    fn default() -> Self {
        ArithTask {
            min_digits: 1,
            max_digits: 2,
            ops: vec!['+'],
        }
    }
}

impl ArithTask {
    /// Checks the digit range and the operators.
    pub fn validate(&self) -> Result<()> {
        if self.min_digits == 0 || self.min_digits > self.max_digits || self.max_digits > MAX_DIGITS {
            bail!(
                "arith task: digits {}..={} must satisfy 1 <= min_digits <= max_digits <= {MAX_DIGITS}",
                self.min_digits,
                self.max_digits
            );
        }
        if self.ops.is_empty() {
            bail!("arith task: no operators (choose from {OPS:?})");
        }
        let mut seen = HashSet::new();
        for op in &self.ops {
            if !OPS.contains(op) {
                bail!("arith task: operator {op:?} is not supported (choose from {OPS:?})");
            }
            if !seen.insert(op) {
                bail!("arith task: operator {op:?} is listed twice");
            }
        }
        Ok(())
    }

    /// One `(prompt, answer)`, e.g. `("12+35=", "47")`. Panics on a task that fails
    /// [`validate`](Self::validate).
    pub fn sample(&self, rng: &mut Rng) -> (String, String) {
        let a = self.operand(rng);
        let op = self.ops[below(rng, self.ops.len() as u64) as usize];
        let b = self.operand(rng);
        let answer = match op {
            '+' => a + b,
            '-' => a - b,
            '*' => a * b,
            other => panic!("arith task: unsupported operator {other:?}"),
        };
        (format!("{a}{op}{b}="), answer.to_string())
    }

    fn operand(&self, rng: &mut Rng) -> i64 {
        let digits = self.min_digits + below(rng, (self.max_digits - self.min_digits + 1) as u64) as u32;
        let (lo, hi) = digit_range(digits);
        lo + below(rng, (hi - lo + 1) as u64) as i64
    }

    /// How many distinct prompts the task has.
    pub fn num_prompts(&self) -> u128 {
        let lo = digit_range(self.min_digits).0 as u128;
        let hi = digit_range(self.max_digits).1 as u128;
        let operands = hi - lo + 1;
        self.ops.len() as u128 * operands * operands
    }

    /// The characters of every prompt and answer: the digits, the operators (in [`OPS`] order;
    /// `'-'` also writes negative answers), and `'='`.
    pub fn vocab_chars(&self) -> String {
        let ops = OPS.iter().filter(|op| self.ops.contains(op));
        "0123456789".chars().chain(ops.copied()).chain(['=']).collect()
    }

    /// The longest prompt, in characters (= tokens): two operands, the operator and `'='`.
    pub fn max_prompt_len(&self) -> usize {
        2 * self.max_digits as usize + 2
    }

    /// The longest answer, in characters (= tokens), without the EOS token.
    pub fn max_answer_len(&self) -> usize {
        let d = self.max_digits as usize;
        let mut len = 0;
        for op in &self.ops {
            len = len.max(match op {
                '*' => 2 * d,
                _ => d + 1, // a carry, or a minus sign
            });
        }
        len
    }

    /// Writes `n` rows `{"input": prompt, "label": answer}` with distinct prompts, none of them in
    /// `exclude`, drawn from `seed`; returns the prompts in file order (see [`write_dataset`]).
    pub fn write_dataset(&self, path: &Path, n: usize, seed: u64, exclude: &HashSet<String>) -> Result<Vec<String>> {
        write_dataset(self, path, n, seed, exclude)
    }
}

/// Writes `n` rows `{"input": prompt, "label": answer}` with distinct prompts, none of them in
/// `exclude`, drawn from `seed`; returns the prompts in file order. Atomic (temp + rename).
pub fn write_dataset(
    task: &dyn SyntheticTask,
    path: &Path,
    n: usize,
    seed: u64,
    exclude: &HashSet<String>,
) -> Result<Vec<String>> {
    task.validate()?;
    let total = task.num_prompts();
    if n as u128 > total {
        bail!(
            "task {task:?} has only {total} distinct prompts; {n} were asked for {}",
            path.display()
        );
    }
    let mut rng = Rng::new(seed);
    let mut seen: HashSet<String> = HashSet::with_capacity(n);
    let mut prompts = Vec::with_capacity(n);
    let mut out = String::new();
    let max_draws = 50 * n as u64 + 10_000;
    let mut draws = 0u64;
    while prompts.len() < n {
        if draws == max_draws {
            bail!(
                "task {task:?}: only {} distinct prompts outside the {} excluded ones after {draws} draws \
                 ({n} wanted, {total} exist); ask for fewer or widen the digits/ops",
                prompts.len(),
                exclude.len()
            );
        }
        draws += 1;
        let (prompt, answer) = task.sample(&mut rng);
        if exclude.contains(&prompt) || !seen.insert(prompt.clone()) {
            continue;
        }
        out.push_str(&serde_json::json!({"input": prompt, "label": answer}).to_string());
        out.push('\n');
        prompts.push(prompt);
    }
    write_atomic(path, out.as_bytes())?;
    Ok(prompts)
}

/// What [`write_task`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskFiles {
    /// `tokenizer.json` + `tokenizer_config.json`.
    pub tokenizer_dir: PathBuf,
    pub train: PathBuf,
    pub eval: PathBuf,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    /// Every id the tokenizer knows: the model's `vocab_size` may not be smaller.
    pub vocab_size: usize,
}

/// Writes `dir/tokenizer/`, `dir/train.jsonl` (`n_train` rows) and `dir/eval.jsonl` (`n_eval`
/// rows, disjoint from train). The ids returned are read back from the written tokenizer.
pub fn write_task(dir: &Path, task: &dyn SyntheticTask, n_train: usize, n_eval: usize, seed: u64) -> Result<TaskFiles> {
    task.validate()?;
    let tokenizer_dir = dir.join("tokenizer");
    write_char_tokenizer(&tokenizer_dir, &task.vocab_chars(), &[EOS_TOKEN, PAD_TOKEN])?;
    let tokenizer = Tokenizer::from_dir(&tokenizer_dir)?;
    let eos_token_id = tokenizer
        .eos_token_id()
        .context("the task tokenizer has no eos token")?;
    let pad_token_id = tokenizer
        .pad_token_id()
        .context("the task tokenizer has no pad token")?;

    let (train, eval) = (dir.join("train.jsonl"), dir.join("eval.jsonl"));
    let eval_prompts: HashSet<String> = write_dataset(task, &eval, n_eval, seed, &HashSet::new())?
        .into_iter()
        .collect();
    write_dataset(task, &train, n_train, seed.wrapping_add(1), &eval_prompts)?;
    Ok(TaskFiles {
        tokenizer_dir,
        train,
        eval,
        eos_token_id,
        pad_token_id,
        vocab_size: tokenizer.vocab_size(),
    })
}

/// The `digits`-digit numbers: `0..=9` for one digit, `10^(d-1)..=10^d - 1` beyond.
fn digit_range(digits: u32) -> (i64, i64) {
    let hi = 10i64.pow(digits) - 1;
    let lo = if digits == 1 { 0 } else { 10i64.pow(digits - 1) };
    (lo, hi)
}

/// Uniform in `0..n` (the modulo bias is below 2^-30 for every `n` used here).
pub(crate) fn below(rng: &mut Rng, n: u64) -> u64 {
    rng.next_u64() % n
}

impl SyntheticTask for ArithTask {
    fn validate(&self) -> Result<()> {
        ArithTask::validate(self)
    }
    fn sample(&self, rng: &mut Rng) -> (String, String) {
        ArithTask::sample(self, rng)
    }
    fn num_prompts(&self) -> u128 {
        ArithTask::num_prompts(self)
    }
    fn vocab_chars(&self) -> String {
        ArithTask::vocab_chars(self)
    }
}
