//! What the terminal shows: a bar over rollouts, a spinner or bar per phase, and log lines that
//! print above the bars. Bars draw only when stderr is a terminal (indicatif's default) and not
//! with `--no-progress`; log lines always print.
//!
//! Ctrl-C sets a flag the loop checks between phases (see [`interrupted`]); a second Ctrl-C exits
//! at once with status 130.
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::time::Duration;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static HANDLER: Once = Once::new();

/// Whether Ctrl-C was pressed.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Installs the Ctrl-C handler once per process (a second install attempt is a no-op, so several
/// runs in one test process are fine; an embedding program's own handler is left alone).
pub fn install_interrupt_handler() {
    HANDLER.call_once(|| {
        let _ = ctrlc::set_handler(|| {
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                eprintln!("\nvime-train: second Ctrl-C, exiting now");
                std::process::exit(130);
            }
            eprintln!(
                "\nvime-train: Ctrl-C: finishing the current phase, then writing the plot (Ctrl-C again to quit now)"
            );
        });
    });
}

pub struct Ui {
    multi: MultiProgress,
    /// Ranks other than 0 print nothing (rank 0 speaks for the run).
    silent: bool,
}

impl Ui {
    pub fn new(no_progress: bool) -> Self {
        let multi = if no_progress {
            MultiProgress::with_draw_target(ProgressDrawTarget::hidden())
        } else {
            MultiProgress::new()
        };
        Self { multi, silent: false }
    }

    /// No bars and no log lines: what the ranks other than 0 use.
    pub fn silent() -> Self {
        Self {
            multi: MultiProgress::with_draw_target(ProgressDrawTarget::hidden()),
            silent: true,
        }
    }

    /// A log line (above the bars when they draw).
    pub fn log(&self, line: &str) {
        if self.silent {
            return;
        }
        if self.multi.is_hidden() {
            eprintln!("{line}");
        } else {
            let _ = self.multi.println(line);
        }
    }

    pub fn main_bar(&self, total: u64, done: u64) -> ProgressBar {
        let bar = self.multi.add(ProgressBar::new(total));
        bar.set_style(
            ProgressStyle::with_template("rollout {pos}/{len} [{bar:30}] {elapsed_precise} eta {eta} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_position(done);
        bar
    }

    pub fn steps_bar(&self, total: u64, name: &str) -> ProgressBar {
        let bar = self.multi.add(ProgressBar::new(total));
        bar.set_style(
            ProgressStyle::with_template("  {prefix} step {pos}/{len} [{bar:20}] {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(name.to_string());
        bar
    }

    pub fn spinner(&self, name: &str) -> ProgressBar {
        let bar = self.multi.add(ProgressBar::new_spinner());
        bar.set_style(
            ProgressStyle::with_template("  {spinner} {prefix} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_prefix(name.to_string());
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    }
}
