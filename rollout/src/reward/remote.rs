//! `remote_rm`: POST `{"prompt", "response", "label"}` to `--rm-url` and take the JSON reply as
//! the reward (slime's `rm_hub.remote_rm`).
//!
//! Each attempt has a timeout; failures (connection refused, timeouts, non-2xx, bad JSON) are
//! retried with exponential backoff (`base * 2^attempt`, capped, plus up to 10% jitter). When
//! every attempt failed the error names the URL, the number of attempts and the last failure:
//! a reward model that is down must stop the run, never turn into zero rewards.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use serde::Serialize;

/// Retry policy for the remote reward model. The defaults follow slime: 10 attempts, backoff
/// `min(2^attempt, 30)` seconds, 120 s per request.
#[derive(Clone, Debug)]
pub struct RemoteRmOptions {
    pub timeout: Duration,
    pub max_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
}

impl Default for RemoteRmOptions {
    fn default() -> Self {
        RemoteRmOptions {
            timeout: Duration::from_secs(120),
            max_attempts: 10,
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(30),
        }
    }
}

/// What slime sends: the prompt as the dataset had it (string or chat messages), the
/// response text and the label (`null` when there is none).
#[derive(Clone, Debug, Serialize)]
pub struct RemotePayload<'a> {
    pub prompt: &'a serde_json::Value,
    pub response: &'a str,
    pub label: Option<&'a str>,
}

/// A client for one reward-model URL (cheap to clone; connections are pooled).
#[derive(Clone, Debug)]
pub struct RemoteRm {
    url: String,
    client: reqwest::Client,
    opts: RemoteRmOptions,
}

impl RemoteRm {
    pub fn new(url: &str, opts: RemoteRmOptions) -> Result<RemoteRm> {
        if opts.max_attempts == 0 {
            return Err(anyhow!("remote_rm: max_attempts must be at least 1"));
        }
        let client = reqwest::Client::builder()
            .timeout(opts.timeout)
            .build()
            .with_context(|| format!("remote_rm: building the HTTP client for {url}"))?;
        Ok(RemoteRm {
            url: url.to_string(),
            client,
            opts,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.opts.backoff_base.saturating_mul(1u32 << attempt.min(20));
        let d = exp.min(self.opts.backoff_cap);
        // Jitter so that many samples retrying together do not hit the server in lockstep.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|t| t.subsec_nanos())
            .unwrap_or(0);
        d + d.mul_f64((nanos % 1000) as f64 / 10_000.0)
    }

    async fn attempt(&self, payload: &RemotePayload<'_>) -> Result<serde_json::Value> {
        let resp = self.client.post(&self.url).json(payload).send().await?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            let body: String = body.chars().take(200).collect();
            return Err(anyhow!("HTTP {status}: {body}"));
        }
        Ok(resp.json::<serde_json::Value>().await?)
    }

    /// Score one sample; the JSON value the server returned.
    pub async fn score(&self, payload: &RemotePayload<'_>) -> Result<serde_json::Value> {
        let started = Instant::now();
        let mut last_err = None;
        for attempt in 0..self.opts.max_attempts {
            match self.attempt(payload).await {
                Ok(v) => return Ok(v),
                Err(e) => last_err = Some(e),
            }
            if attempt + 1 < self.opts.max_attempts {
                tokio::time::sleep(self.backoff(attempt)).await;
            }
        }
        let err = last_err.expect("at least one attempt");
        Err(anyhow!(
            "remote_rm: POST {} failed after {} attempts over {:.1}s: {:#}",
            self.url,
            self.opts.max_attempts,
            started.elapsed().as_secs_f64(),
            err
        ))
    }
}
