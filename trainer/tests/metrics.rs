//! Metrics outputs: JSONL (round trip, resume, errors, NaN), TensorBoard event files (CRC32C
//! vectors, round trip, a file written by TensorBoard's own writer, corruption, resume marker) and
//! PNG plots (decodable, expected size, curves and colours where expected, degenerate inputs).
//!
//! Set `VIME_METRICS_SAMPLE_DIR=/some/dir` to also keep a sample figure (`sample.png`) and a
//! resumed TensorBoard log folder (`tb/`) there, for looking at by eye and for
//! `tests/fixtures/gen_tb_fixture.py read`.
use anyhow::Result;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use vime_trainer::metrics::plot::{figure_size, PALETTE};
use vime_trainer::metrics::{
    crc32c, masked_crc32c, plot_metrics_file, plot_png, read_metrics, read_scalars, JsonlWriter, MetricsLogger, Panel,
    Series, TbWriter,
};

fn m(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn sample_dir() -> Option<PathBuf> {
    std::env::var_os("VIME_METRICS_SAMPLE_DIR").map(PathBuf::from)
}

// ---------------------------------------------------------------------------------------------
// JSONL

/// Values whose f64 bits must survive the text round trip.
fn awkward_values(step: u64) -> BTreeMap<String, f64> {
    let s = step as f64;
    m(&[
        ("rollout/raw_reward", 0.1 + 0.2 * s),
        ("train/grad_norm", 1.0 / 3.0 + s),
        ("train/lr", 1.2345678901234567e-6 * s),
        ("train/tiny", 5e-324),
        ("train/huge", 1.7976931348623157e308),
        ("eval/arith/pass@1", -0.0),
        ("perf/tokens", 123456789012.0 + s),
    ])
}

#[test]
fn jsonl_round_trip_is_bit_exact() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("nested/run/metrics.jsonl");
    let mut w = JsonlWriter::open(&path, None)?;
    for step in 1..=3 {
        w.log(step, &awkward_values(step))?;
    }
    let back = read_metrics(&path)?;
    assert_eq!(back.len(), 3);
    for (i, (step, metrics)) in back.iter().enumerate() {
        assert_eq!(*step, i as u64 + 1);
        let want = awkward_values(*step);
        assert_eq!(metrics.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        for (k, v) in &want {
            assert_eq!(metrics[k].to_bits(), v.to_bits(), "{k} at step {step}");
        }
    }
    // Each line is an object with step and a plausible wall time.
    for line in fs::read_to_string(&path)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        assert!(v["step"].is_u64());
        assert!(v["time"].as_f64().unwrap() > 1.6e9);
    }
    // Reopening without resume starts afresh.
    JsonlWriter::open(&path, None)?.log(7, &m(&[("a", 1.0)]))?;
    assert_eq!(read_metrics(&path)?, vec![(7, m(&[("a", 1.0)]))]);
    Ok(())
}

#[test]
fn jsonl_non_finite_values_are_null_and_skipped_on_read() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("metrics.jsonl");
    let mut w = JsonlWriter::open(&path, None)?;
    w.log(
        1,
        &m(&[
            ("nan", f64::NAN),
            ("inf", f64::INFINITY),
            ("ninf", f64::NEG_INFINITY),
            ("ok", 2.5),
        ]),
    )?;
    let text = fs::read_to_string(&path)?;
    let v: serde_json::Value = serde_json::from_str(text.trim_end())?;
    assert!(v["nan"].is_null() && v["inf"].is_null() && v["ninf"].is_null());
    assert_eq!(v["ok"], 2.5);
    assert_eq!(read_metrics(&path)?, vec![(1, m(&[("ok", 2.5)]))]);
    Ok(())
}

#[test]
fn jsonl_reserved_names_are_rejected() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut w = JsonlWriter::open(&dir.path().join("m.jsonl"), None)?;
    let err = w.log(1, &m(&[("step", 1.0)])).unwrap_err();
    assert!(format!("{err:#}").contains("reserved"), "{err:#}");
    Ok(())
}

#[test]
fn jsonl_resume_keeps_earlier_lines_bit_exactly_and_drops_later_ones() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("metrics.jsonl");
    let mut w = JsonlWriter::open(&path, None)?;
    for step in 1..=5 {
        w.log(step, &awkward_values(step))?;
    }
    drop(w);
    let original = fs::read(&path)?;
    let first_three: Vec<u8> = original
        .split_inclusive(|&b| b == b'\n')
        .take(3)
        .flatten()
        .copied()
        .collect();

    let mut w = JsonlWriter::open(&path, Some(3))?;
    assert_eq!(fs::read(&path)?, first_three, "kept lines must be byte-identical");
    w.log(4, &m(&[("rollout/raw_reward", 42.0)]))?;
    let back = read_metrics(&path)?;
    assert_eq!(back.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    assert_eq!(back[3].1, m(&[("rollout/raw_reward", 42.0)]));
    assert_eq!(
        file_names(dir.path()),
        vec!["metrics.jsonl"],
        "no temp file left behind"
    );

    // Resuming past the last step keeps everything; resuming with no file creates one.
    let before = fs::read(&path)?;
    drop(JsonlWriter::open(&path, Some(100))?);
    assert_eq!(fs::read(&path)?, before);
    let fresh = dir.path().join("new/metrics.jsonl");
    JsonlWriter::open(&fresh, Some(3))?.log(4, &m(&[("a", 1.0)]))?;
    assert_eq!(read_metrics(&fresh)?, vec![(4, m(&[("a", 1.0)]))]);
    Ok(())
}

#[test]
fn jsonl_malformed_line_names_file_and_line_and_leaves_the_file_untouched() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("metrics.jsonl");
    let good = "{\"step\":1,\"time\":1.0,\"a\":1}\n";
    for bad in [
        "{\"step\":2,\"time\":1.0,\"a\":",
        "{\"time\":1.0,\"a\":2}",
        "{\"step\":2,\"a\":\"x\"}",
        "[1,2]",
    ] {
        let content = format!("{good}{bad}\n{good}");
        fs::write(&path, &content)?;
        let err = JsonlWriter::open(&path, Some(1))
            .err()
            .expect("malformed line must fail the resume");
        let msg = format!("{err:#}");
        assert!(msg.contains(&format!("{}:2", path.display())), "{msg}");
        assert_eq!(fs::read_to_string(&path)?, content, "file must be left as it was");
        let msg = format!("{:#}", read_metrics(&path).unwrap_err());
        assert!(msg.contains(&format!("{}:2", path.display())), "{msg}");
    }
    Ok(())
}

#[test]
fn jsonl_torn_last_line_is_skipped() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("metrics.jsonl");
    fs::write(&path, "{\"step\":1,\"a\":1}\n\n{\"step\":2,\"a\":2}\n{\"step\":3,\"a\"")?;
    assert_eq!(read_metrics(&path)?, vec![(1, m(&[("a", 1.0)])), (2, m(&[("a", 2.0)]))]);
    JsonlWriter::open(&path, Some(10))?.log(3, &m(&[("a", 3.0)]))?;
    assert_eq!(fs::read_to_string(&path)?.lines().count(), 3);
    assert_eq!(read_metrics(&path)?.len(), 3);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// TensorBoard

#[test]
fn crc32c_standard_vectors() {
    // RFC 3720 (iSCSI) B.4 and the usual check value.
    assert_eq!(crc32c(b""), 0);
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
    let ascending: Vec<u8> = (0..32).collect();
    assert_eq!(crc32c(&ascending), 0x46DD_794E);
    let descending: Vec<u8> = (0..32).rev().collect();
    assert_eq!(crc32c(&descending), 0x113F_DB5C);
    let m = crc32c(b"123456789");
    assert_eq!(
        masked_crc32c(b"123456789"),
        m.rotate_right(15).wrapping_add(0xa282_ead8)
    );
}

#[test]
fn tb_write_then_read_back() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut tb = TbWriter::create(&dir.path().join("tb"))?;
    let name = tb.path().file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("events.out.tfevents.") && name.ends_with(".vime"),
        "{name}"
    );
    tb.add_scalars(0, 1.7e9, &m(&[("train/loss", 2.5)]))?;
    tb.add_scalars(
        1,
        1.7e9 + 1.0,
        &m(&[("train/loss", 0.1), ("rollout/raw_reward", -1.0 / 3.0), ("x", f64::NAN)]),
    )?;
    tb.add_scalars(
        1 << 40,
        1.7e9 + 2.0,
        &m(&[("eval/arith/pass@1", 1e-7), ("inf", f64::INFINITY)]),
    )?;
    tb.flush()?;
    let want = vec![
        (0, "train/loss".to_string(), 2.5f32),
        (1, "rollout/raw_reward".to_string(), (-1.0f64 / 3.0) as f32),
        (1, "train/loss".to_string(), 0.1f32),
        (1 << 40, "eval/arith/pass@1".to_string(), 1e-7f32),
    ];
    assert_eq!(read_scalars(tb.path())?, want);
    // A second writer in the same second gets its own file.
    let other = TbWriter::create(&dir.path().join("tb"))?;
    assert_ne!(other.path(), tb.path());
    Ok(())
}

/// Written by TensorBoard's own `EventFileWriter` (tests/fixtures/gen_tb_fixture.py write).
#[test]
fn tb_reads_file_written_by_tensorboard() -> Result<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tb");
    let path = dir.join("events.out.tfevents.1700000000.fixture.tensorboard");
    let want: Vec<(u64, String, f32)> = vec![
        (0, "train/loss".into(), 2.5),
        (0, "train/lr".into(), 1e-6),
        (1, "train/loss".into(), 0.1),
        (1, "rollout/raw_reward".into(), -0.333_333_34),
        (2, "eval/arith/pass@1".into(), 0.75),
        (1 << 40, "train/loss".into(), 3.4028235e38),
        (1 << 40, "train/neg".into(), -123.456),
    ];
    assert_eq!(read_scalars(&path)?, want);
    Ok(())
}

/// Record offsets of an event file, by walking the length fields.
fn record_offsets(data: &[u8]) -> Vec<usize> {
    let mut offsets = Vec::new();
    let mut pos = 0;
    while pos < data.len() {
        offsets.push(pos);
        pos += 16 + u64::from_le_bytes(data[pos..pos + 8].try_into().unwrap()) as usize;
    }
    offsets
}

#[test]
fn tb_corruption_is_detected_with_file_and_offset() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut tb = TbWriter::create(dir.path())?;
    for step in 1..=3 {
        tb.add_scalars(step, 1.7e9, &m(&[("a", step as f64), ("b", 0.5)]))?;
    }
    tb.flush()?;
    let path = tb.path().to_path_buf();
    let clean = fs::read(&path)?;
    let offsets = record_offsets(&clean);
    assert_eq!(offsets.len(), 4, "file version + 3 steps");
    assert_eq!(read_scalars(&path)?.len(), 6);

    let third = offsets[2];
    let cases = [
        (third + 12 + 5, "data CRC"), // a byte of the event
        (third + 2, "length CRC"),    // a byte of the length
        (offsets[3] - 1, "data CRC"), // a byte of the data CRC
        (third + 9, "length CRC"),    // a byte of the length CRC
    ];
    for (byte, what) in cases {
        let mut bad = clean.clone();
        bad[byte] ^= 0x20;
        fs::write(&path, &bad)?;
        let msg = format!("{:#}", read_scalars(&path).unwrap_err());
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains(&format!("at byte {third}")), "{msg}");
        assert!(msg.contains(what), "{msg}");
    }
    // A cut-off tail is reported too.
    fs::write(&path, &clean[..clean.len() - 3])?;
    let msg = format!("{:#}", read_scalars(&path).unwrap_err());
    assert!(
        msg.contains(&format!("at byte {}", offsets[3])) && msg.contains("truncated"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn metrics_logger_writes_both_and_resumes() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let keep = sample_dir();
    let root = keep.as_deref().unwrap_or(dir.path());
    let (jsonl, tb_dir) = (root.join("metrics.jsonl"), root.join("tb"));
    let _ = fs::remove_dir_all(&tb_dir);

    let mut logger = MetricsLogger::open(Some(&jsonl), Some(&tb_dir), None)?;
    for step in 1..=5 {
        logger.log(
            step,
            &m(&[
                ("train/loss", 1.0 / step as f64),
                ("rollout/raw_reward", step as f64 * 0.1),
            ]),
        )?;
    }
    logger.flush()?;
    drop(logger);
    std::thread::sleep(std::time::Duration::from_millis(10));

    // Resume from a checkpoint at step 3: steps 4 and 5 are recomputed with other values.
    let mut logger = MetricsLogger::open(Some(&jsonl), Some(&tb_dir), Some(3))?;
    for step in 4..=5 {
        logger.log(
            step,
            &m(&[
                ("train/loss", 10.0 + step as f64),
                ("rollout/raw_reward", -(step as f64)),
            ]),
        )?;
    }
    logger.flush()?;

    let rows = read_metrics(&jsonl)?;
    assert_eq!(rows.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
    assert_eq!(rows[2].1["train/loss"], 1.0 / 3.0);
    assert_eq!(rows[4].1["train/loss"], 15.0);

    // TensorBoard reads a folder's files in name order: the first run's file sorts first.
    let files = file_names(&tb_dir);
    assert_eq!(files.len(), 2, "{files:?}");
    let first = read_scalars(&tb_dir.join(&files[0]))?;
    let resumed = read_scalars(&tb_dir.join(&files[1]))?;
    assert_eq!(first.len(), 10);
    assert_eq!(first[9], (5, "train/loss".to_string(), 0.2));
    assert_eq!(resumed.len(), 4);
    assert_eq!(resumed[3], (5, "train/loss".to_string(), 15.0));
    // Each file starts with the file version, then a session START at its first step: 0 for the
    // fresh run, 4 for the run resumed after step 3.
    for (file, first_step) in files.iter().zip([0u8, 4]) {
        let bytes = fs::read(tb_dir.join(file))?;
        let second_record = record_offsets(&bytes)[1];
        let len = u64::from_le_bytes(bytes[second_record..second_record + 8].try_into()?) as usize;
        let event = &bytes[second_record + 12..second_record + 12 + len];
        // wall_time (9 bytes), step (omitted when 0), session_log { status: START }.
        let step_field: &[u8] = if first_step == 0 { &[] } else { &[0x10, first_step] };
        assert_eq!(&event[9..], [step_field, &[0x3a, 2, 0x08, 0x01]].concat(), "{file}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// PNG

/// A small deterministic noise source.
fn noise(state: &mut u64) -> f64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*state >> 11) as f64 / (1u64 << 53) as f64) - 0.5
}

/// Four panels that look like an RL run: dense noisy curves, a schedule, sparse eval points.
fn sample_panels() -> Vec<Panel> {
    let mut rng = 7u64;
    let steps = 0..300u64;
    let curve = |f: &dyn Fn(f64) -> f64| steps.clone().map(|s| (s as f64, f(s as f64))).collect::<Vec<_>>();
    let reward: Vec<(f64, f64)> = steps
        .clone()
        .map(|s| {
            (
                s as f64,
                0.8 - 0.6 * (-(s as f64) / 80.0).exp() + 0.08 * noise(&mut rng),
            )
        })
        .collect();
    let reward_std: Vec<(f64, f64)> = steps
        .clone()
        .map(|s| {
            (
                s as f64,
                0.3 + 0.1 * (-(s as f64) / 120.0).exp() + 0.03 * noise(&mut rng),
            )
        })
        .collect();
    let grad_norm: Vec<(f64, f64)> = steps
        .clone()
        .map(|s| {
            (
                s as f64,
                1.5 * (-(s as f64) / 150.0).exp() + 0.4 + 0.3 * noise(&mut rng).abs(),
            )
        })
        .collect();
    let lr = curve(&|s| {
        if s < 30.0 {
            1e-6 * s / 30.0
        } else {
            1e-7 + 0.5 * (1e-6 - 1e-7) * (1.0 + (std::f64::consts::PI * (s - 30.0) / 270.0).cos())
        }
    });
    let eval = |base: f64| {
        (0..7)
            .map(|i| ((i * 50) as f64, base + 0.6 * (1.0 - (-(i as f64) / 2.5).exp())))
            .collect()
    };
    vec![
        Panel {
            title: "rollout reward".into(),
            series: vec![
                Series {
                    label: "rollout/raw_reward".into(),
                    points: reward,
                },
                Series {
                    label: "rollout/raw_reward_std".into(),
                    points: reward_std,
                },
            ],
        },
        Panel {
            title: "eval".into(),
            series: vec![
                Series {
                    label: "eval/arith/pass@1".into(),
                    points: eval(0.2),
                },
                Series {
                    label: "eval/gsm8k/pass@1".into(),
                    points: eval(0.1),
                },
            ],
        },
        Panel {
            title: "gradient norm".into(),
            series: vec![Series {
                label: "train/grad_norm".into(),
                points: grad_norm,
            }],
        },
        Panel {
            title: "learning rate".into(),
            series: vec![Series {
                label: "train/lr".into(),
                points: lr,
            }],
        },
    ]
}

fn decode(path: &Path) -> Result<(u32, u32, Vec<u8>)> {
    let decoder = png::Decoder::new(std::io::BufReader::new(fs::File::open(path)?));
    let mut reader = decoder.read_info()?;
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf)?;
    assert_eq!(info.color_type, png::ColorType::Rgb);
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    buf.truncate(info.buffer_size());
    Ok((info.width, info.height, buf))
}

/// Pixels of colour `c` and non-white pixels in the rectangle [x0, x1) x [y0, y1).
fn count(img: &(u32, u32, Vec<u8>), (x0, y0, x1, y1): (u32, u32, u32, u32), c: [u8; 3]) -> (usize, usize) {
    let (w, _, px) = img;
    let (mut exact, mut ink) = (0, 0);
    for y in y0..y1 {
        for x in x0..x1 {
            let i = 3 * (y * w + x) as usize;
            let p = [px[i], px[i + 1], px[i + 2]];
            exact += (p == c) as usize;
            ink += (p != [255, 255, 255]) as usize;
        }
    }
    (exact, ink)
}

#[test]
fn plot_png_draws_every_panel_with_series_colours() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = sample_dir()
        .unwrap_or_else(|| dir.path().to_path_buf())
        .join("sample.png");
    plot_png(&out, "vime run: qwen3-0.6b grpo arith", &sample_panels())?;
    let img = decode(&out)?;
    let (w, h) = figure_size(4);
    assert_eq!((img.0, img.1), (w, h));
    assert!(w > 1000 && h > 700, "{w}x{h}");
    let top = 80; // below the figure title
    let quads = [
        (0, top, w / 2, h / 2),
        (w / 2, top, w, h / 2),
        (0, h / 2 + 30, w / 2, h),
        (w / 2, h / 2 + 30, w, h),
    ];
    for (i, q) in quads.into_iter().enumerate() {
        let (blue, ink) = count(&img, q, PALETTE[0]);
        assert!(ink > 5000, "panel {i}: {ink} ink pixels");
        assert!(blue > 200, "panel {i}: {blue} pixels of the first series colour");
    }
    // The two-series panels show the second colour; the one-series panels do not.
    assert!(count(&img, quads[0], PALETTE[1]).0 > 200);
    assert!(count(&img, quads[1], PALETTE[1]).0 > 50);
    assert_eq!(count(&img, quads[2], PALETTE[1]).0, 0);
    // The figure title is drawn in the top band.
    assert!(count(&img, (0, 0, w, top), [34, 34, 34]).0 > 100);
    assert_eq!(
        file_names(out.parent().unwrap())
            .iter()
            .filter(|n| n.contains("tmp"))
            .count(),
        0
    );
    Ok(())
}

#[test]
fn plot_png_survives_degenerate_inputs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let series = |label: &str, points: Vec<(f64, f64)>| Series {
        label: label.into(),
        points,
    };
    let panel = |title: &str, series: Vec<Series>| Panel {
        title: title.into(),
        series,
    };
    let panels = vec![
        panel("no series", vec![]),
        panel("empty series", vec![series("empty", vec![])]),
        panel("single point", vec![series("one", vec![(5.0, 0.25)])]),
        panel(
            "constant",
            vec![series("flat", (0..50).map(|s| (s as f64, 0.5)).collect())],
        ),
        panel("all zero at x=0", vec![series("zero", vec![(0.0, 0.0), (0.0, 0.0)])]),
        panel("all nan", vec![series("nan", vec![(1.0, f64::NAN), (f64::NAN, 2.0)])]),
        panel(
            "gaps and infinities",
            vec![series(
                "gappy",
                vec![
                    (0.0, 1.0),
                    (1.0, 2.0),
                    (2.0, f64::NAN),
                    (3.0, f64::INFINITY),
                    (4.0, 3.0),
                    (5.0, -1.0),
                ],
            )],
        ),
        panel(
            "extreme range",
            vec![series("huge", vec![(0.0, -f64::MAX), (1.0, f64::MAX), (2.0, 1e-300)])],
        ),
        panel(
            "tiny values",
            vec![series(
                "lr",
                (0..10).map(|s| (s as f64 * 0.5, 1e-9 * s as f64)).collect(),
            )],
        ),
        panel(
            "a title far too long to fit in one panel of the figure, so it gets cut at the panel edge",
            (0..14)
                .map(|i| {
                    series(
                        &format!("a long legend label number {i} that wraps"),
                        vec![(0.0, i as f64)],
                    )
                })
                .collect(),
        ),
    ];
    let out = sample_dir()
        .unwrap_or_else(|| dir.path().to_path_buf())
        .join("degenerate.png");
    plot_png(&out, "degenerate \u{3b1}\u{3b2} inputs", &panels)?;
    let img = decode(&out)?;
    assert_eq!((img.0, img.1), figure_size(panels.len()));
    // The single point is drawn as a marker in the first colour (third panel: left column, row 2).
    let (w, h) = (img.0, img.1);
    let rows = panels.len().div_ceil(2) as u32;
    let row_h = h / rows;
    assert!(count(&img, (0, row_h, w / 2, 2 * row_h), PALETTE[0]).0 > 10);

    plot_png(&dir.path().join("none.png"), "", &[])?;
    assert_eq!(decode(&dir.path().join("none.png"))?.0, figure_size(0).0);
    Ok(())
}

#[test]
fn plot_metrics_file_plots_present_keys() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let jsonl = dir.path().join("metrics.jsonl");
    let mut w = JsonlWriter::open(&jsonl, None)?;
    for step in 0..40 {
        let mut metrics = m(&[
            ("train/loss", 2.0 / (1.0 + step as f64)),
            ("rollout/raw_reward", step as f64 / 40.0),
        ]);
        if step % 10 == 0 {
            metrics.insert("eval/arith/pass@1".into(), step as f64 / 50.0);
        }
        w.log(step, &metrics)?;
    }
    let out = dir.path().join("plots/metrics.png");
    plot_metrics_file(
        &jsonl,
        &out,
        "from jsonl",
        &[
            ("loss", &["train/loss"]),
            (
                "reward and eval",
                &["rollout/raw_reward", "eval/arith/pass@1", "missing/key"],
            ),
        ],
    )?;
    let img = decode(&out)?;
    assert_eq!((img.0, img.1), figure_size(2));
    let (w, h) = (img.0, img.1);
    assert!(count(&img, (0, 80, w / 2, h), PALETTE[0]).0 > 100);
    assert!(
        count(&img, (w / 2, 80, w, h), PALETTE[1]).0 > 50,
        "eval series drawn second"
    );
    assert_eq!(
        count(&img, (0, 0, w, h), PALETTE[2]).0,
        0,
        "the missing key adds no series"
    );
    Ok(())
}
