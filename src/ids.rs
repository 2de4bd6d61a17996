//! The names kvguard gives to requests, tenants, pages and page incarnations.
//!
//! All ids are plain `Copy` newtypes: cheap to pass, impossible to mix up. A [`PageRef`] pairs a
//! page with its [`Generation`] and so names one *incarnation* of a page: once the page is released
//! its generation moves on and every old `PageRef` to it is stale for good.

use serde::{Deserialize, Serialize};
use std::fmt;

/// One inference request (a sequence being prefilled or decoded).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

/// Whose data a request's KV is: the customer, the API key, the isolation domain.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantId(pub u64);

/// One page (block) of the KV pool, `0..num_pages`.
///
/// `u32` because engines hand block tables to kernels as `int32`; the pool configuration refuses
/// more pages than an `int32` block table can address. `repr(transparent)`: a binding may view
/// an engine's `int32`/`uint32` block table as `[PageId]` without copying it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(transparent)]
#[repr(transparent)]
pub struct PageId(pub u32);

/// The key under which a read-only prefix is published (an engine's block hash, radix node id, ...).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PrefixKey(pub u64);

/// A page's incarnation counter, bumped every time the page is released.
///
/// Generations start at [`Generation::FIRST`] (1); 0 never names a live incarnation, so zeroed
/// device memory can never match a real tag. A generation never repeats: when a page's generation
/// reaches the pool's limit (by default `u32::MAX`, i.e. after 4,294,967,294 releases of that one
/// page) the page is *retired* on its next release — never handed out again, and counted in
/// [`PoolSnapshot::retired`](crate::PoolSnapshot::retired) — instead of wrapping around.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u32);

impl Generation {
    /// The generation of a page that has never been released.
    pub const FIRST: Generation = Generation(1);
}

/// One incarnation of a page: the page, and the generation it had when it was handed out.
///
/// A `PageRef` kept past the page's release is *stale*: reads, writes and transfers through it are
/// refused, even after the page has been handed to another request.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub struct PageRef {
    /// The page.
    pub page: PageId,
    /// Its incarnation.
    pub generation: Generation,
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req {}", self.0)
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tenant {}", self.0)
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}", self.0)
    }
}

impl fmt::Display for PrefixKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "prefix {:#x}", self.0)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gen {}", self.0)
    }
}

impl fmt::Display for PageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.page, self.generation)
    }
}

/// Formats a count with thousands separators, for messages people read.
///
/// ```
/// assert_eq!(kvguard::ids::grouped(1_048_576), "1,048,576");
/// ```
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_inserts_separators_every_three_digits() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(681_280), "681,280");
        assert_eq!(grouped(1_048_576), "1,048,576");
        assert_eq!(grouped(u64::MAX), "18,446,744,073,709,551,615");
    }

    #[test]
    fn ids_print_with_their_vocabulary_word() {
        let r = PageRef { page: PageId(12), generation: Generation(3) };
        assert_eq!(r.to_string(), "page 12 gen 3");
        assert_eq!(RequestId(7).to_string(), "req 7");
        assert_eq!(TenantId(2).to_string(), "tenant 2");
    }
}
