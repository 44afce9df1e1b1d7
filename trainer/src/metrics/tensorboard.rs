//! TensorBoard event files, written by hand: TFRecord framing around `tensorflow.Event` protos.
//!
//! Decisions:
//! - No protobuf or TensorFlow crate: the three messages we need (Event, Summary, Summary.Value)
//!   are a few dozen bytes of hand-encoded protobuf, and CRC32C is a 1 KiB table.
//! - Scalars use the legacy `simple_value` field, which every TensorBoard version reads (newer
//!   ones convert it to a tensor on load). One Event per `add_scalars` call holds all its scalars.
//! - Each call's record is written and flushed at once, so a live dashboard sees every step and a
//!   killed process loses at most the record being written. `flush` also fsyncs.
//! - Each run's file starts with a `SessionLog START` event at its first step
//!   ([`TbWriter::start_session`], called by [`super::MetricsLogger`]): 0 for a fresh run, `s + 1`
//!   for a run resumed after step `s`.
//!   TensorBoard takes a later START as a restart and discards the older files' events from that
//!   step on, which the resumed run recomputes. (Its Python loader ignores the first START it sees
//!   and purges on later ones; its Rust data server and `EventAccumulator` purge on each; so every
//!   file gets exactly one.)
//! - Non-finite values are skipped (TensorBoard charts cannot show them either).
//!
//! Record framing: `u64 LE len | u32 LE masked_crc32c(len bytes) | data | u32 LE masked_crc32c(data)`.
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};

const FILE_VERSION: &str = "brain.Event:2";

/// CRC32C (Castagnoli), reflected polynomial 0x82F63B78, one byte per table lookup.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC32C of `data` (iSCSI / TFRecord checksum).
pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |crc, &b| {
        CRC32C_TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// TFRecord's masked CRC: a rotated CRC plus a constant, so CRCs of CRCs stay well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its CRC, the payload, the payload's CRC.
fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, ((field as u64) << 3) | wire_type as u64);
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `Event { wall_time = 1; step = 2; file_version = 3 | summary = 5 | session_log = 7 }`.
enum Payload<'a> {
    FileVersion,
    Scalars(&'a BTreeMap<String, f64>),
    SessionStart,
}

fn encode_event(wall_time: f64, step: u64, payload: Payload) -> Vec<u8> {
    let mut ev = Vec::new();
    put_key(&mut ev, 1, FIXED64);
    ev.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        put_key(&mut ev, 2, VARINT);
        put_varint(&mut ev, step);
    }
    match payload {
        Payload::FileVersion => put_bytes(&mut ev, 3, FILE_VERSION.as_bytes()),
        Payload::Scalars(metrics) => {
            // Summary { repeated Value value = 1 }, Value { string tag = 1; float simple_value = 2 }.
            let mut summary = Vec::new();
            for (tag, &v) in metrics.iter().filter(|(_, v)| v.is_finite()) {
                let mut value = Vec::new();
                put_bytes(&mut value, 1, tag.as_bytes());
                put_key(&mut value, 2, FIXED32);
                value.extend_from_slice(&(v as f32).to_le_bytes());
                put_bytes(&mut summary, 1, &value);
            }
            put_bytes(&mut ev, 5, &summary);
        }
        // SessionLog { status = 1 (START) }.
        Payload::SessionStart => put_bytes(&mut ev, 7, &[0x08, 0x01]),
    }
    ev
}

/// Writes one `events.out.tfevents.<secs>.<host>.<pid>.vime` file in a log folder.
pub struct TbWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TbWriter {
    /// Creates the log folder and a new event file in it, starting with the file-version event.
    pub fn create(log_dir: &Path) -> Result<Self> {
        fs::create_dir_all(log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
        let now = super::jsonl::unix_time();
        let stem = format!(
            "events.out.tfevents.{}.{}.{}",
            now as u64,
            hostname(),
            std::process::id()
        );
        // TensorBoard reads a folder's files in name order; a second file of the same second and
        // process gets a suffix that sorts after the first.
        let (path, file) = (0..1000)
            .find_map(|n| {
                let path = log_dir.join(if n == 0 {
                    format!("{stem}.vime")
                } else {
                    format!("{stem}.vime.{n}")
                });
                match OpenOptions::new().write(true).create_new(true).open(&path) {
                    Err(e) if e.kind() == ErrorKind::AlreadyExists => None,
                    result => Some(
                        result
                            .map(|f| (path.clone(), f))
                            .with_context(|| format!("creating {}", path.display())),
                    ),
                }
            })
            .context("no free event file name")??;
        let mut writer = Self {
            path,
            out: BufWriter::new(file),
        };
        writer.write_record(&encode_event(now, 0, Payload::FileVersion))?;
        Ok(writer)
    }

    /// Writes one Event at `step` holding every finite scalar of `metrics`, and flushes it.
    pub fn add_scalars(&mut self, step: u64, wall_time: f64, metrics: &BTreeMap<String, f64>) -> Result<()> {
        self.write_record(&encode_event(wall_time, step, Payload::Scalars(metrics)))
    }

    /// Writes a `SessionLog START` at `first_step`; call it once, first thing, with 0 for a fresh
    /// run and `s + 1` for a run resumed after step `s`, so TensorBoard drops the events of earlier
    /// files from `s + 1` on.
    pub fn start_session(&mut self, first_step: u64, wall_time: f64) -> Result<()> {
        self.write_record(&encode_event(wall_time, first_step, Payload::SessionStart))
    }

    /// Flushes buffered records and fsyncs the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("flushing {}", self.path.display()))?;
        self.out
            .get_ref()
            .sync_data()
            .with_context(|| format!("syncing {}", self.path.display()))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_record(&mut self, event: &[u8]) -> Result<()> {
        self.out
            .write_all(&frame_record(event))
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.out
            .flush()
            .with_context(|| format!("flushing {}", self.path.display()))
    }
}

/// The host name for the event file name (TensorBoard's convention), made file-name safe.
fn hostname() -> String {
    let raw = fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "-_".contains(*c))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// A cursor over protobuf bytes; errors say what was cut short.
struct Proto<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Proto<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .context("truncated protobuf field")?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn varint(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("varint longer than 10 bytes")
    }

    /// The next field as (number, wire type, value bytes); varints come back as their value.
    fn field(&mut self) -> Result<(u64, u8, Field<'a>)> {
        let key = self.varint()?;
        let (number, wire_type) = (key >> 3, (key & 7) as u8);
        let value = match wire_type {
            VARINT => Field::Varint(self.varint()?),
            FIXED64 => Field::Bytes(self.take(8)?),
            LEN => {
                let n = self.varint()? as usize;
                Field::Bytes(self.take(n)?)
            }
            FIXED32 => Field::Bytes(self.take(4)?),
            other => bail!("unsupported protobuf wire type {other}"),
        };
        Ok((number, wire_type, value))
    }
}

enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

/// The scalars (`simple_value`) of one Event as (step, tag, value).
fn decode_event(event: &[u8], out: &mut Vec<(u64, String, f32)>) -> Result<()> {
    let mut step = 0u64;
    let mut summaries = Vec::new();
    let mut p = Proto::new(event);
    while !p.done() {
        match p.field()? {
            (2, VARINT, Field::Varint(s)) => step = s,
            (5, LEN, Field::Bytes(b)) => summaries.push(b),
            _ => {}
        }
    }
    for summary in summaries {
        let mut s = Proto::new(summary);
        while !s.done() {
            let (1, LEN, Field::Bytes(value)) = s.field()? else {
                continue;
            };
            let (mut tag, mut simple) = (None, None);
            let mut v = Proto::new(value);
            while !v.done() {
                match v.field()? {
                    (1, LEN, Field::Bytes(t)) => tag = Some(String::from_utf8(t.to_vec()).context("tag is not UTF-8")?),
                    (2, FIXED32, Field::Bytes(b)) => simple = Some(f32::from_le_bytes(b.try_into()?)),
                    _ => {}
                }
            }
            if let (Some(tag), Some(x)) = (tag, simple) {
                out.push((step, tag, x));
            }
        }
    }
    Ok(())
}

/// Reads every `simple_value` scalar of an event file as (step, tag, value), in file order.
/// Both CRCs of every record are checked; errors name the file and the record's byte offset.
pub fn read_scalars(path: &Path) -> Result<Vec<(u64, String, f32)>> {
    let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < data.len() {
        let at = || format!("{} at byte {pos}", path.display());
        let Some(header) = data.get(pos..pos + 12) else {
            bail!("{}: truncated record header", at())
        };
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc32c(len_bytes) != u32::from_le_bytes(len_crc.try_into()?) {
            bail!("{}: record length CRC mismatch (corrupt file)", at());
        }
        let len = u64::from_le_bytes(len_bytes.try_into()?) as usize;
        let body = pos + 12;
        let Some(event) = body.checked_add(len).and_then(|end| data.get(body..end)) else {
            bail!("{}: truncated record (length {len})", at())
        };
        let Some(crc) = data.get(body + len..body + len + 4) else {
            bail!("{}: truncated record CRC", at())
        };
        if masked_crc32c(event) != u32::from_le_bytes(crc.try_into()?) {
            bail!("{}: record data CRC mismatch (corrupt file)", at());
        }
        decode_event(event, &mut out).with_context(at)?;
        pos = body + len + 4;
    }
    Ok(out)
}
