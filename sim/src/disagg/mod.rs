//! The prefill and decode nodes as two processes on loopback TCP, with fault injection on the
//! prefill side: what `kvguard-disagg` and `examples/disagg_tcp.rs` run.
//!
//! Decode listens on `127.0.0.1` (port 0 picks an ephemeral one, printed as `listening ADDR`),
//! admits each request from its own copy of the workload, allocates pages for the full prompt and
//! sends a [`Frame::Pull`] naming them; prefill prefills, builds the [`Manifest`] and answers with
//! a [`Frame::Transfer`]. Decode lands it through a [`Receiver`] and prints one line per request:
//! `ACCEPTED req N ...` or `REFUSED req N: <violation kind>: <error>`.

mod carrier;
pub mod frame;

use crate::kv::{KvPool, SLOT_BYTES, SlotKv};
use crate::workload::{self, RequestSpec};
use crate::{DUMMY_TOKEN, SimConfig, SimError};
pub use carrier::Transport;
use carrier::{DecodeCarrier, Fetched, PrefillCarrier};
pub use frame::Frame;
#[cfg(feature = "nixl")]
use kvguard::transfer::nixl::{Direction, NixlError};
use kvguard::transfer::wire::{HEADER_LEN, PAGE_ENTRY_LEN, TRAILER_LEN};
use kvguard::transfer::{BuildError, ExpectedTransfer, Manifest, Receiver, SenderId, TransferHeader, tokens_in_page};
use kvguard::{Error, OwnershipTable, PageId, PageRef, PoolConfig, RequestId};
use std::collections::HashMap;
use std::fmt;
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// A fault the prefill side injects into one transfer (the workload's second request).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Fault {
    /// A clean run.
    None,
    /// The last slot of the first page is cut off.
    TruncatePage,
    /// One byte of the first page is flipped after its checksum was taken.
    FlipByte,
    /// The previous request's transfer is delivered instead.
    WrongRequest,
    /// The first attempt times out (decode retries, reusing the pages), then the first attempt's
    /// transfer lands on the retry.
    Late,
    /// The prompt is replaced by a one-token dummy, as in the incident.
    DummyPrompt,
    /// The first page's checksum is zeroed (and the manifest resealed).
    MissingChecksum,
}

impl Fault {
    /// Every fault, clean run first.
    pub const ALL: [Fault; 7] = [
        Fault::None,
        Fault::TruncatePage,
        Fault::FlipByte,
        Fault::WrongRequest,
        Fault::Late,
        Fault::DummyPrompt,
        Fault::MissingChecksum,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::TruncatePage => "truncate-page",
            Fault::FlipByte => "flip-byte",
            Fault::WrongRequest => "wrong-request",
            Fault::Late => "late",
            Fault::DummyPrompt => "dummy-prompt",
            Fault::MissingChecksum => "missing-checksum",
        }
    }

    /// The violation kind decode refuses the faulty transfer with (`None` for a clean run).
    pub fn expected_refusal(self) -> Option<&'static str> {
        match self {
            Fault::None => None,
            Fault::TruncatePage => Some("page_length_mismatch"),
            Fault::FlipByte => Some("page_checksum_mismatch"),
            Fault::WrongRequest => Some("transfer_misrouted"),
            Fault::Late => Some("stale_page"),
            Fault::DummyPrompt => Some("token_count_mismatch"),
            Fault::MissingChecksum => Some("missing_checksum"),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Fault, String> {
        Fault::ALL.into_iter().find(|f| f.name() == s).ok_or_else(|| {
            let names: Vec<_> = Fault::ALL.iter().map(|f| f.name()).collect();
            format!("unknown fault {s:?}; one of {}", names.join(", "))
        })
    }
}

/// Why a node stopped (not a refused transfer: that is a verdict, printed and counted).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DisaggError {
    /// Socket trouble, a timeout, or a malformed frame.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The peer broke the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The workload or pools could not be set up.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// kvguard refused something that is not a verdict on a transfer.
    #[error(transparent)]
    Kvguard(#[from] Error),
    /// The sender could not build a manifest.
    #[error("manifest: {0}")]
    Build(#[from] BuildError),
    /// NIXL failed outside a transfer (set-up, connection).
    #[cfg(feature = "nixl")]
    #[error("nixl: {0}")]
    Nixl(#[from] NixlError),
    /// A transfer over NIXL failed, timed out or never notified: aborted, nothing readable.
    #[cfg(feature = "nixl")]
    #[error("transfer aborted: {0}")]
    Aborted(NixlError),
    /// The transport was not built in (feature `nixl` of kvguard-sim).
    #[error("transport {0} needs kvguard-sim built with feature nixl")]
    Unsupported(Transport),
}

/// Both nodes' shared knowledge: the workload seed and size (each derives its own copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DisaggConfig {
    /// Workload seed.
    pub seed: u64,
    /// Requests decode pulls.
    pub requests: u32,
    /// Deadline of each frame (sent or received whole) and of the accept.
    pub timeout: Duration,
    /// How the KV travels (both nodes must use the same).
    pub transport: Transport,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig { seed: 1, requests: 3, timeout: Duration::from_secs(10), transport: Transport::Tcp }
    }
}

impl DisaggConfig {
    /// The small deployment both processes model.
    pub fn sim_config(&self) -> SimConfig {
        SimConfig {
            seed: self.seed,
            requests: self.requests,
            tenants: 4,
            long_per_mille: 0,
            max_short_prompt: 2_000,
            max_new_tokens: 64,
            page_size: 64,
            prefill_pages: 128,
            decode_pages: 256,
            max_context: 8_192,
            decode_batch: 1,
        }
    }

    fn workload(&self) -> Vec<RequestSpec> {
        workload::generate(&self.sim_config())
    }
}

/// The request index the prefill side injects its fault into.
pub const FAULTED_REQUEST: usize = 1;
const PREFILL_SENDER: SenderId = SenderId(1);

/// What the decode node saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodeSummary {
    /// Requests whose transfer was accepted and read.
    pub accepted: u32,
    /// `(request, violation kind)` of each refused transfer.
    pub refused: Vec<(RequestId, &'static str)>,
}

fn configure(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)
}

/// The most requests one demo run takes (each side generates the whole workload up front).
pub const MAX_REQUESTS: u32 = 100_000;

/// One frame's exchange on the stream under one deadline: the timeout bounds the whole frame,
/// not each read or write call (a peer trickling one byte at a time cannot hold a node), and a
/// timeout says what was awaited: `timed out after N ms waiting for ...`.
struct Deadline<'s> {
    stream: &'s TcpStream,
    timeout: Duration,
    until: Instant,
    what: &'static str,
}

impl<'s> Deadline<'s> {
    fn new(stream: &'s TcpStream, timeout: Duration, what: &'static str) -> Deadline<'s> {
        Deadline { stream, timeout, until: Instant::now() + timeout, what }
    }

    fn timed_out(&self) -> io::Error {
        let ms = self.timeout.as_millis();
        io::Error::new(io::ErrorKind::TimedOut, format!("timed out after {ms} ms waiting for {}", self.what))
    }

    /// The time left, or the timeout error; sets it on the socket for the next call.
    fn arm(&self, read: bool) -> io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out());
        }
        if read { self.stream.set_read_timeout(Some(left)) } else { self.stream.set_write_timeout(Some(left)) }
    }

    fn map(&self, e: io::Error) -> io::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => self.timed_out(),
            _ => e,
        }
    }
}

impl io::Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(true)?;
        let mut s = self.stream;
        io::Read::read(&mut s, buf).map_err(|e| self.map(e))
    }
}

impl io::Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm(false)?;
        let mut s = self.stream;
        io::Write::write(&mut s, buf).map_err(|e| self.map(e))
    }
    fn flush(&mut self) -> io::Result<()> {
        let mut s = self.stream;
        io::Write::flush(&mut s).map_err(|e| self.map(e))
    }
}

/// Binds the decode node's listener on loopback (`port` 0: ephemeral).
pub fn bind_decode(port: u16) -> io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
}

/// Waits up to `timeout` for the prefill node to connect.
fn accept(listener: &TcpListener, timeout: Duration) -> io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let ms = timeout.as_millis();
                let msg = format!("timed out after {ms} ms waiting for the prefill node to connect");
                return Err(io::Error::new(io::ErrorKind::TimedOut, msg));
            }
            Err(e) => return Err(e),
        }
    }
}

/// The decode node: accepts one prefill connection on `listener`, pulls every request's KV and
/// prints one line per request to `out`.
pub fn run_decode(
    listener: &TcpListener,
    config: DisaggConfig,
    out: &mut dyn Write,
) -> Result<DecodeSummary, DisaggError> {
    check_requests(config)?;
    let sim = config.sim_config();
    let table = OwnershipTable::new(PoolConfig::new(sim.decode_pages, sim.page_size, sim.max_context))?;
    let mut pool = KvPool::new(sim.decode_pages, sim.page_size);
    #[cfg(feature = "nixl")]
    let mut side = match config.transport {
        Transport::Tcp => None,
        _ => Some(carrier::nixl::NixlSide::new("decode", sim.decode_pages, sim.page_size * SLOT_BYTES)?),
    };
    let stream = accept(listener, config.timeout)?;
    let timeout = config.timeout;
    configure(&stream, config.timeout)?;
    let mut carrier = match config.transport {
        Transport::Tcp => DecodeCarrier::Tcp,
        #[cfg(feature = "nixl")]
        t => {
            let side = side.as_mut().ok_or(DisaggError::Unsupported(t))?;
            side.peer_frame()?.write_to(&mut Deadline::new(
                &stream,
                timeout,
                "the prefill node to take our metadata",
            ))?;
            let link = carrier::nixl::connect(&side.agent, &stream, timeout)?;
            let direction = if t == Transport::NixlRead { Direction::Read } else { Direction::Write };
            DecodeCarrier::Nixl(Box::new(carrier::nixl::DecodeNixl { link, region: &mut side.region, direction }))
        }
        #[cfg(not(feature = "nixl"))]
        t => return Err(DisaggError::Unsupported(t)),
    };
    let mut summary = DecodeSummary::default();
    for spec in config.workload() {
        let n = spec.prompt_tokens.div_ceil(sim.page_size) as usize;
        let prompt = spec.prompt();
        let mut attempt = 0;
        loop {
            attempt += 1;
            table.admit(spec.id, spec.tenant, u64::from(spec.prompt_tokens), u64::from(spec.max_new_tokens))?;
            let pages = pool
                .allocate(n)
                .ok_or(SimError::DecodePoolTooSmall { pages_needed: n as u64, pages: sim.decode_pages })?;
            let refs = table.claim(spec.id, &pages)?;
            let expected =
                ExpectedTransfer::for_prompt(spec.id, spec.tenant, &prompt, &refs, sim.page_size, SLOT_BYTES);
            // Pinned before prefill is asked for anything: no byte can land in a page another
            // request holds.
            let pinned = Receiver::new(&table).pin(&expected).map_err(|e| DisaggError::Protocol(e.to_string()))?;
            carrier.expect(spec.id);
            Frame::Pull { request: spec.id, dest: refs.clone() }.write_to(&mut Deadline::new(
                &stream,
                timeout,
                "the prefill node to take a pull",
            ))?;
            let fetched = carrier.fetch(&stream, timeout, pinned, &expected, |_, page, b| {
                pool.land(page.page, b);
                pool.stamp(spec.id, page, (b.len() / SLOT_BYTES as usize) as u32);
                Ok(())
            })?;
            let verdict = match fetched {
                Fetched::NotReady if attempt < 2 => {
                    writeln!(out, "req {}: transfer not ready, releasing and retrying", spec.id.0)?;
                    None
                }
                Fetched::NotReady => {
                    return Err(DisaggError::Protocol(format!("req {}: not ready on the retry", spec.id.0)));
                }
                Fetched::Verdict(landed) => Some(match landed {
                    Ok(a) => match table.verify_read_refs(spec.id, &refs, u64::from(spec.prompt_tokens)) {
                        Ok(()) => Ok(format!(
                            "ACCEPTED req {}: {} tokens in {} pages, read verified",
                            spec.id.0,
                            a.tokens(),
                            a.pages()
                        )),
                        Err(e) => Err((e.violation_kind().map_or("error", |k| k.as_str()), e.to_string())),
                    },
                    Err(e) => Err((e.kind().as_str(), e.to_string())),
                }),
            };
            pool.free(&pages);
            table.release(spec.id)?;
            match verdict {
                None => continue,
                Some(Ok(line)) => {
                    summary.accepted += 1;
                    writeln!(out, "{line}")?;
                }
                Some(Err((kind, message))) => {
                    summary.refused.push((spec.id, kind));
                    writeln!(out, "REFUSED req {}: {kind}: {message}", spec.id.0)?;
                }
            }
            break;
        }
    }
    Frame::Done.write_to(&mut Deadline::new(&stream, timeout, "the prefill node to take the end"))?;
    Ok(summary)
}

/// The prefill node: connects to decode at `127.0.0.1:port`, answers every pull, injecting
/// `fault` into the transfer of request [`FAULTED_REQUEST`].
pub fn run_prefill(port: u16, fault: Fault, config: DisaggConfig, out: &mut dyn Write) -> Result<u32, DisaggError> {
    check_requests(config)?;
    let sim = config.sim_config();
    let workload = config.workload();
    let by_id: HashMap<RequestId, (usize, &RequestSpec)> =
        workload.iter().enumerate().map(|(i, s)| (s.id, (i, s))).collect();
    let table = OwnershipTable::new_unaudited(PoolConfig::new(sim.prefill_pages, sim.page_size, sim.max_context))?;
    let mut pool = KvPool::new(sim.prefill_pages, sim.page_size);
    #[cfg(feature = "nixl")]
    let mut side = match config.transport {
        Transport::Tcp => None,
        _ => Some(carrier::nixl::NixlSide::new("prefill", sim.prefill_pages, sim.page_size * SLOT_BYTES)?),
    };
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = TcpStream::connect_timeout(&addr, config.timeout)?;
    configure(&stream, config.timeout)?;
    let timeout = config.timeout;
    let mut carrier = match config.transport {
        Transport::Tcp => PrefillCarrier::Tcp,
        #[cfg(feature = "nixl")]
        t => {
            let side = side.as_mut().ok_or(DisaggError::Unsupported(t))?;
            let link = carrier::nixl::connect(&side.agent, &stream, timeout)?;
            side.peer_frame()?.write_to(&mut Deadline::new(
                &stream,
                timeout,
                "the decode node to take our metadata",
            ))?;
            let direction = if t == Transport::NixlRead { Direction::Read } else { Direction::Write };
            PrefillCarrier::Nixl(Box::new(carrier::nixl::PrefillNixl { link, region: &mut side.region, direction }))
        }
        #[cfg(not(feature = "nixl"))]
        t => return Err(DisaggError::Unsupported(t)),
    };
    let mut sent: HashMap<RequestId, Frame> = HashMap::new();
    let mut held_back = false;
    let mut served = 0;
    loop {
        let (request, dest) =
            match Frame::read_from(&mut Deadline::new(&stream, timeout, "a pull from the decode node"))? {
                Frame::Done => return Ok(served),
                Frame::Pull { request, dest } => (request, dest),
                other => return Err(DisaggError::Protocol(format!("expected a pull, got {other:?}"))),
            };
        let &(index, spec) =
            by_id.get(&request).ok_or_else(|| DisaggError::Protocol(format!("pull for unknown {request}")))?;
        let faulty = index == FAULTED_REQUEST && fault != Fault::None;
        let prefilled = if faulty && fault == Fault::DummyPrompt { vec![DUMMY_TOKEN] } else { spec.prompt() };
        let transfer = prefill(&table, &mut pool, spec, &prefilled, &dest, sim.page_size)?;
        let frame = match fault {
            _ if !faulty => transfer,
            Fault::Late if !held_back => {
                held_back = true;
                sent.insert(request, transfer);
                writeln!(out, "req {}: holding the transfer back (fault late)", request.0)?;
                carrier.deliver(&stream, timeout, request, &dest, &Frame::Busy)?;
                continue;
            }
            Fault::Late => sent.remove(&request).unwrap_or(transfer),
            Fault::WrongRequest => {
                let previous = index.checked_sub(1).and_then(|i| workload.get(i)).map(|s| s.id);
                previous.and_then(|p| sent.get(&p).cloned()).unwrap_or(transfer)
            }
            _ => corrupt(transfer, fault),
        };
        if let Frame::Transfer { .. } = &frame {
            sent.entry(request).or_insert_with(|| frame.clone());
        }
        carrier.deliver(&stream, timeout, request, &dest, &frame)?;
        served += 1;
        writeln!(out, "sent req {}{}", request.0, if faulty { format!(" (fault {fault})") } else { String::new() })?;
    }
}

/// A workload size both sides can generate: at most [`MAX_REQUESTS`].
fn check_requests(config: DisaggConfig) -> Result<(), DisaggError> {
    if config.requests > MAX_REQUESTS {
        return Err(DisaggError::Protocol(format!(
            "{} requests is more than the demo's {MAX_REQUESTS}",
            config.requests
        )));
    }
    Ok(())
}

/// Prefills `prefilled` for `spec` in the prefill pool and builds the transfer into `dest`.
fn prefill(
    table: &OwnershipTable,
    pool: &mut KvPool,
    spec: &RequestSpec,
    prefilled: &[u32],
    dest: &[PageRef],
    page_size: u32,
) -> Result<Frame, DisaggError> {
    let tokens = prefilled.len() as u32;
    let n = tokens.div_ceil(page_size) as usize;
    table.admit(spec.id, spec.tenant, u64::from(tokens), 0)?;
    let pages: Vec<PageId> =
        pool.allocate(n).ok_or(Error::OutOfPages { requested: n as u64, free: pool.free_pages() as u64 })?;
    table.claim(spec.id, &pages)?;
    for (i, &tok) in prefilled.iter().enumerate() {
        let i = i as u32;
        pool.write(pages[(i / page_size) as usize], i % page_size, SlotKv::new(tok, spec.id, spec.tenant));
    }
    table.record_write_tokens(spec.id, &pages, 0..u64::from(tokens))?;
    let bytes: Vec<Vec<u8>> = pages
        .iter()
        .enumerate()
        .map(|(k, &p)| pool.page_bytes(p, tokens_in_page(u64::from(tokens), page_size, k)).to_vec())
        .collect();
    let header = TransferHeader {
        request: spec.id,
        tenant: spec.tenant,
        sender: PREFILL_SENDER,
        page_size,
        slot_bytes: SLOT_BYTES,
    };
    let dest =
        dest.get(..n).ok_or_else(|| DisaggError::Protocol(format!("{} pages offered, {n} needed", dest.len())))?;
    let manifest = Manifest::build(header, prefilled, dest, &bytes)?.encode();
    pool.free(&pages);
    table.release(spec.id)?;
    Ok(Frame::Transfer { manifest, pages: bytes })
}

/// Applies a byte-level fault to a transfer.
fn corrupt(frame: Frame, fault: Fault) -> Frame {
    let Frame::Transfer { mut manifest, mut pages } = frame else {
        return frame;
    };
    match fault {
        Fault::TruncatePage => {
            if let Some(p) = pages.first_mut() {
                p.truncate(p.len().saturating_sub(SLOT_BYTES as usize));
            }
        }
        Fault::FlipByte => {
            if let Some(b) = pages.first_mut().and_then(|p| p.get_mut(5)) {
                *b ^= 0x01;
            }
        }
        Fault::MissingChecksum if manifest.len() >= HEADER_LEN + PAGE_ENTRY_LEN + TRAILER_LEN => {
            let crc_at = HEADER_LEN + 12;
            manifest[crc_at..crc_at + 4].fill(0);
            let body = manifest.len() - TRAILER_LEN;
            let seal = crc32fast::hash(&manifest[..body]);
            manifest[body..].copy_from_slice(&seal.to_le_bytes());
        }
        _ => {}
    }
    Frame::Transfer { manifest, pages }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trickling_peer_meets_the_frame_deadline() {
        let listener = bind_decode(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            // One byte every 40 ms: each read call succeeds, the frame never completes.
            for _ in 0..25 {
                if s.write_all(&[1]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        let stream = accept(&listener, Duration::from_secs(5)).unwrap();
        let start = Instant::now();
        let err = Frame::read_from(&mut Deadline::new(&stream, Duration::from_millis(200), "a transfer")).unwrap_err();
        // Well before the peer's trickle ends (25 x 40 ms): a timeout per read call would wait
        // all of it, and then see the end of the stream, not a timeout. The bound leaves a loaded
        // machine room (600 ms failed once with two benches running beside the tests).
        assert!(start.elapsed() < Duration::from_millis(900), "{:?}", start.elapsed());
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(err.to_string(), "timed out after 200 ms waiting for a transfer");
        drop(stream);
        peer.join().unwrap();
    }

    #[test]
    fn a_workload_beyond_the_cap_is_refused_before_it_is_built() {
        let config = DisaggConfig { requests: 4_000_000_000, ..DisaggConfig::default() };
        let listener = bind_decode(0).unwrap();
        let err = run_decode(&listener, config, &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("more than the demo's 100000"), "{err}");
    }
}
