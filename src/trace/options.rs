//! What a replay accepts: its limits, and the memory a pool's state takes. The judge holds to the
//! pool's and the live sets' limits, the replayer to the line length.

use super::writers::PageWriters;
use crate::config::MAX_PAGES;

/// The longest line any replayer accepts, whatever its options: 1 GiB.
pub const MAX_LINE_BYTES: usize = 1 << 30;

/// The table's memory per page, at most (see the table's docs: 44 bytes and two bits, rounded
/// up).
const TABLE_BYTES_PER_PAGE: u64 = 45;

/// Limits on what a replayer accepts: every one bounds memory (or time) whatever the input.
///
/// ```
/// use kvguard::trace::ReplayOptions;
/// let options = ReplayOptions::default().with_max_line_bytes(1 << 20).with_max_pool_pages(1 << 20);
/// assert_eq!(options.max_line_bytes, 1 << 20);
/// // A 2^26-page pool of 256-slot pages needs about 8.8 GiB: refused by a 1 GiB budget.
/// assert!(ReplayOptions::pool_bytes(1 << 26, 256) > 1 << 30);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// The longest line, in bytes (default 16 MiB, at most [`MAX_LINE_BYTES`]): a longer one is
    /// unusable input.
    pub max_line_bytes: usize,
    /// The largest pool, in pages (default and most: [`MAX_PAGES`]).
    pub max_pool_pages: u32,
    /// The most memory the pool's state may take, in bytes, as [`pool_bytes`](Self::pool_bytes)
    /// counts it (default: no limit beyond `max_pool_pages`; `kvguard replay` sets 1 GiB).
    pub max_pool_bytes: u64,
    /// The most requests admitted at once (default 262,144): one more is unusable input.
    /// Each costs a few hundred bytes.
    pub max_live_requests: usize,
    /// The most prefixes published at once (default 262,144): one more is unusable input.
    pub max_prefixes: usize,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            max_line_bytes: 16 << 20,
            max_pool_pages: MAX_PAGES,
            max_pool_bytes: u64::MAX,
            max_live_requests: 1 << 18,
            max_prefixes: 1 << 18,
        }
    }
}

impl ReplayOptions {
    /// The memory a replay of a pool of `pages` pages of `page_size` slots takes for its
    /// per-page state, at most: the table's 45 bytes per page and one bit per slot, and the
    /// writer record's 64 bytes per page.
    pub fn pool_bytes(pages: u32, page_size: u32) -> u64 {
        let per_page = TABLE_BYTES_PER_PAGE + PageWriters::BYTES_PER_PAGE;
        u64::from(pages) * per_page + (u64::from(pages) * u64::from(page_size)).div_ceil(8)
    }

    /// Sets the longest line accepted, in bytes (at most [`MAX_LINE_BYTES`]).
    pub fn with_max_line_bytes(mut self, bytes: usize) -> Self {
        self.max_line_bytes = bytes.min(MAX_LINE_BYTES);
        self
    }

    /// Sets the memory budget of the pool's state, in bytes (see [`pool_bytes`](Self::pool_bytes)).
    pub fn with_max_pool_bytes(mut self, bytes: u64) -> Self {
        self.max_pool_bytes = bytes;
        self
    }

    /// Sets the most requests admitted at once.
    pub fn with_max_live_requests(mut self, requests: usize) -> Self {
        self.max_live_requests = requests;
        self
    }

    /// Sets the most prefixes published at once.
    pub fn with_max_prefixes(mut self, prefixes: usize) -> Self {
        self.max_prefixes = prefixes;
        self
    }

    /// Sets the largest pool accepted, in pages (at most [`MAX_PAGES`] in any case).
    pub fn with_max_pool_pages(mut self, pages: u32) -> Self {
        self.max_pool_pages = pages.min(MAX_PAGES);
        self
    }
}
