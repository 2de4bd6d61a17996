//! The block-table entry as the table reads it: a page id, or a page and the incarnation the
//! engine says it is in ([`PageRef`]); the methods that take either are written once over it.

use crate::ids::{Generation, PageId, PageRef};

/// One block-table entry as the table sees it: a page, and maybe the incarnation it must be in.
pub(crate) trait BlockEntry: Copy {
    fn page(self) -> PageId;
    fn generation(self) -> Option<Generation>;
    /// The entry naming `page` in its incarnation `generation` (a page id drops it).
    fn entry(page: PageId, generation: Generation) -> Self;
}

impl BlockEntry for PageId {
    #[inline(always)]
    fn page(self) -> PageId {
        self
    }
    #[inline(always)]
    fn generation(self) -> Option<Generation> {
        None
    }
    #[inline(always)]
    fn entry(page: PageId, _: Generation) -> Self {
        page
    }
}

impl BlockEntry for PageRef {
    #[inline(always)]
    fn page(self) -> PageId {
        self.page
    }
    #[inline(always)]
    fn generation(self) -> Option<Generation> {
        Some(self.generation)
    }
    #[inline(always)]
    fn entry(page: PageId, generation: Generation) -> Self {
        PageRef { page, generation }
    }
}
