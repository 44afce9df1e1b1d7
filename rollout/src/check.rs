//! `vime-train check-engines`: what vime needs of its rollout engines, checked against running
//! ones (vLLM, or vime-serve; directly or through vllm-router) before a long run is started on them.
//!
//! Each check calls the engines the way the trainer does, through [`VllmClient`], and says `pass`,
//! `fail` (with what was expected and what came back) or `skip` (with why):
//!
//! | check | what must hold |
//! |---|---|
//! | `health` | every engine (and the router) answers `GET /health` |
//! | `version` | `GET /version` per engine, and the weight-sync protocol vime picks for it |
//! | `router` | the router lists every engine vime registered (`GET /workers`) |
//! | `greedy` | two greedy completions of one prompt are equal; one log-prob per token, each <= 0 |
//! | `seed` | one seed twice gives one sample; four seeds give at least two different samples |
//! | `stop_token_ids` | with the greedy sample's third token as a stop id, the answer is the greedy sample cut after that token's first occurrence (kept, as vLLM keeps a stop id), `finish_reason` `stop`, the same log-probs |
//! | `rollout` | `--check-rollout-requests` sampled requests all come back well formed |
//! | `pause_keep` / `pause_wait` / `pause_abort` | requests in flight over a pause: kept and finished after `/resume`; drained before the pause returns; or ended with `finish_reason` `abort` and a well-formed partial answer |
//! | `world_size`, `reset_prefix_cache`, `collective_rpc` | the routes answer (`collective_rpc` calls vime's worker extension, skipped without it) |
//! | `sleep_1` | `/sleep?level=1`, `/is_sleeping`, waking `weights` then `kv_cache`: the greedy sample is unchanged |
//! | `sleep_2` | `/sleep?level=2` (weights dropped), waking `weights`, reloading them from `--hf-checkpoint`, waking `kv_cache`: the greedy sample is back |
//!
//! The report (`--report`) has one JSON object per check. The exit status is 1 if any check failed.
use crate::engine::{FinishReason, GenOutput, GenRequest, RolloutEngine, SamplingParams};
use crate::serve::PauseMode;
use crate::vllm::{VllmArgs, VllmClient};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use vime_sync::{Call, EngineControl};

#[derive(clap::Args, Debug, Clone)]
pub struct CheckArgs {
    #[command(flatten)]
    pub vllm: VllmArgs,
    /// The HF checkpoint the engines serve (`sleep_2` reloads it; skipped without). With
    /// `--vllm-launch` it is also the model the engines are started on.
    #[arg(long)]
    pub hf_checkpoint: Option<PathBuf>,
    /// The prompt's token ids, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "9707,11,1879,0,1124,374,264")]
    pub check_prompt_ids: Vec<u32>,
    /// Tokens per greedy completion.
    #[arg(long, default_value_t = 16)]
    pub check_max_tokens: usize,
    /// Sampled requests in the `rollout` check, and their length.
    #[arg(long, default_value_t = 64)]
    pub check_rollout_requests: usize,
    #[arg(long, default_value_t = 64)]
    pub check_rollout_max_tokens: usize,
    /// Requests and tokens in flight over each pause check.
    #[arg(long, default_value_t = 16)]
    pub check_pause_requests: usize,
    #[arg(long, default_value_t = 1024)]
    pub check_pause_max_tokens: usize,
    /// Only these checks (comma-separated names); all when empty.
    #[arg(long, value_delimiter = ',')]
    pub checks: Vec<String>,
    /// Skip the sleep checks (engines started without `--enable-sleep-mode`).
    #[arg(long)]
    pub no_sleep: bool,
    /// JSONL report, one object per check.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Seconds to wait for every engine's `/health` first.
    #[arg(long, default_value_t = 120.0)]
    pub check_health_timeout: f64,
}

/// One check's outcome.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub check: &'static str,
    /// `pass`, `fail` or `skip`.
    pub status: &'static str,
    pub detail: String,
    pub seconds: f64,
}

impl Outcome {
    pub fn to_json(&self) -> Value {
        json!({"check": self.check, "status": self.status, "detail": self.detail, "seconds": self.seconds})
    }
}

/// A check that did not fail: passed, or skipped (with why).
enum Verdict {
    Pass(String),
    Skip(String),
}

struct Ctx<'a> {
    args: &'a CheckArgs,
    client: &'a VllmClient,
    /// The greedy sample of the prompt, once `greedy` has run.
    baseline: Option<GenOutput>,
}

fn req(prompt: &[u32], params: SamplingParams) -> GenRequest {
    GenRequest {
        prompt_ids: prompt.to_vec(),
        params,
    }
}

fn greedy_params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..Default::default()
    }
}

/// Token and log-prob counts agree, log-probs are finite and <= 0, the length respects `max_tokens`
/// and a `length` finish used all of it.
fn well_formed(o: &GenOutput, max_tokens: usize, what: &str) -> Result<()> {
    ensure!(
        o.token_ids.len() == o.logprobs.len(),
        "{what}: {} tokens but {} log-probs",
        o.token_ids.len(),
        o.logprobs.len()
    );
    ensure!(
        o.token_ids.len() <= max_tokens,
        "{what}: {} tokens > max_tokens {max_tokens}",
        o.token_ids.len()
    );
    if let Some((i, lp)) = o
        .logprobs
        .iter()
        .enumerate()
        .find(|(_, l)| !l.is_finite() || **l > 1e-4)
    {
        bail!("{what}: log-prob {i} is {lp}");
    }
    if o.finish_reason == FinishReason::Length {
        ensure!(
            o.token_ids.len() == max_tokens,
            "{what}: finish_reason length after {} of {max_tokens} tokens",
            o.token_ids.len()
        );
    }
    Ok(())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// bf16 engines may batch the same prompt differently; the same tokens' log-probs agree this well.
const LOGPROB_TOL: f32 = 0.05;

impl Ctx<'_> {
    fn prompt(&self) -> &[u32] {
        &self.args.check_prompt_ids
    }

    fn greedy(&self) -> Result<GenOutput> {
        let n = self.args.check_max_tokens;
        let out = self.client.generate(&[req(self.prompt(), greedy_params(n))])?;
        let o = out.into_iter().next().context("no answer")?;
        well_formed(&o, n, "greedy completion")?;
        Ok(o)
    }

    /// The greedy sample equals the baseline (after sleeping, reloading, ...).
    fn same_as_baseline(&self, what: &str) -> Result<String> {
        let base = self.baseline.as_ref().context("the greedy check did not run first")?;
        let now = self.greedy()?;
        ensure!(
            now.token_ids == base.token_ids,
            "{what}: greedy tokens {:?}, before {:?}",
            now.token_ids,
            base.token_ids
        );
        let d = max_abs_diff(&now.logprobs, &base.logprobs);
        ensure!(d <= LOGPROB_TOL, "{what}: greedy log-probs moved by up to {d}");
        Ok(format!("greedy sample unchanged (log-probs within {d:.2e})"))
    }

    fn each_engine(&self, call: &Call) -> Result<Vec<Value>> {
        let urls = self.client.engine_urls();
        ensure!(
            !urls.is_empty(),
            "no engine URLs (--vllm-url): control calls go to the engines"
        );
        (0..urls.len())
            .map(|i| {
                self.client
                    .call(i, call, Duration::from_secs(120))
                    .with_context(|| format!("{} {} on {}", call.method, call.path, urls[i]))
            })
            .collect()
    }

    fn is_sleeping(&self) -> Result<Vec<bool>> {
        self.each_engine(&Call::get("/is_sleeping"))?
            .iter()
            .map(|v| {
                v.get("is_sleeping")
                    .and_then(Value::as_bool)
                    .with_context(|| format!("bad /is_sleeping answer {v}"))
            })
            .collect()
    }

    /// Long sampled requests in flight over a pause in `mode` (issued after 300 ms, held 500 ms).
    fn pause_check(&self, mode: PauseMode) -> Result<Verdict> {
        let n = self.args.check_pause_max_tokens;
        let reqs: Vec<GenRequest> = (0..self.args.check_pause_requests)
            .map(|i| {
                let p = SamplingParams {
                    temperature: 1.0,
                    max_tokens: n,
                    seed: Some(1000 + i as u64),
                    ..Default::default()
                };
                req(self.prompt(), p)
            })
            .collect();
        let (lead, held) = (Duration::from_millis(300), Duration::from_millis(500));
        let (outs, took, paused_at, resumed_at) = std::thread::scope(|s| -> Result<_> {
            let t0 = Instant::now();
            let rollout = s.spawn(move || (self.client.generate(&reqs), t0.elapsed()));
            std::thread::sleep(lead);
            let during = || -> Result<(Duration, Duration)> {
                self.client.pause(mode)?;
                let paused_at = t0.elapsed();
                let paused = self.client.is_paused()?;
                ensure!(
                    paused.iter().all(|p| *p),
                    "/is_paused after /pause?mode={}: {paused:?}",
                    mode.as_str()
                );
                std::thread::sleep(held);
                let resumed_at = t0.elapsed();
                self.client.resume()?;
                let paused = self.client.is_paused()?;
                ensure!(paused.iter().all(|p| !*p), "/is_paused after /resume: {paused:?}");
                Ok((paused_at, resumed_at))
            };
            let times = during();
            let (outs, took) = rollout.join().expect("rollout thread panicked");
            let (paused_at, resumed_at) = times?;
            Ok((outs?, took, paused_at, resumed_at))
        })?;
        for (i, o) in outs.iter().enumerate() {
            well_formed(o, n, &format!("request {i} over the pause"))?;
        }
        let aborted = outs.iter().filter(|o| o.finish_reason == FinishReason::Abort).count();
        let full = outs.iter().filter(|o| o.token_ids.len() == n).count();
        let counts = format!(
            "{} requests of {n} tokens: {full} full, {aborted} aborted; paused at {paused_at:.2?} (asked at {lead:?}), \
             resumed at {resumed_at:.2?}, rollout done at {took:.2?}",
            outs.len()
        );
        if took <= lead {
            return Ok(Verdict::Skip(format!(
                "the rollout ended before the pause (raise --check-pause-max-tokens): {counts}"
            )));
        }
        match mode {
            PauseMode::Keep => {
                ensure!(aborted == 0, "mode=keep aborted requests: {counts}");
                ensure!(
                    took >= resumed_at,
                    "mode=keep: requests finished while paused: {counts}"
                );
            }
            PauseMode::Wait => {
                ensure!(aborted == 0, "mode=wait aborted requests: {counts}");
                ensure!(
                    took < resumed_at,
                    "mode=wait: in-flight requests were not drained by the pause: {counts}"
                );
            }
            PauseMode::Abort => {
                ensure!(aborted > 0, "mode=abort: no request marked abort: {counts}");
                ensure!(took < resumed_at, "mode=abort: requests ran on while paused: {counts}");
            }
        }
        Ok(Verdict::Pass(counts))
    }

    fn run_one(&mut self, name: &'static str) -> Result<Verdict> {
        let client = self.client;
        match name {
            "health" => {
                client.wait_healthy(Duration::from_secs_f64(self.args.check_health_timeout))?;
                Ok(Verdict::Pass(format!(
                    "{} engine(s) healthy",
                    client.engine_urls().len()
                )))
            }
            "version" => {
                let versions = client.engine_versions()?;
                let mut parts = Vec::new();
                for (u, v) in client.engine_urls().iter().zip(&versions) {
                    let one = std::slice::from_ref(v);
                    let ipc = vime_sync::protocol::choose_protocol(one, "ipc")?;
                    let nccl = vime_sync::protocol::choose_protocol(one, "nccl")?;
                    let name = v
                        .as_deref()
                        .map_or("no /version (vime-serve)".to_string(), |v| format!("vLLM {v}"));
                    parts.push(format!("{u}: {name}, weight sync over ipc {ipc:?}, nccl {nccl:?}"));
                }
                vime_sync::protocol::choose_protocol(&versions, "ipc").context("one protocol for all engines")?;
                Ok(Verdict::Pass(parts.join("; ")))
            }
            "router" => {
                let Some(listed) = client.router_listed_workers()? else {
                    return Ok(Verdict::Skip("no --vllm-router-url".into()));
                };
                let mut want = client.registered_workers();
                let mut got = listed.clone();
                want.sort();
                got.sort();
                ensure!(got == want, "the router lists {listed:?}, vime registered {want:?}");
                Ok(Verdict::Pass(format!(
                    "router lists {listed:?}; generation goes through it"
                )))
            }
            "greedy" => {
                let a = self.greedy()?;
                let b = self.greedy()?;
                ensure!(
                    a.token_ids == b.token_ids,
                    "greedy twice: {:?} then {:?}",
                    a.token_ids,
                    b.token_ids
                );
                let d = max_abs_diff(&a.logprobs, &b.logprobs);
                ensure!(d <= LOGPROB_TOL, "greedy log-probs differ by {d} between two calls");
                let detail = format!(
                    "{} tokens {:?}, finish {:?}, log-probs repeat within {d:.2e}",
                    a.token_ids.len(),
                    a.token_ids,
                    a.finish_reason
                );
                self.baseline = Some(a);
                Ok(Verdict::Pass(detail))
            }
            "seed" => {
                let n = self.args.check_max_tokens;
                let sampled = |seed: u64| SamplingParams {
                    temperature: 1.0,
                    max_tokens: n,
                    seed: Some(seed),
                    ..Default::default()
                };
                let reqs: Vec<GenRequest> = [7, 7, 1, 2, 3, 4]
                    .iter()
                    .map(|s| req(self.prompt(), sampled(*s)))
                    .collect();
                let outs = client.generate(&reqs)?;
                for (i, o) in outs.iter().enumerate() {
                    well_formed(o, n, &format!("seeded sample {i}"))?;
                }
                ensure!(
                    outs[0].token_ids == outs[1].token_ids,
                    "seed 7 twice: {:?} then {:?}",
                    outs[0].token_ids,
                    outs[1].token_ids
                );
                let mut distinct: Vec<&Vec<u32>> = outs[2..].iter().map(|o| &o.token_ids).collect();
                distinct.sort();
                distinct.dedup();
                ensure!(distinct.len() >= 2, "seeds 1-4 all gave {:?}", outs[2].token_ids);
                Ok(Verdict::Pass(format!(
                    "seed 7 repeats; seeds 1-4 gave {} different samples",
                    distinct.len()
                )))
            }
            "stop_token_ids" => {
                let base = self.baseline.clone().context("the greedy check did not run first")?;
                if base.token_ids.len() < 2 {
                    return Ok(Verdict::Skip(format!("greedy sample too short: {:?}", base.token_ids)));
                }
                let pick = base.token_ids.len().min(3) - 1;
                let stop = base.token_ids[pick];
                let k = base.token_ids.iter().position(|t| *t == stop).expect("present");
                let mut p = greedy_params(self.args.check_max_tokens);
                p.stop_token_ids = vec![stop];
                let o = client.generate(&[req(self.prompt(), p)])?.remove(0);
                well_formed(&o, self.args.check_max_tokens, "stopped completion")?;
                ensure!(
                    o.token_ids == base.token_ids[..=k],
                    "stop id {stop}: got {:?}, want the greedy sample up to and including its first {stop}: {:?}",
                    o.token_ids,
                    &base.token_ids[..=k]
                );
                ensure!(
                    o.finish_reason == FinishReason::Stop,
                    "stop id {stop}: finish {:?}",
                    o.finish_reason
                );
                let d = max_abs_diff(&o.logprobs, &base.logprobs[..=k]);
                ensure!(
                    d <= LOGPROB_TOL,
                    "stop id {stop}: log-probs differ from greedy's by {d}"
                );
                Ok(Verdict::Pass(format!(
                    "stop id {stop} ended the sample after {} tokens, the id kept, finish stop",
                    k + 1
                )))
            }
            "rollout" => {
                let n = self.args.check_rollout_max_tokens;
                let reqs: Vec<GenRequest> = (0..self.args.check_rollout_requests)
                    .map(|i| {
                        req(
                            self.prompt(),
                            SamplingParams {
                                temperature: 1.0,
                                max_tokens: n,
                                seed: Some(i as u64),
                                ..Default::default()
                            },
                        )
                    })
                    .collect();
                let before = client.stats();
                let t0 = Instant::now();
                let outs = client.generate(&reqs)?;
                let took = t0.elapsed();
                let tokens: usize = outs.iter().map(|o| o.token_ids.len()).sum();
                for (i, o) in outs.iter().enumerate() {
                    well_formed(o, n, &format!("rollout request {i}"))?;
                }
                let st = client.stats();
                Ok(Verdict::Pass(format!(
                    "{} requests, {tokens} tokens in {took:.2?} ({:.0} tokens/s); retries {}, engines deregistered as down {}; registered now {:?}",
                    outs.len(),
                    tokens as f64 / took.as_secs_f64(),
                    st.retries - before.retries,
                    st.deregistered_dead - before.deregistered_dead,
                    client.registered_workers()
                )))
            }
            "pause_keep" => self.pause_check(PauseMode::Keep),
            "pause_wait" => self.pause_check(PauseMode::Wait),
            "pause_abort" => self.pause_check(PauseMode::Abort),
            "world_size" => {
                let v = self.each_engine(&Call::get("/get_world_size"))?;
                let sizes = v
                    .iter()
                    .map(|x| {
                        x.get("world_size")
                            .and_then(Value::as_u64)
                            .with_context(|| format!("bad /get_world_size answer {x}"))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Verdict::Pass(format!("world sizes {sizes:?}")))
            }
            "reset_prefix_cache" => {
                client.reset_prefix_cache()?;
                Ok(Verdict::Pass("ok".into()))
            }
            "collective_rpc" => {
                match client.collective_rpc(vime_sync::protocol::EXT_INFO, &["{}".into()], &Default::default()) {
                    Ok(v) => Ok(Verdict::Pass(format!(
                        "{}: {}",
                        vime_sync::protocol::EXT_INFO,
                        v.iter().map(|x| x.to_string().chars().take(120).collect::<String>()).collect::<Vec<_>>().join("; ")
                    ))),
                    Err(e) => Ok(Verdict::Skip(format!(
                        "no vime worker extension (start vLLM with --worker-extension-cls vime_vllm_ext.VimeWorkerExtension \
                         for weight streaming into vLLM < 0.33): {e:#}"
                    ))),
                }
            }
            "sleep_1" => {
                if self.args.no_sleep {
                    return Ok(Verdict::Skip("--no-sleep".into()));
                }
                client.sleep(1)?;
                let asleep = self.is_sleeping()?;
                ensure!(
                    asleep.iter().all(|s| *s),
                    "/is_sleeping after /sleep?level=1: {asleep:?}"
                );
                client.wake_up(&["weights"])?;
                client.wake_up(&["kv_cache"])?;
                let asleep = self.is_sleeping()?;
                ensure!(
                    asleep.iter().all(|s| !*s),
                    "/is_sleeping after waking weights and kv_cache: {asleep:?}"
                );
                Ok(Verdict::Pass(self.same_as_baseline("after sleep level 1")?))
            }
            "sleep_2" => {
                if self.args.no_sleep {
                    return Ok(Verdict::Skip("--no-sleep".into()));
                }
                let Some(ckpt) = self.args.hf_checkpoint.clone() else {
                    return Ok(Verdict::Skip("no --hf-checkpoint to reload the weights from".into()));
                };
                client.sleep(2)?;
                let asleep = self.is_sleeping()?;
                ensure!(
                    asleep.iter().all(|s| *s),
                    "/is_sleeping after /sleep?level=2: {asleep:?}"
                );
                client.wake_up(&["weights"])?;
                let t0 = Instant::now();
                client
                    .update_weights_from_dir(&ckpt)
                    .with_context(|| format!("reloading {}", ckpt.display()))?;
                let reload = t0.elapsed();
                client.wake_up(&["kv_cache"])?;
                Ok(Verdict::Pass(format!(
                    "reloaded in {reload:.2?}; {}",
                    self.same_as_baseline("after sleep level 2 and a reload")?
                )))
            }
            other => bail!("no check named {other:?}"),
        }
    }
}

/// Every check, in the order they run (`greedy` first among the generation checks: later ones
/// compare against its sample).
pub const CHECKS: &[&str] = &[
    "health",
    "version",
    "router",
    "greedy",
    "seed",
    "stop_token_ids",
    "rollout",
    "pause_keep",
    "pause_wait",
    "pause_abort",
    "world_size",
    "reset_prefix_cache",
    "collective_rpc",
    "sleep_1",
    "sleep_2",
];

/// Runs the checks against a connected client; prints one line per check.
pub fn run_checks(args: &CheckArgs, client: &VllmClient) -> Result<Vec<Outcome>> {
    for c in &args.checks {
        ensure!(
            CHECKS.contains(&c.as_str()),
            "no check named {c:?}; the checks are {}",
            CHECKS.join(", ")
        );
    }
    let wanted = |c: &str| args.checks.is_empty() || args.checks.iter().any(|x| x == c) || c == "health";
    let mut ctx = Ctx {
        args,
        client,
        baseline: None,
    };
    let mut report = match &args.report {
        Some(p) => Some(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?),
        None => None,
    };
    let mut outcomes = Vec::new();
    for name in CHECKS.iter().copied() {
        // Later checks compare against the greedy sample, so it runs whenever they do.
        let needs_baseline = ["stop_token_ids", "sleep_1", "sleep_2"];
        let needed = name == "greedy" && needs_baseline.iter().any(|c| wanted(c));
        if !wanted(name) && !needed {
            continue;
        }
        let t0 = Instant::now();
        let res = ctx.run_one(name);
        let (status, detail) = match res {
            Ok(Verdict::Pass(d)) => ("pass", d),
            Ok(Verdict::Skip(d)) => ("skip", d),
            Err(e) => ("fail", format!("{e:#}")),
        };
        let o = Outcome {
            check: name,
            status,
            detail,
            seconds: t0.elapsed().as_secs_f64(),
        };
        eprintln!(
            "check-engines: {:<18} {} ({:.2} s): {}",
            o.check, o.status, o.seconds, o.detail
        );
        if let Some(f) = report.as_mut() {
            writeln!(f, "{}", o.to_json()).context("writing the report")?;
        }
        let stop = name == "health" && status == "fail";
        outcomes.push(o);
        if stop {
            break;
        }
    }
    Ok(outcomes)
}

/// `vime-train check-engines`: connects (launching engines with `--vllm-launch`), runs the checks,
/// returns the exit status (0: no check failed).
pub fn run(args: &CheckArgs) -> Result<i32> {
    let model = args
        .hf_checkpoint
        .as_ref()
        .map(|p| p.to_string_lossy().to_string())
        .unwrap_or_default();
    if args.vllm.vllm_launch && model.is_empty() {
        bail!("--vllm-launch needs --hf-checkpoint (the model the engines serve)");
    }
    let (_launcher, client) = args.vllm.connect(&model)?;
    let outcomes = run_checks(args, &client)?;
    let count = |s: &str| outcomes.iter().filter(|o| o.status == s).count();
    let (pass, skip, fail) = (count("pass"), count("skip"), count("fail"));
    eprintln!("check-engines: {pass} passed, {skip} skipped, {fail} failed");
    client.shutdown()?;
    Ok(if fail == 0 { 0 } else { 1 })
}
