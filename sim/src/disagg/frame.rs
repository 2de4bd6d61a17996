//! The loopback wire between the prefill and decode processes: length-prefixed frames, every
//! length checked against a hard cap before anything is allocated.

use kvguard::{Generation, PageId, PageRef, RequestId};
use std::io::{self, Read, Write};

/// The largest frame either side accepts: 64 MiB.
pub const MAX_FRAME: u32 = 64 << 20;
/// The most pages one pull or transfer may name.
pub const MAX_FRAME_PAGES: u32 = 1 << 20;

/// One message between the nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Decode → prefill: prefill `request` and send its KV into these pages.
    Pull {
        /// The request.
        request: RequestId,
        /// The receiving pages, in token order, in the incarnations decode holds them.
        dest: Vec<PageRef>,
    },
    /// Prefill → decode: the manifest bytes and one buffer per page.
    Transfer {
        /// The encoded manifest.
        manifest: Vec<u8>,
        /// The pages' bytes.
        pages: Vec<Vec<u8>>,
    },
    /// Prefill → decode: the transfer is not ready yet.
    Busy,
    /// Decode → prefill: no more requests.
    Done,
    /// Either way, once after connecting, when the KV travels over NIXL: the sender's agent
    /// metadata and the layout of its registered pages (the out-of-band exchange NIXL expects).
    Peer {
        /// The NIXL agent metadata.
        metadata: Vec<u8>,
        /// The encoded region layout.
        region: Vec<u8>,
    },
}

const PULL: u8 = 1;
const TRANSFER: u8 = 2;
const BUSY: u8 = 3;
const DONE: u8 = 4;
const PEER: u8 = 5;

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// A bounds-checked reader over one frame's payload.
struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.rest.len() < n {
            return Err(bad(format!("frame truncated: {} bytes needed, {} left", n, self.rest.len())));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u32(&mut self) -> io::Result<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> io::Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    /// A count of items of `item_len` bytes each, checked against the bytes left and `cap`.
    fn count(&mut self, item_len: usize, cap: u32) -> io::Result<usize> {
        let n = self.u32()?;
        if n > cap || (n as usize).saturating_mul(item_len) > self.rest.len() {
            return Err(bad(format!("frame claims {n} items, more than it can hold")));
        }
        Ok(n as usize)
    }
}

impl Frame {
    /// Writes the frame: tag, payload length, payload.
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let mut payload = Vec::new();
        let tag = match self {
            Frame::Pull { request, dest } => {
                payload.extend_from_slice(&request.0.to_le_bytes());
                payload.extend_from_slice(&(dest.len() as u32).to_le_bytes());
                for r in dest {
                    payload.extend_from_slice(&r.page.0.to_le_bytes());
                    payload.extend_from_slice(&r.generation.0.to_le_bytes());
                }
                PULL
            }
            Frame::Transfer { manifest, pages } => {
                payload.extend_from_slice(&(manifest.len() as u32).to_le_bytes());
                payload.extend_from_slice(manifest);
                payload.extend_from_slice(&(pages.len() as u32).to_le_bytes());
                for p in pages {
                    payload.extend_from_slice(&(p.len() as u32).to_le_bytes());
                    payload.extend_from_slice(p);
                }
                TRANSFER
            }
            Frame::Busy => BUSY,
            Frame::Done => DONE,
            Frame::Peer { metadata, region } => {
                for part in [metadata, region] {
                    payload.extend_from_slice(&(part.len() as u32).to_le_bytes());
                    payload.extend_from_slice(part);
                }
                PEER
            }
        };
        let len = u32::try_from(payload.len()).ok().filter(|&l| l <= MAX_FRAME);
        let len = len.ok_or_else(|| bad(format!("frame of {} bytes exceeds the cap", payload.len())))?;
        w.write_all(&[tag])?;
        w.write_all(&len.to_le_bytes())?;
        w.write_all(&payload)?;
        w.flush()
    }

    /// Reads one frame; a length beyond [`MAX_FRAME`], a count beyond what the payload holds or an
    /// unknown tag is `InvalidData`, never an allocation.
    pub fn read_from(r: &mut impl Read) -> io::Result<Frame> {
        let mut head = [0u8; 5];
        r.read_exact(&mut head)?;
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
        if len > MAX_FRAME {
            return Err(bad(format!("frame of {len} bytes exceeds the {MAX_FRAME}-byte cap")));
        }
        let mut payload = vec![0u8; len as usize];
        r.read_exact(&mut payload)?;
        let mut c = Cursor { rest: &payload };
        let frame = match head[0] {
            PULL => {
                let request = RequestId(c.u64()?);
                let n = c.count(8, MAX_FRAME_PAGES)?;
                let mut dest = Vec::with_capacity(n);
                for _ in 0..n {
                    dest.push(PageRef { page: PageId(c.u32()?), generation: Generation(c.u32()?) });
                }
                Frame::Pull { request, dest }
            }
            TRANSFER => {
                let m = c.count(1, MAX_FRAME)?;
                let manifest = c.take(m)?.to_vec();
                let n = c.count(4, MAX_FRAME_PAGES)?;
                let mut pages = Vec::with_capacity(n);
                for _ in 0..n {
                    let len = c.count(1, MAX_FRAME)?;
                    pages.push(c.take(len)?.to_vec());
                }
                Frame::Transfer { manifest, pages }
            }
            BUSY => Frame::Busy,
            DONE => Frame::Done,
            PEER => {
                let m = c.count(1, MAX_FRAME)?;
                let metadata = c.take(m)?.to_vec();
                let r = c.count(1, MAX_FRAME)?;
                let region = c.take(r)?.to_vec();
                Frame::Peer { metadata, region }
            }
            t => return Err(bad(format!("unknown frame tag {t}"))),
        };
        if !c.rest.is_empty() {
            return Err(bad(format!("{} stray bytes after the frame", c.rest.len())));
        }
        Ok(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let frames = [
            Frame::Pull { request: RequestId(3), dest: vec![PageRef { page: PageId(4), generation: Generation(2) }] },
            Frame::Transfer { manifest: vec![1, 2, 3], pages: vec![vec![4; 12], vec![]] },
            Frame::Busy,
            Frame::Done,
            Frame::Peer { metadata: vec![9; 5], region: vec![7; 32] },
        ];
        for f in frames {
            let mut buf = Vec::new();
            f.write_to(&mut buf).unwrap();
            assert_eq!(Frame::read_from(&mut buf.as_slice()).unwrap(), f);
            for cut in 0..buf.len() {
                assert!(Frame::read_from(&mut &buf[..cut]).is_err());
            }
        }
    }

    #[test]
    fn oversized_lengths_are_refused_without_allocating() {
        let mut buf = vec![TRANSFER];
        buf.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Frame::read_from(&mut buf.as_slice()).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let mut buf = vec![PULL];
        buf.extend_from_slice(&12u32.to_le_bytes());
        buf.extend_from_slice(&1u64.to_le_bytes());
        buf.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Frame::read_from(&mut buf.as_slice()).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }
}
