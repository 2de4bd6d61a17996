//! The receiver's checks: a transfer lands only if it is provably the right data for the right
//! request, in pages the receiver still holds in the same incarnation.

use super::digest::PromptDigest;
use super::wire::{DecodeError, Manifest, SenderId};
use crate::error::Error;
use crate::ids::{PageRef, RequestId, TenantId, grouped};
use crate::table::{ImportTicket, OwnershipTable};
use crate::violation::{Op, Violation, ViolationKind};

/// Why a caller's `land` could not copy one page into its pool: the caller's own error, handed
/// back in [`TransferError::Landing`] with the page it failed on.
pub type LandError = Box<dyn std::error::Error + Send + Sync>;

/// What the receiver expects of a transfer, from its own copy of the request.
#[derive(Clone, Copy, Debug)]
pub struct ExpectedTransfer<'a> {
    /// The request the receiving pages belong to.
    pub request: RequestId,
    /// Its tenant.
    pub tenant: TenantId,
    /// The sender it asked, if it checks senders.
    pub sender: Option<SenderId>,
    /// The prompt length the receiver holds.
    pub prompt_tokens: u64,
    /// The digest of the prompt the receiver holds.
    pub prompt_digest: PromptDigest,
    /// The receiving pages, in token order, in the incarnations it offered to the sender: exactly
    /// the ⌈prompt / page size⌉ pages the prompt lands in (pages for generated tokens come later).
    pub pages: &'a [PageRef],
    /// Token slots per page: the receiving table's page size, or the [`Receiver`] refuses
    /// ([`TransferError::TablePageSize`]).
    pub page_size: u32,
    /// Bytes per token slot.
    pub slot_bytes: u32,
}

impl<'a> ExpectedTransfer<'a> {
    /// Expects `prompt` (the receiver's own copy of the request) for `request` of `tenant` into
    /// `pages`, any sender.
    pub fn for_prompt(
        request: RequestId,
        tenant: TenantId,
        prompt: &[u32],
        pages: &'a [PageRef],
        page_size: u32,
        slot_bytes: u32,
    ) -> ExpectedTransfer<'a> {
        ExpectedTransfer {
            request,
            tenant,
            sender: None,
            prompt_tokens: prompt.len() as u64,
            prompt_digest: PromptDigest::of_tokens(prompt),
            pages,
            page_size,
            slot_bytes,
        }
    }

    /// Also requires the transfer to come from `sender`.
    pub fn from_sender(mut self, sender: SenderId) -> Self {
        self.sender = Some(sender);
        self
    }
}

/// Why a transfer was refused. No coverage was recorded, and its pages were not written (but for
/// [`TransferError::Table`]: the table changed while the bytes landed; and
/// [`TransferError::Landing`]: some bytes may have landed, so the pages' coverage was revoked).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The manifest bytes do not decode.
    #[error("manifest refused: {0}")]
    Decode(#[from] DecodeError),
    /// The manifest is for another request.
    #[error("transfer for {found} delivered to {expected}")]
    WrongRequest {
        /// The receiving request.
        expected: RequestId,
        /// The manifest's request.
        found: RequestId,
    },
    /// The manifest is for another tenant.
    #[error("transfer for {expected} carries {found}'s KV")]
    WrongTenant {
        /// The receiving request's tenant.
        expected: TenantId,
        /// The manifest's tenant.
        found: TenantId,
    },
    /// The manifest comes from another sender than the one asked.
    #[error("transfer from {found}, expected {expected}")]
    WrongSender {
        /// The sender asked.
        expected: SenderId,
        /// The manifest's sender.
        found: SenderId,
    },
    /// Another page size or slot size than the receiver's.
    #[error(
        "transfer pages of {found_page_size} slots x {found_slot_bytes} bytes, receiver has {page_size} x {slot_bytes}"
    )]
    PageShape {
        /// Receiver's page size.
        page_size: u32,
        /// Receiver's slot size.
        slot_bytes: u32,
        /// Manifest's page size.
        found_page_size: u32,
        /// Manifest's slot size.
        found_slot_bytes: u32,
    },
    /// The token count is not the prompt length the receiver holds (a substituted or truncated
    /// prompt).
    #[error("transfer carries {} tokens, the request's prompt has {}", grouped(*found), grouped(*expected))]
    TokenCount {
        /// The receiver's prompt length.
        expected: u64,
        /// The manifest's token count.
        found: u64,
    },
    /// The prompt digest is not the digest of the prompt the receiver holds.
    #[error("transfer is the KV of prompt {found}, the request's prompt is {expected}")]
    PromptDigest {
        /// Digest of the receiver's prompt.
        expected: PromptDigest,
        /// The manifest's digest.
        found: PromptDigest,
    },
    /// The manifest names other receiving pages, or another number of them, than were offered.
    #[error("transfer lists {found} pages, {expected} offered{}", .index.map(|i| format!(" (first difference at page {i})")).unwrap_or_default())]
    Pages {
        /// Pages offered.
        expected: usize,
        /// Pages listed.
        found: usize,
        /// The first entry naming another page.
        index: Option<usize>,
    },
    /// The manifest names an earlier incarnation of a receiving page: a late or replayed transfer.
    #[error("late transfer: entry {index} names {found}, the receiver now holds {current}")]
    Stale {
        /// Position in the transfer.
        index: usize,
        /// The incarnation the manifest names.
        found: PageRef,
        /// The incarnation the receiver holds.
        current: PageRef,
    },
    /// The receiver no longer holds a receiving page in the offered incarnation (released,
    /// reused), or another transfer is still landing in it: the table refused to pin the pages.
    #[error("receiving page no longer held: {0}")]
    NotHeld(Violation),
    /// The receiver expects another page size than its ownership table has: landing would write
    /// one page size and record the other as written.
    #[error("receiver expects pages of {expected} slots, its table has {table}")]
    TablePageSize {
        /// The receiver's page size ([`ExpectedTransfer::page_size`]).
        expected: u32,
        /// The table's page size.
        table: u32,
    },
    /// The receiver expects the request to be another tenant's than its ownership table says.
    #[error("receiver expects {request} of {expected}, the table admitted it for {table}")]
    TableTenant {
        /// The receiving request.
        request: RequestId,
        /// The receiver's tenant ([`ExpectedTransfer::tenant`]).
        expected: TenantId,
        /// The tenant the table holds the request's pages for.
        table: TenantId,
    },
    /// Fewer or more page buffers than the manifest lists.
    #[error("{found} page buffers received, the manifest lists {expected}")]
    BufferCount {
        /// Pages listed.
        expected: usize,
        /// Buffers received.
        found: usize,
    },
    /// A page of another length than its tokens imply (truncated or padded).
    #[error("page {index} has {found} bytes, {expected} expected")]
    PageLength {
        /// Position in the transfer.
        index: usize,
        /// `tokens * slot_bytes`.
        expected: u64,
        /// Bytes received.
        found: usize,
    },
    /// A page with no checksum.
    #[error("page {index} has no checksum")]
    MissingChecksum {
        /// Position in the transfer.
        index: usize,
    },
    /// A page's bytes do not match its CRC32.
    #[error("page {index} checksum mismatch: manifest {expected:#010x}, bytes {computed:#010x}")]
    PageChecksum {
        /// Position in the transfer.
        index: usize,
        /// The manifest's checksum.
        expected: u32,
        /// The received bytes' checksum.
        computed: u32,
    },
    /// The ownership table refused to record the import.
    #[error("import refused: {0}")]
    Table(Error),
    /// The caller's `land` failed to copy page `index` into its pool. The import was abandoned
    /// ([`ImportTicket::fail`]): nothing recorded as written, the coverage of every receiving
    /// page revoked (bytes may have landed in any), a [`ViolationKind::LandingFailed`] recorded.
    #[error("landing page {index} ({page}) failed: {source}; the import was abandoned and its pages made unreadable")]
    Landing {
        /// Position in the transfer.
        index: usize,
        /// The receiving page it was landing in.
        page: PageRef,
        /// The caller's error.
        #[source]
        source: LandError,
    },
}

impl TransferError {
    /// The violation kind the refusal is counted as.
    pub fn kind(&self) -> ViolationKind {
        match self {
            TransferError::Decode(DecodeError::MissingChecksum { .. }) | TransferError::MissingChecksum { .. } => {
                ViolationKind::MissingChecksum
            }
            TransferError::Decode(_) => ViolationKind::ManifestCorrupt,
            TransferError::WrongRequest { .. }
            | TransferError::WrongTenant { .. }
            | TransferError::WrongSender { .. }
            | TransferError::TableTenant { .. } => ViolationKind::TransferMisrouted,
            TransferError::PageShape { .. }
            | TransferError::TablePageSize { .. }
            | TransferError::Pages { .. }
            | TransferError::BufferCount { .. } => ViolationKind::TransferPagesMismatch,
            TransferError::TokenCount { .. } => ViolationKind::TokenCountMismatch,
            TransferError::PromptDigest { .. } => ViolationKind::PromptDigestMismatch,
            TransferError::Stale { .. } => ViolationKind::StalePage,
            TransferError::NotHeld(v) => v.kind(),
            TransferError::PageLength { .. } => ViolationKind::PageLengthMismatch,
            TransferError::PageChecksum { .. } => ViolationKind::PageChecksumMismatch,
            TransferError::Table(e) => e.violation_kind().unwrap_or(ViolationKind::UnknownRequest),
            TransferError::Landing { .. } => ViolationKind::LandingFailed,
        }
    }

    /// Whether the table counted this refusal itself (a refused pin is `NotHeld`, a failed
    /// landing was recorded by [`ImportTicket::fail`]).
    fn recorded_by_table(&self) -> bool {
        matches!(self, TransferError::Table(_) | TransferError::NotHeld(_) | TransferError::Landing { .. })
    }

    /// The refusal as a violation by `expected.request`, for [`OwnershipTable::record_violation`].
    pub fn to_violation(&self, expected: &ExpectedTransfer<'_>) -> Violation {
        if let TransferError::NotHeld(v) = self {
            return v.clone();
        }
        if let TransferError::Table(Error::Violation(v)) = self {
            return v.clone();
        }
        let tenant = match *self {
            TransferError::TableTenant { table, .. } => table,
            _ => expected.tenant,
        };
        let v = Violation::new(self.kind(), Op::Import).with_request(expected.request, Some(tenant));
        match *self {
            TransferError::TokenCount { expected, found } => v.with_amounts(found, expected),
            TransferError::Stale { index, found, current } => v
                .with_page(current.page, Some(current.generation))
                .with_block_index(index as u32)
                .with_expected_generation(found.generation),
            TransferError::Landing { index, page, .. } => {
                v.with_page(page.page, Some(page.generation)).with_block_index(index as u32)
            }
            TransferError::PageLength { index, .. }
            | TransferError::PageChecksum { index, .. }
            | TransferError::MissingChecksum { index } => match expected.pages.get(index) {
                Some(r) => v.with_page(r.page, Some(r.generation)).with_block_index(index as u32),
                None => v.with_block_index(index as u32),
            },
            _ => v,
        }
    }
}

/// Checks a decoded manifest and the received page bytes against what the receiver expects: who,
/// what prompt, which pages, and every page's length and CRC32. Touches nothing.
///
/// Cheap checks come first; the page CRCs (the only cost proportional to the bytes) run last.
pub fn verify<P: AsRef<[u8]>>(
    expected: &ExpectedTransfer<'_>,
    manifest: &Manifest,
    pages: &[P],
) -> Result<(), TransferError> {
    verify_with(expected, manifest, pages, &[])
}

/// [`verify`], taking page `i`'s CRC32 from `checksums[i]` where it is `Some` (the transport
/// checksummed the page while the rest of the transfer was in flight, after it landed).
fn verify_with<P: AsRef<[u8]>>(
    expected: &ExpectedTransfer<'_>,
    manifest: &Manifest,
    pages: &[P],
    checksums: &[Option<u32>],
) -> Result<(), TransferError> {
    if manifest.request() != expected.request {
        return Err(TransferError::WrongRequest { expected: expected.request, found: manifest.request() });
    }
    if manifest.tenant() != expected.tenant {
        return Err(TransferError::WrongTenant { expected: expected.tenant, found: manifest.tenant() });
    }
    if let Some(sender) = expected.sender
        && manifest.sender() != sender
    {
        return Err(TransferError::WrongSender { expected: sender, found: manifest.sender() });
    }
    if manifest.page_size() != expected.page_size || manifest.slot_bytes() != expected.slot_bytes {
        return Err(TransferError::PageShape {
            page_size: expected.page_size,
            slot_bytes: expected.slot_bytes,
            found_page_size: manifest.page_size(),
            found_slot_bytes: manifest.slot_bytes(),
        });
    }
    if manifest.prompt_tokens() != expected.prompt_tokens {
        return Err(TransferError::TokenCount { expected: expected.prompt_tokens, found: manifest.prompt_tokens() });
    }
    if manifest.prompt_digest() != expected.prompt_digest {
        return Err(TransferError::PromptDigest { expected: expected.prompt_digest, found: manifest.prompt_digest() });
    }
    let entries = manifest.pages();
    for (index, (entry, &offered)) in entries.iter().zip(expected.pages).enumerate() {
        if entry.dest == offered {
            continue;
        }
        // The page is offered, in a later incarnation: the manifest was made for an earlier one.
        if let Some(&current) =
            expected.pages.iter().find(|r| r.page == entry.dest.page && r.generation > entry.dest.generation)
        {
            return Err(TransferError::Stale { index, found: entry.dest, current });
        }
        return Err(TransferError::Pages { expected: expected.pages.len(), found: entries.len(), index: Some(index) });
    }
    if entries.len() != expected.pages.len() {
        return Err(TransferError::Pages { expected: expected.pages.len(), found: entries.len(), index: None });
    }
    if pages.len() != entries.len() {
        return Err(TransferError::BufferCount { expected: entries.len(), found: pages.len() });
    }
    for (index, (entry, bytes)) in entries.iter().zip(pages).enumerate() {
        let bytes = bytes.as_ref();
        let want = u64::from(entry.tokens) * u64::from(expected.slot_bytes);
        if bytes.len() as u64 != want {
            return Err(TransferError::PageLength { index, expected: want, found: bytes.len() });
        }
        if entry.crc32 == 0 {
            return Err(TransferError::MissingChecksum { index });
        }
        let computed = match checksums.get(index) {
            Some(&Some(crc)) => crc,
            _ => super::wire::page_checksum(bytes),
        };
        if computed != entry.crc32 {
            return Err(TransferError::PageChecksum { index, expected: entry.crc32, computed });
        }
    }
    Ok(())
}

/// What an accepted transfer recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted {
    tokens: u64,
    pages: usize,
}

impl Accepted {
    /// Tokens recorded as written for the receiving request's incarnation.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }
    /// Pages landed.
    pub fn pages(&self) -> usize {
        self.pages
    }
}

/// The decode side of a transfer: checks, lands and records, against the receiver's ownership
/// table; every refusal is [recorded](OwnershipTable::record_violation) to that table.
#[derive(Clone, Copy, Debug)]
pub struct Receiver<'t> {
    table: &'t OwnershipTable,
}

impl<'t> Receiver<'t> {
    /// A receiver recording into `table` (the decode pool's).
    pub fn new(table: &'t OwnershipTable) -> Receiver<'t> {
        Receiver { table }
    }

    /// Accepts a transfer only if it is for `expected` in every respect (see [`verify`]), the
    /// receiver's page size is the table's, and the table holds every receiving page for
    /// `expected.request` (of `expected.tenant`) in the offered incarnation. Then, and only then,
    /// `land(index, page, bytes)` is called for each page (the caller copies the bytes into its
    /// pool) and the pages' coverage is recorded.
    ///
    /// The receiving pages are pinned ([`OwnershipTable::begin_import`]) before anything is
    /// checked against the manifest, and stay pinned until the coverage is recorded
    /// ([`ImportTicket::finish`](crate::ImportTicket::finish)) or the transfer ends otherwise. So
    /// if another thread releases the request while `land` runs (no lock is held then), its pages
    /// leave the request but no other request can get them before the transfer is over; the
    /// record is then refused and records nothing, so a later owner of those pages starts a new
    /// incarnation with no slot written and cannot read the bytes that landed.
    ///
    /// A `land` that returns an error (or panics) fails the import at that page
    /// ([`ImportTicket::fail`](crate::ImportTicket::fail)): nothing is recorded as written, the
    /// coverage of every receiving page is revoked (bytes may have landed in any of them), a
    /// [`ViolationKind::LandingFailed`] is recorded, and the error is handed back as
    /// [`TransferError::Landing`] with the page (a panic goes on unwinding, the import failed).
    ///
    /// Every refusal records no coverage and is recorded in (or counted by) the table. Refusals
    /// before `land` land nothing.
    pub fn accept<P: AsRef<[u8]>>(
        &self,
        expected: &ExpectedTransfer<'_>,
        manifest_bytes: &[u8],
        pages: &[P],
        land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), LandError>,
    ) -> Result<Accepted, TransferError> {
        let outcome = Manifest::decode(manifest_bytes)
            .map_err(TransferError::from)
            .and_then(|manifest| self.check_and_land(expected, &manifest, pages, land));
        self.record_refusal(expected, outcome)
    }

    /// [`accept`](Self::accept) for a manifest already decoded.
    pub fn accept_manifest<P: AsRef<[u8]>>(
        &self,
        expected: &ExpectedTransfer<'_>,
        manifest: &Manifest,
        pages: &[P],
        land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), LandError>,
    ) -> Result<Accepted, TransferError> {
        let outcome = self.check_and_land(expected, manifest, pages, land);
        self.record_refusal(expected, outcome)
    }

    /// Records `outcome` in the table as a violation if it is a refusal, and passes it on.
    fn record_refusal(
        &self,
        expected: &ExpectedTransfer<'_>,
        outcome: Result<Accepted, TransferError>,
    ) -> Result<Accepted, TransferError> {
        if let Err(e) = &outcome
            && !e.recorded_by_table()
        {
            self.table.record_violation(e.to_violation(expected));
        }
        outcome
    }

    /// Records the refusal `error` in the table (unless the table counted it itself) and returns it.
    fn refused(&self, expected: &ExpectedTransfer<'_>, error: TransferError) -> TransferError {
        if !error.recorded_by_table() {
            self.table.record_violation(error.to_violation(expected));
        }
        error
    }

    /// Pins, checks, lands and records coverage; a refusal is returned, not yet recorded.
    fn check_and_land<P: AsRef<[u8]>>(
        &self,
        expected: &ExpectedTransfer<'_>,
        manifest: &Manifest,
        pages: &[P],
        land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), LandError>,
    ) -> Result<Accepted, TransferError> {
        let ticket = self.pin_ticket(expected)?;
        self.land_pinned(ticket, expected, manifest, pages, land)
    }

    /// Pins `expected.pages` for `expected.request` (its page size must be the table's).
    fn pin_ticket(&self, expected: &ExpectedTransfer<'_>) -> Result<ImportTicket<'t>, TransferError> {
        let table_page_size = self.table.page_size();
        if expected.page_size != table_page_size {
            return Err(TransferError::TablePageSize { expected: expected.page_size, table: table_page_size });
        }
        match self.table.begin_import(expected.request, expected.pages) {
            Ok(ticket) => Ok(ticket),
            Err(Error::Violation(v)) => Err(TransferError::NotHeld(v)),
            Err(e) => Err(TransferError::Table(e)),
        }
    }

    /// Checks and lands under `ticket`; every early return before landing drops the ticket,
    /// which aborts; a failed landing fails it.
    fn land_pinned<P: AsRef<[u8]>>(
        &self,
        ticket: ImportTicket<'t>,
        expected: &ExpectedTransfer<'_>,
        manifest: &Manifest,
        pages: &[P],
        land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), LandError>,
    ) -> Result<Accepted, TransferError> {
        self.land_checked(ticket, expected, manifest, pages, &[], land)
    }

    /// [`land_pinned`](Self::land_pinned) with the page CRCs the transport already computed.
    fn land_checked<P: AsRef<[u8]>>(
        &self,
        ticket: ImportTicket<'t>,
        expected: &ExpectedTransfer<'_>,
        manifest: &Manifest,
        pages: &[P],
        checksums: &[Option<u32>],
        mut land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), LandError>,
    ) -> Result<Accepted, TransferError> {
        self.check_tenant(expected)?;
        verify_with(expected, manifest, pages, checksums)?;
        let mut landing = Landing { ticket: Some(ticket), at: 0 };
        for (index, (&page, bytes)) in expected.pages.iter().zip(pages).enumerate() {
            landing.at = index;
            if let Err(source) = land(index, page, bytes.as_ref()) {
                landing.fail();
                return Err(TransferError::Landing { index, page, source });
            }
        }
        landing.landed().finish(manifest.prompt_tokens(), expected.prompt_tokens).map_err(TransferError::Table)?;
        Ok(Accepted { tokens: manifest.prompt_tokens(), pages: expected.pages.len() })
    }

    /// Pins the receiving pages *before* any byte is asked for, for transports that land bytes
    /// directly in the pool (NIXL's one-sided writes and reads): the pages stay the request's,
    /// and out of every other request's reach, until the returned [`PinnedImport`] accepts,
    /// refuses or is dropped (which aborts: nothing recorded). Refused like
    /// [`accept`](Self::accept) when the table does not hold the pages (recorded in the table).
    pub fn pin(&self, expected: &ExpectedTransfer<'_>) -> Result<PinnedImport<'t>, TransferError> {
        match self.pin_ticket(expected) {
            Ok(ticket) => Ok(PinnedImport { receiver: *self, ticket }),
            Err(e) => Err(self.refused(expected, e)),
        }
    }

    /// The table holds the receiving request for `expected.tenant`. Called with the pages pinned:
    /// while the first one is still the request's in the offered incarnation, its tag names the
    /// tenant of exactly the request the pages were pinned for. Should the request have released
    /// it meanwhile, there is nothing left to check: recording the import will be refused.
    fn check_tenant(&self, expected: &ExpectedTransfer<'_>) -> Result<(), TransferError> {
        let req = expected.request;
        let tenant = match expected.pages.first() {
            Some(first) => self
                .table
                .page_info(first.page)
                .filter(|info| info.owner == Some(req) && info.generation == first.generation)
                .and_then(|info| info.tenant),
            None => self.table.request_info(req).map(|info| info.tenant),
        };
        match tenant {
            Some(table) if table != expected.tenant => {
                Err(TransferError::TableTenant { request: req, expected: expected.tenant, table })
            }
            _ => Ok(()),
        }
    }
}

/// An import whose bytes are landing: if it is dropped before [`landed`](Landing::landed) or
/// [`fail`](Landing::fail) (the caller's `land` panicked), the import fails at the page it was
/// landing, as if `land` had returned an error.
struct Landing<'t> {
    ticket: Option<ImportTicket<'t>>,
    /// The entry being landed.
    at: usize,
}

impl<'t> Landing<'t> {
    /// Every page landed: the ticket, to record what landed.
    fn landed(mut self) -> ImportTicket<'t> {
        self.ticket.take().expect("a landing ends once: landed or failed, consuming it")
    }

    /// The entry being landed failed: the import fails there.
    fn fail(mut self) {
        if let Some(ticket) = self.ticket.take() {
            ticket.fail(self.at);
        }
    }
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            ticket.fail(self.at);
        }
    }
}

/// A transfer whose receiving pages are pinned ([`Receiver::pin`]) while its bytes are on their
/// way; it ends by [`accept`](Self::accept), [`refuse`](Self::refuse) or
/// [`abort`](Self::abort) (also on drop): only an accepted transfer records coverage.
#[derive(Debug)]
#[must_use = "dropping a pinned import aborts it"]
pub struct PinnedImport<'t> {
    receiver: Receiver<'t>,
    ticket: ImportTicket<'t>,
}

impl<'t> PinnedImport<'t> {
    /// The pinned pages, in the incarnations pinned.
    pub fn pages(&self) -> &[PageRef] {
        self.ticket.pages()
    }

    /// The request the pages are pinned for.
    pub fn request(&self) -> crate::RequestId {
        self.ticket.request()
    }

    /// [`Receiver::accept`] under the pin: `expected` must name the pages pinned
    /// ([`TransferError::Pages`] otherwise). `pages` are the bytes that landed (for a transport
    /// that wrote them in place, the pool's own pages; `land` may then do nothing).
    pub fn accept<P: AsRef<[u8]>>(
        self,
        expected: &ExpectedTransfer<'_>,
        manifest_bytes: &[u8],
        pages: &[P],
        land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), LandError>,
    ) -> Result<Accepted, TransferError> {
        self.accept_checksummed(expected, manifest_bytes, pages, &[], land)
    }

    /// [`accept`](Self::accept), with page `i`'s CRC32 ([`page_checksum`](super::page_checksum)
    /// of `pages[i]`) taken from `checksums[i]` where it is `Some`: a transport that checksummed
    /// pages as they landed, while the rest of the transfer was in flight, so the check does not
    /// run after the transfer. Each must be the checksum of the bytes `pages[i]` holds now.
    pub fn accept_checksummed<P: AsRef<[u8]>>(
        self,
        expected: &ExpectedTransfer<'_>,
        manifest_bytes: &[u8],
        pages: &[P],
        checksums: &[Option<u32>],
        land: impl FnMut(usize, PageRef, &[u8]) -> Result<(), LandError>,
    ) -> Result<Accepted, TransferError> {
        let PinnedImport { receiver, ticket } = self;
        let outcome = if ticket.pages() != expected.pages {
            let index = ticket.pages().iter().zip(expected.pages).position(|(a, b)| a != b);
            Err(TransferError::Pages { expected: ticket.pages().len(), found: expected.pages.len(), index })
        } else {
            Manifest::decode(manifest_bytes)
                .map_err(TransferError::from)
                .and_then(|manifest| receiver.land_checked(ticket, expected, &manifest, pages, checksums, land))
        };
        receiver.record_refusal(expected, outcome)
    }

    /// Refuses the transfer for `error` (found by the transport: pages it wrote elsewhere, say):
    /// recorded in the table like any refusal, nothing recorded as written, the pages unpinned.
    pub fn refuse(self, expected: &ExpectedTransfer<'_>, error: TransferError) -> TransferError {
        let PinnedImport { receiver, ticket } = self;
        ticket.abort();
        receiver.refused(expected, error)
    }

    /// [`refuse`](Self::refuse), with the pages kept pinned ([`fence`](Self::fence)) instead of
    /// unpinned: for a transport whose transfer may still write them (a push refused before it
    /// finished). Returns the refusal and the fence to lift once the sender is done.
    pub fn refuse_fenced(self, expected: &ExpectedTransfer<'_>, error: TransferError) -> (TransferError, crate::Fence) {
        let PinnedImport { receiver, ticket } = self;
        let fence = ticket.fence();
        (receiver.refused(expected, error), fence)
    }

    /// Records that the transfer's WRITEs named `pages` outside the pinned ones (a hostile or
    /// buggy push): each is treated as overwritten ([`OwnershipTable::record_overwritten`]: its
    /// holders' coverage of it revoked, a violation by the receiving request naming it). The
    /// import itself is untouched: refuse or abort it next.
    pub fn overwritten(&self, pages: &[crate::PageId]) -> Vec<crate::Violation> {
        self.receiver.table.record_overwritten(self.ticket.request(), pages)
    }

    /// Ends the transfer with no verdict on its content and its pages still pinned, because
    /// bytes may still land in them ([`ImportTicket::fence`]): see
    /// [`OwnershipTable::lift_fence`].
    pub fn fence(self) -> crate::Fence {
        self.ticket.fence()
    }

    /// The table the pages are pinned in.
    pub fn table(&self) -> &'t OwnershipTable {
        self.receiver.table
    }

    /// Abandons the transfer with no verdict on its content (it timed out, or the transport
    /// failed): nothing is recorded, the pages are unpinned.
    pub fn abort(self) {
        self.ticket.abort();
    }
}
