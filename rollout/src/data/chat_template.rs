//! Chat templates: a checkpoint's Jinja `chat_template` rendered by minijinja so the text equals
//! HF transformers' `apply_chat_template(..., tokenize=False)` byte for byte.
//!
//! Decisions, each copying what transformers 5 does in `utils/chat_template_utils.py`:
//! - The environment is Jinja2's as HF configures it: `trim_blocks`, `lstrip_blocks`, loop
//!   controls, no autoescape, lenient undefined values, no trailing newline kept. Python string and
//!   dict methods (`startswith`, `split`, `strip('\n')`, `items`, ...) come from minijinja-contrib's
//!   pycompat.
//! - `tojson` is HF's override, `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)`, reimplemented here ([`py_json_dumps`]): `", "` and `": "` separators, no
//!   HTML escaping, Python's float repr, keys in insertion order. minijinja's own `tojson` differs
//!   on every one of these.
//! - Globals `raise_exception(msg)` (fails the render with `msg`) and `strftime_now(fmt)` (UTC
//!   here; HF uses the local clock, which is UTC on the usual container).
//! - The variables are HF's: `messages`, `tools` (none when absent), `documents` (none),
//!   `add_generation_prompt`, the tokenizer's named special tokens (`eos_token`, `pad_token`, ...)
//!   and the caller's kwargs (`enable_thinking`, ...), which override the special tokens.
//! - HF's `{% generation %}` block (assistant-token masks) is a no-op wrapper when rendering text,
//!   so it is rewritten to `{% if true %}` before compiling.
//! - Maps keep insertion order (minijinja's `preserve_order`): parse JSON with [`parse_json`] to
//!   keep a file's key order, which `tojson` of a tool schema shows.
use anyhow::{anyhow, bail, Result};
use minijinja::value::{Kwargs, Serde, ValueKind};
use minijinja::{Environment, ErrorKind, UndefinedBehavior};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// A value handed to a template (messages, tools, kwargs): minijinja's dynamic value.
pub use minijinja::Value as TemplateValue;

const TEMPLATE_NAME: &str = "chat_template";

/// One plain chat message. Anything richer (tool calls, `reasoning_content`) can be passed as
/// JSON through [`parse_json`] or [`to_template_value`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What `apply_chat_template` takes besides the messages.
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Append the assistant header (`<|im_start|>assistant\n`), as slime always does for prompts.
    pub add_generation_prompt: bool,
    /// Tool schemas (a list), or none.
    pub tools: Option<TemplateValue>,
    /// Extra template variables, e.g. `enable_thinking`.
    pub kwargs: BTreeMap<String, TemplateValue>,
}

impl ChatOptions {
    /// `add_generation_prompt` set, nothing else.
    pub fn generation() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            ..Default::default()
        }
    }

    /// Sets one template variable.
    pub fn kwarg(mut self, name: &str, value: impl Into<TemplateValue>) -> Self {
        self.kwargs.insert(name.to_string(), value.into());
        self
    }

    /// Sets `enable_thinking` (Qwen3: `false` appends an empty `<think>\n\n</think>\n\n`).
    pub fn enable_thinking(self, on: bool) -> Self {
        self.kwarg("enable_thinking", on)
    }

    /// Adds every entry of a JSON object (`--apply-chat-template-kwargs`) as template variables.
    pub fn json_kwargs(mut self, kwargs: &serde_json::Map<String, serde_json::Value>) -> Self {
        for (k, v) in kwargs {
            self.kwargs.insert(k.clone(), to_template_value(v));
        }
        self
    }
}

/// Any serde value as a template value. Maps keep the order in which serde yields them
/// (sorted, for a `serde_json::Value` built without serde_json's `preserve_order`).
pub fn to_template_value<T: Serialize + ?Sized>(value: &T) -> TemplateValue {
    TemplateValue::from(Serde(value))
}

/// JSON text as a template value, objects keeping the text's key order (as Python's `json.loads`).
pub fn parse_json(text: &str) -> Result<TemplateValue, serde_json::Error> {
    serde_json::from_str(text)
}

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a Jinja chat template with HF's environment.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<TemplateValue, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| strftime_utc(&fmt, unix_now()));
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_blocks(source))
            .map_err(|e| anyhow!("chat template does not compile: {e:#}"))?;
        Ok(ChatTemplate {
            env,
            special_tokens: Vec::new(),
        })
    }

    /// Sets the named special tokens (`eos_token` -> `<|im_end|>`, ...) the template sees.
    pub fn with_special_tokens(mut self, tokens: Vec<(String, String)>) -> Self {
        self.special_tokens = tokens;
        self
    }

    /// The named special tokens the template sees.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// Renders `messages` (a list of message maps) as HF's `apply_chat_template(tokenize=False)`.
    pub fn render(&self, messages: &TemplateValue, opts: &ChatOptions) -> Result<String> {
        if messages.kind() != ValueKind::Seq {
            bail!("messages must be a list, got {}", value_kind_name(messages));
        }
        if messages.len() == Some(0) {
            bail!("cannot apply a chat template to an empty conversation");
        }
        let mut ctx: BTreeMap<String, TemplateValue> = BTreeMap::new();
        for (name, token) in &self.special_tokens {
            ctx.insert(name.clone(), TemplateValue::from(token.as_str()));
        }
        for (name, value) in &opts.kwargs {
            if matches!(
                name.as_str(),
                "messages" | "tools" | "documents" | "add_generation_prompt"
            ) {
                bail!("chat template kwarg `{name}` clashes with a variable apply_chat_template sets itself");
            }
            ctx.insert(name.clone(), value.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("tools".into(), opts.tools.clone().unwrap_or(TemplateValue::from(())));
        ctx.insert("documents".into(), TemplateValue::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            TemplateValue::from(opts.add_generation_prompt),
        );
        let template = self.env.get_template(TEMPLATE_NAME).expect("added in new");
        template
            .render(TemplateValue::from(ctx))
            .map_err(|e| anyhow!("chat template render failed: {e:#}"))
    }

    /// [`render`](Self::render) for any serde list of messages (e.g. `&[ChatMessage]`).
    pub fn render_messages<M: Serialize + ?Sized>(&self, messages: &M, opts: &ChatOptions) -> Result<String> {
        self.render(&to_template_value(messages), opts)
    }
}

/// `{% generation %}` / `{% endgeneration %}` (HF's assistant-mask extension) become a no-op
/// `{% if true %}` / `{% endif %}`, keeping their whitespace-control marks.
fn rewrite_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let body = inner.trim_start_matches(['-', '+']).trim_end_matches(['-', '+']);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => {
                let open = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let close = &inner[inner.trim_end_matches(['-', '+']).len()..];
                let _ = write!(out, "{{%{open} {word} {close}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
/// (`separators` and `sort_keys` by keyword only: minijinja functions take at most five arguments).
fn tojson_filter(
    value: &TemplateValue,
    ensure_ascii: Option<TemplateValue>,
    indent: Option<TemplateValue>,
    kwargs: Kwargs,
) -> Result<TemplateValue, minijinja::Error> {
    let pick = |pos: Option<TemplateValue>, name: &str| -> Result<Option<TemplateValue>, minijinja::Error> {
        Ok(match pos {
            Some(v) => Some(v),
            None => kwargs.get::<Option<TemplateValue>>(name)?,
        })
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?
        .map(|v| v.is_true())
        .unwrap_or(false);
    let sort_keys = pick(None, "sort_keys")?.map(|v| v.is_true()).unwrap_or(false);
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
        },
    };
    let separators = match pick(None, "separators")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            let parts: Vec<String> = v.try_iter()?.map(|p| p.to_string()).collect();
            let [item, key] = <[String; 2]>::try_from(parts).map_err(|_| {
                minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be a pair of strings",
                )
            })?;
            Some((item, key))
        }
    };
    kwargs.assert_all_used()?;
    let opts = PyJsonOptions {
        ensure_ascii,
        indent,
        separators,
        sort_keys,
    };
    py_json_dumps(value, &opts).map(TemplateValue::from)
}

/// The arguments of Python's `json.dumps` that HF's `tojson` exposes.
#[derive(Debug, Clone, Default)]
pub struct PyJsonOptions {
    pub ensure_ascii: bool,
    /// The indent unit; `None` writes everything on one line.
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; default `(", ", ": ")`, or `(",", ": ")` with an indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// Python's `json.dumps(value, ...)` for a template value.
pub fn py_json_dumps(value: &TemplateValue, opts: &PyJsonOptions) -> Result<String, minijinja::Error> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if opts.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    let w = PyJsonWriter {
        opts,
        item_sep,
        key_sep,
    };
    w.write(&mut out, value, 0)?;
    Ok(out)
}

struct PyJsonWriter<'a> {
    opts: &'a PyJsonOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl PyJsonWriter<'_> {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(unit) = &self.opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(unit);
            }
        }
    }

    fn write(&self, out: &mut String, v: &TemplateValue, level: usize) -> Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.write_number(out, v)?,
            ValueKind::String => write_py_json_str(out, v.as_str().unwrap_or_default(), self.opts.ensure_ascii),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<TemplateValue> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write(out, item, level + 1)?;
                }
                self.newline(out, level);
                out.push(']');
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, TemplateValue)> = Vec::new();
                for key in v.try_iter()? {
                    let item = v.get_item(&key)?;
                    entries.push((py_json_key(&key)?, item));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, level + 1);
                    write_py_json_str(out, key, self.opts.ensure_ascii);
                    out.push_str(self.key_sep);
                    self.write(out, item, level + 1)?;
                }
                self.newline(out, level);
                out.push('}');
            }
            kind => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of kind {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn write_number(&self, out: &mut String, v: &TemplateValue) -> Result<(), minijinja::Error> {
        if v.is_integer() {
            let _ = write!(out, "{v}");
        } else {
            out.push_str(&py_float_repr(f64::try_from(v.clone())?));
        }
        Ok(())
    }
}

/// Python's `json.dumps` key coercion: strings as they are, numbers, booleans and none as text.
fn py_json_key(key: &TemplateValue) -> Result<String, minijinja::Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
        ValueKind::None => "null".to_string(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => py_float_repr(f64::try_from(key.clone())?),
        kind => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

/// A JSON string literal as Python's encoder writes it (lowercase `\u00xx` escapes; with
/// `ensure_ascii`, every non-ASCII or DEL character escaped, astral ones as surrogate pairs).
fn write_py_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional when the decimal
/// exponent is in [-4, 16), scientific (`1e-05`, `1.5e+16`) otherwise; `NaN`, `Infinity`.
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // Rust's `{:e}` is the shortest round-trip representation too: "d[.ddd]e<exp>".
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// `datetime.strftime` for a UTC unix time, with the C locale's names. Supports the usual codes
/// (`%Y %y %m %d %e %H %I %M %S %p %j %B %b %h %A %a %w %u %F %T %D %%`); others stay as written.
pub fn strftime_utc(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (secs / 3600, secs % 3600 / 60, secs % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let month_name = MONTHS[(month - 1) as usize];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(code) = chars.next() else {
            out.push('%');
            break;
        };
        let _ = match code {
            'Y' => write!(out, "{year}"),
            'y' => write!(out, "{:02}", year.rem_euclid(100)),
            'm' => write!(out, "{month:02}"),
            'd' => write!(out, "{day:02}"),
            'e' => write!(out, "{day:2}"),
            'H' => write!(out, "{hour:02}"),
            'I' => write!(out, "{hour12:02}"),
            'M' => write!(out, "{minute:02}"),
            'S' => write!(out, "{second:02}"),
            'p' => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            'j' => write!(out, "{yday:03}"),
            'B' => write!(out, "{month_name}"),
            'b' | 'h' => write!(out, "{}", &month_name[..3]),
            'A' => write!(out, "{}", DAYS[weekday]),
            'a' => write!(out, "{}", &DAYS[weekday][..3]),
            'w' => write!(out, "{}", (weekday + 1) % 7),
            'u' => write!(out, "{}", weekday + 1),
            'F' => write!(out, "{year}-{month:02}-{day:02}"),
            'T' => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            'D' => write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

/// Reads a template value's string, for error messages and checks.
pub(crate) fn value_kind_name(v: &TemplateValue) -> String {
    match v.kind() {
        ValueKind::Seq => "list".into(),
        ValueKind::Map => "object".into(),
        ValueKind::None => "null".into(),
        kind => kind.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        // python3 -c "print([repr(x) for x in [1.0, 0.1, 1e16, 1e15, 1e-05, 0.0001, 1.5e+16, -2.5, 123456.789, 1e22]])"
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e16, "1.5e+16"),
            (-2.5, "-2.5"),
            (123456.789, "123456.789"),
            (1e22, "1e+22"),
            (-0.0, "-0.0"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC was a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %j %A %a %B %b %I%p %%", t),
            "2024-02-29 13:05:09 060 Thursday Thu February Feb 01PM %"
        );
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
    }

    #[test]
    fn generation_blocks_become_ifs() {
        let src = "{%- generation -%}x{% endgeneration %}{% if a %}y{% endif %}";
        assert_eq!(
            rewrite_generation_blocks(src),
            "{%- if true -%}x{% endif %}{% if a %}y{% endif %}"
        );
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let err = t
            .render_messages(&[ChatMessage::new("user", "hi")], &ChatOptions::default())
            .unwrap_err();
        assert!(format!("{err:#}").contains("no system role"), "{err:#}");
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ messages[0] | tojson(sort_keys=true, separators=[',', ':']) }}|{{ messages[0].content | tojson(ensure_ascii=true) }}",
        )
        .unwrap();
        let msgs = parse_json(
            r#"[{"role": "user", "content": "é<&>\"\u0001😀", "n": [1, 2.0, 1e-7, null, true, {}], "a": []}]"#,
        )
        .unwrap();
        let got = t.render(&msgs, &ChatOptions::default()).unwrap();
        // python3: json.dumps(m, ensure_ascii=False) | json.dumps(m, ensure_ascii=False, indent=2)
        //          | json.dumps(m, ensure_ascii=False, sort_keys=True, separators=(',', ':'))
        //          | json.dumps(m['content'])
        let want = concat!(
            r#"{"role": "user", "content": "é<&>\"\u0001😀", "n": [1, 2.0, 1e-07, null, true, {}], "a": []}"#,
            "|{\n  \"role\": \"user\",\n  \"content\": \"é<&>\\\"\\u0001😀\",\n  \"n\": [\n    1,\n    2.0,\n    1e-07,\n    null,\n    true,\n    {}\n  ],\n  \"a\": []\n}",
            r#"|{"a":[],"content":"é<&>\"\u0001😀","n":[1,2.0,1e-07,null,true,{}],"role":"user"}"#,
            r#"|"\u00e9<&>\"\u0001\ud83d\ude00""#,
        );
        assert_eq!(got, want);
    }
}
