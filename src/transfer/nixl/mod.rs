//! Checked KV transfers over NIXL (feature `nixl`): the transport engines use between prefill and
//! decode (vLLM's NixlConnector, SGLang's nixl backend, Dynamo), with kvguard's manifest riding
//! along and decode failing closed.
//!
//! NIXL moves bytes between registered memory of two agents and can attach a notification to a
//! transfer, delivered after the data; it checks nothing about the content. Here:
//!
//! - each side creates a [`NixlAgent`] (UCX back end, no progress thread) and registers its KV
//!   pages ([`HostRegion`]: kvguard's own host pages; [`EnginePool`]: an engine's own pool,
//!   host or GPU, the same code with [`Segment::Vram`]; receiving goes through [`PageRegion`]);
//! - the agents' metadata and [`RegionLayout`]s are exchanged out of band (a file or a socket),
//!   and each side opens a [`NixlLink`] to the other;
//! - decode pins the receiving pages ([`Receiver::pin`](crate::transfer::Receiver::pin)) before it
//!   asks for anything, then [`NixlLink::receive`]s: prefill either WRITEs the pages with the
//!   [`Notice`] `Written` (extents + the encoded [`Manifest`](crate::transfer::Manifest)) as the
//!   transfer's notification ([`NixlLink::push`]), or stages them and notifies `Staged`, and
//!   decode READs them and answers `Released` ([`NixlLink::stage`]);
//! - decode checks the manifest against its own copy of the request and the landed bytes, and
//!   records coverage only on success; on a refusal, an error, a timeout or a notification that
//!   never comes, the import is aborted, nothing is readable, and the pages are scrubbed;
//! - a push that fails with WRITEs still in flight (releasing them does not stop them) returns
//!   [`NixlError::InFlight`], naming the source pages they may still read, and the link holds
//!   those WRITEs until NIXL reports them complete ([`NixlLink::settle_pushes`]); a staging
//!   that fails before decode released it (decode may still READ it) likewise, the link holding
//!   its pages until decode's late `Released` for it ([`NixlLink::settle_stages`]); each held
//!   transfer keeps its region registered and allocated ([`PageRegion::keep_alive`]: a
//!   [`HostRegion`] dropped meanwhile frees nothing) until its pages are handed back;
//! - on decode's side, a transfer given up on while it may still land (a push that timed out, a
//!   READ that outlived its wait) keeps its pages fenced ([`NixlLink::fenced`]) and the region
//!   it lands in alive the same way, until [`NixlLink::settle_fences`] proves it over.
//!
//! The files: `agent.rs` and `region.rs` are the FFI edge (`unsafe` allowed there only: loading
//! the library, registering memory; the regions' bytes); `notice.rs` the notification and layout
//! wire formats; `link.rs` the link and its inbox, and beside it the protocol's steps: `push.rs`
//! (prefill WRITEs), `stage.rs` (prefill stages for decode's READ), `receive.rs` (decode's
//! receive), `fence.rs` (decode's fences), with `held.rs` counting prefill's held pages. The
//! library `libnixl_capi.so` comes from the `nixl-cu12` wheel and is loaded at run time (see
//! docs/transfer.md for the setup); without it [`NixlAgent::new`] returns
//! [`NixlError::Library`], never aborts.

#[allow(unsafe_code)]
mod agent;
mod fence;
mod held;
mod link;
mod notice;
mod push;
mod receive;
#[allow(unsafe_code)]
mod region;
mod stage;

pub use agent::{Direction, NIXL_LIBRARY, NixlAgent, Posted, Registration, library_available};
pub use link::{FLUSH, INBOX_BYTES, INBOX_CAP, NixlLink, PART_BYTES};
pub use notice::{Extent, LAYOUT_LEN, Notice, NoticeKind, RegionLayout, Segment};
pub use receive::ImportError;
pub use region::{EnginePool, HostRegion, KeepAlive, PageRegion};

/// What went wrong in the transport (not a verdict on a transfer's content: that is a
/// [`TransferError`](crate::transfer::TransferError)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NixlError {
    /// `libnixl_capi.so` cannot be loaded (put the `nixl-cu12` wheel's
    /// `site-packages/.nixl_cu12.mesonpy.libs` on `LD_LIBRARY_PATH`).
    #[error("cannot load {NIXL_LIBRARY}: {reason}")]
    Library {
        /// The loader's message.
        reason: String,
    },
    /// A NIXL call failed.
    #[error("NIXL {call} failed: {reason}")]
    Call {
        /// The NIXL operation.
        call: &'static str,
        /// NIXL's error.
        reason: String,
    },
    /// The deadline passed.
    #[error("timed out waiting for {waiting_for}")]
    Timeout {
        /// What was awaited.
        waiting_for: &'static str,
    },
    /// Extents outside their region, or local and remote extents that do not pair up.
    #[error("bad extents: {reason}")]
    Extents {
        /// What is wrong.
        reason: String,
    },
    /// Memory kvguard cannot read or zero from the host (an engine's GPU pool without a
    /// [`PageRegion`] of its own that copies the pages).
    #[error("memory not accessible: {reason}")]
    Segment {
        /// What is wrong.
        reason: String,
    },
    /// A malformed notice or region layout.
    #[error("malformed notice: {reason}")]
    Notice {
        /// What is wrong.
        reason: String,
    },
    /// A transfer failed (`cause`) while its source `pages` may still be read after the call
    /// returned: `direction` [`Write`](Direction::Write), a push's WRITEs NIXL has not reported
    /// complete (releasing a WRITE in flight does not stop it over UCX), handed back by
    /// [`NixlLink::settle_pushes`]; [`Read`](Direction::Read), pages [`NixlLink::stage`] staged
    /// and decode has not released (its READ may be in flight or still to come), handed back by
    /// [`NixlLink::settle_stages`]. Reuse those pages only then; the transfer's other pages are
    /// free.
    #[error("{cause}; {}", held(*direction, *request, pages))]
    InFlight {
        /// Whose read holds the pages: this side's WRITEs (a push) or the peer's READ (a pull).
        direction: Direction,
        /// The request pushed or staged.
        request: crate::RequestId,
        /// The source pages that may still be read, in the order pushed or staged.
        pages: Vec<u32>,
        /// What made the transfer fail.
        cause: Box<NixlError>,
    },
}

/// [`NixlError::InFlight`]'s account of the pages held.
fn held(direction: Direction, request: crate::RequestId, pages: &[u32]) -> String {
    match direction {
        Direction::Write => format!(
            "{request}'s WRITEs may still read source pages {pages:?}: reuse them once settle_pushes hands them back"
        ),
        Direction::Read => format!(
            "the peer may still READ {request}'s staged pages {pages:?}: reuse them once settle_stages hands them back"
        ),
    }
}

impl NixlError {
    /// The source pages a failed push's WRITEs, or the peer's READ of a failed staging, may
    /// still read ([`NixlError::InFlight`]); empty for any other error (nothing of it reads any
    /// page after it returned).
    pub fn in_flight(&self) -> &[u32] {
        match self {
            NixlError::InFlight { pages, .. } => pages,
            _ => &[],
        }
    }

    /// What went wrong: under [`NixlError::InFlight`] its cause (a timeout, a NIXL call that
    /// failed), otherwise the error itself.
    pub fn cause(&self) -> &NixlError {
        match self {
            NixlError::InFlight { cause, .. } => cause.cause(),
            other => other,
        }
    }
}
