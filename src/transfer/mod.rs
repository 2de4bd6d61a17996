//! KV transfers between prefill and decode that fail closed.
//!
//! In a disaggregated deployment the prefill node computes a prompt's KV and sends it to the
//! decode node, which attends to it for the rest of the request (the incident it guards against is
//! in the README). A [`Manifest`] travels with every transfer and says exactly what it is:
//!
//! - whose KV: request, tenant, sending instance;
//! - of what: the number of tokens actually prefilled and a [`PromptDigest`] of their ids;
//! - where to: the receiving pages in the incarnations ([`PageRef`](crate::PageRef)) the receiver
//!   offered, each with its token count and the CRC32 of its bytes.
//!
//! The [`Receiver`] accepts a transfer only if every part matches its own copy of the request and
//! the pages it still holds, which it pins for the transfer's duration so that no other request
//! can get them while bytes land; otherwise it records no coverage, only the violation, in its
//! [`OwnershipTable`](crate::OwnershipTable), and returns a [`TransferError`]. A missing checksum
//! is a failure, never a pass.
//!
//! ```
//! use kvguard::transfer::{ExpectedTransfer, Manifest, Receiver, SenderId, TransferError, TransferHeader};
//! use kvguard::{OwnershipTable, PageId, PoolConfig, RequestId, TenantId, ViolationKind};
//!
//! let decode = OwnershipTable::new(PoolConfig::new(64, 4, 64))?;
//! let (req, tenant) = (RequestId(1), TenantId(9));
//! let prompt = [5, 6, 7, 8, 9, 10];
//! decode.admit(req, tenant, 6, 2)?;
//! let refs = decode.allocate(req, 2)?; // the decode side allocates for the full prompt
//!
//! // Prefill substituted a one-token dummy: its honest manifest says so, and it is refused.
//! let header = TransferHeader { request: req, tenant, sender: SenderId(1), page_size: 4, slot_bytes: 8 };
//! let dummy = Manifest::build(header, &[1], &refs[..1], &[[0u8; 8]])?;
//! let expected = ExpectedTransfer::for_prompt(req, tenant, &prompt, &refs, 4, 8);
//! let err = Receiver::new(&decode).accept(&expected, &dummy.encode(), &[[0u8; 8]], |_, _, _| Ok(())).unwrap_err();
//! assert!(matches!(err, TransferError::TokenCount { expected: 6, found: 1 }));
//! assert_eq!(decode.counters().get(ViolationKind::TokenCountMismatch), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod digest;
#[cfg(feature = "nixl")]
pub mod nixl;
mod receive;
pub mod wire;

pub use digest::PromptDigest;
pub use receive::{Accepted, ExpectedTransfer, LandError, PinnedImport, Receiver, TransferError, verify};
pub use wire::{BuildError, DecodeError, Manifest, PageEntry, SenderId, TransferHeader, page_checksum, tokens_in_page};
