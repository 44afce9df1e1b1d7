//! slime and Megatron flags that are not `vime-train` options of their own. Each is either
//! accepted because vime always does what it asks (one notice line at start), accepted and
//! unused (a notice says why), a Megatron `--no-X` that turns off vime's switch `--X` (the later
//! of the two wins, as with argparse's `store_false` on one dest), a Megatron model-shape flag
//! (checked against the checkpoint's config.json), or refused with what to do instead. None is
//! silently ignored.
//!
//! [`split`] takes them out of the command line before clap parses the rest. The README's flag
//! table is generated from [`COMPAT`] and clap's own definitions (`flag_table`), and a test
//! checks that the README holds exactly that table.
use anyhow::{bail, Result};
use std::ffi::OsString;

/// How many values a flag takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    Switch,
    One,
}

/// The config.json entry a Megatron shape flag describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShapeKey {
    Layers,
    Hidden,
    Ffn,
    Heads,
    QueryGroups,
    KvChannels,
    RotaryBase,
    Vocab,
    NormEps,
    MaxPositions,
    /// A switch or a fixed choice (checked by `resolve::check_shape` as present or absent).
    Switch(&'static str),
}

/// Which values a flag may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accept {
    Any,
    /// A number equal to 0 (dropouts).
    Zero,
    /// One of these (case-insensitive).
    OneOf(&'static [&'static str]),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// vime always does this: accepted (when its value is), with a notice.
    Always,
    /// Has no meaning in vime: accepted, with a notice that says why.
    Unused,
    /// A Megatron model-shape flag: checked against config.json.
    Shape(ShapeKey),
    /// Megatron's `--no-X` of vime's switch `--X` (named here): turns it off, so that the later of
    /// the two on the command line wins.
    Negates(&'static str),
    /// Refused: the message says what to do instead.
    Refused,
}

#[derive(Debug, Clone, Copy)]
pub struct CompatFlag {
    pub flag: &'static str,
    pub arity: Arity,
    pub kind: Kind,
    pub accept: Accept,
    /// What vime does (the notice, or the refusal's advice).
    pub says: &'static str,
}

const fn f(flag: &'static str, arity: Arity, kind: Kind, accept: Accept, says: &'static str) -> CompatFlag {
    CompatFlag {
        flag,
        arity,
        kind,
        accept,
        says,
    }
}

use Accept::{Any, OneOf, Zero};
use Arity::{One, Switch};
use Kind::{Always, Negates, Refused, Shape, Unused};

const WANDB: &str = "vime does not log to Weights & Biases; metrics go to metrics.jsonl and TensorBoard in --log-dir";
const NO_SGLANG: &str = "vime drives vLLM engines or its own engine, not SGLang: use --rollout-backend vllm \
                         (engine flags: --vllm-gpu-memory-utilization, --vllm-max-num-seqs, ...)";

/// Every slime / Megatron flag vime takes that is not a clap option of `TrainArgs`.
#[rustfmt::skip]
pub const COMPAT: &[CompatFlag] = &[
    // ---- vime always does it ------------------------------------------------------------------
    f("--accumulate-allreduce-grads-in-fp32", Switch, Always, Any, "gradients are always accumulated and reduced in f32"),
    f("--attention-softmax-in-fp32", Switch, Always, Any, "attention's softmax always runs in f32 (every kernel)"),
    f("--attention-dropout", One, Always, Zero, "vime trains without dropout (Qwen3's recipe); only 0 is accepted"),
    f("--hidden-dropout", One, Always, Zero, "vime trains without dropout (Qwen3's recipe); only 0 is accepted"),
    f("--use-tensorboard", Switch, Always, Any, "TensorBoard event files are always written to <--log-dir>/tensorboard"),
    f("--bf16", Switch, Always, Any, "the model computes in bf16 on CUDA by default (--dtype auto), with f32 master weights and moments"),
    f("--use-flash-attn", Switch, Always, Any, "attention always runs a fused kernel (cuDNN or vime's flash kernel, --attention-backend)"),
    f("--no-masked-softmax-fusion", Switch, Always, Any, "attention is one fused kernel; there is no separate masked softmax"),
    f("--no-gradient-accumulation-fusion", Switch, Always, Any, "weight gradients come out of their GEMM in f32 either way"),
    f("--offload-rollout", Switch, Always, Any, "with --colocate the engines sleep while vime trains (vLLM sleep mode)"),

    f("--vllm-weight-sync-mode", One, Always, Any, "vime picks each engine's weight-sync protocol from its /version (--update-weight-protocol auto)"),
    f("--pipeline-model-parallel-size", One, Always, OneOf(&["1"]), "vime has no pipeline parallelism (use --tp and --cp); only 1 is accepted"),
    f("--expert-model-parallel-size", One, Always, OneOf(&["1"]), "dense Qwen3 has no experts; only 1 is accepted"),
    f("--expert-tensor-parallel-size", One, Always, OneOf(&["1"]), "dense Qwen3 has no experts; only 1 is accepted"),
    f("--make-vocab-size-divisible-by", One, Always, Any, "the vocabulary is the checkpoint's vocab_size, never padded"),
    f("--rotary-percent", One, Always, OneOf(&["1", "1.0"]), "Qwen3 rotates every dimension of each head; only 1.0 is accepted"),
    f("--seq-length", One, Always, Any, "sequence lengths come from the rollouts (--rollout-max-response-len, --max-tokens-per-gpu)"),
    f("--save-hf", One, Always, Any, "every checkpoint holds the HF folder iter_N/hf (config.json, safetensors, tokenizer)"),
    f("--vllm-weight-sync-packed", Switch, Always, Any, "weights always stream in packed buckets of --update-weight-buffer-size"),
    // ---- turns off a vime switch ---------------------------------------------------------------
    f("--no-check-for-nan-in-loss-and-grad", Switch, Negates("--check-for-nan-in-loss-and-grad"), Any, "a NaN/Inf loss, gradient or reward no longer stops the run; the step is still skipped and counted (train/skipped_steps), as vime never applies a non-finite update"),
    // ---- accepted, unused ---------------------------------------------------------------------
    f("--offload-train", Switch, Unused, Any, "vime does not offload its weights or optimizer state to the host between steps; with --colocate the engines sleep while it trains"),
    f("--num-gpus-per-node", One, Unused, Any, "vime reads the GPU count from the driver"),
    f("--no-save-optim", Switch, Unused, Any, "vime always saves the optimizer state, so that a resume continues exactly"),
    f("--log-probs-max-tokens-per-gpu", One, Unused, Any, "log-prob passes pack by --max-tokens-per-gpu (and run long sequences in query chunks)"),
    f("--tb-project-name", One, Unused, Any, "TensorBoard event files go to <--log-dir>/tensorboard"),
    f("--train-backend", One, Unused, Any, "vime is the training backend (it replaces Megatron)"),
    f("--megatron-config-path", One, Unused, Any, "vime is the training backend; the Megatron config file is not read (pass its settings as flags)"),
    f("--use-wandb", Switch, Unused, Any, WANDB),
    f("--wandb-project", One, Unused, Any, WANDB),
    f("--wandb-group", One, Unused, Any, WANDB),
    f("--wandb-key", One, Unused, Any, WANDB),
    f("--wandb-host", One, Unused, Any, WANDB),
    f("--wandb-team", One, Unused, Any, WANDB),
    f("--train-memory-margin-bytes", One, Unused, Any, "vime does not reserve a margin: colocated engines sleep while it trains"),
    f("--transformer-impl", One, Unused, Any, "vime's Qwen3 block is its own (models/qwen3), neither Megatron's local nor Transformer Engine's"),
    // ---- Megatron's model shape (slime's scripts/models/qwen3-*.sh) -----------------------------
    f("--num-layers", One, Shape(ShapeKey::Layers), Any, "checked against config.json num_hidden_layers"),
    f("--hidden-size", One, Shape(ShapeKey::Hidden), Any, "checked against config.json hidden_size"),
    f("--ffn-hidden-size", One, Shape(ShapeKey::Ffn), Any, "checked against config.json intermediate_size"),
    f("--num-attention-heads", One, Shape(ShapeKey::Heads), Any, "checked against config.json num_attention_heads"),
    f("--num-query-groups", One, Shape(ShapeKey::QueryGroups), Any, "checked against config.json num_key_value_heads"),
    f("--kv-channels", One, Shape(ShapeKey::KvChannels), Any, "checked against config.json head_dim"),
    f("--rotary-base", One, Shape(ShapeKey::RotaryBase), Any, "checked against config.json rope_theta"),
    f("--vocab-size", One, Shape(ShapeKey::Vocab), Any, "checked against config.json vocab_size"),
    f("--norm-epsilon", One, Shape(ShapeKey::NormEps), Any, "checked against config.json rms_norm_eps"),
    f("--max-position-embeddings", One, Shape(ShapeKey::MaxPositions), Any, "checked against config.json max_position_embeddings"),
    f("--group-query-attention", Switch, Shape(ShapeKey::Switch("--group-query-attention")), Any, "required when config.json has fewer key/value heads than query heads"),
    f("--qk-layernorm", Switch, Shape(ShapeKey::Switch("--qk-layernorm")), Any, "required (Qwen3 normalises q and k per head)"),
    f("--swiglu", Switch, Shape(ShapeKey::Switch("--swiglu")), Any, "required (Qwen3's MLP)"),
    f("--untie-embeddings-and-output-weights", Switch, Shape(ShapeKey::Switch("--untie-embeddings-and-output-weights")), Any, "must match config.json tie_word_embeddings (given: untied)"),
    f("--add-qkv-bias", Switch, Shape(ShapeKey::Switch("--add-qkv-bias")), Any, "must match config.json attention_bias"),
    f("--disable-bias-linear", Switch, Shape(ShapeKey::Switch("--disable-bias-linear")), Any, "accepted (Qwen3 has no MLP or output biases)"),
    f("--use-rotary-position-embeddings", Switch, Shape(ShapeKey::Switch("--use-rotary-position-embeddings")), Any, "accepted (Qwen3 uses RoPE)"),
    f("--position-embedding-type", One, Shape(ShapeKey::Switch("--position-embedding-type")), OneOf(&["rope"]), "only rope (Qwen3)"),
    f("--normalization", One, Shape(ShapeKey::Switch("--normalization")), OneOf(&["RMSNorm"]), "only RMSNorm (Qwen3)"),
    // ---- refused ------------------------------------------------------------------------------
    f("--sglang-mem-fraction-static", One, Refused, Any, NO_SGLANG),
    f("--sglang-config", One, Refused, Any, NO_SGLANG),
    f("--sglang-server-concurrency", One, Refused, Any, NO_SGLANG),
    f("--use-rollout-logprobs", Switch, Refused, Any, "vime recomputes the old log-probs with the policy (slime's default); the engine's are compared in rollout/log_probs_abs_diff"),
    f("--custom-rm-path", One, Refused, Any, "vime runs no Python plug-ins: use --rm-type, or --rm-url for a remote reward model"),
    f("--custom-tis-function-path", One, Refused, Any, "vime runs no Python plug-ins: use --use-tis with --tis-clip"),
    f("--dynamic-sampling-filter-path", One, Refused, Any, "dynamic sampling is not implemented; every group trains"),
    f("--over-sampling-batch-size", One, Refused, Any, "dynamic sampling is not implemented; every group trains"),
    f("--partial-rollout", Switch, Refused, Any, "partial rollouts are not implemented; every sample finishes in its rollout"),
    f("--rollout-max-context-len", One, Refused, Any, "not implemented: bound responses with --rollout-max-response-len and prompts with --rollout-max-prompt-len"),
    f("--num-epoch", One, Refused, Any, "pass --num-rollout (epochs x prompts / --rollout-batch-size)"),
    f("--lr-warmup-fraction", One, Refused, Any, "pass --lr-warmup-iters (optimizer steps)"),
    f("--optimizer-cpu-offload", Switch, Refused, Any, "the optimizer state stays on the GPU; shard it over data-parallel ranks (ZeRO-1, always on) to fit"),
    f("--overlap-cpu-optimizer-d2h-h2d", Switch, Refused, Any, "the optimizer state stays on the GPU (no CPU offload)"),
    f("--use-precision-aware-optimizer", Switch, Refused, Any, "the optimizer keeps f32 master weights and moments (no reduced-precision state)"),
    f("--recompute-modules", One, Refused, Any, "vime's recompute is per layer (--recompute-granularity full); --recompute-keep-attention keeps attention instead of recomputing it"),
    f("--fp8", One, Refused, Any, "Megatron spells it --fp8-format: pass --fp8-format hybrid (E4M3 weights and activations, E5M2 gradients; --fp8-recipe tensorwise)"),
    f("--fp16", Switch, Refused, Any, "vime trains in bf16 (or f32 on the CPU); pass --dtype f16 for f16 compute"),
];

/// The Megatron shape flags of a command line (the last value of each wins).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShapeFlags {
    /// (flag, key, value) of flags with a value.
    pub values: Vec<(String, ShapeKey, String)>,
    /// Switches and fixed-choice flags given.
    pub switches: Vec<String>,
}

/// What [`split`] took out of a command line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompatSeen {
    /// One line per accepted flag, for the start of the run.
    pub notices: Vec<String>,
    pub shape: ShapeFlags,
}

fn lookup(flag: &str) -> Option<&'static CompatFlag> {
    COMPAT.iter().find(|c| c.flag == flag)
}

fn accepts(c: &CompatFlag, value: &str) -> bool {
    match c.accept {
        Any => true,
        Zero => value.parse::<f64>().is_ok_and(|v| v == 0.0),
        OneOf(ok) => ok.iter().any(|o| o.eq_ignore_ascii_case(value)),
    }
}

/// Takes the [`COMPAT`] flags out of `argv` (program name first), returning the rest for clap
/// and what was seen; a refused flag, a value a flag does not accept, or a missing value is an
/// error naming the flag.
pub fn split(argv: Vec<OsString>) -> Result<(Vec<OsString>, CompatSeen)> {
    let mut rest = Vec::with_capacity(argv.len());
    let mut seen = CompatSeen::default();
    let mut it = argv.into_iter().peekable();
    // A value of the previous option (e.g. `--eval-prompt-data NAME PATH`) is never a flag here:
    // only tokens that are exactly a known flag (or `--flag=value`) are taken.
    while let Some(tok) = it.next() {
        let Some(s) = tok.to_str().map(str::to_string) else {
            rest.push(tok);
            continue;
        };
        let (name, inline) = match s.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (s.clone(), None),
        };
        let Some(c) = lookup(&name) else {
            rest.push(tok);
            continue;
        };
        let value = match (c.arity, inline) {
            (Switch, None) => None,
            (Switch, Some(v)) => bail!("{name} is a switch and takes no value (got {name}={v})"),
            (One, Some(v)) => Some(v),
            (One, None) => match it.next().and_then(|v| v.into_string().ok()) {
                Some(v) => Some(v),
                None => bail!("{name} needs a value"),
            },
        };
        let shown = match &value {
            Some(v) => format!("{name} {v}"),
            None => name.clone(),
        };
        if c.kind == Refused {
            bail!("{shown}: not supported: {}", c.says);
        }
        if let Some(v) = &value {
            if !accepts(c, v) {
                bail!("{shown}: {}", c.says);
            }
        }
        match c.kind {
            Always => seen.notices.push(format!("{shown}: accepted, {}", c.says)),
            Unused => seen.notices.push(format!("{shown}: not used, {}", c.says)),
            Negates(on) => {
                rest.retain(|t| t.to_str() != Some(on));
                seen.notices.push(format!("{shown}: turns off {on}: {}", c.says));
            }
            Shape(ShapeKey::Switch(_)) => {
                if !seen.shape.switches.contains(&name) {
                    seen.shape.switches.push(name.clone());
                }
            }
            Shape(key) => {
                let v = value.expect("shape flags with a key take a value");
                seen.shape.values.retain(|(f, _, _)| f != &name);
                seen.shape.values.push((name.clone(), key, v));
            }
            Refused => unreachable!("refused above"),
        }
    }
    // One notice per flag, even when a flag is repeated (an override appended at the end).
    let mut uniq: Vec<String> = Vec::new();
    for n in seen.notices.drain(..) {
        let flag = n.split(' ').next().unwrap_or("").trim_end_matches(':').to_string();
        uniq.retain(|u| u.split(' ').next().unwrap_or("").trim_end_matches(':') != flag);
        uniq.push(n);
    }
    seen.notices = uniq;
    Ok((rest, seen))
}

/// The README's flag table: every option of `cmd` (clap's help, "implemented") and every
/// [`COMPAT`] flag, sorted by name.
pub fn flag_table(cmd: &clap::Command) -> String {
    let mut rows: Vec<(String, String, String)> = Vec::new();
    for a in cmd.get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if a.is_hide_set() || long == "help" || long == "version" {
            continue;
        }
        let mut names = format!("`--{long}`");
        for alias in a.get_visible_aliases().unwrap_or_default() {
            names.push_str(&format!(" (`--{alias}`)"));
        }
        let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
        let help = help.trim().trim_end_matches('.').replace('|', "\\|").replace('\n', " ");
        let help = if help.is_empty() {
            "as slime's / Megatron's flag of that name".to_string()
        } else {
            help
        };
        rows.push((long.to_string(), names, format!("implemented: {help}")));
    }
    for c in COMPAT {
        let what = match c.kind {
            Always => "always".to_string(),
            Unused => "accepted, unused".to_string(),
            Negates(on) => format!("implemented: turns off {on} (the later of the two wins)"),
            Shape(_) => "model shape".to_string(),
            Refused => "refused".to_string(),
        };
        let names = match c.arity {
            Switch => format!("`{}`", c.flag),
            One => format!("`{} V`", c.flag),
        };
        rows.push((
            c.flag.trim_start_matches('-').to_string(),
            names,
            format!("{what}: {}", c.says),
        ));
    }
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = String::from("| flag | what vime does |\n|---|---|\n");
    for (_, names, what) in rows {
        out.push_str(&format!("| {names} | {what} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn compat_flags_are_taken_out_and_the_rest_is_kept_in_order() {
        let (rest, seen) = split(os(&[
            "vime-train",
            "--lr",
            "1e-6",
            "--attention-dropout",
            "0.0",
            "--num-layers",
            "36",
            "--qk-layernorm",
            "--eval-prompt-data",
            "aime",
            "/p.jsonl",
            "--num-layers=2",
            "--use-wandb",
            "--normalization",
            "RMSNorm",
        ]))
        .unwrap();
        assert_eq!(
            rest,
            os(&["vime-train", "--lr", "1e-6", "--eval-prompt-data", "aime", "/p.jsonl"])
        );
        assert_eq!(
            seen.shape.values,
            vec![("--num-layers".to_string(), ShapeKey::Layers, "2".to_string())]
        );
        assert_eq!(seen.shape.switches, vec!["--qk-layernorm", "--normalization"]);
        assert_eq!(seen.notices.len(), 2, "{:?}", seen.notices);
        assert!(
            seen.notices[0].starts_with("--attention-dropout 0.0: accepted"),
            "{:?}",
            seen.notices
        );
        assert!(seen.notices[1].contains("Weights & Biases"), "{:?}", seen.notices);
    }

    #[test]
    fn refused_flags_and_values_name_the_flag_and_what_to_do() {
        for (argv, says) in [
            (
                &["--attention-dropout", "0.1"][..],
                "--attention-dropout 0.1: vime trains without dropout",
            ),
            (&["--pipeline-model-parallel-size", "2"][..], "use --tp and --cp"),
            (&["--sglang-mem-fraction-static", "0.7"][..], "--rollout-backend vllm"),
            (&["--normalization", "LayerNorm"][..], "only RMSNorm"),
            (&["--num-layers"][..], "--num-layers needs a value"),
            (&["--qk-layernorm=1"][..], "--qk-layernorm is a switch"),
        ] {
            let mut v = vec!["vime-train"];
            v.extend_from_slice(argv);
            let e = format!("{:#}", split(os(&v)).unwrap_err());
            assert!(e.contains(says), "{argv:?}: {e}");
        }
    }

    /// `--no-check-for-nan-in-loss-and-grad` turns off an earlier `--check-for-nan-in-loss-and-grad`
    /// (a slime script's default followed by a user's override) and is turned off by a later one.
    #[test]
    fn a_negating_flag_turns_off_an_earlier_switch_and_the_later_one_wins() {
        use crate::train::args::TrainArgs;
        let base = ["--hf-checkpoint", "/m", "--prompt-data", "/p.jsonl"];
        let parse = |tail: &[&str]| {
            let mut v: Vec<&str> = base.to_vec();
            v.extend_from_slice(tail);
            TrainArgs::from_flags(v).unwrap()
        };
        let on = "--check-for-nan-in-loss-and-grad";
        let off = "--no-check-for-nan-in-loss-and-grad";
        assert!(parse(&[on]).check_for_nan_in_loss_and_grad);
        assert!(!parse(&[on, off]).check_for_nan_in_loss_and_grad);
        assert!(parse(&[off, on]).check_for_nan_in_loss_and_grad);
        assert!(!parse(&[on, "--lr", "1e-6", off, on, off]).check_for_nan_in_loss_and_grad);
        let a = parse(&[on, off]);
        assert!(
            a.compat
                .notices
                .iter()
                .any(|n| n.starts_with(&format!("{off}: turns off {on}"))),
            "{:?}",
            a.compat.notices
        );
    }

    /// Every flag a compat flag negates is one of vime's own switches.
    #[test]
    fn every_negated_flag_is_a_clap_switch() {
        use clap::CommandFactory;
        let cmd = crate::train::args::TrainCli::command();
        for c in COMPAT {
            if let Negates(on) = c.kind {
                let long = on.trim_start_matches('-');
                let a = cmd.get_arguments().find(|a| a.get_long() == Some(long));
                assert!(
                    a.is_some_and(|a| matches!(a.get_action(), clap::ArgAction::SetTrue)),
                    "{} negates {on}, which is not a vime switch",
                    c.flag
                );
            }
        }
    }

    #[test]
    fn no_compat_flag_is_also_a_clap_option() {
        use clap::CommandFactory;
        let cmd = crate::train::args::TrainCli::command();
        for c in COMPAT {
            let long = c.flag.trim_start_matches('-');
            assert!(
                cmd.get_arguments()
                    .all(|a| a.get_long() != Some(long) && !a.get_all_aliases().unwrap_or_default().contains(&long)),
                "{} is both a compat flag and a clap option",
                c.flag
            );
        }
    }
}
