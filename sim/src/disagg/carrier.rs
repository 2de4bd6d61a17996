//! How a request's KV and its manifest travel from prefill to decode: inside the TCP frames, or
//! over NIXL (prefill WRITEs, or decode READs) with the manifest as a NIXL notification. The
//! nodes' loops, the faults and the checks are the same for every carrier; only this file
//! differs. The control frames (pulls, the end, the NIXL peers' metadata) always go over the TCP
//! connection, the side channel.

use super::{Deadline, DisaggError, Frame};
use kvguard::PageRef;
use kvguard::transfer::{Accepted, ExpectedTransfer, PinnedImport, TransferError};
use std::fmt;
use std::net::TcpStream;
use std::str::FromStr;
use std::time::Duration;

/// The transport of the KV (`--transport`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub enum Transport {
    /// Pages and manifest inside the TCP frames.
    #[default]
    Tcp,
    /// NIXL push: prefill WRITEs decode's pages; the manifest is the WRITE's notification.
    NixlWrite,
    /// NIXL pull: prefill stages and notifies; decode READs, then releases.
    NixlRead,
}

impl Transport {
    /// Every transport.
    pub const ALL: [Transport; 3] = [Transport::Tcp, Transport::NixlWrite, Transport::NixlRead];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::NixlWrite => "nixl-write",
            Transport::NixlRead => "nixl-read",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Transport, String> {
        Transport::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown transport {s:?}; one of tcp, nixl-write, nixl-read"))
    }
}

/// What decode got for one pull.
pub(super) enum Fetched {
    /// Prefill was not ready (the import was aborted); decode may ask again.
    NotReady,
    /// The verdict on what arrived.
    Verdict(Result<Accepted, TransferError>),
}

/// Decode's end of the carrier.
pub(super) enum DecodeCarrier<'a> {
    Tcp,
    #[cfg(feature = "nixl")]
    Nixl(Box<nixl::DecodeNixl<'a>>),
    #[cfg(not(feature = "nixl"))]
    #[allow(dead_code)]
    Never(std::marker::PhantomData<&'a ()>),
}

impl DecodeCarrier<'_> {
    /// Says `request`'s transfer is coming (before the pull is sent): over NIXL, the link drops
    /// notices for requests it does not expect as they arrive.
    pub(super) fn expect(&mut self, request: kvguard::RequestId) {
        #[cfg(feature = "nixl")]
        if let DecodeCarrier::Nixl(n) = self {
            n.link.expect(request);
        }
        let _ = request;
    }

    /// Fetches the transfer `pinned` was pinned for (the pull was sent), checks it, and lands it
    /// through `land`.
    pub(super) fn fetch(
        &mut self,
        stream: &TcpStream,
        timeout: Duration,
        pinned: PinnedImport<'_>,
        expected: &ExpectedTransfer<'_>,
        land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), kvguard::transfer::LandError>,
    ) -> Result<Fetched, DisaggError> {
        match self {
            DecodeCarrier::Tcp => {
                match Frame::read_from(&mut Deadline::new(stream, timeout, "a transfer from the prefill node"))? {
                    Frame::Busy => {
                        pinned.abort();
                        Ok(Fetched::NotReady)
                    }
                    Frame::Transfer { manifest, pages } => {
                        Ok(Fetched::Verdict(pinned.accept(expected, &manifest, &pages, land)))
                    }
                    other => Err(DisaggError::Protocol(format!("expected a transfer, got {other:?}"))),
                }
            }
            #[cfg(feature = "nixl")]
            DecodeCarrier::Nixl(n) => n.fetch(timeout, pinned, expected, land),
            #[cfg(not(feature = "nixl"))]
            DecodeCarrier::Never(_) => unreachable!("no NIXL carrier is built without feature nixl"),
        }
    }
}

/// Prefill's end of the carrier.
pub(super) enum PrefillCarrier<'a> {
    Tcp,
    #[cfg(feature = "nixl")]
    Nixl(Box<nixl::PrefillNixl<'a>>),
    #[cfg(not(feature = "nixl"))]
    #[allow(dead_code)]
    Never(std::marker::PhantomData<&'a ()>),
}

impl PrefillCarrier<'_> {
    /// Sends `frame` (a transfer, or `Busy`) in answer to a pull for `dest`.
    pub(super) fn deliver(
        &mut self,
        stream: &TcpStream,
        timeout: Duration,
        request: kvguard::RequestId,
        dest: &[PageRef],
        frame: &Frame,
    ) -> Result<(), DisaggError> {
        match self {
            PrefillCarrier::Tcp => {
                frame.write_to(&mut Deadline::new(stream, timeout, "the decode node to take a frame"))?;
                Ok(())
            }
            #[cfg(feature = "nixl")]
            PrefillCarrier::Nixl(n) => n.deliver(timeout, request, dest, frame),
            #[cfg(not(feature = "nixl"))]
            PrefillCarrier::Never(_) => {
                let _ = (request, dest);
                unreachable!("no NIXL carrier is built without feature nixl")
            }
        }
    }
}

/// The NIXL carrier's set-up, before the nodes' loops: agent, registered pages, peer exchange.
#[cfg(feature = "nixl")]
pub(super) mod nixl {
    use super::{DisaggError, Fetched, Frame};
    use crate::disagg::Deadline;
    use kvguard::transfer::nixl::{Direction, Extent, HostRegion, ImportError, NixlAgent, NixlLink, RegionLayout};
    use kvguard::transfer::{ExpectedTransfer, PinnedImport};
    use kvguard::{PageId, PageRef, RequestId};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    /// A side's agent and registered pages (owned outside the carrier, which borrows them).
    pub(crate) struct NixlSide {
        pub(crate) agent: NixlAgent,
        pub(crate) region: HostRegion,
    }

    impl NixlSide {
        /// Creates the agent `role-PID` and registers `pages` host pages of `page_bytes` each.
        pub(crate) fn new(role: &str, pages: u32, page_bytes: u32) -> Result<NixlSide, DisaggError> {
            let agent = NixlAgent::new(&format!("kvguard-{role}-{}", std::process::id()))?;
            let region = HostRegion::new(&agent, pages, page_bytes)?;
            Ok(NixlSide { agent, region })
        }

        /// This side's `Peer` frame.
        pub(crate) fn peer_frame(&self) -> Result<Frame, DisaggError> {
            Ok(Frame::Peer { metadata: self.agent.metadata()?, region: self.region.layout().encode().to_vec() })
        }
    }

    /// Reads the peer's `Peer` frame from the side channel and connects to it.
    pub(crate) fn connect<'a>(
        agent: &'a NixlAgent,
        stream: &TcpStream,
        timeout: Duration,
    ) -> Result<NixlLink<'a>, DisaggError> {
        match Frame::read_from(&mut Deadline::new(stream, timeout, "the peer's NIXL metadata"))? {
            Frame::Peer { metadata, region } => {
                Ok(NixlLink::connect(agent, &metadata, RegionLayout::decode(&region)?)?)
            }
            other => Err(DisaggError::Protocol(format!("expected the peer's NIXL metadata, got {other:?}"))),
        }
    }

    pub(crate) struct DecodeNixl<'a> {
        pub(crate) link: NixlLink<'a>,
        pub(crate) region: &'a mut HostRegion,
        pub(crate) direction: Direction,
    }

    impl DecodeNixl<'_> {
        pub(super) fn fetch(
            &mut self,
            timeout: Duration,
            pinned: PinnedImport<'_>,
            expected: &ExpectedTransfer<'_>,
            land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), kvguard::transfer::LandError>,
        ) -> Result<Fetched, DisaggError> {
            let deadline = Instant::now() + timeout;
            match self.link.receive(self.direction, pinned, expected, self.region, deadline, land) {
                Ok(a) => Ok(Fetched::Verdict(Ok(a))),
                Err(ImportError::Refused(e)) => Ok(Fetched::Verdict(Err(e))),
                Err(ImportError::Declined) => Ok(Fetched::NotReady),
                Err(ImportError::Aborted(e)) => Err(DisaggError::Aborted(e)),
                Err(e) => Err(DisaggError::Protocol(e.to_string())),
            }
        }
    }

    pub(crate) struct PrefillNixl<'a> {
        pub(crate) link: NixlLink<'a>,
        pub(crate) region: &'a mut HostRegion,
        pub(crate) direction: Direction,
    }

    impl PrefillNixl<'_> {
        pub(super) fn deliver(
            &mut self,
            timeout: Duration,
            request: RequestId,
            dest: &[PageRef],
            frame: &Frame,
        ) -> Result<(), DisaggError> {
            let deadline = Instant::now() + timeout;
            let (manifest, pages) = match frame {
                Frame::Busy => return Ok(self.link.decline(request, deadline)?),
                Frame::Transfer { manifest, pages } => (manifest, pages),
                other => return Err(DisaggError::Protocol(format!("cannot carry {other:?} over NIXL"))),
            };
            // Staged in this side's registered pages 0.., one request at a time.
            let mut src = Vec::with_capacity(pages.len());
            for (k, bytes) in pages.iter().enumerate() {
                let len = u32::try_from(bytes.len()).map_err(|_| DisaggError::Protocol("page too long".into()))?;
                self.region.bytes_mut(k as u32, len)?.copy_from_slice(bytes);
                src.push(Extent { page: k as u32, len });
            }
            match self.direction {
                // Into the pages decode offered, position by position: a frame of another length
                // (an injected fault) writes as many as both name, as a prefill that carried the
                // wrong KV would; decode's check refuses it.
                Direction::Write => {
                    let n = src.len().min(dest.len());
                    let dest: Vec<PageId> = dest[..n].iter().map(|r| r.page).collect();
                    self.link.push(self.region, &src[..n], &dest, request, manifest, deadline)?
                }
                Direction::Read => self.link.stage(&src, request, manifest, deadline)?,
            }
            Ok(())
        }
    }
}
