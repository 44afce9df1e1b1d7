//! The watchdog: turns a dead rank into an exit naming it on every other rank, within about a
//! second, even while the survivors sit inside a collective that will never return (NCCL has no
//! timeout, so detection cannot wait for the collective).
//!
//! Each rank holds one heartbeat connection to the store on a background thread and PINGs every
//! `interval`. Rank 0's store declares a rank dead on EOF (a killed process's socket is closed by
//! the kernel at once) or on `heartbeat` seconds of silence; the next PING of every other rank
//! reads the record and calls the failure handler. Losing the store itself means rank 0 is gone.
//! The default handler prints `vime: rank N died (...); rank M exits` and exits the process with
//! [`EXIT_PEER_DIED`]: no unwinding, because the main thread may be blocked in a driver call.
//!
//! A clean finish says goodbye first (so it is not flagged); a drop while panicking does not, so a
//! panic on one rank still takes the others down.
use crate::store::{op, read_frame, reply, write_frame, Failure, StoreClient};
use anyhow::{anyhow, bail, Result};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The exit status of a rank that exits because another rank died.
pub const EXIT_PEER_DIED: i32 = 75;

/// Called on the watchdog thread with the failure; the default exits the process.
pub type FailureHandler = Arc<dyn Fn(&Failure) + Send + Sync>;

/// The default handler: one line on stderr, then `exit(EXIT_PEER_DIED)`.
pub fn exit_on_failure(my_rank: usize) -> FailureHandler {
    Arc::new(move |f: &Failure| {
        eprintln!("vime: rank {} died ({}); rank {my_rank} exits", f.rank, f.reason);
        std::process::exit(EXIT_PEER_DIED);
    })
}

pub struct Watchdog {
    goodbye: Option<mpsc::Sender<()>>,
    abandon: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Watchdog {
    /// Registers `client`'s connection as rank `rank`'s heartbeat and starts the thread.
    /// `timeout` bounds each reply from the store.
    pub fn start(
        client: StoreClient,
        interval: Duration,
        timeout: Duration,
        handler: FailureHandler,
    ) -> Result<Watchdog> {
        let (rank, addr) = (client.rank(), client.addr().to_string());
        let stream = client.into_stream();
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut hello = vec![op::HEARTBEAT];
        hello.extend_from_slice(&(rank as u64).to_le_bytes());
        match roundtrip(&stream, &hello) {
            Ok((reply::OK, _)) => {}
            Ok((_, body)) => bail!(
                "rank {rank}: the store at {addr} refused the heartbeat: {}",
                String::from_utf8_lossy(&body)
            ),
            Err(e) => bail!("rank {rank}: lost the rendezvous store at {addr}: {e}"),
        }
        let (tx, rx) = mpsc::channel();
        let abandon = Arc::new(AtomicBool::new(false));
        let ab = abandon.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vime-watchdog-{rank}"))
            .spawn(move || loop {
                match rx.recv_timeout(interval) {
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                        if ab.load(Ordering::SeqCst) {
                            return Ok(());
                        }
                        return match roundtrip(&stream, &[op::BYE]) {
                            Ok((reply::OK, _)) => Ok(()),
                            Ok((_, body)) => Err(anyhow!(
                                "rank {rank}: the store refused the goodbye: {}",
                                String::from_utf8_lossy(&body)
                            )),
                            Err(e) => Err(anyhow!(
                                "rank {rank}: lost the rendezvous store at {addr} while finishing: {e}"
                            )),
                        };
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                }
                let failure = match roundtrip(&stream, &[op::PING]) {
                    Ok((reply::OK, _)) => continue,
                    Ok((reply::FAILED, body)) => Failure::decode(&body),
                    Ok((_, body)) => Failure {
                        rank: 0,
                        reason: format!("its store answered {}", String::from_utf8_lossy(&body)),
                    },
                    Err(e) => Failure {
                        rank: 0,
                        reason: format!("lost the rendezvous store at {addr}: {e}"),
                    },
                };
                handler(&failure);
                return Err(anyhow!("rank {rank}: {failure} died"));
            })?;
        Ok(Watchdog {
            goodbye: Some(tx),
            abandon,
            thread: Some(thread),
        })
    }

    /// Says goodbye to the store and stops the thread.
    pub fn finish(mut self) -> Result<()> {
        self.stop()
    }

    /// Stops without a goodbye: the store declares this rank dead, and the others exit. For a
    /// rank that is about to fail (a bad rendezvous) and must not leave the others waiting.
    pub fn abandon(mut self) {
        self.abandon.store(true, Ordering::SeqCst);
        let _ = self.stop();
    }

    fn stop(&mut self) -> Result<()> {
        if let Some(tx) = self.goodbye.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(h) => h.join().map_err(|_| anyhow!("the watchdog thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // No goodbye: the store sees the connection close and declares this rank dead.
            self.abandon.store(true, Ordering::SeqCst);
        }
        if let Err(e) = self.stop() {
            eprintln!("vime: {e:#}");
        }
    }
}

fn roundtrip(stream: &TcpStream, req: &[u8]) -> std::io::Result<(u8, Vec<u8>)> {
    write_frame(stream, req)?;
    let resp = read_frame(stream)?;
    match resp.split_first() {
        Some((&code, body)) => Ok((code, body.to_vec())),
        None => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "empty reply")),
    }
}
