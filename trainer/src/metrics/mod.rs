//! Metrics a user watches: a JSONL file, TensorBoard event files and PNG curves.
//!
//! - [`jsonl`]: one JSON object per step (`{"step", "time", "rollout/raw_reward", ...}`); the
//!   source of truth, easy to `jq`/pandas, and what the plots are drawn from.
//! - [`tensorboard`]: standard `events.out.tfevents.*` files for a live dashboard.
//! - [`plot`]: PNG figures of chosen metrics, for reports and for machines without a browser.
//!
//! Decisions:
//! - Everything is written by hand on top of `serde_json` and `png`: the TFRecord/Event protobuf
//!   encoding, CRC32C, the rasteriser and its bitmap font. No protobuf, plotting or font crates,
//!   no system fonts, so a bare CI machine renders identical PNGs.
//! - Every step is flushed as it is logged; a killed run loses at most the step being written.
//! - Resume is explicit: opening with `resume_after_step = Some(s)` drops the JSONL lines after
//!   `s` and makes TensorBoard drop the older event files' points after `s`, so the recomputed
//!   steps replace them instead of doubling the curves.
//! - Non-finite values are `null` in JSONL and skipped in TensorBoard and in plots.
mod font;
pub mod jsonl;
pub mod plot;
pub mod tensorboard;

pub use jsonl::{for_each_metrics_line, read_metrics, JsonlWriter};
pub use plot::{plot_metrics_file, plot_png, Panel, Series};
pub use tensorboard::{crc32c, masked_crc32c, read_scalars, TbWriter};

use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// Logs each step's metrics to a JSONL file and/or a TensorBoard log folder.
pub struct MetricsLogger {
    jsonl: Option<JsonlWriter>,
    tb: Option<TbWriter>,
}

impl MetricsLogger {
    /// Opens the writers that are asked for. `resume_after_step = Some(s)` continues a run whose
    /// checkpoint is at step `s` (see the module docs); `None` starts afresh.
    pub fn open(jsonl: Option<&Path>, tb_dir: Option<&Path>, resume_after_step: Option<u64>) -> Result<Self> {
        let jsonl = jsonl.map(|p| JsonlWriter::open(p, resume_after_step)).transpose()?;
        let tb = match tb_dir {
            None => None,
            Some(dir) => {
                let mut tb = TbWriter::create(dir)?;
                tb.start_session(resume_after_step.map_or(0, |s| s + 1), jsonl::unix_time())?;
                Some(tb)
            }
        };
        Ok(Self { jsonl, tb })
    }

    /// Writes `metrics` at `step` to every open writer, stamped with the current wall time.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<()> {
        let now = jsonl::unix_time();
        if let Some(j) = &mut self.jsonl {
            j.log_at(step, now, metrics)?;
        }
        if let Some(tb) = &mut self.tb {
            tb.add_scalars(step, now, metrics)?;
        }
        Ok(())
    }

    /// Flushes and fsyncs the TensorBoard file (JSONL lines are already flushed as written).
    pub fn flush(&mut self) -> Result<()> {
        match &mut self.tb {
            Some(tb) => tb.flush(),
            None => Ok(()),
        }
    }
}
