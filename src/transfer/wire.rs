//! The manifest's wire format: building it from pages, encoding, and decoding untrusted bytes.
//!
//! Version 1, all integers little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"KVGM"` |
//! | 4 | 2 | version (1) |
//! | 6 | 2 | flags (0; any other value is refused) |
//! | 8 | 8 | request id |
//! | 16 | 8 | tenant id |
//! | 24 | 8 | sender instance id |
//! | 32 | 8 | tokens prefilled |
//! | 40 | 8 | prompt digest ([`PromptDigest`]) |
//! | 48 | 4 | page size (token slots per page) |
//! | 52 | 4 | bytes per token slot |
//! | 56 | 4 | page count `n` (at most [`MAX_MANIFEST_PAGES`]) |
//! | 60 | 4 | reserved (0) |
//! | 64 | 16·n | per page: receiving page id, its generation, tokens in it, CRC32 of its bytes |
//! | 64+16·n | 4 | CRC32 of every preceding byte |
//!
//! A page's checksum is crc32fast's CRC32 of its bytes with the value 0 folded into 1, so a stored
//! 0 always means "no checksum" and is refused.

use super::digest::PromptDigest;
use crate::ids::{Generation, PageId, PageRef, RequestId, TenantId, grouped};
use crate::le;

/// The manifest's magic bytes.
pub const MAGIC: [u8; 4] = *b"KVGM";
/// The wire format version this build writes and reads.
pub const VERSION: u16 = 1;
/// Bytes before the page entries.
pub const HEADER_LEN: usize = 64;
/// Bytes per page entry.
pub const PAGE_ENTRY_LEN: usize = 16;
/// Bytes of the trailing manifest CRC32.
pub const TRAILER_LEN: usize = 4;
/// The most pages one manifest may list: a max-context request of 1,048,576 tokens at page size 1.
/// Bounds what a decoder allocates (16 MiB of entries) whatever the bytes claim.
pub const MAX_MANIFEST_PAGES: u32 = 1 << 20;

/// The instance that prefilled and sent a transfer (a prefill worker's id).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct SenderId(pub u64);

impl std::fmt::Display for SenderId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sender {}", self.0)
    }
}

/// One page of a transfer: where it lands, how many tokens it carries, and its bytes' checksum.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PageEntry {
    /// The receiving page and the incarnation the receiver named when it asked for the transfer.
    pub dest: PageRef,
    /// Token slots it carries, from slot 0.
    pub tokens: u32,
    /// CRC32 of the page's bytes, 0 folded into 1 (see [`page_checksum`]).
    pub crc32: u32,
}

/// The checksum a manifest carries for `bytes`: crc32fast's CRC32, with 0 folded into 1 so that a
/// zero field always reads as "missing".
#[inline]
pub fn page_checksum(bytes: &[u8]) -> u32 {
    checksum_value(crc32fast::hash(bytes))
}

/// A CRC32 as [`page_checksum`] reports it (0 folded into 1), for a CRC computed piecewise.
#[inline]
pub(crate) fn checksum_value(crc: u32) -> u32 {
    match crc {
        0 => 1,
        c => c,
    }
}

/// What travels with a prefill→decode KV transfer: whose KV it is, what prompt it is the KV of,
/// where each page lands and what its bytes must hash to.
///
/// Only [`Manifest::build`] and [`Manifest::decode`] make one, so every manifest in hand is
/// self-consistent: page count and per-page tokens agree with the token count and page size, and
/// every page has a checksum.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Manifest {
    request: RequestId,
    tenant: TenantId,
    sender: SenderId,
    prompt_tokens: u64,
    prompt_digest: PromptDigest,
    page_size: u32,
    slot_bytes: u32,
    pages: Vec<PageEntry>,
}

/// Who a transfer is for and the shape of its pages; the rest of a manifest comes from the data.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct TransferHeader {
    /// The request whose KV this is.
    pub request: RequestId,
    /// Its tenant.
    pub tenant: TenantId,
    /// The sending instance.
    pub sender: SenderId,
    /// Token slots per page (the same on both sides).
    pub page_size: u32,
    /// Bytes of KV per token slot; a page carrying `t` tokens sends `t * slot_bytes` bytes.
    pub slot_bytes: u32,
}

/// Why a manifest could not be built from the sender's pages.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// Page size or slot size of 0, or a page's byte size beyond `u32`.
    #[error("page size {page_size} x {slot_bytes} bytes per slot is not a page shape")]
    Shape {
        /// Token slots per page.
        page_size: u32,
        /// Bytes per slot.
        slot_bytes: u32,
    },
    /// More pages than a manifest may list.
    #[error("{} pages, more than the {} a manifest may list", grouped(*pages), grouped(u64::from(MAX_MANIFEST_PAGES)))]
    TooManyPages {
        /// Pages the prompt needs.
        pages: u64,
    },
    /// The number of receiving pages or page buffers is not the number the prompt needs.
    #[error("{tokens} tokens need {needed} pages, but {dest} receiving pages and {buffers} page buffers were given")]
    PageCount {
        /// Tokens prefilled.
        tokens: u64,
        /// Pages they need.
        needed: u64,
        /// Receiving pages given.
        dest: usize,
        /// Page buffers given.
        buffers: usize,
    },
    /// A page buffer of another length than its tokens times the slot size.
    #[error("page {index} has {found} bytes, {expected} expected for its tokens")]
    PageLength {
        /// Position in the transfer.
        index: usize,
        /// Bytes given.
        found: usize,
        /// `tokens * slot_bytes`.
        expected: u64,
    },
}

/// Why manifest bytes were refused. Every malformed input maps to one of these; none panics.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the manifest's fixed parts or than its page count implies.
    #[error("manifest truncated: {found} bytes, at least {needed} needed")]
    Truncated {
        /// Bytes needed.
        needed: u64,
        /// Bytes present.
        found: usize,
    },
    /// More bytes than the page count implies.
    #[error("manifest has {found} bytes, {expected} expected for its page count")]
    TrailingBytes {
        /// Bytes the page count implies.
        expected: u64,
        /// Bytes present.
        found: usize,
    },
    /// Not a kvguard manifest.
    #[error("not a manifest: magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A wire version this build does not read.
    #[error("manifest version {0} is not supported (this build reads version {VERSION})")]
    UnsupportedVersion(u16),
    /// A page count beyond [`MAX_MANIFEST_PAGES`].
    #[error("manifest lists {} pages, more than the {} allowed", grouped(u64::from(*.0)), grouped(u64::from(MAX_MANIFEST_PAGES)))]
    TooManyPages(u32),
    /// The manifest's own CRC32 does not match its bytes.
    #[error("manifest checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// The trailer.
        stored: u32,
        /// CRC32 of the preceding bytes.
        computed: u32,
    },
    /// Flags or reserved bits this version does not define.
    #[error("manifest has undefined flags {flags:#06x} / reserved {reserved:#010x}")]
    ReservedBits {
        /// The flags field.
        flags: u16,
        /// The reserved field.
        reserved: u32,
    },
    /// A page size or slot size of 0.
    #[error("manifest page shape {page_size} slots x {slot_bytes} bytes is invalid")]
    Shape {
        /// Token slots per page.
        page_size: u32,
        /// Bytes per slot.
        slot_bytes: u32,
    },
    /// Page count, per-page token counts and the total token count disagree.
    #[error("manifest token layout is inconsistent: {detail}")]
    Layout {
        /// What disagrees.
        detail: String,
    },
    /// A page with no checksum (zero): a failure, never a pass.
    #[error("manifest page {index} has no checksum")]
    MissingChecksum {
        /// Position in the transfer.
        index: usize,
    },
}

/// The little-endian field at `at` of `bytes`, read by `read` (a [`crate::le`] reader). `decode`
/// checks every length before it reads a field, so a field past the end is not reached; were it
/// reached, it would be `Truncated`, never a panic.
fn field<T>(bytes: &[u8], at: usize, read: fn(&[u8], usize) -> Option<T>) -> Result<T, DecodeError> {
    read(bytes, at)
        .ok_or(DecodeError::Truncated { needed: at.saturating_add(size_of::<T>()) as u64, found: bytes.len() })
}

/// Tokens in page `index` of a `tokens`-token sequence with `page_size` slots per page (0 past
/// its end): the one place that splits a sequence into pages, for manifests and their senders. A
/// sender slices page `index`'s bytes to `tokens_in_page(..) * slot_bytes` before
/// [`Manifest::build`].
///
/// ```
/// use kvguard::transfer::tokens_in_page;
/// // 130 tokens in pages of 64: 64, 64, 2, then nothing.
/// let split: Vec<u32> = (0..4).map(|i| tokens_in_page(130, 64, i)).collect();
/// assert_eq!(split, [64, 64, 2, 0]);
/// ```
pub fn tokens_in_page(tokens: u64, page_size: u32, index: usize) -> u32 {
    let start = (index as u64).saturating_mul(u64::from(page_size));
    let in_page = tokens.saturating_sub(start).min(u64::from(page_size));
    u32::try_from(in_page).unwrap_or(page_size) // `in_page <= page_size`, a `u32`: always `Ok`
}

impl Manifest {
    /// Builds the manifest for `prompt` (the tokens actually prefilled) sent as `pages` (one buffer
    /// per page, `tokens * slot_bytes` bytes each) into the receiver's `dest` pages.
    ///
    /// ```
    /// use kvguard::transfer::{Manifest, SenderId, TransferHeader};
    /// use kvguard::{Generation, PageId, PageRef, RequestId, TenantId};
    /// let header = TransferHeader { request: RequestId(7), tenant: TenantId(1), sender: SenderId(3), page_size: 4, slot_bytes: 2 };
    /// let prompt = [11, 12, 13, 14, 15];
    /// let dest = [PageRef { page: PageId(9), generation: Generation(2) }, PageRef { page: PageId(4), generation: Generation(1) }];
    /// let pages: [&[u8]; 2] = [&[1, 2, 3, 4, 5, 6, 7, 8], &[9, 10]];
    /// let manifest = Manifest::build(header, &prompt, &dest, &pages)?;
    /// assert_eq!(Manifest::decode(&manifest.encode())?, manifest);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn build<P: AsRef<[u8]>>(
        header: TransferHeader,
        prompt: &[u32],
        dest: &[PageRef],
        pages: &[P],
    ) -> Result<Manifest, BuildError> {
        let checksums: Vec<(usize, u32)> = pages.iter().map(|p| (p.as_ref().len(), 1)).collect();
        // Lengths first: no page is checksummed for a manifest that cannot be built.
        Manifest::build_checksummed(header, prompt, dest, &checksums)?;
        let checksums: Vec<(usize, u32)> =
            pages.iter().map(|p| (p.as_ref().len(), page_checksum(p.as_ref()))).collect();
        Manifest::build_checksummed(header, prompt, dest, &checksums)
    }

    /// [`build`](Self::build) from each page's length in bytes and CRC32 ([`page_checksum`] of
    /// its bytes), for a sender that checksummed the pages itself (while earlier pages were in
    /// flight, say). A CRC of 0 is taken as [`page_checksum`] reports it (1).
    pub fn build_checksummed(
        header: TransferHeader,
        prompt: &[u32],
        dest: &[PageRef],
        pages: &[(usize, u32)],
    ) -> Result<Manifest, BuildError> {
        let TransferHeader { request, tenant, sender, page_size, slot_bytes } = header;
        let shape = BuildError::Shape { page_size, slot_bytes };
        if page_size == 0 || slot_bytes == 0 || u64::from(page_size) * u64::from(slot_bytes) > u64::from(u32::MAX) {
            return Err(shape);
        }
        let tokens = prompt.len() as u64;
        let needed = tokens.div_ceil(u64::from(page_size));
        if needed > u64::from(MAX_MANIFEST_PAGES) {
            return Err(BuildError::TooManyPages { pages: needed });
        }
        if dest.len() as u64 != needed || pages.len() as u64 != needed {
            return Err(BuildError::PageCount { tokens, needed, dest: dest.len(), buffers: pages.len() });
        }
        let mut entries = Vec::with_capacity(dest.len());
        for (index, (&dest, &(len, crc))) in dest.iter().zip(pages).enumerate() {
            let page_tokens = tokens_in_page(tokens, page_size, index);
            let expected = u64::from(page_tokens) * u64::from(slot_bytes);
            if len as u64 != expected {
                return Err(BuildError::PageLength { index, found: len, expected });
            }
            entries.push(PageEntry { dest, tokens: page_tokens, crc32: checksum_value(crc) });
        }
        Ok(Manifest {
            request,
            tenant,
            sender,
            prompt_tokens: tokens,
            prompt_digest: PromptDigest::of_tokens(prompt),
            page_size,
            slot_bytes,
            pages: entries,
        })
    }

    /// The request whose KV this is.
    pub fn request(&self) -> RequestId {
        self.request
    }
    /// Its tenant.
    pub fn tenant(&self) -> TenantId {
        self.tenant
    }
    /// The sending instance.
    pub fn sender(&self) -> SenderId {
        self.sender
    }
    /// Tokens actually prefilled and sent.
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens
    }
    /// Digest of the token ids actually prefilled.
    pub fn prompt_digest(&self) -> PromptDigest {
        self.prompt_digest
    }
    /// Token slots per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }
    /// Bytes per token slot.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }
    /// The pages, in token order.
    pub fn pages(&self) -> &[PageEntry] {
        &self.pages
    }

    /// Bytes [`encode`](Self::encode) writes.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + PAGE_ENTRY_LEN * self.pages.len() + TRAILER_LEN
    }

    /// The wire bytes (see the [module docs](self) for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.request.0.to_le_bytes());
        out.extend_from_slice(&self.tenant.0.to_le_bytes());
        out.extend_from_slice(&self.sender.0.to_le_bytes());
        out.extend_from_slice(&self.prompt_tokens.to_le_bytes());
        out.extend_from_slice(&self.prompt_digest.0.to_le_bytes());
        out.extend_from_slice(&self.page_size.to_le_bytes());
        out.extend_from_slice(&self.slot_bytes.to_le_bytes());
        // Build and decode both bound the page count by `MAX_MANIFEST_PAGES`, a `u32`.
        out.extend_from_slice(&(self.pages.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for p in &self.pages {
            out.extend_from_slice(&p.dest.page.0.to_le_bytes());
            out.extend_from_slice(&p.dest.generation.0.to_le_bytes());
            out.extend_from_slice(&p.tokens.to_le_bytes());
            out.extend_from_slice(&p.crc32.to_le_bytes());
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes untrusted manifest bytes: every length is checked against the bytes present and
    /// [`MAX_MANIFEST_PAGES`] before anything is allocated, the manifest's own CRC32 is checked
    /// before any field is believed, and the token layout must be self-consistent.
    pub fn decode(bytes: &[u8]) -> Result<Manifest, DecodeError> {
        let fixed = HEADER_LEN + TRAILER_LEN;
        if bytes.len() < fixed {
            return Err(DecodeError::Truncated { needed: fixed as u64, found: bytes.len() });
        }
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        let version = field(bytes, 4, le::u16_at)?;
        if version != VERSION {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let count = field(bytes, 56, le::u32_at)?;
        if count > MAX_MANIFEST_PAGES {
            return Err(DecodeError::TooManyPages(count));
        }
        let expected_len = fixed as u64 + u64::from(count) * PAGE_ENTRY_LEN as u64;
        if (bytes.len() as u64) < expected_len {
            return Err(DecodeError::Truncated { needed: expected_len, found: bytes.len() });
        }
        if bytes.len() as u64 > expected_len {
            return Err(DecodeError::TrailingBytes { expected: expected_len, found: bytes.len() });
        }
        let body_len = bytes.len() - TRAILER_LEN;
        let stored = field(bytes, body_len, le::u32_at)?;
        let computed = crc32fast::hash(&bytes[..body_len]);
        if stored != computed {
            return Err(DecodeError::ChecksumMismatch { stored, computed });
        }
        let (flags, reserved) = (field(bytes, 6, le::u16_at)?, field(bytes, 60, le::u32_at)?);
        if flags != 0 || reserved != 0 {
            return Err(DecodeError::ReservedBits { flags, reserved });
        }
        let (page_size, slot_bytes) = (field(bytes, 48, le::u32_at)?, field(bytes, 52, le::u32_at)?);
        if page_size == 0 || slot_bytes == 0 || u64::from(page_size) * u64::from(slot_bytes) > u64::from(u32::MAX) {
            return Err(DecodeError::Shape { page_size, slot_bytes });
        }
        let prompt_tokens = field(bytes, 32, le::u64_at)?;
        let needed = prompt_tokens.div_ceil(u64::from(page_size));
        if needed != u64::from(count) {
            return Err(DecodeError::Layout {
                detail: format!("{prompt_tokens} tokens at {page_size} per page need {needed} pages, {count} listed"),
            });
        }
        // `count` is bounded by MAX_MANIFEST_PAGES and by the bytes present.
        let mut pages = Vec::with_capacity(count as usize);
        for (index, e) in bytes[HEADER_LEN..body_len].chunks_exact(PAGE_ENTRY_LEN).enumerate() {
            let entry = PageEntry {
                dest: PageRef {
                    page: PageId(field(e, 0, le::u32_at)?),
                    generation: Generation(field(e, 4, le::u32_at)?),
                },
                tokens: field(e, 8, le::u32_at)?,
                crc32: field(e, 12, le::u32_at)?,
            };
            let want = tokens_in_page(prompt_tokens, page_size, index);
            if entry.tokens != want {
                return Err(DecodeError::Layout {
                    detail: format!("page {index} carries {} tokens, {want} expected", entry.tokens),
                });
            }
            if entry.crc32 == 0 {
                return Err(DecodeError::MissingChecksum { index });
            }
            pages.push(entry);
        }
        Ok(Manifest {
            request: RequestId(field(bytes, 8, le::u64_at)?),
            tenant: TenantId(field(bytes, 16, le::u64_at)?),
            sender: SenderId(field(bytes, 24, le::u64_at)?),
            prompt_tokens,
            prompt_digest: PromptDigest(field(bytes, 40, le::u64_at)?),
            page_size,
            slot_bytes,
            pages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_built_from_checksums_is_the_one_built_from_bytes() {
        let (built, pages) = sample();
        let header = TransferHeader {
            request: built.request(),
            tenant: built.tenant(),
            sender: built.sender(),
            page_size: built.page_size(),
            slot_bytes: built.slot_bytes(),
        };
        let dest: Vec<PageRef> = built.pages().iter().map(|e| e.dest).collect();
        let prompt: Vec<u32> = (100..110).collect(); // sample()'s prompt
        let sums: Vec<(usize, u32)> = pages.iter().map(|p| (p.len(), crc32fast::hash(p))).collect();
        let from_sums = Manifest::build_checksummed(header, &prompt, &dest, &sums).unwrap();
        assert_eq!(from_sums, Manifest::build(header, &prompt, &dest, &pages).unwrap());
        // A raw CRC of 0 is recorded as page_checksum reports it, never as "missing".
        let zero: Vec<(usize, u32)> = sums.iter().map(|&(len, _)| (len, 0)).collect();
        let m = Manifest::build_checksummed(header, &prompt, &dest, &zero).unwrap();
        assert!(m.pages().iter().all(|e| e.crc32 == 1));
        let short: Vec<(usize, u32)> = sums.iter().map(|&(len, c)| (len - 1, c)).collect();
        assert!(matches!(
            Manifest::build_checksummed(header, &prompt, &dest, &short),
            Err(BuildError::PageLength { index: 0, .. })
        ));
    }

    fn sample() -> (Manifest, Vec<Vec<u8>>) {
        let header = TransferHeader {
            request: RequestId(42),
            tenant: TenantId(7),
            sender: SenderId(1),
            page_size: 4,
            slot_bytes: 3,
        };
        let prompt: Vec<u32> = (100..110).collect();
        let dest: Vec<PageRef> =
            (0..3).map(|i| PageRef { page: PageId(10 + i), generation: Generation(1 + i) }).collect();
        let pages: Vec<Vec<u8>> = vec![vec![1; 12], vec![2; 12], vec![3; 6]];
        (Manifest::build(header, &prompt, &dest, &pages).unwrap(), pages)
    }

    #[test]
    fn encode_then_decode_is_identity_and_lengths_match() {
        let (m, _) = sample();
        let bytes = m.encode();
        assert_eq!(bytes.len(), m.encoded_len());
        assert_eq!(bytes.len(), HEADER_LEN + 3 * PAGE_ENTRY_LEN + TRAILER_LEN);
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        assert_eq!(m.pages()[2].tokens, 2);
    }

    #[test]
    fn build_refuses_mismatched_pages() {
        let header = TransferHeader {
            request: RequestId(1),
            tenant: TenantId(1),
            sender: SenderId(1),
            page_size: 4,
            slot_bytes: 1,
        };
        let dest = [PageRef { page: PageId(0), generation: Generation(1) }];
        let err = Manifest::build(header, &[1, 2, 3], &dest, &[vec![0u8; 2]]).unwrap_err();
        assert!(matches!(err, BuildError::PageLength { index: 0, found: 2, expected: 3 }));
        let err = Manifest::build(header, &[1, 2, 3, 4, 5], &dest, &[vec![0u8; 4]]).unwrap_err();
        assert!(matches!(err, BuildError::PageCount { needed: 2, .. }));
        let err = Manifest::build(TransferHeader { page_size: 0, ..header }, &[], &[], &[] as &[Vec<u8>]).unwrap_err();
        assert!(matches!(err, BuildError::Shape { .. }));
    }

    #[test]
    fn a_zero_checksum_is_never_written() {
        // The CRC32 of these four bytes is 0; the manifest stores 1 instead.
        let zero_crc = [0x9d, 0x0a, 0xd9, 0x6d];
        assert_eq!(crc32fast::hash(&zero_crc), 0);
        assert_eq!(page_checksum(&zero_crc), 1);
    }

    #[test]
    fn every_truncation_is_refused() {
        let (m, _) = sample();
        let bytes = m.encode();
        for len in 0..bytes.len() {
            assert!(Manifest::decode(&bytes[..len]).is_err(), "prefix of {len} bytes accepted");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(Manifest::decode(&long), Err(DecodeError::TrailingBytes { .. })));
    }

    #[test]
    fn a_huge_page_count_is_refused_before_allocating() {
        let (m, _) = sample();
        let mut bytes = m.encode();
        bytes[56..60].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Manifest::decode(&bytes), Err(DecodeError::TooManyPages(u32::MAX)));
        bytes[56..60].copy_from_slice(&MAX_MANIFEST_PAGES.to_le_bytes());
        assert!(matches!(Manifest::decode(&bytes), Err(DecodeError::Truncated { .. })));
    }
}
