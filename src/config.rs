//! The pool's shape and its start-up audit.
//!
//! The audit is the first layer of defence: a pool that cannot hold one max-context request is a
//! deployment that will, sooner or later, have to do something other than serve a request whole
//! (as in the incident the README tells).

use crate::ids::{PageId, grouped};
use crate::violation::Policy;
use serde::{Deserialize, Serialize};

/// The most pages a pool may have: 2^26 (67,108,864), i.e. about 2.1 GiB of page tags.
pub const MAX_PAGES: u32 = 1 << 26;
/// The largest page size, in token slots: 65,536.
pub const MAX_PAGE_SIZE: u32 = 1 << 16;
/// The most token slots a pool may have in all: 2^34, i.e. a 2 GiB coverage bitmap.
pub const MAX_SLOTS: u64 = 1 << 34;

/// Division by a page size, as a step's per-row loops make it: a shift when the size is a power
/// of two (every engine's page size), a division otherwise. A 64-bit division takes tens of
/// cycles, and a decode step makes a few per sequence.
///
/// ```
/// use kvguard::config::PageDiv;
/// let div = PageDiv::new(16);
/// assert_eq!((div.floor(47), div.ceil(47), div.offset(47)), (2, 3, 15));
/// assert_eq!(div.floor_i64(-1), -1); // floor, as i64::div_euclid
/// let odd = PageDiv::new(12);
/// assert_eq!((odd.floor(47), odd.ceil(47), odd.offset(47)), (3, 4, 11));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageDiv {
    size: u64,
    shift: Option<u32>,
}

impl PageDiv {
    /// Division by `page_size` (0 is taken as 1: a pool's page size is audited to be at least 1).
    pub fn new(page_size: u32) -> PageDiv {
        let size = u64::from(page_size.max(1));
        PageDiv { size, shift: size.is_power_of_two().then(|| size.trailing_zeros()) }
    }

    /// `x / page_size`.
    #[inline]
    pub fn floor(self, x: u64) -> u64 {
        match self.shift {
            Some(s) => x >> s,
            None => x / self.size,
        }
    }

    /// `x % page_size`: the offset of slot `x` in its page.
    #[inline]
    pub fn offset(self, x: u64) -> u64 {
        match self.shift {
            Some(_) => x & (self.size - 1),
            None => x % self.size,
        }
    }

    /// `x.div_ceil(page_size)`.
    #[inline]
    pub fn ceil(self, x: u64) -> u64 {
        match self.shift {
            Some(s) => (x >> s) + u64::from(x & (self.size - 1) != 0),
            None => x.div_ceil(self.size),
        }
    }

    /// `x.div_euclid(page_size)`: floor division, a negative `x` stays negative.
    #[inline]
    pub fn floor_i64(self, x: i64) -> i64 {
        match self.shift {
            Some(s) => x >> s,
            None => x.div_euclid(self.size as i64),
        }
    }
}

/// The engine's KV pool: `num_pages` pages of `page_size` token slots, and the model's max context.
///
/// ```
/// use kvguard::{PoolConfig, PageId};
/// let config = PoolConfig::new(65_536, 16, 131_072).with_reserved([PageId(0)]);
/// config.audit()?;
/// assert_eq!(config.capacity_tokens(), 65_535 * 16);
/// # Ok::<(), kvguard::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolConfig {
    /// Pages in the pool, ids `0..num_pages`.
    pub num_pages: u32,
    /// Token slots per page.
    pub page_size: u32,
    /// The most tokens (prompt + generated) one request may have.
    pub max_context_tokens: u64,
    /// Pages that are never allocated and never readable (the null/padding page).
    pub reserved: Vec<PageId>,
    /// What a violation does.
    pub policy: Policy,
    /// Whether released pages must be scrubbed (poisoned or zeroed) by the engine before reuse.
    pub scrub_on_release: bool,
    /// The generation at which a page is retired instead of bumped (default `u32::MAX`); lower it
    /// only to exercise retirement in tests.
    pub generation_limit: u32,
}

impl PoolConfig {
    /// A pool with no reserved pages, [`Policy::Enforce`], no scrubbing.
    pub fn new(num_pages: u32, page_size: u32, max_context_tokens: u64) -> PoolConfig {
        PoolConfig {
            num_pages,
            page_size,
            max_context_tokens,
            reserved: Vec::new(),
            policy: Policy::Enforce,
            scrub_on_release: false,
            generation_limit: u32::MAX,
        }
    }

    /// Marks pages as reserved (never allocatable, never readable).
    pub fn with_reserved(mut self, pages: impl IntoIterator<Item = PageId>) -> Self {
        self.reserved.extend(pages);
        self.reserved.sort_unstable();
        self.reserved.dedup();
        self
    }

    /// Sets the violation policy.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Requires released pages to be scrubbed and confirmed before they are handed out again.
    pub fn with_scrub_on_release(mut self, scrub: bool) -> Self {
        self.scrub_on_release = scrub;
        self
    }

    /// Sets the generation at which pages retire (tests of retirement; production keeps the default).
    pub fn with_generation_limit(mut self, limit: u32) -> Self {
        self.generation_limit = limit;
        self
    }

    /// Checks that the numbers describe a pool kvguard can track, without the capacity audit.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.num_pages == 0 {
            return Err(ConfigError::NoPages);
        }
        if self.num_pages > MAX_PAGES {
            return Err(ConfigError::TooManyPages { num_pages: self.num_pages, max: MAX_PAGES });
        }
        if self.page_size == 0 || self.page_size > MAX_PAGE_SIZE {
            return Err(ConfigError::PageSize { page_size: self.page_size, max: MAX_PAGE_SIZE });
        }
        let slots = u64::from(self.num_pages) * u64::from(self.page_size);
        if slots > MAX_SLOTS {
            return Err(ConfigError::TooManySlots { slots, max: MAX_SLOTS });
        }
        if self.max_context_tokens == 0 {
            return Err(ConfigError::NoContext);
        }
        if self.generation_limit <= crate::ids::Generation::FIRST.0 {
            return Err(ConfigError::GenerationLimit { limit: self.generation_limit });
        }
        if let Some(&page) = self.reserved.iter().find(|p| p.0 >= self.num_pages) {
            return Err(ConfigError::ReservedOutOfRange { page, num_pages: self.num_pages });
        }
        Ok(())
    }

    /// The start-up audit: [`validate`](Self::validate), then one max-context request must fit
    /// in the pages that can be allocated.
    ///
    /// ```
    /// use kvguard::{PoolConfig, ConfigError};
    /// // The incident's prefill pool: 10,645 pages of 64 tokens for a 1,048,576-token model.
    /// let err = PoolConfig::new(10_645, 64, 1_048_576).audit().unwrap_err();
    /// assert!(matches!(err, ConfigError::PoolTooSmall { capacity_tokens: 681_280, max_context_tokens: 1_048_576, .. }));
    /// assert!(err.to_string().contains("681,280") && err.to_string().contains("1,048,576"));
    /// ```
    pub fn audit(&self) -> Result<(), ConfigError> {
        self.validate()?;
        let capacity_tokens = self.capacity_tokens();
        if capacity_tokens < self.max_context_tokens {
            return Err(ConfigError::PoolTooSmall {
                capacity_tokens,
                max_context_tokens: self.max_context_tokens,
                allocatable_pages: self.allocatable_pages(),
                page_size: self.page_size,
            });
        }
        Ok(())
    }

    /// Pages that can ever be allocated: all but the reserved ones.
    pub fn allocatable_pages(&self) -> u32 {
        let mut reserved: Vec<u32> = self.reserved.iter().map(|p| p.0).filter(|&p| p < self.num_pages).collect();
        reserved.sort_unstable();
        reserved.dedup();
        // `reserved` holds distinct ids below `num_pages`, so its length is at most `num_pages`.
        self.num_pages - reserved.len() as u32
    }

    /// Tokens the allocatable pages hold.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.allocatable_pages()) * u64::from(self.page_size)
    }

    /// Pages needed for `tokens` tokens (rounded up); 0 for a zero page size.
    pub fn pages_for_tokens(&self, tokens: u64) -> u64 {
        if self.page_size == 0 { 0 } else { tokens.div_ceil(u64::from(self.page_size)) }
    }
}

/// A pool configuration kvguard refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `num_pages` is 0.
    #[error("the pool has no pages")]
    NoPages,
    /// More pages than kvguard tracks.
    #[error("the pool has {} pages, more than the {} kvguard tracks", grouped(u64::from(*num_pages)), grouped(u64::from(*max)))]
    TooManyPages {
        /// Pages asked for.
        num_pages: u32,
        /// [`MAX_PAGES`].
        max: u32,
    },
    /// A page size of 0 or above [`MAX_PAGE_SIZE`].
    #[error("page size {page_size} is not in 1..={max}")]
    PageSize {
        /// Page size asked for.
        page_size: u32,
        /// [`MAX_PAGE_SIZE`].
        max: u32,
    },
    /// More token slots than kvguard tracks.
    #[error("the pool has {} token slots, more than the {} kvguard tracks", grouped(*slots), grouped(*max))]
    TooManySlots {
        /// `num_pages * page_size`.
        slots: u64,
        /// [`MAX_SLOTS`].
        max: u64,
    },
    /// A max context of 0 tokens.
    #[error("the max context is 0 tokens")]
    NoContext,
    /// A generation limit that leaves no room for one release.
    #[error("generation limit {limit} must be above 1")]
    GenerationLimit {
        /// The limit asked for.
        limit: u32,
    },
    /// A reserved page beyond the pool.
    #[error("reserved {page} is outside the pool of {num_pages} pages")]
    ReservedOutOfRange {
        /// The reserved page.
        page: PageId,
        /// Pages in the pool.
        num_pages: u32,
    },
    /// The pool cannot hold one max-context request.
    #[error(
        "pool too small: {} allocatable pages x {} tokens hold {} tokens, but one max-context request needs {} tokens",
        grouped(u64::from(*allocatable_pages)), page_size, grouped(*capacity_tokens), grouped(*max_context_tokens)
    )]
    PoolTooSmall {
        /// Tokens the allocatable pages hold.
        capacity_tokens: u64,
        /// The model's max context.
        max_context_tokens: u64,
        /// Allocatable pages.
        allocatable_pages: u32,
        /// Tokens per page.
        page_size: u32,
    },
}

#[cfg(test)]
mod tests {
    #[test]
    fn page_div_agrees_with_division_for_every_page_size() {
        let values = [0u64, 1, 2, 15, 16, 17, 47, 48, 63, 64, 65, 1 << 20, (1 << 34) - 1, u64::MAX - 1, u64::MAX];
        let signed = [i64::MIN, -65, -64, -17, -16, -1, 0, 1, 16, 17, 63, i64::MAX];
        for ps in (1..=70).chain([128, 1000, 4096, 65_536]) {
            let div = super::PageDiv::new(ps);
            let p = u64::from(ps);
            for &x in &values {
                assert_eq!((div.floor(x), div.offset(x), div.ceil(x)), (x / p, x % p, x.div_ceil(p)), "{x} / {ps}");
            }
            for &x in &signed {
                assert_eq!(div.floor_i64(x), x.div_euclid(i64::from(ps)), "{x} / {ps}");
            }
        }
    }

    use super::*;

    #[test]
    fn the_incident_pool_fails_the_audit_naming_both_numbers() {
        let err = PoolConfig::new(10_645, 64, 1_048_576).audit().unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("681,280"), "{msg}");
        assert!(msg.contains("1,048,576"), "{msg}");
        assert_eq!(
            err,
            ConfigError::PoolTooSmall {
                capacity_tokens: 681_280,
                max_context_tokens: 1_048_576,
                allocatable_pages: 10_645,
                page_size: 64
            }
        );
    }

    #[test]
    fn reserved_pages_do_not_count_towards_capacity() {
        let exact = PoolConfig::new(4, 16, 64);
        assert!(exact.audit().is_ok());
        let with_null = exact.clone().with_reserved([PageId(0)]);
        assert_eq!(with_null.allocatable_pages(), 3);
        assert!(matches!(with_null.audit(), Err(ConfigError::PoolTooSmall { capacity_tokens: 48, .. })));
    }

    #[test]
    fn structural_errors_are_typed() {
        assert_eq!(PoolConfig::new(0, 16, 1).validate(), Err(ConfigError::NoPages));
        assert!(matches!(PoolConfig::new(1, 0, 1).validate(), Err(ConfigError::PageSize { .. })));
        assert!(matches!(PoolConfig::new(1, MAX_PAGE_SIZE + 1, 1).validate(), Err(ConfigError::PageSize { .. })));
        assert!(matches!(PoolConfig::new(u32::MAX, 16, 1).validate(), Err(ConfigError::TooManyPages { .. })));
        assert!(matches!(
            PoolConfig::new(MAX_PAGES, MAX_PAGE_SIZE, 1).validate(),
            Err(ConfigError::TooManySlots { .. })
        ));
        assert_eq!(PoolConfig::new(1, 16, 0).validate(), Err(ConfigError::NoContext));
        assert!(matches!(
            PoolConfig::new(4, 16, 16).with_reserved([PageId(4)]).validate(),
            Err(ConfigError::ReservedOutOfRange { .. })
        ));
        assert!(matches!(
            PoolConfig::new(4, 16, 16).with_generation_limit(1).validate(),
            Err(ConfigError::GenerationLimit { limit: 1 })
        ));
    }

    #[test]
    fn pages_for_tokens_rounds_up_without_overflow() {
        let c = PoolConfig::new(4, 16, 64);
        assert_eq!(c.pages_for_tokens(0), 0);
        assert_eq!(c.pages_for_tokens(1), 1);
        assert_eq!(c.pages_for_tokens(16), 1);
        assert_eq!(c.pages_for_tokens(17), 2);
        assert_eq!(c.pages_for_tokens(u64::MAX), u64::MAX.div_ceil(16));
    }
}
