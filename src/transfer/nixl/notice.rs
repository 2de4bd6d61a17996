//! The notifications of the checked protocol and the region layout exchanged out of band: small
//! binary messages, each sealed by a CRC32 and decoded as untrusted input.

use super::NixlError;
use crate::ids::RequestId;
use crate::transfer::wire::MAX_MANIFEST_PAGES;

/// `len` bytes at the start of page `page` of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// The page index in its region.
    pub page: u32,
    /// Bytes from the page's start (at most the region's page size).
    pub len: u32,
}

const MAGIC: &[u8; 4] = b"KVGN";
const VERSION: u8 = 1;
const HEADER: usize = 24;
const EXTENT: usize = 8;
const TRAILER: usize = 4;

/// What a notification says about one request's transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NoticeKind {
    /// Push, prefill → decode, the notification of the WRITE itself (NIXL delivers it after the
    /// data): the extents written into decode's pages and the manifest.
    Written,
    /// Pull, prefill → decode: the KV is in prefill's pages (the extents) and the manifest says
    /// what it is; decode READs it.
    Staged,
    /// Pull, decode → prefill: decode no longer reads the staged pages (whatever its verdict);
    /// prefill may reuse them. Also decode's answer to `Declined`.
    Released,
    /// prefill → decode: it will not send this request's KV now; decode aborts and may ask again.
    Declined,
    /// Push, prefill → decode, the notification of one WRITE of a transfer sent in several (NIXL
    /// delivers it after that WRITE's data): the extents it landed, no manifest. Decode may
    /// checksum those pages while the rest is in flight; the `Written` notice that ends the
    /// transfer says how many parts came before it.
    Part,
}

impl NoticeKind {
    fn code(self) -> u8 {
        match self {
            NoticeKind::Written => 1,
            NoticeKind::Staged => 2,
            NoticeKind::Released => 3,
            NoticeKind::Declined => 4,
            NoticeKind::Part => 5,
        }
    }
    fn from_code(code: u8) -> Option<NoticeKind> {
        Some(match code {
            1 => NoticeKind::Written,
            2 => NoticeKind::Staged,
            3 => NoticeKind::Released,
            4 => NoticeKind::Declined,
            5 => NoticeKind::Part,
            _ => return None,
        })
    }
}

/// One notification of the protocol.
///
/// ```text
///  0  magic "KVGN"   4      16  extent count n   4
///  4  version = 1    1      20  manifest length  4
///  5  kind           1      24  n x { page u32, bytes u32 }
///  6  parts          2      24+8n  manifest (kvguard's own wire format, sealed by its own CRC)
///  8  request id     8      ...  CRC32 of everything before
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    /// What it says.
    pub kind: NoticeKind,
    /// The request it is about (routing only: the manifest's own request is what is checked).
    pub request: RequestId,
    /// The pages written (push: decode's) or staged (pull: prefill's), each with its length.
    pub extents: Vec<Extent>,
    /// The encoded manifest (empty for `Released`, `Declined` and `Part`).
    pub manifest: Vec<u8>,
    /// `Written` only: how many `Part` notices of the same transfer precede it (0: the whole
    /// transfer was one WRITE). The final WRITE carries the data of the extents no part named;
    /// `extents` still lists every extent of the transfer, in order. 0 for every other kind.
    pub parts: u16,
}

impl Notice {
    /// A notice with no extents and no manifest.
    pub fn bare(kind: NoticeKind, request: RequestId) -> Notice {
        Notice { kind, request, extents: Vec::new(), manifest: Vec::new(), parts: 0 }
    }

    /// The bytes sent.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + EXTENT * self.extents.len() + self.manifest.len() + TRAILER);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(self.kind.code());
        out.extend_from_slice(&self.parts.to_le_bytes());
        out.extend_from_slice(&self.request.0.to_le_bytes());
        out.extend_from_slice(&(self.extents.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.manifest.len() as u32).to_le_bytes());
        for e in &self.extents {
            out.extend_from_slice(&e.page.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
        }
        out.extend_from_slice(&self.manifest);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes untrusted bytes: lengths checked against what is present before anything is
    /// allocated, the CRC checked before any field is believed.
    pub fn decode(bytes: &[u8]) -> Result<Notice, NixlError> {
        let bad = |reason: &str| NixlError::Notice { reason: reason.to_owned() };
        if bytes.len() < HEADER + TRAILER {
            return Err(bad("shorter than a header"));
        }
        if &bytes[..4] != MAGIC {
            return Err(bad("not a kvguard notice (magic)"));
        }
        let (body, trailer) = bytes.split_at(bytes.len() - TRAILER);
        if crc32fast::hash(body).to_le_bytes() != trailer {
            return Err(bad("CRC mismatch"));
        }
        if body[4] != VERSION {
            return Err(bad("unknown version"));
        }
        let kind = NoticeKind::from_code(body[5]).ok_or_else(|| bad("unknown kind"))?;
        let parts = u16::from_le_bytes([body[6], body[7]]);
        if parts != 0 && kind != NoticeKind::Written {
            return Err(bad("parts set on a notice that does not end a push"));
        }
        let u32_at = |at: usize| u32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
        let mut id = [0u8; 8];
        id.copy_from_slice(&body[8..16]);
        let (count, manifest_len) = (u32_at(16), u32_at(20));
        if count > MAX_MANIFEST_PAGES {
            return Err(bad("more extents than a manifest may list"));
        }
        let want = HEADER as u64 + EXTENT as u64 * u64::from(count) + u64::from(manifest_len);
        if want != body.len() as u64 {
            return Err(bad("lengths do not match the bytes present"));
        }
        let extents = (0..count as usize)
            .map(|i| Extent { page: u32_at(HEADER + EXTENT * i), len: u32_at(HEADER + EXTENT * i + 4) });
        let extents: Vec<Extent> = extents.collect();
        let manifest = body[HEADER + EXTENT * count as usize..].to_vec();
        Ok(Notice { kind, request: RequestId(u64::from_le_bytes(id)), extents, manifest, parts })
    }
}

/// Which memory a region is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Segment {
    /// Host memory (NIXL's `DRAM_SEG`).
    Dram,
    /// GPU memory (NIXL's `VRAM_SEG`); `device` is the CUDA device ordinal.
    Vram,
}

/// Where a side's pages are: what it tells its peer out of band, with its agent metadata, so the
/// peer can name them in transfers. Page `i` is `page_bytes` bytes at `base + i * page_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionLayout {
    /// Address of page 0 in the owner's address space.
    pub base: u64,
    /// Bytes per page.
    pub page_bytes: u32,
    /// Pages in the region.
    pub pages: u32,
    /// Host or GPU memory.
    pub segment: Segment,
    /// Device ordinal (0 for host memory).
    pub device: u64,
}

/// Length of an encoded [`RegionLayout`].
pub const LAYOUT_LEN: usize = 32;

impl RegionLayout {
    /// Bytes in the region.
    pub fn len(&self) -> Result<u64, NixlError> {
        let len = u64::from(self.pages) * u64::from(self.page_bytes);
        self.base.checked_add(len).map(|_| len).ok_or_else(|| NixlError::Extents {
            reason: format!("a region of {len} bytes at {:#x} wraps the address space", self.base),
        })
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.pages == 0 || self.page_bytes == 0
    }

    /// The address of `extent`, refused if it is not inside one page of the region.
    pub fn extent_addr(&self, extent: &Extent) -> Result<u64, NixlError> {
        if extent.page >= self.pages || extent.len > self.page_bytes {
            return Err(NixlError::Extents {
                reason: format!(
                    "page {} ({} bytes) outside a region of {} pages of {} bytes",
                    extent.page, extent.len, self.pages, self.page_bytes
                ),
            });
        }
        self.len()?;
        Ok(self.base + u64::from(extent.page) * u64::from(self.page_bytes))
    }

    /// The bytes sent out of band.
    pub fn encode(&self) -> [u8; LAYOUT_LEN] {
        let mut out = [0u8; LAYOUT_LEN];
        out[..8].copy_from_slice(&self.base.to_le_bytes());
        out[8..12].copy_from_slice(&self.page_bytes.to_le_bytes());
        out[12..16].copy_from_slice(&self.pages.to_le_bytes());
        out[16] = match self.segment {
            Segment::Dram => 0,
            Segment::Vram => 1,
        };
        out[24..32].copy_from_slice(&self.device.to_le_bytes());
        out
    }

    /// Decodes untrusted bytes.
    pub fn decode(bytes: &[u8]) -> Result<RegionLayout, NixlError> {
        let bad = |reason: &str| NixlError::Notice { reason: format!("region layout: {reason}") };
        let b: &[u8; LAYOUT_LEN] = bytes.try_into().map_err(|_| bad("wrong length"))?;
        let segment = match b[16] {
            0 => Segment::Dram,
            1 => Segment::Vram,
            _ => return Err(bad("unknown segment")),
        };
        if b[17..24].iter().any(|&x| x != 0) {
            return Err(bad("reserved bits set"));
        }
        let mut u64b = [0u8; 8];
        u64b.copy_from_slice(&b[..8]);
        let base = u64::from_le_bytes(u64b);
        u64b.copy_from_slice(&b[24..32]);
        let device = u64::from_le_bytes(u64b);
        let layout = RegionLayout {
            base,
            page_bytes: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            pages: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
            segment,
            device,
        };
        layout.len()?;
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_round_trips_and_every_flipped_bit_is_refused() {
        let n = Notice {
            kind: NoticeKind::Written,
            request: RequestId(7),
            extents: vec![Extent { page: 3, len: 768 }, Extent { page: 9, len: 12 }],
            manifest: vec![1, 2, 3],
            parts: 2,
        };
        let bytes = n.encode();
        assert_eq!(Notice::decode(&bytes).unwrap(), n);
        for bit in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(Notice::decode(&b).is_err(), "bit {bit}");
        }
        for len in 0..bytes.len() {
            assert!(Notice::decode(&bytes[..len]).is_err(), "len {len}");
        }
    }

    #[test]
    fn parts_are_counted_only_on_the_notice_that_ends_a_push() {
        let part =
            Notice { kind: NoticeKind::Part, request: RequestId(3), extents: vec![], manifest: vec![], parts: 0 };
        assert_eq!(Notice::decode(&part.encode()).unwrap(), part);
        let counted = Notice { parts: 1, ..part };
        assert!(Notice::decode(&counted.encode()).is_err());
    }

    #[test]
    fn a_layout_round_trips_and_extents_stay_inside_it() {
        let l = RegionLayout { base: 0x1000, page_bytes: 64, pages: 4, segment: Segment::Vram, device: 1 };
        assert_eq!(RegionLayout::decode(&l.encode()).unwrap(), l);
        assert_eq!(l.extent_addr(&Extent { page: 3, len: 64 }).unwrap(), 0x1000 + 192);
        assert!(l.extent_addr(&Extent { page: 4, len: 1 }).is_err());
        assert!(l.extent_addr(&Extent { page: 0, len: 65 }).is_err());
        let wrap = RegionLayout { base: u64::MAX - 10, ..l };
        assert!(RegionLayout::decode(&wrap.encode()).is_err());
    }
}
