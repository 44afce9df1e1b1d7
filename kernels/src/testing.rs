//! Test helpers shared by the kernel tests and the model tests of other crates: a seeded normal
//! generator (no `rand` dependency, same numbers on every machine, state saveable for resume), autograd gradients through
//! candle's graph, central finite differences in f64, and a norm-wise relative error.
use candle_core::{DType, Device, Result, Tensor, Var};

/// SplitMix64 + Box-Muller: deterministic standard normals.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// The generator's whole state: saving it and [`Rng::from_state`] resume the exact sequence.
    pub fn state(&self) -> u64 {
        self.0
    }
    pub fn from_state(state: u64) -> Self {
        Rng(state)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// A tensor of `N(0, std^2)` values of the given shape and dtype, on `device`.
    pub fn randn(&mut self, shape: &[usize], std: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.normal() * std).collect();
        Tensor::from_vec(v, shape, device)?.to_dtype(dtype)
    }
}

/// Gradients of the scalar `f(inputs)` with respect to every input, through candle's autograd.
/// An input that receives no gradient gets zeros (so a dropped gradient shows up as an error).
pub fn autograd_grads(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.copy()?))
        .collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let grads = y.backward()?;
    ts.iter()
        .map(|t| match grads.get(t) {
            Some(g) => Ok(g.clone()),
            None => t.zeros_like(),
        })
        .collect()
}

/// Central finite differences of the scalar `f` in f64: `(f(x+h) - f(x-h)) / 2h` per element.
/// Inputs must be f64 tensors; `f` is evaluated without gradient tracking.
pub fn finite_diff_grads(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], h: f64) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(inputs.len());
    for k in 0..inputs.len() {
        let base: Vec<f64> = inputs[k].flatten_all()?.to_vec1()?;
        let mut grad = vec![0f64; base.len()];
        for i in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[i] += delta;
                let mut args = inputs.to_vec();
                args[k] = Tensor::from_vec(v, inputs[k].shape(), inputs[k].device())?;
                f(&args)?.to_dtype(DType::F64)?.to_scalar::<f64>()
            };
            grad[i] = (eval(h)? - eval(-h)?) / (2.0 * h);
        }
        out.push(Tensor::from_vec(grad, inputs[k].shape(), inputs[k].device())?);
    }
    Ok(out)
}

/// `max|a - b| / max|b|` (norm-wise relative error; `b` is the reference).
/// A tensor's values as f32, flat (any dtype that widens to f32 exactly: bf16, f16, f32).
pub fn f32_values(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

pub fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        candle_core::bail!("rel_err: shapes differ, {:?} vs {:?}", a.dims(), b.dims());
    }
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let diff = (a - &b)?.abs()?.max(0)?.to_scalar::<f64>()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f64>()?.max(1e-30);
    Ok(diff / scale)
}

/// `sum(y * r)` for a fixed random `r` of `y`'s shape: a scalar objective whose gradient with
/// respect to `y` is `r`, so every output element contributes to every test.
pub fn weighted_sum(y: &Tensor, seed: u64) -> Result<Tensor> {
    let r = Rng::new(seed).randn(y.dims(), 1.0, y.dtype(), y.device())?;
    (y * r)?.sum_all()
}

/// A tiny in-tree fuzzer for the parsers (no nightly, no `cargo fuzz`, no new dependency): seeded
/// byte mutations of valid seeds (bit flips, byte sets, inserts, deletes, duplicated or swapped
/// ranges, dictionary tokens, splices of two seeds, rewritten numbers, truncation) plus inputs a
/// target builds from the same generator. Each input runs on a worker thread under
/// `catch_unwind`, with a deadline, and with its allocations counted on that thread.
///
/// - CI: each target runs its own bounded number of executions (stopping early at 2 s).
///   `VIME_FUZZ_SECS=60` runs each for that many seconds instead; `VIME_FUZZ_SEED` changes the
///   seed, `VIME_FUZZ_EXECS` the bound, `VIME_FUZZ_DEADLINE_MS` the per-input deadline (5000).
/// - A finding is a panic, an input still running at its deadline, or an input that grew its
///   thread's live heap by more than [`MAX_INPUT_HEAP`]. Allocations of more than
///   [`MAX_ONE_ALLOCATION`] are refused while an input runs (a header claiming a huge size must not
///   get it): the allocator prints the input to stderr, then the process aborts.
/// - Counting needs the test binary to declare `#[global_allocator] static A: CountingAlloc =
///   CountingAlloc;`; without it the heap bounds are not checked.
/// - Panics are shrunk (chunks deleted while it still panics) and printed as a byte-string
///   literal to paste into a regression test.
pub mod fuzz {
    use super::Rng;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;
    use std::io::Write as _;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    /// Net heap growth one input may cause on its thread.
    pub const MAX_INPUT_HEAP: usize = 256 << 20;
    /// The largest single allocation an input may ask for.
    pub const MAX_ONE_ALLOCATION: usize = 1 << 30;
    /// CI's wall-clock cap per target when `VIME_FUZZ_SECS` is not set.
    pub const CI_CAP: Duration = Duration::from_secs(2);

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
        static ARMED: Cell<bool> = const { Cell::new(false) };
        static INPUT: Cell<(*const u8, usize)> = const { Cell::new((std::ptr::null(), 0)) };
    }

    /// A global allocator that counts live bytes per thread (see the module doc).
    pub struct CountingAlloc;

    fn note(delta: isize) {
        let _ = LIVE.try_with(|l| {
            let v = l.get() + delta;
            l.set(v);
            let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
        });
    }

    /// Refuses a huge allocation while an input runs, printing that input first.
    fn refuse(size: usize) -> bool {
        if size <= MAX_ONE_ALLOCATION || !ARMED.try_with(Cell::get).unwrap_or(false) {
            return false;
        }
        let _ = ARMED.try_with(|a| a.set(false));
        let mut err = std::io::stderr().lock();
        let _ = writeln!(
            err,
            "fuzz: an input asked for one allocation of {size} bytes; the input (hex):"
        );
        if let Ok((ptr, len)) = INPUT.try_with(Cell::get) {
            if !ptr.is_null() {
                // SAFETY: set by `run_one` from a slice that outlives the armed call.
                let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
                const HEX: &[u8; 16] = b"0123456789abcdef";
                for chunk in bytes.chunks(64) {
                    let mut buf = [0u8; 129];
                    for (i, b) in chunk.iter().enumerate() {
                        buf[2 * i] = HEX[(b >> 4) as usize];
                        buf[2 * i + 1] = HEX[(b & 15) as usize];
                    }
                    buf[2 * chunk.len()] = b'\n';
                    let _ = err.write_all(&buf[..2 * chunk.len() + 1]);
                }
            }
        }
        true
    }

    // SAFETY: every call forwards to `System` with the same arguments; the bookkeeping only
    // touches const-initialised thread-locals without destructors (no allocation, no unwinding).
    unsafe impl GlobalAlloc for CountingAlloc {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            if refuse(layout.size()) {
                return std::ptr::null_mut();
            }
            let p = System.alloc(layout);
            if !p.is_null() {
                note(layout.size() as isize);
            }
            p
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            if refuse(layout.size()) {
                return std::ptr::null_mut();
            }
            let p = System.alloc_zeroed(layout);
            if !p.is_null() {
                note(layout.size() as isize);
            }
            p
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            System.dealloc(ptr, layout);
            note(-(layout.size() as isize));
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            if refuse(new_size) {
                return std::ptr::null_mut();
            }
            let p = System.realloc(ptr, layout, new_size);
            if !p.is_null() {
                note(new_size as isize - layout.size() as isize);
            }
            p
        }
    }

    /// How long and how hard to fuzz, from the environment (see the module doc).
    #[derive(Clone, Debug)]
    pub struct Budget {
        pub seed: u64,
        /// `Some(d)`: run for `d` (VIME_FUZZ_SECS); `None`: the target's execution bound.
        pub duration: Option<Duration>,
        pub execs: Option<u64>,
        pub deadline: Duration,
    }

    impl Budget {
        pub fn from_env() -> Budget {
            let var = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<u64>().ok());
            Budget {
                seed: var("VIME_FUZZ_SEED").unwrap_or(0x5eed),
                duration: var("VIME_FUZZ_SECS").map(Duration::from_secs),
                execs: var("VIME_FUZZ_EXECS"),
                deadline: Duration::from_millis(var("VIME_FUZZ_DEADLINE_MS").unwrap_or(5000)),
            }
        }
    }

    /// What a run found.
    #[derive(Debug)]
    pub struct Finding {
        pub kind: &'static str,
        pub detail: String,
        pub input: Vec<u8>,
    }

    #[derive(Debug)]
    pub struct Report {
        pub target: String,
        pub execs: u64,
        /// Inputs the target accepted (returned `true` for: parsed and went all the way through).
        pub accepted: u64,
        pub elapsed: Duration,
        pub slowest: Duration,
        pub slowest_input: Vec<u8>,
        pub max_heap: usize,
        pub findings: Vec<Finding>,
    }

    impl Report {
        /// Prints the result line (and every finding as a byte-string literal) and panics when
        /// anything was found.
        pub fn assert_clean(&self) {
            println!(
                "fuzz {}: {} execs in {:.2} s ({:.0}/s), {} accepted, slowest input {:.1} ms ({} bytes), max heap growth {:.1} KiB, {} findings",
                self.target,
                self.execs,
                self.elapsed.as_secs_f64(),
                self.execs as f64 / self.elapsed.as_secs_f64().max(1e-9),
                self.accepted,
                self.slowest.as_secs_f64() * 1e3,
                self.slowest_input.len(),
                self.max_heap as f64 / 1024.0,
                self.findings.len()
            );
            if self.slowest > Duration::from_millis(100) {
                println!("  slowest input: {}", byte_literal(&self.slowest_input));
            }
            for f in &self.findings {
                println!("  {} ({}): {}", f.kind, f.detail, byte_literal(&f.input));
            }
            assert!(
                self.findings.is_empty(),
                "fuzz {}: {} findings (inputs printed above)",
                self.target,
                self.findings.len()
            );
        }
    }

    /// `b"..."` with Rust escapes.
    pub fn byte_literal(bytes: &[u8]) -> String {
        let mut s = String::from("b\"");
        for &b in bytes {
            s.extend(std::ascii::escape_default(b).map(char::from));
        }
        s.push('"');
        s
    }

    /// A source of inputs for one target.
    pub struct Inputs {
        pub seeds: Vec<Vec<u8>>,
        /// Tokens worth inserting (keywords, delimiters, interesting numbers).
        pub dict: Vec<Vec<u8>>,
        pub max_len: usize,
    }

    const NUMBERS: &[&str] = &[
        "0",
        "-1",
        "1",
        "-0",
        "255",
        "65536",
        "4294967295",
        "4294967296",
        "9223372036854775807",
        "18446744073709551615",
        "18446744073709551616",
        "99999999999999999999999",
        "1e309",
        "-1e309",
        "1e-400",
        "0.5",
        "NaN",
        "Infinity",
        "1.0e20",
        "-9223372036854775808",
    ];

    impl Inputs {
        /// One input: a mutated seed (or splice of two), 1 to 8 stacked mutations.
        pub fn mutate(&self, rng: &mut Rng) -> Vec<u8> {
            let pick = |rng: &mut Rng, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
            let mut v = if self.seeds.is_empty() {
                Vec::new()
            } else {
                self.seeds[pick(rng, self.seeds.len())].clone()
            };
            for _ in 0..1 + pick(rng, 8) {
                let n = v.len();
                match pick(rng, 13) {
                    0 if n > 0 => {
                        let i = pick(rng, n);
                        v[i] ^= 1 << pick(rng, 8);
                    }
                    1 if n > 0 => {
                        let i = pick(rng, n);
                        v[i] = rng.next_u64() as u8;
                    }
                    2 if n > 0 => {
                        let i = pick(rng, n);
                        v[i] = b"\0\xff\x7f\x80\"{}[]\\\n:,$"[pick(rng, 14)];
                    }
                    3 if n > 0 => {
                        let a = pick(rng, n);
                        let b = (a + 1 + pick(rng, 16.min(n - a))).min(n);
                        v.drain(a..b);
                    }
                    4 => {
                        let at = pick(rng, n + 1);
                        let k = 1 + pick(rng, 8);
                        let bytes: Vec<u8> = (0..k).map(|_| rng.next_u64() as u8).collect();
                        v.splice(at..at, bytes);
                    }
                    5 if n > 0 => {
                        let a = pick(rng, n);
                        let b = (a + 1 + pick(rng, 64.min(n - a))).min(n);
                        let chunk = v[a..b].to_vec();
                        let at = pick(rng, n + 1);
                        v.splice(at..at, chunk);
                    }
                    6 | 7 if !self.dict.is_empty() => {
                        let tok = self.dict[pick(rng, self.dict.len())].clone();
                        let at = pick(rng, n + 1);
                        if pick(rng, 2) == 0 || at == n {
                            v.splice(at..at, tok);
                        } else {
                            let end = (at + tok.len()).min(n);
                            v.splice(at..end, tok);
                        }
                    }
                    8 if self.seeds.len() > 1 => {
                        let other = &self.seeds[pick(rng, self.seeds.len())];
                        let a = pick(rng, n + 1);
                        let b = pick(rng, other.len() + 1);
                        v.truncate(a);
                        v.extend_from_slice(&other[b..]);
                    }
                    9 if n > 0 => v.truncate(pick(rng, n)),
                    10 => {
                        // Rewrite a run of digits (a size, an offset, a count) as an interesting number.
                        let digits: Vec<usize> = (0..n).filter(|&i| v[i].is_ascii_digit()).collect();
                        if !digits.is_empty() {
                            let a = digits[pick(rng, digits.len())];
                            let mut b = a;
                            while b < n && (v[b].is_ascii_digit() || v[b] == b'.') {
                                b += 1;
                            }
                            let num = NUMBERS[pick(rng, NUMBERS.len())].as_bytes().to_vec();
                            v.splice(a..b, num);
                        }
                    }
                    11 if n > 1 => {
                        let (a, b) = (pick(rng, n), pick(rng, n));
                        v.swap(a, b);
                    }
                    _ if n > 0 => {
                        // Repeat a range many times (deep nesting, long runs).
                        let a = pick(rng, n);
                        let b = (a + 1 + pick(rng, 4.min(n - a))).min(n);
                        let chunk = v[a..b].to_vec();
                        let times = 1 + pick(rng, 256);
                        let rep: Vec<u8> = chunk.iter().copied().cycle().take(chunk.len() * times).collect();
                        v.splice(a..a, rep);
                    }
                    _ => {}
                }
                v.truncate(self.max_len);
            }
            v
        }
    }

    type Job = (Vec<u8>, mpsc::Sender<Outcome>);
    struct Outcome {
        accepted: bool,
        panic: Option<String>,
        heap: usize,
        took: Duration,
    }

    fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic".into())
    }

    fn run_one<T: Fn(&[u8]) -> bool>(target: &T, input: &[u8]) -> Outcome {
        let start = LIVE.with(Cell::get);
        PEAK.with(|p| p.set(start));
        INPUT.with(|i| i.set((input.as_ptr(), input.len())));
        ARMED.with(|a| a.set(true));
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| target(input)));
        let took = t0.elapsed();
        ARMED.with(|a| a.set(false));
        INPUT.with(|i| i.set((std::ptr::null(), 0)));
        let heap = (PEAK.with(Cell::get) - start).max(0) as usize;
        Outcome {
            accepted: matches!(r, Ok(true)),
            panic: r.err().map(|p| panic_text(&*p)),
            heap,
            took,
        }
    }

    /// Fuzzes `target` with inputs from `gen` (called with the generator and the
    /// [`Inputs`]; [`Inputs::mutate`] is the usual choice) for `ci_execs` executions, or for the
    /// budget's duration. `target` must not panic, hang or allocate without bound on any input;
    /// it returns whether it accepted the input (counted, to show how deep the inputs get).
    pub fn run<T, G>(name: &str, budget: &Budget, ci_execs: u64, inputs: &Inputs, mut gen: G, target: T) -> Report
    where
        T: Fn(&[u8]) -> bool + Send + Sync + 'static,
        G: FnMut(&mut Rng, &Inputs) -> Vec<u8>,
    {
        // Panics print one line (no backtrace): symbolising a backtrace can take longer than
        // the deadline in a debug build. The harness reports the input either way.
        let prev_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|info| eprintln!("fuzz: {info}")));
        let target = Arc::new(target);
        let (jobs, rx) = mpsc::channel::<Job>();
        let worker_target = target.clone();
        std::thread::Builder::new()
            .name(format!("fuzz-{name}"))
            .spawn(move || {
                for (input, reply) in rx {
                    let _ = reply.send(run_one(&*worker_target, &input));
                }
            })
            .expect("spawning the fuzz worker");
        let mut rng = Rng::new(budget.seed ^ fnv(name.as_bytes()));
        let t0 = Instant::now();
        let (limit, cap) = match budget.duration {
            Some(d) => (u64::MAX, d),
            None => (budget.execs.unwrap_or(ci_execs), CI_CAP),
        };
        let mut report = Report {
            target: name.to_string(),
            execs: 0,
            accepted: 0,
            elapsed: Duration::ZERO,
            slowest: Duration::ZERO,
            slowest_input: Vec::new(),
            max_heap: 0,
            findings: Vec::new(),
        };
        // The seeds themselves first, then generated inputs.
        let mut queue: std::collections::VecDeque<Vec<u8>> = inputs.seeds.iter().cloned().collect();
        while report.execs < limit && t0.elapsed() < cap && report.findings.len() < 5 {
            let input = queue.pop_front().unwrap_or_else(|| gen(&mut rng, inputs));
            let input: Vec<u8> = input.into_iter().take(inputs.max_len).collect();
            let (tx, done) = mpsc::channel();
            jobs.send((input.clone(), tx)).expect("fuzz worker alive");
            report.execs += 1;
            match done.recv_timeout(budget.deadline) {
                Err(_) => {
                    report.findings.push(Finding {
                        kind: "hang",
                        detail: format!("still running after {:?}", budget.deadline),
                        input,
                    });
                    break; // the worker is stuck on it
                }
                Ok(o) => {
                    if o.took > report.slowest {
                        report.slowest = o.took;
                        report.slowest_input = input.clone();
                    }
                    report.accepted += o.accepted as u64;
                    report.max_heap = report.max_heap.max(o.heap);
                    if let Some(msg) = o.panic {
                        let input = shrink(&*target, input);
                        report.findings.push(Finding {
                            kind: "panic",
                            detail: msg,
                            input,
                        });
                    } else if o.heap > MAX_INPUT_HEAP {
                        report.findings.push(Finding {
                            kind: "heap",
                            detail: format!("grew the heap by {} bytes", o.heap),
                            input,
                        });
                    }
                }
            }
        }
        report.elapsed = t0.elapsed();
        std::panic::set_hook(prev_hook);
        report
    }

    /// Deletes chunks of a panicking input while it still panics (at most a few hundred tries).
    fn shrink<T: Fn(&[u8]) -> bool>(target: &T, mut input: Vec<u8>) -> Vec<u8> {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let mut tries = 0;
        let mut chunk = input.len() / 2;
        while chunk > 0 && tries < 400 {
            let mut i = 0;
            while i + chunk <= input.len() && tries < 400 {
                let mut cand = input.clone();
                cand.drain(i..i + chunk);
                tries += 1;
                if catch_unwind(AssertUnwindSafe(|| target(&cand))).is_err() {
                    input = cand;
                } else {
                    i += chunk;
                }
            }
            chunk /= 2;
        }
        std::panic::set_hook(hook);
        input
    }

    fn fnv(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        })
    }

    /// Random JSON text over a small vocabulary of keys and strings, `depth` levels deep at most:
    /// the structure half of a target's inputs.
    pub fn random_json(rng: &mut Rng, depth: usize, keys: &[&str], strings: &[&str]) -> String {
        let pick = |rng: &mut Rng, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
        let leaf = |rng: &mut Rng| -> String {
            match pick(rng, 7) {
                0 => "null".into(),
                1 => ["true", "false"][pick(rng, 2)].into(),
                2 => NUMBERS[pick(rng, NUMBERS.len())].into(),
                3 => (rng.next_u64() % 200).to_string(),
                4 => format!("{}", rng.normal() * 10.0),
                _ if !strings.is_empty() => json_string(strings[pick(rng, strings.len())]),
                _ => "\"\"".into(),
            }
        };
        if depth == 0 {
            return leaf(rng);
        }
        match pick(rng, 4) {
            0 => {
                let n = pick(rng, 5);
                let items: Vec<String> = (0..n).map(|_| random_json(rng, depth - 1, keys, strings)).collect();
                format!("[{}]", items.join(", "))
            }
            1 | 2 => {
                let n = pick(rng, 7);
                let items: Vec<String> = (0..n)
                    .map(|_| {
                        let k = if keys.is_empty() || pick(rng, 8) == 0 {
                            "x"
                        } else {
                            keys[pick(rng, keys.len())]
                        };
                        format!("{}: {}", json_string(k), random_json(rng, depth - 1, keys, strings))
                    })
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
            _ => leaf(rng),
        }
    }

    /// `s` as a JSON string literal.
    pub fn json_string(s: &str) -> String {
        let mut out = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    }
}
