//! Metrics as JSON lines: `{"step": 12, "time": 1718000000.25, "rollout/raw_reward": 0.41, ...}`.
//!
//! Decisions:
//! - One line per `log` call, written with a single `write_all` and flushed at once, so a killed
//!   process loses at most the line being written. A final line without its `\n` is such a torn
//!   write: readers skip it (with a warning) instead of failing.
//! - Resume (`open(path, Some(s))`) keeps the lines of steps <= `s` byte for byte and drops
//!   the later ones, which the resumed run recomputes. The kept lines go to a temp file (fsynced)
//!   that is renamed over the original, so a crash mid-rewrite leaves the old file whole. A line
//!   that does not parse is an error naming `file:line`, and the file is left untouched.
//! - Values are written in their shortest round-trip form and read back bit-exact (serde_json's
//!   `float_roundtrip` feature, enabled in trainer/Cargo.toml). Non-finite values are written as
//!   `null` (JSON has no NaN); readers skip nulls.
//! - `step` and `time` are reserved keys; `read_metrics` returns neither among the metrics.
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

const RESERVED: [&str; 2] = ["step", "time"];

/// Appends one JSON object per logged step to a file.
pub struct JsonlWriter {
    path: PathBuf,
    file: File,
}

impl JsonlWriter {
    /// Opens `path` for logging, creating parent folders. `None` starts a fresh file; `Some(s)`
    /// resumes after step `s`: earlier lines are kept, lines with a step after `s` are dropped.
    pub fn open(path: &Path, resume_after_step: Option<u64>) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file = match resume_after_step {
            None => File::create(path).with_context(|| format!("creating {}", path.display()))?,
            Some(step) => {
                if path.exists() {
                    truncate_after_step(path, step)?;
                }
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {} for append", path.display()))?
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Appends `{"step", "time" (now), metrics...}` as one line and flushes it.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<()> {
        self.log_at(step, unix_time(), metrics)
    }

    /// [`Self::log`] with a given wall time (Unix seconds).
    pub fn log_at(&mut self, step: u64, time: f64, metrics: &BTreeMap<String, f64>) -> Result<()> {
        let line = format_line(step, time, metrics)?;
        if crate::train::fault::kill_due("metrics") {
            // A torn write, as a kill mid-`write_all` leaves it.
            let _ = self.file.write_all(&line.as_bytes()[..line.len() / 2]);
            let _ = self.file.flush();
            crate::train::fault::kill("metrics");
        }
        self.file
            .write_all(line.as_bytes())
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.file
            .flush()
            .with_context(|| format!("flushing {}", self.path.display()))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Seconds since the Unix epoch, as a float.
pub(crate) fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn format_line(step: u64, time: f64, metrics: &BTreeMap<String, f64>) -> Result<String> {
    let mut line = format!("{{\"step\":{step},\"time\":{}", json_number(time));
    for (name, &value) in metrics {
        if RESERVED.contains(&name.as_str()) {
            bail!("metric name {name:?} is reserved in the JSONL metrics file");
        }
        line.push(',');
        line.push_str(&serde_json::to_string(name)?);
        line.push(':');
        line.push_str(&json_number(value));
    }
    line.push_str("}\n");
    Ok(line)
}

/// The shortest text that parses back to the same f64, or `null` when it is not finite.
fn json_number(v: f64) -> String {
    if v.is_finite() {
        serde_json::Number::from_f64(v)
            .map(|n| n.to_string())
            .unwrap_or_else(|| "null".into())
    } else {
        "null".into()
    }
}

/// One parsed line: its step and its metrics (nulls and `time` left out).
fn parse_line(bytes: &[u8]) -> Result<(u64, BTreeMap<String, f64>)> {
    let value: serde_json::Value = serde_json::from_slice(bytes)?;
    let Some(object) = value.as_object() else {
        bail!("not a JSON object")
    };
    let step = object
        .get("step")
        .and_then(|s| s.as_u64())
        .context("no unsigned integer \"step\"")?;
    let mut metrics = BTreeMap::new();
    for (key, v) in object {
        if RESERVED.contains(&key.as_str()) || v.is_null() {
            continue;
        }
        let Some(x) = v.as_f64() else {
            bail!("value of {key:?} is not a number: {v}")
        };
        metrics.insert(key.clone(), x);
    }
    Ok((step, metrics))
}

/// One parsed line of a metrics file and where its text lies in the file (`\n` excluded).
struct Row {
    step: u64,
    metrics: BTreeMap<String, f64>,
    span: Range<usize>,
}

/// Parses every line of `path`; errors name `file:line`. Blank lines are skipped, and so is a
/// last line without its `\n` that does not parse (a torn write).
fn parse_file(path: &Path, data: &[u8]) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let (mut start, mut number) = (0, 0);
    while start < data.len() {
        number += 1;
        let newline = data[start..].iter().position(|&b| b == b'\n');
        let span = start..newline.map_or(data.len(), |i| start + i);
        start = span.end + 1;
        let line = &data[span.clone()];
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match parse_line(line) {
            Ok((step, metrics)) => rows.push(Row { step, metrics, span }),
            Err(_) if newline.is_none() => {
                eprintln!(
                    "warning: {}:{number}: skipping a torn last line (no newline)",
                    path.display()
                );
            }
            Err(e) => bail!("{}:{number}: malformed metrics line: {e}", path.display()),
        }
    }
    Ok(rows)
}

/// Keeps the lines of `path` with step <= `step`, rewriting the file atomically.
fn truncate_after_step(path: &Path, step: u64) -> Result<()> {
    let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut kept = Vec::with_capacity(data.len());
    for row in parse_file(path, &data)? {
        if row.step <= step {
            kept.extend_from_slice(&data[row.span]);
            kept.push(b'\n');
        }
    }
    if kept == data {
        return Ok(());
    }
    write_atomic(path, &kept)
}

/// Writes `bytes` to a temp file beside `path`, fsyncs it, renames it over `path` and fsyncs the
/// folder. Temp files of `path` that a killed process left (another pid) are removed first.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{} has no file name", path.display()))?;
    let prefix = format!(".{}.tmp-", name.to_string_lossy());
    let tmp = path.with_file_name(format!("{prefix}{}", std::process::id()));
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) && e.path() != tmp {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    let result = (|| -> Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e.context(format!("writing {} atomically (via {})", path.display(), tmp.display())));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// [`read_metrics`] line by line: `row(step, metrics)` for each line, in file order, same rules.
/// What a plot drawn after every step needs, without holding the whole (growing) file and every
/// line's metrics in memory each time.
pub fn for_each_metrics_line(path: &Path, mut row: impl FnMut(u64, BTreeMap<String, f64>)) -> Result<()> {
    use std::io::BufRead;
    let file = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let (mut line, mut number) = (Vec::new(), 0);
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok(());
        }
        number += 1;
        let torn = line.last() != Some(&b'\n');
        let text = line.strip_suffix(b"\n").unwrap_or(&line);
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match parse_line(text) {
            Ok((step, metrics)) => row(step, metrics),
            Err(_) if torn => {
                eprintln!(
                    "warning: {}:{number}: skipping a torn last line (no newline)",
                    path.display()
                );
            }
            Err(e) => bail!("{}:{number}: malformed metrics line: {e}", path.display()),
        }
    }
}

/// Reads a JSONL metrics file back: `(step, metrics)` per line, in file order. Nulls are skipped;
/// a malformed line is an error naming `file:line`; a torn last line is skipped.
pub fn read_metrics(path: &Path) -> Result<Vec<(u64, BTreeMap<String, f64>)>> {
    let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(parse_file(path, &data)?
        .into_iter()
        .map(|row| (row.step, row.metrics))
        .collect())
}
