//! The launch contract: torchrun's environment variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), the distributed timeouts
//! (`VIME_DIST_TIMEOUT`, `VIME_DIST_OP_TIMEOUT`, `VIME_DIST_HEARTBEAT_TIMEOUT`), and
//! `--nproc-per-node N` local spawning.
//!
//! Decisions:
//! - None of the six variables set means one process; some but not all set is an error naming
//!   the missing ones (a half-configured launch is a mistake, not a single-process run).
//! - The local launcher does what torchrun's does and no more: children inherit stdio and the
//!   terminal's process group (so Ctrl-C reaches them directly); when one fails, the others get a
//!   grace period to exit through their watchdogs, then are killed.
use anyhow::{anyhow, bail, Context, Result};
use std::ffi::{OsStr, OsString};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// One rank's view of the launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Where rank 0 serves vime's store: `MASTER_PORT`, except under torchrun, whose agent already
    /// serves its own TCPStore there (seen on the GPU machine: `Address already in use`), where
    /// it is `MASTER_PORT + 1`; `VIME_STORE_PORT` overrides both. Every rank derives it the same
    /// way from the same environment.
    pub store_port: u16,
}

impl DistEnv {
    pub const VARS: [&'static str; 6] = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ];

    /// The contract from this process's environment; `None` when none of it is set.
    pub fn from_env() -> Result<Option<DistEnv>> {
        for v in Self::VARS {
            if let Some(val) = std::env::var_os(v) {
                if val.to_str().is_none() {
                    bail!("{v}={val:?} is not valid UTF-8");
                }
            }
        }
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// The contract from any variable lookup (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let vals: Vec<Option<String>> = Self::VARS.iter().map(|v| get(v)).collect();
        if vals.iter().all(Option::is_none) {
            return Ok(None);
        }
        let missing: Vec<&str> = Self::VARS
            .iter()
            .zip(&vals)
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| *k)
            .collect();
        if !missing.is_empty() {
            bail!(
                "the launch environment is incomplete: {} unset (a distributed launch sets all of {})",
                missing.join(", "),
                Self::VARS.join(", ")
            );
        }
        let s = |i: usize| vals[i].as_deref().unwrap_or_default().trim();
        let num = |i: usize| -> Result<usize> {
            s(i).parse::<usize>()
                .map_err(|_| anyhow!("{}={:?} is not a non-negative integer", Self::VARS[i], s(i)))
        };
        let (rank, world_size, local_rank, local_world_size) = (num(0)?, num(1)?, num(2)?, num(3)?);
        let master_addr = s(4).to_string();
        if master_addr.is_empty() {
            bail!("MASTER_ADDR is empty");
        }
        let master_port = s(5)
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| anyhow!("MASTER_PORT={:?} is not a port in 1..=65535", s(5)))?;
        if world_size == 0 {
            bail!("WORLD_SIZE=0: the world size must be at least 1");
        }
        if rank >= world_size {
            bail!("RANK={rank} is out of range for WORLD_SIZE={world_size}");
        }
        if local_world_size == 0 || local_world_size > world_size {
            bail!("LOCAL_WORLD_SIZE={local_world_size} must be in 1..=WORLD_SIZE={world_size}");
        }
        if local_rank >= local_world_size {
            bail!("LOCAL_RANK={local_rank} is out of range for LOCAL_WORLD_SIZE={local_world_size}");
        }
        let store_port = match get("VIME_STORE_PORT") {
            Some(v) => v
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| anyhow!("VIME_STORE_PORT={v:?} is not a port in 1..=65535"))?,
            // torchrun's agent sets TORCHELASTIC_RUN_ID in every worker's environment.
            None if get("TORCHELASTIC_RUN_ID").is_some() => master_port.checked_add(1).ok_or_else(|| {
                anyhow!(
                    "MASTER_PORT={master_port}: under torchrun vime's store takes MASTER_PORT + 1; set VIME_STORE_PORT"
                )
            })?,
            None => master_port,
        };
        Ok(Some(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            store_port,
        }))
    }

    /// Rank `rank` of a one-node launch with the store on loopback at `port`.
    pub fn local(rank: usize, world_size: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            store_port: port,
        }
    }

    /// `MASTER_ADDR:store_port` (see [`DistEnv::store_port`]), bracketing an IPv6 literal.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.store_port)
        } else {
            format!("{}:{}", self.master_addr, self.store_port)
        }
    }
}

/// Every deadline of the distributed layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeouts {
    /// Connecting to the store and every rendezvous wait (`VIME_DIST_TIMEOUT`, default 300 s).
    pub rendezvous: Duration,
    /// One socket read or write of the CPU backend (`VIME_DIST_OP_TIMEOUT`, default 1800 s: long,
    /// because a peer may legitimately compute that long between collectives).
    pub op: Duration,
    /// Silence on a heartbeat connection before its rank is declared dead
    /// (`VIME_DIST_HEARTBEAT_TIMEOUT`, default 15 s).
    pub heartbeat: Duration,
    /// How often the watchdog PINGs (0.5 s).
    pub heartbeat_interval: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            rendezvous: Duration::from_secs(300),
            op: Duration::from_secs(1800),
            heartbeat: Duration::from_secs(15),
            heartbeat_interval: Duration::from_millis(500),
        }
    }
}

impl Timeouts {
    /// The defaults, overridden by the `VIME_DIST_*` variables (seconds, fractions allowed).
    pub fn from_env() -> Result<Timeouts> {
        let mut t = Timeouts::default();
        for (var, slot) in [
            ("VIME_DIST_TIMEOUT", &mut t.rendezvous),
            ("VIME_DIST_OP_TIMEOUT", &mut t.op),
            ("VIME_DIST_HEARTBEAT_TIMEOUT", &mut t.heartbeat),
        ] {
            if let Ok(v) = std::env::var(var) {
                *slot = parse_secs(var, &v)?;
            }
        }
        Ok(t)
    }
}

fn parse_secs(var: &str, v: &str) -> Result<Duration> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| anyhow!("{var}={v:?} is not a positive number of seconds"))
}

/// A free TCP port on loopback (bound, read, released: another process may take it in between,
/// which the store's bind then reports).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(l.local_addr()?.port())
}

/// Removes `--nproc-per-node N` / `--nproc-per-node=N` from `args`; its value if present.
pub fn take_nproc_flag(args: &mut Vec<String>) -> Result<Option<usize>> {
    let Some(i) = args
        .iter()
        .position(|a| a == "--nproc-per-node" || a.starts_with("--nproc-per-node="))
    else {
        return Ok(None);
    };
    let flag = args.remove(i);
    let val = match flag.split_once('=') {
        Some((_, v)) => v.to_string(),
        None if i < args.len() => args.remove(i),
        None => bail!("--nproc-per-node needs a value"),
    };
    match val.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(Some(n)),
        _ => bail!("--nproc-per-node {val:?} is not a positive integer"),
    }
}

/// What `run_local` spawns.
#[derive(Debug, Clone)]
pub struct LocalLaunch {
    pub nproc: usize,
    pub program: OsString,
    pub args: Vec<OsString>,
    /// After the first failure, how long the others get to exit by themselves before SIGKILL.
    pub grace: Duration,
}

impl LocalLaunch {
    pub fn new(nproc: usize, program: impl AsRef<OsStr>, args: &[impl AsRef<OsStr>]) -> Self {
        LocalLaunch {
            nproc,
            program: program.as_ref().to_os_string(),
            args: args.iter().map(|a| a.as_ref().to_os_string()).collect(),
            grace: Duration::from_secs(20),
        }
    }
}

/// How each child of `run_local` ended.
#[derive(Debug)]
pub struct LocalRun {
    pub statuses: Vec<ExitStatus>,
    /// When each child was seen to exit, from the spawn (polled every 10 ms).
    pub exited_after: Vec<Duration>,
    /// Which children the launcher killed after the grace period.
    pub killed: Vec<bool>,
    /// The local rank whose failure is the root cause, if any rank failed ([`root_cause`]).
    pub first_failure: Option<usize>,
}

impl LocalRun {
    /// The launcher's one-line summary of a failed run, root cause first, e.g. "local rank 1 was
    /// killed by signal 9 (SIGKILL); rank 0 then exited with status 1". `None` if every rank
    /// succeeded.
    pub fn failure_summary(&self) -> Option<String> {
        let root = self.first_failure?;
        let words = |r: usize| {
            if self.killed[r] {
                "was killed by the launcher (still running after the grace period)".to_string()
            } else if signal_of(&self.statuses[r]).is_some() {
                format!("was {}", describe_status(&self.statuses[r]))
            } else {
                describe_status(&self.statuses[r])
            }
        };
        let mut out = format!("local rank {root} {}", words(root));
        let mut after: Vec<usize> = (0..self.statuses.len())
            .filter(|&r| r != root && !self.statuses[r].success())
            .collect();
        after.sort_by_key(|&r| (self.exited_after[r], r));
        for r in after {
            let w = words(r);
            match w.strip_prefix("was ") {
                Some(rest) => out.push_str(&format!("; rank {r} was then {rest}")),
                None => out.push_str(&format!("; rank {r} then {w}")),
            }
        }
        Some(out)
    }
}

fn signal_of(status: &ExitStatus) -> Option<i32> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal()
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        None
    }
}

/// Which failed rank is the root cause: one killed by a signal it did not get from the launcher
/// (a rank that errors because a peer vanished exits later, or in the same 10 ms poll, with a
/// status), else the first to exit non-zero other than with the watchdog's
/// [`EXIT_PEER_DIED`](crate::watchdog::EXIT_PEER_DIED), else the first to exit non-zero; ties go
/// to the lower rank. Ranks the launcher killed after the grace period are the cause only when
/// nothing else failed.
pub fn root_cause(statuses: &[ExitStatus], exited_after: &[Duration], killed: &[bool]) -> Option<usize> {
    let failed = |r: &usize| !statuses[*r].success();
    let by_time = |r: &usize| (exited_after[*r], *r);
    let n = statuses.len();
    (0..n)
        .filter(|r| failed(r) && !killed[*r] && signal_of(&statuses[*r]).is_some())
        .min_by_key(by_time)
        .or_else(|| {
            (0..n)
                .filter(|r| failed(r) && !killed[*r] && statuses[*r].code() != Some(crate::watchdog::EXIT_PEER_DIED))
                .min_by_key(by_time)
        })
        .or_else(|| (0..n).filter(|r| failed(r) && !killed[*r]).min_by_key(by_time))
        .or_else(|| (0..n).filter(failed).min_by_key(by_time))
}

/// `status` in words: "exited with status 1", "killed by signal 9 (SIGKILL)".
pub fn describe_status(status: &ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            let name = match sig {
                2 => " (SIGINT)",
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                _ => "",
            };
            return format!("killed by signal {sig}{name}");
        }
    }
    match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => format!("{status}"),
    }
}

/// What `vime-train --nproc-per-node N ...` does: runs `program args` as local ranks `0..nproc`
/// with the launch environment set (store on loopback at a free port), and waits. The caller
/// removes `--nproc-per-node` from `args` first ([`take_nproc_flag`]).
pub fn spawn_local(nproc: usize, program: impl AsRef<OsStr>, args: &[impl AsRef<OsStr>]) -> Result<()> {
    let run = run_local(&LocalLaunch::new(nproc, program, args), |_, _| {})?;
    match run.failure_summary() {
        None => Ok(()),
        Some(why) => bail!("{why}"),
    }
}

/// [`spawn_local`] with a hook to adjust each child's command (per-rank environment, redirected
/// stderr in tests) and the full outcome instead of the first error.
pub fn run_local(launch: &LocalLaunch, mut configure: impl FnMut(usize, &mut Command)) -> Result<LocalRun> {
    let n = launch.nproc;
    if n == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    let port = free_port()?;
    let start = Instant::now();
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for r in 0..n {
        let mut cmd = Command::new(&launch.program);
        cmd.args(&launch.args)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        configure(r, &mut cmd);
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e).with_context(|| format!("spawning local rank {r}: {:?}", launch.program));
            }
        }
    }
    let _sigint = IgnoreSigint::new();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    let mut exited_after = vec![Duration::ZERO; n];
    let mut killed = vec![false; n];
    let mut first_failure: Option<(usize, Instant)> = None;
    while statuses.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if statuses[r].is_some() {
                continue;
            }
            if let Some(st) = c.try_wait().with_context(|| format!("waiting for local rank {r}"))? {
                statuses[r] = Some(st);
                exited_after[r] = start.elapsed();
                if !st.success() && first_failure.is_none() {
                    first_failure = Some((r, Instant::now()));
                }
            }
        }
        if let Some((_, t)) = first_failure {
            if t.elapsed() > launch.grace {
                for (r, c) in children.iter_mut().enumerate() {
                    if statuses[r].is_none() {
                        let _ = c.kill();
                        killed[r] = true;
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let statuses: Vec<ExitStatus> = statuses.into_iter().flatten().collect();
    let first_failure = root_cause(&statuses, &exited_after, &killed);
    Ok(LocalRun {
        statuses,
        exited_after,
        killed,
        first_failure,
    })
}

/// Ignores SIGINT in the launcher while it waits (Ctrl-C goes to the children, which share the
/// terminal's process group; the launcher must outlive them to report). Children are spawned
/// before this is set, so they keep the default disposition. The one `unsafe` here: libc's
/// `signal`, which std links anyway.
struct IgnoreSigint {
    #[cfg(unix)]
    previous: usize,
}

#[cfg(unix)]
mod sig {
    extern "C" {
        pub fn signal(signum: i32, handler: usize) -> usize;
    }
    pub const SIGINT: i32 = 2;
    pub const SIG_IGN: usize = 1;
}

impl IgnoreSigint {
    fn new() -> Self {
        #[cfg(unix)]
        {
            // SAFETY: `signal` with SIG_IGN installs no Rust code as a handler.
            let previous = unsafe { sig::signal(sig::SIGINT, sig::SIG_IGN) };
            IgnoreSigint { previous }
        }
        #[cfg(not(unix))]
        IgnoreSigint {}
    }
}

impl Drop for IgnoreSigint {
    fn drop(&mut self) {
        #[cfg(unix)]
        // SAFETY: restores the disposition `signal` returned (SIG_ERR, usize::MAX, is skipped).
        if self.previous != usize::MAX {
            unsafe { sig::signal(sig::SIGINT, self.previous) };
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    fn run(statuses: Vec<ExitStatus>, ms: &[u64], killed: Vec<bool>) -> LocalRun {
        let exited_after: Vec<Duration> = ms.iter().map(|&m| Duration::from_millis(m)).collect();
        let first_failure = root_cause(&statuses, &exited_after, &killed);
        LocalRun {
            statuses,
            exited_after,
            killed,
            first_failure,
        }
    }

    /// Rank 1 SIGKILLed and rank 0 erroring out in the same 10 ms poll: the summary names rank 1.
    #[test]
    fn a_rank_killed_by_a_signal_is_the_root_cause_over_one_that_exited_in_the_same_poll() {
        let r = run(
            vec![exited(1), ExitStatus::from_raw(9), exited(0)],
            &[500, 500, 510],
            vec![false; 3],
        );
        assert_eq!(r.first_failure, Some(1));
        assert_eq!(
            r.failure_summary().unwrap(),
            "local rank 1 was killed by signal 9 (SIGKILL); rank 0 then exited with status 1"
        );
    }

    #[test]
    fn without_a_signal_the_first_to_exit_non_zero_is_the_root_cause() {
        let r = run(vec![exited(1), exited(0), exited(3)], &[520, 530, 500], vec![false; 3]);
        assert_eq!(
            r.failure_summary().unwrap(),
            "local rank 2 exited with status 3; rank 0 then exited with status 1"
        );
        // Same poll, no signal: the lower rank, unless it exited because a peer died.
        let r = run(vec![exited(2), exited(1)], &[500, 500], vec![false; 2]);
        assert_eq!(r.first_failure, Some(0));
        let peer_died = exited(crate::watchdog::EXIT_PEER_DIED);
        let r = run(vec![peer_died, exited(1)], &[500, 500], vec![false; 2]);
        assert_eq!(r.first_failure, Some(1));
    }

    #[test]
    fn ranks_the_launcher_killed_come_last() {
        let r = run(
            vec![ExitStatus::from_raw(9), exited(4)],
            &[20_600, 500],
            vec![true, false],
        );
        assert_eq!(
            r.failure_summary().unwrap(),
            "local rank 1 exited with status 4; rank 0 was then killed by the launcher (still running after the grace period)"
        );
        let ok = run(vec![exited(0), exited(0)], &[5, 6], vec![false; 2]);
        assert_eq!(ok.failure_summary(), None);
    }
}
