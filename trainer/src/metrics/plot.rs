//! PNG line plots of training curves, rasterised here and encoded with the `png` crate.
//!
//! Decisions:
//! - A fixed layout: panels of [`PANEL_W`] x [`PANEL_H`] pixels in up to two columns under a
//!   figure title, so the image size depends only on the panel count ([`figure_size`]).
//! - Lines are anti-aliased by coverage: each series is stroked into a coverage mask (distance of
//!   each pixel centre to the segments, max over segments) that is then blended once in the
//!   series colour, so joints do not darken and series cross cleanly. Everything is clipped to
//!   the plot area.
//! - Text uses the built-in 5x7 bitmap font (`font.rs`) at 2x (3x for the figure title): no
//!   system fonts, identical output everywhere.
//! - Ticks are "nice" (1, 2 or 5 times a power of ten) inside the data range padded by a few
//!   percent; integer x data (steps) never gets fractional x ticks. Tick labels switch to
//!   scientific notation for very large or very small magnitudes.
//! - Series get markers when they have few points for their width (eval curves); non-finite
//!   points break the line; a constant series is padded to a visible band; empty panels say so.
//! - The legend sits between the panel title and the plot, so it never hides data.
//! - The file is written atomically (temp file, fsync, rename).
use super::font::{self, GLYPH_H, GLYPH_W};
use super::jsonl::{for_each_metrics_line, write_atomic};
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// One curve: `points` are (x = step, y = value).
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart: a title and the curves drawn in it.
#[derive(Debug, Clone, Default)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

pub const PANEL_W: usize = 720;
pub const PANEL_H: usize = 450;
const COLUMNS: usize = 2;
const MARGIN: usize = 24;
const GAP: usize = 32;
const FIG_TITLE_SCALE: usize = 3;
const TEXT_SCALE: usize = 2;
const FIG_TITLE_H: usize = 24 + GLYPH_H * FIG_TITLE_SCALE + 16;

type Rgb = [u8; 3];
const WHITE: Rgb = [255, 255, 255];
const INK: Rgb = [34, 34, 34];
const LABEL: Rgb = [68, 68, 68];
const SPINE: Rgb = [120, 120, 120];
const GRID: Rgb = [232, 232, 232];
const MUTED: Rgb = [150, 150, 150];
/// Line colours, cycled per series (the widely used "tab10" palette).
pub const PALETTE: [Rgb; 10] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
];

const LINE_HALF_WIDTH: f32 = 1.1;
const MARKER_RADIUS: f32 = 3.6;
/// A series gets markers below this many points, or when its points are this many pixels apart.
const MARKER_MAX_POINTS: usize = 40;
const MARKER_MIN_SPACING: f64 = 12.0;
const MAX_LEGEND_ROWS: usize = 3;

/// Width and height in pixels of a figure with `n_panels` panels.
pub fn figure_size(n_panels: usize) -> (u32, u32) {
    let n = n_panels.max(1);
    let cols = n.min(COLUMNS);
    let rows = n.div_ceil(cols);
    let w = 2 * MARGIN + cols * PANEL_W + (cols - 1) * GAP;
    let h = FIG_TITLE_H + rows * PANEL_H + (rows - 1) * GAP + MARGIN;
    (w as u32, h as u32)
}

/// Draws `panels` in a grid under `title` and writes the figure as an RGB PNG to `out`.
pub fn plot_png(out: &Path, title: &str, panels: &[Panel]) -> Result<()> {
    let (w, h) = figure_size(panels.len());
    let mut canvas = Canvas::new(w as usize, h as usize);
    let title = fit_text(title, w as usize - 2 * MARGIN, FIG_TITLE_SCALE);
    let tw = font::text_width(&title) * FIG_TITLE_SCALE;
    canvas.bold_text((w as usize - tw) as i64 / 2, 24, &title, FIG_TITLE_SCALE, INK);
    if panels.is_empty() {
        canvas.text(MARGIN as i64, FIG_TITLE_H as i64, "no panels", TEXT_SCALE, MUTED);
    }
    for (i, panel) in panels.iter().enumerate() {
        let (col, row) = (i % COLUMNS, i / COLUMNS);
        let x0 = MARGIN + col * (PANEL_W + GAP);
        let y0 = FIG_TITLE_H + row * (PANEL_H + GAP);
        draw_panel(&mut canvas, x0, y0, panel);
    }
    let png = canvas
        .encode_png()
        .with_context(|| format!("encoding {}", out.display()))?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    write_atomic(out, &png)
}

/// Reads a JSONL metrics file and plots, per `(panel title, metric keys)`, one series per key
/// (x = step). Keys absent from the file are skipped.
pub fn plot_metrics_file(jsonl: &Path, out: &Path, title: &str, panels: &[(&str, &[&str])]) -> Result<()> {
    // Only the plotted points are kept, line by line (the file grows with every step).
    let mut points: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for (_, keys) in panels {
        for k in keys.iter() {
            points.insert(k, Vec::new());
        }
    }
    for_each_metrics_line(jsonl, |step, m| {
        for (k, v) in m {
            if let Some(p) = points.get_mut(k.as_str()) {
                p.push((step as f64, v));
            }
        }
    })?;
    let panels: Vec<Panel> = panels
        .iter()
        .map(|(panel_title, keys)| Panel {
            title: panel_title.to_string(),
            series: keys
                .iter()
                .filter_map(|key| {
                    let points = points.get(key).cloned().unwrap_or_default();
                    (!points.is_empty()).then(|| Series {
                        label: key.to_string(),
                        points,
                    })
                })
                .collect(),
        })
        .collect();
    plot_png(out, title, &panels)
}

// ---------------------------------------------------------------------------------------------
// Panel layout

/// An axis: data range mapped onto a pixel span, with its ticks and their labels.
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
    labels: Vec<String>,
}

impl Axis {
    /// Pixel position of `v` on a span from `p0` (at `lo`) to `p1` (at `hi`).
    fn map(&self, v: f64, p0: f64, p1: f64) -> f64 {
        p0 + (v - self.lo) / (self.hi - self.lo) * (p1 - p0)
    }
}

fn draw_panel(canvas: &mut Canvas, x0: usize, y0: usize, panel: &Panel) {
    let s = TEXT_SCALE;
    let text_h = GLYPH_H * s;
    let inner_l = x0 + 8;
    let inner_r = x0 + PANEL_W - 8;

    let title = fit_text(&panel.title, inner_r - inner_l, s);
    let tw = font::text_width(&title) * s;
    canvas.bold_text((x0 + (PANEL_W - tw) / 2) as i64, y0 as i64, &title, s, INK);

    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let drawn: Vec<(usize, &Series)> = panel
        .series
        .iter()
        .enumerate()
        .filter(|(_, s)| s.points.iter().any(|p| finite(&p)))
        .collect();

    // Legend: entries flow left to right under the title, wrapping onto at most
    // MAX_LEGEND_ROWS rows; entries that do not fit are counted in a "+N more" note.
    let legend_top = y0 + text_h + 12;
    let row_h = text_h + 8;
    let swatch = 26;
    let markers = |series: &Series, plot_w: f64| {
        let n = series.points.iter().filter(finite).count();
        n <= MARKER_MAX_POINTS || plot_w / n as f64 >= MARKER_MIN_SPACING
    };
    let approx_plot_w = (PANEL_W - 100) as f64;
    let entries: Vec<(usize, &Series)> = drawn.iter().filter(|(_, s)| !s.label.is_empty()).copied().collect();
    let more_w = font::text_width("+99 more") * s;
    let mut legend_rows = 0;
    let (mut lx, mut ly) = (inner_r, legend_top); // the first entry starts a row
    for (k, &(i, series)) in entries.iter().enumerate() {
        let label = fit_text(&series.label, inner_r - inner_l - swatch - 8, s);
        let entry_w = swatch + 8 + font::text_width(&label) * s;
        let reserve = if legend_rows == MAX_LEGEND_ROWS && k + 1 < entries.len() {
            more_w + 22
        } else {
            0
        };
        if lx + entry_w + reserve > inner_r {
            if legend_rows == MAX_LEGEND_ROWS {
                let more = format!("+{} more", entries.len() - k);
                canvas.text(lx as i64, ly as i64, &more, s, MUTED);
                break;
            }
            legend_rows += 1;
            lx = inner_l;
            ly = legend_top + (legend_rows - 1) * row_h;
        }
        let mid = ly as f32 + (7 * s) as f32 / 2.0;
        let mut mask = Mask::new(lx, ly, swatch + 2, text_h);
        mask.segment(
            (lx as f32 + 1.0, mid),
            ((lx + swatch) as f32 - 1.0, mid),
            LINE_HALF_WIDTH + 0.3,
        );
        if markers(series, approx_plot_w) {
            mask.disc((lx as f32 + swatch as f32 / 2.0, mid), MARKER_RADIUS);
        }
        canvas.composite(&mask, PALETTE[i % PALETTE.len()]);
        canvas.text((lx + swatch + 8) as i64, ly as i64, &label, s, LABEL);
        lx += entry_w + 22;
    }

    let plot_top = legend_top + legend_rows * row_h + text_h / 2 + 4;
    let axis_label_y = y0 + PANEL_H - text_h - 4;
    let plot_bottom = axis_label_y - text_h - 16;

    let points = || drawn.iter().flat_map(|(_, s)| s.points.iter().filter(finite));
    if drawn.is_empty() || plot_bottom <= plot_top + 20 {
        let plot_l = inner_l + 40;
        canvas.frame(plot_l, plot_top, inner_r, plot_bottom, SPINE);
        let msg = "no data";
        let mx = (plot_l + inner_r - font::text_width(msg) * s) / 2;
        canvas.text(mx as i64, ((plot_top + plot_bottom - text_h) / 2) as i64, msg, s, MUTED);
        return;
    }
    let (xmin, xmax) = min_max(points().map(|p| p.0));
    let (ymin, ymax) = min_max(points().map(|p| p.1));
    let x_integer = points().all(|p| p.0.fract() == 0.0);

    let plot_h = (plot_bottom - plot_top) as f64;
    let y_axis = make_axis(ymin, ymax, 0.05, (plot_h / 60.0).clamp(3.0, 8.0) as usize, false);
    let y_label_w = y_axis.labels.iter().map(|l| font::text_width(l) * s).max().unwrap_or(0);
    let plot_l = inner_l + y_label_w + 12;
    let plot_r = inner_r - 12;
    let plot_w = (plot_r - plot_l) as f64;

    // As many x ticks as fit without labels touching.
    let mut target = (plot_w / 110.0).clamp(2.0, 8.0) as usize;
    let x_axis = loop {
        let axis = make_axis(xmin, xmax, 0.03, target, x_integer);
        let widest = axis.labels.iter().map(|l| font::text_width(l) * s).max().unwrap_or(0) as f64;
        let spacing = if axis.ticks.len() > 1 {
            plot_w * (axis.ticks[1] - axis.ticks[0]) / (axis.hi - axis.lo)
        } else {
            plot_w
        };
        if spacing >= widest + 16.0 || target <= 2 {
            break axis;
        }
        target -= 1;
    };

    let (pl, pr, pt, pb) = (plot_l as f64, plot_r as f64, plot_top as f64, plot_bottom as f64);
    // Grid, ticks and tick labels.
    for (&t, label) in y_axis.ticks.iter().zip(&y_axis.labels) {
        let y = y_axis.map(t, pb, pt).round() as usize;
        canvas.hline(plot_l, plot_r, y, GRID);
        canvas.hline(plot_l - 5, plot_l, y, SPINE);
        let lw = font::text_width(label) * s;
        canvas.text((plot_l - 8 - lw) as i64, y as i64 - (7 * s / 2) as i64, label, s, LABEL);
    }
    for (&t, label) in x_axis.ticks.iter().zip(&x_axis.labels) {
        let x = x_axis.map(t, pl, pr).round() as usize;
        canvas.vline(x, plot_top, plot_bottom, GRID);
        canvas.vline(x, plot_bottom, plot_bottom + 5, SPINE);
        let lw = font::text_width(label) * s;
        canvas.text(x as i64 - (lw / 2) as i64, (plot_bottom + 9) as i64, label, s, LABEL);
    }
    canvas.frame(plot_l, plot_top, plot_r, plot_bottom, SPINE);
    let axis_name = "step";
    let aw = font::text_width(axis_name) * s;
    canvas.text(
        ((plot_l + plot_r - aw) / 2) as i64,
        axis_label_y as i64,
        axis_name,
        s,
        LABEL,
    );

    // Curves, clipped to the inside of the frame.
    let mut mask = Mask::new(
        plot_l + 1,
        plot_top + 1,
        plot_r - plot_l - 1,
        plot_bottom - plot_top - 1,
    );
    for &(i, series) in &drawn {
        mask.clear();
        let with_markers = markers(series, plot_w);
        let to_px = |&(x, y): &(f64, f64)| (x_axis.map(x, pl, pr) as f32, y_axis.map(y, pb, pt) as f32);
        // Runs of finite points; a non-finite point breaks the line.
        for run in series.points.split(|p| !finite(&p)) {
            let px: Vec<(f32, f32)> = run.iter().map(to_px).collect();
            for pair in px.windows(2) {
                mask.segment(pair[0], pair[1], LINE_HALF_WIDTH);
            }
            if with_markers || px.len() == 1 {
                for &p in &px {
                    mask.disc(p, MARKER_RADIUS);
                }
            }
        }
        canvas.composite(&mask, PALETTE[i % PALETTE.len()]);
    }
}

fn min_max(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)))
}

/// An axis over [min, max] padded by `pad` of the span (a degenerate span gets a visible band),
/// with about `target` nice ticks inside it.
fn make_axis(min: f64, max: f64, pad: f64, target: usize, integer: bool) -> Axis {
    let (mut lo, mut hi) = (min, max);
    if !(hi - lo).is_finite() {
        (lo, hi) = (lo.max(-f64::MAX / 4.0), hi.min(f64::MAX / 4.0));
    }
    if hi - lo <= f64::EPSILON * lo.abs().max(hi.abs()) {
        let band = if lo == 0.0 {
            1.0
        } else if integer {
            lo.abs().max(1.0) * 0.1
        } else {
            lo.abs() * 0.1
        };
        let band = if integer { band.max(1.0) } else { band };
        (lo, hi) = (lo - band, hi + band);
    } else {
        let span = hi - lo;
        (lo, hi) = (lo - pad * span, hi + pad * span);
    }
    let mut step = nice_step((hi - lo) / target.max(1) as f64);
    if integer {
        step = step.max(1.0);
    }
    let mut ticks = Vec::new();
    if step.is_finite() && step > 0.0 {
        let first = (lo / step).ceil();
        for k in 0..=64 {
            let t = (first + k as f64) * step;
            if t > hi + step * 1e-9 {
                break;
            }
            ticks.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        }
    }
    let labels = tick_labels(&ticks, step);
    Axis { lo, hi, ticks, labels }
}

/// `raw` rounded to 1, 2 or 5 times a power of ten.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return f64::NAN;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let frac = raw / mag;
    let nice = if frac < 1.5 {
        1.0
    } else if frac < 3.0 {
        2.0
    } else if frac < 7.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Labels for ticks `step` apart, all in one format: fixed with just enough decimals, or
/// scientific (`1.5e-6`) for very large or very small magnitudes.
fn tick_labels(ticks: &[f64], step: f64) -> Vec<String> {
    let max_abs = ticks.iter().fold(0f64, |m, t| m.max(t.abs()));
    if max_abs == 0.0 {
        return ticks.iter().map(|_| "0".to_string()).collect();
    }
    let step_exp = (step.log10() + 1e-9).floor() as i32;
    let decimals = (-step_exp).max(0) as usize;
    if !(1e-3..1e6).contains(&max_abs) || decimals > 5 {
        let mag_exp = max_abs.log10().floor() as i32;
        let digits = (mag_exp - step_exp).clamp(0, 4) as usize;
        ticks
            .iter()
            .map(|&t| if t == 0.0 { "0".into() } else { format!("{t:.digits$e}") })
            .collect()
    } else {
        ticks.iter().map(|&t| format!("{t:.decimals$}")).collect()
    }
}

/// `text` cut to fit `max_px` pixels at `scale`, ending in ".." when cut.
fn fit_text(text: &str, max_px: usize, scale: usize) -> String {
    let max_chars = (max_px / scale + font::ADVANCE - GLYPH_W) / font::ADVANCE;
    if text.chars().count() <= max_chars {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(max_chars.saturating_sub(2)).collect();
    cut.push_str("..");
    cut
}

// ---------------------------------------------------------------------------------------------
// Raster

/// An RGB image, row-major.
struct Canvas {
    w: usize,
    h: usize,
    px: Vec<Rgb>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Self {
            w,
            h,
            px: vec![WHITE; w * h],
        }
    }

    fn fill(&mut self, x0: i64, y0: i64, w: usize, h: usize, c: Rgb) {
        let xa = x0.clamp(0, self.w as i64) as usize;
        let xb = (x0 + w as i64).clamp(0, self.w as i64) as usize;
        for y in y0.max(0)..(y0 + h as i64).min(self.h as i64) {
            let row = y as usize * self.w;
            self.px[row + xa..row + xb].fill(c);
        }
    }

    fn hline(&mut self, x0: usize, x1: usize, y: usize, c: Rgb) {
        self.fill(x0 as i64, y as i64, (x1 + 1).saturating_sub(x0), 1, c);
    }

    fn vline(&mut self, x: usize, y0: usize, y1: usize, c: Rgb) {
        self.fill(x as i64, y0 as i64, 1, (y1 + 1).saturating_sub(y0), c);
    }

    fn frame(&mut self, x0: usize, y0: usize, x1: usize, y1: usize, c: Rgb) {
        self.hline(x0, x1, y0, c);
        self.hline(x0, x1, y1, c);
        self.vline(x0, y0, y1, c);
        self.vline(x1, y0, y1, c);
    }

    /// Draws `text` with its top-left corner at (x, y), each font pixel `scale` pixels square.
    fn text(&mut self, x: i64, y: i64, text: &str, scale: usize, c: Rgb) {
        for (i, ch) in text.chars().enumerate() {
            let gx = x + (i * font::ADVANCE * scale) as i64;
            for (row, bits) in font::glyph(ch).iter().enumerate() {
                for col in 0..GLYPH_W {
                    if bits & (1 << (GLYPH_W - 1 - col)) != 0 {
                        let (px, py) = (gx + (col * scale) as i64, y + (row * scale) as i64);
                        self.fill(px, py, scale, scale, c);
                    }
                }
            }
        }
    }

    /// [`Self::text`] drawn twice, one pixel apart: a faux bold for titles.
    fn bold_text(&mut self, x: i64, y: i64, text: &str, scale: usize, c: Rgb) {
        self.text(x, y, text, scale, c);
        self.text(x + 1, y, text, scale, c);
    }

    /// Blends colour `c` over the canvas with the mask's coverage as alpha.
    fn composite(&mut self, mask: &Mask, c: Rgb) {
        for my in 0..mask.h {
            for mx in 0..mask.w {
                let a = mask.cov[my * mask.w + mx];
                let (x, y) = (mask.x0 + mx, mask.y0 + my);
                if a <= 0.0 || x >= self.w || y >= self.h {
                    continue;
                }
                let p = &mut self.px[y * self.w + x];
                for k in 0..3 {
                    p[k] = (p[k] as f32 * (1.0 - a) + c[k] as f32 * a).round() as u8;
                }
            }
        }
    }

    fn encode_png(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.w as u32, self.h as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(self.px.as_flattened())?;
        writer.finish()?;
        Ok(out)
    }
}

/// Anti-aliased coverage (0..=1) over a rectangle of the canvas; shapes outside are clipped.
struct Mask {
    x0: usize,
    y0: usize,
    w: usize,
    h: usize,
    cov: Vec<f32>,
}

impl Mask {
    fn new(x0: usize, y0: usize, w: usize, h: usize) -> Self {
        Self {
            x0,
            y0,
            w,
            h,
            cov: vec![0.0; w * h],
        }
    }

    fn clear(&mut self) {
        self.cov.fill(0.0);
    }

    /// Raises coverage to `coverage(distance to the shape)` over the pixels near it.
    fn raise(&mut self, (xa, ya, xb, yb): (f32, f32, f32, f32), coverage: impl Fn(f32, f32) -> f32) {
        let clip = |v: f32, lo: usize, n: usize| (v.floor() as i64 - lo as i64).clamp(0, n as i64) as usize;
        let (ia, ib) = (clip(xa, self.x0, self.w), clip(xb + 1.0, self.x0, self.w));
        let (ja, jb) = (clip(ya, self.y0, self.h), clip(yb + 1.0, self.y0, self.h));
        for j in ja..jb {
            let py = (self.y0 + j) as f32 + 0.5;
            for i in ia..ib {
                let px = (self.x0 + i) as f32 + 0.5;
                let c = coverage(px, py).clamp(0.0, 1.0);
                let cell = &mut self.cov[j * self.w + i];
                *cell = cell.max(c);
            }
        }
    }

    /// A line segment of half-width `hw` with round caps.
    fn segment(&mut self, a: (f32, f32), b: (f32, f32), hw: f32) {
        if !(a.0.is_finite() && a.1.is_finite() && b.0.is_finite() && b.1.is_finite()) {
            return;
        }
        let r = hw + 1.0;
        let bbox = (a.0.min(b.0) - r, a.1.min(b.1) - r, a.0.max(b.0) + r, a.1.max(b.1) + r);
        let (dx, dy) = (b.0 - a.0, b.1 - a.1);
        let len2 = dx * dx + dy * dy;
        self.raise(bbox, |px, py| {
            let t = if len2 > 0.0 {
                (((px - a.0) * dx + (py - a.1) * dy) / len2).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let (ex, ey) = (px - (a.0 + t * dx), py - (a.1 + t * dy));
            hw + 0.5 - (ex * ex + ey * ey).sqrt()
        });
    }

    /// A filled disc of radius `r`.
    fn disc(&mut self, c: (f32, f32), r: f32) {
        if !(c.0.is_finite() && c.1.is_finite()) {
            return;
        }
        let bbox = (c.0 - r - 1.0, c.1 - r - 1.0, c.0 + r + 1.0, c.1 + r + 1.0);
        self.raise(bbox, |px, py| {
            r + 0.5 - ((px - c.0).powi(2) + (py - c.1).powi(2)).sqrt()
        });
    }
}
